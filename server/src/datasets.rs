//! Datasets: the files users uploaded (under `DATA_DIR/datasets/`), their rows in SQLite, the
//! engine's lint that decides whether a file is kept, and the demo dataset.
//!
//! A dataset belongs to the user who uploaded it. The demo dataset that ships with Sluice is
//! registered at first start with no owner: every user sees it and can train on it, and only an
//! admin can delete it (it is not registered again after that).

use std::collections::HashMap;
use std::path::PathBuf;

use sluice_engine::data::{Columns, DatasetSource, Layout, ReadOptions};
use tracing::{info, warn};

use crate::AppState;
use crate::store::datasets as store;
pub use crate::store::datasets::Dataset;
use crate::store::users::User;

/// The demo dataset compiled into the binary, so a fresh install can train at once.
const DEMO_NAME: &str = "demo-alpaca";
const DEMO_FILE: &str = "demo-alpaca.jsonl";
const DEMO_BYTES: &[u8] = include_bytes!("../../datasets/demo-alpaca.jsonl");

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

/// Why a dataset could not be read, kept or removed; `api/errors.rs` gives each its status.
#[derive(Debug, thiserror::Error)]
pub enum DatasetsError {
    /// No such dataset, or one the user may not see (the two read the same).
    #[error("no dataset {0}")]
    NotFound(i64),
    /// Queued or running jobs train on it or evaluate with it.
    #[error("{active} queued or running jobs use this dataset; cancel them first")]
    InUse { active: i64 },
    /// The file is not a dataset the engine can train on: why, one line per bad record (the
    /// first [`SHOWN_PROBLEMS`]), and how many bad records are not listed.
    #[error("{message}")]
    Unusable { message: String, problems: Vec<String>, unlisted: usize },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

pub type DatasetsResult<T> = Result<T, DatasetsError>;

/// The datasets of `ids` that exist, by id: one query for any number.
pub async fn by_ids(state: &AppState, ids: &[i64]) -> sqlx::Result<HashMap<i64, Dataset>> {
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    let found = store::by_ids(state.pool(), ids).await?;
    Ok(found.into_iter().map(|d| (d.id, d)).collect())
}

/// The dataset `id` if `user` may see it (theirs, shared, or any for an admin).
pub async fn visible(state: &AppState, user: &User, id: i64) -> DatasetsResult<Dataset> {
    let dataset = store::get(state.pool(), id).await?;
    match dataset {
        Some(d) if user.is_admin() || d.owner_id.is_none() || d.owner_id == Some(user.id) => Ok(d),
        _ => Err(DatasetsError::NotFound(id)),
    }
}

/// Every dataset `user` may see, oldest first.
pub async fn all_visible(state: &AppState, user: &User) -> DatasetsResult<Vec<Dataset>> {
    let viewer = (!user.is_admin()).then_some(user.id);
    Ok(store::visible_to(state.pool(), viewer).await?)
}

/// The files of `owner_id`'s datasets.
pub async fn files_of_owner(state: &AppState, owner_id: i64) -> DatasetsResult<Vec<PathBuf>> {
    let owned = store::owned_by(state.pool(), owner_id).await?;
    Ok(owned.iter().flat_map(|d| d.files(state)).collect())
}

/// Forgets `dataset` and removes its file (a file that cannot be removed is logged), answering
/// the bytes freed; refused while a queued or running job uses it, whatever runs beside this.
pub async fn delete(state: &AppState, dataset: &Dataset) -> DatasetsResult<u64> {
    if !store::delete_dataset_if_unused(state.pool(), dataset.id).await? {
        let active = crate::store::jobs::active_using_dataset(state.pool(), dataset.id).await?;
        return Err(DatasetsError::InUse { active });
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
/// largest record in memory. A file with any bad record is refused, with one line per problem
/// (the first 100), unless the source skips invalid records: then they are counted and listed,
/// and only a file with no valid record is refused. A table whose columns name no format is
/// refused with its columns listed, for a mapping.
pub fn lint(source: &DatasetSource) -> DatasetsResult<Linted> {
    let lint = source.open().and_then(|reader| reader.lint(SHOWN_PROBLEMS)).map_err(|err| {
        DatasetsError::Unusable {
            message: format!("not a usable dataset: {}", strip_path(&err.to_string())),
            problems: Vec::new(),
            unlisted: 0,
        }
    })?;
    // The rest are counted apart rather than as a last "... and N more" line, which a page that
    // lists fewer would count as one more problem.
    let listed = |lint: &sluice_engine::data::Lint| {
        let problems = lint.problem_lines();
        let unlisted = lint.bad.saturating_sub(problems.len());
        (problems, unlisted)
    };
    let Some(format) = lint.format else {
        // A table's columns are what to fix first; otherwise one reason for every listed record
        // (all preference pairs, say) is the file's own.
        let reasons: std::collections::BTreeSet<&str> =
            lint.problems.iter().map(|p| p.message.as_str()).collect();
        let message = if !lint.column_names.is_empty() {
            format!(
                "the columns ({}) are not a known format's: map them to instruction/input/output, \
                 prompt/completion, text or messages",
                lint.column_names.join(", ")
            )
        } else if let [reason] = Vec::from_iter(reasons).as_slice() {
            format!("no record can be trained on: {reason}")
        } else {
            "no record is in a known format".to_string()
        };
        let (problems, unlisted) = listed(&lint);
        return Err(DatasetsError::Unusable { message, problems, unlisted });
    };
    if lint.bad > 0 && !source.skips_invalid() {
        let (problems, unlisted) = listed(&lint);
        return Err(DatasetsError::Unusable {
            message: format!(
                "the dataset has {} bad records; fix them and upload again, or skip invalid \
                 records",
                lint.bad
            ),
            problems,
            unlisted,
        });
    }
    if lint.records == 0 {
        let (problems, unlisted) = listed(&lint);
        return Err(DatasetsError::Unusable {
            message: format!("all {} records are invalid; nothing is left to train on", lint.bad),
            problems,
            unlisted,
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
pub fn strip_path(message: &str) -> String {
    match message.split_once(": ") {
        Some((head, rest)) if head.contains('/') => rest.to_string(),
        _ => message.to_string(),
    }
}

/// Registers the bundled demo dataset once per installation.
pub async fn register_demo(state: &AppState) -> anyhow::Result<()> {
    if store::demo_registered(state.pool()).await? {
        return Ok(());
    }
    let path = state.datasets_dir().join(DEMO_FILE);
    tokio::fs::write(&path, DEMO_BYTES).await?;
    let linted = tokio::task::spawn_blocking(move || lint(&DatasetSource::File(path)))
        .await?
        .map_err(|err| anyhow::anyhow!("the bundled demo dataset does not lint: {err:?}"))?;
    let demo = store::NewDataset {
        owner_id: None,
        name: DEMO_NAME,
        file_name: DEMO_FILE,
        format: &linted.format,
        records: linted.records as i64,
        size_bytes: DEMO_BYTES.len() as i64,
    };
    store::register_demo(state.pool(), &demo).await?;
    info!("registered the demo dataset ({} records)", linted.records);
    Ok(())
}
