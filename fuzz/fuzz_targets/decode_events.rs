//! Fuzz target: untrusted bytes into the KV-event decoder and the frame parsers.
//!
//! Invariants checked: nothing panics; whatever decodes re-encodes to bytes that decode to the
//! same value (compared through the encoding and `Debug`, both of which treat NaN consistently).
//! The input is tried both as a payload and as a length-prefixed multipart capture, so the seed
//! corpus can hold `.bin` payloads and `msg_NNNN.bin` / `replay_NNNN.bin` captures alike.

#![no_main]

use kinference_vllm::events::frames::{
    parse_length_prefixed, parse_live, parse_replay, parse_replay_request, ReplayFrame,
};
use kinference_vllm::{decode_batch, encode_batch};
use libfuzzer_sys::fuzz_target;

fn round_trip(payload: &[u8]) {
    let Ok(batch) = decode_batch(payload) else {
        return;
    };
    let encoded = encode_batch(&batch);
    let again = match decode_batch(&encoded) {
        Ok(b) => b,
        Err(e) => panic!("encoded batch does not decode: {e}"),
    };
    assert_eq!(encode_batch(&again), encoded, "encode is not stable");
    assert_eq!(
        format!("{again:?}"),
        format!("{batch:?}"),
        "round trip changed the value"
    );
    if !format!("{batch:?}").contains("NaN") {
        assert_eq!(again, batch);
    }
}

fuzz_target!(|data: &[u8]| {
    round_trip(data);
    if let Ok(frames) = parse_length_prefixed(data) {
        if let Ok(msg) = parse_live(&frames) {
            round_trip(msg.payload);
        }
        if let Ok(ReplayFrame::Batch { payload, .. }) = parse_replay(&frames) {
            round_trip(payload);
        }
        let _ = parse_replay_request(&frames);
    }
});
