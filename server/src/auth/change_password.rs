//! `POST /api/account/password`: a user changes their own password.
//!
//! It must give the current password, so a session left open on a shared screen cannot be
//! turned into the account for good; a wrong one counts as a failed login in the throttle (the
//! route would otherwise be a way around it for anyone holding a session). On success every
//! other session of the user ends and the one making the change stays logged in. API tokens
//! keep working: they are credentials of their own, listed and revoked on the account page.

use std::time::Instant;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use serde::Deserialize;

use super::password::{self, Turn};
use super::session::{self, Cookie, SessionUser};
use super::{AuthError, ClientAddr, guards};
use crate::AppState;
use crate::error::{ApiError, ApiJson};
use crate::store::users as store;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct NewPassword {
    current_password: String,
    new_password: String,
}

/// 204 once changed; 400 for a new password the rules refuse, 403 for a wrong current one (not
/// 401, which would say the session itself is gone), 429 and 503 as for a login. Only through
/// a password session: an API token gets 403.
pub(super) async fn change_password(
    State(state): State<AppState>,
    ClientAddr(address): ClientAddr,
    SessionUser(user): SessionUser,
    headers: HeaderMap,
    ApiJson(body): ApiJson<NewPassword>,
) -> Result<StatusCode, AuthError> {
    password::check_password(&body.new_password)?;
    let Some(Cookie::Session(token)) = session::cookie(&headers) else {
        // SessionUser found a session in this very cookie a moment ago.
        return Err(ApiError::unauthorized().into());
    };
    let guards = guards(&state);
    let attempt = guards.throttle.admit(&user.username, address, Instant::now())?;
    let turn = Turn::try_take()?;
    let stored = store::password_hash(state.pool(), user.id).await?;
    if !turn.verify(body.current_password, stored).await? {
        attempt.failed(Instant::now(), true);
        return Err(ApiError::Forbidden("the current password is wrong".into()).into());
    }
    attempt.succeeded();
    let hash = password::hash(body.new_password).await?;
    if !store::set_password(state.pool(), user.id, &hash, Some(&token)).await? {
        // Deleted by an admin while the hash ran.
        return Err(ApiError::unauthorized().into());
    }
    Ok(StatusCode::NO_CONTENT)
}
