//! The JSON API under `/api/` (and the checkpoint downloads, and the OpenAI-compatible endpoint
//! under `/v1/`): one module per area, each with its own router, merged here and nowhere else. Handlers check who asks and what they send, then
//! call the areas below (`datasets`, `models`, `jobs`, `gpus`); they never train.

pub(crate) mod access;
mod account;
mod checkpoints;
mod datasets;
mod demo;
mod errors;
mod evaluation;
mod exports;
mod gpus;
mod health;
pub(crate) mod jobs;
mod metrics;
mod models;
mod multipart;
pub(crate) mod openai;
mod plan;
mod storage;
mod tryit;
mod users;

use axum::Router;

use crate::AppState;

/// Every API route, compressed (SSE is left uncompressed by the default predicate, so events
/// are not held back).
pub(crate) fn compressed() -> Router<AppState> {
    Router::new()
        .merge(health::router())
        .merge(crate::auth::router())
        .merge(users::router())
        .merge(datasets::router())
        .merge(models::router())
        .merge(gpus::router())
        .merge(plan::router())
        .merge(jobs::router())
        .merge(evaluation::router())
        .merge(demo::router())
        .merge(metrics::router())
        .merge(account::router())
        .merge(storage::router())
        .merge(openai::router())
}

/// Checkpoint downloads: not compressed, since ranges must address the file's own bytes.
pub(crate) fn uncompressed() -> Router<AppState> {
    checkpoints::router().merge(exports::router())
}
