//! The simulated model's "text": pseudo-tokens rendered as filler words, deterministic
//! log-probabilities for them, and vLLM's stop-string matching on the rendered text (the
//! driver stops the engine request at the matching token; the handler truncates the text
//! with the same function, so both agree on where a choice ended).
//!
//! Invariants: a token renders as one ASCII word with a leading space, so byte offsets are
//! char offsets; a token's logprob and its alternatives depend only on (request seed, position),
//! the sampled token is always the most likely one (greedy), and the alternatives are distinct
//! words in descending order of probability.

use kinference_sim::request::{seed_of, splitmix64};

/// Filler vocabulary for generated text: token `t` renders as `WORDS[t % len]`.
const WORDS: &[&str] = &[
    "the", "cache", "block", "token", "hash", "router", "prefix", "server", "request", "model",
    "a", "of", "and", "to", "in", "is", "that", "for", "it", "with", "as", "on", "by", "this",
    "key", "value", "parent", "batch", "event", "step", "queue", "time",
];

fn word_index(token: u32) -> usize {
    token as usize % WORDS.len()
}

/// The text of one generated token: a space and a word.
pub fn word(token: u32) -> String {
    let w = WORDS.get(word_index(token)).copied().unwrap_or("the");
    format!(" {w}")
}

/// One token's log-probability and the most likely alternatives at its position.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f64,
    /// `(token, logprob)`, most likely first; the sampled token leads it.
    pub top: Vec<(String, f64)>,
}

/// Deterministic, plausible log-probabilities for the `index`-th token of request `id`:
/// the sampled token in (-1.5, 0], each alternative 0.4–1.4 nats below the one before.
pub fn logprob(id: &str, index: usize, token: u32, top_k: usize) -> TokenLogprob {
    let seed = splitmix64(seed_of(id) ^ splitmix64(index as u64));
    let unit = |x: u64| (x >> 11) as f64 / (1u64 << 53) as f64;
    let lp = -1.5 * unit(seed);
    let text = word(token);
    let mut top = Vec::with_capacity(top_k);
    if top_k > 0 {
        top.push((text.clone(), lp));
    }
    let first = word_index(token);
    let mut current = lp;
    let mut r = seed;
    // Alternatives walk the vocabulary from a seeded start, skipping the sampled word, so they
    // are distinct; `top_k` is capped at 20 by request validation, below the 32 words.
    let start = (splitmix64(seed) % WORDS.len() as u64) as usize;
    let mut k = 0;
    while top.len() < top_k && k < WORDS.len() {
        let i = (start + k) % WORDS.len();
        k += 1;
        if i == first {
            continue;
        }
        r = splitmix64(r);
        current -= 0.4 + unit(r);
        let w = WORDS.get(i).copied().unwrap_or("the");
        top.push((format!(" {w}"), current));
    }
    TokenLogprob {
        token: text,
        logprob: lp,
        top,
    }
}

/// A request's stop strings (`stop`, `include_stop_str_in_output`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopStrings {
    pub strings: Vec<String>,
    pub include: bool,
}

impl StopStrings {
    /// The longest stop string, bytes: how much trailing text a match can still need.
    pub fn max_len(&self) -> usize {
        self.strings.iter().map(String::len).max().unwrap_or(0)
    }
}

/// Follows one request's rendered text token by token and reports the token that completes a
/// stop string. Keeps only the tail a future match can reach.
#[derive(Clone, Debug)]
pub struct StopMatcher {
    stop: StopStrings,
    tail: String,
}

impl StopMatcher {
    pub fn new(stop: StopStrings) -> Self {
        StopMatcher {
            stop,
            tail: String::new(),
        }
    }

    /// Appends `token`'s text; the stop string it completes, if any.
    pub fn push(&mut self, token: u32) -> Option<String> {
        let w = word(token);
        self.tail.push_str(&w);
        let hit = check_stop(&self.tail, w.len(), &self.stop.strings, self.stop.include);
        let keep = self.stop.max_len();
        if self.tail.len() > keep {
            let cut = floor_boundary(&self.tail, self.tail.len() - keep);
            self.tail.drain(..cut);
        }
        hit.map(|(s, _)| s)
    }
}

/// vLLM's `check_stop_strings`: looks for each stop string where the last `new_chars` bytes
/// could complete it; on a match returns the stop string and the length to truncate the text
/// to (before the stop string, or after it when `include` is set).
pub fn check_stop(
    text: &str,
    new_chars: usize,
    stops: &[String],
    include: bool,
) -> Option<(String, usize)> {
    for stop in stops {
        if stop.is_empty() {
            continue;
        }
        let from = text
            .len()
            .saturating_sub(new_chars.saturating_add(stop.len()).saturating_sub(1));
        let from = floor_boundary(text, from);
        let Some(at) = text.get(from..).and_then(|t| t.find(stop.as_str())) else {
            continue;
        };
        let at = from + at;
        let keep = if include { at + stop.len() } else { at };
        return Some((stop.clone(), keep));
    }
    None
}

/// The largest char boundary at or below `i`.
pub fn floor_boundary(text: &str, mut i: usize) -> usize {
    i = i.min(text.len());
    while !text.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_deterministic_sorted_and_distinct() {
        let a = logprob("cmpl-1", 3, 17, 5);
        assert_eq!(a, logprob("cmpl-1", 3, 17, 5));
        assert_ne!(a.logprob, logprob("cmpl-1", 4, 17, 5).logprob);
        assert_eq!(a.top.len(), 5);
        assert_eq!(a.top[0], (a.token.clone(), a.logprob));
        assert!(a.logprob <= 0.0 && a.logprob > -1.5);
        for w in a.top.windows(2) {
            assert!(w[0].1 > w[1].1, "{:?}", a.top);
        }
        let mut words: Vec<&str> = a.top.iter().map(|t| t.0.as_str()).collect();
        words.sort_unstable();
        words.dedup();
        assert_eq!(words.len(), 5);
        assert!(logprob("x", 0, 1, 0).top.is_empty());
        assert_eq!(logprob("x", 0, 1, 20).top.len(), 20);
    }

    #[test]
    fn matcher_agrees_with_check_stop_on_the_whole_text() {
        let tokens: Vec<u32> = (0..200).map(|i| (i * 7 + 3) % 97).collect();
        for stop in [" cache", "e c", " the value", "zzz"] {
            let spec = StopStrings {
                strings: vec![stop.to_owned()],
                include: false,
            };
            let mut m = StopMatcher::new(spec.clone());
            let mut text = String::new();
            let mut by_text = None;
            let mut by_matcher = None;
            for (i, t) in tokens.iter().enumerate() {
                let w = word(*t);
                text.push_str(&w);
                if by_text.is_none() && check_stop(&text, w.len(), &spec.strings, false).is_some() {
                    by_text = Some(i);
                }
                if by_matcher.is_none() && m.push(*t).is_some() {
                    by_matcher = Some(i);
                }
            }
            assert_eq!(by_text, by_matcher, "{stop}");
            assert_eq!(by_text.is_some(), text.contains(stop), "{stop}");
        }
    }

    #[test]
    fn stop_strings_match_only_where_new_text_can_complete_them() {
        let stops = vec![" cache".to_owned()];
        assert_eq!(
            check_stop(" the cache", 6, &stops, false),
            Some((" cache".into(), 4))
        );
        assert_eq!(
            check_stop(" the cache", 6, &stops, true),
            Some((" cache".into(), 10))
        );
        // Already fully inside older text: vLLM would have stopped then, so not looked for.
        assert_eq!(check_stop(" the cache block", 6, &stops, false), None);
        // A stop string spanning two tokens matches when the second arrives.
        let split = vec!["e c".to_owned()];
        assert_eq!(
            check_stop(" the cache", 6, &split, false),
            Some(("e c".into(), 3))
        );
        assert_eq!(check_stop(" the", 4, &[String::new()], false), None);
    }
}
