//! R8 and R5 routes: the generated ports file, the drift check, the edge-routing table.

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use serde_json::{Value, json};

use super::AppState;
use super::auth::Authorized;
use super::body::{LimitedBody, MAX_REFERENCE};
use super::error::ApiError;
use crate::export::{PortsFile, drift, routes};
use crate::registry::Filter;

fn live_ports(app: &AppState) -> PortsFile {
    PortsFile::from_instances(&app.store.registry.list(&Filter::default()))
}

/// `GET /services/export`: koder-service-ports.toml.
pub async fn export(_: Authorized, State(app): State<AppState>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/toml")], live_ports(&app).render())
}

/// `POST /services/drift`: the body is a reference koder-service-ports.toml.
pub async fn drift(_: Authorized, State(app): State<AppState>, LimitedBody(body): LimitedBody<MAX_REFERENCE>) -> Result<Json<drift::DriftReport>, ApiError> {
    let text = std::str::from_utf8(&body).map_err(|_| ApiError::bad_request("the reference file is not UTF-8"))?;
    let reference = PortsFile::parse(text)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_reference", format!("the reference file is not a ports file: {e}")))?;
    Ok(Json(drift::check(&live_ports(&app), &reference)))
}

/// `GET /routes`: every routed domain with its instances; conflicts flagged.
pub async fn routes(_: Authorized, State(app): State<AppState>) -> Json<Value> {
    Json(json!({ "routes": routes::routes(&app.store.registry.list(&Filter::default())) }))
}
