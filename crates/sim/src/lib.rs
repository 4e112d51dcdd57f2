//! A GPU-free vLLM stand-in: a steppable engine core with an injected clock.
//!
//! The core mirrors vLLM v1's scheduler and block pool closely enough that the KV events,
//! prefix-cache counters and queueing behaviour a router observes are the ones a real vLLM
//! would produce, and charges each engine step a simulated duration from a published-figure
//! timing model. Nothing here reads wall time, sleeps, or does I/O:
//!
//! ```text
//!   add_request(req, now) ──▶ waiting ──▶ step(now) ──▶ StepOutput { duration, outputs, events }
//!                                  ▲          │
//!                                  └─preempt──┘   (the caller advances its clock by `duration`)
//! ```
//!
//! * [`block_pool`]: vLLM's `BlockPool` (free-block queue order, prefix-cache map, events).
//! * `kv_cache`: per-request block tables: prefix lookup, slot allocation, block caching.
//! * `scheduler`: continuous batching with chunked prefill and recompute preemption.
//! * [`timing`] + [`profile`]: step duration from a GPU/model profile (data files, sourced).
//! * [`engine`]: the steppable engine; [`fleet`]: N engines in virtual time for sweeps.
//!
//! Invariants: a block's reference count never goes negative; a referenced block is never
//! evicted; cached free blocks are evicted least recently freed first; the set of cached
//! hashes always equals the hashes published as stored minus those published as removed
//! (minus everything on `AllBlocksCleared`).

pub mod block_pool;
pub mod engine;
pub mod error;
pub mod fleet;
mod kv_cache;
pub mod metrics;
pub mod profile;
pub mod request;
mod scheduler;
pub mod time;
pub mod timing;

pub use block_pool::{BlockId, BlockPool, EventOptions};
pub use engine::{Engine, EngineConfig, FinishReason, Finished, RequestOutput, StepOutput, Usage};
pub use error::{AddRequestError, ConfigError, FleetError, ProfileError, ResetError};
pub use fleet::{Arrival, Fleet, FleetReport, FleetView, RequestRecord};
pub use metrics::{EngineMetrics, Histogram};
pub use profile::Profile;
pub use request::Request;
pub use time::SimTime;
pub use timing::{BatchItem, TimingModel};
