//! What discovery hands the router: an immutable [`PoolSnapshot`] of one pool's endpoints, and
//! [`diff`], the pure comparison of two snapshots the router applies (joined, left, changed).
//!
//! Invariants: a snapshot is a pure function of the pool, its pods and its `KinferencePool`
//! ([`endpoints`]); only pods with an IP, `Ready=True` and no `deletionTimestamp` are endpoints;
//! `revision` grows by one each time the published content changes; applying `diff(a, b)` to
//! `a`'s endpoints gives exactly `b`'s.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Pod;

use crate::crd::{EventsSettings, KinferencePoolSpec};
use crate::error::PoolError;
use crate::gie::InferencePool;

/// Per-pod override of where its KV events come from: `tcp://HOST:PORT`, where a wildcard host
/// (`*`, `0.0.0.0`, `::`) means the pod's own IP.
pub const ANNOTATION_KV_EVENTS: &str = "kinference.io/kv-events-endpoint";
/// Per-pod replay ROUTER endpoint (vLLM `replay_endpoint`), same form.
pub const ANNOTATION_KV_EVENTS_REPLAY: &str = "kinference.io/kv-events-replay-endpoint";
/// Annotations with this prefix are carried into [`Endpoint::annotations`]; others are not, so
/// unrelated writes (`kubectl apply`'s last-applied record) do not show up as changes.
pub const ANNOTATION_PREFIX: &str = "kinference.io/";

/// The wire protocol of a pool's model servers (`InferencePool.spec.appProtocol`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AppProtocol {
    /// HTTP/1.1 (`http`, or unset).
    #[default]
    Http,
    /// HTTP/2 without TLS, prior knowledge (`kubernetes.io/h2c`).
    H2c,
}

/// Where one endpoint's KV events come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventSource {
    /// Ask the replica (`GET /kv_event_sources`); the router's default.
    Discover,
    /// Dial the publisher at this base address, with an optional replay ROUTER.
    Connect {
        endpoint: String,
        replay: Option<String>,
        topic: String,
    },
    /// The publisher connects to this address, which the router binds (shared by the pool,
    /// each pod told apart by its topic), with an optional replay ROUTER on the pod.
    Bind {
        endpoint: String,
        replay: Option<String>,
        topic: String,
    },
}

/// One ready pod of the pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub ip: IpAddr,
    /// `http://IP:PORT`, one per target port, in the pool's order.
    pub urls: Vec<String>,
    pub protocol: AppProtocol,
    pub labels: BTreeMap<String, String>,
    /// The pod's `kinference.io/*` annotations.
    pub annotations: BTreeMap<String, String>,
    pub events: EventSource,
}

/// Whether the snapshot can be trusted, and if not, why.
#[derive(Clone, Debug, PartialEq)]
pub enum PoolState {
    /// Nothing listed yet.
    Syncing,
    Ready,
    /// The last read failed. The endpoints are the last ones known (empty when the pool itself
    /// is gone or was never read).
    Error(PoolError),
}

/// The pool's `KinferencePool`: its spec, not its status (which the router writes, so
/// that writing it does not come back as a change).
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    pub name: String,
    /// `metadata.generation`, for `status.observedGeneration`.
    pub generation: Option<i64>,
    pub spec: KinferencePoolSpec,
}

/// One pool as discovered: the router's whole view of it.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolSnapshot {
    pub namespace: String,
    pub pool: String,
    /// Grows by one with each published change.
    pub revision: u64,
    /// The pool's `metadata.generation`, once read.
    pub pool_generation: Option<i64>,
    /// The `KinferencePool` naming this pool, if any (and if watched).
    pub routing: Option<Routing>,
    pub endpoints: BTreeMap<String, Endpoint>,
    pub state: PoolState,
}

impl PoolSnapshot {
    /// The snapshot before anything was read.
    pub fn syncing(namespace: &str, pool: &str) -> Self {
        PoolSnapshot {
            namespace: namespace.to_owned(),
            pool: pool.to_owned(),
            revision: 0,
            pool_generation: None,
            routing: None,
            endpoints: BTreeMap::new(),
            state: PoolState::Syncing,
        }
    }

    /// Equal apart from the revision: nothing to publish.
    pub fn same_content(&self, other: &PoolSnapshot) -> bool {
        self.pool_generation == other.pool_generation
            && self.routing == other.routing
            && self.endpoints == other.endpoints
            && self.state == other.state
    }
}

/// The protocol named by `spec.appProtocol`, or why it is not supported.
pub fn app_protocol(pool: &InferencePool) -> Result<AppProtocol, PoolError> {
    match pool.spec.app_protocol.as_deref() {
        None | Some("") | Some("http") => Ok(AppProtocol::Http),
        Some("kubernetes.io/h2c") => Ok(AppProtocol::H2c),
        Some(other) => Err(PoolError::Invalid(format!(
            "spec.appProtocol {other:?}: expected http or kubernetes.io/h2c"
        ))),
    }
}

/// A pod counts when it has a parseable IP, `Ready=True` and is not being deleted.
pub fn ready_ip(pod: &Pod) -> Option<IpAddr> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return None;
    }
    status.pod_ip.as_deref()?.parse().ok()
}

/// The endpoints of `pool` among `pods` (already filtered by the selector server-side; the
/// selector is checked again so a stale list never leaks a foreign pod in).
pub fn endpoints<'a>(
    pool: &InferencePool,
    pods: impl IntoIterator<Item = &'a Pod>,
    events: Option<&EventsSettings>,
) -> Result<BTreeMap<String, Endpoint>, PoolError> {
    let protocol = app_protocol(pool)?;
    let ports: Vec<u16> = pool.spec.target_ports.iter().map(|p| p.number).collect();
    if ports.is_empty() || ports.contains(&0) {
        return Err(PoolError::Invalid(
            "spec.targetPorts: at least one port in 1..=65535".to_owned(),
        ));
    }
    let selector = &pool.spec.selector.match_labels;
    if selector.is_empty() {
        return Err(PoolError::Invalid(
            "spec.selector.matchLabels is empty (it would select every pod)".to_owned(),
        ));
    }
    let mut out = BTreeMap::new();
    for pod in pods {
        let labels = pod.metadata.labels.clone().unwrap_or_default();
        let selected = selector.iter().all(|(k, v)| labels.get(k) == Some(v));
        let (Some(name), Some(ip), true) = (pod.metadata.name.clone(), ready_ip(pod), selected)
        else {
            continue;
        };
        let annotations: BTreeMap<String, String> = pod
            .metadata
            .annotations
            .iter()
            .flatten()
            .filter(|(k, _)| k.starts_with(ANNOTATION_PREFIX))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let endpoint = Endpoint {
            ip,
            urls: ports.iter().map(|p| url(ip, *p)).collect(),
            protocol,
            events: event_source(ip, &annotations, events),
            labels,
            annotations,
        };
        out.insert(name, endpoint);
    }
    Ok(out)
}

fn url(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(v4) => format!("http://{v4}:{port}"),
        IpAddr::V6(v6) => format!("http://[{v6}]:{port}"),
    }
}

fn host(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
    }
}

/// `tcp://*:P` (any wildcard host) → `tcp://POD_IP:P`; any other value is kept.
fn at_pod(endpoint: &str, ip: IpAddr) -> String {
    let wild = [
        "tcp://*:",
        "tcp://0.0.0.0:",
        "tcp://[::]:",
        "tcp://:::",
        "tcp://[*]:",
    ];
    for w in wild {
        if let Some(port) = endpoint.strip_prefix(w) {
            return format!("tcp://{}:{port}", host(ip));
        }
    }
    endpoint.to_owned()
}

/// Precedence: the pod's annotation, then the pool's `events` settings, then discovery. The
/// topic's `{host}` is the pod's IP.
fn event_source(
    ip: IpAddr,
    annotations: &BTreeMap<String, String>,
    pool: Option<&EventsSettings>,
) -> EventSource {
    let topic = pool
        .and_then(|e| e.topic.as_deref())
        .map(|t| t.replace(crate::crd::TOPIC_HOST, &ip.to_string()))
        .unwrap_or_default();
    if let Some(ep) = annotations.get(ANNOTATION_KV_EVENTS) {
        return EventSource::Connect {
            endpoint: at_pod(ep.trim(), ip),
            replay: annotations
                .get(ANNOTATION_KV_EVENTS_REPLAY)
                .map(|r| at_pod(r.trim(), ip)),
            topic,
        };
    }
    let Some(settings) = pool else {
        return EventSource::Discover;
    };
    if let Some(bind) = &settings.bind {
        return EventSource::Bind {
            endpoint: bind.clone(),
            replay: settings
                .replay_port
                .map(|p| format!("tcp://{}:{p}", host(ip))),
            topic,
        };
    }
    match settings.port {
        Some(port) => EventSource::Connect {
            endpoint: format!("tcp://{}:{port}", host(ip)),
            replay: settings
                .replay_port
                .map(|p| format!("tcp://{}:{p}", host(ip))),
            topic,
        },
        None => EventSource::Discover,
    }
}

/// What changed between two snapshots' endpoints, by pod name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SnapshotDiff {
    /// New endpoints.
    pub joined: Vec<(String, Endpoint)>,
    /// Endpoints gone (pod deleted, unready, terminating, relabelled out of the pool).
    pub left: Vec<String>,
    /// Endpoints whose IP, URLs, labels, annotations or event source changed: (old, new).
    pub changed: Vec<(String, Endpoint, Endpoint)>,
}

impl SnapshotDiff {
    pub fn is_empty(&self) -> bool {
        self.joined.is_empty() && self.left.is_empty() && self.changed.is_empty()
    }
}

/// The changes that turn `old`'s endpoints into `new`'s, each list sorted by pod name.
pub fn diff(old: &PoolSnapshot, new: &PoolSnapshot) -> SnapshotDiff {
    diff_endpoints(&old.endpoints, &new.endpoints)
}

/// [`diff`] over bare endpoint maps.
pub fn diff_endpoints(
    old: &BTreeMap<String, Endpoint>,
    new: &BTreeMap<String, Endpoint>,
) -> SnapshotDiff {
    let mut d = SnapshotDiff::default();
    for (name, e) in new {
        match old.get(name) {
            None => d.joined.push((name.clone(), e.clone())),
            Some(o) if o != e => d.changed.push((name.clone(), o.clone(), e.clone())),
            Some(_) => {}
        }
    }
    d.left = old
        .keys()
        .filter(|n| !new.contains_key(*n))
        .cloned()
        .collect();
    d
}

/// `old` with `d` applied: what a router holding `old` has after applying the diff.
pub fn apply(old: &BTreeMap<String, Endpoint>, d: &SnapshotDiff) -> BTreeMap<String, Endpoint> {
    let mut out = old.clone();
    for name in &d.left {
        out.remove(name);
    }
    for (name, e) in &d.joined {
        out.insert(name.clone(), e.clone());
    }
    for (name, _, e) in &d.changed {
        out.insert(name.clone(), e.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gie::{InferencePoolSpec, PoolSelector, TargetPort};
    use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use proptest::prelude::*;

    fn pool(ports: &[u16], proto: Option<&str>) -> InferencePool {
        InferencePool::new(
            "pool",
            InferencePoolSpec {
                selector: PoolSelector {
                    match_labels: [("app".to_owned(), "vllm".to_owned())].into(),
                },
                target_ports: ports.iter().map(|&number| TargetPort { number }).collect(),
                app_protocol: proto.map(str::to_owned),
                endpoint_picker_ref: None,
            },
        )
    }

    fn pod(name: &str, ip: Option<&str>, ready: &str, app: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                labels: Some([("app".to_owned(), app.to_owned())].into()),
                ..ObjectMeta::default()
            },
            spec: None,
            status: Some(PodStatus {
                pod_ip: ip.map(str::to_owned),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".to_owned(),
                    status: ready.to_owned(),
                    ..PodCondition::default()
                }]),
                ..PodStatus::default()
            }),
        }
    }

    #[test]
    fn only_ready_selected_live_pods_with_an_ip_are_endpoints() {
        let mut terminating = pod("d", Some("127.0.0.14"), "True", "vllm");
        terminating.metadata.deletion_timestamp =
            Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        let pods = [
            pod("a", Some("127.0.0.11"), "True", "vllm"),
            pod("b", Some("127.0.0.12"), "False", "vllm"),
            pod("c", None, "True", "vllm"),
            terminating,
            pod("e", Some("127.0.0.15"), "True", "other"),
            pod("f", Some("not-an-ip"), "True", "vllm"),
        ];
        let eps = endpoints(&pool(&[8000, 8001], None), &pods, None).unwrap();
        assert_eq!(eps.keys().collect::<Vec<_>>(), ["a"]);
        let a = &eps["a"];
        assert_eq!(a.urls, ["http://127.0.0.11:8000", "http://127.0.0.11:8001"]);
        assert_eq!(a.protocol, AppProtocol::Http);
        assert_eq!(a.events, EventSource::Discover);
    }

    #[test]
    fn app_protocol_and_ipv6() {
        let pods = [pod("a", Some("fd00::5"), "True", "vllm")];
        let eps = endpoints(&pool(&[8000], Some("kubernetes.io/h2c")), &pods, None).unwrap();
        assert_eq!(eps["a"].urls, ["http://[fd00::5]:8000"]);
        assert_eq!(eps["a"].protocol, AppProtocol::H2c);
        let bad = endpoints(&pool(&[8000], Some("grpc")), &pods, None).unwrap_err();
        assert_eq!(bad.metric_label(), "invalid");
        assert!(endpoints(&pool(&[], None), &pods, None).is_err());
    }

    #[test]
    fn event_source_precedence_annotation_then_pool_then_discover() {
        let settings = EventsSettings {
            port: Some(5557),
            replay_port: Some(5558),
            topic: Some("kv".into()),
            ..EventsSettings::default()
        };
        let mut annotated = pod("a", Some("127.0.0.11"), "True", "vllm");
        annotated.metadata.annotations = Some(
            [
                (ANNOTATION_KV_EVENTS.to_owned(), "tcp://*:6000".to_owned()),
                (
                    "kubectl.kubernetes.io/last-applied-configuration".to_owned(),
                    "{}".to_owned(),
                ),
            ]
            .into(),
        );
        let plain = pod("b", Some("127.0.0.12"), "True", "vllm");
        let eps = endpoints(&pool(&[8000], None), [&annotated, &plain], Some(&settings)).unwrap();
        assert_eq!(
            eps["a"].events,
            EventSource::Connect {
                endpoint: "tcp://127.0.0.11:6000".into(),
                replay: None,
                topic: "kv".into()
            }
        );
        assert_eq!(
            eps["a"].annotations.len(),
            1,
            "only kinference.io/ annotations"
        );
        assert_eq!(
            eps["b"].events,
            EventSource::Connect {
                endpoint: "tcp://127.0.0.12:5557".into(),
                replay: Some("tcp://127.0.0.12:5558".into()),
                topic: "kv".into()
            }
        );
        let shared = EventsSettings {
            bind: Some("tcp://0.0.0.0:5557".into()),
            replay_port: Some(5558),
            topic: Some("kv@{host}@m".into()),
            ..EventsSettings::default()
        };
        let eps = endpoints(&pool(&[8000], None), [&plain], Some(&shared)).unwrap();
        assert_eq!(
            eps["b"].events,
            EventSource::Bind {
                endpoint: "tcp://0.0.0.0:5557".into(),
                replay: Some("tcp://127.0.0.12:5558".into()),
                topic: "kv@127.0.0.12@m".into()
            }
        );
    }

    fn arb_endpoint() -> impl Strategy<Value = Endpoint> {
        (1u8..4, 0u8..3).prop_map(|(last, label)| {
            let ip = IpAddr::from([127, 0, 0, last]);
            Endpoint {
                ip,
                urls: vec![url(ip, 8000)],
                protocol: AppProtocol::Http,
                labels: [("v".to_owned(), label.to_string())].into(),
                annotations: BTreeMap::new(),
                events: EventSource::Discover,
            }
        })
    }

    fn arb_map() -> impl Strategy<Value = BTreeMap<String, Endpoint>> {
        proptest::collection::btree_map("[a-f]", arb_endpoint(), 0..6)
    }

    proptest! {
        #[test]
        fn diff_applied_gives_the_new_endpoints(old in arb_map(), new in arb_map()) {
            let d = diff_endpoints(&old, &new);
            prop_assert_eq!(apply(&old, &d), new.clone());
            // Each name in at most one list, each list sorted, nothing reported that did not change.
            let mut names: Vec<&String> = d.joined.iter().map(|(n, _)| n)
                .chain(d.left.iter())
                .chain(d.changed.iter().map(|(n, _, _)| n))
                .collect();
            let total = names.len();
            names.sort();
            names.dedup();
            prop_assert_eq!(names.len(), total);
            for (n, o, e) in &d.changed {
                prop_assert_ne!(o, e);
                prop_assert_eq!(old.get(n), Some(o));
            }
            prop_assert!(d.joined.windows(2).all(|w| w[0].0 < w[1].0));
            prop_assert!(d.left.windows(2).all(|w| w[0] < w[1]));
            prop_assert_eq!(d.is_empty(), old == new);
        }
    }
}
