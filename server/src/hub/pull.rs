//! A pull: which files of a repo Sluice needs ([`plan`]), and bringing them into a cache
//! ([`pull`]) with progress, resume and checksums. Blobs are downloaded as
//! `blobs/<hash>.incomplete` and renamed once whole and checked; the snapshot and its ref appear
//! only when every file is there, so a failed pull leaves nothing listed (and its partial blobs
//! for the next pull to resume).

use std::path::Path;

use serde::Serialize;

use super::cache::{self, CachedModel, SINGLE_WEIGHTS, WEIGHTS_INDEX};
use super::client::{Hub, RemoteFile};
use super::{HubError, HubResult, check_repo, check_revision};

/// Besides the weights: the config, generation defaults, every tokenizer file transformers
/// may read, and a multimodal model's processor files (which its checkpoints carry on).
const WANTED: [&str; 13] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
];

/// What a pull will download.
#[derive(Debug, Clone)]
pub struct PullPlan {
    pub repo: String,
    /// As asked for: a branch, tag or commit.
    pub revision: String,
    pub commit: String,
    pub files: Vec<RemoteFile>,
}

impl PullPlan {
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

/// One file's progress.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct FileProgress {
    pub name: String,
    pub done: u64,
    pub total: u64,
}

/// A pull's progress, file by file.
#[derive(Debug, Clone, Serialize)]
pub struct PullProgress {
    pub files: Vec<FileProgress>,
    pub done: u64,
    pub total: u64,
}

impl PullProgress {
    pub fn of(plan: &PullPlan) -> PullProgress {
        let files: Vec<FileProgress> = plan
            .files
            .iter()
            .map(|f| FileProgress { name: f.name.clone(), done: 0, total: f.size })
            .collect();
        PullProgress { files, done: 0, total: plan.total_bytes() }
    }
}

/// Asks the Hub what `repo` holds at `revision` and picks the files Sluice trains from:
/// config.json, the tokenizer files, generation_config.json and the safetensors weights
/// (`model.safetensors`, or the index and exactly the shards it names). Refuses a repo without
/// config.json, tokenizer.json or safetensors weights, and checks that the token opens the repo
/// (gated repos list their files to anyone) by reading its config.json.
pub fn plan(hub: &Hub, repo: &str, revision: &str) -> HubResult<PullPlan> {
    check_repo(repo)?;
    check_revision(revision)?;
    let info = hub.info(repo, revision)?;
    let top: Vec<&RemoteFile> = info.files.iter().filter(|f| !f.name.contains('/')).collect();
    let named = |name: &str| top.iter().find(|f| f.name == name).copied();
    for required in ["config.json", "tokenizer.json"] {
        if named(required).is_none() {
            return Err(HubError::Unusable(format!(
                "{repo} has no {required} at {revision}: Sluice needs a transformers model \
                 folder with {required}"
            )));
        }
    }
    let mut files: Vec<RemoteFile> =
        WANTED.iter().filter_map(|name| named(name)).cloned().collect();
    // A config readable with this token means the weights are too.
    hub.fetch_text(repo, &info.commit, "config.json")?;
    if let Some(single) = named(SINGLE_WEIGHTS) {
        files.push(single.clone());
    } else if let Some(index) = named(WEIGHTS_INDEX) {
        let text = hub.fetch_text(repo, &info.commit, WEIGHTS_INDEX)?;
        let shards = cache::index_shards(&text).ok_or_else(|| {
            HubError::Unusable(format!(
                "{repo}'s {WEIGHTS_INDEX} is not a safetensors weight index"
            ))
        })?;
        files.push(index.clone());
        for shard in shards {
            let file = named(&shard).ok_or_else(|| {
                HubError::Unusable(format!(
                    "{repo}'s {WEIGHTS_INDEX} names {shard}, which the repo does not have"
                ))
            })?;
            files.push(file.clone());
        }
    } else {
        let others: Vec<&str> = top
            .iter()
            .map(|f| f.name.as_str())
            .filter(|n| {
                n.ends_with(".bin")
                    || n.ends_with(".pt")
                    || n.ends_with(".gguf")
                    || n.ends_with(".safetensors")
            })
            .take(3)
            .collect();
        let found = if others.is_empty() {
            String::new()
        } else {
            format!(" (it has {})", others.join(", "))
        };
        return Err(HubError::Unusable(format!(
            "{repo} has no safetensors weights ({SINGLE_WEIGHTS} or {WEIGHTS_INDEX}) at \
             {revision}{found}: Sluice reads safetensors models only"
        )));
    }
    Ok(PullPlan {
        repo: repo.to_string(),
        revision: revision.to_string(),
        commit: info.commit,
        files,
    })
}

/// Downloads the files of `plan` into the cache at `root` that it does not hold yet, then makes
/// the snapshot and its ref. `progress` is called after every chunk.
pub fn pull(
    hub: &Hub,
    root: &Path,
    plan: &PullPlan,
    progress: &mut dyn FnMut(&PullProgress),
) -> HubResult<CachedModel> {
    let disk = |what: &Path, e: std::io::Error| {
        HubError::Failed(format!("cannot write {}: {e}", what.display()))
    };
    let blobs = cache::blobs_dir(root, &plan.repo);
    std::fs::create_dir_all(&blobs).map_err(|e| disk(&blobs, e))?;
    let mut state = PullProgress::of(plan);
    for (i, file) in plan.files.iter().enumerate() {
        let blob = blobs.join(&file.blob);
        let whole = std::fs::metadata(&blob).is_ok_and(|m| m.is_file() && m.len() == file.size);
        if !whole {
            let partial = blobs.join(format!("{}.incomplete", file.blob));
            let before: u64 = state.files[..i].iter().map(|f| f.done).sum();
            hub.download(&plan.repo, &plan.commit, file, &partial, &mut |done| {
                state.files[i].done = done;
                state.done = before + done;
                progress(&state);
            })?;
            std::fs::rename(&partial, &blob).map_err(|e| disk(&blob, e))?;
        }
        state.files[i].done = file.size;
        state.done = state.files.iter().map(|f| f.done).sum();
        progress(&state);
    }
    let links: Vec<(String, String)> =
        plan.files.iter().map(|f| (f.name.clone(), f.blob.clone())).collect();
    cache::write_snapshot(root, &plan.repo, &plan.revision, &plan.commit, &links)
        .map_err(|e| disk(root, e))?;
    cache::find(root, &plan.repo, &plan.revision).ok_or_else(|| {
        HubError::Failed(format!("the snapshot of {} was written but cannot be read", plan.repo))
    })
}
