//! Python's text forms of template values, byte for byte: `json.dumps` as transformers' `tojson`
//! filter calls it (`ensure_ascii=False` unless asked, its `indent`/`separators`/`sort_keys`
//! behaviour), `str()` of values that templates print (`True`, `None`, `{'a': 1}`), float `repr`,
//! and `str.isspace`. Chat templates print these straight into the prompt, so any difference from
//! Python changes the token ids and with them every block hash after it.

use std::fmt::Write as _;

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, Value};

/// Python's `str.isspace` for one character (`str.strip()` with no argument strips these).
/// Wider than Rust's `char::is_whitespace`: it includes the ASCII separators 0x1C..=0x1F.
pub fn py_is_space(c: char) -> bool {
    matches!(
        c,
        '\t' | '\n'
            | '\x0b'
            | '\x0c'
            | '\r'
            | '\x1c'..='\x1f'
            | ' '
            | '\u{85}'
            | '\u{a0}'
            | '\u{1680}'
            | '\u{2000}'..='\u{200a}'
            | '\u{2028}'
            | '\u{2029}'
            | '\u{202f}'
            | '\u{205f}'
            | '\u{3000}'
    )
}

/// Python's `repr(float)` (also its `str`): shortest round-trip digits, positional between
/// 1e-4 and 1e16, otherwise `1e+16`-style exponents with at least two digits.
pub fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    // Rust's `{:e}` gives the shortest round-trip digits, as Python's repr does.
    let sci = format!("{f:e}");
    let (mantissa, exp) = match sci.split_once('e') {
        Some((m, e)) => (m, e.parse::<i32>().unwrap_or(0)),
        None => (sci.as_str(), 0),
    };
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if negative { "-" } else { "" };
    if !(-4..16).contains(&exp) {
        let (head, tail) = digits.split_at(1);
        let frac = if tail.is_empty() {
            String::new()
        } else {
            format!(".{tail}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{head}{frac}e{esign}{:02}", exp.abs());
    }
    let point = exp + 1; // digits before the decimal point
    let body = if point <= 0 {
        format!("0.{}{}", "0".repeat(point.unsigned_abs() as usize), digits)
    } else if (point as usize) >= digits.len() {
        format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
    } else {
        let (a, b) = digits.split_at(point as usize);
        format!("{a}.{b}")
    };
    format!("{sign}{body}")
}

/// Options of Python's `json.dumps` that HF's `tojson` filter exposes.
#[derive(Debug, Clone)]
pub struct JsonOpts {
    /// Escape every non-ASCII character as `\uXXXX`.
    pub ensure_ascii: bool,
    /// `None`: one line. `Some(s)`: a newline plus `s` repeated per level.
    pub indent: Option<String>,
    /// Between items (default `", "`, or `","` when indenting).
    pub item_sep: String,
    /// Between a key and its value (default `": "`).
    pub key_sep: String,
    /// Sort object keys.
    pub sort_keys: bool,
}

impl Default for JsonOpts {
    fn default() -> Self {
        JsonOpts {
            ensure_ascii: false,
            indent: None,
            item_sep: ", ".into(),
            key_sep: ": ".into(),
            sort_keys: false,
        }
    }
}

/// Python's `json.dumps(value, **opts)`.
pub fn py_json(value: &Value, opts: &JsonOpts) -> Result<String, Error> {
    let mut out = String::new();
    json_value(value, opts, 0, &mut out)?;
    Ok(out)
}

fn json_value(v: &Value, opts: &JsonOpts, level: usize, out: &mut String) -> Result<(), Error> {
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&json_number(v)),
        ValueKind::String => json_str(v.as_str().unwrap_or_default(), opts.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            json_container(('[', ']'), items.len(), opts, level, out, |i, out| {
                json_value(&items[i], opts, level + 1, out)
            })?;
        }
        ValueKind::Map | ValueKind::Plain => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if opts.sort_keys {
                keys.sort();
            }
            json_container(('{', '}'), keys.len(), opts, level, out, |i, out| {
                let key = &keys[i];
                match key.as_str() {
                    Some(s) => json_str(s, opts.ensure_ascii, out),
                    None => json_str(&json_key(key)?, opts.ensure_ascii, out),
                }
                out.push_str(&opts.key_sep);
                json_value(&v.get_item(key)?, opts, level + 1, out)
            })?;
        }
        ValueKind::Undefined => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "Object of type Undefined is not JSON serializable",
            ))
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("value of kind {} is not JSON serializable", v.kind()),
            ))
        }
    }
    Ok(())
}

fn json_container(
    (open, close): (char, char),
    len: usize,
    opts: &JsonOpts,
    level: usize,
    out: &mut String,
    mut item: impl FnMut(usize, &mut String) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..len {
        if i > 0 {
            out.push_str(&opts.item_sep);
        }
        if let Some(ind) = &opts.indent {
            out.push('\n');
            out.push_str(&ind.repeat(level + 1));
        }
        item(i, out)?;
    }
    if let Some(ind) = &opts.indent {
        out.push('\n');
        out.push_str(&ind.repeat(level));
    }
    out.push(close);
    Ok(())
}

/// A non-string dict key as Python's json module converts it.
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.into()),
        ValueKind::None => Ok("null".into()),
        ValueKind::Number => Ok(json_number(key)),
        _ => Err(Error::new(
            ErrorKind::InvalidOperation,
            "keys must be str, int, float, bool or None",
        )),
    }
}

fn json_number(v: &Value) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    match f64::try_from(v.clone()) {
        Ok(f) if f.is_nan() => "NaN".into(),
        Ok(f) if f.is_infinite() => if f > 0.0 { "Infinity" } else { "-Infinity" }.into(),
        Ok(f) => py_float_repr(f),
        Err(_) => v.to_string(),
    }
}

fn json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\x08' => out.push_str("\\b"),
            '\x0c' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `str(value)` for what a template prints with `{{ value }}`: strings as they are,
/// everything else as Python would show it.
pub fn py_str(v: &Value, out: &mut String) -> Result<(), Error> {
    match v.kind() {
        ValueKind::String => out.push_str(v.as_str().unwrap_or_default()),
        ValueKind::Undefined => {}
        _ => py_repr(v, out)?,
    }
    Ok(())
}

/// Python's `repr(value)` (how values nested in lists and dicts print).
pub fn py_repr(v: &Value, out: &mut String) -> Result<(), Error> {
    match v.kind() {
        ValueKind::None | ValueKind::Undefined => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                out.push_str(&py_float_repr(f));
            }
        }
        ValueKind::String => py_str_repr(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&item, out)?;
            }
            out.push(']');
        }
        ValueKind::Map | ValueKind::Plain => {
            out.push('{');
            for (i, key) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&key, out)?;
                out.push_str(": ");
                py_repr(&v.get_item(&key)?, out)?;
            }
            out.push('}');
        }
        _ => out.push_str(&v.to_string()),
    }
    Ok(())
}

/// `repr(str)`: single quotes unless the text has a `'` and no `"`; control characters escaped.
/// Non-printable non-ASCII characters beyond C0/C1 controls and line separators are printed as
/// they are (Python escapes a few more Unicode categories; templates do not print those).
fn py_str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..=0xa0).contains(&(c as u32)) || c == '\u{ad}' => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            '\u{2028}' | '\u{2029}' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (-2.5, "-2.5"),
            (123.456, "123.456"),
            (1e100, "1e+100"),
            (0.0, "0.0"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn json_matches_python_defaults() {
        let v = crate::value::json_to_value(
            &crate::json::Json::parse(
                r#"{"name": "wéather \"x\"\n", "n": [1, 2.5, true, null], "e": {}, "l": []}"#,
            )
            .unwrap(),
        );
        assert_eq!(
            py_json(&v, &JsonOpts::default()).unwrap(),
            r#"{"name": "wéather \"x\"\n", "n": [1, 2.5, true, null], "e": {}, "l": []}"#
        );
        let opts = JsonOpts {
            indent: Some("  ".into()),
            item_sep: ",".into(),
            ensure_ascii: true,
            ..JsonOpts::default()
        };
        assert_eq!(
            py_json(&v, &opts).unwrap(),
            "{\n  \"name\": \"w\\u00e9ather \\\"x\\\"\\n\",\n  \"n\": [\n    1,\n    2.5,\n    true,\n    null\n  ],\n  \"e\": {},\n  \"l\": []\n}"
        );
    }

    #[test]
    fn repr_matches_python() {
        let v = crate::value::json_to_value(
            &crate::json::Json::parse(r#"{"a": [1, "it's", null, false], "b": "x"}"#).unwrap(),
        );
        let mut s = String::new();
        py_str(&v, &mut s).unwrap();
        assert_eq!(s, r#"{'a': [1, "it's", None, False], 'b': 'x'}"#);
    }

    #[test]
    fn isspace_is_pythons() {
        assert!(py_is_space('\x1f') && py_is_space('\u{3000}') && !py_is_space('\u{200b}'));
        assert!(!'\x1f'.is_whitespace(), "the case Rust's trim gets wrong");
    }
}
