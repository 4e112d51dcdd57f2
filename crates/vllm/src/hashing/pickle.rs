//! A pickle protocol 5 writer for the narrow value subset vLLM hashes: tuples, ints, `str`,
//! `bytes` and `None`, byte for byte as CPython 3.11's C pickler (`pickle.dumps(obj, protocol=5)`)
//! writes them.
//!
//! Invariants reproduced here, each one visible in the hash input:
//! - `PROTO 5` sits outside any frame; everything after it, `STOP` included, is framed. A frame
//!   is closed at the start of saving any object once it holds ≥ 64 KiB, and a frame under
//!   4 bytes gets no `FRAME` header.
//! - A `str`/`bytes` payload of ≥ 64 KiB closes the current frame and is written unframed.
//! - `str`, `bytes` and non-empty tuples are memoised (`MEMOIZE`); ints and `None` are not.
//!   A second save of the *same object* is a memo reference (`BINGET`/`LONG_BINGET`). Identity is
//!   the caller's business: see [`Shared`].
//! - Ints use the narrowest of `BININT1`, `BININT2`, `BININT` and `LONG1`.

/// Opcodes (names as in CPython's `pickle.py`).
const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const STOP: u8 = b'.';
const MARK: u8 = b'(';
const NONE: u8 = b'N';
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const LONG1: u8 = 0x8a;
const SHORT_BINBYTES: u8 = b'C';
const BINBYTES: u8 = b'B';
const BINBYTES8: u8 = 0x8e;
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = b'X';
const BINUNICODE8: u8 = 0x8d;
const EMPTY_TUPLE: u8 = b')';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const MEMOIZE: u8 = 0x94;
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';

/// CPython's `_FRAME_SIZE_TARGET` and `_FRAME_SIZE_MIN`.
const FRAME_SIZE_TARGET: usize = 64 * 1024;
const FRAME_SIZE_MIN: usize = 4;
const FRAME_HEADER_SIZE: usize = 9;

/// Objects that are one and the same Python object wherever they appear, so pickle emits them
/// once and refers back with `BINGET`. Everything else is a distinct object per occurrence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shared {
    /// A string literal in vLLM's source (`"mm"`, `"lora"`, ...): one constant object.
    Tag(&'static str),
    /// CPython keeps single instances of `""` and of every one-character Latin-1 string, and
    /// returns them from decoding and slicing, so equal such strings are the same object.
    SmallStr(Option<char>),
}

impl Shared {
    /// The sharing class of a runtime (non-literal) string, if CPython would share it.
    pub(crate) fn of_runtime_str(s: &str) -> Option<Shared> {
        let mut chars = s.chars();
        match (chars.next(), chars.next()) {
            (None, _) => Some(Shared::SmallStr(None)),
            (Some(c), None) if u32::from(c) <= 0xff => Some(Shared::SmallStr(Some(c))),
            _ => None,
        }
    }
}

/// Reusable memo state: only shared objects need to be looked up again.
#[derive(Debug, Default)]
pub(crate) struct Memo {
    shared: Vec<(Shared, u32)>,
}

/// Writes one pickle into `out` (which it clears first).
pub(crate) struct Pickler<'a> {
    out: &'a mut Vec<u8>,
    memo: &'a mut Memo,
    memo_len: u32,
    /// Offset of the reserved 9-byte header of the open frame.
    frame_start: Option<usize>,
    framing: bool,
}

impl<'a> Pickler<'a> {
    /// Starts a protocol 5 pickle: `PROTO 5`, then framing.
    pub(crate) fn new(out: &'a mut Vec<u8>, memo: &'a mut Memo) -> Self {
        out.clear();
        memo.shared.clear();
        out.extend_from_slice(&[PROTO, 5]);
        Pickler {
            out,
            memo,
            memo_len: 0,
            frame_start: None,
            framing: true,
        }
    }

    /// Writes `STOP` and closes the last frame.
    pub(crate) fn finish(mut self) {
        self.write(&[STOP]);
        self.commit_frame();
    }

    fn write(&mut self, bytes: &[u8]) {
        if self.framing && self.frame_start.is_none() {
            self.frame_start = Some(self.out.len());
            self.out.extend_from_slice(&[0u8; FRAME_HEADER_SIZE]);
        }
        self.out.extend_from_slice(bytes);
    }

    fn commit_frame(&mut self) {
        let Some(start) = self.frame_start.take() else {
            return;
        };
        let frame_len = self.out.len() - start - FRAME_HEADER_SIZE;
        if frame_len >= FRAME_SIZE_MIN {
            let mut header = [0u8; FRAME_HEADER_SIZE];
            header[0] = FRAME;
            header[1..].copy_from_slice(&(frame_len as u64).to_le_bytes());
            self.out[start..start + FRAME_HEADER_SIZE].copy_from_slice(&header);
        } else {
            self.out.drain(start..start + FRAME_HEADER_SIZE);
        }
    }

    /// CPython checks the frame size at the start of saving every object.
    fn object_boundary(&mut self) {
        if let Some(start) = self.frame_start {
            if self.out.len() - start - FRAME_HEADER_SIZE >= FRAME_SIZE_TARGET {
                self.commit_frame();
            }
        }
    }

    fn memoize(&mut self, shared: Option<Shared>) {
        if let Some(key) = shared {
            self.memo.shared.push((key, self.memo_len));
        }
        self.memo_len += 1;
        self.write(&[MEMOIZE]);
    }

    /// Emits a memo reference if `shared` was already saved; returns whether it did.
    fn try_memo_get(&mut self, shared: Option<Shared>) -> bool {
        let Some(key) = shared else {
            return false;
        };
        let Some(&(_, index)) = self.memo.shared.iter().find(|(k, _)| *k == key) else {
            return false;
        };
        match u8::try_from(index) {
            Ok(small) => self.write(&[BINGET, small]),
            Err(_) => {
                let b = index.to_le_bytes();
                self.write(&[LONG_BINGET, b[0], b[1], b[2], b[3]]);
            }
        }
        true
    }

    pub(crate) fn save_none(&mut self) {
        self.object_boundary();
        self.write(&[NONE]);
    }

    /// The hot path: token ids are non-negative and below 2^32.
    pub(crate) fn save_u32(&mut self, v: u32) {
        self.object_boundary();
        let b = v.to_le_bytes();
        if v <= 0xff {
            self.write(&[BININT1, b[0]]);
        } else if v <= 0xffff {
            self.write(&[BININT2, b[0], b[1]]);
        } else if v <= 0x7fff_ffff {
            self.write(&[BININT, b[0], b[1], b[2], b[3]]);
        } else {
            // Bit 31 set: a fifth, zero byte keeps the two's-complement value positive.
            self.write(&[LONG1, 5, b[0], b[1], b[2], b[3], 0]);
        }
    }

    /// Saves a run of token ids, as consecutive [`Self::save_u32`] calls would. When no frame
    /// can close inside the run (the usual case), the opcodes are packed without per-token checks.
    pub(crate) fn save_u32_run(&mut self, values: &[u32]) {
        let Some(last) = values.len().checked_sub(1) else {
            return;
        };
        let frame_len = self
            .frame_start
            .map_or(0, |start| self.out.len() - start - FRAME_HEADER_SIZE);
        // A token's opcode takes at most 7 bytes; a frame closes only at a token's start.
        if !self.framing || frame_len + last.saturating_mul(7) >= FRAME_SIZE_TARGET {
            for &v in values {
                self.save_u32(v);
            }
            return;
        }
        self.write(&[]);
        super::pack_words(self.out, values, pickle_u32_word);
    }

    pub(crate) fn save_int(&mut self, v: i128) {
        self.object_boundary();
        if (0..=0xff).contains(&v) {
            self.write(&[BININT1, v as u8]);
        } else if (0..=0xffff).contains(&v) {
            let b = (v as u16).to_le_bytes();
            self.write(&[BININT2, b[0], b[1]]);
        } else if let Ok(small) = i32::try_from(v) {
            let b = small.to_le_bytes();
            self.write(&[BININT, b[0], b[1], b[2], b[3]]);
        } else {
            let mut encoded = [0u8; 17];
            let n = encode_long(v, &mut encoded);
            // At most 17 bytes: LONG1's one-byte length always suffices for an i128.
            self.write(&[LONG1, n as u8]);
            self.write(&encoded[..n]);
        }
    }

    pub(crate) fn save_str(&mut self, s: &str, shared: Option<Shared>) {
        self.object_boundary();
        if self.try_memo_get(shared) {
            return;
        }
        let n = s.len();
        if n <= 0xff {
            self.write(&[SHORT_BINUNICODE, n as u8]);
            self.write(s.as_bytes());
        } else {
            self.write_sized(BINUNICODE, BINUNICODE8, s.as_bytes());
        }
        self.memoize(shared);
    }

    pub(crate) fn save_bytes(&mut self, b: &[u8]) {
        self.object_boundary();
        let n = b.len();
        if n <= 0xff {
            self.write(&[SHORT_BINBYTES, n as u8]);
            self.write(b);
        } else {
            self.write_sized(BINBYTES, BINBYTES8, b);
        }
        self.memoize(None);
    }

    /// A 4-byte-length opcode (or its 8-byte form beyond 4 GiB) and its payload; payloads of
    /// 64 KiB or more go out unframed, after closing the current frame.
    fn write_sized(&mut self, op4: u8, op8: u8, payload: &[u8]) {
        let large = payload.len() >= FRAME_SIZE_TARGET;
        if large {
            self.commit_frame();
            self.framing = false;
        }
        match u32::try_from(payload.len()) {
            Ok(n) => {
                self.write(&[op4]);
                self.write(&n.to_le_bytes());
            }
            Err(_) => {
                self.write(&[op8]);
                self.write(&(payload.len() as u64).to_le_bytes());
            }
        }
        self.write(payload);
        self.framing = true;
    }

    /// Opens a tuple of `len` elements; save the elements next, then call [`Self::tuple_end`].
    pub(crate) fn tuple_begin(&mut self, len: usize) {
        self.object_boundary();
        if len > 3 {
            self.write(&[MARK]);
        }
    }

    pub(crate) fn tuple_end(&mut self, len: usize) {
        match len {
            // The empty tuple is a singleton that pickle writes without memoising.
            0 => self.write(&[EMPTY_TUPLE]),
            1 => self.write(&[TUPLE1]),
            2 => self.write(&[TUPLE2]),
            3 => self.write(&[TUPLE3]),
            _ => self.write(&[TUPLE]),
        }
        if len > 0 {
            self.memoize(None);
        }
    }
}

/// A token id's pickle opcode and argument as little-endian bytes of a word, and their count.
fn pickle_u32_word(v: u32) -> (u64, usize) {
    let arg = u64::from(v) << 8;
    if v <= 0xff {
        (u64::from(BININT1) | arg, 2)
    } else if v <= 0xffff {
        (u64::from(BININT2) | arg, 3)
    } else if v <= 0x7fff_ffff {
        (u64::from(BININT) | arg, 5)
    } else {
        // LONG1, length 5, four bytes, then the zero sign byte the word already holds.
        (u64::from(LONG1) | 5 << 8 | u64::from(v) << 16, 7)
    }
}

/// `pickle.encode_long`: minimal little-endian two's complement; returns the byte count.
fn encode_long(v: i128, out: &mut [u8; 17]) -> usize {
    if v == 0 {
        return 0;
    }
    // Python: nbytes = (abs(v).bit_length() >> 3) + 1, then one 0xff byte trimmed if redundant.
    let bit_length = 128 - v.unsigned_abs().leading_zeros();
    let mut n = (bit_length as usize >> 3) + 1;
    let le = v.to_le_bytes();
    let ext = if v < 0 { 0xff } else { 0x00 };
    for (i, slot) in out.iter_mut().enumerate().take(n) {
        *slot = le.get(i).copied().unwrap_or(ext);
    }
    if v < 0 && n > 1 && out[n - 1] == 0xff && out[n - 2] & 0x80 != 0 {
        n -= 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pickle_int(v: i128) -> Vec<u8> {
        let (mut out, mut memo) = (Vec::new(), Memo::default());
        let mut p = Pickler::new(&mut out, &mut memo);
        p.save_int(v);
        p.finish();
        out
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    /// The opcode and argument bytes of a one-int pickle: strips PROTO, FRAME header and STOP.
    fn int_body(v: i128) -> String {
        let out = pickle_int(v);
        let h = hex(&out);
        // Bodies are under 4 bytes only for BININT1 (2 bytes + STOP = 3): then no FRAME.
        let body = if out[2] == FRAME { &h[22..] } else { &h[4..] };
        body[..body.len() - 2].to_string()
    }

    #[test]
    fn int_widths_match_cpython() {
        // Expected bytes from CPython 3.11 `pickle.dumps(v, protocol=5)`.
        let cases: &[(i128, &str)] = &[
            (0, "4b00"),
            (255, "4bff"),
            (256, "4d0001"),
            (65535, "4dffff"),
            (65536, "4a00000100"),
            (2_147_483_647, "4affffff7f"),
            (2_147_483_648, "8a050000008000"),
            (4_294_967_295, "8a05ffffffff00"),
            (1 << 40, "8a06000000000001"),
            (i128::from(u64::MAX), "8a09ffffffffffffffff00"),
            (-1, "4affffffff"),
            (-11, "4af5ffffff"),
            (-2_147_483_648, "4a00000080"),
            (-2_147_483_649, "8a05ffffff7fff"),
            (-(1 << 32), "8a0500000000ff"),
            (-(1 << 39), "8a050000000080"),
            (i128::from(i64::MIN), "8a080000000000000080"),
        ];
        for (v, want) in cases {
            assert_eq!(int_body(*v), *want, "int {v}");
        }
    }

    #[test]
    fn u32_fast_path_equals_general_path() {
        for v in [
            0u32,
            1,
            255,
            256,
            65535,
            65536,
            0x7fff_ffff,
            0x8000_0000,
            u32::MAX,
        ] {
            let (mut a, mut m1) = (Vec::new(), Memo::default());
            let mut p = Pickler::new(&mut a, &mut m1);
            p.save_u32(v);
            p.finish();
            assert_eq!(a, pickle_int(i128::from(v)), "u32 {v}");
        }
    }

    #[test]
    fn packed_token_run_equals_one_by_one() {
        let values: Vec<u32> = (0..5000u32)
            .map(|i| i.wrapping_mul(2_654_435_761) >> (i % 32))
            .collect();
        let (mut a, mut b, mut m) = (Vec::new(), Vec::new(), Memo::default());
        let mut p = Pickler::new(&mut a, &mut m);
        p.tuple_begin(values.len());
        p.save_u32_run(&values);
        p.tuple_end(values.len());
        p.finish();
        let mut p = Pickler::new(&mut b, &mut m);
        p.tuple_begin(values.len());
        for &v in &values {
            p.save_u32(v);
        }
        p.tuple_end(values.len());
        p.finish();
        assert_eq!(a, b);
    }

    #[test]
    fn tiny_pickle_has_no_frame_header() {
        // pickle.dumps(7, protocol=5) == b'\x80\x05K\x07.'
        assert_eq!(hex(&pickle_int(7)), "80054b072e");
        // pickle.dumps(None, protocol=5) == b'\x80\x05N.'
        let (mut out, mut memo) = (Vec::new(), Memo::default());
        let mut p = Pickler::new(&mut out, &mut memo);
        p.save_none();
        p.finish();
        assert_eq!(hex(&out), "80054e2e");
    }

    #[test]
    fn str_of_256_bytes_uses_binunicode() {
        let (mut out, mut memo) = (Vec::new(), Memo::default());
        let s255 = "a".repeat(255);
        let mut p = Pickler::new(&mut out, &mut memo);
        p.save_str(&s255, None);
        p.finish();
        assert_eq!(&out[11..13], &[SHORT_BINUNICODE, 255]);
        assert_eq!(out.len(), 11 + 2 + 255 + 2);

        let s256 = "é".repeat(128); // 256 UTF-8 bytes, 128 characters
        let mut p = Pickler::new(&mut out, &mut memo);
        p.save_str(&s256, None);
        p.finish();
        assert_eq!(&out[11..16], &[BINUNICODE, 0, 1, 0, 0]);
        assert_eq!(&out[out.len() - 2..], &[MEMOIZE, STOP]);
    }

    fn pickle_with(f: impl FnOnce(&mut Pickler<'_>)) -> String {
        let (mut out, mut memo) = (Vec::new(), Memo::default());
        let mut p = Pickler::new(&mut out, &mut memo);
        f(&mut p);
        p.finish();
        hex(&out)
    }

    #[test]
    fn repeated_shared_str_is_a_memo_reference() {
        // m = "mm"; pickle.dumps((m, "x1", m), protocol=5)
        let got = pickle_with(|p| {
            p.tuple_begin(3);
            p.save_str("mm", Some(Shared::Tag("mm")));
            p.save_str("x1", None);
            p.save_str("mm", Some(Shared::Tag("mm")));
            p.tuple_end(3);
        });
        assert_eq!(got, "8005950f000000000000008c026d6d948c02783194680087942e");
        // Distinct objects with equal text are written twice: pickle.dumps(("ab", "".join("ab")))
        let got = pickle_with(|p| {
            p.tuple_begin(2);
            p.save_str("ab", None);
            p.save_str("ab", None);
            p.tuple_end(2);
        });
        assert_eq!(got, "8005950d000000000000008c026162948c0261629486942e");
    }

    #[test]
    fn empty_tuple_is_not_memoised() {
        // pickle.dumps(((),), protocol=5)
        let got = pickle_with(|p| {
            p.tuple_begin(1);
            p.tuple_begin(0);
            p.tuple_end(0);
            p.tuple_end(1);
        });
        assert_eq!(got, "80059504000000000000002985942e");
    }

    #[test]
    fn small_strings_are_shared_like_cpython() {
        assert_eq!(Shared::of_runtime_str(""), Some(Shared::SmallStr(None)));
        assert_eq!(
            Shared::of_runtime_str("a"),
            Some(Shared::SmallStr(Some('a')))
        );
        assert_eq!(
            Shared::of_runtime_str("é"),
            Some(Shared::SmallStr(Some('é')))
        );
        assert_eq!(Shared::of_runtime_str("ā"), None);
        assert_eq!(Shared::of_runtime_str("ab"), None);
    }

    #[test]
    fn memo_index_past_255_uses_long_binget() {
        // m = "mm"; pickle.dumps(tuple(b"x" + bytes([i % 200 + 1]) for i in range(256)) + (m, m))
        let (mut out, mut memo) = (Vec::new(), Memo::default());
        let mut p = Pickler::new(&mut out, &mut memo);
        p.tuple_begin(258);
        for i in 0..256u32 {
            p.save_bytes(&[b'x', (i % 200 + 1) as u8]);
        }
        p.save_str("mm", Some(Shared::Tag("mm"))); // memo index 256
        p.save_str("mm", Some(Shared::Tag("mm")));
        p.tuple_end(258);
        p.finish();
        assert_eq!(out.len(), 1305);
        assert_eq!(
            hex(&out[out.len() - 16..]),
            "7838948c026d6d946a0001000074942e"
        );
    }
}
