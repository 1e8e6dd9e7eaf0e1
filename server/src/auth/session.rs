//! Sessions and CSRF.
//!
//! A session exists only once someone has logged in (or set up the admin): a random token in an
//! HttpOnly, SameSite=Lax cookie (also `Secure` when the appliance is reached over HTTPS), a row
//! in `sessions` with an expiry, and a CSRF token kept in that row.
//!
//! A visitor who has not logged in gets no row. Their cookie holds a random nonce instead
//! (`anon-<nonce>`), and their CSRF token is a keyed hash of that nonce under a key kept in the
//! database's `meta` table: the signed double-submit pattern. A forged or borrowed token does not
//! match the visitor's own cookie, and another site can neither read the cookie nor send the
//! `X-CSRF-Token` header with the visitor's browser, so the login and setup forms are protected
//! without storing anything per visitor.
//!
//! Every state-changing request must echo its CSRF token in `X-CSRF-Token` ([`csrf_guard`]); the
//! extractors [`CurrentUser`] and [`AdminUser`] give handlers the logged-in user.

use argon2::{Algorithm, Argon2, Params, Version};
use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rand::RngCore;

use super::tokens;
use crate::AppState;
use crate::db::now;
use crate::error::{ApiError, ApiResult};
use crate::store;
pub use crate::store::users::User;

pub const COOKIE: &str = "sluice_session";
pub const CSRF_HEADER: &str = "x-csrf-token";

/// Marks a cookie that holds an anonymous visitor's nonce rather than a session token.
const ANONYMOUS: &str = "anon-";

/// Sessions one user may hold at once; a login past that ends their oldest. Each login costs a
/// password hash, so this only matters to a script logging in over and over.
const MAX_SESSIONS_PER_USER: i64 = 32;

/// A live, logged-in session.
#[derive(Debug, Clone)]
pub struct Session {
    pub token: String,
    pub csrf: String,
    pub user: User,
    /// Unix seconds.
    pub expires_at: i64,
}

/// A visitor without a session: their cookie's nonce and the CSRF token made from it.
#[derive(Debug, Clone)]
pub struct Anonymous {
    pub nonce: String,
    pub csrf: String,
}

/// What the session cookie names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cookie {
    /// A session token, to look up in `sessions`.
    Session(String),
    /// An anonymous visitor's nonce (well-formed: 64 hex digits).
    Anonymous(String),
}

/// 32 random bytes from the thread-local CSPRNG, as hex.
pub fn random_token() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    hex(&bytes)
}

/// Whether `s` has the shape of a [`random_token`] (64 hex digits): anything else is refused
/// before it reaches the database.
pub fn is_token(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The raw value of the session cookie from the `Cookie` header, if any.
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

/// The session cookie, read as a session token or an anonymous nonce. A malformed nonce counts
/// as no cookie.
pub fn cookie(headers: &HeaderMap) -> Option<Cookie> {
    let value = cookie_token(headers)?;
    match value.strip_prefix(ANONYMOUS) {
        Some(nonce) if nonce.len() == 64 && nonce.bytes().all(|b| b.is_ascii_hexdigit()) => {
            Some(Cookie::Anonymous(nonce.to_ascii_lowercase()))
        }
        Some(_) => None,
        None => Some(Cookie::Session(value)),
    }
}

/// Looks up an unexpired session.
pub async fn load(state: &AppState, token: &str) -> ApiResult<Option<Session>> {
    let row = store::sessions::live(state.pool(), token, now()).await?;
    Ok(row.map(|row| Session {
        token: token.to_string(),
        csrf: row.csrf,
        user: row.user,
        expires_at: row.expires_at,
    }))
}

/// Creates a session for `user_id` (at login and setup, the only places sessions start), drops
/// expired sessions, and ends the user's oldest beyond [`MAX_SESSIONS_PER_USER`].
pub async fn create(state: &AppState, user_id: i64) -> ApiResult<Session> {
    let token = random_token();
    let csrf = random_token();
    let ttl = i64::try_from(state.config().session_ttl.as_secs()).unwrap_or(i64::MAX / 2);
    let now = now();
    let expires_at = now.saturating_add(ttl);
    let new = store::sessions::NewSession { token: &token, user_id, csrf: &csrf, expires_at };
    store::sessions::insert(state.pool(), &new, now, MAX_SESSIONS_PER_USER).await?;
    let user = store::users::get(state.pool(), user_id).await?;
    Ok(Session { token, csrf, user, expires_at })
}

pub async fn delete(state: &AppState, token: &str) -> ApiResult<()> {
    Ok(store::sessions::delete(state.pool(), token).await?)
}

/// An anonymous visitor: `nonce` kept when the cookie already had one (so two tabs of the login
/// page keep working), else a fresh one.
pub async fn anonymous(state: &AppState, nonce: Option<String>) -> ApiResult<Anonymous> {
    let nonce = nonce.unwrap_or_else(random_token);
    let csrf = anonymous_csrf(&csrf_key(state).await?, &nonce)?;
    Ok(Anonymous { nonce, csrf })
}

/// The `Set-Cookie` value for a session.
pub fn session_cookie(state: &AppState, session: &Session) -> ApiResult<HeaderValue> {
    let max_age = u64::try_from(session.expires_at.saturating_sub(now())).unwrap_or(0);
    cookie_header(state, &session.token, max_age)
}

/// The `Set-Cookie` value for an anonymous visitor. It lives as long as a session would, so a
/// login form left open stays usable; it is worth nothing but a CSRF token for that form.
pub fn anonymous_cookie(state: &AppState, anonymous: &Anonymous) -> ApiResult<HeaderValue> {
    let value = format!("{ANONYMOUS}{}", anonymous.nonce);
    cookie_header(state, &value, state.config().session_ttl.as_secs())
}

fn cookie_header(state: &AppState, value: &str, max_age: u64) -> ApiResult<HeaderValue> {
    let secure = if state.config().https { "; Secure" } else { "" };
    HeaderValue::from_str(&format!(
        "{COOKIE}={value}; Path=/; HttpOnly; SameSite=Lax; Max-Age={max_age}{secure}"
    ))
    .map_err(ApiError::internal)
}

/// The key anonymous CSRF tokens are made with: 32 random bytes (as hex) created with the
/// database and kept in `meta`, so tokens survive a restart, and read once per appliance.
async fn csrf_key(state: &AppState) -> ApiResult<String> {
    let guards = super::guards(state);
    let key = guards
        .csrf_key
        .get_or_try_init(|| async {
            // Two first requests racing here both end up with the one row that was inserted.
            let key = store::sessions::csrf_key(state.pool(), &random_token()).await?;
            ApiResult::Ok(key)
        })
        .await?;
    Ok(key.clone())
}

/// The CSRF token of the anonymous visitor whose cookie holds `nonce`: a keyed hash of the
/// nonce. Argon2 with the key as its secret input is a keyed hash (RFC 9106, section 3.1, "K");
/// it is the keyed hash this crate already depends on, run here at its minimum cost (8 KiB, one
/// pass), which takes microseconds.
fn anonymous_csrf(key: &str, nonce: &str) -> ApiResult<String> {
    let fault = |err: argon2::Error| ApiError::internal(anyhow::anyhow!("csrf token: {err}"));
    let params = Params::new(Params::MIN_M_COST, 1, 1, Some(32)).map_err(fault)?;
    let keyed =
        Argon2::new_with_secret(key.as_bytes(), Algorithm::Argon2id, Version::V0x13, params)
            .map_err(fault)?;
    let mut out = [0u8; 32];
    keyed
        .hash_password_into(nonce.as_bytes(), b"sluice anonymous csrf", &mut out)
        .map_err(fault)?;
    Ok(hex(&out))
}

/// Rejects a POST, PUT, PATCH or DELETE whose `X-CSRF-Token` is missing or wrong (403): for a
/// session cookie, the session's token; for an anonymous cookie, the token made from its nonce;
/// without a cookie, nothing is right. Safe methods pass untouched, and so does a request with
/// a valid API token (`Authorization: Bearer`, which no browser sends by itself; one with a
/// wrong token is refused here, 401), and anything under `/v1/`, which takes only tokens.
pub async fn csrf_guard(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if matches!(*request.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
        return next.run(request).await;
    }
    // The OpenAI-compatible routes read no cookie, only an API token (`api::openai::Caller`),
    // and answer its absence in OpenAI's shape themselves.
    if request.uri().path().starts_with("/v1/") {
        return next.run(request).await;
    }
    if let Some(bearer) = tokens::bearer(request.headers()) {
        return match tokens::authenticate(&state, &bearer).await {
            Ok(_) => next.run(request).await,
            Err(err) => err.into_response(),
        };
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
    let cookie = cookie(headers).ok_or_else(refuse)?;
    let sent = headers.get(CSRF_HEADER).and_then(|v| v.to_str().ok()).ok_or_else(refuse)?;
    let expected = match cookie {
        Cookie::Session(token) => load(state, &token).await?.ok_or_else(refuse)?.csrf,
        Cookie::Anonymous(nonce) => anonymous_csrf(&csrf_key(state).await?, &nonce)?,
    };
    if constant_time_eq(sent.as_bytes(), expected.as_bytes()) { Ok(()) } else { Err(refuse()) }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The logged-in user, or the user of the request's API token; 401 without one. A request with
/// `Authorization: Bearer` is judged by its token alone.
#[derive(Debug, Clone)]
pub struct CurrentUser(pub User);

impl FromRequestParts<AppState> for CurrentUser {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> ApiResult<Self> {
        if let Some(bearer) = tokens::bearer(&parts.headers) {
            return tokens::authenticate(state, &bearer).await.map(CurrentUser);
        }
        let Some(Cookie::Session(token)) = cookie(&parts.headers) else {
            return Err(ApiError::unauthorized());
        };
        load(state, &token)
            .await?
            .map(|session| CurrentUser(session.user))
            .ok_or_else(ApiError::unauthorized)
    }
}

/// The user logged in with their password, for what a stolen API token must not do (make more
/// tokens, which would outlive its revocation); 401 without a user, 403 for an API token.
#[derive(Debug, Clone)]
pub struct SessionUser(pub User);

impl FromRequestParts<AppState> for SessionUser {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> ApiResult<Self> {
        if tokens::bearer(&parts.headers).is_some() {
            return Err(ApiError::Forbidden(
                "an API token cannot do this: log in with your password (the account page)".into(),
            ));
        }
        let CurrentUser(user) = CurrentUser::from_request_parts(parts, state).await?;
        Ok(SessionUser(user))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anonymous_tokens_depend_on_key_and_nonce() -> ApiResult<()> {
        let (key, other_key) = (random_token(), random_token());
        let (nonce, other_nonce) = (random_token(), random_token());
        let token = anonymous_csrf(&key, &nonce)?;
        assert_eq!(token.len(), 64);
        assert_eq!(token, anonymous_csrf(&key, &nonce)?, "the same visitor, the same token");
        assert_ne!(token, anonymous_csrf(&key, &other_nonce)?);
        assert_ne!(token, anonymous_csrf(&other_key, &nonce)?);
        Ok(())
    }

    #[test]
    fn cookies_are_told_apart() {
        let headers = |value: &str| {
            let mut headers = HeaderMap::new();
            if let Ok(value) = HeaderValue::from_str(value) {
                headers.insert(header::COOKIE, value);
            }
            headers
        };
        let nonce = "ab".repeat(32);
        assert_eq!(
            cookie(&headers(&format!("theme=dark; sluice_session=anon-{nonce}"))),
            Some(Cookie::Anonymous(nonce))
        );
        assert_eq!(cookie(&headers("sluice_session=anon-xyz")), None);
        assert_eq!(cookie(&headers("sluice_session=")), None);
        assert_eq!(cookie(&headers("sluice_session=t0k3n")), Some(Cookie::Session("t0k3n".into())));
    }
}
