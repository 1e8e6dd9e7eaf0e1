//! "Try it" on a checkpoint: a short generation from a trained tiny job, with the same access
//! rules as downloading the checkpoint.

use axum::http::StatusCode;
use serde_json::json;

use crate::common::{TestApp, tiny_job};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_continues_a_prompt() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let demo = alice.demo_dataset().await?;
    let id = alice.submit(tiny_job(demo, 2)).await?;
    alice.wait_job(id, 300, |j| j["status"] == "completed").await?;
    let url = format!("/api/jobs/{id}/checkpoints/final/generate");

    let reply = alice.post(&url, json!({"prompt": "Hello", "max_new_tokens": 8})).await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let answer = reply.json()?;
    let tokens = answer["tokens"].as_u64().unwrap_or_default();
    assert!((1..=8).contains(&tokens), "{answer}");
    assert!(answer["text"].as_str().is_some_and(|t| !t.is_empty()), "{answer}");

    // Greedy decoding is deterministic; sampling is accepted too.
    let again = alice.post(&url, json!({"prompt": "Hello", "max_new_tokens": 8})).await?.json()?;
    assert_eq!(again["text"], answer["text"]);
    let sampled =
        alice.post(&url, json!({"prompt": "Hi", "max_new_tokens": 4, "temperature": 0.8})).await?;
    assert_eq!(sampled.status, StatusCode::OK, "{}", sampled.text());

    // The admin sees every job's checkpoints; another user sees none of alice's.
    let by_admin = admin.post(&url, json!({"prompt": "Hello", "max_new_tokens": 2})).await?;
    assert_eq!(by_admin.status, StatusCode::OK, "{}", by_admin.text());
    let bob = app.user(&admin, "bob").await?;
    let by_bob = bob.post(&url, json!({"prompt": "Hello"})).await?;
    assert_eq!(by_bob.status, StatusCode::NOT_FOUND, "{}", by_bob.text());

    let missing = [
        format!("/api/jobs/{id}/checkpoints/nope/generate"),
        format!("/api/jobs/{id}/checkpoints/..%2Ffinal/generate"),
        "/api/jobs/9999/checkpoints/final/generate".to_string(),
    ];
    for path in missing {
        let reply = alice.post(&path, json!({"prompt": "Hello"})).await?;
        assert_eq!(reply.status, StatusCode::NOT_FOUND, "{path}: {}", reply.text());
    }
    for (body, why) in [
        (json!({"prompt": "  "}), "empty"),
        (json!({"prompt": "Hello", "max_new_tokens": 257}), "max_new_tokens"),
        (json!({"prompt": "Hello", "max_new_tokens": 0}), "max_new_tokens"),
        (json!({"prompt": "Hello", "temperature": -1.0}), "temperature"),
        (json!({"text": "Hello"}), "prompt"),
    ] {
        let reply = alice.post(&url, body.clone()).await?;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{body}: {}", reply.text());
        assert!(reply.error().contains(why), "{body}: {}", reply.error());
    }
    Ok(())
}
