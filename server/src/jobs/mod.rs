//! Jobs: submit, list, show, cancel, resume; metrics history, live events (SSE) and the log.
//! The queue itself (dispatchers and training threads) is in [`runner`].

pub mod request;
pub mod runner;
pub mod store;

use std::convert::Infallible;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::{Stream, StreamExt, stream};
use serde_json::{Value, json};
use tokio_stream::wrappers::BroadcastStream;

use request::JobRequest;
pub use runner::Queue;
use sluice_engine::train::{STATE_DIR, TrainingState};
use store::{COLUMNS, JobRow};

use crate::AppState;
use crate::auth::CurrentUser;
use crate::db::now;
use crate::error::{ApiError, ApiJson, ApiPath, ApiResult};
use crate::plan;

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/api/jobs", get(list).post(create))
        .route("/api/jobs/{id}", get(show))
        .route("/api/jobs/{id}/cancel", post(cancel))
        .route("/api/jobs/{id}/resume", post(resume))
        .route("/api/jobs/{id}/metrics", get(metrics))
        .route("/api/jobs/{id}/events", get(events))
        .route("/api/jobs/{id}/log", get(log))
}

async fn list(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
) -> ApiResult<Json<Vec<Value>>> {
    let rows: Vec<JobRow> = if user.is_admin() {
        sqlx::query_as(&format!("SELECT {COLUMNS} FROM jobs ORDER BY id DESC"))
            .fetch_all(state.pool())
            .await?
    } else {
        sqlx::query_as(&format!("SELECT {COLUMNS} FROM jobs WHERE owner_id = ? ORDER BY id DESC"))
            .bind(user.id)
            .fetch_all(state.pool())
            .await?
    };
    let mut jobs = Vec::with_capacity(rows.len());
    for row in &rows {
        jobs.push(store::view(&state, row).await?);
    }
    Ok(Json(jobs))
}

/// `POST /api/jobs`: 201 `{"id"}`. 400 for a field the engine refuses (with the engine's
/// message) or an unknown model, dataset or device; 422 when the planner says it will not fit;
/// 409 over the per-user job limit or when the dataset was deleted meanwhile.
async fn create(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiJson(body): ApiJson<Value>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let resolved = request::resolve(&state, &user, JobRequest::parse(body)?).await?;
    let Some(dataset) = &resolved.dataset else {
        return Err(ApiError::bad_request("missing field `dataset`"));
    };
    let (job, spec) = (resolved.job.clone(), resolved.model.spec.clone());
    let plan_state = state.clone();
    let verdict = tokio::task::spawn_blocking(move || -> ApiResult<plan::Verdict> {
        let memory = plan::machine_memory(&plan_state, &job.devices)?;
        Ok(plan::verdict(&job, &spec, memory))
    })
    .await??;
    if !verdict.fits {
        return Err(ApiError::unprocessable(verdict.reason));
    }
    let job = &resolved.job;
    let settings = serde_json::to_string(&job.settings).map_err(ApiError::internal)?;
    let device = job.devices.to_string();
    let limit = i64::from(state.config().limits.max_active_jobs_per_user);
    // One statement, so the per-user limit and the datasets' existence hold whatever runs
    // beside it (concurrent submits, a dataset deleted meanwhile).
    let id: Option<i64> = sqlx::query_scalar(
        "INSERT INTO jobs (owner_id, model, dataset_id, eval_dataset_id, device, config, status,
                           queue_seq, total_steps, created_at)
         SELECT ?, ?, ?, ?, ?, ?, 'queued', (SELECT COALESCE(MAX(queue_seq), 0) + 1 FROM jobs), ?, ?
         WHERE (SELECT COUNT(*) FROM jobs WHERE owner_id = ? AND status IN ('queued', 'running')) < ?
           AND EXISTS (SELECT 1 FROM datasets WHERE id = ?)
           AND (? IS NULL OR EXISTS (SELECT 1 FROM datasets WHERE id = ?))
         RETURNING id",
    )
    .bind(user.id)
    .bind(&resolved.model.id)
    .bind(dataset.id)
    .bind(resolved.eval_dataset.as_ref().map(|d| d.id))
    .bind(&device)
    .bind(&settings)
    .bind(job.settings.steps.unwrap_or(0) as i64)
    .bind(now())
    .bind(user.id)
    .bind(limit)
    .bind(dataset.id)
    .bind(resolved.eval_dataset.as_ref().map(|d| d.id))
    .bind(resolved.eval_dataset.as_ref().map(|d| d.id))
    .fetch_optional(state.pool())
    .await?;
    let Some(id) = id else {
        let active: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM jobs WHERE owner_id = ? AND status IN ('queued', 'running')",
        )
        .bind(user.id)
        .fetch_one(state.pool())
        .await?;
        if active >= limit {
            return Err(ApiError::conflict(format!(
                "you have {active} queued or running jobs, the most allowed; wait or cancel one"
            )));
        }
        return Err(ApiError::conflict("the dataset was deleted meanwhile"));
    };
    store::log(&state, id, &format!("queued by {} on {device}", user.username)).await;
    state.queue().wake();
    Ok((StatusCode::CREATED, Json(json!({ "id": id }))))
}

async fn show(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<Json<Value>> {
    let job = store::visible(&state, &user, id).await?;
    Ok(Json(store::view(&state, &job).await?))
}

/// `POST /api/jobs/{id}/cancel`: a queued job is cancelled at once (200); a running one stops
/// after its current step and saves a checkpoint (202, the status follows over SSE); 409 for a
/// finished job.
async fn cancel(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    store::visible(&state, &user, id).await?;
    // Asked first, so a runner claiming the job right now still sees the request.
    state.queue().request_cancel(id);
    let dequeued = sqlx::query(
        "UPDATE jobs SET status = 'cancelled', finished_at = ? WHERE id = ? AND status = 'queued'",
    )
    .bind(now())
    .bind(id)
    .execute(state.pool())
    .await?;
    let job =
        store::get(&state, id).await?.ok_or_else(|| ApiError::not_found(format!("no job {id}")))?;
    if dequeued.rows_affected() == 1 {
        state.queue().clear_cancel(id);
        store::log(&state, id, &format!("cancelled by {} before it started", user.username)).await;
        store::publish_status(&state, id).await?;
        return Ok((StatusCode::OK, Json(store::view(&state, &job).await?)));
    }
    if job.status == "running" {
        store::log(&state, id, &format!("cancel requested by {}", user.username)).await;
        return Ok((StatusCode::ACCEPTED, Json(store::view(&state, &job).await?)));
    }
    state.queue().clear_cancel(id);
    Err(ApiError::conflict(format!(
        "the job is {}; only queued or running jobs can be cancelled",
        job.status
    )))
}

/// `POST /api/jobs/{id}/resume`: queues a cancelled or interrupted job again. It continues
/// exactly from the run's saved training state (weights, Adam moments, schedule position and
/// data order, saved with every checkpoint), or from the start when nothing was saved; 409 for
/// other states.
async fn resume(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<Json<Value>> {
    let job = store::visible(&state, &user, id).await?;
    if !job.is_resumable() {
        return Err(ApiError::conflict(format!(
            "the job is {}; only cancelled or interrupted jobs can be resumed",
            job.status
        )));
    }
    if job.dataset_id.is_none() {
        return Err(ApiError::conflict("the job's dataset was deleted; it cannot be resumed"));
    }
    let state_dir = runner::run_dir(&state, id).join(STATE_DIR);
    let saved = tokio::task::spawn_blocking(move || TrainingState::saved_step(&state_dir))
        .await
        .map_err(ApiError::internal)?
        .map_err(ApiError::internal)?;
    let step = saved.unwrap_or(0) as i64;
    let limit = i64::from(state.config().limits.max_active_jobs_per_user);
    let mut tx = state.pool().begin().await?;
    // Steps after the saved state are taken again, identically.
    sqlx::query("DELETE FROM metrics WHERE job_id = ? AND step > ?")
        .bind(id)
        .bind(step)
        .execute(&mut *tx)
        .await?;
    let queued = sqlx::query(
        "UPDATE jobs SET status = 'queued', queue_seq = (SELECT COALESCE(MAX(queue_seq), 0) + 1 FROM jobs),
             error = NULL, finished_at = NULL, step = ?, start_step = ?
         WHERE id = ? AND status IN ('cancelled', 'interrupted')
           AND (SELECT COUNT(*) FROM jobs WHERE owner_id = ? AND status IN ('queued', 'running')) < ?",
    )
    .bind(step)
    .bind(step)
    .bind(id)
    .bind(job.owner_id)
    .bind(limit)
    .execute(&mut *tx)
    .await?;
    if queued.rows_affected() != 1 {
        return Err(ApiError::conflict(
            "the job changed state, or its owner has the most queued or running jobs allowed; \
             reload and try again",
        ));
    }
    tx.commit().await?;
    state.queue().clear_cancel(id);
    let line = match saved {
        Some(step) => format!(
            "resumed by {} after step {step}: weights, optimizer state and data order as saved",
            user.username
        ),
        None => format!("resumed by {} from the start (nothing was saved)", user.username),
    };
    store::log(&state, id, &line).await;
    store::publish_status(&state, id).await?;
    state.queue().wake();
    let job = store::visible(&state, &user, id).await?;
    Ok(Json(store::view(&state, &job).await?))
}

/// `GET /api/jobs/{id}/metrics`: every stored point, in step order.
async fn metrics(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<Json<Vec<Value>>> {
    store::visible(&state, &user, id).await?;
    let points: Vec<String> =
        sqlx::query_scalar("SELECT point FROM metrics WHERE job_id = ? ORDER BY step")
            .bind(id)
            .fetch_all(state.pool())
            .await?;
    let points = points
        .iter()
        .map(|p| serde_json::from_str(p))
        .collect::<Result<Vec<Value>, _>>()
        .map_err(ApiError::internal)?;
    Ok(Json(points))
}

/// `GET /api/jobs/{id}/events`: SSE. A `status` event first, then `metric`, `status` and `log`
/// events as they happen. A client too slow to keep up loses points (it can reload the history);
/// training never waits for it.
async fn events(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<Sse<impl Stream<Item = Result<Event, Infallible>>>> {
    // Subscribe before reading the status, so no change falls between the two.
    let receiver = state.subscribe();
    let job = store::visible(&state, &user, id).await?;
    let first = Event::default().event("status").data(job.status_json().to_string());
    let live = BroadcastStream::new(receiver).filter_map(move |message| {
        let event = match message {
            Ok(m) if m.job_id == id => Some(Ok(Event::default().event(m.kind).data(m.data))),
            _ => None,
        };
        std::future::ready(event)
    });
    Ok(Sse::new(stream::once(std::future::ready(Ok(first))).chain(live))
        .keep_alive(KeepAlive::default()))
}

/// `GET /api/jobs/{id}/log`: the whole log as text, one line per entry.
async fn log(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<impl IntoResponse> {
    store::visible(&state, &user, id).await?;
    let lines: Vec<String> =
        sqlx::query_scalar("SELECT line FROM job_logs WHERE job_id = ? ORDER BY id")
            .bind(id)
            .fetch_all(state.pool())
            .await?;
    let mut text = lines.join("\n");
    if !text.is_empty() {
        text.push('\n');
    }
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text))
}
