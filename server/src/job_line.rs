//! A job as the `sluice train` line that runs it: what the appliance shows beside a job and
//! its plan, so a user can run the same job from a terminal. Both the command line (whose
//! parser the line must read back to the same job) and the queue use it.

use std::path::Path;

use sluice_engine::data::{DatasetSource, ReadOptions};
use sluice_engine::train::{Job, JobSettings, ModelSource};

/// The `sluice train` command line that runs `job` (its run folder left to the default):
/// what the appliance shows beside a job. Settings at their defaults are left out.
pub fn command_line(job: &Job) -> String {
    let mut words: Vec<String> = vec!["sluice".into(), "train".into()];
    let mut flag = |name: &str, value: String| {
        words.push(format!("--{name}"));
        words.push(value);
    };
    let path = |p: &Path| p.display().to_string();
    match &job.model {
        ModelSource::Dir(dir) => flag("model", path(dir)),
        ModelSource::Preset(name) => flag("preset", name.clone()),
    }
    flag("data", path(job.data.path()));
    if let DatasetSource::Registry { name, .. } = job.data.clone().with(ReadOptions::default()) {
        flag("dataset", name);
    }
    let read = job.data.read_options();
    if !read.columns.is_empty() {
        flag("columns", read.columns.to_flag());
    }
    if let Some(eval) = &job.eval_data {
        flag("eval-data", path(eval.path()));
    }
    flag("device", job.devices.to_string());
    let (s, d) = (&job.settings, JobSettings::default());
    if let Some(steps) = s.steps {
        flag("steps", steps.to_string());
    }
    flag("seq-len", s.seq_len.to_string());
    flag("micro-batch", s.micro_batch.to_string());
    flag("grad-accum", s.grad_accum.to_string());
    if let Some(lr) = s.lr {
        flag("lr", format!("{lr:e}"));
    }
    if s.schedule != d.schedule {
        flag("schedule", s.schedule.to_string());
    }
    if s.warmup != d.warmup {
        flag("warmup", s.warmup.to_string());
    }
    if s.weight_decay != d.weight_decay {
        flag("weight-decay", s.weight_decay.to_string());
    }
    if s.max_grad_norm != d.max_grad_norm {
        flag("max-grad-norm", s.max_grad_norm.to_string());
    }
    if s.gradients != d.gradients {
        flag("gradients", s.gradients.to_string());
    }
    if s.moments != d.moments {
        flag("moments", s.moments.to_string());
    }
    if s.seed != d.seed {
        flag("seed", s.seed.to_string());
    }
    if let Some(n) = s.save_every {
        flag("save-every", n.to_string());
    }
    if s.save_dtype != d.save_dtype {
        flag("save-dtype", s.save_dtype.to_string());
    }
    if let Some(n) = s.eval_every {
        flag("eval-every", n.to_string());
    }
    if s.held_out != d.held_out {
        flag("held-out", s.held_out.to_string());
    }
    if s.train_on_prompt {
        words.push("--train-on-prompt".into());
    }
    if job.data.skips_invalid() {
        words.push("--skip-invalid".into());
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
