//! The one error type of the HTTP API. Every handler returns `Result<_, ApiError>`; the variant
//! decides the status, and the body is always `{"error": "..."}` (plus `problems` for a rejected
//! dataset). A 4xx message is meant for the user; a 5xx is logged with its cause and the client
//! sees a generic message.

use axum::Json;
use axum::body::{Body, to_bytes};
use axum::extract::multipart::MultipartError;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Request, State};
use axum::http::{Extensions, HeaderMap, HeaderValue, Method, StatusCode, Version, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tower_http::compression::{DefaultPredicate, Predicate};
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
    /// 429: over a cap on what one user or the server may hold open at once.
    TooMany(String),
    /// 422: well-formed but refused: a malformed dataset (with one line per problem), a job
    /// that will not fit.
    /// `unlisted` counts the problems beyond those listed.
    Unprocessable { message: String, problems: Vec<String>, unlisted: usize },
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
        ApiError::Unprocessable { message: message.into(), problems: Vec::new(), unlisted: 0 }
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
            ApiError::TooMany(_) => StatusCode::TOO_MANY_REQUESTS,
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
            | ApiError::TooMany(m)
            | ApiError::Unauthorized(m) => json!({ "error": m }),
            ApiError::Unprocessable { message, problems, .. } if problems.is_empty() => {
                json!({ "error": message })
            }
            ApiError::Unprocessable { message, problems, unlisted } => {
                json!({ "error": message, "problems": problems, "unlisted": unlisted })
            }
            ApiError::Internal(err) => {
                error!("internal error: {err:#}");
                json!({ "error": INTERNAL })
            }
        };
        let mut response = (status, Json(body)).into_response();
        response.extensions_mut().insert(ApiErrorBody);
        response
    }
}

impl From<crate::watchers::Full> for ApiError {
    fn from(full: crate::watchers::Full) -> Self {
        ApiError::TooMany(full.to_string())
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
        // A body over axum's limit for JSON is too large, not malformed.
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::TooLarge(format!("the JSON body is too large: {}", rejection.body_text()))
        } else {
            ApiError::BadRequest(rejection.body_text())
        }
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

/// What a client sees of a 5xx.
const INTERNAL: &str = "internal server error; the server log has the details";

/// Longest plain-text error body kept as the JSON message; longer text was not written for people.
const READABLE_MAX: usize = 300;

/// Largest error body [`json_errors`] reads to see whether it is the API's JSON already.
const ERROR_BODY_MAX: usize = 64 << 10;

/// Marks a reply written by [`ApiError`], which [`json_errors`] passes without reading it.
#[derive(Debug, Clone, Copy)]
struct ApiErrorBody;

/// The upload limit in bytes, which [`json_errors`] names when a body is too large.
#[derive(Debug, Clone, Copy)]
pub struct UploadLimit(pub u64);

/// Middleware: every error reply under `/api/` is the API's JSON, whichever layer wrote it:
/// axum's 405 and extractor rejections (a bad multipart boundary), tower-http's 413 over the
/// body ceiling and 416 for a range outside a file (typed as the file, with no body). The
/// status and the other headers (`Content-Range`) stay; successes (event streams, downloads)
/// and JSON errors pass untouched.
pub async fn json_errors(
    State(UploadLimit(max_upload_bytes)): State<UploadLimit>,
    request: Request,
    next: Next,
) -> Response {
    if !request.uri().path().starts_with("/api/") {
        return next.run(request).await;
    }
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let response = next.run(request).await;
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error())
        || response.extensions().get::<ApiErrorBody>().is_some()
    {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let bytes = if parts.headers.contains_key(header::CONTENT_ENCODING) {
        None
    } else {
        to_bytes(body, ERROR_BODY_MAX).await.ok()
    };
    if let Some(bytes) = &bytes
        && is_json(&parts.headers)
        && serde_json::from_slice::<serde_json::Value>(bytes).is_ok_and(|v| v["error"].is_string())
    {
        return Response::from_parts(parts, Body::from(bytes.clone()));
    }
    let text = bytes.filter(|_| is_plain_text(&parts.headers)).and_then(|b| readable(&b));
    let message = if status.is_server_error() {
        error!(%status, "error reply under /api/ from a layer: {}", text.as_deref().unwrap_or(""));
        INTERNAL.to_owned()
    } else if status == StatusCode::PAYLOAD_TOO_LARGE {
        // tower-http's "length limit exceeded" does not say which limit.
        format!(
            "the request body is too large: uploads may be up to {:.1} MiB (set max_upload_mb \
             to raise it)",
            max_upload_bytes as f64 / f64::from(1u32 << 20)
        )
    } else {
        text.unwrap_or_else(|| status_message(status, &method, &path, &parts.headers))
    };
    for name in [
        header::CONTENT_TYPE,
        header::CONTENT_LENGTH,
        header::CONTENT_ENCODING,
        header::TRANSFER_ENCODING,
    ] {
        parts.headers.remove(name);
    }
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Response::from_parts(parts, Body::from(json!({ "error": message }).to_string()))
}

/// tower-http's compression predicate, less error replies: [`json_errors`] reads their text,
/// and they are small anyway.
pub fn compress_unless_error() -> impl Predicate {
    fn not_an_error(status: StatusCode, _: Version, _: &HeaderMap, _: &Extensions) -> bool {
        !(status.is_client_error() || status.is_server_error())
    }
    DefaultPredicate::new().and(not_an_error)
}

fn content_type(headers: &HeaderMap) -> &str {
    headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default()
}

fn is_json(headers: &HeaderMap) -> bool {
    let essence = content_type(headers).split(';').next().unwrap_or_default().trim();
    essence.eq_ignore_ascii_case("application/json") || essence.ends_with("+json")
}

/// Plain text or untyped.
fn is_plain_text(headers: &HeaderMap) -> bool {
    let kind = content_type(headers);
    kind.is_empty() || kind.starts_with("text/plain")
}

/// The body as one short line of text, if it is one.
fn readable(bytes: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(bytes).ok()?.trim();
    (!text.is_empty() && text.len() <= READABLE_MAX && !text.chars().any(char::is_control))
        .then(|| text.to_owned())
}

/// A message for an error reply that came without one.
fn status_message(status: StatusCode, method: &Method, path: &str, headers: &HeaderMap) -> String {
    match status {
        // axum adds the `Allow` header only after every layer has run, so it cannot be quoted.
        StatusCode::METHOD_NOT_ALLOWED => {
            format!("{method} is not allowed on {path}; the Allow header lists what is")
        }
        StatusCode::RANGE_NOT_SATISFIABLE => {
            // tower-http answers `Content-Range: bytes */<size>`.
            let range = headers.get(header::CONTENT_RANGE).and_then(|v| v.to_str().ok());
            match range.and_then(|r| r.strip_prefix("bytes */")) {
                Some(size) => format!("the requested range is not within the file ({size} bytes)"),
                None => "the requested range is not within the file".to_owned(),
            }
        }
        _ => status.canonical_reason().unwrap_or("the request was refused").to_lowercase(),
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
