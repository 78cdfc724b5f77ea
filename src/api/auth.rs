//! `X-API-Key` on every `/api/v1` route, and what the key's scope allows (see
//! [`crate::access`]). The server never runs open: with no key configured it generates an
//! admin key into the data directory.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use axum::extract::{FromRef, FromRequestParts};
use axum::http::request::Parts;
use axum::http::{HeaderMap, Method, StatusCode};

use super::error::ApiError;
use crate::access::{Access, Key, LastKey, Scope};

pub const HEADER: &str = "x-api-key";

/// Where the authenticated API lives.
pub const PREFIX: &str = "/api/v1";

/// The one `POST` a `read` key may send: it compares, it changes nothing.
const DRIFT: &str = "/api/v1/services/drift";

/// What the accept loop ([`super::serve`]) puts on each request of a connection: the
/// client's address, for the log line of every accepted change, and the key the connection
/// last presented ([`Access::identify_on`]).
#[derive(Clone)]
pub struct Connection {
    pub client: SocketAddr,
    pub last_key: Arc<LastKey>,
}

/// The key a request carries: in `X-API-Key`, or as `Authorization: Bearer <key>` for
/// clients that can send no header of their own (Prometheus's `http_sd_configs`
/// `authorization`, for one).
fn presented(headers: &HeaderMap) -> Option<&[u8]> {
    headers.get(HEADER).map(|k| k.as_bytes()).or_else(|| {
        headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
    })
}

/// The key `headers` carry, or the 401 to answer. The message never repeats what was sent.
pub fn identify(access: &Access, headers: &HeaderMap, connection: Option<&Connection>) -> Result<Arc<Key>, ApiError> {
    match presented(headers) {
        Some(token) => match connection {
            Some(connection) => access.identify_on(token, &connection.last_key),
            None => access.identify(token),
        }
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "the X-API-Key header (or Authorization: Bearer) holds no valid key",
            )
        }),
        None => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "send an API key in the X-API-Key header (see KODER_DNS_API_KEY or <data-dir>/api-key)",
        )),
    }
}

/// [`identify`] for paths under `/api/v1`, known or not, so that without a key nothing
/// about the API is revealed; other paths need no key.
pub fn check_path(access: &Access, path: &str, headers: &HeaderMap) -> Result<(), ApiError> {
    match path.strip_prefix(PREFIX) {
        Some(rest) if rest.is_empty() || rest.starts_with('/') => identify(access, headers, None).map(drop),
        _ => Ok(()),
    }
}

/// `403 forbidden`, naming the key and what it may not do.
pub fn forbidden(key: &Key, what: impl std::fmt::Display) -> ApiError {
    let allowed = match key.scope {
        Scope::Admin => "every route".to_owned(),
        Scope::Read => "GET requests under /api/v1 and POST /services/drift".to_owned(),
        Scope::Register => format!("reads, and changes to instances of {}", key.services_text()),
    };
    ApiError::new(
        StatusCode::FORBIDDEN,
        "forbidden",
        format!(
            "key {:?} (scope {}) may not {what}; it may do {allowed}",
            key.id,
            key.scope.as_str()
        ),
    )
}

/// Proof that the request carried a valid key whose scope allows this kind of request: the
/// first argument of every API handler, so a request without one is refused before its body
/// is read. Reads (every `GET`, and the drift comparison) are open to every scope; anything
/// else needs a key that may change instances, and the handler then checks the service
/// ([`Self::may_change`]). (An extractor rather than a middleware layer: it costs a header
/// lookup and a hash, not a boxed service per request.)
pub struct Authorized {
    pub key: Arc<Key>,
    pub client: Option<SocketAddr>,
}

/// Logs an accepted change with the key's id and the client's address (never the token),
/// under the target `koder_dns::audit`, so that a log pipeline can pick the lines out.
macro_rules! audit {
    ($level:ident, $caller:expr, $what:literal, $($field:tt)*) => {
        tracing::$level!(
            target: "koder_dns::audit",
            key = %$caller.key.id,
            client = %$caller.client.map_or_else(|| "-".to_owned(), |c| c.to_string()),
            $($field)*,
            $what
        )
    };
}
pub(crate) use audit;

impl Authorized {
    /// 403 unless the key may change instances of `service`; `what` says what it tried.
    pub fn may_change(&self, service: &str, what: impl std::fmt::Display) -> Result<(), ApiError> {
        if self.key.may_write(service) {
            Ok(())
        } else {
            Err(forbidden(&self.key, what))
        }
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Authorized
where
    Arc<Access>: FromRef<S>,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let connection = parts.extensions.get::<Connection>();
        let key = identify(&Arc::<Access>::from_ref(state), &parts.headers, connection)?;
        let reads = matches!(parts.method, Method::GET | Method::HEAD) || parts.uri.path() == DRIFT;
        if !reads && !key.writes() {
            return Err(forbidden(&key, format_args!("{} {}", parts.method, parts.uri.path())));
        }
        Ok(Authorized {
            key,
            client: connection.map(|c| c.client),
        })
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
