//! What a request may reach: a job its user owns (or any, for an admin), and a checkpoint
//! folder of such a job. Another user's job answers 404, exactly like one that does not exist.
//! [`readable_checkpoints`] lists what [`checkpoint_dir`] would open.

use std::path::PathBuf;

use crate::AppState;
use crate::error::{ApiError, ApiResult};
use crate::jobs::runner;
use crate::paths::is_plain_name;
use crate::store::jobs::{self as store, JobRow, OwnedCheckpoint};
use crate::store::users::User;

/// The job if `user` owns it or is an admin; 404 otherwise, so ids do not leak.
pub(crate) async fn visible_job(state: &AppState, user: &User, id: i64) -> ApiResult<JobRow> {
    match store::get(state.pool(), id).await? {
        Some(job) if user.is_admin() || job.owner_id == user.id => Ok(job),
        _ => Err(ApiError::not_found(format!("no job {id}"))),
    }
}

/// The folder of checkpoint `name` of a job `user` may see; 404 for anything else.
pub(crate) async fn checkpoint_dir(
    state: &AppState,
    user: &User,
    id: i64,
    name: &str,
) -> ApiResult<PathBuf> {
    visible_job(state, user, id).await?;
    let missing = || ApiError::not_found(format!("job {id} has no checkpoint {name:?}"));
    if !is_plain_name(name) {
        return Err(missing());
    }
    let known = store::has_checkpoint(state.pool(), id, name).await?;
    let dir = runner::run_dir(state, id).join(name);
    if !known || !dir.is_dir() {
        return Err(missing());
    }
    Ok(dir)
}

/// Every checkpoint `user` may open: of their own jobs, or of every job for an admin; those
/// whose folder is missing on disk are left out.
pub(crate) async fn readable_checkpoints(
    state: &AppState,
    user: &User,
) -> ApiResult<Vec<OwnedCheckpoint>> {
    let owner = (!user.is_admin()).then_some(user.id);
    let rows = store::checkpoints_of_owner(state.pool(), owner).await?;
    Ok(rows
        .into_iter()
        .filter(|c| {
            is_plain_name(&c.name) && runner::run_dir(state, c.job_id).join(&c.name).is_dir()
        })
        .collect())
}
