//! Finds `"cached_tokens": N` in a response body as it streams past, without holding the body
//! back: each chunk is scanned after it has been handed on, and only a short tail is kept so
//! that a key split across two chunks is still found.
//!
//! Invariant: the scanner never buffers more than [`TAIL`] bytes, and the value it reports is
//! the last complete occurrence seen (vLLM's usage object appears once, in the last chunk or in
//! the whole JSON body).

use std::sync::LazyLock;

use memchr::memmem;

const KEY: &[u8] = b"\"cached_tokens\"";
/// Enough for the key, whitespace, a colon and a 20-digit number.
const TAIL: usize = 64;

/// The scanner state of one response.
#[derive(Debug, Default)]
pub(crate) struct UsageScanner {
    tail: Vec<u8>,
    found: Option<u64>,
}

impl UsageScanner {
    /// The last `cached_tokens` value seen so far.
    pub fn cached_tokens(&self) -> Option<u64> {
        self.found
    }

    /// Scans one chunk. Matches that start in the kept tail are found by scanning the tail
    /// joined to the head of this chunk; a number that runs to the end of a scanned buffer is
    /// left for the next call (the tail keeps its key).
    pub fn feed(&mut self, chunk: &[u8]) {
        if chunk.is_empty() {
            return;
        }
        let mut tail = std::mem::take(&mut self.tail);
        if !tail.is_empty() {
            let old = tail.len();
            tail.extend_from_slice(&chunk[..chunk.len().min(TAIL)]);
            self.scan(&tail);
            tail.truncate(old);
        }
        self.scan(chunk);
        if chunk.len() >= TAIL {
            tail.clear();
            tail.extend_from_slice(&chunk[chunk.len() - TAIL..]);
        } else {
            tail.extend_from_slice(chunk);
            let excess = tail.len().saturating_sub(TAIL);
            tail.drain(..excess);
        }
        self.tail = tail;
    }

    /// Records every complete `key: digits` in `buf`, in order.
    fn scan(&mut self, buf: &[u8]) {
        let mut from = 0;
        while let Some(pos) = find_key(&buf[from..]) {
            let mut i = from + pos + KEY.len();
            from = i;
            i = skip_ws(buf, i);
            if buf.get(i) != Some(&b':') {
                continue;
            }
            i = skip_ws(buf, i + 1);
            let digits = i;
            while buf.get(i).is_some_and(u8::is_ascii_digit) {
                i += 1;
            }
            // No digits (null), or digits that may go on past the end of this buffer.
            if i == digits || i == buf.len() {
                continue;
            }
            let parsed = std::str::from_utf8(&buf[digits..i])
                .ok()
                .and_then(|t| t.parse().ok());
            if let Some(n) = parsed {
                self.found = Some(n);
            }
        }
    }
}

fn skip_ws(buf: &[u8], mut i: usize) -> usize {
    while buf
        .get(i)
        .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
    {
        i += 1;
    }
    i
}

/// The key's searcher, built once (SIMD where the CPU has it): every byte of every response
/// passes through [`UsageScanner::scan`].
static FINDER: LazyLock<memmem::Finder<'static>> = LazyLock::new(|| memmem::Finder::new(KEY));

fn find_key(hay: &[u8]) -> Option<usize> {
    FINDER.find(hay)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan_split(body: &[u8], cut: usize) -> Option<u64> {
        let mut s = UsageScanner::default();
        for c in body.chunks(cut) {
            s.feed(c);
        }
        s.cached_tokens()
    }

    #[test]
    fn finds_the_value_wherever_chunks_are_cut() {
        let body = br#"data: {"id":"x","choices":[]}

data: {"usage":{"prompt_tokens":300,"prompt_tokens_details":{"cached_tokens": 256}},"x":1}

data: [DONE]

"#;
        for cut in 1..body.len() {
            assert_eq!(scan_split(body, cut), Some(256), "cut every {cut} bytes");
        }
    }

    #[test]
    fn long_chunks_and_absent_values() {
        let mut big = vec![b'x'; 10_000];
        big.extend_from_slice(br#"{"cached_tokens":12}"#);
        big.extend(vec![b'y'; 10_000]);
        assert_eq!(scan_split(&big, 4096), Some(12));
        assert_eq!(scan_split(&big, big.len()), Some(12));
        assert_eq!(scan_split(br#"{"prompt_tokens_details":null}"#, 5), None);
        assert_eq!(scan_split(br#"{"cached_tokens":null}"#, 3), None);
    }

    /// The searcher against the plain definition, on generated bodies full of near misses
    /// (pieces of the key, the key cut short, whole keys), from every start offset.
    #[test]
    fn the_key_search_matches_a_naive_one() {
        let pieces: [&[u8]; 6] = [
            b"\"cached_tokens\"",
            b"\"cached_",
            b"tokens\"",
            b"\"",
            b"x",
            b"\"cached_tokens",
        ];
        let mut next = kinference_testkit::xorshift(0x9e37_79b9_7f4a_7c15);
        for _ in 0..2_000 {
            let mut hay = Vec::new();
            for _ in 0..next() % 40 {
                hay.extend_from_slice(pieces[(next() % pieces.len() as u64) as usize]);
            }
            for from in 0..=hay.len() {
                let naive = hay[from..].windows(KEY.len()).position(|w| w == KEY);
                assert_eq!(
                    find_key(&hay[from..]),
                    naive,
                    "{:?}",
                    String::from_utf8_lossy(&hay)
                );
            }
        }
    }

    #[test]
    fn the_last_occurrence_wins() {
        let body = br#"{"cached_tokens":1} {"cached_tokens":77}"#;
        for cut in 1..body.len() {
            assert_eq!(scan_split(body, cut), Some(77), "cut every {cut} bytes");
        }
    }
}
