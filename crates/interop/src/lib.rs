//! Test support for checking kinference's core against a real vLLM server.
//!
//! The interop tests (`tests/`) run only when `KINFERENCE_REAL_VLLM_URL` and its companion
//! variables are set (see [`mod@env`]; `scripts/interop.sh` sets them after starting a server), so a
//! plain `cargo test --workspace` passes without vLLM.
//!
//! The pieces here are deliberately independent of the code under test: the HTTP client talks to
//! vLLM directly, the replay client reads vLLM's event log over its own DEALER socket, and
//! [`model::EventLog`] folds that log into the cache contents the engine announced. The tests
//! then compare what the router's crates compute (block hashes, index contents, predicted prefix
//! hits) with those ground truths.

pub mod env;
pub mod error;
pub mod harness;
pub mod http;
pub mod model;
pub mod replay;

pub use env::RealVllmEnv;
pub use error::InteropError;
pub use harness::{Harness, HashCheck, Request, StepReport};
pub use http::{ChatMessage, Completion, Prompt, ServerCacheConfig, Usage, VllmHttp};
pub use model::{CacheModel, EventLog, StoredBlock};
pub use replay::{fetch_replay, ReplayedBatch};
