//! "Try it", the service: a checkpoint answers a conversation (or continues a prompt) with the KV cache, on a
//! free GPU when one has room, else on the CPU, and the tokens stream to the page as they are
//! made.
//!
//! Training comes first. A generation holds its device in the queue's busy set while it runs
//! (a job queued for that device waits a few seconds); it never takes a device a job is
//! training on or a queued job waits for, and when every device it could use is training,
//! starting a job or wanted by one it answers [`TryError::Busy`]. On the CPU beside a running
//! job it uses a quarter of the cores, so the job's optimizer keeps the rest.
//!
//! One model works at a time; requests wait for their turn in arrival order (a fair semaphore),
//! at most [`MAX_WAITING`] of them and for at most [`MAX_WAIT`], and are Busy beyond that.
//!
//! The last model loaded stays loaded (one slot) so a conversation's next turn starts at once;
//! the dispatcher empties the slot before any job starts, and it is emptied after
//! `slot::IDLE_UNLOAD` without use, so a cached model never holds memory a job could plan with.
//!
//! No HTTP here: `api::tryit` parses the request into an [`Ask`], calls [`begin`], and turns
//! the [`Generation`] into a reply or server-sent events; [`TryError`] says why nothing runs.
//! [`with_model`] is the same rules for any work with a loaded model (`crate::serving`).

pub mod slot;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{Value, json};
use sluice_engine::backend::Backend;
use sluice_engine::backend::cpu::Cpu;
use sluice_engine::backend::cuda::Cuda;
use sluice_engine::data::Message;
use sluice_engine::generate::{GenerateOptions, Generator, PromptStyle};
use sluice_engine::spec::ModelSpec;
use sluice_engine::train::ModelSource;
use tokio::sync::{Semaphore, SemaphorePermit, mpsc};

use slot::{AnyGenerator, Key, Place, load};

use crate::AppState;
use crate::jobs::runner::{self, DeviceClaim};
use crate::store::jobs as store;

/// One generation at a time: each may hold a whole model in memory. Tokio's semaphore is fair:
/// waiters are served in arrival order.
static GENERATING: Semaphore = Semaphore::const_new(1);

/// Requests waiting for their turn now.
static WAITING: AtomicUsize = AtomicUsize::new(0);

/// The most requests that wait for a turn; more are Busy at once.
pub const MAX_WAITING: usize = 32;

/// The longest a request waits for its turn before it is Busy.
pub const MAX_WAIT: Duration = Duration::from_secs(120);

/// What the model is asked, checked.
#[derive(Debug, Clone)]
pub enum Ask {
    /// A prompt: continued as is, or as one user turn with a chat template.
    Prompt(String),
    /// A conversation; without a chat template only its last user turn is continued.
    Turns(Vec<Message>),
}

/// Why a generation does not run, or stopped.
#[derive(Debug, thiserror::Error)]
pub enum TryError {
    /// The model folder cannot generate (the engine refuses it, or the conversation does not
    /// fit the model); `model` says which ("checkpoint final", "the base model").
    #[error("{model} cannot generate: {why}")]
    Unusable { model: String, why: String },
    /// The job has no base model folder to compare with (a preset starts from random weights,
    /// or the folder is gone).
    #[error("{0}")]
    NoBaseModel(String),
    /// Every device it could use is training, starting a job or wanted by a queued one, or too
    /// many requests wait already; worth trying again after about `retry_after_s` seconds.
    #[error("{message}")]
    Busy { message: String, retry_after_s: u64 },
    /// A fault of the server.
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

/// What a generation sends, in order: `("start", ..)`, `("token", ..)`..., `("done", ..)`; an
/// `Err` is a failure after the start, for the user.
pub type Item = Result<(&'static str, Value), String>;

/// A generation under way, its model loaded.
#[derive(Debug)]
pub struct Generation {
    /// The `start` message: device, whether the chat template applies, prompt tokens.
    pub start: (&'static str, Value),
    /// Everything after it.
    pub rest: mpsc::UnboundedReceiver<Item>,
    /// What generates ("checkpoint final"), for errors after the start.
    model: String,
}

impl Generation {
    /// A failure after the start, as the error it is.
    pub fn failed(&self, why: String) -> TryError {
        TryError::Unusable { model: self.model.clone(), why }
    }
}

/// The folder a job with model `id` started from, to answer beside its checkpoints: a model
/// folder, or a snapshot in a Hugging Face cache. A preset has none (its weights were random,
/// drawn from the job's seed), and a folder deleted since is gone.
pub fn base_model_dir(state: &AppState, id: &str) -> Result<PathBuf, TryError> {
    match crate::models::source(state, id) {
        Ok(ModelSource::Dir(dir)) => Ok(dir),
        Ok(ModelSource::Preset(name)) => Err(TryError::NoBaseModel(format!(
            "this job started from the preset {name}, random weights with no folder of their \
             own: there is no base model to compare with"
        ))),
        Err(why) => Err(TryError::NoBaseModel(format!(
            "the base model {id} is no longer on this machine ({why})"
        ))),
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

/// Generates from the model folder `dir` (`model` names it for errors: "checkpoint final")
/// on the device [`choose_device`] picks; returns once the model is loaded (errors until then
/// are the whole answer) or it failed.
pub async fn begin(
    state: &AppState,
    dir: PathBuf,
    model: &str,
    ask: Ask,
    options: GenerateOptions,
) -> Result<Generation, TryError> {
    let unusable = |why: String| TryError::Unusable { model: model.to_string(), why };
    let (sender, mut receiver) = mpsc::unbounded_channel::<Item>();
    let work = with_model(state, dir, model, move |loaded, device| {
        let outcome = match loaded {
            Loaded::Cpu(g) => run(g, device, &ask, &options, &sender),
            Loaded::Cuda(g) => run(g, device, &ask, &options, &sender),
        };
        if let Err(message) = outcome {
            let _ = sender.send(Err(message));
        }
    });
    match first_item(work, &mut receiver).await? {
        Some(Ok(start)) => Ok(Generation { start, rest: receiver, model: model.to_string() }),
        Some(Err(message)) => Err(unusable(message)),
        None => Err(anyhow::anyhow!("generation ended unannounced").into()),
    }
}

/// The first item `work` sends on `receiver`, or `work`'s own error when it fails before it
/// sends one (its model does not load, no device is free). Once the first item is here `work`
/// goes on by itself: the blocking thread [`with_model`] started owns the device and the turn.
pub async fn first_item<I>(
    work: impl Future<Output = Result<(), TryError>>,
    receiver: &mut mpsc::UnboundedReceiver<I>,
) -> Result<Option<I>, TryError> {
    let mut work = std::pin::pin!(work);
    tokio::select! {
        biased;
        first = receiver.recv() => Ok(first),
        done = &mut work => {
            done?;
            Ok(receiver.recv().await)
        }
    }
}

/// A loaded model, as work given to [`with_model`] sees it.
pub enum Loaded<'a> {
    Cpu(&'a Generator<Cpu>),
    Cuda(&'a Generator<Cuda>),
}

/// The device work runs on, held until the work returns.
#[derive(Debug)]
pub struct Device {
    /// "cpu" or "cuda:N".
    pub id: String,
    /// Why it is not a GPU, where GPUs were passed over.
    pub note: Option<String>,
    /// Whether the model was loaded already (by an earlier request).
    pub reused: bool,
    claim: DeviceClaim,
}

impl Device {
    /// Whether a queued job waits for this device: work that can stop early should.
    pub fn job_waiting(&self) -> bool {
        self.claim.job_waiting()
    }
}

/// Runs `work` with the model in `dir` (called `name` in errors) loaded on a device chosen by
/// the rules above, on a blocking thread, once it is this request's turn; returns what `work`
/// returns. Errors before `work` starts are Busy (no turn or device), Unusable (the folder does
/// not load) or Internal. Dropping the future before the work starts gives up the turn; after,
/// the work runs to its end.
pub async fn with_model<T, W>(
    state: &AppState,
    dir: PathBuf,
    name: &str,
    work: W,
) -> Result<T, TryError>
where
    T: Send + 'static,
    W: FnOnce(Loaded<'_>, &Device) -> T + Send + 'static,
{
    let unusable = |why: String| TryError::Unusable { model: name.to_string(), why };
    let spec = ModelSpec::from_path(&dir).map_err(|e| unusable(e.to_string()))?;
    let permit = take_turn().await?;
    let choice = choose_device(state, &dir, &spec).await?;
    let worker = state.clone();
    let done = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        answer(&worker, &dir, choice, work)
    })
    .await
    .map_err(anyhow::Error::new)?;
    done.map_err(unusable)
}

/// This request's turn with the model slot, in arrival order; Busy when too many wait or the
/// wait is too long.
async fn take_turn() -> Result<SemaphorePermit<'static>, TryError> {
    struct Waiting;
    impl Drop for Waiting {
        fn drop(&mut self) {
            WAITING.fetch_sub(1, Ordering::SeqCst);
        }
    }
    if let Ok(permit) = GENERATING.try_acquire() {
        return Ok(permit);
    }
    if WAITING.fetch_add(1, Ordering::SeqCst) >= MAX_WAITING {
        WAITING.fetch_sub(1, Ordering::SeqCst);
        return Err(TryError::Busy {
            message: format!("{MAX_WAITING} requests are waiting for the model already"),
            retry_after_s: 5,
        });
    }
    let _waiting = Waiting;
    match tokio::time::timeout(MAX_WAIT, GENERATING.acquire()).await {
        Ok(permit) => Ok(permit.map_err(anyhow::Error::new)?),
        Err(_) => Err(TryError::Busy {
            message: format!(
                "other requests held the model for {} s; try again in a moment",
                MAX_WAIT.as_secs()
            ),
            retry_after_s: 10,
        }),
    }
}

/// The device a generation will use, held until it ends, and why it is not a GPU.
struct Choice {
    place: Place,
    note: Option<String>,
    claim: DeviceClaim,
}

/// GPU memory a model needs to generate: bf16 weights, a KV cache of a few thousand positions,
/// and room for the context, the logits and the workspace.
fn gpu_bytes_needed(spec: &ModelSpec) -> u64 {
    let weights = spec.total_params() as u64 * 2;
    let positions = spec.max_positions.min(4096) as u64;
    let kv = 2 * spec.layers as u64 * (spec.kv_heads * spec.head_dim) as u64 * positions * 2;
    weights + kv + (2 << 30)
}

/// Seconds to suggest before asking again while job `id` trains: its estimated time left,
/// within 10 s and 10 min, else a minute.
async fn training_wait(state: &AppState, id: i64) -> u64 {
    let eta = store::get(state.pool(), id).await.ok().flatten().and_then(|job| job.eta_s());
    eta.map_or(60, |s| (s.ceil() as u64).clamp(10, 600))
}

async fn choose_device(state: &AppState, dir: &Path, spec: &ModelSpec) -> Result<Choice, TryError> {
    let running = store::running_devices(state.pool()).await.map_err(anyhow::Error::new)?;
    let queued = store::queued_devices(state.pool()).await.map_err(anyhow::Error::new)?;
    let holder = |jobs: &[(i64, String)], device: &str| {
        jobs.iter()
            .find(|(_, d)| {
                d.parse::<sluice_engine::train::Devices>()
                    .is_ok_and(|d| d.members().iter().any(|m| m == device))
            })
            .map(|(id, _)| *id)
    };
    let training = |device: &str| holder(&running, device);
    let waiting = |device: &str| holder(&queued, device);
    let needed = gpu_bytes_needed(spec);
    let mut reasons = Vec::new();
    let mut retry_after_s = 5;
    for gpu in state.gpus().list().into_iter().filter(|d| d.id != "cpu") {
        let Some(n) = gpu.id.strip_prefix("cuda:").and_then(|n| n.parse().ok()) else { continue };
        if let Some(job) = training(&gpu.id) {
            reasons.push(format!("{} is training job {job}", gpu.id));
            retry_after_s = training_wait(state, job).await;
            continue;
        }
        if let Some(job) = waiting(&gpu.id) {
            reasons.push(format!("job {job} is queued for {}", gpu.id));
            retry_after_s = 60;
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
            Some(claim) => return Ok(Choice { place: Place::Gpu(n), note: None, claim }),
            None => reasons.push(format!("{} is starting a job", gpu.id)),
        }
    }
    let and_others =
        || if reasons.is_empty() { String::new() } else { format!(" and {}", reasons.join(", ")) };
    if let Some(job) = training("cpu") {
        return Err(TryError::Busy {
            message: format!(
                "the CPU is training job {job}{}; try again when it finishes",
                and_others()
            ),
            retry_after_s: retry_after_s.max(training_wait(state, job).await),
        });
    }
    if let Some(job) = waiting("cpu") {
        return Err(TryError::Busy {
            message: format!(
                "job {job} is queued for the CPU{}; training goes first",
                and_others()
            ),
            retry_after_s: 60,
        });
    }
    let Some(claim) = runner::try_claim(state, "cpu") else {
        return Err(TryError::Busy {
            message: "the CPU is starting a job; try again in a moment".into(),
            retry_after_s: 5,
        });
    };
    let note =
        (!reasons.is_empty()).then(|| format!("{}, so this ran on the CPU", reasons.join(", ")));
    Ok(Choice { place: Place::Cpu, note, claim })
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 30)
}

type Sender = mpsc::UnboundedSender<Item>;

/// Loads (or reuses) the model on the chosen device and runs `work` with it; `Err` is a load
/// failure. Runs on a blocking thread; the device stays claimed until it returns.
fn answer<T, W>(state: &AppState, dir: &Path, choice: Choice, work: W) -> Result<T, String>
where
    T: Send,
    W: FnOnce(Loaded<'_>, &Device) -> T + Send,
{
    let key = Key::of(dir, choice.place);
    let (generator, reused) = match state.tryit().take(&key) {
        Some(generator) => (generator, true),
        None => (load(dir, choice.place).map_err(|e| e.to_string())?, false),
    };
    let device = Device { id: choice.place.id(), note: choice.note, reused, claim: choice.claim };
    let outcome = match &generator {
        AnyGenerator::Cpu(g) => {
            // Beside a running job, a quarter of the cores: the job's optimizer keeps the rest.
            let others_busy = runner::busy_devices(state).len() > 1;
            let cores = std::thread::available_parallelism().map_or(1, usize::from);
            let threads = if others_busy { (cores / 4).max(1) } else { cores };
            match rayon::ThreadPoolBuilder::new().num_threads(threads).build() {
                Ok(pool) => Ok(pool.install(|| work(Loaded::Cpu(g), &device))),
                Err(e) => Err(format!("cannot start generation threads: {e}")),
            }
        }
        AnyGenerator::Cuda(g) => Ok(work(Loaded::Cuda(g), &device)),
    };
    // Back in the slot before the device is released, so a job that claims it next unloads it.
    state.tryit().put(key, generator);
    drop(device);
    outcome
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
    head: &Device,
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
        "device": head.id,
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
        device: head.id.clone(),
        device_note: head.note.clone(),
        seconds,
        tokens_per_s: if seconds > 0.0 { generated.ids.len() as f64 / seconds } else { 0.0 },
    };
    let done = serde_json::to_value(done).map_err(|e| e.to_string())?;
    let _ = sender.send(Ok(("done", done)));
    Ok(())
}
