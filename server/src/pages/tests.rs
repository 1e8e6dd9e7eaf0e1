//! The handlers called directly: pages and static files need no application state.

use axum::body::to_bytes;
use axum::http::{HeaderMap, HeaderValue, header};

use super::*;

async fn body_text(response: Response) -> String {
    let bytes = to_bytes(response.into_body(), 1 << 20).await.unwrap_or_default();
    String::from_utf8_lossy(&bytes).into_owned()
}

async fn asset(path: &str, headers: HeaderMap) -> Response {
    assets::serve(Path(path.to_owned()), headers).await
}

#[tokio::test]
async fn pages_are_html_with_a_strict_script_policy() {
    for page in [
        &SETUP, &LOGIN, &DASHBOARD, &DATASETS, &DATASET, &MODELS, &NEW_JOB, &JOB, &USERS, &COMPARE,
        &STORAGE,
    ] {
        let response = page.response();
        assert_eq!(response.status(), StatusCode::OK);
        let headers = response.headers();
        assert_eq!(headers[header::CONTENT_TYPE], "text/html; charset=utf-8");
        let csp = headers[header::CONTENT_SECURITY_POLICY].to_str().unwrap_or_default();
        assert!(csp.contains("script-src 'self'"), "{csp}");
        let html = body_text(response).await;
        // Every script a page loads must be one the binary serves.
        let script = format!("js/pages/{}.js", page.script);
        assert_eq!(asset(&script, HeaderMap::new()).await.status(), StatusCode::OK, "{script}");
        assert!(html.contains(&format!("/static/{script}")), "{}", page.script);
    }
}

#[tokio::test]
async fn object_pages_accept_only_numeric_ids() {
    let ok = with_id(Path("42".to_owned()), &JOB).await;
    assert_eq!(ok.status(), StatusCode::OK);
    let bad = with_id(Path("42x".to_owned()), &JOB).await;
    assert_eq!(bad.status(), StatusCode::NOT_FOUND);
    assert!(body_text(bad).await.contains("Page not found"));
}

#[tokio::test]
async fn static_files_have_content_types_and_cache_headers() {
    let css = asset("app.css", HeaderMap::new()).await;
    assert_eq!(css.status(), StatusCode::OK);
    assert_eq!(css.headers()[header::CONTENT_TYPE], "text/css; charset=utf-8");
    assert_eq!(css.headers()[header::CACHE_CONTROL], "no-cache");

    let chart = asset("vendor/uplot-1.6.32/uPlot.iife.min.js", HeaderMap::new()).await;
    assert_eq!(chart.status(), StatusCode::OK);
    assert_eq!(chart.headers()[header::CONTENT_TYPE], "text/javascript; charset=utf-8");
    assert!(
        chart.headers()[header::CACHE_CONTROL].to_str().unwrap_or_default().contains("immutable")
    );
    assert!(body_text(chart).await.contains("uPlot"));
}

#[tokio::test]
async fn a_matching_etag_gets_not_modified() {
    let first = asset("js/api.js", HeaderMap::new()).await;
    let etag = first.headers()[header::ETAG].clone();
    let mut headers = HeaderMap::new();
    headers.insert(header::IF_NONE_MATCH, etag);
    let second = asset("js/api.js", headers).await;
    assert_eq!(second.status(), StatusCode::NOT_MODIFIED);
    assert!(body_text(second).await.is_empty());

    let mut stale = HeaderMap::new();
    stale.insert(header::IF_NONE_MATCH, HeaderValue::from_static("\"0000000000000000\""));
    assert_eq!(asset("js/api.js", stale).await.status(), StatusCode::OK);
}

#[tokio::test]
async fn unknown_static_files_are_not_found() {
    for path in ["nope.js", "../Cargo.toml", "vendor/uplot/uPlot.iife.min.js", ""] {
        assert_eq!(asset(path, HeaderMap::new()).await.status(), StatusCode::NOT_FOUND, "{path}");
    }
}
