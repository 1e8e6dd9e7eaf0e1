//! Handler tests: requests go straight through `app(state)`, with no socket.

use axum::body::{Body, to_bytes};
use axum::http::{Request, StatusCode, header};
use sluice::{AppState, app};
use tower::ServiceExt;

struct Reply {
    status: StatusCode,
    content_type: String,
    body: String,
}

async fn get(path: &str) -> anyhow::Result<Reply> {
    let data_dir = tempfile::tempdir()?;
    let state = AppState::new(data_dir.path().to_path_buf());
    let request = Request::get(path).body(Body::empty())?;
    let response = app(state).oneshot(request).await?;
    let status = response.status();
    let content_type = response
        .headers()
        .get(header::CONTENT_TYPE)
        .map(|value| value.to_str().unwrap_or("<not ascii>").to_owned())
        .unwrap_or_default();
    let bytes = to_bytes(response.into_body(), 1 << 20).await?;
    Ok(Reply { status, content_type, body: String::from_utf8(bytes.to_vec())? })
}

#[tokio::test]
async fn root_serves_the_dashboard_shell() -> anyhow::Result<()> {
    let reply = get("/").await?;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(reply.content_type.starts_with("text/html"), "content-type {}", reply.content_type);
    assert!(reply.body.contains("<title>Dashboard · Sluice</title>"), "{}", reply.body);
    assert!(reply.body.contains("/static/js/pages/dashboard.js"), "{}", reply.body);
    Ok(())
}

#[tokio::test]
async fn healthz_reports_ok_and_the_version() -> anyhow::Result<()> {
    let reply = get("/healthz").await?;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(reply.content_type.starts_with("application/json"), "{}", reply.content_type);
    let json: serde_json::Value = serde_json::from_str(&reply.body)?;
    assert_eq!(json, serde_json::json!({ "status": "ok", "version": env!("CARGO_PKG_VERSION") }));
    Ok(())
}

#[tokio::test]
async fn unknown_route_gets_the_404_page() -> anyhow::Result<()> {
    let reply = get("/no/such/page").await?;
    assert_eq!(reply.status, StatusCode::NOT_FOUND);
    assert!(reply.content_type.starts_with("text/html"), "{}", reply.content_type);
    assert!(reply.body.contains("Page not found"), "{}", reply.body);
    Ok(())
}
