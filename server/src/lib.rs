//! The Sluice appliance: the HTTP application and the command line.
//!
//! [`app`] builds the whole router from an [`AppState`]; tests drive it with
//! `tower::ServiceExt::oneshot`, with no socket. [`cli`] parses the command line and runs a
//! subcommand (`serve` binds a socket and serves [`app`]).

pub mod cli;
mod health;
mod pages;
mod state;

pub use state::AppState;

use axum::Router;

/// The whole HTTP application. Each area contributes its own router; they are merged here and
/// nowhere else.
pub fn app(state: AppState) -> Router {
    Router::new()
        .merge(pages::router())
        .merge(health::router())
        .fallback(pages::not_found)
        .with_state(state)
}
