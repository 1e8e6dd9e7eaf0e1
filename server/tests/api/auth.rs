//! Setup, login, logout, CSRF, session expiry, user management.

use axum::http::StatusCode;
use serde_json::json;

use crate::common::{PASSWORD, TestApp};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_login_logout_and_csrf() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let mut client = app.client();

    let session = client.session().await?;
    assert_eq!(session["setup_needed"], true);
    assert!(session["user"].is_null());
    assert!(session["csrf"].as_str().is_some_and(|t| t.len() == 64), "{session}");
    let cookie = app.client().get("/api/session").await?.header(axum::http::header::SET_COOKIE);
    assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Lax"), "{cookie}");

    // Without the token, even setup is refused.
    let token = client.csrf.take();
    let refused =
        client.post("/api/setup", json!({"username": "admin", "password": PASSWORD})).await?;
    assert_eq!(refused.status, StatusCode::FORBIDDEN);
    assert!(refused.error().contains("CSRF"), "{}", refused.text());
    client.csrf = Some("0".repeat(64));
    let wrong =
        client.post("/api/setup", json!({"username": "admin", "password": PASSWORD})).await?;
    assert_eq!(wrong.status, StatusCode::FORBIDDEN);
    client.csrf = token;

    let short =
        client.post("/api/setup", json!({"username": "admin", "password": "short"})).await?;
    assert_eq!(short.status, StatusCode::BAD_REQUEST);
    let missing = client.post("/api/setup", json!({"username": "admin"})).await?;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert!(missing.error().contains("password"), "{}", missing.text());

    let old_csrf = client.csrf.clone();
    let setup =
        client.post("/api/setup", json!({"username": "admin", "password": PASSWORD})).await?;
    assert_eq!(setup.status, StatusCode::OK, "{}", setup.text());
    let me = client.adopt(&setup)?;
    assert_eq!(me["user"]["username"], "admin");
    assert_eq!(me["user"]["role"], "admin");
    assert_eq!(me["setup_needed"], false);
    assert_ne!(client.csrf, old_csrf, "login must rotate the session");

    let again = client.post("/api/setup", json!({"username": "eve", "password": PASSWORD})).await?;
    assert_eq!(again.status, StatusCode::CONFLICT);

    assert_eq!(client.get("/api/datasets").await?.status, StatusCode::OK);
    let logout = client.post("/api/logout", json!({})).await?;
    assert_eq!(logout.status, StatusCode::OK);
    let anonymous = client.adopt(&logout)?;
    assert!(anonymous["user"].is_null());
    let after = client.get("/api/datasets").await?;
    assert_eq!(after.status, StatusCode::UNAUTHORIZED);
    assert!(after.error().contains("log in"), "{}", after.text());

    let bad = client.login("admin", "wrong password").await?;
    assert_eq!(bad.status, StatusCode::UNAUTHORIZED);
    assert_eq!(bad.error(), "wrong username or password");
    let nobody = client.login("nobody", PASSWORD).await?;
    assert_eq!(nobody.status, StatusCode::UNAUTHORIZED);
    let good = client.login("admin", PASSWORD).await?;
    assert_eq!(good.status, StatusCode::OK);
    assert_eq!(client.get("/api/session").await?.json()?["user"]["username"], "admin");

    // A state-changing request with the session's cookie but a stale token is refused.
    client.csrf = old_csrf;
    let stale = client.post("/api/logout", json!({})).await?;
    assert_eq!(stale.status, StatusCode::FORBIDDEN);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_sessions_are_logged_out() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let client = app.admin().await?;
    assert_eq!(client.get("/api/datasets").await?.status, StatusCode::OK);
    sqlx::query("UPDATE sessions SET expires_at = 0").execute(app.state.pool()).await?;
    assert_eq!(client.get("/api/datasets").await?.status, StatusCode::UNAUTHORIZED);
    let session = client.get("/api/session").await?.json()?;
    assert!(session["user"].is_null(), "{session}");
    let post = client.post("/api/logout", json!({})).await?;
    assert_eq!(post.status, StatusCode::FORBIDDEN, "an expired session's CSRF token is dead too");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admins_manage_users_and_users_cannot() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;

    let users = admin.get("/api/users").await?.json()?;
    let names: Vec<&str> = users
        .as_array()
        .map(|u| u.iter().filter_map(|u| u["username"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(names, ["admin", "alice"]);
    assert!(users[0].get("password_hash").is_none());

    assert_eq!(alice.get("/api/users").await?.status, StatusCode::FORBIDDEN);
    let create = alice.post("/api/users", json!({"username": "bob", "password": PASSWORD})).await?;
    assert_eq!(create.status, StatusCode::FORBIDDEN);

    let taken =
        admin.post("/api/users", json!({"username": "alice", "password": PASSWORD})).await?;
    assert_eq!(taken.status, StatusCode::CONFLICT);
    let bad_role = admin
        .post("/api/users", json!({"username": "bob", "password": PASSWORD, "role": "root"}))
        .await?;
    assert_eq!(bad_role.status, StatusCode::BAD_REQUEST);

    let alice_id = users[1]["id"].as_i64().unwrap_or(0);
    let admin_id = users[0]["id"].as_i64().unwrap_or(0);
    assert_eq!(admin.delete(&format!("/api/users/{admin_id}")).await?.status, StatusCode::CONFLICT);
    assert_eq!(
        admin.delete(&format!("/api/users/{alice_id}")).await?.status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(
        admin.delete(&format!("/api/users/{alice_id}")).await?.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(alice.get("/api/datasets").await?.status, StatusCode::UNAUTHORIZED);
    Ok(())
}
