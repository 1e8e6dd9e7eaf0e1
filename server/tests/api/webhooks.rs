//! Webhooks: a real HTTP server on the loopback receives the POST a job's end sends; retries,
//! failures and the latest delivery's result as the account page shows it.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::routing::post;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::common::{Client, TestApp, tiny_job};

/// A local receiver: records every POST to `/hook`, answering with the queued statuses first
/// and 200 after them.
struct Receiver {
    url: String,
    posts: mpsc::UnboundedReceiver<(HeaderMap, Value)>,
    server: tokio::task::JoinHandle<()>,
}

#[derive(Clone)]
struct Hook {
    statuses: Arc<Mutex<VecDeque<u16>>>,
    posts: mpsc::UnboundedSender<(HeaderMap, Value)>,
}

async fn hook(State(hook): State<Hook>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let json = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let _ = hook.posts.send((headers, json));
    let next = hook.statuses.lock().map(|mut s| s.pop_front()).ok().flatten();
    StatusCode::from_u16(next.unwrap_or(200)).unwrap_or(StatusCode::OK)
}

impl Receiver {
    async fn start(statuses: &[u16]) -> anyhow::Result<Receiver> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}/hook", listener.local_addr()?);
        let (tx, posts) = mpsc::unbounded_channel();
        let state =
            Hook { statuses: Arc::new(Mutex::new(statuses.iter().copied().collect())), posts: tx };
        let app = Router::new().route("/hook", post(hook)).with_state(state);
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Receiver { url, posts, server })
    }

    /// The next POST, waiting at most `secs`.
    async fn next(&mut self, secs: u64) -> anyhow::Result<(HeaderMap, Value)> {
        tokio::time::timeout(Duration::from_secs(secs), self.posts.recv())
            .await
            .map_err(|_| anyhow::anyhow!("no webhook POST within {secs} s"))?
            .ok_or_else(|| anyhow::anyhow!("the receiver stopped"))
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn set_hook(client: &Client, url: &str) -> anyhow::Result<Value> {
    let request = client
        .builder(axum::http::Method::PUT, "/api/account/webhook")
        .header(header::CONTENT_TYPE, "application/json")
        .body(axum::body::Body::from(json!({ "url": url }).to_string()))?;
    let reply = client.send(request).await?;
    anyhow::ensure!(reply.status == StatusCode::OK, "set webhook: {}", reply.text());
    reply.json()
}

/// The account's webhook once its latest delivery is about `job` (`None`: a test).
async fn wait_delivery(client: &Client, job: Option<i64>, secs: u64) -> anyhow::Result<Value> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let hook = client.get("/api/account/webhook").await?.json()?["webhook"].clone();
        if hook["last_at"].is_i64() && hook["last_job_id"].as_i64() == job {
            return Ok(hook);
        }
        anyhow::ensure!(Instant::now() < deadline, "no delivery recorded in {secs} s: {hook}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_job_is_posted_to_its_owners_webhook() -> anyhow::Result<()> {
    let app =
        TestApp::with_config(|c| c.public_url = Some("https://sluice.example".into())).await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let mut receiver = Receiver::start(&[]).await?;
    let set = set_hook(&alice, &receiver.url).await?;
    assert_eq!(set["webhook"]["url"], json!(receiver.url), "{set}");
    assert_eq!(set["webhook"]["last_at"], Value::Null, "{set}");

    // The admin's job is not alice's: her hook stays quiet for it.
    let demo = admin.demo_dataset().await?;
    let other = admin.submit(tiny_job(demo, 1)).await?;
    admin.wait_job(other, 300, |j| j["status"] == "completed").await?;

    let id = alice.submit(tiny_job(demo, 3)).await?;
    let done = alice.wait_job(id, 300, |j| j["status"] == "completed").await?;
    let (headers, body) = receiver.next(30).await?;
    assert_eq!(headers[header::CONTENT_TYPE], "application/json");
    assert_eq!(body["event"], "job_ended", "{body}");
    assert_eq!(body["id"], id, "only alice's job reaches her hook: {body}");
    assert_eq!(body["status"], "completed", "{body}");
    assert_eq!(body["owner"], "alice", "{body}");
    assert_eq!(body["step"], 3, "{body}");
    assert_eq!(body["model"], "preset:tiny", "{body}");
    assert_eq!(body["url"], format!("https://sluice.example/jobs/{id}"), "{body}");
    assert_eq!(body["name"], format!("job {id}"), "an unnamed job: {body}");
    assert!(body["duration_s"].as_f64().is_some_and(|d| d >= 0.0), "{body}");
    let metrics = alice.get(&format!("/api/jobs/{id}/metrics")).await?.json()?;
    let last = metrics.as_array().and_then(|m| m.last()).cloned().unwrap_or_default();
    // The metrics history keeps five significant digits (it is sent whole to every page).
    let (sent, shown) = (body["final_loss"].as_f64(), last["loss"].as_f64());
    assert!(
        sent.zip(shown).is_some_and(|(a, b)| (a - b).abs() <= 1e-4 * b.abs()),
        "the last step's loss: {body} {last}"
    );
    assert!(done["finished_at"].is_i64(), "{done}");

    let hook = wait_delivery(&alice, Some(id), 30).await?;
    assert_eq!(hook["last_ok"], true, "{hook}");
    assert_eq!(hook["last_result"], "HTTP 200", "{hook}");
    assert!(receiver.posts.try_recv().is_err(), "one POST for one job");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_retry_and_failures_are_shown() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let demo = admin.demo_dataset().await?;

    // Two server errors, then a success: three posts, delivered.
    let mut flaky = Receiver::start(&[503, 500]).await?;
    set_hook(&admin, &flaky.url).await?;
    let id = admin.submit(tiny_job(demo, 1)).await?;
    admin.wait_job(id, 300, |j| j["status"] == "completed").await?;
    for attempt in 0..3 {
        let (_, body) = flaky.next(30).await?;
        assert_eq!(body["id"], id, "attempt {attempt}: {body}");
    }
    let hook = wait_delivery(&admin, Some(id), 30).await?;
    assert_eq!(
        (hook["last_ok"].clone(), hook["last_result"].clone()),
        (json!(true), json!("HTTP 200"))
    );

    // A 4xx is the receiver's answer: no retry.
    let mut gone = Receiver::start(&[410]).await?;
    set_hook(&admin, &gone.url).await?;
    let id = admin.submit(tiny_job(demo, 1)).await?;
    admin.wait_job(id, 300, |j| j["status"] == "completed").await?;
    gone.next(30).await?;
    let hook = wait_delivery(&admin, Some(id), 30).await?;
    assert_eq!(
        (hook["last_ok"].clone(), hook["last_result"].clone()),
        (json!(false), json!("HTTP 410"))
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(gone.posts.try_recv().is_err(), "a 410 was retried");

    // Nobody listening: a failure, at once for a test delivery (one attempt).
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        format!("http://{}/hook", listener.local_addr()?)
    };
    set_hook(&admin, &closed).await?;
    let test = admin.post("/api/account/webhook/test", json!({})).await?.json()?;
    assert_eq!(test["ok"], false, "{test}");
    assert!(test["result"].as_str().is_some_and(|r| r.starts_with("cannot connect")), "{test}");

    // A receiver that never answers: each attempt times out, and the queue goes on meanwhile.
    let silent = std::net::TcpListener::bind("127.0.0.1:0")?;
    set_hook(&admin, &format!("http://{}/hook", silent.local_addr()?)).await?;
    let id = admin.submit(tiny_job(demo, 1)).await?;
    admin.wait_job(id, 300, |j| j["status"] == "completed").await?;
    let ended = Instant::now();
    let next = admin.submit(tiny_job(demo, 1)).await?;
    admin.wait_job(next, 300, |j| j["status"] == "completed").await?;
    let queue_time = ended.elapsed();
    let hook = wait_delivery(&admin, Some(next), 90).await?;
    assert_eq!(hook["last_ok"], false, "{hook}");
    assert_eq!(hook["last_result"], "no answer within 5 s", "{hook}");
    // Three attempts of 5 s with pauses of 1 s and 4 s: 20 s before the outcome was stored,
    // while the next job had long finished.
    assert!(ended.elapsed() >= Duration::from_secs(19), "no retries: {:?}", ended.elapsed());
    assert!(
        queue_time < Duration::from_secs(15),
        "the queue waited for the webhook: {queue_time:?}"
    );
    drop(silent);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_jobs_are_posted_and_the_webhook_is_checked_tested_and_removed()
-> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let demo = admin.demo_dataset().await?;
    assert_eq!(admin.get("/api/account/webhook").await?.json()?, json!({"webhook": null}));
    let test = admin.post("/api/account/webhook/test", json!({})).await?;
    assert_eq!(test.status, StatusCode::CONFLICT, "{}", test.text());

    for (url, says) in [
        ("ftp://example.com/x", "https:// or http://"),
        ("example.com/hook", "is not a URL"),
        ("https://user:secret@example.com/", "user name or password"),
    ] {
        let request = admin
            .builder(axum::http::Method::PUT, "/api/account/webhook")
            .header(header::CONTENT_TYPE, "application/json")
            .body(axum::body::Body::from(json!({ "url": url }).to_string()))?;
        let reply = admin.send(request).await?;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{url}: {}", reply.text());
        assert!(
            reply.error().starts_with("url: ") && reply.error().contains(says),
            "{url}: {}",
            reply.text()
        );
    }
    let long = format!("https://example.com/{}", "a".repeat(3000));
    let request = admin
        .builder(axum::http::Method::PUT, "/api/account/webhook")
        .header(header::CONTENT_TYPE, "application/json")
        .body(axum::body::Body::from(json!({ "url": long }).to_string()))?;
    assert_eq!(admin.send(request).await?.status, StatusCode::BAD_REQUEST);
    assert_eq!(admin.get("/api/account/webhook").await?.json()?, json!({"webhook": null}));

    let mut receiver = Receiver::start(&[]).await?;
    set_hook(&admin, &receiver.url).await?;
    let test = admin.post("/api/account/webhook/test", json!({})).await?.json()?;
    assert_eq!(
        (test["ok"].clone(), test["result"].clone()),
        (json!(true), json!("HTTP 200")),
        "{test}"
    );
    let (_, body) = receiver.next(10).await?;
    assert_eq!(body["event"], "test", "{body}");
    assert_eq!(test["webhook"]["last_job_id"], Value::Null, "{test}");

    // A cancelled job is announced too, with the loss of its last step.
    let id = admin.submit(tiny_job(demo, 100_000)).await?;
    admin.wait_job(id, 300, |j| j["step"].as_i64().is_some_and(|s| s >= 2)).await?;
    let cancel = admin.post(&format!("/api/jobs/{id}/cancel"), json!({})).await?;
    assert!(cancel.status.is_success(), "{}", cancel.text());
    admin.wait_job(id, 300, |j| j["status"] == "cancelled").await?;
    let (_, body) = receiver.next(30).await?;
    assert_eq!(
        (body["id"].clone(), body["status"].clone()),
        (json!(id), json!("cancelled")),
        "{body}"
    );
    assert!(body["final_loss"].as_f64().is_some_and(f64::is_finite), "{body}");

    // Removed: nothing is sent any more.
    let removed = set_hook(&admin, "").await?;
    assert_eq!(removed, json!({"webhook": null}));
    let id = admin.submit(tiny_job(demo, 1)).await?;
    admin.wait_job(id, 300, |j| j["status"] == "completed").await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(receiver.posts.try_recv().is_err(), "a removed webhook was called");
    Ok(())
}
