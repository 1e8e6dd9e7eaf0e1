//! A fresh appliance per test (temp data dir, fresh SQLite) and clients with their own cookie.

use std::time::{Duration, Instant};

use axum::body::{Body, Bytes, to_bytes};
use axum::http::{HeaderMap, Method, Request, StatusCode, header};
use serde_json::{Value, json};
use sluice::gpus::Gpus;
use sluice::{AppState, Config, app};
use tower::ServiceExt;

pub const PASSWORD: &str = "correct horse battery";

pub struct TestApp {
    pub state: AppState,
    _dir: tempfile::TempDir,
}

impl TestApp {
    pub async fn new() -> anyhow::Result<TestApp> {
        Self::with_config(|_| {}).await
    }

    pub async fn with_config(edit: impl FnOnce(&mut Config)) -> anyhow::Result<TestApp> {
        let dir = tempfile::tempdir()?;
        let mut config = Config::new(dir.path().join("data"));
        edit(&mut config);
        let state = AppState::open_with(config, Gpus::none()).await?;
        sluice::start(&state).await?;
        Ok(TestApp { state, _dir: dir })
    }

    /// Reopens the same data directory, as a server restart does.
    pub async fn restart(&self) -> anyhow::Result<AppState> {
        let config = self.state.config().clone();
        let state = AppState::open_with(config, Gpus::none()).await?;
        sluice::start(&state).await?;
        Ok(state)
    }

    pub fn client(&self) -> Client {
        Client { state: self.state.clone(), cookie: None, csrf: None }
    }

    /// A client logged in as the admin created through setup.
    pub async fn admin(&self) -> anyhow::Result<Client> {
        let mut client = self.client();
        client.session().await?;
        let reply =
            client.post("/api/setup", json!({"username": "admin", "password": PASSWORD})).await?;
        anyhow::ensure!(reply.status == StatusCode::OK, "setup: {}", reply.text());
        client.adopt(&reply)?;
        Ok(client)
    }

    /// A new plain user created by `admin`, logged in.
    pub async fn user(&self, admin: &Client, name: &str) -> anyhow::Result<Client> {
        let reply = admin
            .post("/api/users", json!({"username": name, "password": PASSWORD, "role": "user"}))
            .await?;
        anyhow::ensure!(reply.status == StatusCode::CREATED, "create user: {}", reply.text());
        let mut client = self.client();
        client.login(name, PASSWORD).await?;
        Ok(client)
    }
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> anyhow::Result<Value> {
        serde_json::from_slice(&self.body)
            .map_err(|e| anyhow::anyhow!("{e}: status {} body {}", self.status, self.text()))
    }

    pub fn header(&self, name: header::HeaderName) -> String {
        self.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string()
    }

    /// The `error` message of an API error body.
    pub fn error(&self) -> String {
        self.json().ok().and_then(|v| v["error"].as_str().map(str::to_string)).unwrap_or_default()
    }
}

#[derive(Clone)]
pub struct Client {
    pub state: AppState,
    pub cookie: Option<String>,
    pub csrf: Option<String>,
}

impl Client {
    pub async fn send(&self, request: Request<Body>) -> anyhow::Result<Reply> {
        let response = app(self.state.clone()).oneshot(request).await?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = to_bytes(response.into_body(), 64 << 20).await?;
        Ok(Reply { status, headers, body })
    }

    pub fn builder(&self, method: Method, path: &str) -> axum::http::request::Builder {
        let mut builder = Request::builder().method(method.clone()).uri(path);
        if let Some(cookie) = &self.cookie {
            builder = builder.header(header::COOKIE, format!("sluice_session={cookie}"));
        }
        if method != Method::GET
            && let Some(csrf) = &self.csrf
        {
            builder = builder.header("x-csrf-token", csrf);
        }
        builder
    }

    pub async fn get(&self, path: &str) -> anyhow::Result<Reply> {
        self.send(self.builder(Method::GET, path).body(Body::empty())?).await
    }

    pub async fn post(&self, path: &str, body: Value) -> anyhow::Result<Reply> {
        let request = self
            .builder(Method::POST, path)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string()))?;
        self.send(request).await
    }

    pub async fn put(&self, path: &str, body: Value) -> anyhow::Result<Reply> {
        let request = self
            .builder(Method::PUT, path)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string()))?;
        self.send(request).await
    }

    pub async fn delete(&self, path: &str) -> anyhow::Result<Reply> {
        self.send(self.builder(Method::DELETE, path).body(Body::empty())?).await
    }

    /// Takes the cookie and CSRF token of a session reply.
    pub fn adopt(&mut self, reply: &Reply) -> anyhow::Result<Value> {
        let json = reply.json()?;
        let set_cookie = reply.header(header::SET_COOKIE);
        if let Some(token) =
            set_cookie.strip_prefix("sluice_session=").and_then(|rest| rest.split(';').next())
        {
            self.cookie = Some(token.to_string());
        }
        if let Some(csrf) = json["csrf"].as_str() {
            self.csrf = Some(csrf.to_string());
        }
        Ok(json)
    }

    pub async fn session(&mut self) -> anyhow::Result<Value> {
        let reply = self.get("/api/session").await?;
        anyhow::ensure!(reply.status == StatusCode::OK, "session: {}", reply.text());
        self.adopt(&reply)
    }

    pub async fn login(&mut self, username: &str, password: &str) -> anyhow::Result<Reply> {
        if self.csrf.is_none() {
            self.session().await?;
        }
        let reply =
            self.post("/api/login", json!({"username": username, "password": password})).await?;
        if reply.status == StatusCode::OK {
            self.adopt(&reply)?;
        }
        Ok(reply)
    }

    /// A multipart dataset upload of one file (and a `name` field when given).
    pub async fn upload(
        &self,
        file_name: &str,
        bytes: &[u8],
        name: Option<&str>,
    ) -> anyhow::Result<Reply> {
        self.upload_to("/api/datasets", file_name, bytes, name).await
    }

    /// A multipart upload of one file (and a `name` field when given) to `path`.
    pub async fn upload_to(
        &self,
        path: &str,
        file_name: &str,
        bytes: &[u8],
        name: Option<&str>,
    ) -> anyhow::Result<Reply> {
        let boundary = "sluice-test-boundary";
        let mut body = Vec::new();
        if let Some(name) = name {
            body.extend_from_slice(
                format!("--{boundary}\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\n{name}\r\n")
                    .as_bytes(),
            );
        }
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{file_name}\"\r\n\
                 Content-Type: application/octet-stream\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(bytes);
        body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        let request = self
            .builder(Method::POST, path)
            .header(header::CONTENT_TYPE, format!("multipart/form-data; boundary={boundary}"))
            .body(Body::from(body))?;
        self.send(request).await
    }

    /// Id of the shared demo dataset.
    pub async fn demo_dataset(&self) -> anyhow::Result<i64> {
        let list = self.get("/api/datasets").await?.json()?;
        list.as_array()
            .and_then(|l| l.iter().find(|d| d["name"] == "demo-alpaca"))
            .and_then(|d| d["id"].as_i64())
            .ok_or_else(|| anyhow::anyhow!("no demo dataset in {list}"))
    }

    /// Submits a job and returns its id.
    pub async fn submit(&self, job: Value) -> anyhow::Result<i64> {
        let reply = self.post("/api/jobs", job).await?;
        anyhow::ensure!(
            reply.status == StatusCode::CREATED,
            "submit: {} {}",
            reply.status,
            reply.text()
        );
        reply.json()?["id"].as_i64().ok_or_else(|| anyhow::anyhow!("no id"))
    }

    /// Polls the job until `done` accepts it (at most `secs`).
    pub async fn wait_job(
        &self,
        id: i64,
        secs: u64,
        done: impl Fn(&Value) -> bool,
    ) -> anyhow::Result<Value> {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let job = self.get(&format!("/api/jobs/{id}")).await?.json()?;
            if done(&job) {
                return Ok(job);
            }
            if Instant::now() > deadline {
                let log = self.get(&format!("/api/jobs/{id}/log")).await?.text();
                anyhow::bail!("job {id} did not get there in {secs} s: {job}\nlog:\n{log}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A tiny-preset CPU job on `dataset`.
pub fn tiny_job(dataset: i64, steps: u64) -> Value {
    json!({
        "model": "preset:tiny", "dataset": dataset, "gpu": "cpu",
        "steps": steps, "seq_len": 64, "micro_batch": 1, "grad_accum": 1,
    })
}
