//! The streaming step, layer-major: each unit's weights visit the device once in the forward and
//! once in the backward of an optimizer step, whatever the number of micro-batches G, and every
//! other byte of state stays in the host store.
//!
//! ```text
//! forward   for unit u = 0..U-1: weights(u) -> slot; for b in 0..G: x[u+1][b] = f_u(x[u][b])
//! head      weights(head); for b: loss, dx[b], d_head += (f32)
//! backward  for layer l = L-1..0: weights(l) -> slot; for b: recompute f_l from x[l][b];
//!               dx[b] <- backprop(dx[b]); dW(l) += (f32 on the device)
//!           (checkpoint interval K > 1: only x[l] with l % K == 0 is kept; each group of K
//!           layers first recomputes its other inputs forward from that one)
//!           embedding: dW(0) += scatter(dx[b])
//!           gradients wait on the device or land on the host (`grads`, by gradient tier)
//! optimizer clipping on:  after the backward, once the global norm is known, AdamW for units
//!                         0, 1, 2, ... on the optimizer worker, overlapping the next forward
//!           clipping off: AdamW(u) as soon as grads(u) land, overlapping the rest of the backward
//! ```
//! Only this module creates streams and events. Transfers run on `h2d` and `d2h`, compute on
//! the backend's compute stream; events are named after what they guard. Weights of the next
//! unit are prefetched into the other half of a double buffer while the current unit computes,
//! and a unit still in a slot is not uploaded again. Nothing is allocated on the device inside
//! the step: every buffer is sized when the streamer is built.
//!
//! Host-side waits (each is commented where it happens): the sum of squares of each unit's
//! gradients (after the next unit's weights are queued), a gradient copy before its buffer is
//! reused, and an optimizer update before its unit's weights are uploaded. Timeline spans are
//! host times: when the schedule issued a unit's work and, where it waits, when that finished.

pub mod from_plan;
mod grads;
mod optimizer;
mod parallel;

use std::sync::Arc;
use std::time::{Duration, Instant};

pub use optimizer::{AdamJob, GradAt, OptimizerWorker};
pub use parallel::{CpuGroup, CpuPeer, DataParallel, split_micro};

use crate::backend::{AllReduce, Backend, FloatKind};
use crate::data::MicroBatch;
use crate::error::{Error, Result};
use crate::model::{
    Decoder, DeviceBatch, HeadGrads, HeadScratch, HeadWeights, HostParams, KeptAttention, LayerAt,
    LayerGrads, LayerScratch, ModelLayout, RouterStats,
};
use crate::optim::{AdamW, clip_coef};
pub use crate::placement::{CAST_CHUNK, CheckpointTier, GradientTier, RING_SLOTS, WeightSource};
use crate::spec::ModelSpec;
use crate::step::{Span, StepMetrics, TrainConfig};
use crate::store::{GradLanding, HostSlab, HostStore};
use grads::{GradPath, Grads};

/// Adam's first and second moments, one vector per unit.
pub type Moments = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// Fills unit `u`'s Adam moments `(m, v)` (a restore's source).
pub type FillMoments<'a> = dyn FnMut(usize, &mut [f32], &mut [f32]) -> Result<()> + 'a;

/// A check that says whether to abandon the current step (see [`Streamer::set_interrupt`]).
pub type Interrupt = Arc<dyn Fn() -> bool + Send + Sync>;

/// How the streamer is laid out: the planner's placement as the streamer runs it, made from a
/// plan by [`from_plan::schedule_options`] only, and recorded in a run's `run.json`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ScheduleOptions {
    /// Largest micro-batch in tokens.
    pub max_tokens: usize,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    pub checkpoints: CheckpointTier,
    /// Keep the input of every K-th layer only (K = 1: every layer); the backward recomputes the
    /// K - 1 inputs in between from it, once per group, into K - 1 device buffers.
    pub checkpoint_interval: usize,
    /// Threads of the optimizer worker's pool (0: one per core).
    pub optimizer_threads: usize,
    /// Units whose weights stay on the device: uploaded once per step (after their update)
    /// instead of once forward and once backward.
    pub resident: Vec<usize>,
    /// Where weight gradients wait for the optimizer; the host ring needs clipping off.
    pub gradients: GradientTier,
    /// What weights stream from: a streaming copy in the device's dtype, or the fp32 master
    /// (cast on the device through [`CAST_CHUNK`] elements of staging).
    pub weights: WeightSource,
    /// Slots of the host gradient ring (device store and host ring; at least 2): more let
    /// updates queue further behind the landings, each costs the largest unit's fp32 bytes.
    pub ring_slots: usize,
    /// Units whose Adam moments live on the disk tier, and where; `None`: all in host memory.
    pub disk: Option<DiskOptions>,
    /// Decoder layers whose activations stay on the device from the forward to the backward,
    /// one set per micro-batch, so their backward skips the recompute (dense layers, device
    /// checkpoints of every layer).
    pub kept: Vec<usize>,
    /// Decoder layers (other than `kept`) whose attention output and log-sum-exp stay on the
    /// device from the forward to the backward, one set per micro-batch, so their recompute
    /// skips the attention (any family; device checkpoints of every layer).
    pub kept_attention: Vec<usize>,
}

/// The disk tier of a run: the folder its moments file is created in (removed when the run
/// ends) and the units whose Adam moments live there.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DiskOptions {
    pub dir: std::path::PathBuf,
    pub units: Vec<usize>,
}

impl ScheduleOptions {
    /// The gradient tier that needs no spare device memory: the ring without clipping, the host
    /// store with it.
    pub fn host_gradients(clipping: bool) -> GradientTier {
        if clipping { GradientTier::HostStore } else { GradientTier::HostRing }
    }
}

/// A host wait for the optimizer: marks on the compute stream before and after it, and how
/// long the host blocked.
struct OptimizerWait<M> {
    before: M,
    after: M,
    host: Duration,
}

/// Transfer and timing figures of one step, beyond [`StepMetrics`]' basics.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepTraffic {
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    pub forward: Duration,
    pub backward: Duration,
    /// Time the optimizer worker spent on updates since the previous step.
    pub optimizer_busy: Duration,
    /// Part of that the device waited for: the compute stream's idle time while the host
    /// waited for the optimizer (updates, ring slots). A wait that the work queued before it
    /// covers costs nothing; on the CPU, whose ops run on the waiting thread, every wait counts.
    pub optimizer_exposed: Duration,
    /// The disk tier's reads and writes since the previous step, and the optimizer's waits
    /// for them.
    pub disk: crate::store::DiskStats,
}

/// Events ordering the three streams, named after what they guard.
struct Events<B: Backend> {
    /// Per slot (streaming and resident): the upload into slot i has finished, compute may
    /// read it.
    weights_ready: Vec<B::Event>,
    /// Per slot: compute has finished reading slot i, the next upload may overwrite it.
    slot_free: Vec<B::Event>,
    /// Checkpoint transfers (either direction) queued so far have finished.
    checkpoints_moved: B::Event,
    /// Host tier: the copies out of working set i have finished; compute may overwrite it.
    work_free: [B::Event; 2],
    /// Compute has produced the activations a checkpoint copy reads.
    activations_ready: B::Event,
}

/// What the ranks of a data-parallel group hold in common.
#[derive(Clone)]
struct Shared {
    layout: Arc<ModelLayout>,
    store: Arc<HostStore>,
    worker: Arc<OptimizerWorker>,
}

pub struct Streamer<'b, B: Backend> {
    b: &'b B,
    pub config: TrainConfig,
    options: ScheduleOptions,
    layout: Arc<ModelLayout>,
    decoder: Decoder<B>,
    store: Arc<HostStore>,
    worker: Arc<OptimizerWorker>,
    /// Data parallelism: this rank's link to the others, through which each unit's gradients
    /// are summed before they are measured and landed. `None`: a single device.
    peers: Option<Box<dyn AllReduce<B> + 'b>>,
    /// Optimizer steps submitted.
    pub step: u64,
    h2d: B::Stream,
    compute: B::Stream,
    d2h: B::Stream,
    events: Events<B>,
    /// Unit weights on the device: slots 0 and 1 are the streaming double buffer, slots from 2
    /// on hold resident units.
    slots: Vec<B::Floats>,
    /// Where the fp32 master lands before its cast, when weights stream from the master onto a
    /// device that computes in another dtype; used only on `h2d`.
    cast_staging: Option<B::Floats>,
    next_slot: usize,
    /// What each streaming slot holds (or is receiving): a unit and the optimizer step of its
    /// weights.
    slot_holds: [Option<(usize, u64)>; 2],
    /// Per unit: its resident slot, if any, and the step whose weights that slot holds.
    resident_slot: Vec<Option<usize>>,
    resident_step: Vec<Option<u64>>,
    /// The embedding table kept on the device for a tied LM head.
    tied_table: Option<B::Floats>,
    /// Weight-gradient accumulators and their landing on the host.
    grads: Grads<B>,
    /// The tied LM head's gradient, which joins the embedding's at the end of the backward.
    tied_grad: Option<B::Floats>,
    /// Device tier: `ckpt_device[l][b]` is the input of layer `l` (`l = layers`: of the head);
    /// empty for layers whose input is not kept.
    ckpt_device: Vec<Vec<B::Floats>>,
    /// Host tier: the same for layers below the head, in host slabs.
    ckpt_host: Vec<Vec<HostSlab>>,
    /// Layer inputs that are not kept (and, host tier, all of them) flow through these in the
    /// forward: layer l reads `work[l % 2]` and writes `work[(l + 1) % 2]`. The backward
    /// brings host checkpoints back into `work[0]`.
    work: [Vec<B::Floats>; 2],
    /// K > 1: `regen[j][b]` holds the recomputed input of layer `s + 1 + j` of the group that
    /// starts at layer `s`.
    regen: Vec<Vec<B::Floats>>,
    /// Activation gradients per micro-batch, flowing down the layers.
    dx: [Vec<B::Floats>; 2],
    /// A MoE model's router statistics, one `[2E]` per micro-batch (empty for dense models).
    router_stats: Vec<B::Floats>,
    /// The load-balancing loss's weight in this step's loss (`∂ loss / ∂ aux` of each
    /// micro-batch), and the step's share of the mean load-balancing loss so far.
    aux_weight: f32,
    aux_share: Option<f64>,
    layer_out: B::Floats,
    scratch: LayerScratch<B>,
    /// What each layer keeps of each micro-batch's forward for its backward.
    kept: KeptSets<B>,
    head: HeadScratch<B>,
    batches: Vec<DeviceBatch<B>>,
    traffic: StepTraffic,
    /// This step's host waits for the optimizer, for [`StepTraffic::optimizer_exposed`].
    waits: Vec<OptimizerWait<B::Mark>>,
    /// When the current step started, and what each unit did on each stream since.
    step_start: Instant,
    timeline: Vec<Span>,
    /// Asked between micro-batches on a synchronous backend; see [`Streamer::set_interrupt`].
    interrupt: Option<Interrupt>,
    /// Device bytes allocated at construction (nothing is allocated later).
    pub device_bytes: usize,
}

/// What a layer keeps of one micro-batch's forward for its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kept {
    /// Its whole forward state: no recompute.
    Layer,
    /// Its attention output and log-sum-exp: the recompute skips the attention.
    Attention,
    /// Nothing: the whole recompute.
    Nothing,
}

/// Per layer and micro-batch, what the forward leaves on the device for the backward:
/// `layers[l][mb]` a layer's whole forward state, `attention[l][mb]` its attention output
/// (each empty for the layers that keep none).
struct KeptSets<B: Backend> {
    layers: Vec<Vec<LayerScratch<B>>>,
    attention: Vec<Vec<KeptAttention<B>>>,
}

impl<B: Backend> KeptSets<B> {
    /// Exchanges `scratch`'s buffers with what layer `l` keeps for micro-batch `mb` and says
    /// what that is; its own inverse, so the forward moves the state into the set and the
    /// backward swaps it in and back out.
    fn swap(&mut self, scratch: &mut LayerScratch<B>, l: usize, mb: usize) -> Kept {
        if let Some(k) = self.layers[l].get_mut(mb) {
            scratch.swap_kept(k);
            Kept::Layer
        } else if let Some(a) = self.attention[l].get_mut(mb) {
            scratch.swap_attention(a);
            Kept::Attention
        } else {
            Kept::Nothing
        }
    }
}

/// Per decoder layer (`layers` of them), `g` sets made by `make` (one per micro-batch) for each
/// layer in `wanted`, none for the others; "no layer l to keep `what` of" for a layer beyond.
fn sets_per_layer<S>(
    layers: usize,
    wanted: &[usize],
    g: usize,
    what: &str,
    mut make: impl FnMut() -> Result<S>,
) -> Result<Vec<Vec<S>>> {
    let mut sets: Vec<Vec<S>> = (0..layers).map(|_| Vec::new()).collect();
    for &l in wanted {
        let set = sets
            .get_mut(l)
            .ok_or_else(|| Error::invalid(format!("no layer {l} to keep {what} of")))?;
        if set.is_empty() {
            for _ in 0..g {
                set.push(make()?);
            }
        }
    }
    Ok(sets)
}

impl<'b, B: Backend> Streamer<'b, B> {
    pub fn new(
        b: &'b B,
        spec: &ModelSpec,
        params: HostParams,
        config: TrainConfig,
        options: ScheduleOptions,
    ) -> Result<Self> {
        let layout = params.layout.clone();
        let (store, worker) = Self::shared_state(b, spec, params, &config, &options)?;
        let shared = Shared { layout, store, worker };
        Self::with_state(b, spec, shared, None, config, options)
    }

    /// The state every rank of a data-parallel group shares: the host store (its slabs pinned
    /// through `b`, which every device can reach: see `Backend::pin`) and the optimizer worker.
    fn shared_state(
        b: &B,
        spec: &ModelSpec,
        params: HostParams,
        config: &TrainConfig,
        options: &ScheduleOptions,
    ) -> Result<(Arc<HostStore>, Arc<OptimizerWorker>)> {
        if options.max_tokens == 0 || options.grad_accum == 0 {
            return Err(Error::invalid("a step needs at least one micro-batch of one token"));
        }
        if options.checkpoint_interval == 0 {
            return Err(Error::invalid("the checkpoint interval must be at least 1 layer"));
        }
        let layout = params.layout.clone();
        if *layout != ModelLayout::new(spec) {
            return Err(Error::invalid("parameters do not match the model spec's layout"));
        }
        if options.gradients == GradientTier::HostRing && config.max_grad_norm.is_some() {
            return Err(Error::invalid(
                "the gradient ring hands each unit to the optimizer as it lands, so it cannot \
                 wait for the global norm: with clipping on, keep gradients in the device or \
                 host store",
            ));
        }
        let landing = match options.gradients {
            GradientTier::HostStore => GradLanding::PerUnit,
            GradientTier::HostStoreBf16 => GradLanding::PerUnitHalf,
            GradientTier::DeviceStore | GradientTier::HostRing => {
                if options.ring_slots < 2 {
                    return Err(Error::invalid(format!(
                        "the gradient ring needs at least 2 slots (one landing while the other \
                         is updated), got {}",
                        options.ring_slots
                    )));
                }
                GradLanding::Ring(options.ring_slots)
            }
        };
        let copy = options.weights == WeightSource::StreamingCopy;
        let disk = options.disk.as_ref().map(|d| (d.dir.as_path(), d.units.as_slice()));
        let store = Arc::new(HostStore::new(
            params.units,
            params.layout.params(),
            b.weight_dtype(),
            landing,
            copy,
            disk,
        )?);
        for u in 0..store.units() {
            let mut unit = store.lock(u)?;
            if copy {
                b.pin(&mut unit.stream)?;
            } else {
                b.pin(&mut unit.master)?;
            }
            b.pin(&mut unit.grad)?;
        }
        for slab in store.ring().slabs() {
            let mut slab = slab.lock().map_err(|_| Error::invalid("gradient ring poisoned"))?;
            b.pin(&mut slab)?;
        }
        let hyper = AdamW {
            lr: config.lr,
            beta1: config.beta1,
            beta2: config.beta2,
            eps: config.eps,
            weight_decay: config.weight_decay,
        };
        hyper.validate()?;
        let worker =
            OptimizerWorker::spawn(store.clone(), layout, hyper, options.optimizer_threads)?;
        Ok((store, Arc::new(worker)))
    }

    /// A streamer on `b` over a store and optimizer worker it may share with other ranks;
    /// `peers` links it to them (rank 0 alone lands gradients and submits updates).
    fn with_state(
        b: &'b B,
        spec: &ModelSpec,
        shared: Shared,
        peers: Option<Box<dyn AllReduce<B> + 'b>>,
        config: TrainConfig,
        options: ScheduleOptions,
    ) -> Result<Self> {
        let Shared { layout, store, worker } = shared;
        let decoder = Decoder::new(b, spec, layout.layers.clone(), layout.head.clone())?;

        let largest = layout.units.iter().map(|u| u.len).max().unwrap_or(0);
        let (g, t, h) = (options.grad_accum, options.max_tokens, spec.hidden);
        let counted = std::cell::Cell::new(0usize);
        let act = |n: usize| {
            counted.set(counted.get() + n * b.elem_bytes(FloatKind::Activation));
            b.alloc(n, FloatKind::Activation)
        };
        let acc = |n: usize| {
            counted.set(counted.get() + n * b.elem_bytes(FloatKind::Accum));
            b.alloc(n, FloatKind::Accum)
        };
        let per_mb = |n: usize| (0..g).map(|_| act(n)).collect::<Result<Vec<_>>>();
        // Layer inputs kept between the forward and the backward: every K-th layer's, and on the
        // device the head's input too. The rest pass through the two working sets.
        let k = options.checkpoint_interval;
        let layers = spec.layers;
        let kept = |l: usize| l.is_multiple_of(k);
        let (ckpt_device, ckpt_host) = match options.checkpoints {
            CheckpointTier::Device => {
                let c = (0..=layers)
                    .map(|l| if kept(l) || l == layers { per_mb(t * h) } else { Ok(Vec::new()) })
                    .collect::<Result<Vec<_>>>()?;
                (c, Vec::new())
            }
            CheckpointTier::Host => {
                let bytes = t * h * b.elem_bytes(FloatKind::Activation);
                let mut host = Vec::with_capacity(layers);
                for l in 0..layers {
                    let mut row = Vec::new();
                    for _ in 0..if kept(l) { g } else { 0 } {
                        let mut slab = HostSlab::zeroed(bytes)?;
                        b.pin(&mut slab)?;
                        row.push(slab);
                    }
                    host.push(row);
                }
                (Vec::new(), host)
            }
        };
        let work = if options.checkpoints == CheckpointTier::Host || k > 1 {
            [per_mb(t * h)?, per_mb(t * h)?]
        } else {
            [Vec::new(), Vec::new()]
        };
        let regen = (1..k.min(layers.max(1))).map(|_| per_mb(t * h)).collect::<Result<_>>()?;
        let tied = spec.tie_embeddings;
        let embed_len = layout.units[0].len;
        let units = layout.units.len();
        let mut slots = vec![act(largest)?, act(largest)?];
        let cast_staging = match options.weights {
            WeightSource::Master if b.weight_dtype() != crate::backend::WeightDtype::F32 => {
                Some(acc(largest.min(CAST_CHUNK))?)
            }
            _ => None,
        };
        let mut resident_slot = vec![None; units];
        for &u in &options.resident {
            let unit = layout
                .units
                .get(u)
                .ok_or_else(|| Error::invalid(format!("no unit {u} to keep resident")))?;
            if resident_slot[u].is_none() {
                resident_slot[u] = Some(slots.len());
                slots.push(act(unit.len)?);
            }
        }
        let slot_count = slots.len();
        let lens = layout.units.iter().map(|u| u.len).collect();
        let lands = peers.as_ref().is_none_or(|p| p.rank() == 0);
        let (grads, grad_bytes) =
            Grads::new(b, options.gradients, options.ring_slots, lens, lands)?;
        counted.set(counted.get() + grad_bytes);
        let scratch = LayerScratch::new(b, spec, t)?;
        let head = HeadScratch::new(b, spec, t)?;
        let keeps = !options.kept.is_empty() || !options.kept_attention.is_empty();
        if keeps && (k != 1 || options.checkpoints != CheckpointTier::Device) {
            return Err(Error::invalid(
                "kept activations need every layer's input checkpointed on the device",
            ));
        }
        if let Some(l) = options.kept_attention.iter().find(|l| options.kept.contains(l)) {
            return Err(Error::invalid(format!(
                "layer {l} keeps all its activations: its attention output is not kept twice"
            )));
        }
        let kept_sets = sets_per_layer(layers, &options.kept, g, "activations", || {
            let s = LayerScratch::for_kept(b, spec, t)?;
            counted.set(counted.get() + s.bytes);
            Ok(s)
        })?;
        let attention_sets =
            sets_per_layer(layers, &options.kept_attention, g, "the attention output", || {
                let s = KeptAttention::new(b, spec, t)?;
                counted.set(counted.get() + s.bytes);
                Ok(s)
            })?;
        // Token ids, positions, targets and document bounds: four i32 arrays per micro-batch.
        let batch_bytes = g * (4 * t + 1) * 4;
        let mut streamer = Streamer {
            b,
            config,
            options,
            decoder,
            store,
            worker,
            peers,
            step: 0,
            h2d: b.new_stream()?,
            compute: b.compute_stream(),
            d2h: b.new_stream()?,
            events: Events {
                weights_ready: (0..slot_count).map(|_| b.new_event()).collect::<Result<_>>()?,
                slot_free: (0..slot_count).map(|_| b.new_event()).collect::<Result<_>>()?,
                checkpoints_moved: b.new_event()?,
                work_free: [b.new_event()?, b.new_event()?],
                activations_ready: b.new_event()?,
            },
            slots,
            cast_staging,
            next_slot: 0,
            slot_holds: [None, None],
            resident_slot,
            resident_step: vec![None; units],
            tied_table: if tied { Some(act(embed_len)?) } else { None },
            grads,
            tied_grad: if tied { Some(acc(embed_len)?) } else { None },
            ckpt_device,
            ckpt_host,
            work,
            regen,
            dx: [per_mb(t * h)?, per_mb(t * h)?],
            router_stats: match &spec.moe {
                Some(m) => (0..g).map(|_| acc(2 * m.experts)).collect::<Result<_>>()?,
                None => Vec::new(),
            },
            aux_weight: 0.0,
            aux_share: None,
            layer_out: act(t * h)?,
            device_bytes: 0,
            scratch,
            kept: KeptSets { layers: kept_sets, attention: attention_sets },
            head,
            batches: (0..g).map(|_| DeviceBatch::new(b, t)).collect::<Result<_>>()?,
            traffic: StepTraffic::default(),
            waits: Vec::new(),
            step_start: Instant::now(),
            interrupt: None,
            timeline: Vec::new(),
            layout,
        };
        streamer.device_bytes =
            counted.get() + streamer.scratch.bytes + streamer.head.bytes + batch_bytes;
        Ok(streamer)
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.decoder.spec
    }

    /// The host store (master weights, moments): read it only between steps.
    pub fn store(&self) -> &Arc<HostStore> {
        &self.store
    }

    /// The learning rate the next step will use.
    pub fn next_lr(&self) -> f32 {
        self.config.lr_at(self.step)
    }

    /// Makes unit `u`'s current weights available to compute and returns their slot: a
    /// resident unit is uploaded only once per step, a streamed one is found in a slot (still
    /// there, or prefetched) or uploaded into the next one. Compute waits for the upload.
    fn load_unit(&mut self, u: usize) -> Result<usize> {
        self.prefetch(u)?;
        let slot = match self.resident_slot[u] {
            Some(slot) => slot,
            None => {
                let held = self.slot_holds.iter().position(|h| *h == Some((u, self.step)));
                let slot = held.ok_or_else(|| {
                    Error::invalid(format!("unit {u} is in no weight slot after its upload"))
                })?;
                // The next upload goes to the other slot, never over the one about to be read.
                self.next_slot = 1 - slot;
                slot
            }
        };
        self.b.wait(&self.compute, &self.events.weights_ready[slot])?;
        Ok(slot)
    }

    /// Queues unit `u`'s upload of this step's weights, unless already queued, while the
    /// current unit computes, so its weights are there when compute needs them: into its own
    /// slot when resident, else into the free half of the double buffer.
    fn prefetch(&mut self, u: usize) -> Result<()> {
        let slot = match self.resident_slot[u] {
            Some(_) if self.resident_step[u] == Some(self.step) => return Ok(()),
            Some(slot) => slot,
            None if self.slot_holds.contains(&Some((u, self.step))) => return Ok(()),
            None => self.next_slot,
        };
        self.upload_unit(u, slot)
    }

    /// Queues the upload of unit `u`'s weights as of this step into `slot` (a streaming slot,
    /// or the unit's resident one), once compute has finished its reads of the slot's previous
    /// contents: for a resident slot, last step's, so the upload overlaps the layers before it.
    /// Waits (on the host) for the unit's pending update first.
    fn upload_unit(&mut self, u: usize, slot: usize) -> Result<()> {
        let b = self.b;
        self.wait_updated(u)?;
        b.wait(&self.h2d, &self.events.slot_free[slot])?;
        self.queue_weights(u, slot)?;
        b.record(&self.events.weights_ready[slot], &self.h2d)?;
        match self.resident_slot[u] {
            Some(_) => self.resident_step[u] = Some(self.step),
            None => self.slot_holds[slot] = Some((u, self.step)),
        }
        Ok(())
    }

    /// Queues the copy of unit `u`'s streaming weights into `slot` on `h2d` (the caller orders
    /// it with events on either side).
    fn queue_weights(&mut self, u: usize, slot: usize) -> Result<()> {
        let b = self.b;
        let len = self.layout.units[u].len;
        let started = Instant::now();
        {
            let unit = self.store.lock(u)?;
            let dst = b.view_mut(&mut self.slots[slot], 0..len);
            // SAFETY: the streaming copy and the master live in the store for the whole run and
            // the optimizer rewrites them only in unit `u`'s next update, which is submitted
            // after the backward has read this slot (compute waits for the upload's event
            // first, and the update only after the gradients computed from it have landed).
            // The slot and the staging are not freed while the streamer lives, only `h2d` uses
            // the staging, and `Drop` drains the streams.
            unsafe {
                match self.options.weights {
                    WeightSource::StreamingCopy => b.upload_on(&self.h2d, dst, &unit.stream, 0)?,
                    WeightSource::Master => {
                        let staging = self.cast_staging.as_mut();
                        b.upload_f32_on(&self.h2d, dst, &unit.master, 0, staging)?
                    }
                }
            }
        }
        self.span(u, "h2d", started);
        let bytes = match self.options.weights {
            WeightSource::StreamingCopy => b.weight_dtype().bytes(),
            WeightSource::Master => 4,
        };
        self.traffic.h2d_bytes += (len * bytes) as u64;
        Ok(())
    }

    /// Blocks until unit `u` has had every update submitted so far, first landing its
    /// gradients (device store) so that update can start.
    fn wait_updated(&mut self, u: usize) -> Result<()> {
        self.pump_grads(Some(u))?;
        self.optimizer_wait(|s| Ok(((), s.store.wait_applied(u, s.step)?)))
    }

    /// Runs `wait`, which returns what it yields and how long the host blocked on the
    /// optimizer, between two marks on the compute stream, so that the step reports the
    /// device's idle time across it rather than the host's wait ([`Streamer::exposed`]).
    fn optimizer_wait<T>(
        &mut self,
        wait: impl FnOnce(&mut Self) -> Result<(T, Duration)>,
    ) -> Result<T> {
        let before = self.b.mark(&self.compute)?;
        let (out, host) = wait(self)?;
        if !host.is_zero() {
            let after = self.b.mark(&self.compute)?;
            self.waits.push(OptimizerWait { before, after, host });
        }
        Ok(out)
    }

    /// The compute stream's idle time across this step's host waits for the optimizer, each
    /// at most the host's wait. A mark that cannot be read (timing is a diagnostic) counts the
    /// host's wait.
    fn exposed(&mut self) -> Duration {
        let b = self.b;
        self.waits
            .drain(..)
            .map(|w| match b.elapsed(&w.before, &w.after) {
                Ok(Some(idle)) => idle.min(w.host),
                Ok(None) | Err(_) => w.host,
            })
            .sum()
    }

    /// Marks the end of compute's use of `slot`: the slot's next upload waits for this mark.
    fn release_slot(&self, slot: usize) -> Result<()> {
        let event = self.events.slot_free.get(slot).ok_or_else(|| {
            Error::invalid(format!("no weight slot {slot} of {}", self.slots.len()))
        })?;
        self.b.record(event, &self.compute)
    }

    /// Unit `u`'s gradients are complete: see [`Grads::end`]. `early` carries the learning
    /// rate when the update should follow the gradients as soon as they land (clipping off).
    fn grads_done(&mut self, u: usize, early: Option<f32>) -> Result<()> {
        if let Some(peers) = &self.peers {
            // Every rank sums the same units in the same order, so the collectives pair up;
            // each rank then measures (and rank 0 lands) the sum over all micro-batches.
            let len = self.layout.units[u].len;
            peers.all_reduce_sum(self.b, self.b.view_mut(self.grads.acc(u), 0..len))?;
        }
        let job = early.map(|lr| AdamJob {
            unit: u,
            step: self.step + 1,
            lr,
            coef: 1.0,
            grad: GradAt::Unit,
        });
        self.land(|grads, path| grads.end(path, u, job))
    }

    /// Runs `f` on the gradient tiers with the path their copies and updates take.
    fn with_grads<T>(
        &mut self,
        f: impl FnOnce(&mut Grads<B>, &GradPath<'_, B>) -> Result<T>,
    ) -> Result<T> {
        let path = GradPath {
            b: self.b,
            store: &self.store,
            worker: &self.worker,
            compute: &self.compute,
            d2h: &self.d2h,
        };
        f(&mut self.grads, &path)
    }

    /// Device store: lands gradients still on the device up to unit `upto` (all with `None`)
    /// and hands their updates over; see [`Grads::pump`].
    fn pump_grads(&mut self, upto: Option<usize>) -> Result<()> {
        if !self.grads.has_waiting() {
            return Ok(());
        }
        self.land(|grads, path| grads.pump(path, upto))
    }

    /// Runs `f`, which ships gradients, on the gradient tiers as [`Streamer::with_grads`]:
    /// its waits for ring slots count as waits for the optimizer, its bytes as d2h traffic, and
    /// each unit it shipped gets a d2h span on the timeline.
    fn land(
        &mut self,
        f: impl FnOnce(&mut Grads<B>, &GradPath<'_, B>) -> Result<grads::Landed>,
    ) -> Result<()> {
        let started = Instant::now();
        let landed = self.optimizer_wait(|s| {
            let landed = s.with_grads(f)?;
            let waited = landed.waited;
            Ok((landed, waited))
        })?;
        self.traffic.d2h_bytes += landed.bytes;
        for &u in &landed.units {
            self.span(u, "d2h", started);
        }
        Ok(())
    }

    /// Host tier: queues the copy of a freshly computed layer input `x` (`n` elements) to its
    /// host checkpoint, after the compute that produced it. Returns the bytes moved.
    fn checkpoint_out(
        b: &B,
        compute: &B::Stream,
        d2h: &B::Stream,
        events: &Events<B>,
        dst: &mut HostSlab,
        x: &B::Floats,
        n: usize,
    ) -> Result<u64> {
        b.record(&events.activations_ready, compute)?;
        b.wait(d2h, &events.activations_ready)?;
        // SAFETY: the checkpoint slab lives as long as the streamer; the backward reads it only
        // after `h2d` waits for `checkpoints_moved`, recorded after this copy, and compute
        // overwrites `x` only after waiting for `work_free`, also recorded after it.
        unsafe { b.download_on(d2h, dst, 0, b.view(x, 0..n))? };
        Ok((n * b.elem_bytes(FloatKind::Activation)) as u64)
    }

    /// Copies the token data of up to G micro-batches to the device.
    fn upload_batches(&mut self, micro: &[MicroBatch]) -> Result<()> {
        if micro.len() > self.batches.len() {
            return Err(Error::invalid(format!(
                "{} micro-batches at once, the schedule holds {}",
                micro.len(),
                self.batches.len()
            )));
        }
        for (dev, mb) in self.batches.iter_mut().zip(micro) {
            if mb.ids.len() > self.options.max_tokens {
                return Err(Error::invalid(format!(
                    "micro-batch of {} tokens exceeds the {} the schedule was sized for",
                    mb.ids.len(),
                    self.options.max_tokens
                )));
            }
            dev.upload(self.b, &mb.ids, &mb.positions, &mb.targets, &mb.cu_seqlens)?;
        }
        Ok(())
    }

    /// Lets `check` abandon a step between micro-batches: the step then returns
    /// [`Error::Interrupted`] with nothing of it applied (no update, no step counted), and the
    /// streamer's weights, moments and step are as after the last finished step. Only a
    /// synchronous backend (the CPU) is interrupted; on others the check is ignored, since ops
    /// in flight would have to be waited for anyway and a GPU step takes seconds.
    pub fn set_interrupt(&mut self, check: Interrupt) {
        if self.b.synchronous() {
            self.interrupt = Some(check);
        }
    }

    /// `Err(Interrupted)` when the interrupt check asks to stop.
    fn check_interrupt(&self) -> Result<()> {
        match &self.interrupt {
            Some(check) if check() => Err(Error::Interrupted),
            _ => Ok(()),
        }
    }

    /// One optimizer step over the G micro-batches of `micro`.
    pub fn step(&mut self, micro: &[MicroBatch]) -> Result<(StepMetrics, StepTraffic)> {
        let trained: usize = micro.iter().map(MicroBatch::trained_tokens).sum();
        self.step_part(micro, trained, micro.len())
    }

    /// This rank's share `micro` of a step whose micro-batches, over every rank, train
    /// `trained` tokens: the loss and the gradients are scaled by `1 / trained`, so summing
    /// them over the ranks gives the step's mean. The reported loss is this share's part. A
    /// MoE model's load-balancing loss is the mean over the step's `micro_total` micro-batches,
    /// every rank's included; this share reports its part of that too.
    pub(crate) fn step_part(
        &mut self,
        micro: &[MicroBatch],
        trained: usize,
        micro_total: usize,
    ) -> Result<(StepMetrics, StepTraffic)> {
        let start = Instant::now();
        let g = micro.len();
        if g == 0 || g > self.options.grad_accum {
            return Err(Error::invalid(format!(
                "a step takes 1 to {} micro-batches, got {g}",
                self.options.grad_accum
            )));
        }
        if trained == 0 {
            return Err(Error::invalid(
                "no token in this step carries loss (all are prompt or padding)",
            ));
        }
        let tokens: usize = micro.iter().map(|m| m.ids.len()).sum();
        self.traffic = StepTraffic::default();
        self.waits.clear();
        self.step_start = start;
        self.timeline.clear();
        self.upload_batches(micro)?;
        let lr = self.next_lr();
        let clip = self.config.max_grad_norm;
        // Updates follow each unit's gradients as they land, unless they must wait for the
        // global norm or the gradients wait on the device.
        let early = match (clip, self.grads.tier) {
            (None, GradientTier::HostRing | GradientTier::HostStore) => Some(lr),
            _ => None,
        };

        let aux_coef = self.decoder.spec.moe.as_ref().filter(|m| m.aux_in_loss).map(|m| m.aux_coef);
        self.aux_weight = aux_coef.map_or(0.0, |c| c / micro_total.max(1) as f32);
        let loss_sum = self.forward(g, Some((1.0 / trained as f32, early)))?;
        let aux_loss = self.aux_share.map(|a| a / micro_total.max(1) as f64);
        let aux_term = aux_coef.zip(aux_loss).map_or(0.0, |(c, a)| f64::from(c) * a);
        let loss = loss_sum / trained as f64 + aux_term;
        let forward_done = Instant::now();
        self.backward(g, early)?;
        let backward_done = Instant::now();

        let mut grad_norm = self.grads.total_sumsq().sqrt();
        self.step += 1;
        let coef = match clip {
            Some(max_norm) => {
                let coef = clip_coef(grad_norm, max_norm)?;
                // Reported as torch's `clip_grad_norm_` returns it: an f32.
                grad_norm = f64::from(grad_norm as f32);
                coef
            }
            None if !grad_norm.is_finite() => {
                return Err(Error::Numerical(format!(
                    "gradient norm is {grad_norm} at step {}",
                    self.step
                )));
            }
            None => 1.0,
        };
        if early.is_none() && self.grads.lands {
            // Forward order: the next step needs unit 0 first.
            let step = self.step;
            let jobs = (0..self.store.units()).map(move |unit| AdamJob {
                unit,
                step,
                lr,
                coef,
                grad: GradAt::Unit,
            });
            if self.grads.tier == GradientTier::DeviceStore {
                // Gradients leave the device as the next forward asks for each unit; start
                // with unit 0 (and the next few) now so its update runs while this step
                // returns.
                self.grads.defer(jobs);
                self.pump_grads(Some(0))?;
            } else {
                for job in jobs {
                    self.worker.submit(job)?;
                }
            }
        }
        self.traffic.forward = forward_done - start;
        self.traffic.backward = backward_done - forward_done;
        if self.grads.lands {
            // Shared by every rank: the one that submits the updates accounts for them.
            self.traffic.optimizer_busy = self.worker.take_busy();
            self.traffic.disk = self.store.disk().map(|d| d.take_stats()).unwrap_or_default();
        }
        self.traffic.optimizer_exposed = self.exposed();
        let elapsed = start.elapsed();
        let metrics = StepMetrics {
            step: self.step,
            loss,
            aux_loss,
            lr,
            grad_norm,
            tokens,
            trained_tokens: trained,
            elapsed,
            compute_time: self.traffic.forward + self.traffic.backward,
            forward_time: self.traffic.forward,
            backward_time: self.traffic.backward,
            optimizer_time: self.traffic.optimizer_busy,
            optimizer_exposed: self.traffic.optimizer_exposed,
            h2d_bytes: self.traffic.h2d_bytes,
            d2h_bytes: self.traffic.d2h_bytes,
            timeline: self.take_timeline(),
            eval_loss: None,
        };
        Ok((metrics, self.traffic))
    }

    /// Embedding and layers for every micro-batch, keeping each layer's input as a checkpoint,
    /// then the head. Returns the summed loss. With `train` set (the loss scale, and the
    /// learning rate when updates follow the gradients as they land), the head also computes
    /// its gradients; without it (evaluation) no checkpoint leaves the device and no gradient
    /// is formed.
    fn forward(&mut self, g: usize, train: Option<(f32, Option<f32>)>) -> Result<f64> {
        let (b, layers, h) = (self.b, self.decoder.spec.layers, self.decoder.spec.hidden);
        let host = self.options.checkpoints == CheckpointTier::Host;
        let keep = train.is_some();

        let slot = self.load_unit(0)?;
        let started = Instant::now();
        for stats in self.router_stats.iter_mut().take(g) {
            let n = b.len(stats);
            b.fill_zero(b.view_mut(stats, 0..n))?;
        }
        for mb in 0..g {
            if keep {
                self.check_interrupt()?;
            }
            let batch = &self.batches[mb];
            if host {
                self.decoder.embed_forward(b, &mut self.work[0][mb], &self.slots[slot], batch)?;
                if !keep {
                    continue;
                }
                let n = batch.tokens * h;
                let (dst, x) = (&mut self.ckpt_host[0][mb], &self.work[0][mb]);
                let events = &self.events;
                self.traffic.d2h_bytes +=
                    Self::checkpoint_out(b, &self.compute, &self.d2h, events, dst, x, n)?;
            } else {
                self.decoder.embed_forward(
                    b,
                    &mut self.ckpt_device[0][mb],
                    &self.slots[slot],
                    batch,
                )?;
            }
        }
        if host && keep {
            b.record(&self.events.work_free[0], &self.d2h)?;
        }
        if let Some(table) = &mut self.tied_table {
            // The tied head reads the embedding table at the end of the forward: keep a copy
            // while it is in the slot rather than streaming it a second time.
            let n = self.layout.units[0].len;
            b.copy(b.view_mut(table, 0..n), b.view(&self.slots[slot], 0..n))?;
        }
        self.release_slot(slot)?;
        self.span(0, "compute", started);
        self.prefetch(1)?;

        // Layer l reads its input and writes layer l + 1's: a kept input stays in its checkpoint
        // (device tier), every other one in a working set; the host tier copies the kept ones
        // out of the working sets.
        let k = self.options.checkpoint_interval;
        for l in 0..layers {
            let slot = self.load_unit(l + 1)?;
            let started = Instant::now();
            let input = if !host && l % k == 0 { Act::Ckpt(l) } else { Act::Work(l % 2) };
            let next = l + 1;
            let output = if !host && (next % k == 0 || next == layers) {
                Act::Ckpt(next)
            } else {
                Act::Work(next % 2)
            };
            let copy_out = host && keep && next % k == 0 && next < layers;
            if host {
                // This layer overwrites the working set whose checkpoints the layer before the
                // last copied out: wait for those copies.
                b.wait(&self.compute, &self.events.work_free[next % 2])?;
            }
            for mb in 0..g {
                if keep {
                    self.check_interrupt()?;
                }
                let batch = &self.batches[mb];
                let (x_in, x_out) = acts(
                    &mut self.ckpt_device,
                    &mut self.work,
                    &mut self.regen,
                    input,
                    output,
                    mb,
                )?;
                // Evaluation keeps no statistics: its loss is the cross-entropy alone.
                let router = match self.router_stats.get_mut(mb) {
                    Some(stats) if keep => RouterStats::Record(stats),
                    _ => RouterStats::Off,
                };
                self.decoder.layer_forward(
                    b,
                    x_out,
                    x_in,
                    &self.slots[slot],
                    &mut self.scratch,
                    LayerAt::packed(batch, l).with_router(router),
                )?;
                // A kept layer's forward state (or attention output) moves into its
                // micro-batch's kept set (buffer handles trade places: the scratch takes the
                // set's previous buffers).
                if keep {
                    self.kept.swap(&mut self.scratch, l, mb);
                }
                if copy_out {
                    let n = batch.tokens * h;
                    let dst = &mut self.ckpt_host[next][mb];
                    self.traffic.d2h_bytes += Self::checkpoint_out(
                        b,
                        &self.compute,
                        &self.d2h,
                        &self.events,
                        dst,
                        x_out,
                        n,
                    )?;
                }
            }
            if copy_out {
                b.record(&self.events.work_free[next % 2], &self.d2h)?;
            }
            self.release_slot(slot)?;
            self.span(l + 1, "compute", started);
            self.prefetch(l + 2)?;
        }
        if host && keep {
            // The backward's checkpoint uploads (on h2d) wait for every copy out.
            b.record(&self.events.checkpoints_moved, &self.d2h)?;
            b.wait(&self.h2d, &self.events.checkpoints_moved)?;
        }
        let loss = self.head(g, train)?;
        if !loss.is_finite() {
            return Err(Error::Numerical(format!("loss is {loss} at step {}", self.step + 1)));
        }
        Ok(loss)
    }

    /// Mean loss over `micro` (held-out micro-batches, taken G at a time) with the weights of
    /// the steps taken so far; changes no training state.
    pub fn eval_loss(&mut self, micro: &[MicroBatch]) -> Result<f64> {
        let trained: usize = micro.iter().map(MicroBatch::trained_tokens).sum();
        if trained == 0 {
            return Err(Error::invalid("no token of the evaluation set carries loss"));
        }
        let mut sum = 0.0;
        for chunk in micro.chunks(self.options.grad_accum) {
            self.upload_batches(chunk)?;
            sum += self.forward(chunk.len(), None)?;
        }
        Ok(sum / trained as f64)
    }

    /// Records that `unit` used `stream` from `from` until now, for the step's timeline.
    fn span(&mut self, unit: usize, stream: &'static str, from: Instant) {
        let at = |t: Instant| t.saturating_duration_since(self.step_start).as_secs_f64();
        let span = Span { unit, stream, start: at(from), end: at(Instant::now()) };
        self.timeline.push(span);
    }

    /// Head forward and, when training, backward for every micro-batch: the loss, `dx[0]` for
    /// the top layer, and the head's gradients (a tied LM head's in `tied_grad`).
    fn head(&mut self, g: usize, train: Option<(f32, Option<f32>)>) -> Result<f64> {
        let (b, layers) = (self.b, self.decoder.spec.layers);
        let head_unit = self.layout.head_unit();
        let slot = self.load_unit(head_unit)?;
        let started = Instant::now();
        if train.is_some() {
            self.grads.begin(b, &self.worker, head_unit)?;
            if let Some(tied) = &mut self.tied_grad {
                let n = b.len(tied);
                b.fill_zero(b.view_mut(tied, 0..n))?;
            }
        }
        let host = self.options.checkpoints == CheckpointTier::Host;
        let mut loss = 0.0;
        self.aux_share = None;
        if train.is_some() {
            for (stats, batch) in self.router_stats.iter().zip(&self.batches).take(g) {
                let aux = self.decoder.aux_loss(b, stats, batch.tokens)?;
                *self.aux_share.get_or_insert(0.0) += aux;
            }
        }
        for mb in 0..g {
            let x = if host { &self.work[layers % 2][mb] } else { &self.ckpt_device[layers][mb] };
            let head_w = &self.slots[slot];
            // Untied heads never read the table argument.
            let table = self.tied_table.as_ref().unwrap_or(head_w);
            let batch = &self.batches[mb];
            let w = HeadWeights { head: head_w, embed: table };
            let Some((scale, _)) = train else {
                loss += self.decoder.head_forward(b, &mut self.head, x, w, batch)?;
                continue;
            };
            let grads = HeadGrads {
                scale,
                dx: &mut self.dx[0][mb],
                head: self.grads.acc(head_unit),
                embed: self.tied_grad.as_mut(),
            };
            loss += self.decoder.head_forward_backward(b, grads, &mut self.head, x, w, batch)?;
        }
        self.release_slot(slot)?;
        self.span(head_unit, "compute", started);
        if let Some((_, early)) = train {
            // The backward starts with the top layer, whose weights may still be in a slot.
            self.prefetch(layers)?;
            // A tied head's own unit is its final norm: the table's gradient joins the
            // embedding's, so the head's update need not wait for it.
            self.grads_done(head_unit, early)?;
        }
        Ok(loss)
    }

    /// Layers from the top down, recomputing each from its checkpoint, then the embedding.
    /// With K > 1, each group of K layers first recomputes the inputs of its upper layers from
    /// the group's checkpoint. Each unit's gradients wait or land as their tier says once they
    /// are complete.
    fn backward(&mut self, g: usize, early: Option<f32>) -> Result<()> {
        let (b, layers) = (self.b, self.decoder.spec.layers);
        let host = self.options.checkpoints == CheckpointTier::Host;
        let passes = backward_passes(layers, self.options.checkpoint_interval);
        // dx[cur][mb] holds the gradient with respect to the current layer's output.
        let mut cur = 0;
        let mut group = None;
        for (i, &Pass { layer: l, start, recompute }) in passes.iter().enumerate() {
            let slot = self.load_unit(l + 1)?;
            let started = Instant::now();
            if group != Some(start) {
                group = Some(start);
                if host {
                    self.checkpoints_in(g, start)?;
                }
            }
            // The group's first input is its checkpoint; the others were recomputed.
            let input = match (l == start, host) {
                (true, true) => Act::Work(0),
                (true, false) => Act::Ckpt(start),
                (false, _) => Act::Regen(l - start - 1),
            };
            if recompute {
                for mb in 0..g {
                    if early.is_none() {
                        self.check_interrupt()?;
                    }
                    let (x_in, x_out) = acts(
                        &mut self.ckpt_device,
                        &mut self.work,
                        &mut self.regen,
                        input,
                        Act::Regen(l - start),
                        mb,
                    )?;
                    let (w, batch) = (&self.slots[slot], &self.batches[mb]);
                    let at = LayerAt::packed(batch, l);
                    let at = at.with_router(complete(&self.router_stats, mb, self.aux_weight));
                    self.decoder.layer_forward(b, x_out, x_in, w, &mut self.scratch, at)?;
                }
            } else {
                self.grads.begin(b, &self.worker, l + 1)?;
                for mb in 0..g {
                    if early.is_none() {
                        self.check_interrupt()?;
                    }
                    let batch = &self.batches[mb];
                    let x_in = act(&self.ckpt_device, &self.work, &self.regen, input, mb)?;
                    let w = &self.slots[slot];
                    let router = || complete(&self.router_stats, mb, self.aux_weight);
                    // A kept layer's forward state is still on the device: no recompute, only
                    // its norms and activation derived again. A kept attention output is
                    // swapped in: the recompute skips the attention.
                    let kept = self.kept.swap(&mut self.scratch, l, mb);
                    if kept == Kept::Layer {
                        self.decoder.layer_rederive(b, x_in, w, &mut self.scratch, l, batch)?;
                    } else {
                        self.decoder.layer_forward(
                            b,
                            &mut self.layer_out,
                            x_in,
                            w,
                            &mut self.scratch,
                            LayerAt::packed(batch, l)
                                .for_backward()
                                .with_router(router())
                                .with_kept_attention(kept == Kept::Attention),
                        )?;
                    }
                    let [d0, d1] = &mut self.dx;
                    let (dx_out, dx_in) =
                        if cur == 0 { (&d0[mb], &mut d1[mb]) } else { (&d1[mb], &mut d0[mb]) };
                    let run = self.decoder.layer_backward(
                        b,
                        LayerGrads { dx_out, dx_in, weights: self.grads.acc(l + 1) },
                        x_in,
                        w,
                        &mut self.scratch,
                        LayerAt::packed(batch, l).with_router(router()),
                    );
                    self.kept.swap(&mut self.scratch, l, mb);
                    run?;
                }
                cur = 1 - cur;
            }
            self.release_slot(slot)?;
            self.span(l + 1, "compute", started);
            if let Some(next) = passes.get(i + 1) {
                self.prefetch(next.layer + 1)?;
            }
            if !recompute {
                self.grads_done(l + 1, early)?;
            }
        }

        // The embedding's gradient: a tied head's contribution first, then the scatter.
        let started = Instant::now();
        self.grads.begin(b, &self.worker, 0)?;
        if let Some(tied) = &self.tied_grad {
            let n = b.len(tied);
            b.copy(b.view_mut(self.grads.acc(0), 0..n), b.view(tied, 0..n))?;
        }
        for mb in 0..g {
            self.decoder.embed_backward(
                b,
                self.grads.acc(0),
                &self.dx[cur][mb],
                &self.batches[mb],
            )?;
        }
        self.span(0, "compute", started);
        self.grads_done(0, early)?;
        self.land(|grads, path| grads.flush(path))
    }

    /// Host tier: brings layer `l`'s checkpoints back into `work[0]`, which compute no longer
    /// reads (the upload waits for all compute queued so far).
    fn checkpoints_in(&mut self, g: usize, l: usize) -> Result<()> {
        let (b, h) = (self.b, self.decoder.spec.hidden);
        b.record(&self.events.activations_ready, &self.compute)?;
        b.wait(&self.h2d, &self.events.activations_ready)?;
        for mb in 0..g {
            let n = self.batches[mb].tokens * h;
            let dst = b.view_mut(&mut self.work[0][mb], 0..n);
            // SAFETY: the checkpoint slab lives as long as the streamer and is written again only
            // by the next forward's copies out, which d2h queues after compute has consumed this
            // upload (compute waits for `checkpoints_moved` below).
            unsafe { b.upload_on(&self.h2d, dst, &self.ckpt_host[l][mb], 0)? };
            self.traffic.h2d_bytes += (n * b.elem_bytes(FloatKind::Activation)) as u64;
        }
        b.record(&self.events.checkpoints_moved, &self.h2d)?;
        b.wait(&self.compute, &self.events.checkpoints_moved)
    }

    /// This step's spans plus the optimizer's updates that finished during it, in start order.
    fn take_timeline(&mut self) -> Vec<Span> {
        let origin = self.step_start;
        let at = |t: Instant| t.saturating_duration_since(origin).as_secs_f64();
        let mut spans = std::mem::take(&mut self.timeline);
        let updates = if self.grads.lands { self.worker.take_spans() } else { Vec::new() };
        for (unit, from, to) in updates {
            spans.push(Span { unit, stream: "optimizer", start: at(from), end: at(to) });
        }
        spans.sort_by(|a, b| a.start.total_cmp(&b.start));
        spans
    }

    /// Continues from a saved state: `step` optimizer steps taken; `moments(unit, m, v)` fills
    /// each unit's Adam moments (in host memory or on the disk tier, a unit at a time). The
    /// master weights came in through [`Streamer::new`].
    pub fn restore(&mut self, step: u64, moments: &mut FillMoments<'_>) -> Result<()> {
        if self.step != 0 {
            return Err(Error::invalid("a state can only be restored before the first step"));
        }
        for u in 0..self.store.units() {
            self.store.set_moments(u, |m, v| moments(u, m, v))?;
        }
        self.step = step;
        self.store.set_applied(step)
    }

    /// Lands every gradient still waiting on the device and waits for every submitted update.
    fn settle(&mut self) -> Result<()> {
        self.pump_grads(None)?;
        for u in 0..self.store.units() {
            self.store.wait_applied(u, self.step)?;
        }
        Ok(())
    }

    /// Waits for every submitted update and returns the Adam moments per unit, `(m, v)`.
    pub fn moments(&mut self) -> Result<Moments> {
        self.settle()?;
        let (mut m, mut v) = (Vec::new(), Vec::new());
        for u in 0..self.store.units() {
            self.store.with_moments(u, |um, uv| {
                m.push(um.to_vec());
                v.push(uv.to_vec());
                Ok(())
            })?;
        }
        Ok((m, v))
    }

    /// Waits for every submitted update and returns the host store, to read the training
    /// state from (a save reads it a tensor at a time instead of copying it all).
    pub fn settled_store(&mut self) -> Result<Arc<HostStore>> {
        self.settle()?;
        Ok(self.store.clone())
    }

    /// Waits for every submitted update and returns the master weights.
    pub fn params(&mut self) -> Result<HostParams> {
        self.settle()?;
        Ok(HostParams { layout: self.layout.clone(), units: self.store.snapshot()? })
    }

    /// Unit `u`'s gradients of the last step (before clipping, summed over its micro-batches),
    /// where the device store still holds them; the other gradient tiers hand each unit's to
    /// the optimizer as it finishes, so there they are an error.
    pub fn stored_gradients(&mut self, u: usize) -> Result<Vec<f32>> {
        if u >= self.layout.units.len() {
            return Err(Error::invalid(format!("no unit {u}")));
        }
        self.grads.read_stored(self.b, u)?.ok_or_else(|| {
            Error::invalid(format!(
                "the step's gradients are kept only where they wait on the device (gradient \
                 tier device store), not {:?}",
                self.grads.tier
            ))
        })
    }

    /// This step's per-unit gradient norms (before clipping), in unit order.
    pub fn grad_norms(&self) -> Vec<f64> {
        self.grads.sumsq.iter().map(|s| s.sqrt()).collect()
    }

    /// Stops the optimizer worker, surfacing any error it hit.
    pub fn finish(&mut self) -> Result<HostParams> {
        let params = self.params()?;
        self.worker.finish()?;
        Ok(params)
    }

    /// Waits for every transfer queued on the schedule's streams.
    fn drain(&self) -> Result<()> {
        for stream in [&self.h2d, &self.d2h, &self.compute] {
            self.b.record(&self.events.activations_ready, stream)?;
            self.b.synchronize(&self.events.activations_ready)?;
        }
        Ok(())
    }
}

/// Where a layer's input or output lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Act {
    /// `ckpt_device[l]`.
    Ckpt(usize),
    /// `work[i]`.
    Work(usize),
    /// `regen[j]`.
    Regen(usize),
}

/// One layer's work in the backward: recomputing its output (the next layer's input) for the
/// group that starts at `start`, or its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pass {
    layer: usize,
    start: usize,
    recompute: bool,
}

/// The backward's passes, top group first: for the group of layers `s..e`, recompute layers
/// `s..e-1` forward, then run the backward of layers `e-1` down to `s`.
/// Micro-batch `mb`'s complete router statistics for a recompute or a backward.
fn complete<B: Backend>(stats: &[B::Floats], mb: usize, weight: f32) -> RouterStats<'_, B> {
    match stats.get(mb) {
        Some(stats) => RouterStats::Complete { stats, weight },
        None => RouterStats::Off,
    }
}

fn backward_passes(layers: usize, k: usize) -> Vec<Pass> {
    let mut passes = Vec::new();
    let mut starts: Vec<usize> = (0..layers).step_by(k.max(1)).collect();
    starts.reverse();
    for start in starts {
        let end = (start + k).min(layers);
        passes.extend((start..end - 1).map(|layer| Pass { layer, start, recompute: true }));
        passes.extend((start..end).rev().map(|layer| Pass { layer, start, recompute: false }));
    }
    passes
}

fn pick<'a, F>(
    ckpt: &'a [Vec<F>],
    work: &'a [Vec<F>; 2],
    regen: &'a [Vec<F>],
    a: Act,
) -> Option<&'a Vec<F>> {
    match a {
        Act::Ckpt(i) => ckpt.get(i),
        Act::Work(i) => work.get(i),
        Act::Regen(i) => regen.get(i),
    }
}

/// Micro-batch `mb` of activation buffer `a`.
fn act<'a, F>(
    ckpt: &'a [Vec<F>],
    work: &'a [Vec<F>; 2],
    regen: &'a [Vec<F>],
    a: Act,
    mb: usize,
) -> Result<&'a F> {
    pick(ckpt, work, regen, a)
        .and_then(|v| v.get(mb))
        .ok_or_else(|| Error::invalid(format!("no activation buffer {a:?}[{mb}]")))
}

fn at<F>(v: &[Vec<F>], i: usize, mb: usize) -> Option<&F> {
    v.get(i)?.get(mb)
}

fn at_mut<F>(v: &mut [Vec<F>], i: usize, mb: usize) -> Option<&mut F> {
    v.get_mut(i)?.get_mut(mb)
}

/// Micro-batch `mb` of buffers `input` (read) and `output` (written), which must differ.
fn acts<'a, F>(
    ckpt: &'a mut [Vec<F>],
    work: &'a mut [Vec<F>; 2],
    regen: &'a mut [Vec<F>],
    input: Act,
    output: Act,
    mb: usize,
) -> Result<(&'a F, &'a mut F)> {
    fn split<F>(v: &mut [Vec<F>], i: usize, o: usize, mb: usize) -> Option<(&F, &mut F)> {
        if i == o || i.max(o) >= v.len() {
            return None;
        }
        let (low, high) = v.split_at_mut(i.max(o));
        let (lo, hi) = (at_mut(low, i.min(o), mb)?, at_mut(high, 0, mb)?);
        Some(if i < o { (&*lo, hi) } else { (&*hi, lo) })
    }
    let found = match (input, output) {
        (Act::Ckpt(i), Act::Ckpt(o)) => split(ckpt, i, o, mb),
        (Act::Work(i), Act::Work(o)) => split(work, i, o, mb),
        (Act::Regen(i), Act::Regen(o)) => split(regen, i, o, mb),
        (Act::Ckpt(i), Act::Work(o)) => at(ckpt, i, mb).zip(at_mut(work, o, mb)),
        (Act::Ckpt(i), Act::Regen(o)) => at(ckpt, i, mb).zip(at_mut(regen, o, mb)),
        (Act::Work(i), Act::Ckpt(o)) => at(work, i, mb).zip(at_mut(ckpt, o, mb)),
        (Act::Work(i), Act::Regen(o)) => at(work, i, mb).zip(at_mut(regen, o, mb)),
        (Act::Regen(i), Act::Ckpt(o)) => at(regen, i, mb).zip(at_mut(ckpt, o, mb)),
        (Act::Regen(i), Act::Work(o)) => at(regen, i, mb).zip(at_mut(work, o, mb)),
    };
    found.ok_or_else(|| {
        Error::invalid(format!("activation buffers {input:?} -> {output:?}[{mb}] unavailable"))
    })
}

impl<B: Backend> Drop for Streamer<'_, B> {
    fn drop(&mut self) {
        // Copies in flight read or write host slabs and device buffers about to be freed.
        let _ = self.drain();
    }
}
