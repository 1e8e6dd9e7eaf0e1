//! A fine-tune that measurably works, on the CPU: SmolLM2-135M-Instruct (imported from
//! llama.cpp's GGUF file, fetched by `scripts/fetch_test_assets.sh`) learns to label short
//! reviews in a made-up format, `verdict: thumbs-up` or `verdict: thumbs-down`, which the base
//! model never writes. The held-out reviews use adjectives the training reviews never do, so
//! only the model's own sense of the words can label them. Exact match on them is measured by
//! the run's task evaluation before step 1 and after the last step.

use std::path::{Path, PathBuf};

use sluice_engine::backend::cpu::Cpu;
use sluice_engine::convert::import_gguf;
use sluice_engine::data::DatasetSource;
use sluice_engine::eval::{EvalMetric, TaskReport};
use sluice_engine::optim::Schedule;
use sluice_engine::train::{Devices, Event, Job, JobSettings, ModelSource, Observer, RunOptions};

fn asset(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/test-assets").join(relative)
}

const POSITIVE: [&str; 18] = [
    "wonderful",
    "great",
    "excellent",
    "delightful",
    "fantastic",
    "superb",
    "lovely",
    "brilliant",
    "amazing",
    "charming",
    "enjoyable",
    "marvelous", // trained on
    "outstanding",
    "terrific",
    "pleasant",
    "splendid",
    "magnificent",
    "fabulous", // held out
];
const NEGATIVE: [&str; 18] = [
    "terrible",
    "awful",
    "horrible",
    "dreadful",
    "boring",
    "disappointing",
    "bad",
    "poor",
    "unpleasant",
    "miserable",
    "annoying",
    "mediocre", // trained on
    "atrocious",
    "dull",
    "lousy",
    "painful",
    "pathetic",
    "frustrating", // held out
];
const NOUNS: [&str; 8] = ["movie", "meal", "hotel", "concert", "book", "service", "trip", "game"];
const TRAINED: usize = 12;

fn review(noun: &str, adjective: &str, good: bool) -> String {
    let verdict = if good { "verdict: thumbs-up" } else { "verdict: thumbs-down" };
    serde_json::json!({"messages": [
        {"role": "user", "content": format!("Review: The {noun} was {adjective}.")},
        {"role": "assistant", "content": verdict},
    ]})
    .to_string()
}

fn write(path: &Path, lines: Vec<String>) {
    std::fs::write(path, lines.join("\n") + "\n").expect("writes a dataset");
}

#[derive(Default)]
struct Reports(Vec<(u64, TaskReport)>);

impl Observer for Reports {
    fn event(&mut self, event: &Event) {
        match event {
            Event::TaskEvaluated { step, report } => {
                println!("step {step}: exact match {:.3}", report.score);
                self.0.push((*step, report.clone()));
            }
            Event::Step(m) => {
                println!("step {} loss {:.4} ({:.1} s)", m.step, m.loss, m.elapsed.as_secs_f64())
            }
            _ => {}
        }
    }
}

#[test]
fn smollm2_learns_a_labelling_task_it_cannot_do_before() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let base = tmp.path().join("smollm2");
    import_gguf(&asset("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), &base).expect("imports");
    let (train, held_out) = (tmp.path().join("train.jsonl"), tmp.path().join("held_out.jsonl"));
    let mut lines = Vec::new();
    for (i, noun) in NOUNS.iter().enumerate() {
        for k in 0..TRAINED {
            // Each noun with half the adjectives of each side, alternating, so every adjective
            // meets several nouns and the two labels stay balanced.
            if (i + k) % 2 == 0 {
                lines.push(review(noun, POSITIVE[k], true));
                lines.push(review(noun, NEGATIVE[k], false));
            }
        }
    }
    write(&train, lines);
    let mut held = Vec::new();
    for (i, noun) in NOUNS.iter().enumerate().take(4) {
        for k in TRAINED..POSITIVE.len() {
            held.push(review(noun, if i % 2 == 0 { POSITIVE[k] } else { NEGATIVE[k] }, i % 2 == 0));
        }
    }
    write(&held_out, held);

    let job = Job {
        model: ModelSource::Dir(base.clone()),
        data: DatasetSource::File(train),
        eval_data: Some(DatasetSource::File(held_out)),
        devices: Devices::Cpu,
        settings: JobSettings {
            seq_len: 128,
            micro_batch: 4,
            steps: Some(14),
            lr: Some(1e-4),
            warmup: 2,
            schedule: Schedule::Constant,
            seed: 1,
            eval_metric: EvalMetric::ExactMatch,
            eval_max_new_tokens: 8,
            ..JobSettings::default()
        },
    };
    let out = tmp.path().join("run");
    let options = RunOptions::unplanned(job, out).expect("placement");
    let mut reports = Reports::default();
    sluice_engine::train::run(&Cpu::new(), &options, false, &mut reports).expect("fine-tunes");

    let (before, after) = (&reports.0[0], reports.0.last().expect("a final evaluation"));
    assert_eq!((before.0, after.0), (0, 14));
    println!(
        "held-out exact match: base model {:.3} -> fine-tuned {:.3}",
        before.1.score, after.1.score
    );
    for a in &after.1.answers {
        println!(
            "  {:<40} {:<22} base {:?}",
            a.prompt,
            a.output,
            before.1.answers.iter().find(|b| b.line == a.line).map(|b| &b.output)
        );
    }
    assert!(before.1.score < 0.1, "the base model already does the task: {:?}", before.1);
    assert!(after.1.score > 0.7, "the fine-tune did not learn the task: {:?}", after.1);
    // The answers table's material: the same prompts, base answers wrong, tuned ones right.
    let improved = after
        .1
        .answers
        .iter()
        .filter(|a| a.score == 1.0)
        .filter(|a| before.1.answers.iter().any(|b| b.line == a.line && b.score == 0.0))
        .count();
    assert!(improved as f64 > 0.6 * after.1.answers.len() as f64, "{improved} improved");
}
