//! The router's report on an `KinferencePool`, written to its `status` subresource with
//! server-side apply.
//!
//! Why server-side apply with one field manager ([`FIELD_MANAGER`]), and not a Lease-elected
//! writer: every router replica computes the status from its own view and applies it as the
//! same manager. The API server merges an apply by field owner, so replicas never get a 409
//! from each other (they are one owner), the request carries only the fields we own (no
//! read-modify-write race on `resourceVersion`), and applying what is already there changes
//! nothing (no new `resourceVersion`, no watch event), so agreeing replicas stay quiet. When
//! their views differ for a moment (one saw a pod leave first) the last apply wins until the
//! other catches up; no leader election, no extra RBAC on Leases, and no single point whose
//! loss stops status updates. Conditions keep their `lastTransitionTime` unless their status
//! changes, which is what keeps a repeated apply a no-op.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;

use crate::crd::{
    HitRate, KinferencePool, KinferencePoolStatus, CONDITION_ACCEPTED, CONDITION_HASHING_VERIFIED,
    CONDITION_READY,
};

/// The one field manager of every router replica.
pub const FIELD_MANAGER: &str = "kinference-router";

/// A condition as the router judges it: true, or false with a reason and message.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    True { reason: String, message: String },
    False { reason: String, message: String },
    Unknown { reason: String, message: String },
}

/// What the router knows about one pool, to be reported.
#[derive(Clone, Debug, PartialEq)]
pub struct StatusReport {
    pub ready: Verdict,
    pub hashing_verified: Verdict,
    /// Whether the router routes with the spec of `generation`.
    pub accepted: Verdict,
    /// The generation the conditions were judged against (the conditions'
    /// `observedGeneration`); `None`: the object's own.
    pub generation: Option<i64>,
    /// The generation whose spec the router routes with (`status.observedGeneration`), if any.
    pub applied_generation: Option<i64>,
    pub replicas: i32,
    pub scorable_replicas: i32,
    pub predicted_hit_rate: Option<f64>,
    pub reported_hit_rate: Option<f64>,
}

#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("reading KinferencePool {name}: {source}")]
    Get { name: String, source: kube::Error },
    #[error("applying the status of KinferencePool {name}: {source}")]
    Apply { name: String, source: kube::Error },
}

impl StatusError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            StatusError::Get { .. } => "get",
            StatusError::Apply { .. } => "apply",
        }
    }
}

/// Writes status as [`FIELD_MANAGER`].
#[derive(Clone, Debug)]
pub struct StatusWriter {
    api: Api<KinferencePool>,
}

impl StatusWriter {
    pub fn new(client: Client, namespace: &str) -> Self {
        StatusWriter {
            api: Api::namespaced(client, namespace),
        }
    }

    /// Applies `report` as `name`'s status; `now` stamps conditions that change.
    pub async fn apply(
        &self,
        name: &str,
        report: &StatusReport,
        now: Timestamp,
    ) -> Result<KinferencePool, StatusError> {
        let current = self
            .api
            .get(name)
            .await
            .map_err(|source| StatusError::Get {
                name: name.to_owned(),
                source,
            })?;
        let status = status_for(&current, report, now);
        let patch = json!({
            "apiVersion": "kinference.io/v1alpha1",
            "kind": "KinferencePool",
            "status": status,
        });
        let params = PatchParams::apply(FIELD_MANAGER).force();
        self.api
            .patch_status(name, &params, &Patch::Apply(&patch))
            .await
            .map_err(|source| StatusError::Apply {
                name: name.to_owned(),
                source,
            })
    }
}

/// The status to apply on `current` (pure: what is applied depends only on its arguments).
pub fn status_for(
    current: &KinferencePool,
    report: &StatusReport,
    now: Timestamp,
) -> KinferencePoolStatus {
    let generation = report.generation.or(current.metadata.generation);
    let old = current
        .status
        .as_ref()
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default();
    let conditions = [
        (CONDITION_READY, &report.ready),
        (CONDITION_HASHING_VERIFIED, &report.hashing_verified),
        (CONDITION_ACCEPTED, &report.accepted),
    ]
    .into_iter()
    .map(|(ty, v)| condition(old, ty, v, generation, now))
    .collect();
    let hit_rate = (report.predicted_hit_rate.is_some() || report.reported_hit_rate.is_some())
        .then(|| HitRate {
            predicted: report.predicted_hit_rate.map(round4),
            reported: report.reported_hit_rate.map(round4),
        });
    KinferencePoolStatus {
        observed_generation: report.applied_generation,
        conditions,
        replicas: Some(report.replicas),
        scorable_replicas: Some(report.scorable_replicas),
        hit_rate,
    }
}

/// Four decimals: finer changes would make every apply a write without telling anyone more.
fn round4(x: f64) -> f64 {
    (x * 10_000.0).round() / 10_000.0
}

fn condition(
    old: &[Condition],
    ty: &str,
    verdict: &Verdict,
    generation: Option<i64>,
    now: Timestamp,
) -> Condition {
    let (status, reason, message) = match verdict {
        Verdict::True { reason, message } => ("True", reason, message),
        Verdict::False { reason, message } => ("False", reason, message),
        Verdict::Unknown { reason, message } => ("Unknown", reason, message),
    };
    // The API server keeps whole seconds; a sub-second stamp would differ from what it stored.
    let now = Timestamp::from_second(now.as_second()).unwrap_or(now);
    let since = old
        .iter()
        .find(|c| c.type_ == ty && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(Time(now));
    Condition {
        type_: ty.to_owned(),
        status: status.to_owned(),
        reason: reason.clone(),
        message: message.clone(),
        observed_generation: generation,
        last_transition_time: since,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{Hashing, KinferencePoolSpec, PoolRef, TokenizerSource};

    fn routing(status: Option<KinferencePoolStatus>) -> KinferencePool {
        let mut r = KinferencePool::new(
            "r1",
            KinferencePoolSpec {
                pool_ref: PoolRef { name: "p".into() },
                models: vec!["m".into()],
                tokenizer: TokenizerSource { path: "/t".into() },
                hashing: Hashing {
                    block_size: 16,
                    algorithm: "sha256".into(),
                    seed: None,
                },
                policy: Default::default(),
                events: Default::default(),
            },
        );
        r.metadata.generation = Some(3);
        r.status = status;
        r
    }

    fn report(ready: bool) -> StatusReport {
        let v = |b: bool| {
            if b {
                Verdict::True {
                    reason: "Routing".into(),
                    message: "ok".into(),
                }
            } else {
                Verdict::False {
                    reason: "NoEndpoints".into(),
                    message: "no ready pod".into(),
                }
            }
        };
        StatusReport {
            ready: v(ready),
            hashing_verified: v(true),
            accepted: v(true),
            generation: None,
            applied_generation: Some(3),
            replicas: 2,
            scorable_replicas: 1,
            predicted_hit_rate: Some(0.123456),
            reported_hit_rate: None,
        }
    }

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap_or(Timestamp::UNIX_EPOCH)
    }

    #[test]
    fn transition_time_moves_only_when_status_changes() {
        let first = status_for(&routing(None), &report(true), t(100));
        assert_eq!(first.observed_generation, Some(3));
        assert_eq!(first.conditions[0].last_transition_time, Time(t(100)));
        assert_eq!(
            first.hit_rate.as_ref().and_then(|h| h.predicted),
            Some(0.1235)
        );
        // Same verdict later: same status, so a repeated apply changes nothing.
        let again = status_for(&routing(Some(first.clone())), &report(true), t(200));
        assert_eq!(again, first);
        // Ready flips: its time moves, HashingVerified's does not.
        let flipped = status_for(&routing(Some(first)), &report(false), t(300));
        assert_eq!(flipped.conditions[0].last_transition_time, Time(t(300)));
        assert_eq!(flipped.conditions[0].status, "False");
        assert_eq!(flipped.conditions[1].last_transition_time, Time(t(100)));
    }

    #[test]
    fn observed_generation_is_the_applied_one_and_conditions_carry_the_judged_one() {
        let mut refused = report(true);
        refused.accepted = Verdict::False {
            reason: "InvalidSpec".into(),
            message: "hashing.blockSize: must be positive".into(),
        };
        refused.generation = Some(4);
        let s = status_for(&routing(None), &refused, t(100));
        assert_eq!(s.observed_generation, Some(3));
        let accepted = s.conditions.iter().find(|c| c.type_ == "Accepted").unwrap();
        assert_eq!(
            (accepted.status.as_str(), accepted.observed_generation),
            ("False", Some(4))
        );
        refused.applied_generation = None;
        let none = status_for(&routing(None), &refused, t(100));
        assert_eq!(none.observed_generation, None);
    }
}
