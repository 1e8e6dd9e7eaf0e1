//! Kills the real `sluice serve` process (SIGKILL, no chance to clean up) in the middle of a CPU
//! training job, starts it again on the same data directory, resumes the job, and checks that it
//! ends exactly where an uninterrupted run of the same job ends: the same weights byte for byte,
//! the same loss at every step.

#![cfg(unix)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

const PASSWORD: &str = "correct horse battery";
/// How long a whole 12-step run may take on a loaded 2-core machine (it takes about 1-2 s).
const RUN_LIMIT: Duration = Duration::from_secs(180);

/// The job both runs train. A tiny-preset step over 2 x 2 rows of 64 tokens takes about
/// 50-100 ms on the CPU, so steps 4..12 leave the test most of a second to kill the server
/// while the job is running, and its training state (saved every 3 steps) exists by then.
fn job(dataset: i64) -> Value {
    json!({
        "model": "preset:tiny", "dataset": dataset, "gpu": "cpu",
        "steps": 12, "seq_len": 64, "micro_batch": 2, "grad_accum": 2,
        "save_every": 3, "save_dtype": "f32", "seed": 5,
    })
}
const STEPS: u64 = 12;
const SAVE_EVERY: u64 = 3;

/// A `sluice` command isolated from the caller's environment.
fn sluice() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_sluice"));
    command
        .env_remove("SLUICE_ADDR")
        .env_remove("SLUICE_DATA_DIR")
        .env_remove("SLUICE_CONFIG")
        .env("RUST_LOG", "info");
    command
}

/// A running `sluice serve`, killed if a test fails before it is stopped.
struct Server {
    child: Child,
    addr: String,
    lines: mpsc::Receiver<String>,
    log: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts the server on a port the OS picks and waits for it to say where it listens.
    fn start(data_dir: &Path) -> anyhow::Result<Server> {
        let mut child = sluice()
            .args(["serve", "--addr", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        let stderr = child.stderr.take().ok_or_else(|| anyhow::anyhow!("no stderr pipe"))?;
        let (lines_tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if lines_tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut server = Server { child, addr: String::new(), lines, log: String::new() };
        server.addr = loop {
            let line = server.lines.recv_timeout(Duration::from_secs(30)).map_err(|err| {
                anyhow::anyhow!("no 'listening on' log line ({err}); log:\n{}", server.log)
            })?;
            server.log.push_str(&line);
            server.log.push('\n');
            if let Some((_, rest)) = line.split_once("listening on http://") {
                break rest.split_whitespace().next().unwrap_or_default().to_owned();
            }
        };
        Ok(server)
    }

    /// Everything the server has logged so far.
    fn log(&mut self) -> &str {
        while let Ok(line) = self.lines.try_recv() {
            self.log.push_str(&line);
            self.log.push('\n');
        }
        &self.log
    }

    /// SIGKILL: the process dies between two instructions, whatever it was doing.
    fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill()?;
        let status = self.child.wait()?;
        anyhow::ensure!(!status.success(), "the server exited cleanly ({status}) instead of dying");
        Ok(())
    }
}

/// One HTTP/1.1 exchange's answer.
struct Reply {
    status: u16,
    /// Header names lower-cased.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn json(&self) -> anyhow::Result<Value> {
        serde_json::from_slice(&self.body)
            .map_err(|e| anyhow::anyhow!("{e}: status {} body {}", self.status, self.text()))
    }

    /// The JSON body of a reply that must have `status`.
    fn expect(&self, status: u16, what: &str) -> anyhow::Result<Value> {
        anyhow::ensure!(
            self.status == status,
            "{what}: status {} body {}",
            self.status,
            self.text()
        );
        self.json()
    }
}

/// A browser-like client of one server: the session cookie and CSRF token it was given.
struct Client {
    addr: String,
    cookie: Option<String>,
    csrf: Option<String>,
}

impl Client {
    fn new(server: &Server) -> Client {
        Client { addr: server.addr.clone(), cookie: None, csrf: None }
    }

    /// One request on its own connection (`Connection: close`), read to the end.
    fn send(&self, method: &str, path: &str, body: Option<&Value>) -> anyhow::Result<Reply> {
        let mut stream = TcpStream::connect(&self.addr)?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        let body = body.map(Value::to_string).unwrap_or_default();
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n");
        if let Some(cookie) = &self.cookie {
            head.push_str(&format!("Cookie: sluice_session={cookie}\r\n"));
        }
        if let Some(csrf) = &self.csrf {
            head.push_str(&format!("x-csrf-token: {csrf}\r\n"));
        }
        if method != "GET" {
            head.push_str("Content-Type: application/json\r\n");
            head.push_str(&format!("Content-Length: {}\r\n", body.len()));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes())?;
        stream.write_all(body.as_bytes())?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw)?;
        parse_reply(&raw).map_err(|e| {
            anyhow::anyhow!("{method} {path}: {e}; reply:\n{}", String::from_utf8_lossy(&raw))
        })
    }

    fn get(&self, path: &str) -> anyhow::Result<Reply> {
        self.send("GET", path, None)
    }

    fn post(&self, path: &str, body: Value) -> anyhow::Result<Reply> {
        self.send("POST", path, Some(&body))
    }

    /// Takes the cookie and CSRF token of a session reply (`/api/session`, setup, login).
    fn adopt(&mut self, reply: &Reply) -> anyhow::Result<()> {
        let json = reply.expect(200, "session reply")?;
        if let Some(token) = reply
            .header("set-cookie")
            .and_then(|c| c.strip_prefix("sluice_session="))
            .and_then(|rest| rest.split(';').next())
        {
            self.cookie = Some(token.to_owned());
        }
        let csrf = json["csrf"].as_str().ok_or_else(|| anyhow::anyhow!("no csrf in {json}"))?;
        self.csrf = Some(csrf.to_owned());
        Ok(())
    }

    fn session(&mut self) -> anyhow::Result<()> {
        let reply = self.get("/api/session")?;
        self.adopt(&reply)
    }

    /// Creates the admin account of a fresh appliance and logs in as it.
    fn setup(&mut self) -> anyhow::Result<()> {
        self.session()?;
        let reply = self.post("/api/setup", json!({"username": "admin", "password": PASSWORD}))?;
        self.adopt(&reply)
    }

    fn login(&mut self) -> anyhow::Result<()> {
        self.session()?;
        let reply = self.post("/api/login", json!({"username": "admin", "password": PASSWORD}))?;
        self.adopt(&reply)
    }

    /// Id of the shared demo dataset.
    fn demo_dataset(&self) -> anyhow::Result<i64> {
        let list = self.get("/api/datasets")?.expect(200, "datasets")?;
        list.as_array()
            .and_then(|l| l.iter().find(|d| d["name"] == "demo-alpaca"))
            .and_then(|d| d["id"].as_i64())
            .ok_or_else(|| anyhow::anyhow!("no demo dataset in {list}"))
    }

    fn submit(&self, job: Value) -> anyhow::Result<i64> {
        let reply = self.post("/api/jobs", job)?.expect(201, "submit")?;
        reply["id"].as_i64().ok_or_else(|| anyhow::anyhow!("no id in {reply}"))
    }

    fn job(&self, id: i64) -> anyhow::Result<Value> {
        self.get(&format!("/api/jobs/{id}"))?.expect(200, "job")
    }

    /// Polls job `id` every `every` until `done` accepts it; fails after `limit` with the job,
    /// its log and the server's log.
    fn wait_job(
        &self,
        server: &mut Server,
        id: i64,
        limit: Duration,
        every: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> anyhow::Result<Value> {
        let deadline = Instant::now() + limit;
        loop {
            let job = self.job(id)?;
            if done(&job) {
                return Ok(job);
            }
            if Instant::now() > deadline {
                let log = self.get(&format!("/api/jobs/{id}/log"))?.text();
                anyhow::bail!(
                    "job {id} did not get there in {limit:?}: {job}\njob log:\n{log}\nserver log:\n{}",
                    server.log()
                );
            }
            std::thread::sleep(every);
        }
    }

    /// The job's stored metric points by step; fails if a step is there twice.
    fn metrics(&self, id: i64) -> anyhow::Result<BTreeMap<u64, Value>> {
        let points = self.get(&format!("/api/jobs/{id}/metrics"))?.expect(200, "metrics")?;
        let mut by_step = BTreeMap::new();
        for point in points.as_array().ok_or_else(|| anyhow::anyhow!("not a list: {points}"))? {
            let step = point["step"].as_u64().ok_or_else(|| anyhow::anyhow!("{point}"))?;
            anyhow::ensure!(
                by_step.insert(step, point.clone()).is_none(),
                "step {step} stored twice in {points}"
            );
        }
        Ok(by_step)
    }
}

/// Status line, headers and a `Content-Length` body (or, without one, the rest of the stream,
/// which `Connection: close` ends).
fn parse_reply(raw: &[u8]) -> anyhow::Result<Reply> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow::anyhow!("no end of headers"))?;
    let head = std::str::from_utf8(&raw[..split])?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("bad status line {status_line:?}"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let rest = &raw[split + 4..];
    let chunked = headers.iter().any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
    anyhow::ensure!(!chunked, "chunked bodies are not expected here");
    let body = match headers.iter().find(|(n, _)| n == "content-length") {
        Some((_, length)) => {
            let length: usize = length.parse()?;
            anyhow::ensure!(rest.len() >= length, "body of {} < {length} bytes", rest.len());
            rest[..length].to_vec()
        }
        None => rest.to_vec(),
    };
    Ok(Reply { status, headers, body })
}

fn run_dir(data_dir: &Path, id: i64) -> PathBuf {
    data_dir.join("runs").join(id.to_string())
}

/// The checkpoint folders of a run (`checkpoint-<step>` and `final`), by name.
fn checkpoints(run: &Path) -> anyhow::Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(run)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name == "final" || name.starts_with("checkpoint-") {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// Every `*.safetensors` file of a checkpoint folder, by name, with its bytes.
fn weights(dir: &Path) -> anyhow::Result<BTreeMap<String, Vec<u8>>> {
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let name = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
            files.insert(name, std::fs::read(&path)?);
        }
    }
    anyhow::ensure!(!files.is_empty(), "no safetensors in {}", dir.display());
    Ok(files)
}

/// Checkpoint folders `a` and `b` hold the same weight files, byte for byte.
fn assert_same_weights(a: &Path, b: &Path) -> anyhow::Result<()> {
    let (a_files, b_files) = (weights(a)?, weights(b)?);
    let names = |f: &BTreeMap<String, Vec<u8>>| f.keys().cloned().collect::<Vec<_>>();
    assert_eq!(names(&a_files), names(&b_files), "{} vs {}", a.display(), b.display());
    for (name, a_bytes) in &a_files {
        let b_bytes = &b_files[name];
        let first_diff = a_bytes.iter().zip(b_bytes).position(|(x, y)| x != y);
        assert!(
            a_bytes.len() == b_bytes.len() && first_diff.is_none(),
            "{name} differs between {} and {}: {} vs {} bytes, first different byte at {first_diff:?}",
            a.display(),
            b.display(),
            a_bytes.len(),
            b_bytes.len()
        );
    }
    Ok(())
}

/// The step of the training state saved in a run folder, if there is one.
fn saved_step(run: &Path) -> anyhow::Result<Option<u64>> {
    let path = run.join("state/trainer_state.json");
    if !path.is_file() {
        return Ok(None);
    }
    let trainer: Value = serde_json::from_slice(&std::fs::read(&path)?)?;
    Ok(trainer["step"].as_u64())
}

#[test]
fn a_job_killed_with_the_server_resumes_bit_exactly() -> anyhow::Result<()> {
    let data_dir = tempfile::tempdir()?;
    let data = data_dir.path();
    let mut server = Server::start(data)?;
    let mut client = Client::new(&server);
    client.setup()?;
    let demo = client.demo_dataset()?;

    // A: the reference, never interrupted.
    let started = Instant::now();
    let a = client.submit(job(demo))?;
    let poll = Duration::from_millis(50);
    client.wait_job(&mut server, a, RUN_LIMIT, poll, |j| j["status"] == "completed")?;
    eprintln!("job A: {STEPS} steps in {:.2} s", started.elapsed().as_secs_f64());

    // B: the same job, killed with the server once a checkpoint and the state exist. Polled
    // fast so the kill lands while it is still running.
    let b = client.submit(job(demo))?;
    let b_run = run_dir(data, b);
    let fast = Duration::from_millis(10);
    let running = client.wait_job(&mut server, b, RUN_LIMIT, fast, |j| {
        j["status"] != "queued" && (j["status"] != "running" || j["step"].as_u64() >= Some(4))
    })?;
    anyhow::ensure!(
        running["status"] == "running",
        "job B was no longer running at step 4 ({running}): make the job longer so the kill \
         lands mid-run; server log:\n{}",
        server.log()
    );
    anyhow::ensure!(
        saved_step(&b_run)?.is_some(),
        "no {}/state/trainer_state.json at {running}",
        b_run.display()
    );
    server.kill()?;
    let killed_at = running["step"].as_u64().unwrap_or_default();
    let saved = saved_step(&b_run)?
        .ok_or_else(|| anyhow::anyhow!("the kill left no training state in {}", b_run.display()))?;
    eprintln!("job B: killed at step >= {killed_at}, training state saved after step {saved}");
    assert!(saved >= SAVE_EVERY && saved % SAVE_EVERY == 0 && saved < STEPS, "saved {saved}");

    // The restarted server finds B interrupted; resumed, B continues from its saved state.
    let mut server = Server::start(data)?;
    let mut client = Client::new(&server);
    client.login()?;
    let interrupted = client.job(b)?;
    assert_eq!(interrupted["status"], "interrupted", "{interrupted}\nlog:\n{}", server.log());
    client.post(&format!("/api/jobs/{b}/resume"), json!({}))?.expect(200, "resume")?;
    let started = Instant::now();
    client.wait_job(&mut server, b, RUN_LIMIT, poll, |j| j["status"] == "completed")?;
    eprintln!("job B: steps {}..{STEPS} in {:.2} s", saved + 1, started.elapsed().as_secs_f64());
    let log = client.get(&format!("/api/jobs/{b}/log"))?.text();
    assert!(log.contains(&format!("continuing exactly after step {saved}")), "{log}");

    // Every checkpoint B ended up with, `final` included, equals A's byte for byte.
    let a_run = run_dir(data, a);
    let names = checkpoints(&a_run)?;
    assert_eq!(names, checkpoints(&b_run)?, "checkpoint folders of A and B");
    assert!(names.contains(&"final".to_owned()), "{names:?}");
    for name in &names {
        assert_same_weights(&a_run.join(name), &b_run.join(name))?;
    }

    // B's history has every step once, each with A's loss exactly.
    let (a_points, b_points) = (client.metrics(a)?, client.metrics(b)?);
    let every_step: Vec<u64> = (1..=STEPS).collect();
    assert_eq!(a_points.keys().copied().collect::<Vec<_>>(), every_step, "A's steps");
    assert_eq!(b_points.keys().copied().collect::<Vec<_>>(), every_step, "B's steps");
    for (step, a_point) in &a_points {
        let b_point = &b_points[step];
        let (a_loss, b_loss) = (a_point["loss"].as_f64(), b_point["loss"].as_f64());
        assert!(a_loss.is_some(), "step {step}: no loss in {a_point}");
        assert_eq!(
            a_loss.map(f64::to_bits),
            b_loss.map(f64::to_bits),
            "step {step}: loss {a_loss:?} vs {b_loss:?}"
        );
        assert_eq!(a_point["grad_norm"], b_point["grad_norm"], "step {step}: grad norm");
    }
    Ok(())
}
