//! Page shells: the shared layout around each page's static HTML. The pages hold no data; their
//! scripts fetch it from the JSON API, so a shell is the same for every user and every id.

use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

use super::assets::UPLOT_VERSION;

const LAYOUT: &str = include_str!("../../../web/templates/layout.html");

/// Which navigation entry a page highlights; `None` pages (login, setup) show no navigation.
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

/// One page: its title, its body (a fragment of `web/templates/pages/`) and the module script
/// under `/static/js/pages/` that brings it to life.
#[derive(Debug)]
pub(crate) struct Page {
    /// Shown before " · Sluice" in the window title; empty for the home page, titled "Sluice".
    pub title: &'static str,
    pub body: &'static str,
    pub script: &'static str,
    pub nav: Nav,
    /// Loads the chart library's stylesheet and script before the page's module.
    pub charts: bool,
}

/// Scripts may come only from the appliance itself; uPlot sets element styles from script,
/// which `style-src` governs only for markup, and the 404 page carries its own `<style>`.
const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
                   img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; \
                   form-action 'self'; frame-ancestors 'none'";

impl Page {
    pub(crate) fn render(&self) -> String {
        let uplot = format!("/static/vendor/uplot-{UPLOT_VERSION}");
        let (chart_css, chart_js) = if self.charts {
            (
                format!(r#"<link rel="stylesheet" href="{uplot}/uPlot.min.css">"#),
                format!(r#"<script src="{uplot}/uPlot.iife.min.js"></script>"#),
            )
        } else {
            (String::new(), String::new())
        };
        let nav = if self.nav == Nav::None { String::new() } else { nav_html(self.nav) };
        let title = if self.title.is_empty() {
            "Sluice".to_owned()
        } else {
            format!("{} · Sluice", self.title)
        };
        LAYOUT
            .replace("{{title}}", &title)
            .replace("{{chart_css}}", &chart_css)
            .replace("{{chart_js}}", &chart_js)
            .replace("{{nav}}", &nav)
            .replace("{{body}}", self.body)
            .replace("{{script}}", self.script)
    }

    pub(crate) fn response(&self) -> Response {
        (
            [
                (header::CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8")),
                (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
                (header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP)),
            ],
            self.render(),
        )
            .into_response()
    }
}

/// The top bar. On narrow screens the navigation and the account fold into `#menu`, opened by
/// `#menu-button` (`static/js/shell.js`); on wide ones the button is hidden and the menu is a row.
fn nav_html(active: Nav) -> String {
    let entries = [
        (Nav::Dashboard, "/", "Dashboard", ""),
        (Nav::Datasets, "/datasets", "Datasets", ""),
        (Nav::Models, "/models", "Models", ""),
        (Nav::NewJob, "/jobs/new", "New job", ""),
        // Shown by the page script once the session says the user is an admin.
        (Nav::Users, "/admin/users", "Users", " data-admin-only hidden"),
        (Nav::Storage, "/admin/storage", "Storage", " data-admin-only hidden"),
    ];
    let mut links = String::new();
    for (nav, href, label, extra) in entries {
        let current = if nav == active { r#" aria-current="page""# } else { "" };
        links.push_str(&format!(r#"<a href="{href}"{current}{extra}>{label}</a>"#));
    }
    let account = if active == Nav::Account { r#" aria-current="page""# } else { "" };
    format!(
        r#"<header class="topbar"><a class="brand" href="/">Sluice</a><button type="button" class="menu-button" id="menu-button" aria-expanded="false" aria-controls="menu">Menu</button><div class="menu" id="menu"><nav aria-label="Main">{links}</nav><div class="who"><a id="who-name" href="/account" title="Your account: API tokens and webhook"{account}></a><button type="button" id="logout" class="link">Log out</button></div></div></header>"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(nav: Nav, charts: bool) -> Page {
        Page { title: "T", body: "<p id=b>body</p>", script: "x", nav, charts }
    }

    #[test]
    fn render_fills_every_placeholder() {
        let html = page(Nav::Datasets, true).render();
        assert!(!html.contains("{{"), "unfilled placeholder in {html}");
        assert!(html.contains("<title>T · Sluice</title>"));
        let home = Page { title: "", ..page(Nav::Dashboard, false) };
        assert!(home.render().contains("<title>Sluice</title>"));
        assert!(html.contains("<p id=b>body</p>"));
        assert!(html.contains(r#"src="/static/js/pages/x.js""#));
        assert!(html.contains(&format!("uplot-{UPLOT_VERSION}/uPlot.iife.min.js")));
        assert!(html.contains(r#"<a href="/datasets" aria-current="page">"#));
        assert!(!html.contains(r#"<a href="/" aria-current"#));
        assert!(html.contains(r#"aria-controls="menu""#) && html.contains(r#"id="menu""#));
    }

    #[test]
    fn every_page_starts_with_a_skip_link_to_main() {
        for nav in [Nav::None, Nav::Dashboard] {
            let html = page(nav, false).render();
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
    fn login_pages_have_no_navigation_and_no_charts() {
        let html = page(Nav::None, false).render();
        assert!(!html.contains("topbar"));
        assert!(!html.contains("uPlot"));
    }
}
