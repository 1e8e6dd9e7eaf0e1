//! Accounts: first-run admin creation, login, logout and the session endpoint the pages start
//! from. Sessions, CSRF and the user extractors are in [`session`]; hashing in [`password`]; the
//! login throttle in [`throttle`]; personal API tokens (`Authorization: Bearer`) in [`tokens`];
//! a user changing their own password in `change_password`.
//!
//! A login passes three gates before its password is checked, cheapest first: the throttle (per
//! client address and per address and account, 429; never per account alone, so a stranger
//! cannot lock its owner out), a turn with the password hasher (503 when its short queue is
//! full), then the database. Both refusals carry `Retry-After`.

mod change_password;
pub mod password;
pub mod session;
pub mod throttle;
pub mod tokens;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, DefaultBodyLimit, FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::OnceCell;

pub use session::{AdminUser, CurrentUser, SessionUser, User};

use crate::AppState;
use crate::db::now;
use crate::error::{ApiError, ApiJson, ApiResult};
use crate::store::users as store;
use password::{Busy, Turn};
use session::{Anonymous, Cookie, Session};
use throttle::{Throttle, Throttled};

/// The largest body the account routes read: credentials are small, and a flood of logins
/// should not be able to make the server buffer megabytes each.
const MAX_BODY: usize = 16 << 10;

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/api/session", get(get_session))
        .route("/api/setup", post(setup))
        .route("/api/login", post(login))
        .route("/api/logout", post(logout))
        .route("/api/account/password", post(change_password::change_password))
        .layer(DefaultBodyLimit::max(MAX_BODY))
}

/// What this module keeps in memory for one appliance: the throttle's counts and the CSRF key
/// once read. They belong to the appliance rather than the process (tests run several in one
/// process), and an appliance is its database, so they are found by the database's path.
#[derive(Debug, Default)]
pub(crate) struct Guards {
    pub(crate) throttle: Throttle,
    pub(crate) csrf_key: OnceCell<String>,
}

static GUARDS: LazyLock<Mutex<HashMap<PathBuf, Arc<Guards>>>> = LazyLock::new(Default::default);

pub(crate) fn guards(state: &AppState) -> Arc<Guards> {
    let mut all = GUARDS.lock().unwrap_or_else(PoisonError::into_inner);
    Arc::clone(all.entry(state.config().database_path()).or_default())
}

/// The client's address as the socket saw it, when the server was started with connect info
/// (`None` otherwise, and for requests made without a socket). `X-Forwarded-For` and its kin
/// are deliberately ignored: any client can send them, and the appliance cannot tell whether a
/// proxy it trusts stands in front of it. IPv6 clients are counted per /64, the block one
/// household or host usually gets, since a single machine can use any address in it.
#[derive(Debug, Clone, Copy)]
struct ClientAddr(Option<IpAddr>);

impl<S: Send + Sync> FromRequestParts<S> for ClientAddr {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Infallible> {
        let peer = ConnectInfo::<SocketAddr>::from_request_parts(parts, state).await.ok();
        Ok(ClientAddr(peer.map(|ConnectInfo(addr)| match addr.ip().to_canonical() {
            IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(v6.to_bits() & !u128::from(u64::MAX))),
            v4 => v4,
        })))
    }
}

/// A handler's failure: an [`ApiError`], or a refusal to try now with a time to come back.
#[derive(Debug)]
enum AuthError {
    Api(ApiError),
    /// 429 or 503 with `Retry-After` and the API's `{"error": ...}` body.
    Later {
        status: StatusCode,
        retry_after: Duration,
        message: String,
    },
}

impl From<ApiError> for AuthError {
    fn from(err: ApiError) -> Self {
        AuthError::Api(err)
    }
}

impl From<sqlx::Error> for AuthError {
    fn from(err: sqlx::Error) -> Self {
        AuthError::Api(err.into())
    }
}

impl From<Throttled> for AuthError {
    fn from(throttled: Throttled) -> Self {
        AuthError::Later {
            status: StatusCode::TOO_MANY_REQUESTS,
            retry_after: throttled.retry_after,
            message: throttled.message,
        }
    }
}

impl From<Busy> for AuthError {
    fn from(Busy: Busy) -> Self {
        AuthError::Later {
            status: StatusCode::SERVICE_UNAVAILABLE,
            retry_after: Duration::from_secs(1),
            message: "the server is busy checking other logins: try again in a moment".into(),
        }
    }
}

impl IntoResponse for AuthError {
    fn into_response(self) -> Response {
        match self {
            AuthError::Api(err) => err.into_response(),
            AuthError::Later { status, retry_after, message } => {
                let seconds = throttle::whole_seconds(retry_after).to_string();
                (status, [(header::RETRY_AFTER, seconds)], Json(json!({ "error": message })))
                    .into_response()
            }
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Credentials {
    username: String,
    password: String,
}

pub(crate) async fn setup_needed(state: &AppState) -> ApiResult<bool> {
    let users = store::count(state.pool()).await?;
    Ok(users == 0)
}

/// A logged-in session as the pages see it (from `GET /api/session`, or embedded in a page).
/// Setup is never needed once someone is logged in.
pub(crate) fn session_body(session: &Session) -> Value {
    json!({ "setup_needed": false, "user": session.user, "csrf": session.csrf })
}

/// A logged-in session as the pages see it, with its cookie.
async fn session_response(state: &AppState, session: &Session) -> ApiResult<Response> {
    let body = session_body(session);
    let cookie = session::session_cookie(state, session)?;
    Ok(([(header::SET_COOKIE, cookie)], Json(body)).into_response())
}

/// An anonymous visitor as the pages see them; the cookie is sent only when it changes.
async fn anonymous_response(
    state: &AppState,
    anonymous: &Anonymous,
    set_cookie: bool,
) -> ApiResult<Response> {
    let body = json!({
        "setup_needed": setup_needed(state).await?,
        "user": null,
        "csrf": anonymous.csrf,
    });
    if set_cookie {
        let cookie = session::anonymous_cookie(state, anonymous)?;
        Ok(([(header::SET_COOKIE, cookie)], Json(body)).into_response())
    } else {
        Ok(Json(body).into_response())
    }
}

/// `GET /api/session`: always 200. Someone logged in gets their session; anyone else a CSRF
/// token for the login and setup forms, tied to a nonce in their cookie, with nothing stored.
async fn get_session(State(state): State<AppState>, headers: HeaderMap) -> ApiResult<Response> {
    let nonce = match session::cookie(&headers) {
        Some(Cookie::Session(token)) => match session::load(&state, &token).await? {
            Some(session) => return session_response(&state, &session).await,
            None => None,
        },
        Some(Cookie::Anonymous(nonce)) => Some(nonce),
        None => None,
    };
    let kept = nonce.is_some();
    let anonymous = session::anonymous(&state, nonce).await?;
    anonymous_response(&state, &anonymous, !kept).await
}

/// Replaces the caller's session (if any) with a fresh one for `user_id`: a new token on every
/// login, so a token planted before login is worth nothing after it.
async fn rotate(state: &AppState, headers: &HeaderMap, user_id: i64) -> ApiResult<Response> {
    if let Some(Cookie::Session(token)) = session::cookie(headers) {
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
) -> Result<Response, AuthError> {
    password::check_username(&body.username)?;
    password::check_password(&body.password)?;
    if !setup_needed(&state).await? {
        return Err(ApiError::conflict("setup is done: an admin account exists; log in").into());
    }
    let hash = Turn::try_take()?.hash(body.password).await?;
    // The existence check and the insert are one statement, so two racing setups make one admin.
    let created = store::insert_first_admin(state.pool(), &body.username, &hash, now()).await?;
    let Some(id) = created else {
        return Err(ApiError::conflict("setup is done: an admin account exists; log in").into());
    };
    Ok(rotate(&state, &headers, id).await?)
}

/// `POST /api/login`: 401 for an unknown user or a wrong password (the same message, and the
/// same argon2 work, for both); 429 while the address, or this account from this address, is
/// throttled; 503 while the password hasher's queue is full.
async fn login(
    State(state): State<AppState>,
    ClientAddr(address): ClientAddr,
    headers: HeaderMap,
    ApiJson(body): ApiJson<Credentials>,
) -> Result<Response, AuthError> {
    let wrong = || ApiError::Unauthorized("wrong username or password".into());
    // Every account was created through this check, so a name that fails it names nobody; it
    // also keeps the throttle's keys short.
    if password::check_username(&body.username).is_err() {
        return Err(wrong().into());
    }
    let guards = guards(&state);
    let attempt = guards.throttle.admit(&body.username, address, Instant::now())?;
    let turn = Turn::try_take()?;
    let (id, stored) = match store::login_of(state.pool(), &body.username).await? {
        Some((id, hash)) => (Some(id), Some(hash)),
        None => (None, None),
    };
    match (turn.verify(body.password, stored).await?, id) {
        (true, Some(id)) => {
            attempt.succeeded();
            Ok(rotate(&state, &headers, id).await?)
        }
        _ => {
            attempt.failed(Instant::now(), id.is_some());
            Err(wrong().into())
        }
    }
}

/// `POST /api/logout`: ends the session and answers like `GET /api/session` for an anonymous
/// visitor (a fresh nonce and CSRF token), so the page can log in again.
async fn logout(State(state): State<AppState>, headers: HeaderMap) -> ApiResult<Response> {
    if let Some(Cookie::Session(token)) = session::cookie(&headers) {
        session::delete(&state, &token).await?;
    }
    let anonymous = session::anonymous(&state, None).await?;
    anonymous_response(&state, &anonymous, true).await
}
