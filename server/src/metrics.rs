//! `GET /metrics`: Prometheus text format. Unauthenticated, as scrapers expect; it shows counts,
//! device memory and job ids, no names or data.

use std::fmt::Write;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;

use crate::AppState;
use crate::error::ApiResult;

pub(crate) fn router() -> Router<AppState> {
    Router::new().route("/metrics", get(metrics))
}

#[derive(sqlx::FromRow)]
struct Rate {
    id: i64,
    tokens_per_s: Option<f64>,
}

async fn metrics(State(state): State<AppState>) -> ApiResult<impl IntoResponse> {
    let queued: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM jobs WHERE status = 'queued'")
        .fetch_one(state.pool())
        .await?;
    let running: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM jobs WHERE status = 'running'")
        .fetch_one(state.pool())
        .await?;
    let rates: Vec<Rate> = sqlx::query_as(
        "SELECT j.id, (SELECT json_extract(m.point, '$.tokens_per_s') FROM metrics m
                       WHERE m.job_id = j.id ORDER BY m.step DESC LIMIT 1) AS tokens_per_s
         FROM jobs j WHERE j.status = 'running' ORDER BY j.id",
    )
    .fetch_all(state.pool())
    .await?;
    let gpu_state = state.clone();
    let devices = tokio::task::spawn_blocking(move || gpu_state.gpus().list()).await?;

    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(out, "# HELP sluice_queue_length Jobs waiting for a device.");
    let _ = writeln!(out, "# TYPE sluice_queue_length gauge");
    let _ = writeln!(out, "sluice_queue_length {queued}");
    let _ = writeln!(out, "# HELP sluice_running_jobs Jobs training now.");
    let _ = writeln!(out, "# TYPE sluice_running_jobs gauge");
    let _ = writeln!(out, "sluice_running_jobs {running}");
    let _ = writeln!(
        out,
        "# HELP sluice_gpu_memory_used_bytes Memory in use per device (host RAM for the CPU)."
    );
    let _ = writeln!(out, "# TYPE sluice_gpu_memory_used_bytes gauge");
    for device in &devices {
        let _ = writeln!(
            out,
            "sluice_gpu_memory_used_bytes{{gpu=\"{}\"}} {}",
            device.id, device.memory_used
        );
    }
    let _ = writeln!(
        out,
        "# HELP sluice_tokens_per_second Throughput of the latest step per running job."
    );
    let _ = writeln!(out, "# TYPE sluice_tokens_per_second gauge");
    for rate in &rates {
        if let Some(value) = rate.tokens_per_s {
            let _ = writeln!(out, "sluice_tokens_per_second{{job=\"{}\"}} {value}", rate.id);
        }
    }
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], out))
}
