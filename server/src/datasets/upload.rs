//! `POST /api/datasets`: a multipart upload streamed to a server-named file, counted against
//! the size limit as it arrives, linted, and kept only when every record is good.

use std::path::{Path, PathBuf};

use axum::Json;
use axum::extract::multipart::Field;
use axum::extract::{Multipart, State};
use axum::http::{HeaderMap, StatusCode, header};
use sluice_engine::data::Layout;
use tokio::io::AsyncWriteExt;

use super::{Dataset, SELECT, lint};
use crate::AppState;
use crate::auth::CurrentUser;
use crate::auth::session::random_token;
use crate::db::now;
use crate::error::{ApiError, ApiResult};

/// Multipart framing and the `name` field on top of the file itself.
pub(crate) const MULTIPART_OVERHEAD: u64 = 64 << 10;

/// Deletes the temporary file unless the upload is kept.
pub(crate) struct TempFile(pub(crate) Option<PathBuf>);

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// 413 before reading anything when the declared body is larger than `limit` allows.
pub(crate) fn refuse_declared_oversize(headers: &HeaderMap, limit: u64) -> ApiResult<()> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit.saturating_add(MULTIPART_OVERHEAD)) {
        return Err(too_large(limit));
    }
    Ok(())
}

/// Streams a multipart field into a new file at `path`, counting it against `limit` as it
/// arrives; returns the file (deleted on drop unless kept) and its size.
pub(crate) async fn stream_to_temp(
    field: &mut Field<'_>,
    path: PathBuf,
    limit: u64,
) -> ApiResult<(TempFile, u64)> {
    let temp = TempFile(Some(path.clone()));
    let mut out = tokio::fs::File::create(&path).await?;
    let mut size = 0u64;
    while let Some(chunk) = field.chunk().await? {
        size += chunk.len() as u64;
        if size > limit {
            return Err(too_large(limit));
        }
        out.write_all(&chunk).await?;
    }
    out.flush().await?;
    out.sync_all().await?;
    Ok((temp, size))
}

pub(crate) fn too_large(limit: u64) -> ApiError {
    ApiError::TooLarge(format!(
        "the file is larger than the upload limit of {} (set max_upload_mb to raise it)",
        human_bytes(limit)
    ))
}

fn human_bytes(bytes: u64) -> String {
    if bytes >= 1 << 20 {
        format!("{:.1} MiB", bytes as f64 / f64::from(1u32 << 20))
    } else {
        format!("{bytes} bytes")
    }
}

/// 201 with the dataset; 413 over the limit; 422 with one line per bad record; 400 without a
/// `file` field.
pub(super) async fn upload(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    headers: HeaderMap,
    mut multipart: Multipart,
) -> ApiResult<(StatusCode, Json<Dataset>)> {
    let limit = state.config().max_upload_bytes;
    refuse_declared_oversize(&headers, limit)?;

    let mut name: Option<String> = None;
    let mut file: Option<(TempFile, u64, Option<String>)> = None;
    while let Some(mut field) = multipart.next_field().await? {
        let field_name = field.name().map(str::to_string);
        match field_name.as_deref() {
            Some("file") => {
                if file.is_some() {
                    return Err(ApiError::bad_request("send one file per upload"));
                }
                let original = field.file_name().map(str::to_string);
                let path = state.datasets_dir().join(format!(".upload-{}", random_token()));
                let (temp, size) = stream_to_temp(&mut field, path, limit).await?;
                file = Some((temp, size, original));
            }
            Some("name") => {
                let text = field.text().await?;
                name = Some(text.trim().chars().take(200).collect());
            }
            _ => {}
        }
    }
    let Some((mut temp, size, original)) = file else {
        return Err(ApiError::bad_request("the upload needs a \"file\" field"));
    };
    if size == 0 {
        return Err(ApiError::unprocessable("the file is empty"));
    }
    let Some(temp_path) = temp.0.clone() else {
        return Err(ApiError::internal(anyhow::anyhow!("upload temp file vanished")));
    };

    let lint_path = temp_path.clone();
    let linted = tokio::task::spawn_blocking(move || lint(lint_path)).await??;

    let extension = if linted.layout == Layout::JsonArray { "json" } else { "jsonl" };
    let file_name = format!("{}.{extension}", random_token());
    let final_path = state.datasets_dir().join(&file_name);
    tokio::fs::rename(&temp_path, &final_path).await?;
    temp.0 = None;
    let name = name
        .filter(|n| !n.is_empty())
        .or_else(|| original.as_deref().map(display_name))
        .unwrap_or_else(|| "dataset".to_string());

    let inserted = sqlx::query(
        "INSERT INTO datasets (owner_id, name, file_name, format, records, size_bytes, created_at)
         VALUES (?, ?, ?, ?, ?, ?, ?)",
    )
    .bind(user.id)
    .bind(&name)
    .bind(&file_name)
    .bind(&linted.format)
    .bind(linted.records as i64)
    .bind(size as i64)
    .bind(now())
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

/// The uploaded file's own name, without any directory part, as the dataset's default name.
fn display_name(original: &str) -> String {
    let base = Path::new(original).file_name().and_then(|n| n.to_str()).unwrap_or(original);
    base.chars().take(200).collect()
}
