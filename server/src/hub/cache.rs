//! The Hugging Face cache folder layout (see the module above): reading the models a cache
//! holds, and writing a pulled snapshot into it so that a half-pulled model is never listed.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{check_repo, is_commit};

/// The file `TensorSource` reads a single-file model from.
pub const SINGLE_WEIGHTS: &str = "model.safetensors";
/// The index `TensorSource` reads a sharded model through.
pub const WEIGHTS_INDEX: &str = "model.safetensors.index.json";

/// One snapshot of a cache that holds a model Sluice can train.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedModel {
    /// `Org/Name`.
    pub repo: String,
    /// The branch or tag that points to this snapshot (`main` first), else its commit.
    pub revision: String,
    pub commit: String,
    /// `snapshots/<commit>`: a Hugging Face model folder (through symlinks).
    pub dir: PathBuf,
}

impl CachedModel {
    /// The model id jobs use: `hf:Org/Name@revision`.
    pub fn id(&self) -> String {
        format!("hf:{}@{}", self.repo, self.revision)
    }
}

/// The user's Hugging Face cache as `huggingface_hub` finds it after `HF_HUB_CACHE` (which the
/// caller reads): `HF_HOME/hub`, else `~/.cache/huggingface/hub` (`XDG_CACHE_HOME` in place of
/// `~/.cache` when set).
pub fn user_cache_from_env() -> Option<PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(home) = var("HF_HOME") {
        return Some(home.join("hub"));
    }
    let cache = var("XDG_CACHE_HOME").or_else(|| var("HOME").map(|h| h.join(".cache")))?;
    Some(cache.join("huggingface").join("hub"))
}

/// `models--Org--Name`, the folder of `repo` in a cache.
pub fn repo_folder(repo: &str) -> String {
    format!("models--{}", repo.replace('/', "--"))
}

/// The repo id a cache folder stands for, if it is a model folder with a valid name.
pub fn repo_of_folder(folder: &str) -> Option<String> {
    let repo = folder.strip_prefix("models--")?.replace("--", "/");
    check_repo(&repo).ok().map(|()| repo)
}

/// Every usable snapshot in the cache at `root`, by repo then revision. A missing or unreadable
/// cache holds nothing; snapshots without a config.json and complete safetensors weights (what
/// `AutoConfig` alone leaves, or a download cut short) are left out.
pub fn list(root: &Path) -> Vec<CachedModel> {
    let mut models = Vec::new();
    let Ok(entries) = std::fs::read_dir(root) else { return models };
    for entry in entries.flatten() {
        let Some(repo) = entry.file_name().to_str().and_then(repo_of_folder) else { continue };
        let folder = entry.path();
        let refs = refs_by_commit(&folder.join("refs"));
        let Ok(snapshots) = std::fs::read_dir(folder.join("snapshots")) else { continue };
        for snapshot in snapshots.flatten() {
            let Some(commit) = snapshot.file_name().to_str().map(str::to_string) else { continue };
            if commit.starts_with('.') || !usable(&snapshot.path()) {
                continue;
            }
            let revision = refs.get(&commit).and_then(|names| names.first()).cloned();
            models.push(CachedModel {
                repo: repo.clone(),
                revision: revision.unwrap_or_else(|| commit.clone()),
                commit,
                dir: snapshot.path(),
            });
        }
    }
    models.sort_by(|a, b| (&a.repo, &a.revision).cmp(&(&b.repo, &b.revision)));
    models
}

/// The usable snapshot `revision` (a name under `refs/`, or a commit) of `repo` in `root`.
pub fn find(root: &Path, repo: &str, revision: &str) -> Option<CachedModel> {
    check_repo(repo).ok()?;
    super::check_revision(revision).ok()?;
    let folder = root.join(repo_folder(repo));
    let commit = match read_ref(&folder.join("refs").join(revision)) {
        Some(commit) => commit,
        None if is_commit(revision) => revision.to_string(),
        None => return None,
    };
    let dir = folder.join("snapshots").join(&commit);
    usable(&dir).then(|| CachedModel {
        repo: repo.to_string(),
        revision: revision.to_string(),
        commit,
        dir,
    })
}

/// Ref names per commit, `main` first, then by name.
fn refs_by_commit(refs: &Path) -> BTreeMap<String, Vec<String>> {
    let mut by_commit: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(refs) else { return by_commit };
    for entry in entries.flatten() {
        let Some(name) = entry.file_name().to_str().map(str::to_string) else { continue };
        if super::check_revision(&name).is_err() {
            continue;
        }
        if let Some(commit) = read_ref(&entry.path()) {
            by_commit.entry(commit).or_default().push(name);
        }
    }
    for names in by_commit.values_mut() {
        names.sort_by_key(|name| (name != "main", name.clone()));
    }
    by_commit
}

/// The commit a ref file holds, if it holds one.
fn read_ref(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let commit = text.trim();
    is_commit(commit).then(|| commit.to_string())
}

#[derive(Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

/// The shard files a `model.safetensors.index.json` names, each once; `None` when it is not a
/// weight index or names a file outside its folder.
pub fn index_shards(text: &str) -> Option<Vec<String>> {
    let index: Index = serde_json::from_str(text).ok()?;
    let mut shards: Vec<String> = index.weight_map.into_values().collect();
    shards.sort();
    shards.dedup();
    let plain =
        shards.iter().all(|s| crate::paths::is_plain_name(s) && s.ends_with(".safetensors"));
    (plain && !shards.is_empty()).then_some(shards)
}

/// Whether `dir` holds config.json and whole safetensors weights (every shard of an index).
/// Links into missing blobs do not count.
fn usable(dir: &Path) -> bool {
    if !dir.join("config.json").is_file() {
        return false;
    }
    if dir.join(SINGLE_WEIGHTS).is_file() {
        return true;
    }
    let Ok(text) = std::fs::read_to_string(dir.join(WEIGHTS_INDEX)) else { return false };
    index_shards(&text).is_some_and(|shards| shards.iter().all(|s| dir.join(s).is_file()))
}

/// `blobs/` of `repo` in `root`.
pub fn blobs_dir(root: &Path, repo: &str) -> PathBuf {
    root.join(repo_folder(repo)).join("blobs")
}

/// Makes `snapshots/<commit>` link each `(file, blob)` to `../../blobs/<blob>`, then points
/// `refs/<revision>` at it (unless the revision is the commit). The links are made in a hidden
/// folder renamed into place, and the ref is written last, so a reader sees the old snapshot
/// or the whole new one.
pub fn write_snapshot(
    root: &Path,
    repo: &str,
    revision: &str,
    commit: &str,
    files: &[(String, String)],
) -> std::io::Result<PathBuf> {
    let folder = root.join(repo_folder(repo));
    let snapshots = folder.join("snapshots");
    std::fs::create_dir_all(&snapshots)?;
    let staging = snapshots.join(format!(".partial-{commit}-{}", std::process::id()));
    if staging.exists() {
        std::fs::remove_dir_all(&staging)?;
    }
    std::fs::create_dir(&staging)?;
    for (file, blob) in files {
        std::os::unix::fs::symlink(Path::new("../../blobs").join(blob), staging.join(file))?;
    }
    let dir = snapshots.join(commit);
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::rename(&staging, &dir)?;
    if revision != commit {
        let refs = folder.join("refs");
        std::fs::create_dir_all(&refs)?;
        let temp = refs.join(format!(".{revision}.{}", std::process::id()));
        let mut file = std::fs::File::create(&temp)?;
        // huggingface_hub writes the bare commit, without a newline.
        file.write_all(commit.as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&temp, refs.join(revision))?;
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::{index_shards, repo_folder, repo_of_folder};

    #[test]
    fn folders_and_repos_map_both_ways() {
        assert_eq!(repo_folder("Qwen/Qwen2.5-7B"), "models--Qwen--Qwen2.5-7B");
        assert_eq!(repo_of_folder("models--Qwen--Qwen2.5-7B").as_deref(), Some("Qwen/Qwen2.5-7B"));
        assert_eq!(repo_of_folder("models--gpt2").as_deref(), Some("gpt2"));
        assert_eq!(repo_of_folder("datasets--a--b"), None);
        assert_eq!(repo_of_folder("models--a--b--c"), None);
    }

    #[test]
    fn index_shards_stay_in_the_folder() {
        let ok = r#"{"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors", "c": "m-1.safetensors"}}"#;
        assert_eq!(
            index_shards(ok),
            Some(vec!["m-1.safetensors".into(), "m-2.safetensors".into()])
        );
        assert_eq!(index_shards(r#"{"weight_map": {"a": "../x.safetensors"}}"#), None);
        assert_eq!(index_shards(r#"{"weight_map": {}}"#), None);
        assert_eq!(index_shards("not json"), None);
    }
}
