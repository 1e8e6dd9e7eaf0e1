//! "Try it": a checkpoint answers a conversation (or continues a prompt) with the KV cache, on a
//! free GPU when one has room, else on the CPU, and the tokens stream to the page as they are
//! made.
//!
//! Training comes first. A generation holds its device in the queue's busy set while it runs
//! (a job queued for that device waits a few seconds); it never takes a device a job is
//! training on, and when every device it could use is training it answers 409. On the CPU
//! beside a running job it uses a quarter of the cores, so the job's optimizer keeps the rest.
//!
//! The last model loaded stays loaded (one slot) so a conversation's next turn starts at once;
//! the dispatcher empties the slot before any job starts, and it is emptied after
//! [`IDLE_UNLOAD`] without use, so a cached model never holds memory a job could plan with.

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use axum::Json;
use axum::extract::State;
use axum::http::header;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sluice_engine::backend::Backend;
use sluice_engine::backend::cpu::Cpu;
use sluice_engine::backend::cuda::Cuda;
use sluice_engine::data::{Message, Role};
use sluice_engine::generate::{GenerateOptions, Generator, PromptStyle};
use sluice_engine::spec::ModelSpec;
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::AppState;
use crate::auth::CurrentUser;
use crate::error::{ApiError, ApiJson, ApiPath, ApiResult};
use crate::jobs::runner::{self, DeviceClaim};
use crate::jobs::store;

/// The most tokens one answer may have: enough to judge a checkpoint, short enough on a CPU.
pub const MAX_NEW_TOKENS: usize = 256;
/// The most messages a conversation may send, and their most text in all.
pub const MAX_MESSAGES: usize = 64;
pub const MAX_CONVERSATION_BYTES: usize = 64 << 10;
/// A loaded model not used for this long is unloaded.
pub const IDLE_UNLOAD: Duration = Duration::from_secs(300);

/// One generation at a time: each may hold a whole model in memory.
static GENERATING: Semaphore = Semaphore::const_new(1);

/// The loaded-model slot (in [`AppState`]).
#[derive(Debug, Default)]
pub struct TryIt {
    slot: Mutex<Option<Loaded>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Cpu,
    Gpu(usize),
}

impl Place {
    fn id(self) -> String {
        match self {
            Place::Cpu => "cpu".into(),
            Place::Gpu(n) => format!("cuda:{n}"),
        }
    }
}

/// What a loaded model was loaded from: a checkpoint folder as it was on disk, on a device.
#[derive(Debug, Clone, PartialEq)]
struct Key {
    dir: PathBuf,
    modified: Option<SystemTime>,
    place: Place,
}

impl Key {
    fn of(dir: &Path, place: Place) -> Key {
        let modified = std::fs::metadata(dir.join("config.json")).and_then(|m| m.modified()).ok();
        Key { dir: dir.to_path_buf(), modified, place }
    }
}

enum AnyGenerator {
    // Boxed: a generator is kilobytes of handles and buffers; the slot holds a pointer.
    Cpu(Box<Generator<Cpu>>),
    Cuda(Box<Generator<Cuda>>),
}

struct Loaded {
    key: Key,
    generator: AnyGenerator,
    last_used: Instant,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded").field("key", &self.key).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl TryIt {
    /// Empties the slot (before a job starts: its memory is the job's). Dropping a GPU model
    /// frees its memory and, with the last user of the device gone, the driver's context.
    pub fn unload(&self) {
        let loaded = lock(&self.slot).take();
        drop(loaded);
    }

    fn unload_idle(&self) {
        let mut slot = lock(&self.slot);
        if slot.as_ref().is_some_and(|l| l.last_used.elapsed() >= IDLE_UNLOAD) {
            let loaded = slot.take();
            drop(slot);
            drop(loaded);
        }
    }

    fn take(&self, key: &Key) -> Option<AnyGenerator> {
        let mut slot = lock(&self.slot);
        match slot.take() {
            Some(loaded) if loaded.key == *key => Some(loaded.generator),
            other => {
                drop(slot);
                drop(other);
                None
            }
        }
    }

    fn put(&self, key: Key, generator: AnyGenerator) {
        *lock(&self.slot) = Some(Loaded { key, generator, last_used: Instant::now() });
    }

    fn holds(&self, dir: &Path, place: Place) -> bool {
        lock(&self.slot).as_ref().is_some_and(|l| l.key.dir == dir && l.key.place == place)
    }
}

/// Starts the task that unloads an idle model.
pub fn start(state: &AppState) {
    let state = state.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(30)).await;
            let state = state.clone();
            let _ = tokio::task::spawn_blocking(move || state.tryit().unload_idle()).await;
        }
    });
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TryRequest {
    /// A text to continue (one user turn when the checkpoint has a chat template).
    #[serde(default)]
    prompt: Option<String>,
    /// A conversation ending with a user turn.
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    #[serde(default = "default_new_tokens")]
    max_new_tokens: usize,
    /// 0 (the default) is greedy.
    #[serde(default)]
    temperature: f32,
    /// Server-sent events (`start`, `token`..., `done` or `error`) instead of one JSON reply.
    #[serde(default)]
    stream: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatMessage {
    role: String,
    content: String,
}

fn default_new_tokens() -> usize {
    64
}

/// What the model is asked, checked.
#[derive(Debug, Clone)]
enum Ask {
    /// A prompt: continued as is, or as one user turn with a chat template.
    Prompt(String),
    /// A conversation; without a chat template only its last user turn is continued.
    Turns(Vec<Message>),
}

impl TryRequest {
    fn check(&self) -> ApiResult<Ask> {
        if self.max_new_tokens == 0 || self.max_new_tokens > MAX_NEW_TOKENS {
            return Err(ApiError::bad_request(format!(
                "max_new_tokens must be 1 to {MAX_NEW_TOKENS}"
            )));
        }
        if !self.temperature.is_finite() || !(0.0..=2.0).contains(&self.temperature) {
            return Err(ApiError::bad_request("temperature must be 0 to 2"));
        }
        let ask = match (&self.prompt, &self.messages) {
            (Some(_), Some(_)) => {
                return Err(ApiError::bad_request("give a prompt or messages, not both"));
            }
            (None, None) => {
                return Err(ApiError::bad_request("the request needs a prompt or messages"));
            }
            (Some(prompt), None) => Ask::Prompt(prompt.clone()),
            (None, Some(messages)) => Ask::Turns(turns(messages)?),
        };
        let last = match &ask {
            Ask::Prompt(p) => p.as_str(),
            Ask::Turns(t) => t.last().map_or("", |m| m.content.as_str()),
        };
        if last.trim().is_empty() {
            return Err(ApiError::bad_request("the prompt is empty"));
        }
        if last.len() > MAX_CONVERSATION_BYTES {
            return Err(ApiError::bad_request(format!(
                "the prompt is longer than {} KiB",
                MAX_CONVERSATION_BYTES >> 10
            )));
        }
        Ok(ask)
    }
}

fn turns(messages: &[ChatMessage]) -> ApiResult<Vec<Message>> {
    if messages.is_empty() || messages.len() > MAX_MESSAGES {
        return Err(ApiError::bad_request(format!("messages must hold 1 to {MAX_MESSAGES} turns")));
    }
    let bytes: usize = messages.iter().map(|m| m.content.len()).sum();
    if bytes > MAX_CONVERSATION_BYTES {
        return Err(ApiError::bad_request(format!(
            "the conversation is longer than {} KiB; start a new one",
            MAX_CONVERSATION_BYTES >> 10
        )));
    }
    let turns = messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match m.role.as_str() {
                "system" => Role::System,
                "user" => Role::User,
                "assistant" => Role::Assistant,
                other => {
                    return Err(ApiError::bad_request(format!(
                        "message {} has role {other:?}; roles are system, user and assistant",
                        i + 1
                    )));
                }
            };
            Ok(Message::new(role, m.content.clone()))
        })
        .collect::<ApiResult<Vec<_>>>()?;
    if turns.last().is_some_and(|m| m.role != Role::User) {
        return Err(ApiError::bad_request("messages must end with a user turn"));
    }
    Ok(turns)
}

/// `POST /api/jobs/{id}/checkpoints/{name}/generate`: see the module's documentation. 404 for
/// a checkpoint the user may not download; 400 for a request out of range; 409 when every
/// device is training; 422 when the folder cannot generate.
pub(crate) async fn generate(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath((id, name)): ApiPath<(i64, String)>,
    ApiJson(request): ApiJson<TryRequest>,
) -> ApiResult<Response> {
    let dir = super::checkpoints::checkpoint_dir(&state, &user, id, &name).await?;
    let ask = request.check()?;
    let unusable = {
        let name = name.clone();
        move |err: &dyn std::fmt::Display| {
            ApiError::unprocessable(format!("checkpoint {name} cannot generate: {err}"))
        }
    };
    let spec = ModelSpec::from_path(&dir).map_err(|e| unusable(&e))?;
    let permit = GENERATING.acquire().await.map_err(ApiError::internal)?;
    let choice = choose_device(&state, &dir, &spec).await?;
    let options = GenerateOptions {
        max_new_tokens: request.max_new_tokens,
        temperature: request.temperature,
        top_p: 1.0,
        seed: 0,
    };
    let (sender, mut receiver) = mpsc::unbounded_channel::<Result<(&'static str, Value), String>>();
    let worker = state.clone();
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let outcome = answer(&worker, &dir, choice, &ask, &options, &sender);
        if let Err(message) = outcome {
            let _ = sender.send(Err(message));
        }
    });
    // The first message says whether the model loaded: errors until then are plain API errors.
    let start = match receiver.recv().await {
        Some(Ok(start)) => start,
        Some(Err(message)) => return Err(unusable(&message)),
        None => return Err(ApiError::internal(anyhow::anyhow!("generation ended unannounced"))),
    };
    if request.stream {
        let first = futures_util::stream::once(std::future::ready(Ok(start)));
        let rest = UnboundedReceiverStream::new(receiver);
        let events = first.chain(rest).map(|item| {
            let (name, data) = match item {
                Ok(pair) => pair,
                Err(message) => ("error", json!({ "error": message })),
            };
            Ok::<_, Infallible>(Event::default().event(name).data(data.to_string()))
        });
        // The page decodes UTF-8; saying so keeps other readers from guessing Latin-1.
        let utf8 = [(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")];
        return Ok((utf8, Sse::new(events).keep_alive(KeepAlive::default())).into_response());
    }
    while let Some(item) = receiver.recv().await {
        match item {
            Ok(("done", reply)) => return Ok(Json(reply).into_response()),
            Ok(_) => {}
            Err(message) => return Err(unusable(&message)),
        }
    }
    Err(ApiError::internal(anyhow::anyhow!("generation ended without an answer")))
}

/// The device a generation will use, held until it ends, and why it is not a GPU.
struct Choice {
    place: Place,
    note: Option<String>,
    _claim: DeviceClaim,
}

/// GPU memory a model needs to generate: bf16 weights, a KV cache of a few thousand positions,
/// and room for the context, the logits and the workspace.
fn gpu_bytes_needed(spec: &ModelSpec) -> u64 {
    let weights = spec.total_params() as u64 * 2;
    let positions = spec.max_positions.min(4096) as u64;
    let kv = 2 * spec.layers as u64 * (spec.kv_heads * spec.head_dim) as u64 * positions * 2;
    weights + kv + (2 << 30)
}

async fn choose_device(state: &AppState, dir: &Path, spec: &ModelSpec) -> ApiResult<Choice> {
    let running = store::running_devices(state).await?;
    let training = |device: &str| {
        running.iter().find(|(_, d)| d.split(',').any(|m| m == device)).map(|(id, _)| *id)
    };
    let needed = gpu_bytes_needed(spec);
    let mut reasons = Vec::new();
    for gpu in state.gpus().list().into_iter().filter(|d| d.id != "cpu") {
        let Some(n) = gpu.id.strip_prefix("cuda:").and_then(|n| n.parse().ok()) else { continue };
        if let Some(job) = training(&gpu.id) {
            reasons.push(format!("{} is training job {job}", gpu.id));
            continue;
        }
        let free = gpu.memory_total.saturating_sub(gpu.memory_used);
        if free < needed && !state.tryit().holds(dir, Place::Gpu(n)) {
            reasons.push(format!(
                "{} has {:.1} GiB free and the model needs {:.1} GiB",
                gpu.id,
                gib(free),
                gib(needed)
            ));
            continue;
        }
        match runner::try_claim(state, &gpu.id) {
            Some(claim) => return Ok(Choice { place: Place::Gpu(n), note: None, _claim: claim }),
            None => reasons.push(format!("{} is starting a job", gpu.id)),
        }
    }
    if let Some(job) = training("cpu") {
        return Err(ApiError::conflict(format!(
            "the CPU is training job {job}{}; try again when it finishes",
            if reasons.is_empty() { String::new() } else { format!(" and {}", reasons.join(", ")) }
        )));
    }
    let Some(claim) = runner::try_claim(state, "cpu") else {
        return Err(ApiError::conflict("the CPU is starting a job; try again in a moment"));
    };
    let note =
        (!reasons.is_empty()).then(|| format!("{}, so this ran on the CPU", reasons.join(", ")));
    Ok(Choice { place: Place::Cpu, note, _claim: claim })
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 30)
}

type Sender = mpsc::UnboundedSender<Result<(&'static str, Value), String>>;

/// Loads (or reuses) the model on the chosen device and generates, sending `start`, each
/// `token` and `done`. Runs on a blocking thread; the device stays claimed until it returns.
fn answer(
    state: &AppState,
    dir: &Path,
    choice: Choice,
    ask: &Ask,
    options: &GenerateOptions,
    sender: &Sender,
) -> Result<(), String> {
    let key = Key::of(dir, choice.place);
    let (generator, reused) = match state.tryit().take(&key) {
        Some(generator) => (generator, true),
        None => (load(dir, choice.place).map_err(|e| e.to_string())?, false),
    };
    let head = Head { device: choice.place.id(), note: choice.note.clone(), reused };
    let outcome = match &generator {
        AnyGenerator::Cpu(g) => {
            // Beside a running job, a quarter of the cores: the job's optimizer keeps the rest.
            let others_busy = runner::busy_devices(state).len() > 1;
            let cores = std::thread::available_parallelism().map_or(1, usize::from);
            let threads = if others_busy { (cores / 4).max(1) } else { cores };
            match rayon::ThreadPoolBuilder::new().num_threads(threads).build() {
                Ok(pool) => pool.install(|| run(g.as_ref(), &head, ask, options, sender)),
                Err(e) => Err(format!("cannot start generation threads: {e}")),
            }
        }
        AnyGenerator::Cuda(g) => run(g.as_ref(), &head, ask, options, sender),
    };
    // Back in the slot before the device is released, so a job that claims it next unloads it.
    state.tryit().put(key, generator);
    drop(choice);
    outcome
}

fn load(dir: &Path, place: Place) -> sluice_engine::Result<AnyGenerator> {
    Ok(match place {
        Place::Cpu => AnyGenerator::Cpu(Box::new(Generator::load_dir(dir)?)),
        Place::Gpu(n) => AnyGenerator::Cuda(Box::new(Generator::load_dir_on(Cuda::new(n)?, dir)?)),
    })
}

struct Head {
    device: String,
    note: Option<String>,
    reused: bool,
}

#[derive(Debug, Serialize)]
struct Done {
    text: String,
    /// New tokens generated (without the prompt or the stop token).
    tokens: usize,
    /// Whether the model ended on its end-of-sequence token rather than the length limit.
    stopped_at_eos: bool,
    /// Whether the conversation went through the checkpoint's chat template.
    chat: bool,
    device: String,
    device_note: Option<String>,
    /// Seconds from the first prompt token to the last new token (loading not counted).
    seconds: f64,
    tokens_per_s: f64,
}

fn run<B: Backend>(
    g: &Generator<B>,
    head: &Head,
    ask: &Ask,
    options: &GenerateOptions,
    sender: &Sender,
) -> Result<(), String> {
    let chat = g.has_chat_template();
    let text_err = |e: sluice_engine::Error| e.to_string();
    let prompt = match (ask, chat) {
        (Ask::Prompt(p), true) => g.prompt_ids(p, PromptStyle::Chat).map_err(text_err)?,
        (Ask::Prompt(p), false) => g.prompt_ids(p, PromptStyle::Plain).map_err(text_err)?,
        (Ask::Turns(turns), true) => g.chat_ids(turns).map_err(text_err)?,
        (Ask::Turns(turns), false) => {
            let last = turns.last().map_or("", |m| m.content.as_str());
            g.prompt_ids(last, PromptStyle::Plain).map_err(text_err)?
        }
    };
    let room = g.spec().max_positions.saturating_sub(1);
    if prompt.len() > room {
        return Err(format!(
            "the conversation is {} tokens and the model reads at most {room}; start a new one",
            prompt.len()
        ));
    }
    let start = json!({
        "device": head.device,
        "device_note": head.note,
        "chat": chat,
        "prompt_tokens": prompt.len(),
        "reused": head.reused,
    });
    if sender.send(Ok(("start", start))).is_err() {
        return Ok(());
    }
    let began = Instant::now();
    let mut ids = Vec::new();
    let mut shown = String::new();
    let generated = g
        .generate(&prompt, options, &mut |id| {
            ids.push(id);
            // Whole-text decoding, so a character split over tokens shows once it is complete.
            let Ok(text) = g.decode(&ids) else { return true };
            if text.ends_with('\u{FFFD}') || text.len() <= shown.len() {
                return true;
            }
            let delta = match text.get(shown.len()..) {
                Some(tail) if text.starts_with(&shown) => tail.to_string(),
                _ => return true,
            };
            shown = text;
            // A viewer that went away stops the generation.
            sender.send(Ok(("token", json!({ "text": delta })))).is_ok()
        })
        .map_err(text_err)?;
    let seconds = began.elapsed().as_secs_f64();
    let text = g.decode(&generated.ids).map_err(text_err)?;
    if text.len() > shown.len() && text.starts_with(&shown) {
        let _ = sender.send(Ok(("token", json!({ "text": text[shown.len()..] }))));
    }
    let done = Done {
        text,
        tokens: generated.ids.len(),
        stopped_at_eos: generated.stopped_at_eos,
        chat,
        device: head.device.clone(),
        device_note: head.note.clone(),
        seconds,
        tokens_per_s: if seconds > 0.0 { generated.ids.len() as f64 / seconds } else { 0.0 },
    };
    let done = serde_json::to_value(done).map_err(|e| e.to_string())?;
    let _ = sender.send(Ok(("done", done)));
    Ok(())
}
