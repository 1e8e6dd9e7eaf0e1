//! `GET /api/gpus`: the devices jobs can run on, with their memory and use now.

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};

use crate::AppState;
use crate::auth::CurrentUser;
use crate::error::ApiResult;
use crate::gpus::DeviceInfo;

pub(crate) fn router() -> Router<AppState> {
    Router::new().route("/api/gpus", get(list))
}

async fn list(
    State(state): State<AppState>,
    _user: CurrentUser,
) -> ApiResult<Json<Vec<DeviceInfo>>> {
    let devices = tokio::task::spawn_blocking(move || state.gpus().list()).await?;
    Ok(Json(devices))
}
