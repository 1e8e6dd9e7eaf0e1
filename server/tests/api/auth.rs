//! Setup, login, logout, CSRF, session expiry, user management, the login throttle.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use axum::body::{Body, to_bytes};
use axum::extract::connect_info::MockConnectInfo;
use axum::http::{Method, StatusCode, header};
use serde_json::json;
use sluice::app;
use sluice::auth::throttle::{ADDRESS, ALERT_FAILURES, PAIR};
use tower::ServiceExt;

use crate::common::{Client, PASSWORD, Reply, TestApp};

/// A login as `client` sends it, arriving from `from` as the socket would report it (`None`:
/// no socket, as with every other request in these tests).
async fn login_from(
    client: &Client,
    from: Option<[u8; 4]>,
    username: &str,
    password: &str,
) -> anyhow::Result<Reply> {
    let request = client
        .builder(Method::POST, "/api/login")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(json!({"username": username, "password": password}).to_string()))?;
    let router = app(client.state.clone());
    let response = match from {
        Some(ip) => {
            let peer = SocketAddr::new(IpAddr::V4(Ipv4Addr::from(ip)), 40000);
            router.layer(MockConnectInfo(peer)).oneshot(request).await?
        }
        None => router.oneshot(request).await?,
    };
    let status = response.status();
    let headers = response.headers().clone();
    let body = to_bytes(response.into_body(), 1 << 20).await?;
    Ok(Reply { status, headers, body })
}

/// A client with a CSRF token and no session, as the login page has.
async fn visitor(app: &TestApp) -> anyhow::Result<Client> {
    let mut client = app.client();
    client.session().await?;
    Ok(client)
}

async fn session_rows(app: &TestApp) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar("SELECT COUNT(*) FROM sessions").fetch_one(app.state.pool()).await?)
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn visitors_get_csrf_tokens_but_no_session_rows() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    for _ in 0..20 {
        app.client().session().await?;
    }
    let mut tab = app.client();
    let first = tab.session().await?;
    assert_eq!(tab.session().await?["csrf"], first["csrf"], "a second tab keeps the token");
    assert_eq!(session_rows(&app).await?, 0, "anonymous visitors are not stored");

    // A token is good only with the cookie it was made for.
    let other = visitor(&app).await?;
    let mut borrowed = visitor(&app).await?;
    borrowed.csrf.clone_from(&other.csrf);
    let body = json!({"username": "admin", "password": PASSWORD});
    assert_eq!(borrowed.post("/api/setup", body.clone()).await?.status, StatusCode::FORBIDDEN);
    let mut cookieless = visitor(&app).await?;
    cookieless.cookie = None;
    assert_eq!(cookieless.post("/api/setup", body.clone()).await?.status, StatusCode::FORBIDDEN);
    let mut forged = visitor(&app).await?;
    forged.cookie = Some(format!("anon-{}", "0".repeat(64)));
    assert_eq!(forged.post("/api/setup", body.clone()).await?.status, StatusCode::FORBIDDEN);
    assert_eq!(session_rows(&app).await?, 0);

    let admin = app.admin().await?;
    assert_eq!(session_rows(&app).await?, 1, "setup logs the admin in");
    let logout = admin.post("/api/logout", json!({})).await?;
    assert_eq!(logout.status, StatusCode::OK);
    assert!(logout.header(header::SET_COOKIE).starts_with("sluice_session=anon-"));
    assert_eq!(session_rows(&app).await?, 0, "logout leaves no row behind");

    // Expired sessions are pruned when the next one starts.
    let mut old = visitor(&app).await?;
    assert_eq!(old.login("admin", PASSWORD).await?.status, StatusCode::OK);
    sqlx::query("UPDATE sessions SET expires_at = 0").execute(app.state.pool()).await?;
    let mut new = visitor(&app).await?;
    assert_eq!(new.login("admin", PASSWORD).await?.status, StatusCode::OK);
    assert_eq!(session_rows(&app).await?, 1);
    assert_eq!(new.get("/api/datasets").await?.status, StatusCode::OK);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cookies_are_secure_only_over_https() -> anyhow::Result<()> {
    for https in [false, true] {
        let app = TestApp::with_config(|config| config.https = https).await?;
        let anonymous = app.client().get("/api/session").await?.header(header::SET_COOKIE);
        let mut client = visitor(&app).await?;
        let setup =
            client.post("/api/setup", json!({"username": "admin", "password": PASSWORD})).await?;
        assert_eq!(setup.status, StatusCode::OK, "{}", setup.text());
        client.adopt(&setup)?;
        let logged_in = setup.header(header::SET_COOKIE);
        let logout = client.post("/api/logout", json!({})).await?.header(header::SET_COOKIE);
        for cookie in [anonymous, logged_in, logout] {
            assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Lax"), "{cookie}");
            let secure = cookie.split(';').any(|part| part.trim() == "Secure");
            assert_eq!(secure, https, "https {https}: {cookie}");
        }
    }
    Ok(())
}

/// A refusal to try now: 429, `Retry-After` in whole seconds, and a JSON message.
fn assert_throttled(reply: &Reply, message: &str) {
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS, "{}", reply.text());
    let retry = reply.header(header::RETRY_AFTER).parse::<u64>();
    assert!(retry.as_ref().is_ok_and(|s| (1..=300).contains(s)), "Retry-After: {retry:?}");
    assert!(reply.error().contains(message), "{}", reply.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_logins_slow_the_address_and_the_pair_never_the_owner() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    app.user(&admin, "alice").await?;
    let guesser = visitor(&app).await?;
    let stranger = Some([10, 0, 0, 1]);
    let home = Some([10, 0, 0, 2]);

    // The same for a real account and for a name nobody has: the throttle tells nothing.
    for name in ["alice", "nobody"] {
        for _ in 0..PAIR.free {
            let reply = login_from(&guesser, stranger, name, "wrong password").await?;
            assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{}", reply.text());
        }
        let blocked = login_from(&guesser, stranger, name, PASSWORD).await?;
        assert_throttled(&blocked, "too many failed logins for this account from this address");
        assert_eq!(blocked.header(header::RETRY_AFTER), "1");
        let shouted = login_from(&guesser, stranger, &name.to_uppercase(), PASSWORD).await?;
        assert_throttled(&shouted, "for this account from this address");
    }
    // The owner, from an address that has not failed, is not refused because a stranger did,
    // and neither is the stranger's address for another account, under the address's limit.
    let owner = login_from(&visitor(&app).await?, home, "alice", PASSWORD).await?;
    assert_eq!(owner.status, StatusCode::OK, "{}", owner.text());
    let other_account = login_from(&visitor(&app).await?, stranger, "admin", PASSWORD).await?;
    assert_eq!(other_account.status, StatusCode::OK, "{}", other_account.text());

    // The stranger comes back when the wait ends and waits twice as long after the next
    // failure; the owner still gets in at every turn.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let again = login_from(&guesser, stranger, "alice", "wrong password").await?;
    assert_eq!(again.status, StatusCode::UNAUTHORIZED, "{}", again.text());
    let blocked = login_from(&guesser, stranger, "alice", PASSWORD).await?;
    assert_throttled(&blocked, "for this account from this address");
    assert_eq!(blocked.header(header::RETRY_AFTER), "2");
    let owner = login_from(&visitor(&app).await?, home, "alice", PASSWORD).await?;
    assert_eq!(owner.status, StatusCode::OK, "{}", owner.text());

    // The owner's own typos are the pair's: after the right password it starts over.
    for _ in 0..PAIR.free - 1 {
        let reply = login_from(&guesser, home, "alice", "wrong password").await?;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{}", reply.text());
    }
    let owner = login_from(&visitor(&app).await?, home, "alice", PASSWORD).await?;
    assert_eq!(owner.status, StatusCode::OK, "{}", owner.text());
    for _ in 0..PAIR.free - 1 {
        let reply = login_from(&guesser, home, "alice", "wrong password").await?;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{}", reply.text());
    }

    // One address guessing at many accounts.
    let spray = Some([10, 0, 0, 9]);
    for i in 0..ADDRESS.free {
        let reply = login_from(&guesser, spray, &format!("user{i}"), "wrong password").await?;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{}", reply.text());
    }
    let blocked = login_from(&visitor(&app).await?, spray, "admin", PASSWORD).await?;
    assert_throttled(&blocked, "too many failed logins from this address");
    let neighbour = visitor(&app).await?;
    let neighbour = login_from(&neighbour, Some([10, 0, 0, 10]), "admin", PASSWORD).await?;
    assert_eq!(neighbour.status, StatusCode::OK, "{}", neighbour.text());
    // Without a known address the clients cannot be told apart: they share one pair per
    // account, and no address count (one shared count would let any guesser lock everyone out).
    assert_eq!(
        login_from(&visitor(&app).await?, None, "admin", PASSWORD).await?.status,
        StatusCode::OK
    );
    Ok(())
}

/// The failed-login alert the admins' list shows for `username`.
async fn alert_of(admin: &Client, username: &str) -> anyhow::Result<serde_json::Value> {
    let users = admin.get("/api/users").await?.json()?;
    let user = users.as_array().and_then(|users| users.iter().find(|u| u["username"] == username));
    Ok(user.map_or(serde_json::Value::Null, |u| u["failed_logins"].clone()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guessing_from_many_addresses_alerts_the_admins_and_never_reaches_the_owner()
-> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    app.user(&admin, "alice").await?;
    let guesser = visitor(&app).await?;

    // Each address guesses too few times for its own counts, always for alice: the guard is an
    // alert, and no guess is refused because of it.
    let bots = u8::try_from(2 * ALERT_FAILURES)?;
    for bot in 0..bots {
        for _ in 0..PAIR.free - 1 {
            let reply = login_from(&guesser, Some([10, 66, 0, bot]), "alice", "guess").await?;
            assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{}", reply.text());
        }
        if u32::from(bot) + 1 == ALERT_FAILURES / (PAIR.free - 1) {
            assert!(alert_of(&admin, "alice").await?.is_null(), "not yet");
        }
    }
    let alert = alert_of(&admin, "alice").await?;
    assert_eq!(alert["count"], (PAIR.free - 1) * u32::from(bots), "{alert}");
    assert_eq!(alert["addresses"], bots, "{alert}");
    assert!(alert["last_at"].as_i64().is_some_and(|t| t > 0), "{alert}");
    assert!(alert_of(&admin, "admin").await?.is_null(), "only the account guessed at");

    // The owner, from an address of their own, logs in at once; the alert stays for the admins.
    let owner =
        login_from(&visitor(&app).await?, Some([192, 168, 1, 20]), "alice", PASSWORD).await?;
    assert_eq!(owner.status, StatusCode::OK, "{}", owner.text());
    assert!(!alert_of(&admin, "alice").await?.is_null());
    // Guesses at names nobody has raise nothing.
    for bot in 0..bots {
        let reply = login_from(&guesser, Some([10, 67, 0, bot]), "nobody", "guess").await?;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{}", reply.text());
    }
    let users = admin.get("/api/users").await?.json()?;
    assert_eq!(users.as_array().map(Vec::len), Some(2), "{users}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_users_take_as_long_as_known_ones() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    app.admin().await?;
    let guesser = visitor(&app).await?;
    let (mut known, mut unknown) = (Vec::new(), Vec::new());
    // Interleaved, so both see the same load from other tests; fewer than the free failures.
    for i in 0..PAIR.free - 1 {
        let start = Instant::now();
        let reply = login_from(&guesser, None, "admin", "wrong password").await?;
        known.push(start.elapsed());
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
        let start = Instant::now();
        let reply = login_from(&guesser, None, &format!("nobody{i}"), "wrong password").await?;
        unknown.push(start.elapsed());
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
        assert_eq!(reply.error(), "wrong username or password");
    }
    known.sort();
    unknown.sort();
    let (known, unknown) = (known[known.len() / 2], unknown[unknown.len() / 2]);
    // The same argon2 work either way; half is a margin for scheduling noise, far above the
    // ratio of a lookup alone to a hash (about 1 to 30).
    assert!(unknown * 2 >= known, "unknown user {unknown:?}, known user {known:?}");
    Ok(())
}
