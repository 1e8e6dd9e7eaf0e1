//! Sessions: a random token in an HttpOnly, SameSite=Lax cookie, a row in `sessions` with an
//! expiry, and a CSRF token tied to it. Every state-changing request must echo the CSRF token in
//! `X-CSRF-Token` ([`csrf_guard`]); the extractors [`CurrentUser`] and [`AdminUser`] give handlers
//! the logged-in user.

use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rand::RngCore;
use serde::Serialize;
use sqlx::FromRow;

use crate::AppState;
use crate::db::now;
use crate::error::{ApiError, ApiResult};

pub const COOKIE: &str = "sluice_session";
pub const CSRF_HEADER: &str = "x-csrf-token";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, FromRow)]
pub struct User {
    pub id: i64,
    pub username: String,
    /// "admin" or "user".
    pub role: String,
}

impl User {
    pub fn is_admin(&self) -> bool {
        self.role == "admin"
    }
}

/// A live session row.
#[derive(Debug, Clone)]
pub struct Session {
    pub token: String,
    pub csrf: String,
    pub user: Option<User>,
}

#[derive(FromRow)]
struct SessionRow {
    csrf: String,
    user_id: Option<i64>,
    username: Option<String>,
    role: Option<String>,
}

/// 32 random bytes from the thread-local CSPRNG, as hex.
pub fn random_token() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The session token from the `Cookie` header, if any.
pub fn cookie_token(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value.to_string())
        .filter(|token| !token.is_empty())
}

/// Looks up an unexpired session.
pub async fn load(state: &AppState, token: &str) -> ApiResult<Option<Session>> {
    let row: Option<SessionRow> = sqlx::query_as(
        "SELECT s.csrf, u.id AS user_id, u.username, u.role
         FROM sessions s LEFT JOIN users u ON u.id = s.user_id
         WHERE s.token = ? AND s.expires_at > ?",
    )
    .bind(token)
    .bind(now())
    .fetch_optional(state.pool())
    .await?;
    Ok(row.map(|row| {
        let user = match (row.user_id, row.username, row.role) {
            (Some(id), Some(username), Some(role)) => Some(User { id, username, role }),
            _ => None,
        };
        Session { token: token.to_string(), csrf: row.csrf, user }
    }))
}

/// Creates a session (anonymous when `user_id` is `None`) and drops expired ones.
pub async fn create(state: &AppState, user_id: Option<i64>) -> ApiResult<Session> {
    let token = random_token();
    let csrf = random_token();
    let ttl = i64::try_from(state.config().session_ttl.as_secs()).unwrap_or(i64::MAX / 2);
    let now = now();
    sqlx::query("DELETE FROM sessions WHERE expires_at <= ?")
        .bind(now)
        .execute(state.pool())
        .await?;
    sqlx::query("INSERT INTO sessions (token, user_id, csrf, expires_at) VALUES (?, ?, ?, ?)")
        .bind(&token)
        .bind(user_id)
        .bind(&csrf)
        .bind(now.saturating_add(ttl))
        .execute(state.pool())
        .await?;
    let user = match user_id {
        Some(id) => Some(
            sqlx::query_as::<_, User>("SELECT id, username, role FROM users WHERE id = ?")
                .bind(id)
                .fetch_one(state.pool())
                .await?,
        ),
        None => None,
    };
    Ok(Session { token, csrf, user })
}

pub async fn delete(state: &AppState, token: &str) -> ApiResult<()> {
    sqlx::query("DELETE FROM sessions WHERE token = ?").bind(token).execute(state.pool()).await?;
    Ok(())
}

/// The `Set-Cookie` value for a session.
pub fn set_cookie(state: &AppState, session: &Session) -> ApiResult<HeaderValue> {
    let max_age = state.config().session_ttl.as_secs();
    HeaderValue::from_str(&format!(
        "{COOKIE}={}; Path=/; HttpOnly; SameSite=Lax; Max-Age={max_age}",
        session.token
    ))
    .map_err(ApiError::internal)
}

/// Rejects a POST, PUT, PATCH or DELETE whose `X-CSRF-Token` is missing or is not the token of
/// the session named by its cookie (403). Safe methods pass untouched.
pub async fn csrf_guard(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if matches!(*request.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
        return next.run(request).await;
    }
    match check_csrf(&state, request.headers()).await {
        Ok(()) => next.run(request).await,
        Err(err) => err.into_response(),
    }
}

async fn check_csrf(state: &AppState, headers: &HeaderMap) -> ApiResult<()> {
    let refuse = || {
        ApiError::Forbidden(
            "missing or wrong CSRF token: send the X-CSRF-Token header from GET /api/session \
             (reload the page)"
                .into(),
        )
    };
    let token = cookie_token(headers).ok_or_else(refuse)?;
    let sent = headers.get(CSRF_HEADER).and_then(|v| v.to_str().ok()).ok_or_else(refuse)?;
    let session = load(state, &token).await?.ok_or_else(refuse)?;
    if constant_time_eq(sent.as_bytes(), session.csrf.as_bytes()) { Ok(()) } else { Err(refuse()) }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The logged-in user; 401 without one.
#[derive(Debug, Clone)]
pub struct CurrentUser(pub User);

impl FromRequestParts<AppState> for CurrentUser {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> ApiResult<Self> {
        let token = cookie_token(&parts.headers).ok_or_else(ApiError::unauthorized)?;
        load(state, &token)
            .await?
            .and_then(|session| session.user)
            .map(CurrentUser)
            .ok_or_else(ApiError::unauthorized)
    }
}

/// The logged-in user, who must be an admin; 401 without a user, 403 for a non-admin.
#[derive(Debug, Clone)]
pub struct AdminUser(pub User);

impl FromRequestParts<AppState> for AdminUser {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> ApiResult<Self> {
        let CurrentUser(user) = CurrentUser::from_request_parts(parts, state).await?;
        if user.is_admin() {
            Ok(AdminUser(user))
        } else {
            Err(ApiError::Forbidden("only an admin may do this".into()))
        }
    }
}
