//! Datasets as people have them: lenient uploads that skip invalid records (listed, counted,
//! and skipped again by the jobs that train on them), CSV and Parquet uploads with column
//! mapping, and the preview's account of the template it rendered with.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Method, StatusCode, header};
use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

use crate::common::{Client, Reply, TestApp, tiny_job};

/// An upload of `file` with extra form fields.
async fn upload(
    client: &Client,
    file_name: &str,
    bytes: &[u8],
    fields: &[(&str, &str)],
) -> anyhow::Result<Reply> {
    let boundary = "sluice-formats-boundary";
    let mut body = Vec::new();
    for (name, value) in fields {
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
            )
            .as_bytes(),
        );
    }
    body.extend_from_slice(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; \
             filename=\"{file_name}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
        )
        .as_bytes(),
    );
    body.extend_from_slice(bytes);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    let request = client
        .builder(Method::POST, "/api/datasets")
        .header(header::CONTENT_TYPE, format!("multipart/form-data; boundary={boundary}"))
        .body(Body::from(body))?;
    client.send(request).await
}

/// Five records; lines 2 and 4 are bad (not JSON; a conversation ending with the user).
const MIXED: &str = r#"{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}
{"conversations": [{"from": "human", "value": "broken"
{"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}
{"conversations": [{"from": "human", "value": "Anyone there?"}]}
{"conversations": [{"from": "human", "value": "Bye"}, {"from": "gpt", "value": "Goodbye."}]}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lenient_upload_lists_what_it_skips_and_its_jobs_skip_the_same() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;

    let strict = upload(&admin, "chat.jsonl", MIXED.as_bytes(), &[]).await?;
    assert_eq!(strict.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", strict.text());
    assert!(strict.error().contains("2 bad records"), "{}", strict.text());

    let reply = upload(&admin, "chat.jsonl", MIXED.as_bytes(), &[("skip_invalid", "true")]).await?;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
    let created = reply.json()?;
    assert_eq!(created["format"], "sharegpt");
    assert_eq!(created["records"], 3);
    assert_eq!(created["skip_invalid"], true);
    assert_eq!(created["skipped"], 2);
    let skipped = created["skipped_records"].as_array().cloned().unwrap_or_default();
    let lines: Vec<i64> = skipped.iter().filter_map(|s| s["line"].as_i64()).collect();
    assert_eq!(lines, [2, 4], "{created}");
    assert!(skipped[0]["reason"].as_str().is_some_and(|r| r.contains("not valid JSON")));
    assert!(skipped[1]["reason"].as_str().is_some_and(|r| r.contains("ends with a user")));
    let id = created["id"].as_i64().unwrap_or(0);
    let shown = admin.get(&format!("/api/datasets/{id}")).await?.json()?;
    assert_eq!(shown["skipped"], 2);
    assert_eq!(shown["skipped_records"], created["skipped_records"]);

    // A job on it trains on the three good records; a strict read would fail at line 2.
    let job = admin.submit(tiny_job(id, 2)).await?;
    let done =
        admin.wait_job(job, 300, |j| j["status"] != "queued" && j["status"] != "running").await?;
    assert_eq!(done["status"], "completed", "{done}");

    // 300 bad records among good ones: 100 are listed and the other 200 counted, never as a
    // line of their own (a page listing fewer would count that line as one more problem).
    let many: String = (1..=400)
        .map(|i| if i % 4 == 0 { "{\"text\": \"fine\"}\n" } else { "{\"text\": 1}\n" })
        .collect();
    let strict = upload(&admin, "many.jsonl", many.as_bytes(), &[]).await?;
    assert_eq!(strict.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", strict.text());
    let body = strict.json()?;
    assert_eq!(body["problems"].as_array().map(Vec::len), Some(100), "{body}");
    assert_eq!(body["unlisted"], 200, "{body}");
    assert!(!body.to_string().contains("more"), "{body}");
    let reply = upload(&admin, "many.jsonl", many.as_bytes(), &[("skip_invalid", "true")]).await?;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
    let created = reply.json()?;
    assert_eq!((created["records"].as_i64(), created["skipped"].as_i64()), (Some(100), Some(300)));
    let listed = created["skipped_records"].as_array().map(Vec::len).unwrap_or(0);
    assert_eq!(created["skipped"].as_i64().unwrap_or(0) - listed as i64, 200, "{created}");

    // Nothing valid at all is refused even leniently.
    let none = "{\"conversations\": []}\nnot json\n";
    let reply = upload(&admin, "none.jsonl", none.as_bytes(), &[("skip_invalid", "on")]).await?;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", reply.text());
    let reply = upload(&admin, "x.jsonl", MIXED.as_bytes(), &[("skip_invalid", "maybe")]).await?;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text());
    Ok(())
}

const QA_CSV: &str =
    "id,q,a\n1,What is the capital of France?,Paris.\n2,\"Two, words?\",\"Yes, two.\"\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_csv_upload_is_mapped_by_its_columns_and_previewed_with_the_template_used()
-> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;

    // Columns of no known name: refused, naming them, so the page can offer a mapping.
    let reply = upload(&admin, "qa.csv", QA_CSV.as_bytes(), &[]).await?;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", reply.text());
    assert!(reply.error().contains("(id, q, a)"), "{}", reply.text());
    let reply =
        upload(&admin, "qa.csv", QA_CSV.as_bytes(), &[("columns", "instruction=q,output=b")])
            .await?;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", reply.text());
    assert!(reply.error().contains("\"b\""), "{}", reply.text());
    let reply = upload(&admin, "qa.csv", QA_CSV.as_bytes(), &[("columns", "answer=a")]).await?;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text());

    let reply =
        upload(&admin, "qa.csv", QA_CSV.as_bytes(), &[("columns", "instruction=q,output=a")])
            .await?;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
    let created = reply.json()?;
    assert_eq!(created["layout"], "csv");
    assert_eq!(created["format"], "alpaca");
    assert_eq!(created["records"], 2);
    assert_eq!(created["columns"], serde_json::json!({"instruction": "q", "output": "a"}));
    let id = created["id"].as_i64().unwrap_or(0);

    let preview =
        admin.get(&format!("/api/datasets/{id}/preview?model=preset:tiny&limit=2")).await?;
    assert_eq!(preview.status, StatusCode::OK, "{}", preview.text());
    let preview = preview.json()?;
    let text: String = preview["samples"][1]["segments"]
        .as_array()
        .map(|s| s.iter().filter_map(|p| p["text"].as_str()).collect())
        .unwrap_or_default();
    assert!(text.contains("<|im_start|>user\nTwo, words?"), "{text}");
    assert!(text.contains("Yes, two."), "{text}");
    assert_eq!(preview["samples"][1]["line"], 3);
    let with = &preview["rendered_with"];
    assert_eq!(with["source"], "builtin", "{with}");
    assert!(with["summary"].as_str().is_some_and(|s| s.contains("tiny tokenizer")), "{with}");
    assert!(with["chat_template"].as_str().is_some_and(|t| t.contains("<|im_start|>")));

    // The job reads it with the same mapping.
    let job = admin.submit(tiny_job(id, 1)).await?;
    let done =
        admin.wait_job(job, 300, |j| j["status"] != "queued" && j["status"] != "running").await?;
    assert_eq!(done["status"], "completed", "{done}");
    Ok(())
}

fn parquet_bytes(rows: &[(&str, &str)]) -> anyhow::Result<Vec<u8>> {
    let schema = "message schema {
        REQUIRED BYTE_ARRAY question (UTF8);
        REQUIRED BYTE_ARRAY answer (UTF8);
    }";
    let schema = Arc::new(parse_message_type(schema)?);
    let props = Arc::new(WriterProperties::builder().set_compression(Compression::SNAPPY).build());
    let mut writer = SerializedFileWriter::new(Vec::new(), schema, props)?;
    let mut group = writer.next_row_group()?;
    for column in 0..2 {
        let values: Vec<ByteArray> =
            rows.iter().map(|r| ByteArray::from(if column == 0 { r.0 } else { r.1 })).collect();
        let Some(mut col) = group.next_column()? else { anyhow::bail!("no column {column}") };
        col.typed::<ByteArrayType>().write_batch(&values, None, None)?;
        col.close()?;
    }
    group.close()?;
    Ok(writer.into_inner()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parquet_upload_with_the_usual_column_names_is_mapped_automatically() -> anyhow::Result<()>
{
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let bytes = parquet_bytes(&[("2+2?", "4"), ("", "nothing asked"), ("3+3?", "6")])?;

    let strict = upload(&admin, "train-00000-of-00001.parquet", &bytes, &[]).await?;
    assert_eq!(strict.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", strict.text());
    let problems = strict.json()?;
    assert!(problems.to_string().contains("row 2"), "{problems}");

    let reply = upload(&admin, "train.parquet", &bytes, &[("skip_invalid", "1")]).await?;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
    let created = reply.json()?;
    assert_eq!(created["layout"], "parquet");
    assert_eq!(created["records"], 2);
    assert_eq!(created["skipped"], 1);
    assert_eq!(created["skipped_records"][0]["line"], 2);
    assert_eq!(
        created["columns"],
        serde_json::json!({"instruction": "question", "output": "answer"})
    );

    // A damaged Parquet file is refused with a reason, not a 500.
    let damaged = &bytes[..bytes.len() - 9];
    let reply = upload(&admin, "broken.parquet", damaged, &[]).await?;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", reply.text());
    assert!(reply.error().contains("Parquet"), "{}", reply.text());
    Ok(())
}

/// The repository's LLaMA-Factory example: `datasets/examples/dataset_info.json` and its files.
fn example(name: &str) -> anyhow::Result<Vec<u8>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/examples");
    Ok(std::fs::read(dir.join(name))?)
}

/// The files under `DATA_DIR/datasets/` but the demo's.
fn stored_files(app: &TestApp) -> anyhow::Result<Vec<String>> {
    let mut names: Vec<String> = std::fs::read_dir(app.state.datasets_dir())?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .filter(|n| !n.starts_with("demo-"))
        .collect();
    names.sort();
    Ok(names)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dataset_info_json_maps_an_upload_kept_beside_it_and_deleted_with_it()
-> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let registry = String::from_utf8(example("dataset_info.json")?)?;
    let data = example("openai-tags.jsonl")?;

    // Its own tags ("dialog", "speaker", "text") are no format Sluice knows by itself.
    let alone = upload(&admin, "openai-tags.jsonl", &data, &[]).await?;
    assert_eq!(alone.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", alone.text());

    // The registry's entry for the file's own name maps them.
    let fields = [("dataset_info", registry.as_str())];
    let reply = upload(&admin, "openai-tags.jsonl", &data, &fields).await?;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
    let created = reply.json()?;
    assert_eq!(created["registry_name"], "custom_tags_example", "{created}");
    assert_eq!(created["records"], 1, "{created}");
    let id = created["id"].as_i64().unwrap_or(0);
    let files = stored_files(&app)?;
    assert_eq!(files.len(), 2, "the file and its registry: {files:?}");
    assert!(files.iter().any(|f| f.ends_with(".dataset_info.json")), "{files:?}");

    let preview =
        admin.get(&format!("/api/datasets/{id}/preview?model=preset:tiny&limit=1")).await?;
    assert_eq!(preview.status, StatusCode::OK, "{}", preview.text());
    let text = preview.text();
    assert!(text.contains("What is 2 + 2?") && text.contains("Answer with the sum."), "{text}");
    let job = admin.submit(tiny_job(id, 1)).await?;
    let done =
        admin.wait_job(job, 300, |j| j["status"] != "queued" && j["status"] != "running").await?;
    assert_eq!(done["status"], "completed", "{done}");

    // A file the registry does not name: the entry must be named, and then it is used.
    let other = upload(&admin, "mine.jsonl", &data, &fields).await?;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", other.text());
    assert!(other.error().contains("name the dataset to use (it has: "), "{}", other.text());
    let named = [("dataset_info", registry.as_str()), ("dataset", "custom_tags_example")];
    let reply = upload(&admin, "mine.jsonl", &data, &named).await?;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
    let second = reply.json()?["id"].as_i64().unwrap_or(0);
    let unknown = [("dataset_info", registry.as_str()), ("dataset", "nope")];
    let reply = upload(&admin, "mine.jsonl", &data, &unknown).await?;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", reply.text());
    assert!(reply.error().contains("no dataset named \"nope\""), "{}", reply.text());
    let reply = upload(&admin, "mine.jsonl", &data, &[("dataset_info", "{")]).await?;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", reply.text());
    assert!(reply.error().contains("not valid JSON"), "{}", reply.text());
    let both = [("dataset_info", registry.as_str()), ("columns", "text=dialog")];
    let reply = upload(&admin, "openai-tags.jsonl", &data, &both).await?;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text());
    assert_eq!(stored_files(&app)?.len(), 4, "refused uploads leave nothing behind");

    // Deleting it frees the file and its registry (both registries are the same size: their
    // file names differ only in their random part).
    let registry_size: u64 = std::fs::read_dir(app.state.datasets_dir())?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".dataset_info.json"))
        .map(|e| e.metadata().map_or(0, |m| m.len()))
        .min()
        .unwrap_or(0);
    assert!(registry_size > 0);
    let deleted = admin.delete(&format!("/api/datasets/{id}")).await?;
    assert_eq!(deleted.status, StatusCode::OK, "{}", deleted.text());
    let freed = deleted.json()?["freed_bytes"].as_u64().unwrap_or(0);
    assert_eq!(freed, data.len() as u64 + registry_size, "the file's and the registry's bytes");
    assert_eq!(stored_files(&app)?.len(), 2, "{:?}", stored_files(&app)?);
    assert_eq!(admin.delete(&format!("/api/datasets/{second}")).await?.status, StatusCode::OK);
    assert_eq!(stored_files(&app)?, Vec::<String>::new());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_file_is_pretraining_text_packed_across_rows_not_cut() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    // Paragraphs separated by blank lines (one of several lines); the last, long one.
    let long = "word ".repeat(200);
    let corpus = format!("The first paragraph,\nwritten over two lines.\n\nA second.\n\n{long}\n");
    // A bad block is refused with its line, as a JSON record would be.
    let bad = [corpus.as_bytes(), b"\n\xff broken\n"].concat();
    let strict = upload(&admin, "corpus.txt", &bad, &[]).await?;
    assert_eq!(strict.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", strict.text());
    let body = strict.json()?;
    assert!(body.to_string().contains("line 8: not valid UTF-8"), "{body}");
    let reply = upload(&admin, "corpus.txt", corpus.as_bytes(), &[]).await?;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
    let created = reply.json()?;
    assert_eq!((created["format"].as_str(), created["records"].as_i64()), (Some("text"), Some(3)));
    let id = created["id"].as_i64().unwrap_or(0);

    // The long text goes on over rows: nothing cut, every token but each part's first trained.
    let preview = admin
        .get(&format!("/api/datasets/{id}/preview?model=preset:tiny&limit=3&seq_len=64"))
        .await?;
    assert_eq!(preview.status, StatusCode::OK, "{}", preview.text());
    let preview = preview.json()?;
    let stats = &preview["stats"];
    assert_eq!((stats["truncated"].as_u64(), stats["continued"].as_u64()), (Some(0), Some(1)));
    let lengths: Vec<u64> = preview["samples"]
        .as_array()
        .map(|s| s.iter().filter_map(|s| s["tokens"].as_u64()).collect())
        .unwrap_or_default();
    assert_eq!(stats["tokens"].as_u64(), Some(lengths.iter().sum()), "{preview}");
    let parts: u64 = lengths.iter().map(|l| l.div_ceil(64)).sum();
    assert_eq!(stats["trained_tokens"].as_u64(), Some(lengths.iter().sum::<u64>() - parts));
    let first = preview["samples"][0]["segments"].to_string();
    assert!(first.contains("The first paragraph,\\nwritten over two lines."), "{first}");

    let job = admin.submit(tiny_job(id, 2)).await?;
    let done =
        admin.wait_job(job, 300, |j| j["status"] != "queued" && j["status"] != "running").await?;
    assert_eq!(done["status"], "completed", "{done}");
    let log = admin.get(&format!("/api/jobs/{job}/log")).await?.text();
    assert!(log.contains("0 truncated samples, 1 texts continued over rows"), "{log}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_of_preference_pairs_is_refused_for_what_it_is() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    // LLaMA-Factory's DPO demo shape: every record a preference pair, none trainable by SFT.
    let pairs: String = (0..3)
        .map(|i| {
            serde_json::json!({
                "conversations": [{"from": "human", "value": format!("Question {i}?")}],
                "chosen": {"from": "gpt", "value": "A careful answer."},
                "rejected": {"from": "gpt", "value": "A careless one."},
            })
            .to_string()
                + "\n"
        })
        .collect();
    let refused = upload(&admin, "dpo_en_demo.jsonl", pairs.as_bytes(), &[]).await?;
    assert_eq!(refused.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", refused.text());
    let error = refused.error();
    assert!(error.starts_with("no record can be trained on: \"chosen\""), "{error}");
    assert!(error.contains("this is preference data"), "{error}");
    assert!(!error.contains("known format"), "{error}");
    let problems = refused.json()?["problems"].as_array().map(Vec::len);
    assert_eq!(problems, Some(3), "{}", refused.text());
    Ok(())
}
