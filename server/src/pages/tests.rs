//! The static files' handler, called directly (it needs no application state); the pages,
//! which need a session, are tested through the whole app in `tests/api/pages.rs`.

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
