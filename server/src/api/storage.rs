//! Disk use: what each user's datasets and runs take, the per-user quota that submits and
//! uploads respect, and the models (shared by everyone) an admin may delete: folders under
//! `DATA_DIR/models` and repos pulled into `DATA_DIR/hub` (never the user's own Hugging Face
//! cache, which Sluice only reads). Every delete says how many bytes it freed.

use std::path::{Path, PathBuf};

use axum::extract::State;
use axum::routing::{delete, get, put};
use axum::{Json, Router};
use serde_json::{Value, json};

use crate::AppState;
use crate::auth::session::random_token;
use crate::auth::{AdminUser, User};
use crate::error::{ApiError, ApiJson, ApiPath, ApiResult};
use crate::jobs::runner;
use crate::paths::is_plain_name;
use crate::store::jobs as store;

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
    let datasets = crate::store::datasets::bytes_of(state.pool(), Some(user_id)).await?;
    let runs: Vec<PathBuf> = store::job_ids_of_owner(state.pool(), user_id)
        .await?
        .into_iter()
        .map(|id| runner::run_dir(state, id))
        .collect();
    let (runs, checkpoints) = tokio::task::spawn_blocking(move || {
        runs.iter().fold((0, 0), |(all, saved), dir| {
            (all + crate::paths::dir_bytes(dir), saved + checkpoint_bytes(dir))
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
        .map(|e| crate::paths::dir_bytes(&e.path()))
        .sum()
}

/// `user`'s quota in bytes, if an admin set one.
pub async fn quota_of(state: &AppState, user_id: i64) -> ApiResult<Option<u64>> {
    let quota = crate::store::users::quota(state.pool(), user_id).await?;
    Ok(quota.map(|q| q.max(0) as u64))
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
        let bytes = crate::paths::dir_bytes(&dir);
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
                bytes.saturating_sub(crate::paths::dir_bytes(&target))
            }
        }
    })
    .await
    .unwrap_or(0)
}

/// `GET /api/storage` (admins): every user's usage and quota, the model folders with their
/// sizes, and the data directory's disk.
async fn overview(State(state): State<AppState>, _admin: AdminUser) -> ApiResult<Json<Value>> {
    let users = crate::store::users::quotas(state.pool()).await?;
    let mut rows = Vec::with_capacity(users.len());
    for (id, username, quota) in users {
        let usage = usage_of(&state, id).await?;
        let jobs = store::job_ids_of_owner(state.pool(), id).await?.len();
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
    let shared = crate::store::datasets::bytes_of(state.pool(), None).await?;
    let (models_dir, hub_dir) = (state.models_dir(), state.config().hub_dir());
    let models = tokio::task::spawn_blocking(move || model_folders(&models_dir, &hub_dir))
        .await
        .map_err(ApiError::internal)?;
    let mut model_rows = Vec::with_capacity(models.len());
    for (model, bytes) in models {
        let in_use = active_using_model(&state, &model).await?;
        model_rows.push(json!({
            "name": model.name(),
            "id": model.id(),
            "origin": model.origin(),
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

/// A model an admin may delete, named as `DELETE /api/storage/models/{name}` takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Model {
    /// `DATA_DIR/models/<folder>`, named by its folder.
    Local(String),
    /// A repo pulled into `DATA_DIR/hub` with all its revisions, named `hf:Org/Name`.
    Pulled(String),
}

impl Model {
    /// The model a name stands for, if it is a valid one (it may not exist).
    fn parse(name: &str) -> Option<Model> {
        match name.strip_prefix("hf:") {
            Some(repo) => crate::hub::check_repo(repo).ok().map(|()| Model::Pulled(repo.into())),
            None => (is_plain_name(name) && !name.starts_with('.'))
                .then(|| Model::Local(name.to_string())),
        }
    }

    fn name(&self) -> String {
        match self {
            Model::Local(folder) => folder.clone(),
            Model::Pulled(repo) => format!("hf:{repo}"),
        }
    }

    /// The model id jobs name it by (a pulled repo's jobs add `@revision`).
    fn id(&self) -> String {
        match self {
            Model::Local(folder) => format!("local:{folder}"),
            Model::Pulled(repo) => format!("hf:{repo}"),
        }
    }

    fn origin(&self) -> &'static str {
        match self {
            Model::Local(_) => "local",
            Model::Pulled(_) => "pulled",
        }
    }

    fn dir(&self, state: &AppState) -> PathBuf {
        match self {
            Model::Local(folder) => state.models_dir().join(folder),
            Model::Pulled(repo) => {
                state.config().hub_dir().join(crate::hub::cache::repo_folder(repo))
            }
        }
    }
}

/// The model folders (not the hidden ones of imports under way), then the pulled repos, with
/// their bytes.
fn model_folders(models: &Path, hub: &Path) -> Vec<(Model, u64)> {
    let folders = |dir: &Path| -> Vec<(String, PathBuf)> {
        let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
        let mut found: Vec<(String, PathBuf)> = entries
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| e.file_name().to_str().map(|n| (n.to_string(), e.path())))
            .collect();
        found.sort();
        found
    };
    let local = folders(models)
        .into_iter()
        .filter(|(name, _)| is_plain_name(name) && !name.starts_with('.'))
        .map(|(name, path)| (Model::Local(name), crate::paths::dir_bytes(&path)));
    let pulled = folders(hub).into_iter().filter_map(|(name, path)| {
        let repo = crate::hub::cache::repo_of_folder(&name)?;
        Some((Model::Pulled(repo), crate::paths::dir_bytes(&path)))
    });
    local.chain(pulled).collect()
}

/// Queued or running jobs that train `model` (any revision of a pulled repo).
async fn active_using_model(state: &AppState, model: &Model) -> ApiResult<i64> {
    Ok(store::active_using_model(state.pool(), &model.id()).await?)
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
    let updated = crate::store::users::set_quota(state.pool(), id, quota).await?;
    if !updated {
        return Err(ApiError::not_found(format!("no user {id}")));
    }
    Ok(Json(json!({ "id": id, "quota_bytes": quota })))
}

/// `DELETE /api/storage/models/{name}` (admins): the model folder `models/<name>`, or for
/// `hf:Org/Name` the pulled repo with every revision; `{"freed_bytes"}`. 409 while a queued or
/// running job trains it or the repo is being pulled; 404 for anything else.
async fn delete_model(
    State(state): State<AppState>,
    _admin: AdminUser,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<Value>> {
    let not_found = || ApiError::not_found(format!("no model {name:?} to delete"));
    let model = Model::parse(&name).ok_or_else(not_found)?;
    let dir = model.dir(&state);
    if !dir.is_dir() {
        return Err(not_found());
    }
    let active = active_using_model(&state, &model).await?;
    if active > 0 {
        return Err(ApiError::conflict(format!(
            "{active} queued or running jobs train this model; cancel them first"
        )));
    }
    if let Model::Pulled(repo) = &model
        && state.pulls().all().iter().any(|p| &p.repo == repo && p.state == "running")
    {
        return Err(ApiError::conflict(format!("{repo} is being pulled; wait for it to end")));
    }
    let freed = remove_dir(dir).await;
    tracing::info!("model {name} deleted; {freed} bytes freed");
    Ok(Json(json!({ "name": name, "freed_bytes": freed })))
}
