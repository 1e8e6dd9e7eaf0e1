//! `POST /api/datasets`: a multipart upload streamed to a server-named file, counted against
//! the size limit as it arrives, linted, and kept only when every record is good, or, with
//! `skip_invalid`, when any is (the others are listed and left out of every job). Fields other
//! than the file are refused past 1 KiB: `name`; `skip_invalid` (`true`, `on` or `1`);
//! `columns`, a table's mapping to a format's fields (`instruction=question,output=answer`).
//! The file may be JSON Lines, JSON, CSV, TSV or Parquet, told by its name's extension or else
//! its contents.

use std::path::Path;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use sluice_engine::data::{Columns, Layout, ReadOptions};
use tokio::sync::Semaphore;

use super::super::multipart::{BoundedMultipart, read_upload, refuse_declared_oversize};
use crate::AppState;
use crate::auth::CurrentUser;
use crate::auth::session::random_token;
use crate::datasets::{Dataset, SELECT, lint};
use crate::db::now;
use crate::error::{ApiError, ApiResult};

/// A lint holds one parsed record at a time, up to the engine's `MAX_RECORD_BYTES` of text: two at
/// once bound what a burst of uploads of long records costs; later uploads wait their turn.
static LINTING: Semaphore = Semaphore::const_new(2);

/// 201 with the dataset; 413 over the limit; 422 with one line per bad record; 400 without a
/// `file` field or with another field over 1 KiB.
pub(super) async fn upload(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    headers: HeaderMap,
    mut multipart: BoundedMultipart,
) -> ApiResult<(StatusCode, Json<Dataset>)> {
    let limit = state.config().max_upload_bytes;
    refuse_declared_oversize(&headers, limit)?;

    let path = state.datasets_dir().join(format!(".upload-{}", random_token()));
    let upload = read_upload(&mut multipart, path, limit, "upload").await?;
    let read = read_options(&upload)?;
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

    let lint_path = temp_path.clone();
    let permit = LINTING.acquire().await.map_err(ApiError::internal)?;
    let lint_read = read.clone();
    let linted = tokio::task::spawn_blocking(move || {
        // Held by the lint itself: a client that goes away does not free its place early.
        let _permit = permit;
        lint(lint_path, &lint_read)
    })
    .await??;

    let file_name = format!("{}.{}", random_token(), linted.layout.extension());
    let final_path = state.datasets_dir().join(&file_name);
    tokio::fs::rename(&temp_path, &final_path).await?;
    temp.0 = None;
    let name = name
        .filter(|n| !n.is_empty())
        .or_else(|| original.as_deref().map(display_name))
        .unwrap_or_else(|| "dataset".to_string());

    let columns = serde_json::to_string(&linted.columns).map_err(ApiError::internal)?;
    let inserted = sqlx::query(
        "INSERT INTO datasets (owner_id, name, file_name, format, records, size_bytes, created_at,
            layout, skip_invalid, skipped, skipped_records, columns)
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    )
    .bind(user.id)
    .bind(&name)
    .bind(&file_name)
    .bind(&linted.format)
    .bind(linted.records as i64)
    .bind(size as i64)
    .bind(now())
    .bind(linted.layout.name())
    .bind(read.skip_invalid)
    .bind(linted.skipped as i64)
    .bind(&linted.skipped_records)
    .bind(&columns)
    .execute(state.pool())
    .await;
    let id = match inserted {
        Ok(result) => result.last_insert_rowid(),
        Err(err) => {
            let _ = tokio::fs::remove_file(&final_path).await;
            return Err(err.into());
        }
    };
    let dataset: Dataset = sqlx::query_as(&format!("{SELECT} WHERE d.id = ?"))
        .bind(id)
        .fetch_one(state.pool())
        .await?;
    Ok((StatusCode::CREATED, Json(dataset)))
}

/// The upload's `skip_invalid` and `columns` fields; 400 for a value that means nothing.
fn read_options(upload: &super::super::multipart::Upload) -> ApiResult<ReadOptions> {
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
    let known = [Layout::JsonLines, Layout::JsonArray, Layout::Csv, Layout::Tsv, Layout::Parquet];
    known.iter().any(|l| l.extension() == extension).then_some(extension)
}

/// The uploaded file's own name, without any directory part, as the dataset's default name.
fn display_name(original: &str) -> String {
    let base = Path::new(original).file_name().and_then(|n| n.to_str()).unwrap_or(original);
    base.chars().take(200).collect()
}
