//! Blocking queries: `?index=N&wait=D` on the listings and `/api/v1/routes`, and the
//! `X-Koder-Index` header that tells a client which revision an answer shows.
//!
//! A held request is a parked future on the registry's [`Registry::changed`] notifier: no
//! thread, no polling. It wakes at a new revision, at the earliest lease's end (an expiry
//! changes the answer and is reaped then), at its deadline, or at shutdown.
//!
//! [`Registry::changed`]: crate::registry::Registry::changed

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::http::{HeaderName, HeaderValue, StatusCode};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use super::error::ApiError;
use crate::model::parse_duration;
use crate::registry::Registry;

/// The response header carrying the revision an answer shows.
pub const INDEX_HEADER: HeaderName = HeaderName::from_static("x-koder-index");
/// `wait` when a blocking query gives none.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(5 * 60);
/// The longest `wait` honoured; longer ones are cut to it.
pub const MAX_WAIT: Duration = Duration::from_secs(10 * 60);

/// `?index=N&wait=D`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct WatchParams {
    /// Blocking query: answer once the revision is above this (the `X-Koder-Index` of the
    /// last answer).
    pub index: Option<String>,
    /// How long to hold the request at most, e.g. `30s` (default 5m, at most 10m; up to a
    /// sixteenth more of jitter).
    pub wait: Option<String>,
}

/// What blocking queries share: the bound on held requests and the server's shutdown.
#[derive(Clone)]
pub struct Watches {
    held: Arc<AtomicUsize>,
    max: usize,
    shutdown: CancellationToken,
}

/// Gives a held slot back when the request ends, however it ends.
struct Held(Arc<AtomicUsize>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
        crate::metrics::watch_held(false);
    }
}

impl Watches {
    pub fn new(max: usize, shutdown: CancellationToken) -> Self {
        Self {
            held: Arc::new(AtomicUsize::new(0)),
            max,
            shutdown,
        }
    }

    /// Returns once the registry's revision is above `?index=` (at once without one), or
    /// once `?wait=` has passed, or at shutdown: the revision the answer will show.
    pub async fn wait(&self, registry: &Registry, params: &WatchParams) -> Result<u64, ApiError> {
        let Some(index) = params.index.as_deref().filter(|i| !i.is_empty()) else {
            return Ok(registry.current_revision());
        };
        let index: u64 = index.trim().parse().map_err(|_| {
            ApiError::bad_request(format!(
                "?index={index} is not a revision; send the X-Koder-Index of the last answer"
            ))
        })?;
        let wait = match params.wait.as_deref().filter(|w| !w.is_empty()) {
            None => DEFAULT_WAIT,
            Some(w) => parse_duration(w).map_err(|e| ApiError::bad_request(format!("?wait: {e}")))?,
        }
        .min(MAX_WAIT);
        // Jitter, so that watchers woken together do not come back together.
        let wait = wait + wait.mul_f64(fastrand::f64() / 16.0);
        if registry.current_revision() > index {
            return Ok(registry.revision());
        }
        if self.held.fetch_add(1, Ordering::AcqRel) >= self.max {
            self.held.fetch_sub(1, Ordering::AcqRel);
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_watches",
                format!(
                    "{} blocking queries are held already (--watch-max); retry later or without ?index=",
                    self.max
                ),
            ));
        }
        crate::metrics::watch_held(true);
        let _held = Held(self.held.clone());
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let changed = registry.changed();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let revision = registry.current_revision();
            if revision > index {
                return Ok(revision);
            }
            let expiry = registry
                .until_next_expiry()
                .map_or(deadline, |d| (tokio::time::Instant::now() + d).min(deadline));
            tokio::select! {
                _ = &mut changed => {}
                _ = tokio::time::sleep_until(expiry) => {
                    if expiry >= deadline {
                        return Ok(registry.current_revision());
                    }
                    // A lease ended: the loop reaps it, and the revision moves.
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                _ = self.shutdown.cancelled() => return Ok(registry.current_revision()),
            }
        }
    }
}

/// The `X-Koder-Index` header for `revision`.
pub fn index_header(revision: u64) -> (HeaderName, HeaderValue) {
    (INDEX_HEADER, HeaderValue::from(revision))
}
