//! The job lifecycle on the tiny preset: queue, run, metrics, checkpoints, downloads, cancel,
//! resume, restart.

use std::io::Read;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Method, StatusCode, header};
use futures_util::StreamExt;
use serde_json::json;
use tower::ServiceExt;

use crate::common::{Client, TestApp, tiny_job};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_runs_to_completion_with_metrics_and_checkpoints() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let demo = admin.demo_dataset().await?;
    let mut job = tiny_job(demo, 3);
    job["save_every"] = json!(2);
    let id = admin.submit(job).await?;

    let done = admin.wait_job(id, 300, |j| j["status"] == "completed").await?;
    assert_eq!(done["step"], 3, "{done}");
    assert_eq!(done["total_steps"], 3);
    assert_eq!(done["progress"], 1.0);
    assert_eq!(done["gpu"], "cpu");
    assert_eq!(done["config"]["lr"], json!(0.001), "presets default to a higher lr");
    assert!(done["error"].is_null());

    let metrics = admin.get(&format!("/api/jobs/{id}/metrics")).await?.json()?;
    let steps: Vec<u64> = metrics
        .as_array()
        .map(|m| m.iter().filter_map(|p| p["step"].as_u64()).collect())
        .unwrap_or_default();
    assert_eq!(steps, [1, 2, 3], "{metrics}");
    for point in metrics.as_array().into_iter().flatten() {
        assert!(point["loss"].as_f64().is_some_and(|l| l.is_finite() && l > 0.0), "{point}");
        assert!(point["tokens_per_s"].as_f64().is_some_and(|t| t > 0.0), "{point}");
        assert!(
            point["lr"].is_number() && point["grad_norm"].is_number() && point["t"].is_number()
        );
        // How much of the optimizer the step waited for: a time, never more than the step.
        let exposed = point["optimizer_exposed_s"].as_f64();
        let step = point["step_s"].as_f64().unwrap_or(0.0);
        assert!(exposed.is_some_and(|e| (0.0..=step).contains(&e)), "{point}");
    }

    let checkpoints = admin.get(&format!("/api/jobs/{id}/checkpoints")).await?.json()?;
    let names: Vec<&str> = checkpoints
        .as_array()
        .map(|c| c.iter().filter_map(|c| c["name"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(names, ["checkpoint-2", "final"], "{checkpoints}");
    assert_eq!(checkpoints[1]["step"], 3);
    let files = checkpoints[1]["files"].as_array().cloned().unwrap_or_default();
    assert!(files.iter().any(|f| f["name"] == "config.json"), "{checkpoints}");
    assert!(files.iter().any(|f| f["name"] == "model.safetensors"), "{checkpoints}");

    // A ranged download gets exactly the asked bytes.
    let on_disk =
        std::fs::read(app.state.runs_dir().join(id.to_string()).join("final/config.json"))?;
    let request = admin
        .builder(Method::GET, &format!("/api/jobs/{id}/checkpoints/final/files/config.json"))
        .header(header::RANGE, "bytes=2-11")
        .body(Body::empty())?;
    let ranged = admin.send(request).await?;
    assert_eq!(ranged.status, StatusCode::PARTIAL_CONTENT);
    assert_eq!(&ranged.body[..], &on_disk[2..12]);
    assert_eq!(ranged.header(header::CONTENT_RANGE), format!("bytes 2-11/{}", on_disk.len()));
    let whole = admin.get(&format!("/api/jobs/{id}/checkpoints/final/files/config.json")).await?;
    assert_eq!(whole.status, StatusCode::OK);
    assert_eq!(&whole.body[..], &on_disk[..]);
    for bad in ["..%2Fcheckpoint-2%2Fconfig.json", "nope.bin"] {
        let reply = admin.get(&format!("/api/jobs/{id}/checkpoints/final/files/{bad}")).await?;
        assert_eq!(reply.status, StatusCode::NOT_FOUND, "{bad}");
    }
    assert_eq!(
        admin.get(&format!("/api/jobs/{id}/checkpoints/..%2F..%2F/archive")).await?.status,
        StatusCode::NOT_FOUND
    );

    // The archive is a tar of the folder.
    let archive = admin.get(&format!("/api/jobs/{id}/checkpoints/final/archive")).await?;
    assert_eq!(archive.status, StatusCode::OK);
    assert_eq!(archive.header(header::CONTENT_TYPE), "application/x-tar");
    let mut tar = tar::Archive::new(&archive.body[..]);
    let mut config = None;
    let mut entries = Vec::new();
    for entry in tar.entries()? {
        let mut entry = entry?;
        let path = entry.path()?.to_string_lossy().into_owned();
        if path == "final/config.json" {
            let mut text = Vec::new();
            entry.read_to_end(&mut text)?;
            config = Some(text);
        }
        entries.push(path);
    }
    assert_eq!(config.as_deref(), Some(&on_disk[..]), "entries: {entries:?}");
    assert!(entries.iter().any(|e| e == "final/model.safetensors"), "{entries:?}");

    let log = admin.get(&format!("/api/jobs/{id}/log")).await?.text();
    for needle in [
        "queued by admin",
        "plan on cpu:",
        "on cpu; host store",
        "saved checkpoint checkpoint-2 (step 2)",
        "completed after step 3",
    ] {
        assert!(log.contains(needle), "{needle:?} not in log:\n{log}");
    }
    let listed = admin.get("/api/jobs").await?.json()?;
    assert_eq!(listed[0]["id"], id);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_jobs_get_clear_4xx() -> anyhow::Result<()> {
    let app = TestApp::with_config(|c| c.limits.max_steps = 100).await?;
    let admin = app.admin().await?;
    let demo = admin.demo_dataset().await?;
    let cases = [
        (
            json!({"model": "preset:nope", "dataset": demo, "gpu": "cpu"}),
            StatusCode::BAD_REQUEST,
            "preset:nope",
        ),
        (
            json!({"model": "local:missing", "dataset": demo, "gpu": "cpu"}),
            StatusCode::BAD_REQUEST,
            "local:missing",
        ),
        (
            json!({"model": "preset:tiny", "dataset": demo, "gpu": "cuda:7"}),
            StatusCode::BAD_REQUEST,
            "cuda:7",
        ),
        (
            json!({"model": "preset:tiny", "dataset": 999, "gpu": "cpu"}),
            StatusCode::BAD_REQUEST,
            "unknown dataset 999",
        ),
        (json!({"dataset": demo, "gpu": "cpu"}), StatusCode::BAD_REQUEST, "model"),
        (
            json!({"model": "preset:tiny", "dataset": demo, "gpu": "cpu", "steps": 101}),
            StatusCode::BAD_REQUEST,
            "steps",
        ),
        (
            json!({"model": "preset:tiny", "dataset": demo, "gpu": "cpu", "lr": -1.0}),
            StatusCode::BAD_REQUEST,
            "lr",
        ),
        (
            json!({"model": "preset:tiny", "dataset": demo, "gpu": "cpu", "schedule": "zigzag"}),
            StatusCode::BAD_REQUEST,
            "schedule",
        ),
        (
            json!({"model": "preset:tiny", "dataset": demo, "gpu": "cpu", "stepz": 3}),
            StatusCode::BAD_REQUEST,
            "stepz",
        ),
        (
            json!({"model": "preset:qwen2.5-72b", "dataset": demo, "gpu": "cpu"}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "Does not fit",
        ),
    ];
    for (body, status, needle) in cases {
        let reply = admin.post("/api/jobs", body.clone()).await?;
        assert_eq!(reply.status, status, "{body}: {}", reply.text());
        assert!(reply.error().contains(needle), "{body}: {}", reply.text());
    }
    let not_json = admin
        .send(
            admin
                .builder(Method::POST, "/api/jobs")
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from("{"))?,
        )
        .await?;
    assert_eq!(not_json.status, StatusCode::BAD_REQUEST);
    assert!(!not_json.error().is_empty());
    assert_eq!(admin.get("/api/jobs/abc").await?.status, StatusCode::BAD_REQUEST);
    assert_eq!(admin.get("/api/jobs/12345").await?.status, StatusCode::NOT_FOUND);
    assert_eq!(admin.get("/api/jobs").await?.json()?, json!([]));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_queue_order_and_resume() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let demo = admin.demo_dataset().await?;
    let long = admin.submit(tiny_job(demo, 100_000)).await?;
    let waiting = admin.submit(tiny_job(demo, 2)).await?;

    let running = admin
        .wait_job(long, 300, |j| j["status"] == "running" && j["step"].as_u64() >= Some(2))
        .await?;
    assert!(running["eta_s"].as_f64().is_some_and(|e| e > 0.0), "{running}");
    let queued = admin.get(&format!("/api/jobs/{waiting}")).await?.json()?;
    assert_eq!(queued["status"], "queued");
    assert_eq!(queued["position"], 1);

    // Live events: the current status first, then metric points.
    let request =
        admin.builder(Method::GET, &format!("/api/jobs/{long}/events")).body(Body::empty())?;
    let response = sluice::app(admin.state.clone()).oneshot(request).await?;
    assert_eq!(response.headers()[header::CONTENT_TYPE], "text/event-stream");
    let mut stream = response.into_body().into_data_stream();
    let mut seen = String::new();
    while !(seen.contains("event: status") && seen.contains("event: metric")) {
        let chunk = tokio::time::timeout(Duration::from_secs(60), stream.next()).await?;
        let Some(chunk) = chunk else { anyhow::bail!("stream ended: {seen}") };
        let chunk: axum::body::Bytes = chunk?;
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(seen.contains("\"loss\""), "{seen}");
    drop(stream);

    let cancelled = admin.post(&format!("/api/jobs/{waiting}/cancel"), json!({})).await?;
    assert_eq!(cancelled.status, StatusCode::OK, "{}", cancelled.text());
    assert_eq!(cancelled.json()?["status"], "cancelled");

    let stopping = admin.post(&format!("/api/jobs/{long}/cancel"), json!({})).await?;
    assert_eq!(stopping.status, StatusCode::ACCEPTED, "{}", stopping.text());
    let stopped = admin.wait_job(long, 120, |j| j["status"] == "cancelled").await?;
    let at = stopped["step"].as_i64().unwrap_or(0);
    assert!(at >= 2, "{stopped}");
    assert_eq!(
        admin.post(&format!("/api/jobs/{long}/cancel"), json!({})).await?.status,
        StatusCode::CONFLICT
    );
    // The cancelled run saved where it stopped.
    let checkpoints = admin.get(&format!("/api/jobs/{long}/checkpoints")).await?.json()?;
    assert_eq!(checkpoints[0]["name"], format!("checkpoint-{at}"), "{checkpoints}");
    assert_eq!(checkpoints[0]["step"], at);

    // Resume continues from that checkpoint, with steps numbered on from it.
    let resumed = admin.post(&format!("/api/jobs/{long}/resume"), json!({})).await?;
    assert_eq!(resumed.status, StatusCode::OK, "{}", resumed.text());
    let again = admin
        .wait_job(long, 300, |j| j["status"] == "running" && j["step"].as_i64() > Some(at))
        .await?;
    assert_eq!(again["total_steps"], 100_000);
    let log = admin.get(&format!("/api/jobs/{long}/log")).await?.text();
    assert!(log.contains(&format!("continuing exactly after step {at}")), "{log}");
    let metrics = admin.get(&format!("/api/jobs/{long}/metrics")).await?.json()?;
    let steps: Vec<i64> = metrics
        .as_array()
        .map(|m| m.iter().filter_map(|p| p["step"].as_i64()).collect())
        .unwrap_or_default();
    assert!(steps.windows(2).all(|w| w[1] == w[0] + 1), "steps continue without gaps: {steps:?}");

    assert_eq!(
        admin.post(&format!("/api/jobs/{long}/resume"), json!({})).await?.status,
        StatusCode::CONFLICT
    );
    assert_eq!(
        admin.post(&format!("/api/jobs/{long}/cancel"), json!({})).await?.status,
        StatusCode::ACCEPTED
    );
    admin.wait_job(long, 120, |j| j["status"] == "cancelled").await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_marks_running_jobs_interrupted_and_they_resume() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let demo = admin.demo_dataset().await?;
    // A job the previous server process was running when it died.
    let config = json!({"steps": 2, "seq_len": 64, "micro_batch": 1, "grad_accum": 1, "lr": 0.001,
        "schedule": "cosine", "warmup": 0, "weight_decay": 0.0, "max_grad_norm": 1.0,
        "save_every": null, "seed": 0, "train_on_prompt": false});
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO jobs (owner_id, model, dataset_id, device, config, status, queue_seq, total_steps, step, created_at)
         VALUES (1, 'preset:tiny', ?, 'cpu', ?, 'running', 1, 2, 1, 0) RETURNING id",
    )
    .bind(demo)
    .bind(config.to_string())
    .fetch_one(app.state.pool())
    .await?;

    let restarted = app.restart().await?;
    let mut client =
        Client { state: restarted, cookie: admin.cookie.clone(), csrf: admin.csrf.clone() };
    client.session().await?;
    let job = client.get(&format!("/api/jobs/{id}")).await?.json()?;
    assert_eq!(job["status"], "interrupted", "{job}");
    assert_eq!(job["resumable"], true);
    assert!(job["error"].as_str().is_some_and(|e| e.contains("server stopped")), "{job}");

    let resumed = client.post(&format!("/api/jobs/{id}/resume"), json!({})).await?;
    assert_eq!(resumed.status, StatusCode::OK, "{}", resumed.text());
    let done = client.wait_job(id, 300, |j| j["status"] == "completed").await?;
    assert_eq!(done["step"], 2, "no checkpoint: it started over, {done}");
    let log = client.get(&format!("/api/jobs/{id}/log")).await?.text();
    assert!(log.contains("from the start (nothing was saved)"), "{log}");
    Ok(())
}

/// Each setting the engine refuses is refused by `POST /api/jobs` and `POST /api/plan` with
/// the engine's own message, whatever the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_refuses_what_the_engine_refuses_with_its_message() -> anyhow::Result<()> {
    use sluice_engine::train::{Devices, Job, JobSettings, Limits, ModelSource};
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let demo = admin.demo_dataset().await?;
    let limits = app.state.config().limits.engine();
    assert_eq!(limits, Limits::ENGINE.at_most(1_000_000, 131_072));
    let cases = [
        json!({"seq_len": 0}),
        json!({"seq_len": 1u64 << 40}),
        json!({"micro_batch": 0}),
        json!({"micro_batch": 1u64 << 56}),
        json!({"grad_accum": 1_000_000_000}),
        json!({"seq_len": 131_072, "micro_batch": 4096}),
        json!({"steps": 0}),
        json!({"steps": 2_000_000}),
        json!({"save_every": 0}),
        json!({"eval_every": 0}),
        json!({"warmup": 2_000_000}),
        json!({"lr": 0.0}),
        json!({"lr": 5.0}),
        json!({"weight_decay": -0.5}),
        json!({"max_grad_norm": -1.0}),
        json!({"max_grad_norm": 0.0, "gradients": "host_bf16"}),
        json!({"held_out": 0.0}),
        json!({"held_out": 0.75}),
    ];
    for settings in cases {
        let parsed: JobSettings = serde_json::from_value(settings.clone())?;
        let job = Job {
            model: ModelSource::Preset("tiny".into()),
            data: sluice_engine::data::DatasetSource::File("d.jsonl".into()),
            eval_data: None,
            devices: Devices::Cpu,
            settings: parsed,
        };
        let engine = job.validate(&limits).expect_err(&settings.to_string()).to_string();
        let mut body = settings.clone();
        body["model"] = json!("preset:tiny");
        body["dataset"] = json!(demo);
        body["gpu"] = json!("cpu");
        for route in ["/api/jobs", "/api/plan"] {
            let reply = admin.post(route, body.clone()).await?;
            assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{route} {body}: {}", reply.text());
            assert_eq!(reply.error(), engine, "{route} {body}");
        }
    }
    // Values of the wrong type name their field.
    for (field, value) in [
        ("seq_len", json!("long")),
        ("save_dtype", json!("f16")),
        ("seed", json!(-1)),
        ("moments", json!("ssd")),
    ] {
        let body = json!({"model": "preset:tiny", "dataset": demo, "gpu": "cpu", field: value});
        let reply = admin.post("/api/jobs", body.clone()).await?;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{body}");
        assert!(reply.error().contains(&format!("{field}: ")), "{body}: {}", reply.text());
    }
    assert_eq!(admin.get("/api/jobs").await?.json()?, json!([]), "nothing was queued");
    Ok(())
}

/// A plan answers with the placement the job will run and the same job's command line; a job
/// records the placement it ran and what its run takes on disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plans_and_jobs_show_placement_command_and_disk() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let demo = admin.demo_dataset().await?;
    let mut body = tiny_job(demo, 2);
    body["save_dtype"] = json!("f32");
    body["eval_every"] = json!(1);
    body["held_out"] = json!(0.25);
    let plan = admin.post("/api/plan", body.clone()).await?;
    assert_eq!(plan.status, StatusCode::OK, "{}", plan.text());
    let plan = plan.json()?;
    assert_eq!(plan["fits"], true, "{plan}");
    let placement = plan["placement"].as_str().unwrap_or_default().to_string();
    assert!(placement.contains("units resident"), "{plan}");
    let command = plan["command"].as_str().unwrap_or_default();
    assert!(command.starts_with("sluice train --preset tiny --data "), "{plan}");
    for flag in ["--save-dtype f32", "--eval-every 1", "--held-out 0.25", "--steps 2", "--lr 1e-3"]
    {
        assert!(command.contains(flag), "{flag}: {command}");
    }
    assert_eq!(plan["tiers"][0]["name"], "host", "one tier on the CPU: {plan}");
    // At the CPU's rates (a GPU's would predict under a microsecond for 64 tokens of 1M
    // parameters).
    assert!(plan["step_time_s"].as_f64().is_some_and(|t| t > 1e-3), "{plan}");

    let id = admin.submit(body).await?;
    let done = admin.wait_job(id, 300, |j| j["status"] == "completed").await?;
    assert_eq!(done["placement"], json!(placement), "{done}");
    assert_eq!(done["config"]["save_dtype"], "f32", "{done}");
    assert_eq!(done["config"]["held_out"], 0.25, "{done}");
    assert!(done["disk_bytes"].as_u64().is_some_and(|b| b > 10_000), "{done}");
    assert_eq!(done["command"], plan["command"], "{done}");
    let metrics = admin.get(&format!("/api/jobs/{id}/metrics")).await?.json()?;
    assert!(metrics[1]["eval_loss"].as_f64().is_some_and(f64::is_finite), "{metrics}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_a_long_cpu_step_between_micro_batches() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let demo = admin.demo_dataset().await?;
    // One step is 2,048 micro-batches: about a minute of CPU work, so waiting for the step to
    // end would miss the bound below by far.
    let mut body = tiny_job(demo, 3);
    body["grad_accum"] = json!(2048);
    let id = admin.submit(body).await?;
    admin.wait_job(id, 120, |j| j["status"] == "running").await?;
    // Well into the first step.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let asked = Instant::now();
    let reply = admin.post(&format!("/api/jobs/{id}/cancel"), json!({})).await?;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    let stopped = admin.wait_job(id, 60, |j| j["status"] != "running").await?;
    let took = asked.elapsed();
    assert_eq!(stopped["status"], "cancelled", "{stopped}");
    assert_eq!(stopped["step"], 0, "the abandoned step counts for nothing: {stopped}");
    // The bound the step itself would blow: a second to notice, the rest for the save of a
    // 1M-parameter model on a loaded machine.
    assert!(took < Duration::from_secs(5), "cancelled after {took:?}");
    // Resumable from where it stood: nothing of the abandoned step was applied.
    assert_eq!(stopped["resumable"], true, "{stopped}");
    Ok(())
}

/// `GET /api/job-defaults` describes every setting the engine takes, with the engine's defaults
/// and this appliance's limits, so the form needs no copy of either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_defaults_describe_every_setting_under_the_sites_limits() -> anyhow::Result<()> {
    use sluice_engine::train::JobSettings;
    let app = TestApp::with_config(|c| c.limits.max_seq_len = 2048).await?;
    let admin = app.admin().await?;
    let reply = admin.get("/api/job-defaults").await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let guide = reply.json()?;
    let settings = guide["settings"].as_array().cloned().unwrap_or_default();
    let names: Vec<&str> = settings.iter().filter_map(|s| s["name"].as_str()).collect();
    let fields: Vec<&str> = JobSettings::FIELDS.iter().map(|f| f.name).collect();
    assert_eq!(names, fields);
    let defaults = serde_json::to_value(JobSettings::default())?;
    for s in &settings {
        let name = s["name"].as_str().unwrap_or_default();
        assert_eq!(s["default"], defaults[name], "{name}");
    }
    let seq_len = settings.iter().find(|s| s["name"] == "seq_len").cloned().unwrap_or_default();
    assert_eq!((seq_len["min"].as_f64(), seq_len["max"].as_f64()), (Some(1.0), Some(2048.0)));
    let gradients = settings.iter().find(|s| s["name"] == "gradients").cloned().unwrap_or_default();
    assert_eq!(gradients["choices"], json!(["auto", "device", "host", "host_bf16"]));
    assert_eq!(guide["lr_pretrained"].as_f64().map(|x| x as f32), Some(2e-5));
    assert_eq!(guide["limits"]["max_seq_len"], 2048);
    Ok(())
}
