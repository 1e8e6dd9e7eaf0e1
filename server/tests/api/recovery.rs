//! The queue's rules under races, and what is cleaned up: submits, resumes and a dataset's
//! delete hammered at once never give a 500 nor a queued job without its dataset, and never
//! exceed the per-user limit; a deleted user's files go with them; job ids (and so run folders)
//! are never given twice; a restart removes half-written uploads, imports, exports, saves and
//! Hub snapshots, and orphaned run folders, and nothing kept.

use axum::http::StatusCode;
use serde_json::{Value, json};

use crate::common::{Client, TestApp, tiny_job};

const DATA: &[u8] = b"{\"instruction\": \"Say hi\", \"output\": \"Hi there, friend.\"}\n\
{\"instruction\": \"Say bye\", \"output\": \"Goodbye, friend.\"}\n";

async fn upload(client: &Client, name: &str) -> anyhow::Result<i64> {
    let reply = client.upload("d.jsonl", DATA, Some(name)).await?;
    anyhow::ensure!(reply.status == StatusCode::CREATED, "upload: {}", reply.text());
    reply.json()?["id"].as_i64().ok_or_else(|| anyhow::anyhow!("no id"))
}

async fn jobs(client: &Client) -> anyhow::Result<Vec<Value>> {
    Ok(client.get("/api/jobs").await?.json()?.as_array().cloned().unwrap_or_default())
}

/// Cancels `jobs` and waits until each has stopped.
async fn stop_all(client: &Client, jobs: &[&Value]) -> anyhow::Result<()> {
    for job in jobs {
        client.post(&format!("/api/jobs/{}/cancel", job["id"]), json!({})).await?;
    }
    for job in jobs {
        let id = job["id"].as_i64().unwrap_or_default();
        client
            .wait_job(id, 60, |j| j["status"] == "cancelled" || j["status"] == "completed")
            .await?;
    }
    Ok(())
}

fn active(jobs: &[Value]) -> Vec<&Value> {
    jobs.iter().filter(|j| j["status"] == "queued" || j["status"] == "running").collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn submits_resumes_and_deletes_at_once_keep_the_rules() -> anyhow::Result<()> {
    const LIMIT: usize = 3;
    let app = TestApp::with_config(|c| c.limits.max_active_jobs_per_user = LIMIT as u32).await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    for round in 0..12 {
        let dataset = upload(&alice, &format!("round-{round}")).await?;
        // Eight submits and a delete of their dataset, all at once.
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let client = alice.clone();
            tasks.push(tokio::spawn(async move {
                client.post("/api/jobs", tiny_job(dataset, 100_000)).await
            }));
        }
        let client = alice.clone();
        let delete =
            tokio::spawn(async move { client.delete(&format!("/api/datasets/{dataset}")).await });
        for task in tasks {
            let reply = task.await??;
            // A dataset already gone when the body is read is an unknown dataset (400).
            let gone = reply.status == StatusCode::BAD_REQUEST
                && reply.error().contains("unknown dataset");
            assert!(
                gone || [StatusCode::CREATED, StatusCode::CONFLICT].contains(&reply.status),
                "round {round}: submit answered {} {}",
                reply.status,
                reply.text()
            );
        }
        let deleted = delete.await??;
        assert!(
            [StatusCode::OK, StatusCode::CONFLICT].contains(&deleted.status),
            "round {round}: delete answered {} {}",
            deleted.status,
            deleted.text()
        );
        let all = jobs(&alice).await?;
        let now_active = active(&all);
        assert!(now_active.len() <= LIMIT, "round {round}: {} active", now_active.len());
        for job in &now_active {
            assert!(
                job["dataset"].is_i64(),
                "round {round}: an active job lost its dataset: {job}"
            );
        }
        if deleted.status == StatusCode::OK {
            assert!(now_active.iter().all(|j| j["dataset"] != dataset), "round {round}");
        }

        // Cancel everything, then resume it all at once beside another delete attempt.
        stop_all(&alice, &now_active).await?;
        let stopped: Vec<i64> = jobs(&alice)
            .await?
            .iter()
            .filter(|j| j["status"] == "cancelled")
            .filter_map(|j| j["id"].as_i64())
            .collect();
        let mut tasks = Vec::new();
        for id in stopped.iter().copied().take(2 * LIMIT) {
            let client = alice.clone();
            tasks.push(tokio::spawn(async move {
                client.post(&format!("/api/jobs/{id}/resume"), json!({})).await
            }));
        }
        let client = alice.clone();
        let delete =
            tokio::spawn(async move { client.delete(&format!("/api/datasets/{dataset}")).await });
        for task in tasks {
            let reply = task.await??;
            assert!(
                [StatusCode::OK, StatusCode::CONFLICT].contains(&reply.status),
                "round {round}: resume answered {} {}",
                reply.status,
                reply.text()
            );
        }
        let deleted = delete.await??;
        assert!(
            [StatusCode::OK, StatusCode::CONFLICT, StatusCode::NOT_FOUND].contains(&deleted.status),
            "round {round}: delete answered {} {}",
            deleted.status,
            deleted.text()
        );
        let all = jobs(&alice).await?;
        let now_active = active(&all);
        assert!(
            now_active.len() <= LIMIT,
            "round {round}: {} active after resumes",
            now_active.len()
        );
        for job in &now_active {
            assert!(job["dataset"].is_i64(), "round {round}: a resumed job has no dataset: {job}");
        }
        stop_all(&alice, &now_active).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_users_files_go_and_job_ids_are_never_given_twice() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let bob = app.user(&admin, "bob").await?;
    let dataset = upload(&bob, "bob's").await?;
    let id = bob.submit(tiny_job(dataset, 2)).await?;
    bob.wait_job(id, 300, |j| j["status"] == "completed").await?;
    let data_dir = app.state.data_dir().to_path_buf();
    let run = data_dir.join("runs").join(id.to_string());
    assert!(run.join("final").is_dir());
    let uploads = || -> anyhow::Result<usize> {
        Ok(std::fs::read_dir(data_dir.join("datasets"))?
            .flatten()
            .filter(|e| e.file_name() != "demo-alpaca.jsonl")
            .count())
    };
    assert_eq!(uploads()?, 1);

    let users = admin.get("/api/users").await?.json()?;
    let bob_id = users
        .as_array()
        .and_then(|u| u.iter().find(|u| u["username"] == "bob"))
        .and_then(|u| u["id"].as_i64())
        .ok_or_else(|| anyhow::anyhow!("no bob in {users}"))?;
    let reply = admin.delete(&format!("/api/users/{bob_id}")).await?;
    assert_eq!(reply.status, StatusCode::NO_CONTENT, "{}", reply.text());
    assert!(!run.exists(), "bob's run folder is still there");
    assert_eq!(uploads()?, 0, "bob's upload is still there");

    // Bob's job had the highest id; the next job must not take it (nor its folder).
    let demo = admin.demo_dataset().await?;
    let next = admin.submit(tiny_job(demo, 1)).await?;
    assert!(next > id, "job id {next} given again (bob's was {id})");
    admin.wait_job(next, 300, |j| j["status"] == "completed").await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_removes_half_written_uploads_and_orphaned_run_folders() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let demo = admin.demo_dataset().await?;
    let id = admin.submit(tiny_job(demo, 1)).await?;
    admin.wait_job(id, 300, |j| j["status"] == "completed").await?;
    let data = app.state.data_dir().to_path_buf();
    let models = data.join("models");
    std::fs::create_dir_all(models.join(".import-abc/nested"))?;
    std::fs::create_dir_all(models.join("kept-model"))?;
    let strays = [
        data.join("datasets/.upload-0123456789"),
        models.join(".upload-feed.gguf"),
        data.join("runs/987654"),
    ];
    std::fs::write(&strays[0], b"half a dataset")?;
    std::fs::write(&strays[1], b"half a gguf")?;
    std::fs::create_dir_all(strays[2].join("checkpoint-3"))?;
    // Hidden folders of saves, imports, exports and Hub pulls cut short, each with a file in it,
    // named as the code that makes them names them.
    let run = data.join("runs").join(id.to_string());
    let snapshots = data.join("hub/models--Org--Model/snapshots");
    let hidden = [
        run.join(".pruned-checkpoint-5"),
        run.join(".checkpoint-7.partial"),
        run.join(".state.partial"),
        models.join("..import-0a1b2c.partial"),
        data.join("runs/.gguf-export-3-q8_0-1712345678"),
        snapshots.join(".partial-0123abcd-4242"),
    ];
    for folder in &hidden {
        std::fs::create_dir_all(folder)?;
        std::fs::write(folder.join("model.safetensors"), vec![0u8; 4096])?;
    }
    // A save killed between its two renames leaves the previous checkpoint only as `.old`.
    let kept = [run.join(".checkpoint-1.old"), snapshots.join("0123abcd")];
    for folder in &kept {
        std::fs::create_dir_all(folder)?;
    }

    app.restart().await?;
    for stray in strays.iter().chain(&hidden) {
        assert!(!stray.exists(), "{} survived the restart", stray.display());
    }
    for folder in &kept {
        assert!(folder.is_dir(), "{} was removed", folder.display());
    }
    assert!(!models.join(".import-abc").exists());
    assert!(models.join("kept-model").is_dir(), "a real model folder was removed");
    assert!(data.join("runs").join(id.to_string()).join("final").is_dir(), "a job's run went");
    assert!(data.join("datasets/demo-alpaca.jsonl").is_file());
    Ok(())
}
