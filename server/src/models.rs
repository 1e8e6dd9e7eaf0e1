//! Models a job can train: the engine's random-init presets (`preset:<name>`) and Hugging Face
//! folders under `DATA_DIR/models/<folder>` (`local:<folder>`), some of them imported from GGUF
//! uploads (see `api::models`).

use std::path::{Path, PathBuf};

use serde::Serialize;
use sluice_engine::data::{self, Tokenizer};
use sluice_engine::spec::{self, ModelSpec};
use sluice_engine::train::ModelSource;
use tracing::warn;

use crate::AppState;
use crate::error::{ApiError, ApiResult};

#[derive(Debug, Clone, Serialize)]
pub struct ModelView {
    pub id: String,
    pub name: String,
    /// `model_type` as transformers writes it: llama, qwen2, qwen3, mistral.
    pub family: &'static str,
    pub params: usize,
    /// "preset" or "local".
    pub kind: &'static str,
    pub description: String,
}

/// A model id checked against what exists.
#[derive(Debug, Clone)]
pub struct ResolvedModel {
    pub id: String,
    pub source: ModelSource,
    pub spec: ModelSpec,
}

impl ResolvedModel {
    pub fn is_preset(&self) -> bool {
        matches!(self.source, ModelSource::Preset(_))
    }

    /// The tokenizer a run uses: the model folder's, or the bundled one for presets.
    pub fn tokenizer(&self) -> sluice_engine::Result<Tokenizer> {
        match &self.source {
            ModelSource::Dir(dir) => Tokenizer::from_dir(dir),
            ModelSource::Preset(_) => data::tiny_tokenizer(),
        }
    }
}

/// `preset:<name>` or `local:<folder>` to its spec; 400 naming the id when it is unknown.
pub fn resolve(state: &AppState, id: &str) -> ApiResult<ResolvedModel> {
    let unknown = |why: String| ApiError::bad_request(format!("unknown model {id:?}: {why}"));
    if let Some(name) = id.strip_prefix("preset:") {
        let spec = spec::preset(name).map_err(|e| unknown(e.to_string()))?;
        return Ok(ResolvedModel {
            id: id.to_string(),
            source: ModelSource::Preset(name.to_string()),
            spec,
        });
    }
    if let Some(folder) = id.strip_prefix("local:") {
        let dir = local_dir(state, folder).ok_or_else(|| unknown("no such folder".into()))?;
        let spec = ModelSpec::from_path(&dir).map_err(|e| unknown(e.to_string()))?;
        return Ok(ResolvedModel { id: id.to_string(), source: ModelSource::Dir(dir), spec });
    }
    Err(unknown("model ids start with \"preset:\" or \"local:\"".into()))
}

/// `DATA_DIR/models/<folder>` when `folder` is one plain path component naming a folder.
fn local_dir(state: &AppState, folder: &str) -> Option<PathBuf> {
    if !crate::paths::is_plain_name(folder) {
        return None;
    }
    let dir = state.models_dir().join(folder);
    dir.is_dir().then_some(dir)
}

/// Every preset, then every local folder with a readable `config.json` (others are logged).
pub fn all(state: &AppState) -> Vec<ModelView> {
    let mut models = Vec::new();
    for (name, description) in spec::PRESETS {
        match spec::preset(name) {
            Ok(spec) => models.push(ModelView {
                id: format!("preset:{name}"),
                name: (*name).to_string(),
                family: spec.family.model_type(),
                params: spec.total_params(),
                kind: "preset",
                description: format!("random init: {description}"),
            }),
            Err(err) => warn!("preset {name}: {err}"),
        }
    }
    let mut local = Vec::new();
    if let Ok(entries) = std::fs::read_dir(state.models_dir()) {
        for entry in entries.flatten() {
            let Some(folder) = entry.file_name().to_str().map(str::to_string) else { continue };
            if !entry.path().is_dir() || !crate::paths::is_plain_name(&folder) {
                continue;
            }
            match local_view(&folder, &entry.path()) {
                Ok(view) => local.push(view),
                Err(err) => warn!("skipping the model folder {}: {err}", entry.path().display()),
            }
        }
    }
    local.sort_by(|a, b| a.name.cmp(&b.name));
    models.extend(local);
    models
}

/// The listing entry of the model folder `dir` named `folder`.
pub(crate) fn local_view(folder: &str, dir: &Path) -> sluice_engine::Result<ModelView> {
    let spec = ModelSpec::from_path(dir)?;
    Ok(ModelView {
        id: format!("local:{folder}"),
        name: folder.to_string(),
        family: spec.family.model_type(),
        params: spec.total_params(),
        kind: "local",
        description: format!("model folder models/{folder}"),
    })
}
