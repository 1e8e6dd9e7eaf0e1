//! A job's start and end, announced: a line in the server log for operators (job, user, model,
//! device; at the end the duration and the final loss or the error), and at the end a `POST`
//! to the owner's webhook, if they set one ([`crate::webhooks`]). Nothing here waits on a
//! receiver: the queue goes on at once.

use serde_json::json;
use tracing::{info, warn};

use crate::AppState;
use crate::db::now_f64;
use crate::store::jobs::{self as store, JobRow, JobStatus};

/// Logs that job `job` has started (once it is claimed and its thread is starting).
pub async fn job_started(state: &AppState, job: &JobRow) {
    let user = username(state, job.owner_id).await;
    info!(
        job = job.id,
        user = %user,
        model = %job.model,
        device = %job.device,
        step = job.step,
        "job {} started",
        job.id
    );
}

/// Logs the end of job `id` (completed, failed or cancelled, as stored) and fires its owner's
/// webhook, on a task of its own. Call it after the final status is stored.
pub fn job_ended(state: &AppState, id: i64) {
    let state = state.clone();
    tokio::spawn(async move { announce_end(&state, id).await });
}

async fn announce_end(state: &AppState, id: i64) {
    let job = match store::get(state.pool(), id).await {
        Ok(Some(job)) => job,
        Ok(None) => return,
        Err(err) => {
            warn!("job {id} ended, but it cannot be read back: {err:?}");
            return;
        }
    };
    let user = username(state, job.owner_id).await;
    let final_loss = final_loss(state, id).await;
    let duration_s = match (job.started_at, job.finished_at) {
        (Some(start), Some(end)) => Some((end as f64 - start).max(0.0)),
        (Some(start), None) => Some((now_f64() - start).max(0.0)),
        _ => None,
    };
    let duration = duration_s.map_or_else(|| "-".to_string(), |s| format!("{s:.0} s"));
    let loss = final_loss.map_or_else(|| "-".to_string(), |l| format!("{l:.4}"));
    match job.status {
        JobStatus::Failed => warn!(
            job = id,
            user = %user,
            model = %job.model,
            device = %job.device,
            duration = %duration,
            final_loss = %loss,
            error = job.error.as_deref().unwrap_or(""),
            "job {id} failed"
        ),
        status => info!(
            job = id,
            user = %user,
            model = %job.model,
            device = %job.device,
            duration = %duration,
            final_loss = %loss,
            step = job.step,
            "job {id} {status}"
        ),
    }
    // An unnamed job is "job N", as the pages call it.
    let name = Some(job.name.clone()).filter(|n| !n.trim().is_empty());
    let body = json!({
        "event": "job_ended",
        "id": id,
        "name": name.unwrap_or_else(|| format!("job {id}")),
        "status": job.status,
        "final_loss": final_loss,
        "duration_s": duration_s,
        "step": job.step,
        "total_steps": job.total_steps,
        "model": job.model,
        "device": job.device,
        "owner": user,
        "error": job.error,
        "url": job_url(state, id),
    });
    crate::webhooks::send_later(state, job.owner_id, Some(id), body);
}

/// The link to a job's page: under `public_url` when it is set, else the address the
/// appliance listens on.
pub fn job_url(state: &AppState, id: i64) -> String {
    let config = state.config();
    let base = match &config.public_url {
        Some(url) => url.clone(),
        None => {
            let scheme = if config.tls.is_some() { "https" } else { "http" };
            format!("{scheme}://{}", config.addr)
        }
    };
    format!("{}/jobs/{id}", base.trim_end_matches('/'))
}

async fn username(state: &AppState, user_id: i64) -> String {
    crate::store::users::username(state.pool(), user_id)
        .await
        .ok()
        .flatten()
        .unwrap_or_else(|| format!("user {user_id}"))
}

/// The loss of the job's last recorded step.
async fn final_loss(state: &AppState, id: i64) -> Option<f64> {
    store::final_loss(state.pool(), id).await.ok().flatten().filter(|l| l.is_finite())
}
