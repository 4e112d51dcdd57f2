//! Errors of the simulator core. Every variant has a stable label for metrics and logs; none
//! is a panic in disguise: bad input from a caller comes back as one of these.

use kinference_vllm::HashError;

/// An engine configuration that cannot describe a vLLM instance.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    #[error(
        "num_gpu_blocks must be at least 2 (vLLM reserves block 0 as the null block), got {0}"
    )]
    TooFewBlocks(usize),
    #[error(
        "max_model_len {max_model_len} does not fit the KV cache ({capacity} tokens in \
         num_gpu_blocks - 1 blocks): vLLM refuses to start in this case"
    )]
    ModelLenExceedsCache {
        max_model_len: usize,
        capacity: usize,
    },
    #[error(
        "max_num_batched_tokens {max_num_batched_tokens} < max_model_len {max_model_len} \
         without chunked prefill: long prompts could never be scheduled"
    )]
    BudgetBelowModelLen {
        max_num_batched_tokens: usize,
        max_model_len: usize,
    },
    #[error("block hasher: {0}")]
    Hasher(#[from] HashError),
    #[error("profile: {0}")]
    Profile(#[from] ProfileError),
}

impl ConfigError {
    pub fn label(&self) -> &'static str {
        match self {
            ConfigError::Zero(_) => "zero_setting",
            ConfigError::TooFewBlocks(_) => "too_few_blocks",
            ConfigError::ModelLenExceedsCache { .. } => "model_len_exceeds_cache",
            ConfigError::BudgetBelowModelLen { .. } => "budget_below_model_len",
            ConfigError::Hasher(_) => "hasher",
            ConfigError::Profile(_) => "profile",
        }
    }
}

/// A GPU/model profile that does not parse or does not make physical sense.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProfileError {
    #[error("profile {name}: cannot parse: {message}")]
    Parse { name: String, message: String },
    #[error("profile {name}: {field} must be positive and finite, got {value}")]
    NotPositive {
        name: String,
        field: &'static str,
        value: f64,
    },
    #[error("profile {name}: efficiency {field} must be in (0, 1], got {value}")]
    Efficiency {
        name: String,
        field: &'static str,
        value: f64,
    },
    #[error("profile {name}: {field} must be at least 1")]
    ZeroCount { name: String, field: &'static str },
    #[error("unknown built-in profile {0:?}")]
    Unknown(String),
}

impl ProfileError {
    pub fn label(&self) -> &'static str {
        match self {
            ProfileError::Parse { .. } => "parse",
            ProfileError::NotPositive { .. } => "not_positive",
            ProfileError::Efficiency { .. } => "efficiency",
            ProfileError::ZeroCount { .. } => "zero_count",
            ProfileError::Unknown(_) => "unknown",
        }
    }
}

/// Why a request was refused at admission (vLLM answers these with HTTP 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddRequestError {
    #[error("request id {0:?} is already in the engine")]
    DuplicateId(String),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("prompt of {prompt_len} tokens exceeds max_model_len {max_model_len}")]
    PromptTooLong {
        prompt_len: usize,
        max_model_len: usize,
    },
}

impl AddRequestError {
    pub fn label(&self) -> &'static str {
        match self {
            AddRequestError::DuplicateId(_) => "duplicate_id",
            AddRequestError::EmptyPrompt => "empty_prompt",
            AddRequestError::ZeroMaxTokens => "zero_max_tokens",
            AddRequestError::PromptTooLong { .. } => "prompt_too_long",
        }
    }
}

/// `reset_prefix_cache` refused, as vLLM refuses it while blocks are in use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResetError {
    #[error("{0} blocks are still in use by requests; reset only an idle engine")]
    BlocksInUse(usize),
}

impl ResetError {
    pub fn label(&self) -> &'static str {
        match self {
            ResetError::BlocksInUse(_) => "blocks_in_use",
        }
    }
}

/// A fleet run that cannot continue.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FleetError {
    #[error("the fleet has no engines")]
    NoEngines,
    #[error("the router chose engine {chosen} of {engines}")]
    BadRoute { chosen: usize, engines: usize },
    #[error("arrivals must come in time order: {at_ns} ns after {previous_ns} ns")]
    OutOfOrder { at_ns: u64, previous_ns: u64 },
    #[error("engine {engine} refused request {request_id:?}: {error}")]
    Rejected {
        engine: usize,
        request_id: String,
        error: AddRequestError,
    },
}

impl FleetError {
    pub fn label(&self) -> &'static str {
        match self {
            FleetError::NoEngines => "no_engines",
            FleetError::BadRoute { .. } => "bad_route",
            FleetError::OutOfOrder { .. } => "out_of_order",
            FleetError::Rejected { .. } => "rejected",
        }
    }
}
