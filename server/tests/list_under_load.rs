//! `GET /api/jobs` under a busy appliance's load: one job training, fifty queued behind it and
//! two hundred live views of the running one. The list answers in a fixed number of SQL
//! statements however many jobs it shows (counted through sqlx's own statement events, by the
//! request they ran for), and its 99th-percentile time stays under a bound. Its own test binary,
//! so the timings are this test's alone and the statement counter sees only this appliance.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Method, StatusCode};
use futures_util::StreamExt;
use serde_json::Value;
use tower::ServiceExt;
use tracing::Instrument;
use tracing::span::{Attributes, Id};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

#[path = "api/common.rs"]
#[allow(dead_code)]
mod common;

use common::{Client, TestApp, tiny_job};

const QUEUED: usize = 50;
const WATCHERS: usize = 200;
const SAMPLES: usize = 200;
/// The list's 99th percentile under this load, on a two-core machine that is also training.
const P99_LIMIT: Duration = Duration::from_millis(50);

/// Statements each counted request ran, by the request's number.
fn statements() -> &'static Mutex<HashMap<u64, usize>> {
    static STATEMENTS: OnceLock<Mutex<HashMap<u64, usize>>> = OnceLock::new();
    STATEMENTS.get_or_init(Mutex::default)
}

/// The number a `counted` span carries (in its extensions).
struct RequestNo(u64);

/// Counts sqlx's statement events (target `sqlx::query`, one as each statement finishes) under a
/// span named `counted`; sqlx's SQLite worker runs each statement inside its caller's span.
struct StatementCounter;

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S>
    for StatementCounter
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if attrs.metadata().name() != "counted" {
            return;
        }
        struct Visit(Option<u64>);
        impl tracing::field::Visit for Visit {
            fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
                if field.name() == "request" {
                    self.0 = Some(value);
                }
            }
            fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
        }
        let mut visit = Visit(None);
        attrs.record(&mut visit);
        if let (Some(n), Some(span)) = (visit.0, ctx.span(id)) {
            span.extensions_mut().insert(RequestNo(n));
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, ctx: Context<'_, S>) {
        if event.metadata().target() != "sqlx::query" {
            return;
        }
        // A connection the pool opens under load sets itself up (PRAGMAs) inside the span of
        // the request that asked for it: that is the pool's work, not the request's.
        struct Pragma(bool);
        impl tracing::field::Visit for Pragma {
            fn record_str(&mut self, _: &tracing::field::Field, value: &str) {
                self.0 |= value.trim_start().to_ascii_uppercase().starts_with("PRAGMA");
            }
            fn record_debug(&mut self, _: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                let text = format!("{value:?}");
                self.0 |= text.trim_start_matches('"').to_ascii_uppercase().starts_with("PRAGMA");
            }
        }
        let mut pragma = Pragma(false);
        event.record(&mut pragma);
        if pragma.0 {
            return;
        }
        let Some(scope) = ctx.event_scope(event) else { return };
        for span in scope {
            if let Some(RequestNo(n)) = span.extensions().get::<RequestNo>() {
                *statements().lock().unwrap_or_else(|e| e.into_inner()).entry(*n).or_default() += 1;
                return;
            }
        }
    }
}

/// One `GET /api/jobs` as `client`, its statements counted: (time, jobs listed, statements).
async fn list(client: &Client) -> anyhow::Result<(Duration, usize, usize)> {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let span = tracing::info_span!("counted", request = n);
    let start = Instant::now();
    let reply = client.get("/api/jobs").instrument(span).await?;
    let took = start.elapsed();
    anyhow::ensure!(reply.status == StatusCode::OK, "list: {}", reply.text());
    let jobs = reply.json()?.as_array().map_or(0, Vec::len);
    let ran = statements().lock().unwrap_or_else(|e| e.into_inner()).remove(&n).unwrap_or(0);
    Ok((took, jobs, ran))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_job_list_under_load_runs_a_fixed_number_of_statements_and_answers_quickly()
-> anyhow::Result<()> {
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(StatementCounter))?;
    let app = TestApp::with_config(|c| {
        c.max_streams_per_user = 2 * WATCHERS;
        c.limits.max_active_jobs_per_user = 2 * QUEUED as u32;
    })
    .await?;
    let admin = app.admin().await?;
    let demo = admin.demo_dataset().await?;

    let long = admin.submit(tiny_job(demo, 1_000_000)).await?;
    admin.wait_job(long, 300, |j| j["status"] == "running").await?;
    let (_, listed, alone) = list(&admin).await?;
    assert_eq!(listed, 1);
    assert!(alone > 0, "no statement was counted: the counter sees nothing");

    for _ in 0..QUEUED {
        admin.submit(tiny_job(demo, 2)).await?;
    }
    let path = format!("/api/jobs/{long}/events");
    let mut watchers = Vec::new();
    for _ in 0..WATCHERS {
        let request = admin.builder(Method::GET, &path).body(Body::empty())?;
        let response = sluice::app(admin.state.clone()).oneshot(request).await?;
        assert_eq!(response.status(), StatusCode::OK);
        let mut stream = response.into_body().into_data_stream();
        // Each viewer reads everything, as a browser does, until the stream ends.
        watchers.push(tokio::spawn(async move { while stream.next().await.is_some() {} }));
    }

    let mut times = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let (took, listed, ran) = list(&admin).await?;
        assert_eq!(listed, 1 + QUEUED);
        assert_eq!(ran, alone, "statements for {listed} jobs against {alone} for one");
        times.push(took);
    }
    let running = admin.get(&format!("/api/jobs/{long}")).await?.json()?;
    assert_eq!(running["status"], "running", "the load held to the end: {running}");
    times.sort();
    let (p50, p99) = (times[SAMPLES / 2], times[SAMPLES * 99 / 100]);
    println!(
        "GET /api/jobs with {} jobs ({QUEUED} queued, 1 training) and {WATCHERS} live views: \
         {alone} statements a request; p50 {p50:?}, p99 {p99:?}, max {:?}",
        1 + QUEUED,
        times[SAMPLES - 1],
    );
    assert!(p99 <= P99_LIMIT, "p99 {p99:?} over {P99_LIMIT:?} (p50 {p50:?})");

    let reply = admin.post(&format!("/api/jobs/{long}/cancel"), serde_json::json!({})).await?;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    for watcher in watchers {
        tokio::time::timeout(Duration::from_secs(30), watcher).await??;
    }
    let _: Value = admin.wait_job(long, 60, |j| j["status"] == "cancelled").await?;
    Ok(())
}
