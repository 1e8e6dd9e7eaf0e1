//! Jobs: submit, list, show, cancel, resume; metrics history, live events (SSE) and the log.
//! The queue itself (dispatchers and training threads) is in [`runner`].

pub mod runner;
pub mod store;

/// The placements a job runs with today: every layer checkpointed on the device, no resident
/// units, gradients in the host store (clipping) or the ring (no clipping). The web form's plan
/// verdict budgets exactly these, so a job it accepts fits.
pub const RUNNER: sluice_engine::plan::Capabilities = sluice_engine::plan::Capabilities {
    max_checkpoint_interval: 1,
    device_gradient_store: false,
    gradient_ring: true,
};

use std::convert::Infallible;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::{Stream, StreamExt, stream};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_stream::wrappers::BroadcastStream;

pub use runner::Queue;
use store::{COLUMNS, JobConfig, JobRow};

use crate::AppState;
use crate::auth::CurrentUser;
use crate::db::now;
use crate::error::{ApiError, ApiJson, ApiPath, ApiResult};
use crate::{datasets, models, plan};

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

/// A job as submitted; everything but `model`, `dataset` and `gpu` has a default.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewJob {
    model: String,
    dataset: i64,
    gpu: String,
    /// Default: one pass over the data.
    steps: Option<u64>,
    #[serde(default = "plan::default_seq_len")]
    seq_len: usize,
    #[serde(default = "plan::default_micro_batch")]
    micro_batch: usize,
    #[serde(default = "plan::default_grad_accum")]
    grad_accum: usize,
    /// Default: 1e-3 for a random-init preset, 2e-5 for a pretrained folder.
    lr: Option<f32>,
    #[serde(default = "default_schedule")]
    schedule: String,
    #[serde(default)]
    warmup: u64,
    #[serde(default)]
    weight_decay: f32,
    #[serde(default = "default_max_grad_norm")]
    max_grad_norm: f32,
    save_every: Option<u64>,
    #[serde(default)]
    seed: u64,
    #[serde(default)]
    train_on_prompt: bool,
}

fn default_schedule() -> String {
    "cosine".into()
}

fn default_max_grad_norm() -> f32 {
    1.0
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

/// `POST /api/jobs`: 201 `{"id"}`. 400 for a bad field or an unknown model, dataset or GPU;
/// 422 when the planner says it will not fit; 409 over the per-user job limit.
async fn create(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiJson(body): ApiJson<NewJob>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let limits = &state.config().limits;
    if let Some(steps) = body.steps
        && !(1..=limits.max_steps).contains(&steps)
    {
        return Err(ApiError::bad_request(format!(
            "steps must be between 1 and {}",
            limits.max_steps
        )));
    }
    if body.seq_len == 0 || body.seq_len > limits.max_seq_len {
        return Err(ApiError::bad_request(format!(
            "seq_len must be between 1 and {}",
            limits.max_seq_len
        )));
    }
    if body.save_every == Some(0) {
        return Err(ApiError::bad_request("save_every must be at least 1"));
    }
    if body.lr.is_some_and(|lr| !(lr.is_finite() && lr > 0.0)) {
        return Err(ApiError::bad_request("lr must be a positive number"));
    }
    if !(body.weight_decay.is_finite() && body.weight_decay >= 0.0) {
        return Err(ApiError::bad_request("weight_decay must be 0 or more"));
    }
    if !(body.max_grad_norm.is_finite() && body.max_grad_norm >= 0.0) {
        return Err(ApiError::bad_request("max_grad_norm must be 0 (off) or more"));
    }
    if body.schedule.parse::<sluice_engine::optim::Schedule>().is_err() {
        return Err(ApiError::bad_request(format!(
            "schedule must be constant, linear or cosine, not {:?}",
            body.schedule
        )));
    }
    let dataset = datasets::visible(&state, &user, body.dataset)
        .await
        .map_err(|_| ApiError::bad_request(format!("unknown dataset {}", body.dataset)))?;

    let check_state = state.clone();
    let (model_id, gpu) = (body.model.clone(), body.gpu.clone());
    let (seq_len, micro_batch, grad_accum) = (body.seq_len, body.micro_batch, body.grad_accum);
    let (model, verdict) = tokio::task::spawn_blocking(move || -> ApiResult<_> {
        let verdict =
            plan::verdict_for(&check_state, &model_id, &gpu, seq_len, micro_batch, grad_accum)?;
        Ok((models::resolve(&check_state, &model_id)?, verdict))
    })
    .await??;
    if !verdict.fits {
        return Err(ApiError::unprocessable(verdict.reason));
    }

    let active: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM jobs WHERE owner_id = ? AND status IN ('queued', 'running')",
    )
    .bind(user.id)
    .fetch_one(state.pool())
    .await?;
    if active >= i64::from(limits.max_active_jobs_per_user) {
        return Err(ApiError::conflict(format!(
            "you have {active} queued or running jobs, the most allowed; wait or cancel one"
        )));
    }

    let config = JobConfig {
        steps: body.steps,
        seq_len: body.seq_len,
        micro_batch: body.micro_batch,
        grad_accum: body.grad_accum,
        lr: body.lr.unwrap_or(if model.is_preset() { 1e-3 } else { 2e-5 }),
        schedule: body.schedule,
        warmup: body.warmup,
        weight_decay: body.weight_decay,
        max_grad_norm: body.max_grad_norm,
        save_every: body.save_every,
        seed: body.seed,
        train_on_prompt: body.train_on_prompt,
    };
    let config = serde_json::to_string(&config).map_err(ApiError::internal)?;
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO jobs (owner_id, model, dataset_id, device, config, status, queue_seq, total_steps, created_at)
         VALUES (?, ?, ?, ?, ?, 'queued', (SELECT COALESCE(MAX(queue_seq), 0) + 1 FROM jobs), ?, ?)
         RETURNING id",
    )
    .bind(user.id)
    .bind(&model.id)
    .bind(dataset.id)
    .bind(&body.gpu)
    .bind(&config)
    .bind(body.steps.unwrap_or(0) as i64)
    .bind(now())
    .fetch_one(state.pool())
    .await?;
    store::log(&state, id, &format!("queued by {} on {}", user.username, body.gpu)).await;
    state.queue().wake(&body.gpu);
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

#[derive(sqlx::FromRow)]
struct CheckpointRow {
    name: String,
    step: i64,
}

/// `POST /api/jobs/{id}/resume`: queues a cancelled or interrupted job again, to continue from
/// its latest checkpoint (or from the start when it has none); 409 for other states.
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
    let run_dir = runner::run_dir(&state, id);
    let checkpoints: Vec<CheckpointRow> =
        sqlx::query_as("SELECT name, step FROM checkpoints WHERE job_id = ? ORDER BY step DESC")
            .bind(id)
            .fetch_all(state.pool())
            .await?;
    let latest = checkpoints.into_iter().find(|c| run_dir.join(&c.name).is_dir());
    let (from, step) = match &latest {
        Some(c) => (Some(c.name.clone()), c.step),
        None => (None, 0),
    };
    let mut tx = state.pool().begin().await?;
    sqlx::query("DELETE FROM metrics WHERE job_id = ? AND step > ?")
        .bind(id)
        .bind(step)
        .execute(&mut *tx)
        .await?;
    let queued = sqlx::query(
        "UPDATE jobs SET status = 'queued', queue_seq = (SELECT COALESCE(MAX(queue_seq), 0) + 1 FROM jobs),
             error = NULL, finished_at = NULL, resume_from = ?, step = ?, start_step = ?
         WHERE id = ? AND status IN ('cancelled', 'interrupted')",
    )
    .bind(&from)
    .bind(step)
    .bind(step)
    .bind(id)
    .execute(&mut *tx)
    .await?;
    if queued.rows_affected() != 1 {
        return Err(ApiError::conflict("the job changed state; reload and try again"));
    }
    tx.commit().await?;
    state.queue().clear_cancel(id);
    let line = match &from {
        Some(name) => format!(
            "resumed by {} from {name} (step {step}); optimizer state restarts",
            user.username
        ),
        None => format!("resumed by {} from the start (no checkpoint)", user.username),
    };
    store::log(&state, id, &line).await;
    store::publish_status(&state, id).await?;
    state.queue().wake(&job.device);
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
