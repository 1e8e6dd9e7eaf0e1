//! What a process killed mid-request can leave in the data directory, removed when the next
//! one starts, each removal logged by name:
//!
//! - `datasets/.upload-*`, `models/.upload-*.gguf`: half-written uploads;
//! - `models/.import-*`: half-built model imports, and `models/.*.partial`, the checkpoint
//!   folder an import (`..import-*.partial`) or any save was writing;
//! - `models/.deleting-*`, `runs/.deleting-*`: folders set aside to be removed;
//! - `runs/.gguf-export-*`: half-written GGUF exports;
//! - `runs/N` that no job owns (their jobs were deleted); inside a job's run folder,
//!   `.pruned-checkpoint-*` (a checkpoint set aside to be removed) and `.*.partial` (a
//!   checkpoint or state being saved);
//! - `hub/models--*/snapshots/.partial-*`: a Hub snapshot being assembled.
//!
//! Names starting with a dot are never a dataset's, a model's, a checkpoint's or a snapshot's, so
//! nothing kept is touched. A checkpoint's `.NAME.old` is not a leftover: a save killed between
//! its two renames leaves the previous checkpoint only there.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use tracing::{info, warn};

use crate::AppState;
use crate::store::jobs as store;

/// Removes the leftovers, logging each; says nothing when there are none.
pub async fn remove_leftovers(state: &AppState) -> anyhow::Result<()> {
    let owned: HashSet<String> = store::all_job_ids(state.pool())
        .await
        .map_err(|e| anyhow::anyhow!("listing jobs: {e:?}"))?
        .into_iter()
        .map(|id| id.to_string())
        .collect();
    let (datasets, models, runs) = (state.datasets_dir(), state.models_dir(), state.runs_dir());
    let hub = state.config().hub_dir();
    let removed = tokio::task::spawn_blocking(move || {
        let mut removed = Vec::new();
        removed.extend(remove_matching(&datasets, |name| name.starts_with(".upload-")));
        removed.extend(remove_matching(&models, |name| {
            name.starts_with(".upload-")
                || name.starts_with(".import-")
                || name.starts_with(".deleting-")
                || is_partial(name)
        }));
        removed.extend(remove_matching(&runs, |name| {
            (name.bytes().all(|b| b.is_ascii_digit()) && !owned.contains(name))
                || name.starts_with(".deleting-")
                || name.starts_with(".gguf-export-")
        }));
        for run in &owned {
            removed.extend(remove_matching(&runs.join(run), |name| {
                name.starts_with(".pruned-checkpoint-") || is_partial(name)
            }));
        }
        for repo in subfolders(&hub) {
            removed.extend(remove_matching(&repo.join("snapshots"), |name| {
                name.starts_with(".partial-")
            }));
        }
        removed
    })
    .await?;
    if !removed.is_empty() {
        info!("removed {} leftover(s) of an earlier run from the data directory", removed.len());
    }
    Ok(())
}

/// A folder `save_hf_folder` was filling: `.NAME.partial`.
fn is_partial(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(".partial")
}

fn subfolders(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect()
}

/// Removes the entries of `dir` whose names `stray` picks (files or whole folders), logging
/// each; returns those that went. A missing `dir` has none.
fn remove_matching(dir: &Path, stray: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else { continue };
        if !stray(&name) {
            continue;
        }
        let path = entry.path();
        let result = match entry.file_type() {
            Ok(t) if t.is_dir() => std::fs::remove_dir_all(&path),
            _ => std::fs::remove_file(&path),
        };
        match result {
            Ok(()) => {
                info!("removed the leftover {}", path.display());
                removed.push(path);
            }
            Err(e) => warn!("cannot remove the leftover {}: {e}", path.display()),
        }
    }
    removed
}
