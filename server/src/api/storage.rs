//! Disk use: what each user's datasets and runs take, the per-user quota that submits and
//! uploads respect, and the model folders (shared by everyone) an admin may delete. Every delete
//! says how many bytes it freed.

use std::path::{Path, PathBuf};

use axum::extract::State;
use axum::routing::{delete, get, put};
use axum::{Json, Router};
use serde_json::{Value, json};

use crate::AppState;
use crate::auth::session::random_token;
use crate::auth::{AdminUser, User};
use crate::error::{ApiError, ApiJson, ApiPath, ApiResult};
use crate::jobs::{runner, store};
use crate::paths::is_plain_name;

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/api/storage", get(overview))
        .route("/api/storage/users/{id}/quota", put(set_quota))
        .route("/api/storage/models/{name}", delete(delete_model))
}

/// Bytes one user's things take.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Usage {
    /// Their uploaded datasets.
    pub datasets: u64,
    /// Their jobs' run folders, checkpoints included.
    pub runs: u64,
    /// The checkpoint folders within those runs.
    pub checkpoints: u64,
}

impl Usage {
    /// What counts against a quota.
    pub fn total(&self) -> u64 {
        self.datasets + self.runs
    }
}

/// What `user_id` takes on disk now.
pub async fn usage_of(state: &AppState, user_id: i64) -> ApiResult<Usage> {
    let datasets: i64 =
        sqlx::query_scalar("SELECT COALESCE(SUM(size_bytes), 0) FROM datasets WHERE owner_id = ?")
            .bind(user_id)
            .fetch_one(state.pool())
            .await?;
    let runs: Vec<PathBuf> = store::job_ids_of_owner(state, user_id)
        .await?
        .into_iter()
        .map(|id| runner::run_dir(state, id))
        .collect();
    let (runs, checkpoints) = tokio::task::spawn_blocking(move || {
        runs.iter().fold((0, 0), |(all, saved), dir| {
            (all + store::dir_bytes(dir), saved + checkpoint_bytes(dir))
        })
    })
    .await
    .map_err(ApiError::internal)?;
    Ok(Usage { datasets: datasets.max(0) as u64, runs, checkpoints })
}

/// Bytes of the checkpoint folders (`checkpoint-<step>`, `final`) of a run folder.
fn checkpoint_bytes(run: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(run) else { return 0 };
    entries
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name == "final" || name.starts_with("checkpoint-")
        })
        .map(|e| store::dir_bytes(&e.path()))
        .sum()
}

/// `user`'s quota in bytes, if an admin set one.
pub async fn quota_of(state: &AppState, user_id: i64) -> ApiResult<Option<u64>> {
    let quota: Option<Option<i64>> =
        sqlx::query_scalar("SELECT quota_bytes FROM users WHERE id = ?")
            .bind(user_id)
            .fetch_optional(state.pool())
            .await?;
    Ok(quota.flatten().map(|q| q.max(0) as u64))
}

/// Refuses when `user`'s usage plus `incoming` bytes is over their quota: 413 for an upload,
/// 409 for a submit (which passes 0: it is refused once the quota is reached, since what a run
/// will write is not known beforehand).
pub async fn refuse_over_quota(state: &AppState, user: &User, incoming: u64) -> ApiResult<()> {
    let Some(quota) = quota_of(state, user.id).await? else { return Ok(()) };
    let used = usage_of(state, user.id).await?.total();
    let over = if incoming == 0 { used >= quota } else { used + incoming > quota };
    if over {
        let adding = if incoming > 0 {
            format!(" and this upload adds {}", gib(incoming))
        } else {
            String::new()
        };
        let message = format!(
            "your storage quota is {}; you use {}{adding}. Delete jobs, checkpoints or datasets \
             you no longer need (or ask an admin for more room)",
            gib(quota),
            gib(used),
        );
        return Err(if incoming > 0 {
            ApiError::TooLarge(message)
        } else {
            ApiError::conflict(message)
        });
    }
    Ok(())
}

/// Bytes as the pages show them ("1.20 GiB").
fn gib(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["bytes", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{bytes} bytes") } else { format!("{value:.2} {}", UNITS[unit]) }
}

/// Removes folder `dir` and returns the bytes it held. It is first renamed to a hidden sibling,
/// so nothing half-deleted ever carries its name; a removal that fails midway leaves only the
/// hidden name, which the next start clears.
pub async fn remove_dir(dir: PathBuf) -> u64 {
    tokio::task::spawn_blocking(move || {
        let bytes = store::dir_bytes(&dir);
        if !dir.exists() {
            return 0;
        }
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let trash = dir.with_file_name(format!(".deleting-{name}-{}", random_token()));
        let target = match std::fs::rename(&dir, &trash) {
            Ok(()) => trash,
            Err(err) => {
                tracing::warn!("cannot move {} aside: {err}", dir.display());
                dir
            }
        };
        match std::fs::remove_dir_all(&target) {
            Ok(()) => bytes,
            Err(err) => {
                tracing::warn!("cannot remove {}: {err}", target.display());
                bytes.saturating_sub(store::dir_bytes(&target))
            }
        }
    })
    .await
    .unwrap_or(0)
}

/// `GET /api/storage` (admins): every user's usage and quota, the model folders with their
/// sizes, and the data directory's disk.
async fn overview(State(state): State<AppState>, _admin: AdminUser) -> ApiResult<Json<Value>> {
    let users: Vec<(i64, String, Option<i64>)> =
        sqlx::query_as("SELECT id, username, quota_bytes FROM users ORDER BY id")
            .fetch_all(state.pool())
            .await?;
    let mut rows = Vec::with_capacity(users.len());
    for (id, username, quota) in users {
        let usage = usage_of(&state, id).await?;
        let jobs = store::job_ids_of_owner(&state, id).await?.len();
        rows.push(json!({
            "id": id,
            "username": username,
            "jobs": jobs,
            "datasets_bytes": usage.datasets,
            "runs_bytes": usage.runs,
            "checkpoints_bytes": usage.checkpoints,
            "total_bytes": usage.total(),
            "quota_bytes": quota,
        }));
    }
    let shared: i64 = sqlx::query_scalar(
        "SELECT COALESCE(SUM(size_bytes), 0) FROM datasets WHERE owner_id IS NULL",
    )
    .fetch_one(state.pool())
    .await?;
    let models_dir = state.models_dir();
    let models = tokio::task::spawn_blocking(move || model_folders(&models_dir))
        .await
        .map_err(ApiError::internal)?;
    let mut model_rows = Vec::with_capacity(models.len());
    for (name, bytes) in models {
        let in_use = active_using_model(&state, &name).await?;
        model_rows.push(json!({
            "name": name,
            "id": format!("local:{name}"),
            "bytes": bytes,
            "active_jobs": in_use,
        }));
    }
    Ok(Json(json!({
        "users": rows,
        "shared_datasets_bytes": shared,
        "models": model_rows,
    })))
}

/// The model folders (not the hidden ones of imports under way) with their bytes, by name.
fn model_folders(dir: &Path) -> Vec<(String, u64)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut folders: Vec<(String, u64)> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| e.file_name().to_str().map(|n| (n.to_string(), e.path())))
        .filter(|(name, _)| is_plain_name(name) && !name.starts_with('.'))
        .map(|(name, path)| (name, store::dir_bytes(&path)))
        .collect();
    folders.sort();
    folders
}

/// Queued or running jobs that train model folder `name`.
async fn active_using_model(state: &AppState, name: &str) -> ApiResult<i64> {
    Ok(sqlx::query_scalar(
        "SELECT COUNT(*) FROM jobs WHERE model = ? AND status IN ('queued', 'running')",
    )
    .bind(format!("local:{name}"))
    .fetch_one(state.pool())
    .await?)
}

/// `PUT /api/storage/users/{id}/quota` (admins): `{"quota_bytes": N}`, or `null` for none.
async fn set_quota(
    State(state): State<AppState>,
    _admin: AdminUser,
    ApiPath(id): ApiPath<i64>,
    ApiJson(body): ApiJson<Value>,
) -> ApiResult<Json<Value>> {
    let quota = match body.get("quota_bytes") {
        Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(q) if q <= i64::MAX as u64 => Some(q as i64),
            _ => {
                return Err(ApiError::bad_request(
                    "quota_bytes must be a whole number of bytes (0 or more), or null for none",
                ));
            }
        },
        None => return Err(ApiError::bad_request("missing field `quota_bytes`")),
    };
    let updated = sqlx::query("UPDATE users SET quota_bytes = ? WHERE id = ?")
        .bind(quota)
        .bind(id)
        .execute(state.pool())
        .await?;
    if updated.rows_affected() != 1 {
        return Err(ApiError::not_found(format!("no user {id}")));
    }
    Ok(Json(json!({ "id": id, "quota_bytes": quota })))
}

/// `DELETE /api/storage/models/{name}` (admins): the model folder `models/<name>`;
/// `{"freed_bytes"}`. 409 while a queued or running job trains it.
async fn delete_model(
    State(state): State<AppState>,
    _admin: AdminUser,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<Value>> {
    let dir = state.models_dir().join(&name);
    if !is_plain_name(&name) || name.starts_with('.') || !dir.is_dir() {
        return Err(ApiError::not_found(format!("no model folder {name:?}")));
    }
    let active = active_using_model(&state, &name).await?;
    if active > 0 {
        return Err(ApiError::conflict(format!(
            "{active} queued or running jobs train this model; cancel them first"
        )));
    }
    let freed = remove_dir(dir).await;
    Ok(Json(json!({ "name": name, "freed_bytes": freed })))
}
