//! A run's task evaluations on disk: `eval/step-<N>.json` in the run folder, one
//! [`TaskReport`] (figures and every record's answer) per evaluation, step 0 being the base
//! model's. They outlive the process, so a resumed run still knows the base model's figure and
//! answers, and whoever shows the run reads the answers from here.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::eval::TaskReport;
use crate::weights::write_file_atomically;

/// The folder of a run's task reports.
pub const EVAL_DIR: &str = "eval";

/// Where the report after `step` steps lives.
pub fn path(run: &Path, step: u64) -> PathBuf {
    run.join(EVAL_DIR).join(format!("step-{step}.json"))
}

/// Writes the report after `step` steps (atomically: a reader never sees half of one).
pub fn save(run: &Path, step: u64, report: &TaskReport) -> Result<()> {
    let file = path(run, step);
    let dir = run.join(EVAL_DIR);
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    let json = serde_json::to_vec(report)
        .map_err(|e| Error::invalid(format!("cannot describe the evaluation: {e}")))?;
    write_file_atomically(&file, |w| w.write_all(&json))
}

/// Reads the report after `step` steps.
pub fn load(run: &Path, step: u64) -> Result<TaskReport> {
    let file = path(run, step);
    let bytes = std::fs::read(&file).map_err(|e| Error::io(&file, e))?;
    serde_json::from_slice(&bytes)
        .map_err(|e| Error::invalid(format!("{}: not a task report: {e}", file.display())))
}

/// The steps a run has task reports for, in order.
pub fn steps(run: &Path) -> Vec<u64> {
    let mut steps: Vec<u64> = std::fs::read_dir(run.join(EVAL_DIR))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            name.strip_prefix("step-")?.strip_suffix(".json")?.parse().ok()
        })
        .collect();
    steps.sort_unstable();
    steps
}
