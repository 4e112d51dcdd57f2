//! `kinference-k8s`: kinference's Kubernetes control plane, as a library the router uses.
//!
//! - [`watch::PoolWatcher`] follows one `InferencePool` (`inference.networking.k8s.io/v1`), the
//!   pods its selector matches and the `KinferencePool` naming it, and publishes
//!   immutable [`PoolSnapshot`]s on a `tokio::sync::watch` channel. The router applies
//!   [`diff`] between the snapshot it holds and the new one (joined / left / changed); it never
//!   walks live Kubernetes state.
//! - [`crd`]: our `kinference.io/v1alpha1` API, generated from these Rust types
//!   (`kinference crdgen`; the chart's copies are checked against it by a test).
//! - [`router`]: the router's side, one task per discovered pool applying each snapshot's
//!   diff to the router's live fleet, applying each new generation of the `KinferencePool`'s
//!   spec to the running pool, and writing the `KinferencePool` status.
//! - [`settings`]: a `KinferencePool`'s policy, tokenizer and hashing applied to its pool, at
//!   the router's start and live (they win over the router's own settings).
//! - [`deletion_cost`]: cache-aware scale-in, the pods' `pod-deletion-cost` annotations kept
//!   at what losing each would cost (off unless the pool's `scale_in` asks for it).
//! - [`status::StatusWriter`]: the router's report, by server-side apply with one field manager
//!   (why one, and not a Lease: see that module).
//!
//! ```no_run
//! # async fn router() -> Result<(), Box<dyn std::error::Error>> {
//! use kinference_k8s::{client, diff, PoolWatcher, WatchConfig};
//! let watcher = PoolWatcher::start(client(None).await?, WatchConfig::new("models", "llama"));
//! let mut rx = watcher.subscribe();
//! let mut held = rx.borrow_and_update().clone();
//! while rx.changed().await.is_ok() {
//!     let new = rx.borrow_and_update().clone();
//!     let d = diff(&held, &new);
//!     // Stop routing to d.left at once, add d.joined, rebuild d.changed; report new.state.
//!     held = new;
//! }
//! # Ok(()) }
//! ```
//!
//! Invariants: reading Kubernetes never panics and never takes other pools down; a pool that
//! cannot be read is a [`PoolState::Error`] with a [`PoolError`] that names the fix.

pub mod crd;
pub mod deletion_cost;
pub mod error;
pub mod gie;
pub mod router;
pub mod settings;
pub mod snapshot;
pub mod status;
pub mod watch;

pub use crd::{crd_files, crds, KinferencePool, KinferencePoolSpec};
pub use error::{Access, PoolError};
pub use gie::InferencePool;
/// The client type [`client`] returns, for callers without their own `kube` dependency.
pub use kube::Client;
pub use snapshot::{
    diff, diff_endpoints, AppProtocol, Endpoint, EventSource, PoolSnapshot, PoolState, Routing,
    SnapshotDiff, ANNOTATION_KV_EVENTS, ANNOTATION_KV_EVENTS_REPLAY,
};
pub use status::{StatusReport, StatusWriter, Verdict, FIELD_MANAGER};
pub use watch::{PoolWatcher, WatchConfig};

/// A client from a kubeconfig file, or, without one, the environment's (in a pod: its service
/// account; outside: `$KUBECONFIG` or `~/.kube/config`).
pub async fn client(kubeconfig: Option<&std::path::Path>) -> Result<kube::Client, ClientError> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await?
        }
        None => kube::Config::infer().await?,
    };
    Ok(kube::Client::try_from(config)?)
}

/// Why no client could be built.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("kubeconfig: {0}")]
    Kubeconfig(#[from] kube::config::KubeconfigError),
    #[error("no Kubernetes configuration found: {0}")]
    Infer(#[from] kube::config::InferConfigError),
    #[error("Kubernetes client: {0}")]
    Client(#[from] kube::Error),
}
