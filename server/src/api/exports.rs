//! Checkpoints in the forms other tools load: safetensors in bf16 converted while they download
//! (`?dtype=bf16` on a file or the archive, for checkpoints saved in f32), and one GGUF file
//! for llama.cpp and Ollama (`/gguf?type=q8_0|f16`). Same access rules as every checkpoint
//! download: the job's owner (or an admin), 404 for anyone else.

use std::path::{Path, PathBuf};

use axum::Router;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Deserialize;
use sluice_engine::convert::{GgufType, export_gguf};
use sluice_engine::weights::Bf16Safetensors;
use tokio_util::io::ReaderStream;

use super::access::checkpoint_dir;
use crate::AppState;
use crate::auth::CurrentUser;
use crate::error::{ApiError, ApiPath, ApiResult};
use crate::jobs::runner;

pub(crate) fn router() -> Router<AppState> {
    Router::new().route("/api/jobs/{id}/checkpoints/{name}/gguf", get(gguf))
}

/// `?dtype=` of a checkpoint download: `bf16` converts f32 tensors; `f32` (or nothing) sends
/// the files as saved.
#[derive(Debug, Deserialize)]
pub(crate) struct DownloadQuery {
    dtype: Option<String>,
}

impl DownloadQuery {
    /// Whether f32 safetensors are to be sent as bf16; an unknown dtype is a 400.
    pub(crate) fn bf16(&self) -> ApiResult<bool> {
        match self.dtype.as_deref() {
            None | Some("f32") => Ok(false),
            Some("bf16") => Ok(true),
            Some(other) => {
                Err(ApiError::bad_request(format!("dtype {other:?} is not one of bf16, f32")))
            }
        }
    }
}

pub(crate) fn is_safetensors(file: &str) -> bool {
    file.ends_with(".safetensors")
}

/// One safetensors file as bf16, converted on a blocking thread into a pipe whose other end is
/// the response body, with its final length announced.
pub(crate) async fn bf16_file(path: PathBuf, file: &str) -> ApiResult<Response> {
    let opened = path.clone();
    let stream = tokio::task::spawn_blocking(move || Bf16Safetensors::open(&opened))
        .await?
        .map_err(|e| ApiError::unprocessable(e.to_string()))?;
    let len = stream.len();
    let (reader, writer) = tokio::io::duplex(256 << 10);
    tokio::task::spawn_blocking(move || {
        let mut stream = stream;
        let mut writer = tokio_util::io::SyncIoBridge::new(writer);
        // A client that hangs up closes the pipe; that ends the copy early and is no fault.
        if let Err(err) = std::io::copy(&mut stream, &mut writer) {
            tracing::debug!("bf16 download of {} stopped: {err}", path.display());
        }
    });
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, len.to_string()),
            (
                header::CONTENT_DISPOSITION,
                format!("attachment; filename=\"{}\"", file.replace('"', "")),
            ),
        ],
        Body::from_stream(ReaderStream::new(reader)),
    )
        .into_response())
}

/// Appends the checkpoint folder `dir` to a tar as `folder/...`, its safetensors files as bf16
/// when `bf16` (their converted length goes in the entry's header before the data streams).
pub(crate) fn append_checkpoint<W: std::io::Write>(
    builder: &mut tar::Builder<W>,
    folder: &str,
    dir: &Path,
    bf16: bool,
) -> std::io::Result<()> {
    if !bf16 {
        return builder.append_dir_all(folder, dir);
    }
    let mut names: Vec<(String, PathBuf)> = std::fs::read_dir(dir)?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .collect();
    names.sort();
    for (name, path) in names {
        let inside = format!("{folder}/{name}");
        if !is_safetensors(&name) {
            builder.append_path_with_name(&path, &inside)?;
            continue;
        }
        let stream = Bf16Safetensors::open(&path).map_err(std::io::Error::other)?;
        let mut entry = tar::Header::new_gnu();
        entry.set_size(stream.len());
        entry.set_mode(0o644);
        entry.set_mtime(
            std::fs::metadata(&path)?
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_secs()),
        );
        builder.append_data(&mut entry, &inside, stream)?;
    }
    Ok(())
}

#[derive(Debug, Deserialize)]
struct GgufQuery {
    #[serde(rename = "type")]
    ty: Option<String>,
}

/// `GET /api/jobs/{id}/checkpoints/{name}/gguf?type=q8_0|f16` (q8_0 by default): written into
/// a hidden temporary folder beside the run folders, opened, the folder removed (the open file
/// stays readable until the download ends, and nothing is left behind however it ends), then
/// streamed.
async fn gguf(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath((id, name)): ApiPath<(i64, String)>,
    Query(query): Query<GgufQuery>,
) -> ApiResult<Response> {
    let ty: GgufType = query
        .ty
        .as_deref()
        .unwrap_or("q8_0")
        .parse()
        .map_err(|e: sluice_engine::Error| ApiError::bad_request(e.to_string()))?;
    let dir = checkpoint_dir(&state, &user, id, &name).await?;
    let runs = runner::run_dir(&state, id).parent().map(Path::to_path_buf).ok_or_else(|| {
        ApiError::internal(anyhow::anyhow!("run folder of job {id} has no parent"))
    })?;
    let (file, len) = tokio::task::spawn_blocking(move || -> ApiResult<(std::fs::File, u64)> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let tmp = TempFolder(runs.join(format!(".gguf-export-{id}-{}-{nanos}", ty.name())));
        std::fs::create_dir(&tmp.0).map_err(ApiError::internal)?;
        let out = tmp.0.join("model.gguf");
        let summary = export_gguf(&dir, &out, ty).map_err(|e| match e {
            sluice_engine::Error::Io { .. } => ApiError::internal(e),
            other => ApiError::unprocessable(format!("cannot export as GGUF: {other}")),
        })?;
        let file = std::fs::File::open(&out).map_err(ApiError::internal)?;
        Ok((file, summary.bytes))
    })
    .await??;
    let disposition =
        format!("attachment; filename=\"job-{id}-{}-{}.gguf\"", name.replace('"', ""), ty.name());
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, len.to_string()),
            (header::CONTENT_DISPOSITION, disposition),
        ],
        Body::from_stream(ReaderStream::new(tokio::fs::File::from_std(file))),
    )
        .into_response())
}

/// A folder removed with everything in it when dropped, whatever path the export took.
struct TempFolder(PathBuf);

impl Drop for TempFolder {
    fn drop(&mut self) {
        // Best effort: a leftover hidden folder holds nothing anyone reads.
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
