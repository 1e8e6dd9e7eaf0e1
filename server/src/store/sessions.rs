//! The `sessions` table, and the key anonymous CSRF tokens are made with (kept in `meta`).

use sqlx::SqlitePool;

use super::users::User;

/// A session to record.
#[derive(Debug)]
pub struct NewSession<'a> {
    pub token: &'a str,
    pub user_id: i64,
    pub csrf: &'a str,
    pub expires_at: i64,
}

/// A live session with its user.
#[derive(Debug)]
pub struct Live {
    pub csrf: String,
    pub expires_at: i64,
    pub user: User,
}

/// The session `token`, if it has not expired by `now`.
pub async fn live(pool: &SqlitePool, token: &str, now: i64) -> sqlx::Result<Option<Live>> {
    let found = sqlx::query!(
        r#"SELECT s.csrf, s.expires_at, u.id AS "id!", u.username, u.role
           FROM sessions s JOIN users u ON u.id = s.user_id
           WHERE s.token = ? AND s.expires_at > ?"#,
        token,
        now,
    )
    .fetch_optional(pool)
    .await?;
    Ok(found.map(|r| Live {
        csrf: r.csrf,
        expires_at: r.expires_at,
        user: User { id: r.id, username: r.username, role: r.role },
    }))
}

/// Records `new`, drops sessions expired by `now`, and ends the user's oldest beyond `max`.
pub async fn insert(
    pool: &SqlitePool,
    new: &NewSession<'_>,
    now: i64,
    max: i64,
) -> sqlx::Result<()> {
    sqlx::query!("DELETE FROM sessions WHERE expires_at <= ?", now).execute(pool).await?;
    sqlx::query!(
        "INSERT INTO sessions (token, user_id, csrf, expires_at) VALUES (?, ?, ?, ?)",
        new.token,
        new.user_id,
        new.csrf,
        new.expires_at,
    )
    .execute(pool)
    .await?;
    sqlx::query!(
        "DELETE FROM sessions WHERE user_id = ?1 AND token NOT IN
         (SELECT token FROM sessions WHERE user_id = ?1 ORDER BY expires_at DESC LIMIT ?2)",
        new.user_id,
        max,
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Ends session `token`.
pub async fn delete(pool: &SqlitePool, token: &str) -> sqlx::Result<()> {
    sqlx::query!("DELETE FROM sessions WHERE token = ?", token).execute(pool).await?;
    Ok(())
}

/// The CSRF key: the one stored, or `fresh`, stored now. Two first requests racing here both
/// end up with the one row that was inserted.
pub async fn csrf_key(pool: &SqlitePool, fresh: &str) -> sqlx::Result<String> {
    sqlx::query!("INSERT OR IGNORE INTO meta (key, value) VALUES ('csrf_key', ?)", fresh)
        .execute(pool)
        .await?;
    sqlx::query_scalar!("SELECT value FROM meta WHERE key = 'csrf_key'").fetch_one(pool).await
}
