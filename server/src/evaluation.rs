//! Task evaluations as the appliance shows them: a sample of what a job's evaluation will
//! compare (the first records of its eval set, turned into prompts and references the way the
//! run turns them), and a finished or running job's answers before and after training, read
//! from the reports its run folder keeps (`eval/step-<N>.json`).
//!
//! No HTTP here: `api::evaluation` calls these on a blocking thread (both read files) and
//! `api/errors.rs` turns an [`EvalError`] into a status.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde::Serialize;
use sluice_engine::data::{self, DatasetSource};
use sluice_engine::eval::{EvalItem, EvalMetric, TaskReport, choice_items, items_from_entries};
use sluice_engine::train::{held_out_records, task_reports};

/// Why there is nothing to show.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// The eval set cannot be read, or does not suit the metric; the message names the setting
    /// (`eval_metric`, `held_out`) and, where one is at fault, the record.
    #[error("{0}")]
    Unfit(String),
    /// The job has no task evaluation, or none has been reported yet.
    #[error("{0}")]
    NoReport(String),
    /// A report in the run folder cannot be read.
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

/// Which records a job evaluates on.
#[derive(Debug, Clone, Copy)]
pub enum EvalSet<'a> {
    /// An evaluation dataset of its own: all its records.
    Separate { data: &'a DatasetSource, registry: bool },
    /// The last `held_out` fraction of the training data (at least one record, never all).
    HeldOut { data: &'a DatasetSource, held_out: f64 },
}

/// The first records of an eval set as a task evaluation sees them.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub metric: EvalMetric,
    /// Records in the eval set (a run scores the first `eval_records` of them).
    pub records: usize,
    pub items: Vec<SampleItem>,
}

/// One record: what the model is asked and what its answer is compared with.
#[derive(Debug, Clone, Serialize)]
pub struct SampleItem {
    /// The record's line (or number) in its file.
    pub line: usize,
    /// The prompt as the answers table shows it (a conversation's last user turn).
    pub prompt: String,
    pub reference: String,
    /// For `choice`: every choice, the reference being the right one.
    pub choices: Vec<String>,
}

/// The first `n` eval items of `set` under `metric`, with how many it has.
pub fn sample(set: EvalSet<'_>, metric: EvalMetric, n: usize) -> Result<Sample, EvalError> {
    if metric == EvalMetric::Loss {
        return Err(EvalError::Unfit(
            "eval_metric loss compares no answers: choose a task metric to see what it compares"
                .into(),
        ));
    }
    let unfit = |e: sluice_engine::Error| EvalError::Unfit(named(metric, &e));
    let items: Vec<EvalItem> = match set {
        EvalSet::Separate { registry: true, .. } if metric == EvalMetric::Choice => {
            return Err(EvalError::Unfit(
                "eval_metric choice reads a JSON Lines file of questions with choices, not a \
                 dataset registry"
                    .into(),
            ));
        }
        EvalSet::Separate { data, .. } if metric == EvalMetric::Choice => {
            choice_items(data.path()).map_err(unfit)?
        }
        EvalSet::Separate { data, .. } => {
            let (_, entries) = data::read_entries(data).map_err(unfit)?;
            items_from_entries(&entries, metric).map_err(unfit)?
        }
        EvalSet::HeldOut { data, held_out } => {
            // Refuses `choice` (training records have no choices) before reading anything.
            items_from_entries(&[], metric).map_err(unfit)?;
            if !(held_out.is_finite() && held_out > 0.0 && held_out <= 0.5) {
                return Err(EvalError::Unfit(format!(
                    "held_out must be above 0 and at most 0.5 (a fraction of the data), got \
                     {held_out}"
                )));
            }
            let (_, mut entries) = data::read_entries(data).map_err(unfit)?;
            let total = entries.len();
            let Some(held) = held_out_records(total, held_out) else {
                return Err(EvalError::Unfit(format!(
                    "eval_metric {metric}: the dataset has {total} record; holding some out \
                     needs at least 2, or give an evaluation dataset"
                )));
            };
            let held = entries.split_off(total - held);
            items_from_entries(&held, metric).map_err(unfit)?
        }
    };
    if items.is_empty() {
        return Err(EvalError::Unfit(format!("eval_metric {metric}: the eval set has no records")));
    }
    let records = items.len();
    let items = items
        .into_iter()
        .take(n)
        .map(|item| SampleItem {
            line: item.line,
            prompt: item.prompt.shown(),
            reference: item.reference,
            choices: item.choices,
        })
        .collect();
    Ok(Sample { metric, records, items })
}

/// An engine error about the eval set, for the user: its record named, the server's file name
/// left out, and the setting it concerns first (the form marks the field a message starts with).
fn named(metric: EvalMetric, err: &sluice_engine::Error) -> String {
    use sluice_engine::Error;
    let why = match err {
        Error::Invalid(message) => message.clone(),
        Error::DatasetRecord { line, message, .. } => format!("line {line}: {message}"),
        Error::Dataset { message, .. } => message.clone(),
        other => crate::datasets::strip_path(&other.to_string()),
    };
    if why.starts_with("eval_metric") { why } else { format!("eval_metric {metric}: {why}") }
}

/// A run's answers before training and after its latest evaluation, record by record.
#[derive(Debug, Clone, Serialize)]
pub struct Answers {
    pub metric: EvalMetric,
    pub higher_is_better: bool,
    /// The base model's report (step 0).
    pub base_step: u64,
    pub base_score: f64,
    /// The latest report after it; `None` while only the base model has been scored.
    pub tuned_step: Option<u64>,
    pub tuned_score: Option<f64>,
    /// Other figures beside each score (`acc_norm` for `choice`).
    pub base_extra: BTreeMap<String, f64>,
    pub tuned_extra: Option<BTreeMap<String, f64>>,
    /// By line in the eval set.
    pub records: Vec<AnswerRow>,
}

/// One record, as the base model and the tuned one answered it.
#[derive(Debug, Clone, Serialize)]
pub struct AnswerRow {
    pub line: usize,
    pub prompt: String,
    pub reference: String,
    pub base_answer: Option<String>,
    pub base_score: Option<f64>,
    pub tuned_answer: Option<String>,
    pub tuned_score: Option<f64>,
}

/// The answers in run folder `run`: its first report (the base model's, step 0) and its
/// latest, joined by line. [`EvalError::NoReport`] before the first report is written.
pub fn answers(run: &Path) -> Result<Answers, EvalError> {
    let steps = task_reports::steps(run);
    let (Some(&base_step), Some(&last)) = (steps.first(), steps.last()) else {
        return Err(EvalError::NoReport(
            "no task evaluation has been reported yet: the base model is scored before the \
             first step"
                .into(),
        ));
    };
    let load = |step: u64| -> Result<TaskReport, EvalError> {
        task_reports::load(run, step).map_err(|e| EvalError::Internal(anyhow::anyhow!("{e}")))
    };
    let base = load(base_step)?;
    let tuned = if last == base_step { None } else { Some(load(last)?) };
    Ok(join(base_step, &base, tuned.as_ref().map(|t| (last, t))))
}

/// Two reports side by side, by line: the base's records in order, then any only the tuned
/// report has.
fn join(base_step: u64, base: &TaskReport, tuned: Option<(u64, &TaskReport)>) -> Answers {
    let later: HashMap<usize, &sluice_engine::eval::Answer> =
        tuned.map(|(_, t)| t.answers.iter().map(|a| (a.line, a)).collect()).unwrap_or_default();
    let mut records: Vec<AnswerRow> = base
        .answers
        .iter()
        .map(|a| {
            let after = later.get(&a.line);
            AnswerRow {
                line: a.line,
                prompt: a.prompt.clone(),
                reference: a.reference.clone(),
                base_answer: Some(a.output.clone()),
                base_score: Some(a.score),
                tuned_answer: after.map(|t| t.output.clone()),
                tuned_score: after.map(|t| t.score),
            }
        })
        .collect();
    if let Some((_, t)) = tuned {
        let seen: std::collections::HashSet<usize> = base.answers.iter().map(|a| a.line).collect();
        records.extend(t.answers.iter().filter(|a| !seen.contains(&a.line)).map(|a| AnswerRow {
            line: a.line,
            prompt: a.prompt.clone(),
            reference: a.reference.clone(),
            base_answer: None,
            base_score: None,
            tuned_answer: Some(a.output.clone()),
            tuned_score: Some(a.score),
        }));
    }
    Answers {
        metric: base.metric,
        higher_is_better: base.metric.higher_is_better(),
        base_step,
        base_score: base.score,
        tuned_step: tuned.map(|(step, _)| step),
        tuned_score: tuned.map(|(_, t)| t.score),
        base_extra: base.extra.clone(),
        tuned_extra: tuned.map(|(_, t)| t.extra.clone()),
        records,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_engine::eval::Answer;

    fn report(score: f64, answers: &[(usize, &str, f64)]) -> TaskReport {
        TaskReport {
            metric: EvalMetric::ExactMatch,
            score,
            extra: BTreeMap::new(),
            answers: answers
                .iter()
                .map(|&(line, output, score)| Answer {
                    line,
                    prompt: format!("question {line}"),
                    reference: "ok".into(),
                    output: output.into(),
                    score,
                })
                .collect(),
            timing: None,
        }
    }

    #[test]
    fn reports_join_by_line_with_records_only_one_side_has() {
        let base = report(0.0, &[(3, "no", 0.0), (5, "nope", 0.0)]);
        let tuned = report(1.0, &[(5, "ok", 1.0), (3, "ok", 1.0), (9, "ok", 1.0)]);
        let joined = join(0, &base, Some((40, &tuned)));
        assert_eq!((joined.base_step, joined.tuned_step), (0, Some(40)));
        assert_eq!((joined.base_score, joined.tuned_score), (0.0, Some(1.0)));
        let lines: Vec<usize> = joined.records.iter().map(|r| r.line).collect();
        assert_eq!(lines, vec![3, 5, 9]);
        let five = &joined.records[1];
        assert_eq!(five.base_answer.as_deref(), Some("nope"));
        assert_eq!(five.tuned_answer.as_deref(), Some("ok"));
        assert_eq!(joined.records[2].base_answer, None);

        let alone = join(0, &base, None);
        assert_eq!(alone.tuned_step, None);
        assert!(alone.records.iter().all(|r| r.tuned_answer.is_none()));
    }

    #[test]
    fn a_run_without_reports_has_no_answers() {
        let dir = tempfile::tempdir().expect("temp dir");
        let err = answers(dir.path()).expect_err("no report");
        assert!(matches!(err, EvalError::NoReport(_)), "{err}");
    }
}
