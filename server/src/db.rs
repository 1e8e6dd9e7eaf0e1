//! The embedded SQLite database: opened in WAL mode with foreign keys on, migrated at start
//! from `migrations/` (append-only: never edit a migration that has run).

use std::path::Path;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

/// Opens (creating if missing) and migrates the database at `path`.
pub async fn open(path: &Path) -> anyhow::Result<SqlitePool> {
    let options = SqliteConnectOptions::from_str("sqlite://")
        .context("sqlite options")?
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        // NORMAL is durable across application crashes in WAL mode; only a power cut may lose
        // the last transactions, which for metrics and logs is acceptable.
        .synchronous(SqliteSynchronous::Normal)
        .foreign_keys(true)
        .busy_timeout(Duration::from_secs(10));
    let pool = SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .with_context(|| format!("cannot open the database {}", path.display()))?;
    sqlx::migrate!("../migrations")
        .run(&pool)
        .await
        .with_context(|| format!("cannot migrate the database {}", path.display()))?;
    Ok(pool)
}

/// Unix time in whole seconds.
pub fn now() -> i64 {
    now_f64() as i64
}

/// Unix time in seconds with sub-second precision.
pub fn now_f64() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}
