//! A first, fast reading of a request body's JSON: the punctuation and the strings that are
//! most of a chat request's bytes (keys, roles, message texts, a text prompt) are read here;
//! every other value is read by serde_json from where it starts, as the field's own type.
//!
//! Why: serde_json finds a string's end eight bytes at a time and starts over after every
//! escape; chat text has an escape every hundred-odd bytes, and that scan was the largest
//! single part of the router's instructions per request. Here a string's end is found with
//! `memchr` (SIMD, chosen at run time). Control characters, which a string must not hold, are
//! looked for once in the whole body (a loop the compiler vectorises), and string by string
//! only in a body that has some (pretty-printed JSON's newlines and tabs).
//!
//! Invariants: the walker only ever answers what serde_json would have answered, or nothing.
//! Anything it does not read itself the way serde_json does (a surrogate pair, an unknown
//! escape, a control character, a repeated field, a missing one, a value of the wrong kind, a
//! struct written as an array, bytes after the body, a body that opens enough arrays and
//! objects to reach serde_json's nesting limit) makes it answer `None`, and the caller parses
//! the body with serde_json from the start, so errors and rare forms are serde_json's. It
//! never panics and never reads past the text.

use std::borrow::Cow;

use serde::Deserialize;

/// serde_json's nesting limit: arrays and objects 128 deep are refused.
const NESTING_LIMIT: usize = 128;

/// A position in a body known to be valid UTF-8.
pub(crate) struct Walker<'a> {
    text: &'a str,
    at: usize,
    /// Whether the body has a byte below 0x20 anywhere.
    controls: bool,
    /// Whether the body opens enough arrays and objects to reach serde_json's nesting limit,
    /// once a value that opens one is read.
    deep: Option<bool>,
}

impl<'a> Walker<'a> {
    pub(crate) fn new(text: &'a str) -> Self {
        let controls = text.as_bytes().iter().fold(0xffu8, |m, &c| m.min(c)) < 0x20;
        Walker {
            text,
            at: 0,
            controls,
            deep: None,
        }
    }

    fn bytes(&self) -> &'a [u8] {
        self.text.as_bytes()
    }

    /// JSON's whitespace (space, tab, newline, carriage return), then the next byte.
    pub(crate) fn peek(&mut self) -> Option<u8> {
        let b = self.bytes();
        while let Some(&c) = b.get(self.at) {
            if !matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
                return Some(c);
            }
            self.at += 1;
        }
        None
    }

    /// Consumes `c` after whitespace.
    fn eat(&mut self, c: u8) -> Option<()> {
        (self.peek()? == c).then(|| self.at += 1)
    }

    /// Whether only whitespace is left.
    pub(crate) fn at_end(&mut self) -> bool {
        self.peek().is_none()
    }

    /// A string value: borrowed from the body when it has no escapes.
    pub(crate) fn string(&mut self) -> Option<Cow<'a, str>> {
        self.eat(b'"')?;
        let text = self.text;
        let b = self.bytes();
        let mut owned: Option<String> = None;
        let mut from = self.at;
        loop {
            let rest = b.get(from..)?;
            let stop = from + memchr::memchr2(b'"', b'\\', rest)?;
            let run = b.get(from..stop)?;
            // Control characters must be escaped (serde_json refuses them; so does Python's
            // json in its default strict mode).
            if self.controls && run.iter().fold(0xffu8, |m, &c| m.min(c)) < 0x20 {
                return None;
            }
            if b.get(stop) == Some(&b'"') {
                self.at = stop + 1;
                // Both ends are ASCII bytes, so both are character boundaries.
                let run = text.get(from..stop)?;
                return Some(match owned {
                    None => Cow::Borrowed(run),
                    Some(mut s) => {
                        s.push_str(run);
                        Cow::Owned(s)
                    }
                });
            }
            let s = owned.get_or_insert_with(|| String::with_capacity(rest.len().min(1024)));
            s.push_str(text.get(from..stop)?);
            let (c, len) = escape(b.get(stop + 1..)?)?;
            s.push(c);
            from = stop + 1 + len;
        }
    }

    /// One value of type `T`, read by serde_json from here (its whitespace included).
    ///
    /// serde_json refuses a body nested 128 deep, counted from the body's top; a value read
    /// here on its own would count from itself. So an array or object is read here only in a
    /// body with fewer than [`NESTING_LIMIT`] `[` and `{` bytes in all, where neither count can
    /// reach the limit.
    pub(crate) fn value<T: Deserialize<'a>>(&mut self) -> Option<T> {
        if matches!(self.peek()?, b'[' | b'{') {
            let text = self.text;
            let deep = *self.deep.get_or_insert_with(|| {
                memchr::memchr2_iter(b'[', b'{', text.as_bytes())
                    .nth(NESTING_LIMIT - 1)
                    .is_some()
            });
            if deep {
                return None;
            }
        }
        let rest = self.text.get(self.at..)?;
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<T>();
        let v = values.next()?.ok()?;
        self.at += values.byte_offset();
        Some(v)
    }

    /// An object: `field` reads each member's value given its key; `None` from it stops the
    /// walk.
    pub(crate) fn object(
        &mut self,
        mut field: impl FnMut(&mut Self, Cow<'a, str>) -> Option<()>,
    ) -> Option<()> {
        self.list(b'{', b'}', |w| {
            let key = w.string()?;
            w.eat(b':')?;
            field(w, key)
        })
    }

    /// An array: `item` reads each element.
    pub(crate) fn array(&mut self, item: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.list(b'[', b']', item)
    }

    /// `open`, items separated by commas, `close`.
    fn list(
        &mut self,
        open: u8,
        close: u8,
        mut item: impl FnMut(&mut Self) -> Option<()>,
    ) -> Option<()> {
        self.eat(open)?;
        if self.peek()? == close {
            self.at += 1;
            return Some(());
        }
        loop {
            item(self)?;
            match self.peek()? {
                b',' => self.at += 1,
                c if c == close => {
                    self.at += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }
}

/// The character of the escape after a backslash, and how many bytes it took. A `\u` escape
/// of a surrogate (half of a pair, or a lone one, which serde_json refuses) is left to
/// serde_json.
fn escape(b: &[u8]) -> Option<(char, usize)> {
    Some(match *b.first()? {
        b'"' => ('"', 1),
        b'\\' => ('\\', 1),
        b'/' => ('/', 1),
        b'b' => ('\u{8}', 1),
        b'f' => ('\u{c}', 1),
        b'n' => ('\n', 1),
        b'r' => ('\r', 1),
        b't' => ('\t', 1),
        b'u' => {
            let mut n = 0u32;
            for &h in b.get(1..5)? {
                n = n * 16 + char::from(h).to_digit(16)?;
            }
            // `char::from_u32` refuses exactly the surrogates.
            (char::from_u32(n)?, 5)
        }
        _ => return None,
    })
}

/// Which of a struct's fields have been read, so that a repeated one (which serde's derived
/// readers refuse) stops the walk.
#[derive(Default)]
pub(crate) struct Seen(u32);

impl Seen {
    /// Marks field `i`; `None` if it was read before.
    pub(crate) fn first(&mut self, i: u32) -> Option<()> {
        let bit = 1u32.checked_shl(i)?;
        (self.0 & bit == 0).then(|| self.0 |= bit)
    }

    pub(crate) fn has(&self, i: u32) -> bool {
        1u32.checked_shl(i).is_some_and(|bit| self.0 & bit != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string(json: &str) -> Option<Cow<'_, str>> {
        let mut w = Walker::new(json);
        let s = w.string()?;
        w.at_end().then_some(s)
    }

    /// Strings read as serde_json reads them, or not at all: hand-picked, then seeded random
    /// strings of escapes, control characters, quotes, surrogates and multi-byte text.
    #[test]
    fn strings_are_serde_jsons_or_nothing() {
        use rand::{Rng, SeedableRng};
        let check = |json: &str| -> bool {
            let reference = serde_json::from_str::<String>(json).ok();
            match string(json) {
                Some(ours) => {
                    assert_eq!(Some(ours.as_ref()), reference.as_deref(), "{json:?}");
                    true
                }
                None => false,
            }
        };
        assert_eq!(string(r#""plain é""#), Some(Cow::Borrowed("plain é")));
        assert!(matches!(string(r#""a\nb""#), Some(Cow::Owned(s)) if s == "a\nb"));
        for (json, read) in [
            (r#""""#, true),
            (r#""\"\\\/\b\f\n\r\t""#, true),
            (r#""\u00e9\u00E9\u20ac""#, true),
            (r#""\ud83d\ude00""#, false),
            (r#""\ud83d""#, false),
            (r#""\ude00""#, false),
            (r#""\u00g0""#, false),
            (r#""\u00e""#, false),
            (r#""\x""#, false),
            ("\"tab\there\"", false),
            ("\"nul\u{0}\"", false),
            (r#""unclosed"#, false),
            (r#""trailing\"#, false),
        ] {
            assert_eq!(check(json), read, "{json:?}");
        }
        let pieces = [
            "a",
            "é",
            "😀",
            " ",
            "\\n",
            "\\\"",
            "\\\\",
            "\\/",
            "\\t",
            "\\u0041",
            "\\u00e9",
            "\\uD83D\\uDE00",
            "\\ud800",
            "\\u12",
            "\\q",
            "\t",
            "\u{1}",
            "\u{7f}",
            "\\",
            "\"",
        ];
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(29);
        let mut read = 0;
        for _ in 0..50_000 {
            let n = r.gen_range(0..12);
            let body: String = (0..n)
                .map(|_| pieces[r.gen_range(0..pieces.len())])
                .collect();
            read += usize::from(check(&format!("\"{body}\"")));
        }
        assert!((5_000..45_000).contains(&read), "{read}");
    }

    #[test]
    fn values_are_read_by_serde_json_up_to_their_end() {
        let mut w = Walker::new(r#" [1, {"a": "b"}] , 2.5e3}"#);
        let v: Option<crate::Json> = w.value();
        assert_eq!(
            v.map(|v| v.to_string()).as_deref(),
            Some(r#"[1,{"a":"b"}]"#)
        );
        assert_eq!(w.peek(), Some(b','));
        w.at += 1;
        assert_eq!(w.value::<f64>(), Some(2500.0));
        assert_eq!(w.peek(), Some(b'}'));
        // A number must end where a value can end.
        assert_eq!(Walker::new("12x").value::<u32>(), None);
        assert_eq!(Walker::new("").value::<u32>(), None);
    }

    /// A value nested near serde_json's limit is refused or read as the whole body's parse
    /// does: the walker leaves bodies that open that many arrays and objects to serde_json.
    #[test]
    fn nesting_is_counted_from_the_bodys_top() {
        let mut walker_read = 0;
        for k in 118..132 {
            let deep = format!("{}1{}", "[".repeat(k), "]".repeat(k));
            let body = format!(r#"{{"messages": [{{"role": "user", "task": {deep}}}]}}"#);
            let ours = crate::ChatRequest::from_json(body.as_bytes()).ok();
            let reference = crate::ChatRequest::from_json_reference(body.as_bytes()).ok();
            assert_eq!(format!("{ours:?}"), format!("{reference:?}"), "{k}");
            let mut w = Walker::new(&body);
            w.at = body.find("[[").unwrap_or(0);
            walker_read += usize::from(w.value::<crate::Json>().is_some());
        }
        // The body's own object, list and message open three: k = 118..=124 is read here.
        assert_eq!(walker_read, 7);
    }

    #[test]
    fn repeated_fields_are_caught() {
        let mut seen = Seen::default();
        assert!(seen.first(3).is_some());
        assert!(seen.has(3) && !seen.has(2));
        assert!(seen.first(3).is_none());
        assert!(seen.first(40).is_none());
    }
}
