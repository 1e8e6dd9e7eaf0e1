//! The queue's engine room: one tokio task (the dispatcher) starts queued jobs whose devices
//! are all free, in queue order, and records what they report; each job trains on its own OS
//! thread (training blocks for minutes or days, so it never runs on the async threads).
//!
//! Flow of one job: the dispatcher claims it and reserves every device it names (a job on
//! `cuda:0,1` holds both; a job waiting for a busy device also holds back later jobs that want
//! it, so a several-GPU job is never starved by single-GPU ones). The job's thread plans it
//! against the machine as it is now (the driver's free GPU memory, MemAvailable less what
//! other starting jobs have planned but not yet allocated, the disk tier where the job needs
//! it), runs exactly that plan through
//! `train::run_on`, and forwards every event into an unbounded channel (the engine never waits
//! on the server); the dispatcher's task for the job stores each event in SQLite and
//! broadcasts it to SSE viewers, and writes the final status after the last event.
//!
//! Resume is exact: the engine keeps the latest training state (master weights, Adam moments,
//! step and data position) in the run folder's `state/` with each checkpoint, and a start that
//! finds one continues from it.

use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde_json::json;
use sluice_engine::plan::MachineMemory;
use sluice_engine::train::{
    self, Event, Interrupt, Job, Observer, RunOptions, RunSummary, STATE_DIR, TrainingState,
};
use tokio::sync::{mpsc, oneshot};
use tracing::{error, info};

use super::JobsError;
use super::queue::{Queue, lock};
use super::record;
use crate::AppState;
use crate::db::now_f64;
use crate::store::jobs::{self as store, JobRow, JobStatus};

/// A device held outside any job (a try-it generation, a served request): a queued job for it
/// waits until the claim is dropped, which frees the device and wakes the dispatcher.
#[derive(Debug)]
pub struct DeviceClaim {
    state: AppState,
    device: String,
}

impl DeviceClaim {
    /// Whether a queued job waits for this device (the dispatcher found it held by the claim):
    /// work that can stop early should stop and drop the claim.
    pub fn job_waiting(&self) -> bool {
        lock(&self.state.queue().wanted).contains(&self.device)
    }
}

impl Drop for DeviceClaim {
    fn drop(&mut self) {
        let queue = self.state.queue();
        lock(&queue.busy).remove(&self.device);
        queue.wake();
    }
}

/// Claims `device` ("cpu", "cuda:0") if no job or other claim holds it.
pub fn try_claim(state: &AppState, device: &str) -> Option<DeviceClaim> {
    let fresh = lock(&state.queue().busy).insert(device.to_string());
    fresh.then(|| DeviceClaim { state: state.clone(), device: device.to_string() })
}

/// The devices running jobs and claims hold now.
pub fn busy_devices(state: &AppState) -> Vec<String> {
    lock(&state.queue().busy).iter().cloned().collect()
}

/// Jobs that were running when the server stopped cannot be running now.
pub async fn mark_interrupted(pool: &sqlx::SqlitePool) -> anyhow::Result<()> {
    let marked = store::mark_interrupted(pool).await?;
    if marked > 0 {
        info!("{marked} job(s) were running when the server stopped: marked interrupted");
    }
    Ok(())
}

/// Starts the dispatcher.
pub fn start(state: &AppState) {
    tokio::spawn(dispatch(state.clone()));
}

async fn dispatch(state: AppState) {
    let wake = state.queue().wake.clone();
    loop {
        // Registered before looking, so a wake-up between the look and the wait is not lost.
        let woken = wake.notified();
        match claim_ready(&state).await {
            Ok(Some((job, devices))) => {
                let state = state.clone();
                tokio::spawn(async move {
                    run_job(&state, job).await;
                    let queue = state.queue();
                    let mut busy = lock(&queue.busy);
                    for d in &devices {
                        busy.remove(d);
                    }
                    drop(busy);
                    queue.wake();
                });
            }
            Ok(None) => woken.await,
            Err(err) => {
                error!("job queue: {err:?}");
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
            }
        }
    }
}

/// Claims the first queued job, in queue order, whose devices are all free and not wanted by
/// an earlier queued job; marks them busy. Jobs naming a device this machine lacks fail. The
/// devices the jobs it passes over wait for become the queue's `wanted` set.
async fn claim_ready(state: &AppState) -> Result<Option<(JobRow, Vec<String>)>, JobsError> {
    let queued = store::queued_devices(state.pool()).await?;
    let known = state.gpus().device_ids();
    let mut blocked = lock(&state.queue().busy).clone();
    let mut waiting = HashSet::new();
    let claimed = claim_first(state, queued, &known, &mut blocked, &mut waiting).await;
    *lock(&state.queue().wanted) = waiting;
    claimed
}

async fn claim_first(
    state: &AppState,
    queued: Vec<(i64, String)>,
    known: &[String],
    blocked: &mut HashSet<String>,
    waiting: &mut HashSet<String>,
) -> Result<Option<(JobRow, Vec<String>)>, JobsError> {
    for (id, device) in queued {
        let members = match device.parse::<train::Devices>() {
            Ok(d) => d.members(),
            Err(e) => {
                record::finish(state, id, JobStatus::Failed, Some(&e.to_string())).await?;
                continue;
            }
        };
        if let Some(missing) = members.iter().find(|d| !known.contains(d)) {
            let message = format!("{missing} is not on this machine");
            record::log(state, id, &format!("cannot start: {message}")).await;
            record::finish(state, id, JobStatus::Failed, Some(&message)).await?;
            continue;
        }
        if members.iter().any(|d| blocked.contains(d)) {
            waiting.extend(members.iter().cloned());
            blocked.extend(members);
            continue;
        }
        let claimed = store::claim(state.pool(), id).await?;
        if let Some(job) = claimed {
            lock(&state.queue().busy).extend(members.iter().cloned());
            // A model kept loaded for "try it" holds memory this job plans with.
            let tryit = state.clone();
            tokio::task::spawn_blocking(move || tryit.tryit().unload()).await?;
            return Ok(Some((job, members)));
        }
    }
    Ok(None)
}

pub fn run_dir(state: &AppState, job_id: i64) -> PathBuf {
    state.runs_dir().join(job_id.to_string())
}

/// What the job's thread reports back.
enum RunEvent {
    Planned { placement: String, line: String },
    Started { total_steps: u64, line: String },
    Step { step: u64, point: serde_json::Value },
    Saved { name: String, step: u64 },
    Log(String),
}

async fn run_job(state: &AppState, job: JobRow) {
    let id = job.id;
    let _ = record::publish_status(state, id).await;
    crate::announce::job_started(state, &job).await;
    let engine_job = match record::job_of(state, &job).await {
        Ok(j) => j,
        Err(message) => {
            record::log(state, id, &format!("cannot start: {message}")).await;
            let _ = record::finish(state, id, JobStatus::Failed, Some(&message)).await;
            crate::announce::job_ended(state, id);
            return;
        }
    };
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let (done_tx, done) = oneshot::channel();
    let forwarder = Forwarder {
        job_id: id,
        params: 0,
        device_bytes: None,
        events: events_tx,
        cancels: state.queue().cancels.clone(),
        reserved: state.queue().reserved.clone(),
        keep_checkpoints: state.config().limits.keep_checkpoints,
        eval_before: None,
        task_before: None,
        task_score: None,
    };
    let out = run_dir(state, id);
    let disk_dir = state.config().disk_tier_dir();
    let spawned = std::thread::Builder::new().name(format!("sluice-job-{id}")).spawn(move || {
        let mut forwarder = forwarder;
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            train_job(engine_job, out, &disk_dir, &mut forwarder)
        }));
        lock(&forwarder.reserved).remove(&forwarder.job_id);
        // Dropping the observer closes the event channel: the task has seen every event
        // before it reads the result.
        drop(forwarder);
        let result = match result {
            Ok(r) => r,
            Err(_) => Err("the trainer crashed; the server log has the details".to_string()),
        };
        let _ = done_tx.send(result);
    });
    if let Err(err) = spawned {
        let message = format!("cannot start a training thread: {err}");
        let _ = record::finish(state, id, JobStatus::Failed, Some(&message)).await;
        crate::announce::job_ended(state, id);
        return;
    }
    let mut total = job.total_steps.max(0) as u64;
    while let Some(event) = events.recv().await {
        if let RunEvent::Started { total_steps, .. } = &event {
            total = *total_steps;
        }
        if let Err(err) = store_event(state, id, event).await {
            error!("job {id}: cannot record an event: {err:?}");
        }
    }
    let result = done.await.unwrap_or_else(|_| Err("the training thread stopped".to_string()));
    let cancelled = state.queue().clear_cancel(id);
    let (status, error) = match &result {
        Ok(summary) if cancelled && summary.steps < total => (JobStatus::Cancelled, None),
        Ok(_) => (JobStatus::Completed, None),
        Err(message) => (JobStatus::Failed, Some(message.as_str())),
    };
    let line = match &result {
        Ok(summary) => format!(
            "{status} after step {}: loss {:.4} -> {:.4}",
            summary.steps, summary.first_loss, summary.last_loss
        ),
        Err(message) => format!("failed: {message}"),
    };
    record::log(state, id, &line).await;
    if let Err(err) = record::finish(state, id, status, error).await {
        error!("job {id}: cannot store the final status: {err:?}");
    }
    crate::announce::job_ended(state, id);
}

/// On the job's thread: plans `job` on this machine now (with the disk tier at `disk_dir` where
/// it needs one), then runs that plan in `out`, continuing from the saved training state when
/// there is one. `Err` is for the user.
fn train_job(
    job: Job,
    out: PathBuf,
    disk_dir: &Path,
    forwarder: &mut Forwarder,
) -> Result<RunSummary, String> {
    let text = |e: sluice_engine::Error| e.to_string();
    let resume = TrainingState::saved_step(&out.join(STATE_DIR)).map_err(text)?;
    let spec = train::model_spec(&job.model).map_err(text)?;
    let mut memory = MachineMemory::detect(job.devices.gpu_query(), None, None).map_err(text)?;
    memory.host_bytes =
        Queue::budget(&forwarder.reserved, memory.host_bytes, Some(forwarder.job_id));
    let memory = super::disk::attach(disk_dir, &job, &spec, memory)?;
    let plan = sluice_engine::plan::plan(&job.plan_input(&spec, memory))
        .map_err(text)?
        .into_plan()
        .map_err(text)?;
    lock(&forwarder.reserved).insert(forwarder.job_id, plan.budget.host_used());
    std::fs::create_dir_all(&out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    let mut options = RunOptions::planned(job, out, &plan).map_err(text)?;
    options.keep_checkpoints = Some(forwarder.keep_checkpoints);
    let placement = options.placement.describe(plan.model.units);
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let mut line = format!(
        "plan on {}: {placement}; {:.2} GiB device, {:.2} GiB host; {:.2} s per step predicted",
        options.job.devices,
        gib(plan.budget.device.used),
        gib(plan.budget.host_used()),
        plan.time.total_s
    );
    if let Some(disk) = plan.disk_text() {
        line.push(' ');
        line.push_str(&disk);
    }
    forwarder.send(RunEvent::Planned { placement, line });
    let devices = options.job.devices.clone();
    train::run_on(&devices, &options, resume.is_some(), forwarder).map_err(text)
}

/// Stores one event and tells live viewers.
async fn store_event(state: &AppState, id: i64, event: RunEvent) -> Result<(), JobsError> {
    match event {
        RunEvent::Planned { placement, line } => {
            store::set_placement(state.pool(), id, &placement).await?;
            record::log(state, id, &line).await;
        }
        RunEvent::Started { total_steps, line } => {
            store::set_total_steps(state.pool(), id, total_steps as i64).await?;
            record::log(state, id, &line).await;
            record::publish_status(state, id).await?;
        }
        RunEvent::Step { step, point } => {
            let text = point.to_string();
            store::record_step(state.pool(), id, step as i64, &text).await?;
            state.publish(id, "metric", text);
        }
        RunEvent::Saved { name, step } => {
            store::record_checkpoint(state.pool(), id, &name, step as i64).await?;
            record::log(state, id, &format!("saved checkpoint {name} (step {step})")).await;
            // The run prunes older checkpoints as it saves (and says so in its log): their rows
            // go with their folders.
            let run = run_dir(state, id);
            for (name, _) in store::checkpoints(state.pool(), id).await? {
                if !run.join(&name).is_dir() {
                    store::forget_checkpoint(state.pool(), id, &name).await?;
                }
            }
        }

        RunEvent::Log(line) => record::log(state, id, &line).await,
    }
    Ok(())
}

/// The observer handed to the engine: forwards events and answers cancel requests; never
/// blocks.
struct Forwarder {
    job_id: i64,
    params: usize,
    /// Device memory the schedule allocated (GPU jobs only).
    device_bytes: Option<u64>,
    events: mpsc::UnboundedSender<RunEvent>,
    cancels: Arc<Mutex<HashSet<i64>>>,
    reserved: Arc<Mutex<HashMap<i64, u64>>>,
    /// Periodic checkpoints the run keeps (the latest, plus the best by eval loss).
    keep_checkpoints: usize,
    /// The held-out loss before training: step 0's point is stored whole each time, so the
    /// task evaluation's point of step 0, which follows, carries it too.
    eval_before: Option<f64>,
    /// The task evaluation's figure for the base model, and the one waiting for its step's
    /// point.
    task_before: Option<f64>,
    task_score: Option<f64>,
}

impl Forwarder {
    fn send(&self, event: RunEvent) {
        // A closed channel means the dispatcher is gone (runtime shutting down); nothing to do.
        let _ = self.events.send(event);
    }
}

impl Observer for Forwarder {
    fn event(&mut self, event: &Event) {
        match event {
            Event::Started {
                params,
                active_params,
                backend,
                total_steps,
                data,
                device_bytes,
                host_store,
                resumed_at,
            } => {
                // The training state is allocated: it is in MemAvailable from now on.
                lock(&self.reserved).remove(&self.job_id);
                // TFLOPS count the parameters each token computes with.
                self.params = *active_params;
                self.device_bytes = (backend != "cpu").then_some(*device_bytes as u64);
                let from = if *resumed_at > 0 {
                    format!("continuing exactly after step {resumed_at}; ")
                } else {
                    String::new()
                };
                let line = format!(
                    "{from}model: {:.2}M parameters on {backend}; host store {:.2} GiB; data: {} records, {} rows, {} tokens ({} trained), {} truncated samples, {} texts continued over rows; steps {}..{}",
                    *params as f64 / 1e6,
                    host_store.total() as f64 / (1u64 << 30) as f64,
                    data.records,
                    data.rows,
                    data.tokens,
                    data.trained_tokens,
                    data.truncated_samples,
                    data.continued_samples,
                    resumed_at + 1,
                    total_steps,
                );
                self.send(RunEvent::Started { total_steps: *total_steps, line });
            }
            Event::Step(m) => {
                let seconds = m.elapsed.as_secs_f64().max(1e-9);
                // 6 FLOPs per parameter per token (forward 2, backward 4), attention excluded;
                // a mixture of experts counts the experts each token is routed to.
                let tflops = 6.0 * self.params as f64 * m.tokens as f64 / seconds / 1e12;
                let point = json!({
                    "step": m.step,
                    "loss": m.loss,
                    "lr": m.lr,
                    "grad_norm": m.grad_norm,
                    "tokens_per_s": m.tokens_per_second(),
                    "tflops": tflops,
                    "gpu_mem": self.device_bytes,
                    // PCIe only exists for GPU jobs; on the CPU the "copies" are memcpy.
                    "h2d_gbps": self.device_bytes.map(|_| m.h2d_bytes as f64 / seconds / 1e9),
                    "d2h_gbps": self.device_bytes.map(|_| m.d2h_bytes as f64 / seconds / 1e9),
                    "host_mem": crate::gpus::process_rss(),
                    "optimizer_s": m.optimizer_time.as_secs_f64(),
                    // The part of it the GPU's compute stream sat idle waiting for (on the CPU:
                    // the trainer's waits); the rest was hidden behind the step's other work.
                    "optimizer_exposed_s": m.optimizer_exposed.as_secs_f64(),
                    "compute_s": m.compute_time.as_secs_f64(),
                    "step_s": seconds,
                    "tokens": m.tokens,
                    "trained_tokens": m.trained_tokens,
                    "eval_loss": m.eval_loss,
                    // The task evaluation's figure, where one ran after this step.
                    "task_score": self.task_score.take(),
                    // A mixture of experts' load-balancing loss (null for dense models).
                    "aux_loss": m.aux_loss,
                    "timeline": (!m.timeline.is_empty()).then_some(&m.timeline),
                    "t": now_f64(),
                });
                self.send(RunEvent::Step { step: m.step, point });
            }
            Event::Evaluated { step, loss } => {
                // A point of its own, so the eval chart starts at the untrained model; the
                // log says it in words as before.
                let point = json!({ "step": step, "eval_loss": loss, "t": now_f64() });
                if *step == 0 {
                    self.eval_before = Some(*loss);
                }
                self.send(RunEvent::Log(format!("held-out loss before training: {loss:.4}")));
                self.send(RunEvent::Step { step: *step, point });
            }
            Event::TaskEvaluated { step, report } => {
                let (metric, score) = (report.metric, report.score);
                if *step == 0 {
                    self.task_before = Some(score);
                    let point = json!({
                        "step": 0,
                        "eval_loss": self.eval_before,
                        "task_score": score,
                        "t": now_f64(),
                    });
                    self.send(RunEvent::Log(format!("{metric} of the base model: {score:.4}")));
                    self.send(RunEvent::Step { step: 0, point });
                } else {
                    // Goes into the step's own point, which follows.
                    self.task_score = Some(score);
                    let before = self
                        .task_before
                        .map_or_else(String::new, |b| format!(" (base model {b:.4})"));
                    self.send(RunEvent::Log(format!(
                        "{metric} after step {step}: {score:.4}{before}"
                    )));
                }
            }
            Event::Notice(text) => self.send(RunEvent::Log(text.clone())),
            Event::Saved { path, step } => {
                let name = path.file_name().map_or_else(
                    || path.display().to_string(),
                    |n| n.to_string_lossy().into_owned(),
                );
                self.send(RunEvent::Saved { name, step: *step });
            }
        }
    }

    fn keep_going(&mut self) -> bool {
        !lock(&self.cancels).contains(&self.job_id)
    }

    /// A cancel also abandons a long CPU step between micro-batches.
    fn interrupt(&self) -> Option<Interrupt> {
        let (cancels, id) = (self.cancels.clone(), self.job_id);
        Some(Arc::new(move || lock(&cancels).contains(&id)))
    }
}
