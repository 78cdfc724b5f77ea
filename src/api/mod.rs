//! The REST surface (R7): routes, authentication and errors.

pub mod auth;
pub mod body;
pub mod error;
pub mod export;
pub mod serve;
pub mod services;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRef, Request, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::registry::store::Store;
use auth::ApiKeys;
use error::ApiError;

#[derive(Clone)]
pub struct AppState {
    pub store: Arc<Store>,
    pub keys: Arc<ApiKeys>,
}

impl FromRef<AppState> for Arc<ApiKeys> {
    fn from_ref(app: &AppState) -> Self {
        app.keys.clone()
    }
}

/// Answers 408 (as JSON) when a request, body included, takes longer than `limit`.
async fn deadline(State(limit): State<Duration>, request: Request, next: Next) -> Response {
    match tokio::time::timeout(limit, next.run(request)).await {
        Ok(response) => response,
        Err(_) => ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            format!("the request was not completed within {limit:?}"),
        )
        .into_response(),
    }
}

/// Unknown routes: 404, or 401 under `/api/v1` without a key.
async fn not_found(State(keys): State<Arc<ApiKeys>>, uri: Uri, headers: HeaderMap) -> ApiError {
    keys.check_path(uri.path(), &headers)
        .err()
        .unwrap_or_else(|| ApiError::not_found("no such route; the API lives under /api/v1 (see the README)"))
}

/// Known routes asked with another method: 405, or 401 under `/api/v1` without a key.
async fn method_not_allowed(State(keys): State<Arc<ApiKeys>>, uri: Uri, headers: HeaderMap) -> ApiError {
    keys.check_path(uri.path(), &headers).err().unwrap_or_else(|| {
        ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "this route does not take that method")
    })
}

/// Every route. Those under `/api/v1` take [`auth::Authorized`] first; the fallbacks check
/// the key themselves.
pub fn router(state: AppState, request_timeout: Duration) -> Router {
    Router::new()
        .route("/healthz", get(|| async { axum::Json(serde_json::json!({ "status": "ok" })) }))
        .route("/api/v1/services", get(services::list))
        .route("/api/v1/services/register", post(services::register))
        .route("/api/v1/services/heartbeat", post(services::heartbeat))
        .route("/api/v1/services/deregister", post(services::deregister))
        .route("/api/v1/services/export", get(export::export))
        .route("/api/v1/services/drift", post(export::drift).layer(DefaultBodyLimit::max(body::MAX_REFERENCE)))
        .route("/api/v1/routes", get(export::routes))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(body::MAX_BODY))
        .layer(axum::middleware::from_fn_with_state(request_timeout, deadline))
        .with_state(state)
}
