//! Disk use per user, quotas that submits and uploads respect, and model folders deleted with
//! the bytes they freed.

use axum::http::StatusCode;
use serde_json::{Value, json};

use crate::common::{TestApp, tiny_job};

fn row<'a>(storage: &'a Value, username: &str) -> &'a Value {
    storage["users"]
        .as_array()
        .and_then(|u| u.iter().find(|u| u["username"] == username))
        .unwrap_or(&Value::Null)
}

const RECORDS: &[u8] = b"{\"prompt\": \"2+2=\", \"completion\": \"4\"}\n{\"prompt\": \"3+3=\", \"completion\": \"6\"}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_is_counted_per_user_and_a_quota_refuses_more() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let uploaded = alice.upload("sums.jsonl", RECORDS, None).await?;
    assert_eq!(uploaded.status, StatusCode::CREATED, "{}", uploaded.text());
    let dataset = uploaded.json()?["id"].as_i64().unwrap_or(0);
    let mut job = tiny_job(dataset, 2);
    job["save_every"] = json!(1);
    let id = alice.submit(job).await?;
    alice.wait_job(id, 300, |j| j["status"] == "completed").await?;

    let storage = admin.get("/api/storage").await?.json()?;
    let mine = row(&storage, "alice");
    let run = app.state.runs_dir().join(id.to_string());
    let run_bytes = sluice::paths::dir_bytes(&run);
    let saved = sluice::paths::dir_bytes(&run.join("checkpoint-1"))
        + sluice::paths::dir_bytes(&run.join("final"));
    assert_eq!(mine["datasets_bytes"], RECORDS.len(), "{storage}");
    assert_eq!(mine["runs_bytes"], run_bytes, "{storage}");
    assert_eq!(mine["checkpoints_bytes"], saved, "{storage}");
    assert!(saved > 0 && saved < run_bytes, "the state and run.json are runs but not checkpoints");
    assert_eq!(mine["total_bytes"], RECORDS.len() as u64 + run_bytes);
    assert_eq!(mine["jobs"], 1);
    assert!(mine["quota_bytes"].is_null());
    assert_eq!(row(&storage, "admin")["total_bytes"], 0, "the demo dataset is shared: {storage}");
    assert!(storage["shared_datasets_bytes"].as_u64().is_some_and(|b| b > 0), "{storage}");
    assert_eq!(alice.get("/api/storage").await?.status, StatusCode::FORBIDDEN);

    // A quota under what alice uses: no new job, no upload, each saying why.
    let alice_id = mine["id"].as_i64().unwrap_or(0);
    let quota = format!("/api/storage/users/{alice_id}/quota");
    let set = admin.put(&quota, json!({"quota_bytes": run_bytes})).await?;
    assert_eq!(set.status, StatusCode::OK, "{}", set.text());
    let refused = alice.post("/api/jobs", tiny_job(dataset, 1)).await?;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{}", refused.text());
    assert!(refused.error().contains("storage quota"), "{}", refused.error());
    let before = std::fs::read_dir(app.state.datasets_dir())?.count();
    let upload = alice.upload("more.jsonl", RECORDS, None).await?;
    assert_eq!(upload.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", upload.text());
    assert!(upload.error().contains("this upload adds"), "{}", upload.error());
    assert_eq!(std::fs::read_dir(app.state.datasets_dir())?.count(), before, "nothing is kept");
    assert_eq!(admin.get("/api/storage").await?.json()?["users"][1]["quota_bytes"], run_bytes);

    // Room made by deleting the job: alice may start again.
    let freed = alice.delete(&format!("/api/jobs/{id}")).await?.json()?;
    assert_eq!(freed["freed_bytes"], run_bytes);
    alice.submit(tiny_job(dataset, 1)).await?;
    // No quota at all again; bad values are refused.
    assert_eq!(admin.put(&quota, json!({"quota_bytes": null})).await?.status, StatusCode::OK);
    for bad in [
        json!({"quota_bytes": -1}),
        json!({"quota_bytes": "1 GB"}),
        json!({}),
        json!({"quota_bytes": 1.5}),
    ] {
        let reply = admin.put(&quota, bad.clone()).await?;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{bad}: {}", reply.text());
    }
    assert_eq!(
        admin.put("/api/storage/users/9999/quota", json!({"quota_bytes": 1})).await?.status,
        StatusCode::NOT_FOUND
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_folder_is_deleted_with_its_size_but_not_while_a_job_trains_it()
-> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let demo = admin.demo_dataset().await?;
    // A real model folder: the final checkpoint of a tiny run, copied into models/.
    let id = admin.submit(tiny_job(demo, 1)).await?;
    admin.wait_job(id, 300, |j| j["status"] == "completed").await?;
    let folder = app.state.models_dir().join("mine");
    std::fs::create_dir_all(&folder)?;
    let final_dir = app.state.runs_dir().join(id.to_string()).join("final");
    for entry in std::fs::read_dir(&final_dir)? {
        let entry = entry?;
        std::fs::copy(entry.path(), folder.join(entry.file_name()))?;
    }
    let bytes = sluice::paths::dir_bytes(&folder);
    let storage = admin.get("/api/storage").await?.json()?;
    let listed = storage["models"].as_array().cloned().unwrap_or_default();
    assert_eq!(listed.len(), 1, "{storage}");
    assert_eq!(
        (listed[0]["name"].as_str(), listed[0]["bytes"].as_u64()),
        (Some("mine"), Some(bytes))
    );

    let mut long = tiny_job(demo, 100_000);
    long["model"] = json!("local:mine");
    let running = admin.submit(long).await?;
    admin.wait_job(running, 300, |j| j["status"] == "running").await?;
    let busy = admin.delete("/api/storage/models/mine").await?;
    assert_eq!(busy.status, StatusCode::CONFLICT, "{}", busy.text());
    assert!(busy.error().contains("cancel them first"), "{}", busy.error());
    assert!(folder.is_dir());
    admin.post(&format!("/api/jobs/{running}/cancel"), json!({})).await?;
    admin.wait_job(running, 120, |j| j["status"] == "cancelled").await?;

    let gone = admin.delete("/api/storage/models/mine").await?;
    assert_eq!(gone.status, StatusCode::OK, "{}", gone.text());
    assert_eq!(gone.json()?["freed_bytes"], bytes);
    assert!(!folder.exists());
    assert!(std::fs::read_dir(app.state.models_dir())?.next().is_none(), "nothing left aside");
    for missing in ["mine", "..", ".hidden"] {
        let reply = admin.delete(&format!("/api/storage/models/{missing}")).await?;
        assert_eq!(reply.status, StatusCode::NOT_FOUND, "{missing}");
    }
    Ok(())
}
