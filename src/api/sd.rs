//! `GET /api/v1/sd/prometheus`: Prometheus HTTP service discovery (`http_sd_configs`), so a
//! Prometheus scrapes whatever registered itself, with its metadata as labels.

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use serde::Serialize;

use super::AppState;
use super::auth::Authorized;
use super::error::{ApiError, ErrorBody};
use super::services::flag;
use crate::model::instance::{Address, Instance};
use crate::registry::Filter;

/// Which instances are targets.
#[derive(Debug, Default, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct SdParams {
    /// `1` or `true`: healthy instances only.
    healthy_only: Option<String>,
    /// One service.
    name: Option<String>,
}

/// One target group, as Prometheus reads it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct TargetGroup {
    targets: [String; 1],
    labels: BTreeMap<String, String>,
}

/// A label name Prometheus accepts: `[a-zA-Z0-9_]`, everything else as `_` (as Consul SD
/// does for its metadata labels).
fn label_name(key: &str) -> String {
    key.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// One group per instance, so each target carries its own labels.
fn group(instance: &Instance) -> TargetGroup {
    let host = match &instance.address {
        Address::Ip(ip) if ip.is_ipv6() => format!("[{ip}]"),
        address => address.to_string(),
    };
    let mut labels = BTreeMap::from([
        ("__meta_koder_service".to_owned(), instance.name.to_string()),
        ("__meta_koder_id".to_owned(), instance.id.to_string()),
        ("__meta_koder_address".to_owned(), instance.address.to_string()),
        ("__meta_koder_port".to_owned(), instance.port.to_string()),
        ("__meta_koder_protocol".to_owned(), instance.protocol.to_string()),
        ("__meta_koder_healthy".to_owned(), instance.healthy.to_string()),
        // Consul's convention: separators at both ends, so `.*,tag,.*` matches one tag.
        ("__meta_koder_tags".to_owned(), format!(",{},", instance.tags.join(","))),
    ]);
    for (key, value) in instance.metadata.iter() {
        labels.insert(format!("__meta_koder_metadata_{}", label_name(key)), value.to_owned());
    }
    TargetGroup {
        targets: [format!("{host}:{}", instance.port)],
        labels,
    }
}

/// `?name=` keeps one service, `?healthy_only=1` healthy instances; instances parked by the
/// registry's own outage are left out until confirmed, as from DNS.
#[utoipa::path(get, path = "/api/v1/sd/prometheus", tag = "operations", params(SdParams),
    responses(
        (status = 200, description = "target groups for Prometheus http_sd_configs", body = Vec<TargetGroup>),
        (status = 401, description = "no valid key", body = ErrorBody),
        (status = 408, description = "the request took longer than the request timeout", body = ErrorBody),
        (status = 400, description = "a parameter does not parse", body = ErrorBody)
    ))]
pub async fn prometheus(
    _: Authorized,
    State(app): State<AppState>,
    params: Result<Query<SdParams>, QueryRejection>,
) -> Result<Json<Vec<TargetGroup>>, ApiError> {
    let Query(params) = params.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let filter = Filter {
        name: params.name.filter(|n| !n.is_empty()).map(|n| n.to_ascii_lowercase()),
        healthy_only: flag("healthy_only", params.healthy_only.as_deref())?,
        confirmed_only: true,
    };
    Ok(Json(app.store.registry.list(&filter).iter().map(group).collect()))
}
