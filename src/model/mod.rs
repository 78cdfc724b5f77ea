//! The model: what an instance is and how its values are read, parsed once and carried
//! typed. Everything else depends on it; it depends on nothing of ours, so the registry,
//! DNS, the health checker, the REST API and the configuration all read one definition.
//!
//! - [`instance`]: the [`instance::Instance`] a registrant sends and the registry stores
//!   (one struct), with its address, metadata and labels, validated into an
//!   [`instance::Validated`] that carries its parsed check;
//! - [`metadata`]: its metadata map and the labels read from it or from its tags;
//! - [`check`]: the health check an instance asks for through its labels;
//! - [`clock`]: the registry's notion of now, real or moved by a test.

pub mod check;
pub mod clock;
pub mod instance;
pub mod metadata;

#[cfg(test)]
pub(crate) mod tests;

use std::time::Duration;

/// Parses `90s`, `500ms`, `2m`, `1h30m` or `0`: every duration a flag, a config file, a
/// label or a query parameter carries.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    humantime::parse_duration(s).map_err(|e| format!("{s:?} is not a duration like 90s, 500ms or 2m ({e})"))
}

/// A validation failure: which field, and what was wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}
