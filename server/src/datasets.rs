//! Datasets: the files users uploaded (under `DATA_DIR/datasets/`), their rows in SQLite, the
//! engine's lint that decides whether a file is kept, and the demo dataset.
//!
//! A dataset belongs to the user who uploaded it. The demo dataset that ships with Sluice is
//! registered at first start with no owner: every user sees it and can train on it, and only an
//! admin can delete it (it is not registered again after that).

use std::path::PathBuf;

use serde::{Serialize, Serializer};
use sluice_engine::data::{Columns, DatasetSource, Layout, ReadOptions};
use sqlx::FromRow;
use tracing::{info, warn};

use crate::AppState;
use crate::auth::User;
use crate::db::now;
use crate::error::{ApiError, ApiResult};

/// The demo dataset compiled into the binary, so a fresh install can train at once.
const DEMO_NAME: &str = "demo-alpaca";
const DEMO_FILE: &str = "demo-alpaca.jsonl";
const DEMO_BYTES: &[u8] = include_bytes!("../../datasets/demo-alpaca.jsonl");

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

pub(crate) const SELECT: &str =
    "SELECT d.id, d.name, d.format, d.records, d.size_bytes, d.created_at,
        u.username AS owner, d.owner_id, d.file_name, d.layout, d.skip_invalid, d.skipped,
        d.skipped_records, d.columns, d.registry_file, d.registry_name
    FROM datasets d LEFT JOIN users u ON u.id = d.owner_id";

/// A column of JSON text the server wrote, sent as the JSON it holds (`null` if damaged).
fn stored_json<S: Serializer>(text: &str, serializer: S) -> Result<S::Ok, S::Error> {
    serde_json::from_str::<serde_json::Value>(text)
        .unwrap_or(serde_json::Value::Null)
        .serialize(serializer)
}

impl Dataset {
    pub fn path(&self, state: &AppState) -> PathBuf {
        state.datasets_dir().join(&self.file_name)
    }

    /// How the engine reads it: as it was linted at upload.
    pub fn read_options(&self) -> ReadOptions {
        ReadOptions {
            columns: serde_json::from_str(&self.columns).unwrap_or_default(),
            skip_invalid: self.skip_invalid,
        }
    }

    /// The engine's source for this dataset, read as at upload.
    pub fn source(&self, state: &AppState) -> DatasetSource {
        let base = match (&self.registry_file, &self.registry_name) {
            (Some(registry), Some(name)) => DatasetSource::Registry {
                registry: state.datasets_dir().join(registry),
                name: name.clone(),
            },
            _ => DatasetSource::File(self.path(state)),
        };
        base.with(self.read_options())
    }

    /// The files it keeps under `DATA_DIR/datasets/`: the data, and its registry if any.
    pub fn files(&self, state: &AppState) -> Vec<PathBuf> {
        let registry = self.registry_file.iter().map(|r| state.datasets_dir().join(r));
        std::iter::once(self.path(state)).chain(registry).collect()
    }
}

/// The dataset `id` if `user` may see it (theirs, shared, or any for an admin); 404 otherwise.
pub async fn visible(state: &AppState, user: &User, id: i64) -> ApiResult<Dataset> {
    let dataset: Option<Dataset> = sqlx::query_as(&format!("{SELECT} WHERE d.id = ?"))
        .bind(id)
        .fetch_optional(state.pool())
        .await?;
    match dataset {
        Some(d) if user.is_admin() || d.owner_id.is_none() || d.owner_id == Some(user.id) => Ok(d),
        _ => Err(ApiError::not_found(format!("no dataset {id}"))),
    }
}

/// Every dataset `user` may see, oldest first.
pub async fn all_visible(state: &AppState, user: &User) -> ApiResult<Vec<Dataset>> {
    let datasets = if user.is_admin() {
        sqlx::query_as(&format!("{SELECT} ORDER BY d.id")).fetch_all(state.pool()).await?
    } else {
        sqlx::query_as(&format!(
            "{SELECT} WHERE d.owner_id = ? OR d.owner_id IS NULL ORDER BY d.id"
        ))
        .bind(user.id)
        .fetch_all(state.pool())
        .await?
    };
    Ok(datasets)
}

/// The files of `owner_id`'s datasets.
pub async fn files_of_owner(state: &AppState, owner_id: i64) -> ApiResult<Vec<PathBuf>> {
    let owned: Vec<Dataset> = sqlx::query_as(&format!("{SELECT} WHERE d.owner_id = ?"))
        .bind(owner_id)
        .fetch_all(state.pool())
        .await?;
    Ok(owned.iter().flat_map(|d| d.files(state)).collect())
}

/// Forgets `dataset` and removes its file (a file that cannot be removed is logged), answering
/// the bytes freed; 409 while a queued or running job uses it, whatever runs beside this.
pub async fn delete(state: &AppState, dataset: &Dataset) -> ApiResult<u64> {
    if !crate::jobs::store::delete_dataset_if_unused(state, dataset.id).await? {
        let active = crate::jobs::store::active_using_dataset(state, dataset.id).await?;
        return Err(ApiError::conflict(format!(
            "{active} queued or running jobs use this dataset; cancel them first"
        )));
    }
    let mut freed = 0;
    for path in dataset.files(state) {
        let size = tokio::fs::metadata(&path).await.map_or(0, |m| m.len());
        match tokio::fs::remove_file(&path).await {
            Ok(()) => freed += size,
            Err(err) => warn!("dataset {}: cannot remove {}: {err}", dataset.id, path.display()),
        }
    }
    Ok(freed)
}

/// What the lint found in a file that is good enough to keep.
pub struct Linted {
    pub format: String,
    pub records: usize,
    pub layout: Layout,
    /// Invalid records left out (lenient uploads only; otherwise any refuses the file).
    pub skipped: usize,
    /// The first [`SHOWN_PROBLEMS`] of them, as `[{"line", "reason"}]`.
    pub skipped_records: String,
    /// The mapping the records were read with (given, or a table's automatic one).
    pub columns: Columns,
}

/// Problems a refused upload lists, and a lenient one keeps; the rest are counted.
const SHOWN_PROBLEMS: usize = 100;

/// Reads `source` with the engine, record by record, so a file of any size costs only its
/// largest record in memory. A file with any bad record is refused with 422 and one line per
/// problem (the first 100), unless the source skips invalid records: then they are counted and
/// listed, and only a file with no valid record is refused. A table whose columns name no format
/// is refused with its columns listed, for a mapping.
pub fn lint(source: &DatasetSource) -> ApiResult<Linted> {
    let lint = source.open().and_then(|reader| reader.lint(SHOWN_PROBLEMS)).map_err(|err| {
        ApiError::Unprocessable {
            message: format!("not a usable dataset: {}", strip_path(&err.to_string())),
            problems: Vec::new(),
        }
    })?;
    let listed = |lint: &sluice_engine::data::Lint| {
        let mut problems = lint.problem_lines();
        if lint.bad > problems.len() {
            problems.push(format!("... and {} more", lint.bad - problems.len()));
        }
        problems
    };
    let Some(format) = lint.format else {
        let message = if lint.column_names.is_empty() {
            "no record is in a known format".to_string()
        } else {
            format!(
                "the columns ({}) are not a known format's: map them to instruction/input/output, \
                 prompt/completion, text or messages",
                lint.column_names.join(", ")
            )
        };
        return Err(ApiError::Unprocessable { message, problems: listed(&lint) });
    };
    if lint.bad > 0 && !source.skips_invalid() {
        return Err(ApiError::Unprocessable {
            message: format!(
                "the dataset has {} bad records; fix them and upload again, or skip invalid \
                 records",
                lint.bad
            ),
            problems: listed(&lint),
        });
    }
    if lint.records == 0 {
        return Err(ApiError::Unprocessable {
            message: format!("all {} records are invalid; nothing is left to train on", lint.bad),
            problems: listed(&lint),
        });
    }
    let skipped: Vec<serde_json::Value> = lint
        .problems
        .iter()
        .map(|p| serde_json::json!({ "line": p.line, "reason": p.message }))
        .collect();
    Ok(Linted {
        format: format.name().to_string(),
        records: lint.records,
        layout: lint.layout,
        skipped: lint.bad,
        skipped_records: serde_json::Value::Array(skipped).to_string(),
        columns: lint.columns,
    })
}

/// Engine errors name the file; the server-chosen name means nothing to the user.
fn strip_path(message: &str) -> String {
    match message.split_once(": ") {
        Some((head, rest)) if head.contains('/') => rest.to_string(),
        _ => message.to_string(),
    }
}

/// Registers the bundled demo dataset once per installation.
pub async fn register_demo(state: &AppState) -> anyhow::Result<()> {
    let done: Option<String> =
        sqlx::query_scalar("SELECT value FROM meta WHERE key = 'demo_dataset_registered'")
            .fetch_optional(state.pool())
            .await?;
    if done.is_some() {
        return Ok(());
    }
    let path = state.datasets_dir().join(DEMO_FILE);
    tokio::fs::write(&path, DEMO_BYTES).await?;
    let linted = tokio::task::spawn_blocking(move || lint(&DatasetSource::File(path)))
        .await?
        .map_err(|err| anyhow::anyhow!("the bundled demo dataset does not lint: {err:?}"))?;
    let mut tx = state.pool().begin().await?;
    sqlx::query(
        "INSERT INTO datasets (owner_id, name, file_name, format, records, size_bytes, created_at)
         VALUES (NULL, ?, ?, ?, ?, ?, ?)",
    )
    .bind(DEMO_NAME)
    .bind(DEMO_FILE)
    .bind(&linted.format)
    .bind(linted.records as i64)
    .bind(DEMO_BYTES.len() as i64)
    .bind(now())
    .execute(&mut *tx)
    .await?;
    sqlx::query("INSERT INTO meta (key, value) VALUES ('demo_dataset_registered', '1')")
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    info!("registered the demo dataset ({} records)", linted.records);
    Ok(())
}
