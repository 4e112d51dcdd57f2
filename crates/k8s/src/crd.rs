//! The `kinference.io/v1alpha1` API: `KinferencePool`, what an `InferencePool` cannot say
//! about a pool (how to route it, how its replicas hash blocks, where their KV events are), and
//! the status the router reports back.
//!
//! Invariants: the Rust types are the source of truth; the YAML in
//! `charts/kinference-crds/crds/` is [`crd_files`]'s output, and a test fails when they differ.
//! Settings that other crates own are validated by those crates ([`PolicyConfig::validate`],
//! [`HashAlgo`]'s parser), so the CRD accepts exactly what the router's config file accepts.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kinference_policy::{ConfigErrors, PolicyConfig};
use kinference_vllm::{HashAlgo, HashError};
use kube::{CustomResource, CustomResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

/// In `spec.events.topic`: the pod's IP.
pub const TOPIC_HOST: &str = "{host}";
/// In `spec.events.topic`: the first of `spec.models`.
pub const TOPIC_MODEL: &str = "{model}";

/// Condition type: the router has endpoints to route to and reads the pool without error.
pub const CONDITION_READY: &str = "Ready";
/// Condition type: the replicas' KV events agree with the configured hashing (block size,
/// algorithm, seed), so cached-prefix predictions can be trusted.
pub const CONDITION_HASHING_VERIFIED: &str = "HashingVerified";
/// Condition type: the router routes with this generation of the spec (`False`: the spec
/// cannot be applied, and the router routes with the last one that could, whose generation is
/// `status.observedGeneration`).
pub const CONDITION_ACCEPTED: &str = "Accepted";

/// How kinference routes one `InferencePool`'s pods: policy, tokenizer, the hashing the vLLM
/// pods run with, and where their KV events are.
// Clippy reads each `printcolumn(type_ = ...)` of the derive as a repeated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Deserialize, Serialize, JsonSchema)]
#[kube(
    group = "kinference.io",
    version = "v1alpha1",
    kind = "KinferencePool",
    plural = "kinferencepools",
    shortname = "kpool",
    category = "kinference",
    namespaced,
    status = "KinferencePoolStatus",
    doc = "kinference's settings for one InferencePool (same namespace); status is written by the router",
    printcolumn(name = "Pool", type_ = "string", json_path = ".spec.poolRef.name"),
    printcolumn(name = "Policy", type_ = "string", json_path = ".spec.policy.kind"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Hashing",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"HashingVerified\")].status"
    ),
    printcolumn(
        name = "Accepted",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status",
        description = "whether the router routes with this generation of the spec"
    ),
    printcolumn(name = "Replicas", type_ = "integer", json_path = ".status.replicas"),
    printcolumn(
        name = "Scorable",
        type_ = "integer",
        json_path = ".status.scorableReplicas"
    ),
    printcolumn(
        name = "Predicted",
        type_ = "number",
        json_path = ".status.hitRate.predicted",
        description = "prefix-cache hit rate the router predicted"
    ),
    printcolumn(
        name = "Reported",
        type_ = "number",
        json_path = ".status.hitRate.reported",
        description = "prefix-cache hit rate the replicas reported"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct KinferencePoolSpec {
    /// The `InferencePool` (same namespace) whose pods this routes to.
    pub pool_ref: PoolRef,
    /// The `model` values routed to this pool (vLLM's `--served-model-name`).
    pub models: Vec<String>,
    pub tokenizer: TokenizerSource,
    pub hashing: Hashing,
    #[serde(default)]
    pub policy: RoutingPolicy,
    #[serde(default)]
    pub events: EventsSettings,
}

/// A reference to an `InferencePool` in the same namespace.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize, JsonSchema)]
pub struct PoolRef {
    pub name: String,
}

/// Where the router finds the model's tokenizer.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize, JsonSchema)]
pub struct TokenizerSource {
    /// Directory in the router's filesystem with `tokenizer.json` (and `tokenizer_config.json`
    /// for chat), e.g. a mounted volume.
    pub path: String,
}

/// How the pool's vLLM replicas hash blocks; must match their flags exactly.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Hashing {
    /// Tokens per KV block (`--block-size`).
    #[schemars(range(min = 1))]
    pub block_size: u32,
    /// `--prefix-caching-hash-algo`.
    #[serde(default = "default_algo")]
    #[schemars(schema_with = "hash_algo_schema")]
    pub algorithm: String,
    /// The replicas' `PYTHONHASHSEED` (required by the xxhash algorithms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<String>,
}

fn default_algo() -> String {
    HashAlgo::default().as_str().to_owned()
}

fn hash_algo_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let names: Vec<&str> = HashAlgo::ALL.iter().map(|a| a.as_str()).collect();
    schemars::json_schema!({"type": "string", "enum": names, "default": default_algo()})
}

/// The routing policy and its weights; unset weights keep the policy's defaults.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RoutingPolicy {
    #[serde(default)]
    pub kind: PolicyKind,
    /// Cache-vs-load weights of the `precise` and `approximate` policies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<PolicyWeights>,
    /// `approximate` only: how long a routed prefix is assumed cached, milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// `approximate` only: upper bound on remembered (block, worker) entries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u64>,
    /// `session-affinity` only: the request header holding the session key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_header: Option<String>,
}

/// The policies of `kinference-policy`, by their config-file names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    #[default]
    Precise,
    Approximate,
    RoundRobin,
    LeastLoad,
    SessionAffinity,
}

/// The knobs of `kinference_policy::PreciseConfig`, camelCased; the meaning and units of each
/// are documented there and in `docs/config.md`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyWeights {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_weight_tokens: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fair_share_cap: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fair_share_slack: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offload_credit: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_prefill_weight: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_pressure_threshold: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_pressure_tokens: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculative_ttl_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculative_capacity: Option<u64>,
}

/// Where the replicas' KV events come from. Unset: each pod is asked (`GET /kv_event_sources`),
/// unless its `kinference.io/kv-events-endpoint` annotation says otherwise.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EventsSettings {
    /// Every pod publishes on this port of its own IP (vLLM `endpoint: tcp://*:PORT`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// Every pod's replay ROUTER port (vLLM `replay_endpoint: tcp://*:PORT`), with `port` or
    /// `bind`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_port: Option<u16>,
    /// The router binds this endpoint and every pod's publisher connects to it (vLLM
    /// `endpoint: tcp://ROUTER:PORT`), e.g. `tcp://0.0.0.0:5557`; the pods are told apart by
    /// topic, so `topic` must contain `{host}`. Exclusive with `port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bind: Option<String>,
    /// vLLM's `topic` (default empty). `{host}` stands for each pod's IP and `{model}` for the
    /// first of `models` (llm-d's convention: `kv@{host}@{model}`, the pod running with
    /// `"topic": "kv@$(POD_IP)@MODEL"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic: Option<String>,
}

/// `KinferencePool.status`, written by the router (server-side apply, see `status`).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KinferencePoolStatus {
    /// The `metadata.generation` of the spec the router routes with (the last one it could
    /// apply; a later one it could not is `Accepted` `False`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `HashingVerified` and `Accepted`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Ready pods of the pool the router routes to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// Of those, the ones whose KV events the router follows (cached prefixes known).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scorable_replicas: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hit_rate: Option<HitRate>,
}

/// Prefix-cache hit rates, 0 to 1, over the router's recent requests.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
pub struct HitRate {
    /// What the router's index predicted when it routed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted: Option<f64>,
    /// What the replicas reported (vLLM's prefix-cache metrics).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reported: Option<f64>,
}

impl KinferencePoolSpec {
    /// Every problem with the spec, each prefixed with its field; empty when the router can use
    /// it as is.
    pub fn validate(&self) -> Vec<String> {
        let mut errs = Vec::new();
        if self.models.is_empty() {
            errs.push("models: name at least one served model".to_owned());
        }
        if self.hashing.block_size == 0 {
            errs.push("hashing.blockSize: must be positive".to_owned());
        }
        if let Err(e) = self.hashing.hash_algo() {
            errs.push(e.to_string());
        }
        if let Err(e) = self.policy.policy_config() {
            errs.push(e.to_string());
        }
        if self.events.bind.is_some() && self.events.port.is_some() {
            errs.push("events: set either bind (pods connect to the router) or port (the router dials each pod), not both".to_owned());
        }
        let per_pod = self
            .events
            .topic
            .as_deref()
            .is_some_and(|t| t.contains(TOPIC_HOST));
        if self.events.bind.is_some() && !per_pod {
            errs.push(format!("events.topic: with bind, every pod publishes to one endpoint and is told apart by its topic: include {TOPIC_HOST} (its IP), e.g. kv@{TOPIC_HOST}@{TOPIC_MODEL}"));
        }
        errs
    }

    /// `events` as the pods' event sources are computed from it: `{model}` in the topic
    /// replaced by the first model (`{host}` is each pod's, see `snapshot`).
    pub fn pod_events(&self) -> EventsSettings {
        let mut e = self.events.clone();
        if let (Some(t), Some(m)) = (&mut e.topic, self.models.first()) {
            *t = t.replace(TOPIC_MODEL, m);
        }
        e
    }
}

/// Why a `KinferencePool`'s policy or hashing cannot be used; shown in its `Accepted`
/// condition.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("policy: {0}")]
    PolicyShape(#[source] serde_json::Error),
    #[error("policy: {0}")]
    Policy(#[source] ConfigErrors),
    #[error("hashing.algorithm: {0}")]
    HashAlgo(#[source] HashError),
}

impl RoutingPolicy {
    /// The router's [`PolicyConfig`], through the policy crate's own parser and validation.
    pub fn policy_config(&self) -> Result<PolicyConfig, SpecError> {
        let kind = serde_json::to_value(self.kind).map_err(SpecError::PolicyShape)?;
        let mut obj = Map::new();
        obj.insert("kind".into(), kind);
        let weights = self.weights.as_ref().map(PolicyWeights::snake_case);
        match self.kind {
            PolicyKind::Precise => obj.extend(weights.unwrap_or_default()),
            PolicyKind::Approximate => {
                if let Some(w) = weights {
                    obj.insert("scoring".into(), Value::Object(w));
                }
                if let Some(t) = self.ttl_ms {
                    obj.insert("ttl_ms".into(), json!(t));
                }
                if let Some(c) = self.capacity {
                    obj.insert("capacity".into(), json!(c));
                }
            }
            PolicyKind::RoundRobin | PolicyKind::LeastLoad | PolicyKind::SessionAffinity => {}
        }
        let cfg: PolicyConfig =
            serde_json::from_value(Value::Object(obj)).map_err(SpecError::PolicyShape)?;
        cfg.checked().map_err(SpecError::Policy)
    }
}

impl PolicyWeights {
    /// The set weights under the policy config's (snake_case) names.
    fn snake_case(&self) -> Map<String, Value> {
        let mut m = Map::new();
        let floats = [
            ("load_weight_tokens", self.load_weight_tokens),
            ("fair_share_cap", self.fair_share_cap),
            ("fair_share_slack", self.fair_share_slack),
            ("offload_credit", self.offload_credit),
            ("pending_prefill_weight", self.pending_prefill_weight),
            ("kv_pressure_threshold", self.kv_pressure_threshold),
            ("kv_pressure_tokens", self.kv_pressure_tokens),
        ];
        for (k, v) in floats {
            if let Some(v) = v {
                m.insert(k.into(), json!(v));
            }
        }
        let ints = [
            ("speculative_ttl_ms", self.speculative_ttl_ms),
            ("speculative_capacity", self.speculative_capacity),
        ];
        for (k, v) in ints {
            if let Some(v) = v {
                m.insert(k.into(), json!(v));
            }
        }
        m
    }
}

impl Hashing {
    /// The algorithm, checked by the hashing crate's parser.
    pub fn hash_algo(&self) -> Result<HashAlgo, SpecError> {
        self.algorithm.parse().map_err(SpecError::HashAlgo)
    }
}

/// Every CRD of the `kinference.io` group.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![KinferencePool::crd()]
}

/// Each CRD as the chart holds it: (`kinference.io_<plural>.yaml`, its YAML).
pub fn crd_files() -> Result<Vec<(String, String)>, serde_yaml_ng::Error> {
    crds()
        .into_iter()
        .map(|crd| {
            let file = format!("{}_{}.yaml", crd.spec.group, crd.spec.names.plural);
            Ok((file, serde_yaml_ng::to_string(&crd)?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_goes_through_the_policy_crate() {
        let p = RoutingPolicy {
            kind: PolicyKind::Precise,
            weights: Some(PolicyWeights {
                load_weight_tokens: Some(512.0),
                speculative_ttl_ms: Some(500),
                ..PolicyWeights::default()
            }),
            ..RoutingPolicy::default()
        };
        let PolicyConfig::Precise(c) = p.policy_config().unwrap() else {
            panic!("not precise")
        };
        assert_eq!(c.load_weight_tokens, 512.0);
        assert_eq!(c.speculative_ttl, std::time::Duration::from_millis(500));

        let approx = RoutingPolicy {
            kind: PolicyKind::Approximate,
            ttl_ms: Some(1000),
            ..RoutingPolicy::default()
        };
        assert_eq!(approx.policy_config().unwrap().name(), "approximate");

        let bad = RoutingPolicy {
            weights: Some(PolicyWeights {
                fair_share_cap: Some(0.5),
                ..PolicyWeights::default()
            }),
            ..RoutingPolicy::default()
        };
        let e = bad.policy_config().unwrap_err().to_string();
        assert!(
            e.starts_with("policy: ") && e.contains("fair_share_cap"),
            "{e}"
        );
    }

    #[test]
    fn spec_parses_from_yaml_with_defaults() {
        let spec: KinferencePoolSpec = serde_yaml_ng::from_str(
            "poolRef: {name: llama}\nmodels: [m]\ntokenizer: {path: /tok}\nhashing: {blockSize: 16}\n",
        )
        .unwrap();
        assert_eq!(spec.hashing.hash_algo().unwrap(), HashAlgo::Sha256);
        assert_eq!(spec.policy.policy_config().unwrap().name(), "precise");
        let bad = Hashing {
            block_size: 16,
            algorithm: "md5".into(),
            seed: None,
        };
        assert!(bad.hash_algo().is_err());
        assert!(spec.validate().is_empty());
        let mut both = spec.clone();
        both.events.port = Some(5557);
        both.events.bind = Some("tcp://0.0.0.0:5557".into());
        both.hashing = bad;
        let errs = both.validate();
        assert_eq!(errs.len(), 3, "{errs:?}");
        assert!(errs[2].contains("{host}"), "{errs:?}");
        let mut shared = spec.clone();
        shared.events.bind = Some("tcp://0.0.0.0:5557".into());
        shared.events.topic = Some("kv@{host}@{model}".into());
        assert!(shared.validate().is_empty());
        assert_eq!(shared.pod_events().topic.as_deref(), Some("kv@{host}@m"));
    }

    #[test]
    fn schema_lists_the_hash_algorithms() {
        let yaml = serde_yaml_ng::to_string(&KinferencePool::crd()).unwrap();
        for a in HashAlgo::ALL {
            assert!(yaml.contains(&format!("- {}", a.as_str())), "{a:?}");
        }
    }
}
