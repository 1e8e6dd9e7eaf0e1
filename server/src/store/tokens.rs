//! The `api_tokens` table: personal API tokens, stored as their SHA-256.

use serde::Serialize;
use sqlx::{FromRow, SqlitePool};

use super::users::User;

/// A token as its owner sees it in the list (never the token itself).
#[derive(Debug, Clone, Serialize, FromRow)]
pub struct TokenView {
    pub id: i64,
    pub name: String,
    /// The token's first characters ("sluice_1a2b3c4d").
    pub prefix: String,
    pub created_at: i64,
    pub last_used_at: Option<i64>,
}

/// A token's owner, found by the token's hash.
#[derive(Debug, FromRow)]
pub struct Holder {
    pub token_id: i64,
    pub last_used_at: Option<i64>,
    #[sqlx(flatten)]
    pub user: User,
}

/// A token to record.
#[derive(Debug)]
pub struct NewToken<'a> {
    pub user_id: i64,
    pub name: &'a str,
    /// The token's SHA-256, as hex.
    pub hash: &'a str,
    /// Its first characters, shown in the list.
    pub prefix: &'a str,
}

/// The token whose hash is `hash`, with its user.
pub async fn by_hash(pool: &SqlitePool, hash: &str) -> sqlx::Result<Option<Holder>> {
    sqlx::query_as(
        "SELECT t.id AS token_id, t.last_used_at, u.id, u.username, u.role
         FROM api_tokens t JOIN users u ON u.id = t.user_id WHERE t.token_hash = ?",
    )
    .bind(hash)
    .fetch_optional(pool)
    .await
}

/// Notes that token `id` was used at `now`.
pub async fn touch(pool: &SqlitePool, id: i64, now: i64) -> sqlx::Result<()> {
    sqlx::query("UPDATE api_tokens SET last_used_at = ? WHERE id = ?")
        .bind(now)
        .bind(id)
        .execute(pool)
        .await?;
    Ok(())
}

/// Records `new` unless its user holds `max` tokens already (the count and the insert are one
/// statement, so racing requests cannot pass the limit); `None` then.
pub async fn insert(
    pool: &SqlitePool,
    new: &NewToken<'_>,
    now: i64,
    max: i64,
) -> sqlx::Result<Option<TokenView>> {
    sqlx::query_as(
        "INSERT INTO api_tokens (user_id, name, token_hash, prefix, created_at)
         SELECT ?, ?, ?, ?, ? WHERE (SELECT COUNT(*) FROM api_tokens WHERE user_id = ?) < ?
         RETURNING id, name, prefix, created_at, last_used_at",
    )
    .bind(new.user_id)
    .bind(new.name)
    .bind(new.hash)
    .bind(new.prefix)
    .bind(now)
    .bind(new.user_id)
    .bind(max)
    .fetch_optional(pool)
    .await
}

/// `user_id`'s tokens, newest first.
pub async fn list(pool: &SqlitePool, user_id: i64) -> sqlx::Result<Vec<TokenView>> {
    sqlx::query_as(
        "SELECT id, name, prefix, created_at, last_used_at FROM api_tokens
         WHERE user_id = ? ORDER BY id DESC",
    )
    .bind(user_id)
    .fetch_all(pool)
    .await
}

/// Revokes token `id` of `user_id`; `false` when they hold no such token.
pub async fn revoke(pool: &SqlitePool, user_id: i64, id: i64) -> sqlx::Result<bool> {
    let gone = sqlx::query("DELETE FROM api_tokens WHERE id = ? AND user_id = ?")
        .bind(id)
        .bind(user_id)
        .execute(pool)
        .await?;
    Ok(gone.rows_affected() > 0)
}
