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
pub mod task_reports;
mod trainer;

pub use crate::schedule::Interrupt;
pub use card::{CARD_FILE, Curves, model_card, write_model_card};
pub use job::{
    DEFAULT_LR_PRETRAINED, DEFAULT_LR_RANDOM_INIT, Devices, GradientPolicy, Job, JobSettings,
    LR_BANDS, Limits, LrBand, LrMethod, Max, SettingDoc, SettingView, SettingsGuide,
};
pub use launch::run_on;
pub use retention::save_interval;
pub use run::{
    LoadedModel, ModelSource, RunOptions, RunSummary, held_out_records, load_model, model_spec,
    read_run_job, run, run_parallel, save_checkpoint,
};
pub use state::{RUN_FILE, STATE_DIR, TrainingState, data_fingerprint};
pub use trainer::Trainer;

pub use crate::step::{Span, StepMetrics, TrainConfig};

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
    /// The held-out loss at a point where no step was taken: before the first step (step 0),
    /// so a chart of the eval loss starts where training did.
    Evaluated {
        step: u64,
        loss: f64,
    },
    /// A task evaluation after `step` steps (0: the base model, before the first step): the
    /// metric's figure and every record's answer, also saved in the run folder
    /// ([`task_reports`]).
    TaskEvaluated {
        step: u64,
        report: crate::eval::TaskReport,
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
