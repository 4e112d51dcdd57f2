//! Errors of the benchmark library. Each variant has a stable label for logs and reports;
//! bad input (a missing trace, a malformed line, an impossible setting) comes back as one of
//! these, never as a panic.

use std::path::PathBuf;

/// Why a benchmark could not be prepared or run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} line {line}: {message}")]
    Parse {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("invalid setting: {0}")]
    Config(String),
    /// The command line's flags do not go together (the message names them).
    #[error("{0}")]
    Usage(String),
    #[error("the workload is empty after selection")]
    EmptyWorkload,
    #[error("simulator: {0}")]
    Sim(String),
    #[error("tokenizer: {0}")]
    Tokenize(String),
    #[error("live run: {0}")]
    Live(String),
    #[error("report: {0}")]
    Report(String),
    #[error("default data file {file} (pass a path)")]
    DefaultData {
        file: String,
        source: Box<BenchError>,
    },
    #[error("loading the tokenizer in {}", dir.display())]
    LoadTokenizer {
        dir: PathBuf,
        source: kinference_tokenize::TokenizeError,
    },
    #[error("starting the async runtime")]
    Runtime(#[source] std::io::Error),
}

impl BenchError {
    pub fn label(&self) -> &'static str {
        match self {
            BenchError::Io { .. } => "io",
            BenchError::Parse { .. } => "parse",
            BenchError::Config(_) => "config",
            BenchError::Usage(_) => "usage",
            BenchError::EmptyWorkload => "empty_workload",
            BenchError::Sim(_) => "sim",
            BenchError::Tokenize(_) => "tokenize",
            BenchError::Live(_) => "live",
            BenchError::Report(_) => "report",
            BenchError::DefaultData { .. } => "default_data",
            BenchError::LoadTokenizer { .. } => "tokenizer",
            BenchError::Runtime(_) => "runtime",
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        BenchError::Io {
            path: path.into(),
            source,
        }
    }
}

impl From<kinference_sim::ConfigError> for BenchError {
    fn from(e: kinference_sim::ConfigError) -> Self {
        BenchError::Sim(e.to_string())
    }
}

impl From<kinference_sim::FleetError> for BenchError {
    fn from(e: kinference_sim::FleetError) -> Self {
        BenchError::Sim(e.to_string())
    }
}

impl From<kinference_sim::ProfileError> for BenchError {
    fn from(e: kinference_sim::ProfileError) -> Self {
        BenchError::Sim(e.to_string())
    }
}

impl From<kinference_tokenize::TokenizeError> for BenchError {
    fn from(e: kinference_tokenize::TokenizeError) -> Self {
        BenchError::Tokenize(e.to_string())
    }
}
