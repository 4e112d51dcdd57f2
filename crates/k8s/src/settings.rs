//! A `KinferencePool`'s spec applied to the router's pool: when one names the `InferencePool`
//! a pool is discovered from, its policy (kind and weights, session header), tokenizer path
//! and hashing (block size, algorithm, seed) replace what the router's flags or config file
//! say for that pool, at start ([`apply_to_pools`]) and for each later generation of the spec
//! while the router runs (`router`, through [`overlay`]).
//!
//! Invariants: the cluster's object wins over the router's own settings, because it is what
//! the operator declared for the pods; the router's settings are the fallback when no
//! `KinferencePool` names the pool, when it cannot be read (RBAC, CRD missing, API server
//! down) or when its spec is invalid; each of these is logged and never stops the router.
//! The `KinferencePool` chosen is the watcher's: the first by name whose `poolRef` is the pool.
//! A spec changed while the router runs is applied live by `router` (the pool's tokenizer,
//! hasher and policy are replaced whole); one that cannot be applied leaves the pool on its last
//! settings and is reported in the status (`Accepted` `False`).

use kinference_proxy::PoolConfig;
use kube::api::ListParams;
use kube::{Api, Client};

use crate::crd::{KinferencePool, KinferencePoolSpec};
use crate::error::{PoolError, Watched};

/// What [`apply_to_pool`] did.
#[derive(Clone, Debug, PartialEq)]
pub enum Applied {
    /// No `KinferencePool` names the pool: the router's settings stand.
    Absent,
    /// The named `KinferencePool`'s spec was applied; the fields it changed.
    Spec { name: String, changed: Vec<String> },
    /// The named `KinferencePool`'s spec is invalid: the router's settings stand.
    Invalid { name: String, errors: Vec<String> },
}

/// Reads the `KinferencePool` naming `pool`'s `InferencePool` (in its namespace, else
/// `namespace`) and applies its spec. A pool not discovered from an `InferencePool` is left
/// alone (`Absent`).
pub async fn apply_to_pool(
    client: &Client,
    pool: &mut PoolConfig,
    namespace: &str,
) -> Result<Applied, PoolError> {
    let Some(source) = pool.inference_pool.clone() else {
        return Ok(Applied::Absent);
    };
    let ns = source.namespace.as_deref().unwrap_or(namespace);
    let api: Api<KinferencePool> = Api::namespaced(client.clone(), ns);
    let list = api.list(&ListParams::default()).await.map_err(|e| {
        Watched {
            group: "kinference.io",
            version: "v1alpha1",
            resource: "kinferencepools",
            namespace: ns.to_owned(),
        }
        .classify_client("list", &e)
    })?;
    let ours = list
        .items
        .into_iter()
        .filter(|o| o.spec.pool_ref.name == source.name)
        .min_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    Ok(match ours {
        None => Applied::Absent,
        Some(o) => {
            let name = o.metadata.name.clone().unwrap_or_default();
            match overlay(pool, &o.spec) {
                Ok(changed) => Applied::Spec { name, changed },
                Err(errors) => Applied::Invalid { name, errors },
            }
        }
    })
}

/// Applies `spec` to `pool` (pure): every field it changed, or the spec's problems (and
/// `pool` untouched).
pub fn overlay(
    pool: &mut PoolConfig,
    spec: &KinferencePoolSpec,
) -> Result<Vec<String>, Vec<String>> {
    let errors = spec.validate();
    if !errors.is_empty() {
        return Err(errors);
    }
    let policy = spec
        .policy
        .policy_config()
        .map_err(|e| vec![e.to_string()])?;
    let mut changed = Vec::new();
    let mut set = |field: &str, differs: bool| {
        if differs {
            changed.push(field.to_owned());
        }
    };
    let tokenizer = std::path::PathBuf::from(&spec.tokenizer.path);
    set("tokenizer", pool.tokenizer != tokenizer);
    set("blockSize", pool.block_size != spec.hashing.block_size);
    set("algorithm", pool.hash_algo != spec.hashing.algorithm);
    set("seed", pool.hash_seed != spec.hashing.seed);
    set("policy", pool.policy != policy);
    let header = spec.policy.session_header.clone();
    set(
        "sessionHeader",
        header.is_some() && pool.session_header != header,
    );
    pool.tokenizer = tokenizer;
    pool.block_size = spec.hashing.block_size;
    pool.hash_algo = spec.hashing.algorithm.clone();
    pool.hash_seed = spec.hashing.seed.clone();
    pool.policy = policy;
    if header.is_some() {
        pool.session_header = header;
    }
    Ok(changed)
}

/// Applies every discovered pool's `KinferencePool` and logs what happened; a pool whose
/// `KinferencePool` cannot be read or is invalid keeps the router's settings.
pub async fn apply_to_pools(client: &Client, pools: &mut [PoolConfig], namespace: &str) {
    for pool in pools.iter_mut().filter(|p| p.inference_pool.is_some()) {
        let label = pool.name.clone().or_else(|| pool.models.first().cloned());
        let label = label.unwrap_or_default();
        match apply_to_pool(client, pool, namespace).await {
            Ok(Applied::Absent) => tracing::info!(pool = %label,
                "no KinferencePool names the InferencePool; routing with the router's own settings"),
            Ok(Applied::Spec { name, changed }) => tracing::info!(pool = %label,
                kinference_pool = %name, ?changed,
                "routing with the KinferencePool's policy, tokenizer and hashing"),
            Ok(Applied::Invalid { name, errors }) => tracing::error!(pool = %label,
                kinference_pool = %name, errors = %errors.join("; "),
                "the KinferencePool's spec is invalid; routing with the router's own settings"),
            Err(e) => tracing::warn!(pool = %label, error = %e,
                "the KinferencePool cannot be read; routing with the router's own settings"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{Hashing, PolicyKind, PoolRef, RoutingPolicy, TokenizerSource};

    fn spec() -> KinferencePoolSpec {
        KinferencePoolSpec {
            pool_ref: PoolRef { name: "p".into() },
            models: vec!["m".into()],
            tokenizer: TokenizerSource {
                path: "/tok".into(),
            },
            hashing: Hashing {
                block_size: 32,
                algorithm: "xxhash".into(),
                seed: Some("0".into()),
            },
            policy: RoutingPolicy {
                kind: PolicyKind::LeastLoad,
                ..RoutingPolicy::default()
            },
            events: Default::default(),
        }
    }

    #[test]
    fn the_spec_replaces_the_routers_settings() {
        let mut p = PoolConfig::new("m", "/other", 16);
        let changed = overlay(&mut p, &spec()).unwrap_or_default();
        assert_eq!(
            changed,
            ["tokenizer", "blockSize", "algorithm", "seed", "policy"]
        );
        assert_eq!((p.block_size, p.hash_algo.as_str()), (32, "xxhash"));
        assert_eq!(p.hash_seed.as_deref(), Some("0"));
        assert_eq!(p.tokenizer, std::path::PathBuf::from("/tok"));
        assert_eq!(p.policy.name(), "least-load");
        assert_eq!(overlay(&mut p, &spec()), Ok(Vec::new()));
    }

    #[test]
    fn an_invalid_spec_changes_nothing() {
        let mut p = PoolConfig::new("m", "/other", 16);
        let before = p.clone();
        let mut bad = spec();
        bad.hashing.block_size = 0;
        assert!(overlay(&mut p, &bad).is_err());
        assert_eq!(p, before);
    }
}
