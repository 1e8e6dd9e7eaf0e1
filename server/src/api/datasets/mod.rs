//! `/api/datasets`: upload (streamed to disk, linted by the engine), list, show, delete, preview.

mod preview;
mod upload;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};

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

/// `DELETE /api/datasets/{id}`: 204; 403 for a non-admin on the shared demo; 409 while a queued
/// or running job uses it. Finished jobs keep their checkpoints but can no longer be resumed.
async fn remove(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<StatusCode> {
    let dataset = datasets::visible(&state, &user, id).await?;
    if dataset.owner_id.is_none() && !user.is_admin() {
        return Err(ApiError::Forbidden("only an admin can delete a shared dataset".into()));
    }
    datasets::delete(&state, &dataset).await?;
    Ok(StatusCode::NO_CONTENT)
}
