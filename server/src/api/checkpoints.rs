//! Checkpoint folders of a job: listed, downloaded file by file (with HTTP ranges, so a broken
//! download of a large shard resumes), or whole as a tar streamed while it is written, either
//! in bf16 with `?dtype=bf16` (see `exports`); or tried out (see `tryit`); or deleted, one at a
//! time.

use axum::body::Body;
use axum::extract::{Query, Request, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde::Serialize;
use tokio_util::io::{ReaderStream, SyncIoBridge};
use tower::ServiceExt;
use tower_http::services::ServeFile;
use tracing::warn;

use super::access::checkpoint_dir;
use crate::AppState;
use crate::auth::CurrentUser;
use crate::error::{ApiError, ApiPath, ApiResult};
use crate::jobs::runner;
use crate::paths::is_plain_name;
use crate::store::jobs as store;

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/api/jobs/{id}/checkpoints", get(list))
        .route("/api/jobs/{id}/checkpoints/{name}", delete(remove))
        .route("/api/jobs/{id}/checkpoints/{name}/files/{file}", get(file))
        .route("/api/jobs/{id}/checkpoints/{name}/archive", get(archive))
        .route("/api/jobs/{id}/checkpoints/{name}/generate", post(super::tryit::generate))
        .route("/api/jobs/{id}/base-model/generate", post(super::tryit::generate_base))
}

#[derive(Debug, Serialize)]
struct Checkpoint {
    name: String,
    step: i64,
    files: Vec<FileEntry>,
}

#[derive(Debug, Serialize)]
struct FileEntry {
    name: String,
    size: u64,
}

/// The plain files of a folder, sorted by name.
fn files_of(dir: &std::path::Path) -> std::io::Result<Vec<FileEntry>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        if meta.is_file() {
            files.push(FileEntry {
                name: entry.file_name().to_string_lossy().into_owned(),
                size: meta.len(),
            });
        }
    }
    files.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(files)
}

/// `GET /api/jobs/{id}/checkpoints`: in step order; folders missing on disk are left out.
async fn list(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<Json<Vec<Checkpoint>>> {
    super::access::visible_job(&state, &user, id).await?;
    let rows = store::checkpoints(state.pool(), id).await?;
    let run_dir = runner::run_dir(&state, id);
    let checkpoints = tokio::task::spawn_blocking(move || {
        rows.into_iter()
            .filter_map(|(name, step)| match files_of(&run_dir.join(&name)) {
                Ok(files) => Some(Checkpoint { name, step, files }),
                Err(err) => {
                    warn!("job {id}: checkpoint {name}: {err}");
                    None
                }
            })
            .collect::<Vec<_>>()
    })
    .await?;
    Ok(Json(checkpoints))
}

/// `DELETE /api/jobs/{id}/checkpoints/{name}`: the folder; `{"freed_bytes"}`. 409 while the
/// job runs (its run may be saving or pruning). The resumable state (`state/`) is separate and
/// stays: a resume does not need any checkpoint folder.
async fn remove(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath((id, name)): ApiPath<(i64, String)>,
) -> ApiResult<Json<serde_json::Value>> {
    let dir = checkpoint_dir(&state, &user, id, &name).await?;
    let job = super::access::visible_job(&state, &user, id).await?;
    if job.status == store::JobStatus::Running {
        return Err(ApiError::conflict(
            "the job is running; delete its checkpoints once it has stopped",
        ));
    }
    store::forget_checkpoint(state.pool(), id, &name).await?;
    let freed = super::storage::remove_dir(dir).await;
    Ok(Json(serde_json::json!({ "name": name, "freed_bytes": freed })))
}

/// One file of a checkpoint; `Range` requests get 206 with the asked bytes.
async fn file(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath((id, name, file)): ApiPath<(i64, String, String)>,
    Query(query): Query<super::exports::DownloadQuery>,
    request: Request,
) -> ApiResult<Response> {
    let dir = checkpoint_dir(&state, &user, id, &name).await?;
    let path = dir.join(&file);
    if !is_plain_name(&file) || !path.is_file() {
        return Err(ApiError::not_found(format!("checkpoint {name} has no file {file:?}")));
    }
    if query.bf16()? && super::exports::is_safetensors(&file) {
        return super::exports::bf16_file(path, &file).await;
    }
    let response = ServeFile::new(&path).oneshot(request).await.map_err(ApiError::internal)?;
    let mut response = response.map(Body::new);
    if let Ok(value) =
        HeaderValue::from_str(&format!("attachment; filename=\"{}\"", file.replace('"', "")))
    {
        response.headers_mut().insert(header::CONTENT_DISPOSITION, value);
    }
    Ok(response)
}

/// The whole folder as `<name>/...` in a tar, written on a blocking thread into a pipe whose
/// other end is the response body: memory stays at the pipe's size whatever the checkpoint's.
async fn archive(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath((id, name)): ApiPath<(i64, String)>,
    Query(query): Query<super::exports::DownloadQuery>,
) -> ApiResult<Response> {
    let bf16 = query.bf16()?;
    let dir = checkpoint_dir(&state, &user, id, &name).await?;
    let (reader, writer) = tokio::io::duplex(256 << 10);
    let writer = SyncIoBridge::new(writer);
    let folder = name.clone();
    tokio::task::spawn_blocking(move || {
        let mut builder = tar::Builder::new(writer);
        builder.follow_symlinks(false);
        let result = super::exports::append_checkpoint(&mut builder, &folder, &dir, bf16)
            .and_then(|()| builder.into_inner())
            .and_then(|mut bridge| {
                use std::io::Write;
                bridge.flush()?;
                bridge.shutdown()
            });
        // A client that hangs up closes the pipe; that ends the archive early and is no fault.
        if let Err(err) = result {
            warn!("job {id}: archive of {folder} stopped: {err}");
        }
    });
    let disposition = format!("attachment; filename=\"job-{id}-{}.tar\"", name.replace('"', ""));
    Ok((
        [
            (header::CONTENT_TYPE, "application/x-tar".to_string()),
            (header::CONTENT_DISPOSITION, disposition),
        ],
        Body::from_stream(ReaderStream::new(reader)),
    )
        .into_response())
}
