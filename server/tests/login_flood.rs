//! A flood of wrong-password logins against an appliance running in this process: memory stays
//! bounded, the appliance keeps answering, and a real user still logs in. A test binary of its
//! own, so the peak memory of the process is this test's alone.
//!
//! The guessers come from many addresses (as a botnet would), so only the password hasher's
//! bound stands between them and the memory: half the rounds spray names that do not exist (each
//! still costs a hash), half hammer one real account, `alice`, whose failed-login alert the
//! admins must see, while alice herself, from an address of her own, still gets in. The real
//! user is `admin`, from an address of their own, with no failures on either count, so neither
//! throttle may hold them back; they may only have to wait for a turn with the hasher, as a
//! browser would, after `Retry-After`.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes, to_bytes};
use axum::extract::connect_info::MockConnectInfo;
use axum::http::{HeaderMap, Method, Request, StatusCode, header};
use serde_json::{Value, json};
use sluice::auth::throttle::ALERT_FAILURES;
use sluice::gpus::Gpus;
use sluice::{AppState, Config, app};
use tower::ServiceExt;

const PASSWORD: &str = "correct horse battery";
/// Wrong-password logins in flight at once, per round.
const GUESSERS: usize = 128;
const MIN_ROUNDS: usize = 6;
const HEALTH_PROBES: usize = 50;
const PEAK_RSS_LIMIT_KB: u64 = 300 * 1024;
const HEALTH_P99_LIMIT: Duration = Duration::from_millis(100);

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    fn header(&self, name: header::HeaderName) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// One browser: its cookie and CSRF token.
#[derive(Clone, Default)]
struct Browser {
    cookie: Option<String>,
    csrf: Option<String>,
}

impl Browser {
    async fn send(
        &self,
        router: &Router,
        from: Option<IpAddr>,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Reply> {
        let mut request = Request::builder().method(method).uri(path);
        if let Some(cookie) = &self.cookie {
            request = request.header(header::COOKIE, format!("sluice_session={cookie}"));
        }
        if let Some(csrf) = &self.csrf {
            request = request.header("x-csrf-token", csrf);
        }
        let request = match body {
            Some(body) => request
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from(body.to_string()))?,
            None => request.body(Body::empty())?,
        };
        let router = router.clone();
        let response = match from {
            Some(ip) => router.layer(MockConnectInfo(SocketAddr::new(ip, 50000))).oneshot(request),
            None => router.oneshot(request),
        }
        .await?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = to_bytes(response.into_body(), 1 << 20).await?;
        Ok(Reply { status, headers, body })
    }

    /// Takes the cookie and CSRF token of a session reply.
    fn adopt(&mut self, reply: &Reply) {
        if let Some(token) = reply
            .header(header::SET_COOKIE)
            .and_then(|c| c.strip_prefix("sluice_session="))
            .and_then(|rest| rest.split(';').next())
        {
            self.cookie = Some(token.to_string());
        }
        if let Some(csrf) = reply.json()["csrf"].as_str() {
            self.csrf = Some(csrf.to_string());
        }
    }

    /// A browser that has loaded a page: a CSRF token, no session.
    async fn visit(router: &Router) -> anyhow::Result<Browser> {
        let mut browser = Browser::default();
        let reply = browser.send(router, None, Method::GET, "/api/session", None).await?;
        anyhow::ensure!(reply.status == StatusCode::OK, "session: {}", reply.status);
        browser.adopt(&reply);
        Ok(browser)
    }
}

fn credentials(username: &str, password: &str) -> Option<Value> {
    Some(json!({"username": username, "password": password}))
}

/// A field of `/proc/self/status` in KiB (`VmRSS`, `VmHWM`).
fn status_kib(field: &str) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no {field} in /proc/self/status"))
}

/// The address of guesser `i` in round `round`: a different one for every guess.
fn guesser_address(round: usize, i: usize) -> IpAddr {
    let [_, _, hi, lo] = u32::try_from(round * GUESSERS + i).unwrap_or(u32::MAX).to_be_bytes();
    IpAddr::V4(Ipv4Addr::new(10, 77, hi, lo))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_login_flood_keeps_memory_bounded_and_lets_the_real_user_in() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let state = AppState::open_with(Config::new(dir.path().join("data")), Gpus::none()).await?;
    sluice::start(&state).await?;
    let router = app(state.clone());

    let mut admin = Browser::visit(&router).await?;
    let setup = admin
        .send(&router, None, Method::POST, "/api/setup", credentials("admin", PASSWORD))
        .await?;
    anyhow::ensure!(setup.status == StatusCode::OK, "setup: {}", setup.status);
    admin.adopt(&setup);
    let alice = json!({"username": "alice", "password": PASSWORD, "role": "user"});
    let created = admin.send(&router, None, Method::POST, "/api/users", Some(alice)).await?;
    anyhow::ensure!(created.status == StatusCode::CREATED, "create alice: {}", created.status);

    // Sampled from a thread of its own, so a busy runtime cannot make it miss the peak.
    let stop = Arc::new(AtomicBool::new(false));
    let sampled_peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (stop, peak) = (Arc::clone(&stop), Arc::clone(&sampled_peak));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(rss) = status_kib("VmRSS") {
                    peak.fetch_max(rss, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };

    // One page load serves every guess: the attacker reuses its token.
    let guesser = Browser::visit(&router).await?;
    let flood_done = Arc::new(AtomicBool::new(false));
    let flood = {
        let (router, stop, done) = (router.clone(), Arc::clone(&stop), Arc::clone(&flood_done));
        tokio::spawn(async move {
            let mut answers: BTreeMap<u16, usize> = BTreeMap::new();
            let mut bad = Vec::new();
            let mut round = 0;
            let deadline = Instant::now() + Duration::from_secs(60);
            while (round < MIN_ROUNDS || !stop.load(Ordering::Relaxed)) && Instant::now() < deadline
            {
                let guesses: Vec<_> = (0..GUESSERS)
                    .map(|i| {
                        let (router, guesser) = (router.clone(), guesser.clone());
                        let name = if round % 2 == 0 {
                            format!("guess{round}-{i}")
                        } else {
                            "alice".into()
                        };
                        let from = Some(guesser_address(round, i));
                        tokio::spawn(async move {
                            let body = credentials(&name, "not the password");
                            guesser.send(&router, from, Method::POST, "/api/login", body).await
                        })
                    })
                    .collect();
                for guess in guesses {
                    let reply = guess.await??;
                    *answers.entry(reply.status.as_u16()).or_default() += 1;
                    let refusal = matches!(reply.status.as_u16(), 429 | 503);
                    let well_formed = reply.json()["error"].is_string()
                        && (!refusal || reply.header(header::RETRY_AFTER).is_some());
                    if !matches!(reply.status.as_u16(), 401 | 429 | 503) || !well_formed {
                        bad.push(format!("{} {:?}", reply.status, reply.body));
                    }
                }
                round += 1;
            }
            done.store(true, Ordering::Relaxed);
            anyhow::Ok((round, answers, bad))
        })
    };

    let health = {
        let router = router.clone();
        tokio::spawn(async move {
            let mut latencies = Vec::new();
            for _ in 0..HEALTH_PROBES {
                tokio::time::sleep(Duration::from_millis(20)).await;
                let start = Instant::now();
                let reply =
                    Browser::default().send(&router, None, Method::GET, "/healthz", None).await?;
                latencies.push(start.elapsed());
                anyhow::ensure!(reply.status == StatusCode::OK, "healthz: {}", reply.status);
            }
            anyhow::Ok(latencies)
        })
    };

    // The real user arrives while the flood is on and retries as the server asks.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let me = Some(IpAddr::V4(Ipv4Addr::new(192, 168, 1, 7)));
    let login_deadline = Instant::now() + Duration::from_secs(30);
    let mut waits = Vec::new();
    let logged_in = loop {
        let mut browser = Browser::visit(&router).await?;
        let reply = browser
            .send(&router, me, Method::POST, "/api/login", credentials("admin", PASSWORD))
            .await?;
        if reply.status == StatusCode::OK {
            browser.adopt(&reply);
            break Some(browser);
        }
        let retry = reply.header(header::RETRY_AFTER).and_then(|s| s.parse::<u64>().ok());
        waits.push((reply.status, retry));
        if reply.status != StatusCode::SERVICE_UNAVAILABLE || Instant::now() > login_deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_secs(retry.unwrap_or(1))).await;
    };
    let during_flood = !flood_done.load(Ordering::Relaxed);

    let mut latencies = health.await??;
    stop.store(true, Ordering::Relaxed);
    let (rounds, answers, bad) = flood.await??;
    let _ = sampler.join();
    let peak_kib = status_kib("VmHWM")?.max(sampled_peak.load(Ordering::Relaxed));

    latencies.sort();
    let p99 = latencies[(latencies.len() * 99).div_ceil(100) - 1];
    println!(
        "{rounds} rounds of {GUESSERS} guesses: answers {answers:?}; peak RSS {} MiB; \
         healthz p50 {:?} p99 {p99:?}; real user's refusals before getting in {waits:?}",
        peak_kib / 1024,
        latencies[latencies.len() / 2],
    );

    assert!(peak_kib < PEAK_RSS_LIMIT_KB, "peak RSS {} MiB", peak_kib / 1024);
    assert!(p99 < HEALTH_P99_LIMIT, "healthz p99 {p99:?}: {latencies:?}");
    assert!(bad.is_empty(), "unexpected answers: {bad:?}");
    assert!(answers.get(&503).is_some_and(|&n| n > 0), "the hasher never said busy: {answers:?}");
    // Each guess came from an address of its own: nothing had failed there, so nothing was
    // refused for having failed.
    assert!(!answers.contains_key(&429), "an address that never failed was throttled: {answers:?}");
    let admin =
        logged_in.ok_or_else(|| anyhow::anyhow!("the real user did not get in: {waits:?}"))?;
    assert!(during_flood, "the real user got in only after the flood");
    assert!(
        waits.iter().all(|(status, _)| *status == StatusCode::SERVICE_UNAVAILABLE),
        "the real user was throttled: {waits:?}"
    );
    let session = admin.send(&router, None, Method::GET, "/api/session", None).await?;
    assert_eq!(session.json()["user"]["username"], "admin");

    let users = admin.send(&router, None, Method::GET, "/api/users", None).await?.json();
    let alice = users.as_array().and_then(|all| all.iter().find(|u| u["username"] == "alice"));
    let alert = alice.map_or(Value::Null, |alice| alice["failed_logins"].clone());
    let count = alert["count"].as_u64().unwrap_or(0);
    assert!(count >= u64::from(ALERT_FAILURES), "no alert for alice: {users}");
    assert!(alert["addresses"].as_u64().is_some_and(|n| n > 1), "{alert}");
    let browser = Browser::visit(&router).await?;
    let home = Some(IpAddr::V4(Ipv4Addr::new(192, 168, 1, 8)));
    let reply = browser
        .send(&router, home, Method::POST, "/api/login", credentials("alice", PASSWORD))
        .await?;
    assert_eq!(reply.status, StatusCode::OK, "alice was kept out: {:?}", reply.body);
    Ok(())
}
