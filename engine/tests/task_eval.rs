//! Task evaluation inside a training run, on the CPU: the base model is scored before step 1,
//! again every `eval_every` steps and after the last; each report is saved in the run folder
//! with every record's answer, the figure reaches the model card as "before → after", and a
//! model that learns the task's fixed answer goes from none right to nearly all right. Bad
//! evaluation settings and sets are refused with the field or record named, before a step runs.

use std::path::{Path, PathBuf};

use sluice_engine::backend::cpu::Cpu;
use sluice_engine::data::DatasetSource;
use sluice_engine::eval::{AnswerFormat, EvalMetric, TaskReport};
use sluice_engine::train::{
    Devices, Event, Job, JobSettings, Limits, ModelSource, Observer, RunOptions, task_reports,
};

const STEPS: u64 = 40;

#[derive(Default)]
struct Reports(Vec<(u64, TaskReport)>);

impl Observer for Reports {
    fn event(&mut self, event: &Event) {
        if let Event::TaskEvaluated { step, report } = event {
            self.0.push((*step, report.clone()));
        }
    }
}

/// Requests with varied wording whose answer is always the word `ok`: a random-init model does
/// not say it, a trained one says it to requests it never saw.
fn dataset(dir: &Path) -> PathBuf {
    let words = ["river", "stone", "cloud", "maple", "amber", "north", "quiet", "lemon"];
    let lines: Vec<String> = (0..64)
        .map(|i| {
            let (a, b) = (words[i % 8], words[(i / 8) % 8]);
            serde_json::json!({"instruction": format!("{a} {b} {i}: reply"), "input": "", "output": "ok"})
                .to_string()
        })
        .collect();
    let path = dir.join("ok.jsonl");
    std::fs::write(&path, lines.join("\n")).expect("writes the dataset");
    path
}

fn job(data: &Path, settings: JobSettings) -> Job {
    Job {
        model: ModelSource::Preset("tiny".into()),
        data: DatasetSource::File(data.to_path_buf()),
        eval_data: None,
        devices: Devices::Cpu,
        settings,
    }
}

fn settings() -> JobSettings {
    JobSettings {
        seq_len: 64,
        micro_batch: 4,
        steps: Some(STEPS),
        lr: Some(1e-2),
        eval_every: Some(20),
        held_out: 0.125,
        eval_metric: EvalMetric::ExactMatch,
        eval_max_new_tokens: 4,
        ..JobSettings::default()
    }
}

#[test]
fn a_run_scores_the_base_model_then_the_tuned_one_and_keeps_every_answer() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let data = dataset(tmp.path());
    let out = tmp.path().join("run");
    let options = RunOptions::unplanned(job(&data, settings()), out.clone()).expect("placement");
    let mut reports = Reports::default();
    sluice_engine::train::run(&Cpu::new(), &options, false, &mut reports).expect("the run");

    let steps: Vec<u64> = reports.0.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, vec![0, 20, 40], "before step 1, every eval_every steps, after the last");
    let (before, after) = (&reports.0[0].1, &reports.0[2].1);
    // 64 records, the last 1/8 held out: 8 prompts the model never trained on.
    assert_eq!(before.answers.len(), 8);
    println!("exact match: base {:.3} -> tuned {:.3}", before.score, after.score);
    assert!(before.score < 0.1, "the base model already answers: {before:?}");
    assert!(after.score > 0.7, "the tuned model did not learn the answer: {after:?}");
    for answer in &after.answers {
        assert_eq!(answer.reference, "ok");
        assert!(answer.prompt.ends_with(": reply"), "{answer:?}");
    }
    // Each report is in the run folder, and the card says before → after.
    assert_eq!(task_reports::steps(&out), vec![0, 20, 40]);
    assert_eq!(&task_reports::load(&out, 0).expect("base report"), before);
    let card = std::fs::read_to_string(out.join("final/README.md")).expect("card");
    let line = format!("{:.4} → {:.4}", before.score, after.score);
    assert!(card.contains(&line), "no {line:?} in the card:\n{card}");
}

#[test]
fn bad_evaluation_settings_and_sets_are_refused_by_name() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let data = dataset(tmp.path());
    let run = |settings: JobSettings, eval: Option<&str>| -> String {
        let mut job = job(&data, settings);
        if let Some(text) = eval {
            let path = tmp.path().join("eval.jsonl");
            std::fs::write(&path, text).expect("writes");
            job.eval_data = Some(DatasetSource::File(path));
        }
        let out = tmp.path().join("bad");
        let options = match RunOptions::unplanned(job, out) {
            Ok(options) => options,
            Err(e) => return e.to_string(),
        };
        let mut reports = Reports::default();
        let err = sluice_engine::train::run(&Cpu::new(), &options, false, &mut reports)
            .expect_err("refused");
        assert!(reports.0.is_empty(), "an evaluation ran before the refusal");
        err.to_string()
    };
    let regex = JobSettings {
        eval_metric: EvalMetric::Extract,
        eval_answer: AnswerFormat::Regex,
        eval_pattern: Some("(unclosed".into()),
        ..settings()
    };
    let err = regex.validate(&Limits::ENGINE).expect_err("a bad pattern");
    assert!(err.to_string().starts_with("invalid option: eval_pattern: the regular"), "{err}");
    let err = JobSettings { eval_max_new_tokens: 100_000, ..settings() }
        .validate(&Limits::ENGINE)
        .expect_err("absurd");
    assert!(err.to_string().contains("eval_max_new_tokens"), "{err}");

    let choice = JobSettings { eval_metric: EvalMetric::Choice, ..settings() };
    let err = run(choice.clone(), None);
    assert!(err.contains("choices"), "{err}");
    let err = run(choice.clone(), Some("{\"question\": \"2+2?\", \"answer\": 0}\n"));
    assert!(err.contains("line 1") && err.contains("choices"), "{err}");
    let err =
        run(choice, Some("{\"question\": \"2+2?\", \"choices\": [\"4\", \"5\"], \"answer\": 2}\n"));
    assert!(err.contains("line 1") && err.contains("answer"), "{err}");
    // An eval set in another format than the training set: plain text has no reference.
    let err = run(settings(), Some("{\"text\": \"just some text\"}\n"));
    assert!(err.contains("plain text") && err.contains("record 1"), "{err}");
    // A prompt longer than the model's context.
    let long = "word ".repeat(5000);
    let short = serde_json::json!({"prompt": "fine: reply", "completion": "ok"});
    let long = serde_json::json!({"prompt": long, "completion": "ok"});
    let err = run(settings(), Some(&format!("{short}\n{long}\n")));
    assert!(err.contains("eval record 2") && err.contains("context"), "{err}");
}
