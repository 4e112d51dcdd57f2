//! Chat templates rendered the way transformers renders them: a Jinja environment with
//! `trim_blocks` and `lstrip_blocks`, loop controls, the `{% generation %}` block, HF's `tojson`
//! filter, the `raise_exception` and `strftime_now` globals, Python's `str()` for printed
//! values, and Python string/dict methods (`.strip()`, `.split()`, `.items()`, ...).
//! Invariant: for the same context, `render` returns the text Python's jinja2 renders; any
//! template error becomes a [`TokenizeError`], never a panic.

use std::fmt::Write as _;

use minijinja::value::{from_args, Kwargs, Rest, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State, UndefinedBehavior, Value};

use crate::error::{Result, TokenizeError};
use crate::pyfmt::{py_is_space, py_json, py_str, JsonOpts};

const TEMPLATE_NAME: &str = "chat_template";
/// Marks errors raised by the template itself so they can be told from engine errors.
const RAISED_PREFIX: &str = "\u{1}raise_exception\u{1}";

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
}

impl ChatTemplate {
    /// Compiles `source` (the text of a Jinja chat template).
    pub fn new(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| TokenizeError::TemplateSyntax(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_formatter(|out, _state, value| match value.kind() {
            // What `py_str` does for these, without its temporary copy: message contents are
            // most of what templates print.
            ValueKind::String => out
                .write_str(value.as_str().unwrap_or_default())
                .map_err(Error::from),
            ValueKind::Undefined => Ok(()),
            _ => {
                let mut s = String::new();
                py_str(value, &mut s)?;
                out.write_str(&s).map_err(Error::from)
            }
        });
        env.set_unknown_method_callback(py_methods);
        env.add_filter("tojson", tojson);
        env.add_filter("trim", py_trim_filter);
        env.add_filter("string", |v: &Value| -> Result<Value, Error> {
            let mut s = String::new();
            py_str(v, &mut s)?;
            Ok(Value::from(s))
        });
        env.add_function(
            "raise_exception",
            |msg: Option<Value>| -> Result<Value, Error> {
                let text = msg.map(|m| m.to_string()).unwrap_or_default();
                Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("{RAISED_PREFIX}{text}"),
                ))
            },
        );
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_tags(source))
            .map_err(|e| TokenizeError::TemplateSyntax(error_chain(&e)))?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
        })
    }

    /// The template text as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders the template with `ctx` (a map of variables).
    pub fn render(&self, ctx: Value) -> Result<String> {
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TokenizeError::TemplateRender(error_chain(&e)))?;
        tmpl.render(ctx).map_err(|e| classify(&e))
    }
}

/// transformers' `AssistantTracker` extension adds `{% generation %}...{% endgeneration %}`, a
/// block that renders its body unchanged. An `if true` block has the same whitespace handling
/// under trim/lstrip_blocks, so the tags are rewritten to it.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        // The closing `%}` is searched after the opening `{%`: in `{%}` the two share the `%`.
        let Some(end) = tag[2..].find("%}").map(|i| i + 2) else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body, trail) = split_ws_markers(inner);
        match body.trim() {
            "generation" => {
                let _ = write!(out, "{{%{lead} if true {trail}%}}");
            }
            "endgeneration" => {
                let _ = write!(out, "{{%{lead} endif {trail}%}}");
            }
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// Splits the inside of a `{% ... %}` tag into its whitespace-control markers and body.
fn split_ws_markers(inner: &str) -> (&str, &str, &str) {
    let lead = if inner.starts_with('-') || inner.starts_with('+') {
        &inner[..1]
    } else {
        ""
    };
    let body = &inner[lead.len()..];
    let trail = if body.ends_with('-') || body.ends_with('+') {
        &body[body.len() - 1..]
    } else {
        ""
    };
    (lead, &body[..body.len() - trail.len()], trail)
}

fn classify(e: &Error) -> TokenizeError {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(mj) = err.downcast_ref::<Error>() {
            if let Some(msg) = mj.detail().and_then(|d| d.strip_prefix(RAISED_PREFIX)) {
                return TokenizeError::TemplateRaised(msg.to_string());
            }
        }
        cur = err.source();
    }
    TokenizeError::TemplateRender(error_chain(e))
}

fn error_chain(e: &Error) -> String {
    let mut s = e.to_string();
    let mut cur = std::error::Error::source(e);
    while let Some(err) = cur {
        let _ = write!(s, ": {err}");
        cur = err.source();
    }
    s
}

/// HF's filter: `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// positionally or by keyword in that order.
fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let mut opt: [Option<Value>; 4] = Default::default();
    for (slot, arg) in opt.iter_mut().zip(args.iter()) {
        *slot = Some(arg.clone());
    }
    if args.len() > opt.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments",
        ));
    }
    for (i, name) in ["ensure_ascii", "indent", "separators", "sort_keys"]
        .iter()
        .enumerate()
    {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            opt[i] = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let mut opts = JsonOpts::default();
    let [ensure_ascii, indent, separators, sort_keys] = opt;
    opts.ensure_ascii = ensure_ascii.is_some_and(|v| v.is_true());
    opts.sort_keys = sort_keys.is_some_and(|v| v.is_true());
    opts.indent = match indent {
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) if v.kind() == ValueKind::String => {
            Some(v.as_str().unwrap_or_default().to_string())
        }
        Some(v) => {
            let n = v.as_i64().ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson indent must be an int or a string",
                )
            })?;
            Some(" ".repeat(usize::try_from(n).unwrap_or(0)))
        }
        None => None,
    };
    if opts.indent.is_some() {
        opts.item_sep = ",".into();
    }
    if let Some(seps) = separators.filter(|v| !v.is_none()) {
        let parts: Vec<Value> = seps.try_iter()?.collect();
        match parts.as_slice() {
            [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                opts.item_sep = a.as_str().unwrap_or_default().to_string();
                opts.key_sep = b.as_str().unwrap_or_default().to_string();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson separators must be a pair of strings",
                ))
            }
        }
    }
    py_json(value, &opts).map(Value::from)
}

/// jinja2's `trim`: Python's `str.strip(chars)`.
fn py_trim_filter(value: &Value, chars: Option<Value>) -> Result<Value, Error> {
    if value.kind() == ValueKind::String {
        let s = value.as_str().unwrap_or_default();
        return Ok(stripped(value, py_strip(s, chars.as_ref(), true, true)?));
    }
    let mut s = String::new();
    py_str(value, &mut s)?;
    Ok(Value::from(py_strip(&s, chars.as_ref(), true, true)?))
}

/// The result of stripping the string `value` to `part` (a slice of it). When nothing was
/// stripped (the usual case for message contents) the value is shared instead of copied; a safe
/// string is still copied, since the result has always been a plain string.
fn stripped(value: &Value, part: &str) -> Value {
    let whole =
        value.kind() == ValueKind::String && value.as_str().is_some_and(|s| s.len() == part.len());
    if whole && !value.is_safe() {
        value.clone()
    } else {
        Value::from(part)
    }
}

fn py_strip<'a>(
    s: &'a str,
    chars: Option<&Value>,
    left: bool,
    right: bool,
) -> Result<&'a str, Error> {
    let set: Option<Vec<char>> = match chars {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_str() {
            Some(c) => Some(c.chars().collect()),
            None => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "strip arg must be None or str",
                ))
            }
        },
    };
    let strip = |c: char| match &set {
        Some(set) => set.contains(&c),
        None => py_is_space(c),
    };
    let mut out = s;
    if left {
        out = out.trim_start_matches(strip);
    }
    if right {
        out = out.trim_end_matches(strip);
    }
    Ok(out)
}

/// Python's `str.split(sep=None, maxsplit=-1)`.
fn py_split(s: &str, sep: Option<&str>, maxsplit: i64) -> Result<Vec<Value>, Error> {
    let limit = usize::try_from(maxsplit).ok();
    match sep {
        Some("") => Err(Error::new(ErrorKind::InvalidOperation, "empty separator")),
        Some(sep) => Ok(match limit {
            Some(n) => s.splitn(n + 1, sep).map(Value::from).collect(),
            None => s.split(sep).map(Value::from).collect(),
        }),
        None => {
            let mut out = Vec::new();
            let mut rest = s.trim_start_matches(py_is_space);
            while !rest.is_empty() {
                if limit.is_some_and(|n| out.len() >= n) {
                    out.push(Value::from(rest));
                    break;
                }
                let end = rest.find(py_is_space).unwrap_or(rest.len());
                out.push(Value::from(&rest[..end]));
                rest = rest[end..].trim_start_matches(py_is_space);
            }
            Ok(out)
        }
    }
}

/// Python methods on values. The string methods whose whitespace rules differ between Rust and
/// Python are implemented here; the rest come from `minijinja-contrib`'s pycompat.
fn py_methods(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        match method {
            "strip" | "lstrip" | "rstrip" => {
                let (chars,): (Option<Value>,) = from_args(args)?;
                let (l, r) = (method != "rstrip", method != "lstrip");
                return Ok(stripped(value, py_strip(s, chars.as_ref(), l, r)?));
            }
            "split" => {
                let (sep, maxsplit): (Option<Value>, Option<i64>) = from_args(args)?;
                let sep = sep.filter(|v| !v.is_none());
                let sep_str = match &sep {
                    Some(v) => Some(v.as_str().ok_or_else(|| {
                        Error::new(
                            ErrorKind::InvalidOperation,
                            "split separator must be a string",
                        )
                    })?),
                    None => None,
                };
                return Ok(Value::from(py_split(s, sep_str, maxsplit.unwrap_or(-1))?));
            }
            "isspace" => {
                let () = from_args(args)?;
                return Ok(Value::from(!s.is_empty() && s.chars().all(py_is_space)));
            }
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// `datetime.now().strftime(format)` in local time. An invalid format is an error, not a panic.
fn strftime_now(format: &str) -> Result<Value, Error> {
    use chrono::format::{Item, StrftimeItems};
    let items: Vec<Item> = StrftimeItems::new(format).collect();
    if items.iter().any(|i| matches!(i, Item::Error)) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "invalid strftime format",
        ));
    }
    let now = chrono::Local::now();
    let mut out = String::new();
    write!(out, "{}", now.format_with_items(items.into_iter()))
        .map_err(|_| Error::new(ErrorKind::InvalidOperation, "strftime failed"))?;
    Ok(Value::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, ctx: serde_json::Value) -> Result<String> {
        let ctx = crate::json::Json::parse(&ctx.to_string())
            .map_err(|e| TokenizeError::InvalidRequest(e.to_string()))?;
        ChatTemplate::new(src)?.render(crate::value::json_to_value(&ctx))
    }

    #[test]
    fn python_printing_and_methods() {
        let out = render(
            "{{ a }}|{{ b }}|{{ c }}|{{ d }}|{{ s.strip() }}|{{ s.split() }}|{{ 'x,y'.split(',')[-1] }}|{{ s | trim }}",
            serde_json::json!({"a": true, "b": null, "c": {"k": [1, 2.0]}, "d": 0.5, "s": "\x1f a  b \n"}),
        )
        .unwrap();
        assert_eq!(out, "True|None|{'k': [1, 2.0]}|0.5|a  b|['a', 'b']|y|a  b");
    }

    #[test]
    fn printed_values_are_pythons_str() {
        let long = "a message longer than a small string, printed as it is \u{e9}";
        let out = render(
            "{{ s }}|{{ long }}|{{ n }}|{{ f }}|{{ none }}|{{ missing }}|{{ m.missing }}|{{ t }}|{{ no }}|{{ l }}|{{ m }}|{{ s | safe }}|{{ 'a' ~ 1 }}|{{ 1.0 / 4 }}",
            serde_json::json!({
                "s": "it's", "long": long, "n": -7, "f": 2.0, "none": null, "t": true,
                "no": false, "l": ["x", 1, null, [true]], "m": {"k": "v"},
            }),
        )
        .unwrap();
        assert_eq!(
            out,
            format!("it's|{long}|-7|2.0|None|||True|False|['x', 1, None, [True]]|{{'k': 'v'}}|it's|a1|0.25")
        );
    }

    #[test]
    fn strip_and_trim_keep_or_cut_the_text() {
        let long = "a message longer than a small string, with nothing to strip";
        let ctx = serde_json::json!({"long": long, "padded": format!("\n {long}\x1f\n"), "n": 5, "none": null});
        let src = "{{ long | trim }}|{{ long.strip() }}|{{ long.lstrip('a') }}|{{ padded | trim }}|{{ padded.rstrip() }}|{{ padded.lstrip('\n') }}|{{ n | trim }}|{{ none | trim }}|{{ (long | trim) is string }}|{{ (long | safe | trim) == long }}|{{ long.strip() ~ '!' }}";
        let out = render(src, ctx).unwrap();
        let cut = &long[1..];
        assert_eq!(
            out,
            format!("{long}|{long}|{cut}|{long}|\n {long}| {long}\x1f\n|5|None|True|True|{long}!")
        );
    }

    #[test]
    fn tojson_forms() {
        let v = serde_json::json!({"t": {"name": "f", "x": "é"}});
        assert_eq!(
            render("{{ t | tojson }}", v.clone()).unwrap(),
            r#"{"name": "f", "x": "é"}"#
        );
        assert_eq!(
            render("{{ t | tojson(indent=2) }}", v.clone()).unwrap(),
            "{\n  \"name\": \"f\",\n  \"x\": \"é\"\n}"
        );
        assert_eq!(
            render(
                "{{ t | tojson(separators=(',', ':'), ensure_ascii=true) }}",
                v
            )
            .unwrap(),
            r#"{"name":"f","x":"\u00e9"}"#
        );
    }

    #[test]
    fn trim_and_lstrip_blocks_and_generation() {
        let src = "{% for m in messages %}\n  {% generation %}\n{{ m }}\n{% endgeneration %}\n{% endfor %}\n";
        assert_eq!(
            render(src, serde_json::json!({"messages": ["a", "b"]})).unwrap(),
            "a\nb\n"
        );
    }

    #[test]
    fn raise_exception_is_a_rejection() {
        let err = render(
            "{{ raise_exception('no system role') }}",
            serde_json::json!({}),
        )
        .unwrap_err();
        assert!(
            matches!(&err, TokenizeError::TemplateRaised(m) if m == "no system role"),
            "{err}"
        );
    }

    #[test]
    fn bad_templates_are_errors() {
        assert!(matches!(
            ChatTemplate::new("{% for %}"),
            Err(TokenizeError::TemplateSyntax(_))
        ));
        let err = render("{{ x.y.z }}", serde_json::json!({})).unwrap_err();
        assert!(matches!(err, TokenizeError::TemplateRender(_)), "{err}");
        let err = render("{{ strftime_now('%Q') }}", serde_json::json!({})).unwrap_err();
        assert!(matches!(err, TokenizeError::TemplateRender(_)), "{err}");
        assert_eq!(
            render("{{ strftime_now('%Y') | length }}", serde_json::json!({})).unwrap(),
            "4"
        );
    }

    #[test]
    fn tags_that_share_their_percent_sign_are_syntax_errors_not_panics() {
        for src in [
            "{%}",
            "a{%}b",
            "{%-}",
            "{%}%}",
            "{%%}",
            "{% generation %}{%}",
        ] {
            match ChatTemplate::new(src) {
                Err(TokenizeError::TemplateSyntax(_)) => {}
                other => panic!("{src:?}: {:?}", other.map(|t| t.source().to_string())),
            }
        }
        assert_eq!(rewrite_generation_tags("{%}"), "{%}");
        assert_eq!(rewrite_generation_tags("{%%}"), "{%%}");
        assert_eq!(
            rewrite_generation_tags("{%- generation -%}x{% endgeneration %}"),
            "{%- if true -%}x{% endif %}"
        );
    }

    #[test]
    fn namespace_slices_and_loop() {
        let src = "{% set ns = namespace(n=0) %}{% for m in xs[::-1] %}{% set ns.n = ns.n + 1 %}{{ m }}{% if loop.last %}!{% endif %}{% endfor %}{{ ns.n }}";
        assert_eq!(
            render(src, serde_json::json!({"xs": [1, 2, 3]})).unwrap(),
            "321!3"
        );
    }
}
