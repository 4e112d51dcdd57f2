//! Fuzzes the data port's HTTP/1.1 head parser (`crates/proxy/src/h1.rs`): which heads its
//! own path serves and the request parts it builds from them, on any bytes a client can send.
//! Invariants checked (by `kinference_proxy::fuzzing::http1_head`): nothing panics; a complete
//! head lies inside the input, every part of it inside the head; parts that build keep the
//! parsed method (the others send the connection to hyper).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kinference_proxy::fuzzing::http1_head(data);
});
