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
use crate::store::jobs as store;

pub(crate) fn router() -> Router<AppState> {
    Router::new().route("/metrics", get(metrics))
}

async fn metrics(State(state): State<AppState>) -> ApiResult<impl IntoResponse> {
    let (queued, running) = store::queue_counts(state.pool()).await?;
    let rates = store::running_rates(state.pool()).await?;
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
    for (job, rate) in &rates {
        if let Some(value) = rate {
            let _ = writeln!(out, "sluice_tokens_per_second{{job=\"{job}\"}} {value}");
        }
    }
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], out))
}
