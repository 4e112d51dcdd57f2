//! Fuzzes chat-template loading and rendering (`kinference_tokenize::ChatTemplate`): a model
//! directory's template is untrusted text, and a template that does not compile must be a
//! `TemplateSyntax` error for the chat requests of that model, never a panic of the router.
//!
//! Invariants checked: nothing panics; a template that compiles renders a fixed two-message
//! conversation to a string or a typed error. Inputs are capped at 4 KiB so that a template's
//! own loops stay short.
#![no_main]

use kinference_tokenize::value::json_to_value;
use kinference_tokenize::{ChatTemplate, Json, TokenizeError};
use libfuzzer_sys::fuzz_target;

const CONTEXT: &str = r#"{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello {% raw %} }} %}"}], "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>"}"#;

fuzz_target!(|data: &[u8]| {
    if data.len() > 4096 {
        return;
    }
    let src = String::from_utf8_lossy(data);
    let template = match ChatTemplate::new(&src) {
        Ok(t) => t,
        Err(TokenizeError::TemplateSyntax(_)) => return,
        Err(e) => panic!("compiling gave a non-syntax error: {e}"),
    };
    let ctx = match Json::parse(CONTEXT) {
        Ok(ctx) => json_to_value(&ctx),
        Err(e) => panic!("the fixed context does not parse: {e}"),
    };
    let _ = template.render(ctx);
});
