//! `/api/models`: the models a job can train, the GGUF import, and pulls from the Hugging Face
//! Hub.

mod import;
mod pull;

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
        .route("/api/models/pull", axum::routing::post(pull::start))
        .route("/api/models/pulls", get(pull::list))
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
