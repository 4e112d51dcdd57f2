//! Typed configuration of the event plane and of each worker's stream, plus vLLM's endpoint rules.
//!
//! Invariant: a [`WorkerConfig`] carries the replica's *base* endpoints (what the operator gave
//! vLLM for all ranks); [`WorkerConfig::events_endpoint`] and [`WorkerConfig::replay_endpoint`]
//! apply vLLM's per-rank offset, so DP rank r of a tcp endpoint always uses port base + r.

use std::time::Duration;

use kinference_index::{ReplicaId, WorkerId};
use kinference_vllm::DpRank;

use crate::backoff::BackoffConfig;
use crate::error::EventsError;

/// How this subscriber's SUB socket meets the publisher.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SocketMode {
    /// The publisher binds (vLLM endpoint like `tcp://*:5557`); we dial `address`.
    Connect,
    /// The publisher connects to us (vLLM endpoint like `tcp://10.0.0.9:5557`); we bind `address`.
    Bind,
    /// Apply vLLM's rule to the endpoint the publisher was configured with: if the publisher
    /// binds we connect, otherwise we bind.
    Auto {
        /// The `endpoint` from the replica's `--kv-events-config` (the publisher's own view,
        /// e.g. `tcp://*:5557`; never dialled as such).
        publisher_endpoint: String,
    },
}

impl SocketMode {
    /// Whether our SUB socket binds (true) or connects (false).
    pub fn binds(&self) -> bool {
        match self {
            SocketMode::Connect => false,
            SocketMode::Bind => true,
            SocketMode::Auto { publisher_endpoint } => !publisher_binds(publisher_endpoint),
        }
    }
}

/// vLLM's rule (`ZmqEventPublisher._socket_setup`): the PUB binds if the endpoint contains `*`
/// or `::` or starts with `ipc://` or `inproc://`; otherwise it connects.
pub fn publisher_binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// vLLM's `offset_endpoint_port`: rank 0 keeps the endpoint; tcp adds the rank to the port;
/// inproc appends `_dp{rank}`; anything else with a rank above 0 is an error, as in vLLM.
pub fn offset_endpoint(endpoint: &str, rank: DpRank) -> Result<String, EventsError> {
    if rank.0 == 0 {
        return Ok(endpoint.to_owned());
    }
    if endpoint.contains("inproc") {
        return Ok(format!("{endpoint}_dp{}", rank.0));
    }
    if endpoint.contains("tcp") {
        let bad = || EventsError::Endpoint {
            endpoint: endpoint.to_owned(),
            reason: "DP rank > 0 needs a tcp endpoint with a fixed numeric base port".into(),
        };
        let (base, port) = endpoint.rsplit_once(':').ok_or_else(bad)?;
        let port: u32 = port.parse().map_err(|_| bad())?;
        if port == 0 {
            // An ephemeral port has no base to add the rank to.
            return Err(bad());
        }
        let port = port
            .checked_add(rank.0)
            .filter(|p| *p <= u32::from(u16::MAX))
            .ok_or_else(bad)?;
        return Ok(format!("{base}:{port}"));
    }
    Err(EventsError::Endpoint {
        endpoint: endpoint.to_owned(),
        reason: "only tcp and inproc endpoints can be offset by DP rank".into(),
    })
}

/// Whether a host in a publisher's endpoint is a wildcard: the publisher bound every
/// interface, so it is reached at its replica's own host. vLLM's `*` and the resolved spellings
/// servers report (`0.0.0.0`, `::`), with or without IPv6 brackets.
pub fn is_wildcard_host(host: &str) -> bool {
    matches!(host, "*" | "0.0.0.0" | "::" | "[::]" | "[*]")
}

/// Where our socket meets a replica's publisher, from the endpoint the replica reports for one
/// DP rank (`/kv_event_sources`, or an operator's flag).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedEndpoint {
    /// Our SUB socket binds `base` (the publisher connects to it) rather than dialling it.
    pub we_bind: bool,
    /// The replica's base endpoint (rank 0's port): the event plane adds each rank back.
    pub base: String,
}

impl ResolvedEndpoint {
    /// The stream of DP rank `rank` of `replica` at this endpoint.
    pub fn worker(&self, replica: ReplicaId, rank: DpRank) -> WorkerConfig {
        if self.we_bind {
            WorkerConfig::bind(replica, rank, &self.base)
        } else {
            WorkerConfig::connect(replica, rank, &self.base)
        }
    }
}

/// Why a reported endpoint cannot be subscribed to.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("unsupported endpoint {endpoint:?}: expected tcp://HOST:PORT")]
    Unsupported { endpoint: String },
    #[error("endpoint {endpoint:?}: port below its DP rank {rank}")]
    PortBelowRank { endpoint: String, rank: u32 },
}

impl From<EndpointError> for EventsError {
    fn from(e: EndpointError) -> Self {
        let endpoint = match &e {
            EndpointError::Unsupported { endpoint } => endpoint.clone(),
            EndpointError::PortBelowRank { endpoint, .. } => endpoint.clone(),
        };
        EventsError::Endpoint {
            endpoint,
            reason: e.to_string(),
        }
    }
}

/// Host and port of `tcp://HOST:PORT`; an IPv6 host keeps its brackets.
fn split_tcp(endpoint: &str) -> Option<(&str, u16)> {
    let (host, port) = endpoint.strip_prefix("tcp://")?.rsplit_once(':')?;
    if host.is_empty() {
        return None;
    }
    Some((host, port.parse().ok()?))
}

/// Resolves the endpoint a replica reports for DP rank `rank` (already offset by the rank, as
/// vLLM reports it) into the base endpoint and the side that binds:
/// - a wildcard host ([`is_wildcard_host`]): the publisher bound every interface; we dial
///   `replica_host`;
/// - another host that vLLM's rule says the publisher binds ([`publisher_binds`]: an IPv6
///   address such as `[::1]`): we dial that address;
/// - any other host: the publisher connected to it, so we bind it.
///
/// The port becomes the base port (port − rank); only tcp endpoints are supported.
pub fn resolve_endpoint(
    endpoint: &str,
    rank: u32,
    replica_host: &str,
) -> Result<ResolvedEndpoint, EndpointError> {
    let (host, port) = split_tcp(endpoint).ok_or_else(|| EndpointError::Unsupported {
        endpoint: endpoint.to_owned(),
    })?;
    let base_port =
        u32::from(port)
            .checked_sub(rank)
            .ok_or_else(|| EndpointError::PortBelowRank {
                endpoint: endpoint.to_owned(),
                rank,
            })?;
    let (we_bind, host) = if is_wildcard_host(host) {
        (false, replica_host)
    } else {
        (!publisher_binds(endpoint), host)
    };
    Ok(ResolvedEndpoint {
        we_bind,
        base: format!("tcp://{host}:{base_port}"),
    })
}

/// The base endpoint to dial for a rank's replay ROUTER, which always binds: at the replica's
/// host when it bound a wildcard, as reported otherwise; port − rank as for events.
pub fn resolve_replay(
    endpoint: &str,
    rank: u32,
    replica_host: &str,
) -> Result<String, EndpointError> {
    resolve_endpoint(endpoint, rank, replica_host).map(|r| r.base)
}

/// One (replica, DP rank) event stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerConfig {
    pub replica: ReplicaId,
    pub dp_rank: DpRank,
    /// Base address of the event stream for the whole replica (rank offset applied later):
    /// dialled in connect mode, bound in bind mode. `tcp://HOST:0` binds an ephemeral port
    /// (rank 0 only); the bound endpoint is reported in [`crate::WorkerHealth::local_endpoint`].
    pub address: String,
    pub mode: SocketMode,
    /// Base address of the publisher's replay ROUTER to dial; `None` disables replay, so every
    /// gap is unrecoverable.
    pub replay: Option<String>,
    /// Subscription topic (vLLM's `topic`, default empty). Non-empty topics must match frame 0
    /// exactly; an empty topic accepts any.
    pub topic: String,
}

impl WorkerConfig {
    fn new(replica: ReplicaId, dp_rank: DpRank, address: &str, mode: SocketMode) -> Self {
        WorkerConfig {
            replica,
            dp_rank,
            address: address.to_owned(),
            mode,
            replay: None,
            topic: String::new(),
        }
    }

    /// The publisher connects to `address`; we bind it (vLLM endpoint `tcp://HOST:PORT`).
    pub fn bind(replica: ReplicaId, dp_rank: DpRank, address: &str) -> Self {
        Self::new(replica, dp_rank, address, SocketMode::Bind)
    }

    /// The publisher binds (vLLM endpoint `tcp://*:PORT`); we dial `address`.
    pub fn connect(replica: ReplicaId, dp_rank: DpRank, address: &str) -> Self {
        Self::new(replica, dp_rank, address, SocketMode::Connect)
    }

    /// vLLM's rule applied to `publisher_endpoint` decides; `address` is what we dial or bind.
    pub fn auto(
        replica: ReplicaId,
        dp_rank: DpRank,
        address: &str,
        publisher_endpoint: &str,
    ) -> Self {
        let mode = SocketMode::Auto {
            publisher_endpoint: publisher_endpoint.to_owned(),
        };
        Self::new(replica, dp_rank, address, mode)
    }

    pub fn with_replay(mut self, replay_address: &str) -> Self {
        self.replay = Some(replay_address.to_owned());
        self
    }

    pub fn with_topic(mut self, topic: &str) -> Self {
        self.topic = topic.to_owned();
        self
    }

    pub fn worker_id(&self) -> WorkerId {
        WorkerId {
            replica: self.replica,
            rank: self.dp_rank,
        }
    }

    /// The event endpoint of this rank (base offset by the DP rank).
    pub fn events_endpoint(&self) -> Result<String, EventsError> {
        offset_endpoint(&self.address, self.dp_rank)
    }

    /// The replay endpoint of this rank, if replay is configured.
    pub fn replay_endpoint(&self) -> Result<Option<String>, EventsError> {
        self.replay
            .as_deref()
            .map(|r| offset_endpoint(r, self.dp_rank))
            .transpose()
    }

    /// Checks everything that can be checked before opening sockets.
    pub fn validate(&self) -> Result<(), EventsError> {
        for endpoint in std::iter::once(self.events_endpoint()?).chain(self.replay_endpoint()?) {
            // ipc and inproc do not reach another host, and the rank offset is defined for tcp.
            if !endpoint.starts_with("tcp://") {
                return Err(EventsError::Endpoint {
                    endpoint,
                    reason: "expected a tcp:// endpoint".into(),
                });
            }
        }
        Ok(())
    }
}

/// All DP ranks of one replica, as configured by one `--kv-events-config`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaConfig {
    /// Template for every rank; its `dp_rank` is ignored.
    pub base: WorkerConfig,
    /// Number of DP ranks (vLLM's `data_parallel_size`); ranks 0..dp_size.
    pub dp_size: u32,
}

impl ReplicaConfig {
    pub fn workers(&self) -> Vec<WorkerConfig> {
        (0..self.dp_size)
            .map(|r| WorkerConfig {
                dp_rank: DpRank(r),
                ..self.base.clone()
            })
            .collect()
    }
}

/// Plane-wide settings. Every duration is wall-clock time on tokio's clock.
#[derive(Clone, Debug, PartialEq)]
pub struct EventPlaneConfig {
    /// Capacity (updates) of the channel from subscribers to the index writer.
    pub channel_capacity: usize,
    /// Most updates applied per write-lock hold.
    pub writer_batch_max: usize,
    /// Capacity (messages) between a socket reader and its subscriber task.
    pub reader_capacity: usize,
    /// Most live messages buffered while a replay runs; beyond it the replay is abandoned and
    /// the gap treated as unrecoverable.
    pub replay_buffer_max: usize,
    /// Time for a replay request to reach the publisher's ROUTER (the DEALER dials in the
    /// background; the request waits for the connection).
    pub replay_connect_timeout: Duration,
    /// Longest wait for a replay reply's first message (the whole reply may take longer).
    pub replay_idle_timeout: Duration,
    /// Longest pause between two messages of a replay reply once it has begun. A publisher
    /// sends its reply in one loop, and vLLM's ROUTER drops what exceeds its send limit (1,000
    /// queued messages), end marker included: a pause means the rest of the reply is lost,
    /// and it is asked for again from the first batch missing. Too short a value costs a
    /// reply asked for twice, never a batch.
    pub replay_stall_timeout: Duration,
    /// Upper bound on one whole replay.
    pub replay_total_timeout: Duration,
    /// Replay attempts per gap before it is declared unrecoverable.
    pub replay_attempts: u32,
    /// Retry pacing after socket errors and failed replays.
    pub backoff: BackoffConfig,
    /// While a SUB socket's messages arrive faster than this, its reader wakes at most once
    /// per this interval and reads them all (see [`crate::socket::Pace`]); zero: on every
    /// message. The default, 3 ms, delays an event by well under an engine step (tens of
    /// milliseconds on a GPU; the router's own placements are in its speculative entries
    /// meanwhile); each wake-up of the event thread costs the router more than the messages
    /// it reads (BENCHMARKS.md, "the event thread's wake-ups"): 1 ms cost about 3 µs more CPU
    /// per request than 3 or 5 ms on the latency benchmark, and 10 ms cost more again (cause
    /// not established).
    pub read_pacing: Duration,
}

impl Default for EventPlaneConfig {
    fn default() -> Self {
        EventPlaneConfig {
            channel_capacity: 1024,
            writer_batch_max: 256,
            reader_capacity: 4096,
            replay_buffer_max: 100_000,
            replay_connect_timeout: Duration::from_secs(2),
            replay_idle_timeout: Duration::from_secs(2),
            replay_stall_timeout: Duration::from_millis(200),
            replay_total_timeout: Duration::from_secs(30),
            replay_attempts: 2,
            backoff: BackoffConfig::default(),
            read_pacing: Duration::from_millis(3),
        }
    }
}

impl EventPlaneConfig {
    /// Reports every invalid field at once.
    pub fn validate(&self) -> Result<(), EventsError> {
        let mut problems = Vec::new();
        let positive = [
            ("channel_capacity", self.channel_capacity),
            ("writer_batch_max", self.writer_batch_max),
            ("reader_capacity", self.reader_capacity),
            ("replay_buffer_max", self.replay_buffer_max),
        ];
        for (name, value) in positive {
            if value == 0 {
                problems.push(format!("{name} must be > 0"));
            }
        }
        let durations = [
            ("replay_connect_timeout", self.replay_connect_timeout),
            ("replay_idle_timeout", self.replay_idle_timeout),
            ("replay_stall_timeout", self.replay_stall_timeout),
            ("replay_total_timeout", self.replay_total_timeout),
        ];
        for (name, value) in durations {
            if value.is_zero() {
                problems.push(format!("{name} must be > 0"));
            }
        }
        problems.extend(self.backoff.problems());
        if problems.is_empty() {
            Ok(())
        } else {
            Err(EventsError::Config(problems.join("; ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_bind_rule() {
        assert!(publisher_binds("tcp://*:5557"));
        assert!(publisher_binds("tcp://[::]:5557"));
        assert!(publisher_binds("ipc:///tmp/kv"));
        assert!(publisher_binds("inproc://kv"));
        assert!(!publisher_binds("tcp://127.0.0.1:5557"));
        assert!(!SocketMode::Auto {
            publisher_endpoint: "tcp://*:5557".into()
        }
        .binds());
        assert!(SocketMode::Auto {
            publisher_endpoint: "tcp://10.0.0.9:5557".into()
        }
        .binds());
    }

    #[test]
    fn rank_offsets_like_vllm() {
        let r = |n| DpRank(n);
        assert_eq!(
            offset_endpoint("tcp://h:5557", r(0)).unwrap(),
            "tcp://h:5557"
        );
        assert_eq!(
            offset_endpoint("tcp://h:5557", r(3)).unwrap(),
            "tcp://h:5560"
        );
        assert_eq!(
            offset_endpoint("inproc://kv", r(2)).unwrap(),
            "inproc://kv_dp2"
        );
        assert!(offset_endpoint("ipc:///tmp/kv", r(1)).is_err());
        assert!(offset_endpoint("tcp://h:port", r(1)).is_err());
        assert!(offset_endpoint("tcp://h:65535", r(1)).is_err());
        assert!(offset_endpoint("tcp://h:0", r(1)).is_err());
        assert_eq!(offset_endpoint("tcp://h:0", r(0)).unwrap(), "tcp://h:0");
        assert_eq!(
            offset_endpoint("ipc:///tmp/kv", r(0)).unwrap(),
            "ipc:///tmp/kv"
        );
    }

    fn resolved(endpoint: &str, rank: u32, host: &str) -> (bool, String) {
        let r = resolve_endpoint(endpoint, rank, host).unwrap();
        (r.we_bind, r.base)
    }

    #[test]
    fn every_wildcard_spelling_is_dialled_at_the_replica_host() {
        for host in ["*", "0.0.0.0", "::", "[::]", "[*]"] {
            assert!(is_wildcard_host(host), "{host}");
            assert_eq!(
                resolved(&format!("tcp://{host}:5557"), 0, "10.0.0.5"),
                (false, "tcp://10.0.0.5:5557".into()),
                "{host}"
            );
        }
        assert_eq!(
            resolved("tcp://[::]:5557", 0, "[fd00::7]"),
            (false, "tcp://[fd00::7]:5557".into())
        );
        for host in ["127.0.0.1", "h", "[::1]", "**", ""] {
            assert!(!is_wildcard_host(host), "{host}");
        }
    }

    #[test]
    fn other_hosts_follow_vllms_bind_rule() {
        // The publisher connected to a plain address: we bind it.
        assert_eq!(
            resolved("tcp://10.0.0.9:6000", 0, "h"),
            (true, "tcp://10.0.0.9:6000".into())
        );
        // vLLM binds any endpoint containing `::`: a specific IPv6 address is dialled as is.
        assert_eq!(
            resolved("tcp://[::1]:6000", 0, "h"),
            (false, "tcp://[::1]:6000".into())
        );
        assert_eq!(
            resolved("tcp://[fd00::9]:6002", 2, "h"),
            (false, "tcp://[fd00::9]:6000".into())
        );
    }

    #[test]
    fn rank_endpoints_resolve_to_the_base_port() {
        assert_eq!(
            resolved("tcp://0.0.0.0:5559", 2, "h"),
            (false, "tcp://h:5557".into())
        );
        assert_eq!(
            resolved("tcp://10.0.0.9:6003", 3, "h"),
            (true, "tcp://10.0.0.9:6000".into())
        );
        assert_eq!(resolved("tcp://*:2", 2, "h"), (false, "tcp://h:0".into()));
        assert_eq!(
            resolve_replay("tcp://*:7001", 1, "10.0.0.5").unwrap(),
            "tcp://10.0.0.5:7000"
        );
        assert_eq!(
            resolve_replay("tcp://10.0.0.9:7001", 1, "h").unwrap(),
            "tcp://10.0.0.9:7000"
        );
        let w = resolve_endpoint("tcp://*:5558", 1, "h")
            .unwrap()
            .worker(ReplicaId(3), DpRank(1));
        assert_eq!(w.mode, SocketMode::Connect);
        assert_eq!(w.events_endpoint().unwrap(), "tcp://h:5558");
        let w = resolve_endpoint("tcp://10.0.0.9:6001", 1, "h")
            .unwrap()
            .worker(ReplicaId(3), DpRank(1));
        assert_eq!(w.mode, SocketMode::Bind);
        assert_eq!(w.events_endpoint().unwrap(), "tcp://10.0.0.9:6001");
    }

    #[test]
    fn unusable_endpoints_are_typed_errors() {
        for endpoint in [
            "ipc:///tmp/x",
            "inproc://kv",
            "tcp://*",
            "tcp://:5557",
            "tcp://*:port",
            "tcp://*:70000",
            "5557",
        ] {
            assert_eq!(
                resolve_endpoint(endpoint, 0, "h"),
                Err(EndpointError::Unsupported {
                    endpoint: endpoint.into()
                }),
                "{endpoint}"
            );
        }
        let err = resolve_endpoint("tcp://*:1", 2, "h").unwrap_err();
        assert_eq!(
            err,
            EndpointError::PortBelowRank {
                endpoint: "tcp://*:1".into(),
                rank: 2
            }
        );
        assert!(resolve_replay("tcp://*:1", u32::MAX, "h").is_err());
        let wrapped = EventsError::from(err);
        assert_eq!(wrapped.label(), "endpoint");
        assert!(wrapped.to_string().contains("DP rank 2"), "{wrapped}");
    }

    #[test]
    fn replica_expands_ranks() {
        let base = WorkerConfig::connect(ReplicaId(7), DpRank(0), "tcp://h:6000")
            .with_replay("tcp://h:7000");
        let workers = ReplicaConfig { base, dp_size: 2 }.workers();
        assert_eq!(workers.len(), 2);
        assert_eq!(workers[1].events_endpoint().unwrap(), "tcp://h:6001");
        assert_eq!(
            workers[1].replay_endpoint().unwrap().unwrap(),
            "tcp://h:7001"
        );
    }

    #[test]
    fn config_reports_every_problem() {
        let cfg = EventPlaneConfig {
            channel_capacity: 0,
            replay_idle_timeout: Duration::ZERO,
            ..EventPlaneConfig::default()
        };
        let err = cfg.validate().unwrap_err().to_string();
        assert!(
            err.contains("channel_capacity") && err.contains("replay_idle_timeout"),
            "{err}"
        );
        assert!(EventPlaneConfig::default().validate().is_ok());
    }
}
