//! Turning prompt descriptions into what a run sends: token ids for the simulator, text for
//! a live OpenAI endpoint.
//!
//! Block ids become content deterministically, seeded by the id alone, so requests that share
//! leading ids share leading tokens (simulated) or leading text (live):
//! * tokens: `block_tokens` pseudo-random ids in `0..vocab` per block id;
//! * text: `block_tokens` words per block id, each written with a leading space. With a
//!   tokenizer, the word list keeps only words that encode to exactly one token with their
//!   leading space, and a GPT-style pre-tokenizer splits at each space, so a block of `k`
//!   words is `k` tokens and blocks never merge across a boundary: the trace's block sizes
//!   hold in tokens. Without a tokenizer the sizes are approximate (about one token a word).
//!
//! Chat text (ShareGPT) goes to the simulator through the model's chat template when a
//! tokenizer is given, else through a word-level stand-in (one pseudo token per
//! whitespace-separated word, role markers included) that keeps the prefix structure but
//! undercounts tokens by roughly a quarter.

use kinference_sim::request::{pseudo_token, splitmix64};
use kinference_tokenize::{ChatMessage, ChatRequest, Tokenizer};

use crate::error::BenchError;
use crate::workload::{Message, Prompt, Workload};

/// Salt of the block-id seeds (the example replays used the same one, so their prompts and
/// these agree token for token).
const BLOCK_SALT: u64 = 0x6d6f_6f6e_6361_6b65;

fn block_seed(id: u64) -> u64 {
    splitmix64(id ^ BLOCK_SALT)
}

/// The token ids of a [`Prompt::Blocks`] description.
pub fn block_tokens(ids: &[u64], len: usize, block_tokens: usize, vocab: u32) -> Vec<u32> {
    let mut p = Vec::with_capacity(len);
    for &id in ids {
        let seed = block_seed(id);
        let take = len.saturating_sub(p.len()).min(block_tokens);
        p.extend((0..take as u64).map(|j| pseudo_token(seed, j, vocab)));
        if p.len() >= len {
            break;
        }
    }
    p
}

/// FNV-1a of a word: its stand-in token.
fn word_token(word: &str, vocab: u32) -> u32 {
    let h = word.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    (splitmix64(h) % u64::from(vocab.max(1))) as u32
}

/// The word-level stand-in tokenization of a chat (see the module docs).
pub fn chat_tokens_approx(messages: &[Message], vocab: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for m in messages {
        out.push(word_token(&format!("<|{}|>", m.role), vocab));
        out.extend(m.content.split_whitespace().map(|w| word_token(w, vocab)));
        out.push(word_token("<|end|>", vocab));
    }
    out.push(word_token("<|assistant|>", vocab));
    out
}

pub(crate) fn chat_request(messages: &[Message]) -> ChatRequest<'static> {
    ChatRequest::from_messages(
        messages
            .iter()
            .map(|m| ChatMessage::text(&m.role, &m.content))
            .collect(),
    )
}

/// Replaces every chat prompt by its token ids, through `tokenizer`'s chat template or the
/// word-level stand-in. Block prompts stay descriptions (they are cheap to expand).
pub fn tokenize_chats(
    w: &mut Workload,
    tokenizer: Option<&Tokenizer>,
    vocab: u32,
) -> Result<(), BenchError> {
    for r in &mut w.requests {
        if let Prompt::Chat(msgs) = &r.prompt {
            let tokens = match tokenizer {
                Some(t) => t.encode_chat(&chat_request(msgs))?,
                None => chat_tokens_approx(msgs, vocab),
            };
            r.prompt = Prompt::Tokens(tokens);
        }
    }
    Ok(())
}

/// The token ids a simulated engine gets for `prompt` (chat prompts must have been tokenized
/// by [`tokenize_chats`]; one left over goes through the stand-in).
pub fn sim_tokens(prompt: &Prompt, vocab: u32) -> Vec<u32> {
    match prompt {
        Prompt::Blocks {
            ids,
            len,
            block_tokens: b,
        } => block_tokens(ids, *len, *b, vocab),
        Prompt::Tokens(t) => t.clone(),
        Prompt::Chat(m) => chat_tokens_approx(m, vocab),
    }
}

/// Common English words; with a tokenizer only the single-token ones are kept.
const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "was",
    "with",
    "he",
    "as",
    "at",
    "by",
    "this",
    "had",
    "not",
    "are",
    "but",
    "from",
    "or",
    "have",
    "an",
    "they",
    "which",
    "one",
    "you",
    "were",
    "all",
    "we",
    "her",
    "she",
    "there",
    "would",
    "their",
    "will",
    "when",
    "who",
    "him",
    "been",
    "has",
    "more",
    "if",
    "no",
    "out",
    "so",
    "said",
    "what",
    "up",
    "its",
    "about",
    "than",
    "into",
    "them",
    "can",
    "only",
    "other",
    "time",
    "new",
    "some",
    "could",
    "these",
    "two",
    "may",
    "first",
    "then",
    "do",
    "any",
    "like",
    "my",
    "now",
    "over",
    "such",
    "our",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
    "small",
    "large",
    "next",
    "early",
    "young",
    "important",
    "few",
    "public",
    "bad",
    "able",
    "cache",
    "block",
    "token",
    "model",
    "server",
    "request",
    "value",
    "key",
    "table",
    "water",
    "light",
    "house",
    "city",
    "road",
    "river",
    "music",
    "paper",
    "story",
    "number",
    "point",
    "group",
    "problem",
    "fact",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "government",
    "night",
];

/// Deterministic prompt text for block descriptions (see the module docs).
#[derive(Clone, Debug)]
pub struct TextGen {
    words: Vec<&'static str>,
    /// Whether every word is known to be one token.
    exact: bool,
}

impl TextGen {
    /// Words checked against `tokenizer` (one token each with a leading space), or the whole
    /// list unchecked without one.
    pub fn new(tokenizer: Option<&Tokenizer>) -> Result<Self, BenchError> {
        let Some(t) = tokenizer else {
            return Ok(TextGen {
                words: WORDS.to_vec(),
                exact: false,
            });
        };
        let mut words = Vec::new();
        for w in WORDS {
            if t.encode_uncached(&format!(" {w}"), false)?.len() == 1 {
                words.push(*w);
            }
        }
        if words.len() < 32 {
            return Err(BenchError::Tokenize(format!(
                "only {} of the filler words are single tokens for this tokenizer",
                words.len()
            )));
        }
        Ok(TextGen { words, exact: true })
    }

    /// Whether generated block texts have exactly their nominal token counts.
    pub fn exact(&self) -> bool {
        self.exact
    }

    fn push_block(&self, out: &mut String, id: u64, words: usize) {
        let seed = block_seed(id);
        let n = self.words.len().max(1) as u32;
        for j in 0..words as u64 {
            let w = self
                .words
                .get(pseudo_token(seed, j, n) as usize)
                .copied()
                .unwrap_or("the");
            out.push(' ');
            out.push_str(w);
        }
    }

    /// The text of a [`Prompt::Blocks`] description: `len` words.
    pub fn blocks_text(&self, ids: &[u64], len: usize, block_tokens: usize) -> String {
        let mut s = String::with_capacity(len * 6);
        let mut done = 0;
        for &id in ids {
            let take = len.saturating_sub(done).min(block_tokens);
            self.push_block(&mut s, id, take);
            done += take;
            if done >= len {
                break;
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_ids_give_shared_prefixes() {
        let a = block_tokens(&[1, 2, 3], 1500, 512, 32_000);
        let b = block_tokens(&[1, 2, 9], 1400, 512, 32_000);
        assert_eq!(a.len(), 1500);
        assert_eq!(b.len(), 1400);
        assert_eq!(a[..1024], b[..1024]);
        assert_ne!(a[1024..1100], b[1024..1100]);
        let g = TextGen::new(None).unwrap();
        let ta = g.blocks_text(&[1, 2, 3], 1500, 512);
        let tb = g.blocks_text(&[1, 2, 9], 1400, 512);
        let wa: Vec<&str> = ta.split(' ').collect();
        let wb: Vec<&str> = tb.split(' ').collect();
        assert_eq!(wa.len(), 1501);
        assert_eq!(wa[..1025], wb[..1025]);
        assert_ne!(wa[1025..], wb[1025..1401]);
    }

    #[test]
    fn block_text_has_the_nominal_token_count_with_a_tokenizer() {
        let dir = crate::sources::data_file("tokenizers/qwen3").unwrap();
        let t = Tokenizer::from_dir(dir).unwrap();
        let g = TextGen::new(Some(&t)).unwrap();
        assert!(g.exact());
        let text = g.blocks_text(&[5, 6, 7], 1200, 512);
        assert_eq!(t.encode_uncached(&text, false).unwrap().len(), 1200);
        // A shared first block tokenizes identically whatever follows it.
        let other = g.blocks_text(&[5, 8], 700, 512);
        let (x, y) = (
            t.encode_uncached(&text, false).unwrap(),
            t.encode_uncached(&other, false).unwrap(),
        );
        assert_eq!(x[..512], y[..512]);
    }

    #[test]
    fn chats_tokenize_with_a_shared_history_prefix() {
        let m1 = vec![Message {
            role: "user".into(),
            content: "hello there how are you".into(),
        }];
        let mut m2 = m1.clone();
        m2.push(Message {
            role: "assistant".into(),
            content: "fine thanks".into(),
        });
        m2.push(Message {
            role: "user".into(),
            content: "and then".into(),
        });
        let (a, b) = (chat_tokens_approx(&m1, 1000), chat_tokens_approx(&m2, 1000));
        assert!(b.len() > a.len());
        assert_eq!(a[..a.len() - 1], b[..a.len() - 1]);
    }
}
