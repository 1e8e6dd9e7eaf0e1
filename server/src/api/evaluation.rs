//! Task evaluation over HTTP: `GET /api/datasets/{id}/eval-sample`, what a job's evaluation
//! will compare, for the new-job form; `GET /api/jobs/{id}/answers`, a job's answers before and
//! after training, for its page. The work is `crate::evaluation`'s.

use std::str::FromStr;

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use sluice_engine::eval::EvalMetric;
use tokio::sync::Semaphore;

use crate::AppState;
use crate::auth::CurrentUser;
use crate::datasets::visible;
use crate::error::{ApiError, ApiPath, ApiQuery, ApiResult};
use crate::evaluation::{self, Answers, EvalSet, Sample};
use crate::jobs::runner;

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/api/datasets/{id}/eval-sample", get(eval_sample))
        .route("/api/jobs/{id}/answers", get(answers))
}

/// Records a sample shows at most.
const MAX_SAMPLE: usize = 10;

/// A sample reads its whole dataset (the held-out records are the last ones); two at once, as
/// previews, and a request past them waits for a place.
static SAMPLES: Semaphore = Semaphore::const_new(2);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SampleQuery {
    /// The job's `eval_metric`.
    eval_metric: String,
    /// Given: the dataset is the training data, and the sample comes from the part of it the
    /// job holds out (the job's `held_out`). Absent: the dataset is the evaluation dataset.
    held_out: Option<f64>,
    #[serde(default = "default_limit")]
    limit: usize,
}

fn default_limit() -> usize {
    3
}

/// `GET /api/datasets/{id}/eval-sample?eval_metric=M[&held_out=F][&limit=N]`: `{"metric",
/// "records", "items": [{"line", "prompt", "reference", "choices"}]}`, the first N (3) records
/// of the eval set as the job's evaluation will ask and compare them. 404 for a dataset the
/// user may not see; 400 for an unknown metric; 422 when the eval set does not suit the
/// metric, naming the setting and the record (a `choice` record without `choices`, a text
/// record with nothing to answer).
async fn eval_sample(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
    query: Result<ApiQuery<SampleQuery>, ApiError>,
) -> ApiResult<Json<Sample>> {
    // Whose dataset it is comes first: another user's answers 404 whatever the query says.
    let dataset = visible(&state, &user, id).await?;
    let ApiQuery(query) = query?;
    let metric =
        EvalMetric::from_str(&query.eval_metric).map_err(|e| ApiError::bad_request(plain(&e)))?;
    if !(1..=MAX_SAMPLE).contains(&query.limit) {
        return Err(ApiError::bad_request(format!("limit must be between 1 and {MAX_SAMPLE}")));
    }
    let source = dataset.source(&state);
    let registry = dataset.registry_file.is_some();
    let permit = SAMPLES.acquire().await.map_err(ApiError::internal)?;
    let sample = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let set = match query.held_out {
            Some(held_out) => EvalSet::HeldOut { data: &source, held_out },
            None => EvalSet::Separate { data: &source, registry },
        };
        evaluation::sample(set, metric, query.limit)
    })
    .await??;
    Ok(Json(sample))
}

/// The engine's message without its "invalid option: " head.
fn plain(err: &sluice_engine::Error) -> String {
    match err {
        sluice_engine::Error::Invalid(message) => message.clone(),
        other => other.to_string(),
    }
}

/// `GET /api/jobs/{id}/answers`: `{"metric", "higher_is_better", "base_step", "base_score",
/// "tuned_step", "tuned_score", "base_extra", "tuned_extra", "records": [{"line", "prompt",
/// "reference", "base_answer", "base_score", "tuned_answer", "tuned_score"}]}`: the base
/// model's answers (step 0) beside the latest evaluation's, by line. 404 for a job the user
/// may not see, one without a task evaluation, or one whose base model is not scored yet.
async fn answers(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<Json<Answers>> {
    let job = super::access::visible_job(&state, &user, id).await?;
    let has_task = job.settings().is_ok_and(|s| s.task().is_some());
    if !has_task {
        return Err(ApiError::not_found(format!("job {id} has no task evaluation")));
    }
    let run = runner::run_dir(&state, id);
    let answers = tokio::task::spawn_blocking(move || evaluation::answers(&run)).await??;
    Ok(Json(answers))
}
