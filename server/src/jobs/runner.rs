//! The queue's engine room: per device, one tokio task picks the next queued job and records
//! what it reports, and one plain OS thread trains it (training blocks for minutes or days, so
//! it never runs on the async threads).
//!
//! Flow of one job: the dispatcher claims the oldest queued job of its device, builds the run
//! options and hands them to the device thread; the thread calls `train::run` with an observer
//! that forwards every event into an unbounded channel and returns at once (the engine never
//! waits on the server); the dispatcher stores each event in SQLite and broadcasts it to SSE
//! viewers; when the thread is done the channel closes, so the final status is written after
//! the last metric.
//!
//! Resume: a job restarts from its latest checkpoint folder as its model and trains the steps
//! left. The optimizer state (Adam moments) and the learning-rate schedule restart with it until
//! the engine can save and load them.

use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use serde_json::json;
use sluice_engine::backend::cpu::Cpu;
use sluice_engine::backend::cuda::Cuda;
use sluice_engine::data::DatasetSource;
use sluice_engine::optim::Schedule;
use sluice_engine::schedule::Tier;
use sluice_engine::train::{
    self, Event, ModelSource, Observer, RunOptions, RunSummary, TrainConfig,
};
use sluice_engine::weights::SaveDtype;
use tokio::sync::{Notify, mpsc, oneshot};
use tracing::{error, info, warn};

use super::store::{self, COLUMNS, JobRow};
use crate::AppState;
use crate::db::now_f64;
use crate::error::{ApiError, ApiResult};
use crate::models;

/// Folder a start writes into before its checkpoints are moved to their final names.
const STAGING: &str = ".staging";

/// Wake-ups for the dispatchers and cancel requests for running jobs.
#[derive(Debug, Default)]
pub struct Queue {
    wakers: HashMap<String, Arc<Notify>>,
    cancels: Arc<Mutex<HashSet<i64>>>,
}

impl Queue {
    pub fn new(devices: &[String]) -> Queue {
        Queue {
            wakers: devices.iter().map(|d| (d.clone(), Arc::new(Notify::new()))).collect(),
            cancels: Arc::default(),
        }
    }

    /// Tells the device's dispatcher that a job was queued.
    pub fn wake(&self, device: &str) {
        if let Some(notify) = self.wakers.get(device) {
            notify.notify_one();
        }
    }

    pub fn request_cancel(&self, job_id: i64) {
        self.cancels.lock().unwrap_or_else(PoisonError::into_inner).insert(job_id);
    }

    /// Forgets a cancel request; says whether there was one.
    pub fn clear_cancel(&self, job_id: i64) -> bool {
        self.cancels.lock().unwrap_or_else(PoisonError::into_inner).remove(&job_id)
    }
}

/// Jobs that were running when the server stopped cannot be running now.
pub async fn mark_interrupted(pool: &sqlx::SqlitePool) -> anyhow::Result<()> {
    let marked = sqlx::query(
        "UPDATE jobs SET status = 'interrupted', finished_at = CAST(strftime('%s', 'now') AS INTEGER),
             error = 'the server stopped while the job was running; resume it to continue'
         WHERE status = 'running'",
    )
    .execute(pool)
    .await?;
    if marked.rows_affected() > 0 {
        info!(
            "{} job(s) were running when the server stopped: marked interrupted",
            marked.rows_affected()
        );
    }
    Ok(())
}

/// Starts a dispatcher task and a training thread per device.
pub fn start(state: &AppState) {
    for device in state.gpus().device_ids() {
        let Some(notify) = state.queue().wakers.get(&device).cloned() else { continue };
        let (work_tx, work_rx) = std::sync::mpsc::channel::<Work>();
        let thread_device = device.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("sluice-{device}"))
            .spawn(move || device_thread(&thread_device, work_rx));
        if let Err(err) = spawned {
            error!("cannot start the runner thread for {device}: {err}; its jobs stay queued");
            continue;
        }
        tokio::spawn(dispatch(state.clone(), device, notify, work_tx));
    }
}

/// What the dispatcher hands the device thread.
struct Work {
    options: RunOptions,
    forwarder: Forwarder,
    done: oneshot::Sender<Result<RunSummary, String>>,
}

/// What the observer reports back, already in the job's global step numbering.
enum RunEvent {
    Started { total_steps: u64, line: String },
    Step { step: u64, point: serde_json::Value },
    Saved { name: String, step: u64 },
    Log(String),
}

/// Trains one job at a time on `device` ("cpu" or "cuda:N") until the dispatcher goes away.
/// The GPU is opened once, by the first job that needs it; if it cannot be, each job on it
/// fails with the reason.
fn device_thread(device: &str, work: std::sync::mpsc::Receiver<Work>) {
    let ordinal = device.strip_prefix("cuda:").and_then(|n| n.parse::<usize>().ok());
    let mut cuda: Option<Result<Cuda, String>> = None;
    for Work { options, mut forwarder, done } in work {
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| match ordinal {
            None => train::run(&Cpu, &options, false, &mut forwarder),
            Some(n) => match cuda.get_or_insert_with(|| Cuda::new(n).map_err(|e| e.to_string())) {
                Ok(gpu) => train::run(gpu, &options, false, &mut forwarder),
                Err(reason) => {
                    Err(sluice_engine::Error::invalid(format!("cannot use {device}: {reason}")))
                }
            },
        }));
        // Dropping the observer closes the event channel: the dispatcher has seen every event
        // before it reads the result.
        drop(forwarder);
        let result = match result {
            Ok(Ok(summary)) => Ok(summary),
            Ok(Err(err)) => Err(err.to_string()),
            Err(_) => Err("the trainer crashed; the server log has the details".to_string()),
        };
        let _ = done.send(result);
    }
}

async fn dispatch(
    state: AppState,
    device: String,
    notify: Arc<Notify>,
    work: std::sync::mpsc::Sender<Work>,
) {
    loop {
        match claim_next(&state, &device).await {
            Ok(Some(job)) => run_job(&state, job, &work).await,
            Ok(None) => notify.notified().await,
            Err(err) => {
                error!("queue for {device}: {err:?}");
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
            }
        }
    }
}

async fn claim_next(state: &AppState, device: &str) -> ApiResult<Option<JobRow>> {
    Ok(sqlx::query_as(&format!(
        "UPDATE jobs SET status = 'running', started_at = ?, start_step = step, error = NULL,
             finished_at = NULL
         WHERE id = (SELECT id FROM jobs WHERE device = ? AND status = 'queued'
                     ORDER BY queue_seq LIMIT 1)
         RETURNING {COLUMNS}"
    ))
    .bind(now_f64())
    .bind(device)
    .fetch_optional(state.pool())
    .await?)
}

pub fn run_dir(state: &AppState, job_id: i64) -> PathBuf {
    state.runs_dir().join(job_id.to_string())
}

async fn run_job(state: &AppState, job: JobRow, work: &std::sync::mpsc::Sender<Work>) {
    let id = job.id;
    let _ = store::publish_status(state, id).await;
    let (options, offset, planned) = match prepare(state, &job).await {
        Ok(Some(prepared)) => prepared,
        Ok(None) => {
            store::log(state, id, "no steps left: the job is complete").await;
            let _ = store::finish(state, id, "completed", None).await;
            return;
        }
        Err(message) => {
            store::log(state, id, &format!("cannot start: {message}")).await;
            let _ = store::finish(state, id, "failed", Some(&message)).await;
            return;
        }
    };
    let from = match &options.model {
        ModelSource::Dir(dir) if job.resume_from.is_some() => {
            format!(
                " from {} at step {offset}",
                dir.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned())
            )
        }
        _ => String::new(),
    };
    store::log(state, id, &format!("starting on {}{from} (CPU backend)", job.device)).await;

    let (events_tx, mut events) = mpsc::unbounded_channel();
    let (done_tx, done) = oneshot::channel();
    let forwarder = Forwarder {
        job_id: id,
        offset,
        total: job.total_steps.max(0) as u64,
        params: 0,
        device_bytes: None,
        run_dir: run_dir(state, id),
        events: events_tx,
        cancels: state.queue().cancels.clone(),
    };
    if work.send(Work { options, forwarder, done: done_tx }).is_err() {
        let message = format!("the runner thread for {} has stopped", job.device);
        let _ = store::finish(state, id, "failed", Some(&message)).await;
        return;
    }
    while let Some(event) = events.recv().await {
        if let Err(err) = record(state, id, event).await {
            error!("job {id}: cannot record an event: {err:?}");
        }
    }
    let result = done.await.unwrap_or_else(|_| Err("the runner thread stopped".to_string()));
    let cancelled = state.queue().clear_cancel(id);
    let (status, error) = match &result {
        Ok(summary) if cancelled && summary.steps < planned => ("cancelled", None),
        Ok(_) => ("completed", None),
        Err(message) => ("failed", Some(message.as_str())),
    };
    let line = match &result {
        Ok(summary) => format!(
            "{status} after step {}: loss {:.4} -> {:.4}",
            offset + summary.steps,
            summary.first_loss,
            summary.last_loss
        ),
        Err(message) => format!("failed: {message}"),
    };
    store::log(state, id, &line).await;
    if let Err(err) = store::finish(state, id, status, error).await {
        error!("job {id}: cannot store the final status: {err:?}");
    }
    let staging = run_dir(state, id).join(STAGING);
    if let Err(err) = tokio::fs::remove_dir_all(&staging).await
        && err.kind() != std::io::ErrorKind::NotFound
    {
        warn!("job {id}: cannot remove {}: {err}", staging.display());
    }
}

/// The run options of a claimed job, its step offset and the steps this start should take;
/// `None` when no step is left. `Err` carries a message for the user.
async fn prepare(state: &AppState, job: &JobRow) -> Result<Option<(RunOptions, u64, u64)>, String> {
    let config = job.config().map_err(|e| format!("{e:?}"))?;
    let Some(dataset_id) = job.dataset_id else {
        return Err("the dataset was deleted".into());
    };
    let file_name: Option<String> =
        sqlx::query_scalar("SELECT file_name FROM datasets WHERE id = ?")
            .bind(dataset_id)
            .fetch_optional(state.pool())
            .await
            .map_err(|e| format!("database: {e}"))?;
    let Some(file_name) = file_name else {
        return Err("the dataset was deleted".into());
    };
    let dir = run_dir(state, job.id);
    let model = match &job.resume_from {
        Some(name) => {
            let checkpoint = dir.join(name);
            if !checkpoint.is_dir() {
                return Err(format!("the checkpoint {name} to resume from is gone"));
            }
            ModelSource::Dir(checkpoint)
        }
        None => {
            let state = state.clone();
            let model_id = job.model.clone();
            tokio::task::spawn_blocking(move || models::resolve(&state, &model_id))
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| match e {
                    ApiError::BadRequest(m) => m,
                    other => format!("{other:?}"),
                })?
                .source
        }
    };
    let offset = job.step.max(0) as u64;
    let steps = if job.total_steps > 0 {
        Some((job.total_steps as u64).saturating_sub(offset))
    } else {
        config.steps
    };
    if steps == Some(0) {
        return Ok(None);
    }
    let out = dir.join(STAGING);
    if out.exists() {
        std::fs::remove_dir_all(&out)
            .map_err(|e| format!("cannot clear {}: {e}", out.display()))?;
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let schedule: Schedule =
        config.schedule.parse().map_err(|e: sluice_engine::Error| e.to_string())?;
    let options = RunOptions {
        model,
        data: DatasetSource::File(state.datasets_dir().join(file_name)),
        out,
        seq_len: config.seq_len,
        micro_batch: config.micro_batch,
        grad_accum: config.grad_accum,
        steps,
        train: TrainConfig {
            lr: config.lr,
            schedule,
            warmup_steps: config.warmup.saturating_sub(offset),
            weight_decay: config.weight_decay,
            max_grad_norm: (config.max_grad_norm > 0.0).then_some(config.max_grad_norm),
            ..TrainConfig::default()
        },
        seed: config.seed,
        train_on_prompt: config.train_on_prompt,
        save_every: config.save_every,
        save_dtype: SaveDtype::F32,
        checkpoints: Tier::Device,
        checkpoint_interval: 1,
        resident: Vec::new(),
        gradients: None,
        // About ten evaluations over the job; the engine holds out the data for them.
        eval_every: Some(steps.map_or(10, |s| (s / 10).max(1))),
        eval_data: None,
    };
    // Unknown until the first start has packed the data; then `steps` is exact.
    let planned = steps.unwrap_or(u64::MAX);
    Ok(Some((options, offset, planned)))
}

/// Stores one event and tells live viewers.
async fn record(state: &AppState, id: i64, event: RunEvent) -> ApiResult<()> {
    match event {
        RunEvent::Started { total_steps, line } => {
            sqlx::query("UPDATE jobs SET total_steps = ? WHERE id = ?")
                .bind(total_steps as i64)
                .bind(id)
                .execute(state.pool())
                .await?;
            store::log(state, id, &line).await;
            store::publish_status(state, id).await?;
        }
        RunEvent::Step { step, point } => {
            let text = point.to_string();
            sqlx::query("INSERT OR REPLACE INTO metrics (job_id, step, point) VALUES (?, ?, ?)")
                .bind(id)
                .bind(step as i64)
                .bind(&text)
                .execute(state.pool())
                .await?;
            sqlx::query("UPDATE jobs SET step = ? WHERE id = ?")
                .bind(step as i64)
                .bind(id)
                .execute(state.pool())
                .await?;
            state.publish(id, "metric", text);
        }
        RunEvent::Saved { name, step } => {
            sqlx::query("INSERT OR REPLACE INTO checkpoints (job_id, name, step) VALUES (?, ?, ?)")
                .bind(id)
                .bind(&name)
                .bind(step as i64)
                .execute(state.pool())
                .await?;
            store::log(state, id, &format!("saved checkpoint {name} (step {step})")).await;
        }
        RunEvent::Log(line) => store::log(state, id, &line).await,
    }
    Ok(())
}

/// The observer handed to the engine: forwards events and answers cancel requests. It never
/// blocks; the one file-system call (a rename within the run folder) is quick.
struct Forwarder {
    job_id: i64,
    /// Steps taken before this start.
    offset: u64,
    /// Total steps of the job (0 until known).
    total: u64,
    params: usize,
    /// Device memory the schedule allocated (GPU jobs only).
    device_bytes: Option<u64>,
    run_dir: PathBuf,
    events: mpsc::UnboundedSender<RunEvent>,
    cancels: Arc<Mutex<HashSet<i64>>>,
}

impl Forwarder {
    fn send(&self, event: RunEvent) {
        // A closed channel means the dispatcher is gone (runtime shutting down); nothing to do.
        let _ = self.events.send(event);
    }

    /// Moves a checkpoint the engine wrote under the staging folder to
    /// `checkpoint-<global step>`, or `final` when it ends the job.
    fn place(&self, path: &Path, step: u64) -> Result<String, String> {
        let is_final = path.file_name().is_some_and(|n| n == "final");
        let name = if is_final && self.total > 0 && step >= self.total {
            "final".to_string()
        } else {
            format!("checkpoint-{step}")
        };
        let target = self.run_dir.join(&name);
        if target.exists() {
            // Left by an earlier start that got further before it stopped, or the same step
            // saved twice (a cancel right after a periodic save): the new one wins.
            std::fs::remove_dir_all(&target)
                .map_err(|e| format!("cannot replace {}: {e}", target.display()))?;
        }
        std::fs::rename(path, &target)
            .map_err(|e| format!("cannot move the checkpoint to {}: {e}", target.display()))?;
        Ok(name)
    }
}

impl Observer for Forwarder {
    fn event(&mut self, event: &Event) {
        match event {
            Event::Started { params, backend, total_steps, data, device_bytes, .. } => {
                self.params = *params;
                self.device_bytes = (backend != "cpu").then_some(*device_bytes as u64);
                self.total = self.offset + total_steps;
                let line = format!(
                    "model: {:.2}M parameters on {backend}; data: {} records, {} rows, {} tokens ({} trained), {} truncated samples; steps {}..{}",
                    *params as f64 / 1e6,
                    data.records,
                    data.rows,
                    data.tokens,
                    data.trained_tokens,
                    data.truncated_samples,
                    self.offset + 1,
                    self.total,
                );
                self.send(RunEvent::Started { total_steps: self.total, line });
            }
            Event::Step(m) => {
                let seconds = m.elapsed.as_secs_f64().max(1e-9);
                // 6 FLOPs per parameter per token (forward 2, backward 4), attention excluded.
                let tflops = 6.0 * self.params as f64 * m.tokens as f64 / seconds / 1e12;
                let point = json!({
                    "step": self.offset + m.step,
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
                    "compute_s": m.compute_time.as_secs_f64(),
                    "step_s": seconds,
                    "tokens": m.tokens,
                    "trained_tokens": m.trained_tokens,
                    "eval_loss": m.eval_loss,
                    "timeline": (!m.timeline.is_empty()).then_some(&m.timeline),
                    "t": now_f64(),
                });
                self.send(RunEvent::Step { step: self.offset + m.step, point });
            }
            Event::Notice(text) => self.send(RunEvent::Log(text.clone())),
            Event::Saved { path, step } => {
                let step = self.offset + step;
                match self.place(path, step) {
                    Ok(name) => self.send(RunEvent::Saved { name, step }),
                    Err(message) => self.send(RunEvent::Log(message)),
                }
            }
        }
    }

    fn keep_going(&mut self) -> bool {
        !self.cancels.lock().unwrap_or_else(PoisonError::into_inner).contains(&self.job_id)
    }
}
