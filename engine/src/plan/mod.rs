//! The memory-hierarchy planner: given a model, a batch shape and a machine, decides where every
//! buffer of the streaming step lives and predicts what a step costs, or refuses with the reason
//! and what would fit. One implementation serves `sluice plan`, the web form and the trainer
//! (which refuses a plan that does not fit before it allocates anything).
//!
//! The step it plans (DESIGN.md §3): units (embedding, each decoder layer, head) stream through
//! the device in layer-major order over G micro-batches. Weights cross PCIe twice per step
//! (forward, backward; once for a resident unit), as bf16 from a streaming copy or as the fp32
//! master cast on the device; fp32 gradients come back once. The host
//! holds 12 bytes per parameter (fp32 master, m, v) plus, where PCIe bounds the step, a bf16
//! streaming copy (2 more: the weights then cross PCIe at half the bytes), the gradient store or
//! landing ring, host checkpoints and staging.
//!
//! How it decides: every combination of checkpoint tier (device or host), checkpoint interval K
//! (1, or up to about sqrt(L) on the device) and, with clipping on, gradient tier (device store
//! or host store) and weight source (the fp32 master, cast on the device, or a bf16 streaming
//! copy) is a candidate. Each candidate then keeps as many units' weights resident as
//! spare device memory allows, most-used first, and spends what the device has left on kept
//! activations ([`fill_kept`]). Candidates that fit are timed by a
//! discrete-event model of the schedule ([`timing`]); the fastest wins, and among those within
//! 1% of it the one with the fewest units' moments on the disk tier, then with no bf16 copy on
//! the host (host memory bounds the models a machine trains), then the simplest (device
//! checkpoints, K = 1, gradients on the device). Only layouts the executing schedule implements are candidates ([`Capabilities`]). For the CPU backend the
//! device is host memory ([`MemorySource::SharedWithHost`]): nothing is kept resident, and the
//! device's buffers and the host store must fit the host together.
//!
//! The disk tier (a folder on a local SSD, [`MachineMemory::disk`]): the Adam moments of chosen
//! units can live in a file there, read before and written after each unit's update, so that
//! a model whose state exceeds host memory still trains. [`MomentsPolicy`] says where moments
//! may go: with `auto` a candidate that does not fit host memory gets the fewest units that
//! make it fit (the last layers first: the next forward needs their updates last, and layers
//! are smaller than the embedding and head, which keeps the host's staging small; then the
//! head, then the embedding), never one more; `host` never uses the disk, `disk` puts every
//! unit there. The disk tier is a fourth tier of the budget, and the disk's reads and writes
//! pace the optimizer in the event model ([`timing`]).
//!
//! Several GPUs of one host (data parallelism, [`parallel`]): each GPU runs the same schedule on
//! its share of the micro-batches, planned as one GPU with that share; their PCIe links share
//! the host's memory bandwidth, and the gradients' all-reduce adds to each step. The plan then
//! carries the predicted speed-up over one GPU.

pub mod budget;
mod parallel;
pub mod rates;
mod report;
pub mod sizes;
pub mod timing;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

pub use crate::placement::{CheckpointTier, GradientTier, WeightSource};
pub use budget::{Budget, Part, Tier, TierName};
pub use parallel::{ALLREDUCE_BUS_BYTES, Parallel};
pub use rates::{DiskSpace, GpuQuery, H200_GPU_BYTES, MachineMemory, MachineRates, MemorySource};
pub use sizes::BatchShape;

use crate::error::{Error, Result};
use crate::placement::RING_SLOTS;
use crate::spec::ModelSpec;
use budget::Layout;
use sizes::Sizes;
use timing::StepCost;

/// Whether a schedule with `caps` can run gradient tier `tier`.
fn gradient_supported(tier: GradientTier, caps: &Capabilities) -> bool {
    match tier {
        GradientTier::DeviceStore => caps.device_gradient_store,
        GradientTier::HostStore => true,
        GradientTier::HostStoreBf16 => caps.bf16_gradient_store,
        GradientTier::HostRing => caps.gradient_ring,
    }
}

/// When the CPU AdamW runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerMode {
    /// After the global norm is known, unit by unit in forward order, overlapped with the next
    /// step's forward (each unit's update must finish before the forward needs it).
    AfterNorm,
    /// As each unit's gradients land, overlapped with the rest of the backward.
    AsGradientsLand,
}

/// What a step spends most of its time on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bottleneck {
    Pcie,
    GpuCompute,
    CpuAdam,
    /// The disk tier's reads and writes of Adam moments.
    Disk,
}

/// The problem: a model, a batch shape, clipping, a machine, and what the schedule that will
/// run the plan implements.
#[derive(Debug, Clone)]
pub struct PlanInput<'a> {
    pub spec: &'a ModelSpec,
    pub batch: BatchShape,
    /// Whether global-norm gradient clipping is on (gradients then wait for the norm).
    pub clipping: bool,
    pub memory: MachineMemory,
    pub rates: MachineRates,
    pub supports: Capabilities,
    /// GPUs of this host the job's micro-batches are shared among (data parallelism); the
    /// memory figures are each GPU's.
    pub gpus: usize,
}

/// The placements a schedule can execute. The planner offers only those, so a plan never asks
/// for a layout the trainer would have to approximate (and whose memory it would then not
/// match): `schedule::from_plan::STREAMER` says what the streamer implements today.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Capabilities {
    /// Largest checkpoint interval K (1: every layer's input is kept).
    pub max_checkpoint_interval: usize,
    /// With clipping on, gradients can wait on the device for the global norm
    /// ([`GradientTier::DeviceStore`]); otherwise they wait in the host store.
    pub device_gradient_store: bool,
    /// With clipping off, gradients land in a small ring ([`GradientTier::HostRing`]);
    /// otherwise in a full host store.
    pub gradient_ring: bool,
    /// With clipping on, gradients can wait on the host in bf16
    /// ([`GradientTier::HostStoreBf16`]) where no fp32 store fits.
    pub bf16_gradient_store: bool,
    /// Weights can stream from the fp32 master ([`WeightSource::Master`]); otherwise from a
    /// streaming copy.
    pub master_streaming: bool,
    /// The one gradient tier to offer, where the user chose it (it must suit the clipping);
    /// `None`: the most exact that fits.
    pub only_gradients: Option<GradientTier>,
    /// Units' Adam moments can live on the disk tier ([`MachineMemory::disk`]).
    pub disk_moments: bool,
    /// Where the user wants the Adam moments.
    pub moments: MomentsPolicy,
    /// Dense layers' activations can stay on the device from the forward to the backward,
    /// sparing their recompute, where device memory is left over.
    pub keep_activations: bool,
}

/// Where Adam moments live: the user's choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MomentsPolicy {
    /// In host memory, and on the disk tier for as few units as host memory needs.
    #[default]
    Auto,
    /// In host memory only.
    Host,
    /// Every unit's on the disk tier.
    Disk,
}

impl MomentsPolicy {
    /// Every policy, as written on the command line and in JSON.
    pub const NAMES: [&'static str; 3] = ["auto", "host", "disk"];
    const ALL: [MomentsPolicy; 3] = [MomentsPolicy::Auto, MomentsPolicy::Host, MomentsPolicy::Disk];
}

impl fmt::Display for MomentsPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = Self::ALL.iter().position(|p| p == self).unwrap_or(0);
        f.write_str(Self::NAMES[i])
    }
}

impl FromStr for MomentsPolicy {
    type Err = Error;

    fn from_str(s: &str) -> Result<MomentsPolicy> {
        match Self::NAMES.iter().position(|n| *n == s) {
            Some(i) => Ok(Self::ALL[i]),
            None => Err(Error::invalid(format!(
                "moments {s:?}: expected one of {}",
                Self::NAMES.join(", ")
            ))),
        }
    }
}

impl Capabilities {
    /// Every placement the planner models.
    pub const ALL: Capabilities = Capabilities {
        max_checkpoint_interval: usize::MAX,
        device_gradient_store: true,
        gradient_ring: true,
        bf16_gradient_store: true,
        master_streaming: true,
        only_gradients: None,
        disk_moments: true,
        moments: MomentsPolicy::Auto,
        keep_activations: true,
    };
}

/// The model as the plan describes it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelSummary {
    pub family: String,
    pub params: u64,
    /// Parameters a token computes with: `params` for a dense model, the routed experts only
    /// for a mixture (the `6 x params x tokens` figures use these).
    pub active_params: u64,
    pub layers: usize,
    pub hidden: usize,
    pub vocab: usize,
    pub tied_embeddings: bool,
    /// Units in streaming order: embedding, layers, head.
    pub units: usize,
}

/// Where things live.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Placement {
    /// Unit indices (0 = embedding, 1..=L the layers, L+1 the head) whose bf16 weights stay on
    /// the device; they cross PCIe once per step (the updated copy) instead of per visit.
    pub resident_units: Vec<usize>,
    /// The same, readable: "embedding, layers 0-27".
    pub resident_summary: String,
    pub streamed_units: usize,
    pub checkpoints: CheckpointTier,
    /// K: one checkpoint every K layers (K - 1 layers recomputed from it in a separate pass).
    pub checkpoint_interval: usize,
    pub gradients: GradientTier,
    /// Why the gradients wait in the host store where a device store was offered, in a clause
    /// ("the device store would fit, but ..."); empty otherwise.
    pub gradients_reason: String,
    /// Slots of the host gradient ring (device store and host ring), each the largest unit's
    /// fp32 gradients: [`RING_SLOTS`], or 2 where host memory is short.
    pub ring_slots: usize,
    /// Decoder layers (0-based) whose activations stay on the device from the forward to the
    /// backward, so their backward skips the recompute: as many as the device's spare memory
    /// holds.
    pub kept_layers: Vec<usize>,
    /// Decoder layers (0-based, none of `kept_layers`) whose attention output and log-sum-exp
    /// stay on the device, so their recompute skips the attention: where that spares more
    /// time per byte than whole kept layers (long rows).
    pub kept_attention_layers: Vec<usize>,
    /// What the weights stream from: the fp32 master (less host memory) unless PCIe bounds
    /// the step, where a half-size copy is faster.
    pub weights: WeightSource,
    /// Why, in a clause: "PCIe bounds the step: ...".
    pub weights_reason: String,
    pub optimizer: OptimizerMode,
    /// Units whose Adam moments live on the disk tier (empty: every unit's are in host
    /// memory), read before and written after each update.
    pub disk_units: Vec<usize>,
    /// The same, readable: "layers 12-27".
    pub disk_summary: String,
    /// Why they are there, in a clause ("host memory is 20.31 GiB short without it"); empty
    /// when no unit's are.
    pub disk_reason: String,
}

/// Predicted cost of one steady-state step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepTime {
    /// Seconds per optimizer step.
    pub total_s: f64,
    /// GPU busy time: the layers' GEMMs (forward, recompute, backward), the LM head, attention
    /// and the elementwise kernels.
    pub compute_s: f64,
    pub gemm_s: f64,
    pub head_s: f64,
    pub attention_s: f64,
    pub elementwise_s: f64,
    /// FLOPs per step: GEMMs (the LM head's too) and attention.
    pub flops: f64,
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    /// Seconds the host-to-device and device-to-host copy engines are busy (they run
    /// concurrently with each other and with compute).
    pub h2d_s: f64,
    pub d2h_s: f64,
    /// CPU AdamW seconds per step, how much of it overlaps GPU work and how much the step
    /// waits for (the step's time with the optimizer minus without it).
    pub adam_s: f64,
    pub adam_hidden_s: f64,
    pub adam_exposed_s: f64,
    /// Seconds per step the disk tier is busy reading and writing Adam moments (they pace
    /// the optimizer: [`timing`]), and the bytes it moves both ways; 0 without disk units.
    pub disk_s: f64,
    pub disk_bytes: u64,
    /// Step time the GPU does not compute.
    pub gpu_idle_s: f64,
    /// The busiest resource.
    pub bottleneck: Bottleneck,
    pub tokens_per_s: f64,
    /// `6 x params x tokens / step time`, the figure peers report.
    pub model_tflops: f64,
}

/// A configuration that fits, with its budget and predicted step time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    pub model: ModelSummary,
    pub batch: BatchShape,
    pub tokens_per_step: u64,
    pub clipping: bool,
    pub memory: MachineMemory,
    pub rates: MachineRates,
    pub placement: Placement,
    pub budget: Budget,
    /// Several GPUs: the whole step's time and tokens; PCIe and GPU figures are one GPU's.
    pub time: StepTime,
    /// Several GPUs: how the step is shared and what they gain over one.
    pub parallel: Option<Parallel>,
    /// The job's task evaluation between steps, where it has one (the job adds it:
    /// `train::Job::eval_plan`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval: Option<EvalPlan>,
}

/// A predicted task evaluation (`eval::timing::predict`): its forwards and where their time
/// goes. Defined here, below the evaluation layer, so a plan can carry it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EvalTime {
    pub forwards: usize,
    /// Tokens run through the layers (prompts, continuations and generated tokens).
    pub tokens: usize,
    /// Logit rows read back: one per answer token picked, one per continuation token scored.
    #[serde(default)]
    pub rows: usize,
    pub seconds: f64,
    /// The layers' uploads when the weights stream from host memory (once per forward).
    pub upload_s: f64,
    /// The layers' and head's GEMMs and attention.
    pub compute_s: f64,
    /// The per-sequence work of each layer (a decode's small kernels), the logits' download,
    /// and for scoring each scored row's log-softmax on the host.
    pub overhead_s: f64,
}

/// A task evaluation's cost beside the steps: the device memory the placement left it and its
/// predicted time, at most, each time and over the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EvalPlan {
    /// Device bytes kept free of the training's buffers for it.
    pub device_reserve: u64,
    /// Records, sequences at once, and the longest prompt and answer assumed.
    pub records: usize,
    pub sequences: usize,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    /// One evaluation, every answer running to `new_tokens`, the layers streamed from the
    /// host store.
    pub each: EvalTime,
    /// Evaluations over the run (the base model, every `eval_every` steps, the last step);
    /// `None` when the steps are not known before the data is read.
    pub evaluations: Option<u64>,
}

/// Which memory overflowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Memory {
    Device,
    /// Host RAM: pinned and pageable together.
    Host,
    /// The disk tier: the Adam moments host memory cannot hold.
    Disk,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Overflow {
    pub memory: Memory,
    pub needed: u64,
    pub capacity: u64,
    pub over_by: u64,
}

impl Overflow {
    fn of(memory: Memory, needed: u64, capacity: u64) -> Overflow {
        Overflow { memory, needed, capacity, over_by: needed.saturating_sub(capacity) }
    }
}

/// A change that would make the job fit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Suggestion {
    /// The largest micro-batch that fits with the other settings unchanged.
    MicroBatch(usize),
    /// The largest number of micro-batches per step that fits.
    GradAccum(usize),
    /// Host RAM the job needs as asked.
    HostMemory(u64),
    /// GPU memory the job needs as asked (with nothing resident).
    GpuMemory(u64),
    /// Disk tier space the job needs as asked.
    DiskSpace(u64),
}

/// Why a job does not fit, and what would.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Refusal {
    /// One sentence naming the tier that overflows and by how much.
    pub reason: String,
    pub overflows: Vec<Overflow>,
    /// The budget of the placement that came closest.
    pub budget: Budget,
    pub fits: Vec<Suggestion>,
    pub model: ModelSummary,
    pub batch: BatchShape,
    pub memory: MachineMemory,
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Verdict {
    Fits(Box<Plan>),
    Refused(Box<Refusal>),
}

impl Verdict {
    /// The plan, or the refusal as an error (for the trainer, before it allocates anything).
    pub fn into_plan(self) -> Result<Plan> {
        match self {
            Verdict::Fits(plan) => Ok(*plan),
            Verdict::Refused(r) => Err(Error::invalid(format!("the job does not fit: {r}"))),
        }
    }
}

/// Plans a job. Errors only for invalid input (zero sizes, a sequence longer than the model's
/// positions, non-positive rates); a job that does not fit is [`Verdict::Refused`].
pub fn plan(input: &PlanInput<'_>) -> Result<Verdict> {
    match input.gpus {
        0 => Err(Error::invalid("a plan needs at least one GPU")),
        1 => plan_one(input),
        _ => parallel::plan(input),
    }
}

/// One gradient policy a job could run with, and what it would cost there.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GradientOption {
    pub gradients: GradientTier,
    /// Whether global-norm clipping is on with this policy.
    pub clipping: bool,
    /// What the policy does to the results ([`GradientTier::effect`]).
    pub effect: &'static str,
    pub fits: bool,
    /// Host, device and disk tier bytes of the best placement with this policy (of the
    /// closest one where it does not fit).
    pub host_bytes: u64,
    pub device_bytes: u64,
    pub disk_bytes: u64,
    /// Host bytes per parameter.
    pub host_bytes_per_param: f64,
    /// Predicted seconds per step where it fits.
    pub step_s: Option<f64>,
    /// Why it does not fit.
    pub refused: Option<String>,
}

/// The job of `input` planned with each gradient policy the schedule runs, most exact first,
/// whatever clipping and tier `input` asks for: what the choice between them costs.
pub fn gradient_options(input: &PlanInput<'_>) -> Result<Vec<GradientOption>> {
    let mut out = Vec::new();
    for tier in GradientTier::ALL.into_iter().filter(|&t| gradient_supported(t, &input.supports)) {
        let one = PlanInput {
            clipping: tier.clips(),
            supports: Capabilities { only_gradients: Some(tier), ..input.supports },
            ..input.clone()
        };
        let (fits, budget, params, step_s, refused) = match plan(&one)? {
            Verdict::Fits(p) => (true, p.budget, p.model.params, Some(p.time.total_s), None),
            Verdict::Refused(r) => (false, r.budget, r.model.params, None, Some(r.reason)),
        };
        out.push(GradientOption {
            gradients: tier,
            clipping: tier.clips(),
            effect: tier.effect(),
            fits,
            host_bytes: budget.host_used(),
            device_bytes: budget.device.used,
            disk_bytes: budget.disk_used(),
            host_bytes_per_param: budget.host_used() as f64 / params.max(1) as f64,
            step_s,
            refused,
        });
    }
    Ok(out)
}

/// Whether a disk tier would change the verdict on this job, before one is measured (which
/// takes seconds of I/O): where the moments are asked on the disk; with `auto`, where the job
/// or one of its gradient options is refused without a disk tier and fits with one of any
/// size. Any disk tier `input.memory` has is ignored.
pub fn wants_disk(input: &PlanInput<'_>) -> Result<bool> {
    if !input.supports.disk_moments {
        return Ok(false);
    }
    match input.supports.moments {
        MomentsPolicy::Host => Ok(false),
        MomentsPolicy::Disk => Ok(true),
        MomentsPolicy::Auto => {
            let without = PlanInput {
                memory: MachineMemory { disk: None, ..input.memory.clone() },
                ..input.clone()
            };
            let unlimited = DiskSpace {
                dir: std::path::PathBuf::new(),
                bytes: 1 << 60,
                read_bytes_per_s: 1 << 30,
                write_bytes_per_s: 1 << 30,
                source: MemorySource::Given,
            };
            let with = PlanInput {
                memory: MachineMemory { disk: Some(unlimited), ..input.memory.clone() },
                ..input.clone()
            };
            let fits = |v: Verdict| matches!(v, Verdict::Fits(_));
            if fits(plan(&without)?) != fits(plan(&with)?) {
                return Ok(true);
            }
            let options = |i: &PlanInput<'_>| -> Result<Vec<bool>> {
                Ok(gradient_options(i)?.iter().map(|o| o.fits).collect())
            };
            Ok(options(&without)? != options(&with)?)
        }
    }
}

/// Refuses a moments policy the machine or the schedule cannot follow, and a disk tier whose
/// rates are not positive.
fn validate_disk(input: &PlanInput<'_>) -> Result<()> {
    if input.supports.moments == MomentsPolicy::Disk {
        if !input.supports.disk_moments {
            return Err(Error::invalid(
                "moments is disk, but this schedule cannot keep Adam moments on a disk tier",
            ));
        }
        if input.memory.disk.is_none() {
            return Err(Error::invalid(
                "moments is disk, but this machine has no disk tier (a folder on a local SSD \
                 for the Adam moments)",
            ));
        }
    }
    if let Some(d) = &input.memory.disk
        && (d.read_bytes_per_s == 0 || d.write_bytes_per_s == 0)
    {
        return Err(Error::invalid(format!(
            "the disk tier at {} must read and write at more than 0 bytes/s, got {} and {}",
            d.dir.display(),
            d.read_bytes_per_s,
            d.write_bytes_per_s
        )));
    }
    Ok(())
}

/// Plans a job on one GPU.
fn plan_one(input: &PlanInput<'_>) -> Result<Verdict> {
    input.batch.validate(input.spec)?;
    input.rates.validate()?;
    validate_disk(input)?;
    let sizes = Sizes::new(input.spec, input.batch);
    let model = ModelSummary {
        family: input.spec.family.model_type().to_string(),
        params: sizes.params,
        active_params: input.spec.active_params() as u64,
        layers: sizes.layers,
        hidden: input.spec.hidden,
        vocab: input.spec.vocab,
        tied_embeddings: sizes.tied,
        units: sizes.units.len(),
    };
    match search(&sizes, input) {
        Some((best, other)) => {
            let mut placement = placement(&sizes, &best.layout, input.clipping);
            placement.weights_reason =
                weights_reason(&best.layout, best.cost.step, other.source_s, input);
            placement.gradients_reason =
                gradients_reason(&best.layout, best.cost.step, other.device_store_s, input);
            placement.disk_reason = disk_reason(&sizes, &best.layout, input);
            let time = step_time(&sizes, &best, input);
            Ok(Verdict::Fits(Box::new(Plan {
                model,
                batch: input.batch,
                tokens_per_step: input.batch.step_tokens(),
                clipping: input.clipping,
                memory: input.memory.clone(),
                rates: input.rates,
                placement,
                budget: best.budget,
                time,
                parallel: None,
                eval: None,
            })))
        }
        None => Ok(Verdict::Refused(Box::new(refusal(&sizes, input, model)))),
    }
}

/// A candidate after residency was filled in.
struct Evaluated {
    layout: Layout,
    budget: Budget,
    rank: usize,
    cost: StepCost,
}

/// The candidate layouts (nothing resident yet), each with its preference rank (lower is
/// simpler): device checkpoints with K = 1, then host checkpoints, then growing K; gradients on
/// the device before the host; weights from the master before a copy (less host memory).
fn candidates(s: &Sizes, input: &PlanInput<'_>) -> Vec<(Layout, usize)> {
    let caps = input.supports;
    let max_k = ((s.layers as f64).sqrt().ceil() as usize).clamp(1, caps.max_checkpoint_interval);
    let mut ckpts = vec![(CheckpointTier::Device, 1, 0)];
    // Where the device is host memory, a host checkpoint would only be a second host copy.
    if !input.memory.shared() {
        ckpts.push((CheckpointTier::Host, 1, 1));
    }
    ckpts.extend((2..=max_k).map(|k| (CheckpointTier::Device, k, k)));
    // (tier, ring slots, rank): the ring keeps RING_SLOTS slots of the largest unit, or two
    // where host memory is short (updates then queue less far behind the landings).
    let grads: Vec<(GradientTier, usize, usize)> = match (input.clipping, caps) {
        (_, Capabilities { only_gradients: Some(GradientTier::HostRing), .. })
        | (false, Capabilities { only_gradients: None, gradient_ring: true, .. }) => {
            vec![(GradientTier::HostRing, RING_SLOTS, 0), (GradientTier::HostRing, 2, 1)]
        }
        (_, Capabilities { only_gradients: Some(tier), .. }) => vec![(tier, RING_SLOTS, 0)],
        (true, c) if c.device_gradient_store => {
            let mut tiers = vec![
                (GradientTier::DeviceStore, RING_SLOTS, 0),
                (GradientTier::HostStore, RING_SLOTS, 1),
            ];
            if c.bf16_gradient_store {
                tiers.push((GradientTier::HostStoreBf16, RING_SLOTS, 2));
            }
            tiers
        }
        // Without a ring, unclipped gradients land in the host store too. The event model then
        // times updates after the backward, not as gradients land: an upper bound on the step.
        _ => vec![(GradientTier::HostStore, RING_SLOTS, 0)],
    };
    // Streaming from the master saves host memory at the price of PCIe bytes: preferred
    // whenever it is as fast (PCIe has room), and the only source some jobs fit with.
    let sources: &[(WeightSource, usize)] = if caps.master_streaming {
        &[(WeightSource::Master, 0), (WeightSource::StreamingCopy, 1)]
    } else {
        &[(WeightSource::StreamingCopy, 0)]
    };
    let mut out = Vec::new();
    for &(checkpoints, interval, ck_rank) in &ckpts {
        for &(gradients, ring_slots, g_rank) in &grads {
            for &(weights, w_rank) in sources {
                let mut layout = Layout {
                    checkpoints,
                    interval,
                    gradients,
                    ring_slots,
                    weights,
                    resident: vec![false; s.units.len()],
                    disk: vec![false; s.units.len()],
                    kept: vec![false; s.units.len()],
                    kept_attention: vec![false; s.units.len()],
                };
                place_moments(s, &mut layout, input);
                // Within a weight source, a simpler checkpoint or gradient placement at the
                // same predicted speed is also the one whose prediction holds best (host
                // checkpoints with fp32 weights measured 10% slower than predicted at 7B);
                // `search` prefers the master over a copy before it looks at this rank.
                out.push((layout, 4 * ck_rank + 2 * g_rank + w_rank));
            }
        }
    }
    out
}

/// Whether host memory holds the layout (where the device is host memory, its buffers too).
fn host_fits(s: &Sizes, l: &Layout, memory: &MachineMemory) -> bool {
    let b = budget_for(s, l, memory);
    b.host_over() == 0 && !(memory.shared() && b.device_over() > 0)
}

/// Host bytes the layout needs beyond the host's (where the device is host memory, with the
/// device's buffers).
fn host_short(s: &Sizes, l: &Layout, memory: &MachineMemory) -> u64 {
    let b = budget_for(s, l, memory);
    b.host_over() + if memory.shared() { b.device_over() } else { 0 }
}

/// The order units' moments go to the disk tier under `auto`: the last layer first (under
/// either optimizer mode the next forward needs its update last), down to the first, then the
/// head and the embedding, larger than a layer (the host's staging holds the largest disk
/// unit three times).
fn disk_order(s: &Sizes) -> Vec<usize> {
    let head = s.head();
    (1..head).rev().chain([head, 0]).collect()
}

/// Puts units' Adam moments on the disk tier as the moments policy says: none without a disk
/// tier (or the schedule's support) or with `host`; every unit with `disk`; with `auto`, none
/// where host memory holds the layout, else the fewest in [`disk_order`] that make it fit, or,
/// where none do, the count that needs the least host memory (the closest to fitting).
fn place_moments(s: &Sizes, l: &mut Layout, input: &PlanInput<'_>) {
    let memory = &input.memory;
    if memory.disk.is_none() || !input.supports.disk_moments {
        return;
    }
    match input.supports.moments {
        MomentsPolicy::Host => {}
        MomentsPolicy::Disk => l.disk.iter_mut().for_each(|d| *d = true),
        MomentsPolicy::Auto => {
            if host_fits(s, l, memory) {
                return;
            }
            let order = disk_order(s);
            let mut least = (host_short(s, l, memory), 0);
            for (n, &u) in order.iter().enumerate() {
                l.disk[u] = true;
                let short = host_short(s, l, memory);
                if short == 0 {
                    return;
                }
                least = least.min((short, n + 1));
            }
            for (n, &u) in order.iter().enumerate() {
                l.disk[u] = n < least.1;
            }
        }
    }
}

/// Why the moments of the layout's disk units are there, in a clause for the plan's text.
fn disk_reason(s: &Sizes, l: &Layout, input: &PlanInput<'_>) -> String {
    if !l.disk.contains(&true) {
        return String::new();
    }
    match input.supports.moments {
        MomentsPolicy::Disk => "every unit's, as asked (moments: disk)".to_string(),
        _ => {
            let host_only = Layout { disk: vec![false; l.disk.len()], ..l.clone() };
            format!(
                "host memory is {} short without it",
                report::gib(host_short(s, &host_only, &input.memory))
            )
        }
    }
}

/// Keeps units resident, most-used first, while the device has room. A streamed unit crosses
/// PCIe once per visit, a resident one once per step, so the saving per byte is (visits - 1):
/// two for a tied embedding (its own two visits and the head's), one for layers and an untied
/// embedding (two with K > 1, whose recompute pass is a third visit), none for the head. Ties go
/// to the larger unit, whose residency also shrinks the streaming slots.
fn fill_resident(s: &Sizes, layout: &mut Layout, memory: &MachineMemory) {
    // Where the device is host memory, a resident unit is only a second copy in the same RAM.
    if memory.shared() {
        return;
    }
    let visits = |u: usize| -> usize {
        match u {
            0 if s.tied => 3,
            0 => 2,
            u if u == s.head() => 1,
            _ if layout.interval > 1 => 3,
            _ => 2,
        }
    };
    let mut order: Vec<usize> = (0..s.units.len()).collect();
    order.sort_by_key(|&u| {
        (std::cmp::Reverse(visits(u)), std::cmp::Reverse(s.units[u].params), std::cmp::Reverse(u))
    });
    for u in order {
        layout.resident[u] = true;
        if budget_for(s, layout, memory).device_over() > 0 {
            layout.resident[u] = false;
        }
    }
}

/// Spends the device memory a placement leaves on sparing recompute, last layers
/// first (the order does not change the time): whole layers' activations kept (no recompute),
/// or only their attention outputs (the recompute skips the attention, which at long context
/// is most of it, for a few percent of a whole layer's bytes). Every split between the two
/// that fits is timed and the fastest kept. Only with every layer's input checkpointed on the
/// device (a recompute group of K > 1 layers recomputes them all) and on a GPU; a mixture of
/// experts' layers keep only their attention (their routing buffers have no kept form).
fn fill_kept(s: &Sizes, layout: &mut Layout, input: &PlanInput<'_>) {
    if !input.supports.keep_activations
        || input.memory.shared()
        || layout.checkpoints != CheckpointTier::Device
        || layout.interval != 1
    {
        return;
    }
    let g = s.batch.grad_accum as u64;
    let free = budget_for(s, layout, &input.memory);
    let spare = input.memory.gpu_bytes.saturating_sub(free.device.used);
    // Sets are the same size whichever layer they are for: count how many fit at once.
    let (whole, attention) = (s.kept_layer * g, s.kept_attention * g);
    let most = spare.checked_div(whole).map_or(0, |n| n.min(s.layers as u64) as usize);
    let mut best: Option<(f64, Vec<bool>, Vec<bool>)> = None;
    for n in (0..=most).rev() {
        let mut l = layout.clone();
        let rest = spare - n as u64 * whole;
        let m = rest.checked_div(attention).map_or(0, |m| m as usize);
        for (i, u) in (1..=s.layers).rev().enumerate() {
            l.kept[u] = i < n;
            l.kept_attention[u] = i >= n && i < n + m;
        }
        // Rounding in the budget's parts: give back sets until it fits.
        while budget_for(s, &l, &input.memory).device_over() > 0 {
            if let Some(u) = l.kept_attention.iter().position(|&k| k) {
                l.kept_attention[u] = false;
            } else if let Some(u) = l.kept.iter().position(|&k| k) {
                l.kept[u] = false;
            } else {
                break;
            }
        }
        let step = timing::simulate(s, &l, &input.rates, input.memory.disk.as_ref(), 1.0).step;
        // Fewer whole layers only where faster (tried from the most down). An attention
        // output spares a forward attention, priced at the forward's own rate: one rate for
        // forward and backward together overpriced it by a fifth at rows of 1,024 tokens, put
        // 7 whole layers and 21 attention outputs ahead of 8 and 6, and the H200 ran them 1.7%
        // slower (6.510 s against 6.403 s a step, 2026-12-04).
        if best.as_ref().is_none_or(|(t, _, _)| step < *t) {
            best = Some((step, l.kept, l.kept_attention));
        }
    }
    if let Some((_, kept, kept_attention)) = best {
        layout.kept = kept;
        layout.kept_attention = kept_attention;
    }
}

/// The fastest fitting steps of what the chosen layout passed over, so the plan can say why it
/// chose (`None` where nothing of the kind fits).
struct PassedOver {
    /// The other weight source.
    source_s: Option<f64>,
    /// Gradients in the device store.
    device_store_s: Option<f64>,
}

/// The best fitting layout (`None` when none fits), with what it passed over.
fn search(s: &Sizes, input: &PlanInput<'_>) -> Option<(Evaluated, PassedOver)> {
    let mut fitting = Vec::new();
    for (mut layout, rank) in candidates(s, input) {
        fill_resident(s, &mut layout, &input.memory);
        if !budget_for(s, &layout, &input.memory).fits() {
            continue;
        }
        // Kept activations take only what the placement leaves of the device: they never push
        // gradients or weights elsewhere (the host's memory is the scarcer). They are filled in
        // before candidates are compared, because what a placement leaves differs: at 7B with
        // rows of 32,768 tokens, gradients waiting in the host store leave the H100 room for 26
        // layers' attention outputs instead of 17, 4.4% faster a step at the same exactness.
        fill_kept(s, &mut layout, input);
        let b = budget_for(s, &layout, &input.memory);
        let cost = timing::simulate(s, &layout, &input.rates, input.memory.disk.as_ref(), 1.0);
        fitting.push(Evaluated { layout, budget: b, rank, cost });
    }
    // The most exact gradients that fit: bf16 gradients only where no fp32 store does.
    if fitting.iter().any(|e| e.layout.gradients != GradientTier::HostStoreBf16) {
        fitting.retain(|e| e.layout.gradients != GradientTier::HostStoreBf16);
    }
    let at = choose(&fitting, |_| true)?;
    // The device store's time as the plan restricted to it would choose (`gradient_options`).
    let device_store_s = choose(&fitting, |l| l.gradients == GradientTier::DeviceStore)
        .map(|i| fitting[i].cost.step);
    let best = fitting.swap_remove(at);
    let source_s = fitting
        .iter()
        .filter(|e| e.layout.weights != best.layout.weights)
        .map(|e| e.cost.step)
        .reduce(f64::min);
    Some((best, PassedOver { source_s, device_store_s }))
}

/// The index of the layout chosen among the fitting ones that `keep` accepts: the fastest, and
/// among those within 1% of it the fewest units on the disk tier, then no bf16 copy on the
/// host (host memory is what bounds the models a machine trains: where PCIe has room, the
/// master streams itself), then the simplest.
fn choose(fitting: &[Evaluated], keep: impl Fn(&Layout) -> bool) -> Option<usize> {
    let eligible = || fitting.iter().enumerate().filter(|(_, e)| keep(&e.layout));
    let fastest = eligible().map(|(_, e)| e.cost.step).fold(f64::INFINITY, f64::min);
    let key = |e: &Evaluated| {
        (e.layout.disk_units().len(), e.layout.weights != WeightSource::Master, e.rank)
    };
    eligible()
        .filter(|(_, e)| e.cost.step <= fastest * 1.01)
        .min_by_key(|(_, e)| key(e))
        .map(|(i, _)| i)
}

/// Why the gradients wait in the host store rather than the device store, where that was a
/// choice (clipping on, both stores offered), in a clause for the plan's text.
fn gradients_reason(
    l: &Layout,
    chosen_s: f64,
    device_store_s: Option<f64>,
    input: &PlanInput<'_>,
) -> String {
    let offered = input.clipping
        && input.supports.only_gradients.is_none()
        && input.supports.device_gradient_store;
    if !offered || l.gradients != GradientTier::HostStore {
        return String::new();
    }
    match device_store_s {
        Some(device) => format!(
            "faster than the device store, whose 4 bytes per parameter on the device would \
             leave less room for kept activations: {chosen_s:.2} s a step against {device:.2} s"
        ),
        None => "an fp32 gradient store on the device would not fit beside the rest".to_string(),
    }
}

/// Why the weights stream from where they do, in a clause for the plan's text.
fn weights_reason(
    l: &Layout,
    chosen_s: f64,
    other_s: Option<f64>,
    input: &PlanInput<'_>,
) -> String {
    if !input.supports.master_streaming {
        return "the schedule was asked to stream from a copy".to_string();
    }
    let memory = &input.memory;
    match (l.weights, other_s) {
        (WeightSource::Master, _) if memory.shared() => {
            "the CPU computes on the fp32 master as it is".to_string()
        }
        (WeightSource::Master, Some(copy)) if copy < chosen_s * 0.9995 => format!(
            "PCIe has room for fp32: a bf16 copy would save only {:.1}% of the step for 2 more \
             host bytes per parameter",
            (chosen_s - copy) / chosen_s * 100.0
        ),
        (WeightSource::Master, Some(_)) => "PCIe has room for fp32: a bf16 copy would be no \
                                            faster and take 2 more host bytes per parameter"
            .to_string(),
        (WeightSource::Master, None) => {
            "a bf16 copy would not fit beside the rest of the training state".to_string()
        }
        (WeightSource::StreamingCopy, Some(master)) if master > chosen_s * 1.01 => format!(
            "PCIe bounds the step: streaming the fp32 master would take {master:.2} s per step \
             instead of {chosen_s:.2} s"
        ),
        (WeightSource::StreamingCopy, Some(master)) => format!(
            "streaming the fp32 master would be no faster ({master:.2} s per step) and needs a \
             more involved placement of checkpoints or gradients"
        ),
        (WeightSource::StreamingCopy, None) => {
            "the fp32 master's cast staging would not fit the device".to_string()
        }
    }
}

/// The budget of a layout on a machine. Where the device is host memory (the CPU backend), the
/// device's capacity is what the host parts leave of the host's.
fn budget_for(s: &Sizes, l: &Layout, memory: &MachineMemory) -> Budget {
    let host = memory.host_bytes;
    let disk = memory.disk.as_ref().map(|d| d.bytes);
    if !memory.shared() {
        return budget::budget(s, l, memory.gpu_bytes, host, disk);
    }
    // The CPU's loss works through smaller chunks than a GPU's.
    let s = &Sizes { head_workspace: s.head_workspace_host, attention_sums: 0, ..s.clone() };
    let gpu = host.saturating_sub(budget::budget(s, l, 0, host, disk).host_used());
    let mut b = budget::budget(s, l, gpu, host, disk);
    // No CUDA context or cuBLAS workspace to keep room for, and no cast: the CPU computes on
    // f32 weights and reads the master as it is.
    b.device.parts.retain(|p| p.name != budget::RUNTIME_RESERVE && p.name != budget::CAST_STAGING);
    b.device.used = b.device.parts.iter().map(|p| p.bytes).sum();
    b
}

/// The decoder layers (0-based) of the units marked in `units` (unit l + 1 is layer l).
fn decoder_layers(units: &[bool]) -> Vec<usize> {
    (1..units.len()).filter(|&u| units[u]).map(|u| u - 1).collect()
}

fn placement(s: &Sizes, l: &Layout, clipping: bool) -> Placement {
    let resident: Vec<usize> = (0..s.units.len()).filter(|&u| l.resident[u]).collect();
    let disk_units = l.disk_units();
    Placement {
        kept_layers: decoder_layers(&l.kept),
        kept_attention_layers: decoder_layers(&l.kept_attention),
        resident_summary: report::unit_ranges(s, &resident),
        streamed_units: s.units.len() - resident.len(),
        resident_units: resident,
        checkpoints: l.checkpoints,
        checkpoint_interval: l.interval,
        gradients: l.gradients,
        gradients_reason: String::new(),
        ring_slots: l.ring_slots,
        weights: l.weights,
        weights_reason: String::new(),
        optimizer: if clipping { OptimizerMode::AfterNorm } else { OptimizerMode::AsGradientsLand },
        disk_summary: if disk_units.is_empty() {
            String::new()
        } else {
            report::unit_ranges(s, &disk_units)
        },
        disk_units,
        disk_reason: String::new(),
    }
}

fn step_time(s: &Sizes, e: &Evaluated, input: &PlanInput<'_>) -> StepTime {
    let c = &e.cost;
    let disk = input.memory.disk.as_ref();
    let without_adam = timing::simulate(s, &e.layout, &input.rates, disk, 0.0).step;
    let exposed = (c.step - without_adam).clamp(0.0, c.adam);
    let compute = c.gemm + c.head + c.attention + c.elementwise;
    let pcie = c.h2d.max(c.d2h);
    let bottleneck = if c.disk > compute && c.disk > pcie && c.disk > c.adam {
        Bottleneck::Disk
    } else if pcie >= compute && pcie >= c.adam {
        Bottleneck::Pcie
    } else if c.adam > compute {
        Bottleneck::CpuAdam
    } else {
        Bottleneck::GpuCompute
    };
    let tokens = s.batch.step_tokens() as f64;
    StepTime {
        total_s: c.step,
        compute_s: compute,
        gemm_s: c.gemm,
        head_s: c.head,
        attention_s: c.attention,
        elementwise_s: c.elementwise,
        flops: c.gemm * input.rates.gemm_flops
            + c.head * input.rates.head_flops
            + c.attention_flops,
        h2d_bytes: c.h2d_bytes,
        d2h_bytes: c.d2h_bytes,
        h2d_s: c.h2d,
        d2h_s: c.d2h,
        adam_s: c.adam,
        adam_hidden_s: c.adam - exposed,
        adam_exposed_s: exposed,
        disk_s: c.disk,
        disk_bytes: c.disk_bytes,
        gpu_idle_s: (c.step - compute).max(0.0),
        bottleneck,
        tokens_per_s: tokens / c.step,
        model_tflops: 6.0 * s.active_params as f64 * tokens / c.step / 1e12,
    }
}

/// The leanest budgets when nothing fits: nothing resident, every candidate.
struct Leanest {
    /// The budget to show: the least host among candidates whose device fits, else the least
    /// device among those whose host fits, else the least total overflow.
    shown: Budget,
    /// Least device memory any candidate needs, and least host memory.
    device_min: u64,
    host_min: u64,
    /// Least disk tier space any candidate needs (0 where one keeps every moment in host
    /// memory).
    disk_min: u64,
    /// Host memory needed with a device that fits (the HostMemory suggestion), device memory
    /// needed with a host that fits, and disk tier space needed with both fitting.
    host_needed: u64,
    device_needed: u64,
    disk_needed: u64,
}

fn leanest(s: &Sizes, input: &PlanInput<'_>) -> Leanest {
    let budgets: Vec<Budget> =
        candidates(s, input).into_iter().map(|(l, _)| budget_for(s, &l, &input.memory)).collect();
    let device_min = budgets.iter().map(|b| b.device.used).min().unwrap_or(0);
    let host_min = budgets.iter().map(Budget::host_used).min().unwrap_or(0);
    let device_fits = budgets.iter().filter(|b| b.device_over() == 0).min_by_key(|b| b.host_used());
    let host_fits = budgets.iter().filter(|b| b.host_over() == 0).min_by_key(|b| b.device.used);
    let closest = budgets.iter().min_by_key(|b| b.device_over() + b.host_over() + b.disk_over());
    let disk_min = budgets.iter().map(Budget::disk_used).min().unwrap_or(0);
    let disk_needed = budgets
        .iter()
        .filter(|b| b.device_over() == 0 && b.host_over() == 0)
        .map(Budget::disk_used)
        .min()
        .unwrap_or(disk_min);
    // The candidate list always holds device checkpoints with K = 1.
    let shown = device_fits.or(host_fits).or(closest).cloned().unwrap_or_else(|| {
        let first = &candidates(s, input)[0].0;
        budget_for(s, first, &input.memory)
    });
    // Where the device is host memory, the host must hold both.
    let shared_needed = budgets.iter().map(|b| b.device.used + b.host_used()).min();
    Leanest {
        host_needed: match shared_needed {
            Some(both) if input.memory.shared() => both,
            _ => device_fits.map_or(host_min, Budget::host_used),
        },
        device_needed: host_fits.map_or(device_min, |b| b.device.used),
        disk_needed,
        shown,
        device_min,
        host_min,
        disk_min,
    }
}

fn refusal(s: &Sizes, input: &PlanInput<'_>, model: ModelSummary) -> Refusal {
    let lean = leanest(s, input);
    let (gpu, host) = (input.memory.gpu_bytes, input.memory.host_bytes);
    let disk = input.memory.disk.as_ref().map_or(0, |d| d.bytes);
    let mut overflows = Vec::new();
    // Where the host would hold the leanest placement and only the disk tier is short, the
    // disk is the reason (below), on the CPU too.
    if input.memory.shared() && lean.host_needed > host {
        // One memory holds everything: it is the reason.
        overflows.push(Overflow::of(Memory::Host, lean.host_needed, host));
    }
    // A memory is named only when no placement fits it: then it is the reason.
    if overflows.is_empty() && lean.device_min > gpu {
        overflows.push(Overflow::of(Memory::Device, lean.device_min, gpu));
    }
    if overflows.is_empty() && lean.host_min > host {
        overflows.push(Overflow::of(Memory::Host, lean.host_min, host));
    }
    if overflows.is_empty() && lean.disk_min > disk {
        overflows.push(Overflow::of(Memory::Disk, lean.disk_min, disk));
    }
    if overflows.is_empty() {
        // Each memory fits some placement, but no placement fits them all.
        let b = &lean.shown;
        // The budget's own overflows: on the CPU the device's capacity is what the host
        // parts leave, not the machine's figure.
        let (memory, needed, capacity, over_by) = if b.device_over() > 0 {
            (Memory::Device, b.device.used, gpu, b.device_over())
        } else if b.host_over() > 0 || b.disk_over() == 0 {
            (Memory::Host, b.host_used(), host, b.host_over())
        } else {
            (Memory::Disk, b.disk_used(), disk, b.disk_over())
        };
        overflows.push(Overflow { memory, needed, capacity, over_by });
    }
    let reason = overflows
        .iter()
        .map(|o| match o.memory {
            Memory::Device => format!(
                "device memory: needs {} of {} (over by {})",
                report::gib(o.needed),
                report::gib(o.capacity),
                report::gib(o.over_by)
            ),
            Memory::Host if input.memory.shared() => format!(
                "host memory (the CPU backend's buffers and the training state): needs {} of {} \
                 (over by {})",
                report::gib(o.needed),
                report::gib(o.capacity),
                report::gib(o.over_by)
            ),
            Memory::Host => format!(
                "host memory (pinned + pageable): needs {} of {} (over by {})",
                report::gib(o.needed),
                report::gib(o.capacity),
                report::gib(o.over_by)
            ),
            Memory::Disk => format!(
                "disk tier{} (the Adam moments host memory cannot hold): needs {} of {} (over \
                 by {})",
                input
                    .memory
                    .disk
                    .as_ref()
                    .map_or(String::new(), |d| format!(" at {}", d.dir.display())),
                report::gib(o.needed),
                report::gib(o.capacity),
                report::gib(o.over_by)
            ),
        })
        .collect::<Vec<_>>()
        .join("; ");
    Refusal {
        reason,
        fits: suggestions(input, &lean),
        overflows,
        budget: lean.shown.clone(),
        model,
        batch: input.batch,
        memory: input.memory.clone(),
    }
}

/// Whether a batch shape fits (any candidate).
fn fits_with(input: &PlanInput<'_>, batch: BatchShape) -> bool {
    let s = Sizes::new(input.spec, batch);
    candidates(&s, input).into_iter().any(|(l, _)| budget_for(&s, &l, &input.memory).fits())
}

/// The largest `n` in `1..limit` with `fits(n)`, assuming fitting is monotone (memory grows with
/// every batch dimension).
fn largest_fitting(limit: usize, fits: impl Fn(usize) -> bool) -> Option<usize> {
    let (mut lo, mut hi) = (0usize, limit);
    // Invariant: lo fits (or is 0), hi does not.
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) { lo = mid } else { hi = mid }
    }
    (lo > 0).then_some(lo)
}

fn suggestions(input: &PlanInput<'_>, lean: &Leanest) -> Vec<Suggestion> {
    let b = input.batch;
    let mut out = Vec::new();
    let micro =
        largest_fitting(b.micro_batch, |m| fits_with(input, BatchShape { micro_batch: m, ..b }));
    out.extend(micro.map(Suggestion::MicroBatch));
    let accum =
        largest_fitting(b.grad_accum, |g| fits_with(input, BatchShape { grad_accum: g, ..b }));
    out.extend(accum.map(Suggestion::GradAccum));
    if lean.host_needed > input.memory.host_bytes {
        out.push(Suggestion::HostMemory(lean.host_needed));
    }
    if lean.device_needed > input.memory.gpu_bytes && !input.memory.shared() {
        out.push(Suggestion::GpuMemory(lean.device_needed));
    }
    if let Some(d) = &input.memory.disk
        && lean.disk_needed > d.bytes
    {
        out.push(Suggestion::DiskSpace(lean.disk_needed));
    }
    out
}

#[cfg(test)]
mod tests;
