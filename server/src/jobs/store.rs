//! Job rows: the queries the handlers and the runners share, and the JSON a job is shown as.

use std::path::Path;

use serde_json::{Value, json};
use sluice_engine::data::DatasetSource;
use sluice_engine::train::{Devices, Job, JobSettings, ModelSource};
use sqlx::FromRow;

use crate::AppState;
use crate::auth::User;
use crate::db::{now, now_f64};
use crate::error::{ApiError, ApiResult};

#[derive(Debug, Clone, FromRow)]
pub struct JobRow {
    pub id: i64,
    pub owner_id: i64,
    pub model: String,
    pub dataset_id: Option<i64>,
    pub device: String,
    pub config: String,
    pub status: String,
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
}

pub const COLUMNS: &str = "id, owner_id, model, dataset_id, device, config, status, queue_seq, \
    error, total_steps, step, start_step, started_at, finished_at, resume_from, created_at, \
    eval_dataset_id, placement";

impl JobRow {
    /// The engine's settings the job was accepted with.
    pub fn settings(&self) -> ApiResult<JobSettings> {
        serde_json::from_str(&self.config)
            .map_err(|e| ApiError::internal(anyhow::anyhow!("job {} config: {e}", self.id)))
    }

    pub fn is_resumable(&self) -> bool {
        matches!(self.status.as_str(), "cancelled" | "interrupted")
    }

    /// Seconds left, from the pace of the steps since the latest start.
    pub fn eta_s(&self) -> Option<f64> {
        if self.status != "running" || self.total_steps <= 0 {
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
    let position: Option<i64> = if job.status == "queued" {
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
    Ok(json!({
        "id": job.id,
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
    }))
}

/// The engine's job a row describes, its files named by their paths in this data directory.
/// `Err` says, for the user, why the job can no longer run (a deleted dataset or model).
pub async fn job_of(state: &AppState, row: &JobRow) -> Result<Job, String> {
    let settings = row.settings().map_err(|e| format!("{e:?}"))?;
    let devices: Devices = row.device.parse().map_err(|e: sluice_engine::Error| e.to_string())?;
    let model = if let Some(name) = row.model.strip_prefix("preset:") {
        ModelSource::Preset(name.to_string())
    } else if let Some(folder) = row.model.strip_prefix("local:")
        && crate::paths::is_plain_name(folder)
    {
        ModelSource::Dir(state.models_dir().join(folder))
    } else {
        return Err(format!("unknown model {:?}", row.model));
    };
    let file = |id: Option<i64>| async move {
        let Some(id) = id else { return Ok(None) };
        let name: Option<String> =
            sqlx::query_scalar("SELECT file_name FROM datasets WHERE id = ?")
                .bind(id)
                .fetch_optional(state.pool())
                .await
                .map_err(|e| format!("database: {e}"))?;
        Ok::<_, String>(name.map(|n| DatasetSource::File(state.datasets_dir().join(n))))
    };
    let data = file(row.dataset_id).await?.ok_or("the dataset was deleted")?;
    let eval_data = match row.eval_dataset_id {
        Some(_) => {
            Some(file(row.eval_dataset_id).await?.ok_or("the evaluation dataset was deleted")?)
        }
        None => None,
    };
    Ok(Job { model, data, eval_data, devices, settings })
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
    status: &str,
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
