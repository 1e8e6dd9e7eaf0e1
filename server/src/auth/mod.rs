//! Accounts: first-run admin creation, login, logout and the session endpoint the pages start
//! from. Sessions, CSRF and the user extractors are in [`session`]; hashing in [`password`].

pub mod password;
pub mod session;

use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;

pub use session::{AdminUser, CurrentUser, User};

use crate::AppState;
use crate::db::now;
use crate::error::{ApiError, ApiJson, ApiResult};
use session::Session;

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/api/session", get(get_session))
        .route("/api/setup", post(setup))
        .route("/api/login", post(login))
        .route("/api/logout", post(logout))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Credentials {
    username: String,
    password: String,
}

async fn setup_needed(state: &AppState) -> ApiResult<bool> {
    let users: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM users").fetch_one(state.pool()).await?;
    Ok(users == 0)
}

/// The session as the pages see it, with its cookie.
async fn session_response(state: &AppState, session: &Session) -> ApiResult<Response> {
    let body = json!({
        "setup_needed": setup_needed(state).await?,
        "user": session.user,
        "csrf": session.csrf,
    });
    let cookie = session::set_cookie(state, session)?;
    Ok(([(header::SET_COOKIE, cookie)], Json(body)).into_response())
}

/// `GET /api/session`: always 200; starts an anonymous session when there is none, so the
/// login and setup forms have a CSRF token.
async fn get_session(State(state): State<AppState>, headers: HeaderMap) -> ApiResult<Response> {
    let existing = match session::cookie_token(&headers) {
        Some(token) => session::load(&state, &token).await?,
        None => None,
    };
    let session = match existing {
        Some(session) => session,
        None => session::create(&state, None).await?,
    };
    session_response(&state, &session).await
}

/// Replaces the caller's session with a fresh one for `user_id`: a new token on every login, so
/// a token planted before login is worth nothing after it.
async fn rotate(
    state: &AppState,
    headers: &HeaderMap,
    user_id: Option<i64>,
) -> ApiResult<Response> {
    if let Some(token) = session::cookie_token(headers) {
        session::delete(state, &token).await?;
    }
    let session = session::create(state, user_id).await?;
    session_response(state, &session).await
}

/// `POST /api/setup`: creates the first (admin) account and logs it in; 409 once any user exists.
async fn setup(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<Credentials>,
) -> ApiResult<Response> {
    password::check_username(&body.username)?;
    password::check_password(&body.password)?;
    if !setup_needed(&state).await? {
        return Err(ApiError::conflict("setup is done: an admin account exists; log in"));
    }
    let hash = password::hash(body.password).await?;
    // The existence check and the insert are one statement, so two racing setups make one admin.
    let created = sqlx::query(
        "INSERT INTO users (username, password_hash, role, created_at)
         SELECT ?, ?, 'admin', ? WHERE NOT EXISTS (SELECT 1 FROM users)",
    )
    .bind(&body.username)
    .bind(&hash)
    .bind(now())
    .execute(state.pool())
    .await?;
    if created.rows_affected() == 0 {
        return Err(ApiError::conflict("setup is done: an admin account exists; log in"));
    }
    let id = created.last_insert_rowid();
    rotate(&state, &headers, Some(id)).await
}

#[derive(sqlx::FromRow)]
struct LoginRow {
    id: i64,
    password_hash: String,
}

/// `POST /api/login`: 401 for an unknown user or a wrong password (the same message for both).
async fn login(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<Credentials>,
) -> ApiResult<Response> {
    let row: Option<LoginRow> =
        sqlx::query_as("SELECT id, password_hash FROM users WHERE username = ?")
            .bind(&body.username)
            .fetch_optional(state.pool())
            .await?;
    let wrong = || ApiError::Unauthorized("wrong username or password".into());
    let row = row.ok_or_else(wrong)?;
    if !password::verify(body.password, row.password_hash).await? {
        return Err(wrong());
    }
    rotate(&state, &headers, Some(row.id)).await
}

/// `POST /api/logout`: ends the session and starts an anonymous one (returned like
/// `GET /api/session`, so the page has a CSRF token for the next login).
async fn logout(State(state): State<AppState>, headers: HeaderMap) -> ApiResult<Response> {
    rotate(&state, &headers, None).await
}
