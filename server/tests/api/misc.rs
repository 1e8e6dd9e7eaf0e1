//! Pages, health, models, GPUs, plan, `/metrics`.

use axum::http::{StatusCode, header};
use serde_json::json;

use crate::common::TestApp;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn root_serves_the_placeholder_and_unknown_routes_get_404() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let client = app.client();
    let root = client.get("/").await?;
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

    let huge = admin
        .post("/api/plan", json!({"model": "preset:qwen2.5-72b", "gpu": "cpu", "seq_len": 4096}))
        .await?
        .json()?;
    assert_eq!(huge["fits"], false, "{huge}");
    assert!(huge["reason"].as_str().is_some_and(|r| r.contains("does not fit")), "{huge}");

    let unknown = admin.post("/api/plan", json!({"model": "preset:nope", "gpu": "cpu"})).await?;
    assert_eq!(unknown.status, StatusCode::BAD_REQUEST);
    assert!(unknown.error().contains("preset:nope"), "{}", unknown.text());
    let no_gpu = admin.post("/api/plan", json!({"model": "preset:tiny", "gpu": "cuda:7"})).await?;
    assert_eq!(no_gpu.status, StatusCode::BAD_REQUEST);
    assert!(no_gpu.error().contains("cuda:7"), "{}", no_gpu.text());
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
