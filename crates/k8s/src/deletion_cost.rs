//! Cache-aware scale-in: keeps each pod's `controller.kubernetes.io/pod-deletion-cost`
//! annotation at the router's scale-in cost of its replicas (the tokens of the prefixes they
//! recently served from cache that no other replica holds; see the pool's `scale_in`
//! setting), so that a ReplicaSet or LeaderWorkerSet scaling down deletes the pod whose cache
//! is worth least first.
//!
//! Invariants: off unless the pool's `scale_in.pod_deletion_cost` is set (writing pods needs
//! `patch` on them, which the chart grants only then); one look every `scale_in.interval_s`,
//! at most `scale_in.max_patches` pods written per look, and a pod is written only when its
//! cost moved by more than the hysteresis since the value this router last wrote ([`plan`]),
//! so a steady fleet leaves the API server alone. Only the one annotation is changed, by a
//! JSON merge patch (no read-modify-write of the pod). A failed write is logged and tried
//! again at the next look; it never stops routing or the pool's discovery.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use kinference_proxy::PoolMembers;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;

/// The annotation the ReplicaSet controller reads when it picks pods to delete: lower first.
pub const ANNOTATION_POD_DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";

/// The annotation's value for a cost: the cost rounded, within what the annotation takes
/// (an int32; costs are never negative).
pub fn annotation_value(cost: f64) -> i32 {
    if cost.is_nan() || cost <= 0.0 {
        return 0;
    }
    cost.round().min(f64::from(i32::MAX)) as i32
}

/// The pods to write at this look, with their new values, most changed first: every pod
/// with no value written yet, and every pod whose value moved by more than `hysteresis` of
/// the larger of the old and the new value; at most `max`.
pub fn plan(
    written: &BTreeMap<String, i32>,
    costs: &[(String, f64)],
    hysteresis: f64,
    max: usize,
) -> Vec<(String, i32)> {
    let mut due: Vec<(u64, &String, i32)> = costs
        .iter()
        .map(|(pod, c)| (pod, annotation_value(*c)))
        .filter_map(|(pod, v)| match written.get(pod) {
            None => Some((u64::MAX, pod, v)),
            Some(&w) => {
                let moved = (i64::from(v) - i64::from(w)).unsigned_abs();
                let band = hysteresis * f64::from(v.max(w));
                (moved > 0 && moved as f64 > band).then_some((moved, pod, v))
            }
        })
        .collect();
    due.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));
    due.into_iter()
        .take(max)
        .map(|(_, pod, v)| (pod.clone(), v))
        .collect()
}

/// Keeps the annotations of `members`' pods (in `namespace`) current while the pool's
/// `scale_in.pod_deletion_cost` is set; runs until aborted.
pub async fn run(client: Client, members: PoolMembers, namespace: String) {
    let api: Api<Pod> = Api::namespaced(client, &namespace);
    let mut written: BTreeMap<String, i32> = BTreeMap::new();
    let mut failing = false;
    loop {
        let settings = members.settings().scale_in;
        tokio::time::sleep(settings.interval()).await;
        if !settings.pod_deletion_cost {
            continue;
        }
        let costs = members.scale_in_costs();
        written.retain(|pod, _| costs.iter().any(|(p, _)| p == pod));
        let due = plan(&written, &costs, settings.hysteresis, settings.max_patches);
        let mut failed = None;
        for (pod, value) in due {
            let patch = json!({"metadata": {"annotations": {
                ANNOTATION_POD_DELETION_COST: value.to_string()
            }}});
            match api
                .patch(&pod, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    tracing::debug!(pool = %members.name(), %pod, value, "pod deletion cost written");
                    written.insert(pod, value);
                }
                // Gone meanwhile: the next look no longer lists it.
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => failed = Some((pod, e)),
            }
        }
        match failed {
            Some((pod, e)) if !failing => {
                failing = true;
                let hint = match &e {
                    kube::Error::Api(s) if s.code == 403 => {
                        "; the router needs patch on pods (the chart's scaleIn.podDeletionCost)"
                    }
                    _ => "",
                };
                tracing::warn!(pool = %members.name(), %pod, error = %e,
                    "cannot write the pod deletion cost{hint}; trying again at every look");
            }
            Some(_) => {}
            None if failing => {
                failing = false;
                tracing::info!(pool = %members.name(), "pod deletion costs are written again");
            }
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs(cs: &[(&str, f64)]) -> Vec<(String, f64)> {
        cs.iter().map(|(p, c)| ((*p).to_owned(), *c)).collect()
    }

    #[test]
    fn values_are_rounded_non_negative_int32s() {
        assert_eq!(annotation_value(0.4), 0);
        assert_eq!(annotation_value(1.5), 2);
        assert_eq!(annotation_value(-3.0), 0);
        assert_eq!(annotation_value(f64::NAN), 0);
        assert_eq!(annotation_value(1e12), i32::MAX);
    }

    #[test]
    fn every_pod_is_written_once_then_only_when_it_moves_past_the_hysteresis() {
        let mut written = BTreeMap::new();
        let first = plan(&written, &costs(&[("a", 1000.0), ("b", 0.0)]), 0.25, 10);
        assert_eq!(first, [("a".to_owned(), 1000), ("b".to_owned(), 0)]);
        written.extend(first);
        // a: 1000 → 1200 moved 200 ≤ 25 % of 1200; b did not move.
        let quiet = plan(&written, &costs(&[("a", 1200.0), ("b", 0.3)]), 0.25, 10);
        assert!(quiet.is_empty(), "{quiet:?}");
        let exact = plan(&written, &costs(&[("a", 1001.0), ("b", 0.0)]), 0.0, 10);
        assert_eq!(exact, [("a".to_owned(), 1001)]);
        let moved = plan(&written, &costs(&[("a", 400.0), ("b", 700.0)]), 0.25, 10);
        assert_eq!(moved, [("b".to_owned(), 700), ("a".to_owned(), 400)]);
    }

    #[test]
    fn at_most_max_pods_per_look_largest_change_first_unwritten_before_all() {
        let written: BTreeMap<String, i32> = [("a".to_owned(), 0), ("b".to_owned(), 0)].into();
        let due = plan(
            &written,
            &costs(&[("a", 10.0), ("b", 900.0), ("c", 1.0)]),
            0.0,
            2,
        );
        assert_eq!(due, [("c".to_owned(), 1), ("b".to_owned(), 900)]);
    }
}
