//! A job's live stream (server-sent events) ends when the job does, and open streams are capped
//! per user and in all.

use std::time::{Duration, Instant};

use axum::body::{Body, BodyDataStream};
use axum::http::{Method, StatusCode};
use futures_util::StreamExt;
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::common::{Client, TestApp, tiny_job};

/// Opens `path`'s event stream for `client`: its status and, when it was admitted, its body.
async fn open(client: &Client, path: &str) -> anyhow::Result<(StatusCode, BodyDataStream)> {
    let request = client.builder(Method::GET, path).body(Body::empty())?;
    let response = sluice::app(client.state.clone()).oneshot(request).await?;
    Ok((response.status(), response.into_body().into_data_stream()))
}

/// Reads `stream` until it ends (at most `secs`): everything it sent.
async fn read_to_end(stream: &mut BodyDataStream, secs: u64) -> anyhow::Result<String> {
    let mut seen = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Err(_) => anyhow::bail!("the stream was still open after {secs} s: {seen}"),
            Ok(None) => return Ok(seen),
            Ok(Some(chunk)) => seen.push_str(&String::from_utf8_lossy(&chunk?)),
        }
    }
}

/// A request over a cap: its status and error message (an admitted stream would hang here, so
/// its body is read for at most 5 s).
async fn refused(client: &Client, path: &str) -> anyhow::Result<(StatusCode, String)> {
    let (status, mut stream) = open(client, path).await?;
    anyhow::ensure!(status != StatusCode::OK, "{path} was admitted");
    let body: Value = serde_json::from_str(&read_to_end(&mut stream, 5).await?)?;
    Ok((status, body["error"].as_str().unwrap_or_default().to_string()))
}

/// Reads `stream` until it has sent `what` (at most `secs`).
async fn read_until(stream: &mut BodyDataStream, what: &str, secs: u64) -> anyhow::Result<()> {
    let mut seen = String::new();
    while !seen.contains(what) {
        let chunk = tokio::time::timeout(Duration::from_secs(secs), stream.next()).await?;
        let Some(chunk) = chunk else { anyhow::bail!("the stream ended before {what:?}: {seen}") };
        seen.push_str(&String::from_utf8_lossy(&chunk?));
    }
    Ok(())
}

/// The statuses a stream's text carries, in order.
fn statuses(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut kind = "";
    for line in text.lines() {
        if let Some(k) = line.strip_prefix("event: ") {
            kind = k;
        } else if let Some(data) = line.strip_prefix("data: ")
            && kind == "status"
            && let Ok(v) = serde_json::from_str::<Value>(data)
        {
            out.push(v["status"].as_str().unwrap_or_default().to_string());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_jobs_stream_sends_its_one_status_and_closes() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let demo = admin.demo_dataset().await?;
    let done = admin.submit(tiny_job(demo, 2)).await?;
    admin.wait_job(done, 300, |j| j["status"] == "completed").await?;

    let (status, mut stream) = open(&admin, &format!("/api/jobs/{done}/events")).await?;
    assert_eq!(status, StatusCode::OK);
    let text = read_to_end(&mut stream, 5).await?;
    assert_eq!(statuses(&text), ["completed"], "{text}");
    assert!(!text.contains("event: metric"), "{text}");
    assert_eq!(app.state.watchers().open(), 0, "a closed stream keeps no place");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_watchers_all_close_within_two_seconds_of_the_cancel() -> anyhow::Result<()> {
    let app = TestApp::with_config(|c| c.max_streams_per_user = 256).await?;
    let admin = app.admin().await?;
    let demo = admin.demo_dataset().await?;
    let long = admin.submit(tiny_job(demo, 100_000)).await?;
    admin.wait_job(long, 300, |j| j["status"] == "running").await?;

    let path = format!("/api/jobs/{long}/events");
    let mut watchers = Vec::new();
    for _ in 0..200 {
        let (status, mut stream) = open(&admin, &path).await?;
        assert_eq!(status, StatusCode::OK);
        // The first status says the stream is subscribed.
        read_until(&mut stream, "event: status", 30).await?;
        watchers.push(tokio::spawn(async move {
            let text = read_to_end(&mut stream, 60).await?;
            anyhow::Ok((Instant::now(), statuses(&text)))
        }));
    }
    assert_eq!(app.state.watchers().open(), 200);

    let cancelled_at = Instant::now();
    let reply = admin.post(&format!("/api/jobs/{long}/cancel"), json!({})).await?;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    let mut last = Duration::ZERO;
    for watcher in watchers {
        let (closed_at, seen) = watcher.await??;
        assert_eq!(seen.last().map(String::as_str), Some("cancelled"), "{seen:?}");
        last = last.max(closed_at - cancelled_at);
    }
    assert!(last <= Duration::from_secs(2), "the last stream closed {last:?} after the cancel");
    assert_eq!(app.state.watchers().open(), 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_streams_are_capped_per_user_and_in_all_with_a_429() -> anyhow::Result<()> {
    let app = TestApp::with_config(|c| {
        c.max_streams_per_user = 2;
        c.max_streams = 3;
    })
    .await?;
    let admin = app.admin().await?;
    let bob = app.user(&admin, "bob").await?;
    let demo = admin.demo_dataset().await?;
    let long = admin.submit(tiny_job(demo, 100_000)).await?;
    admin.wait_job(long, 300, |j| j["status"] == "running").await?;
    let mine = format!("/api/jobs/{long}/events");
    let bobs_job = bob.submit(tiny_job(bob.demo_dataset().await?, 2)).await?;
    let his = format!("/api/jobs/{bobs_job}/events");

    let (first, first_stream) = open(&admin, &mine).await?;
    let (second, _second_stream) = open(&admin, &mine).await?;
    assert_eq!((first, second), (StatusCode::OK, StatusCode::OK));
    let (status, error) = refused(&admin, &mine).await?;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(error.contains("2 live views open"), "{error}");

    // Another user still has room, up to the server's cap.
    let (his_first, _his_stream) = open(&bob, &his).await?;
    assert_eq!(his_first, StatusCode::OK);
    let (status, error) = refused(&bob, &his).await?;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(error.contains("the server has 3 live views open"), "{error}");

    // A closed stream gives its place back.
    drop(first_stream);
    let (again, _again_stream) = open(&admin, &mine).await?;
    assert_eq!(again, StatusCode::OK);

    let reply = admin.post(&format!("/api/jobs/{long}/cancel"), json!({})).await?;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    admin.wait_job(long, 120, |j| j["status"] == "cancelled").await?;
    Ok(())
}
