//! GGUF export of a fine-tuned real model: SmolLM2-135M-Instruct (imported from its GGUF file)
//! fine-tuned for a few CPU steps, its checkpoint exported as Q8_0 and F16, each file read by
//! llama.cpp's own Python package (`gguf`, through `scripts/check_gguf_export.py`) and compared
//! tensor by tensor with the checkpoint, then imported back into Sluice, where it still answers
//! "Paris".
//!
//! The model and the Python wheels are fetched (never committed) by
//! `scripts/fetch_test_assets.sh`; the test fails, naming that script, when they are missing.

use std::path::{Path, PathBuf};
use std::process::Command;

use sluice_engine::backend::cpu::Cpu;
use sluice_engine::convert::{GgufType, export_gguf, import_gguf};
use sluice_engine::data::DatasetSource;
use sluice_engine::generate::{GenerateOptions, Generator, PromptStyle};
use sluice_engine::model::HostParams;
use sluice_engine::optim::Schedule;
use sluice_engine::train::{Devices, Event, Job, JobSettings, ModelSource, Observer, RunOptions};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn asset(relative: &str) -> PathBuf {
    let path = root().join(".cache/test-assets").join(relative);
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch_test_assets.sh to fetch the test assets",
        path.display()
    );
    path
}

struct Quiet;

impl Observer for Quiet {
    fn event(&mut self, _: &Event) {}
    fn keep_going(&mut self) -> bool {
        true
    }
}

/// A few steps on short question/answer records, saved as the run's `final/` checkpoint.
fn fine_tune(base: &Path, tmp: &Path) -> PathBuf {
    let data = tmp.join("qa.jsonl");
    let records = [
        ("What is the largest planet?", "Jupiter is the largest planet in the solar system."),
        ("What colour is the sky?", "On a clear day the sky is blue."),
        ("How many legs does a spider have?", "A spider has eight legs."),
    ];
    let lines: Vec<String> = records
        .iter()
        .map(|(q, a)| {
            serde_json::json!({"messages": [
                {"role": "user", "content": q},
                {"role": "assistant", "content": a},
            ]})
            .to_string()
        })
        .collect();
    std::fs::write(&data, lines.join("\n") + "\n").expect("writes the dataset");
    let job = Job {
        model: ModelSource::Dir(base.to_path_buf()),
        data: DatasetSource::File(data),
        eval_data: None,
        devices: Devices::Cpu,
        settings: JobSettings {
            seq_len: 64,
            micro_batch: 1,
            grad_accum: 1,
            steps: Some(3),
            lr: Some(5e-5),
            schedule: Schedule::Constant,
            ..JobSettings::default()
        },
    };
    let options = RunOptions::unplanned(job, tmp.join("run")).expect("a plan-free placement");
    let summary =
        sluice_engine::train::run(&Cpu::new(), &options, false, &mut Quiet).expect("fine-tunes");
    assert_eq!(summary.steps, 3);
    summary.final_checkpoint
}

fn python_check(gguf: &Path, checkpoint: &Path, ty: GgufType) {
    let path = [asset("py-gguf"), asset("py-numpy")].map(|p| p.display().to_string()).join(":");
    let output = Command::new("python3")
        .arg("-s")
        .arg(root().join("scripts/check_gguf_export.py"))
        .arg(gguf)
        .arg(checkpoint)
        .arg(ty.name())
        .env("PYTHONPATH", path)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("gguf-py check of {ty}:\n{stdout}{stderr}");
    assert!(output.status.success(), "gguf-py check of {ty} failed:\n{stdout}{stderr}");
    assert!(stdout.trim_end().ends_with("OK"), "{stdout}");
}

fn capital_of_france(dir: &Path) -> String {
    let g = Generator::load_dir(dir).expect("the imported folder loads");
    let prompt = g.prompt_ids("The capital of France is", PromptStyle::Plain).expect("prompt");
    let out = g.generate(&prompt, &GenerateOptions::greedy(4), &mut |_| true).expect("generates");
    g.decode(&out.ids).expect("decodes")
}

#[test]
fn fine_tuned_smollm2_exports_to_gguf_that_gguf_py_reads_and_sluice_imports_back() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let base = tmp.path().join("smollm2");
    import_gguf(&asset("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), &base).expect("imports");
    let checkpoint = fine_tune(&base, tmp.path());
    // The checkpoint really is a fine-tuned one, not the base model.
    let (_, tuned) = HostParams::load_dir(&checkpoint).expect("checkpoint loads");
    let (_, original) = HostParams::load_dir(&base).expect("base loads");
    assert_ne!(tuned.units[1], original.units[1], "layer 0 did not change");
    drop((tuned, original));
    // The test writes several copies of a 135M-parameter model; each goes as soon as it has
    // served, so the test needs about a gigabyte of disk at a time, not several.
    remove(&base);

    for ty in [GgufType::Q8_0, GgufType::F16] {
        let file = tmp.path().join(format!("smollm2-{ty}.gguf"));
        let summary = export_gguf(&checkpoint, &file, ty).expect("exports");
        println!("{ty}: {} tensors, {} bytes", summary.tensors, summary.bytes);
        assert_eq!(summary.tensors, 1 + 30 * 9 + 1, "tied embeddings: no output.weight");
        python_check(&file, &checkpoint, ty);

        let back = tmp.path().join(format!("back-{ty}"));
        import_gguf(&file, &back).expect("imports back");
        let text = capital_of_france(&back);
        println!("{ty} continuation: {text:?}");
        assert!(text.starts_with(" Paris"), "{ty} continuation {text:?}");
        remove(&back);
        std::fs::remove_file(&file).expect("removes the exported file");
    }
}

fn remove(dir: &Path) {
    std::fs::remove_dir_all(dir).unwrap_or_else(|e| panic!("removes {}: {e}", dir.display()));
}
