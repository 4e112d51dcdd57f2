//! Why a pool cannot be read, classified from the API server's answers so an operator sees
//! the fix (the missing RBAC rule, the CRD to install), not a transport error.
//!
//! Invariants: every [`PoolError`] has a stable [`PoolError::metric_label`]; a 403 names the
//! verb, resource, API group and namespace that were denied, taken from the request that was
//! made, not parsed out of the server's prose.

use kube::runtime::watcher;

/// What a watch was doing when it failed: enough to name the missing permission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Access {
    /// `list` or `watch`.
    pub verb: &'static str,
    /// Plural resource name, e.g. `pods`.
    pub resource: &'static str,
    /// API group; empty for the core group.
    pub group: &'static str,
    pub namespace: String,
}

impl std::fmt::Display for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let group = if self.group.is_empty() {
            "\"\" (core)"
        } else {
            self.group
        };
        write!(
            f,
            "{} {} (API group {group}) in namespace {}",
            self.verb, self.resource, self.namespace
        )
    }
}

/// One pool's read failure.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PoolError {
    /// 403: RBAC does not grant the request.
    #[error(
        "RBAC denied: missing permission to {access}; grant get, list and watch on it ({message})"
    )]
    Forbidden { access: Access, message: String },
    /// 404 on a collection: the resource type is not served (CRD not installed).
    #[error("CRD missing: the API server does not serve {resource}.{group}/{version}; install its CustomResourceDefinition")]
    CrdMissing {
        group: &'static str,
        version: &'static str,
        resource: &'static str,
    },
    #[error("InferencePool {namespace}/{name} not found")]
    PoolNotFound { namespace: String, name: String },
    /// The pool exists but cannot be routed to as written.
    #[error("invalid pool: {0}")]
    Invalid(String),
    /// No answer from the API server (connection refused, TLS, timeout).
    #[error("API server unreachable: {0}")]
    Unreachable(String),
    /// Any other answer.
    #[error("API error {code}: {message}")]
    Api { code: u16, message: String },
}

impl PoolError {
    /// A stable label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            PoolError::Forbidden { .. } => "forbidden",
            PoolError::CrdMissing { .. } => "crd_missing",
            PoolError::PoolNotFound { .. } => "pool_not_found",
            PoolError::Invalid(_) => "invalid",
            PoolError::Unreachable(_) => "unreachable",
            PoolError::Api { .. } => "api",
        }
    }
}

/// The resource a watch reads, to classify its errors.
#[derive(Clone, Debug)]
pub(crate) struct Watched {
    pub group: &'static str,
    pub version: &'static str,
    pub resource: &'static str,
    pub namespace: String,
}

/// 410 Gone: the watch's resource version was compacted away. kube's watcher re-lists on its
/// own; it is routine, not a failure to report (it would flip the pool to an error for the
/// length of a backoff).
pub(crate) fn is_routine(err: &watcher::Error) -> bool {
    matches!(err, watcher::Error::WatchError(status) if status.code == 410)
}

impl Watched {
    pub fn classify(&self, err: &watcher::Error) -> PoolError {
        let (verb, client_err) = match err {
            watcher::Error::InitialListFailed(e) => ("list", e),
            watcher::Error::WatchStartFailed(e) | watcher::Error::WatchFailed(e) => ("watch", e),
            watcher::Error::WatchError(status) => {
                return self.classify_status("watch", status.code, &status.message)
            }
            watcher::Error::NoResourceVersion => {
                return PoolError::Api {
                    code: 0,
                    message: err.to_string(),
                }
            }
        };
        self.classify_client(verb, client_err)
    }

    /// Errors of a one-off call (`verb` as RBAC names it).
    pub fn classify_client(&self, verb: &'static str, err: &kube::Error) -> PoolError {
        match err {
            kube::Error::Api(status) => self.classify_status(verb, status.code, &status.message),
            other => PoolError::Unreachable(other.to_string()),
        }
    }

    fn classify_status(&self, verb: &'static str, code: u16, message: &str) -> PoolError {
        match code {
            403 => PoolError::Forbidden {
                access: Access {
                    verb,
                    resource: self.resource,
                    group: self.group,
                    namespace: self.namespace.clone(),
                },
                message: message.to_owned(),
            },
            404 => PoolError::CrdMissing {
                group: self.group,
                version: self.version,
                resource: self.resource,
            },
            _ => PoolError::Api {
                code,
                message: message.to_owned(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pods() -> Watched {
        Watched {
            group: "",
            version: "v1",
            resource: "pods",
            namespace: "ns1".into(),
        }
    }

    fn api(code: u16) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure("pods is forbidden: User \"u\" cannot list", "Forbidden")
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn forbidden_names_the_permission() {
        let e = pods().classify(&watcher::Error::InitialListFailed(api(403)));
        assert_eq!(e.metric_label(), "forbidden");
        let text = e.to_string();
        assert!(
            text.contains("list pods (API group \"\" (core)) in namespace ns1"),
            "{text}"
        );
        let e = pods().classify(&watcher::Error::WatchStartFailed(api(403)));
        assert!(e.to_string().contains("watch pods"), "{e}");
    }

    #[test]
    fn not_found_collection_is_a_missing_crd() {
        let w = Watched {
            group: "inference.networking.k8s.io",
            version: "v1",
            resource: "inferencepools",
            namespace: "ns1".into(),
        };
        let e = w.classify(&watcher::Error::InitialListFailed(api(404)));
        assert_eq!(
            e.to_string(),
            "CRD missing: the API server does not serve inferencepools.inference.networking.k8s.io/v1; install its CustomResourceDefinition"
        );
        assert_eq!(
            pods()
                .classify(&watcher::Error::InitialListFailed(api(500)))
                .metric_label(),
            "api"
        );
    }

    #[test]
    fn gone_is_routine() {
        let gone =
            kube::core::Status::failure("too old resource version", "Expired").with_code(410);
        assert!(is_routine(&watcher::Error::WatchError(gone.boxed())));
        let forbidden = kube::core::Status::failure("no", "Forbidden").with_code(403);
        assert!(!is_routine(&watcher::Error::WatchError(forbidden.boxed())));
    }
}
