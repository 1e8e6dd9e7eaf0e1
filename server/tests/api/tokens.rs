//! Personal API tokens: made and revoked by their owner, acting as that user with
//! `Authorization: Bearer` and no CSRF token, stored only as a hash, and dead the moment they
//! are revoked or their user is deleted.

use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use serde_json::{Value, json};

use crate::common::{Client, Reply, TestApp};

/// A request with a bearer token and nothing else: no cookie, no CSRF header.
pub(crate) async fn bearer(
    app: &TestApp,
    token: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> anyhow::Result<Reply> {
    let mut builder = Request::builder()
        .method(method)
        .uri(path)
        .header(header::AUTHORIZATION, format!("Bearer {token}"));
    let body = match body {
        Some(body) => {
            builder = builder.header(header::CONTENT_TYPE, "application/json");
            Body::from(body.to_string())
        }
        None => Body::empty(),
    };
    app.client().send(builder.body(body)?).await
}

/// Makes a token named `name` for `client`; returns (id, token).
pub(crate) async fn make_token(client: &Client, name: &str) -> anyhow::Result<(i64, String)> {
    let reply = client.post("/api/account/tokens", json!({ "name": name })).await?;
    anyhow::ensure!(reply.status == StatusCode::CREATED, "create token: {}", reply.text());
    let body = reply.json()?;
    let id = body["id"].as_i64().ok_or_else(|| anyhow::anyhow!("no id in {body}"))?;
    let token = body["token"].as_str().ok_or_else(|| anyhow::anyhow!("no token in {body}"))?;
    Ok((id, token.to_string()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_cannot_make_tokens() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let (_, token) = make_token(&alice, "stolen").await?;

    let minted = bearer(
        &app,
        &token,
        Method::POST,
        "/api/account/tokens",
        Some(json!({"name": "successor"})),
    )
    .await?;
    assert_eq!(minted.status, StatusCode::FORBIDDEN, "{}", minted.text());
    assert_eq!(
        minted.error(),
        "an API token cannot do this: log in with your password (the account page)"
    );
    // A token with a session cookie beside it is still judged by the token.
    let request = alice
        .builder(Method::POST, "/api/account/tokens")
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .header(header::CONTENT_TYPE, "application/json");
    let both = alice.send(request.body(Body::from(json!({"name": "x"}).to_string()))?).await?;
    assert_eq!(both.status, StatusCode::FORBIDDEN, "{}", both.text());

    // The token still reads, and its owner's password session still makes tokens.
    let listed = bearer(&app, &token, Method::GET, "/api/account/tokens", None).await?;
    assert_eq!(listed.status, StatusCode::OK, "{}", listed.text());
    assert_eq!(listed.json()?.as_array().map(Vec::len), Some(1), "only the first token exists");
    make_token(&alice, "from the browser").await?;
    Ok(())
}

fn tiny_plan() -> Value {
    json!({"model": "preset:tiny", "gpu": "cpu", "seq_len": 64, "micro_batch": 1})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_acts_as_its_user_without_csrf_and_a_cookie_still_needs_it() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let (_, token) = make_token(&alice, "  laptop script ").await?;
    assert!(token.starts_with("sluice_") && token.len() == 7 + 64, "{token}");

    // Reading and writing as alice, with no cookie and no CSRF token.
    let jobs = bearer(&app, &token, Method::GET, "/api/jobs", None).await?;
    assert_eq!(jobs.status, StatusCode::OK, "{}", jobs.text());
    let upload = {
        let boundary = "b";
        let body = format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"s.jsonl\"\r\n\r\n\
             {{\"prompt\": \"2+2=\", \"completion\": \"4\"}}\n\r\n--{boundary}--\r\n"
        );
        let request = Request::builder()
            .method(Method::POST)
            .uri("/api/datasets")
            .header(header::AUTHORIZATION, format!("Bearer {token}"))
            .header(header::CONTENT_TYPE, format!("multipart/form-data; boundary={boundary}"))
            .body(Body::from(body))?;
        app.client().send(request).await?
    };
    assert_eq!(upload.status, StatusCode::CREATED, "{}", upload.text());
    let dataset = upload.json()?["id"].as_i64().unwrap_or(0);
    // It is alice's: she sees it through her session, another user does not.
    assert_eq!(alice.get(&format!("/api/datasets/{dataset}")).await?.status, StatusCode::OK);
    let bob = app.user(&admin, "bob").await?;
    assert_eq!(bob.get(&format!("/api/datasets/{dataset}")).await?.status, StatusCode::NOT_FOUND);

    // The same write with alice's cookie and no CSRF header is still refused.
    let mut no_csrf = alice.clone();
    no_csrf.csrf = None;
    let refused = no_csrf.post("/api/plan", tiny_plan()).await?;
    assert_eq!(refused.status, StatusCode::FORBIDDEN, "{}", refused.text());
    assert!(refused.error().contains("CSRF"), "{}", refused.text());
    let planned = bearer(&app, &token, Method::POST, "/api/plan", Some(tiny_plan())).await?;
    assert_eq!(planned.status, StatusCode::OK, "{}", planned.text());

    // A bearer request is judged by its token alone: a wrong one with alice's good cookie and
    // CSRF token is refused, reading or writing.
    let wrong = format!("sluice_{}", "0".repeat(64));
    for (method, path) in [(Method::GET, "/api/jobs"), (Method::POST, "/api/plan")] {
        let mut builder = alice
            .builder(method.clone(), path)
            .header(header::AUTHORIZATION, format!("Bearer {wrong}"));
        let body = if method == Method::POST {
            builder = builder.header(header::CONTENT_TYPE, "application/json");
            Body::from(tiny_plan().to_string())
        } else {
            Body::empty()
        };
        let reply = alice.send(builder.body(body)?).await?;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{method} {path}: {}", reply.text());
    }
    let reply = bearer(&app, &wrong, Method::GET, "/api/jobs", None).await?;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    assert!(reply.error().contains("API token"), "{}", reply.text());
    for malformed in ["", "sluice_xyz", "not-a-token", &token.to_uppercase()] {
        let reply = bearer(&app, malformed, Method::GET, "/api/jobs", None).await?;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{malformed:?}");
    }
    // Another scheme is no credential: with it, the cookie decides as before.
    let request = alice
        .builder(Method::GET, "/api/jobs")
        .header(header::AUTHORIZATION, "Basic YWxpY2U6eA==")
        .body(Body::empty())?;
    assert_eq!(alice.send(request).await?.status, StatusCode::OK);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_listed_hashed_and_stop_when_revoked_or_their_user_goes() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let (first, token) = make_token(&alice, "ci").await?;
    let (second, other) = make_token(&alice, "notebook").await?;

    let list = alice.get("/api/account/tokens").await?.json()?;
    let names: Vec<&str> =
        list.as_array().into_iter().flatten().filter_map(|t| t["name"].as_str()).collect();
    assert_eq!(names, ["notebook", "ci"], "newest first: {list}");
    assert_eq!(list[1]["prefix"], json!(&token[..15]), "{list}");
    assert_eq!(list[1]["last_used_at"], Value::Null, "not used yet: {list}");
    assert!(!list.to_string().contains(&token[15..]), "the list shows a token: {list}");
    // Only the SHA-256 is kept: the token itself is nowhere in the database.
    let stored: Vec<(String, String)> =
        sqlx::query_as("SELECT token_hash, prefix FROM api_tokens ORDER BY id")
            .fetch_all(app.state.pool())
            .await?;
    assert_eq!(stored.len(), 2);
    for (hash, prefix) in &stored {
        assert_eq!(hash.len(), 64, "{hash}");
        assert!(hash != &token && !hash.contains(&token[7..]) && prefix.len() == 15);
    }
    use sha2::Digest;
    let expected: String =
        sha2::Sha256::digest(token.as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(stored[0].0, expected);

    assert_eq!(bearer(&app, &token, Method::GET, "/api/jobs", None).await?.status, StatusCode::OK);
    let list = alice.get("/api/account/tokens").await?.json()?;
    assert!(list[1]["last_used_at"].as_i64().is_some_and(|t| t > 0), "{list}");
    assert_eq!(list[0]["last_used_at"], Value::Null, "the other was not used: {list}");

    // Someone else can neither see nor revoke alice's tokens.
    let bob = app.user(&admin, "bob").await?;
    assert_eq!(bob.get("/api/account/tokens").await?.json()?, json!([]));
    let theirs = bob.delete(&format!("/api/account/tokens/{first}")).await?;
    assert_eq!(theirs.status, StatusCode::NOT_FOUND, "{}", theirs.text());
    assert_eq!(bearer(&app, &token, Method::GET, "/api/jobs", None).await?.status, StatusCode::OK);

    // Revoked: the next request fails, the other token still works.
    assert_eq!(
        alice.delete(&format!("/api/account/tokens/{first}")).await?.status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(
        alice.delete(&format!("/api/account/tokens/{first}")).await?.status,
        StatusCode::NOT_FOUND
    );
    for (method, body) in [(Method::GET, None), (Method::POST, Some(tiny_plan()))] {
        let path = if body.is_some() { "/api/plan" } else { "/api/jobs" };
        let reply = bearer(&app, &token, method, path, body).await?;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{path}: {}", reply.text());
    }
    assert_eq!(bearer(&app, &other, Method::GET, "/api/jobs", None).await?.status, StatusCode::OK);

    // The user deleted: their token dies with them.
    let users = admin.get("/api/users").await?.json()?;
    let alice_id = users
        .as_array()
        .and_then(|u| u.iter().find(|u| u["username"] == "alice"))
        .and_then(|u| u["id"].as_i64())
        .unwrap_or(0);
    assert_eq!(
        admin.delete(&format!("/api/users/{alice_id}")).await?.status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(
        bearer(&app, &other, Method::GET, "/api/jobs", None).await?.status,
        StatusCode::UNAUTHORIZED
    );
    let _ = second;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admins_token_acts_as_admin_and_a_users_does_not() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let (_, admin_token) = make_token(&admin, "ops").await?;
    let (_, alice_token) = make_token(&alice, "mine").await?;
    assert_eq!(
        bearer(&app, &admin_token, Method::GET, "/api/users", None).await?.status,
        StatusCode::OK
    );
    let made = bearer(
        &app,
        &admin_token,
        Method::POST,
        "/api/users",
        Some(json!({"username": "carol", "password": crate::common::PASSWORD})),
    )
    .await?;
    assert_eq!(made.status, StatusCode::CREATED, "{}", made.text());
    assert_eq!(
        bearer(&app, &alice_token, Method::GET, "/api/users", None).await?.status,
        StatusCode::FORBIDDEN
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_names_and_counts_are_bounded() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    for (body, says) in [
        (json!({"name": "   "}), "name: give the token a name"),
        (json!({"name": "x".repeat(65)}), "name: at most 64 characters"),
        (json!({"name": "a\nb"}), "name: no control characters"),
        (json!({}), "name"),
        (json!({"name": "ok", "role": "admin"}), "role"),
    ] {
        let reply = admin.post("/api/account/tokens", body.clone()).await?;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{body}: {}", reply.text());
        assert!(reply.error().contains(says), "{body}: {}", reply.text());
    }
    // Without a session or a token, nothing.
    let anonymous = app.client().get("/api/account/tokens").await?;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
    for n in 0..50 {
        make_token(&admin, &format!("token {n}")).await?;
    }
    let over = admin.post("/api/account/tokens", json!({"name": "one more"})).await?;
    assert_eq!(over.status, StatusCode::CONFLICT, "{}", over.text());
    assert!(over.error().contains("revoke one first"), "{}", over.text());
    assert_eq!(admin.get("/api/account/tokens").await?.json()?.as_array().map(Vec::len), Some(50));
    Ok(())
}
