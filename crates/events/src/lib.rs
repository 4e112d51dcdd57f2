//! Live KV-event subscription per replica (edge crate: sockets and tokio live here).
