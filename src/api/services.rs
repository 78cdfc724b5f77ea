//! The R7 routes under `/api/v1/services`.

use axum::Json;
use axum::extract::{Query, State, rejection::QueryRejection};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use compact_str::CompactString;
use serde::{Deserialize, Serialize};

use super::AppState;
use super::auth::{Authorized, audit, forbidden};
use super::body::JsonBody;
use super::error::{ApiError, ErrorBody};
use super::watch::{WatchParams, index_header};
use crate::metrics;
use crate::model::instance::Instance;
use crate::registry::Filter;
use crate::store::Renewal;

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct RegisterResponse {
    #[schema(value_type = String)]
    pub id: CompactString,
    pub created: bool,
}

/// `{"id": …}`, the body of heartbeat and deregister.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct IdBody {
    id: Option<String>,
}

impl IdBody {
    fn id(self) -> Result<String, ApiError> {
        self.id
            .filter(|id| !id.is_empty())
            .ok_or_else(|| ApiError::from(crate::model::FieldError::new("id", "is required")))
    }
}

/// R2: upsert; `created` only on the first registration of a live id.
#[utoipa::path(post, path = "/api/v1/services/register", tag = "services", request_body = Instance,
    responses(
        (status = 200, description = "registered (or refreshed), durable", body = RegisterResponse),
        (status = 401, description = "no valid key", body = ErrorBody),
        (status = 403, description = "the key may not register this service (a read key, or a register key whose services do not match the name, or the id's stored service)", body = ErrorBody),
        (status = 408, description = "the request took longer than the request timeout", body = ErrorBody),
        (status = 400, description = "a field is missing or invalid; the message names it", body = ErrorBody),
        (status = 413, description = "the body is over 64 KiB", body = ErrorBody),
        (status = 503, description = "the store cannot take the change; nothing was changed", body = ErrorBody),
        (status = 507, description = "the registry holds --max-instances", body = ErrorBody)
    ))]
pub async fn register(
    caller: Authorized,
    State(app): State<AppState>,
    JsonBody(body): JsonBody<Instance>,
) -> Result<Json<RegisterResponse>, ApiError> {
    let result = upsert(&caller, app, body).await;
    match &result {
        Ok(r) => metrics::registration(if r.created { "created" } else { "refreshed" }, ""),
        Err(e) => metrics::registration("refused", e.code),
    }
    result
}

async fn upsert(caller: &Authorized, app: AppState, body: Instance) -> Result<Json<RegisterResponse>, ApiError> {
    let new = body.validate()?;
    app.ttl_bounds.check(new.ttl_ns)?;
    caller.may_change(&new.name, format_args!("register instances of service {:?}", new.name))?;
    // An id of another service would be taken over: the stored one's service counts too.
    if !caller.key.may_write_all()
        && let Some(stored) = app.store.registry.service_of(&new.id)
        && stored != new.name
    {
        caller.may_change(
            &stored,
            format_args!("replace instance {:?}, which belongs to service {stored:?}", new.id),
        )?;
    }
    let service = new.name.clone();
    // Completed even if the client goes away and this is dropped (see `Store::register`).
    let registered = app.store.register(new).await?;
    audit!(info, caller, "registered", id = %registered.instance.id, %service, created = registered.created);
    Ok(Json(RegisterResponse {
        id: registered.instance.id,
        created: registered.created,
    }))
}

/// R3: renews the lease; 410 once it has run out, so the registrant re-registers. Answers
/// with the instance, serialised as it is renewed.
#[utoipa::path(post, path = "/api/v1/services/heartbeat", tag = "services", request_body = IdBody,
    responses(
        (status = 200, description = "the lease is renewed; the instance as stored", body = Instance),
        (status = 401, description = "no valid key", body = ErrorBody),
        (status = 403, description = "the key may not renew instances of the service this id belongs to", body = ErrorBody),
        (status = 408, description = "the request took longer than the request timeout", body = ErrorBody),
        (status = 400, description = "no id", body = ErrorBody),
        (status = 410, description = "unknown, or its lease has run out: register again", body = ErrorBody),
        (status = 413, description = "the body is over 64 KiB", body = ErrorBody),
        (status = 503, description = "--store etcd: etcd could not take the renewal (unreachable or without quorum; outcome_unknown: it may still have)", body = ErrorBody)
    ))]
pub async fn heartbeat(
    caller: Authorized,
    State(app): State<AppState>,
    JsonBody(body): JsonBody<IdBody>,
) -> Result<Response, ApiError> {
    let id = body.id()?;
    let renewal = app
        .store
        .heartbeat(
            &id,
            |service| caller.key.may_write(service),
            |instance| serde_json::to_vec(instance).expect("instances serialise"),
        )
        .await
        .inspect_err(|_| metrics::heartbeat("unavailable"))?;
    let json = match renewal {
        Renewal::Renewed(json) => Some(json),
        Renewal::Gone => None,
        Renewal::Refused { service } => {
            return Err(forbidden(
                &caller.key,
                format_args!("renew instance {id:?}, which belongs to service {service:?}"),
            ));
        }
    };
    metrics::heartbeat(if json.is_some() { "ok" } else { "gone" });
    if json.is_some() {
        // A line per renewal would outnumber every other line by far (10,000 instances on
        // 30 s leases renew 1,000 times a second): at debug, `KODER_DNS_LOG=info,koder_dns::audit=debug`.
        audit!(debug, caller, "renewed", id = %id);
    }
    let json = json.ok_or_else(|| {
        ApiError::new(
            StatusCode::GONE,
            "gone",
            format!("instance {id:?} is unknown or its lease has run out; register it again"),
        )
    })?;
    Ok(([(header::CONTENT_TYPE, "application/json")], json).into_response())
}

/// R4: removes at once; 404 when unknown.
#[utoipa::path(post, path = "/api/v1/services/deregister", tag = "services", request_body = IdBody,
    responses(
        (status = 200, description = "removed", body = Deregistered),
        (status = 401, description = "no valid key", body = ErrorBody),
        (status = 403, description = "the key may not remove instances of the service this id belongs to", body = ErrorBody),
        (status = 408, description = "the request took longer than the request timeout", body = ErrorBody),
        (status = 400, description = "no id", body = ErrorBody),
        (status = 404, description = "not registered", body = ErrorBody),
        (status = 413, description = "the body is over 64 KiB", body = ErrorBody),
        (status = 503, description = "the store cannot take the change", body = ErrorBody)
    ))]
pub async fn deregister(
    caller: Authorized,
    State(app): State<AppState>,
    JsonBody(body): JsonBody<IdBody>,
) -> Result<Json<Deregistered>, ApiError> {
    let id = body.id()?;
    // An unknown id goes on to its 404.
    let service = app.store.registry.service_of(&id);
    if let Some(service) = &service {
        caller.may_change(
            service,
            format_args!("remove instance {id:?}, which belongs to service {service:?}"),
        )?;
    }
    let (store, key) = (app.store.clone(), id.clone());
    let removed = tokio::spawn(async move { store.deregister(&key).await })
        .await
        .expect("deregister does not panic");
    metrics::deregistration(match removed {
        Ok(true) => "ok",
        Ok(false) => "not_found",
        Err(_) => "unavailable",
    });
    if removed? {
        audit!(info, caller, "deregistered", id = %id, service = %service.unwrap_or_default());
        Ok(Json(Deregistered { id, deregistered: true }))
    } else {
        Err(ApiError::not_found(format!("instance {id:?} is not registered")))
    }
}

#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListParams {
    /// `1` or `true`: full instances instead of names.
    pub(super) detail: Option<String>,
    /// `1` or `true`: healthy instances only (and names that have one).
    pub(super) healthy_only: Option<String>,
    /// One service.
    pub(super) name: Option<String>,
}

/// The answer of a deregistration.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Deregistered {
    pub id: String,
    pub deregistered: bool,
}

pub(super) fn flag(name: &str, value: Option<&str>) -> Result<bool, ApiError> {
    match value.map(str::to_ascii_lowercase).as_deref() {
        None | Some("") | Some("0") | Some("false") | Some("no") => Ok(false),
        Some("1") | Some("true") | Some("yes") => Ok(true),
        Some(other) => Err(ApiError::bad_request(format!(
            "?{name}={other} is not a boolean; use 1 or 0"
        ))),
    }
}

/// R7: service names, or with `?detail=1` full instances; `?healthy_only=1`, `?name=`.
#[utoipa::path(get, path = "/api/v1/services", tag = "services", params(ListParams, WatchParams),
    responses(
        (status = 200, description = "service names, or with detail=1 the instances", body = Listing,
            headers(("X-Koder-Index" = u64, description = "the revision this answer shows; send it back as ?index= to wait for the next change"))),
        (status = 429, description = "--watch-max blocking queries are held already", body = ErrorBody),
        (status = 401, description = "no valid key", body = ErrorBody),
        (status = 408, description = "the request took longer than the request timeout", body = ErrorBody),
        (status = 400, description = "a parameter does not parse", body = ErrorBody)
    ))]
pub async fn list(
    _: Authorized,
    State(app): State<AppState>,
    params: Result<Query<ListParams>, QueryRejection>,
    watch: Result<Query<WatchParams>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(params) = params.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let Query(watch) = watch.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let revision = app.watches.wait(&app.store.registry, &watch).await?;
    let filter = Filter {
        name: params.name.filter(|n| !n.is_empty()).map(|n| n.to_ascii_lowercase()),
        healthy_only: flag("healthy_only", params.healthy_only.as_deref())?,
        confirmed_only: false,
    };
    let registry = &app.store.registry;
    // Serialised straight from the structs: a JSON value tree of 100k instances would cost
    // several hundred megabytes on the way out.
    let listing = if flag("detail", params.detail.as_deref())? {
        Listing::Instances(registry.list(&filter))
    } else {
        Listing::Services(registry.service_names(&filter))
    };
    Ok(([index_header(revision)], Json(listing)).into_response())
}

#[derive(Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Listing {
    Instances(Vec<Instance>),
    Services(Vec<String>),
}
