//! Upload (limit, lint), list, delete, preview.

use axum::http::StatusCode;

use crate::common::TestApp;

const GOOD: &str = r#"{"instruction": "Say hi.", "input": "", "output": "Hi there!"}
{"instruction": "Add 2 and 3.", "input": "", "output": "2 + 3 = 5."}
{"instruction": "Name a colour.", "input": "", "output": "Blue."}
"#;

/// Files in the data directory's datasets folder (the demo included).
fn dataset_files(app: &TestApp) -> anyhow::Result<Vec<String>> {
    let mut names: Vec<String> = std::fs::read_dir(app.state.datasets_dir())?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()?;
    names.sort();
    Ok(names)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upload_list_show_delete() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;

    let demo = alice.demo_dataset().await?;
    let demo_view = alice.get(&format!("/api/datasets/{demo}")).await?.json()?;
    assert!(demo_view["owner"].is_null(), "{demo_view}");
    assert_eq!(demo_view["format"], "alpaca");
    assert_eq!(demo_view["records"], 1000);

    let reply = alice.upload("../../etc/my data.jsonl", GOOD.as_bytes(), None).await?;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
    let created = reply.json()?;
    assert_eq!(created["name"], "my data.jsonl", "the client's path is not used");
    assert_eq!(created["format"], "alpaca");
    assert_eq!(created["records"], 3);
    assert_eq!(created["size_bytes"], GOOD.len());
    assert_eq!(created["owner"], "alice");
    let id = created["id"].as_i64().unwrap_or(0);
    // Stored under a name the server chose.
    let files = dataset_files(&app)?;
    assert_eq!(files.len(), 2, "{files:?}");
    assert!(files.iter().all(|f| !f.contains("my data")), "{files:?}");

    let named = alice.upload("x.jsonl", GOOD.as_bytes(), Some("greetings")).await?.json()?;
    assert_eq!(named["name"], "greetings");

    let list = alice.get("/api/datasets").await?.json()?;
    assert_eq!(list.as_array().map(Vec::len), Some(3), "{list}");

    // Users cannot delete the shared demo; admins can.
    assert_eq!(alice.delete(&format!("/api/datasets/{demo}")).await?.status, StatusCode::FORBIDDEN);
    let deleted = alice.delete(&format!("/api/datasets/{id}")).await?;
    assert_eq!(deleted.status, StatusCode::OK, "{}", deleted.text());
    let deleted = deleted.json()?;
    assert_eq!(deleted["id"], id, "{deleted}");
    assert_eq!(deleted["freed_bytes"], GOOD.len(), "the file's size is freed: {deleted}");
    assert_eq!(alice.get(&format!("/api/datasets/{id}")).await?.status, StatusCode::NOT_FOUND);
    assert_eq!(dataset_files(&app)?.len(), 2);
    assert_eq!(admin.delete(&format!("/api/datasets/{demo}")).await?.status, StatusCode::OK);

    // The demo is registered once per installation, not again at the next start.
    let restarted = app.restart().await?;
    let mut again = crate::common::Client {
        state: restarted,
        cookie: alice.cookie.clone(),
        csrf: alice.csrf.clone(),
    };
    again.session().await?;
    assert!(again.demo_dataset().await.is_err());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_upload_is_413_and_leaves_nothing() -> anyhow::Result<()> {
    let app = TestApp::with_config(|c| c.max_upload_bytes = 1000).await?;
    let admin = app.admin().await?;
    let before = dataset_files(&app)?;
    let big = GOOD.repeat(20);
    assert!(big.len() > 1000);
    let reply = admin.upload("big.jsonl", big.as_bytes(), None).await?;
    assert_eq!(reply.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", reply.text());
    assert!(reply.error().contains("upload limit"), "{}", reply.text());
    assert_eq!(dataset_files(&app)?, before);
    // Just under the limit passes.
    assert_eq!(admin.upload("ok.jsonl", GOOD.as_bytes(), None).await?.status, StatusCode::CREATED);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_dataset_is_422_with_line_numbers() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let before = dataset_files(&app)?;
    let bad =
        "{\"instruction\": \"Hi\", \"output\": \"Hello\"}\n{not json\n{\"instruction\": \"x\"}\n";
    let reply = admin.upload("bad.jsonl", bad.as_bytes(), None).await?;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", reply.text());
    let body = reply.json()?;
    let problems: Vec<&str> = body["problems"]
        .as_array()
        .map(|p| p.iter().filter_map(|p| p.as_str()).collect())
        .unwrap_or_default();
    assert_eq!(problems.len(), 2, "{body}");
    assert!(problems[0].starts_with("line 2:"), "{problems:?}");
    assert!(problems[1].starts_with("line 3:"), "{problems:?}");
    assert!(body["error"].as_str().is_some_and(|e| e.contains("2 bad records")), "{body}");
    assert_eq!(dataset_files(&app)?, before, "nothing is kept");

    let garbage = admin.upload("x.jsonl", b"\xff\xfe garbage", None).await?;
    assert_eq!(garbage.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", garbage.text());
    let empty = admin.upload("x.jsonl", b"", None).await?;
    assert_eq!(empty.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", empty.text());
    let no_file = admin.post("/api/datasets", serde_json::json!({})).await?;
    assert_eq!(no_file.status, StatusCode::BAD_REQUEST, "{}", no_file.text());
    assert_eq!(dataset_files(&app)?, before);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preview_marks_trained_text_and_counts_tokens() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let id =
        admin.upload("g.jsonl", GOOD.as_bytes(), None).await?.json()?["id"].as_i64().unwrap_or(0);

    let preview = admin
        .get(&format!("/api/datasets/{id}/preview?model=preset:tiny&limit=2&seq_len=16"))
        .await?;
    assert_eq!(preview.status, StatusCode::OK, "{}", preview.text());
    let preview = preview.json()?;
    let samples = preview["samples"].as_array().cloned().unwrap_or_default();
    assert_eq!(samples.len(), 2, "{preview}");
    let segments = samples[0]["segments"].as_array().cloned().unwrap_or_default();
    let text: String = segments.iter().filter_map(|s| s["text"].as_str()).collect();
    let trained: String = segments
        .iter()
        .filter(|s| s["trained"] == true)
        .filter_map(|s| s["text"].as_str())
        .collect();
    let prompt: String = segments
        .iter()
        .filter(|s| s["trained"] == false)
        .filter_map(|s| s["text"].as_str())
        .collect();
    assert!(text.contains("<|im_start|>user") && text.contains("Say hi."), "{text}");
    assert!(trained.contains("Hi there!"), "the reply is trained: {segments:?}");
    assert!(
        prompt.contains("Say hi.") && !trained.contains("Say hi."),
        "the prompt is not: {segments:?}"
    );

    let stats = &preview["stats"];
    assert_eq!(stats["records"], 3);
    assert_eq!(stats["seq_len"], 16);
    let tokens = stats["tokens"].as_u64().unwrap_or(0);
    let trained_tokens = stats["trained_tokens"].as_u64().unwrap_or(0);
    assert!(trained_tokens > 0 && trained_tokens < tokens && tokens <= 3 * 16, "{stats}");
    // Every sample is longer than 16 tokens with the chat template around it.
    assert_eq!(stats["truncated"], 3, "{stats}");
    let counted: u64 = stats["lengths"]
        .as_array()
        .map_or(0, |b| b.iter().filter_map(|b| b["count"].as_u64()).sum());
    assert_eq!(counted, 3, "{stats}");

    let unknown = admin.get(&format!("/api/datasets/{id}/preview?model=preset:huge")).await?;
    assert_eq!(unknown.status, StatusCode::BAD_REQUEST);
    let missing = admin.get(&format!("/api/datasets/{id}/preview")).await?;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert!(missing.error().contains("model"), "{}", missing.text());
    Ok(())
}

/// One part of a hand-built multipart body: a field's name, a file name if it is a file, and
/// its bytes.
pub(crate) struct Part<'a>(pub &'a str, pub Option<&'a str>, pub &'a [u8]);

/// Posts `parts`, in this order, as `multipart/form-data` to `path`.
pub(crate) async fn post_parts(
    client: &crate::common::Client,
    path: &str,
    parts: &[Part<'_>],
) -> anyhow::Result<crate::common::Reply> {
    let boundary = "sluice-parts-boundary";
    let mut body = Vec::new();
    for Part(name, file_name, bytes) in parts {
        let file = file_name.map(|f| format!("; filename=\"{f}\"")).unwrap_or_default();
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"{file}\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(bytes);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    let request = client
        .builder(axum::http::Method::POST, path)
        .header(
            axum::http::header::CONTENT_TYPE,
            format!("multipart/form-data; boundary={boundary}"),
        )
        .body(axum::body::Body::from(body))?;
    client.send(request).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fields_other_than_the_file_are_refused_past_their_limit() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let before = dataset_files(&app)?;
    let huge = vec![b'a'; 2 << 20];
    // After the file, so it has been streamed to a temporary file that must go again.
    for (field, first) in [("name", false), ("name", true), ("comment", false)] {
        let file = Part("file", Some("g.jsonl"), GOOD.as_bytes());
        let big = Part(field, None, &huge);
        let parts = if first { [big, file] } else { [file, big] };
        let reply = post_parts(&admin, "/api/datasets", &parts).await?;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{field}: {}", reply.text());
        assert_eq!(
            reply.error(),
            format!("the multipart field \"{field}\" is longer than 1024 bytes"),
            "{}",
            reply.text()
        );
        assert_eq!(dataset_files(&app)?, before, "{field}: no temporary file is left");
    }
    assert_eq!(admin.get("/api/datasets").await?.json()?.as_array().map(Vec::len), Some(1));

    // A name at the limit is fine (and cut to 200 characters, as ever).
    let name = "n".repeat(1024);
    let parts =
        [Part("file", Some("g.jsonl"), GOOD.as_bytes()), Part("name", None, name.as_bytes())];
    let reply = post_parts(&admin, "/api/datasets", &parts).await?;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
    assert_eq!(reply.json()?["name"].as_str().map(str::len), Some(200));
    Ok(())
}

/// A stopped job (cancelled or interrupted) resumes by reading its dataset again: deleting the
/// dataset names those jobs first, and afterwards they say why they cannot resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_dataset_names_and_ends_the_resume_of_its_stopped_jobs() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let data = alice.upload("mine.jsonl", GOOD.as_bytes(), None).await?.json()?;
    let other = alice.upload("other.jsonl", GOOD.as_bytes(), None).await?.json()?;
    let (data, other) = (data["id"].as_i64().unwrap_or(0), other["id"].as_i64().unwrap_or(0));
    let owner: i64 = sqlx::query_scalar("SELECT id FROM users WHERE username = 'alice'")
        .fetch_one(app.state.pool())
        .await?;
    let config = serde_json::json!({"steps": 4, "seq_len": 64}).to_string();
    let mut ids = Vec::new();
    for (name, dataset, status) in [
        ("stopped", data, "cancelled"),
        ("cut off", data, "interrupted"),
        ("done", data, "completed"),
        ("elsewhere", other, "cancelled"),
    ] {
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO jobs (owner_id, name, model, dataset_id, device, config, status, queue_seq,
                               total_steps, step, created_at)
             VALUES (?, ?, 'preset:tiny', ?, 'cpu', ?, ?, 0, 4, 2, 0) RETURNING id",
        )
        .bind(owner)
        .bind(name)
        .bind(dataset)
        .bind(&config)
        .bind(status)
        .fetch_one(app.state.pool())
        .await?;
        ids.push(id);
    }
    let (stopped, cut_off, done, elsewhere) = (ids[0], ids[1], ids[2], ids[3]);
    let before = alice.get(&format!("/api/jobs/{stopped}")).await?.json()?;
    assert_eq!(before["resumable"], true, "{before}");
    assert!(before["resume_blocked"].is_null(), "{before}");

    // What the delete's confirmation names: the stopped jobs on this dataset only.
    let named = alice.get(&format!("/api/datasets/{data}/resumable-jobs")).await?;
    assert_eq!(named.status, StatusCode::OK, "{}", named.text());
    assert_eq!(
        named.json()?,
        serde_json::json!([{"id": stopped, "name": "stopped"}, {"id": cut_off, "name": "cut off"}])
    );
    // Another user's dataset stays private here too.
    let bob = app.user(&admin, "bob").await?;
    let hidden = bob.get(&format!("/api/datasets/{data}/resumable-jobs")).await?;
    assert_eq!(hidden.status, StatusCode::NOT_FOUND);

    let deleted = alice.delete(&format!("/api/datasets/{data}")).await?.json()?;
    assert_eq!(deleted["resume_ended"], serde_json::json!([stopped, cut_off]), "{deleted}");
    for id in [stopped, cut_off] {
        let job = alice.get(&format!("/api/jobs/{id}")).await?.json()?;
        assert_eq!(job["resumable"], false, "{job}");
        let why = job["resume_blocked"].as_str().unwrap_or_default();
        assert!(why.contains("dataset was deleted"), "{job}");
        let refused = alice.post(&format!("/api/jobs/{id}/resume"), serde_json::json!({})).await?;
        assert_eq!(refused.status, StatusCode::CONFLICT, "{}", refused.text());
        assert!(refused.error().contains("dataset was deleted"), "{}", refused.text());
    }
    // A finished job was never resumable, and one on another dataset still is.
    let finished = alice.get(&format!("/api/jobs/{done}")).await?.json()?;
    assert!(finished["resume_blocked"].is_null(), "{finished}");
    let untouched = alice.get(&format!("/api/jobs/{elsewhere}")).await?.json()?;
    assert_eq!(untouched["resumable"], true, "{untouched}");

    // A stopped job that evaluates with a dataset: deleting that one ends its resume too (the
    // delete clears the job's evaluation dataset, which would otherwise resume without it).
    let held_out = alice.upload("held-out.jsonl", GOOD.as_bytes(), None).await?.json()?;
    let held_out = held_out["id"].as_i64().unwrap_or(0);
    sqlx::query("UPDATE jobs SET eval_dataset_id = ? WHERE id = ?")
        .bind(held_out)
        .bind(elsewhere)
        .execute(app.state.pool())
        .await?;
    let named = alice.get(&format!("/api/datasets/{held_out}/resumable-jobs")).await?.json()?;
    assert_eq!(named, serde_json::json!([{"id": elsewhere, "name": "elsewhere"}]));
    let deleted = alice.delete(&format!("/api/datasets/{held_out}")).await?.json()?;
    assert_eq!(deleted["resume_ended"], serde_json::json!([elsewhere]), "{deleted}");
    let job = alice.get(&format!("/api/jobs/{elsewhere}")).await?.json()?;
    assert!(job["eval_dataset"].is_null(), "{job}");
    assert_eq!(job["resumable"], false, "{job}");
    let why = job["resume_blocked"].as_str().unwrap_or_default();
    assert!(why.contains("evaluation dataset was deleted"), "{job}");
    let refused =
        alice.post(&format!("/api/jobs/{elsewhere}/resume"), serde_json::json!({})).await?;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{}", refused.text());
    assert!(refused.error().contains("evaluation dataset was deleted"), "{}", refused.text());
    // A delete refused (a running job evaluates with it) ends no resume.
    let kept = alice.upload("kept.jsonl", GOOD.as_bytes(), None).await?.json()?;
    let kept = kept["id"].as_i64().unwrap_or(0);
    sqlx::query("UPDATE jobs SET eval_dataset_id = ? WHERE id IN (?, ?)")
        .bind(kept)
        .bind(done)
        .bind(stopped)
        .execute(app.state.pool())
        .await?;
    sqlx::query("UPDATE jobs SET status = 'running' WHERE id = ?")
        .bind(done)
        .execute(app.state.pool())
        .await?;
    let refused = alice.delete(&format!("/api/datasets/{kept}")).await?;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{}", refused.text());
    let resume_ended: Option<String> =
        sqlx::query_scalar("SELECT resume_ended FROM jobs WHERE id = ?")
            .bind(stopped)
            .fetch_one(app.state.pool())
            .await?;
    assert_eq!(resume_ended, None, "a refused delete rolls its marks back");
    Ok(())
}
