//! `POST /api/models/pull` and `GET /api/models/pulls`: a model by Hugging Face name, pulled in
//! the background into the appliance's cache (`DATA_DIR/hub`), one pull per repo at a time.
//! Any signed-in user may pull, as any may import a GGUF file: models are shared by everyone.
//! The pull is planned before the answer (so a missing repo, a gated one without a token or one
//! without safetensors weights is refused at once); the download then runs on a thread of its
//! own, and its progress is polled.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Deserialize;
use tracing::{info, warn};

use crate::AppState;
use crate::auth::CurrentUser;
use crate::error::{ApiError, ApiResult};
use crate::hub::{self, Hub, HubError};
use crate::models::PullView;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PullRequest {
    repo: String,
    #[serde(default)]
    revision: Option<String>,
}

/// The status a refusal is answered with, its message kept.
fn refused(err: HubError) -> ApiError {
    match err {
        HubError::BadName(m) => ApiError::bad_request(m),
        HubError::NotFound(m) => ApiError::not_found(m),
        HubError::Denied(m) => ApiError::Forbidden(m),
        HubError::Unusable(m) | HubError::Checksum(m) | HubError::Failed(m) => {
            ApiError::unprocessable(m)
        }
    }
}

/// 202 with the pull's progress; 400 for a bad name, 404 for a repo or revision the Hub does
/// not have, 403 for a gated repo the token does not open, 409 while `repo` is being pulled,
/// 422 for a repo without safetensors weights or a Hub that cannot be reached.
pub(super) async fn start(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    Json(body): Json<PullRequest>,
) -> ApiResult<(StatusCode, Json<PullView>)> {
    let repo = body.repo.trim().to_string();
    let revision = body.revision.as_deref().map(str::trim).filter(|r| !r.is_empty());
    let revision = revision.unwrap_or("main").to_string();
    hub::check_repo(&repo).map_err(refused)?;
    hub::check_revision(&revision).map_err(refused)?;
    if !state.pulls().begin(&repo, &revision) {
        return Err(ApiError::conflict(format!("{repo} is being pulled already")));
    }
    let settings = state.config().hub.clone();
    let client = Hub::new(&settings.endpoint, settings.token);
    let planned = {
        let (client, repo, revision) = (client.clone(), repo.clone(), revision.clone());
        tokio::task::spawn_blocking(move || hub::pull::plan(&client, &repo, &revision)).await
    };
    let plan = match planned {
        Ok(Ok(plan)) => plan,
        Ok(Err(err)) => {
            state.pulls().forget(&repo);
            return Err(refused(err));
        }
        Err(err) => {
            state.pulls().forget(&repo);
            return Err(err.into());
        }
    };
    let progress = hub::PullProgress::of(&plan);
    state.pulls().update(&repo, |view| {
        view.commit = Some(plan.commit.clone());
        view.files = progress.files;
        view.total = progress.total;
    });
    info!(
        "user {} pulls {repo} at {revision} (commit {}, {} files, {} bytes)",
        user.username,
        plan.commit,
        plan.files.len(),
        plan.total_bytes()
    );
    let root = state.config().hub_dir();
    let worker = state.clone();
    let spawned = std::thread::Builder::new().name(format!("pull {repo}")).spawn(move || {
        let pulls = worker.pulls();
        let result = hub::pull(&client, &root, &plan, &mut |now| {
            pulls.update(&plan.repo, |view| {
                view.files.clone_from(&now.files);
                view.done = now.done;
            });
        });
        match result {
            Ok(model) => {
                info!("pulled {} into {}", model.id(), model.dir.display());
                pulls.update(&plan.repo, |view| {
                    view.state = "done";
                    view.done = view.total;
                    view.model = Some(model.id());
                });
            }
            Err(err) => {
                warn!("the pull of {} failed: {err}", plan.repo);
                pulls.update(&plan.repo, |view| {
                    view.state = "failed";
                    view.error = Some(err.to_string());
                });
            }
        }
    });
    if let Err(err) = spawned {
        state.pulls().forget(&repo);
        return Err(ApiError::internal(err));
    }
    let view = state.pulls().all().into_iter().find(|p| p.repo == repo);
    let view = view.unwrap_or_else(|| PullView::running(&repo, &revision));
    Ok((StatusCode::ACCEPTED, Json(view)))
}

/// Every pull of this process: under way, done or failed.
pub(super) async fn list(
    State(state): State<AppState>,
    _user: CurrentUser,
) -> ApiResult<Json<Vec<PullView>>> {
    Ok(Json(state.pulls().all()))
}
