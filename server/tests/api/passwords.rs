//! Passwords changed by their owner (with the current one) and reset by an admin: the old
//! password and the sessions opened with it stop working, the session making a change stays,
//! API tokens keep working, and bad input is a clear 4xx.

use axum::http::{Method, StatusCode};
use serde_json::json;
use sluice::auth::throttle::PAIR;

use crate::common::{Client, PASSWORD, TestApp};
use crate::tokens::{bearer, make_token};

const NEW_PASSWORD: &str = "a new password";

/// Another session of `name`'s, as a second browser would have.
async fn second_session(app: &TestApp, name: &str, password: &str) -> anyhow::Result<Client> {
    let mut laptop = app.client();
    let reply = laptop.login(name, password).await?;
    anyhow::ensure!(reply.status == StatusCode::OK, "login: {}", reply.text());
    Ok(laptop)
}

async fn logs_in(app: &TestApp, name: &str, password: &str) -> anyhow::Result<StatusCode> {
    Ok(app.client().login(name, password).await?.status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn users_change_their_password_and_end_their_other_sessions() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let laptop = second_session(&app, "alice", PASSWORD).await?;
    let (_, token) = make_token(&alice, "nightly").await?;
    let change =
        |current: &str, new: &str| json!({"current_password": current, "new_password": new});

    let short = alice.post("/api/account/password", change(PASSWORD, "short")).await?;
    assert_eq!(short.status, StatusCode::BAD_REQUEST, "{}", short.text());
    assert!(short.error().contains("at least 8 characters"), "{}", short.text());
    let wrong =
        alice.post("/api/account/password", change("not my password", NEW_PASSWORD)).await?;
    assert_eq!(wrong.status, StatusCode::FORBIDDEN, "{}", wrong.text());
    assert_eq!(wrong.error(), "the current password is wrong");
    let missing =
        alice.post("/api/account/password", json!({"new_password": NEW_PASSWORD})).await?;
    assert!(missing.status.is_client_error(), "{}", missing.text());
    let body = Some(change(PASSWORD, NEW_PASSWORD));
    let by_token = bearer(&app, &token, Method::POST, "/api/account/password", body).await?;
    assert_eq!(by_token.status, StatusCode::FORBIDDEN, "a token is not a password session");
    let mut visitor = app.client();
    visitor.session().await?;
    let anonymous = visitor.post("/api/account/password", change(PASSWORD, NEW_PASSWORD)).await?;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED, "{}", anonymous.text());
    assert_eq!(logs_in(&app, "alice", PASSWORD).await?, StatusCode::OK, "nothing changed yet");

    let changed = alice.post("/api/account/password", change(PASSWORD, NEW_PASSWORD)).await?;
    assert_eq!(changed.status, StatusCode::NO_CONTENT, "{}", changed.text());
    assert_eq!(alice.get("/api/datasets").await?.status, StatusCode::OK, "this session stays");
    assert_eq!(laptop.get("/api/datasets").await?.status, StatusCode::UNAUTHORIZED);
    let listed = bearer(&app, &token, Method::GET, "/api/datasets", None).await?;
    assert_eq!(listed.status, StatusCode::OK, "API tokens are credentials of their own");
    assert_eq!(admin.get("/api/datasets").await?.status, StatusCode::OK, "others are untouched");
    assert_eq!(logs_in(&app, "alice", PASSWORD).await?, StatusCode::UNAUTHORIZED);
    assert_eq!(logs_in(&app, "alice", NEW_PASSWORD).await?, StatusCode::OK);

    // A wrong current password is a failed login: a held session cannot guess without limit.
    for _ in 0..PAIR.free {
        let wrong =
            alice.post("/api/account/password", change("guess", "guessed password")).await?;
        assert_eq!(wrong.status, StatusCode::FORBIDDEN, "{}", wrong.text());
    }
    let throttled =
        alice.post("/api/account/password", change("guess", "guessed password")).await?;
    assert_eq!(throttled.status, StatusCode::TOO_MANY_REQUESTS, "{}", throttled.text());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admins_reset_passwords_and_end_every_session() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let laptop = second_session(&app, "alice", PASSWORD).await?;
    let (_, token) = make_token(&alice, "nightly").await?;
    let users = admin.get("/api/users").await?.json()?;
    let id_of = |name: &str| {
        users
            .as_array()
            .and_then(|all| all.iter().find(|u| u["username"] == name))
            .and_then(|u| u["id"].as_i64())
            .unwrap_or(0)
    };
    let (alice_id, admin_id) = (id_of("alice"), id_of("admin"));
    let reset = |id: i64| format!("/api/users/{id}/password");

    let short = admin.put(&reset(alice_id), json!({"password": "short"})).await?;
    assert_eq!(short.status, StatusCode::BAD_REQUEST, "{}", short.text());
    assert!(short.error().contains("at least 8 characters"), "{}", short.text());
    let nobody = admin.put(&reset(alice_id + 100), json!({"password": NEW_PASSWORD})).await?;
    assert_eq!(nobody.status, StatusCode::NOT_FOUND, "{}", nobody.text());
    let not_an_id =
        admin.put("/api/users/alice/password", json!({"password": NEW_PASSWORD})).await?;
    assert!(not_an_id.status.is_client_error(), "{}", not_an_id.text());
    let own = admin.put(&reset(admin_id), json!({"password": NEW_PASSWORD})).await?;
    assert_eq!(own.status, StatusCode::CONFLICT, "{}", own.text());
    assert!(own.error().contains("account page"), "{}", own.text());
    let by_user = alice.put(&reset(admin_id), json!({"password": NEW_PASSWORD})).await?;
    assert_eq!(by_user.status, StatusCode::FORBIDDEN, "{}", by_user.text());
    assert_eq!(alice.get("/api/datasets").await?.status, StatusCode::OK, "nothing changed yet");

    let done = admin.put(&reset(alice_id), json!({"password": NEW_PASSWORD})).await?;
    assert_eq!(done.status, StatusCode::NO_CONTENT, "{}", done.text());
    for session in [&alice, &laptop] {
        assert_eq!(session.get("/api/datasets").await?.status, StatusCode::UNAUTHORIZED);
    }
    let listed = bearer(&app, &token, Method::GET, "/api/datasets", None).await?;
    assert_eq!(listed.status, StatusCode::OK, "API tokens are credentials of their own");
    assert_eq!(admin.get("/api/datasets").await?.status, StatusCode::OK, "the admin stays");
    assert_eq!(logs_in(&app, "alice", PASSWORD).await?, StatusCode::UNAUTHORIZED);
    assert_eq!(logs_in(&app, "alice", NEW_PASSWORD).await?, StatusCode::OK);
    Ok(())
}
