//! The layout around every page (`web/templates/layout.html`, through askama): the window title,
//! the chart library where a page draws, the top bar with the navigation the user's role may
//! use, and the page's first data embedded as JSON so its script starts without a round trip.

use askama::Template;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::assets::UPLOT_VERSION;
use crate::store::users::User;

/// Which navigation entry a page highlights; `None` pages (login, setup, demo) show no top bar.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Nav {
    None,
    Dashboard,
    Datasets,
    Models,
    NewJob,
    Users,
    /// The user's own page (API tokens, webhook), linked from their name in the top bar.
    Account,
    Storage,
}

/// One link of the top bar.
#[derive(Debug)]
pub(crate) struct NavEntry {
    pub href: &'static str,
    pub label: &'static str,
    pub current: bool,
}

/// The navigation: (entry, path, label, admins only).
const NAVIGATION: [(Nav, &str, &str, bool); 6] = [
    (Nav::Dashboard, "/", "Dashboard", false),
    (Nav::Datasets, "/datasets", "Datasets", false),
    (Nav::Models, "/models", "Models", false),
    (Nav::NewJob, "/jobs/new", "New job", false),
    (Nav::Users, "/admin/users", "Users", true),
    (Nav::Storage, "/admin/storage", "Storage", true),
];

/// What the layout needs from a page.
#[derive(Debug)]
pub(crate) struct Shell<'a> {
    /// Shown before " · Sluice" in the window title; empty for the home page, titled "Sluice".
    pub title: &'static str,
    /// The module under `/static/js/pages/` that brings the page to life.
    pub script: &'static str,
    pub nav: Nav,
    /// Loads the chart library's stylesheet and script before the page's module.
    pub charts: bool,
    /// Who is logged in; the top bar is drawn only for them, on pages with navigation.
    pub user: Option<&'a User>,
    /// JSON the page's script reads before it asks the API (`#first-data`), already safe to
    /// place inside a `<script>` element (see [`first_data`]).
    pub first_data: Option<String>,
}

impl Shell<'_> {
    pub(crate) fn window_title(&self) -> String {
        if self.title.is_empty() {
            "Sluice".to_owned()
        } else {
            format!("{} · Sluice", self.title)
        }
    }

    /// The user the top bar is drawn for: none on pages without navigation.
    pub(crate) fn top_bar(&self) -> Option<&User> {
        self.user.filter(|_| self.nav != Nav::None)
    }

    pub(crate) fn nav_is_account(&self) -> bool {
        self.nav == Nav::Account
    }

    pub(crate) fn uplot(&self) -> String {
        format!("/static/vendor/uplot-{UPLOT_VERSION}")
    }

    /// The links the user may follow: the admin pages only for admins.
    pub(crate) fn nav_entries(&self) -> Vec<NavEntry> {
        let admin = self.user.is_some_and(User::is_admin);
        NAVIGATION
            .iter()
            .filter(|(_, _, _, admins_only)| admin || !admins_only)
            .map(|&(nav, href, label, _)| NavEntry { href, label, current: nav == self.nav })
            .collect()
    }
}

/// `value` as JSON text that can sit inside a `<script>` element: `<`, `>` and `&` written as
/// JSON escapes, so no string in it can close the element or open a comment.
pub(crate) fn first_data(value: &serde_json::Value) -> String {
    value
        .to_string()
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026")
        .replace('\u{2028}', "\\u2028")
        .replace('\u{2029}', "\\u2029")
}

/// Scripts may come only from the appliance itself; uPlot sets element styles from script,
/// which `style-src` governs only for markup, and the 404 page carries its own `<style>`.
const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
                   img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; \
                   form-action 'self'; frame-ancestors 'none'";

/// A rendered template as an HTML reply. Pages carry the user's name and data, so no cache may
/// keep them (`no-store`); a template that fails to render (it cannot, short of a bug in a
/// value's `Display`) answers 500 without a panic.
pub(crate) fn html(status: StatusCode, page: &impl Template) -> Response {
    match page.render() {
        Ok(html) => (
            status,
            [
                (header::CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8")),
                (header::CACHE_CONTROL, HeaderValue::from_static("no-store")),
                (header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP)),
            ],
            html,
        )
            .into_response(),
        Err(e) => {
            tracing::error!("rendering a page: {e}");
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A page through the real layout, with a body of its own.
    #[derive(Template)]
    #[template(
        source = r#"{% extends "layout.html" %}{% block main %}<p id=b>body</p>{% endblock %}"#,
        ext = "html"
    )]
    struct Probe<'a> {
        shell: Shell<'a>,
    }

    fn render(nav: Nav, charts: bool, user: Option<&User>) -> String {
        let shell = Shell { title: "T", script: "x", nav, charts, user, first_data: None };
        Probe { shell }.render().unwrap_or_else(|e| panic!("render: {e}"))
    }

    fn user(role: &str) -> User {
        User { id: 1, username: "ann<b>".into(), role: role.into() }
    }

    #[test]
    fn the_layout_frames_the_page() {
        let ann = user("user");
        let html = render(Nav::Datasets, true, Some(&ann));
        assert!(html.contains("<title>T · Sluice</title>"), "{html}");
        assert!(html.contains("<p id=b>body</p>"));
        assert!(html.contains(r#"src="/static/js/pages/x.js""#));
        assert!(html.contains(&format!("uplot-{UPLOT_VERSION}/uPlot.iife.min.js")));
        assert!(html.contains(r#"<a href="/datasets" aria-current="page">"#));
        assert!(!html.contains(r#"<a href="/" aria-current"#));
        assert!(html.contains(r#"aria-controls="menu""#) && html.contains(r#"id="menu""#));
        // The name is the user's, escaped.
        assert!(html.contains("ann&#60;b&#62;") || html.contains("ann&lt;b&gt;"), "{html}");
        let home = Probe {
            shell: Shell {
                title: "",
                script: "x",
                nav: Nav::Dashboard,
                charts: false,
                user: None,
                first_data: None,
            },
        };
        assert!(home.render().is_ok_and(|h| h.contains("<title>Sluice</title>")));
    }

    #[test]
    fn the_navigation_shows_admin_pages_to_admins_only() {
        let (plain, admin) = (user("user"), user("admin"));
        let html = render(Nav::Dashboard, false, Some(&plain));
        assert!(!html.contains("/admin/users") && !html.contains("/admin/storage"), "{html}");
        assert!(!html.contains("(admin)"));
        let html = render(Nav::Dashboard, false, Some(&admin));
        assert!(html.contains(r#"<a href="/admin/users">Users</a>"#), "{html}");
        assert!(html.contains(r#"<a href="/admin/storage">Storage</a>"#));
        assert!(html.contains("(admin)"));
    }

    #[test]
    fn every_page_starts_with_a_skip_link_to_main() {
        let ann = user("user");
        for (nav, who) in [(Nav::None, None), (Nav::Dashboard, Some(&ann))] {
            let html = render(nav, false, who);
            let body = &html[html.find("<body>").unwrap_or(0)..];
            let first_link = body.find("<a ").unwrap_or(usize::MAX);
            assert_eq!(
                body.find(r##"<a class="skip-link" href="#main">"##),
                Some(first_link),
                "{html}"
            );
            assert!(html.contains(r#"<main id="main" tabindex="-1">"#));
        }
    }

    #[test]
    fn pages_without_navigation_or_user_have_no_top_bar_and_no_charts() {
        let ann = user("user");
        for (nav, who) in [(Nav::None, Some(&ann)), (Nav::Dashboard, None)] {
            let html = render(nav, false, who);
            assert!(!html.contains("topbar"), "{html}");
            assert!(!html.contains("uPlot"));
        }
    }

    #[test]
    fn first_data_cannot_close_its_script_element() {
        let value = serde_json::json!({ "name": "</script><script>alert(1)</script> & <!--" });
        let text = first_data(&value);
        assert!(!text.contains('<') && !text.contains('>') && !text.contains('&'), "{text}");
        let back: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        assert_eq!(back, value);
    }
}
