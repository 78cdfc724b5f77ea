//! `X-API-Key` on every `/api/v1` route. The server never runs open: with no key
//! configured it generates one into the data directory.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use axum::extract::{FromRef, FromRequestParts};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use subtle::ConstantTimeEq;

use super::error::ApiError;

pub const HEADER: &str = "x-api-key";

pub struct ApiKeys(Vec<Vec<u8>>);

impl ApiKeys {
    pub fn new(keys: &[String]) -> Self {
        Self(keys.iter().map(|k| k.as_bytes().to_vec()).collect())
    }

    /// Compares against every key in constant time, so timing reveals neither which key
    /// nor how much of one matched.
    pub fn accepts(&self, presented: &[u8]) -> bool {
        self.0
            .iter()
            .fold(false, |ok, key| ok | bool::from(key.as_slice().ct_eq(presented)))
    }

    /// Whether `headers` carry a key we accept; the 401 to answer if not. The key goes in
    /// `X-API-Key`, or as `Authorization: Bearer <key>` for clients that can send no header
    /// of their own (Prometheus's `http_sd_configs` `authorization`, for one).
    pub fn check(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let bearer = || {
            headers
                .get(axum::http::header::AUTHORIZATION)
                .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
        };
        match headers.get(HEADER).map(|k| k.as_bytes()).or_else(bearer) {
            Some(key) if self.accepts(key) => Ok(()),
            Some(_) => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "the X-API-Key header (or Authorization: Bearer) holds no valid key",
            )),
            None => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "send an API key in the X-API-Key header (see KODER_DNS_API_KEY or <data-dir>/api-key)",
            )),
        }
    }

    /// [`Self::check`] for paths under `/api/v1`, known or not, so that without a key
    /// nothing about the API is revealed; other paths need no key.
    pub fn check_path(&self, path: &str, headers: &HeaderMap) -> Result<(), ApiError> {
        match path.strip_prefix(PREFIX) {
            Some(rest) if rest.is_empty() || rest.starts_with('/') => self.check(headers),
            _ => Ok(()),
        }
    }
}

/// Where the authenticated API lives.
pub const PREFIX: &str = "/api/v1";

/// Proof that the request carried a valid `X-API-Key`: the first argument of every API
/// handler, so a request without one is refused before its body is read. (An extractor
/// rather than a middleware layer: it costs a header lookup, not a boxed service per request.)
pub struct Authorized;

impl<S: Send + Sync> FromRequestParts<S> for Authorized
where
    Arc<ApiKeys>: FromRef<S>,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Arc::<ApiKeys>::from_ref(state)
            .check(&parts.headers)
            .map(|()| Authorized)
    }
}

/// The key file used when no key is configured.
pub fn key_path(data_dir: &Path) -> PathBuf {
    data_dir.join("api-key")
}

/// Reads the generated key, or generates one (32 random bytes, hex) with mode 0600.
pub fn load_or_generate(data_dir: &Path) -> anyhow::Result<(String, PathBuf, bool)> {
    let path = key_path(data_dir);
    match std::fs::read_to_string(&path) {
        Ok(key) if !key.trim().is_empty() => return Ok((key.trim().to_owned(), path, false)),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("cannot read the API key file {}", path.display())),
    }
    let mut raw = [0u8; 32];
    getrandom::fill(&mut raw).map_err(|e| anyhow::anyhow!("no randomness for an API key: {e}"))?;
    let key: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("cannot create the data directory {}", data_dir.display()))?;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options
        .open(&path)
        .with_context(|| format!("cannot write the API key file {}", path.display()))?;
    file.write_all(key.as_bytes())?;
    file.sync_all()?;
    Ok((key, path, true))
}
