//! The `users` table.

use serde::Serialize;
use sqlx::SqlitePool;

use super::jobs::JobStatus;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct User {
    pub id: i64,
    pub username: String,
    /// "admin" or "user".
    pub role: String,
}

impl User {
    pub fn is_admin(&self) -> bool {
        self.role == "admin"
    }
}

/// The name of user `id`, if they exist.
pub async fn username(pool: &SqlitePool, id: i64) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar!("SELECT username FROM users WHERE id = ?", id).fetch_optional(pool).await
}

/// Deletes user `user_id` (their sessions, datasets and jobs go with them) unless they have a
/// queued or running job, in one statement. Says whether they were deleted.
pub async fn delete_user_if_idle(pool: &SqlitePool, user_id: i64) -> sqlx::Result<bool> {
    let [queued, running] = JobStatus::ACTIVE;
    let deleted = sqlx::query!(
        "DELETE FROM users WHERE id = ?1
           AND NOT EXISTS (SELECT 1 FROM jobs WHERE owner_id = ?1 AND status IN (?2, ?3))",
        user_id,
        queued,
        running,
    )
    .execute(pool)
    .await?;
    Ok(deleted.rows_affected() == 1)
}

/// User `id`'s quota in bytes: `None` when there is no such user or no quota.
pub async fn quota(pool: &SqlitePool, id: i64) -> sqlx::Result<Option<i64>> {
    let quota = sqlx::query_scalar!("SELECT quota_bytes FROM users WHERE id = ?", id)
        .fetch_optional(pool)
        .await?;
    Ok(quota.flatten())
}

/// Every user's id, name and quota, by id.
pub async fn quotas(pool: &SqlitePool) -> sqlx::Result<Vec<(i64, String, Option<i64>)>> {
    let rows = sqlx::query!(r#"SELECT id AS "id!", username, quota_bytes FROM users ORDER BY id"#)
        .fetch_all(pool)
        .await?;
    Ok(rows.into_iter().map(|r| (r.id, r.username, r.quota_bytes)).collect())
}

/// Sets user `id`'s quota (`None`: none); whether the user exists.
pub async fn set_quota(pool: &SqlitePool, id: i64, quota: Option<i64>) -> sqlx::Result<bool> {
    let updated = sqlx::query!("UPDATE users SET quota_bytes = ? WHERE id = ?", quota, id)
        .execute(pool)
        .await?;
    Ok(updated.rows_affected() == 1)
}

/// A user as the admin's list shows them.
#[derive(Debug, Serialize)]
pub struct UserView {
    pub id: i64,
    pub username: String,
    pub role: String,
    pub created_at: i64,
}

/// Every user, by id.
pub async fn list(pool: &SqlitePool) -> sqlx::Result<Vec<UserView>> {
    sqlx::query_as!(
        UserView,
        r#"SELECT id AS "id!", username, role, created_at FROM users ORDER BY id"#
    )
    .fetch_all(pool)
    .await
}

/// The id of the user called `username`, if there is one.
pub async fn id_of(pool: &SqlitePool, username: &str) -> sqlx::Result<Option<i64>> {
    sqlx::query_scalar!(r#"SELECT id AS "id!" FROM users WHERE username = ?"#, username)
        .fetch_optional(pool)
        .await
}

/// Whether user `id` exists.
pub async fn exists(pool: &SqlitePool, id: i64) -> sqlx::Result<bool> {
    let found =
        sqlx::query_scalar!("SELECT id FROM users WHERE id = ?", id).fetch_optional(pool).await?;
    Ok(found.is_some())
}

/// Adds a user with password hash `hash` and `role`, created `now`.
pub async fn insert(
    pool: &SqlitePool,
    username: &str,
    hash: &str,
    role: &str,
    now: i64,
) -> sqlx::Result<UserView> {
    sqlx::query_as!(
        UserView,
        r#"INSERT INTO users (username, password_hash, role, created_at) VALUES (?, ?, ?, ?)
         RETURNING id AS "id!", username, role, created_at"#,
        username,
        hash,
        role,
        now,
    )
    .fetch_one(pool)
    .await
}

/// Adds the first admin, unless a user exists, in one statement (two racing setups make one
/// admin); the new id, or `None`.
pub async fn insert_first_admin(
    pool: &SqlitePool,
    username: &str,
    hash: &str,
    now: i64,
) -> sqlx::Result<Option<i64>> {
    let created = sqlx::query!(
        "INSERT INTO users (username, password_hash, role, created_at)
         SELECT ?, ?, 'admin', ? WHERE NOT EXISTS (SELECT 1 FROM users)",
        username,
        hash,
        now,
    )
    .execute(pool)
    .await?;
    Ok((created.rows_affected() > 0).then(|| created.last_insert_rowid()))
}

/// How many users there are.
pub async fn count(pool: &SqlitePool) -> sqlx::Result<i64> {
    sqlx::query_scalar!(r#"SELECT COUNT(*) AS "count!: i64" FROM users"#).fetch_one(pool).await
}

/// The id and password hash of the user called `username`, for a login.
pub async fn login_of(pool: &SqlitePool, username: &str) -> sqlx::Result<Option<(i64, String)>> {
    let found = sqlx::query!(
        r#"SELECT id AS "id!", password_hash FROM users WHERE username = ?"#,
        username
    )
    .fetch_optional(pool)
    .await?;
    Ok(found.map(|r| (r.id, r.password_hash)))
}

/// User `id`.
pub async fn get(pool: &SqlitePool, id: i64) -> sqlx::Result<User> {
    sqlx::query_as!(User, "SELECT id, username, role FROM users WHERE id = ?", id)
        .fetch_one(pool)
        .await
}

/// User `id`'s password hash, if they exist.
pub async fn password_hash(pool: &SqlitePool, id: i64) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar!("SELECT password_hash FROM users WHERE id = ?", id)
        .fetch_optional(pool)
        .await
}

/// Gives user `id` the password hash `hash` and ends every session of theirs but `keep` (the
/// one making the change, when it is theirs), in one transaction: a session opened with the
/// old password never outlives the change. Says whether the user exists. API tokens are left
/// alone: they are credentials of their own, revoked one by one.
pub async fn set_password(
    pool: &SqlitePool,
    id: i64,
    hash: &str,
    keep: Option<&str>,
) -> sqlx::Result<bool> {
    let mut tx = pool.begin().await?;
    let updated = sqlx::query!("UPDATE users SET password_hash = ? WHERE id = ?", hash, id)
        .execute(&mut *tx)
        .await?;
    if updated.rows_affected() != 1 {
        return Ok(false);
    }
    sqlx::query!(
        "DELETE FROM sessions WHERE user_id = ?1 AND (?2 IS NULL OR token <> ?2)",
        id,
        keep,
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(true)
}
