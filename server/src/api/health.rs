//! Liveness probe for supervisors and load balancers.

use axum::routing::get;
use axum::{Json, Router};
use serde_json::{Value, json};

use crate::AppState;

pub(crate) fn router() -> Router<AppState> {
    Router::new().route("/healthz", get(healthz))
}

/// `200 {"status":"ok","version":"<crate version>"}` while the process can answer at all.
async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok", "version": env!("CARGO_PKG_VERSION") }))
}
