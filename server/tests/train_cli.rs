//! `sluice train` as a user runs it: a tiny model learns from the demo dataset and leaves a
//! checkpoint folder; every kind of bad input ends with one clear message and exit code 1.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use sluice_engine::model::HostParams;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn demo_data() -> PathBuf {
    repo().join("datasets/demo-alpaca.jsonl")
}

/// Runs `sluice train ARGS` and returns (exit code, stdout, stderr).
fn train(args: &[&str], extra: &[&Path]) -> (Option<i32>, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_sluice"));
    command.arg("train").args(args).args(extra).stdin(Stdio::null());
    let Output { status, stdout, stderr } = command.output().expect("sluice runs");
    (
        status.code(),
        String::from_utf8_lossy(&stdout).into(),
        String::from_utf8_lossy(&stderr).into(),
    )
}

/// A failure the user can act on: exit code 1, an `error:` line naming the problem, no panic.
fn assert_fails_with(result: (Option<i32>, String, String), needle: &str) {
    let (code, _, stderr) = result;
    assert_eq!(code, Some(1), "stderr:\n{stderr}");
    assert!(stderr.contains("error: "), "stderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "stderr:\n{stderr}");
    assert!(stderr.contains(needle), "expected {needle:?} in stderr:\n{stderr}");
}

/// Losses printed on the per-step lines.
fn losses(stdout: &str) -> Vec<f64> {
    stdout
        .lines()
        .filter(|l| l.starts_with("step "))
        .filter_map(|l| l.split("loss ").nth(1)?.split_whitespace().next()?.parse().ok())
        .collect()
}

/// Trains the tiny preset for a few steps into `out` and returns its stdout.
fn train_tiny(out: &Path, steps: &str) -> String {
    let (code, stdout, stderr) = train(
        &["--preset", "tiny", "--steps", steps, "--seq-len", "128", "--out"],
        &[out, Path::new("--data"), &demo_data()],
    );
    assert_eq!(code, Some(0), "stdout:\n{stdout}\nstderr:\n{stderr}");
    stdout
}

#[test]
fn tiny_preset_learns_and_its_checkpoint_loads() {
    let dir = tempfile::tempdir().unwrap();
    let stdout = train_tiny(dir.path(), "16");
    let l = losses(&stdout);
    assert_eq!(l.len(), 16, "one line per step:\n{stdout}");
    // From ln(2048) ≈ 7.6 at random init, 16 steps at lr 1e-3 bring the loss down by well over
    // a nat on this data; the mean of the last 4 must be at least 1.0 below the first.
    let tail = l[12..].iter().sum::<f64>() / 4.0;
    assert!(tail < l[0] - 1.0, "loss did not fall: {l:?}");
    let final_dir = dir.path().join("final");
    for file in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        assert!(final_dir.join(file).is_file(), "{file} missing from the checkpoint");
    }
    let (spec, params) = HostParams::load_dir(&final_dir).expect("checkpoint loads");
    assert_eq!(spec.layers, 4);
    assert!(params.units.iter().flatten().all(|x| x.is_finite()));
}

#[test]
fn a_held_out_dataset_is_evaluated_before_and_after_training() {
    let dir = tempfile::tempdir().unwrap();
    // The demo data's last 60 records as the held-out set (the run trains on all of it, so the
    // held-out loss must fall too).
    let text = std::fs::read_to_string(demo_data()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let held_out = dir.path().join("held-out.jsonl");
    std::fs::write(&held_out, lines[lines.len() - 60..].join("\n")).unwrap();
    let out = dir.path().join("run");
    let (code, stdout, stderr) = train(
        &["--preset", "tiny", "--steps", "12", "--seq-len", "128", "--eval-every", "6"],
        &[
            Path::new("--out"),
            &out,
            Path::new("--data"),
            &demo_data(),
            Path::new("--eval-data"),
            &held_out,
        ],
    );
    assert_eq!(code, Some(0), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let before: f64 = stdout
        .lines()
        .find_map(|l| l.split("held-out loss before training: ").nth(1)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no loss before training:\n{stdout}"));
    let evals: Vec<f64> = stdout
        .lines()
        .filter_map(|l| l.split("eval loss ").nth(1)?.split_whitespace().next()?.parse().ok())
        .collect();
    assert_eq!(evals.len(), 2, "evaluated at steps 6 and 12:\n{stdout}");
    // ln(2048) ≈ 7.6 for the random init; 12 steps take well over a nat off.
    assert!((before - 2048f64.ln()).abs() < 0.5, "random init's loss is {before}");
    assert!(evals[1] < before - 1.0, "held-out loss {before} -> {evals:?}");
    // A held-out file with nothing to learn from is refused before training.
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let result = train(
        &["--preset", "tiny", "--steps", "1", "--seq-len", "128"],
        &[
            Path::new("--out"),
            &dir.path().join("bad"),
            Path::new("--data"),
            &demo_data(),
            Path::new("--eval-data"),
            &empty,
        ],
    );
    assert_eq!(result.0, Some(1), "stderr:\n{}", result.2);
    assert!(!dir.path().join("bad").join("final").exists(), "a refused run wrote a checkpoint");
}

/// A valid model folder to corrupt: the tiny preset after one step.
fn model_folder(dir: &Path) -> PathBuf {
    train_tiny(dir, "1");
    dir.join("final")
}

#[test]
fn bad_models_are_refused_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_folder(&dir.path().join("run"));
    let data = demo_data();
    let out = dir.path().join("out");
    let try_model = |m: &Path| {
        train(
            &["--steps", "1", "--model"],
            &[m, Path::new("--data"), &data, Path::new("--out"), &out],
        )
    };

    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    assert_fails_with(try_model(&empty), "config.json");

    let garbled = dir.path().join("garbled");
    copy_dir(&model, &garbled);
    std::fs::write(garbled.join("config.json"), "{\"model_type\": \"llama\", \"hidden_size\":")
        .unwrap();
    assert_fails_with(try_model(&garbled), "not valid JSON");

    let unknown = dir.path().join("unknown");
    copy_dir(&model, &unknown);
    let config = std::fs::read_to_string(unknown.join("config.json")).unwrap();
    std::fs::write(unknown.join("config.json"), config.replace("\"llama\"", "\"gpt_neox\""))
        .unwrap();
    assert_fails_with(try_model(&unknown), "unsupported model_type \"gpt_neox\"");

    let truncated = dir.path().join("truncated");
    copy_dir(&model, &truncated);
    let weights = truncated.join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    assert_fails_with(try_model(&truncated), "truncated");
    assert!(!out.exists(), "a failed run must not leave a run folder");
}

#[test]
fn bad_data_and_options_are_refused_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let with_data = |data: &Path, more: &[&str]| {
        let mut args = vec!["--preset", "tiny", "--steps", "1"];
        args.extend_from_slice(more);
        train(&args, &[Path::new("--data"), data, Path::new("--out"), &out])
    };

    let malformed = dir.path().join("malformed.jsonl");
    std::fs::write(
        &malformed,
        "{\"instruction\": \"Say hi\", \"output\": \"Hi\"}\n{\"instruction\": \"Say bye\", \"output\": \n",
    )
    .unwrap();
    assert_fails_with(with_data(&malformed, &[]), "line 2");

    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    assert_fails_with(with_data(&empty, &[]), "no records");

    assert_fails_with(
        with_data(&demo_data(), &["--seq-len", "0"]),
        "seq_len must be between 1 and 1048576, got 0",
    );
    assert_fails_with(with_data(&dir.path().join("missing.jsonl"), &[]), "missing.jsonl");
    assert_fails_with(
        with_data(&demo_data(), &["--lr=-1"]),
        "lr must be above 0 and at most 1, got -1",
    );
    assert!(!out.exists(), "a failed run must not leave a run folder");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create the copy");
    for entry in std::fs::read_dir(from).expect("read the model folder") {
        let entry = entry.expect("read a folder entry");
        std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy a file");
    }
}

/// The weights of a checkpoint folder, as bits.
fn weight_bits(dir: &Path) -> Vec<u32> {
    let (_, params) = HostParams::load_dir(dir).expect("checkpoint loads");
    params.units.iter().flatten().map(|x| x.to_bits()).collect()
}

#[test]
fn a_run_killed_mid_way_resumes_to_the_same_bits() {
    killed_and_resumed(&[]);
}

#[test]
fn a_run_with_its_moments_on_disk_killed_mid_way_resumes_to_the_same_bits() {
    // The disk tier's file is rewritten in place every step; the saved state holds the
    // moments themselves, so a kill at any moment resumes exactly. The uninterrupted run keeps
    // its moments in memory: the tier must not change a bit.
    let tier = tempfile::tempdir().unwrap();
    let dir = tier.path().to_str().unwrap();
    killed_and_resumed(&["--moments", "disk", "--disk-dir", dir]);
    let left: Vec<_> = std::fs::read_dir(tier.path()).unwrap().collect();
    assert!(left.is_empty(), "the disk tier left files behind: {left:?}");
}

/// Trains `tiny` for 12 steps whole, and again with `cut_args`, killed (SIGKILL) after step 7
/// and resumed with the same `cut_args`: the final weights must be the same bits.
fn killed_and_resumed(cut_args: &[&str]) {
    use std::io::{BufRead, BufReader};

    let dir = tempfile::tempdir().expect("a scratch folder");
    let base = |out: &Path| -> Vec<std::ffi::OsString> {
        let mut a: Vec<std::ffi::OsString> =
            ["train", "--preset", "tiny", "--steps", "12", "--seq-len", "64"]
                .iter()
                .map(Into::into)
                .collect();
        a.extend(["--save-every".into(), "1".into(), "--data".into(), demo_data().into()]);
        a.extend(["--out".into(), out.as_os_str().to_owned()]);
        a
    };
    let args = |out: &Path| -> Vec<std::ffi::OsString> {
        let mut a = base(out);
        a.extend(cut_args.iter().map(Into::into));
        a
    };
    let whole = dir.path().join("whole");
    let status = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(base(&whole))
        .output()
        .expect("sluice runs");
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));

    let cut = dir.path().join("cut");
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args(&cut))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("sluice starts");
    let stdout = child.stdout.take().expect("piped stdout");
    let mut seen = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("a line of output");
        let step7 = line.starts_with("step ") && line.split_whitespace().nth(1) == Some("7");
        seen.push(line);
        if step7 {
            child.kill().expect("the run can be killed"); // SIGKILL: no chance to clean up
            break;
        }
    }
    child.wait().expect("the killed run is reaped");
    assert!(seen.iter().any(|l| l.starts_with("step ")), "the run printed no step: {seen:?}");
    assert!(!cut.join("final").exists(), "the run finished before it was killed");

    let resume: Vec<&Path> =
        std::iter::once(cut.as_path()).chain(cut_args.iter().map(Path::new)).collect();
    let (code, stdout, stderr) = train(&["--resume"], &resume);
    assert_eq!(code, Some(0), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("resuming after step"), "{stdout}");
    if !cut_args.is_empty() {
        assert!(stdout.contains("disk tier"), "the plan does not mention the disk tier:\n{stdout}");
    }
    assert_eq!(weight_bits(&cut.join("final")), weight_bits(&whole.join("final")));
}

#[test]
fn a_job_that_cannot_fit_is_refused_by_the_planner_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    // The CPU backend: one memory holds the training state and the buffers; 1 MB holds neither.
    let result = train(
        &["--preset", "tiny", "--steps", "1", "--host-mem", "1000000", "--out"],
        &[&out, Path::new("--data"), &demo_data()],
    );
    let stdout = result.1.clone();
    assert_fails_with(result, "does not fit: host memory (the CPU backend");
    // The same details `sluice plan` prints: the machine, and the closest placement's budget.
    assert!(stdout.contains("memory of the closest placement"), "{stdout}");
    assert!(stdout.contains("host 1.0 MiB (given)"), "{stdout}");
    assert!(!out.exists(), "a refused run must not leave a run folder");

    // Enough memory for one row per micro-batch but not four: the refusal names what fits.
    let (code, stdout, stderr) = train(
        &["--preset", "tiny", "--steps", "1", "--seq-len", "2048", "--micro-batch", "4"],
        &[Path::new("--host-mem"), Path::new("60000000"), Path::new("--out"), &out]
            .into_iter()
            .chain([Path::new("--data"), &demo_data()])
            .collect::<Vec<_>>(),
    );
    assert_eq!(code, Some(1), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let fits = stderr.split("--micro-batch ").nth(1).and_then(|s| s.split([',', ' ', '\n']).next());
    let m: usize = fits.and_then(|m| m.parse().ok()).unwrap_or(0);
    assert!((1..4).contains(&m), "no smaller micro-batch suggested:\n{stderr}");
    assert!(!out.exists(), "a refused run must not leave a run folder");
}
