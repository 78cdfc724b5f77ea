//! The REST surface (R7): routes, authentication and errors.

pub mod auth;
pub mod body;
pub mod error;
pub mod export;
pub mod openapi;
pub mod sd;
pub mod serve;
pub mod services;
pub mod watch;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRef, Request, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};

use crate::access::Access;
use crate::store::Store;
use error::ApiError;

/// What every handler shares: a cheap-clone handle, because axum clones the state for each
/// request. As a plain struct of its parts (a cancellation token, whose clone and drop take
/// a lock, a path, several `Arc`s) its clone and drop were 3-4% of the CPU of a heartbeat
/// under load (perf); one `Arc` costs an increment.
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

impl AppState {
    pub fn new(shared: Shared) -> Self {
        Self(Arc::new(shared))
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

pub struct Shared {
    pub store: Arc<Store>,
    /// Blocking queries: the bound and the shutdown that answers them.
    pub watches: watch::Watches,
    /// `--drift-reference`: the file `GET /services/drift` compares with, read on each request
    /// so that an updated reference counts at once.
    pub drift_reference: Option<std::path::PathBuf>,
    /// `GET /ui`, rendered once at start.
    pub ui: axum::body::Bytes,
    /// `GET /metrics`.
    pub metrics: Arc<crate::metrics::Exposition>,
    /// The keys in force (a reload swaps their table).
    pub access: Arc<Access>,
    /// `--min-ttl` and `--max-ttl`: the leases a registration may ask for.
    pub ttl_bounds: TtlBounds,
}

/// The range of a registration's own `ttl_ns`: a lease too short is dead before the answer
/// arrives, one too long outlives any operator's idea of a dead registrant.
#[derive(Clone, Copy, Debug)]
pub struct TtlBounds {
    pub min: Duration,
    pub max: Duration,
}

impl TtlBounds {
    /// `ttl_ns` of 0 or less means the default and is always allowed.
    pub fn check(&self, ttl_ns: i64) -> Result<(), crate::model::FieldError> {
        let (min, max) = (self.min.as_nanos() as i64, self.max.as_nanos() as i64);
        if ttl_ns > 0 && !(min..=max).contains(&ttl_ns) {
            return Err(crate::model::FieldError::new(
                "ttl_ns",
                format!(
                    "must be 0 (the default lease) or between {min} ({:?}, --min-ttl) and {max} ({:?}, --max-ttl), got {ttl_ns}",
                    self.min, self.max
                ),
            ));
        }
        Ok(())
    }
}

impl FromRef<AppState> for Arc<Access> {
    fn from_ref(app: &AppState) -> Self {
        app.access.clone()
    }
}

/// Unknown routes: 404, or 401 under `/api/v1` without a key.
async fn not_found(State(access): State<Arc<Access>>, uri: Uri, headers: HeaderMap) -> ApiError {
    auth::check_path(&access, uri.path(), &headers)
        .err()
        .unwrap_or_else(|| ApiError::not_found("no such route; the API lives under /api/v1 (see the README)"))
}

/// Known routes asked with another method: 405, or 401 under `/api/v1` without a key.
async fn method_not_allowed(State(access): State<Arc<Access>>, uri: Uri, headers: HeaderMap) -> ApiError {
    auth::check_path(&access, uri.path(), &headers)
        .err()
        .unwrap_or_else(|| {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "this route does not take that method",
            )
        })
}

/// Liveness with detail: `200` whenever the server listens (a full disk must not get it
/// restarted), `status` `degraded` with the disk's state when commits fail.
async fn healthz(State(app): State<AppState>) -> axum::Json<serde_json::Value> {
    let disk = app.store.disk_status();
    let status = if disk.state == "ok" { "ok" } else { "degraded" };
    let mut body = serde_json::json!({ "status": status, "disk": disk });
    // On etcd: this node and the live nodes the health checks are spread over.
    if let Some(membership) = app.store.membership() {
        let members: Vec<String> = membership.members.borrow().iter().map(|m| m.to_string()).collect();
        body["node"] = membership.me.to_string().into();
        body["members"] = members.into();
    }
    axum::Json(body)
}

/// `GET /metrics`: no key, like `/healthz`, so a Prometheus needs no secret to scrape.
pub async fn metrics(State(exposition): State<Arc<crate::metrics::Exposition>>) -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        exposition.render(),
    )
        .into_response()
}

impl FromRef<AppState> for Arc<crate::metrics::Exposition> {
    fn from_ref(app: &AppState) -> Self {
        app.metrics.clone()
    }
}

/// The status page: static HTML and script from the binary (no CDN), with the default lease
/// written in so it can show the time left on leases of `ttl_ns` 0. It holds no data: the
/// script asks the API with the key the operator types into its form.
pub fn ui_page(default_ttl: Duration) -> axum::body::Bytes {
    include_str!("ui.html")
        .replace("__DEFAULT_TTL_NS__", &default_ttl.as_nanos().to_string())
        .into()
}

async fn ui(State(app): State<AppState>) -> Response {
    (
        [
            (axum::http::header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // Nothing from elsewhere, and never inside another site's frame.
            (
                axum::http::header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; frame-ancestors 'none'",
            ),
        ],
        app.ui.clone(),
    )
        .into_response()
}

/// What every route's requests go through: counted under the route's pattern (method,
/// status, latency), and answered 408 (as JSON) when a request, body included, takes longer
/// than `limit`. One hand-written layer, because the two `from_fn` middlewares it replaces
/// each boxed and cloned the route's service on every request.
#[derive(Clone)]
struct Measured<S = ()> {
    inner: S,
    counters: crate::metrics::RouteCounters,
    limit: Duration,
}

impl<S> tower_layer::Layer<S> for Measured {
    type Service = Measured<S>;

    fn layer(&self, inner: S) -> Measured<S> {
        Measured {
            inner,
            counters: self.counters.clone(),
            limit: self.limit,
        }
    }
}

impl<S> tower_service::Service<Request> for Measured<S>
where
    S: tower_service::Service<Request, Response = Response, Error = std::convert::Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let method = match *request.method() {
            axum::http::Method::GET => "GET",
            axum::http::Method::POST => "POST",
            axum::http::Method::HEAD => "HEAD",
            _ => "other",
        };
        // A blocking query is held by design: its own `wait` bounds it, plus the usual limit.
        let blocking = request
            .uri()
            .query()
            .is_some_and(|q| q.split('&').any(|p| p.starts_with("index=")));
        let limit = if blocking {
            self.limit + watch::MAX_WAIT + watch::MAX_WAIT / 16
        } else {
            self.limit
        };
        let counters = self.counters.clone();
        let answer = self.inner.call(request);
        Box::pin(async move {
            let started = std::time::Instant::now();
            let response = match tokio::time::timeout(limit, answer).await {
                Ok(Ok(response)) => response,
                Ok(Err(never)) => match never {},
                Err(_) => ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "request_timeout",
                    format!("the request was not completed within {limit:?}"),
                )
                .into_response(),
            };
            counters.record(method, response.status().as_u16(), started.elapsed());
            Ok(response)
        })
    }
}

/// `Router::route`, with the route's requests going through [`Measured`].
trait MeasuredRoute {
    fn measured(self, path: &'static str, route: MethodRouter<AppState>, limit: Duration) -> Self;
}

impl MeasuredRoute for Router<AppState> {
    fn measured(self, path: &'static str, route: MethodRouter<AppState>, limit: Duration) -> Self {
        let counters = crate::metrics::RouteCounters::new(path);
        self.route(
            path,
            route.layer(Measured {
                inner: (),
                counters,
                limit,
            }),
        )
    }
}

/// Every route. Those under `/api/v1` take [`auth::Authorized`] first; the fallbacks check
/// the key themselves.
/// `/metrics` is among them unless `--metrics-listen` gave it an address of its own.
pub fn router(state: AppState, request_timeout: Duration, with_metrics: bool) -> Router {
    let t = request_timeout;
    let mut router = Router::new()
        .measured("/healthz", get(healthz), t)
        .measured("/ui", get(ui), t);
    if with_metrics {
        router = router.measured("/metrics", get(metrics), t);
    }
    router
        .measured("/api/v1/services", get(services::list), t)
        .measured("/api/v1/services/register", post(services::register), t)
        .measured("/api/v1/services/heartbeat", post(services::heartbeat), t)
        .measured("/api/v1/services/deregister", post(services::deregister), t)
        .measured("/api/v1/services/export", get(export::export), t)
        .measured(
            "/api/v1/services/drift",
            get(export::drift_configured)
                .post(export::drift)
                .layer(DefaultBodyLimit::max(body::MAX_REFERENCE)),
            t,
        )
        .measured("/api/v1/routes", get(export::routes), t)
        .measured("/api/v1/sd/prometheus", get(sd::prometheus), t)
        .measured("/api/v1/openapi.json", get(openapi::openapi), t)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(body::MAX_BODY))
        .with_state(state)
}
