//! Which `checkpoint-<step>` folders a run saves and keeps. Without an explicit `save_every` a
//! run saves a few times over its length (not every ten steps of a long run); with a limit, it
//! keeps the latest few and the one with the best held-out loss, and removes the others as it
//! goes. `final/` is never removed, and the resumable state (`state/`) is separate: it is always
//! the latest save's, whatever is pruned.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::weights::write_file_atomically;

/// `OUT/checkpoints.json`: each kept checkpoint's step and held-out loss, so the best one is
/// still known after a restart.
pub const CHECKPOINTS_FILE: &str = "checkpoints.json";

/// Saves over a run whose job sets no `save_every`, about.
pub const AUTO_SAVES: u64 = 5;

/// Steps between periodic checkpoints: `save_every` when set; otherwise about [`AUTO_SAVES`]
/// over `steps`, and none for runs too short for them to matter (the final save remains).
pub fn save_interval(save_every: Option<u64>, steps: u64) -> Option<u64> {
    save_every.or_else(|| (steps >= 2 * AUTO_SAVES).then(|| steps.div_ceil(AUTO_SAVES)))
}

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
struct Saved {
    step: u64,
    eval_loss: Option<f64>,
}

/// The step of a `checkpoint-<step>` folder name.
fn step_of(name: &str) -> Option<u64> {
    name.strip_prefix("checkpoint-")?.parse().ok()
}

fn read_saved(out: &Path) -> BTreeMap<u64, Saved> {
    // A missing or damaged record only loses which checkpoint was best; pruning still keeps the
    // latest ones, so it is not an error.
    std::fs::read(out.join(CHECKPOINTS_FILE))
        .ok()
        .and_then(|bytes| serde_json::from_slice::<Vec<Saved>>(&bytes).ok())
        .map(|list| list.into_iter().map(|s| (s.step, s)).collect())
        .unwrap_or_default()
}

/// Records that `checkpoint-<step>` was saved in `out` with held-out loss `eval_loss`, then,
/// with `keep_last`, removes every other `checkpoint-<n>` folder but the latest `keep_last`
/// (at least one) and the best by held-out loss. Returns the removed folders.
pub fn record_and_prune(
    out: &Path,
    step: u64,
    eval_loss: Option<f64>,
    keep_last: Option<usize>,
) -> Result<Vec<PathBuf>> {
    let mut saved = read_saved(out);
    saved.insert(step, Saved { step, eval_loss });
    let on_disk: Vec<u64> = std::fs::read_dir(out)
        .map_err(|e| Error::io(out, e))?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| e.file_name().to_str().and_then(step_of))
        .collect();
    saved.retain(|s, _| on_disk.contains(s));
    let mut removed = Vec::new();
    if let Some(keep_last) = keep_last {
        let mut steps: Vec<u64> = on_disk.clone();
        steps.sort_unstable();
        let recent = &steps[steps.len().saturating_sub(keep_last.max(1))..];
        let best = saved
            .values()
            .filter_map(|s| s.eval_loss.filter(|l| l.is_finite()).map(|l| (l, s.step)))
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
            .map(|(_, step)| step);
        for &old in steps.iter().filter(|s| !recent.contains(s) && Some(**s) != best) {
            let dir = out.join(format!("checkpoint-{old}"));
            // Renamed first, so no half-removed folder ever carries a checkpoint's name.
            let aside = out.join(format!(".pruned-checkpoint-{old}"));
            std::fs::rename(&dir, &aside).map_err(|e| Error::io(&dir, e))?;
            std::fs::remove_dir_all(&aside).map_err(|e| Error::io(&aside, e))?;
            saved.remove(&old);
            removed.push(dir);
        }
    }
    let list: Vec<Saved> = saved.into_values().collect();
    let json = serde_json::to_vec_pretty(&list)
        .map_err(|e| Error::invalid(format!("cannot describe the checkpoints: {e}")))?;
    write_file_atomically(&out.join(CHECKPOINTS_FILE), |w| w.write_all(&json))?;
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_interval_scales_with_the_run_unless_set() {
        assert_eq!(save_interval(Some(10), 400), Some(10));
        assert_eq!(save_interval(None, 400), Some(80));
        assert_eq!(save_interval(None, 401), Some(81));
        assert_eq!(save_interval(None, 9), None);
        assert_eq!(save_interval(None, 10), Some(2));
    }

    fn folders(out: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(out)
            .unwrap()
            .flatten()
            .filter(|e| e.file_type().unwrap().is_dir())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn keeps_the_latest_and_the_best_by_eval_loss() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path();
        std::fs::create_dir(out.join("final")).unwrap();
        std::fs::create_dir(out.join("state")).unwrap();
        let losses = [(10, 3.0), (20, 1.5), (30, 2.0), (40, 2.5), (50, 2.2)];
        let mut removed = Vec::new();
        for (step, loss) in losses {
            let dir = out.join(format!("checkpoint-{step}"));
            std::fs::create_dir(&dir).unwrap();
            std::fs::write(dir.join("model.safetensors"), b"weights").unwrap();
            removed.extend(record_and_prune(out, step, Some(loss), Some(2)).unwrap());
        }
        assert_eq!(
            folders(out),
            ["checkpoint-20", "checkpoint-40", "checkpoint-50", "final", "state"],
            "the two latest, the best (step 20), final and state stay"
        );
        assert_eq!(removed, [out.join("checkpoint-10"), out.join("checkpoint-30")]);
        // The best is still known on a later start, from the record.
        std::fs::create_dir(out.join("checkpoint-60")).unwrap();
        record_and_prune(out, 60, None, Some(1)).unwrap();
        assert_eq!(folders(out), ["checkpoint-20", "checkpoint-60", "final", "state"]);
    }

    #[test]
    fn without_a_limit_every_checkpoint_stays() {
        let tmp = tempfile::tempdir().unwrap();
        for step in [1, 2, 3] {
            std::fs::create_dir(tmp.path().join(format!("checkpoint-{step}"))).unwrap();
            assert!(record_and_prune(tmp.path(), step, None, None).unwrap().is_empty());
        }
        assert_eq!(folders(tmp.path()).len(), 3);
    }
}
