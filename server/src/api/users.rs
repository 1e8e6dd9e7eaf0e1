//! User management, for admins only: the list (with each account's failed-login alert from the
//! throttle), new accounts, password resets and deletes.

use std::time::Instant;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{delete, get, put};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tracing::warn;

use crate::AppState;
use crate::auth::{self, AdminUser, password};
use crate::datasets;
use crate::db::now;
use crate::error::{ApiError, ApiJson, ApiPath, ApiResult};
use crate::jobs::runner;
use crate::store::jobs as store;
use crate::store::users::UserView;

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/api/users", get(list).post(create))
        .route("/api/users/{id}", delete(remove))
        .route("/api/users/{id}/password", put(reset_password))
}

/// A user as the admins' list shows them.
#[derive(Debug, Serialize)]
struct Listed {
    #[serde(flatten)]
    user: UserView,
    /// The throttle's alert: many failed logins for this account lately, from any addresses.
    failed_logins: Option<FailedLogins>,
}

#[derive(Debug, Serialize)]
struct FailedLogins {
    count: u32,
    /// Distinct client addresses they came from (counted up to a bound).
    addresses: usize,
    /// Unix seconds of the latest.
    last_at: i64,
}

async fn list(State(state): State<AppState>, _admin: AdminUser) -> ApiResult<Json<Vec<Listed>>> {
    let users = crate::store::users::list(state.pool()).await?;
    let (instant, unix) = (Instant::now(), now());
    let alerts = auth::guards(&state).throttle.alerts(instant);
    let listed = users
        .into_iter()
        .map(|user| {
            let name = user.username.to_ascii_lowercase();
            let failed_logins = alerts.iter().find(|a| a.account == name).map(|alert| {
                let ago = instant.saturating_duration_since(alert.last_failure).as_secs();
                FailedLogins {
                    count: alert.failures,
                    addresses: alert.addresses,
                    last_at: unix.saturating_sub(i64::try_from(ago).unwrap_or(i64::MAX)),
                }
            });
            Listed { user, failed_logins }
        })
        .collect();
    Ok(Json(listed))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewUser {
    username: String,
    password: String,
    #[serde(default = "default_role")]
    role: String,
}

fn default_role() -> String {
    "user".into()
}

/// `POST /api/users`: 201 with the new user; 409 when the name is taken.
async fn create(
    State(state): State<AppState>,
    _admin: AdminUser,
    ApiJson(body): ApiJson<NewUser>,
) -> ApiResult<(StatusCode, Json<crate::store::users::UserView>)> {
    password::check_username(&body.username)?;
    password::check_password(&body.password)?;
    if body.role != "admin" && body.role != "user" {
        return Err(ApiError::bad_request(format!(
            "role must be \"admin\" or \"user\", not {:?}",
            body.role
        )));
    }
    let taken = crate::store::users::id_of(state.pool(), &body.username).await?;
    if taken.is_some() {
        return Err(ApiError::conflict(format!("the username {:?} is taken", body.username)));
    }
    let hash = password::hash(body.password).await?;
    let user =
        crate::store::users::insert(state.pool(), &body.username, &hash, &body.role, now()).await?;
    Ok((StatusCode::CREATED, Json(user)))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewPassword {
    password: String,
}

/// `PUT /api/users/{id}/password` `{"password"}`: 204 once user `id` has this password; every
/// session of theirs ends (their API tokens keep working). 400 for a password the rules refuse,
/// 404 for no such user, 409 for the admin's own account, which is changed on the account page
/// with the current password (so a session left open cannot take the account for good).
async fn reset_password(
    State(state): State<AppState>,
    AdminUser(admin): AdminUser,
    ApiPath(id): ApiPath<i64>,
    ApiJson(body): ApiJson<NewPassword>,
) -> ApiResult<StatusCode> {
    if id == admin.id {
        return Err(ApiError::conflict(
            "change your own password on your account page, with your current one",
        ));
    }
    password::check_password(&body.password)?;
    if !crate::store::users::exists(state.pool(), id).await? {
        return Err(ApiError::not_found(format!("no user {id}")));
    }
    let hash = password::hash(body.password).await?;
    if !crate::store::users::set_password(state.pool(), id, &hash, None).await? {
        return Err(ApiError::not_found(format!("no user {id}")));
    }
    Ok(StatusCode::NO_CONTENT)
}

/// `DELETE /api/users/{id}`: 204. An admin cannot delete themself, nor a user whose jobs are
/// queued or running (cancel them first). The user's datasets, jobs and sessions go with them,
/// and so do their files: dataset uploads and run folders (checkpoints, state).
async fn remove(
    State(state): State<AppState>,
    AdminUser(admin): AdminUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<StatusCode> {
    if id == admin.id {
        return Err(ApiError::conflict("you cannot delete your own account"));
    }
    if !crate::store::users::exists(state.pool(), id).await? {
        return Err(ApiError::not_found(format!("no user {id}")));
    }
    // Their files are found before the rows go; the rows go in one statement that also checks
    // that nothing of theirs is queued or running.
    let mut paths = datasets::files_of_owner(&state, id).await?;
    let jobs = store::job_ids_of_owner(state.pool(), id).await?;
    if !crate::store::users::delete_user_if_idle(state.pool(), id).await? {
        let active = store::active_of_owner(state.pool(), id).await?;
        return Err(ApiError::conflict(format!(
            "the user has {active} queued or running jobs; cancel them first"
        )));
    }
    paths.extend(jobs.iter().map(|&job| runner::run_dir(&state, job)));
    tokio::task::spawn_blocking(move || {
        for path in paths {
            let removed = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            match removed {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => warn!("deleting a user: cannot remove {}: {e}", path.display()),
            }
        }
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}
