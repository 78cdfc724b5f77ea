//! The REST surface (R7): routes, authentication and errors.

pub mod auth;
pub mod body;
pub mod error;
pub mod export;
pub mod services;

use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::routing::{get, post};

use crate::registry::store::Store;
use auth::ApiKeys;
use error::ApiError;

#[derive(Clone)]
pub struct AppState {
    pub store: Arc<Store>,
}

pub fn router(state: AppState, keys: Arc<ApiKeys>) -> Router {
    let api = Router::new()
        .route("/services", get(services::list))
        .route("/services/register", post(services::register))
        .route("/services/heartbeat", post(services::heartbeat))
        .route("/services/deregister", post(services::deregister))
        .route("/services/export", get(export::export))
        .route("/services/drift", post(export::drift))
        .route("/routes", get(export::routes))
        .route_layer(axum::middleware::from_fn_with_state(keys, auth::require_key));
    Router::new()
        .route("/healthz", get(|| async { axum::Json(serde_json::json!({ "status": "ok" })) }))
        .nest("/api/v1", api)
        .fallback(|| async { ApiError::not_found("no such route; the API lives under /api/v1 (see the README)") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "this route does not take that method")
        })
        .layer(DefaultBodyLimit::max(body::MAX_BODY))
        .with_state(state)
}
