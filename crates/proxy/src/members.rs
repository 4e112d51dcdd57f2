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
//!
//! The same handle replaces the pool's rules ([`PoolMembers::reconfigure`]: tokenizer,
//! hashing, policy, session header) while it routes: new settings are validated as a config
//! file's pool is, and the tokenizer loaded, before anything changes; settings that fail keep
//! the pool on its current rules. Requests prepared before the swap finish with the old rules,
//! those after use the new ones; no request sees a mix.

use std::sync::Arc;

use crate::config::{
    resolve_one, resolve_one_pool, ConfigErrors, InferencePoolRef, PoolConfig, ReplicaSpec,
};
use crate::fleet::{subscribe, Fleet, Member, Pool, Replica, Rules};

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

/// Why new settings were not applied; the pool routes on with its current ones.
#[derive(Debug, thiserror::Error)]
pub enum ReconfigureError {
    #[error("{0}")]
    Config(ConfigErrors),
    #[error("loading the tokenizer from {dir}: {source}")]
    Tokenizer {
        dir: String,
        source: kinference_tokenize::TokenizeError,
    },
    #[error("loading the tokenizer from {dir}: the loading task failed: {message}")]
    Task { dir: String, message: String },
}

/// The fields of a [`PoolConfig`] that [`PoolMembers::reconfigure`] applies, by their names
/// in a config file, with whether `a` and `b` differ in each.
fn rule_changes(a: &PoolConfig, b: &PoolConfig) -> Vec<&'static str> {
    [
        ("tokenizer", a.tokenizer != b.tokenizer),
        (
            "tokenizer_cache_bytes",
            a.tokenizer_cache_bytes != b.tokenizer_cache_bytes,
        ),
        ("block_size", a.block_size != b.block_size),
        ("hash_algo", a.hash_algo != b.hash_algo),
        ("hash_seed", a.hash_seed != b.hash_seed),
        (
            "extra_keys_format",
            a.extra_keys_format != b.extra_keys_format,
        ),
        ("policy", a.policy != b.policy),
        ("session_header", a.session_header != b.session_header),
    ]
    .into_iter()
    .filter_map(|(name, differs)| differs.then_some(name))
    .collect()
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

    /// The settings the pool routes with now (what it was started with, or last
    /// [`reconfigured`](PoolMembers::reconfigure) to).
    pub fn settings(&self) -> PoolConfig {
        self.pool.rules().config.clone()
    }

    /// Routes the pool with `new`'s tokenizer, hashing (block size, algorithm, seed, extra-keys
    /// format), policy and session header from now on; `new`'s other fields (name, models,
    /// adapters, replicas, events, source) are the pool's identity and are ignored. Returns
    /// the fields that changed (none: nothing was replaced). On error nothing changed.
    ///
    /// The policy starts afresh when its settings, the tokenizer or the hashing change (its
    /// records are of prompts hashed the old way). The index is kept: it holds what the
    /// replicas reported, and entries hashed another way than the new rules simply match no
    /// prompt; a replica whose reported hashing differs from the new rules is marked
    /// unscorable at its next scrape.
    pub async fn reconfigure(
        &self,
        new: &PoolConfig,
    ) -> Result<Vec<&'static str>, ReconfigureError> {
        let current = self.pool.rules();
        let mut pc = current.config.clone();
        pc.tokenizer = new.tokenizer.clone();
        pc.tokenizer_cache_bytes = new.tokenizer_cache_bytes;
        pc.block_size = new.block_size;
        pc.hash_algo = new.hash_algo.clone();
        pc.hash_seed = new.hash_seed.clone();
        pc.extra_keys_format = new.extra_keys_format.clone();
        pc.policy = new.policy.clone();
        pc.session_header = new.session_header.clone();
        let changed = rule_changes(&current.config, &pc);
        if changed.is_empty() {
            return Ok(changed);
        }
        let rp = resolve_one_pool(&pc).map_err(ReconfigureError::Config)?;
        let dir = pc.tokenizer.display().to_string();
        // Loading a tokenizer reads and parses files: not on the runtime's threads.
        let built = tokio::task::spawn_blocking(move || {
            Rules::build(&pc, rp.hasher, rp.session_header, Some(&current))
        })
        .await
        .map_err(|e| ReconfigureError::Task {
            dir: dir.clone(),
            message: e.to_string(),
        })?
        .map_err(|source| ReconfigureError::Tokenizer { dir, source })?;
        self.pool.set_rules(built);
        tracing::info!(pool = %self.pool.name, ?changed, "pool settings replaced");
        self.fleet.bump();
        Ok(changed)
    }

    /// Records why the pool's declared settings cannot be applied (`None`: they are); shown
    /// in `/debug/replicas` and as `kinference_pool_settings_error`.
    pub fn set_settings_error(&self, error: Option<String>) {
        self.pool.discovery.lock().settings_error = error;
        self.fleet.bump();
    }

    /// The pool's state now, as `/debug/replicas` shows it.
    pub fn status(&self) -> crate::api::PoolStatus {
        crate::snapshot::pool(
            &self.pool,
            tokio::time::Instant::now(),
            self.fleet.now(),
            crate::snapshot::Costs::Compute,
        )
    }

    /// Each member's scale-in cost now (the sum over its replicas; see `scale_in` in the
    /// pool's configuration), by key.
    pub fn scale_in_costs(&self) -> Vec<(String, f64)> {
        let now = self.fleet.now();
        let half_life = self.pool.rules().config.scale_in.half_life();
        // The members' lock is not held while the index is read.
        let members: Vec<(String, Vec<Arc<Replica>>)> = self
            .pool
            .members
            .lock()
            .iter()
            .map(|(key, m)| (key.clone(), m.replicas.clone()))
            .collect();
        let index = self.pool.index.read();
        members
            .into_iter()
            .map(|(key, replicas)| {
                let cost = replicas
                    .iter()
                    .map(|r| r.scale_in_cost(&index, now, half_life))
                    .sum();
                (key, cost)
            })
            .collect()
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
            let rules = self.pool.rules();
            {
                let mut policy = rules.policy.lock();
                for rank in 0..r.dp_size() {
                    policy.remove_worker(r.worker(rank));
                }
            }
            for s in rules.shadows.lock().iter_mut() {
                for rank in 0..r.dp_size() {
                    s.remove_worker(r.worker(rank));
                }
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
