//! The CBOR subset `cbor2.dumps(obj, canonical=True)` produces for vLLM's hash inputs: arrays
//! (Python tuples), unsigned and negative ints, text and byte strings, and `null`.
//!
//! Hand-written rather than built on a CBOR crate: for these five major types canonical CBOR is
//! fully determined (definite lengths, shortest argument encoding), and writing straight into the
//! hasher's reused buffer avoids building a serde value tree per block on the request path.
//! `canonical=True` only changes map key order and float width in cbor2; neither occurs here.

const MAJOR_UINT: u8 = 0;
const MAJOR_NEGINT: u8 = 1 << 5;
const MAJOR_BYTES: u8 = 2 << 5;
const MAJOR_TEXT: u8 = 3 << 5;
const MAJOR_ARRAY: u8 = 4 << 5;
const NULL: u8 = 0xf6;

/// The initial byte and the shortest argument that holds `arg`.
fn head(out: &mut Vec<u8>, major: u8, arg: u64) {
    if arg < 24 {
        out.push(major | arg as u8);
    } else if let Ok(v) = u8::try_from(arg) {
        out.extend_from_slice(&[major | 24, v]);
    } else if let Ok(v) = u16::try_from(arg) {
        out.push(major | 25);
        out.extend_from_slice(&v.to_be_bytes());
    } else if let Ok(v) = u32::try_from(arg) {
        out.push(major | 26);
        out.extend_from_slice(&v.to_be_bytes());
    } else {
        out.push(major | 27);
        out.extend_from_slice(&arg.to_be_bytes());
    }
}

pub(crate) fn array(out: &mut Vec<u8>, len: usize) {
    head(out, MAJOR_ARRAY, len as u64);
}

/// Token ids as unsigned ints, packed without per-token capacity checks.
pub(crate) fn uint_run(out: &mut Vec<u8>, values: &[u32]) {
    super::pack_words(out, values, |v| {
        if v < 24 {
            (u64::from(v), 1)
        } else if v <= 0xff {
            (u64::from(MAJOR_UINT | 24) | u64::from(v) << 8, 2)
        } else if v <= 0xffff {
            let be = u64::from((v as u16).swap_bytes());
            (u64::from(MAJOR_UINT | 25) | be << 8, 3)
        } else {
            (
                u64::from(MAJOR_UINT | 26) | u64::from(v.swap_bytes()) << 8,
                5,
            )
        }
    });
}

pub(crate) fn int(out: &mut Vec<u8>, v: i64) {
    match u64::try_from(v) {
        Ok(u) => head(out, MAJOR_UINT, u),
        // -1 - v is non-negative and fits in u64 for every negative i64.
        Err(_) => head(out, MAJOR_NEGINT, (-1 - i128::from(v)) as u64),
    }
}

pub(crate) fn text(out: &mut Vec<u8>, s: &str) {
    head(out, MAJOR_TEXT, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

pub(crate) fn bytes(out: &mut Vec<u8>, b: &[u8]) {
    head(out, MAJOR_BYTES, b.len() as u64);
    out.extend_from_slice(b);
}

pub(crate) fn null(out: &mut Vec<u8>) {
    out.push(NULL);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uint(out: &mut Vec<u8>, v: u64) {
        head(out, MAJOR_UINT, v);
    }

    fn enc(f: impl FnOnce(&mut Vec<u8>)) -> String {
        let mut out = Vec::new();
        f(&mut out);
        out.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn integers_use_the_shortest_head() {
        // cbor2.dumps(v, canonical=True).hex()
        let cases: &[(i64, &str)] = &[
            (0, "00"),
            (23, "17"),
            (24, "1818"),
            (255, "18ff"),
            (256, "190100"),
            (65535, "19ffff"),
            (65536, "1a00010000"),
            (4_294_967_295, "1affffffff"),
            (4_294_967_296, "1b0000000100000000"),
            (-1, "20"),
            (-11, "2a"),
            (-24, "37"),
            (-25, "3818"),
            (-256, "38ff"),
            (-257, "390100"),
            (i64::MIN, "3b7fffffffffffffff"),
        ];
        for (v, want) in cases {
            assert_eq!(enc(|o| int(o, *v)), *want, "int {v}");
        }
        assert_eq!(enc(|o| uint(o, u64::MAX)), "1bffffffffffffffff");
    }

    #[test]
    fn packed_uint_run_equals_one_by_one() {
        let values: Vec<u32> = (0..5000u32)
            .map(|i| i.wrapping_mul(2_654_435_761) >> (i % 32))
            .collect();
        let mut one_by_one = Vec::new();
        for &v in &values {
            uint(&mut one_by_one, u64::from(v));
        }
        let mut packed = vec![0xaa];
        uint_run(&mut packed, &values);
        assert_eq!(packed[1..], one_by_one[..]);
    }

    #[test]
    fn strings_bytes_arrays_and_null() {
        assert_eq!(enc(|o| text(o, "0")), "6130");
        assert_eq!(
            enc(|o| text(o, "vllm-none-hash")),
            "6e766c6c6d2d6e6f6e652d68617368"
        );
        assert_eq!(enc(|o| bytes(o, &[0xab; 2])), "42abab");
        assert_eq!(enc(|o| array(o, 16)), "90");
        assert_eq!(enc(|o| array(o, 32)), "9820");
        assert_eq!(enc(null), "f6");
        let long = "x".repeat(300);
        assert!(enc(|o| text(o, &long)).starts_with("79012c78"));
    }
}
