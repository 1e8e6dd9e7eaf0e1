//! A dataset of a gigabyte goes through the API, uploaded and then previewed, in a process whose
//! peak resident memory stays far below the file's size: the upload streams to disk, and the lint
//! and the preview read the file record by record. Its own test binary, so the peak it reads is
//! this test's alone. A multipart `name` field of 256 MiB streamed as fast as the server reads
//! is refused with the process still far below its size.

use std::path::Path;
use std::time::Instant;

use axum::body::{Body, Bytes, to_bytes};
use axum::http::{Method, Request, StatusCode, header};
use futures_util::StreamExt;
use serde_json::{Value, json};
use sluice::gpus::Gpus;
use sluice::{AppState, Config, app};
use tower::ServiceExt;

/// The dataset's size: a real gigabyte.
const DATASET_BYTES: u64 = 1_000_000_000;
/// What the whole process may reach, the server's work and this test's own together.
const PEAK_RSS_BYTES: u64 = 300_000_000;

/// A logged-in client of an in-process appliance.
struct Client {
    state: AppState,
    cookie: String,
    csrf: String,
}

impl Client {
    async fn send(&self, request: axum::http::request::Builder, body: Body) -> (StatusCode, Value) {
        let request = request
            .header(header::COOKIE, format!("sluice_session={}", self.cookie))
            .header("x-csrf-token", &self.csrf)
            .body(body)
            .expect("request");
        let response = app(self.state.clone()).oneshot(request).await.expect("response");
        let status = response.status();
        let body = to_bytes(response.into_body(), 16 << 20).await.expect("body");
        (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }

    /// Sets up the admin account and logs in as it.
    async fn admin(state: &AppState) -> Client {
        let session = app(state.clone())
            .oneshot(Request::get("/api/session").body(Body::empty()).expect("request"))
            .await
            .expect("session");
        let cookie = session_cookie(session.headers());
        let body = to_bytes(session.into_body(), 1 << 20).await.expect("body");
        let csrf: Value = serde_json::from_slice(&body).expect("session json");
        let mut client = Client {
            state: state.clone(),
            cookie,
            csrf: csrf["csrf"].as_str().unwrap_or_default().to_string(),
        };
        let setup = json!({"username": "admin", "password": "correct horse battery"});
        let request = Request::post("/api/setup")
            .header(header::COOKIE, format!("sluice_session={}", client.cookie))
            .header("x-csrf-token", &client.csrf)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(setup.to_string()))
            .expect("request");
        let reply = app(state.clone()).oneshot(request).await.expect("setup");
        assert_eq!(reply.status(), StatusCode::OK);
        client.cookie = session_cookie(reply.headers());
        let body = to_bytes(reply.into_body(), 1 << 20).await.expect("body");
        let json: Value = serde_json::from_slice(&body).expect("setup json");
        client.csrf = json["csrf"].as_str().unwrap_or_default().to_string();
        client
    }
}

fn session_cookie(headers: &axum::http::HeaderMap) -> String {
    let set_cookie = headers.get(header::SET_COOKIE).and_then(|v| v.to_str().ok());
    set_cookie
        .and_then(|c| c.strip_prefix("sluice_session="))
        .and_then(|rest| rest.split(';').next())
        .expect("a session cookie")
        .to_string()
}

/// Writes at least `DATASET_BYTES` of alpaca records by repeating one block of them; returns
/// the file's size and its record count.
fn write_dataset(path: &Path) -> std::io::Result<(u64, usize)> {
    use std::io::Write;
    let mut block = String::new();
    let mut per_block = 0;
    while block.len() < 1 << 20 {
        let n = per_block;
        block.push_str(&format!(
            "{{\"instruction\": \"What is {n} plus {}?\", \"input\": \"\", \
             \"output\": \"{n} plus {} is {}. Adding the two numbers digit by digit gives the \
             same result.\"}}\n",
            n % 97,
            n % 97,
            n + n % 97
        ));
        per_block += 1;
    }
    let blocks = DATASET_BYTES.div_ceil(block.len() as u64);
    let mut file = std::fs::File::create(path)?;
    for _ in 0..blocks {
        file.write_all(block.as_bytes())?;
    }
    file.sync_all()?;
    Ok((blocks * block.len() as u64, per_block * blocks as usize))
}

/// A multipart body of one file field read from disk in chunks, so no one holds the file.
async fn streamed_upload(path: &Path) -> Body {
    let boundary = "large-dataset-boundary";
    let head = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n\
         Content-Type: application/octet-stream\r\n\r\n"
    );
    let tail = format!(
        "\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\n\
         big\r\n--{boundary}--\r\n"
    );
    let file = tokio::fs::File::open(path).await.expect("dataset");
    let chunks = tokio_util::io::ReaderStream::with_capacity(file, 256 << 10);
    let frame = |text: String| futures_util::stream::once(async { Ok(Bytes::from(text)) });
    Body::from_stream(frame(head).chain(chunks).chain(frame(tail)))
}

/// The process's peak resident set (`VmHWM`), in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM");
    let kib: u64 = line.split_whitespace().nth(1).and_then(|n| n.parse().ok()).expect("a number");
    kib * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gigabyte_dataset_uploads_and_previews_in_bounded_memory() {
    let dir = tempfile::tempdir().expect("temp dir");
    let source = dir.path().join("big.jsonl");
    let started = Instant::now();
    let written = source.clone();
    let (size, records) = tokio::task::spawn_blocking(move || write_dataset(&written))
        .await
        .expect("join")
        .expect("write");
    assert!(size >= DATASET_BYTES, "{size}");
    let wrote = started.elapsed();

    let mut config = Config::new(dir.path().join("data"));
    config.max_upload_bytes = 2 << 30;
    let state = AppState::open_with(config, Gpus::none()).await.expect("open");
    sluice::start(&state).await.expect("start");
    let admin = Client::admin(&state).await;

    let started = Instant::now();
    let upload = Request::builder()
        .method(Method::POST)
        .uri("/api/datasets")
        .header(header::CONTENT_TYPE, "multipart/form-data; boundary=large-dataset-boundary");
    let (status, dataset) = admin.send(upload, streamed_upload(&source).await).await;
    assert_eq!(status, StatusCode::CREATED, "{dataset}");
    assert_eq!(dataset["name"], "big");
    assert_eq!(dataset["format"], "alpaca");
    assert_eq!(dataset["records"].as_u64(), Some(records as u64));
    assert_eq!(dataset["size_bytes"].as_u64(), Some(size));
    let uploaded = started.elapsed();
    let mut files: Vec<String> = std::fs::read_dir(state.datasets_dir())
        .expect("datasets dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files.len(), 2, "the demo and the upload, nothing temporary: {files:?}");

    // More previews at once than run at once: the rest wait their turn.
    let started = Instant::now();
    let id = dataset["id"].as_i64().expect("id");
    let previews = (0..4).map(|_| {
        let uri = format!("/api/datasets/{id}/preview?model=preset:tiny&limit=3&seq_len=64");
        admin.send(Request::get(uri), Body::empty())
    });
    for (status, preview) in futures_util::future::join_all(previews).await {
        assert_eq!(status, StatusCode::OK, "{preview}");
        assert_eq!(preview["samples"].as_array().map(Vec::len), Some(3), "{preview}");
        let stats = &preview["stats"];
        assert_eq!(stats["records"].as_u64(), Some(records as u64), "{stats}");
        assert_eq!(stats["measured"], 10_000, "{stats}");
        let counted: u64 = stats["lengths"]
            .as_array()
            .map_or(0, |b| b.iter().filter_map(|b| b["count"].as_u64()).sum());
        assert_eq!(counted, 10_000, "{stats}");
    }
    let previewed = started.elapsed();

    let peak = peak_rss();
    eprintln!(
        "{size} bytes, {records} records: written in {wrote:.1?}, uploaded and linted in \
         {uploaded:.1?}, 4 previews in {previewed:.1?}; peak RSS {:.0} MB",
        peak as f64 / 1e6
    );
    assert!(peak < PEAK_RSS_BYTES, "peak RSS {peak} bytes, over {PEAK_RSS_BYTES}");
}

/// A field other than the file, far over its 1 KiB limit, sent as fast as it can be read.
const GIANT_FIELD_BYTES: usize = 256 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_giant_name_field_is_refused_in_bounded_memory() {
    let dir = tempfile::tempdir().expect("temp dir");
    let state = AppState::open_with(Config::new(dir.path().join("data")), Gpus::none())
        .await
        .expect("open");
    sluice::start(&state).await.expect("start");
    let admin = Client::admin(&state).await;

    let boundary = "giant-field-boundary";
    let head = format!("--{boundary}\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\n");
    let chunk = Bytes::from(vec![b'a'; 64 << 10]);
    let chunks = GIANT_FIELD_BYTES / chunk.len();
    // Always ready, as a client on a fast link is: nothing here waits for the server.
    let body = futures_util::stream::once(async { Bytes::from(head) })
        .chain(futures_util::stream::iter(std::iter::repeat_n(chunk, chunks)))
        .map(Ok::<_, std::io::Error>);
    let upload = Request::builder()
        .method(Method::POST)
        .uri("/api/datasets")
        .header(header::CONTENT_TYPE, format!("multipart/form-data; boundary={boundary}"));
    let (status, reply) = admin.send(upload, Body::from_stream(body)).await;
    let peak = peak_rss();
    eprintln!(
        "a {GIANT_FIELD_BYTES}-byte name field: {status} {reply}; peak RSS {:.0} MB",
        peak as f64 / 1e6
    );
    assert_eq!(status, StatusCode::BAD_REQUEST, "{reply}");
    let error = reply["error"].as_str().unwrap_or_default();
    assert!(error.contains("\"name\" is longer than 1024 bytes"), "{reply}");
    assert!(peak < PEAK_RSS_BYTES, "peak RSS {peak} bytes, over {PEAK_RSS_BYTES}");
}
