//! Webhooks: a real HTTP server on the loopback (allowed by name, as an admin allows a
//! department's relay) receives the POST a job's end sends; retries, failures and the latest
//! delivery's result as the account page shows it, which says delivered or failed and nothing
//! of what answered. Targets on this machine or a private network are refused in every
//! notation, by name (`localhost`) too, and a redirect is never followed.

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

const DELIVERED: &str = "delivered";
const FAILED: &str = "failed: the receiver could not be reached or did not accept it";
const REFUSED: &str = "webhooks go only to public addresses, not to this machine or a private \
                       network (an administrator can allow a named host)";

/// An appliance whose admin allows webhooks to `hosts`.
async fn allowing(hosts: &[&str]) -> anyhow::Result<TestApp> {
    let hosts: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
    TestApp::with_config(move |c| c.webhook_private_hosts = hosts).await
}

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
    let app = TestApp::with_config(|c| {
        c.public_url = Some("https://sluice.example".into());
        c.webhook_private_hosts = vec!["127.0.0.1".into()];
    })
    .await?;
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
    assert_eq!(hook["last_result"], DELIVERED, "{hook}");
    assert!(receiver.posts.try_recv().is_err(), "one POST for one job");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_retry_and_failures_are_shown() -> anyhow::Result<()> {
    let app = allowing(&["127.0.0.1"]).await?;
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
        (json!(true), json!(DELIVERED))
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
        (json!(false), json!(FAILED))
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
    assert_eq!(test["result"], FAILED, "connection refused is not said: {test}");

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
    assert_eq!(hook["last_result"], FAILED, "{hook}");
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
    let app = allowing(&["127.0.0.1"]).await?;
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
        (json!(true), json!(DELIVERED)),
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

async fn put_hook(client: &Client, url: &str) -> anyhow::Result<crate::common::Reply> {
    let request = client
        .builder(axum::http::Method::PUT, "/api/account/webhook")
        .header(header::CONTENT_TYPE, "application/json")
        .body(axum::body::Body::from(json!({ "url": url }).to_string()))?;
    client.send(request).await
}

/// A listener that counts the connections made to it.
struct Listener {
    port: u16,
    connections: Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Listener {
    async fn start() -> anyhow::Result<Listener> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = Arc::clone(&connections);
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                drop(stream);
            }
        });
        Ok(Listener { port, connections, task })
    }

    fn count(&self) -> usize {
        self.connections.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_on_this_machine_or_a_private_network_are_refused_in_every_notation()
-> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let listener = Listener::start().await?;
    let port = listener.port;
    let urls = [
        format!("http://127.0.0.1:{port}/hook"),
        format!("http://127.1.2.3:{port}/"),
        format!("http://2130706433:{port}/"),
        format!("http://0x7f.1:{port}/"),
        format!("http://0177.0.0.1:{port}/"),
        format!("http://localhost:{port}/hook"),
        format!("http://LOCALHOST:{port}/hook"),
        format!("http://[::1]:{port}/"),
        format!("http://[::ffff:127.0.0.1]:{port}/"),
        format!("http://0.0.0.0:{port}/"),
        format!("http://0:{port}/"),
        format!("http://[::]:{port}/"),
        "http://169.254.169.254/latest/meta-data/".into(),
        "http://[::ffff:169.254.169.254]/".into(),
        "http://[fe80::1]/".into(),
        "http://10.0.0.1/".into(),
        "http://172.16.5.4/".into(),
        "http://192.168.1.1/".into(),
        "http://100.64.0.1/".into(),
        "http://[fd12:3456::1]/".into(),
        "http://[fc00::1]/".into(),
        "http://224.0.0.1/".into(),
        "http://[ff02::1]/".into(),
        "http://255.255.255.255/".into(),
        "https://[64:ff9b::7f00:1]/".into(),
    ];
    for url in &urls {
        let reply = put_hook(&admin, url).await?;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{url}: {}", reply.text());
        assert_eq!(reply.error(), format!("url: {REFUSED}"), "{url}");
    }
    assert_eq!(admin.get("/api/account/webhook").await?.json()?, json!({"webhook": null}));
    // A public address is taken (nothing is sent to it here).
    let public = put_hook(&admin, "https://93.184.215.14/hook").await?;
    assert_eq!(public.status, StatusCode::OK, "{}", public.text());
    assert_eq!(listener.count(), 0, "something connected to the loopback listener");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_private_host_is_allowed_and_no_other() -> anyhow::Result<()> {
    let app = allowing(&["localhost"]).await?;
    let admin = app.admin().await?;
    let mut receiver = Receiver::start(&[]).await?;
    let port = receiver.url.rsplit(':').next().and_then(|p| p.split('/').next()).unwrap_or("");
    let named = format!("http://localhost:{port}/hook");
    set_hook(&admin, &named).await?;
    let test = admin.post("/api/account/webhook/test", json!({})).await?.json()?;
    assert_eq!((test["ok"].clone(), test["result"].clone()), (json!(true), json!(DELIVERED)));
    let (_, body) = receiver.next(10).await?;
    assert_eq!(body["event"], "test", "{body}");

    // The same receiver by its address is not the name the admin allowed.
    let reply = put_hook(&admin, &receiver.url).await?;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text());
    assert_eq!(reply.error(), format!("url: {REFUSED}"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_is_not_followed() -> anyhow::Result<()> {
    let app = allowing(&["127.0.0.1"]).await?;
    let admin = app.admin().await?;
    // The second hop: the loopback by a name no admin allowed, and then by the allowed address.
    let target = Listener::start().await?;
    for second in
        [format!("http://localhost:{}/", target.port), format!("http://127.0.0.1:{}/", target.port)]
    {
        let (posts, mut posted) = mpsc::unbounded_channel::<()>();
        let redirect = Router::new().route(
            "/hook",
            post(move || {
                let _ = posts.send(());
                let second = second.clone();
                async move { (StatusCode::FOUND, [(header::LOCATION, second)]) }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let first = format!("http://{}/hook", listener.local_addr()?);
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, redirect).await;
        });
        set_hook(&admin, &first).await?;
        let test = admin.post("/api/account/webhook/test", json!({})).await?.json()?;
        server.abort();
        assert_eq!((test["ok"].clone(), test["result"].clone()), (json!(false), json!(FAILED)));
        assert!(posted.try_recv().is_ok(), "the first hop was not posted to");
    }
    assert_eq!(target.count(), 0, "a redirect was followed");
    Ok(())
}
