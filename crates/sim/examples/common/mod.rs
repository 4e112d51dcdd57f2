//! Code shared by the trace-replay examples and the comparison's integration test.

pub mod compare;
pub mod trace;
