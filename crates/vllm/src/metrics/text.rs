//! The Prometheus text exposition format (version 0.0.4), read without copying: the one parser
//! of `/metrics` pages in the workspace (the router's scrapes, `kinfctl doctor`, the benchmark
//! and the interop suite all read through it).
//!
//! Invariants: the input is untrusted, so nothing here panics or allocates per line; a line is
//! either a [`Sample`] whose name, labels, value and timestamp are all well formed, or a
//! [`ParseError`] naming the line and what was wrong with it. Comments (`# HELP`, `# TYPE`,
//! anything starting with `#`) and blank lines yield nothing. Label values keep their escapes
//! in the page and are decoded on lookup, borrowing when a value has none.
//!
//! ```
//! use kinference_vllm::metrics::text;
//! let page = "# TYPE vllm:num_requests_running gauge\n\
//!             vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n";
//! let s = text::parse(page).next().unwrap().unwrap();
//! assert_eq!((s.name, s.value), ("vllm:num_requests_running", 3.0));
//! assert_eq!(s.label("engine").as_deref(), Some("0"));
//! ```

use std::borrow::Cow;

/// One sample line: `name{labels} value [timestamp]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    /// The text between the braces, already checked to be a well-formed label set.
    raw_labels: &'a str,
    /// `+Inf`, `-Inf` and `NaN` included, as the format allows.
    pub value: f64,
    /// Milliseconds since the Unix epoch, when the line carries one.
    pub timestamp_ms: Option<i64>,
}

impl<'a> Sample<'a> {
    /// The decoded value of label `key`, if the sample has it (the first one, were a page to
    /// repeat a label name).
    pub fn label(&self, key: &str) -> Option<Cow<'a, str>> {
        self.labels().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// The labels in page order, values decoded.
    pub fn labels(&self) -> Labels<'a> {
        Labels {
            rest: self.raw_labels,
        }
    }
}

/// Iterator over a sample's labels: (name, decoded value).
#[derive(Clone, Debug)]
pub struct Labels<'a> {
    rest: &'a str,
}

impl<'a> Iterator for Labels<'a> {
    type Item = (&'a str, Cow<'a, str>);

    fn next(&mut self) -> Option<Self::Item> {
        // The label set was validated when the sample was parsed, so an error cannot occur
        // here; ending the iteration is the safe answer if it ever did.
        let (key, raw, rest) = next_label(self.rest).ok()??;
        self.rest = rest;
        Some((key, decode(raw)))
    }
}

/// Why a line is not a sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ErrorKind {
    #[error("invalid metric name")]
    Name,
    #[error("malformed label set")]
    Labels,
    #[error("invalid escape sequence in a label value")]
    Escape,
    #[error("missing or invalid value")]
    Value,
    #[error("invalid timestamp")]
    Timestamp,
    #[error("unexpected text after the timestamp")]
    Trailing,
}

/// A line that could not be read, by its 1-based number in the page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {kind}")]
pub struct ParseError {
    pub line: usize,
    pub kind: ErrorKind,
}

/// The samples of a page, in order; each unreadable line as an error in its place.
pub fn parse(text: &str) -> Samples<'_> {
    Samples {
        lines: text.lines().enumerate(),
    }
}

/// Iterator returned by [`parse`].
#[derive(Clone, Debug)]
pub struct Samples<'a> {
    lines: std::iter::Enumerate<std::str::Lines<'a>>,
}

impl<'a> Iterator for Samples<'a> {
    type Item = Result<Sample<'a>, ParseError>;

    fn next(&mut self) -> Option<Self::Item> {
        for (i, line) in self.lines.by_ref() {
            let line = line.trim_matches(is_blank);
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            return Some(parse_line(line).map_err(|kind| ParseError { line: i + 1, kind }));
        }
        None
    }
}

fn is_blank(c: char) -> bool {
    c == ' ' || c == '\t'
}

fn parse_line(line: &str) -> Result<Sample<'_>, ErrorKind> {
    let name_len = line
        .find(|c: char| c == '{' || is_blank(c))
        .unwrap_or(line.len());
    let (name, rest) = line.split_at(name_len);
    if !valid_name(name, true) {
        return Err(ErrorKind::Name);
    }
    let rest = rest.trim_start_matches(is_blank);
    let (raw_labels, rest) = match rest.strip_prefix('{') {
        Some(inner) => split_labels(inner)?,
        None => ("", rest),
    };
    let mut fields = rest.split(is_blank).filter(|f| !f.is_empty());
    let value = fields
        .next()
        .and_then(parse_value)
        .ok_or(ErrorKind::Value)?;
    let timestamp_ms = match fields.next() {
        Some(t) => Some(t.parse::<i64>().map_err(|_| ErrorKind::Timestamp)?),
        None => None,
    };
    if fields.next().is_some() {
        return Err(ErrorKind::Trailing);
    }
    Ok(Sample {
        name,
        raw_labels,
        value,
        timestamp_ms,
    })
}

/// Splits `k="v",...} rest` (the `{` consumed) into the label text and what follows `}`,
/// checking every label on the way: a `}` inside a quoted value does not end the set.
fn split_labels(inner: &str) -> Result<(&str, &str), ErrorKind> {
    let mut rest = inner;
    while let Some((_, _, tail)) = next_label(rest)? {
        rest = tail;
    }
    let close = inner.len() - rest.len();
    let after = rest
        .trim_start_matches(is_blank)
        .strip_prefix('}')
        .ok_or(ErrorKind::Labels)?;
    Ok((&inner[..close], after))
}

/// Reads one `key="raw value"` and the separator after it. `Ok(None)` at the closing brace
/// or at the end of the text; the remainder starts after the separating comma.
fn next_label(s: &str) -> Result<Option<(&str, &str, &str)>, ErrorKind> {
    let s = s.trim_start_matches(is_blank);
    if s.is_empty() || s.starts_with('}') {
        return Ok(None);
    }
    let (key, after_key) = s.split_once('=').ok_or(ErrorKind::Labels)?;
    let key = key.trim_end_matches(is_blank);
    if !valid_name(key, false) {
        return Err(ErrorKind::Labels);
    }
    let quoted = after_key
        .trim_start_matches(is_blank)
        .strip_prefix('"')
        .ok_or(ErrorKind::Labels)?;
    let end = closing_quote(quoted)?;
    let raw = &quoted[..end];
    let tail = quoted[end + 1..].trim_start_matches(is_blank);
    // The last label ends at the brace, or at the end of a sample's stored label text.
    let rest = match tail.strip_prefix(',') {
        Some(r) => r,
        None if tail.is_empty() || tail.starts_with('}') => tail,
        None => return Err(ErrorKind::Labels),
    };
    Ok(Some((key, raw, rest)))
}

/// Byte offset of the quote that ends a label value; only `\\`, `\"` and `\n` are escapes.
fn closing_quote(s: &str) -> Result<usize, ErrorKind> {
    let mut bytes = s.bytes().enumerate();
    while let Some((i, b)) = bytes.next() {
        match b {
            b'"' => return Ok(i),
            b'\\' => match bytes.next() {
                Some((_, b'\\' | b'"' | b'n')) => {}
                Some(_) => return Err(ErrorKind::Escape),
                None => return Err(ErrorKind::Labels),
            },
            _ => {}
        }
    }
    Err(ErrorKind::Labels)
}

fn decode(raw: &str) -> Cow<'_, str> {
    if !raw.contains('\\') {
        return Cow::Borrowed(raw);
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some(other) => out.push(other),
            None => {}
        }
    }
    Cow::Owned(out)
}

/// `[a-zA-Z_:][a-zA-Z0-9_:]*` for metric names; label names exclude `:`.
fn valid_name(name: &str, colon: bool) -> bool {
    let ok = |c: u8, first: bool| {
        c.is_ascii_alphabetic()
            || c == b'_'
            || (colon && c == b':')
            || (!first && c.is_ascii_digit())
    };
    let mut bytes = name.bytes();
    bytes.next().is_some_and(|c| ok(c, true)) && bytes.all(|c| ok(c, false))
}

/// Go's `ParseFloat` spellings the format allows: decimals, exponents, `±Inf`, `NaN`.
fn parse_value(v: &str) -> Option<f64> {
    match v {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        // Rust also reads "inf", "infinity" and "nan" in any case, which Go accepts as well.
        v => v.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn one(line: &str) -> Result<Sample<'_>, ErrorKind> {
        parse(line).next().unwrap().map_err(|e| e.kind)
    }

    fn labels<'a>(s: &Sample<'a>) -> Vec<(&'a str, String)> {
        s.labels().map(|(k, v)| (k, v.into_owned())).collect()
    }

    #[test]
    fn parses_escapes_special_values_and_bare_names() {
        let page = "a{x=\"q\\\"uo\\\\te\\n\", y = \"2\" ,} +Inf 1700000000\nb 7\nc{} NaN\n\
                    d{x=\"unterminated} 1\n";
        let (s, bad): (Vec<_>, Vec<_>) = parse(page).partition(Result::is_ok);
        let s: Vec<Sample> = s.into_iter().map(Result::unwrap).collect();
        assert_eq!(bad.len(), 1);
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].label("x").as_deref(), Some("q\"uo\\te\n"));
        assert_eq!(s[0].label("y").as_deref(), Some("2"));
        assert_eq!(s[0].value, f64::INFINITY);
        assert_eq!(s[0].timestamp_ms, Some(1_700_000_000));
        assert_eq!((s[1].name, s[1].value), ("b", 7.0));
        assert!(s[2].value.is_nan());
    }

    #[test]
    fn comments_and_blank_lines_yield_nothing_and_errors_carry_line_numbers() {
        let page = "# HELP x a help text {with} \"quotes\"\n\n   \n# TYPE x gauge\n\
                    x 1\n  \t x{a=\"b\"}\t2\t\nnot a sample\n";
        let all: Vec<_> = parse(page).collect();
        assert_eq!(all.len(), 3);
        assert_eq!(all[0].as_ref().unwrap().value, 1.0);
        let second = all[1].as_ref().unwrap();
        assert_eq!((second.name, second.value), ("x", 2.0));
        assert_eq!(second.label("a").as_deref(), Some("b"));
        assert_eq!(
            all[2],
            Err(ParseError {
                line: 7,
                kind: ErrorKind::Value
            })
        );
    }

    #[test]
    fn values_in_every_spelling_the_format_allows() {
        for (text, want) in [
            ("1", 1.0),
            ("-2.5", -2.5),
            ("1.5e3", 1500.0),
            ("6.02E-3", 0.00602),
            ("+Inf", f64::INFINITY),
            ("Inf", f64::INFINITY),
            ("-Inf", f64::NEG_INFINITY),
        ] {
            assert_eq!(one(&format!("m {text}")).unwrap().value, want, "{text}");
        }
        assert!(one("m NaN").unwrap().value.is_nan());
        assert_eq!(one("m").unwrap_err(), ErrorKind::Value);
        assert_eq!(one("m{} ").unwrap_err(), ErrorKind::Value);
        assert_eq!(one("m one").unwrap_err(), ErrorKind::Value);
    }

    #[test]
    fn timestamps_are_integer_milliseconds() {
        assert_eq!(one("m 1 -5").unwrap().timestamp_ms, Some(-5));
        assert_eq!(one("m 1").unwrap().timestamp_ms, None);
        assert_eq!(one("m 1 1.5").unwrap_err(), ErrorKind::Timestamp);
        assert_eq!(one("m 1 2 3").unwrap_err(), ErrorKind::Trailing);
    }

    #[test]
    fn label_sets_keep_quoted_braces_commas_and_utf8() {
        let s = one(r#"m {a="x}y",b="1,2", c="é\\"} 3"#).unwrap();
        assert_eq!(s.name, "m");
        assert_eq!(
            labels(&s),
            vec![
                ("a", "x}y".to_owned()),
                ("b", "1,2".to_owned()),
                ("c", "é\\".to_owned())
            ]
        );
        assert_eq!(s.value, 3.0);
        assert!(matches!(s.label("a"), Some(Cow::Borrowed("x}y"))));
        assert!(matches!(s.label("c"), Some(Cow::Owned(_))));
        assert_eq!(s.label("missing"), None);
        assert_eq!(labels(&one("m{} 1").unwrap()), vec![]);
    }

    #[test]
    fn malformed_lines_say_what_is_wrong() {
        for (line, kind) in [
            ("9m 1", ErrorKind::Name),
            ("{a=\"b\"} 1", ErrorKind::Name),
            ("m-x 1", ErrorKind::Name),
            ("m{a=\"b\" 1", ErrorKind::Labels),
            ("m{a=b} 1", ErrorKind::Labels),
            ("m{a=\"b\" c=\"d\"} 1", ErrorKind::Labels),
            ("m{a:b=\"c\"} 1", ErrorKind::Labels),
            ("m{=\"c\"} 1", ErrorKind::Labels),
            ("m{a=\"b\\", ErrorKind::Labels),
            ("m{a=\"\\t\"} 1", ErrorKind::Escape),
            ("m{a=\"b\"}} 1", ErrorKind::Value),
        ] {
            assert_eq!(one(line).unwrap_err(), kind, "{line}");
        }
    }

    /// A well-formed line from random parts, then, half the time, a random byte-level edit
    /// (a character inserted or one removed), so that both the sample path and every error
    /// path are reached.
    fn random_line(rng: &mut impl rand::Rng) -> String {
        let pick = |rng: &mut dyn rand::RngCore, xs: &[&'static str]| {
            xs[rand::Rng::gen_range(rng, 0..xs.len())]
        };
        let mut line = pick(rng, &["m", "a_b:c", "vllm:x_total", "_"]).to_owned();
        if rng.gen_bool(0.7) {
            let n = rng.gen_range(0..3);
            let labels: Vec<String> = (0..n)
                .map(|i| {
                    let v = pick(
                        rng,
                        &["", "0", "x}y", "1,2", "é", "q\\\"t", "a\\nb", "\\\\"],
                    );
                    format!("k{i}=\"{v}\"")
                })
                .collect();
            line += &format!("{{{}}}", labels.join(","));
        }
        line += pick(rng, &[" ", "\t", "  "]);
        line += pick(rng, &["1", "-2.5e3", "+Inf", "-Inf", "NaN", "0.25"]);
        if rng.gen_bool(0.3) {
            line += " 1700000000";
        }
        if rng.gen_bool(0.5) && !line.is_empty() {
            let chars: Vec<char> = line.chars().collect();
            let at = rng.gen_range(0..chars.len());
            let mut edited: String = chars[..at].iter().collect();
            if rng.gen_bool(0.5) {
                edited.push(['{', '}', '"', '\\', ',', '=', ' ', '#', 'é'][rng.gen_range(0..9)]);
                edited.extend(&chars[at..]);
            } else {
                edited.extend(&chars[at + 1..]);
            }
            line = edited;
        }
        line
    }

    #[test]
    fn never_panics_on_arbitrary_text() {
        use rand::SeedableRng;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let (mut samples, mut errors) = (0, 0);
        for _ in 0..20_000 {
            let page = random_line(&mut rng) + "\n" + &random_line(&mut rng);
            for item in parse(&page) {
                let Ok(sample) = item else {
                    errors += 1;
                    continue;
                };
                // Whatever parsed, its labels can be walked and looked up again.
                for (k, v) in sample.labels() {
                    assert!(sample.label(k).is_some(), "{page:?}: {k}={v}");
                }
                samples += 1;
            }
        }
        assert!(
            errors > 100,
            "the generator reached the error paths {errors} times"
        );
        assert!(
            samples > 100,
            "the generator reached the sample path {samples} times"
        );
    }
}
