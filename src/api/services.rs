//! The R7 routes under `/api/v1/services`.

use axum::Json;
use axum::extract::{Query, State, rejection::QueryRejection};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use compact_str::CompactString;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::AppState;
use super::auth::Authorized;
use super::body::JsonBody;
use super::error::ApiError;
use crate::registry::Filter;
use crate::registry::instance::{Instance, Registration};

#[derive(Debug, Serialize)]
pub struct RegisterResponse {
    pub id: CompactString,
    pub created: bool,
}

/// `{"id": …}`, the body of heartbeat and deregister.
#[derive(Debug, Deserialize)]
pub struct IdBody {
    id: Option<String>,
}

impl IdBody {
    fn id(self) -> Result<String, ApiError> {
        self.id.filter(|id| !id.is_empty()).ok_or_else(|| ApiError::from(crate::registry::instance::FieldError::new("id", "is required")))
    }
}

/// R2: upsert; `created` only on the first registration of a live id.
pub async fn register(_: Authorized, State(app): State<AppState>, JsonBody(body): JsonBody<Registration>) -> Result<Json<RegisterResponse>, ApiError> {
    let spec = body.validate()?;
    // Run to completion even if the client goes away: a change is committed or undone whole.
    let store = app.store.clone();
    let registered = tokio::spawn(async move { store.register(spec).await }).await.expect("register does not panic")?;
    Ok(Json(RegisterResponse { id: registered.instance.id, created: registered.created }))
}

/// R3: renews the lease; 410 once it has run out, so the registrant re-registers. Answers
/// with the instance, serialised as it is renewed.
pub async fn heartbeat(_: Authorized, State(app): State<AppState>, JsonBody(body): JsonBody<IdBody>) -> Result<Response, ApiError> {
    let id = body.id()?;
    let json = app.store.heartbeat(&id, |instance| serde_json::to_vec(instance).expect("instances serialise"));
    let json = json.ok_or_else(|| {
        ApiError::new(StatusCode::GONE, "gone", format!("instance {id:?} is unknown or its lease has run out; register it again"))
    })?;
    Ok(([(header::CONTENT_TYPE, "application/json")], json).into_response())
}

/// R4: removes at once; 404 when unknown.
pub async fn deregister(_: Authorized, State(app): State<AppState>, JsonBody(body): JsonBody<IdBody>) -> Result<Json<Value>, ApiError> {
    let id = body.id()?;
    let (store, key) = (app.store.clone(), id.clone());
    if tokio::spawn(async move { store.deregister(&key).await }).await.expect("deregister does not panic")? {
        Ok(Json(json!({ "id": id, "deregistered": true })))
    } else {
        Err(ApiError::not_found(format!("instance {id:?} is not registered")))
    }
}

#[derive(Debug, Default, Deserialize)]
pub struct ListParams {
    detail: Option<String>,
    healthy_only: Option<String>,
    name: Option<String>,
}

fn flag(name: &str, value: Option<&str>) -> Result<bool, ApiError> {
    match value.map(str::to_ascii_lowercase).as_deref() {
        None | Some("") | Some("0") | Some("false") | Some("no") => Ok(false),
        Some("1") | Some("true") | Some("yes") => Ok(true),
        Some(other) => Err(ApiError::bad_request(format!("?{name}={other} is not a boolean; use 1 or 0"))),
    }
}

/// R7: service names, or with `?detail=1` full instances; `?healthy_only=1`, `?name=`.
pub async fn list(_: Authorized, State(app): State<AppState>, params: Result<Query<ListParams>, QueryRejection>) -> Result<Json<Listing>, ApiError> {
    let Query(params) = params.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let filter = Filter {
        name: params.name.filter(|n| !n.is_empty()).map(|n| n.to_ascii_lowercase()),
        healthy_only: flag("healthy_only", params.healthy_only.as_deref())?,
    };
    let registry = &app.store.registry;
    // Serialised straight from the structs: a JSON value tree of 100k instances would cost
    // several hundred megabytes on the way out.
    Ok(if flag("detail", params.detail.as_deref())? {
        Json(Listing::Instances(registry.list(&filter)))
    } else {
        Json(Listing::Services(registry.service_names(&filter)))
    })
}

#[derive(Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Listing {
    Instances(Vec<Instance>),
    Services(Vec<String>),
}
