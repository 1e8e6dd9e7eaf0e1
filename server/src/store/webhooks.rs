//! The `webhooks` table: a user's webhook and how its latest delivery went.

use serde::Serialize;
use sqlx::SqlitePool;

/// A user's webhook and how its latest delivery went.
#[derive(Debug, Clone, Serialize)]
pub struct WebhookView {
    pub url: String,
    pub updated_at: i64,
    /// The job the latest delivery was about (`None` for a test, or before any).
    pub last_job_id: Option<i64>,
    pub last_at: Option<i64>,
    pub last_ok: Option<bool>,
    /// "HTTP 200", or why the delivery failed.
    pub last_result: Option<String>,
}

/// `user_id`'s webhook, if they set one.
pub async fn get(pool: &SqlitePool, user_id: i64) -> sqlx::Result<Option<WebhookView>> {
    sqlx::query_as!(
        WebhookView,
        r#"SELECT url, updated_at, last_job_id, last_at, last_ok AS "last_ok: bool", last_result
           FROM webhooks WHERE user_id = ?"#,
        user_id
    )
    .fetch_optional(pool)
    .await
}

/// Removes `user_id`'s webhook.
pub async fn delete(pool: &SqlitePool, user_id: i64) -> sqlx::Result<()> {
    sqlx::query!("DELETE FROM webhooks WHERE user_id = ?", user_id).execute(pool).await?;
    Ok(())
}

/// Sets `user_id`'s webhook to `url` (checked); a new URL starts with no delivery result.
pub async fn set(pool: &SqlitePool, user_id: i64, url: &str, now: i64) -> sqlx::Result<()> {
    sqlx::query!(
        "INSERT INTO webhooks (user_id, url, updated_at) VALUES (?, ?, ?)
         ON CONFLICT (user_id) DO UPDATE SET url = excluded.url,
           updated_at = excluded.updated_at, last_job_id = NULL, last_at = NULL,
           last_ok = NULL, last_result = NULL
         WHERE webhooks.url <> excluded.url",
        user_id,
        url,
        now,
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Stores the outcome of a delivery to `url` about `job_id` (`None`: a test), unless the
/// webhook changed meanwhile or it already holds the outcome of one about a job that ended
/// later (deliveries run side by side and retries take their time).
pub async fn record(
    pool: &SqlitePool,
    user_id: i64,
    url: &str,
    job_id: Option<i64>,
    at: i64,
    ok: bool,
    result: &str,
) -> sqlx::Result<()> {
    sqlx::query!(
        "UPDATE webhooks SET last_job_id = ?1, last_at = ?2, last_ok = ?3, last_result = ?4
         WHERE user_id = ?5 AND url = ?6
           AND NOT EXISTS (
             SELECT 1 FROM jobs later, jobs this
             WHERE later.id = webhooks.last_job_id AND this.id = ?1
               AND (COALESCE(later.finished_at, 0), later.id)
                 > (COALESCE(this.finished_at, 0), this.id))",
        job_id,
        at,
        ok,
        result,
        user_id,
        url,
    )
    .execute(pool)
    .await?;
    Ok(())
}
