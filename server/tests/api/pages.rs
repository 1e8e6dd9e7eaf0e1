//! The pages as the server renders them: who may open which page, the navigation each role
//! sees, the plain not-found page for objects the user may not see, and the first data
//! embedded for the page's script.

use axum::http::{StatusCode, header};
use serde_json::Value;

use super::common::{Client, TestApp, tiny_job};

const RECORD: &str = "{\"instruction\": \"Say hi\", \"input\": \"\", \"output\": \"hi\"}\n";

/// The JSON a page embeds for its script (`#first-data`).
fn first_data(html: &str) -> anyhow::Result<Value> {
    let start = html
        .find(r#"<script type="application/json" id="first-data">"#)
        .ok_or_else(|| anyhow::anyhow!("no first data in {html}"))?;
    let rest = &html[start..];
    let open = rest.find('>').unwrap_or(0) + 1;
    let close = rest.find("</script>").unwrap_or(rest.len());
    Ok(serde_json::from_str(&rest[open..close])?)
}

async fn page(client: &Client, path: &str) -> anyhow::Result<(StatusCode, String)> {
    let reply = client.get(path).await?;
    if reply.status.is_success() || reply.status == StatusCode::NOT_FOUND {
        anyhow::ensure!(
            reply.header(header::CONTENT_TYPE).starts_with("text/html"),
            "{path}: {}",
            reply.header(header::CONTENT_TYPE)
        );
    }
    Ok((reply.status, reply.text()))
}

#[tokio::test]
async fn visitors_without_a_session_go_to_setup_then_to_the_login() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let visitor = app.client();
    let reply = visitor.get("/jobs/new").await?;
    assert_eq!(reply.status, StatusCode::SEE_OTHER);
    assert_eq!(reply.header(header::LOCATION), "/setup");
    // The pages anyone may open render for anyone, without a top bar.
    for path in ["/setup", "/login"] {
        let (status, html) = page(&visitor, path).await?;
        assert_eq!(status, StatusCode::OK, "{path}");
        assert!(!html.contains("topbar") && !html.contains("first-data"), "{html}");
    }

    let _admin = app.admin().await?;
    let reply = visitor.get("/jobs/7?tab=log").await?;
    assert_eq!(reply.status, StatusCode::SEE_OTHER);
    assert_eq!(reply.header(header::LOCATION), "/login?next=/jobs/7%3Ftab%3Dlog");
    Ok(())
}

#[tokio::test]
async fn the_navigation_and_admin_pages_follow_the_role() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;

    let (status, html) = page(&admin, "/").await?;
    assert_eq!(status, StatusCode::OK);
    assert!(html.contains(r#"<a href="/admin/users">Users</a>"#), "{html}");
    assert!(html.contains("admin (admin)</a>"), "{html}");
    for path in ["/admin/users", "/admin/storage"] {
        assert_eq!(page(&admin, path).await?.0, StatusCode::OK, "{path}");
    }

    let (status, html) = page(&alice, "/").await?;
    assert_eq!(status, StatusCode::OK);
    assert!(!html.contains("/admin/"), "{html}");
    assert!(html.contains(">alice</a>"), "{html}");
    for path in ["/admin/users", "/admin/storage"] {
        let (status, html) = page(&alice, path).await?;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
        assert!(html.contains("Page not found"), "{html}");
    }
    // Every page behind the login renders for a plain user, with a strict script policy and a
    // script the binary serves.
    for path in ["/", "/datasets", "/models", "/jobs/new", "/jobs/compare", "/account"] {
        let reply = alice.get(path).await?;
        assert_eq!(reply.status, StatusCode::OK, "{path}");
        assert!(reply.header(header::CONTENT_SECURITY_POLICY).contains("script-src 'self'"));
        assert_eq!(reply.header(header::CACHE_CONTROL), "no-store", "{path}");
        let html = reply.text();
        let script = html
            .split(r#"<script type="module" src=""#)
            .nth(2)
            .and_then(|s| s.split('"').next())
            .ok_or_else(|| anyhow::anyhow!("{path}: no page script in {html}"))?;
        assert_eq!(alice.get(script).await?.status, StatusCode::OK, "{script}");
    }
    Ok(())
}

#[tokio::test]
async fn objects_the_user_may_not_see_are_not_found() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let bob = app.user(&admin, "bob").await?;

    let uploaded = alice.upload("hi.jsonl", RECORD.as_bytes(), Some("alice's")).await?;
    assert_eq!(uploaded.status, StatusCode::CREATED, "{}", uploaded.text());
    let dataset = uploaded.json()?["id"].as_i64().unwrap_or_default();
    let job = alice.submit(tiny_job(dataset, 1)).await?;

    // The owner's pages embed what they show, and the session.
    let (status, html) = page(&alice, &format!("/jobs/{job}")).await?;
    assert_eq!(status, StatusCode::OK);
    let data = first_data(&html)?;
    assert_eq!(data["job"]["id"], job);
    assert_eq!(data["session"]["user"]["username"], "alice");
    assert!(data["session"]["csrf"].as_str().is_some_and(|c| !c.is_empty()));
    let (status, html) = page(&alice, &format!("/datasets/{dataset}")).await?;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(first_data(&html)?["dataset"]["name"], "alice's");
    let (_, html) = page(&alice, "/").await?;
    let jobs = first_data(&html)?["jobs"].clone();
    assert_eq!(jobs.as_array().map(|j| j.len()), Some(1), "{jobs}");

    // Another user gets the not-found page, as for ids that do not exist or are not ids.
    for path in [
        format!("/jobs/{job}"),
        format!("/datasets/{dataset}"),
        "/jobs/999".into(),
        "/datasets/999".into(),
        "/jobs/12x".into(),
    ] {
        let (status, html) = page(&bob, &path).await?;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
        assert!(html.contains("Page not found") && !html.contains("first-data"), "{path}");
    }
    // An admin sees everyone's.
    assert_eq!(page(&admin, &format!("/jobs/{job}")).await?.0, StatusCode::OK);
    // Bob's dashboard lists none of alice's jobs.
    let (_, html) = page(&bob, "/").await?;
    assert_eq!(first_data(&html)?["jobs"], serde_json::json!([]));

    // A demo link opens without an account (its script says whether the link is on); what is
    // not shaped like a link is not found.
    assert_eq!(page(&app.client(), "/demo/not-a-token").await?.0, StatusCode::NOT_FOUND);
    let shared = alice.put(&format!("/api/jobs/{job}/demo"), serde_json::json!({})).await?;
    let link = shared.json()?["demo"].as_str().unwrap_or_default().to_owned();
    let (status, html) = page(&app.client(), &link).await?;
    assert_eq!(status, StatusCode::OK, "{link}");
    assert!(!html.contains("topbar"));
    Ok(())
}
