//! R8 and R5 routes: the generated ports file, the drift check, the edge-routing table.

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::IntoResponse;

use super::AppState;
use super::auth::Authorized;
use super::body::{LimitedBody, MAX_REFERENCE};
use super::error::{ApiError, ErrorBody};
use super::watch::{WatchParams, index_header};
use crate::export::{PortsFile, drift, routes};
use crate::registry::Filter;

/// What the export and routes describe: every live instance except those parked by the
/// registry's outage, which are not served until confirmed.
const SERVED: Filter = Filter {
    name: None,
    healthy_only: false,
    confirmed_only: true,
};

fn live_ports(app: &AppState) -> PortsFile {
    PortsFile::from_instances(&app.store.registry.list(&SERVED))
}

/// `GET /services/export`: koder-service-ports.toml.
#[utoipa::path(get, path = "/api/v1/services/export", tag = "artifacts", params(WatchParams),
    responses(
        (status = 200, description = "koder-service-ports.toml (R8)", body = String, content_type = "application/toml",
            headers(("X-Koder-Index" = u64, description = "the revision this answer shows; send it back as ?index= to wait for the next change"))),
        (status = 400, description = "?index= or ?wait= does not parse", body = ErrorBody),
        (status = 429, description = "--watch-max blocking queries are held already", body = ErrorBody),
        (status = 401, description = "no valid key", body = ErrorBody),
        (status = 408, description = "the request took longer than the request timeout", body = ErrorBody)
    ))]
pub async fn export(
    _: Authorized,
    State(app): State<AppState>,
    watch: Result<Query<WatchParams>, QueryRejection>,
) -> Result<impl IntoResponse, ApiError> {
    let revision = held(&app, watch).await?;
    Ok((
        [
            (header::CONTENT_TYPE, HeaderValue::from_static("application/toml")),
            index_header(revision),
        ],
        live_ports(&app).render(),
    ))
}

#[utoipa::path(get, path = "/api/v1/services/drift", tag = "artifacts",
    responses(
        (status = 200, description = "the drift report against the --drift-reference file", body = crate::export::drift::DriftReport),
        (status = 401, description = "no valid key", body = ErrorBody),
        (status = 404, description = "no --drift-reference is configured", body = ErrorBody),
        (status = 408, description = "the request took longer than the request timeout", body = ErrorBody),
        (status = 503, description = "the reference file cannot be read or parsed now", body = ErrorBody)
    ))]
/// `GET /services/drift`: the live registry against the configured `--drift-reference`.
pub async fn drift_configured(
    _: Authorized,
    State(app): State<AppState>,
) -> Result<Json<drift::DriftReport>, ApiError> {
    let path = app.drift_reference.as_deref().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "no_reference",
            "no reference is configured: start with --drift-reference FILE, or POST a reference here",
        )
    })?;
    let path = path.to_owned();
    let reference = tokio::task::spawn_blocking(move || drift::load_reference(&path))
        .await
        .expect("reading a file does not panic")
        .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "reference_unavailable", e))?;
    Ok(Json(drift::check(&live_ports(&app), &reference)))
}

/// Waits as `?index=&wait=` ask; the revision to answer with.
async fn held(app: &AppState, watch: Result<Query<WatchParams>, QueryRejection>) -> Result<u64, ApiError> {
    let Query(watch) = watch.map_err(|e| ApiError::bad_request(e.body_text()))?;
    app.watches.wait(&app.store.registry, &watch).await
}

/// `POST /services/drift`: the body is a reference koder-service-ports.toml.
#[utoipa::path(post, path = "/api/v1/services/drift", tag = "artifacts",
    request_body(content = String, description = "a reference koder-service-ports.toml", content_type = "text/plain"),
    responses(
        (status = 200, description = "the drift report", body = crate::export::drift::DriftReport),
        (status = 401, description = "no valid key", body = ErrorBody),
        (status = 408, description = "the request took longer than the request timeout", body = ErrorBody),
        (status = 400, description = "the reference is not a ports file; the message names the line", body = ErrorBody),
        (status = 413, description = "the reference is over 16 MiB", body = ErrorBody)
    ))]
pub async fn drift(
    _: Authorized,
    State(app): State<AppState>,
    LimitedBody(body): LimitedBody<MAX_REFERENCE>,
) -> Result<Json<drift::DriftReport>, ApiError> {
    let text = std::str::from_utf8(&body).map_err(|_| ApiError::bad_request("the reference file is not UTF-8"))?;
    let reference = PortsFile::parse(text).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_reference",
            format!("the reference file is not a ports file: {e}"),
        )
    })?;
    Ok(Json(drift::check(&live_ports(&app), &reference)))
}

/// `GET /routes`: every routed domain with its instances; conflicts flagged.
#[utoipa::path(get, path = "/api/v1/routes", tag = "artifacts", params(WatchParams),
    responses(
        (status = 200, description = "every routed domain with its instances", body = Routes,
            headers(("X-Koder-Index" = u64, description = "the revision this answer shows; send it back as ?index= to wait for the next change"))),
        (status = 400, description = "?index= or ?wait= does not parse", body = ErrorBody),
        (status = 429, description = "--watch-max blocking queries are held already", body = ErrorBody),
        (status = 401, description = "no valid key", body = ErrorBody),
        (status = 408, description = "the request took longer than the request timeout", body = ErrorBody)
    ))]
pub async fn routes(
    _: Authorized,
    State(app): State<AppState>,
    watch: Result<Query<WatchParams>, QueryRejection>,
) -> Result<impl IntoResponse, ApiError> {
    let revision = held(&app, watch).await?;
    let table = Routes {
        routes: routes::routes(&app.store.registry.list(&SERVED)),
    };
    Ok(([index_header(revision)], Json(table)))
}

/// The edge-routing table (R5).
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct Routes {
    pub routes: Vec<routes::Route>,
}
