//! The `datasets` table, and the `meta` flag that says the demo dataset was registered once.

use serde::{Serialize, Serializer};
use sqlx::{FromRow, SqlitePool};

use super::jobs::JobStatus;
use crate::db::now;

#[derive(Debug, Clone, Serialize, FromRow)]
pub struct Dataset {
    pub id: i64,
    pub name: String,
    pub format: String,
    pub records: i64,
    pub size_bytes: i64,
    pub created_at: i64,
    /// The owner's username; `null` for a dataset shared with everyone (the demo).
    pub owner: Option<String>,
    #[serde(skip)]
    pub owner_id: Option<i64>,
    #[serde(skip)]
    pub file_name: String,
    /// `jsonl`, `json`, `csv`, `tsv` or `parquet`.
    pub layout: String,
    /// Uploaded leniently: invalid records are left out, here and in every job.
    pub skip_invalid: bool,
    /// Records left out as invalid.
    pub skipped: i64,
    /// The first 100 of them: `[{"line", "reason"}]` (`line` counts rows of Parquet files and
    /// records of JSON arrays).
    #[serde(serialize_with = "stored_json")]
    pub skipped_records: String,
    /// The column mapping records are read with: `{"instruction": "question", ...}`.
    #[serde(serialize_with = "stored_json")]
    pub columns: String,
    /// The one-entry `dataset_info.json` kept beside the file, for a dataset uploaded with its
    /// LLaMA-Factory registry.
    #[serde(skip)]
    pub registry_file: Option<String>,
    /// That registry's entry: the dataset's name in LLaMA-Factory's terms.
    pub registry_name: Option<String>,
}

const SELECT: &str = "SELECT d.id, d.name, d.format, d.records, d.size_bytes, d.created_at,
        u.username AS owner, d.owner_id, d.file_name, d.layout, d.skip_invalid, d.skipped,
        d.skipped_records, d.columns, d.registry_file, d.registry_name
    FROM datasets d LEFT JOIN users u ON u.id = d.owner_id";

/// A column of JSON text the server wrote, sent as the JSON it holds (`null` if damaged).
fn stored_json<S: Serializer>(text: &str, serializer: S) -> Result<S::Ok, S::Error> {
    serde_json::from_str::<serde_json::Value>(text)
        .unwrap_or(serde_json::Value::Null)
        .serialize(serializer)
}

/// A dataset to record: the file is in place and linted.
#[derive(Debug)]
pub struct NewDataset<'a> {
    /// `None` for the demo, shared with everyone.
    pub owner_id: Option<i64>,
    pub name: &'a str,
    pub file_name: &'a str,
    pub format: &'a str,
    pub records: i64,
    pub size_bytes: i64,
}

/// How an uploaded dataset is read, as stored beside it.
#[derive(Debug)]
pub struct Layout<'a> {
    pub layout: &'a str,
    pub skip_invalid: bool,
    pub skipped: i64,
    pub skipped_records: &'a str,
    pub columns: &'a str,
    /// The kept `dataset_info.json` and the dataset's name in it.
    pub registry: Option<(&'a str, &'a str)>,
}

/// Dataset `id`, if it exists.
pub async fn get(pool: &SqlitePool, id: i64) -> sqlx::Result<Option<Dataset>> {
    sqlx::query_as(&format!("{SELECT} WHERE d.id = ?")).bind(id).fetch_optional(pool).await
}

/// Every dataset (`viewer` `None`), or those of user `viewer` and the shared ones, oldest first.
pub async fn visible_to(pool: &SqlitePool, viewer: Option<i64>) -> sqlx::Result<Vec<Dataset>> {
    match viewer {
        None => sqlx::query_as(&format!("{SELECT} ORDER BY d.id")).fetch_all(pool).await,
        Some(user) => {
            sqlx::query_as(&format!(
                "{SELECT} WHERE d.owner_id = ? OR d.owner_id IS NULL ORDER BY d.id"
            ))
            .bind(user)
            .fetch_all(pool)
            .await
        }
    }
}

/// The datasets `owner_id` uploaded.
pub async fn owned_by(pool: &SqlitePool, owner_id: i64) -> sqlx::Result<Vec<Dataset>> {
    sqlx::query_as(&format!("{SELECT} WHERE d.owner_id = ?")).bind(owner_id).fetch_all(pool).await
}

/// The datasets of `ids` that exist: one query for any number.
pub async fn by_ids(pool: &SqlitePool, ids: &[i64]) -> sqlx::Result<Vec<Dataset>> {
    let list = serde_json::Value::from(ids.to_vec()).to_string();
    sqlx::query_as(&format!("{SELECT} WHERE d.id IN (SELECT value FROM json_each(?))"))
        .bind(list)
        .fetch_all(pool)
        .await
}

/// Bytes of the datasets `owner_id` uploaded (`None`: of the shared ones).
pub async fn bytes_of(pool: &SqlitePool, owner_id: Option<i64>) -> sqlx::Result<i64> {
    sqlx::query_scalar("SELECT COALESCE(SUM(size_bytes), 0) FROM datasets WHERE owner_id IS ?")
        .bind(owner_id)
        .fetch_one(pool)
        .await
}

/// Records an uploaded dataset, read as `layout` says; its id.
pub async fn insert(
    pool: &SqlitePool,
    new: &NewDataset<'_>,
    layout: &Layout<'_>,
) -> sqlx::Result<i64> {
    let inserted = sqlx::query(
        "INSERT INTO datasets (owner_id, name, file_name, format, records, size_bytes, created_at,
            layout, skip_invalid, skipped, skipped_records, columns, registry_file, registry_name)
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    )
    .bind(new.owner_id)
    .bind(new.name)
    .bind(new.file_name)
    .bind(new.format)
    .bind(new.records)
    .bind(new.size_bytes)
    .bind(now())
    .bind(layout.layout)
    .bind(layout.skip_invalid)
    .bind(layout.skipped)
    .bind(layout.skipped_records)
    .bind(layout.columns)
    .bind(layout.registry.map(|(file, _)| file))
    .bind(layout.registry.map(|(_, name)| name))
    .execute(pool)
    .await?;
    Ok(inserted.last_insert_rowid())
}

/// Whether the demo dataset was registered (it is never registered again, even once deleted).
pub async fn demo_registered(pool: &SqlitePool) -> sqlx::Result<bool> {
    let done: Option<String> =
        sqlx::query_scalar("SELECT value FROM meta WHERE key = 'demo_dataset_registered'")
            .fetch_optional(pool)
            .await?;
    Ok(done.is_some())
}

/// Records the demo dataset and that it was registered, together.
pub async fn register_demo(pool: &SqlitePool, demo: &NewDataset<'_>) -> sqlx::Result<()> {
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO datasets (owner_id, name, file_name, format, records, size_bytes, created_at)
         VALUES (?, ?, ?, ?, ?, ?, ?)",
    )
    .bind(demo.owner_id)
    .bind(demo.name)
    .bind(demo.file_name)
    .bind(demo.format)
    .bind(demo.records)
    .bind(demo.size_bytes)
    .bind(now())
    .execute(&mut *tx)
    .await?;
    sqlx::query("INSERT INTO meta (key, value) VALUES ('demo_dataset_registered', '1')")
        .execute(&mut *tx)
        .await?;
    tx.commit().await
}

/// Deletes dataset `dataset_id` unless a queued or running job trains on it or evaluates with
/// it, in one statement, so no submit or resume can slip in between the check and the delete.
/// Says whether it was deleted.
pub async fn delete_dataset_if_unused(pool: &SqlitePool, dataset_id: i64) -> sqlx::Result<bool> {
    let deleted = sqlx::query(&format!(
        "DELETE FROM datasets WHERE id = ?
           AND NOT EXISTS (SELECT 1 FROM jobs WHERE (dataset_id = ? OR eval_dataset_id = ?)
                                              AND status IN {})",
        JobStatus::ACTIVE_SQL
    ))
    .bind(dataset_id)
    .bind(dataset_id)
    .bind(dataset_id)
    .execute(pool)
    .await?;
    Ok(deleted.rows_affected() == 1)
}
