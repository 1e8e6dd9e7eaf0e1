//! `POST /api/plan`: the planner's verdict on a job before it is submitted (see `jobs::plan`);
//! `GET /api/job-defaults`: every job setting with its default, bounds and choices under this
//! appliance's limits, so the form copies none of them.

use axum::extract::State;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::Value;
use sluice_engine::train::{JobSettings, SettingsGuide};

use crate::AppState;
use crate::auth::CurrentUser;
use crate::error::{ApiJson, ApiResult};
use crate::jobs::plan::{Verdict, machine_memory, verdict, with_disk_tier};
use crate::jobs::request::{self, JobRequest};

pub(crate) fn router() -> Router<AppState> {
    Router::new().route("/api/plan", post(plan)).route("/api/job-defaults", get(job_defaults))
}

/// `POST /api/plan` with a job's body (the dataset may be left out): the verdict. 400 for a
/// field the engine refuses, an unknown model, dataset or device, or `moments: disk` where the
/// disk tier cannot be used.
async fn plan(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiJson(body): ApiJson<Value>,
) -> ApiResult<Json<Verdict>> {
    let resolved = request::resolve(&state, &user, JobRequest::parse(body)?).await?;
    let verdict = tokio::task::spawn_blocking(move || -> ApiResult<Verdict> {
        let (job, spec) = (&resolved.job, &resolved.model.spec);
        let memory = with_disk_tier(&state, job, spec, machine_memory(&state, &job.devices)?)?;
        Ok(verdict(job, spec, memory))
    })
    .await??;
    Ok(Json(verdict))
}

/// `GET /api/job-defaults`: the engine's settings guide under this appliance's limits.
async fn job_defaults(
    State(state): State<AppState>,
    CurrentUser(_): CurrentUser,
) -> Json<SettingsGuide> {
    Json(JobSettings::guide(&state.config().limits.engine()))
}
