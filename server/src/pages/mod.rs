//! HTML pages (owned by the pages' author, who replaces these insides). Until the appliance's own
//! pages exist, `/` is a static placeholder that points to the command line.

use axum::Router;
use axum::http::StatusCode;
use axum::response::Html;
use axum::routing::get;

use crate::AppState;

const PLACEHOLDER: &str = include_str!("../../../web/templates/placeholder.html");
const NOT_FOUND: &str = include_str!("../../../web/templates/not_found.html");

pub fn router() -> Router<AppState> {
    Router::new().route("/", get(placeholder))
}

async fn placeholder() -> Html<&'static str> {
    Html(PLACEHOLDER)
}

/// The fallback for every route nobody claimed.
pub(crate) async fn not_found() -> (StatusCode, Html<&'static str>) {
    (StatusCode::NOT_FOUND, Html(NOT_FOUND))
}
