//! Fuzzes what the router does with every request body before it routes: parse the OpenAI
//! request, tokenize it as vLLM would (the llama 3.1 tokenizer and chat template from
//! `../shared`), and hash its blocks (sha256, 16-token blocks), the same library calls as the
//! proxy's `decide::prepare`.
//!
//! The first input byte picks the API (even: chat completions, odd: completions), the rest is
//! the body. Invariants checked: nothing panics; a body that parses either tokenizes or gives a
//! typed error; the hashes cover exactly the full blocks of the prompt.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use kinference_tokenize::{ChatRequest, CompletionRequest, Tokenizer};
use kinference_vllm::{BlockHasher, ExtraKeysFormat, HashAlgo, RequestExtras};
use libfuzzer_sys::fuzz_target;

const BLOCK: usize = 16;

fn setup() -> &'static (Tokenizer, BlockHasher) {
    static SETUP: OnceLock<(Tokenizer, BlockHasher)> = OnceLock::new();
    SETUP.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/tokenizers/llama3.1");
        let tokenizer = Tokenizer::from_dir(&dir)
            .unwrap_or_else(|e| panic!("the fuzz target needs {}: {e}", dir.display()));
        let hasher = BlockHasher::new(HashAlgo::Sha256, BLOCK, None, ExtraKeysFormat::Tagged)
            .unwrap_or_else(|e| panic!("sha256 hasher: {e}"));
        (tokenizer, hasher)
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&api, body)) = data.split_first() else {
        return;
    };
    let (tokenizer, hasher) = setup();
    let tokens = if api % 2 == 0 {
        let parsed = ChatRequest::from_json(body);
        let reference = ChatRequest::from_json_reference(body);
        assert_eq!(format!("{:?}", parsed.as_ref().ok()), format!("{:?}", reference.ok()));
        let Ok(req) = parsed else {
            return;
        };
        match tokenizer.encode_chat(&req) {
            Ok(t) => t,
            Err(_) => return,
        }
    } else {
        let parsed = CompletionRequest::from_json(body);
        let reference = CompletionRequest::from_json_reference(body);
        assert_eq!(format!("{:?}", parsed.as_ref().ok()), format!("{:?}", reference.ok()));
        let Ok(req) = parsed else {
            return;
        };
        match tokenizer.encode_completion_request(&req) {
            Ok(prompts) => prompts.into_iter().next().unwrap_or_default(),
            Err(_) => return,
        }
    };
    let hashes = hasher.hash_blocks(&tokens, &RequestExtras::default());
    assert_eq!(hashes.len(), tokens.len() / BLOCK);
});
