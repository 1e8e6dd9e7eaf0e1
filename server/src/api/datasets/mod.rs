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

/// `DELETE /api/datasets/{id}`: `{"id", "freed_bytes"}`; 403 for a non-admin on the shared
/// demo; 409 while a queued or running job uses it. Finished jobs keep their checkpoints but can
/// no longer be resumed.
async fn remove(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<Json<Value>> {
    let dataset = datasets::visible(&state, &user, id).await?;
    if dataset.owner_id.is_none() && !user.is_admin() {
        return Err(ApiError::Forbidden("only an admin can delete a shared dataset".into()));
    }
    let freed = datasets::delete(&state, &dataset).await?;
    tracing::info!("dataset {id} deleted by {}; {freed} bytes freed", user.username);
    Ok(Json(json!({ "id": id, "freed_bytes": freed })))
}
