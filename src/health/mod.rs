//! Health checks (R6): the checker that drives each instance's `healthy` flag.

mod check;

pub use check::{CheckKind, CheckSpec};
