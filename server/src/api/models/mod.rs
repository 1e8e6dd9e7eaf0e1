//! `/api/models`: the models a job can train, and the GGUF import.

mod import;

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};

use crate::AppState;
use crate::auth::CurrentUser;
use crate::error::ApiResult;
use crate::models::{self, ModelView};

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/api/models", get(list))
        .route("/api/models/import", axum::routing::post(import::import))
        // The import counts its own bytes against the configured limit while streaming.
        .layer(axum::extract::DefaultBodyLimit::disable())
}

async fn list(
    State(state): State<AppState>,
    _user: CurrentUser,
) -> ApiResult<Json<Vec<ModelView>>> {
    let models = tokio::task::spawn_blocking(move || models::all(&state)).await?;
    Ok(Json(models))
}
