//! A discovered pool's changing membership: [`PoolMembers`] is the handle discovery (for
//! example the Kubernetes control plane) uses to add and remove the pool's replicas while the
//! router runs.
//!
//! Invariants: a joiner is subscribed, scraped and discovered exactly as a configured replica
//! is, and is routable as soon as it is in the set; one whose event stream cannot be subscribed
//! is still routed, by load (the error is in its `events_error`). A leaver is taken out of the
//! set first (no new request can pick it), then its tasks are stopped and awaited, then its
//! index entries, the policy's records of it and its metric series are cleared before
//! [`PoolMembers::leave`] returns; requests already routed to it finish on their own reference
//! (series they write afterwards are swept later). Changes to one pool are made by one caller
//! at a time (the pool's discovery loop); other pools are never touched.

use std::sync::Arc;

use crate::config::{resolve_one, ConfigErrors, InferencePoolRef, ReplicaSpec};
use crate::fleet::{subscribe, Fleet, Member, Pool, Replica};

/// Adds and removes the replicas of one discovered pool.
#[derive(Clone, Debug)]
pub struct PoolMembers {
    fleet: Arc<Fleet>,
    pool: Arc<Pool>,
    source: InferencePoolRef,
}

/// Why a member could not join.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("member {key:?}: {errors}")]
    Config { key: String, errors: ConfigErrors },
    #[error("the router is shutting down")]
    ShutDown,
}

impl PoolMembers {
    pub(crate) fn new(fleet: Arc<Fleet>, pool: Arc<Pool>) -> Option<PoolMembers> {
        let source = pool.source.clone()?;
        Some(PoolMembers {
            fleet,
            pool,
            source,
        })
    }

    /// The pool's name (as in metrics and `/debug/replicas`).
    pub fn name(&self) -> &str {
        &self.pool.name
    }

    /// The `InferencePool` the configuration names.
    pub fn source(&self) -> &InferencePoolRef {
        &self.source
    }

    /// The pool's state now, as `/debug/replicas` shows it.
    pub fn status(&self) -> crate::api::PoolStatus {
        crate::snapshot::pool(&self.pool, tokio::time::Instant::now())
    }

    /// The keys of the members now.
    pub fn keys(&self) -> Vec<String> {
        self.pool.members.lock().keys().cloned().collect()
    }

    /// Adds member `key` with one replica per spec (replacing a member of that key). The
    /// replicas are routable when this returns.
    pub async fn join(&self, key: &str, specs: &[ReplicaSpec]) -> Result<(), JoinError> {
        self.leave(key).await;
        let config = |errors| JoinError::Config {
            key: key.to_owned(),
            errors,
        };
        let resolved: Vec<_> = specs
            .iter()
            .map(resolve_one)
            .collect::<Result<_, _>>()
            .map_err(config)?;
        let plane = self.pool.plane().ok_or(JoinError::ShutDown)?;
        let pool_index = self
            .fleet
            .pool_index(&self.pool)
            .ok_or(JoinError::ShutDown)?;
        let mut member = Member::default();
        for (spec, rr) in specs.iter().zip(&resolved) {
            let replica = Arc::new(Replica::new(
                self.fleet.new_replica_id(),
                spec,
                rr,
                self.pool.room.clone(),
            ));
            let discover = match subscribe(&plane, &replica, spec, rr.events.as_ref()).await {
                Ok(d) => d,
                Err(e) => {
                    // Routed by load without events rather than not at all.
                    tracing::warn!(pool = %self.pool.name, member = key, replica = %replica.url(),
                        error = %e, "KV-event subscription failed; routing the replica by load");
                    replica.info.lock().events_error = Some(e.to_string());
                    false
                }
            };
            if discover {
                member.tasks.push(tokio::spawn(crate::discovery::run(
                    self.fleet.clone(),
                    pool_index,
                    replica.clone(),
                )));
            }
            if let Some(every) = self.fleet.settings.scrape_interval {
                member.tasks.push(tokio::spawn(crate::scrape::run(
                    self.fleet.clone(),
                    self.pool.clone(),
                    replica.clone(),
                    every,
                )));
            }
            member.replicas.push(replica);
        }
        self.pool.add_replicas(&member.replicas);
        let urls: Vec<&str> = member.replicas.iter().map(|r| r.url()).collect();
        tracing::info!(pool = %self.pool.name, member = key, ?urls, "replica joined");
        self.pool.members.lock().insert(key.to_owned(), member);
        self.fleet.bump();
        Ok(())
    }

    /// Removes member `key`: no new requests from now on, its index entries gone when this
    /// returns. Returns whether it was a member.
    pub async fn leave(&self, key: &str) -> bool {
        let Some(member) = self.pool.members.lock().remove(key) else {
            return false;
        };
        let ids: Vec<_> = member.replicas.iter().map(|r| r.id).collect();
        self.pool.remove_replicas(&ids);
        self.stop(member).await;
        self.fleet.forget_left_replicas();
        tracing::info!(pool = %self.pool.name, member = key, "replica left");
        self.fleet.bump();
        true
    }

    /// Stops a member's tasks and forgets what the index and the policy know of it.
    async fn stop(&self, member: Member) {
        for t in &member.tasks {
            t.abort();
        }
        for t in member.tasks {
            // Awaited so that no discovery can subscribe after the index is cleared.
            let _ = t.await;
        }
        let plane = self.pool.plane();
        for r in &member.replicas {
            if let Some(plane) = &plane {
                if let Err(e) = plane.remove_replica(r.id).await {
                    tracing::debug!(replica = %r.url(), error = %e, "removing a replica's events");
                }
            }
            let mut policy = self.pool.policy.lock();
            for rank in 0..r.dp_size() {
                policy.remove_worker(r.worker(rank));
            }
        }
    }

    /// Records whether the pool's source can be read: `None` once it was read, or a bounded
    /// label (for metrics) and a message that names the fix.
    pub fn set_source_state(&self, error: Option<(&str, String)>) {
        {
            let mut d = self.pool.discovery.lock();
            match error {
                None => {
                    d.synced = true;
                    d.error = None;
                }
                Some((label, message)) => d.error = Some((label.to_owned(), message)),
            }
        }
        self.fleet.bump();
    }

    /// Stops every member's tasks (at shutdown).
    pub(crate) fn abort_all(pool: &Pool) {
        for m in pool.members.lock().values() {
            for t in &m.tasks {
                t.abort();
            }
        }
    }
}
