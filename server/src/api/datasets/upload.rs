//! `POST /api/datasets`: a multipart upload streamed to a server-named file, counted against
//! the size limit as it arrives, linted, and kept only when every record is good, or, with
//! `skip_invalid`, when any is (the others are listed and left out of every job). Fields other
//! than the file are refused past 1 KiB: `name`; `skip_invalid` (`true`, `on` or `1`);
//! `columns`, a table's mapping to a format's fields (`instruction=question,output=answer`);
//! `dataset_info`, a LLaMA-Factory `dataset_info.json` (up to 256 KiB) whose entry for the file
//! maps it instead, with `dataset` naming the entry when the file's name does not tell it.
//! The file may be JSON Lines, JSON, CSV, TSV or Parquet, told by its name's extension or else
//! its contents.

use std::path::Path;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use sluice_engine::Error as EngineError;
use sluice_engine::data::{Columns, DatasetSource, Layout, ReadOptions, single_dataset_registry};
use tokio::sync::Semaphore;

use super::super::multipart::{
    BoundedMultipart, TempFile, Upload, read_upload, refuse_declared_oversize,
};
use crate::AppState;
use crate::auth::CurrentUser;
use crate::auth::session::random_token;
use crate::datasets::{Dataset, lint};
use crate::error::{ApiError, ApiResult};
use crate::store::datasets as store;

/// A lint holds one parsed record at a time, up to the engine's `MAX_RECORD_BYTES` of text: two at
/// once bound what a burst of uploads of long records costs; later uploads wait their turn.
static LINTING: Semaphore = Semaphore::const_new(2);

/// 201 with the dataset; 413 over the limit; 422 with one line per bad record, or for a
/// `dataset_info` that does not say how to read the file; 400 without a `file` field, with
/// another field over 1 KiB (`dataset_info` over 256 KiB), or with both `columns` and
/// `dataset_info`.
pub(super) async fn upload(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    headers: HeaderMap,
    mut multipart: BoundedMultipart,
) -> ApiResult<(StatusCode, Json<Dataset>)> {
    let limit = state.config().max_upload_bytes;
    refuse_declared_oversize(&headers, limit)?;

    let path = state.datasets_dir().join(format!(".upload-{}", random_token()));
    let upload = read_upload(&mut multipart, path, limit, "upload", &["dataset_info"]).await?;
    let read = read_options(&upload)?;
    let registry = upload.field("dataset_info").filter(|text| !text.trim().is_empty());
    let registry = registry.map(str::to_string);
    let entry = upload.field("dataset").map(str::to_string);
    if registry.is_some() && !read.columns.is_empty() {
        return Err(ApiError::bad_request(
            "send columns or a dataset_info.json, not both: the registry maps the columns",
        ));
    }
    let (mut temp, size, original) = upload.file;
    let name: Option<String> = upload.name.map(|n| n.trim().chars().take(200).collect());
    if size == 0 {
        return Err(ApiError::unprocessable("the file is empty"));
    }
    crate::api::storage::refuse_over_quota(&state, &user, size).await?;
    let Some(mut temp_path) = temp.0.clone() else {
        return Err(ApiError::internal(anyhow::anyhow!("upload temp file vanished")));
    };
    // The engine tells a file's layout by its extension first: the temporary file takes the
    // original's, when it is one of the layouts.
    if let Some(extension) = original.as_deref().and_then(known_extension) {
        let named = temp_path.with_extension(extension);
        tokio::fs::rename(&temp_path, &named).await?;
        temp.0 = Some(named.clone());
        temp_path = named;
    }

    // With a registry, the file is read through a one-entry copy of it kept beside the file.
    let registry = match registry {
        Some(text) => Some(Registry::write(&temp_path, text, entry, original.as_deref()).await?),
        None => None,
    };
    let source = match &registry {
        Some(registry) => DatasetSource::Registry {
            registry: registry.temp.0.clone().unwrap_or_default(),
            name: registry.name.clone(),
        },
        None => DatasetSource::File(temp_path.clone()),
    }
    .with(read.clone());
    let permit = LINTING.acquire().await.map_err(ApiError::internal)?;
    let linted = tokio::task::spawn_blocking(move || {
        // Held by the lint itself: a client that goes away does not free its place early.
        let _permit = permit;
        lint(&source)
    })
    .await??;

    let token = random_token();
    let file_name = format!("{token}.{}", linted.layout.extension());
    let final_path = state.datasets_dir().join(&file_name);
    tokio::fs::rename(&temp_path, &final_path).await?;
    temp.0 = None;
    let registry_file = match registry {
        Some(mut registry) => match registry.keep(&state, &token, &file_name).await {
            Ok(kept) => Some(kept),
            Err(err) => {
                let _ = tokio::fs::remove_file(&final_path).await;
                return Err(err);
            }
        },
        None => None,
    };
    let name = name
        .filter(|n| !n.is_empty())
        .or_else(|| original.as_deref().map(display_name))
        .unwrap_or_else(|| "dataset".to_string());

    let columns = serde_json::to_string(&linted.columns).map_err(ApiError::internal)?;
    let new = store::NewDataset {
        owner_id: Some(user.id),
        name: &name,
        file_name: &file_name,
        format: &linted.format,
        records: linted.records as i64,
        size_bytes: size as i64,
    };
    let layout = store::Layout {
        layout: linted.layout.name(),
        skip_invalid: read.skip_invalid,
        skipped: linted.skipped as i64,
        skipped_records: &linted.skipped_records,
        columns: &columns,
        registry: registry_file.as_ref().map(|(file, name)| (file.as_str(), name.as_str())),
    };
    let inserted = store::insert(state.pool(), &new, &layout).await;
    let id = match inserted {
        Ok(id) => id,
        Err(err) => {
            let _ = tokio::fs::remove_file(&final_path).await;
            if let Some((file, _)) = &registry_file {
                let _ = tokio::fs::remove_file(state.datasets_dir().join(file)).await;
            }
            return Err(err.into());
        }
    };
    let dataset = store::get(state.pool(), id).await?.ok_or_else(|| {
        ApiError::internal(anyhow::anyhow!("dataset {id} vanished as it was kept"))
    })?;
    Ok((StatusCode::CREATED, Json(dataset)))
}

/// An upload's `dataset_info.json`, reduced to the entry for its file and written beside the
/// uploaded file under a temporary name until the dataset is kept.
struct Registry {
    temp: TempFile,
    /// The one-entry registry as written (its `file_name` the temporary file's).
    single: String,
    /// The entry's name.
    name: String,
}

impl Registry {
    /// 422 for a registry that names no usable entry for the file, saying why.
    async fn write(
        data: &Path,
        text: String,
        dataset: Option<String>,
        original: Option<&str>,
    ) -> ApiResult<Registry> {
        let stored_as = file_name_of(data);
        let (single, name) =
            single_dataset_registry(&text, dataset.as_deref(), original, &stored_as)
                .map_err(refused_registry)?;
        let path = data.with_file_name(format!("{stored_as}.dataset_info.json"));
        let temp = TempFile(Some(path.clone()));
        tokio::fs::write(&path, &single).await?;
        Ok(Registry { temp, single, name })
    }

    /// Writes the registry for the data's final name `file_name` as `{token}.dataset_info.json`;
    /// returns that file's name and the entry's.
    async fn keep(
        &mut self,
        state: &AppState,
        token: &str,
        file_name: &str,
    ) -> ApiResult<(String, String)> {
        // The one entry again, pointing at the final name.
        let (single, name) =
            single_dataset_registry(&self.single, Some(&self.name), None, file_name)
                .map_err(refused_registry)?;
        let Some(temp) = self.temp.0.clone() else {
            return Err(ApiError::internal(anyhow::anyhow!("upload registry vanished")));
        };
        tokio::fs::write(&temp, single).await?;
        let registry_file = format!("{token}.dataset_info.json");
        tokio::fs::rename(&temp, state.datasets_dir().join(&registry_file)).await?;
        self.temp.0 = None;
        Ok((registry_file, name))
    }
}

fn file_name_of(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// A registry the engine cannot use, as the 422 that says why.
fn refused_registry(err: EngineError) -> ApiError {
    let message = match err {
        EngineError::Invalid(message) => message,
        other => other.to_string(),
    };
    ApiError::unprocessable(message)
}

/// The upload's `skip_invalid` and `columns` fields; 400 for a value that means nothing.
fn read_options(upload: &Upload) -> ApiResult<ReadOptions> {
    let skip_invalid = match upload.field("skip_invalid").map(str::trim) {
        None | Some("" | "false" | "off" | "0") => false,
        Some("true" | "on" | "1") => true,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "skip_invalid must be true or false, got {other:?}"
            )));
        }
    };
    let columns = Columns::parse(upload.field("columns").unwrap_or_default())
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(ReadOptions { columns, skip_invalid })
}

/// The extension of a file name the engine reads as a layout, lowercased.
fn known_extension(original: &str) -> Option<String> {
    let extension = Path::new(original).extension()?.to_str()?.to_ascii_lowercase();
    Layout::ALL.iter().any(|l| l.extension() == extension).then_some(extension)
}

/// The uploaded file's own name, without any directory part, as the dataset's default name.
fn display_name(original: &str) -> String {
    let base = Path::new(original).file_name().and_then(|n| n.to_str()).unwrap_or(original);
    base.chars().take(200).collect()
}
