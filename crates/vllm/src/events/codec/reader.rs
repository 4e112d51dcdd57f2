//! A bounds-checked, zero-copy msgpack cursor over one input slice.
//!
//! Invariants: `pos <= buf.len()` at all times; every read either advances past a complete
//! value or returns an error (the cursor is then abandoned); nothing here allocates, so a length
//! header can never cause an allocation; skipping is iterative, so nesting depth cannot exhaust
//! the stack.

use rmp::Marker;

use super::DecodeError;

/// A msgpack integer as read from the wire, before range checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Int {
    /// A non-negative value (any unsigned or positive signed encoding).
    U(u64),
    /// A negative value.
    I(i64),
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub(super) fn pos(&self) -> usize {
        self.pos
    }

    pub(super) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn rest(&self) -> &'a [u8] {
        self.buf.get(self.pos..).unwrap_or_default()
    }

    fn truncated(&self) -> DecodeError {
        DecodeError::Truncated { offset: self.pos }
    }

    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        match self.rest().get(..n) {
            Some(s) => {
                self.pos += n;
                Ok(s)
            }
            None => Err(self.truncated()),
        }
    }

    fn fixed<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        match self.rest().first_chunk::<N>() {
            Some(c) => {
                self.pos += N;
                Ok(*c)
            }
            None => Err(self.truncated()),
        }
    }

    fn byte(&mut self) -> Result<u8, DecodeError> {
        self.fixed::<1>().map(|[b]| b)
    }

    fn be16(&mut self) -> Result<usize, DecodeError> {
        self.fixed::<2>()
            .map(|b| usize::from(u16::from_be_bytes(b)))
    }

    fn be32(&mut self) -> Result<usize, DecodeError> {
        // u32 always fits usize on the 32/64-bit targets this crate builds for.
        self.fixed::<4>().map(|b| u32::from_be_bytes(b) as usize)
    }

    fn be64(&mut self) -> Result<u64, DecodeError> {
        self.fixed::<8>().map(u64::from_be_bytes)
    }

    pub(super) fn peek_marker(&self) -> Result<Marker, DecodeError> {
        match self.rest().first() {
            Some(b) => Ok(Marker::from_u8(*b)),
            None => Err(self.truncated()),
        }
    }

    /// Consumes a nil if one is next; the `Option` readers build on this.
    pub(super) fn take_nil(&mut self) -> Result<bool, DecodeError> {
        if self.peek_marker()? == Marker::Null {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    pub(super) fn unexpected(
        &self,
        field: &'static str,
        expected: &'static str,
        at: usize,
    ) -> DecodeError {
        let found = self
            .buf
            .get(at)
            .map_or("end of input", |b| marker_name(Marker::from_u8(*b)));
        DecodeError::UnexpectedType {
            field,
            expected,
            found,
            offset: at,
        }
    }

    pub(super) fn int(&mut self, field: &'static str) -> Result<Int, DecodeError> {
        let at = self.pos;
        let v = match Marker::from_u8(self.byte()?) {
            Marker::FixPos(v) => Int::U(u64::from(v)),
            Marker::FixNeg(v) => Int::I(i64::from(v)),
            Marker::U8 => Int::U(u64::from(self.byte()?)),
            Marker::U16 => Int::U(self.be16()? as u64),
            Marker::U32 => Int::U(self.be32()? as u64),
            Marker::U64 => Int::U(self.be64()?),
            Marker::I8 => signed(i64::from(self.byte()? as i8)),
            Marker::I16 => signed(i64::from(i16::from_be_bytes(self.fixed::<2>()?))),
            Marker::I32 => signed(i64::from(i32::from_be_bytes(self.fixed::<4>()?))),
            Marker::I64 => signed(i64::from_be_bytes(self.fixed::<8>()?)),
            _ => return Err(self.unexpected(field, "integer", at)),
        };
        Ok(v)
    }

    pub(super) fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        let at = self.pos;
        // Fast path for the token ids that dominate a payload.
        if let Some(&b) = self.rest().first() {
            if b <= 0x7f {
                self.pos += 1;
                return Ok(u32::from(b));
            }
        }
        match self.int(field)? {
            Int::U(v) => {
                u32::try_from(v).map_err(|_| DecodeError::IntOutOfRange { field, offset: at })
            }
            Int::I(_) => Err(DecodeError::IntOutOfRange { field, offset: at }),
        }
    }

    pub(super) fn i64(&mut self, field: &'static str) -> Result<i64, DecodeError> {
        let at = self.pos;
        match self.int(field)? {
            Int::U(v) => {
                i64::try_from(v).map_err(|_| DecodeError::IntOutOfRange { field, offset: at })
            }
            Int::I(v) => Ok(v),
        }
    }

    /// A float field; msgspec also accepts integers for `float`, so this does too.
    pub(super) fn f64(&mut self, field: &'static str) -> Result<f64, DecodeError> {
        let at = self.pos;
        match self.peek_marker()? {
            Marker::F64 => {
                self.pos += 1;
                Ok(f64::from_bits(self.be64()?))
            }
            Marker::F32 => {
                self.pos += 1;
                Ok(f64::from(f32::from_bits(u32::from_be_bytes(
                    self.fixed::<4>()?,
                ))))
            }
            _ => match self.int(field) {
                Ok(Int::U(v)) => Ok(v as f64),
                Ok(Int::I(v)) => Ok(v as f64),
                Err(_) => Err(self.unexpected(field, "float", at)),
            },
        }
    }

    /// The raw bytes of a str value (UTF-8 not checked: keys and tags are compared as bytes).
    pub(super) fn str_bytes(&mut self, field: &'static str) -> Result<&'a [u8], DecodeError> {
        let at = self.pos;
        let len = match Marker::from_u8(self.byte()?) {
            Marker::FixStr(n) => usize::from(n),
            Marker::Str8 => usize::from(self.byte()?),
            Marker::Str16 => self.be16()?,
            Marker::Str32 => self.be32()?,
            _ => return Err(self.unexpected(field, "string", at)),
        };
        self.take(len)
    }

    pub(super) fn str(&mut self, field: &'static str) -> Result<&'a str, DecodeError> {
        let at = self.pos;
        let bytes = self.str_bytes(field)?;
        std::str::from_utf8(bytes).map_err(|_| DecodeError::InvalidUtf8 { field, offset: at })
    }

    pub(super) fn bin(&mut self, field: &'static str) -> Result<&'a [u8], DecodeError> {
        let at = self.pos;
        let len = match Marker::from_u8(self.byte()?) {
            Marker::Bin8 => usize::from(self.byte()?),
            Marker::Bin16 => self.be16()?,
            Marker::Bin32 => self.be32()?,
            _ => return Err(self.unexpected(field, "bytes", at)),
        };
        self.take(len)
    }

    /// An array header. A count larger than the bytes left is rejected here, since every
    /// element takes at least one byte; callers may therefore size buffers by the count.
    pub(super) fn array_len(&mut self, field: &'static str) -> Result<usize, DecodeError> {
        let at = self.pos;
        let len = match Marker::from_u8(self.byte()?) {
            Marker::FixArray(n) => usize::from(n),
            Marker::Array16 => self.be16()?,
            Marker::Array32 => self.be32()?,
            _ => return Err(self.unexpected(field, "array", at)),
        };
        self.check_count(len, 1)
    }

    /// A map header and whether it was a fixmap. Checked like [`Reader::array_len`].
    pub(super) fn map_len(&mut self, field: &'static str) -> Result<(usize, bool), DecodeError> {
        let at = self.pos;
        let (len, fix) = match Marker::from_u8(self.byte()?) {
            Marker::FixMap(n) => (usize::from(n), true),
            Marker::Map16 => (self.be16()?, false),
            Marker::Map32 => (self.be32()?, false),
            _ => return Err(self.unexpected(field, "map", at)),
        };
        self.check_count(len, 2).map(|n| (n, fix))
    }

    fn check_count(&self, len: usize, bytes_per_item: usize) -> Result<usize, DecodeError> {
        if len.saturating_mul(bytes_per_item) > self.remaining() {
            Err(self.truncated())
        } else {
            Ok(len)
        }
    }

    /// Skips `count` complete values of any type without recursion or allocation.
    pub(super) fn skip_values(&mut self, count: usize) -> Result<(), DecodeError> {
        // Values still to skip; containers add their children. Bounded by the input length
        // because every header is checked against the bytes left.
        let mut pending = count;
        while pending > 0 {
            pending -= 1;
            let at = self.pos;
            match Marker::from_u8(self.byte()?) {
                Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                    self.pos = at;
                    pending = pending.saturating_add(self.array_len("skipped value")?);
                }
                Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                    self.pos = at;
                    let (n, _) = self.map_len("skipped value")?;
                    pending = pending.saturating_add(n.saturating_mul(2));
                }
                Marker::Reserved => return Err(DecodeError::ReservedMarker { offset: at }),
                scalar => {
                    let n = self.scalar_body_len(scalar)?;
                    self.skip(n)?;
                }
            }
        }
        Ok(())
    }

    /// The bytes a scalar occupies after its marker, reading its length field if it has one.
    fn scalar_body_len(&mut self, marker: Marker) -> Result<usize, DecodeError> {
        let n = match marker {
            Marker::U8 | Marker::I8 => 1,
            Marker::U16 | Marker::I16 => 2,
            Marker::U32 | Marker::I32 | Marker::F32 => 4,
            Marker::U64 | Marker::I64 | Marker::F64 => 8,
            Marker::FixStr(n) => usize::from(n),
            Marker::Str8 | Marker::Bin8 => usize::from(self.byte()?),
            Marker::Str16 | Marker::Bin16 => self.be16()?,
            Marker::Str32 | Marker::Bin32 => self.be32()?,
            // Extensions: a type byte, then the data.
            Marker::FixExt1 => 2,
            Marker::FixExt2 => 3,
            Marker::FixExt4 => 5,
            Marker::FixExt8 => 9,
            Marker::FixExt16 => 17,
            Marker::Ext8 => usize::from(self.byte()?) + 1,
            Marker::Ext16 => self.be16()? + 1,
            Marker::Ext32 => self.be32()?.saturating_add(1),
            // Positive/negative fixint, nil and bools are the marker alone; containers and the
            // reserved marker are handled by the caller.
            _ => 0,
        };
        Ok(n)
    }

    fn skip(&mut self, n: usize) -> Result<(), DecodeError> {
        self.take(n).map(|_| ())
    }
}

fn signed(v: i64) -> Int {
    if v >= 0 {
        Int::U(v as u64)
    } else {
        Int::I(v)
    }
}

/// A short name of a marker's type for error messages.
pub(super) fn marker_name(m: Marker) -> &'static str {
    match m {
        Marker::FixPos(_) | Marker::FixNeg(_) => "integer",
        Marker::U8 | Marker::U16 | Marker::U32 | Marker::U64 => "integer",
        Marker::I8 | Marker::I16 | Marker::I32 | Marker::I64 => "integer",
        Marker::Null => "nil",
        Marker::True | Marker::False => "bool",
        Marker::F32 | Marker::F64 => "float",
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => "string",
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => "bytes",
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => "array",
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => "map",
        Marker::FixExt1
        | Marker::FixExt2
        | Marker::FixExt4
        | Marker::FixExt8
        | Marker::FixExt16 => "ext",
        Marker::Ext8 | Marker::Ext16 | Marker::Ext32 => "ext",
        Marker::Reserved => "reserved marker 0xc1",
    }
}
