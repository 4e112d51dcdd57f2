//! Which shape of message `content` a chat template expects, detected as vLLM detects it
//! (`vllm/renderers/hf.py::_detect_content_format`): a template that loops over a message's
//! content (`{% for part in message['content'] %}`) takes the OpenAI list-of-parts form
//! ("openai"); any other takes one string ("string"), text parts joined with `"\n"`.
//!
//! vLLM walks jinja2's AST; this walks the template's `{% for %}`, `{% set %}` and
//! `{% macro %}` statements, which is what that AST walk looks at. Invariant: for the
//! templates vLLM classifies, the same answer; an unreadable template falls back to "string",
//! vLLM's default.

/// How message content is handed to the template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// Content is one string; text parts are joined with `"\n"`.
    String,
    /// Content is a list of `{"type": "text", "text": ...}` parts.
    OpenAi,
}

/// One `{% ... %}` statement that the detection looks at.
#[derive(Debug)]
enum Stmt<'a> {
    For {
        target: &'a str,
        iter: &'a str,
        in_macro: bool,
    },
    Set {
        target: &'a str,
        expr: &'a str,
    },
    Macro {
        params: Vec<&'a str>,
        loops: Vec<(&'a str, &'a str)>,
    },
    Call {
        args: Vec<&'a str>,
    },
}

/// Detects the content format of `template` (vLLM's "auto" setting).
pub fn detect(template: &str) -> ContentFormat {
    let stmts = statements(template);
    let message_lists = aliases(&stmts, "messages");
    let message_vars: Vec<&str> = stmts
        .iter()
        .filter_map(|s| match s {
            Stmt::For { target, iter, .. }
                if message_lists.iter().any(|m| is_var_or_elems(iter, m, None)) =>
            {
                Some(*target)
            }
            _ => None,
        })
        .collect();
    let is_content = |expr: &str| {
        message_vars
            .iter()
            .any(|m| is_var_or_elems(expr, m, Some("content")))
    };
    for s in &stmts {
        match s {
            Stmt::For { iter, in_macro, .. }
                if is_content(iter) || (!in_macro && bare_name(iter) == Some("content")) =>
            {
                return ContentFormat::OpenAi;
            }
            Stmt::Macro { params, loops } => {
                // A macro whose parameter receives `message.content` and loops over it.
                let content_params: Vec<&str> = params
                    .iter()
                    .enumerate()
                    .filter(|(i, p)| {
                        stmts.iter().any(|c| match c {
                            Stmt::Call { args } => args.iter().enumerate().any(|(j, a)| {
                                let (key, val) = split_kwarg(a);
                                (key == Some(**p) || (key.is_none() && j == *i)) && is_content(val)
                            }),
                            _ => false,
                        })
                    })
                    .map(|(_, p)| *p)
                    .collect();
                if loops
                    .iter()
                    .any(|(_, iter)| bare_name(iter).is_some_and(|n| content_params.contains(&n)))
                {
                    return ContentFormat::OpenAi;
                }
            }
            _ => {}
        }
    }
    ContentFormat::String
}

/// `name` plus every variable assigned (transitively) from an access of it.
fn aliases<'a>(stmts: &[Stmt<'a>], name: &'a str) -> Vec<&'a str> {
    let mut names = vec![name];
    let mut i = 0;
    while i < names.len() {
        let cur = names[i];
        for s in stmts {
            if let Stmt::Set { target, expr } = s {
                if is_var_or_elems(expr, cur, None) && !names.contains(target) {
                    names.push(target);
                }
            }
        }
        i += 1;
    }
    names
}

/// vLLM's `_is_var_or_elems_access`: `var`, `var[...]` slices, `var.key`/`var['key']`, each
/// possibly followed by filters or a test.
fn is_var_or_elems(expr: &str, var: &str, key: Option<&str>) -> bool {
    let mut e = strip_filters_and_tests(expr).trim();
    // Trailing slices `[a:b]` keep the variable.
    while let Some(open) = e.strip_suffix(']').and_then(|x| x.rfind('[')) {
        let inner = &e[open + 1..e.len() - 1];
        if inner.contains(':') {
            e = e[..open].trim_end();
        } else {
            break;
        }
    }
    match key {
        None => e == var,
        Some(k) => {
            let Some(rest) = e.strip_prefix(var) else {
                return false;
            };
            let rest = rest.trim_start();
            if let Some(attr) = rest.strip_prefix('.') {
                return attr.trim() == k;
            }
            let Some(inner) = rest.strip_prefix('[').and_then(|r| r.strip_suffix(']')) else {
                return false;
            };
            let inner = inner.trim();
            inner.len() >= 2
                && (inner.starts_with('\'') || inner.starts_with('"'))
                && inner.ends_with(&inner[..1])
                && &inner[1..inner.len() - 1] == k
        }
    }
}

fn strip_filters_and_tests(expr: &str) -> &str {
    let mut depth = 0i32;
    let mut quote: Option<char> = None;
    for (i, c) in expr.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(c),
            (None, '(' | '[' | '{') => depth += 1,
            (None, ')' | ']' | '}') => depth -= 1,
            (None, '|') if depth == 0 => return &expr[..i],
            (None, ' ') if depth == 0 && expr[i..].trim_start().starts_with("is ") => {
                return &expr[..i]
            }
            _ => {}
        }
    }
    expr
}

fn bare_name(expr: &str) -> Option<&str> {
    let e = expr.trim();
    (!e.is_empty() && e.chars().all(|c| c.is_alphanumeric() || c == '_')).then_some(e)
}

fn split_kwarg(arg: &str) -> (Option<&str>, &str) {
    match arg.split_once('=') {
        Some((k, v)) if bare_name(k).is_some() && !v.starts_with('=') => (Some(k.trim()), v.trim()),
        _ => (None, arg.trim()),
    }
}

/// An open `{% macro %}`: its parameters and the `(target, iter)` of its loops.
type MacroScope<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>);

/// The `{% %}` statements of a template, with loops inside macros marked.
fn statements(src: &str) -> Vec<Stmt<'_>> {
    let mut out = Vec::new();
    let mut macro_stack: Vec<MacroScope<'_>> = Vec::new();
    for body in tag_bodies(src) {
        let (kw, rest) = body.split_once(char::is_whitespace).unwrap_or((body, ""));
        let rest = rest.trim();
        match kw {
            "for" => {
                if let Some((target, iter)) = parse_for(rest) {
                    if let Some((_, loops)) = macro_stack.last_mut() {
                        loops.push((target, iter));
                    }
                    out.push(Stmt::For {
                        target,
                        iter,
                        in_macro: !macro_stack.is_empty(),
                    });
                }
            }
            "set" => {
                if let Some((t, e)) = rest.split_once('=') {
                    if let Some(target) = bare_name(t) {
                        out.push(Stmt::Set {
                            target,
                            expr: e.trim(),
                        });
                    }
                }
            }
            "macro" => {
                let params = rest
                    .split_once('(')
                    .and_then(|(_, p)| p.rsplit_once(')'))
                    .map(|(p, _)| {
                        split_args(p)
                            .into_iter()
                            .map(|a| split_kwarg(a).0.unwrap_or(a.trim()))
                            .collect()
                    })
                    .unwrap_or_default();
                macro_stack.push((params, Vec::new()));
            }
            "endmacro" => {
                if let Some((params, loops)) = macro_stack.pop() {
                    out.push(Stmt::Macro { params, loops });
                }
            }
            _ => {}
        }
    }
    for args in calls(src) {
        out.push(Stmt::Call { args });
    }
    out
}

fn parse_for(rest: &str) -> Option<(&str, &str)> {
    let (target, iter) = rest.split_once(" in ")?;
    let target = target.split(',').next()?.trim();
    let iter = iter.trim();
    let iter = iter.split(" if ").next().unwrap_or(iter);
    let iter = iter.strip_suffix("recursive").unwrap_or(iter).trim();
    Some((bare_name(target)?, iter))
}

/// Bodies of `{% ... %}` tags, without whitespace-control markers.
fn tag_bodies(src: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = src;
    while let Some(start) = rest.find("{%") {
        let after = &rest[start + 2..];
        let Some(end) = after.find("%}") else { break };
        let body = after[..end]
            .trim_start_matches(['-', '+'])
            .trim_end_matches(['-', '+'])
            .trim();
        out.push(body);
        rest = &after[end + 2..];
    }
    out
}

/// `name(args)` calls inside `{{ }}` and `{% %}` (enough to see macro arguments).
fn calls(src: &str) -> Vec<Vec<&str>> {
    let mut out = Vec::new();
    let bytes = src.as_bytes();
    let mut i = 0;
    while let Some(off) = src.get(i..).and_then(|s| s.find('(')) {
        let open = i + off;
        let name_start = src[..open]
            .char_indices()
            .rev()
            .take_while(|(_, c)| c.is_alphanumeric() || *c == '_')
            .last()
            .map(|(j, _)| j)
            .unwrap_or(open);
        let name = &src[name_start..open];
        if let Some(close) = matching_paren(bytes, open) {
            if !name.is_empty() {
                out.push(split_args(&src[open + 1..close]));
            }
        }
        i = open + 1;
    }
    out
}

fn matching_paren(bytes: &[u8], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (j, b) in bytes.iter().enumerate().skip(open) {
        match b {
            b'(' => depth += 1,
            b')' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(j);
                }
            }
            _ => {}
        }
    }
    None
}

fn split_args(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(s[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    if !s[start..].trim().is_empty() {
        out.push(s[start..].trim());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn string_templates() {
        for t in [
            "{% for message in messages %}{{ message['content'] }}{% endfor %}",
            "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% endif %}{% endfor %}",
            "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}",
        ] {
            assert_eq!(detect(t), ContentFormat::String, "{t}");
        }
    }

    #[test]
    fn openai_templates() {
        for t in [
            "{% for message in messages %}{% for part in message['content'] %}{{ part.text }}{% endfor %}{% endfor %}",
            "{%- set msgs = messages[1:] %}{% for m in msgs %}{% for c in m.content | selectattr('type') %}{% endfor %}{% endfor %}",
            "{% for m in messages %}{% set content = m.content %}{% for c in content %}{{ c }}{% endfor %}{% endfor %}",
            "{% macro render(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}{% for m in messages %}{{ render(m['content']) }}{% endfor %}",
        ] {
            assert_eq!(detect(t), ContentFormat::OpenAi, "{t}");
        }
    }
}
