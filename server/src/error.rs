//! The one error type of the HTTP API. Every handler returns `Result<_, ApiError>`; the variant
//! decides the status, and the body is always `{"error": "..."}` (plus `problems` for a rejected
//! dataset). A 4xx message is meant for the user; a 5xx is logged with its cause and the client
//! sees a generic message.

use axum::Json;
use axum::extract::multipart::MultipartError;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tracing::error;

#[derive(Debug)]
pub enum ApiError {
    /// 400: malformed request: bad JSON, a missing or mistyped field, an unknown model or GPU.
    BadRequest(String),
    /// 401: the request needs a logged-in user, or the login was wrong.
    Unauthorized(String),
    /// 403: logged in but not allowed (not an admin), or a missing or wrong CSRF token.
    Forbidden(String),
    /// 404: no such thing, or it belongs to someone else (ids do not leak).
    NotFound(String),
    /// 409: the thing exists but its state forbids the action (cancel a finished job).
    Conflict(String),
    /// 413: an upload over the size limit.
    TooLarge(String),
    /// 422: well-formed but refused: a malformed dataset (with one line per problem), a job
    /// that will not fit.
    Unprocessable { message: String, problems: Vec<String> },
    /// 500: a fault of the server (database, disk); logged, never shown.
    Internal(anyhow::Error),
}

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::BadRequest(message.into())
    }

    pub fn not_found(what: impl Into<String>) -> Self {
        ApiError::NotFound(what.into())
    }

    pub fn unauthorized() -> Self {
        ApiError::Unauthorized("log in first".into())
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        ApiError::Conflict(message.into())
    }

    pub fn unprocessable(message: impl Into<String>) -> Self {
        ApiError::Unprocessable { message: message.into(), problems: Vec::new() }
    }

    pub fn internal(err: impl Into<anyhow::Error>) -> Self {
        ApiError::Internal(err.into())
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Unprocessable { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let body = match self {
            ApiError::BadRequest(m)
            | ApiError::Forbidden(m)
            | ApiError::NotFound(m)
            | ApiError::Conflict(m)
            | ApiError::TooLarge(m)
            | ApiError::Unauthorized(m) => json!({ "error": m }),
            ApiError::Unprocessable { message, problems } if problems.is_empty() => {
                json!({ "error": message })
            }
            ApiError::Unprocessable { message, problems } => {
                json!({ "error": message, "problems": problems })
            }
            ApiError::Internal(err) => {
                error!("internal error: {err:#}");
                json!({ "error": "internal server error; the server log has the details" })
            }
        };
        (status, Json(body)).into_response()
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(err: sqlx::Error) -> Self {
        ApiError::Internal(anyhow::Error::new(err).context("database"))
    }
}

impl From<std::io::Error> for ApiError {
    fn from(err: std::io::Error) -> Self {
        ApiError::Internal(err.into())
    }
}

impl From<tokio::task::JoinError> for ApiError {
    fn from(err: tokio::task::JoinError) -> Self {
        ApiError::Internal(err.into())
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        ApiError::BadRequest(rejection.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        ApiError::BadRequest(rejection.body_text())
    }
}

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        ApiError::BadRequest(rejection.body_text())
    }
}

impl From<MultipartError> for ApiError {
    fn from(err: MultipartError) -> Self {
        // A body cut off by the size limit surfaces here too.
        if err.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::TooLarge(err.body_text())
        } else {
            ApiError::BadRequest(format!("bad upload: {}", err.body_text()))
        }
    }
}

/// `axum::Json` whose rejection is an [`ApiError`], so bad JSON gets the API's error body.
#[derive(Debug, axum::extract::FromRequest)]
#[from_request(via(axum::Json), rejection(ApiError))]
pub struct ApiJson<T>(pub T);

/// `axum::extract::Query` with the API's error body.
#[derive(Debug, axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub struct ApiQuery<T>(pub T);

/// `axum::extract::Path` with the API's error body.
#[derive(Debug, axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(ApiError))]
pub struct ApiPath<T>(pub T);
