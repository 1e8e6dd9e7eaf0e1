//! Demo links: a job's owner turns on a read-only, full-screen view of its live figures, meant
//! for a projector, which anyone with the link opens without an account (`/demo/{token}`). The
//! link shows the model, the progress and the latest step's figures and per-unit timeline,
//! never the data, the checkpoints, the settings or the log; turning it off ends it at once.

use std::convert::Infallible;

use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::routing::{get, put};
use axum::{Json, Router};
use futures_util::Stream;
use serde_json::{Value, json};

use crate::AppState;
use crate::auth::CurrentUser;
use crate::auth::session::{is_token, random_token};
use crate::error::{ApiError, ApiPath, ApiResult};
use crate::store::jobs::{self as store, JobRow};

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/api/jobs/{id}/demo", put(share).delete(unshare))
        .route("/api/demo/{token}", get(show))
        .route("/api/demo/{token}/events", get(events))
}

/// `PUT /api/jobs/{id}/demo`: turns the job's demo link on (the same link if it already is);
/// `{"demo": "/demo/<token>"}`.
async fn share(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<Json<Value>> {
    super::access::visible_job(&state, &user, id).await?;
    let token = store::share_demo(state.pool(), id, &random_token())
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no job {id}")))?;
    crate::jobs::record::log(&state, id, &format!("demo link turned on by {}", user.username))
        .await;
    Ok(Json(json!({ "demo": format!("/demo/{token}") })))
}

/// `DELETE /api/jobs/{id}/demo`: turns it off; `{"demo": null}`.
async fn unshare(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<Json<Value>> {
    super::access::visible_job(&state, &user, id).await?;
    if store::unshare_demo(state.pool(), id).await? {
        crate::jobs::record::log(&state, id, &format!("demo link turned off by {}", user.username))
            .await;
    }
    Ok(Json(json!({ "demo": null })))
}

/// The job a demo token opens: 404, saying the link is off, for an unknown token.
async fn shared(state: &AppState, token: &str) -> ApiResult<JobRow> {
    let job = if is_token(token) { store::by_demo_token(state.pool(), token).await? } else { None };
    job.ok_or_else(|| ApiError::not_found("this demo link is off or never existed"))
}

/// `GET /api/demo/{token}`: what the demo page shows, without an account: the job's title,
/// model and size, status and progress, and its latest step with the per-unit timeline.
async fn show(
    State(state): State<AppState>,
    ApiPath(token): ApiPath<String>,
) -> ApiResult<Json<Value>> {
    let job = shared(&state, &token).await?;
    let (model_state, model) = (state.clone(), job.model.clone());
    let params = tokio::task::spawn_blocking(move || {
        crate::models::resolve(&model_state, &model)
            .ok()
            .map(|m| sluice_engine::model::ModelLayout::new(&m.spec).params())
    })
    .await
    .map_err(ApiError::internal)?;
    let point = match store::latest_point(state.pool(), job.id).await? {
        Some(text) => serde_json::from_str::<Value>(&text).map_err(ApiError::internal)?,
        None => Value::Null,
    };
    let title = if job.name.is_empty() { format!("job {}", job.id) } else { job.name.clone() };
    Ok(Json(json!({
        "title": title,
        "model": job.model,
        "params": params,
        "gpu": job.device,
        "status": job.status,
        "step": job.step,
        "total_steps": job.total_steps,
        "placement": job.placement,
        "started_at": job.started_at,
        "point": point,
    })))
}

/// `GET /api/demo/{token}/events`: SSE, as the job page's but only `status` and `metric`
/// events (no log lines). The link's state is checked once, when the stream opens.
async fn events(
    State(state): State<AppState>,
    ApiPath(token): ApiPath<String>,
) -> ApiResult<Sse<impl Stream<Item = Result<Event, Infallible>>>> {
    // Visitors have no account: they count against the server's cap only.
    let watch = state.watchers().admit(None)?;
    // Subscribe before reading the status, so no change falls between the two.
    let receiver = state.subscribe();
    let job = shared(&state, &token).await?;
    let shown = |kind: &str| kind == "metric" || kind == "status";
    Ok(super::jobs::event_stream(receiver, &job, shown, watch))
}
