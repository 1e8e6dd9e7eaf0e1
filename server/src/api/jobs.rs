//! `/api/jobs`: submit, list, show, rename, delete, cancel, resume; metrics history, the
//! per-unit timeline of one step, live events (SSE) and the log. The queue itself (dispatcher and training threads) is in `jobs::runner`.

use std::collections::HashMap;
use std::convert::Infallible;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::{Stream, StreamExt, stream};
use serde_json::{Value, json};
use tokio::sync::broadcast;
use tokio_stream::wrappers::BroadcastStream;
use tokio_stream::wrappers::errors::BroadcastStreamRecvError;

use sluice_engine::train::{JobSettings, STATE_DIR, TrainingState};

use crate::AppState;
use crate::auth::CurrentUser;
use crate::datasets::Dataset;
use crate::error::{ApiError, ApiJson, ApiPath, ApiResult};
use crate::jobs::plan;
use crate::jobs::record;
use crate::jobs::request::{self, JobRequest, Label};
use crate::jobs::runner;
use crate::paths::dir_bytes;
use crate::state::JobMessage;
use crate::store::jobs::{self as store, JobRow, JobStatus, Listed, Which};
use crate::watchers::Watch;

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/api/jobs", get(list).post(create))
        .route("/api/jobs/{id}", get(show).patch(relabel).delete(remove))
        .route("/api/jobs/{id}/cancel", post(cancel))
        .route("/api/jobs/{id}/resume", post(resume))
        .route("/api/jobs/{id}/metrics", get(metrics))
        .route("/api/jobs/{id}/timeline", get(timeline))
        .route("/api/jobs/{id}/events", get(events))
        .route("/api/jobs/{id}/log", get(log))
}

async fn list(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
) -> ApiResult<Json<Vec<Value>>> {
    let which = if user.is_admin() { Which::All } else { Which::OwnedBy(user.id) };
    Ok(Json(views(&state, which).await?))
}

/// Jobs as the API shows them, newest first: one statement reads the rows with everything the
/// list shows from the database, one more the datasets their command lines name; then, on one
/// blocking thread for the whole list, each job's disk use (a walk of its run folder, which the
/// database does not know) and its command line (the model looked up on disk).
pub(crate) async fn views(state: &AppState, which: Which) -> ApiResult<Vec<Value>> {
    let listed = store::listed(state.pool(), which).await?;
    let ids: Vec<i64> =
        listed.iter().flat_map(|l| [l.row.dataset_id, l.row.eval_dataset_id]).flatten().collect();
    let datasets = crate::datasets::by_ids(state, &ids).await?;
    let state = state.clone();
    let views = tokio::task::spawn_blocking(move || {
        listed.iter().map(|job| job_view(&state, job, &datasets)).collect()
    })
    .await?;
    Ok(views)
}

/// Job `id` as the API shows it (the caller has checked that the user may see it).
pub(crate) async fn view(state: &AppState, id: i64) -> ApiResult<Value> {
    views(state, Which::One(id))
        .await?
        .pop()
        .ok_or_else(|| ApiError::not_found(format!("no job {id}")))
}

fn job_view(state: &AppState, listed: &Listed, datasets: &HashMap<i64, Dataset>) -> Value {
    let job = &listed.row;
    // Every setting, defaults filled in; through text so f32 values read as written (0.001,
    // not 0.0010000000474974513).
    let settings = job.settings().ok();
    let config: Value = settings
        .as_ref()
        .and_then(|s| serde_json::to_string(s).ok())
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or(Value::Null);
    // The task evaluation, if any: its metric and which way is better.
    let task = settings
        .as_ref()
        .and_then(JobSettings::task)
        .map(|t| json!({ "metric": t.metric, "higher_is_better": t.metric.higher_is_better() }));
    // Checkpoints come every `save_every` steps, or about five times over a run that sets
    // none: the steps between them as the run decides (null: only at the end, or not known
    // before a one-pass job has counted its steps).
    let save_interval = settings.and_then(|s| {
        let steps = s.steps.unwrap_or(job.total_steps.max(0) as u64);
        sluice_engine::train::save_interval(s.save_every, steps).filter(|_| steps > 0)
    });
    let disk_bytes = dir_bytes(&runner::run_dir(state, job.id));
    let progress = (job.total_steps > 0).then(|| job.step as f64 / job.total_steps as f64);
    let command =
        record::engine_job(state, job, datasets).ok().map(|j| crate::job_line::command_line(&j));
    let summary = &listed.summary;
    let summary = json!({
        "final_loss": summary.final_loss,
        "best_loss": summary.best_loss,
        "best_loss_step": summary.best_loss_step,
        "final_eval_loss": summary.final_eval_loss,
        "best_eval_loss": summary.best_eval_loss,
        "best_eval_step": summary.best_eval_step,
        "task_before": summary.task_before,
        "task_score": summary.task_score,
        "task_step": summary.task_step,
        "tokens_seen": summary.tokens_seen,
        "trained_tokens": summary.trained_tokens,
        "tokens_per_s": summary.tokens_per_s,
    });
    json!({
        "demo": listed.demo_token.as_ref().map(|token| format!("/demo/{token}")),
        "id": job.id,
        "name": job.name,
        "note": job.note,
        "owner": listed.owner,
        "model": job.model,
        "dataset": job.dataset_id,
        "dataset_name": listed.dataset_name,
        "gpu": job.device,
        "status": job.status,
        "position": listed.position,
        "error": job.error,
        "step": job.step,
        "total_steps": job.total_steps,
        "progress": progress,
        "eta_s": job.eta_s(),
        "resumable": job.is_resumable() && job.resume_blocked().is_none(),
        "resume_blocked": job.resume_blocked(),
        "eval_dataset": job.eval_dataset_id,
        "eval_dataset_name": listed.eval_dataset_name,
        "config": config,
        "task": task,
        "save_interval": save_interval,
        "placement": job.placement,
        "command": command,
        "disk_bytes": disk_bytes,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "duration_s": job_duration_s(job),
        "summary": summary,
    })
}

/// Seconds from the latest start to the finish (or to now while running).
fn job_duration_s(job: &JobRow) -> Option<f64> {
    let started = job.started_at?;
    let end = match (job.status, job.finished_at) {
        (JobStatus::Running, _) => crate::db::now_f64(),
        (_, Some(finished)) => finished as f64,
        (_, None) => return None,
    };
    Some((end - started).max(0.0))
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
    super::storage::refuse_over_quota(&state, &user, 0).await?;
    let (job, spec) = (resolved.job.clone(), resolved.model.spec.clone());
    let plan_state = state.clone();
    let verdict = tokio::task::spawn_blocking(move || -> ApiResult<plan::Verdict> {
        let memory = plan::machine_memory(&plan_state, &job.devices)?;
        let memory = plan::with_disk_tier(&plan_state, &job, &spec, memory)?;
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
    let new = store::NewJob {
        owner_id: user.id,
        name: &resolved.label.name,
        note: &resolved.label.note,
        model: &resolved.model.id,
        dataset_id: dataset.id,
        eval_dataset_id: resolved.eval_dataset.as_ref().map(|d| d.id),
        device: &device,
        config: &settings,
        total_steps: job.settings.steps.unwrap_or(0) as i64,
    };
    let id = match store::insert_queued(state.pool(), &new, limit).await? {
        Ok(id) => id,
        Err(store::NotQueued::AtLimit { active }) => {
            return Err(ApiError::conflict(format!(
                "you have {active} queued or running jobs, the most allowed; wait or cancel one"
            )));
        }
        Err(store::NotQueued::DatasetGone) => {
            return Err(ApiError::conflict("the dataset was deleted meanwhile"));
        }
    };
    record::log(&state, id, &format!("queued by {} on {device}", user.username)).await;
    state.queue().wake();
    Ok((StatusCode::CREATED, Json(json!({ "id": id }))))
}

async fn show(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<Json<Value>> {
    let job = super::access::visible_job(&state, &user, id).await?;
    Ok(Json(view(&state, job.id).await?))
}

/// `POST /api/jobs/{id}/cancel`: a queued job is cancelled at once (200); a running one stops
/// after its current step and saves a checkpoint (202, the status follows over SSE); 409 for a
/// finished job.
async fn cancel(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    super::access::visible_job(&state, &user, id).await?;
    // Asked first, so a runner claiming the job right now still sees the request.
    state.queue().request_cancel(id);
    let dequeued = store::cancel_queued(state.pool(), id).await?;
    let job = store::get(state.pool(), id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no job {id}")))?;
    if dequeued {
        state.queue().clear_cancel(id);
        record::log(&state, id, &format!("cancelled by {} before it started", user.username)).await;
        record::publish_status(&state, id).await?;
        return Ok((StatusCode::OK, Json(view(&state, job.id).await?)));
    }
    if job.status == JobStatus::Running {
        record::log(&state, id, &format!("cancel requested by {}", user.username)).await;
        return Ok((StatusCode::ACCEPTED, Json(view(&state, job.id).await?)));
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
    let job = super::access::visible_job(&state, &user, id).await?;
    if !job.is_resumable() {
        return Err(ApiError::conflict(format!(
            "the job is {}; only cancelled or interrupted jobs can be resumed",
            job.status
        )));
    }
    if let Some(why) = job.resume_blocked() {
        return Err(ApiError::conflict(format!("cannot resume: {why}")));
    }
    let state_dir = runner::run_dir(&state, id).join(STATE_DIR);
    let saved = tokio::task::spawn_blocking(move || TrainingState::saved_step(&state_dir))
        .await
        .map_err(ApiError::internal)?
        .map_err(ApiError::internal)?;
    let step = saved.unwrap_or(0) as i64;
    let limit = i64::from(state.config().limits.max_active_jobs_per_user);
    // Steps after the saved state are taken again, identically.
    if !store::requeue(state.pool(), id, job.owner_id, step, limit).await? {
        return Err(ApiError::conflict(
            "the job changed state, or its owner has the most queued or running jobs allowed; \
             reload and try again",
        ));
    }
    state.queue().clear_cancel(id);
    let line = match saved {
        Some(step) => format!(
            "resumed by {} after step {step}: weights, optimizer state and data order as saved",
            user.username
        ),
        None => format!("resumed by {} from the start (nothing was saved)", user.username),
    };
    record::log(&state, id, &line).await;
    record::publish_status(&state, id).await?;
    state.queue().wake();
    let job = super::access::visible_job(&state, &user, id).await?;
    Ok(Json(view(&state, job.id).await?))
}

/// `PATCH /api/jobs/{id}`: `{"name", "note"}` (either may be left out), at any time.
async fn relabel(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
    ApiJson(body): ApiJson<Value>,
) -> ApiResult<Json<Value>> {
    let job = super::access::visible_job(&state, &user, id).await?;
    let Value::Object(mut fields) = body else {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    };
    let name = Label::name(fields.remove("name"))?.unwrap_or(job.name);
    let note = Label::note(fields.remove("note"))?.unwrap_or(job.note);
    if let Some(other) = fields.keys().next() {
        return Err(ApiError::bad_request(format!(
            "unknown field `{other}`; only `name` and `note` can be changed"
        )));
    }
    store::set_label(state.pool(), id, &name, &note).await?;
    let job = super::access::visible_job(&state, &user, id).await?;
    Ok(Json(view(&state, job.id).await?))
}

/// `DELETE /api/jobs/{id}`: the job, its history and its run folder; `{"freed_bytes"}`. 409
/// while it is queued or running (cancel it first).
async fn remove(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<Json<Value>> {
    super::access::visible_job(&state, &user, id).await?;
    if !store::delete_job_if_idle(state.pool(), id).await? {
        let status = store::get(state.pool(), id).await?.map(|j| j.status);
        return Err(ApiError::conflict(match status {
            Some(status) => format!("the job is {status}; cancel it before deleting it"),
            None => "the job was deleted meanwhile".to_string(),
        }));
    }
    let freed = super::storage::remove_dir(runner::run_dir(&state, id)).await;
    tracing::info!("job {id} deleted by {}; {freed} bytes freed", user.username);
    Ok(Json(json!({ "id": id, "freed_bytes": freed })))
}

/// `GET /api/jobs/{id}/metrics`: every stored point, in step order, without the per-unit
/// timeline (`/timeline?step=N` has it). Numbers carry five significant digits and absent
/// values are left out, so a long run's history stays small.
async fn metrics(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<Json<Vec<Value>>> {
    super::access::visible_job(&state, &user, id).await?;
    let points = store::metric_points(state.pool(), id).await?;
    let points = points
        .iter()
        .map(|p| serde_json::from_str(p).map(compact_point))
        .collect::<Result<Vec<Value>, _>>()
        .map_err(ApiError::internal)?;
    Ok(Json(points))
}

/// A point without nulls, its fractional numbers cut to what a chart shows (the time keeps
/// milliseconds).
fn compact_point(point: Value) -> Value {
    let Value::Object(fields) = point else { return point };
    let fields = fields
        .into_iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| {
            let v = match v.as_f64() {
                Some(x) if !v.is_i64() && !v.is_u64() => {
                    let rounded =
                        if k == "t" { (x * 1e3).round() / 1e3 } else { significant(x, 5) };
                    serde_json::Number::from_f64(rounded).map_or(v, Value::Number)
                }
                _ => v,
            };
            (k, v)
        })
        .collect();
    Value::Object(fields)
}

/// `x` to `digits` significant digits.
fn significant(x: f64, digits: i32) -> f64 {
    if !x.is_finite() {
        return x;
    }
    // Through decimal text, so the reply shows 0.00123, not 0.0012300000000000002.
    format!("{x:.*e}", (digits - 1) as usize).parse().unwrap_or(x)
}

#[derive(serde::Deserialize)]
struct TimelineQuery {
    step: Option<i64>,
}

/// `GET /api/jobs/{id}/timeline?step=N`: `{"step", "timeline"}`, the per-unit timeline of step
/// N (without `step`: the latest step that has one). 404 for a step with no point; the timeline
/// is `null` for a step that recorded none.
async fn timeline(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
    query: Result<axum::extract::Query<TimelineQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<Value>> {
    super::access::visible_job(&state, &user, id).await?;
    let query = query.map_err(|_| ApiError::bad_request("step must be a step number"))?;
    let step = match query.step {
        Some(step) => step,
        None => match store::latest_timeline_step(state.pool(), id).await? {
            Some(step) => step,
            None => return Ok(Json(json!({ "step": null, "timeline": null }))),
        },
    };
    let Some(text) = store::timeline_at(state.pool(), id, step).await? else {
        return Err(ApiError::not_found(format!("job {id} has no step {step}")));
    };
    let timeline: Value = serde_json::from_str(&text).map_err(ApiError::internal)?;
    Ok(Json(json!({ "step": step, "timeline": timeline })))
}

/// `GET /api/jobs/{id}/events`: SSE. A `status` event first, then `metric`, `status` and `log`
/// events as they happen. A client too slow to keep up loses points (it can reload the history);
/// training never waits for it.
async fn events(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<Sse<impl Stream<Item = Result<Event, Infallible>>>> {
    let watch = state.watchers().admit(Some(user.id))?;
    // Subscribe before reading the status, so no change falls between the two.
    let receiver = state.subscribe();
    let job = super::access::visible_job(&state, &user, id).await?;
    Ok(event_stream(receiver, &job, |_| true, watch))
}

/// A job's events as SSE: its status now, then each event whose kind `shown` lets through, as
/// it happens, until the job ends: the stream closes after the status that says so (at once
/// for a job that has ended already). A viewer that falls so far behind that news was lost is
/// closed too; its browser reconnects and starts again from the status. `receiver` must have
/// subscribed before `job` was read, so no change falls between the two; `watch` is the
/// stream's place among the open ones, given back when it closes.
pub(super) fn event_stream(
    receiver: broadcast::Receiver<JobMessage>,
    job: &JobRow,
    shown: fn(&str) -> bool,
    watch: Watch,
) -> Sse<impl Stream<Item = Result<Event, Infallible>> + use<>> {
    let id = job.id;
    let first = Event::default().event("status").data(job.status_json().to_string());
    // (the event to send, if any; whether the stream ends with it)
    let live = BroadcastStream::new(receiver).filter_map(move |message| {
        let step = match message {
            Ok(m) if m.job_id == id && shown(m.kind) => {
                let ends = m.kind == "status" && ends_the_job(&m.data);
                Some((Some(Event::default().event(m.kind).data(m.data)), ends))
            }
            Ok(_) => None,
            Err(BroadcastStreamRecvError::Lagged(_)) => Some((None, true)),
        };
        std::future::ready(step)
    });
    let ended = job.status.is_ended();
    let all = Box::pin(stream::once(std::future::ready((Some(first), ended))).chain(live));
    // Ends right after the ending item, without waiting for another: none may ever come.
    let until_the_end = stream::unfold((all, false, watch), |(mut all, done, watch)| async move {
        if done {
            return None;
        }
        let (event, ends) = all.next().await?;
        Some((event, (all, ends, watch)))
    })
    .filter_map(|event| std::future::ready(event.map(Ok)));
    Sse::new(until_the_end).keep_alive(KeepAlive::default())
}

/// Whether a status event's JSON says the job has ended.
fn ends_the_job(data: &str) -> bool {
    #[derive(serde::Deserialize)]
    struct Status {
        status: JobStatus,
    }
    serde_json::from_str::<Status>(data).is_ok_and(|s| s.status.is_ended())
}

/// `GET /api/jobs/{id}/log`: the whole log as text, one line per entry.
async fn log(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<impl IntoResponse> {
    super::access::visible_job(&state, &user, id).await?;
    let lines = store::log_lines(state.pool(), id).await?;
    let mut text = lines.join("\n");
    if !text.is_empty() {
        text.push('\n');
    }
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text))
}
