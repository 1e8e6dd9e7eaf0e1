//! The `jobs` table and its children (`metrics`, `checkpoints`, `job_logs`, `demo_links`):
//! every query on them is here, for the API, the queue and the announcements alike, with
//! [`JobStatus`], the one spelling of a job's states in SQL.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sluice_engine::train::JobSettings;
use sqlx::{SqliteExecutor, SqlitePool};

use crate::db::{now, now_f64};

/// Where a job is in its life. Stored as its lower-case name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, sqlx::Type)]
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
    /// The states that hold a place in the queue or a device: what the limits on jobs, and the
    /// deletes that must not pull a dataset or user from under a job, test (bound into
    /// `status IN (?, ?)`).
    pub const ACTIVE: [JobStatus; 2] = [JobStatus::Queued, JobStatus::Running];

    /// Whether the job has ended, for now at least (cancelled and interrupted jobs may be
    /// resumed, which starts them again).
    pub fn is_ended(self) -> bool {
        !Self::ACTIVE.contains(&self)
    }

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

#[derive(Debug, Clone)]
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
    /// Why it can no longer be resumed, when something it needs went (see
    /// [`super::datasets::delete_dataset_if_unused`]).
    pub resume_ended: Option<String>,
}

impl JobRow {
    /// The engine's settings the job was accepted with.
    pub fn settings(&self) -> anyhow::Result<JobSettings> {
        serde_json::from_str(&self.config)
            .map_err(|e| anyhow::anyhow!("job {} config: {e}", self.id))
    }

    /// Stopped before its end, so a resume could continue it (if its dataset still exists:
    /// see [`Self::resume_blocked`]).
    pub fn is_resumable(&self) -> bool {
        matches!(self.status, JobStatus::Cancelled | JobStatus::Interrupted)
    }

    /// Why a job stopped before its end cannot be resumed: its training dataset was deleted
    /// (the column is cleared with it), and a resume must read the same data again.
    pub fn resume_blocked(&self) -> Option<&str> {
        if !self.is_resumable() {
            return None;
        }
        match (self.dataset_id, &self.resume_ended) {
            (None, _) => {
                Some("the job's dataset was deleted, and a resume must read the same data again")
            }
            (_, Some(why)) => Some(why),
            _ => None,
        }
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
    row(pool, id).await
}

/// Job `id`'s row, read by `db` (the pool, or a transaction that just changed it).
async fn row(db: impl SqliteExecutor<'_>, id: i64) -> sqlx::Result<Option<JobRow>> {
    sqlx::query_as!(
        JobRow,
        r#"SELECT id, owner_id, model, dataset_id, device, config, status AS "status: JobStatus",
                  queue_seq, error, total_steps, step, start_step, started_at, finished_at,
                  resume_from, created_at, eval_dataset_id, placement, name, note, resume_ended
           FROM jobs WHERE id = ?"#,
        id
    )
    .fetch_optional(db)
    .await
}

/// The token of job `id`'s demo link, while its owner keeps it on.
pub async fn demo_token(pool: &SqlitePool, id: i64) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar!("SELECT token FROM demo_links WHERE job_id = ?", id)
        .fetch_optional(pool)
        .await
}

/// Turns job `id`'s demo link on and returns its token: the one it has, or `fresh`; `None`
/// when the job is gone.
pub async fn share_demo(pool: &SqlitePool, id: i64, fresh: &str) -> sqlx::Result<Option<String>> {
    let now = now();
    sqlx::query!(
        "INSERT INTO demo_links (job_id, token, created_at) VALUES (?, ?, ?)
         ON CONFLICT (job_id) DO NOTHING",
        id,
        fresh,
        now,
    )
    .execute(pool)
    .await?;
    demo_token(pool, id).await
}

/// Turns job `id`'s demo link off; whether it was on.
pub async fn unshare_demo(pool: &SqlitePool, id: i64) -> sqlx::Result<bool> {
    let done = sqlx::query!("DELETE FROM demo_links WHERE job_id = ?", id).execute(pool).await?;
    Ok(done.rows_affected() > 0)
}

/// The job whose demo link carries `token`, if that link is on.
pub async fn by_demo_token(pool: &SqlitePool, token: &str) -> sqlx::Result<Option<JobRow>> {
    let job =
        sqlx::query_scalar!(r#"SELECT job_id AS "id!" FROM demo_links WHERE token = ?"#, token)
            .fetch_optional(pool)
            .await?;
    match job {
        Some(id) => row(pool, id).await,
        None => Ok(None),
    }
}

/// The loss of job `id`'s last recorded step.
pub async fn final_loss(pool: &SqlitePool, id: i64) -> sqlx::Result<Option<f64>> {
    let last = sqlx::query_scalar!(
        r#"SELECT json_extract(point, '$.loss') AS "loss: f64" FROM metrics WHERE job_id = ?
         ORDER BY step DESC LIMIT 1"#,
        id
    )
    .fetch_optional(pool)
    .await?;
    Ok(last.flatten())
}

/// Job `id`'s latest metric point (JSON text, with its timeline), if it has one.
pub async fn latest_point(pool: &SqlitePool, id: i64) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar!("SELECT point FROM metrics WHERE job_id = ? ORDER BY step DESC LIMIT 1", id)
        .fetch_optional(pool)
        .await
}

/// Appends a line to job `job_id`'s log, stamped `t` (Unix seconds).
pub async fn append_log(pool: &SqlitePool, job_id: i64, t: f64, line: &str) -> sqlx::Result<()> {
    sqlx::query!("INSERT INTO job_logs (job_id, t, line) VALUES (?, ?, ?)", job_id, t, line)
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
    let now = now();
    sqlx::query!(
        "UPDATE jobs SET status = ?, error = ?, finished_at = ? WHERE id = ?",
        status,
        error,
        now,
        job_id,
    )
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
    let [queued, running] = JobStatus::ACTIVE;
    let now = now();
    let id = sqlx::query_scalar!(
        r#"INSERT INTO jobs (id, owner_id, name, note, model, dataset_id, eval_dataset_id, device,
                           config, status, queue_seq, total_steps, created_at)
         SELECT MAX(COALESCE((SELECT MAX(id) FROM jobs), 0),
                    COALESCE((SELECT CAST(value AS INTEGER) FROM meta
                              WHERE key = 'job_id_high_water'), 0)) + 1,
                ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9,
                (SELECT COALESCE(MAX(queue_seq), 0) + 1 FROM jobs), ?10, ?11
         WHERE (SELECT COUNT(*) FROM jobs WHERE owner_id = ?1 AND status IN (?9, ?12)) < ?13
           AND EXISTS (SELECT 1 FROM datasets WHERE id = ?5)
           AND (?6 IS NULL OR EXISTS (SELECT 1 FROM datasets WHERE id = ?6))
         RETURNING id AS "id!: i64""#,
        job.owner_id,
        job.name,
        job.note,
        job.model,
        job.dataset_id,
        job.eval_dataset_id,
        job.device,
        job.config,
        queued,
        job.total_steps,
        now,
        running,
        limit,
    )
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
    let [queued, running] = JobStatus::ACTIVE;
    sqlx::query_scalar!(
        r#"SELECT COUNT(*) AS "count!: i64" FROM jobs WHERE owner_id = ? AND status IN (?, ?)"#,
        owner_id,
        queued,
        running,
    )
    .fetch_one(pool)
    .await
}

/// Queued or running jobs that train on, or evaluate with, dataset `dataset_id`.
pub async fn active_using_dataset(pool: &SqlitePool, dataset_id: i64) -> sqlx::Result<i64> {
    let [queued, running] = JobStatus::ACTIVE;
    sqlx::query_scalar!(
        r#"SELECT COUNT(*) AS "count!: i64" FROM jobs
           WHERE (dataset_id = ?1 OR eval_dataset_id = ?1) AND status IN (?2, ?3)"#,
        dataset_id,
        queued,
        running,
    )
    .fetch_one(pool)
    .await
}

/// Queued or running jobs that train model `id`, or any revision of it (`id@...`).
pub async fn active_using_model(pool: &SqlitePool, id: &str) -> sqlx::Result<i64> {
    let revisions = format!("{id}@");
    let length = revisions.len() as i64;
    let [queued, running] = JobStatus::ACTIVE;
    sqlx::query_scalar!(
        r#"SELECT COUNT(*) AS "count!: i64" FROM jobs
           WHERE (model = ? OR substr(model, 1, ?) = ?) AND status IN (?, ?)"#,
        id,
        length,
        revisions,
        queued,
        running,
    )
    .fetch_one(pool)
    .await
}

/// Jobs by status: (queued, running).
pub async fn queue_counts(pool: &SqlitePool) -> sqlx::Result<(i64, i64)> {
    let [queued, running] = JobStatus::ACTIVE;
    let counts = sqlx::query!(
        r#"SELECT COALESCE(SUM(status = ?), 0) AS "queued!: i64",
                  COALESCE(SUM(status = ?), 0) AS "running!: i64"
           FROM jobs"#,
        queued,
        running,
    )
    .fetch_one(pool)
    .await?;
    Ok((counts.queued, counts.running))
}

/// Each running job's id and its latest tokens per second, if it reported one.
pub async fn running_rates(pool: &SqlitePool) -> sqlx::Result<Vec<(i64, Option<f64>)>> {
    let rows = sqlx::query!(
        r#"SELECT j.id, (SELECT json_extract(m.point, '$.tokens_per_s') FROM metrics m
                       WHERE m.job_id = j.id ORDER BY m.step DESC LIMIT 1) AS "tokens_per_s: f64"
         FROM jobs j WHERE j.status = ? ORDER BY j.id"#,
        JobStatus::Running,
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|r| (r.id, r.tokens_per_s)).collect())
}

/// Running jobs with their devices ("cuda:0,1").
pub async fn running_devices(pool: &SqlitePool) -> sqlx::Result<Vec<(i64, String)>> {
    let rows = sqlx::query!(
        r#"SELECT id AS "id!", device FROM jobs WHERE status = ?"#,
        JobStatus::Running
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|r| (r.id, r.device)).collect())
}

/// Queued jobs with their devices, in queue order.
pub async fn queued_devices(pool: &SqlitePool) -> sqlx::Result<Vec<(i64, String)>> {
    let rows = sqlx::query!(
        r#"SELECT id AS "id!", device FROM jobs WHERE status = ? ORDER BY queue_seq"#,
        JobStatus::Queued
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|r| (r.id, r.device)).collect())
}

/// Marks queued job `id` running (from the step it is at); `None` when it is no longer queued.
pub async fn claim(pool: &SqlitePool, id: i64) -> sqlx::Result<Option<JobRow>> {
    let mut tx = pool.begin().await?;
    let started = now_f64();
    let claimed = sqlx::query!(
        "UPDATE jobs SET status = ?, started_at = ?, start_step = step, error = NULL,
             finished_at = NULL
         WHERE id = ? AND status = ?",
        JobStatus::Running,
        started,
        id,
        JobStatus::Queued,
    )
    .execute(&mut *tx)
    .await?;
    if claimed.rows_affected() != 1 {
        return Ok(None);
    }
    let job = row(&mut *tx, id).await?;
    tx.commit().await?;
    Ok(job)
}

/// The cancelled or interrupted jobs (id, name) that train or evaluate on dataset
/// `dataset_id`, oldest first: deleting it ends their resume, which reads the same data again.
pub async fn resumable_on(pool: &SqlitePool, dataset_id: i64) -> sqlx::Result<Vec<(i64, String)>> {
    let rows = sqlx::query!(
        r#"SELECT id AS "id!", name FROM jobs
           WHERE (dataset_id = ?1 OR eval_dataset_id = ?1) AND status IN (?2, ?3) ORDER BY id"#,
        dataset_id,
        JobStatus::Cancelled,
        JobStatus::Interrupted,
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|r| (r.id, r.name)).collect())
}

/// Cancels job `id` if it is still queued; says whether it was.
pub async fn cancel_queued(pool: &SqlitePool, id: i64) -> sqlx::Result<bool> {
    let now = now();
    let dequeued = sqlx::query!(
        "UPDATE jobs SET status = ?, finished_at = ? WHERE id = ? AND status = ?",
        JobStatus::Cancelled,
        now,
        id,
        JobStatus::Queued,
    )
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
    sqlx::query!("DELETE FROM metrics WHERE job_id = ? AND step > ?", id, step)
        .execute(&mut *tx)
        .await?;
    summarise_again(&mut tx, Some(id)).await?;
    let [queued, running] = JobStatus::ACTIVE;
    let requeued = sqlx::query!(
        "UPDATE jobs SET status = ?1,
             queue_seq = (SELECT COALESCE(MAX(queue_seq), 0) + 1 FROM jobs),
             error = NULL, finished_at = NULL, step = ?2, start_step = ?2
         WHERE id = ?3 AND status IN (?4, ?5)
           AND EXISTS (SELECT 1 FROM datasets d WHERE d.id = jobs.dataset_id)
           AND jobs.resume_ended IS NULL
           AND (jobs.eval_dataset_id IS NULL
                OR EXISTS (SELECT 1 FROM datasets d WHERE d.id = jobs.eval_dataset_id))
           AND (SELECT COUNT(*) FROM jobs WHERE owner_id = ?6 AND status IN (?1, ?7)) < ?8",
        queued,
        step,
        id,
        JobStatus::Cancelled,
        JobStatus::Interrupted,
        owner_id,
        running,
        limit,
    )
    .execute(&mut *tx)
    .await?;
    if requeued.rows_affected() != 1 {
        return Ok(false);
    }
    tx.commit().await?;
    Ok(true)
}

/// Jobs that were running when the server stopped cannot be running now: marks them
/// interrupted and returns how many there were.
pub async fn mark_interrupted(pool: &sqlx::SqlitePool) -> sqlx::Result<u64> {
    let marked = sqlx::query!(
        "UPDATE jobs SET status = ?, finished_at = CAST(strftime('%s', 'now') AS INTEGER),
             error = 'the server stopped while the job was running; resume it to continue'
         WHERE status = ?",
        JobStatus::Interrupted,
        JobStatus::Running,
    )
    .execute(pool)
    .await?;
    Ok(marked.rows_affected())
}

pub async fn set_placement(pool: &SqlitePool, id: i64, placement: &str) -> sqlx::Result<()> {
    sqlx::query!("UPDATE jobs SET placement = ? WHERE id = ?", placement, id).execute(pool).await?;
    Ok(())
}

pub async fn set_total_steps(pool: &SqlitePool, id: i64, total_steps: i64) -> sqlx::Result<()> {
    sqlx::query!("UPDATE jobs SET total_steps = ? WHERE id = ?", total_steps, id)
        .execute(pool)
        .await?;
    Ok(())
}

/// Stores step `step`'s metrics point (JSON) and moves the job's step there.
pub async fn record_step(pool: &SqlitePool, id: i64, step: i64, point: &str) -> sqlx::Result<()> {
    let mut tx = pool.begin().await?;
    sqlx::query!(
        "INSERT OR REPLACE INTO metrics (job_id, step, point) VALUES (?, ?, ?)",
        id,
        step,
        point,
    )
    .execute(&mut *tx)
    .await?;
    summarise_step(&mut tx, id, step, point).await?;
    sqlx::query!("UPDATE jobs SET step = ? WHERE id = ?", step, id).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(())
}

/// Folds step `step`'s `point` into job `id`'s summary (`job_summaries`) when it comes after the
/// job's last summarised step, as steps do while a job runs; a step stored again is summarised
/// from all the job's points instead, since a best or latest figure it replaces cannot be
/// taken back out of the row.
async fn summarise_step(
    tx: &mut sqlx::SqliteConnection,
    id: i64,
    step: i64,
    point: &str,
) -> sqlx::Result<()> {
    // In an upsert's SET, `s.` reads the row as it was before the update; a new best needs a
    // figure, and beats the old one only when lower (ties keep the earlier step, as the
    // summary from all the points does).
    let folded = sqlx::query!(
        "INSERT INTO job_summaries AS s (job_id, last_step, best_loss, best_loss_step,
             final_loss, final_eval_loss, best_eval_loss, best_eval_step, task_before,
             task_score, task_step, tokens_seen, trained_tokens, step_s)
         SELECT ?1, ?2, p.loss, IIF(p.loss IS NULL, NULL, ?2), p.loss,
                p.eval_loss, p.eval_loss, IIF(p.eval_loss IS NULL, NULL, ?2),
                IIF(?2 = 0, p.task, NULL), IIF(?2 > 0, p.task, NULL),
                IIF(?2 > 0 AND p.task IS NOT NULL, ?2, NULL),
                p.tokens, p.trained, p.step_s
         FROM (SELECT ?3 ->> '$.loss' AS loss, ?3 ->> '$.eval_loss' AS eval_loss,
                      ?3 ->> '$.task_score' AS task, ?3 ->> '$.tokens' AS tokens,
                      ?3 ->> '$.trained_tokens' AS trained, ?3 ->> '$.step_s' AS step_s) p
         WHERE true
         ON CONFLICT (job_id) DO UPDATE SET
             last_step = excluded.last_step,
             best_loss = IIF(excluded.best_loss < s.best_loss OR s.best_loss IS NULL,
                             COALESCE(excluded.best_loss, s.best_loss), s.best_loss),
             best_loss_step = IIF(excluded.best_loss < s.best_loss
                                  OR (s.best_loss IS NULL AND excluded.best_loss IS NOT NULL),
                                  excluded.best_loss_step, s.best_loss_step),
             final_loss = excluded.final_loss,
             final_eval_loss = COALESCE(excluded.final_eval_loss, s.final_eval_loss),
             best_eval_loss = IIF(excluded.best_eval_loss < s.best_eval_loss
                                  OR s.best_eval_loss IS NULL,
                                  COALESCE(excluded.best_eval_loss, s.best_eval_loss),
                                  s.best_eval_loss),
             best_eval_step = IIF(excluded.best_eval_loss < s.best_eval_loss
                                  OR (s.best_eval_loss IS NULL
                                      AND excluded.best_eval_loss IS NOT NULL),
                                  excluded.best_eval_step, s.best_eval_step),
             task_score = COALESCE(excluded.task_score, s.task_score),
             task_step = IIF(excluded.task_score IS NULL, s.task_step, excluded.task_step),
             tokens_seen = IIF(excluded.tokens_seen IS NULL, s.tokens_seen,
                               COALESCE(s.tokens_seen, 0) + excluded.tokens_seen),
             trained_tokens = IIF(excluded.trained_tokens IS NULL, s.trained_tokens,
                                  COALESCE(s.trained_tokens, 0) + excluded.trained_tokens),
             step_s = IIF(excluded.step_s IS NULL, s.step_s,
                          COALESCE(s.step_s, 0) + excluded.step_s)
         WHERE excluded.last_step > s.last_step",
        id,
        step,
        point,
    )
    .execute(&mut *tx)
    .await?;
    if folded.rows_affected() == 0 {
        summarise_again(tx, Some(id)).await?;
    }
    Ok(())
}

/// Summarises job `id` from all its stored points, or with `None` every job that has points
/// but no summary (those stored before summaries were kept; the server runs this at start).
pub async fn summarise_again(
    conn: &mut sqlx::SqliteConnection,
    id: Option<i64>,
) -> sqlx::Result<()> {
    if let Some(id) = id {
        sqlx::query!("DELETE FROM job_summaries WHERE job_id = ?", id).execute(&mut *conn).await?;
    }
    sqlx::query!(
        "INSERT INTO job_summaries (job_id, last_step, best_loss, best_loss_step, final_loss,
             final_eval_loss, best_eval_loss, best_eval_step, task_before, task_score,
             task_step, tokens_seen, trained_tokens, step_s)
         SELECT j.id,
             (SELECT MAX(m.step) FROM metrics m WHERE m.job_id = j.id),
             (SELECT MIN(m.point ->> '$.loss') FROM metrics m WHERE m.job_id = j.id),
             (SELECT m.step FROM metrics m WHERE m.job_id = j.id
                 AND m.point ->> '$.loss' IS NOT NULL
                 ORDER BY m.point ->> '$.loss', m.step LIMIT 1),
             (SELECT m.point ->> '$.loss' FROM metrics m WHERE m.job_id = j.id
                 ORDER BY m.step DESC LIMIT 1),
             (SELECT m.point ->> '$.eval_loss' FROM metrics m WHERE m.job_id = j.id
                 AND m.point ->> '$.eval_loss' IS NOT NULL ORDER BY m.step DESC LIMIT 1),
             (SELECT MIN(m.point ->> '$.eval_loss') FROM metrics m WHERE m.job_id = j.id),
             (SELECT m.step FROM metrics m WHERE m.job_id = j.id
                 AND m.point ->> '$.eval_loss' IS NOT NULL
                 ORDER BY m.point ->> '$.eval_loss', m.step LIMIT 1),
             (SELECT m.point ->> '$.task_score' FROM metrics m
                 WHERE m.job_id = j.id AND m.step = 0),
             (SELECT m.point ->> '$.task_score' FROM metrics m WHERE m.job_id = j.id
                 AND m.step > 0 AND m.point ->> '$.task_score' IS NOT NULL
                 ORDER BY m.step DESC LIMIT 1),
             (SELECT m.step FROM metrics m WHERE m.job_id = j.id
                 AND m.step > 0 AND m.point ->> '$.task_score' IS NOT NULL
                 ORDER BY m.step DESC LIMIT 1),
             (SELECT SUM(m.point ->> '$.tokens') FROM metrics m WHERE m.job_id = j.id),
             (SELECT SUM(m.point ->> '$.trained_tokens') FROM metrics m WHERE m.job_id = j.id),
             (SELECT SUM(m.point ->> '$.step_s') FROM metrics m WHERE m.job_id = j.id)
         FROM jobs j
         WHERE (?1 IS NULL OR j.id = ?1)
           AND EXISTS (SELECT 1 FROM metrics m WHERE m.job_id = j.id)
           AND NOT EXISTS (SELECT 1 FROM job_summaries s WHERE s.job_id = j.id)",
        id,
    )
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Every stored metrics point of job `id` (JSON text) without its per-unit timeline, which is
/// most of a point's bytes (see [`timeline_at`]), in step order.
pub async fn metric_points(pool: &SqlitePool, id: i64) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar!(
        r#"SELECT json_remove(point, '$.timeline') AS "point!: String" FROM metrics
           WHERE job_id = ? ORDER BY step"#,
        id
    )
    .fetch_all(pool)
    .await
}

/// The per-unit timeline of job `id`'s step `step` (JSON text): `Ok(None)` when the step has no
/// point; `Some("null")` when it has no timeline.
pub async fn timeline_at(pool: &SqlitePool, id: i64, step: i64) -> sqlx::Result<Option<String>> {
    let found = sqlx::query_scalar!(
        r#"SELECT json_extract(point, '$.timeline') AS "timeline: String" FROM metrics
           WHERE job_id = ? AND step = ?"#,
        id,
        step,
    )
    .fetch_optional(pool)
    .await?;
    Ok(found.map(|t| t.unwrap_or_else(|| "null".to_string())))
}

/// The latest step of job `id` whose point has a timeline.
pub async fn latest_timeline_step(pool: &SqlitePool, id: i64) -> sqlx::Result<Option<i64>> {
    sqlx::query_scalar!(
        r#"SELECT MAX(step) AS "step: i64" FROM metrics WHERE job_id = ?
           AND json_type(point, '$.timeline') IS NOT NULL
           AND json_type(point, '$.timeline') != 'null'"#,
        id
    )
    .fetch_one(pool)
    .await
}

/// What a job's summary needs from its metrics (read by [`listed`]): the latest and best losses (with their steps),
/// the task evaluation's figure before and after, the tokens of every step, and the tokens per second over the time spent in steps.
#[derive(Debug, Default)]
pub struct MetricSummary {
    pub best_loss: Option<f64>,
    pub best_loss_step: Option<i64>,
    pub final_loss: Option<f64>,
    pub final_eval_loss: Option<f64>,
    pub best_eval_loss: Option<f64>,
    pub best_eval_step: Option<i64>,
    /// The task evaluation's figure for the base model (step 0's point), and the latest after
    /// it with its step.
    pub task_before: Option<f64>,
    pub task_score: Option<f64>,
    pub task_step: Option<i64>,
    pub tokens_seen: Option<i64>,
    pub trained_tokens: Option<i64>,
    pub tokens_per_s: Option<f64>,
}

/// Sets job `id`'s name and note.
pub async fn set_label(pool: &SqlitePool, id: i64, name: &str, note: &str) -> sqlx::Result<()> {
    sqlx::query!("UPDATE jobs SET name = ?, note = ? WHERE id = ?", name, note, id)
        .execute(pool)
        .await?;
    Ok(())
}

/// Deletes job `id` (its metrics, log and checkpoint rows go with it) unless it is queued or
/// running, in one statement, so no resume or claim slips in between. Says whether it was.
pub async fn delete_job_if_idle(pool: &SqlitePool, id: i64) -> sqlx::Result<bool> {
    let [queued, running] = JobStatus::ACTIVE;
    let deleted =
        sqlx::query!("DELETE FROM jobs WHERE id = ? AND status NOT IN (?, ?)", id, queued, running)
            .execute(pool)
            .await?;
    Ok(deleted.rows_affected() == 1)
}

/// Forgets checkpoint `name` of job `id`.
pub async fn forget_checkpoint(pool: &SqlitePool, id: i64, name: &str) -> sqlx::Result<()> {
    sqlx::query!("DELETE FROM checkpoints WHERE job_id = ? AND name = ?", id, name)
        .execute(pool)
        .await?;
    Ok(())
}

/// Every log line of job `id`, oldest first.
pub async fn log_lines(pool: &SqlitePool, id: i64) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar!("SELECT line FROM job_logs WHERE job_id = ? ORDER BY id", id)
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
    sqlx::query!(
        "INSERT OR REPLACE INTO checkpoints (job_id, name, step) VALUES (?, ?, ?)",
        id,
        name,
        step,
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Job `id`'s checkpoints as (name, step), in step order.
pub async fn checkpoints(pool: &SqlitePool, id: i64) -> sqlx::Result<Vec<(String, i64)>> {
    let rows =
        sqlx::query!("SELECT name, step FROM checkpoints WHERE job_id = ? ORDER BY step, name", id)
            .fetch_all(pool)
            .await?;
    Ok(rows.into_iter().map(|r| (r.name, r.step)).collect())
}

/// A checkpoint with its job's owner, for lists across jobs.
#[derive(Debug, Clone)]
pub struct OwnedCheckpoint {
    pub job_id: i64,
    pub name: String,
    /// When its job was submitted (Unix seconds).
    pub job_created_at: i64,
    pub owner: String,
}

/// Every recorded checkpoint of the jobs of `owner_id` (of every job for `None`), by job and
/// step.
pub async fn checkpoints_of_owner(
    pool: &SqlitePool,
    owner_id: Option<i64>,
) -> sqlx::Result<Vec<OwnedCheckpoint>> {
    let rows = sqlx::query!(
        r#"SELECT c.job_id, c.name, j.created_at, u.username
         FROM checkpoints c JOIN jobs j ON j.id = c.job_id JOIN users u ON u.id = j.owner_id
         WHERE ?1 IS NULL OR j.owner_id = ?1
         ORDER BY c.job_id, c.step, c.name"#,
        owner_id,
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| OwnedCheckpoint {
            job_id: r.job_id,
            name: r.name,
            job_created_at: r.created_at,
            owner: r.username,
        })
        .collect())
}

/// Whether job `id` recorded a checkpoint called `name`.
pub async fn has_checkpoint(pool: &SqlitePool, id: i64, name: &str) -> sqlx::Result<bool> {
    let known =
        sqlx::query_scalar!("SELECT name FROM checkpoints WHERE job_id = ? AND name = ?", id, name)
            .fetch_optional(pool)
            .await?;
    Ok(known.is_some())
}

/// The ids of `owner_id`'s jobs.
pub async fn job_ids_of_owner(pool: &SqlitePool, owner_id: i64) -> sqlx::Result<Vec<i64>> {
    sqlx::query_scalar!(r#"SELECT id AS "id!" FROM jobs WHERE owner_id = ?"#, owner_id)
        .fetch_all(pool)
        .await
}

/// Every job id (to find run folders no job owns).
pub async fn all_job_ids(pool: &SqlitePool) -> sqlx::Result<Vec<i64>> {
    sqlx::query_scalar!(r#"SELECT id AS "id!" FROM jobs"#).fetch_all(pool).await
}

/// A job as the API lists it: its row with what the list shows beside it, all from one
/// statement (names joined in, the metric summary from `job_summaries`).
#[derive(Debug)]
pub struct Listed {
    pub row: JobRow,
    /// The owner's name; `None` only in the instant of a user's delete.
    pub owner: Option<String>,
    pub dataset_name: Option<String>,
    pub eval_dataset_name: Option<String>,
    /// Place in its device's queue (1 is next), while queued.
    pub position: Option<i64>,
    pub demo_token: Option<String>,
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
    let (owner, job) = match which {
        Which::All => (None, None),
        Which::OwnedBy(owner) => (Some(owner), None),
        Which::One(job) => (None, Some(job)),
    };
    // The metric summaries are kept as the steps are stored (see `summarise_step`).
    let rows = sqlx::query!(
        r#"SELECT j.id AS "id!: i64", j.owner_id AS "owner_id!: i64", j.model AS "model!",
                j.dataset_id, j.device AS "device!", j.config AS "config!",
                j.status AS "status!: JobStatus", j.queue_seq AS "queue_seq!: i64", j.error,
                j.total_steps AS "total_steps!: i64", j.step AS "step!: i64",
                j.start_step AS "start_step!: i64", j.started_at, j.finished_at, j.resume_from,
                j.created_at AS "created_at!: i64", j.eval_dataset_id, j.placement,
                j.name AS "name!", j.note AS "note!", j.resume_ended,
                u.username AS "owner?",
                d.name AS "dataset_name?",
                e.name AS "eval_dataset_name?",
                CASE WHEN j.status = ?1 THEN
                    (SELECT COUNT(*) FROM jobs q
                     WHERE q.device = j.device AND q.status = ?1 AND q.queue_seq <= j.queue_seq)
                END AS "position: i64",
                (SELECT token FROM demo_links l WHERE l.job_id = j.id) AS "demo_token: String",
                s.best_loss AS "best_loss?: f64", s.best_loss_step AS "best_loss_step?: i64",
                s.final_loss AS "final_loss?: f64", s.final_eval_loss AS "final_eval_loss?: f64",
                s.best_eval_loss AS "best_eval_loss?: f64",
                s.best_eval_step AS "best_eval_step?: i64",
                s.task_before AS "task_before?: f64", s.task_score AS "task_score?: f64",
                s.task_step AS "task_step?: i64", s.tokens_seen AS "tokens_seen?: i64",
                s.trained_tokens AS "trained_tokens?: i64",
                CASE WHEN s.step_s > 0 THEN s.tokens_seen / s.step_s END AS "tokens_per_s?: f64"
         FROM jobs j
         LEFT JOIN users u ON u.id = j.owner_id
         LEFT JOIN datasets d ON d.id = j.dataset_id
         LEFT JOIN datasets e ON e.id = j.eval_dataset_id
         LEFT JOIN job_summaries s ON s.job_id = j.id
         WHERE (?2 IS NULL OR j.owner_id = ?2) AND (?3 IS NULL OR j.id = ?3)
         ORDER BY j.id DESC"#,
        JobStatus::Queued,
        owner,
        job,
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| Listed {
            row: JobRow {
                id: r.id,
                owner_id: r.owner_id,
                model: r.model,
                dataset_id: r.dataset_id,
                device: r.device,
                config: r.config,
                status: r.status,
                queue_seq: r.queue_seq,
                error: r.error,
                total_steps: r.total_steps,
                step: r.step,
                start_step: r.start_step,
                started_at: r.started_at,
                finished_at: r.finished_at,
                resume_from: r.resume_from,
                created_at: r.created_at,
                eval_dataset_id: r.eval_dataset_id,
                placement: r.placement,
                name: r.name,
                note: r.note,
                resume_ended: r.resume_ended,
            },
            owner: r.owner,
            dataset_name: r.dataset_name,
            eval_dataset_name: r.eval_dataset_name,
            position: r.position,
            demo_token: r.demo_token,
            summary: MetricSummary {
                best_loss: r.best_loss,
                best_loss_step: r.best_loss_step,
                final_loss: r.final_loss,
                final_eval_loss: r.final_eval_loss,
                best_eval_loss: r.best_eval_loss,
                best_eval_step: r.best_eval_step,
                task_before: r.task_before,
                task_score: r.task_score,
                task_step: r.task_step,
                tokens_seen: r.tokens_seen,
                trained_tokens: r.trained_tokens,
                tokens_per_s: r.tokens_per_s,
            },
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Job 1's summary row, every column as SQL text (`quote`: NULL, types and full precision).
    async fn summary(pool: &SqlitePool) -> Vec<String> {
        let row: Option<(String,)> = sqlx::query_as(
            "SELECT concat_ws(' ', quote(last_step), quote(best_loss), quote(best_loss_step), quote(final_loss), quote(final_eval_loss), quote(best_eval_loss), quote(best_eval_step), quote(task_before), quote(task_score), quote(task_step), quote(tokens_seen), quote(trained_tokens), quote(step_s))
             FROM job_summaries WHERE job_id = 1",
        )
        .fetch_optional(pool)
        .await
        .unwrap();
        row.map(|(text,)| text.split(' ').map(str::to_string).collect()).unwrap_or_default()
    }

    /// The summary kept step by step, against the one recomputed from all the points.
    async fn check(pool: &SqlitePool, when: &str) {
        let kept = summary(pool).await;
        summarise_again(&mut pool.acquire().await.unwrap(), Some(1)).await.unwrap();
        assert_eq!(kept, summary(pool).await, "{when}");
    }

    /// A point as the runner stores it: figures missing on some steps, ties among the losses,
    /// a per-unit timeline the summary ignores.
    fn point(step: i64) -> String {
        let loss = [2.5, 1.75, 2.0, 1.75, 0.5][step as usize % 5] + (step / 10) as f64;
        let mut p = serde_json::json!({
            "step": step,
            "loss": loss,
            "tokens": 1000 + step,
            "step_s": 0.25,
            "timeline": [{"unit": 0, "t": 0.1}],
        });
        if step % 7 == 6 {
            p["loss"] = serde_json::Value::Null;
        }
        if step % 3 == 0 {
            p["eval_loss"] = serde_json::json!([3.0, 2.0, 2.0, 2.5][step as usize % 4]);
            p["trained_tokens"] = serde_json::json!(500 + step);
        }
        if step % 4 == 0 {
            p["task_score"] = serde_json::json!(step as f64 / 100.0);
        }
        p.to_string()
    }

    #[tokio::test]
    async fn the_summary_kept_step_by_step_is_the_one_from_all_the_points() {
        let dir = tempfile::tempdir().unwrap();
        let pool = crate::db::open(&dir.path().join("sluice.db")).await.unwrap();
        for sql in [
            "INSERT INTO users (id, username, password_hash, role, created_at)
             VALUES (1, 'a', 'x', 'admin', 0)",
            "INSERT INTO datasets (id, owner_id, name, file_name, format, records, size_bytes,
                 created_at) VALUES (1, 1, 'd', 'd.jsonl', 'alpaca', 1, 1, 0)",
            "INSERT INTO jobs (id, owner_id, model, dataset_id, device, config, status,
                 queue_seq, created_at) VALUES (1, 1, 'preset:tiny', 1, 'cpu', '{}', 'running', 1, 0)",
        ] {
            sqlx::query(sql).execute(&pool).await.unwrap();
        }
        assert!(summary(&pool).await.is_empty(), "a job with no points has no summary");
        // Step 0 is stored twice (the base model's score, then the held-out loss beside it).
        record_step(&pool, 1, 0, &point(0)).await.unwrap();
        check(&pool, "step 0").await;
        record_step(&pool, 1, 0, &point(3)).await.unwrap();
        check(&pool, "step 0 stored again").await;
        for step in 1..=40 {
            record_step(&pool, 1, step, &point(step)).await.unwrap();
            check(&pool, &format!("step {step}")).await;
        }
        // Resumed from step 17: later points go, and the summary with them.
        sqlx::query("UPDATE jobs SET status = 'cancelled' WHERE id = 1")
            .execute(&pool)
            .await
            .unwrap();
        assert!(requeue(&pool, 1, 1, 17, 10).await.unwrap());
        let kept = summary(&pool).await;
        assert_eq!(kept[0], "17", "{kept:?}");
        assert_eq!(kept.len(), 13, "{kept:?}");
        check(&pool, "after the resume").await;
        for step in 18..=25 {
            record_step(&pool, 1, step, &point(step)).await.unwrap();
            check(&pool, &format!("step {step} after the resume")).await;
        }
        // Summaries of jobs stored before they were kept are made at start.
        let before = summary(&pool).await;
        assert_eq!(before[0], "25", "{before:?}");
        sqlx::query("DELETE FROM job_summaries").execute(&pool).await.unwrap();
        summarise_again(&mut pool.acquire().await.unwrap(), None).await.unwrap();
        assert_eq!(summary(&pool).await, before);
    }
}
