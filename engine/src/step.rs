//! These sit below `train/` and `schedule/`, so both use them without depending on each other.

use std::time::Duration;

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
    /// Part of the optimizer's time the device waited for: on a GPU, the compute stream's idle
    /// time while the host waited for an update (timed between marks on the stream); on the
    /// CPU, the host's waits.
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
