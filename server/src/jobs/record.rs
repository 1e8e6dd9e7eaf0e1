//! What the queue records of a job and tells its viewers: log lines, status changes, the final
//! status; and the engine's [`Job`] a stored row describes.

use std::collections::HashMap;

use sluice_engine::train::{Devices, Job};

use super::JobsError;
use crate::AppState;
use crate::datasets::Dataset;
use crate::db::now_f64;
use crate::store::{self, jobs::JobRow, jobs::JobStatus};

/// Appends a line to the job's log and sends it to live viewers.
pub async fn log(state: &AppState, job_id: i64, line: &str) {
    let stored = store::jobs::append_log(state.pool(), job_id, now_f64(), line).await;
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
) -> Result<(), JobsError> {
    store::jobs::finish(state.pool(), job_id, status, error).await?;
    publish_status(state, job_id).await
}

/// Sends the job's current status to live viewers.
pub async fn publish_status(state: &AppState, job_id: i64) -> Result<(), JobsError> {
    if let Some(job) = store::jobs::get(state.pool(), job_id).await? {
        state.publish(job_id, "status", job.status_json().to_string());
    }
    Ok(())
}

/// The engine's job a row describes, its files named by their paths in this data directory.
/// `Err` says, for the user, why the job can no longer run (a deleted dataset or model).
pub async fn job_of(state: &AppState, row: &JobRow) -> Result<Job, String> {
    let ids: Vec<i64> = [row.dataset_id, row.eval_dataset_id].into_iter().flatten().collect();
    let datasets =
        crate::datasets::by_ids(state, &ids).await.map_err(|e| format!("database: {e}"))?;
    let (state, row) = (state.clone(), row.clone());
    tokio::task::spawn_blocking(move || engine_job(&state, &row, &datasets))
        .await
        .map_err(|e| format!("model lookup: {e}"))?
}

/// [`job_of`] with the job's datasets at hand (`datasets` by id; a deleted one is absent).
/// Blocking: it looks the model up on disk.
pub fn engine_job(
    state: &AppState,
    row: &JobRow,
    datasets: &HashMap<i64, Dataset>,
) -> Result<Job, String> {
    let settings = row.settings().map_err(|e| format!("{e:#}"))?;
    let devices: Devices = row.device.parse().map_err(|e: sluice_engine::Error| e.to_string())?;
    let model = crate::models::source(state, &row.model)
        .map_err(|why| format!("unknown model {:?}: {why}", row.model))?;
    // Read as the dataset was linted at upload: the same records skipped, the same columns.
    let file = |id: Option<i64>| id.and_then(|id| datasets.get(&id)).map(|d| d.source(state));
    let data = file(row.dataset_id).ok_or("the dataset was deleted")?;
    let eval_data = match row.eval_dataset_id {
        Some(_) => Some(file(row.eval_dataset_id).ok_or("the evaluation dataset was deleted")?),
        None => None,
    };
    let job = Job { model, data, eval_data, devices, settings };
    // Checked again as read back: what the engine runs must hold the engine's rules whatever
    // wrote the row.
    job.validate(&sluice_engine::train::Limits::ENGINE).map_err(|e| e.to_string())?;
    Ok(job)
}
