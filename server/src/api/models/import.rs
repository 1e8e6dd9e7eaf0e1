//! `POST /api/models/import`: a llama.cpp GGUF upload streamed to a server-named file, turned by
//! the engine's importer into a Hugging Face folder beside it, and moved into the models area
//! under its chosen name only once complete. A file the importer refuses leaves nothing behind.

use std::path::{Path, PathBuf};

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use sluice_engine::convert::import_gguf;
use tokio::sync::Semaphore;
use tracing::{info, warn};

use crate::AppState;
use crate::api::multipart::{BoundedMultipart, read_upload, refuse_declared_oversize};
use crate::auth::CurrentUser;
use crate::auth::session::random_token;
use crate::error::{ApiError, ApiResult};
use crate::models::{ModelView, local_view};

/// Converting holds every weight in f32 in memory: one import at a time keeps a burst of uploads
/// from exhausting the host.
static CONVERTING: Semaphore = Semaphore::const_new(1);

/// Removes a half-written model folder unless it was moved into place.
struct TempDir(Option<PathBuf>);

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Some(path) = self.0.take()
            && path.exists()
            && let Err(err) = std::fs::remove_dir_all(&path)
        {
            warn!("cannot remove the unfinished import {}: {err}", path.display());
        }
    }
}

/// A folder name for the models area: letters, digits, `.`, `-` and `_`, not starting with `.`.
fn check_name(name: &str) -> ApiResult<()> {
    let ok = !name.is_empty()
        && name.len() <= 100
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad_request(format!(
            "model name {name:?}: use 1 to 100 letters, digits, '.', '-' or '_', not starting with '.'"
        )))
    }
}

/// The default model name: the uploaded file's name without directories and `.gguf`, with other
/// characters replaced by `-`.
fn name_from_file(original: &str) -> String {
    let base = Path::new(original).file_name().and_then(|n| n.to_str()).unwrap_or(original);
    let stem = base.strip_suffix(".gguf").unwrap_or(base);
    let name: String = stem
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') { c } else { '-' })
        .take(100)
        .collect();
    name.trim_start_matches('.').to_string()
}

/// 201 with the new model's listing entry; 400 for a file the importer refuses (with its
/// message), a bad name, or a field other than the file over 1 KiB; 409 when the name is taken;
/// 413 over the upload limit.
pub(super) async fn import(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    headers: HeaderMap,
    mut multipart: BoundedMultipart,
) -> ApiResult<(StatusCode, Json<ModelView>)> {
    let limit = state.config().max_upload_bytes;
    refuse_declared_oversize(&headers, limit)?;
    let models_dir = state.models_dir();
    tokio::fs::create_dir_all(&models_dir).await?;

    let path = models_dir.join(format!(".upload-{}.gguf", random_token()));
    let upload = read_upload(&mut multipart, path, limit, "import", &[]).await?;
    let (temp, size, original) = upload.file;
    let name = upload.name.map(|n| n.trim().to_string());
    let name = name
        .filter(|n| !n.is_empty())
        .or_else(|| original.as_deref().map(name_from_file))
        .unwrap_or_default();
    check_name(&name)?;
    let target = models_dir.join(&name);
    if target.exists() {
        return Err(ApiError::conflict(format!("a model named {name:?} exists already")));
    }
    if size == 0 {
        return Err(ApiError::bad_request("the file is empty"));
    }
    let Some(gguf) = temp.0.clone() else {
        return Err(ApiError::internal(anyhow::anyhow!("import temp file vanished")));
    };
    let shown = original.unwrap_or_else(|| "the upload".to_string());

    let permit = CONVERTING.acquire().await.map_err(ApiError::internal)?;
    let view = tokio::task::spawn_blocking(move || {
        // Held by the conversion itself, which goes on when the client goes away.
        let _permit = permit;
        // The upload's file is removed when `temp` drops, whatever happens here.
        let _temp = temp;
        let staging = TempDir(Some(models_dir.join(format!(".import-{}", random_token()))));
        let out = staging.0.clone().unwrap_or_default();
        let summary = import_gguf(&gguf, &out).map_err(|err| {
            let output_fault =
                matches!(&err, sluice_engine::Error::Io { path, .. } if path.starts_with(&out));
            if output_fault {
                return ApiError::internal(err);
            }
            // The engine names the file it read; the user knows it by its own name.
            let path = gguf.display().to_string();
            let message = err.to_string();
            let message = message.strip_prefix(&format!("weights {path}: ")).unwrap_or(&message);
            let message = message.replace(&path, &shown);
            ApiError::bad_request(format!("cannot import {shown}: {message}"))
        })?;
        if target.exists() {
            return Err(ApiError::conflict(format!("a model named {name:?} exists already")));
        }
        std::fs::rename(&out, &target)?;
        let mut staging = staging;
        staging.0 = None;
        info!(
            "imported {shown} as models/{name}: {} layers, vocabulary {}",
            summary.spec.layers, summary.vocab_size
        );
        local_view(&name, &target).map_err(ApiError::internal)
    })
    .await??;
    info!("user {} imported the model {}", user.username, view.id);
    Ok((StatusCode::CREATED, Json(view)))
}

#[cfg(test)]
mod tests {
    use super::{check_name, name_from_file};

    #[test]
    fn names_are_single_safe_components() {
        for good in ["SmolLM2-135M", "a.b_c", "x"] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for bad in ["", ".hidden", "a/b", "..", "a b", "é"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert_eq!(name_from_file("dir/My Model.Q4_1.gguf"), "My-Model.Q4_1");
        assert_eq!(name_from_file("..gguf"), "");
    }
}
