//! The Sluice appliance: the HTTP application and the command line.
//!
//! [`app`] builds the whole router from an [`AppState`] (opened with [`AppState::open`], brought
//! to life by [`start`]); tests drive it with `tower::ServiceExt::oneshot`, with no socket. [`cli`] parses the command line
//! and runs a subcommand (`serve` binds a socket and serves [`app`]).
//!
//! Invariants: HTTP handlers never train (training runs on one OS thread per device, see
//! [`jobs::runner`]); every 4xx body is `{"error": ...}`; another user's dataset, job or
//! checkpoint answers 404.

mod announce;
mod api;
pub mod auth;
pub mod cli;
pub mod config;
mod datasets;
pub mod db;
pub mod error;
mod evaluation;
pub mod gpus;
pub mod hub;
mod job_line;
pub mod jobs;
pub mod models;
mod pages;
pub mod paths;
mod recovery;
mod serving;
mod state;
mod store;
mod tryit;
mod watchers;
mod webhooks;

pub use config::Config;
pub use state::{AppState, JobMessage};

/// Brings an opened appliance to life: jobs a previous process left running are marked
/// interrupted, what it left half-written is removed (see `recovery`), the demo dataset is
/// registered (once), and the job dispatcher and the task that
/// unloads an idle try-it model start. Call it once per [`AppState`], inside a tokio runtime.
pub async fn start(state: &AppState) -> anyhow::Result<()> {
    jobs::runner::mark_interrupted(state.pool()).await?;
    recovery::remove_leftovers(state).await?;
    datasets::register_demo(state).await?;
    jobs::runner::start(state);
    tryit::start(state);
    Ok(())
}

use axum::Router;
use axum::middleware;
use tower_http::compression::CompressionLayer;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::trace::TraceLayer;

/// The whole HTTP application. Each area contributes its own router; they are merged here and
/// nowhere else.
pub fn app(state: AppState) -> Router {
    // A hard ceiling on every body, above the upload limit that uploads check themselves with a
    // precise message; `json_errors` gives this layer's plain 413 the API's shape.
    let ceiling = state.config().max_upload_bytes.saturating_add(16 << 20);
    let ceiling = usize::try_from(ceiling).unwrap_or(usize::MAX);
    let compressed = Router::new()
        .merge(pages::router())
        .merge(api::compressed())
        .layer(CompressionLayer::new().compress_when(error::compress_unless_error()));
    Router::new()
        .merge(compressed)
        .merge(api::uncompressed())
        .fallback(fallback)
        .layer(middleware::from_fn_with_state(state.clone(), auth::session::csrf_guard))
        .layer(RequestBodyLimitLayer::new(ceiling))
        .layer(middleware::from_fn_with_state(
            error::UploadLimit(state.config().max_upload_bytes),
            error::json_errors,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), pages::security_headers))
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}

/// Unknown `/api/` paths get a JSON 404, unknown `/v1/` paths OpenAI's; everything else the 404
/// page.
async fn fallback(uri: axum::http::Uri) -> axum::response::Response {
    use axum::response::IntoResponse;
    if uri.path().starts_with("/v1/") {
        api::openai::no_route(uri.path())
    } else if uri.path().starts_with("/api/") {
        error::ApiError::not_found(format!("no API route {}", uri.path())).into_response()
    } else {
        pages::not_found().await.into_response()
    }
}
