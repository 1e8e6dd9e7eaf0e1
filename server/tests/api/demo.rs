//! Demo links: the owner turns a job's read-only live view on and off; with the link anyone
//! sees the figures without an account, and nothing else of the job; without it, nobody does.

use axum::http::StatusCode;
use serde_json::json;

use crate::common::{TestApp, tiny_job};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demo_link_shows_a_jobs_figures_to_anyone_until_it_is_turned_off() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let bob = app.user(&admin, "bob").await?;
    let anonymous = app.client();
    let demo = alice.demo_dataset().await?;
    let job = alice.submit(tiny_job(demo, 2)).await?;
    alice.wait_job(job, 300, |j| j["status"] == "completed").await?;
    assert!(alice.get(&format!("/api/jobs/{job}")).await?.json()?["demo"].is_null());

    // Only the owner (or an admin) turns it on.
    assert_eq!(
        bob.put(&format!("/api/jobs/{job}/demo"), json!({})).await?.status,
        StatusCode::NOT_FOUND
    );
    let status = anonymous.put(&format!("/api/jobs/{job}/demo"), json!({})).await?.status;
    assert!([StatusCode::UNAUTHORIZED, StatusCode::FORBIDDEN].contains(&status), "{status}");
    let on = alice.put(&format!("/api/jobs/{job}/demo"), json!({})).await?;
    assert_eq!(on.status, StatusCode::OK, "{}", on.text());
    let link = on.json()?["demo"].as_str().unwrap_or_default().to_string();
    let token = link.strip_prefix("/demo/").unwrap_or_default().to_string();
    assert_eq!(token.len(), 64, "{link}");
    // Turning it on again keeps the link the room already has.
    let again = alice.put(&format!("/api/jobs/{job}/demo"), json!({})).await?.json()?;
    assert_eq!(again["demo"], link.as_str());
    assert_eq!(alice.get(&format!("/api/jobs/{job}")).await?.json()?["demo"], link.as_str());

    // Anyone with the link: the page and its figures, without a session.
    let page = anonymous.get(&link).await?;
    assert_eq!(page.status, StatusCode::OK);
    assert!(page.text().contains("/static/js/pages/demo.js"), "{}", page.text());
    let view = anonymous.get(&format!("/api/demo/{token}")).await?;
    assert_eq!(view.status, StatusCode::OK, "{}", view.text());
    let view = view.json()?;
    assert_eq!(view["title"], format!("job {job}"));
    assert_eq!(view["model"], "preset:tiny");
    assert_eq!(view["status"], "completed");
    assert_eq!((view["step"].as_i64(), view["total_steps"].as_i64()), (Some(2), Some(2)));
    let params = view["params"].as_u64().unwrap_or(0);
    assert!((900_000..1_200_000).contains(&params), "tiny preset: {params} parameters");
    assert_eq!(view["point"]["step"], 2, "{view}");
    assert!(view["point"]["loss"].is_number() && view["point"]["tokens_per_s"].is_number());
    // The figures only: no data, settings, checkpoints or log.
    for key in ["config", "dataset", "dataset_name", "owner", "command", "note"] {
        assert!(view.get(key).is_none(), "the demo view shows {key}: {view}");
    }
    assert_eq!(anonymous.get(&format!("/api/jobs/{job}")).await?.status, StatusCode::UNAUTHORIZED);

    // Off: the link opens nothing, and a guessed or malformed token never did.
    let off = alice.delete(&format!("/api/jobs/{job}/demo")).await?;
    assert_eq!(off.status, StatusCode::OK);
    assert!(off.json()?["demo"].is_null());
    for path in [format!("/api/demo/{token}"), format!("/api/demo/{token}/events")] {
        let reply = anonymous.get(&path).await?;
        assert_eq!(reply.status, StatusCode::NOT_FOUND, "{path}");
        assert!(reply.error().contains("demo link is off"), "{}", reply.text());
    }
    let guess = "0".repeat(64);
    assert_eq!(anonymous.get(&format!("/api/demo/{guess}")).await?.status, StatusCode::NOT_FOUND);
    assert_eq!(anonymous.get("/demo/not-a-token").await?.status, StatusCode::NOT_FOUND);
    assert!(alice.get(&format!("/api/jobs/{job}")).await?.json()?["demo"].is_null());
    Ok(())
}
