//! HTML pages and their static files.
//!
//! Every page is a static shell (layout + a body fragment from `web/templates/pages/`) with a
//! module script that fetches its data from the JSON API. Access control therefore lives in the
//! API alone: a shell reveals nothing, and the scripts send anyone without a session to the login
//! (or first-run setup) page.

mod assets;
mod shell;

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;

use crate::AppState;
use shell::{Nav, Page};

const NOT_FOUND: &str = include_str!("../../../web/templates/not_found.html");

macro_rules! page {
    ($title:literal, $file:literal, $nav:expr) => {
        page!($title, $file, $nav, false)
    };
    ($title:literal, $file:literal, $nav:expr, $charts:expr) => {
        Page {
            title: $title,
            body: include_str!(concat!("../../../web/templates/pages/", $file, ".html")),
            script: $file,
            nav: $nav,
            charts: $charts,
        }
    };
}

static SETUP: Page = page!("Welcome", "setup", Nav::None);
static LOGIN: Page = page!("Log in", "login", Nav::None);
static DASHBOARD: Page = page!("", "dashboard", Nav::Dashboard);
static DATASETS: Page = page!("Datasets", "datasets", Nav::Datasets);
static DATASET: Page = page!("Dataset", "dataset", Nav::Datasets);
static MODELS: Page = page!("Models", "models", Nav::Models);
static NEW_JOB: Page = page!("New job", "new_job", Nav::NewJob);
static JOB: Page = page!("Job", "job", Nav::Dashboard, true);
static USERS: Page = page!("Users", "users", Nav::Users);
static ACCOUNT: Page = page!("Your account", "account", Nav::Account);
static COMPARE: Page = page!("Compare jobs", "compare", Nav::Dashboard, true);
static STORAGE: Page = page!("Storage", "storage", Nav::Storage);
static DEMO: Page = page!("Live demo", "demo", Nav::None);

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/", get(|| async { DASHBOARD.response() }))
        .route("/setup", get(|| async { SETUP.response() }))
        .route("/login", get(|| async { LOGIN.response() }))
        .route("/datasets", get(|| async { DATASETS.response() }))
        .route("/datasets/{id}", get(|id: Path<String>| with_id(id, &DATASET)))
        .route("/models", get(|| async { MODELS.response() }))
        .route("/jobs/new", get(|| async { NEW_JOB.response() }))
        .route("/jobs/compare", get(|| async { COMPARE.response() }))
        .route("/jobs/{id}", get(|id: Path<String>| with_id(id, &JOB)))
        .route("/admin/users", get(|| async { USERS.response() }))
        .route("/account", get(|| async { ACCOUNT.response() }))
        .route("/admin/storage", get(|| async { STORAGE.response() }))
        .route("/demo/{token}", get(demo))
        .route("/static/{*path}", get(assets::serve))
}

/// A page about one object: the shell for numeric ids, the 404 page for anything else.
async fn with_id(Path(id): Path<String>, page: &'static Page) -> Response {
    if id.parse::<u64>().is_ok() { page.response() } else { not_found().await.into_response() }
}

/// A job's demo view: the shell for anything shaped like a token (its script asks the API
/// whether the link is on), the 404 page otherwise.
async fn demo(Path(token): Path<String>) -> Response {
    if crate::auth::session::is_token(&token) {
        DEMO.response()
    } else {
        not_found().await.into_response()
    }
}

/// Middleware: headers on every reply, pages and API alike. Browsers must not guess a download's
/// type from its bytes, tell other sites which page linked them, or show the appliance in a
/// frame (the pages' CSP says so too, for browsers that read it). HSTS, which tells a browser to
/// use nothing but HTTPS for this host from then on, only once the appliance is reached over it.
pub(crate) async fn security_headers(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    if state.config().https {
        // A year, the usual value; subdomains are left alone, since the appliance may share its
        // domain with sites that have no HTTPS.
        headers.insert(
            header::STRICT_TRANSPORT_SECURITY,
            HeaderValue::from_static("max-age=31536000"),
        );
    }
    response
}

/// The fallback for every route nobody claimed.
pub(crate) async fn not_found() -> (StatusCode, Html<&'static str>) {
    (StatusCode::NOT_FOUND, Html(NOT_FOUND))
}

#[cfg(test)]
mod tests;
