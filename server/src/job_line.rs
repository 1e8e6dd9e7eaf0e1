//! A job as the `sluice train` line that runs it: what the appliance shows beside a job and
//! its plan, so a user can run the same job from a terminal. Both the command line (whose
//! parser the line must read back to the same job) and the queue use it.

use std::path::Path;

use serde_json::Value;
use sluice_engine::data::{DatasetSource, ReadOptions};
use sluice_engine::train::{Job, ModelSource};

/// The `sluice train` command line that runs `job` (its run folder left to the default):
/// what the appliance shows beside a job. Settings at their defaults are left out.
pub fn command_line(job: &Job) -> String {
    let mut words: Vec<String> = vec!["sluice".into(), "train".into()];
    // A flag and its value, or a switch alone.
    let mut flag = |name: &str, value: Option<String>| {
        words.push(format!("--{name}"));
        words.extend(value);
    };
    let path = |p: &Path| p.display().to_string();
    match &job.model {
        ModelSource::Dir(dir) => flag("model", Some(path(dir))),
        ModelSource::Preset(name) => flag("preset", Some(name.clone())),
    }
    flag("data", Some(path(job.data.path())));
    if let DatasetSource::Registry { name, .. } = job.data.clone().with(ReadOptions::default()) {
        flag("dataset", Some(name));
    }
    let read = job.data.read_options();
    if !read.columns.is_empty() {
        flag("columns", Some(read.columns.to_flag()));
    }
    if let Some(eval) = &job.eval_data {
        flag("eval-data", Some(path(eval.path())));
    }
    flag("device", Some(job.devices.to_string()));
    // Every setting that differs from its default, the batch shape always; each flag is the
    // setting's name with dashes (`cli/settings.rs`).
    for (name, value) in job.settings.changed(&["seq_len", "micro_batch", "grad_accum"]) {
        let name = name.replace('_', "-");
        match value {
            Value::Bool(true) => flag(&name, None),
            Value::Bool(false) | Value::Null => {}
            Value::String(text) => flag(&name, Some(text)),
            number => flag(&name, Some(short_number(&number))),
        }
    }
    if job.data.skips_invalid() {
        flag("skip-invalid", None);
    }
    words.iter().map(|w| shell_quote(w)).collect::<Vec<_>>().join(" ")
}

/// `word` as a POSIX shell reads it back: bare when it is only safe characters, else in
/// single quotes.
pub fn shell_quote(word: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "-_./:,=+@%".contains(c);
    if !word.is_empty() && word.chars().all(safe) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// A number as a person writes it on a command line: integers as they are, fractions in the
/// shorter of plain and scientific notation (`0.25`, `1e-3`); both read back as the same value.
fn short_number(number: &Value) -> String {
    match number.as_f64() {
        Some(x) if !(number.is_i64() || number.is_u64()) => {
            let (plain, scientific) = (number.to_string(), format!("{x:e}"));
            if scientific.len() < plain.len() { scientific } else { plain }
        }
        _ => number.to_string(),
    }
}
