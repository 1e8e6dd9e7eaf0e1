//! The `datasets` table, and the `meta` flag that says the demo dataset was registered once.

use serde::{Serialize, Serializer};
use sqlx::SqlitePool;

use super::jobs::JobStatus;
use crate::db::now;

#[derive(Debug, Clone, Serialize)]
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

/// Which datasets [`select`] reads: all its conditions hold.
#[derive(Default)]
struct Filter<'a> {
    /// Only these ids.
    ids: Option<&'a [i64]>,
    /// Only those this user uploaded...
    owner: Option<i64>,
    /// ...and, if set, the shared ones too.
    or_shared: bool,
}

/// The datasets `filter` names, oldest first, with their owners' names: the one query every
/// reader of the table goes through.
async fn select(pool: &SqlitePool, filter: Filter<'_>) -> sqlx::Result<Vec<Dataset>> {
    let ids = filter.ids.map(|ids| serde_json::Value::from(ids.to_vec()).to_string());
    sqlx::query_as!(
        Dataset,
        r#"SELECT d.id, d.name, d.format, d.records, d.size_bytes, d.created_at,
                  u.username AS "owner?", d.owner_id, d.file_name, d.layout,
                  d.skip_invalid AS "skip_invalid: bool", d.skipped, d.skipped_records,
                  d.columns, d.registry_file, d.registry_name
           FROM datasets d LEFT JOIN users u ON u.id = d.owner_id
           WHERE (?1 IS NULL OR d.id IN (SELECT value FROM json_each(?1)))
             AND (?2 IS NULL OR d.owner_id = ?2 OR (?3 AND d.owner_id IS NULL))
           ORDER BY d.id"#,
        ids,
        filter.owner,
        filter.or_shared,
    )
    .fetch_all(pool)
    .await
}

/// Dataset `id`, if it exists.
pub async fn get(pool: &SqlitePool, id: i64) -> sqlx::Result<Option<Dataset>> {
    let found = select(pool, Filter { ids: Some(&[id]), ..Filter::default() }).await?;
    Ok(found.into_iter().next())
}

/// Every dataset (`viewer` `None`), or those of user `viewer` and the shared ones, oldest first.
pub async fn visible_to(pool: &SqlitePool, viewer: Option<i64>) -> sqlx::Result<Vec<Dataset>> {
    select(pool, Filter { owner: viewer, or_shared: true, ..Filter::default() }).await
}

/// The datasets `owner_id` uploaded.
pub async fn owned_by(pool: &SqlitePool, owner_id: i64) -> sqlx::Result<Vec<Dataset>> {
    select(pool, Filter { owner: Some(owner_id), ..Filter::default() }).await
}

/// The datasets of `ids` that exist: one query for any number.
pub async fn by_ids(pool: &SqlitePool, ids: &[i64]) -> sqlx::Result<Vec<Dataset>> {
    select(pool, Filter { ids: Some(ids), ..Filter::default() }).await
}

/// Bytes of the datasets `owner_id` uploaded (`None`: of the shared ones).
pub async fn bytes_of(pool: &SqlitePool, owner_id: Option<i64>) -> sqlx::Result<i64> {
    sqlx::query_scalar!(
        r#"SELECT COALESCE(SUM(size_bytes), 0) AS "bytes!: i64" FROM datasets
           WHERE owner_id IS ?"#,
        owner_id
    )
    .fetch_one(pool)
    .await
}

/// Records an uploaded dataset, read as `layout` says; its id.
pub async fn insert(
    pool: &SqlitePool,
    new: &NewDataset<'_>,
    layout: &Layout<'_>,
) -> sqlx::Result<i64> {
    let now = now();
    let (registry_file, registry_name) = layout.registry.unzip();
    let inserted = sqlx::query!(
        "INSERT INTO datasets (owner_id, name, file_name, format, records, size_bytes, created_at,
            layout, skip_invalid, skipped, skipped_records, columns, registry_file, registry_name)
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        new.owner_id,
        new.name,
        new.file_name,
        new.format,
        new.records,
        new.size_bytes,
        now,
        layout.layout,
        layout.skip_invalid,
        layout.skipped,
        layout.skipped_records,
        layout.columns,
        registry_file,
        registry_name,
    )
    .execute(pool)
    .await?;
    Ok(inserted.last_insert_rowid())
}

/// Whether the demo dataset was registered (it is never registered again, even once deleted).
pub async fn demo_registered(pool: &SqlitePool) -> sqlx::Result<bool> {
    let done = sqlx::query_scalar!("SELECT value FROM meta WHERE key = 'demo_dataset_registered'")
        .fetch_optional(pool)
        .await?;
    Ok(done.is_some())
}

/// Records the demo dataset and that it was registered, together.
pub async fn register_demo(pool: &SqlitePool, demo: &NewDataset<'_>) -> sqlx::Result<()> {
    let mut tx = pool.begin().await?;
    let now = now();
    sqlx::query!(
        "INSERT INTO datasets (owner_id, name, file_name, format, records, size_bytes, created_at)
         VALUES (?, ?, ?, ?, ?, ?, ?)",
        demo.owner_id,
        demo.name,
        demo.file_name,
        demo.format,
        demo.records,
        demo.size_bytes,
        now,
    )
    .execute(&mut *tx)
    .await?;
    sqlx::query!("INSERT INTO meta (key, value) VALUES ('demo_dataset_registered', '1')")
        .execute(&mut *tx)
        .await?;
    tx.commit().await
}

/// Deletes dataset `dataset_id` unless a queued or running job trains on it or evaluates with
/// it, checked in the delete's own statement, so no submit or resume can slip in between the
/// check and the delete; in the same transaction, the stopped jobs evaluating with it are marked
/// no longer resumable (`resume_ended`). Says whether it was deleted.
pub async fn delete_dataset_if_unused(pool: &SqlitePool, dataset_id: i64) -> sqlx::Result<bool> {
    let [queued, running] = JobStatus::ACTIVE;
    let mut tx = pool.begin().await?;
    // Before the delete clears their `eval_dataset_id`: afterwards nothing says they had one.
    let why = "the job's evaluation dataset was deleted, and a resume must evaluate on the same \
               data again";
    sqlx::query!(
        "UPDATE jobs SET resume_ended = ? WHERE eval_dataset_id = ? AND status IN (?, ?)",
        why,
        dataset_id,
        JobStatus::Cancelled,
        JobStatus::Interrupted,
    )
    .execute(&mut *tx)
    .await?;
    let deleted = sqlx::query!(
        "DELETE FROM datasets WHERE id = ?1
           AND NOT EXISTS (SELECT 1 FROM jobs WHERE (dataset_id = ?1 OR eval_dataset_id = ?1)
                                              AND status IN (?2, ?3))",
        dataset_id,
        queued,
        running,
    )
    .execute(&mut *tx)
    .await?;
    if deleted.rows_affected() != 1 {
        return Ok(false);
    }
    tx.commit().await?;
    Ok(true)
}
