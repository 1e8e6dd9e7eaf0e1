//! Models a job can train: the engine's random-init presets (`preset:<name>`), Hugging Face
//! folders under `DATA_DIR/models/<folder>` (`local:<folder>`), some of them imported from GGUF
//! uploads (see `api::models`), and snapshots in a Hugging Face cache (`hf:Org/Name@revision`):
//! the appliance's own (`DATA_DIR/hub`, where pulls land) first, then the user's.

use std::path::{Path, PathBuf};

use serde::Serialize;
use sluice_engine::data::{self, Tokenizer};
use sluice_engine::spec::{self, ModelSpec};
use sluice_engine::train::ModelSource;
use tracing::warn;

use crate::AppState;
pub use crate::hub::progress::{PullView, Pulls};

#[derive(Debug, Clone, Serialize)]
pub struct ModelView {
    pub id: String,
    pub name: String,
    /// `model_type` as transformers writes it: llama, qwen2, qwen3, mistral, phi3, gemma2,
    /// gemma3_text, gemma3 (a multimodal folder, whose text model is trained), mixtral,
    /// qwen3_moe, qwen2_moe, gpt_oss.
    pub family: &'static str,
    /// What to know before training it, if anything: for a multimodal folder, that only its
    /// text model is trained.
    pub note: Option<String>,
    pub params: usize,
    /// "preset" (random weights) or "local" (real weights on this machine).
    pub kind: &'static str,
    /// Where it comes from: "preset", "folder" (`models/`), "pulled" (from the Hub, into the
    /// appliance's cache) or "hf-cache" (the user's Hugging Face cache).
    pub origin: &'static str,
    pub description: String,
}

/// What every random-init preset is called where models are chosen.
pub const PRESET_LABEL: &str = "random weights, for trying the appliance, not for real use";

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

/// A model id that names no model the appliance can load: the id and why, for the user.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UnknownModel(pub String);

/// `preset:<name>`, `local:<folder>` or `hf:Org/Name[@revision]` to its spec; `Err` names the
/// id and says why it is unknown.
pub fn resolve(state: &AppState, id: &str) -> Result<ResolvedModel, UnknownModel> {
    let unknown = |why: String| UnknownModel(format!("unknown model {id:?}: {why}"));
    let source = source(state, id).map_err(unknown)?;
    let spec = match &source {
        ModelSource::Preset(name) => spec::preset(name),
        ModelSource::Dir(dir) => ModelSpec::from_path(dir),
    }
    .map_err(|e| unknown(e.to_string()))?;
    Ok(ResolvedModel { id: id.to_string(), source, spec })
}

/// Where model `id` is: the one reading of ids, for the API as for the runner (a job names its
/// model by id, and a pulled model may be deleted between the submit and the start). `Err` says
/// why it is unknown.
pub fn source(state: &AppState, id: &str) -> Result<ModelSource, String> {
    if let Some(name) = id.strip_prefix("preset:") {
        return Ok(ModelSource::Preset(name.to_string()));
    }
    if let Some(folder) = id.strip_prefix("local:") {
        let dir = local_dir(state, folder).ok_or_else(|| "no such folder".to_string())?;
        return Ok(ModelSource::Dir(dir));
    }
    if let Some(name) = id.strip_prefix("hf:") {
        let (repo, revision) = name.split_once('@').unwrap_or((name, "main"));
        let found = hub_caches(state)
            .into_iter()
            .find_map(|(root, _)| crate::hub::cache::find(&root, repo, revision))
            .ok_or_else(|| {
                format!(
                    "{repo} at {revision} is not in the appliance's or your Hugging Face cache \
                     (pull it first)"
                )
            })?;
        return Ok(ModelSource::Dir(found.dir));
    }
    Err("model ids start with \"preset:\", \"local:\" or \"hf:\"".into())
}

/// The Hugging Face caches read, in order, with the origin their models are shown with.
fn hub_caches(state: &AppState) -> Vec<(PathBuf, &'static str)> {
    let mut caches = vec![(state.config().hub_dir(), "pulled")];
    if let Some(user) = &state.config().hub.user_cache {
        caches.push((user.clone(), "hf-cache"));
    }
    caches
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
                note: None,
                params: spec.total_params(),
                kind: "preset",
                origin: "preset",
                description: format!("{PRESET_LABEL}: {description}"),
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
    // A snapshot in both caches is listed once, from the appliance's.
    let mut seen = std::collections::HashSet::new();
    for (root, origin) in hub_caches(state) {
        for cached in crate::hub::cache::list(&root) {
            if !seen.insert(cached.id()) {
                continue;
            }
            match hub_view(&cached, origin, &root) {
                Ok(view) => models.push(view),
                Err(err) => warn!("skipping {} in {}: {err}", cached.id(), root.display()),
            }
        }
    }
    models
}

/// The listing entry of a cached snapshot.
pub(crate) fn hub_view(
    cached: &crate::hub::CachedModel,
    origin: &'static str,
    root: &Path,
) -> sluice_engine::Result<ModelView> {
    let spec = ModelSpec::from_path(&cached.dir)?;
    let short = &cached.commit[..cached.commit.len().min(7)];
    let at = if cached.revision == cached.commit {
        format!("commit {short}")
    } else {
        format!("revision {} (commit {short})", cached.revision)
    };
    let place = if origin == "pulled" {
        "pulled from the Hugging Face Hub".to_string()
    } else {
        format!("in the Hugging Face cache {}", root.display())
    };
    Ok(ModelView {
        id: cached.id(),
        name: cached.repo.clone(),
        family: family(&spec),
        note: note(&spec),
        params: spec.total_params(),
        kind: "local",
        origin,
        description: format!("{place}, {at}"),
    })
}

/// The listing entry of the model folder `dir` named `folder`.
pub(crate) fn local_view(folder: &str, dir: &Path) -> sluice_engine::Result<ModelView> {
    let spec = ModelSpec::from_path(dir)?;
    Ok(ModelView {
        id: format!("local:{folder}"),
        name: folder.to_string(),
        family: family(&spec),
        note: note(&spec),
        params: spec.total_params(),
        kind: "local",
        origin: "folder",
        description: format!("model folder models/{folder}"),
    })
}

/// The `model_type` a folder's config names: the multimodal wrapper's for such a folder.
fn family(spec: &ModelSpec) -> &'static str {
    spec.multimodal.as_ref().map_or(spec.family.model_type(), |m| m.model_type)
}

/// The note a listing carries: a multimodal folder trains its text model only (the parameters
/// shown are the text model's).
fn note(spec: &ModelSpec) -> Option<String> {
    spec.multimodal.as_ref().map(|m| {
        format!(
            "{}: only the text model is trained; the vision tower and projector are copied into \
             every checkpoint unchanged",
            m.architecture
        )
    })
}
