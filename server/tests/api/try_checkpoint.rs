//! "Try it" on a checkpoint: a short generation from a trained tiny job, with the same access
//! rules as downloading the checkpoint; a conversation in the chat template, streamed as
//! server-sent events; never on a device a job is training on.

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
        (json!({}), "prompt or messages"),
        (json!({"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]}), "not both"),
        (json!({"messages": []}), "1 to 64"),
        (json!({"messages": [{"role": "bot", "content": "Hi"}]}), "role \"bot\""),
        (
            json!({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}),
            "end with a user turn",
        ),
        (json!({"messages": [{"role": "user", "content": "Hi", "name": "x"}]}), "name"),
        (json!({"messages": [{"role": "user", "content": "x".repeat(70_000)}]}), "KiB"),
    ] {
        let reply = alice.post(&url, body.clone()).await?;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{body}: {}", reply.text());
        assert!(reply.error().contains(why), "{body}: {}", reply.error());
    }
    Ok(())
}

/// Splits a server-sent events body into (event, JSON data) pairs.
fn sse_events(body: &str) -> Vec<(String, serde_json::Value)> {
    body.split("\n\n")
        .filter_map(|frame| {
            let mut name = None;
            let mut data = String::new();
            for line in frame.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    name = Some(v.trim().to_string());
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push_str(v.strip_prefix(' ').unwrap_or(v));
                }
            }
            Some((name?, serde_json::from_str(&data).ok()?))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_streams_and_waits_for_training() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let demo = alice.demo_dataset().await?;
    let id = alice.submit(tiny_job(demo, 2)).await?;
    alice.wait_job(id, 300, |j| j["status"] == "completed").await?;
    let url = format!("/api/jobs/{id}/checkpoints/final/generate");
    let conversation = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there."},
        {"role": "user", "content": "How are you?"},
    ]);

    // One JSON answer: the tiny tokenizer has a ChatML template; no GPU here, so the CPU.
    let body = json!({"messages": conversation, "max_new_tokens": 6});
    let reply = alice.post(&url, body.clone()).await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let answer = reply.json()?;
    assert_eq!(answer["chat"], true, "{answer}");
    assert_eq!(answer["device"], "cpu", "{answer}");
    assert!(answer["tokens"].as_u64().is_some_and(|t| (1..=6).contains(&t)), "{answer}");
    assert!(answer["tokens_per_s"].as_f64().is_some_and(|r| r > 0.0), "{answer}");

    // Streamed: start, the tokens' text in order, then done with the same greedy answer; the
    // model loaded for the first request is reused.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let reply = alice.post(&url, streamed).await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert!(reply.header(axum::http::header::CONTENT_TYPE).starts_with("text/event-stream"));
    let events = sse_events(&reply.text());
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"start"), "{names:?}");
    assert_eq!(names.last(), Some(&"done"), "{names:?}");
    assert!(names[1..names.len() - 1].iter().all(|n| *n == "token"), "{names:?}");
    let (_, start) = &events[0];
    assert_eq!(start["device"], "cpu", "{start}");
    assert_eq!(start["reused"], true, "{start}");
    assert!(start["prompt_tokens"].as_u64().is_some_and(|n| n > 4), "{start}");
    let joined: String = events
        .iter()
        .filter(|(n, _)| n == "token")
        .filter_map(|(_, d)| d["text"].as_str())
        .collect();
    let (_, done) = events.last().expect("done");
    assert_eq!(done["text"], answer["text"], "{done}");
    assert_eq!(joined, answer["text"].as_str().unwrap_or_default(), "{done}");

    // A different conversation gives a different prompt (the history is used).
    let short = alice
        .post(
            &url,
            json!({"messages": [{"role": "user", "content": "How are you?"}], "stream": true}),
        )
        .await?;
    let short = sse_events(&short.text());
    assert!(short[0].1["prompt_tokens"].as_u64() < start["prompt_tokens"].as_u64(), "{short:?}");

    // While a job trains on the CPU (the only device here), try-it refuses rather than slow it.
    let long = alice.submit(tiny_job(demo, 100_000)).await?;
    alice.wait_job(long, 120, |j| j["status"] == "running").await?;
    let busy = alice.post(&url, body.clone()).await?;
    assert_eq!(busy.status, StatusCode::CONFLICT, "{}", busy.text());
    assert!(busy.error().contains(&format!("training job {long}")), "{}", busy.error());
    let cancel = alice.post(&format!("/api/jobs/{long}/cancel"), json!({})).await?;
    assert!(cancel.status.is_success(), "{}", cancel.text());
    alice.wait_job(long, 120, |j| j["status"] == "cancelled").await?;
    let mut again = body;
    again["stream"] = json!(true);
    let after = alice.post(&url, again).await?;
    assert_eq!(after.status, StatusCode::OK, "{}", after.text());
    let after = sse_events(&after.text());
    // The model was unloaded when the long job started, and loads again the same.
    assert_eq!(after[0].1["reused"], false, "{after:?}");
    assert_eq!(after.last().map(|(_, d)| d["text"].clone()), Some(answer["text"].clone()));
    Ok(())
}
