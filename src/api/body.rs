//! Request bodies: JSON whatever the `Content-Type`, at most 64 KiB, with errors that name
//! the field that was wrong.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{StatusCode, header};
use serde::de::DeserializeOwned;

use super::error::ApiError;

pub const MAX_BODY: usize = 64 * 1024;
/// A reference ports file for the drift check: the export of a large registry is well over
/// 64 KiB (about 45 bytes per instance), and it is TOML, not a JSON request.
pub const MAX_REFERENCE: usize = 16 * 1024 * 1024;

fn too_large(max: usize) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
        format!("this request's body is limited to {max} bytes"),
    )
}

/// The raw body, at most `MAX` bytes (the route must allow as much with `DefaultBodyLimit`).
/// A declared `Content-Length` over the limit is refused before anything is read, so a
/// client cannot make us wait for a body we would refuse anyway.
pub struct LimitedBody<const MAX: usize = MAX_BODY>(pub Bytes);

impl<S: Send + Sync, const MAX: usize> FromRequest<S> for LimitedBody<MAX> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|n| n > MAX as u64) {
            return Err(too_large(MAX));
        }
        Bytes::from_request(req, state)
            .await
            .map(LimitedBody)
            .map_err(|e| match e.status() {
                StatusCode::PAYLOAD_TOO_LARGE => too_large(MAX),
                status => ApiError::new(status, "bad_request", e.body_text()),
            })
    }
}

/// A JSON body, whatever the `Content-Type`.
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let LimitedBody(bytes) = LimitedBody::<MAX_BODY>::from_request(req, state).await?;
        parse(&bytes).map(JsonBody)
    }
}

pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    // The plain parser is the fast path; tracking the field path costs on every request, so
    // it runs only to explain a failure.
    if let Ok(value) = serde_json::from_slice(bytes) {
        return Ok(value);
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." || inner.is_syntax() || inner.is_eof() {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_json",
                format!("the body is not valid JSON: {inner}"),
            )
        } else {
            ApiError::new(StatusCode::BAD_REQUEST, "invalid_field", format!("{path}: {inner}"))
        }
    })?;
    de.end().map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!("the body is not valid JSON: {e}"),
        )
    })?;
    Ok(value)
}
