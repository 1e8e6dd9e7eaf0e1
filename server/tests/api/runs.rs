//! Runs one can find, compare and clean up: names and notes, the summary, a long run's metrics
//! without the per-unit timeline (which is served per step), checkpoints scaled to the run and
//! pruned, and deletes that say what they freed.

use axum::body::Body;
use axum::http::{Method, StatusCode, header};
use serde_json::{Value, json};

use crate::common::{Client, TestApp, tiny_job};

async fn patch(client: &Client, path: &str, body: Value) -> anyhow::Result<crate::common::Reply> {
    let request = client
        .builder(Method::PATCH, path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))?;
    client.send(request).await
}

fn close(a: f64, b: f64) -> bool {
    // The metrics reply carries five significant digits.
    (a - b).abs() <= 1e-4 * a.abs().max(b.abs())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_has_a_name_a_note_and_a_summary() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let demo = admin.demo_dataset().await?;
    let mut job = tiny_job(demo, 4);
    job["name"] = json!("  first try  ");
    job["note"] = json!("lr as the preset says\nseq 64");
    job["eval_every"] = json!(2);
    let id = admin.submit(job).await?;
    let done = admin.wait_job(id, 300, |j| j["status"] == "completed").await?;
    assert_eq!(done["name"], "first try", "trimmed: {done}");
    assert_eq!(done["note"], "lr as the preset says\nseq 64");

    let metrics = admin.get(&format!("/api/jobs/{id}/metrics")).await?.json()?;
    let points = metrics.as_array().cloned().unwrap_or_default();
    // Four steps, and the held-out loss before the first: a point of step 0 with only that.
    assert_eq!(points.len(), 5, "{metrics}");
    assert_eq!(points[0]["step"], 0, "{metrics}");
    assert!(points[0]["loss"].is_null() && points[0]["eval_loss"].as_f64().is_some(), "{metrics}");
    let summary = &done["summary"];
    let losses: Vec<f64> = points.iter().filter_map(|p| p["loss"].as_f64()).collect();
    let last = *losses.last().unwrap_or(&f64::NAN);
    assert!(close(summary["final_loss"].as_f64().unwrap_or(0.0), last), "{summary} {metrics}");
    let best = losses.iter().copied().fold(f64::INFINITY, f64::min);
    assert!(close(summary["best_loss"].as_f64().unwrap_or(0.0), best), "{summary}");
    let evals: Vec<(i64, f64)> = points
        .iter()
        .filter_map(|p| Some((p["step"].as_i64()?, p["eval_loss"].as_f64()?)))
        .collect();
    assert_eq!(evals.iter().map(|e| e.0).collect::<Vec<_>>(), [0, 2, 4], "{metrics}");
    assert!(close(summary["final_eval_loss"].as_f64().unwrap_or(0.0), evals[2].1), "{summary}");
    let log = admin.get(&format!("/api/jobs/{id}/log")).await?.text();
    assert!(log.contains("held-out loss before training: "), "{log}");
    let tokens: i64 = points.iter().filter_map(|p| p["tokens"].as_i64()).sum();
    assert!(tokens > 0);
    assert_eq!(summary["tokens_seen"], tokens, "{summary}");
    assert!(summary["tokens_per_s"].as_f64().is_some_and(|t| t > 0.0), "{summary}");
    let (started, finished) = (done["started_at"].as_f64(), done["finished_at"].as_f64());
    assert!(started.is_some() && finished.is_some(), "{done}");
    assert!(done["duration_s"].as_f64().is_some_and(|d| d >= 0.0), "{done}");
    assert!(done["created_at"].as_f64() <= started, "{done}");

    // Renamed and re-noted later; each field may come alone.
    let renamed = patch(&admin, &format!("/api/jobs/{id}"), json!({"name": "baseline"})).await?;
    assert_eq!(renamed.status, StatusCode::OK, "{}", renamed.text());
    let renamed = renamed.json()?;
    assert_eq!(
        (renamed["name"].as_str(), renamed["note"].as_str()),
        (Some("baseline"), Some("lr as the preset says\nseq 64"))
    );
    let cleared = patch(&admin, &format!("/api/jobs/{id}"), json!({"note": null})).await?;
    assert_eq!(cleared.json()?["note"], "");
    let listed = admin.get("/api/jobs").await?.json()?;
    assert_eq!(listed[0]["name"], "baseline", "{listed}");

    for (body, needle) in [
        (json!({"name": "x".repeat(101)}), "at most 100"),
        (json!({"name": "two\nlines"}), "one line"),
        (json!({"name": 7}), "name must be a string"),
        (json!({"note": "n".repeat(2001)}), "at most 2000"),
        (json!({"steps": 9}), "unknown field `steps`"),
        (json!([1]), "JSON object"),
    ] {
        let reply = patch(&admin, &format!("/api/jobs/{id}"), body.clone()).await?;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{body}");
        assert!(reply.error().contains(needle), "{body}: {}", reply.error());
    }
    let mut long_name = tiny_job(demo, 1);
    long_name["name"] = json!("y".repeat(101));
    let refused = admin.post("/api/jobs", long_name).await?;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert!(refused.error().contains("at most 100"), "{}", refused.error());
    // The plan takes the same body and ignores the label.
    let mut planned = tiny_job(demo, 1);
    planned["name"] = json!("a plan");
    assert_eq!(admin.post("/api/plan", planned).await?.status, StatusCode::OK);
    let unchanged = admin.get(&format!("/api/jobs/{id}")).await?.json()?;
    assert_eq!(unchanged["name"], "baseline");
    Ok(())
}

/// A real 400-step CPU run: its metrics reply stays small, each step's timeline is served on
/// its own, and with no `save_every` it saves a few checkpoints, keeping the latest three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_400_step_run_has_small_metrics_and_few_checkpoints() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let demo = admin.demo_dataset().await?;
    let id = admin.submit(tiny_job(demo, 400)).await?;
    let done =
        admin.wait_job(id, 600, |j| j["status"] != "queued" && j["status"] != "running").await?;
    assert_eq!(done["status"], "completed", "{done}");

    let reply = admin.get(&format!("/api/jobs/{id}/metrics")).await?;
    assert_eq!(reply.status, StatusCode::OK);
    let points = reply.json()?;
    let points = points.as_array().cloned().unwrap_or_default();
    assert_eq!(points.len(), 400);
    assert!(points.iter().all(|p| p.get("timeline").is_none()), "{}", points[0]);
    assert!(points.iter().all(|p| p["loss"].is_number() && p["step"].is_number()));
    println!("metrics of a 400-step run: {} bytes", reply.body.len());
    // About 270 bytes a point on the CPU (no GPU fields).
    assert!(reply.body.len() < 120_000, "the metrics reply is {} bytes", reply.body.len());

    // The timeline of a chosen step, and of the latest when none is named.
    let at_7 = admin.get(&format!("/api/jobs/{id}/timeline?step=7")).await?;
    assert_eq!(at_7.status, StatusCode::OK, "{}", at_7.text());
    let at_7 = at_7.json()?;
    assert_eq!(at_7["step"], 7);
    let spans = at_7["timeline"].as_array().cloned().unwrap_or_default();
    assert!(!spans.is_empty(), "{at_7}");
    let latest = admin.get(&format!("/api/jobs/{id}/timeline")).await?.json()?;
    assert_eq!(latest["step"], 400, "{latest}");
    assert!(latest["timeline"].is_array());
    assert_eq!(
        admin.get(&format!("/api/jobs/{id}/timeline?step=401")).await?.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        admin.get(&format!("/api/jobs/{id}/timeline?step=seven")).await?.status,
        StatusCode::BAD_REQUEST
    );

    // Every 80 steps (400 / 5), of which the latest three stay beside the final one.
    let checkpoints = admin.get(&format!("/api/jobs/{id}/checkpoints")).await?.json()?;
    let names: Vec<&str> = checkpoints
        .as_array()
        .map(|c| c.iter().filter_map(|c| c["name"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(names, ["checkpoint-160", "checkpoint-240", "checkpoint-320", "final"]);
    let run = app.state.runs_dir().join(id.to_string());
    assert!(!run.join("checkpoint-80").exists());
    assert!(run.join("state").is_dir(), "the resumable state stays");
    let log = admin.get(&format!("/api/jobs/{id}/log")).await?.text();
    assert!(log.contains("saved checkpoint checkpoint-80 (step 80)"), "{log}");
    assert!(log.contains("removed checkpoint-80"), "{log}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletes_free_the_disk_they_say_and_spare_running_jobs() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let demo = admin.demo_dataset().await?;
    let mut job = tiny_job(demo, 3);
    job["save_every"] = json!(1);
    let id = alice.submit(job).await?;
    alice.wait_job(id, 300, |j| j["status"] == "completed").await?;
    let run = app.state.runs_dir().join(id.to_string());

    // One checkpoint: its folder's bytes, and it is gone from the list and the disk.
    let folder = run.join("checkpoint-1");
    let bytes = sluice::paths::dir_bytes(&folder);
    assert!(bytes > 0);
    let reply = alice.delete(&format!("/api/jobs/{id}/checkpoints/checkpoint-1")).await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(reply.json()?["freed_bytes"], bytes);
    assert!(!folder.exists());
    let names = alice.get(&format!("/api/jobs/{id}/checkpoints")).await?.json()?;
    assert_eq!(names.as_array().map(Vec::len), Some(2), "{names}");
    assert_eq!(
        alice.delete(&format!("/api/jobs/{id}/checkpoints/checkpoint-1")).await?.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        alice.delete(&format!("/api/jobs/{id}/checkpoints/..")).await?.status,
        StatusCode::NOT_FOUND
    );

    // A running job and its checkpoints stay; so does a queued one behind it.
    let mut long = tiny_job(demo, 100_000);
    long["save_every"] = json!(1);
    let running = alice.submit(long).await?;
    alice
        .wait_job(running, 300, |j| j["status"] == "running" && j["step"].as_i64() >= Some(2))
        .await?;
    let queued = alice.submit(tiny_job(demo, 1)).await?;
    for target in [running, queued] {
        let reply = alice.delete(&format!("/api/jobs/{target}")).await?;
        assert_eq!(reply.status, StatusCode::CONFLICT, "{}", reply.text());
        assert!(reply.error().contains("cancel it before deleting it"), "{}", reply.error());
    }
    let saved = alice.delete(&format!("/api/jobs/{running}/checkpoints/checkpoint-1")).await?;
    assert_eq!(saved.status, StatusCode::CONFLICT, "{}", saved.text());
    assert!(app.state.runs_dir().join(running.to_string()).join("checkpoint-1").is_dir());

    // Another user cannot delete it; its owner can, and learns what it freed.
    let bob = app.user(&admin, "bob").await?;
    assert_eq!(bob.delete(&format!("/api/jobs/{id}")).await?.status, StatusCode::NOT_FOUND);
    let whole = sluice::paths::dir_bytes(&run);
    let reply = alice.delete(&format!("/api/jobs/{id}")).await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(reply.json()?["freed_bytes"], whole);
    assert!(!run.exists());
    let leftovers: Vec<_> = std::fs::read_dir(app.state.runs_dir())?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    assert_eq!(alice.get(&format!("/api/jobs/{id}")).await?.status, StatusCode::NOT_FOUND);
    assert_eq!(alice.get(&format!("/api/jobs/{id}/metrics")).await?.status, StatusCode::NOT_FOUND);
    assert_eq!(alice.delete(&format!("/api/jobs/{id}")).await?.status, StatusCode::NOT_FOUND);

    for target in [queued, running] {
        alice.post(&format!("/api/jobs/{target}/cancel"), json!({})).await?;
    }
    alice.wait_job(running, 120, |j| j["status"] == "cancelled").await?;
    let reply = alice.delete(&format!("/api/jobs/{running}")).await?;
    assert_eq!(reply.status, StatusCode::OK, "a stopped job can go: {}", reply.text());
    Ok(())
}
