//! The `api_tokens` table: personal API tokens, stored as their SHA-256.

use serde::Serialize;
use sqlx::SqlitePool;

use super::users::User;

/// A token as its owner sees it in the list (never the token itself).
#[derive(Debug, Clone, Serialize)]
pub struct TokenView {
    pub id: i64,
    pub name: String,
    /// The token's first characters ("sluice_1a2b3c4d").
    pub prefix: String,
    pub created_at: i64,
    pub last_used_at: Option<i64>,
}

/// A token's owner, found by the token's hash.
#[derive(Debug)]
pub struct Holder {
    pub token_id: i64,
    pub last_used_at: Option<i64>,
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
    let found = sqlx::query!(
        r#"SELECT t.id AS "token_id!", t.last_used_at, u.id AS "id!", u.username, u.role
           FROM api_tokens t JOIN users u ON u.id = t.user_id WHERE t.token_hash = ?"#,
        hash
    )
    .fetch_optional(pool)
    .await?;
    Ok(found.map(|r| Holder {
        token_id: r.token_id,
        last_used_at: r.last_used_at,
        user: User { id: r.id, username: r.username, role: r.role },
    }))
}

/// Notes that token `id` was used at `now`.
pub async fn touch(pool: &SqlitePool, id: i64, now: i64) -> sqlx::Result<()> {
    sqlx::query!("UPDATE api_tokens SET last_used_at = ? WHERE id = ?", now, id)
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
    sqlx::query_as!(
        TokenView,
        r#"INSERT INTO api_tokens (user_id, name, token_hash, prefix, created_at)
         SELECT ?1, ?2, ?3, ?4, ?5 WHERE (SELECT COUNT(*) FROM api_tokens WHERE user_id = ?1) < ?6
         RETURNING id AS "id!: i64", name AS "name!", prefix AS "prefix!",
                   created_at AS "created_at!: i64", last_used_at"#,
        new.user_id,
        new.name,
        new.hash,
        new.prefix,
        now,
        max,
    )
    .fetch_optional(pool)
    .await
}

/// `user_id`'s tokens, newest first.
pub async fn list(pool: &SqlitePool, user_id: i64) -> sqlx::Result<Vec<TokenView>> {
    sqlx::query_as!(
        TokenView,
        r#"SELECT id AS "id!", name, prefix, created_at, last_used_at FROM api_tokens
           WHERE user_id = ? ORDER BY id DESC"#,
        user_id
    )
    .fetch_all(pool)
    .await
}

/// Revokes token `id` of `user_id`; `false` when they hold no such token.
pub async fn revoke(pool: &SqlitePool, user_id: i64, id: i64) -> sqlx::Result<bool> {
    let gone = sqlx::query!("DELETE FROM api_tokens WHERE id = ? AND user_id = ?", id, user_id)
        .execute(pool)
        .await?;
    Ok(gone.rows_affected() > 0)
}
