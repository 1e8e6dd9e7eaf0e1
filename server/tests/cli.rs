//! Runs the built `sluice` binary and checks what a user sees: exit codes and messages.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A `sluice` command isolated from the caller's environment.
fn sluice() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_sluice"));
    command
        .env_remove("SLUICE_ADDR")
        .env_remove("SLUICE_DATA_DIR")
        .env_remove("SLUICE_CONFIG")
        .env("RUST_LOG", "info");
    command
}

fn run(command: &mut Command) -> anyhow::Result<(Output, String)> {
    let output = command.stdin(Stdio::null()).output()?;
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    Ok((output, stderr))
}

/// A failure the user can act on: exit code 1, an `error:` line, never a panic.
fn assert_clean_failure(output: &Output, stderr: &str) {
    assert_eq!(output.status.code(), Some(1), "stderr:\n{stderr}");
    assert!(stderr.contains("error: "), "stderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "stderr:\n{stderr}");
}

#[test]
fn bad_addr_fails_with_the_address_in_the_message() -> anyhow::Result<()> {
    let data_dir = tempfile::tempdir()?;
    let (output, stderr) = run(sluice()
        .args(["serve", "--addr", "127.0.0.1:notaport", "--data-dir"])
        .arg(data_dir.path()))?;
    assert_clean_failure(&output, &stderr);
    assert!(stderr.contains("cannot listen on 127.0.0.1:notaport"), "stderr:\n{stderr}");
    Ok(())
}

#[test]
fn no_subcommand_serves_and_reads_the_environment() -> anyhow::Result<()> {
    let data_dir = tempfile::tempdir()?;
    let (output, stderr) = run(sluice()
        .env("SLUICE_ADDR", "127.0.0.1:notaport")
        .env("SLUICE_DATA_DIR", data_dir.path()))?;
    assert_clean_failure(&output, &stderr);
    assert!(stderr.contains("cannot listen on 127.0.0.1:notaport"), "stderr:\n{stderr}");
    Ok(())
}

#[test]
fn address_in_use_names_the_address() -> anyhow::Result<()> {
    let holder = TcpListener::bind("127.0.0.1:0")?;
    let addr = holder.local_addr()?.to_string();
    let data_dir = tempfile::tempdir()?;
    let (output, stderr) =
        run(sluice().args(["serve", "--addr", &addr, "--data-dir"]).arg(data_dir.path()))?;
    assert_clean_failure(&output, &stderr);
    assert!(stderr.contains(&format!("cannot listen on {addr}")), "stderr:\n{stderr}");
    assert!(stderr.to_lowercase().contains("in use"), "stderr:\n{stderr}");
    Ok(())
}

#[test]
fn uncreatable_data_dir_is_reported() -> anyhow::Result<()> {
    let file = tempfile::NamedTempFile::new()?;
    let data_dir = file.path().join("data");
    let (output, stderr) =
        run(sluice().args(["serve", "--addr", "127.0.0.1:0", "--data-dir"]).arg(&data_dir))?;
    assert_clean_failure(&output, &stderr);
    let expected = format!("cannot create the data directory {}", data_dir.display());
    assert!(stderr.contains(&expected), "stderr:\n{stderr}");
    Ok(())
}

#[test]
fn usage_errors_exit_with_code_2() -> anyhow::Result<()> {
    let (output, stderr) = run(sluice().arg("--no-such-flag"))?;
    assert_eq!(output.status.code(), Some(2), "stderr:\n{stderr}");
    assert!(stderr.contains("--no-such-flag"), "stderr:\n{stderr}");
    Ok(())
}

/// Kills the server if a test fails before it stops by itself.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[cfg(unix)]
#[test]
fn serves_then_stops_cleanly_on_sigterm() -> anyhow::Result<()> {
    let data_dir = tempfile::tempdir()?;
    let mut child = sluice()
        .args(["serve", "--addr", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let stderr = child.stderr.take().ok_or_else(|| anyhow::anyhow!("no stderr pipe"))?;
    let mut server = Server(child);

    // The port is chosen by the OS; the server logs it.
    let (lines_tx, lines_rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut log = String::new();
    let addr = loop {
        let line = lines_rx
            .recv_timeout(Duration::from_secs(30))
            .map_err(|err| anyhow::anyhow!("no 'listening on' log line ({err}); log:\n{log}"))?;
        log.push_str(&line);
        log.push('\n');
        if let Some((_, rest)) = line.split_once("listening on http://") {
            break rest.split_whitespace().next().unwrap_or_default().to_owned();
        }
    };

    let mut stream = TcpStream::connect(&addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    assert!(response.starts_with("HTTP/1.1 200"), "response:\n{response}");
    assert!(response.contains(r#""status":"ok""#), "response:\n{response}");

    let pid = server.0.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status()?;
    assert!(killed.success(), "kill -TERM {pid} failed");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = server.0.try_wait()? {
            break status;
        }
        anyhow::ensure!(Instant::now() < deadline, "the server ignored SIGTERM for 10 s");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit status {status} after SIGTERM; log:\n{log}");
    Ok(())
}

#[test]
fn config_file_is_read_and_flags_win() -> anyhow::Result<()> {
    let data_dir = tempfile::tempdir()?;
    let config = data_dir.path().join("sluice.toml");
    std::fs::write(&config, "addr = \"127.0.0.1:fromfile\"\nmax_upload_mb = 1\n")?;
    // DATA_DIR/sluice.toml is read without --config.
    let (output, stderr) = run(sluice().args(["serve", "--data-dir"]).arg(data_dir.path()))?;
    assert_clean_failure(&output, &stderr);
    assert!(stderr.contains("cannot listen on 127.0.0.1:fromfile"), "stderr:\n{stderr}");
    // A flag overrides the file.
    let (output, stderr) = run(sluice()
        .args(["serve", "--addr", "127.0.0.1:fromflag", "--config"])
        .arg(&config)
        .arg("--data-dir")
        .arg(data_dir.path()))?;
    assert_clean_failure(&output, &stderr);
    assert!(stderr.contains("cannot listen on 127.0.0.1:fromflag"), "stderr:\n{stderr}");
    Ok(())
}

#[test]
fn config_file_with_an_unknown_key_is_refused() -> anyhow::Result<()> {
    let data_dir = tempfile::tempdir()?;
    let config = data_dir.path().join("custom.toml");
    std::fs::write(&config, "adress = \"127.0.0.1:1\"\n")?;
    let (output, stderr) =
        run(sluice().arg("--config").arg(&config).arg("--data-dir").arg(data_dir.path()))?;
    assert_clean_failure(&output, &stderr);
    assert!(stderr.contains("bad config file") && stderr.contains("adress"), "stderr:\n{stderr}");
    Ok(())
}

#[test]
fn bench_train_on_the_cpu_reports_every_step_a_summary_and_a_replayable_first_step()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (json, check) = (dir.path().join("bench.json"), dir.path().join("check"));
    let (output, stderr) = run(sluice()
        .args(["bench", "train", "--device", "cpu", "--preset", "tiny", "--seq-len", "64"])
        .args(["--micro-batch", "2", "--grad-accum", "2", "--steps", "3", "--json"])
        .arg(&json)
        .arg("--check-dir")
        .arg(&check))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.starts_with("device: cpu\n"), "{stdout}");
    assert_eq!(stdout.lines().filter(|l| l.starts_with("step ")).count(), 3, "{stdout}");
    assert!(stdout.contains("summary (median of steps 3..3): "), "{stdout}");
    assert!(stdout.contains("TFLOPS by 6 x params x tokens"), "{stdout}");

    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json)?)?;
    let steps = report["steps"].as_array().map_or(0, Vec::len);
    assert_eq!(steps, 3, "{report}");
    // 2 micro-batches x 2 rows x 64 tokens per step.
    assert_eq!(report["steps"][0]["tokens"], 256, "{report}");
    assert!(report["summary"]["tokens_per_s"].as_f64().is_some_and(|t| t > 0.0), "{report}");
    assert!(report["summary"]["host_store_bytes"].as_u64().is_some_and(|b| b > 0), "{report}");
    // Causal attention counted: 6 x layers x hidden x seq FLOPs more per token than 6 x params.
    let (s, m) = (&report["summary"], &report["plan"]["model"]);
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
    let ratio = f(&s["attention_tflops"]) / f(&s["model_tflops"]);
    let want = 1.0 + f(&m["layers"]) * f(&m["hidden"]) * 64.0 / f(&m["active_params"]);
    assert!((ratio - want).abs() < 1e-9, "{ratio} vs {want}: {report}");

    // What PyTorch needs to replay step 1: its weights, its tokens, its loss and unit norms.
    for file in ["model/config.json", "model/model.safetensors", "batches.json", "step1.json"] {
        assert!(check.join(file).is_file(), "{file} missing");
    }
    let step1: serde_json::Value =
        serde_json::from_slice(&std::fs::read(check.join("step1.json"))?)?;
    assert_eq!(step1["loss"], report["steps"][0]["loss"], "{step1}");
    assert_eq!(step1["trained_tokens"], 256, "{step1}");
    // The tiny model's units: embedding (with the tied LM head), 4 layers, the final norm.
    let units = step1["units"].as_array().cloned().unwrap_or_default();
    assert_eq!(units.len(), 6, "{step1}");
    assert_eq!(units[5]["tensors"], serde_json::json!(["model.norm.weight"]), "{step1}");
    let squares: f64 = units.iter().filter_map(|u| u["grad_norm"].as_f64()).map(|n| n * n).sum();
    let norm = step1["grad_norm"].as_f64().unwrap_or(f64::NAN);
    // The reported global norm is rounded to f32 as torch's clip_grad_norm_ returns it.
    assert!((squares.sqrt() - norm).abs() < 1e-6 * norm, "{} vs {norm}", squares.sqrt());
    let batches: serde_json::Value =
        serde_json::from_slice(&std::fs::read(check.join("batches.json"))?)?;
    assert_eq!(batches["micro_batches"].as_array().map_or(0, Vec::len), 2);
    // Every tensor's gradient, not only the norms: the check asks for the device store.
    assert_eq!(step1["gradients"], "grads", "{step1}");
    assert!(check.join("grads").is_dir());
    Ok(())
}

#[test]
fn plan_and_bench_train_take_the_same_job_shape_flags_as_train() -> anyhow::Result<()> {
    // No batch flags: the engine's job defaults (256 x 4 x 1), as for `train` and the API.
    let memory = ["--gpu-mem", "80000000000", "--host-mem", "200000000000"];
    let (output, stderr) =
        run(sluice().args(["plan", "--preset", "qwen2.5-0.5b", "--json"]).args(memory))?;
    assert!(output.status.success(), "{stderr}");
    let plan: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    assert_eq!(
        plan["batch"],
        serde_json::json!({"seq_len": 256, "micro_batch": 4, "grad_accum": 1})
    );

    // Several GPUs are named by --device, the same parser as `train`'s.
    let (output, stderr) = run(sluice()
        .args(["plan", "--preset", "qwen2.5-0.5b", "--device", "cuda:0,1", "--grad-accum", "2"])
        .args(["--json"])
        .args(memory))?;
    assert!(output.status.success(), "{stderr}");
    let plan: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    assert_eq!(plan["parallel"]["gpus"], 2, "{plan}");
    let (output, stderr) = run(sluice()
        .args(["plan", "--preset", "qwen2.5-0.5b", "--device", "cuda:0,1"])
        .args(memory))?;
    assert_clean_failure(&output, &stderr);
    assert!(stderr.contains("2 GPUs need at least 2 micro-batches"), "{stderr}");

    // `bench train` measures one device and says which command trains on several.
    let (output, stderr) =
        run(sluice().args(["bench", "train", "--preset", "tiny", "--device", "cuda:0,1"]))?;
    assert_clean_failure(&output, &stderr);
    assert!(stderr.contains("sluice train --device cuda:0,1"), "{stderr}");
    for bad in ["gpu0", "cuda:x"] {
        let (output, stderr) = run(sluice().args(["plan", "--preset", "tiny", "--device", bad]))?;
        assert_eq!(output.status.code(), Some(2), "{bad}: {stderr}");
        assert!(stderr.contains("expected cpu, cuda, cuda:N"), "{bad}: {stderr}");
    }
    Ok(())
}

/// `bench attention` measures GPU kernels: the CPU and shapes the kernels do not take are
/// refused with the reason, before any GPU or memory is touched.
#[test]
fn bench_attention_refuses_the_cpu_and_shapes_the_kernels_do_not_take() -> anyhow::Result<()> {
    let cases: [(&[&str], &str); 6] = [
        (&["--device", "cpu"], "name a GPU (cuda:N)"),
        (&["--q-heads", "7", "--kv-heads", "2"], "must be a multiple of --kv-heads 2"),
        (&["--head-dim", "300"], "--head-dim must be between 1 and 256"),
        (&["--tokens", "1000", "--docs", "3"], "--docs 3 must be at least 1 and divide"),
        (&["--tokens", "1099511627776"], "--tokens must be between 1 and 1048576"),
        (&["--window", "0"], "--window must be at least 1 token"),
    ];
    for (args, want) in cases {
        let (output, stderr) = run(sluice().args(["bench", "attention"]).args(args))?;
        assert_clean_failure(&output, &stderr);
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
    Ok(())
}

/// `--disk-dir` gives the planner a disk tier, measured there (the folder made if missing),
/// which `--moments` uses or not and `--disk-mem` caps; `--moments disk` needs one.
#[test]
fn plan_keeps_adam_moments_on_the_disk_tier_it_is_given() -> anyhow::Result<()> {
    let scratch = tempfile::tempdir()?;
    let dir = scratch.path().join("tier");
    // Qwen2.5-0.5B needs about 8 GB of host memory; with 6 GiB some layers' moments go to disk.
    let job = ["plan", "--preset", "qwen2.5-0.5b", "--seq-len", "512", "--json"];
    let memory = ["--gpu-mem", "80000000000", "--host-mem", "6442450944"];
    let (output, stderr) = run(sluice().args(job).args(memory).arg("--disk-dir").arg(&dir))?;
    assert!(output.status.success(), "{stderr}");
    assert!(dir.is_dir());
    let plan: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    let disk = &plan["memory"]["disk"];
    assert_eq!(disk["dir"], dir.display().to_string(), "{plan}");
    assert_eq!(disk["source"], "measured", "{plan}");
    assert!(disk["read_bytes_per_s"].as_u64().is_some_and(|r| r > 0), "{plan}");
    let units = plan["placement"]["disk_units"].as_array().map_or(0, Vec::len);
    assert!(units > 0 && units < 24, "some layers: {plan}");
    assert!(plan["budget"]["disk"]["used"].as_u64().is_some_and(|u| u > 0), "{plan}");

    // The text says where the moments are; host memory only does not fit.
    let text = ["plan", "--preset", "qwen2.5-0.5b", "--seq-len", "512"];
    let (output, stderr) = run(sluice().args(text).args(memory).arg("--disk-dir").arg(&dir))?;
    assert!(output.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("live on the disk tier at "), "{stdout}");
    let (output, stderr) =
        run(sluice().args(text).args(memory).args(["--moments", "host", "--disk-dir"]).arg(&dir))?;
    assert_clean_failure(&output, &stderr);
    assert!(stderr.contains("does not fit: host memory"), "{stderr}");
    // A tier capped below what the moments need is named.
    let (output, stderr) = run(sluice()
        .args(text)
        .args(memory)
        .args(["--disk-mem", "1000000", "--disk-dir"])
        .arg(&dir))?;
    assert_clean_failure(&output, &stderr);
    assert!(stderr.contains("does not fit: disk tier at "), "{stderr}");

    let (output, stderr) = run(sluice().args(text).args(["--moments", "disk"]))?;
    assert_clean_failure(&output, &stderr);
    assert!(stderr.contains("--moments disk") && stderr.contains("--disk-dir DIR"), "{stderr}");
    for bad in [&["--moments", "ssd"][..], &["--disk-mem", "1000"][..]] {
        let (output, stderr) = run(sluice().args(text).args(bad))?;
        assert_eq!(output.status.code(), Some(2), "{bad:?}: {stderr}");
    }
    Ok(())
}

#[test]
fn train_plan_and_bench_refuse_sizes_beyond_the_engines_ceilings() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("d.jsonl");
    std::fs::write(&data, "{\"text\": \"hello there\"}\n")?;
    let huge = [
        ("--grad-accum", "1000000000", "grad_accum must be between 1 and 65536"),
        ("--micro-batch", "72057594037927936", "micro_batch must be between 1 and 4096"),
        ("--seq-len", "1099511627776", "seq_len must be between 1 and 1048576"),
    ];
    for (flag, value, want) in huge {
        let commands: [Vec<&std::ffi::OsStr>; 3] = [
            ["train", "--preset", "tiny", "--data"]
                .map(std::ffi::OsStr::new)
                .into_iter()
                .chain([data.as_os_str()])
                .collect(),
            ["plan", "--preset", "tiny"].map(std::ffi::OsStr::new).to_vec(),
            ["bench", "train", "--preset", "tiny", "--device", "cpu"]
                .map(std::ffi::OsStr::new)
                .to_vec(),
        ];
        for args in commands {
            let (output, stderr) =
                run(sluice().args(&args).args([flag, value]).current_dir(dir.path()))?;
            assert_clean_failure(&output, &stderr);
            assert!(stderr.contains(want), "{args:?} {flag} {value}: {stderr}");
        }
    }
    Ok(())
}
