//! Every route the server declares, found by reading its source, asked by someone without a
//! session, by another user and by a non-admin: each must answer as its access class says. A
//! route added without a line in `access` below fails this test, so none ships unchecked. The
//! OpenAI-compatible routes under `/v1/` take an API token only: a session is refused there too.

use std::path::Path;

use axum::body::Body;
use axum::http::{Method, StatusCode, header};

use crate::common::{Client, TestApp, tiny_job};

/// Who may use a route.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Access {
    /// Anyone, without a session (health, metrics for scrapers, the login flow).
    Public,
    /// Any logged-in user, on nothing that belongs to someone else.
    User,
    /// A logged-in user on their own job or dataset (`{id}`): anyone else gets 404, so ids leak
    /// nothing.
    Owner,
    /// Administrators only: others get 403.
    Admin,
    /// An API token only (the OpenAI-compatible routes): no credential and a session cookie both
    /// get 401. Which models a token reaches is `openai.rs`'s to check.
    Token,
}

fn access(method: &str, path: &str) -> Option<Access> {
    use Access::*;
    Some(match (method, path) {
        ("GET", "/healthz" | "/metrics" | "/api/session") => Public,
        // A demo link is its own key: without it, these answer 404.
        ("GET", "/api/demo/{token}" | "/api/demo/{token}/events") => Public,
        ("POST", "/api/setup" | "/api/login") => Public,
        ("POST", "/api/logout") => User,
        ("GET" | "POST", "/api/jobs" | "/api/datasets") => User,
        ("GET", "/api/models" | "/api/gpus" | "/api/job-defaults") => User,
        ("POST", "/api/models/import" | "/api/plan" | "/api/models/pull") => User,
        ("GET", "/api/models/pulls") => User,
        ("GET", "/api/jobs/{id}" | "/api/jobs/{id}/metrics" | "/api/jobs/{id}/events") => Owner,
        ("GET", "/api/jobs/{id}/log" | "/api/jobs/{id}/checkpoints") => Owner,
        ("GET", "/api/jobs/{id}/checkpoints/{name}/files/{file}") => Owner,
        ("GET", "/api/jobs/{id}/checkpoints/{name}/archive") => Owner,
        ("GET", "/api/jobs/{id}/checkpoints/{name}/gguf") => Owner,
        ("POST", "/api/jobs/{id}/checkpoints/{name}/generate") => Owner,
        ("POST", "/api/jobs/{id}/base-model/generate") => Owner,
        ("GET", "/api/jobs/{id}/answers") => Owner,
        ("POST", "/api/jobs/{id}/cancel" | "/api/jobs/{id}/resume") => Owner,
        ("GET" | "DELETE", "/api/datasets/{id}") => Owner,
        ("GET", "/api/datasets/{id}/preview") => Owner,
        ("GET", "/api/datasets/{id}/resumable-jobs") => Owner,
        ("GET", "/api/datasets/{id}/eval-sample") => Owner,
        ("GET" | "POST", "/api/users") => Admin,
        ("DELETE", "/api/users/{id}") => Admin,
        ("PUT", "/api/users/{id}/password") => Admin,
        ("POST", "/api/account/password") => User,
        ("GET" | "POST", "/api/account/tokens") => User,
        ("DELETE", "/api/account/tokens/{id}") => User,
        ("GET" | "PUT", "/api/account/webhook") => User,
        ("POST", "/api/account/webhook/test") => User,
        ("PATCH" | "DELETE", "/api/jobs/{id}") => Owner,
        ("GET", "/api/jobs/{id}/timeline") => Owner,
        ("PUT" | "DELETE", "/api/jobs/{id}/demo") => Owner,
        ("DELETE", "/api/jobs/{id}/checkpoints/{name}") => Owner,
        ("GET", "/api/storage") => Admin,
        ("PUT", "/api/storage/users/{id}/quota") => Admin,
        ("DELETE", "/api/storage/models/{name}") => Admin,
        ("GET", "/v1/models" | "/v1/models/{*id}") => Token,
        ("POST", "/v1/completions" | "/v1/chat/completions") => Token,
        _ => return None,
    })
}

/// Every `(METHOD, path)` the `.route(...)` calls under `server/src` declare, pages left out
/// (they are shells that fetch the API).
fn declared_routes() -> Vec<(String, String)> {
    fn walk(dir: &Path, out: &mut Vec<(String, String)>) {
        let mut entries: Vec<_> =
            std::fs::read_dir(dir).expect("source folder").flatten().map(|e| e.path()).collect();
        entries.sort();
        for path in entries {
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n != "pages") {
                    walk(&path, out);
                }
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("source file");
                out.extend(routes_in(&text));
            }
        }
    }
    let mut routes = Vec::new();
    walk(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &mut routes);
    routes
}

/// `.route("PATH", get(a).post(b))` calls in `text`: each method with its path.
fn routes_in(text: &str) -> Vec<(String, String)> {
    let mut routes = Vec::new();
    for piece in text.split(".route(\"").skip(1) {
        let Some((path, rest)) = piece.split_once('"') else { continue };
        // The handlers run to the call's closing parenthesis.
        let mut depth = 1;
        let end = rest
            .char_indices()
            .find(|&(_, c)| {
                depth += match c {
                    '(' => 1,
                    ')' => -1,
                    _ => 0,
                };
                depth == 0
            })
            .map_or(rest.len(), |(i, _)| i);
        let handlers = &rest[..end];
        for method in ["get", "post", "put", "patch", "delete"] {
            let called = handlers.match_indices(&format!("{method}(")).any(|(i, _)| {
                i == 0 || !handlers[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_')
            });
            if called {
                routes.push((method.to_uppercase(), path.to_string()));
            }
        }
    }
    routes
}

async fn ask(client: &Client, method: &str, path: &str) -> anyhow::Result<StatusCode> {
    let method = Method::from_bytes(method.as_bytes())?;
    let mut builder = client.builder(method.clone(), path);
    let body = if method == Method::GET || method == Method::DELETE {
        Body::empty()
    } else {
        builder = builder.header(header::CONTENT_TYPE, "application/json");
        Body::from("{}")
    };
    Ok(client.send(builder.body(body)?).await?.status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_declared_route_answers_as_its_access_class_says() -> anyhow::Result<()> {
    let routes = declared_routes();
    assert!(routes.len() >= 25, "found only {} routes: {routes:?}", routes.len());
    let unclassified: Vec<_> = routes.iter().filter(|(m, p)| access(m, p).is_none()).collect();
    assert!(
        unclassified.is_empty(),
        "routes without an authorization expectation (add them to `access`): {unclassified:?}"
    );

    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let bob = app.user(&admin, "bob").await?;
    let anonymous = app.client();
    let data = b"{\"prompt\": \"2+2=\", \"completion\": \"4\"}\n";
    let dataset = alice.upload("sums.jsonl", data, None).await?.json()?["id"].as_i64().unwrap_or(0);
    let job = alice.submit(tiny_job(dataset, 1)).await?;
    alice.wait_job(job, 300, |j| j["status"] == "completed").await?;
    let users = admin.get("/api/users").await?.json()?;
    let alice_id = users
        .as_array()
        .and_then(|u| u.iter().find(|u| u["username"] == "alice"))
        .and_then(|u| u["id"].as_i64())
        .unwrap_or(0);

    for (method, template) in &routes {
        let class = access(method, template).unwrap_or(Access::Public);
        let id = if template.starts_with("/api/datasets/") {
            dataset
        } else if template.starts_with("/api/users/") {
            alice_id
        } else {
            job
        };
        let path = template
            .replace("{id}", &id.to_string())
            .replace("{name}", "final")
            .replace("{file}", "config.json")
            .replace("{*id}", &format!("job-{job}/final"));
        let path =
            if path.ends_with("/preview") { format!("{path}?model=preset:tiny") } else { path };

        let status = ask(&anonymous, method, &path).await?;
        match class {
            Access::Public => {
                assert!(!status.is_server_error(), "{method} {path} anonymous: {status}")
            }
            Access::Token => assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {path}"),
            _ => assert!(
                [StatusCode::UNAUTHORIZED, StatusCode::FORBIDDEN].contains(&status),
                "{method} {path} answered {status} without a session"
            ),
        }
        if class == Access::Public {
            continue;
        }
        // Logging out ends bob's session: ask it last, below.
        if template == "/api/logout" {
            continue;
        }
        let status = ask(&bob, method, &path).await?;
        match class {
            Access::Owner => assert_eq!(
                status,
                StatusCode::NOT_FOUND,
                "{method} {path}: another user got {status}"
            ),
            Access::Token => assert_eq!(
                status,
                StatusCode::UNAUTHORIZED,
                "{method} {path}: a session cookie got {status}"
            ),
            Access::Admin => assert_eq!(
                status,
                StatusCode::FORBIDDEN,
                "{method} {path}: a non-admin got {status}"
            ),
            _ => assert!(
                ![StatusCode::UNAUTHORIZED, StatusCode::FORBIDDEN].contains(&status)
                    && !status.is_server_error(),
                "{method} {path}: a logged-in user got {status}"
            ),
        }
    }
    assert_eq!(ask(&bob, "POST", "/api/logout").await?, StatusCode::OK);
    // Alice's things are still hers, untouched by everyone else's attempts.
    assert_eq!(alice.get(&format!("/api/jobs/{job}")).await?.status, StatusCode::OK);
    assert_eq!(alice.get(&format!("/api/datasets/{dataset}")).await?.status, StatusCode::OK);
    Ok(())
}
