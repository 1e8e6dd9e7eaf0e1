//! The one description of a training job: which model, which data, which devices, and the
//! settings (batch shape, optimizer, evaluation, saving). Its defaults and its validation live
//! here once; `sluice train`'s flags, the appliance's JSON body and the job runner all build a
//! [`Job`], so the command line and the API accept and refuse exactly the same jobs, with the
//! same messages (which name each setting by its JSON field).
//!
//! A job is what a user asks for; the [`super::RunOptions`] a run executes add the run folder
//! and the planner's placement (the streamer's [`crate::schedule::ScheduleOptions`]).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::data::DatasetSource;
use crate::error::{Error, Result};
use crate::eval::{AnswerFormat, EvalMetric, TaskSettings};
use crate::optim::Schedule;
use crate::plan::{
    BatchShape, Capabilities, GpuQuery, GradientTier, MachineMemory, MachineRates, MomentsPolicy,
    PlanInput,
};
use crate::schedule::from_plan::STREAMER;
use crate::spec::ModelSpec;
use crate::weights::SaveDtype;

use super::{ModelSource, TrainConfig};

/// Learning rate when none is given: fine-tuning a pretrained folder wants a small one, a
/// random-init preset learns from scratch with a larger one.
pub const DEFAULT_LR_PRETRAINED: f32 = 2e-5;
pub const DEFAULT_LR_RANDOM_INIT: f32 = 1e-3;

/// The most any job may ask for. Sizes past these are refused before anything is planned or
/// allocated: they are far beyond what the schedule can run (token positions are `i32`, a step's
/// micro-batches are held as a list) and would only exhaust memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Limits {
    pub max_steps: u64,
    pub max_seq_len: usize,
    pub max_micro_batch: usize,
    pub max_grad_accum: usize,
    /// Tokens in one micro-batch (`seq_len x micro_batch`).
    pub max_micro_tokens: usize,
}

impl Limits {
    /// What the engine itself can run; a deployment may only lower these.
    pub const ENGINE: Limits = Limits {
        max_steps: 100_000_000,
        max_seq_len: BatchShape::MAX_SEQ_LEN,
        max_micro_batch: BatchShape::MAX_MICRO_BATCH,
        max_grad_accum: BatchShape::MAX_GRAD_ACCUM,
        max_micro_tokens: BatchShape::MAX_MICRO_TOKENS,
    };

    /// These limits lowered to `max_steps` and `max_seq_len` where those are lower.
    pub fn at_most(self, max_steps: u64, max_seq_len: usize) -> Limits {
        Limits {
            max_steps: self.max_steps.min(max_steps),
            max_seq_len: self.max_seq_len.min(max_seq_len),
            ..self
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits::ENGINE
    }
}

/// Where a job computes: the CPU backend, or one or several NVIDIA GPUs of this host (several
/// share each step's micro-batches through NCCL). Written `cpu`, `cuda` (GPU 0), `cuda:N` or
/// `cuda:N,M,...`; this is the one parser of device names.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Devices {
    Cpu,
    /// Distinct ordinals, in the order given (the first is rank 0).
    Cuda(Vec<usize>),
}

impl Devices {
    /// The GPU ordinals (empty on the CPU).
    pub fn gpus(&self) -> &[usize] {
        match self {
            Devices::Cpu => &[],
            Devices::Cuda(ordinals) => ordinals,
        }
    }

    /// How many devices share a step (1 on the CPU).
    pub fn count(&self) -> usize {
        self.gpus().len().max(1)
    }

    /// Which memory the planner reads: the first GPU's (each GPU plans its own share), or the
    /// host's for the CPU.
    pub fn gpu_query(&self) -> GpuQuery {
        match self.gpus().first() {
            Some(&n) => GpuQuery::Ordinal(n),
            None => GpuQuery::HostOnly,
        }
    }

    /// The single device names this set is made of: `cpu`, or `cuda:N` for each GPU.
    pub fn members(&self) -> Vec<String> {
        match self {
            Devices::Cpu => vec!["cpu".into()],
            Devices::Cuda(ordinals) => ordinals.iter().map(|n| format!("cuda:{n}")).collect(),
        }
    }
}

impl FromStr for Devices {
    type Err = Error;

    fn from_str(s: &str) -> Result<Devices> {
        let expected =
            || Error::invalid(format!("device {s:?}: expected cpu, cuda, cuda:N or cuda:N,M,..."));
        if s == "cpu" {
            return Ok(Devices::Cpu);
        }
        let list = match s.strip_prefix("cuda") {
            Some("") => return Ok(Devices::Cuda(vec![0])),
            Some(rest) => rest.strip_prefix(':').ok_or_else(expected)?,
            None => return Err(expected()),
        };
        let mut ordinals = Vec::new();
        for n in list.split(',') {
            let o: usize = n.trim().parse().map_err(|_| expected())?;
            if ordinals.contains(&o) {
                return Err(Error::invalid(format!("device {s:?}: GPU {o} is named twice")));
            }
            ordinals.push(o);
        }
        Ok(Devices::Cuda(ordinals))
    }
}

impl fmt::Display for Devices {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Devices::Cpu => write!(f, "cpu"),
            Devices::Cuda(ordinals) => {
                let list: Vec<String> = ordinals.iter().map(usize::to_string).collect();
                write!(f, "cuda:{}", list.join(","))
            }
        }
    }
}

impl Serialize for Devices {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Devices {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Devices, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// Where gradients wait for the global norm while clipping is on: the user's choice between
/// memory and exactness, or `auto`, the most exact placement that fits (the planner's order:
/// the GPU, then fp32 in host memory, then bf16 in host memory). With clipping off there is no
/// choice: gradients go from a small ring straight into AdamW.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GradientPolicy {
    #[default]
    Auto,
    /// fp32 gradients wait in GPU memory.
    Device,
    /// fp32 gradients wait in host memory.
    Host,
    /// Gradients wait in host memory rounded to bf16, after their norm is taken in fp32.
    HostBf16,
}

impl GradientPolicy {
    /// Every policy, as written on the command line and in JSON.
    pub const NAMES: [&'static str; 4] = ["auto", "device", "host", "host_bf16"];

    /// The tier the planner must use, or `None` for its own choice.
    pub fn tier(self) -> Option<GradientTier> {
        match self {
            GradientPolicy::Auto => None,
            GradientPolicy::Device => Some(GradientTier::DeviceStore),
            GradientPolicy::Host => Some(GradientTier::HostStore),
            GradientPolicy::HostBf16 => Some(GradientTier::HostStoreBf16),
        }
    }
}

impl GradientPolicy {
    /// The policy that asks for `tier`; `None` for the ring, which is asked for by turning
    /// clipping off.
    pub fn asking_for(tier: GradientTier) -> Option<GradientPolicy> {
        [Self::Device, Self::Host, Self::HostBf16].into_iter().find(|p| p.tier() == Some(tier))
    }
}

impl fmt::Display for GradientPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = [Self::Auto, Self::Device, Self::Host, Self::HostBf16]
            .iter()
            .position(|p| p == self)
            .unwrap_or(0);
        f.write_str(Self::NAMES[i])
    }
}

impl FromStr for GradientPolicy {
    type Err = Error;

    fn from_str(s: &str) -> Result<GradientPolicy> {
        match s.replace('-', "_").as_str() {
            "auto" => Ok(GradientPolicy::Auto),
            "device" => Ok(GradientPolicy::Device),
            "host" => Ok(GradientPolicy::Host),
            "host_bf16" => Ok(GradientPolicy::HostBf16),
            _ => Err(Error::invalid(format!(
                "gradients {s:?}: expected one of {}",
                Self::NAMES.join(", ")
            ))),
        }
    }
}

/// How a job trains, everything but its model, data and devices. Every field has a default, so
/// a JSON body may give any subset; unknown fields are refused (a typo must not pass silently).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JobSettings {
    /// Tokens per packed row.
    pub seq_len: usize,
    /// Rows per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    /// Optimizer steps; `None`: one pass over the data.
    pub steps: Option<u64>,
    /// Peak learning rate; `None`: [`DEFAULT_LR_PRETRAINED`] for a model folder,
    /// [`DEFAULT_LR_RANDOM_INIT`] for a preset.
    pub lr: Option<f32>,
    pub schedule: Schedule,
    /// Steps of linear warmup.
    pub warmup: u64,
    /// AdamW's decoupled weight decay (matrices only).
    pub weight_decay: f32,
    /// Global gradient-norm clipping threshold; 0 turns clipping off.
    pub max_grad_norm: f32,
    /// Where gradients wait for the norm while clipping is on.
    pub gradients: GradientPolicy,
    /// Where the Adam moments live: host memory and, where it runs short, the machine's disk
    /// tier (`auto`), host memory only (`host`), or every unit's on the disk tier (`disk`).
    pub moments: MomentsPolicy,
    /// Seeds random initialisation and the shuffle of samples.
    pub seed: u64,
    /// Train on prompt tokens too, not only on assistant turns.
    pub train_on_prompt: bool,
    /// Also save a checkpoint (and the resumable state) every this many steps.
    pub save_every: Option<u64>,
    /// Precision of the saved checkpoints (the resumable state is always f32).
    pub save_dtype: SaveDtype,
    /// Report the held-out loss every this many steps (and after the last).
    pub eval_every: Option<u64>,
    /// Without a separate evaluation dataset, the fraction of the data's micro-batches held
    /// out for evaluation (at least one) when `eval_every` is set.
    pub held_out: f64,
    /// How the eval set is scored beside its loss: `loss` (the loss only) or a task metric,
    /// run on the base model before the first step, every `eval_every` steps and after the
    /// last.
    pub eval_metric: EvalMetric,
    /// How `extract` finds an output's final answer.
    pub eval_answer: AnswerFormat,
    /// The regular expression of `eval_answer` regex.
    pub eval_pattern: Option<String>,
    /// Tokens an answer may take in a task evaluation.
    pub eval_max_new_tokens: usize,
    /// Records of the eval set a task evaluation scores (the first ones).
    pub eval_records: usize,
}

impl Default for JobSettings {
    fn default() -> Self {
        JobSettings {
            seq_len: 256,
            micro_batch: 4,
            grad_accum: 1,
            steps: None,
            lr: None,
            schedule: Schedule::Cosine,
            warmup: 0,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            gradients: GradientPolicy::Auto,
            moments: MomentsPolicy::Auto,
            seed: 0,
            train_on_prompt: false,
            save_every: None,
            // Downloads are half the size; exact resume reads the f32 state, not checkpoints.
            save_dtype: SaveDtype::Bf16,
            eval_every: None,
            held_out: 0.05,
            eval_metric: EvalMetric::Loss,
            eval_answer: AnswerFormat::LastNumber,
            eval_pattern: None,
            eval_max_new_tokens: 128,
            eval_records: 200,
        }
    }
}

impl JobSettings {
    /// Settings from a JSON object (a job's body): absent fields take their defaults, an
    /// unknown field is refused, and a bad value's message starts with its field's name.
    pub fn from_json(fields: serde_json::Map<String, serde_json::Value>) -> Result<JobSettings> {
        serde_json::from_value(serde_json::Value::Object(fields.clone())).map_err(|whole| {
            // serde names unknown fields but not the field whose value is bad: find it.
            let bad = fields.iter().find_map(|(name, value)| {
                let alone = serde_json::Map::from_iter([(name.clone(), value.clone())]);
                serde_json::from_value::<JobSettings>(serde_json::Value::Object(alone))
                    .err()
                    .filter(|_| !whole.to_string().starts_with("unknown field"))
                    .map(|e| format!("{name}: {e}"))
            });
            Error::invalid(bad.unwrap_or_else(|| whole.to_string()))
        })
    }

    /// Checks every setting against `limits`; the message names the field as the JSON body
    /// does and says what is allowed.
    pub fn validate(&self, limits: &Limits) -> Result<()> {
        let batch = BatchShape {
            seq_len: self.seq_len,
            micro_batch: self.micro_batch,
            grad_accum: self.grad_accum,
        };
        batch.check_sizes(
            [limits.max_seq_len, limits.max_micro_batch, limits.max_grad_accum],
            limits.max_micro_tokens,
        )?;
        let counts = [
            ("steps", self.steps),
            ("save_every", self.save_every),
            ("eval_every", self.eval_every),
        ];
        for (name, value) in counts {
            if let Some(n) = value
                && !(1..=limits.max_steps).contains(&n)
            {
                return Err(Error::invalid(format!(
                    "{name} must be between 1 and {}, got {n}",
                    limits.max_steps
                )));
            }
        }
        if self.warmup > limits.max_steps {
            return Err(Error::invalid(format!(
                "warmup must be at most {} steps, got {}",
                limits.max_steps, self.warmup
            )));
        }
        if let Some(lr) = self.lr
            && !(lr.is_finite() && lr > 0.0 && lr <= 1.0)
        {
            return Err(Error::invalid(format!("lr must be above 0 and at most 1, got {lr}")));
        }
        if !(self.weight_decay.is_finite() && (0.0..=1.0).contains(&self.weight_decay)) {
            return Err(Error::invalid(format!(
                "weight_decay must be between 0 and 1, got {}",
                self.weight_decay
            )));
        }
        if !(self.max_grad_norm.is_finite() && self.max_grad_norm >= 0.0) {
            return Err(Error::invalid(format!(
                "max_grad_norm must be 0 (no clipping) or more, got {}",
                self.max_grad_norm
            )));
        }
        if !self.clipping() && self.gradients != GradientPolicy::Auto {
            return Err(Error::invalid(format!(
                "gradients must be auto when max_grad_norm is 0 (no clipping: gradients go \
                 straight into AdamW and wait nowhere), got {}",
                self.gradients
            )));
        }
        if !(self.held_out.is_finite() && self.held_out > 0.0 && self.held_out <= 0.5) {
            return Err(Error::invalid(format!(
                "held_out must be above 0 and at most 0.5 (a fraction of the data), got {}",
                self.held_out
            )));
        }
        let bounded = [
            ("eval_max_new_tokens", self.eval_max_new_tokens, MAX_EVAL_NEW_TOKENS),
            ("eval_records", self.eval_records, MAX_EVAL_RECORDS),
        ];
        for (name, value, max) in bounded {
            if !(1..=max).contains(&value) {
                return Err(Error::invalid(format!(
                    "{name} must be between 1 and {max}, got {value}"
                )));
            }
        }
        if self.eval_pattern.is_some() && self.eval_answer != AnswerFormat::Regex {
            return Err(Error::invalid(
                "eval_pattern is read only with eval_answer regex; set both or neither",
            ));
        }
        if let Some(task) = self.task()
            && (task.metric == EvalMetric::Extract || task.answer == AnswerFormat::Regex)
        {
            task.extractor()?;
        }
        Ok(())
    }

    /// Positions a sequence of a task evaluation between steps is planned for: a row's tokens
    /// and the answer's.
    pub fn eval_positions(&self) -> usize {
        self.seq_len + self.eval_max_new_tokens
    }

    /// Device bytes the planner leaves free for a task evaluation between steps.
    pub fn eval_device_reserve(&self, spec: &ModelSpec) -> u64 {
        crate::eval::task::device_reserve(
            spec,
            crate::eval::task::BETWEEN_STEPS,
            self.eval_positions(),
        )
    }

    /// Evaluations a run of `steps` steps makes: the base model's, every `eval_every` steps,
    /// and after the last.
    pub fn task_evaluations(&self, steps: u64) -> u64 {
        let every = self.eval_every.filter(|&e| e > 0);
        let periodic = every.map_or(0, |e| steps / e);
        let last = u64::from(every.is_none_or(|e| !steps.is_multiple_of(e)) && steps > 0);
        1 + periodic + last
    }

    /// The task evaluation asked for, if any (`eval_metric` other than loss).
    pub fn task(&self) -> Option<TaskSettings> {
        (self.eval_metric != EvalMetric::Loss).then(|| TaskSettings {
            metric: self.eval_metric,
            answer: self.eval_answer,
            pattern: self.eval_pattern.clone(),
            max_new_tokens: self.eval_max_new_tokens,
            records: self.eval_records,
        })
    }

    /// The learning rate, with the default for `model` when none was given.
    pub fn lr_for(&self, model: &ModelSource) -> f32 {
        self.lr.unwrap_or(match model {
            ModelSource::Dir(_) => DEFAULT_LR_PRETRAINED,
            ModelSource::Preset(_) => DEFAULT_LR_RANDOM_INIT,
        })
    }

    /// Whether global-norm clipping is on.
    pub fn clipping(&self) -> bool {
        self.max_grad_norm > 0.0
    }

    pub fn batch(&self) -> BatchShape {
        BatchShape {
            seq_len: self.seq_len,
            micro_batch: self.micro_batch,
            grad_accum: self.grad_accum,
        }
    }
}

/// A setting as the command line, the API's description and the form show it. `sluice train`
/// makes a flag of each (`--seq-len` for `seq_len`) and the appliance's
/// `GET /api/job-defaults` lists them, so a new setting is a field of [`JobSettings`], its
/// entry in [`JobSettings::FIELDS`], its check in [`JobSettings::validate`] and its use.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SettingDoc {
    /// The JSON field; the flag is the same with dashes.
    pub name: &'static str,
    /// What it does, for a user.
    pub help: &'static str,
    /// The value's name in a usage line (`N`, `RATE`, ...).
    pub value: &'static str,
    /// The words a choice may be; empty for a number or a switch.
    pub choices: &'static [&'static str],
    /// The smallest value allowed (for a number; a fraction or rate must be above it when
    /// `above` is set).
    pub min: Option<f64>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub above: bool,
    /// Free text (a pattern), not a number or a choice.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub text: bool,
    /// The largest value allowed, before a deployment's [`Limits`] lower it (a client sees it
    /// under the limits, [`SettingView::max_value`]).
    #[serde(skip)]
    pub max: Option<Max>,
}

/// Where a setting's largest value comes from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Max {
    Value(f64),
    /// [`Limits::max_steps`].
    Steps,
    /// [`Limits::max_seq_len`].
    SeqLen,
    /// [`Limits::max_micro_batch`].
    MicroBatch,
    /// [`Limits::max_grad_accum`].
    GradAccum,
}

impl Max {
    /// The bound under `limits`.
    pub fn under(self, limits: &Limits) -> f64 {
        match self {
            Max::Value(v) => v,
            Max::Steps => limits.max_steps as f64,
            Max::SeqLen => limits.max_seq_len as f64,
            Max::MicroBatch => limits.max_micro_batch as f64,
            Max::GradAccum => limits.max_grad_accum as f64,
        }
    }
}

/// A setting's description with its bounds under a deployment's limits and its default.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SettingView {
    #[serde(flatten)]
    pub doc: SettingDoc,
    /// [`SettingDoc::max`] under the limits.
    #[serde(rename = "max")]
    pub max_value: Option<f64>,
    /// The value a job takes when the setting is left out (`null`: decided by the job, as
    /// the learning rate by its model and the steps by its data).
    pub default: serde_json::Value,
}

/// What a client needs to offer a job's settings without copying a constant: every setting
/// with its default, bounds and choices, the learning rates a job takes without one, the
/// rates worth a warning, and the limits they fall under.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SettingsGuide {
    pub settings: Vec<SettingView>,
    /// The learning rate for a model folder and for a random-init preset.
    pub lr_pretrained: f32,
    pub lr_random_init: f32,
    /// Above which learning rate a job likely diverges, by method and model size.
    pub lr_bands: &'static [LrBand],
    pub limits: Limits,
}

/// The most tokens a task evaluation's answer may take.
pub const MAX_EVAL_NEW_TOKENS: usize = 2048;
/// The most records a task evaluation scores.
pub const MAX_EVAL_RECORDS: usize = 5000;

/// How a job starts: from a preset's random weights or from a model folder's trained ones.
/// The safe learning rates of the two differ by orders of magnitude.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LrMethod {
    RandomInit,
    Pretrained,
}

/// The learning rates a method takes without a warning, for models up to a size. Above
/// `warn_above` AdamW's full-precision updates typically throw the loss up instead of down
/// (a random-init tiny preset at 0.5 climbs above 40), and a pretrained model forgets what it
/// knew well before that; larger models need smaller rates. A warning, not a refusal: the
/// bounds of [`JobSettings::validate`] still decide what runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LrBand {
    pub method: LrMethod,
    /// Models of at most this many parameters; `None`: any size.
    pub max_params: Option<u64>,
    /// The largest rate taken without a warning.
    pub warn_above: f32,
}

/// The bands, smallest models first within each method; the first that matches applies.
pub const LR_BANDS: &[LrBand] = &[
    LrBand { method: LrMethod::RandomInit, max_params: Some(100_000_000), warn_above: 1e-2 },
    LrBand { method: LrMethod::RandomInit, max_params: None, warn_above: 3e-3 },
    LrBand { method: LrMethod::Pretrained, max_params: Some(1_000_000_000), warn_above: 1e-4 },
    LrBand { method: LrMethod::Pretrained, max_params: Some(13_000_000_000), warn_above: 5e-5 },
    LrBand { method: LrMethod::Pretrained, max_params: None, warn_above: 3e-5 },
];

impl LrBand {
    /// The band for a model of `params` parameters started by `method`.
    pub fn of(method: LrMethod, params: u64) -> &'static LrBand {
        LR_BANDS
            .iter()
            .find(|b| b.method == method && b.max_params.is_none_or(|max| params <= max))
            .unwrap_or(&LR_BANDS[LR_BANDS.len() - 1])
    }
}

const NO_CHOICE: &[&str] = &[];

const fn doc(name: &'static str, value: &'static str, help: &'static str) -> SettingDoc {
    SettingDoc {
        name,
        help,
        value,
        choices: NO_CHOICE,
        min: None,
        above: false,
        text: false,
        max: None,
    }
}

const fn count(name: &'static str, min: f64, max: Max, help: &'static str) -> SettingDoc {
    SettingDoc { min: Some(min), max: Some(max), ..doc(name, "N", help) }
}

const fn choice(
    name: &'static str,
    choices: &'static [&'static str],
    help: &'static str,
) -> SettingDoc {
    SettingDoc { choices, ..doc(name, "CHOICE", help) }
}

impl JobSettings {
    /// Every setting, in the order a form or a usage line shows them; one entry per field
    /// (a unit test holds the two together).
    pub const FIELDS: [SettingDoc; 22] = [
        count("seq_len", 1.0, Max::SeqLen, "Tokens per packed row."),
        count("micro_batch", 1.0, Max::MicroBatch, "Rows per micro-batch."),
        count("grad_accum", 1.0, Max::GradAccum, "Micro-batches per optimizer step."),
        count("steps", 1.0, Max::Steps, "Optimizer steps [default: one pass over the data]."),
        SettingDoc {
            min: Some(0.0),
            above: true,
            max: Some(Max::Value(1.0)),
            ..doc(
                "lr",
                "RATE",
                "Peak learning rate [default: 2e-5 for a model folder, 1e-3 for a random-init \
                 preset].",
            )
        },
        choice(
            "schedule",
            &["constant", "linear", "cosine"],
            "Learning-rate schedule after warmup.",
        ),
        count("warmup", 0.0, Max::Steps, "Steps of linear warmup."),
        SettingDoc {
            min: Some(0.0),
            max: Some(Max::Value(1.0)),
            ..doc("weight_decay", "DECAY", "AdamW's decoupled weight decay, matrices only.")
        },
        SettingDoc {
            min: Some(0.0),
            ..doc(
                "max_grad_norm",
                "NORM",
                "Clip the global gradient norm to this; 0 turns clipping off.",
            )
        },
        choice(
            "gradients",
            &GradientPolicy::NAMES,
            "Where gradients wait for the norm while clipping: auto (the most exact that fits; \
             of the two fp32 stores, the faster), device (fp32 in GPU memory), host (fp32 in \
             host memory) or host_bf16 (rounded to bf16 in host memory after an fp32 norm: \
             half the host bytes).",
        ),
        choice(
            "moments",
            &MomentsPolicy::NAMES,
            "Where the Adam moments live: host memory and, where it runs short, the disk tier \
             (auto), host memory only (host), or every unit's on the disk tier (disk).",
        ),
        SettingDoc {
            min: Some(0.0),
            ..doc("seed", "SEED", "Seed for random initialisation and the order of samples.")
        },
        doc(
            "train_on_prompt",
            "",
            "Compute the loss on prompt tokens too, not only on assistant turns.",
        ),
        count(
            "save_every",
            1.0,
            Max::Steps,
            "Also save a checkpoint (and the resumable state) every N steps.",
        ),
        choice(
            "save_dtype",
            &["bf16", "f32"],
            "Precision of saved weights: bf16 (half the size) or f32 (the exact master \
             weights); the resumable state is always f32.",
        ),
        count(
            "eval_every",
            1.0,
            Max::Steps,
            "Report the held-out loss every N steps (and after the last).",
        ),
        SettingDoc {
            min: Some(0.0),
            above: true,
            max: Some(Max::Value(0.5)),
            ..doc(
                "held_out",
                "FRACTION",
                "Without a separate evaluation dataset, the fraction of the data held out for \
                 evaluation when eval_every is set.",
            )
        },
        choice(
            "eval_metric",
            &EvalMetric::NAMES,
            "Score the eval set beside its loss, on the base model before step 1, every \
             eval_every steps and after the last: loss (the loss only), exact_match, contains \
             (the reference in the answer), extract (a final answer, see eval_answer), rouge_l, \
             bleu, choice (multiple choice by likelihood: records with choices) or perplexity \
             (of the references).",
        ),
        choice(
            "eval_answer",
            &AnswerFormat::NAMES,
            "How extract finds the final answer: gsm8k (after ####), last_number, boxed \
             (\\boxed{...}) or regex (eval_pattern).",
        ),
        SettingDoc {
            text: true,
            ..doc(
                "eval_pattern",
                "REGEX",
                "With eval_answer regex: the answer is the pattern's first group (or whole \
                 match), its last match in the output.",
            )
        },
        count(
            "eval_max_new_tokens",
            1.0,
            Max::Value(MAX_EVAL_NEW_TOKENS as f64),
            "Tokens an answer may take in a task evaluation.",
        ),
        count(
            "eval_records",
            1.0,
            Max::Value(MAX_EVAL_RECORDS as f64),
            "Records of the eval set a task evaluation scores (the first N).",
        ),
    ];

    /// The settings as a client offers them under `limits`.
    pub fn guide(limits: &Limits) -> SettingsGuide {
        let defaults = serde_json::to_value(JobSettings::default()).unwrap_or_default();
        let settings = Self::FIELDS
            .iter()
            .map(|doc| SettingView {
                doc: *doc,
                max_value: doc.max.map(|m| m.under(limits)),
                default: defaults.get(doc.name).cloned().unwrap_or_default(),
            })
            .collect();
        SettingsGuide {
            settings,
            lr_pretrained: DEFAULT_LR_PRETRAINED,
            lr_random_init: DEFAULT_LR_RANDOM_INIT,
            lr_bands: LR_BANDS,
            limits: *limits,
        }
    }

    /// The settings that differ from the defaults, as JSON fields in [`Self::FIELDS`]' order
    /// (`always` are listed even at their default): what a command line or a summary shows.
    /// Numbers are the shortest decimals that read back as the same values (`0.00002` for an
    /// f32 learning rate of 2e-5, not its f64 expansion).
    pub fn changed(&self, always: &[&str]) -> Vec<(&'static str, serde_json::Value)> {
        let json = |s: &JobSettings| {
            serde_json::to_string(s)
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .unwrap_or_default()
        };
        // The defaults as JSON, made once: the job list asks this of every job it shows.
        static DEFAULTS: std::sync::OnceLock<serde_json::Value> = std::sync::OnceLock::new();
        let defaults = DEFAULTS.get_or_init(|| json(&JobSettings::default()));
        let mine = json(self);
        Self::FIELDS
            .iter()
            .filter_map(|doc| {
                let value = mine.get(doc.name).cloned().unwrap_or_default();
                let differs = Some(&value) != defaults.get(doc.name);
                (differs || always.contains(&doc.name)).then_some((doc.name, value))
            })
            .collect()
    }
}

/// A whole job: what to train, on what, where, and how.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Job {
    pub model: ModelSource,
    pub data: DatasetSource,
    /// A separate held-out dataset, evaluated before the first step, every `eval_every` steps
    /// and after the last, instead of a fraction of `data`.
    #[serde(default)]
    pub eval_data: Option<DatasetSource>,
    pub devices: Devices,
    #[serde(default)]
    pub settings: JobSettings,
}

impl Job {
    /// Everything that can be checked without reading a file.
    pub fn validate(&self, limits: &Limits) -> Result<()> {
        self.settings.validate(limits)?;
        let gpus = self.devices.count();
        if gpus > 1 && self.settings.grad_accum < gpus {
            return Err(Error::invalid(format!(
                "grad_accum must be at least the number of GPUs ({gpus}) so each has a \
                 micro-batch, got {}",
                self.settings.grad_accum
            )));
        }
        Ok(())
    }

    /// The optimizer's hyperparameters (`total_steps` is set once the data is packed).
    pub fn train_config(&self) -> TrainConfig {
        let s = &self.settings;
        TrainConfig {
            lr: s.lr_for(&self.model),
            schedule: s.schedule,
            warmup_steps: s.warmup,
            weight_decay: s.weight_decay,
            max_grad_norm: s.clipping().then_some(s.max_grad_norm),
            ..TrainConfig::default()
        }
    }

    /// What the planner is asked for this job on a machine with `memory` (each GPU's), for
    /// the placements the streamer runs, at the rates of its kind of device.
    /// The task evaluation's cost for `plan`'s placement, at most: `eval_records` records with
    /// prompts as long as `seq_len` (multiple choice: four choices each), every answer running
    /// to `eval_max_new_tokens`, the layers streamed from the host store as between steps.
    /// `None` without a task evaluation.
    pub fn eval_plan(&self, spec: &ModelSpec) -> Option<crate::plan::EvalPlan> {
        use crate::eval::EvalWork;
        use crate::eval::task::BETWEEN_STEPS;
        const CHOICES_ASSUMED: usize = 4;
        let s = &self.settings;
        let task = s.task()?;
        let records = s.eval_records;
        let prompt = s.seq_len.min(spec.max_positions.saturating_sub(1)).max(1);
        let (work, new_tokens) = match task.metric {
            EvalMetric::Choice => {
                let n = records * CHOICES_ASSUMED;
                (EvalWork::Score { lengths: vec![prompt; n], wanted: vec![prompt / 4 + 1; n] }, 0)
            }
            EvalMetric::Perplexity => (
                EvalWork::Score { lengths: vec![prompt; records], wanted: vec![prompt; records] },
                0,
            ),
            _ => {
                let new = s.eval_max_new_tokens;
                (EvalWork::Generate { prompts: vec![prompt; records], new_tokens: new }, new)
            }
        };
        let each = crate::eval::timing::predict(spec, &self.rates(), BETWEEN_STEPS, true, &work);
        Some(crate::plan::EvalPlan {
            device_reserve: if self.devices == Devices::Cpu {
                0
            } else {
                s.eval_device_reserve(spec)
            },
            records,
            sequences: BETWEEN_STEPS.sequences,
            prompt_tokens: prompt,
            new_tokens,
            each,
            evaluations: s.steps.map(|steps| s.task_evaluations(steps)),
        })
    }

    /// The rates the planner prices this job's devices at.
    pub fn rates(&self) -> MachineRates {
        match self.devices {
            Devices::Cpu => MachineRates::cpu(),
            Devices::Cuda(_) => MachineRates::default(),
        }
    }

    pub fn plan_input<'a>(&self, spec: &'a ModelSpec, memory: MachineMemory) -> PlanInput<'a> {
        // A task evaluation between steps runs beside the training's buffers: the placement
        // leaves it room.
        let mut memory = memory;
        if self.devices != Devices::Cpu && self.settings.task().is_some() {
            let reserve = self.settings.eval_device_reserve(spec);
            memory.gpu_bytes = memory.gpu_bytes.saturating_sub(reserve);
        }
        PlanInput {
            spec,
            batch: self.settings.batch(),
            clipping: self.settings.clipping(),
            memory,
            rates: self.rates(),
            supports: Capabilities {
                only_gradients: self.settings.gradients.tier(),
                moments: self.settings.moments,
                ..STREAMER
            },
            gpus: self.devices.count(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_one_or_several_gpus() {
        let parse = |s: &str| s.parse::<Devices>();
        assert_eq!(parse("cpu").expect("cpu"), Devices::Cpu);
        assert_eq!(parse("cuda").expect("cuda"), Devices::Cuda(vec![0]));
        assert_eq!(parse("cuda:3").expect("cuda:3"), Devices::Cuda(vec![3]));
        assert_eq!(parse("cuda:0,1, 2").expect("three"), Devices::Cuda(vec![0, 1, 2]));
        assert_eq!(Devices::Cuda(vec![0, 1]).to_string(), "cuda:0,1");
        assert_eq!(Devices::Cuda(vec![2, 0]).members(), ["cuda:2", "cuda:0"]);
        for bad in ["gpu", "cuda0", "cuda:", "cuda:0,x", "cuda:1,1", ""] {
            let e = parse(bad).expect_err(bad).to_string();
            assert!(e.contains(&format!("{bad:?}")), "{bad}: {e}");
        }
        let json: Devices = serde_json::from_str("\"cuda:1,0\"").expect("json");
        assert_eq!(json, Devices::Cuda(vec![1, 0]));
        assert!(serde_json::from_str::<Devices>("\"tpu\"").is_err());
    }

    #[test]
    fn every_setting_is_described_once_with_the_bounds_validate_holds() {
        let defaults = serde_json::to_value(JobSettings::default()).expect("json");
        let fields: Vec<&str> =
            defaults.as_object().expect("object").keys().map(|k| &**k).collect();
        let described: Vec<&str> = JobSettings::FIELDS.iter().map(|d| d.name).collect();
        let mut sorted = described.clone();
        sorted.sort_unstable();
        let mut fields_sorted = fields.clone();
        fields_sorted.sort_unstable();
        assert_eq!(sorted, fields_sorted, "every field of JobSettings has one entry in FIELDS");

        let limits = Limits::ENGINE.at_most(1000, 4096);
        // Whole numbers go as JSON integers, as a client sends a count.
        let num = |x: f64| -> serde_json::Value {
            if x.fract() == 0.0 && x.abs() < 1e15 { (x as i64).into() } else { x.into() }
        };
        let with = |name: &str, value: serde_json::Value| {
            let mut map = serde_json::Map::new();
            map.insert(name.to_string(), value);
            // The ring needs clipping off only for gradients; every other field stands alone.
            JobSettings::from_json(map).and_then(|s| s.validate(&limits))
        };
        for doc in JobSettings::FIELDS {
            for choice in doc.choices {
                with(doc.name, (*choice).into()).expect(choice);
            }
            if let Some(max) = doc.max {
                let max = max.under(&limits);
                with(doc.name, num(max)).unwrap_or_else(|e| panic!("{}: {max}: {e}", doc.name));
                let past = if max.fract() == 0.0 && max > 1.0 { max + 1.0 } else { max * 1.01 };
                let e = with(doc.name, num(past)).expect_err(doc.name).to_string();
                assert!(e.contains(doc.name), "{}: {e}", doc.name);
            }
            if let Some(min) = doc.min {
                let result = with(doc.name, num(min));
                assert_eq!(result.is_err(), doc.above, "{} at its minimum {min}", doc.name);
                let below = if doc.above { -1e-3 } else { min - 1.0 };
                assert!(with(doc.name, num(below)).is_err(), "{} below {min}", doc.name);
            }
        }
        let guide = JobSettings::guide(&limits);
        let seq = guide.settings.iter().find(|v| v.doc.name == "seq_len").expect("seq_len");
        assert_eq!((seq.max_value, seq.default.as_u64()), (Some(4096.0), Some(256)));
    }

    #[test]
    fn changed_lists_what_differs_in_field_order_with_short_numbers() {
        let s = JobSettings { lr: Some(2e-5), seed: 3, ..JobSettings::default() };
        let changed = s.changed(&["seq_len"]);
        let names: Vec<&str> = changed.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["seq_len", "lr", "seed"]);
        // The f32's shortest decimal, not its f64 expansion (1.9999999494757503e-5).
        assert_eq!(changed[1].1.to_string(), "0.00002");
    }

    #[test]
    fn every_setting_is_bounded_and_named() {
        let limits = Limits::ENGINE;
        JobSettings::default().validate(&limits).expect("defaults are valid");
        let cases: Vec<(JobSettings, &str)> = vec![
            (JobSettings { seq_len: 0, ..Default::default() }, "seq_len must be between 1"),
            (JobSettings { seq_len: 1 << 40, ..Default::default() }, "seq_len"),
            (JobSettings { micro_batch: 1 << 56, ..Default::default() }, "micro_batch"),
            (JobSettings { grad_accum: 1_000_000_000, ..Default::default() }, "grad_accum"),
            (
                JobSettings { seq_len: 1 << 20, micro_batch: 4096, ..Default::default() },
                "seq_len x micro_batch",
            ),
            (JobSettings { steps: Some(0), ..Default::default() }, "steps"),
            (JobSettings { steps: Some(u64::MAX), ..Default::default() }, "steps"),
            (JobSettings { save_every: Some(0), ..Default::default() }, "save_every"),
            (JobSettings { eval_every: Some(0), ..Default::default() }, "eval_every"),
            (JobSettings { warmup: u64::MAX, ..Default::default() }, "warmup"),
            (JobSettings { lr: Some(-1.0), ..Default::default() }, "lr"),
            (JobSettings { lr: Some(f32::NAN), ..Default::default() }, "lr"),
            (JobSettings { weight_decay: -0.1, ..Default::default() }, "weight_decay"),
            (JobSettings { max_grad_norm: f32::INFINITY, ..Default::default() }, "max_grad_norm"),
            (
                JobSettings {
                    max_grad_norm: 0.0,
                    gradients: GradientPolicy::HostBf16,
                    ..Default::default()
                },
                "gradients must be auto when max_grad_norm is 0",
            ),
            (JobSettings { held_out: 0.0, ..Default::default() }, "held_out"),
            (JobSettings { held_out: 0.9, ..Default::default() }, "held_out"),
        ];
        for (settings, needle) in cases {
            let err = settings.validate(&limits).expect_err(needle).to_string();
            assert!(err.contains(needle), "{needle}: {err}");
        }
        // A deployment's lower limits apply with the same message.
        let site = Limits::ENGINE.at_most(100, 512);
        let err = JobSettings { steps: Some(101), ..Default::default() }.validate(&site);
        assert!(err.expect_err("over").to_string().contains("between 1 and 100"));
    }

    #[test]
    fn unknown_fields_are_refused_and_defaults_fill_the_rest() {
        let s: JobSettings = serde_json::from_str(r#"{"seq_len": 64}"#).expect("subset");
        assert_eq!(s, JobSettings { seq_len: 64, ..Default::default() });
        let err = serde_json::from_str::<JobSettings>(r#"{"stepz": 3}"#).expect_err("typo");
        assert!(err.to_string().contains("stepz"), "{err}");
        let err = serde_json::from_str::<JobSettings>(r#"{"schedule": "zigzag"}"#);
        assert!(err.expect_err("bad schedule").to_string().contains("zigzag"));
        let object = |text: &str| match serde_json::from_str(text) {
            Ok(serde_json::Value::Object(map)) => map,
            other => panic!("{text}: {other:?}"),
        };
        let err = JobSettings::from_json(object(r#"{"seq_len": 64, "schedule": "zigzag"}"#));
        let err = err.expect_err("bad schedule").to_string();
        assert!(err.contains("schedule: unknown variant `zigzag`"), "{err}");
        let err = JobSettings::from_json(object(r#"{"micro_batch": "eight"}"#));
        assert!(err.expect_err("a string").to_string().contains("micro_batch: invalid type"));
        let err = JobSettings::from_json(object(r#"{"seq_len": 64, "stepz": 3}"#));
        assert!(err.expect_err("typo").to_string().contains("unknown field `stepz`"));
        let s = JobSettings::from_json(object(r#"{"seq_len": 64}"#)).expect("valid");
        assert_eq!(s.seq_len, 64);
    }

    #[test]
    fn gradient_policies_parse_and_reach_the_planner() {
        for name in GradientPolicy::NAMES {
            let policy: GradientPolicy = name.parse().expect(name);
            assert_eq!(policy.to_string(), name);
            let json = serde_json::to_string(&policy).expect("json");
            assert_eq!(json, format!("\"{name}\""));
        }
        assert_eq!("host-bf16".parse::<GradientPolicy>().expect("dash"), GradientPolicy::HostBf16);
        let err = "gpu".parse::<GradientPolicy>().expect_err("unknown").to_string();
        assert!(err.contains("auto, device, host, host_bf16"), "{err}");

        // 7B on a 24 GiB GPU with 125 GiB of host memory: the planner's own choice is the fp32
        // host store; a user who asks for bf16 gradients gets them, and one who asks for the
        // device store is refused (it cannot hold 30 GB of gradients), not silently moved.
        let spec = crate::spec::preset("qwen2.5-7b").expect("preset");
        let gib = 1u64 << 30;
        let memory = MachineMemory::given(24 * gib, 125 * gib);
        let job = |gradients| seven_b(JobSettings { gradients, ..seven_b_shape() });
        let planned = |policy| {
            crate::plan::plan(&job(policy).plan_input(&spec, memory.clone())).expect("plan")
        };
        let tier = |v: crate::plan::Verdict| v.into_plan().expect("fits").placement.gradients;
        assert_eq!(tier(planned(GradientPolicy::Auto)), GradientTier::HostStore);
        assert_eq!(tier(planned(GradientPolicy::Host)), GradientTier::HostStore);
        assert_eq!(tier(planned(GradientPolicy::HostBf16)), GradientTier::HostStoreBf16);
        let refused = planned(GradientPolicy::Device).into_plan().expect_err("no room");
        assert!(refused.to_string().contains("does not fit"), "{refused}");
    }

    /// Qwen2.5-7B on GPU 0 with `settings`.
    fn seven_b(settings: JobSettings) -> Job {
        Job {
            model: ModelSource::Preset("qwen2.5-7b".into()),
            data: DatasetSource::File("d.jsonl".into()),
            eval_data: None,
            devices: Devices::Cuda(vec![0]),
            settings,
        }
    }

    /// 8 micro-batches of 8 x 1024 tokens, the rest default.
    fn seven_b_shape() -> JobSettings {
        JobSettings { seq_len: 1024, micro_batch: 8, grad_accum: 8, ..Default::default() }
    }

    #[test]
    fn moments_policies_parse_and_reach_the_planner() {
        for name in MomentsPolicy::NAMES {
            let policy: MomentsPolicy = name.parse().expect(name);
            assert_eq!(policy.to_string(), name);
            assert_eq!(serde_json::to_string(&policy).expect("json"), format!("\"{name}\""));
        }
        let err = "ssd".parse::<MomentsPolicy>().expect_err("unknown").to_string();
        assert!(err.contains("auto, host, disk"), "{err}");
        let object = |text: &str| match serde_json::from_str(text) {
            Ok(serde_json::Value::Object(map)) => map,
            other => panic!("{text}: {other:?}"),
        };
        let err = JobSettings::from_json(object(r#"{"moments": "ssd"}"#)).expect_err("unknown");
        assert!(err.to_string().contains("moments: unknown variant `ssd`"), "{err}");
        let s = JobSettings::from_json(object(r#"{"moments": "disk"}"#)).expect("valid");
        assert_eq!(s.moments, MomentsPolicy::Disk);
        assert_eq!(JobSettings::default().moments, MomentsPolicy::Auto);

        // 7B with 64 GiB of host memory and a disk tier: auto and disk use it, host refuses.
        let spec = crate::spec::preset("qwen2.5-7b").expect("preset");
        let gib = 1u64 << 30;
        let disk = crate::plan::DiskSpace {
            dir: "/mnt/nvme".into(),
            bytes: 200 * gib,
            read_bytes_per_s: 2_000_000_000,
            write_bytes_per_s: 2_000_000_000,
            source: crate::plan::MemorySource::Given,
        };
        let memory =
            MachineMemory { disk: Some(disk), ..MachineMemory::given(139 * gib, 64 * gib) };
        let job = |moments| seven_b(JobSettings { moments, ..seven_b_shape() });
        let planned = |moments| {
            crate::plan::plan(&job(moments).plan_input(&spec, memory.clone())).expect("plan")
        };
        let on_disk = |v: crate::plan::Verdict| v.into_plan().expect("fits").placement.disk_units;
        let auto = on_disk(planned(MomentsPolicy::Auto));
        assert!(!auto.is_empty() && auto.len() < spec.layers, "{auto:?}");
        assert_eq!(on_disk(planned(MomentsPolicy::Disk)).len(), spec.layers + 2);
        let refused = planned(MomentsPolicy::Host).into_plan().expect_err("no room");
        assert!(refused.to_string().contains("does not fit: host memory"), "{refused}");
    }

    #[test]
    fn a_task_evaluation_is_planned_beside_the_steps() {
        let with = |eval_every| JobSettings { eval_every, ..Default::default() };
        assert_eq!(with(Some(25)).task_evaluations(100), 5); // 0, 25, 50, 75, 100
        assert_eq!(with(Some(30)).task_evaluations(100), 5); // 0, 30, 60, 90, 100
        assert_eq!(with(None).task_evaluations(100), 2); // 0 and the last
        assert_eq!(with(Some(25)).task_evaluations(0), 1);

        let spec = crate::spec::preset("qwen2.5-7b").expect("preset");
        let job = |eval_metric, devices| Job {
            model: ModelSource::Preset("qwen2.5-7b".into()),
            data: DatasetSource::File("d.jsonl".into()),
            eval_data: None,
            devices,
            settings: JobSettings {
                eval_metric,
                eval_every: Some(25),
                steps: Some(100),
                seq_len: 512,
                ..Default::default()
            },
        };
        assert!(job(EvalMetric::Loss, Devices::Cuda(vec![0])).eval_plan(&spec).is_none());
        let gpu = job(EvalMetric::ExactMatch, Devices::Cuda(vec![0]));
        let e = gpu.eval_plan(&spec).expect("a task");
        assert_eq!(e.device_reserve, gpu.settings.eval_device_reserve(&spec));
        // 200 records in 7 groups of at most 32: each prefills (32 x 512 tokens in 4 forwards
        // of 4096; the last group's 8 prompts in 1) and decodes 127 forwards.
        assert_eq!(e.each.forwards, 6 * (4 + 127) + (1 + 127));
        assert_eq!(e.evaluations, Some(5));
        assert!((e.total_s().expect("steps known") - 5.0 * e.each.seconds).abs() < 1e-9);
        assert!(e.each.upload_s > 0.0, "between steps the layers stream");
        // On the processor nothing is kept on a device, and its rates are its own.
        let cpu = job(EvalMetric::ExactMatch, Devices::Cpu).eval_plan(&spec).expect("a task");
        assert_eq!(cpu.device_reserve, 0);
        assert!(cpu.each.seconds > e.each.seconds);
        // The planner leaves the reserve free on the GPU.
        let memory = MachineMemory::given(24 << 30, 125 << 30);
        let input = gpu.plan_input(&spec, memory);
        assert_eq!(input.memory.gpu_bytes, (24 << 30) - e.device_reserve);
    }

    #[test]
    fn several_gpus_need_a_micro_batch_each() {
        let job = Job {
            model: ModelSource::Preset("tiny".into()),
            data: DatasetSource::File("d.jsonl".into()),
            eval_data: None,
            devices: Devices::Cuda(vec![0, 1]),
            settings: JobSettings { grad_accum: 1, ..Default::default() },
        };
        let err = job.validate(&Limits::ENGINE).expect_err("one micro-batch, two GPUs");
        assert!(err.to_string().contains("grad_accum must be at least the number of GPUs (2)"));
        assert_eq!(job.train_config().lr, DEFAULT_LR_RANDOM_INIT);
    }

    #[test]
    fn every_default_rate_is_inside_its_band_and_every_size_has_one() {
        for (method, default) in [
            (LrMethod::RandomInit, DEFAULT_LR_RANDOM_INIT),
            (LrMethod::Pretrained, DEFAULT_LR_PRETRAINED),
        ] {
            let mut last = f32::INFINITY;
            for params in [1_000_000, 500_000_000, 7_000_000_000, 70_000_000_000, u64::MAX] {
                let band = LrBand::of(method, params);
                assert_eq!(band.method, method, "{params} parameters");
                assert!(default <= band.warn_above, "{method:?} at {params}: {band:?}");
                assert!(band.warn_above <= last, "larger models take smaller rates");
                last = band.warn_above;
            }
        }
        // A tiny preset at 0.5 diverges (its loss climbs above 40): it is warned about.
        assert!(0.5 > LrBand::of(LrMethod::RandomInit, 1_000_000).warn_above);
        let guide = JobSettings::guide(&Limits::ENGINE);
        assert_eq!(guide.lr_bands, LR_BANDS);
    }
}
