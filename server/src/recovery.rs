//! What a process killed mid-request can leave in the data directory, removed when the next
//! one starts: half-written uploads (`datasets/.upload-*`, `models/.upload-*.gguf`), half-built
//! model imports (`models/.import-*`), and run folders no job owns (their jobs were deleted).
//! Names starting with a dot are never a dataset's or a model's, so nothing kept is touched.

use std::collections::HashSet;
use std::path::Path;

use tracing::{info, warn};

use crate::AppState;
use crate::store::jobs as store;

/// Removes the leftovers; says nothing when there are none.
pub async fn remove_leftovers(state: &AppState) -> anyhow::Result<()> {
    let owned: HashSet<String> = store::all_job_ids(state.pool())
        .await
        .map_err(|e| anyhow::anyhow!("listing jobs: {e:?}"))?
        .into_iter()
        .map(|id| id.to_string())
        .collect();
    let (datasets, models, runs) = (state.datasets_dir(), state.models_dir(), state.runs_dir());
    let removed = tokio::task::spawn_blocking(move || {
        let mut removed = 0;
        removed += remove_matching(&datasets, |name| name.starts_with(".upload-"));
        removed += remove_matching(&models, |name| {
            name.starts_with(".upload-")
                || name.starts_with(".import-")
                || name.starts_with(".deleting-")
        });
        removed += remove_matching(&runs, |name| {
            (name.bytes().all(|b| b.is_ascii_digit()) && !owned.contains(name))
                || name.starts_with(".deleting-")
        });
        removed
    })
    .await?;
    if removed > 0 {
        info!("removed {removed} leftover(s) of an earlier run from the data directory");
    }
    Ok(())
}

/// Removes the entries of `dir` whose names `stray` picks (files or whole folders); returns
/// how many went. A missing `dir` has none.
fn remove_matching(dir: &Path, stray: impl Fn(&str) -> bool) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut removed = 0;
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
            Ok(()) => removed += 1,
            Err(e) => warn!("cannot remove the leftover {}: {e}", path.display()),
        }
    }
    removed
}
