//! The `users` table.

use serde::Serialize;
use sqlx::{FromRow, SqlitePool};

use super::jobs::JobStatus;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, FromRow)]
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
    sqlx::query_scalar("SELECT username FROM users WHERE id = ?")
        .bind(id)
        .fetch_optional(pool)
        .await
}

/// Deletes user `user_id` (their sessions, datasets and jobs go with them) unless they have a
/// queued or running job, in one statement. Says whether they were deleted.
pub async fn delete_user_if_idle(pool: &SqlitePool, user_id: i64) -> sqlx::Result<bool> {
    let deleted = sqlx::query(&format!(
        "DELETE FROM users WHERE id = ?
           AND NOT EXISTS (SELECT 1 FROM jobs WHERE owner_id = ? AND status IN {})",
        JobStatus::ACTIVE_SQL
    ))
    .bind(user_id)
    .bind(user_id)
    .execute(pool)
    .await?;
    Ok(deleted.rows_affected() == 1)
}

/// User `id`'s quota in bytes: `None` when there is no such user or no quota.
pub async fn quota(pool: &SqlitePool, id: i64) -> sqlx::Result<Option<i64>> {
    let quota: Option<Option<i64>> =
        sqlx::query_scalar("SELECT quota_bytes FROM users WHERE id = ?")
            .bind(id)
            .fetch_optional(pool)
            .await?;
    Ok(quota.flatten())
}

/// Every user's id, name and quota, by id.
pub async fn quotas(pool: &SqlitePool) -> sqlx::Result<Vec<(i64, String, Option<i64>)>> {
    sqlx::query_as("SELECT id, username, quota_bytes FROM users ORDER BY id").fetch_all(pool).await
}

/// Sets user `id`'s quota (`None`: none); whether the user exists.
pub async fn set_quota(pool: &SqlitePool, id: i64, quota: Option<i64>) -> sqlx::Result<bool> {
    let updated = sqlx::query("UPDATE users SET quota_bytes = ? WHERE id = ?")
        .bind(quota)
        .bind(id)
        .execute(pool)
        .await?;
    Ok(updated.rows_affected() == 1)
}

/// A user as the admin's list shows them.
#[derive(Debug, Serialize, FromRow)]
pub struct UserView {
    pub id: i64,
    pub username: String,
    pub role: String,
    pub created_at: i64,
}

/// Every user, by id.
pub async fn list(pool: &SqlitePool) -> sqlx::Result<Vec<UserView>> {
    sqlx::query_as("SELECT id, username, role, created_at FROM users ORDER BY id")
        .fetch_all(pool)
        .await
}

/// The id of the user called `username`, if there is one.
pub async fn id_of(pool: &SqlitePool, username: &str) -> sqlx::Result<Option<i64>> {
    sqlx::query_scalar("SELECT id FROM users WHERE username = ?")
        .bind(username)
        .fetch_optional(pool)
        .await
}

/// Whether user `id` exists.
pub async fn exists(pool: &SqlitePool, id: i64) -> sqlx::Result<bool> {
    let found: Option<i64> = sqlx::query_scalar("SELECT id FROM users WHERE id = ?")
        .bind(id)
        .fetch_optional(pool)
        .await?;
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
    sqlx::query_as(
        "INSERT INTO users (username, password_hash, role, created_at) VALUES (?, ?, ?, ?)
         RETURNING id, username, role, created_at",
    )
    .bind(username)
    .bind(hash)
    .bind(role)
    .bind(now)
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
    let created = sqlx::query(
        "INSERT INTO users (username, password_hash, role, created_at)
         SELECT ?, ?, 'admin', ? WHERE NOT EXISTS (SELECT 1 FROM users)",
    )
    .bind(username)
    .bind(hash)
    .bind(now)
    .execute(pool)
    .await?;
    Ok((created.rows_affected() > 0).then(|| created.last_insert_rowid()))
}

/// How many users there are.
pub async fn count(pool: &SqlitePool) -> sqlx::Result<i64> {
    sqlx::query_scalar("SELECT COUNT(*) FROM users").fetch_one(pool).await
}

/// The id and password hash of the user called `username`, for a login.
pub async fn login_of(pool: &SqlitePool, username: &str) -> sqlx::Result<Option<(i64, String)>> {
    sqlx::query_as("SELECT id, password_hash FROM users WHERE username = ?")
        .bind(username)
        .fetch_optional(pool)
        .await
}

/// User `id`.
pub async fn get(pool: &SqlitePool, id: i64) -> sqlx::Result<User> {
    sqlx::query_as("SELECT id, username, role FROM users WHERE id = ?")
        .bind(id)
        .fetch_one(pool)
        .await
}
