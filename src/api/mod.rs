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
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::http::StatusCode;
use axum::routing::{get, post};

use crate::registry::store::Store;
use auth::ApiKeys;
use error::ApiError;

#[derive(Clone)]
pub struct AppState {
    pub store: Arc<Store>,
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

async fn not_found() -> ApiError {
    ApiError::not_found("no such route; the API lives under /api/v1 (see the README)")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "this route does not take that method")
}

pub fn router(state: AppState, keys: Arc<ApiKeys>, request_timeout: Duration) -> Router {
    let api = Router::new()
        .route("/services", get(services::list))
        .route("/services/register", post(services::register))
        .route("/services/heartbeat", post(services::heartbeat))
        .route("/services/deregister", post(services::deregister))
        .route("/services/export", get(export::export))
        .route("/services/drift", post(export::drift).layer(DefaultBodyLimit::max(body::MAX_REFERENCE)))
        .route("/routes", get(export::routes))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // On the whole tree, unknown routes included: without a key nothing is revealed.
        .layer(axum::middleware::from_fn_with_state(keys, auth::require_key));
    Router::new()
        .route("/healthz", get(|| async { axum::Json(serde_json::json!({ "status": "ok" })) }))
        .nest("/api/v1", api)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(body::MAX_BODY))
        .layer(axum::middleware::from_fn_with_state(request_timeout, deadline))
        .with_state(state)
}
