//! Personal API tokens: `Authorization: Bearer <token>` acts as the token's user on `/api/*`.
//!
//! A token is `sluice_` and 64 hex digits (32 random bytes), shown once when it is made. Only
//! its SHA-256 is stored: a slow password hash would add nothing for a secret that cannot be
//! guessed, and every request with a token looks it up. Each lookup joins `users`, so a token
//! acts with its user's role as it is now, and a revoked token (its row deleted) or a deleted
//! user's (their rows go with them) stops working at the next request.
//!
//! Bearer requests need no CSRF token (see `session::csrf_guard`): a browser never adds an
//! `Authorization` header by itself, and another site cannot make it send one, so a request
//! that carries one was made by someone who holds the token. Such a request is judged by its
//! token alone: its cookies are not looked at.

use axum::http::{HeaderMap, header};
use rand::RngCore;
use sha2::{Digest, Sha256};

use crate::AppState;
use crate::db::now;
use crate::error::{ApiError, ApiResult};
use crate::store::tokens as store;
pub use crate::store::tokens::TokenView;
use crate::store::users::User;

/// What every token starts with, so a leaked one is recognisable (and searchable) as ours.
pub const PREFIX: &str = "sluice_";

/// Characters of a token kept in clear to tell tokens apart in the list: the prefix and 8 hex
/// digits, 32 bits of a 256-bit secret.
const SHOWN: usize = PREFIX.len() + 8;

/// Tokens one user may hold; each is a row, and a script minting tokens in a loop should stop.
pub const MAX_PER_USER: i64 = 50;

/// The longest name a token may have, in characters.
pub const MAX_NAME_CHARS: usize = 64;

/// How stale `last_used_at` may get: a busy script would otherwise write a row per request.
const LAST_USED_RESOLUTION_S: i64 = 60;

/// What an `Authorization` header says, if it says `Bearer`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bearer {
    /// A well-formed token, to look up.
    Token(String),
    /// `Bearer` with something that is not one of our tokens: refused without a lookup.
    Malformed,
}

/// The bearer credential of a request, if it has one. Other schemes (`Basic`, ...) are not
/// credentials here and leave the request to its cookie.
pub fn bearer(headers: &HeaderMap) -> Option<Bearer> {
    let value = headers.get(header::AUTHORIZATION)?;
    let Ok(value) = value.to_str() else {
        return Some(Bearer::Malformed).filter(|_| starts_with_bearer(value.as_bytes()));
    };
    let (scheme, rest) = value.trim().split_once(' ').unwrap_or((value.trim(), ""));
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = rest.trim();
    let well_formed = token.strip_prefix(PREFIX).is_some_and(|hex| {
        hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    });
    Some(if well_formed { Bearer::Token(token.to_string()) } else { Bearer::Malformed })
}

fn starts_with_bearer(bytes: &[u8]) -> bool {
    bytes.len() >= 6 && bytes[..6].eq_ignore_ascii_case(b"bearer")
}

fn digest(token: &str) -> String {
    Sha256::digest(token.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

fn refused() -> ApiError {
    ApiError::Unauthorized(
        "unknown or revoked API token: make a new one on your account page".into(),
    )
}

/// The user a bearer credential acts as, or 401. Notes when the token was last used.
pub async fn authenticate(state: &AppState, bearer: &Bearer) -> ApiResult<User> {
    let Bearer::Token(token) = bearer else { return Err(refused()) };
    let row = store::by_hash(state.pool(), &digest(token)).await?;
    let row = row.ok_or_else(refused)?;
    let now = now();
    if row.last_used_at.is_none_or(|t| now - t >= LAST_USED_RESOLUTION_S) {
        store::touch(state.pool(), row.token_id, now).await?;
    }
    Ok(row.user)
}

/// A token's name, trimmed: 1 to [`MAX_NAME_CHARS`] characters, no control characters.
pub fn check_name(name: &str) -> ApiResult<String> {
    let name = name.trim();
    if name.is_empty() {
        return Err(ApiError::bad_request(
            "name: give the token a name, such as \"laptop script\"",
        ));
    }
    if name.chars().count() > MAX_NAME_CHARS {
        return Err(ApiError::bad_request(format!(
            "name: at most {MAX_NAME_CHARS} characters, not {}",
            name.chars().count()
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(ApiError::bad_request("name: no control characters (tabs, new lines)"));
    }
    Ok(name.to_string())
}

/// Makes a token for `user_id`: its row, and the token itself, which exists nowhere else.
/// 409 past [`MAX_PER_USER`] tokens.
pub async fn create(state: &AppState, user_id: i64, name: &str) -> ApiResult<(TokenView, String)> {
    let name = check_name(name)?;
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    let token = format!("{PREFIX}{}", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>());
    // The count and the insert are one statement, so racing requests cannot pass the limit.
    let new =
        store::NewToken { user_id, name: &name, hash: &digest(&token), prefix: &token[..SHOWN] };
    let view = store::insert(state.pool(), &new, now(), MAX_PER_USER).await?;
    match view {
        Some(view) => Ok((view, token)),
        None => Err(ApiError::conflict(format!(
            "you have {MAX_PER_USER} API tokens, the most one account may hold: revoke one first"
        ))),
    }
}

/// `user_id`'s tokens, newest first.
pub async fn list(state: &AppState, user_id: i64) -> ApiResult<Vec<TokenView>> {
    Ok(store::list(state.pool(), user_id).await?)
}

/// Revokes token `id` of `user_id`; `false` when they hold no such token.
pub async fn revoke(state: &AppState, user_id: i64, id: i64) -> ApiResult<bool> {
    Ok(store::revoke(state.pool(), user_id, id).await?)
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn headers(value: &[u8]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Ok(value) = HeaderValue::from_bytes(value) {
            headers.insert(header::AUTHORIZATION, value);
        }
        headers
    }

    #[test]
    fn bearer_headers_are_read_strictly() {
        let token = format!("{PREFIX}{}", "0a".repeat(32));
        let read = |v: &str| bearer(&headers(v.as_bytes()));
        assert_eq!(read(&format!("Bearer {token}")), Some(Bearer::Token(token.clone())));
        assert_eq!(read(&format!("bearer  {token} ")), Some(Bearer::Token(token.clone())));
        assert_eq!(read("Bearer"), Some(Bearer::Malformed));
        assert_eq!(read(&format!("Bearer {}", token.to_uppercase())), Some(Bearer::Malformed));
        assert_eq!(read(&format!("Bearer {token}0")), Some(Bearer::Malformed));
        assert_eq!(read("Bearer 0123"), Some(Bearer::Malformed));
        assert_eq!(bearer(&headers(b"Bearer \xff\xfe")), Some(Bearer::Malformed));
        assert_eq!(read("Basic dXNlcjpwYXNz"), None);
        assert_eq!(bearer(&HeaderMap::new()), None);
    }

    #[test]
    fn names_are_checked() {
        assert_eq!(check_name("  ci runner ").ok().as_deref(), Some("ci runner"));
        assert!(check_name("   ").is_err());
        assert!(check_name("a\tb").is_err());
        assert!(check_name(&"é".repeat(MAX_NAME_CHARS)).is_ok());
        assert!(check_name(&"é".repeat(MAX_NAME_CHARS + 1)).is_err());
    }
}
