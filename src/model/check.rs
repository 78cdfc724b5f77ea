//! How an instance asks to be checked (R6): the `check*` labels in its metadata or tags.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::metadata::{Metadata, label};
use super::{FieldError, parse_duration};

pub const DEFAULT_PATH: &str = "/";
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
/// Checks more often than this would be a load test, not a health check.
pub const MIN_INTERVAL: Duration = Duration::from_millis(50);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckKind {
    /// The lease alone is the signal.
    None,
    /// Healthy when a TCP connection to address:port is accepted.
    Tcp,
    /// Healthy when `GET http://address:port<path>` answers 2xx or 3xx.
    Http,
}

impl FromStr for CheckKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "none" => Ok(Self::None),
            "tcp" => Ok(Self::Tcp),
            "http" => Ok(Self::Http),
            _ => Err(format!("{s:?} is not a check kind; use tcp, http or none")),
        }
    }
}

impl fmt::Display for CheckKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::None => "none",
            Self::Tcp => "tcp",
            Self::Http => "http",
        })
    }
}

/// The check an instance asked for; `kind: None` means "the server's `--default-check`".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckSpec {
    pub kind: Option<CheckKind>,
    pub path: String,
    pub interval: Duration,
    pub timeout: Duration,
}

impl Default for CheckSpec {
    /// What an instance that sets no check label asks for.
    fn default() -> Self {
        Self {
            kind: None,
            path: DEFAULT_PATH.to_owned(),
            interval: DEFAULT_INTERVAL,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

impl CheckSpec {
    pub fn from_labels(metadata: &Metadata, tags: &[String]) -> Result<Self, FieldError> {
        let get = |key: &str| label(metadata, tags, key);
        let field = |key: &str| format!("metadata.{key}");
        let kind = get("check")
            .map(|k| k.parse::<CheckKind>().map_err(|e| FieldError::new(field("check"), e)))
            .transpose()?;
        let path = get("check_path").unwrap_or(DEFAULT_PATH).to_owned();
        if !path.starts_with('/') || path.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(FieldError::new(
                field("check_path"),
                format!("{path:?} must be a URL path starting with '/'"),
            ));
        }
        let duration = |key: &str, default: Duration| -> Result<Duration, FieldError> {
            match get(key) {
                None => Ok(default),
                Some(v) => match parse_duration(v) {
                    Ok(d) if d >= MIN_INTERVAL => Ok(d),
                    Ok(_) => Err(FieldError::new(
                        field(key),
                        format!("{v:?} is shorter than {MIN_INTERVAL:?}"),
                    )),
                    Err(e) => Err(FieldError::new(field(key), e)),
                },
            }
        };
        Ok(Self {
            kind,
            path,
            interval: duration("check_interval", DEFAULT_INTERVAL)?,
            timeout: duration("check_timeout", DEFAULT_TIMEOUT)?,
        })
    }

    /// Shared: the instances that set no check label (most) share one allocation.
    pub fn shared(self) -> Arc<Self> {
        static UNSET: std::sync::LazyLock<Arc<CheckSpec>> = std::sync::LazyLock::new(Arc::default);
        if self == **UNSET { UNSET.clone() } else { Arc::new(self) }
    }

    pub fn effective_kind(&self, default: CheckKind) -> CheckKind {
        self.kind.unwrap_or(default)
    }
}
