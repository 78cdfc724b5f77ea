//! Every REST error is `{"error": "<code>", "message": "<for a person>"}`.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }
}

/// Every error on the wire.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ErrorBody<'a> {
    /// A short code a program can match on, e.g. `invalid_field`, `gone`, `unauthorized`.
    pub error: &'a str,
    /// What was wrong, for a person.
    pub message: &'a str,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: self.code,
            message: &self.message,
        };
        (self.status, Json(body)).into_response()
    }
}

impl From<crate::model::FieldError> for ApiError {
    fn from(e: crate::model::FieldError) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_field", e.to_string())
    }
}

impl From<crate::store::StoreError> for ApiError {
    fn from(e: crate::store::StoreError) -> Self {
        use crate::store::StoreError;
        match e {
            StoreError::Full(_) => Self::new(StatusCode::INSUFFICIENT_STORAGE, "registry_full", e.to_string()),
            StoreError::Unavailable(_) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "storage_unavailable",
                format!("{e}; nothing was changed, retry later"),
            ),
            StoreError::OutcomeUnknown(_) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "outcome_unknown",
                format!("{e}; the change may still take effect: registering again is safe"),
            ),
        }
    }
}
