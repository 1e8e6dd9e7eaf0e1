//! Models by Hugging Face name. A local HTTP server here answers in the Hub's URL layout
//! (`/api/models/{repo}/revision/{rev}` with siblings and LFS sha256s, `/{repo}/resolve/{rev}/
//! {file}` with ETag, X-Repo-Commit and ranges, 401 for a gated repo without the token) and
//! serves the real SmolLM2-135M-Instruct, imported from its GGUF by the engine. Pulls go through
//! the API and `sluice pull`; a cache folder laid out by hand (refs, snapshots, blobs with
//! symlinks) stands for a user's own Hugging Face cache.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use sluice::hub::HubToken;
use sluice_engine::convert::import_gguf;
use sluice_engine::generate::{GenerateOptions, Generator, PromptStyle};

use crate::common::{Client, TestApp};

const TOKEN: &str = "hf_test_secret_token";
const SMOL: &str = "test-org/SmolLM2-135M-Instruct";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn sha256_file(path: &Path) -> String {
    let mut file = std::fs::File::open(path).expect("opens");
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).expect("reads");
        if n == 0 {
            break;
        }
        ctx.update(&buf[..n]);
    }
    hex(ctx.finish().as_ref())
}

/// Git's blob id: sha1 of `blob <size>\0` and the bytes.
fn git_blob_id(bytes: &[u8]) -> String {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY);
    ctx.update(format!("blob {}\0", bytes.len()).as_bytes());
    ctx.update(bytes);
    hex(ctx.finish().as_ref())
}

/// SmolLM2-135M-Instruct as a Hugging Face folder, imported once per test run.
fn smollm2() -> &'static Path {
    static DIR: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    let (_, dir) = DIR.get_or_init(|| {
        let gguf = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../.cache/test-assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
        assert!(gguf.exists(), "{} is missing: run scripts/fetch_test_assets.sh", gguf.display());
        let tmp = tempfile::tempdir().expect("temp dir");
        let out = tmp.path().join("smollm2");
        import_gguf(&gguf, &out).expect("SmolLM2 imports");
        (tmp, out)
    });
    dir
}

/// A small repo (SmolLM2's config and tokenizer, 3 MiB of stand-in weights, and files a pull
/// must skip): for refusals and revisions, where the weights' bytes matter, not their meaning.
fn small_repo() -> &'static Path {
    static DIR: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    let (_, dir) = DIR.get_or_init(|| {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path().join("small");
        std::fs::create_dir_all(&dir).expect("mkdir");
        for name in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(smollm2().join(name), dir.join(name)).expect("copies");
        }
        let weights: Vec<u8> =
            (0..3u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
        std::fs::write(dir.join("model.safetensors"), weights).expect("writes");
        std::fs::write(dir.join("README.md"), "# a model card\n").expect("writes");
        std::fs::write(dir.join("pytorch_model.bin"), vec![7u8; 4096]).expect("writes");
        // A sharded layout beside it, with the consolidated file some repos also carry.
        let index = json!({"metadata": {}, "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
            "c": "model-00001-of-00002.safetensors",
        }});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string())
            .expect("writes");
        for (i, name) in [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "consolidated.safetensors",
        ]
        .iter()
        .enumerate()
        {
            std::fs::write(dir.join(name), vec![i as u8 + 1; 300_000]).expect("writes");
        }
        (tmp, dir)
    });
    dir
}

/// A file a fake repo serves.
#[derive(Clone)]
struct Served {
    path: PathBuf,
    size: u64,
    /// Announced for LFS files (safetensors, bin); `None` for files kept in git.
    sha256: Option<String>,
    blob_id: String,
}

#[derive(Clone)]
struct FakeRepo {
    /// Revision name (and each commit itself) to commit.
    revisions: BTreeMap<String, String>,
    files: BTreeMap<String, Served>,
    gated: bool,
}

#[derive(Default)]
struct HubLog {
    /// `(path, Range header)` of every resolve request.
    resolves: Vec<(String, Option<String>)>,
    /// Bytes after which the next download of a file ending in this name is cut off, once.
    cut_once: Option<(String, u64)>,
    authorizations: Vec<Option<String>>,
}

#[derive(Clone)]
struct FakeHub {
    repos: Arc<BTreeMap<String, FakeRepo>>,
    log: Arc<Mutex<HubLog>>,
}

fn served_folder(dir: &Path, names: &[&str], wrong_sha: bool) -> BTreeMap<String, Served> {
    let mut files = BTreeMap::new();
    for name in names {
        let path = dir.join(name);
        let bytes = std::fs::read(&path).expect("reads");
        let lfs = name.ends_with(".safetensors") || name.ends_with(".bin");
        let sha256 = lfs.then(|| if wrong_sha { "0".repeat(64) } else { sha256_file(&path) });
        files.insert(
            name.to_string(),
            Served { size: bytes.len() as u64, sha256, blob_id: git_blob_id(&bytes), path },
        );
    }
    files
}

fn commit(n: u8) -> String {
    format!("{n:02x}").repeat(20)
}

fn revisions(pairs: &[(&str, String)]) -> BTreeMap<String, String> {
    let mut map: BTreeMap<String, String> =
        pairs.iter().map(|(name, c)| (name.to_string(), c.clone())).collect();
    for (_, c) in pairs {
        map.insert(c.clone(), c.clone());
    }
    map
}

impl FakeHub {
    fn new() -> FakeHub {
        static SMOL_FILES: OnceLock<BTreeMap<String, Served>> = OnceLock::new();
        let smol = SMOL_FILES.get_or_init(|| {
            let names: Vec<String> = std::fs::read_dir(smollm2())
                .expect("lists")
                .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
                .collect();
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            served_folder(smollm2(), &names, false)
        });
        let small_names = [
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "model.safetensors",
            "README.md",
            "pytorch_model.bin",
        ];
        let small = served_folder(small_repo(), &small_names, false);
        let sharded_names = [
            "config.json",
            "tokenizer.json",
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "consolidated.safetensors",
        ];
        let sharded = served_folder(small_repo(), &sharded_names, false);
        let mut broken_index = sharded.clone();
        broken_index.remove("model-00002-of-00002.safetensors");
        let mut bin_only = small.clone();
        bin_only.remove("model.safetensors");
        let mut repos = BTreeMap::new();
        repos.insert(
            SMOL.to_string(),
            FakeRepo {
                revisions: revisions(&[("main", commit(1))]),
                files: smol.clone(),
                gated: false,
            },
        );
        repos.insert(
            "test-org/small".to_string(),
            FakeRepo {
                revisions: revisions(&[("main", commit(2)), ("v1", commit(3))]),
                files: small.clone(),
                gated: false,
            },
        );
        repos.insert(
            "test-org/gated".to_string(),
            FakeRepo {
                revisions: revisions(&[("main", commit(4))]),
                files: small.clone(),
                gated: true,
            },
        );
        repos.insert(
            "test-org/corrupt".to_string(),
            FakeRepo {
                revisions: revisions(&[("main", commit(5))]),
                files: served_folder(small_repo(), &small_names, true),
                gated: false,
            },
        );
        repos.insert(
            "test-org/bin-only".to_string(),
            FakeRepo {
                revisions: revisions(&[("main", commit(6))]),
                files: bin_only,
                gated: false,
            },
        );
        repos.insert(
            "test-org/sharded".to_string(),
            FakeRepo {
                revisions: revisions(&[("main", commit(10))]),
                files: sharded,
                gated: false,
            },
        );
        repos.insert(
            "test-org/broken-index".to_string(),
            FakeRepo {
                revisions: revisions(&[("main", commit(11))]),
                files: broken_index,
                gated: false,
            },
        );
        FakeHub { repos: Arc::new(repos), log: Arc::default() }
    }

    /// Serves on a port of 127.0.0.1 from a thread of its own for the rest of the test run.
    fn serve(&self) -> String {
        let router = Router::new()
            .route("/api/models/{org}/{name}/revision/{rev}", get(info))
            .route("/{org}/{name}/resolve/{rev}/{file}", get(resolve))
            .with_state(self.clone());
        let (tx, rx) = std::sync::mpsc::channel::<SocketAddr>();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
                tx.send(listener.local_addr().expect("addr")).expect("sends");
                axum::serve(listener, router).await.expect("serves");
            });
        });
        let addr = rx.recv().expect("the fake Hub starts");
        format!("http://{addr}")
    }

    fn log(&self) -> std::sync::MutexGuard<'_, HubLog> {
        self.log.lock().expect("log")
    }
}

fn refuse(status: StatusCode, code: &str) -> Response {
    (status, [("x-error-code", code.to_string())], json!({"error": code}).to_string())
        .into_response()
}

async fn info(
    State(hub): State<FakeHub>,
    UrlPath((org, name, rev)): UrlPath<(String, String, String)>,
) -> Response {
    let Some(repo) = hub.repos.get(&format!("{org}/{name}")) else {
        return refuse(StatusCode::UNAUTHORIZED, "RepoNotFound");
    };
    let Some(sha) = repo.revisions.get(&rev) else {
        return refuse(StatusCode::NOT_FOUND, "RevisionNotFound");
    };
    let siblings: Vec<Value> = repo
        .files
        .iter()
        .map(|(file, served)| {
            let mut sibling =
                json!({"rfilename": file, "size": served.size, "blobId": served.blob_id});
            if let Some(sha256) = &served.sha256 {
                sibling["lfs"] = json!({"sha256": sha256, "size": served.size, "pointerSize": 134});
            }
            sibling
        })
        .collect();
    let gated = if repo.gated { json!("auto") } else { json!(false) };
    axum::Json(
        json!({"id": format!("{org}/{name}"), "sha": sha, "gated": gated, "siblings": siblings}),
    )
    .into_response()
}

async fn resolve(
    State(hub): State<FakeHub>,
    UrlPath((org, name, rev, file)): UrlPath<(String, String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let text = |name: header::HeaderName| {
        headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_string)
    };
    let range = text(header::RANGE);
    let cut = {
        let mut log = hub.log.lock().expect("log");
        log.resolves.push((format!("{org}/{name}/{file}"), range.clone()));
        log.authorizations.push(text(header::AUTHORIZATION));
        match log.cut_once.take() {
            Some((suffix, at)) if file.ends_with(&suffix) => Some(at),
            other => {
                log.cut_once = other;
                None
            }
        }
    };
    let Some(repo) = hub.repos.get(&format!("{org}/{name}")) else {
        return refuse(StatusCode::UNAUTHORIZED, "RepoNotFound");
    };
    if repo.gated && text(header::AUTHORIZATION).as_deref() != Some(&format!("Bearer {TOKEN}")) {
        return refuse(StatusCode::UNAUTHORIZED, "GatedRepo");
    }
    let Some(sha) = repo.revisions.get(&rev) else {
        return refuse(StatusCode::NOT_FOUND, "RevisionNotFound");
    };
    let Some(served) = repo.files.get(&file) else {
        return refuse(StatusCode::NOT_FOUND, "EntryNotFound");
    };
    let start: u64 = range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    if start > served.size {
        return StatusCode::RANGE_NOT_SATISFIABLE.into_response();
    }
    let mut body = std::fs::File::open(&served.path).expect("opens");
    body.seek(SeekFrom::Start(start)).expect("seeks");
    let length = served.size - start;
    let etag = served.sha256.clone().unwrap_or_else(|| served.blob_id.clone());
    let mut response = Response::builder()
        .header("x-repo-commit", sha)
        .header(header::ETAG, format!("\"{etag}\""))
        .header(header::CONTENT_LENGTH, length)
        .header(header::ACCEPT_RANGES, "bytes");
    response = if range.is_some() {
        response.status(StatusCode::PARTIAL_CONTENT).header(
            header::CONTENT_RANGE,
            format!("bytes {start}-{}/{}", served.size.saturating_sub(1), served.size),
        )
    } else {
        response.status(StatusCode::OK)
    };
    // A cut-off download sends part of the bytes, then drops the connection.
    let limit = cut.map_or(length, |at| at.min(length));
    let reader = tokio::fs::File::from_std(body);
    let stream = tokio_util::io::ReaderStream::new(tokio::io::AsyncReadExt::take(reader, limit));
    let stream = futures_util::StreamExt::chain(
        stream,
        futures_util::stream::iter(
            cut.map(|_| Err::<axum::body::Bytes, _>(std::io::Error::other("cut off"))),
        ),
    );
    response.body(Body::from_stream(stream)).expect("response")
}

async fn app_with_hub(endpoint: &str, token: Option<&str>) -> anyhow::Result<TestApp> {
    let endpoint = endpoint.to_string();
    let token = token.and_then(HubToken::new);
    TestApp::with_config(move |config| {
        config.hub.endpoint = endpoint;
        config.hub.token = token;
    })
    .await
}

/// Polls the pulls until `repo`'s is no longer running.
async fn wait_pull(client: &Client, repo: &str) -> anyhow::Result<Value> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let pulls = client.get("/api/models/pulls").await?.json()?;
        let pull = pulls.as_array().and_then(|p| p.iter().find(|p| p["repo"] == repo)).cloned();
        let pull = pull.ok_or_else(|| anyhow::anyhow!("no pull of {repo} in {pulls}"))?;
        if pull["state"] != "running" {
            return Ok(pull);
        }
        anyhow::ensure!(Instant::now() < deadline, "the pull of {repo} did not end: {pull}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn model_ids(client: &Client) -> anyhow::Result<Vec<String>> {
    let models = client.get("/api/models").await?.json()?;
    Ok(models
        .as_array()
        .map(|list| list.iter().filter_map(|m| m["id"].as_str().map(str::to_string)).collect())
        .unwrap_or_default())
}

fn answers_paris(dir: &Path) {
    let g = Generator::load_dir(dir).expect("the pulled folder loads");
    let prompt = g.prompt_ids("The capital of France is", PromptStyle::Plain).expect("prompt");
    let out = g.generate(&prompt, &GenerateOptions::greedy(4), &mut |_| true).expect("generates");
    let text = g.decode(&out.ids).expect("decodes");
    assert!(text.starts_with(" Paris"), "continuation {text:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_pulled_by_name_is_listed_in_the_cache_layout_and_answers() -> anyhow::Result<()> {
    let hub = FakeHub::new();
    let app = app_with_hub(&hub.serve(), None).await?;
    let admin = app.admin().await?;
    let user = app.user(&admin, "alice").await?;

    let reply = user.post("/api/models/pull", json!({"repo": SMOL})).await?;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    let started = reply.json()?;
    assert_eq!(started["commit"], commit(1));
    let total = started["total"].as_u64().unwrap_or_default();
    let weights = std::fs::metadata(smollm2().join("model.safetensors"))?.len();
    assert!(total > weights, "total {total} of {started}");
    // A second pull of the same repo while the first runs is refused.
    let again = user.post("/api/models/pull", json!({"repo": SMOL})).await?;
    assert_eq!(again.status, StatusCode::CONFLICT, "{}", again.text());
    let pull = wait_pull(&user, SMOL).await?;
    assert_eq!(pull["state"], "done", "{pull}");
    assert_eq!(pull["done"], pull["total"]);
    let id = format!("hf:{SMOL}@main");
    assert_eq!(pull["model"], id.as_str());

    let models = user.get("/api/models").await?.json()?;
    let listed = models
        .as_array()
        .and_then(|l| l.iter().find(|m| m["id"] == id.as_str()))
        .ok_or_else(|| anyhow::anyhow!("{id} not in {models}"))?;
    assert_eq!(listed["kind"], "local");
    assert_eq!(listed["origin"], "pulled");
    assert_eq!(listed["family"], "llama");
    let preset = models.as_array().and_then(|l| l.iter().find(|m| m["kind"] == "preset"));
    let preset_text = preset.map(|p| p["description"].to_string()).unwrap_or_default();
    assert!(preset_text.contains("random weights"), "{preset_text}");

    // The standard layout: refs/main holds the commit, the snapshot links into blobs.
    let folder = app.state.config().hub_dir().join("models--test-org--SmolLM2-135M-Instruct");
    assert_eq!(std::fs::read_to_string(folder.join("refs/main"))?, commit(1));
    let snapshot = folder.join("snapshots").join(commit(1));
    let link = std::fs::read_link(snapshot.join("model.safetensors"))?;
    let sha = sha256_file(&smollm2().join("model.safetensors"));
    assert_eq!(link, Path::new("../../blobs").join(&sha));
    assert_eq!(std::fs::metadata(folder.join("blobs").join(&sha))?.len(), weights);
    let leftovers: Vec<_> = std::fs::read_dir(folder.join("blobs"))?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".incomplete"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    let resolved =
        sluice::models::resolve(&app.state, &id).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    assert_eq!(resolved.spec.layers, 30);
    answers_paris(&snapshot);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_download_lists_nothing_and_resumes_with_a_range() -> anyhow::Result<()> {
    let hub = FakeHub::new();
    let cut_at = 100 << 20;
    hub.log().cut_once = Some(("model.safetensors".into(), cut_at));
    let app = app_with_hub(&hub.serve(), None).await?;
    let admin = app.admin().await?;

    let reply = admin.post("/api/models/pull", json!({"repo": SMOL})).await?;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    let failed = wait_pull(&admin, SMOL).await?;
    assert_eq!(failed["state"], "failed", "{failed}");
    let error = failed["error"].as_str().unwrap_or_default();
    assert!(error.contains("model.safetensors") && error.contains("resume"), "{error}");
    assert!(!model_ids(&admin).await?.iter().any(|id| id.starts_with("hf:")));
    let sha = sha256_file(&smollm2().join("model.safetensors"));
    let blobs = app.state.config().hub_dir().join("models--test-org--SmolLM2-135M-Instruct/blobs");
    let partial = std::fs::metadata(blobs.join(format!("{sha}.incomplete")))?.len();
    assert!(partial > 0 && partial <= cut_at, "partial {partial}");

    let reply = admin.post("/api/models/pull", json!({"repo": SMOL, "revision": "main"})).await?;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    let pull = wait_pull(&admin, SMOL).await?;
    assert_eq!(pull["state"], "done", "{pull}");
    let ranges: Vec<Option<String>> = hub
        .log()
        .resolves
        .iter()
        .filter(|(path, _)| path.ends_with("model.safetensors"))
        .map(|(_, range)| range.clone())
        .collect();
    assert_eq!(ranges, vec![None, Some(format!("bytes={partial}-"))]);
    assert!(model_ids(&admin).await?.contains(&format!("hf:{SMOL}@main")));
    assert_eq!(sha256_file(&blobs.join(&sha)), sha);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checksum_mismatch_is_refused_and_removed() -> anyhow::Result<()> {
    let hub = FakeHub::new();
    let app = app_with_hub(&hub.serve(), None).await?;
    let admin = app.admin().await?;
    let repo = "test-org/corrupt";
    let reply = admin.post("/api/models/pull", json!({"repo": repo})).await?;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    let pull = wait_pull(&admin, repo).await?;
    assert_eq!(pull["state"], "failed", "{pull}");
    let error = pull["error"].as_str().unwrap_or_default();
    assert!(error.contains("checksum mismatch for model.safetensors"), "{error}");
    assert!(!model_ids(&admin).await?.iter().any(|id| id.contains("corrupt")));
    let folder = app.state.config().hub_dir().join("models--test-org--corrupt");
    let blobs: Vec<String> = std::fs::read_dir(folder.join("blobs"))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!blobs.iter().any(|b| b.starts_with(&"0".repeat(64))), "{blobs:?}");
    assert!(!folder.join("snapshots").join(commit(5)).exists());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gated_repos_need_the_token_which_is_never_shown() -> anyhow::Result<()> {
    let hub = FakeHub::new();
    let endpoint = hub.serve();
    let without = app_with_hub(&endpoint, None).await?;
    let admin = without.admin().await?;
    let reply = admin.post("/api/models/pull", json!({"repo": "test-org/gated"})).await?;
    assert_eq!(reply.status, StatusCode::FORBIDDEN, "{}", reply.text());
    assert!(
        reply.error().contains("gated") && reply.error().contains("HF_TOKEN"),
        "{}",
        reply.text()
    );
    // A refused pull is forgotten: nothing is listed as under way.
    assert_eq!(admin.get("/api/models/pulls").await?.json()?, json!([]));

    let with = app_with_hub(&endpoint, Some(TOKEN)).await?;
    let admin = with.admin().await?;
    let reply = admin.post("/api/models/pull", json!({"repo": "test-org/gated"})).await?;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    let pull = wait_pull(&admin, "test-org/gated").await?;
    assert_eq!(pull["state"], "done", "{pull}");
    for path in ["/api/models/pulls", "/api/models", "/api/session"] {
        let text = admin.get(path).await?.text();
        assert!(!text.contains(TOKEN), "{path} shows the token");
    }
    assert!(!format!("{:?}", with.state.config()).contains(TOKEN));
    let sent = hub.log().authorizations.clone();
    assert!(sent.contains(&Some(format!("Bearer {TOKEN}"))), "{sent:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revisions_refusals_and_skipped_files() -> anyhow::Result<()> {
    let hub = FakeHub::new();
    let app = app_with_hub(&hub.serve(), None).await?;
    let admin = app.admin().await?;
    let repo = "test-org/small";

    let reply = admin.post("/api/models/pull", json!({"repo": repo, "revision": "v1"})).await?;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    let pull = wait_pull(&admin, repo).await?;
    assert_eq!(pull["state"], "done", "{pull}");
    assert_eq!(pull["commit"], commit(3));
    let names: Vec<&str> =
        pull["files"].as_array().into_iter().flatten().filter_map(|f| f["name"].as_str()).collect();
    assert_eq!(
        names,
        ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"]
    );
    let folder = app.state.config().hub_dir().join("models--test-org--small");
    assert_eq!(std::fs::read_to_string(folder.join("refs/v1"))?, commit(3));
    assert!(!folder.join("refs/main").exists());
    assert!(!folder.join("snapshots").join(commit(3)).join("README.md").exists());
    let ids = model_ids(&admin).await?;
    assert!(ids.contains(&format!("hf:{repo}@v1")), "{ids:?}");
    assert!(!ids.contains(&format!("hf:{repo}@main")), "{ids:?}");
    // A commit pulls by itself, without a ref, and shares the blobs already there.
    let before = hub.log().resolves.len();
    let reply =
        admin.post("/api/models/pull", json!({"repo": repo, "revision": commit(2)})).await?;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    assert_eq!(wait_pull(&admin, repo).await?["state"], "done");
    let fetched: Vec<String> =
        hub.log().resolves[before..].iter().map(|(path, _)| path.clone()).collect();
    assert_eq!(fetched, [format!("{repo}/config.json")], "only the access check is fetched");
    assert!(model_ids(&admin).await?.contains(&format!("hf:{repo}@{}", commit(2))));

    // A sharded model: the index and exactly the shards it names.
    let reply = admin.post("/api/models/pull", json!({"repo": "test-org/sharded"})).await?;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    let pull = wait_pull(&admin, "test-org/sharded").await?;
    assert_eq!(pull["state"], "done", "{pull}");
    let names: Vec<&str> =
        pull["files"].as_array().into_iter().flatten().filter_map(|f| f["name"].as_str()).collect();
    assert_eq!(
        names,
        [
            "config.json",
            "tokenizer.json",
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors"
        ]
    );
    assert!(model_ids(&admin).await?.contains(&"hf:test-org/sharded@main".to_string()));

    let cases = [
        (
            json!({"repo": "test-org/broken-index"}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "names model-00002-of-00002.safetensors",
        ),
        (json!({"repo": "test-org/missing"}), StatusCode::NOT_FOUND, "no model test-org/missing"),
        (json!({"repo": repo, "revision": "v9"}), StatusCode::NOT_FOUND, "no revision \"v9\""),
        (json!({"repo": "test-org/bin-only"}), StatusCode::UNPROCESSABLE_ENTITY, "no safetensors"),
        (json!({"repo": "../etc"}), StatusCode::BAD_REQUEST, "not a Hugging Face model id"),
        (json!({"repo": repo, "revision": "refs/pr/1"}), StatusCode::BAD_REQUEST, "revision"),
        (json!({"repo": repo, "extra": 1}), StatusCode::UNPROCESSABLE_ENTITY, "extra"),
    ];
    for (body, status, words) in cases {
        let reply = admin.post("/api/models/pull", body.clone()).await?;
        assert_eq!(reply.status, status, "{body}: {}", reply.text());
        assert!(reply.error().contains(words), "{body}: {}", reply.text());
    }
    let reply = app.client().post("/api/models/pull", json!({"repo": repo})).await?;
    assert!(reply.status.is_client_error(), "{}", reply.status);
    Ok(())
}

/// Lays out a Hugging Face cache as `huggingface_hub` writes it: blobs named by hash (hard
/// links to the imported files, to spare the disk), a snapshot of symlinks, a ref.
fn user_cache(root: &Path, repo: &str, commit: &str) -> PathBuf {
    let folder = root.join(format!("models--{}", repo.replace('/', "--")));
    let snapshot = folder.join("snapshots").join(commit);
    std::fs::create_dir_all(folder.join("blobs")).expect("mkdir");
    std::fs::create_dir_all(folder.join("refs")).expect("mkdir");
    std::fs::create_dir_all(&snapshot).expect("mkdir");
    for entry in std::fs::read_dir(smollm2()).expect("lists") {
        let entry = entry.expect("entry");
        let name = entry.file_name().to_string_lossy().into_owned();
        let hash = sha256_file(&entry.path());
        let blob = folder.join("blobs").join(&hash);
        if !blob.exists() {
            std::fs::hard_link(entry.path(), &blob).expect("links");
        }
        std::os::unix::fs::symlink(format!("../../blobs/{hash}"), snapshot.join(name))
            .expect("symlink");
    }
    std::fs::write(folder.join("refs/main"), commit).expect("ref");
    snapshot
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_cache_is_listed_and_its_models_load() -> anyhow::Result<()> {
    let cache = tempfile::tempdir()?;
    let snapshot = user_cache(cache.path(), "HuggingFaceTB/SmolLM2-135M-Instruct", &commit(9));
    // What `AutoConfig` alone leaves (a config, no weights) and a cut-off download are not listed.
    let config_only = cache.path().join("models--someone--config-only/snapshots").join(commit(8));
    std::fs::create_dir_all(&config_only)?;
    std::fs::copy(smollm2().join("config.json"), config_only.join("config.json"))?;
    let dangling = cache.path().join("models--someone--dangling/snapshots").join(commit(7));
    std::fs::create_dir_all(&dangling)?;
    std::fs::copy(smollm2().join("config.json"), dangling.join("config.json"))?;
    std::os::unix::fs::symlink("../../blobs/missing", dangling.join("model.safetensors"))?;

    let root = cache.path().to_path_buf();
    let app = TestApp::with_config(move |config| config.hub.user_cache = Some(root)).await?;
    let admin = app.admin().await?;
    let models = admin.get("/api/models").await?.json()?;
    let hf: Vec<&Value> =
        models.as_array().into_iter().flatten().filter(|m| m["origin"] == "hf-cache").collect();
    assert_eq!(hf.len(), 1, "{models}");
    let id = "hf:HuggingFaceTB/SmolLM2-135M-Instruct@main";
    assert_eq!(hf[0]["id"], id);
    assert!(hf[0]["description"].as_str().unwrap_or_default().contains("commit 0909090"));
    let by_commit = format!("hf:HuggingFaceTB/SmolLM2-135M-Instruct@{}", commit(9));
    for id in [id, by_commit.as_str(), "hf:HuggingFaceTB/SmolLM2-135M-Instruct"] {
        let resolved =
            sluice::models::resolve(&app.state, id).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        assert_eq!(resolved.spec.hidden, 576, "{id}");
    }
    for bad in
        ["hf:someone/config-only@main", "hf:HuggingFaceTB/SmolLM2-135M-Instruct@v2", "hf:../x"]
    {
        assert!(sluice::models::resolve(&app.state, bad).is_err(), "{bad}");
    }
    // The new-job form's planner takes the id like any other model.
    let dataset = admin.demo_dataset().await?;
    let plan = admin
        .post(
            "/api/plan",
            json!({"model": id, "dataset": dataset, "gpu": "cpu", "steps": 1, "seq_len": 64}),
        )
        .await?;
    assert_eq!(plan.status, StatusCode::OK, "{}", plan.text());
    answers_paris(&snapshot);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pulled_model_is_deleted_with_every_revision_and_the_users_cache_never_is()
-> anyhow::Result<()> {
    let hub = FakeHub::new();
    let endpoint = hub.serve();
    let cache = tempfile::tempdir()?;
    let theirs = user_cache(cache.path(), "HuggingFaceTB/SmolLM2-135M-Instruct", &commit(9));
    let root = cache.path().to_path_buf();
    let app = TestApp::with_config(move |config| {
        config.hub.endpoint = endpoint;
        config.hub.user_cache = Some(root);
    })
    .await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let reply = alice.post("/api/models/pull", json!({"repo": SMOL})).await?;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    assert_eq!(wait_pull(&alice, SMOL).await?["state"], "done");

    // The storage page lists the pulled repo with its size; the user's cache is not Sluice's.
    let storage = admin.get("/api/storage").await?.json()?;
    let name = format!("hf:{SMOL}");
    let models = storage["models"].as_array().cloned().unwrap_or_default();
    let row = models.iter().find(|m| m["name"] == name.as_str()).cloned();
    let row = row.ok_or_else(|| anyhow::anyhow!("{name} not in {storage}"))?;
    assert_eq!(row["origin"], "pulled", "{row}");
    let weights = std::fs::metadata(smollm2().join("model.safetensors"))?.len();
    let bytes = row["bytes"].as_u64().unwrap_or_default();
    assert!(bytes > weights, "{row}");
    assert!(!storage.to_string().contains("HuggingFaceTB"), "{storage}");

    let path = format!("/api/storage/models/hf%3A{}", SMOL.replace('/', "%2F"));
    assert_eq!(alice.delete(&path).await?.status, StatusCode::FORBIDDEN);
    // Not while a job trains any revision of it.
    let demo = admin.demo_dataset().await?;
    let job = alice
        .submit(json!({"model": format!("hf:{SMOL}@main"), "dataset": demo, "gpu": "cpu",
            "steps": 100_000, "seq_len": 256, "micro_batch": 1, "grad_accum": 1}))
        .await?;
    let started = alice.wait_job(job, 120, |j| j["status"] != "queued").await?;
    let log = alice.get(&format!("/api/jobs/{job}/log")).await?.text();
    assert_eq!(started["status"], "running", "{started}\n{log}");
    let busy = admin.delete(&path).await?;
    let now = alice.get(&format!("/api/jobs/{job}")).await?.json()?;
    assert_eq!(busy.status, StatusCode::CONFLICT, "{} while the job is {now}", busy.text());
    alice.post(&format!("/api/jobs/{job}/cancel"), json!({})).await?;
    alice.wait_job(job, 120, |j| j["status"] == "cancelled").await?;

    let deleted = admin.delete(&path).await?;
    assert_eq!(deleted.status, StatusCode::OK, "{}", deleted.text());
    assert_eq!(deleted.json()?["freed_bytes"], bytes);
    let folder = app.state.config().hub_dir().join("models--test-org--SmolLM2-135M-Instruct");
    assert!(!folder.exists(), "{}", folder.display());
    let ids = model_ids(&admin).await?;
    assert!(!ids.iter().any(|id| id.contains(SMOL)), "{ids:?}");
    assert!(ids.iter().any(|id| id.contains("HuggingFaceTB")), "{ids:?}");
    assert!(theirs.join("config.json").exists(), "the user's cache is untouched");

    // Gone, in the user's cache only, or no repo name at all: nothing to delete.
    assert_eq!(admin.delete(&path).await?.status, StatusCode::NOT_FOUND);
    let user_cache_path = "/api/storage/models/hf%3AHuggingFaceTB%2FSmolLM2-135M-Instruct";
    assert_eq!(admin.delete(user_cache_path).await?.status, StatusCode::NOT_FOUND);
    assert_eq!(
        admin.delete("/api/storage/models/hf%3A..%2Fx").await?.status,
        StatusCode::NOT_FOUND
    );
    assert!(theirs.join("config.json").exists());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sluice_pull_pulls_from_the_command_line() -> anyhow::Result<()> {
    let hub = FakeHub::new();
    let endpoint = hub.serve();
    let data = tempfile::tempdir()?;
    let run = |repo: &str, token: Option<&str>, extra: &[&str]| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
        command.arg("pull").arg(repo).args(extra).arg("--data-dir").arg(data.path());
        command.env("HF_ENDPOINT", &endpoint).env_remove("HF_TOKEN");
        if let Some(token) = token {
            command.env("HF_TOKEN", token);
        }
        command.output().expect("runs")
    };
    let denied = tokio::task::block_in_place(|| run("test-org/gated", None, &[]));
    assert!(!denied.status.success());
    let stderr = String::from_utf8_lossy(&denied.stderr);
    assert!(stderr.contains("gated") && stderr.contains("HF_TOKEN"), "{stderr}");

    let pulled =
        tokio::task::block_in_place(|| run("test-org/gated", Some(TOKEN), &["--revision", "main"]));
    let stdout = String::from_utf8_lossy(&pulled.stdout);
    assert!(pulled.status.success(), "{stdout} {}", String::from_utf8_lossy(&pulled.stderr));
    assert!(stdout.contains("pulled hf:test-org/gated@main"), "{stdout}");
    let folder = data.path().join("hub/models--test-org--gated");
    assert_eq!(std::fs::read_to_string(folder.join("refs/main"))?, commit(4));

    // The appliance on that data directory lists what the command line pulled.
    let dir = data.path().to_path_buf();
    let app = TestApp::with_config(move |config| config.data_dir = dir).await?;
    let admin = app.admin().await?;
    assert!(model_ids(&admin).await?.contains(&"hf:test-org/gated@main".to_string()));
    Ok(())
}
