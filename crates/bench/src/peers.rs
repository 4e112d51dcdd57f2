//! Peer routers to compare against in live mode: how to find them and how to start them in
//! front of a set of replicas with their cache-aware policy (the settings quoted in the
//! shared peer notes). Starting and stopping the processes is the caller's job (the demo);
//! once one listens, it is just another [`crate::live::LiveTarget`].

use std::path::{Path, PathBuf};

/// A peer router with a cache-aware policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerRouter {
    /// The vLLM project's router (`vllm-router`, PyPI `vllm-router`).
    VllmRouter,
    /// SGLang's model gateway (`smg launch`, PyPI `sglang-router`).
    SglangRouter,
}

impl PeerRouter {
    pub const ALL: [PeerRouter; 2] = [PeerRouter::VllmRouter, PeerRouter::SglangRouter];

    pub fn name(self) -> &'static str {
        match self {
            PeerRouter::VllmRouter => "vllm-router",
            PeerRouter::SglangRouter => "sglang-router",
        }
    }

    pub fn from_name(name: &str) -> Option<PeerRouter> {
        PeerRouter::ALL.into_iter().find(|p| p.name() == name)
    }

    fn program(self) -> &'static str {
        match self {
            PeerRouter::VllmRouter => "vllm-router",
            PeerRouter::SglangRouter => "smg",
        }
    }

    /// The executable on `PATH`, if installed.
    pub fn find(self) -> Option<PathBuf> {
        let path = std::env::var_os("PATH")?;
        std::env::split_paths(&path)
            .map(|d| d.join(self.program()))
            .find(|p| is_executable(p))
    }

    /// The command line that starts the router on `127.0.0.1:port` in front of `workers`
    /// (base URLs), cache-aware, with Prometheus on `metrics_port`.
    pub fn command(self, port: u16, metrics_port: u16, workers: &[String]) -> Vec<String> {
        let mut c: Vec<String> = match self {
            PeerRouter::VllmRouter => vec!["vllm-router".into()],
            PeerRouter::SglangRouter => vec!["smg".into(), "launch".into()],
        };
        c.extend(
            ["--host", "127.0.0.1", "--port"]
                .iter()
                .map(|s| s.to_string()),
        );
        c.push(port.to_string());
        c.push("--worker-urls".into());
        c.extend(workers.iter().cloned());
        c.extend(
            [
                "--policy",
                "cache_aware",
                "--cache-threshold",
                "0.3",
                "--balance-abs-threshold",
                "64",
                "--balance-rel-threshold",
                "1.5",
                "--eviction-interval-secs",
                "120",
                "--max-tree-size",
                "33554432",
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
            ]
            .iter()
            .map(|s| s.to_string()),
        );
        c.push(metrics_port.to_string());
        c.extend(["--log-level", "warning"].iter().map(|s| s.to_string()));
        c
    }
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_name_the_workers_and_the_policy() {
        let c =
            PeerRouter::SglangRouter.command(30001, 29001, &["http://a".into(), "http://b".into()]);
        assert_eq!(&c[..2], &["smg", "launch"]);
        let w = c.iter().position(|x| x == "--worker-urls").unwrap();
        assert_eq!(&c[w + 1..w + 3], &["http://a", "http://b"]);
        assert!(c
            .windows(2)
            .any(|x| x[0] == "--policy" && x[1] == "cache_aware"));
        assert_eq!(
            PeerRouter::from_name("vllm-router"),
            Some(PeerRouter::VllmRouter)
        );
    }
}
