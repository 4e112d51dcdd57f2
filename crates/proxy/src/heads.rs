//! Headers as the router's HTTP/1.1 paths carry them, without building `http` header maps:
//! a message's headers as its head brought them ([`Headers::Raw`]: the head's bytes and where
//! each header lies in them) or as hyper's map, and a response's headers already in wire form
//! for the client ([`WireHeaders`]).
//!
//! Why: the router forwards headers it does not read. It built a map for each head, cloned the
//! client's for the replica and wrote both out again. Carried as bytes instead (with the ports'
//! own request and response types, `h1::Req` and `h1::Answer`, and the idle pool's cheaper
//! key), a request costs the data plane 9.2 % fewer instructions on the developers' workload
//! and 5.9 % fewer on chat, and the router 5.2 % and 4.1 % less CPU (BENCHMARKS.md,
//! "2026-12-07, afternoon").
//!
//! Invariants: a raw head's places lie inside its bytes (they come from `httparse`, which also
//! checked every name and value, so each is one an `http` map would take); names keep the case
//! they were sent in, so every comparison of a name here is case-insensitive.

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// Where a header's name and value lie in its head's bytes.
pub(crate) type Place = ((usize, usize), (usize, usize));

/// A message's headers, in the order they were sent.
#[derive(Debug)]
pub(crate) enum Headers {
    /// As an HTTP/1.1 head brought them: its bytes and the places of its headers.
    Raw { bytes: Bytes, at: Vec<Place> },
    /// hyper's map (HTTP/2, and the requests hyper serves).
    Map(HeaderMap),
}

impl Headers {
    /// The headers as a map (a raw head's made into one; none is left out, `httparse`
    /// having checked them as a map would).
    pub fn into_map(self) -> HeaderMap {
        match self {
            Headers::Map(m) => m,
            Headers::Raw { .. } => {
                let mut m = HeaderMap::with_capacity(self.count());
                for (n, v) in self.iter() {
                    if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(n), HeaderValue::from_bytes(v))
                    {
                        m.append(n, v);
                    }
                }
                m
            }
        }
    }

    /// Each header's name (as sent) and value, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        let (raw, map) = match self {
            Headers::Raw { bytes, at } => (Some((bytes, at)), None),
            Headers::Map(m) => (None, Some(m)),
        };
        let raw = raw.into_iter().flat_map(|(bytes, at)| {
            at.iter()
                .filter_map(|&((n0, n1), (v0, v1))| Some((bytes.get(n0..n1)?, bytes.get(v0..v1)?)))
        });
        let map = map
            .into_iter()
            .flat_map(|m| m.iter().map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes())));
        raw.chain(map)
    }

    /// The first value of `name` (any case).
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v)
    }

    /// How many headers (each value of a repeated one counted).
    pub fn count(&self) -> usize {
        match self {
            Headers::Raw { at, .. } => at.len(),
            Headers::Map(m) => m.len(),
        }
    }

    /// Room enough for the headers in wire form: a raw head's bytes (its first line and end
    /// included), else each `name: value` line.
    pub fn wire_len(&self) -> usize {
        match self {
            Headers::Raw { bytes, .. } => bytes.len(),
            Headers::Map(m) => m.iter().map(|(n, v)| n.as_str().len() + v.len() + 4).sum(),
        }
    }
}

/// One header's first value by name (any case), from whichever form a caller holds.
pub(crate) trait HeaderLookup {
    fn header(&self, name: &str) -> Option<&[u8]>;
}

impl HeaderLookup for Headers {
    fn header(&self, name: &str) -> Option<&[u8]> {
        self.get(name)
    }
}

impl HeaderLookup for HeaderMap {
    fn header(&self, name: &str) -> Option<&[u8]> {
        self.get(name).map(HeaderValue::as_bytes)
    }
}

#[cfg(test)]
impl Headers {
    /// Raw headers as a head with these `name: value` lines brings them (for tests).
    pub fn from_lines(lines: &[&str]) -> Headers {
        let mut bytes = b"HTTP/1.1 200 OK\r\n".to_vec();
        let mut at = Vec::new();
        for line in lines {
            let colon = line.find(':').unwrap_or(line.len());
            let (name, value) = (&line[..colon], line[colon..].trim_start_matches(':').trim());
            let n0 = bytes.len();
            bytes.extend_from_slice(name.as_bytes());
            let n1 = bytes.len();
            bytes.extend_from_slice(b": ");
            let v0 = bytes.len();
            bytes.extend_from_slice(value.as_bytes());
            at.push(((n0, n1), (v0, bytes.len())));
            bytes.extend_from_slice(b"\r\n");
        }
        bytes.extend_from_slice(b"\r\n");
        Headers::Raw {
            bytes: Bytes::from(bytes),
            at,
        }
    }
}

/// A response's headers already in wire form: a replica's end-to-end headers go to the client
/// without being made into a map on the way. The data port's HTTP/1.1 path writes them as
/// they are; hyper's path turns them back into a map first ([`WireHeaders::into_map`]).
#[derive(Debug, Default)]
pub(crate) struct WireHeaders {
    /// `name: value\r\n` lines, none of them `Content-Length`, `Transfer-Encoding` or
    /// `Connection` (the writer frames the body and says whether the connection closes).
    pub lines: Vec<u8>,
    /// The `Content-Length` the response declared.
    pub content_length: Option<u64>,
    /// Whether a `Date` is among the lines.
    pub dated: bool,
}

impl WireHeaders {
    /// Room for `bytes` of lines, so that appending them does not grow the buffer step by step.
    pub fn with_capacity(bytes: usize) -> Self {
        WireHeaders {
            lines: Vec::with_capacity(bytes),
            ..WireHeaders::default()
        }
    }

    /// Appends one header line.
    pub fn push(&mut self, name: &[u8], value: &[u8]) {
        self.lines.extend_from_slice(name);
        self.lines.extend_from_slice(b": ");
        self.lines.extend_from_slice(value);
        self.lines.extend_from_slice(b"\r\n");
    }

    /// Appends the headers to `map` (a line that is not a valid header is left out, as
    /// neither HTTP path could send it).
    pub fn into_map(self, map: &mut HeaderMap) {
        for line in self.lines.split(|&b| b == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let Some(colon) = memchr::memchr(b':', line) else {
                continue;
            };
            let (name, value) = (&line[..colon], line[colon + 1..].trim_ascii_start());
            if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value)) {
                map.append(n, v);
            }
        }
        if let Some(n) = self.content_length {
            map.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// Wire-form headers become the same headers in a map, in order, with the declared
    /// length; a line no map could hold is left out.
    #[test]
    fn wire_headers_turn_back_into_a_map() {
        let mut wire = WireHeaders {
            content_length: Some(12),
            ..WireHeaders::default()
        };
        wire.push(b"Content-Type", b"text/plain");
        wire.push(b"x-a", b"1:2");
        wire.push(b"x-a", b"");
        wire.push(b"bad name", b"x");
        let mut map = HeaderMap::new();
        wire.into_map(&mut map);
        let got: Vec<(&str, &[u8])> = map
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_bytes()))
            .collect();
        assert_eq!(
            got,
            [
                ("content-type", &b"text/plain"[..]),
                ("x-a", b"1:2"),
                ("x-a", b""),
                ("content-length", b"12"),
            ]
        );
    }

    /// A raw head and a map of the same headers read alike (names as sent, any case found).
    #[test]
    fn raw_and_mapped_headers_read_alike() {
        let raw = Headers::from_lines(&["X-A: 1", "x-b: 2", "x-a: 3"]);
        let mut map = HeaderMap::new();
        for (n, v) in [("x-a", "1"), ("x-b", "2"), ("x-a", "3")] {
            map.append(n, HeaderValue::from_static(v));
        }
        let map = Headers::Map(map);
        for h in [&raw, &map] {
            assert_eq!(h.get("x-a"), Some(&b"1"[..]));
            assert_eq!(h.get("X-B"), Some(&b"2"[..]));
            assert_eq!(h.get("x-c"), None);
            assert_eq!(h.count(), 3);
        }
        // In order as sent; a map keeps a name's values together.
        let values = |h: &Headers| h.iter().map(|(_, v)| v.to_vec()).collect::<Vec<_>>();
        assert_eq!(values(&raw), [b"1", b"2", b"3"]);
        assert_eq!(values(&map), [b"1", b"3", b"2"]);
        assert_eq!(raw.iter().next().map(|(n, _)| n), Some(&b"X-A"[..]));
        // Made into a map, a raw head's headers are the map's.
        let Headers::Map(m) = map else { unreachable!() };
        assert_eq!(raw.into_map(), m);
    }
}
