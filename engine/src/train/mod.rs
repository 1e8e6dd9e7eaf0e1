//! Training: the loop that turns packed micro-batches into optimizer steps, its configuration,
//! and the events it reports to an observer.
//!
//! The engine never blocks on its observer: events are plain values handed over synchronously,
//! and an observer that needs to do slow work (write to a database, push to browsers) queues
//! them itself.

mod card;
mod job;
mod launch;
mod retention;
mod run;
mod state;
mod trainer;

use std::time::Duration;

pub use crate::schedule::Interrupt;
pub use card::{CARD_FILE, Curves, model_card, write_model_card};
pub use job::{
    DEFAULT_LR_PRETRAINED, DEFAULT_LR_RANDOM_INIT, Devices, GradientPolicy, Job, JobSettings,
    Limits,
};
pub use launch::run_on;
pub use run::{
    LoadedModel, ModelSource, RunOptions, RunPlacement, RunSummary, load_model, model_spec,
    read_run_options, run, run_parallel, save_checkpoint,
};
pub use state::{RUN_FILE, STATE_DIR, TrainingState, data_fingerprint};
pub use trainer::Trainer;

use crate::optim::Schedule;

/// Hyperparameters, one line each; defaults suit fine-tuning a pretrained model.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainConfig {
    /// Peak learning rate.
    pub lr: f32,
    /// Learning-rate shape after warmup.
    pub schedule: Schedule,
    /// Steps of linear warmup from 0 to `lr`.
    pub warmup_steps: u64,
    /// Optimizer steps in the run (the schedule's horizon).
    pub total_steps: u64,
    /// AdamW's decoupled weight decay, applied to matrices only.
    pub weight_decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Global gradient-norm clipping threshold; `None` disables clipping.
    pub max_grad_norm: Option<f32>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            lr: 2e-5,
            schedule: Schedule::Cosine,
            warmup_steps: 0,
            total_steps: 100,
            weight_decay: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            max_grad_norm: Some(1.0),
        }
    }
}

impl TrainConfig {
    /// The learning rate of the step after `steps_taken` optimizer steps.
    pub fn lr_at(&self, steps_taken: u64) -> f32 {
        let schedule = crate::optim::LrSchedule {
            kind: self.schedule,
            peak_lr: self.lr,
            warmup_steps: self.warmup_steps,
            total_steps: self.total_steps,
        };
        schedule.lr_at(steps_taken)
    }
}

/// What one optimizer step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepMetrics {
    /// 1-based index of the step just taken.
    pub step: u64,
    /// Mean cross-entropy over the step's trained tokens, plus, for a mixture of experts whose
    /// config counts it (`output_router_logits`), `router_aux_loss_coef` times `aux_loss`.
    pub loss: f64,
    /// A mixture of experts' load-balancing loss (transformers' `load_balancing_loss_func`),
    /// the mean over the step's micro-batches; `None` for dense models.
    pub aux_loss: Option<f64>,
    /// Learning rate the step used.
    pub lr: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens processed (including untrained prompt and padding tokens).
    pub tokens: usize,
    /// Tokens that carried loss.
    pub trained_tokens: usize,
    /// Wall time of the step.
    pub elapsed: Duration,
    /// Time in forward and backward compute.
    pub compute_time: Duration,
    /// Of which the forward (embedding, layers, and the head's loss and gradient).
    pub forward_time: Duration,
    /// And the backward through the layers and the embedding.
    pub backward_time: Duration,
    /// Time the optimizer spent on updates (on its own threads, mostly hidden).
    pub optimizer_time: Duration,
    /// Part of the optimizer's time the step waited for.
    pub optimizer_exposed: Duration,
    /// Bytes copied host to device (weights, checkpoints) and device to host (gradients,
    /// checkpoints) during the step.
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    /// What each unit did on each stream during the step (empty for the reference loop).
    pub timeline: Vec<Span>,
    /// Mean loss on the held-out micro-batches, on the steps where the run evaluates.
    pub eval_loss: Option<f64>,
}

/// One unit's work on one stream, in seconds from the start of the step.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Span {
    pub unit: usize,
    /// `h2d`, `compute`, `d2h` or `optimizer`.
    pub stream: &'static str,
    pub start: f64,
    pub end: f64,
}

impl StepMetrics {
    pub fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Progress reported by a training run.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The run is set up and about to take its first step.
    Started {
        params: usize,
        /// Parameters a token computes with (a mixture of experts' routed experts only).
        active_params: usize,
        backend: String,
        total_steps: u64,
        /// What the dataset turned into: records, tokens, truncation.
        data: crate::data::Stats,
        /// Host memory of the training state, by part.
        host_store: crate::store::StoreBytes,
        /// Bytes the schedule allocated on the device.
        device_bytes: usize,
        /// The step the run starts after (non-zero when resuming).
        resumed_at: u64,
    },
    Step(StepMetrics),
    /// A checkpoint folder was written.
    Saved {
        path: std::path::PathBuf,
        step: u64,
    },
    /// Something the user should know that does not stop the run.
    Notice(String),
}

/// Receives training events. Implementations must return quickly.
pub trait Observer {
    fn event(&mut self, event: &Event);

    /// Asked before every step; returning `false` stops the run cleanly after saving a
    /// checkpoint of the steps taken (how a job is cancelled).
    fn keep_going(&mut self) -> bool {
        true
    }

    /// A check the trainer calls between micro-batches, where the backend computes
    /// synchronously (the CPU), so a long step can be abandoned: `true` drops the current step
    /// (nothing of it is applied) and the run stops as after `keep_going` returned `false`. It
    /// must be cheap; it is called from the training thread.
    fn interrupt(&self) -> Option<Interrupt> {
        None
    }
}

/// An observer that ignores everything.
impl Observer for () {
    fn event(&mut self, _: &Event) {}
}
