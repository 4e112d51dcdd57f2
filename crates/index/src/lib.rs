//! Which replica holds which KV-cache blocks (pure; no I/O, no async runtime).
