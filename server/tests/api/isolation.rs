//! A user sees only their own datasets, jobs and checkpoints; others' ids answer 404.

use axum::http::StatusCode;

use crate::common::{TestApp, tiny_job};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_user_gets_404_for_everything_of_the_first() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let bob = app.user(&admin, "bob").await?;

    let data = "{\"prompt\": \"2+2=\", \"completion\": \"4\"}\n{\"prompt\": \"3+3=\", \"completion\": \"6\"}\n";
    let dataset = alice.upload("sums.jsonl", data.as_bytes(), None).await?.json()?["id"]
        .as_i64()
        .unwrap_or(0);
    let job = alice.submit(tiny_job(dataset, 2)).await?;
    alice.wait_job(job, 300, |j| j["status"] == "completed").await?;
    let checkpoints = alice.get(&format!("/api/jobs/{job}/checkpoints")).await?.json()?;
    assert_eq!(checkpoints[0]["name"], "final", "{checkpoints}");

    for path in [
        format!("/api/datasets/{dataset}"),
        format!("/api/datasets/{dataset}/preview?model=preset:tiny"),
        format!("/api/jobs/{job}"),
        format!("/api/jobs/{job}/metrics"),
        format!("/api/jobs/{job}/log"),
        format!("/api/jobs/{job}/events"),
        format!("/api/jobs/{job}/checkpoints"),
        format!("/api/jobs/{job}/checkpoints/final/files/config.json"),
        format!("/api/jobs/{job}/checkpoints/final/archive"),
    ] {
        let reply = bob.get(&path).await?;
        assert_eq!(reply.status, StatusCode::NOT_FOUND, "{path}: {}", reply.text());
        assert!(reply.error().starts_with("no "), "{path}: {}", reply.text());
    }
    for path in [format!("/api/jobs/{job}/cancel"), format!("/api/jobs/{job}/resume")] {
        let reply = bob.post(&path, serde_json::json!({})).await?;
        assert_eq!(reply.status, StatusCode::NOT_FOUND, "{path}: {}", reply.text());
    }
    assert_eq!(
        bob.delete(&format!("/api/datasets/{dataset}")).await?.status,
        StatusCode::NOT_FOUND
    );

    // Bob's lists hold none of it, and he cannot train on Alice's data.
    let datasets = bob.get("/api/datasets").await?.json()?;
    assert!(
        datasets.as_array().is_some_and(|d| d.iter().all(|d| d["id"] != dataset)),
        "{datasets}"
    );
    assert_eq!(bob.get("/api/jobs").await?.json()?, serde_json::json!([]));
    let refused = bob.post("/api/jobs", tiny_job(dataset, 2)).await?;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert!(refused.error().contains("unknown dataset"), "{}", refused.text());

    // The admin sees everything.
    assert_eq!(admin.get(&format!("/api/jobs/{job}")).await?.json()?["owner"], "alice");
    assert_eq!(admin.get(&format!("/api/datasets/{dataset}")).await?.status, StatusCode::OK);
    assert_eq!(
        admin.get(&format!("/api/jobs/{job}/checkpoints/final/files/config.json")).await?.status,
        StatusCode::OK
    );
    Ok(())
}
