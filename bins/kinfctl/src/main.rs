//! kinfctl: the operator CLI.
fn main() {}
