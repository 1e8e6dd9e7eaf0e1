//! Task evaluation in the API: a sample of what a job's evaluation will compare (refused, with
//! the setting and record named, for a set that does not suit the metric), a finished job's
//! answers before and after training, and the base model answering beside a checkpoint; each
//! with the job's or dataset's own access rules.

use axum::http::StatusCode;
use serde_json::{Value, json};

use crate::common::{Client, TestApp, tiny_job};
use crate::datasets::{Part, post_parts};

/// 64 requests whose answer is always "ok": a random-init model does not say it, one trained
/// on them for 40 steps does (as `engine/tests/task_eval.rs`).
fn ok_dataset() -> String {
    let words = ["river", "stone", "cloud", "maple", "amber", "north", "quiet", "lemon"];
    (0..64)
        .map(|i| {
            let (a, b) = (words[i % 8], words[(i / 8) % 8]);
            json!({"instruction": format!("{a} {b} {i}: reply"), "input": "", "output": "ok"})
                .to_string()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The job that learns it, with an exact-match evaluation on its last eighth.
fn ok_job(dataset: i64) -> Value {
    json!({
        "model": "preset:tiny", "dataset": dataset, "gpu": "cpu",
        "steps": 40, "seq_len": 64, "micro_batch": 4, "lr": 1e-2, "eval_every": 20,
        "held_out": 0.125, "eval_metric": "exact_match", "eval_max_new_tokens": 4,
    })
}

async fn upload(client: &Client, name: &str, text: &str) -> anyhow::Result<i64> {
    let reply = client.upload(name, text.as_bytes(), None).await?;
    anyhow::ensure!(reply.status == StatusCode::CREATED, "upload {name}: {}", reply.text());
    reply.json()?["id"].as_i64().ok_or_else(|| anyhow::anyhow!("no id"))
}

/// Questions and answers read as alpaca through a column mapping (the upload's `columns`), as
/// a multiple-choice file has to be uploaded.
async fn upload_questions(client: &Client, name: &str, text: &str) -> anyhow::Result<i64> {
    let parts = [
        Part("columns", None, b"instruction=question,output=answer".as_slice()),
        Part("file", Some(name), text.as_bytes()),
    ];
    let reply = post_parts(client, "/api/datasets", &parts).await?;
    anyhow::ensure!(reply.status == StatusCode::CREATED, "upload {name}: {}", reply.text());
    reply.json()?["id"].as_i64().ok_or_else(|| anyhow::anyhow!("no id"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eval_sample_shows_what_will_be_compared_or_why_it_cannot_be() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let bob = app.user(&admin, "bob").await?;
    let ok = upload(&alice, "ok.jsonl", &ok_dataset()).await?;
    let sample = |query: &str| format!("/api/datasets/{ok}/eval-sample?{query}");

    // Held out of the training data: its last eighth, as the run splits it.
    let reply = alice.get(&sample("eval_metric=exact_match&held_out=0.125")).await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let held = reply.json()?;
    assert_eq!(held["metric"], "exact_match");
    assert_eq!(held["records"], 8, "{held}");
    let items = held["items"].as_array().cloned().unwrap_or_default();
    assert_eq!(items.len(), 3, "{held}");
    assert_eq!(items[0]["line"], 57, "{held}");
    assert_eq!(items[0]["prompt"], "river lemon 56: reply", "{held}");
    assert_eq!(items[0]["reference"], "ok", "{held}");

    // As an evaluation dataset of its own: every record, from the first.
    let whole = alice.get(&sample("eval_metric=contains&limit=5")).await?.json()?;
    assert_eq!(whole["records"], 64, "{whole}");
    assert_eq!(whole["items"].as_array().map(Vec::len), Some(5), "{whole}");
    assert_eq!(whole["items"][0]["line"], 1, "{whole}");

    // What does not suit the metric is refused, naming the setting (and the record).
    for (query, words) in [
        ("eval_metric=choice", "eval_metric choice: line 1"),
        ("eval_metric=choice&held_out=0.1", "eval_metric choice needs an evaluation dataset"),
        ("eval_metric=exact_match&held_out=0.9", "held_out must be"),
        ("eval_metric=loss", "eval_metric loss"),
    ] {
        let reply = alice.get(&sample(query)).await?;
        assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY, "{query}: {}", reply.text());
        assert!(reply.error().contains(words), "{query}: {}", reply.error());
    }
    let unknown = alice.get(&sample("eval_metric=accuracy")).await?;
    assert_eq!(unknown.status, StatusCode::BAD_REQUEST, "{}", unknown.text());
    assert!(unknown.error().starts_with("eval_metric \"accuracy\""), "{}", unknown.error());
    let missing = alice.get(&format!("/api/datasets/{ok}/eval-sample")).await?;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST, "{}", missing.text());

    // Questions without choices: a dataset of questions and answers, but not multiple choice.
    let no_choices = "{\"question\": \"2+2?\", \"answer\": \"4\"}\n{\"question\": \"3+3?\", \"answer\": \"6\"}\n";
    let plain = upload_questions(&alice, "plain.jsonl", no_choices).await?;
    let reply = alice.get(&format!("/api/datasets/{plain}/eval-sample?eval_metric=choice")).await?;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", reply.text());
    assert!(reply.error().contains("line 1: no `choices` list"), "{}", reply.error());

    // With choices, each item shows them with the right one as the reference.
    let with_choices = "{\"question\": \"2+2?\", \"choices\": [\"3\", \"4\"], \"answer\": \"4\"}\n\
                        {\"question\": \"3+3?\", \"choices\": [\"6\", \"9\"], \"answer\": \"6\"}\n";
    let quiz = upload_questions(&alice, "quiz.jsonl", with_choices).await?;
    let reply = alice.get(&format!("/api/datasets/{quiz}/eval-sample?eval_metric=choice")).await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let quiz_sample = reply.json()?;
    assert_eq!(quiz_sample["items"][0]["choices"], json!(["3", "4"]), "{quiz_sample}");
    assert_eq!(quiz_sample["items"][0]["reference"], "4", "{quiz_sample}");

    // Another user's dataset is not there.
    let reply = bob.get(&sample("eval_metric=exact_match")).await?;
    assert_eq!(reply.status, StatusCode::NOT_FOUND, "{}", reply.text());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_answers_set_the_base_model_beside_the_tuned_one() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let bob = app.user(&admin, "bob").await?;
    let ok = upload(&alice, "ok.jsonl", &ok_dataset()).await?;
    let id = alice.submit(ok_job(ok)).await?;
    let job = alice.wait_job(id, 300, |j| j["status"] == "completed").await?;

    let reply = alice.get(&format!("/api/jobs/{id}/answers")).await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let answers = reply.json()?;
    assert_eq!(answers["metric"], "exact_match");
    assert_eq!(answers["higher_is_better"], true);
    assert_eq!(
        (answers["base_step"].as_u64(), answers["tuned_step"].as_u64()),
        (Some(0), Some(40))
    );
    let (base, tuned) = (
        answers["base_score"].as_f64().unwrap_or(f64::NAN),
        answers["tuned_score"].as_f64().unwrap_or(f64::NAN),
    );
    assert!(base < 0.1 && tuned > 0.7, "base {base}, tuned {tuned}");
    let records = answers["records"].as_array().cloned().unwrap_or_default();
    assert_eq!(records.len(), 8, "{answers}");
    let lines: Vec<u64> = records.iter().filter_map(|r| r["line"].as_u64()).collect();
    assert_eq!(lines, (57..=64).collect::<Vec<u64>>());
    for record in &records {
        assert_eq!(record["reference"], "ok", "{record}");
        assert!(record["prompt"].as_str().is_some_and(|p| p.ends_with(": reply")), "{record}");
        assert!(record["base_answer"].is_string() && record["tuned_answer"].is_string());
    }
    let right = records.iter().filter(|r| r["tuned_answer"] == "ok").count();
    assert!(right >= 6, "{answers}");

    // The job says which metric it has, and its figure before and after.
    assert_eq!(job["task"], json!({"metric": "exact_match", "higher_is_better": true}));
    assert_eq!(job["summary"]["task_before"].as_f64(), Some(base), "{job}");
    assert_eq!(job["summary"]["task_score"].as_f64(), Some(tuned), "{job}");
    assert_eq!(job["summary"]["task_step"], 40, "{job}");
    // Step 0's point keeps the held-out loss before training beside the base model's figure.
    let history = alice.get(&format!("/api/jobs/{id}/metrics")).await?.json()?;
    let first = &history[0];
    assert_eq!(first["step"], 0, "{history}");
    assert!(first["eval_loss"].is_number() && first["task_score"].is_number(), "{first}");

    // The job's own access rules: the admin sees them, another user gets 404.
    assert_eq!(admin.get(&format!("/api/jobs/{id}/answers")).await?.status, StatusCode::OK);
    let reply = bob.get(&format!("/api/jobs/{id}/answers")).await?;
    assert_eq!(reply.status, StatusCode::NOT_FOUND, "{}", reply.text());
    assert_eq!(bob.get("/api/jobs/9999/answers").await?.status, StatusCode::NOT_FOUND);

    // A job without a task evaluation has no answers.
    let plain = alice.submit(tiny_job(ok, 2)).await?;
    alice.wait_job(plain, 300, |j| j["status"] == "completed").await?;
    let reply = alice.get(&format!("/api/jobs/{plain}/answers")).await?;
    assert_eq!(reply.status, StatusCode::NOT_FOUND, "{}", reply.text());
    assert!(reply.error().contains("no task evaluation"), "{}", reply.error());
    let listed = alice.get(&format!("/api/jobs/{plain}")).await?.json()?;
    assert_eq!(listed["task"], Value::Null, "{listed}");

    // A preset's job has no base model to answer beside its checkpoints.
    let ask = json!({"messages": [{"role": "user", "content": "river stone 3: reply"}],
                     "max_new_tokens": 4});
    let reply = alice.post(&format!("/api/jobs/{id}/base-model/generate"), ask.clone()).await?;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", reply.text());
    assert!(reply.error().contains("no base model to compare with"), "{}", reply.error());
    let reply = bob.post(&format!("/api/jobs/{id}/base-model/generate"), ask).await?;
    assert_eq!(reply.status, StatusCode::NOT_FOUND, "{}", reply.text());
    Ok(())
}

/// Copies a folder's files (a checkpoint has no subfolders).
fn copy_dir(from: &std::path::Path, to: &std::path::Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        std::fs::copy(entry.path(), to.join(entry.file_name()))?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folder_jobs_base_model_answers_the_same_conversation() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let ok = upload(&alice, "ok.jsonl", &ok_dataset()).await?;
    let first = alice.submit(ok_job(ok)).await?;
    alice.wait_job(first, 300, |j| j["status"] == "completed").await?;
    // The model that learnt to say "ok" becomes a model folder, and a job starts from it.
    let folder = app.state.models_dir().join("says-ok");
    copy_dir(&app.state.runs_dir().join(first.to_string()).join("final"), &folder)?;
    let mut job = tiny_job(ok, 2);
    job["model"] = json!("local:says-ok");
    job["lr"] = json!(1e-6);
    let second = alice.submit(job).await?;
    alice.wait_job(second, 300, |j| j["status"] == "completed").await?;

    let ask = json!({"messages": [{"role": "user", "content": "river stone 3: reply"}],
                     "max_new_tokens": 4});
    let url = format!("/api/jobs/{second}/base-model/generate");
    let reply = alice.post(&url, ask.clone()).await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let base = reply.json()?;
    assert!(base["text"].as_str().is_some_and(|t| t.contains("ok")), "{base}");
    assert_eq!(base["device"], "cpu", "{base}");
    let tuned_url = format!("/api/jobs/{second}/checkpoints/final/generate");
    let tuned = alice.post(&tuned_url, ask.clone()).await?;
    assert_eq!(tuned.status, StatusCode::OK, "{}", tuned.text());

    // Its folder gone, the base model cannot answer, and says why.
    std::fs::remove_dir_all(&folder)?;
    let reply = alice.post(&url, ask).await?;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", reply.text());
    assert!(reply.error().contains("no longer on this machine"), "{}", reply.error());
    Ok(())
}
