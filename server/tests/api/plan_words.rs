//! The plan in plain words: one sentence with durations in days past a day and sizes in GiB,
//! the closest job that fits when one does not, and the same sentence and figures as
//! `sluice plan` prints for the same job on the CPU.

use std::process::Command;

use axum::http::StatusCode;
use serde_json::{Value, json};

use crate::common::{Client, TestApp};

async fn plan(client: &Client, body: Value) -> anyhow::Result<Value> {
    let reply = client.post("/api/plan", body.clone()).await?;
    anyhow::ensure!(reply.status == StatusCode::OK, "plan {body}: {}", reply.text());
    reply.json()
}

/// `sluice plan` for the job `body` describes, on the CPU, with the host memory the API's
/// plan saw (MemAvailable moves between two readings): its exit status, text and JSON.
fn cli_plan(body: &Value, host_bytes: u64) -> anyhow::Result<(bool, String, Value)> {
    let model = body["model"].as_str().unwrap_or_default();
    let preset = model.strip_prefix("preset:").ok_or_else(|| anyhow::anyhow!("{model}"))?;
    let mut args =
        vec!["plan".to_string(), "--preset".into(), preset.into(), "--device".into(), "cpu".into()];
    for (field, flag) in [
        ("seq_len", "--seq-len"),
        ("micro_batch", "--micro-batch"),
        ("grad_accum", "--grad-accum"),
        ("steps", "--steps"),
    ] {
        if let Some(n) = body[field].as_u64() {
            args.extend([flag.to_string(), n.to_string()]);
        }
    }
    args.extend(["--host-mem".to_string(), host_bytes.to_string()]);
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_sluice")).args(&args).args(extra).output()
    };
    let text = run(&[])?;
    let json = run(&["--json"])?;
    let verdict = serde_json::from_slice(&json.stdout)
        .map_err(|e| anyhow::anyhow!("{e}: {}", String::from_utf8_lossy(&json.stderr)))?;
    Ok((text.status.success(), String::from_utf8(text.stdout)?, verdict))
}

/// The engine's budget total on the CPU: everything is host memory.
fn engine_host_total(budget: &Value) -> u64 {
    ["device", "pinned_host", "pageable_host"]
        .iter()
        .filter_map(|t| budget[t]["used"].as_u64())
        .sum()
}

/// The API's plan and `sluice plan` agree on the sentence, the memory, the step time and the
/// closest job that fits.
async fn check_same_as_cli(admin: &Client, body: Value) -> anyhow::Result<Value> {
    let api = plan(admin, body.clone()).await?;
    let tier = &api["tiers"][0];
    assert_eq!(tier["name"], "host", "{api}");
    let capacity = tier["capacity"].as_u64().ok_or_else(|| anyhow::anyhow!("{api}"))?;
    let (ok, text, engine) = cli_plan(&body, capacity)?;
    assert_eq!(ok, api["fits"] == true, "{text}");
    let first = text.lines().next().unwrap_or_default();
    assert_eq!(first, api["reason"].as_str().unwrap_or_default(), "{body}\n{text}");
    let budget = &engine["budget"];
    assert_eq!(tier["used"].as_u64(), Some(engine_host_total(budget)), "{api}\n{engine}");
    assert_eq!(budget["host_capacity"].as_u64(), Some(capacity), "{engine}");
    // The terminal's host total is the web's one bar.
    let used = tier["used"].as_u64().unwrap_or(0) as f64;
    let shown = if used >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", used / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", used / (1u64 << 20) as f64)
    };
    let total = text.lines().find(|l| l.trim_start().starts_with("host total")).unwrap_or_default();
    assert!(total.contains(&format!("{shown} used")), "{shown} vs {total:?}\n{text}");
    if api["fits"] == true {
        assert_eq!(api["step_time_s"], engine["time"]["total_s"], "{api}\n{engine}");
    } else {
        let micro =
            engine["fits"].as_array().into_iter().flatten().find_map(|s| s["micro_batch"].as_u64());
        assert_eq!(
            api["suggestion"]["value"].as_u64(),
            micro.or_else(|| {
                engine["fits"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find_map(|s| s["grad_accum"].as_u64())
            }),
            "{api}\n{engine}"
        );
    }
    Ok(api)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plan_speaks_plain_words_and_matches_sluice_plan() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;

    // A short run: seconds, on this processor; no advice.
    let short = json!({"model": "preset:tiny", "gpu": "cpu", "seq_len": 64, "micro_batch": 1, "grad_accum": 1, "steps": 20});
    let api = check_same_as_cli(&admin, short).await?;
    let reason = api["reason"].as_str().unwrap_or_default();
    assert!(reason.starts_with("Fits, ") && reason.ends_with(" on this processor."), "{api}");
    let run = api["run_time_s"].as_f64().unwrap_or(-1.0);
    let step = api["step_time_s"].as_f64().unwrap_or(0.0);
    assert!((run - 20.0 * step).abs() <= 1e-9 * run.max(1.0), "{api}");
    assert_eq!(api["bottleneck"], "cpu", "no PCIe on the processor: {api}");
    assert!(api["detail"].as_str().is_some_and(|d| d.starts_with("fits: ")), "{api}");

    // A long one: days, and what would make it shorter.
    let long = json!({"model": "preset:tiny", "gpu": "cpu", "seq_len": 2048, "micro_batch": 8, "grad_accum": 4, "steps": 1_000_000});
    let api = check_same_as_cli(&admin, long).await?;
    let days = api["run_time_s"].as_f64().unwrap_or(0.0) / 86_400.0;
    assert!(days > 1.0, "{api}");
    let reason = api["reason"].as_str().unwrap_or_default();
    assert!(reason.contains(" days on this processor: try a GPU or fewer steps."), "{api}");
    assert!(
        api["run_time"].as_str().is_some_and(|t| t.ends_with(" days") && reason.contains(t)),
        "{api}"
    );

    // Without steps, one pass over the data: only the step's time is known.
    let open = plan(&admin, json!({"model": "preset:tiny", "gpu": "cpu", "seq_len": 64})).await?;
    assert_eq!(open["run_time_s"], Value::Null, "{open}");
    assert!(
        open["reason"].as_str().is_some_and(|r| r.contains("the whole run depends on the data")),
        "{open}"
    );

    // Never fits: what memory it would need, in GiB, and no smaller batch that would do.
    let huge = json!({"model": "preset:qwen2.5-72b", "gpu": "cpu", "seq_len": 1024, "micro_batch": 1, "grad_accum": 1});
    let api = check_same_as_cli(&admin, huge).await?;
    let reason = api["reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with("Does not fit: needs ") && reason.contains(" GiB of host memory, "),
        "{api}"
    );
    assert!(reason.contains(" GiB free. No smaller batch fits: try a smaller model"), "{api}");
    assert!(!reason.contains("GB ") && !reason.contains("--"), "{api}");
    assert_eq!(api["suggestion"], Value::Null, "{api}");

    // Too large a batch: the closest job that fits, which does fit when asked.
    let wide = json!({"model": "preset:tiny", "gpu": "cpu", "seq_len": 2048, "micro_batch": 4096, "grad_accum": 1, "steps": 10});
    let api = check_same_as_cli(&admin, wide.clone()).await?;
    if api["fits"] == false {
        let value = api["suggestion"]["value"].as_u64().unwrap_or(0);
        assert_eq!(api["suggestion"]["field"], "micro_batch", "{api}");
        assert!((1..4096).contains(&value), "{api}");
        let reason = api["reason"].as_str().unwrap_or_default();
        assert!(
            reason.ends_with(&format!("The closest job that fits: micro-batch {value}.")),
            "{api}"
        );
        // On the same memory (the suggestion is the largest that fits, so a reading of
        // MemAvailable a moment later could refuse it).
        let capacity = api["tiers"][0]["capacity"].as_u64().unwrap_or(0);
        let mut closer = wide.clone();
        closer["micro_batch"] = json!(value);
        let (fits, text, _) = cli_plan(&closer, capacity)?;
        assert!(fits && text.starts_with("Fits, "), "{closer}: {text}");
        closer["micro_batch"] = json!(value + 1);
        let (fits, text, _) = cli_plan(&closer, capacity)?;
        assert!(!fits, "the largest that fits: {closer}: {text}");
    } else {
        // A machine with over 70 GiB free holds even this.
        assert!(api["reason"].as_str().is_some_and(|r| r.starts_with("Fits, ")), "{api}");
    }
    Ok(())
}
