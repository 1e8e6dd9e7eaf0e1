//! `/api/datasets`: upload (streamed to disk, linted by the engine), list, show, delete, preview.

mod preview;
mod upload;

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{Value, json};

use crate::AppState;
use crate::auth::CurrentUser;
use crate::datasets::{self, Dataset};
use crate::error::{ApiError, ApiPath, ApiResult};

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/api/datasets", get(list).post(upload::upload))
        .route("/api/datasets/{id}", get(show).delete(remove))
        .route("/api/datasets/{id}/preview", get(preview::preview))
        .route("/api/datasets/{id}/resumable-jobs", get(resumable_jobs))
        // Uploads count their own bytes against the configured limit while streaming.
        .layer(axum::extract::DefaultBodyLimit::disable())
}

async fn list(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
) -> ApiResult<Json<Vec<Dataset>>> {
    Ok(Json(datasets::all_visible(&state, &user).await?))
}

async fn show(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<Json<Dataset>> {
    Ok(Json(datasets::visible(&state, &user, id).await?))
}

/// `GET /api/datasets/{id}/resumable-jobs`: `[{"id", "name"}]`, the cancelled or interrupted
/// jobs training on it, whose resume its deletion ends: what a delete's confirmation names.
async fn resumable_jobs(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<Json<Vec<Value>>> {
    datasets::visible(&state, &user, id).await?;
    let jobs = crate::store::jobs::resumable_on(state.pool(), id).await?;
    Ok(Json(jobs.into_iter().map(|(id, name)| json!({ "id": id, "name": name })).collect()))
}

/// `DELETE /api/datasets/{id}`: `{"id", "freed_bytes", "resume_ended"}` (the ids of the
/// cancelled or interrupted jobs that can no longer be resumed); 403 for a non-admin on the
/// shared demo; 409 while a queued or running job uses it. Finished jobs keep their
/// checkpoints.
async fn remove(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<Json<Value>> {
    let dataset = datasets::visible(&state, &user, id).await?;
    if dataset.owner_id.is_none() && !user.is_admin() {
        return Err(ApiError::Forbidden("only an admin can delete a shared dataset".into()));
    }
    // Read before the delete clears their dataset: afterwards nothing says which they were.
    let ended: Vec<i64> = crate::store::jobs::resumable_on(state.pool(), id)
        .await?
        .into_iter()
        .map(|(job, _)| job)
        .collect();
    let freed = datasets::delete(&state, &dataset).await?;
    tracing::info!(
        "dataset {id} deleted by {}; {freed} bytes freed; resume ended for jobs {ended:?}",
        user.username
    );
    Ok(Json(json!({ "id": id, "freed_bytes": freed, "resume_ended": ended })))
}
