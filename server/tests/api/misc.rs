//! Pages, health, models, GPUs, plan, `/metrics`; the headers on every reply and the JSON shape
//! of every API error.

use axum::body::Body;
use axum::http::{Method, StatusCode, header};
use serde_json::json;
use tower::ServiceExt;

use crate::common::{Reply, TestApp, tiny_job};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn root_serves_the_placeholder_and_unknown_routes_get_404() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let client = app.client();
    // Before the first account exists, the home page sends everyone to the setup.
    let root = client.get("/").await?;
    assert_eq!(root.status, StatusCode::SEE_OTHER);
    assert_eq!(root.header(header::LOCATION), "/setup");
    let admin = app.admin().await?;
    let root = admin.get("/").await?;
    assert_eq!(root.status, StatusCode::OK);
    assert!(root.header(header::CONTENT_TYPE).starts_with("text/html"));
    assert!(root.text().contains("<title>Sluice</title>"), "{}", root.text());

    let page = client.get("/no/such/page").await?;
    assert_eq!(page.status, StatusCode::NOT_FOUND);
    assert!(page.text().contains("Page not found"), "{}", page.text());

    let api = client.get("/api/no/such").await?;
    assert_eq!(api.status, StatusCode::NOT_FOUND);
    assert!(api.error().contains("/api/no/such"), "{}", api.text());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_reports_ok_and_the_version() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let reply = app.client().get("/healthz").await?;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.json()?, json!({ "status": "ok", "version": env!("CARGO_PKG_VERSION") }));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_gpus_and_plan() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;

    let models = admin.get("/api/models").await?.json()?;
    let tiny = models
        .as_array()
        .and_then(|m| m.iter().find(|m| m["id"] == "preset:tiny"))
        .ok_or_else(|| anyhow::anyhow!("no tiny preset in {models}"))?;
    assert_eq!(tiny["kind"], "preset");
    assert_eq!(tiny["family"], "llama");
    assert!(tiny["params"].as_u64().is_some_and(|p| p > 1_000_000 && p < 3_000_000), "{tiny}");

    let gpus = admin.get("/api/gpus").await?.json()?;
    assert_eq!(gpus.as_array().map(Vec::len), Some(1), "{gpus}");
    assert_eq!(gpus[0]["id"], "cpu");
    assert!(gpus[0]["memory_total"].as_u64().is_some_and(|m| m > 0), "{gpus}");

    let fits = admin
        .post("/api/plan", json!({"model": "preset:tiny", "gpu": "cpu", "seq_len": 64, "micro_batch": 1, "grad_accum": 1}))
        .await?
        .json()?;
    assert_eq!(fits["fits"], true, "{fits}");
    assert_eq!(fits["tiers"][0]["name"], "host");
    let used = fits["tiers"][0]["used"].as_u64().unwrap_or(0);
    let parts: u64 = fits["tiers"][0]["parts"]
        .as_array()
        .map_or(0, |p| p.iter().filter_map(|p| p["bytes"].as_u64()).sum());
    assert_eq!(used, parts, "{fits}");
    assert!(fits["step_time_s"].as_f64().is_some_and(|t| t > 0.0), "{fits}");
    // Every gradient policy, with its memory and effect; the job runs with the first (the GPU
    // store, which on the CPU is host memory too) and says so.
    let options = fits["gradient_options"].as_array().cloned().unwrap_or_default();
    let policies: Vec<_> = options.iter().map(|o| o["policy"].as_str().unwrap_or("")).collect();
    assert_eq!(policies, ["device", "host", "host_bf16", "no_clip"], "{fits}");
    let chosen: Vec<_> = options.iter().map(|o| o["chosen"] == true).collect();
    assert_eq!(chosen, [true, false, false, false], "{fits}");
    assert!(options.iter().all(|o| o["fits"] == true && o["effect"].is_string()), "{fits}");
    // Asking for bf16 gradients moves the job there.
    let bf16 = admin
        .post("/api/plan", json!({"model": "preset:tiny", "gpu": "cpu", "seq_len": 64, "micro_batch": 1, "grad_accum": 1, "gradients": "host_bf16"}))
        .await?
        .json()?;
    let chosen: Vec<_> = bf16["gradient_options"]
        .as_array()
        .map(|o| o.iter().filter(|o| o["chosen"] == true).map(|o| o["policy"].clone()).collect())
        .unwrap_or_default();
    assert_eq!(chosen, [json!("host_bf16")], "{bf16}");
    assert!(
        bf16["command"].as_str().is_some_and(|c| c.contains("--gradients host_bf16")),
        "{bf16}"
    );

    let huge = admin
        .post("/api/plan", json!({"model": "preset:qwen2.5-72b", "gpu": "cpu", "seq_len": 4096}))
        .await?
        .json()?;
    assert_eq!(huge["fits"], false, "{huge}");
    assert!(
        huge["reason"].as_str().is_some_and(|r| r.starts_with("Does not fit: needs ")),
        "{huge}"
    );

    let unknown = admin.post("/api/plan", json!({"model": "preset:nope", "gpu": "cpu"})).await?;
    assert_eq!(unknown.status, StatusCode::BAD_REQUEST);
    assert!(unknown.error().contains("preset:nope"), "{}", unknown.text());
    let no_gpu = admin.post("/api/plan", json!({"model": "preset:tiny", "gpu": "cuda:7"})).await?;
    assert_eq!(no_gpu.status, StatusCode::BAD_REQUEST);
    assert!(no_gpu.error().contains("cuda:7"), "{}", no_gpu.text());
    Ok(())
}

/// The Adam moments live where the job asks: in host memory where it holds them (the disk
/// tier is then never measured), every unit's on the disk tier (`SLUICE_DISK_DIR`, measured
/// when first needed) with `moments: disk`, shown as a tier, a sentence and in the command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adam_moments_live_where_the_job_asks() -> anyhow::Result<()> {
    let scratch = tempfile::tempdir()?;
    let dir = scratch.path().join("moments");
    let app = TestApp::with_config(|c| c.disk_dir = Some(dir.clone())).await?;
    let admin = app.admin().await?;
    let body = |moments: &str| json!({"model": "preset:tiny", "gpu": "cpu", "seq_len": 64, "micro_batch": 1, "grad_accum": 1, "moments": moments});
    let disk_tier = |plan: &serde_json::Value| {
        plan["tiers"].as_array().and_then(|t| t.iter().find(|t| t["name"] == "disk tier")).cloned()
    };
    for moments in ["auto", "host"] {
        let plan = admin.post("/api/plan", body(moments)).await?.json()?;
        assert_eq!(plan["fits"], true, "{plan}");
        assert_eq!(disk_tier(&plan), None, "{plan}");
        assert_eq!(plan["disk"], serde_json::Value::Null, "{plan}");
    }
    assert!(!dir.exists(), "the disk tier was measured for jobs that do not need it");

    let plan = admin.post("/api/plan", body("disk")).await?.json()?;
    assert_eq!(plan["fits"], true, "{plan}");
    assert!(dir.is_dir(), "the disk tier's folder is made when it is measured");
    let tier = disk_tier(&plan).ok_or_else(|| anyhow::anyhow!("no disk tier: {plan}"))?;
    assert!(tier["used"].as_u64().is_some_and(|u| u > 0), "{plan}");
    assert!(tier["capacity"].as_u64() > tier["used"].as_u64(), "{plan}");
    assert_eq!(plan["tiers"][0]["name"], "host", "{plan}");
    let text = plan["disk"].as_str().unwrap_or_default();
    let want = format!(
        "Adam moments of embedding, layers 0-3, head live on the disk tier at {} (",
        dir.display()
    );
    assert!(text.starts_with(&want), "{plan}");
    let command = plan["command"].as_str().unwrap_or_default();
    assert!(command.contains(" --moments disk "), "{plan}");
    assert!(command.ends_with(&format!(" --disk-dir {}", dir.display())), "{plan}");

    // A job keeps its choice.
    let demo = admin.demo_dataset().await?;
    let mut job = tiny_job(demo, 1);
    job["moments"] = json!("host");
    let created = admin.post("/api/jobs", job).await?;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    let id = created.json()?["id"].as_i64().unwrap_or_default();
    let shown = admin.get(&format!("/api/jobs/{id}")).await?.json()?;
    assert_eq!(shown["config"]["moments"], "host", "{shown}");

    // A disk tier that cannot be made, asked for: 400 naming the field and the folder.
    let file = scratch.path().join("a-file");
    std::fs::write(&file, "not a folder")?;
    let blocked = file.join("moments");
    let app = TestApp::with_config(|c| c.disk_dir = Some(blocked.clone())).await?;
    let admin = app.admin().await?;
    let reply = admin.post("/api/plan", body("disk")).await?;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text());
    assert!(reply.error().starts_with("moments: disk keeps the Adam moments"), "{}", reply.text());
    assert!(reply.error().contains(&blocked.display().to_string()), "{}", reply.text());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_metrics_are_text() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let reply = app.client().get("/metrics").await?;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(reply.header(header::CONTENT_TYPE).starts_with("text/plain"));
    let text = reply.text();
    for line in [
        "sluice_queue_length 0",
        "sluice_running_jobs 0",
        "sluice_gpu_memory_used_bytes{gpu=\"cpu\"}",
        "# TYPE sluice_tokens_per_second gauge",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_reply_carries_the_security_headers_and_hsts_only_over_https() -> anyhow::Result<()> {
    let paths = ["/", "/healthz", "/static/app.css", "/api/session", "/api/no/such", "/no/such"];
    let app = TestApp::new().await?;
    let client = app.client();
    for path in paths {
        let reply = client.get(path).await?;
        assert_eq!(reply.header(header::X_CONTENT_TYPE_OPTIONS), "nosniff", "{path}");
        assert_eq!(reply.header(header::REFERRER_POLICY), "same-origin", "{path}");
        assert_eq!(reply.header(header::X_FRAME_OPTIONS), "DENY", "{path}");
        assert!(!reply.headers.contains_key(header::STRICT_TRANSPORT_SECURITY), "{path}");
    }
    // Pages keep their script policy beside the new headers.
    let page = client.get("/login").await?;
    assert!(page.header(header::CONTENT_SECURITY_POLICY).contains("frame-ancestors 'none'"));

    let https = TestApp::with_config(|c| c.https = true).await?;
    let client = https.client();
    for path in paths {
        let reply = client.get(path).await?;
        assert_eq!(reply.header(header::STRICT_TRANSPORT_SECURITY), "max-age=31536000", "{path}");
        assert_eq!(reply.header(header::X_FRAME_OPTIONS), "DENY", "{path}");
    }
    Ok(())
}

/// A JSON error body with `status` whose message contains `needle`.
fn assert_json_error(reply: &Reply, status: StatusCode, needle: &str) {
    assert_eq!(reply.status, status, "{}", reply.text());
    assert_eq!(reply.header(header::CONTENT_TYPE), "application/json", "{}", reply.text());
    let message = reply.error();
    assert!(message.contains(needle), "{needle:?} not in {:?}", reply.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_from_layers_and_extractors_are_json_under_api() -> anyhow::Result<()> {
    let app = TestApp::with_config(|c| c.max_upload_bytes = 1024).await?;
    let admin = app.admin().await?;

    // Over the body ceiling (upload limit + 16 MiB): refused by the limit layer before any
    // handler, with the limit a user can change.
    let body = vec![b'x'; 17 << 20];
    let request = admin
        .builder(Method::POST, "/api/datasets")
        .header(header::CONTENT_TYPE, "multipart/form-data; boundary=b")
        .header(header::CONTENT_LENGTH, body.len())
        .body(Body::from(body))?;
    assert_json_error(&admin.send(request).await?, StatusCode::PAYLOAD_TOO_LARGE, "max_upload_mb");

    // Over axum's 2 MiB for JSON bodies: too large, not malformed.
    let big = json!({"model": "preset:tiny", "gpu": "cpu", "pad": "x".repeat(3 << 20)});
    let reply = admin.post("/api/plan", big).await?;
    assert_json_error(&reply, StatusCode::PAYLOAD_TOO_LARGE, "too large");

    // axum's multipart rejection, with its own message kept (and not compressed away).
    let request = admin
        .builder(Method::POST, "/api/datasets")
        .header(header::CONTENT_TYPE, "multipart/form-data")
        .header(header::ACCEPT_ENCODING, "gzip")
        .body(Body::from("--x\r\n"))?;
    let reply = admin.send(request).await?;
    assert_json_error(&reply, StatusCode::BAD_REQUEST, "boundary");

    // A wrong method: JSON, and the `Allow` header still says what works.
    let request = admin.builder(Method::PUT, "/api/gpus").body(Body::empty())?;
    let reply = admin.send(request).await?;
    assert_json_error(&reply, StatusCode::METHOD_NOT_ALLOWED, "PUT is not allowed on /api/gpus");
    assert!(reply.header(header::ALLOW).contains("GET"), "{:?}", reply.headers);

    // The replies that were JSON already stay as they were: 401, 403, 404.
    let anonymous = app.client();
    assert_json_error(&anonymous.get("/api/jobs").await?, StatusCode::UNAUTHORIZED, "log in");
    let reply = anonymous.post("/api/jobs", json!({})).await?;
    assert_json_error(&reply, StatusCode::FORBIDDEN, "CSRF");
    assert_json_error(&admin.get("/api/no/such").await?, StatusCode::NOT_FOUND, "/api/no/such");

    // Outside /api/ the pages keep their HTML, for a 404 as for a 405.
    let page = admin.get("/no/such/page").await?;
    assert_eq!(page.status, StatusCode::NOT_FOUND);
    assert!(page.header(header::CONTENT_TYPE).starts_with("text/html"));
    assert!(page.text().contains("Page not found"), "{}", page.text());
    let request = admin.builder(Method::PUT, "/login").body(Body::empty())?;
    let reply = admin.send(request).await?;
    assert_eq!(reply.status, StatusCode::METHOD_NOT_ALLOWED);
    assert!(reply.json().is_err(), "{}", reply.text());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn downloads_and_event_streams_pass_and_a_bad_range_is_json() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let demo = admin.demo_dataset().await?;
    let id = admin.submit(tiny_job(demo, 1)).await?;
    admin.wait_job(id, 300, |j| j["status"] == "completed").await?;
    let file = format!("/api/jobs/{id}/checkpoints/final/files/config.json");
    let size =
        std::fs::metadata(app.state.runs_dir().join(id.to_string()).join("final/config.json"))?
            .len();

    let ranged = |range: &'static str| -> anyhow::Result<_> {
        Ok(admin.builder(Method::GET, &file).header(header::RANGE, range).body(Body::empty())?)
    };
    let part = admin.send(ranged("bytes=0-3")?).await?;
    assert_eq!(part.status, StatusCode::PARTIAL_CONTENT);
    assert_eq!(part.body.len(), 4);
    assert_eq!(part.header(header::CONTENT_RANGE), format!("bytes 0-3/{size}"));

    // Past the end: still 416 with `Content-Range: bytes */size`, and a JSON body saying so.
    let past = admin.send(ranged("bytes=999999999-")?).await?;
    assert_json_error(&past, StatusCode::RANGE_NOT_SATISFIABLE, &format!("({size} bytes)"));
    assert_eq!(past.header(header::CONTENT_RANGE), format!("bytes */{size}"));

    // Server-sent events keep their type (the stream never ends, so only the head is read).
    let request =
        admin.builder(Method::GET, &format!("/api/jobs/{id}/events")).body(Body::empty())?;
    let response = sluice::app(admin.state.clone()).oneshot(request).await?;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()[header::CONTENT_TYPE], "text/event-stream");
    let log = admin.get(&format!("/api/jobs/{id}/log")).await?;
    assert_eq!(log.status, StatusCode::OK);
    assert!(log.header(header::CONTENT_TYPE).starts_with("text/plain"));
    Ok(())
}
