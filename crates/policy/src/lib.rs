//! Routing policies for kinference: pure functions from (request, candidates, time) to a
//! [`Decision`], plus the small router-side state some policies keep.
//!
//! ```text
//!   caller: hashes = BlockHasher(prompt); cache = Index::longest_prefix(hashes)
//!           candidates = [Candidate { worker, load, cache, scorable, .. }]
//!   Policy::select(&ctx, &candidates, now) ──▶ Decision { ranked, reason, scores }   (no effects)
//!   caller: forward to decision.ranked[0] (fall back down the list), then
//!   Policy::apply(&decision, ctx.hashes, now)   (speculative entries, approximate tree)
//!   Policy::undo(applied, ctx.hashes, now)      (the worker refused or failed before answering)
//! ```
//!
//! Invariants:
//! * `select` never mutates anything; the same inputs give the same `Decision`. Everything that
//!   must change after a choice (in-flight counters, speculative entries, metrics) is applied by
//!   the caller, `Policy::apply` for the state kept here.
//! * Time is a [`Duration`](std::time::Duration) from any fixed origin the caller chooses; the
//!   crate never reads a clock.
//! * Every available candidate appears exactly once in `Decision::ranked` and in
//!   `Decision::scores`; unavailable ones appear in neither.

mod config;
mod lru;
mod policy;
mod scale_in;
mod score;
mod shadow;
mod tracker;
mod types;

pub use config::{ApproximateConfig, ConfigError, ConfigErrors, PolicyConfig, PreciseConfig};
pub use policy::{Applied, Policy};
pub use scale_in::{unique_span, UniqueHits, UniqueSpan};
pub use shadow::{Guess, Shadow, ShadowError, CAPACITY_UNKNOWN};
pub use tracker::{Inserted, PrefixTracker};
pub use types::{Candidate, Decision, Load, Reason, RequestCtx, Score};
