//! The `jobs` table and its children (`metrics`, `checkpoints`, `job_logs`): every query on
//! them is here, for the API handlers and the runner alike, and the JSON a job is shown as.

use std::path::Path;

use serde::Serialize;
use serde_json::{Value, json};
use sluice_engine::train::{Devices, Job, JobSettings};
use sqlx::FromRow;

use crate::AppState;
use crate::auth::User;
use crate::db::{now, now_f64};
use crate::error::{ApiError, ApiResult};

/// Where a job is in its life. Stored as its lower-case name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, sqlx::Type)]
#[serde(rename_all = "lowercase")]
#[sqlx(rename_all = "lowercase")]
pub enum JobStatus {
    /// Waiting for its devices.
    Queued,
    Running,
    Completed,
    Failed,
    /// Stopped by its owner; resumable.
    Cancelled,
    /// Running when the server stopped; resumable.
    Interrupted,
}

impl JobStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            JobStatus::Queued => "queued",
            JobStatus::Running => "running",
            JobStatus::Completed => "completed",
            JobStatus::Failed => "failed",
            JobStatus::Cancelled => "cancelled",
            JobStatus::Interrupted => "interrupted",
        }
    }
}

impl std::fmt::Display for JobStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, FromRow)]
pub struct JobRow {
    pub id: i64,
    pub owner_id: i64,
    pub model: String,
    pub dataset_id: Option<i64>,
    pub device: String,
    pub config: String,
    pub status: JobStatus,
    pub queue_seq: i64,
    pub error: Option<String>,
    pub total_steps: i64,
    pub step: i64,
    pub start_step: i64,
    pub started_at: Option<f64>,
    pub finished_at: Option<i64>,
    pub resume_from: Option<String>,
    pub created_at: i64,
    pub eval_dataset_id: Option<i64>,
    /// The placement the latest start ran with, one line.
    pub placement: Option<String>,
    /// What its owner calls it ("" when unnamed).
    pub name: String,
    /// Its owner's note ("" when none).
    pub note: String,
}

pub const COLUMNS: &str = "id, owner_id, model, dataset_id, device, config, status, queue_seq, \
    error, total_steps, step, start_step, started_at, finished_at, resume_from, created_at, \
    eval_dataset_id, placement, name, note";

impl JobRow {
    /// The engine's settings the job was accepted with.
    pub fn settings(&self) -> ApiResult<JobSettings> {
        serde_json::from_str(&self.config)
            .map_err(|e| ApiError::internal(anyhow::anyhow!("job {} config: {e}", self.id)))
    }

    pub fn is_resumable(&self) -> bool {
        matches!(self.status, JobStatus::Cancelled | JobStatus::Interrupted)
    }

    /// Seconds left, from the pace of the steps since the latest start.
    pub fn eta_s(&self) -> Option<f64> {
        if self.status != JobStatus::Running || self.total_steps <= 0 {
            return None;
        }
        let done = self.step - self.start_step;
        let started = self.started_at?;
        if done <= 0 {
            return None;
        }
        let per_step = (now_f64() - started).max(0.0) / done as f64;
        Some(per_step * (self.total_steps - self.step).max(0) as f64)
    }

    /// What SSE `status` events carry.
    pub fn status_json(&self) -> Value {
        json!({
            "id": self.id,
            "status": self.status,
            "step": self.step,
            "total_steps": self.total_steps,
            "error": self.error,
        })
    }
}

pub async fn get(state: &AppState, id: i64) -> ApiResult<Option<JobRow>> {
    Ok(sqlx::query_as(&format!("SELECT {COLUMNS} FROM jobs WHERE id = ?"))
        .bind(id)
        .fetch_optional(state.pool())
        .await?)
}

/// The job if `user` owns it or is an admin; 404 otherwise, so ids do not leak.
pub async fn visible(state: &AppState, user: &User, id: i64) -> ApiResult<JobRow> {
    match get(state, id).await? {
        Some(job) if user.is_admin() || job.owner_id == user.id => Ok(job),
        _ => Err(ApiError::not_found(format!("no job {id}"))),
    }
}

/// The token of job `id`'s demo link, while its owner keeps it on.
pub async fn demo_token(state: &AppState, id: i64) -> ApiResult<Option<String>> {
    Ok(sqlx::query_scalar("SELECT token FROM demo_links WHERE job_id = ?")
        .bind(id)
        .fetch_optional(state.pool())
        .await?)
}

/// Turns job `id`'s demo link on and returns its token: the one it has, or `fresh`.
pub async fn share_demo(state: &AppState, id: i64, fresh: &str) -> ApiResult<String> {
    sqlx::query(
        "INSERT INTO demo_links (job_id, token, created_at) VALUES (?, ?, ?)
         ON CONFLICT (job_id) DO NOTHING",
    )
    .bind(id)
    .bind(fresh)
    .bind(now())
    .execute(state.pool())
    .await?;
    demo_token(state, id).await?.ok_or_else(|| ApiError::not_found(format!("no job {id}")))
}

/// Turns job `id`'s demo link off; whether it was on.
pub async fn unshare_demo(state: &AppState, id: i64) -> ApiResult<bool> {
    let done = sqlx::query("DELETE FROM demo_links WHERE job_id = ?")
        .bind(id)
        .execute(state.pool())
        .await?;
    Ok(done.rows_affected() > 0)
}

/// The job whose demo link carries `token`, if that link is on.
pub async fn by_demo_token(state: &AppState, token: &str) -> ApiResult<Option<JobRow>> {
    Ok(sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM jobs WHERE id = (SELECT job_id FROM demo_links WHERE token = ?)"
    ))
    .bind(token)
    .fetch_optional(state.pool())
    .await?)
}

/// Job `id`'s latest metric point (JSON text, with its timeline), if it has one.
pub async fn latest_point(state: &AppState, id: i64) -> ApiResult<Option<String>> {
    Ok(sqlx::query_scalar("SELECT point FROM metrics WHERE job_id = ? ORDER BY step DESC LIMIT 1")
        .bind(id)
        .fetch_optional(state.pool())
        .await?)
}

/// The name of dataset `id`; `None` for no id or a deleted dataset.
async fn name_of_dataset(state: &AppState, id: Option<i64>) -> ApiResult<Option<String>> {
    let Some(id) = id else { return Ok(None) };
    Ok(sqlx::query_scalar("SELECT name FROM datasets WHERE id = ?")
        .bind(id)
        .fetch_optional(state.pool())
        .await?)
}

/// The job as the API shows it.
pub async fn view(state: &AppState, job: &JobRow) -> ApiResult<Value> {
    let owner: Option<String> = sqlx::query_scalar("SELECT username FROM users WHERE id = ?")
        .bind(job.owner_id)
        .fetch_optional(state.pool())
        .await?;
    let dataset_name = name_of_dataset(state, job.dataset_id).await?;
    let position: Option<i64> = if job.status == JobStatus::Queued {
        Some(
            sqlx::query_scalar(
                "SELECT COUNT(*) FROM jobs WHERE device = ? AND status = 'queued' AND queue_seq <= ?",
            )
            .bind(&job.device)
            .bind(job.queue_seq)
            .fetch_one(state.pool())
            .await?,
        )
    } else {
        None
    };
    let eval_dataset_name = name_of_dataset(state, job.eval_dataset_id).await?;
    // Every setting, defaults filled in; through text so f32 values read as written (0.001,
    // not 0.0010000000474974513).
    let config: Value = job
        .settings()
        .ok()
        .and_then(|s| serde_json::to_string(&s).ok())
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or(Value::Null);
    let run_dir = super::runner::run_dir(state, job.id);
    let disk_bytes = tokio::task::spawn_blocking(move || dir_bytes(&run_dir))
        .await
        .map_err(ApiError::internal)?;
    let progress = (job.total_steps > 0).then(|| job.step as f64 / job.total_steps as f64);
    let duration_s = job_duration_s(job);
    let summary = metric_summary(state, job.id).await?;
    let demo = demo_token(state, job.id).await?.map(|token| format!("/demo/{token}"));
    Ok(json!({
        "demo": demo,
        "id": job.id,
        "name": job.name,
        "note": job.note,
        "owner": owner,
        "model": job.model,
        "dataset": job.dataset_id,
        "dataset_name": dataset_name,
        "gpu": job.device,
        "status": job.status,
        "position": position,
        "error": job.error,
        "step": job.step,
        "total_steps": job.total_steps,
        "progress": progress,
        "eta_s": job.eta_s(),
        "resumable": job.is_resumable(),
        "eval_dataset": job.eval_dataset_id,
        "eval_dataset_name": eval_dataset_name,
        "config": config,
        "placement": job.placement,
        "command": job_of(state, job).await.ok().map(|j| crate::cli::train::command_line(&j)),
        "disk_bytes": disk_bytes,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "duration_s": duration_s,
        "summary": {
            "final_loss": summary.final_loss,
            "best_loss": summary.best_loss,
            "best_loss_step": summary.best_loss_step,
            "final_eval_loss": summary.final_eval_loss,
            "best_eval_loss": summary.best_eval_loss,
            "best_eval_step": summary.best_eval_step,
            "tokens_seen": summary.tokens_seen,
            "trained_tokens": summary.trained_tokens,
            "tokens_per_s": summary.tokens_per_s,
        },
    }))
}

/// Seconds from the latest start to the finish (or to now while running).
fn job_duration_s(job: &JobRow) -> Option<f64> {
    let started = job.started_at?;
    let end = match (job.status, job.finished_at) {
        (JobStatus::Running, _) => now_f64(),
        (_, Some(finished)) => finished as f64,
        (_, None) => return None,
    };
    Some((end - started).max(0.0))
}

/// The engine's job a row describes, its files named by their paths in this data directory.
/// `Err` says, for the user, why the job can no longer run (a deleted dataset or model).
pub async fn job_of(state: &AppState, row: &JobRow) -> Result<Job, String> {
    let settings = row.settings().map_err(|e| format!("{e:?}"))?;
    let devices: Devices = row.device.parse().map_err(|e: sluice_engine::Error| e.to_string())?;
    let (model_state, id) = (state.clone(), row.model.clone());
    let model = tokio::task::spawn_blocking(move || crate::models::source(&model_state, &id))
        .await
        .map_err(|e| format!("model lookup: {e}"))?
        .map_err(|why| format!("unknown model {:?}: {why}", row.model))?;
    let file = |id: Option<i64>| async move {
        let Some(id) = id else { return Ok(None) };
        // Read as the dataset was linted at upload: the same records skipped, the same columns.
        let dataset: Option<crate::datasets::Dataset> =
            sqlx::query_as(&format!("{} WHERE d.id = ?", crate::datasets::SELECT))
                .bind(id)
                .fetch_optional(state.pool())
                .await
                .map_err(|e| format!("database: {e}"))?;
        Ok::<_, String>(dataset.map(|d| d.source(state)))
    };
    let data = file(row.dataset_id).await?.ok_or("the dataset was deleted")?;
    let eval_data = match row.eval_dataset_id {
        Some(_) => {
            Some(file(row.eval_dataset_id).await?.ok_or("the evaluation dataset was deleted")?)
        }
        None => None,
    };
    let job = Job { model, data, eval_data, devices, settings };
    // Checked again as read back: a row is the job's own record, but what the engine runs must
    // hold the engine's rules whatever wrote it.
    job.validate(&sluice_engine::train::Limits::ENGINE).map_err(|e| e.to_string())?;
    Ok(job)
}

/// Bytes of the files under `dir` (0 when it does not exist): what a run takes on disk.
pub fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .map(|entry| match entry.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&entry.path()),
            Ok(t) if t.is_file() => entry.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// Appends a line to the job's log and sends it to live viewers.
pub async fn log(state: &AppState, job_id: i64, line: &str) {
    let stored = sqlx::query("INSERT INTO job_logs (job_id, t, line) VALUES (?, ?, ?)")
        .bind(job_id)
        .bind(now_f64())
        .bind(line)
        .execute(state.pool())
        .await;
    if let Err(err) = stored {
        tracing::error!("job {job_id}: cannot store a log line: {err}");
    }
    state.publish(job_id, "log", line.to_string());
}

/// Sets a final status and tells live viewers.
pub async fn finish(
    state: &AppState,
    job_id: i64,
    status: JobStatus,
    error: Option<&str>,
) -> ApiResult<()> {
    sqlx::query("UPDATE jobs SET status = ?, error = ?, finished_at = ? WHERE id = ?")
        .bind(status)
        .bind(error)
        .bind(now())
        .bind(job_id)
        .execute(state.pool())
        .await?;
    publish_status(state, job_id).await
}

/// Sends the job's current status to live viewers.
pub async fn publish_status(state: &AppState, job_id: i64) -> ApiResult<()> {
    if let Some(job) = get(state, job_id).await? {
        state.publish(job_id, "status", job.status_json().to_string());
    }
    Ok(())
}

/// Every job `user` may see (all of them for an admin), newest first.
pub async fn list_for(state: &AppState, user: &User) -> ApiResult<Vec<JobRow>> {
    Ok(if user.is_admin() {
        sqlx::query_as(&format!("SELECT {COLUMNS} FROM jobs ORDER BY id DESC"))
            .fetch_all(state.pool())
            .await?
    } else {
        sqlx::query_as(&format!("SELECT {COLUMNS} FROM jobs WHERE owner_id = ? ORDER BY id DESC"))
            .bind(user.id)
            .fetch_all(state.pool())
            .await?
    })
}

/// A job to queue, as the API accepted it.
pub struct NewJob<'a> {
    pub owner_id: i64,
    pub name: &'a str,
    pub note: &'a str,
    pub model: &'a str,
    pub dataset_id: i64,
    pub eval_dataset_id: Option<i64>,
    pub device: &'a str,
    /// The engine's settings as JSON.
    pub config: &'a str,
    pub total_steps: i64,
}

/// Why [`insert_queued`] did not queue a job.
pub enum NotQueued {
    /// The owner has `active` queued or running jobs, the most allowed.
    AtLimit { active: i64 },
    /// A dataset was deleted meanwhile.
    DatasetGone,
}

/// Queues `job` at the end of the queue, in one statement, so the owner's limit of `limit`
/// active jobs and the datasets' existence hold whatever runs beside it (concurrent submits, a
/// dataset deleted meanwhile).
pub async fn insert_queued(
    state: &AppState,
    job: &NewJob<'_>,
    limit: i64,
) -> ApiResult<Result<i64, NotQueued>> {
    let id: Option<i64> = sqlx::query_scalar(
        "INSERT INTO jobs (id, owner_id, name, note, model, dataset_id, eval_dataset_id, device,
                           config, status, queue_seq, total_steps, created_at)
         SELECT MAX(COALESCE((SELECT MAX(id) FROM jobs), 0),
                    COALESCE((SELECT CAST(value AS INTEGER) FROM meta
                              WHERE key = 'job_id_high_water'), 0)) + 1,
                ?, ?, ?, ?, ?, ?, ?, ?, 'queued', (SELECT COALESCE(MAX(queue_seq), 0) + 1 FROM jobs),
                ?, ?
         WHERE (SELECT COUNT(*) FROM jobs WHERE owner_id = ? AND status IN ('queued', 'running')) < ?
           AND EXISTS (SELECT 1 FROM datasets WHERE id = ?)
           AND (? IS NULL OR EXISTS (SELECT 1 FROM datasets WHERE id = ?))
         RETURNING id",
    )
    .bind(job.owner_id)
    .bind(job.name)
    .bind(job.note)
    .bind(job.model)
    .bind(job.dataset_id)
    .bind(job.eval_dataset_id)
    .bind(job.device)
    .bind(job.config)
    .bind(job.total_steps)
    .bind(now())
    .bind(job.owner_id)
    .bind(limit)
    .bind(job.dataset_id)
    .bind(job.eval_dataset_id)
    .bind(job.eval_dataset_id)
    .fetch_optional(state.pool())
    .await?;
    if let Some(id) = id {
        return Ok(Ok(id));
    }
    let active = active_of_owner(state, job.owner_id).await?;
    Ok(Err(if active >= limit { NotQueued::AtLimit { active } } else { NotQueued::DatasetGone }))
}

/// Queued or running jobs of `owner_id`.
pub async fn active_of_owner(state: &AppState, owner_id: i64) -> ApiResult<i64> {
    Ok(sqlx::query_scalar(
        "SELECT COUNT(*) FROM jobs WHERE owner_id = ? AND status IN ('queued', 'running')",
    )
    .bind(owner_id)
    .fetch_one(state.pool())
    .await?)
}

/// Queued or running jobs that train on, or evaluate with, dataset `dataset_id`.
pub async fn active_using_dataset(state: &AppState, dataset_id: i64) -> ApiResult<i64> {
    Ok(sqlx::query_scalar(
        "SELECT COUNT(*) FROM jobs WHERE (dataset_id = ? OR eval_dataset_id = ?)
             AND status IN ('queued', 'running')",
    )
    .bind(dataset_id)
    .bind(dataset_id)
    .fetch_one(state.pool())
    .await?)
}

/// Jobs by status: (queued, running).
pub async fn queue_counts(state: &AppState) -> ApiResult<(i64, i64)> {
    let (queued, running): (i64, i64) = sqlx::query_as(
        "SELECT COALESCE(SUM(status = 'queued'), 0), COALESCE(SUM(status = 'running'), 0)
         FROM jobs",
    )
    .fetch_one(state.pool())
    .await?;
    Ok((queued, running))
}

/// Each running job's id and its latest tokens per second, if it reported one.
pub async fn running_rates(state: &AppState) -> ApiResult<Vec<(i64, Option<f64>)>> {
    Ok(sqlx::query_as(
        "SELECT j.id, (SELECT json_extract(m.point, '$.tokens_per_s') FROM metrics m
                       WHERE m.job_id = j.id ORDER BY m.step DESC LIMIT 1) AS tokens_per_s
         FROM jobs j WHERE j.status = 'running' ORDER BY j.id",
    )
    .fetch_all(state.pool())
    .await?)
}

/// Running jobs with their devices ("cuda:0,1").
pub async fn running_devices(state: &AppState) -> ApiResult<Vec<(i64, String)>> {
    Ok(sqlx::query_as("SELECT id, device FROM jobs WHERE status = 'running'")
        .fetch_all(state.pool())
        .await?)
}

/// Queued jobs with their devices, in queue order.
pub async fn queued_devices(state: &AppState) -> ApiResult<Vec<(i64, String)>> {
    Ok(sqlx::query_as("SELECT id, device FROM jobs WHERE status = 'queued' ORDER BY queue_seq")
        .fetch_all(state.pool())
        .await?)
}

/// Marks queued job `id` running (from the step it is at); `None` when it is no longer queued.
pub async fn claim(state: &AppState, id: i64) -> ApiResult<Option<JobRow>> {
    Ok(sqlx::query_as(&format!(
        "UPDATE jobs SET status = 'running', started_at = ?, start_step = step, error = NULL,
             finished_at = NULL
         WHERE id = ? AND status = 'queued'
         RETURNING {COLUMNS}"
    ))
    .bind(now_f64())
    .bind(id)
    .fetch_optional(state.pool())
    .await?)
}

/// Cancels job `id` if it is still queued; says whether it was.
pub async fn cancel_queued(state: &AppState, id: i64) -> ApiResult<bool> {
    let dequeued = sqlx::query(
        "UPDATE jobs SET status = 'cancelled', finished_at = ? WHERE id = ? AND status = 'queued'",
    )
    .bind(now())
    .bind(id)
    .execute(state.pool())
    .await?;
    Ok(dequeued.rows_affected() == 1)
}

/// Queues cancelled or interrupted job `id` again from `step`, dropping the metrics of later
/// steps (they are taken again, identically), if its owner is under `limit` active jobs and its
/// datasets still exist (checked in the same statement, so a dataset deleted meanwhile can
/// never leave a queued job without one). Says whether it was queued.
pub async fn requeue(
    state: &AppState,
    id: i64,
    owner_id: i64,
    step: i64,
    limit: i64,
) -> ApiResult<bool> {
    let mut tx = state.pool().begin().await?;
    sqlx::query("DELETE FROM metrics WHERE job_id = ? AND step > ?")
        .bind(id)
        .bind(step)
        .execute(&mut *tx)
        .await?;
    let queued = sqlx::query(
        "UPDATE jobs SET status = 'queued', queue_seq = (SELECT COALESCE(MAX(queue_seq), 0) + 1 FROM jobs),
             error = NULL, finished_at = NULL, step = ?, start_step = ?
         WHERE id = ? AND status IN ('cancelled', 'interrupted')
           AND EXISTS (SELECT 1 FROM datasets d WHERE d.id = jobs.dataset_id)
           AND (jobs.eval_dataset_id IS NULL
                OR EXISTS (SELECT 1 FROM datasets d WHERE d.id = jobs.eval_dataset_id))
           AND (SELECT COUNT(*) FROM jobs WHERE owner_id = ? AND status IN ('queued', 'running')) < ?",
    )
    .bind(step)
    .bind(step)
    .bind(id)
    .bind(owner_id)
    .bind(limit)
    .execute(&mut *tx)
    .await?;
    if queued.rows_affected() != 1 {
        return Ok(false);
    }
    tx.commit().await?;
    Ok(true)
}

/// Jobs that were running when the server stopped cannot be running now: marks them
/// interrupted and returns how many there were.
pub async fn mark_interrupted(pool: &sqlx::SqlitePool) -> sqlx::Result<u64> {
    let marked = sqlx::query(
        "UPDATE jobs SET status = 'interrupted', finished_at = CAST(strftime('%s', 'now') AS INTEGER),
             error = 'the server stopped while the job was running; resume it to continue'
         WHERE status = 'running'",
    )
    .execute(pool)
    .await?;
    Ok(marked.rows_affected())
}

pub async fn set_placement(state: &AppState, id: i64, placement: &str) -> ApiResult<()> {
    sqlx::query("UPDATE jobs SET placement = ? WHERE id = ?")
        .bind(placement)
        .bind(id)
        .execute(state.pool())
        .await?;
    Ok(())
}

pub async fn set_total_steps(state: &AppState, id: i64, total_steps: i64) -> ApiResult<()> {
    sqlx::query("UPDATE jobs SET total_steps = ? WHERE id = ?")
        .bind(total_steps)
        .bind(id)
        .execute(state.pool())
        .await?;
    Ok(())
}

/// Stores step `step`'s metrics point (JSON) and moves the job's step there.
pub async fn record_step(state: &AppState, id: i64, step: i64, point: &str) -> ApiResult<()> {
    let mut tx = state.pool().begin().await?;
    sqlx::query("INSERT OR REPLACE INTO metrics (job_id, step, point) VALUES (?, ?, ?)")
        .bind(id)
        .bind(step)
        .bind(point)
        .execute(&mut *tx)
        .await?;
    sqlx::query("UPDATE jobs SET step = ? WHERE id = ?")
        .bind(step)
        .bind(id)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

/// Every stored metrics point of job `id` (JSON text) without its per-unit timeline, which is
/// most of a point's bytes (see [`timeline_at`]), in step order.
pub async fn metric_points(state: &AppState, id: i64) -> ApiResult<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT json_remove(point, '$.timeline') FROM metrics WHERE job_id = ? ORDER BY step",
    )
    .bind(id)
    .fetch_all(state.pool())
    .await?)
}

/// The per-unit timeline of job `id`'s step `step` (JSON text): `Ok(None)` when the step has no
/// point; `Some("null")` when it has no timeline.
pub async fn timeline_at(state: &AppState, id: i64, step: i64) -> ApiResult<Option<String>> {
    let found: Option<Option<String>> = sqlx::query_scalar(
        "SELECT json_extract(point, '$.timeline') FROM metrics WHERE job_id = ? AND step = ?",
    )
    .bind(id)
    .bind(step)
    .fetch_optional(state.pool())
    .await?;
    Ok(found.map(|t| t.unwrap_or_else(|| "null".to_string())))
}

/// The latest step of job `id` whose point has a timeline.
pub async fn latest_timeline_step(state: &AppState, id: i64) -> ApiResult<Option<i64>> {
    Ok(sqlx::query_scalar(
        "SELECT MAX(step) FROM metrics WHERE job_id = ?
           AND json_type(point, '$.timeline') IS NOT NULL
           AND json_type(point, '$.timeline') != 'null'",
    )
    .bind(id)
    .fetch_one(state.pool())
    .await?)
}

/// What a job's summary needs from its metrics: the latest and best losses (with their steps),
/// the tokens of every step, and the tokens per second over the time spent in steps.
#[derive(Debug, Default, FromRow)]
pub struct MetricSummary {
    pub best_loss: Option<f64>,
    pub best_loss_step: Option<i64>,
    pub final_loss: Option<f64>,
    pub final_eval_loss: Option<f64>,
    pub best_eval_loss: Option<f64>,
    pub best_eval_step: Option<i64>,
    pub tokens_seen: Option<i64>,
    pub trained_tokens: Option<i64>,
    pub tokens_per_s: Option<f64>,
}

pub async fn metric_summary(state: &AppState, id: i64) -> ApiResult<MetricSummary> {
    Ok(sqlx::query_as(
        "WITH p AS (SELECT step,
                           json_extract(point, '$.loss') AS loss,
                           json_extract(point, '$.eval_loss') AS eval_loss,
                           json_extract(point, '$.tokens') AS tokens,
                           json_extract(point, '$.trained_tokens') AS trained,
                           json_extract(point, '$.step_s') AS step_s
                    FROM metrics WHERE job_id = ?)
         SELECT (SELECT MIN(loss) FROM p) AS best_loss,
                (SELECT step FROM p WHERE loss IS NOT NULL ORDER BY loss, step LIMIT 1)
                    AS best_loss_step,
                (SELECT loss FROM p ORDER BY step DESC LIMIT 1) AS final_loss,
                (SELECT eval_loss FROM p WHERE eval_loss IS NOT NULL ORDER BY step DESC LIMIT 1)
                    AS final_eval_loss,
                (SELECT MIN(eval_loss) FROM p) AS best_eval_loss,
                (SELECT step FROM p WHERE eval_loss IS NOT NULL ORDER BY eval_loss, step LIMIT 1)
                    AS best_eval_step,
                (SELECT SUM(tokens) FROM p) AS tokens_seen,
                (SELECT SUM(trained) FROM p) AS trained_tokens,
                (SELECT CASE WHEN SUM(step_s) > 0 THEN SUM(tokens) / SUM(step_s) END FROM p)
                    AS tokens_per_s",
    )
    .bind(id)
    .fetch_one(state.pool())
    .await?)
}

/// Sets job `id`'s name and note.
pub async fn set_label(state: &AppState, id: i64, name: &str, note: &str) -> ApiResult<()> {
    sqlx::query("UPDATE jobs SET name = ?, note = ? WHERE id = ?")
        .bind(name)
        .bind(note)
        .bind(id)
        .execute(state.pool())
        .await?;
    Ok(())
}

/// Deletes job `id` (its metrics, log and checkpoint rows go with it) unless it is queued or
/// running, in one statement, so no resume or claim slips in between. Says whether it was.
pub async fn delete_job_if_idle(state: &AppState, id: i64) -> ApiResult<bool> {
    let deleted =
        sqlx::query("DELETE FROM jobs WHERE id = ? AND status NOT IN ('queued', 'running')")
            .bind(id)
            .execute(state.pool())
            .await?;
    Ok(deleted.rows_affected() == 1)
}

/// Forgets checkpoint `name` of job `id`.
pub async fn forget_checkpoint(state: &AppState, id: i64, name: &str) -> ApiResult<()> {
    sqlx::query("DELETE FROM checkpoints WHERE job_id = ? AND name = ?")
        .bind(id)
        .bind(name)
        .execute(state.pool())
        .await?;
    Ok(())
}

/// Every log line of job `id`, oldest first.
pub async fn log_lines(state: &AppState, id: i64) -> ApiResult<Vec<String>> {
    Ok(sqlx::query_scalar("SELECT line FROM job_logs WHERE job_id = ? ORDER BY id")
        .bind(id)
        .fetch_all(state.pool())
        .await?)
}

/// Records checkpoint `name` of job `id`, saved at `step`.
pub async fn record_checkpoint(state: &AppState, id: i64, name: &str, step: i64) -> ApiResult<()> {
    sqlx::query("INSERT OR REPLACE INTO checkpoints (job_id, name, step) VALUES (?, ?, ?)")
        .bind(id)
        .bind(name)
        .bind(step)
        .execute(state.pool())
        .await?;
    Ok(())
}

/// Job `id`'s checkpoints as (name, step), in step order.
pub async fn checkpoints(state: &AppState, id: i64) -> ApiResult<Vec<(String, i64)>> {
    Ok(sqlx::query_as("SELECT name, step FROM checkpoints WHERE job_id = ? ORDER BY step, name")
        .bind(id)
        .fetch_all(state.pool())
        .await?)
}

/// Whether job `id` recorded a checkpoint called `name`.
pub async fn has_checkpoint(state: &AppState, id: i64, name: &str) -> ApiResult<bool> {
    let known: Option<String> =
        sqlx::query_scalar("SELECT name FROM checkpoints WHERE job_id = ? AND name = ?")
            .bind(id)
            .bind(name)
            .fetch_optional(state.pool())
            .await?;
    Ok(known.is_some())
}

/// Deletes dataset `dataset_id` unless a queued or running job trains on it or evaluates with
/// it, in one statement, so no submit or resume can slip in between the check and the delete.
/// Says whether it was deleted.
pub async fn delete_dataset_if_unused(state: &AppState, dataset_id: i64) -> ApiResult<bool> {
    let deleted = sqlx::query(
        "DELETE FROM datasets WHERE id = ?
           AND NOT EXISTS (SELECT 1 FROM jobs WHERE (dataset_id = ? OR eval_dataset_id = ?)
                                              AND status IN ('queued', 'running'))",
    )
    .bind(dataset_id)
    .bind(dataset_id)
    .bind(dataset_id)
    .execute(state.pool())
    .await?;
    Ok(deleted.rows_affected() == 1)
}

/// Deletes user `user_id` (their sessions, datasets and jobs go with them) unless they have a
/// queued or running job, in one statement. Says whether they were deleted.
pub async fn delete_user_if_idle(state: &AppState, user_id: i64) -> ApiResult<bool> {
    let deleted = sqlx::query(
        "DELETE FROM users WHERE id = ?
           AND NOT EXISTS (SELECT 1 FROM jobs WHERE owner_id = ?
                                              AND status IN ('queued', 'running'))",
    )
    .bind(user_id)
    .bind(user_id)
    .execute(state.pool())
    .await?;
    Ok(deleted.rows_affected() == 1)
}

/// The ids of `owner_id`'s jobs.
pub async fn job_ids_of_owner(state: &AppState, owner_id: i64) -> ApiResult<Vec<i64>> {
    Ok(sqlx::query_scalar("SELECT id FROM jobs WHERE owner_id = ?")
        .bind(owner_id)
        .fetch_all(state.pool())
        .await?)
}

/// Every job id (to find run folders no job owns).
pub async fn all_job_ids(state: &AppState) -> ApiResult<Vec<i64>> {
    Ok(sqlx::query_scalar("SELECT id FROM jobs").fetch_all(state.pool()).await?)
}
