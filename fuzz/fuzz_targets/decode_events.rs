//! Fuzz target: untrusted bytes into the KV-event decoder, the frame parsers and the ZMTP
//! framing a publisher's TCP stream is read with.
//!
//! Invariants checked: nothing panics; whatever decodes re-encodes to bytes that decode to the
//! same value (compared through the encoding and `Debug`, both of which treat NaN consistently).
//! The input is tried both as a payload and as a length-prefixed multipart capture, so the seed
//! corpus can hold `.bin` payloads and `msg_NNNN.bin` / `replay_NNNN.bin` captures alike.

#![no_main]

use kinference_vllm::events::frames::{
    parse_length_prefixed, parse_live, parse_replay, parse_replay_request, ReplayFrame,
};
use kinference_vllm::events::zmtp;
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

/// The stream splits without panicking, never past its end, and every message it yields
/// re-encodes to frames that split back to the same message.
fn zmtp_stream(data: &[u8]) {
    let Ok((messages, used)) = zmtp::split_messages(data) else {
        return;
    };
    assert!(used <= data.len());
    for m in messages {
        let mut out = Vec::new();
        zmtp::write_message(&mut out, &m);
        match zmtp::split_messages(&out) {
            Ok((again, n)) => {
                assert_eq!(n, out.len());
                assert_eq!(again, vec![m]);
            }
            Err(e) => panic!("a re-encoded message does not split: {e}"),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    round_trip(data);
    zmtp_stream(data);
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
