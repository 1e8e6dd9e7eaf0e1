//! Multipart uploads as a broken client or an attacker sends them (bytes changed anywhere, the
//! body cut, a wrong boundary): each gets a 4xx JSON error or a kept dataset, never a 5xx, and
//! nothing half-written stays behind.

use axum::body::Body;
use axum::http::{Method, header};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::common::TestApp;

const BOUNDARY: &str = "sluice-damaged-boundary";

fn valid_body() -> Vec<u8> {
    format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\nmy data\r\n\
         --{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"d.jsonl\"\r\n\
         Content-Type: application/octet-stream\r\n\r\n\
         {{\"prompt\": \"2+2=\", \"completion\": \"4\"}}\n\
         {{\"text\": \"hello there\"}}\n\r\n--{BOUNDARY}--\r\n"
    )
    .into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_multipart_uploads_are_4xx_or_kept_never_5xx() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let mut kept = 0;
    for case in 0..160 {
        let mut body = valid_body();
        match case % 4 {
            // A few bytes changed anywhere.
            0 | 1 => {
                for _ in 0..rng.random_range(1..6) {
                    let i = rng.random_range(0..body.len());
                    body[i] = rng.random();
                }
            }
            // Cut short.
            2 => body.truncate(rng.random_range(0..body.len())),
            // Random bytes.
            _ => body = (0..rng.random_range(0..512)).map(|_| rng.random()).collect(),
        }
        let boundary = if case % 7 == 0 { "another-boundary" } else { BOUNDARY };
        let request = admin
            .builder(Method::POST, "/api/datasets")
            .header(header::CONTENT_TYPE, format!("multipart/form-data; boundary={boundary}"))
            .body(Body::from(body.clone()))?;
        let reply = admin.send(request).await?;
        assert!(
            reply.status.is_success() || reply.status.is_client_error(),
            "case {case}: {} {} for {:?}",
            reply.status,
            reply.text(),
            String::from_utf8_lossy(&body)
        );
        if reply.status.is_success() {
            kept += 1;
        } else {
            assert!(
                reply.header(header::CONTENT_TYPE).starts_with("application/json"),
                "case {case}: a {} that is not JSON: {}",
                reply.status,
                reply.text()
            );
        }
    }
    let listed = admin.get("/api/datasets").await?.json()?;
    // Every kept upload is listed (beside the demo), and no temporary file is left.
    assert_eq!(listed.as_array().map_or(0, Vec::len), kept + 1, "{listed}");
    let leftovers: Vec<_> = std::fs::read_dir(app.state.datasets_dir())?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".upload-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    Ok(())
}
