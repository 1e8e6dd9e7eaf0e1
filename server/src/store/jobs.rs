//! The `jobs` table and its children (`metrics`, `checkpoints`, `job_logs`, `demo_links`):
//! every query on them is here, for the API, the queue and the announcements alike, with
//! [`JobStatus`], the one spelling of a job's states in SQL.

use serde::Serialize;
use serde_json::{Value, json};
use sluice_engine::train::JobSettings;
use sqlx::{FromRow, SqlitePool};

use crate::db::{now, now_f64};

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
    /// The states that hold a place in the queue or a device, as an SQL list: what the limits
    /// on jobs, and the deletes that must not pull a dataset or user from under a job, test.
    /// A test holds it to [`JobStatus::as_str`].
    pub const ACTIVE_SQL: &'static str = "('queued', 'running')";

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
    pub fn settings(&self) -> anyhow::Result<JobSettings> {
        serde_json::from_str(&self.config)
            .map_err(|e| anyhow::anyhow!("job {} config: {e}", self.id))
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

pub async fn get(pool: &SqlitePool, id: i64) -> sqlx::Result<Option<JobRow>> {
    sqlx::query_as(&format!("SELECT {COLUMNS} FROM jobs WHERE id = ?"))
        .bind(id)
        .fetch_optional(pool)
        .await
}

/// The token of job `id`'s demo link, while its owner keeps it on.
pub async fn demo_token(pool: &SqlitePool, id: i64) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar("SELECT token FROM demo_links WHERE job_id = ?")
        .bind(id)
        .fetch_optional(pool)
        .await
}

/// Turns job `id`'s demo link on and returns its token: the one it has, or `fresh`; `None`
/// when the job is gone.
pub async fn share_demo(pool: &SqlitePool, id: i64, fresh: &str) -> sqlx::Result<Option<String>> {
    sqlx::query(
        "INSERT INTO demo_links (job_id, token, created_at) VALUES (?, ?, ?)
         ON CONFLICT (job_id) DO NOTHING",
    )
    .bind(id)
    .bind(fresh)
    .bind(now())
    .execute(pool)
    .await?;
    demo_token(pool, id).await
}

/// Turns job `id`'s demo link off; whether it was on.
pub async fn unshare_demo(pool: &SqlitePool, id: i64) -> sqlx::Result<bool> {
    let done =
        sqlx::query("DELETE FROM demo_links WHERE job_id = ?").bind(id).execute(pool).await?;
    Ok(done.rows_affected() > 0)
}

/// The job whose demo link carries `token`, if that link is on.
pub async fn by_demo_token(pool: &SqlitePool, token: &str) -> sqlx::Result<Option<JobRow>> {
    sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM jobs WHERE id = (SELECT job_id FROM demo_links WHERE token = ?)"
    ))
    .bind(token)
    .fetch_optional(pool)
    .await
}

/// The loss of job `id`'s last recorded step.
pub async fn final_loss(pool: &SqlitePool, id: i64) -> sqlx::Result<Option<f64>> {
    let last: Option<Option<f64>> = sqlx::query_scalar(
        "SELECT json_extract(point, '$.loss') FROM metrics WHERE job_id = ?
         ORDER BY step DESC LIMIT 1",
    )
    .bind(id)
    .fetch_optional(pool)
    .await?;
    Ok(last.flatten())
}

/// Job `id`'s latest metric point (JSON text, with its timeline), if it has one.
pub async fn latest_point(pool: &SqlitePool, id: i64) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar("SELECT point FROM metrics WHERE job_id = ? ORDER BY step DESC LIMIT 1")
        .bind(id)
        .fetch_optional(pool)
        .await
}

/// Appends a line to job `job_id`'s log, stamped `t` (Unix seconds).
pub async fn append_log(pool: &SqlitePool, job_id: i64, t: f64, line: &str) -> sqlx::Result<()> {
    sqlx::query("INSERT INTO job_logs (job_id, t, line) VALUES (?, ?, ?)")
        .bind(job_id)
        .bind(t)
        .bind(line)
        .execute(pool)
        .await?;
    Ok(())
}

/// Sets job `job_id`'s final status (and error), finished now.
pub async fn finish(
    pool: &SqlitePool,
    job_id: i64,
    status: JobStatus,
    error: Option<&str>,
) -> sqlx::Result<()> {
    sqlx::query("UPDATE jobs SET status = ?, error = ?, finished_at = ? WHERE id = ?")
        .bind(status)
        .bind(error)
        .bind(now())
        .bind(job_id)
        .execute(pool)
        .await?;
    Ok(())
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
    pool: &SqlitePool,
    job: &NewJob<'_>,
    limit: i64,
) -> sqlx::Result<Result<i64, NotQueued>> {
    let id: Option<i64> = sqlx::query_scalar(&format!(
        "INSERT INTO jobs (id, owner_id, name, note, model, dataset_id, eval_dataset_id, device,
                           config, status, queue_seq, total_steps, created_at)
         SELECT MAX(COALESCE((SELECT MAX(id) FROM jobs), 0),
                    COALESCE((SELECT CAST(value AS INTEGER) FROM meta
                              WHERE key = 'job_id_high_water'), 0)) + 1,
                ?, ?, ?, ?, ?, ?, ?, ?, ?, (SELECT COALESCE(MAX(queue_seq), 0) + 1 FROM jobs),
                ?, ?
         WHERE (SELECT COUNT(*) FROM jobs WHERE owner_id = ? AND status IN {active}) < ?
           AND EXISTS (SELECT 1 FROM datasets WHERE id = ?)
           AND (? IS NULL OR EXISTS (SELECT 1 FROM datasets WHERE id = ?))
         RETURNING id",
        active = JobStatus::ACTIVE_SQL,
    ))
    .bind(job.owner_id)
    .bind(job.name)
    .bind(job.note)
    .bind(job.model)
    .bind(job.dataset_id)
    .bind(job.eval_dataset_id)
    .bind(job.device)
    .bind(job.config)
    .bind(JobStatus::Queued)
    .bind(job.total_steps)
    .bind(now())
    .bind(job.owner_id)
    .bind(limit)
    .bind(job.dataset_id)
    .bind(job.eval_dataset_id)
    .bind(job.eval_dataset_id)
    .fetch_optional(pool)
    .await?;
    if let Some(id) = id {
        return Ok(Ok(id));
    }
    let active = active_of_owner(pool, job.owner_id).await?;
    Ok(Err(if active >= limit { NotQueued::AtLimit { active } } else { NotQueued::DatasetGone }))
}

/// Queued or running jobs of `owner_id`.
pub async fn active_of_owner(pool: &SqlitePool, owner_id: i64) -> sqlx::Result<i64> {
    sqlx::query_scalar(&format!(
        "SELECT COUNT(*) FROM jobs WHERE owner_id = ? AND status IN {}",
        JobStatus::ACTIVE_SQL
    ))
    .bind(owner_id)
    .fetch_one(pool)
    .await
}

/// Queued or running jobs that train on, or evaluate with, dataset `dataset_id`.
pub async fn active_using_dataset(pool: &SqlitePool, dataset_id: i64) -> sqlx::Result<i64> {
    sqlx::query_scalar(&format!(
        "SELECT COUNT(*) FROM jobs WHERE (dataset_id = ? OR eval_dataset_id = ?)
             AND status IN {}",
        JobStatus::ACTIVE_SQL
    ))
    .bind(dataset_id)
    .bind(dataset_id)
    .fetch_one(pool)
    .await
}

/// Queued or running jobs that train model `id`, or any revision of it (`id@...`).
pub async fn active_using_model(pool: &SqlitePool, id: &str) -> sqlx::Result<i64> {
    let revisions = format!("{id}@");
    sqlx::query_scalar(&format!(
        "SELECT COUNT(*) FROM jobs WHERE (model = ? OR substr(model, 1, ?) = ?) AND status IN {}",
        JobStatus::ACTIVE_SQL
    ))
    .bind(id)
    .bind(revisions.len() as i64)
    .bind(&revisions)
    .fetch_one(pool)
    .await
}

/// Jobs by status: (queued, running).
pub async fn queue_counts(pool: &SqlitePool) -> sqlx::Result<(i64, i64)> {
    let (queued, running): (i64, i64) = sqlx::query_as(
        "SELECT COALESCE(SUM(status = ?), 0), COALESCE(SUM(status = ?), 0) FROM jobs",
    )
    .bind(JobStatus::Queued)
    .bind(JobStatus::Running)
    .fetch_one(pool)
    .await?;
    Ok((queued, running))
}

/// Each running job's id and its latest tokens per second, if it reported one.
pub async fn running_rates(pool: &SqlitePool) -> sqlx::Result<Vec<(i64, Option<f64>)>> {
    sqlx::query_as(
        "SELECT j.id, (SELECT json_extract(m.point, '$.tokens_per_s') FROM metrics m
                       WHERE m.job_id = j.id ORDER BY m.step DESC LIMIT 1) AS tokens_per_s
         FROM jobs j WHERE j.status = ? ORDER BY j.id",
    )
    .bind(JobStatus::Running)
    .fetch_all(pool)
    .await
}

/// Running jobs with their devices ("cuda:0,1").
pub async fn running_devices(pool: &SqlitePool) -> sqlx::Result<Vec<(i64, String)>> {
    sqlx::query_as("SELECT id, device FROM jobs WHERE status = ?")
        .bind(JobStatus::Running)
        .fetch_all(pool)
        .await
}

/// Queued jobs with their devices, in queue order.
pub async fn queued_devices(pool: &SqlitePool) -> sqlx::Result<Vec<(i64, String)>> {
    sqlx::query_as("SELECT id, device FROM jobs WHERE status = ? ORDER BY queue_seq")
        .bind(JobStatus::Queued)
        .fetch_all(pool)
        .await
}

/// Marks queued job `id` running (from the step it is at); `None` when it is no longer queued.
pub async fn claim(pool: &SqlitePool, id: i64) -> sqlx::Result<Option<JobRow>> {
    sqlx::query_as(&format!(
        "UPDATE jobs SET status = ?, started_at = ?, start_step = step, error = NULL,
             finished_at = NULL
         WHERE id = ? AND status = ?
         RETURNING {COLUMNS}"
    ))
    .bind(JobStatus::Running)
    .bind(now_f64())
    .bind(id)
    .bind(JobStatus::Queued)
    .fetch_optional(pool)
    .await
}

/// Cancels job `id` if it is still queued; says whether it was.
pub async fn cancel_queued(pool: &SqlitePool, id: i64) -> sqlx::Result<bool> {
    let dequeued =
        sqlx::query("UPDATE jobs SET status = ?, finished_at = ? WHERE id = ? AND status = ?")
            .bind(JobStatus::Cancelled)
            .bind(now())
            .bind(id)
            .bind(JobStatus::Queued)
            .execute(pool)
            .await?;
    Ok(dequeued.rows_affected() == 1)
}

/// Queues cancelled or interrupted job `id` again from `step`, dropping the metrics of later
/// steps (they are taken again, identically), if its owner is under `limit` active jobs and its
/// datasets still exist (checked in the same statement, so a dataset deleted meanwhile can
/// never leave a queued job without one). Says whether it was queued.
pub async fn requeue(
    pool: &SqlitePool,
    id: i64,
    owner_id: i64,
    step: i64,
    limit: i64,
) -> sqlx::Result<bool> {
    let mut tx = pool.begin().await?;
    sqlx::query("DELETE FROM metrics WHERE job_id = ? AND step > ?")
        .bind(id)
        .bind(step)
        .execute(&mut *tx)
        .await?;
    let queued = sqlx::query(&format!(
        "UPDATE jobs SET status = ?, queue_seq = (SELECT COALESCE(MAX(queue_seq), 0) + 1 FROM jobs),
             error = NULL, finished_at = NULL, step = ?, start_step = ?
         WHERE id = ? AND status IN (?, ?)
           AND EXISTS (SELECT 1 FROM datasets d WHERE d.id = jobs.dataset_id)
           AND (jobs.eval_dataset_id IS NULL
                OR EXISTS (SELECT 1 FROM datasets d WHERE d.id = jobs.eval_dataset_id))
           AND (SELECT COUNT(*) FROM jobs WHERE owner_id = ? AND status IN {}) < ?",
        JobStatus::ACTIVE_SQL
    ))
    .bind(JobStatus::Queued)
    .bind(step)
    .bind(step)
    .bind(id)
    .bind(JobStatus::Cancelled)
    .bind(JobStatus::Interrupted)
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
        "UPDATE jobs SET status = ?, finished_at = CAST(strftime('%s', 'now') AS INTEGER),
             error = 'the server stopped while the job was running; resume it to continue'
         WHERE status = ?",
    )
    .bind(JobStatus::Interrupted)
    .bind(JobStatus::Running)
    .execute(pool)
    .await?;
    Ok(marked.rows_affected())
}

pub async fn set_placement(pool: &SqlitePool, id: i64, placement: &str) -> sqlx::Result<()> {
    sqlx::query("UPDATE jobs SET placement = ? WHERE id = ?")
        .bind(placement)
        .bind(id)
        .execute(pool)
        .await?;
    Ok(())
}

pub async fn set_total_steps(pool: &SqlitePool, id: i64, total_steps: i64) -> sqlx::Result<()> {
    sqlx::query("UPDATE jobs SET total_steps = ? WHERE id = ?")
        .bind(total_steps)
        .bind(id)
        .execute(pool)
        .await?;
    Ok(())
}

/// Stores step `step`'s metrics point (JSON) and moves the job's step there.
pub async fn record_step(pool: &SqlitePool, id: i64, step: i64, point: &str) -> sqlx::Result<()> {
    let mut tx = pool.begin().await?;
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
pub async fn metric_points(pool: &SqlitePool, id: i64) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(
        "SELECT json_remove(point, '$.timeline') FROM metrics WHERE job_id = ? ORDER BY step",
    )
    .bind(id)
    .fetch_all(pool)
    .await
}

/// The per-unit timeline of job `id`'s step `step` (JSON text): `Ok(None)` when the step has no
/// point; `Some("null")` when it has no timeline.
pub async fn timeline_at(pool: &SqlitePool, id: i64, step: i64) -> sqlx::Result<Option<String>> {
    let found: Option<Option<String>> = sqlx::query_scalar(
        "SELECT json_extract(point, '$.timeline') FROM metrics WHERE job_id = ? AND step = ?",
    )
    .bind(id)
    .bind(step)
    .fetch_optional(pool)
    .await?;
    Ok(found.map(|t| t.unwrap_or_else(|| "null".to_string())))
}

/// The latest step of job `id` whose point has a timeline.
pub async fn latest_timeline_step(pool: &SqlitePool, id: i64) -> sqlx::Result<Option<i64>> {
    sqlx::query_scalar(
        "SELECT MAX(step) FROM metrics WHERE job_id = ?
           AND json_type(point, '$.timeline') IS NOT NULL
           AND json_type(point, '$.timeline') != 'null'",
    )
    .bind(id)
    .fetch_one(pool)
    .await
}

/// What a job's summary needs from its metrics (read by [`listed`]): the latest and best losses (with their steps),
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

/// Sets job `id`'s name and note.
pub async fn set_label(pool: &SqlitePool, id: i64, name: &str, note: &str) -> sqlx::Result<()> {
    sqlx::query("UPDATE jobs SET name = ?, note = ? WHERE id = ?")
        .bind(name)
        .bind(note)
        .bind(id)
        .execute(pool)
        .await?;
    Ok(())
}

/// Deletes job `id` (its metrics, log and checkpoint rows go with it) unless it is queued or
/// running, in one statement, so no resume or claim slips in between. Says whether it was.
pub async fn delete_job_if_idle(pool: &SqlitePool, id: i64) -> sqlx::Result<bool> {
    let deleted = sqlx::query(&format!(
        "DELETE FROM jobs WHERE id = ? AND status NOT IN {}",
        JobStatus::ACTIVE_SQL
    ))
    .bind(id)
    .execute(pool)
    .await?;
    Ok(deleted.rows_affected() == 1)
}

/// Forgets checkpoint `name` of job `id`.
pub async fn forget_checkpoint(pool: &SqlitePool, id: i64, name: &str) -> sqlx::Result<()> {
    sqlx::query("DELETE FROM checkpoints WHERE job_id = ? AND name = ?")
        .bind(id)
        .bind(name)
        .execute(pool)
        .await?;
    Ok(())
}

/// Every log line of job `id`, oldest first.
pub async fn log_lines(pool: &SqlitePool, id: i64) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar("SELECT line FROM job_logs WHERE job_id = ? ORDER BY id")
        .bind(id)
        .fetch_all(pool)
        .await
}

/// Records checkpoint `name` of job `id`, saved at `step`.
pub async fn record_checkpoint(
    pool: &SqlitePool,
    id: i64,
    name: &str,
    step: i64,
) -> sqlx::Result<()> {
    sqlx::query("INSERT OR REPLACE INTO checkpoints (job_id, name, step) VALUES (?, ?, ?)")
        .bind(id)
        .bind(name)
        .bind(step)
        .execute(pool)
        .await?;
    Ok(())
}

/// Job `id`'s checkpoints as (name, step), in step order.
pub async fn checkpoints(pool: &SqlitePool, id: i64) -> sqlx::Result<Vec<(String, i64)>> {
    sqlx::query_as("SELECT name, step FROM checkpoints WHERE job_id = ? ORDER BY step, name")
        .bind(id)
        .fetch_all(pool)
        .await
}

/// Whether job `id` recorded a checkpoint called `name`.
pub async fn has_checkpoint(pool: &SqlitePool, id: i64, name: &str) -> sqlx::Result<bool> {
    let known: Option<String> =
        sqlx::query_scalar("SELECT name FROM checkpoints WHERE job_id = ? AND name = ?")
            .bind(id)
            .bind(name)
            .fetch_optional(pool)
            .await?;
    Ok(known.is_some())
}

/// The ids of `owner_id`'s jobs.
pub async fn job_ids_of_owner(pool: &SqlitePool, owner_id: i64) -> sqlx::Result<Vec<i64>> {
    sqlx::query_scalar("SELECT id FROM jobs WHERE owner_id = ?")
        .bind(owner_id)
        .fetch_all(pool)
        .await
}

/// Every job id (to find run folders no job owns).
pub async fn all_job_ids(pool: &SqlitePool) -> sqlx::Result<Vec<i64>> {
    sqlx::query_scalar("SELECT id FROM jobs").fetch_all(pool).await
}

/// A job as the API lists it: its row with what the list shows beside it, all from one
/// statement (names joined in, the rest as subqueries per row).
#[derive(Debug, FromRow)]
pub struct Listed {
    #[sqlx(flatten)]
    pub row: JobRow,
    /// The owner's name; `None` only in the instant of a user's delete.
    pub owner: Option<String>,
    pub dataset_name: Option<String>,
    pub eval_dataset_name: Option<String>,
    /// Place in its device's queue (1 is next), while queued.
    pub position: Option<i64>,
    pub demo_token: Option<String>,
    #[sqlx(flatten)]
    pub summary: MetricSummary,
}

/// Which jobs [`listed`] reads.
#[derive(Debug, Clone, Copy)]
pub enum Which {
    All,
    OwnedBy(i64),
    One(i64),
}

/// The jobs `which` names, newest first, each with its owner's and datasets' names, its queue
/// position, its demo token and the summary of its metrics: one statement for any number of
/// jobs.
pub async fn listed(pool: &SqlitePool, which: Which) -> sqlx::Result<Vec<Listed>> {
    let columns = COLUMNS.split(", ").map(|c| format!("j.{c} AS {c}")).collect::<Vec<_>>();
    let (filter, id) = match which {
        Which::All => ("1 = 1 OR ? IS NULL", None),
        Which::OwnedBy(owner) => ("j.owner_id = ?", Some(owner)),
        Which::One(job) => ("j.id = ?", Some(job)),
    };
    let point = |field: &str| format!("json_extract(m.point, '$.{field}')");
    let over = |select: String, rest: &str| {
        format!("(SELECT {select} FROM metrics m WHERE m.job_id = j.id {rest})")
    };
    let (loss, eval_loss) = (point("loss"), point("eval_loss"));
    let (tokens, step_s) = (point("tokens"), point("step_s"));
    let sql = format!(
        "SELECT {columns},
                u.username AS owner,
                d.name AS dataset_name,
                e.name AS eval_dataset_name,
                CASE WHEN j.status = ?1 THEN
                    (SELECT COUNT(*) FROM jobs q
                     WHERE q.device = j.device AND q.status = ?1 AND q.queue_seq <= j.queue_seq)
                END AS position,
                (SELECT token FROM demo_links l WHERE l.job_id = j.id) AS demo_token,
                {best_loss} AS best_loss,
                {best_loss_step} AS best_loss_step,
                {final_loss} AS final_loss,
                {final_eval_loss} AS final_eval_loss,
                {best_eval_loss} AS best_eval_loss,
                {best_eval_step} AS best_eval_step,
                {tokens_seen} AS tokens_seen,
                {trained_tokens} AS trained_tokens,
                {tokens_per_s} AS tokens_per_s
         FROM jobs j
         LEFT JOIN users u ON u.id = j.owner_id
         LEFT JOIN datasets d ON d.id = j.dataset_id
         LEFT JOIN datasets e ON e.id = j.eval_dataset_id
         WHERE {filter}
         ORDER BY j.id DESC",
        columns = columns.join(", "),
        filter = filter.replace('?', "?2"),
        best_loss = over(format!("MIN({loss})"), ""),
        best_loss_step = over(
            "m.step".into(),
            &format!("AND {loss} IS NOT NULL ORDER BY {loss}, m.step LIMIT 1")
        ),
        final_loss = over(loss.clone(), "ORDER BY m.step DESC LIMIT 1"),
        final_eval_loss = over(
            eval_loss.clone(),
            &format!("AND {eval_loss} IS NOT NULL ORDER BY m.step DESC LIMIT 1")
        ),
        best_eval_loss = over(format!("MIN({eval_loss})"), ""),
        best_eval_step = over(
            "m.step".into(),
            &format!("AND {eval_loss} IS NOT NULL ORDER BY {eval_loss}, m.step LIMIT 1")
        ),
        tokens_seen = over(format!("SUM({tokens})"), ""),
        trained_tokens = over(format!("SUM({})", point("trained_tokens")), ""),
        tokens_per_s =
            over(format!("CASE WHEN SUM({step_s}) > 0 THEN SUM({tokens}) / SUM({step_s}) END"), ""),
    );
    sqlx::query_as(&sql).bind(JobStatus::Queued).bind(id).fetch_all(pool).await
}

#[cfg(test)]
mod tests {
    use super::JobStatus;

    #[test]
    fn the_active_list_names_the_active_states() {
        let names = [JobStatus::Queued, JobStatus::Running].map(JobStatus::as_str);
        assert_eq!(JobStatus::ACTIVE_SQL, format!("('{}', '{}')", names[0], names[1]));
    }
}
