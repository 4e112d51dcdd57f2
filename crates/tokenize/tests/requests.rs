//! Request handling as vLLM does it, seen through a template that prints what it receives:
//! message normalization, tools, kwargs, errors, completions prompt forms.

// Test code: a failed unwrap is a failed test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use kinference_tokenize::{
    ChatRequest, CompletionRequest, ContentFormat, TokenizeError, Tokenizer, TokenizerOptions,
};

use common::*;

/// The tiny-llama tokenizer with a template that dumps its inputs.
fn dumper(template: &str) -> Tokenizer {
    let opts = TokenizerOptions {
        chat_template: Some(template.to_string()),
        ..TokenizerOptions::default()
    };
    Tokenizer::from_dir_with(tiny_llama_dir(), opts).unwrap()
}

/// Requests are written as JSON text: key order is part of what templates print.
fn render(tok: &Tokenizer, req: &str) -> Result<String, TokenizeError> {
    tok.render_chat(&ChatRequest::from_json(req.as_bytes())?)
}

const DUMP: &str = "{{ messages | tojson }}|{{ tools | tojson }}|{{ add_generation_prompt }}|{{ bos_token }}|{{ enable_thinking }}|{{ reasoning_effort }}";

#[test]
fn messages_are_normalized_like_vllm() {
    let tok = dumper(DUMP);
    let out = render(&tok, r#"{
        "messages": [
            {"role": "system", "content": "x-anthropic-billing-header: cch=1\nkeep this"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}, "c"], "name": "bob"},
            {"role": "assistant", "content": null, "reasoning": "why",
             "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
                            {"id": "2", "function": {"name": "g", "arguments": "not json"}}]},
            {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
            {"role": "assistant", "content": "ok", "tool_calls": []}
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "extra": 1}}],
        "reasoning_effort": "low"
    }"#)
    .unwrap();
    let want = concat!(
        r#"[{"role": "system", "content": "keep this"}, "#,
        r#"{"role": "user", "content": "a\nb\nc", "name": "bob"}, "#,
        r#"{"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}, "#,
        r#"{"id": "2", "function": {"name": "g", "arguments": {}}}], "reasoning": "why", "reasoning_content": "why"}, "#,
        r#"{"role": "tool", "content": "r1\nr2", "tool_call_id": "1"}, "#,
        r#"{"role": "assistant", "content": "ok"}]"#,
        r#"|[{"type": "function", "function": {"name": "f", "description": null, "parameters": {"type": "object"}}}]"#,
        r#"|True|<|begin_of_text|>|True|low"#,
    );
    assert_eq!(out, want);
}

#[test]
fn developer_becomes_system_unless_the_template_knows_it() {
    let req = r#"{"messages": [
        {"role": "developer", "content": "d1"}, {"role": "user", "content": "u"}, {"role": "developer", "content": "d2"}]}"#;
    let out = render(&dumper("{{ messages | tojson }}"), req).unwrap();
    assert_eq!(
        out,
        r#"[{"role": "system", "content": "d1\n\nd2"}, {"role": "user", "content": "u"}]"#
    );
    let out = render(
        &dumper("{# 'developer' #}{% for m in messages %}{{ m.role }},{% endfor %}"),
        req,
    )
    .unwrap();
    assert_eq!(out, "developer,user,developer,");
}

#[test]
fn developer_messages_lose_their_tools_and_merge_with_system_ones() {
    let dump = dumper("{{ messages | tojson }}");
    let out = render(&dump, r#"{"messages": [
        {"role": "developer", "content": "d", "name": "n", "tools": [{"x": 1}]}, {"role": "user", "content": "u"}]}"#)
    .unwrap();
    assert_eq!(
        out,
        r#"[{"role": "system", "content": "d", "name": "n"}, {"role": "user", "content": "u"}]"#
    );
    let out = render(&dump, r#"{"messages": [
        {"role": "system", "content": [{"type": "text", "text": "s1"}, "s2"]},
        {"role": "developer", "content": "d", "name": "n"}, {"role": "user", "content": "u", "name": "m"}]}"#)
    .unwrap();
    assert_eq!(
        out,
        r#"[{"role": "system", "content": "s1\ns2\n\nd"}, {"role": "user", "content": "u", "name": "m"}]"#
    );
}

#[test]
fn continue_final_message_with_content_parts() {
    let tok = dumper(
        "{% for m in messages %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endfor %}",
    );
    let out = render(&tok, r#"{"messages": [{"role": "user", "content": "u"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hel"}, {"type": "refusal", "refusal": "no"}]}],
        "add_generation_prompt": false, "continue_final_message": true}"#)
    .unwrap();
    assert_eq!(out, "[u][Hel][no");
}

#[test]
fn openai_content_format_templates_get_parts() {
    let tok = dumper(
        "{% for m in messages %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endfor %}",
    );
    assert_eq!(tok.content_format(), Some(ContentFormat::OpenAi));
    let out = render(&tok, r#"{"messages": [
        {"role": "user", "content": "plain"}, {"role": "user", "content": [{"type": "text", "text": "p1"}, {"type": "text", "text": "p2"}]}]}"#)
    .unwrap();
    assert_eq!(out, "[plain][p1][p2]");
}

#[test]
fn kwargs_merge_in_vllm_order() {
    let tok = dumper("{{ add_generation_prompt }}|{{ enable_thinking }}|{{ custom }}|{{ eos_token }}|{{ documents | tojson }}");
    let out = render(
        &tok,
        r#"{
        "messages": [{"role": "user", "content": "x"}],
        "add_generation_prompt": false,
        "reasoning_effort": "none",
        "documents": [{"title": "t", "text": "d"}],
        "chat_template_kwargs": {"add_generation_prompt": true, "custom": "auto", "eos_token": "E"}
    }"#,
    )
    .unwrap();
    // The request field wins over the kwarg, "auto" counts as unset, kwargs override special tokens.
    assert_eq!(out, r#"False|False||E|[{"title": "t", "text": "d"}]"#);
}

#[test]
fn continue_final_message_cuts_after_the_last_message() {
    let tok = Tokenizer::from_dir(tiny_llama_dir()).unwrap();
    let out = render(
        &tok,
        r#"{
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
        "add_generation_prompt": false, "continue_final_message": true}"#,
    )
    .unwrap();
    assert_eq!(
        out,
        "<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHel"
    );
}

#[test]
fn bad_requests_are_errors_not_panics() {
    let tok = Tokenizer::from_dir(tiny_llama_dir()).unwrap();
    let cases = [
        serde_json::json!({"messages": []}),
        serde_json::json!({"messages": [{"role": "user", "content": "x"}], "tools": []}),
        serde_json::json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}),
        serde_json::json!({"messages": [{"role": "user", "content": "x"}], "continue_final_message": true}),
        serde_json::json!({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}),
        serde_json::json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": true}}),
        serde_json::json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}),
        serde_json::json!({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
        serde_json::json!({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"type": "other"}]}]}),
        serde_json::json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"function": {}}]}),
        serde_json::json!({"messages": [{"content": "no role"}]}),
        serde_json::json!({"messages": "nope"}),
    ];
    for req in cases {
        let err = tok.encode_chat(&match ChatRequest::from_json(req.to_string().as_bytes()) {
            Ok(r) => r,
            Err(e) => {
                assert!(e.is_client_error(), "{e}");
                continue;
            }
        });
        let e = err.expect_err(&req.to_string());
        assert!(
            e.is_client_error(),
            "{req}: {e} should be the client's fault"
        );
    }
    assert!(ChatRequest::from_json(b"{not json").is_err());
}

#[test]
fn template_rejections_carry_the_templates_message() {
    let tok = dumper("{% if messages[0].role != 'user' %}{{ raise_exception('Conversation roles must start with user') }}{% endif %}");
    let err = render(
        &tok,
        r#"{"messages": [{"role": "assistant", "content": "x"}]}"#,
    )
    .unwrap_err();
    assert!(
        matches!(&err, TokenizeError::TemplateRaised(m) if m == "Conversation roles must start with user"),
        "{err}"
    );
    assert_eq!(err.metric_label(), "template_raised");
}

#[test]
fn tokenizers_without_templates_refuse_chat_but_encode_prompts() {
    let tok = Tokenizer::from_dir(tokenizers_dir().join("gpt2")).unwrap();
    assert!(!tok.has_chat_template());
    let req =
        ChatRequest::from_json(br#"{"messages": [{"role": "user", "content": "x"}]}"#).unwrap();
    assert!(matches!(
        tok.encode_chat(&req),
        Err(TokenizeError::NoChatTemplate)
    ));
    assert_eq!(
        tok.encode_completion("Hello world").unwrap(),
        vec![15496, 995]
    );
}

#[test]
fn completion_prompt_forms() {
    let tok = Tokenizer::from_dir(tokenizers_dir().join("llama3.1")).unwrap();
    let parse = |s: &'static str| CompletionRequest::from_json(s.as_bytes()).unwrap();
    let one = tok
        .encode_completion_request(&parse(r#"{"prompt": "Hello world"}"#))
        .unwrap();
    assert_eq!(one, vec![vec![128000, 9906, 1917]]);
    let no_bos = tok
        .encode_completion_request(&parse(
            r#"{"prompt": "Hello world", "add_special_tokens": false}"#,
        ))
        .unwrap();
    assert_eq!(no_bos, vec![vec![9906, 1917]]);
    let ids = tok
        .encode_completion_request(&parse(r#"{"prompt": [1, 2, 3]}"#))
        .unwrap();
    assert_eq!(ids, vec![vec![1, 2, 3]]);
    let batch = tok
        .encode_completion_request(&parse(r#"{"prompt": ["Hello world", "Hello"]}"#))
        .unwrap();
    assert_eq!(batch.len(), 2);
    assert_eq!(batch[0], one[0]);
    let lists = tok
        .encode_completion_request(&parse(r#"{"prompt": [[5], [6, 7]]}"#))
        .unwrap();
    assert_eq!(lists, vec![vec![5], vec![6, 7]]);
    for bad in [r#"{"prompt": []}"#, r#"{"prompt": [[]]}"#] {
        assert!(tok.encode_completion_request(&parse(bad)).is_err(), "{bad}");
    }
    assert!(CompletionRequest::from_json(br#"{"prompt": [-1]}"#).is_err());
}

#[test]
fn hello_world_ids_from_the_tokenizer_readme() {
    let cases: [(&str, &[u32]); 8] = [
        ("llama3", &[9906, 1917]),
        ("llama3.1", &[128000, 9906, 1917]),
        ("qwen2", &[9707, 1879]),
        ("qwen3", &[9707, 1879]),
        ("deepseek-v3", &[19923, 2058]),
        ("gpt2", &[15496, 995]),
        ("mistral-v1", &[1, 22557, 1526]),
        ("mistral-v3", &[1, 23325, 2294]),
    ];
    for (name, want) in cases {
        let tok = Tokenizer::from_dir(tokenizers_dir().join(name)).unwrap();
        assert_eq!(
            tok.encode_completion("Hello world").unwrap(),
            want,
            "{name}"
        );
        assert!(tok.prefix_cache_supported(), "{name}");
    }
}

#[test]
fn missing_files_are_errors() {
    let err = Tokenizer::from_dir("/nonexistent/dir").unwrap_err();
    assert!(matches!(err, TokenizeError::Io { .. }), "{err}");
    let err = Tokenizer::from_files(
        tiny_llama_dir().join("config.json"),
        None,
        None,
        TokenizerOptions::default(),
    )
    .unwrap_err();
    assert!(matches!(err, TokenizeError::TokenizerLoad { .. }), "{err}");
}
