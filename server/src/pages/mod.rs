//! HTML pages and their static files.
//!
//! Every page is an askama template (`web/templates/pages/`, extending `layout.html`), checked
//! when the server compiles. The server knows who asks: a page behind the login sends a visitor
//! without a session to the login (or first-run setup) page, draws the navigation the user's
//! role may use, answers the plain not-found page for an object the user may not see (exactly
//! as for one that does not exist, like the API), and embeds the page's first data (the
//! session, and the job or dataset or job list it shows) so its script starts without a round
//! trip. The scripts keep the live parts: they refresh from the JSON API, which stays the one
//! place access is decided for data.

mod assets;
mod shell;

use askama::Template;
use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use serde_json::{Map, Value, json};

use crate::AppState;
use crate::api::{access, jobs as job_views};
use crate::auth::session::{self, Cookie, Session};
use crate::error::ApiResult;
use crate::store::jobs::Which;
use shell::{Nav, Shell};

/// The page templates: one struct per file of `web/templates/pages/`, each holding the layout's
/// [`Shell`].
macro_rules! templates {
    ($($name:ident => $path:literal,)*) => {$(
        #[derive(Template)]
        #[template(path = $path)]
        struct $name<'a> {
            shell: Shell<'a>,
        }
    )*};
}

templates! {
    SetupPage => "pages/setup.html",
    DashboardPage => "pages/dashboard.html",
    DatasetsPage => "pages/datasets.html",
    DatasetPage => "pages/dataset.html",
    ModelsPage => "pages/models.html",
    NewJobPage => "pages/new_job.html",
    JobPage => "pages/job.html",
    UsersPage => "pages/users.html",
    AccountPage => "pages/account.html",
    ComparePage => "pages/compare.html",
    StoragePage => "pages/storage.html",
    DemoPage => "pages/demo.html",
}

/// The login page, which says what the server trains on: its GPU, its GPUs or its processor.
#[derive(Template)]
#[template(path = "pages/login.html")]
struct LoginPage<'a> {
    shell: Shell<'a>,
    device: &'static str,
}

/// How a visitor reads what a server with `gpus` GPUs trains on.
fn trains_on(gpus: usize) -> &'static str {
    match gpus {
        0 => "this server's processor",
        1 => "this server's GPU",
        _ => "this server's GPUs",
    }
}

/// The page for an address nobody serves, and for an object the user may not see.
#[derive(Template)]
#[template(path = "not_found.html")]
struct NotFoundPage;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/", get(dashboard))
        .route("/setup", get(|| async { open_page(SetupPage { shell: open("Welcome", "setup") }) }))
        .route(
            "/login",
            get(|state: State<AppState>| async move {
                // The list starts with "cpu"; the rest are GPUs.
                let device = trains_on(state.gpus().device_ids().len().saturating_sub(1));
                open_page(LoginPage { shell: open("Log in", "login"), device })
            }),
        )
        .route("/datasets", get(datasets))
        .route("/datasets/{id}", get(dataset))
        .route("/models", get(models))
        .route("/jobs/new", get(new_job))
        .route("/jobs/compare", get(compare))
        .route("/jobs/{id}", get(job))
        .route("/admin/users", get(users))
        .route("/admin/storage", get(storage))
        .route("/account", get(account))
        .route("/demo/{token}", get(demo))
        .route("/static/{*path}", get(assets::serve))
}

/// A page anyone may open (login, setup): no top bar, no embedded data; its script asks for the
/// visitor's CSRF token.
fn open(title: &'static str, script: &'static str) -> Shell<'static> {
    Shell { title, script, nav: Nav::None, charts: false, user: None, first_data: None }
}

fn open_page(page: impl Template) -> Response {
    shell::html(StatusCode::OK, &page)
}

/// Who asks for a page behind the login, or where to send them instead.
enum Viewer {
    In(Session),
    Out(Response),
}

/// The session of the request's cookie; without one, a redirect to the first-run setup (while
/// no account exists) or to the login, which comes back here afterwards.
async fn viewer(state: &AppState, headers: &HeaderMap, uri: &Uri) -> ApiResult<Viewer> {
    if let Some(Cookie::Session(token)) = session::cookie(headers)
        && let Some(session) = session::load(state, &token).await?
    {
        return Ok(Viewer::In(session));
    }
    if crate::auth::setup_needed(state).await? {
        return Ok(Viewer::Out(Redirect::to("/setup").into_response()));
    }
    let back = uri.path_and_query().map_or("/", |p| p.as_str());
    Ok(Viewer::Out(Redirect::to(&format!("/login?next={}", url_encode(back))).into_response()))
}

/// `text` as a query value: everything but unreserved characters and `/` percent-encoded.
fn url_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~/".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// The layout of a page behind the login, with the session and `data` embedded.
fn behind_login<'a>(
    session: &'a Session,
    (title, script, nav): (&'static str, &'static str, Nav),
    charts: bool,
    data: Map<String, Value>,
) -> Shell<'a> {
    let mut first = data;
    first.insert("session".into(), crate::auth::session_body(session));
    Shell {
        title,
        script,
        nav,
        charts,
        user: Some(&session.user),
        first_data: Some(shell::first_data(&Value::Object(first))),
    }
}

/// Renders a page behind the login: `build` gets the session and answers the page, or `None`
/// for "not found" (an object that does not exist or that the user may not see).
async fn guarded<F, Fut>(state: &AppState, headers: &HeaderMap, uri: &Uri, build: F) -> Response
where
    F: FnOnce(Session) -> Fut,
    Fut: Future<Output = ApiResult<Option<Response>>>,
{
    let outcome = async {
        match viewer(state, headers, uri).await? {
            Viewer::Out(redirect) => Ok(Some(redirect)),
            Viewer::In(session) => build(session).await,
        }
    }
    .await;
    match outcome {
        Ok(Some(page)) => page,
        Ok(None) => not_found().await,
        Err(e) => e.into_response(),
    }
}

/// A page behind the login with nothing but the session embedded.
macro_rules! plain_page {
    ($handler:ident, $page:ident, $title:literal, $script:literal, $nav:expr, $charts:expr) => {
        async fn $handler(State(state): State<AppState>, headers: HeaderMap, uri: Uri) -> Response {
            guarded(&state, &headers, &uri, |session| async move {
                let shell = behind_login(&session, ($title, $script, $nav), $charts, Map::new());
                Ok(Some(shell::html(StatusCode::OK, &$page { shell })))
            })
            .await
        }
    };
}

plain_page!(datasets, DatasetsPage, "Datasets", "datasets", Nav::Datasets, false);
plain_page!(models, ModelsPage, "Models", "models", Nav::Models, false);
plain_page!(new_job, NewJobPage, "New job", "new_job", Nav::NewJob, false);
plain_page!(compare, ComparePage, "Compare jobs", "compare", Nav::Dashboard, true);
plain_page!(account, AccountPage, "Your account", "account", Nav::Account, false);

/// The dashboard, with the jobs its user may see.
async fn dashboard(State(state): State<AppState>, headers: HeaderMap, uri: Uri) -> Response {
    let state = &state;
    guarded(state, &headers, &uri, |session| async move {
        let user = &session.user;
        let which = if user.is_admin() { Which::All } else { Which::OwnedBy(user.id) };
        let jobs = job_views::views(state, which).await?;
        let data = Map::from_iter([("jobs".to_owned(), Value::Array(jobs))]);
        let shell = behind_login(&session, ("", "dashboard", Nav::Dashboard), false, data);
        Ok(Some(shell::html(StatusCode::OK, &DashboardPage { shell })))
    })
    .await
}

/// Job `id`'s page, with its view; not found unless the user may see the job.
async fn job(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    uri: Uri,
) -> Response {
    let state = &state;
    guarded(state, &headers, &uri, |session| async move {
        let Ok(id) = id.parse::<i64>() else { return Ok(None) };
        if access::visible_job(state, &session.user, id).await.is_err() {
            return Ok(None);
        }
        let view = job_views::view(state, id).await?;
        let data = Map::from_iter([("job".to_owned(), view)]);
        let shell = behind_login(&session, ("Job", "job", Nav::Dashboard), true, data);
        Ok(Some(shell::html(StatusCode::OK, &JobPage { shell })))
    })
    .await
}

/// Dataset `id`'s page, with the dataset; not found unless the user may see it.
async fn dataset(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    uri: Uri,
) -> Response {
    let state = &state;
    guarded(state, &headers, &uri, |session| async move {
        let Ok(id) = id.parse::<i64>() else { return Ok(None) };
        let Ok(dataset) = crate::datasets::visible(state, &session.user, id).await else {
            return Ok(None);
        };
        let data = Map::from_iter([("dataset".to_owned(), json!(dataset))]);
        let shell = behind_login(&session, ("Dataset", "dataset", Nav::Datasets), false, data);
        Ok(Some(shell::html(StatusCode::OK, &DatasetPage { shell })))
    })
    .await
}

/// An admin's page; not found for everyone else, like the admin API's objects.
macro_rules! admin_page {
    ($handler:ident, $page:ident, $title:literal, $script:literal, $nav:expr) => {
        async fn $handler(State(state): State<AppState>, headers: HeaderMap, uri: Uri) -> Response {
            guarded(&state, &headers, &uri, |session| async move {
                if !session.user.is_admin() {
                    return Ok(None);
                }
                let shell = behind_login(&session, ($title, $script, $nav), false, Map::new());
                Ok(Some(shell::html(StatusCode::OK, &$page { shell })))
            })
            .await
        }
    };
}

admin_page!(users, UsersPage, "Users", "users", Nav::Users);
admin_page!(storage, StoragePage, "Storage", "storage", Nav::Storage);

/// A job's demo view, for anyone with the link: the page for anything shaped like a token (its
/// script asks the API whether the link is on, and says so when its owner turned it off, also
/// to a projector left open on it), the not-found page otherwise.
async fn demo(Path(token): Path<String>) -> Response {
    if session::is_token(&token) {
        shell::html(StatusCode::OK, &DemoPage { shell: open("Live demo", "demo") })
    } else {
        not_found().await
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

/// The fallback for every route nobody claimed, and the answer for an object the user may not
/// see.
pub(crate) async fn not_found() -> Response {
    shell::html(StatusCode::NOT_FOUND, &NotFoundPage)
}

#[cfg(test)]
mod tests;
