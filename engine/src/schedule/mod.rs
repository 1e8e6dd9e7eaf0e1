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
//!
//! This file is the step itself, in the order it runs: `step_part` (forward, loss, backward,
//! global norm, updates), `forward`, `head`, `backward`. Its parts, each with the events it
//! owns, live beside it:
//!
//! - `slots.rs`: unit weights on the device and their prefetch (`WeightSlots`);
//! - `checkpoints.rs`: layer inputs and kept activations between the forward and the backward
//!   (`Checkpoints`);
//! - `grads.rs`: weight gradients from the device to the optimizer (`Grads`);
//! - `micro.rs`: the micro-batches' token data and compute buffers (`MicroBatches`);
//! - `clock.rs`: the step's traffic, timeline and waits for the optimizer (`Clock`);
//! - `optimizer.rs`: the optimizer worker; `parallel.rs`: data parallelism over several
//!   devices; `from_plan.rs`: the planner's placement as [`ScheduleOptions`].

mod checkpoints;
mod clock;
pub mod from_plan;
mod grads;
mod micro;
mod optimizer;
mod parallel;
mod slots;

use std::sync::Arc;
use std::time::Instant;

pub use clock::StepTraffic;
pub use optimizer::{AdamJob, GradAt, OptimizerWorker};
pub use parallel::{CpuGroup, CpuPeer, DataParallel, split_micro};

use crate::backend::{AllReduce, Backend};
use crate::data::MicroBatch;
use crate::error::{Error, Result};
use crate::generate::Streamed;
use crate::generate::batch::Model as BatchModel;
use crate::model::{Decoder, HeadGrads, HostParams, LayerAt, LayerGrads, ModelLayout};
use crate::optim::{AdamW, clip_coef};
pub use crate::placement::{CAST_CHUNK, CheckpointTier, GradientTier, RING_SLOTS, WeightSource};
use crate::spec::ModelSpec;
use crate::step::{Span, StepMetrics, TrainConfig};
use crate::store::{GradLanding, HostStore};
use checkpoints::{Act, Checkpoints, Kept, Pass, backward_passes};
use clock::Clock;
use grads::{GradPath, Grads};
use micro::MicroBatches;
use slots::WeightSlots;

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

/// What the ranks of a data-parallel group hold in common: the model's layout, the host store
/// and the optimizer worker.
#[derive(Clone)]
struct Shared {
    layout: Arc<ModelLayout>,
    store: Arc<HostStore>,
    worker: Arc<OptimizerWorker>,
}

/// The streams a step is ordered on: weights and host checkpoints come in on `h2d`,
/// gradients and host checkpoints go out on `d2h`, and everything else runs on the backend's
/// compute stream.
struct Streams<B: Backend> {
    h2d: B::Stream,
    compute: B::Stream,
    d2h: B::Stream,
}

pub struct Streamer<'b, B: Backend> {
    b: &'b B,
    pub config: TrainConfig,
    options: ScheduleOptions,
    decoder: Decoder<B>,
    shared: Shared,
    /// Data parallelism: this rank's link to the others, through which each unit's gradients
    /// are summed before they are measured and landed. `None`: a single device.
    peers: Option<Box<dyn AllReduce<B> + 'b>>,
    /// Optimizer steps submitted.
    pub step: u64,
    streams: Streams<B>,
    /// Unit weights on the device and their prefetch.
    slots: WeightSlots<B>,
    /// Layer inputs and kept activations between the forward and the backward.
    ckpt: Checkpoints<B>,
    /// Weight-gradient accumulators and their landing on the host.
    grads: Grads<B>,
    /// The micro-batches' token data and the buffers their compute runs in.
    micro: MicroBatches<B>,
    /// This step's traffic, timeline and waits for the optimizer.
    clock: Clock<B>,
    /// Asked between micro-batches on a synchronous backend; see [`Streamer::set_interrupt`].
    interrupt: Option<Interrupt>,
    /// Device bytes allocated at construction (nothing is allocated later).
    pub device_bytes: usize,
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
    /// `peers` links it to them (rank 0 alone lands gradients and submits updates). Every
    /// device buffer of the step is sized here.
    fn with_state(
        b: &'b B,
        spec: &ModelSpec,
        shared: Shared,
        peers: Option<Box<dyn AllReduce<B> + 'b>>,
        config: TrainConfig,
        options: ScheduleOptions,
    ) -> Result<Self> {
        let layout = &shared.layout;
        let decoder = Decoder::new(b, spec, layout.layers.clone(), layout.head.clone())?;
        let (ckpt, ckpt_bytes) = Checkpoints::new(b, spec, &options)?;
        let tied = spec.tie_embeddings;
        let (slots, slot_bytes) = WeightSlots::new(b, layout, &options, tied)?;
        let lens = layout.units.iter().map(|u| u.len).collect();
        let lands = peers.as_ref().is_none_or(|p| p.rank() == 0);
        let tied_len = tied.then(|| layout.units[0].len);
        let (grads, grad_bytes) =
            Grads::new(b, options.gradients, options.ring_slots, lens, lands, tied_len)?;
        let (micro, micro_bytes) = MicroBatches::new(b, spec, &options)?;
        let streams =
            Streams { h2d: b.new_stream()?, compute: b.compute_stream(), d2h: b.new_stream()? };
        Ok(Streamer {
            b,
            config,
            options,
            decoder,
            shared,
            peers,
            step: 0,
            streams,
            slots,
            ckpt,
            grads,
            micro,
            clock: Clock::new(),
            interrupt: None,
            device_bytes: ckpt_bytes + slot_bytes + grad_bytes + micro_bytes,
        })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.decoder.spec
    }

    /// The host store (master weights, moments): read it only between steps.
    pub fn store(&self) -> &Arc<HostStore> {
        &self.shared.store
    }

    /// The learning rate the next step will use.
    pub fn next_lr(&self) -> f32 {
        self.config.lr_at(self.step)
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
    ///
    /// Top to bottom: the forward (ending in the head's loss and gradients), the backward,
    /// the global norm, then the updates the gradients' landing has not already submitted.
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
        self.clock.restart(start);
        self.micro.upload(self.b, micro)?;
        let lr = self.next_lr();
        let clip = self.config.max_grad_norm;
        // Updates follow each unit's gradients as they land, unless they must wait for the
        // global norm or the gradients wait on the device.
        let early = match (clip, self.grads.tier) {
            (None, GradientTier::HostRing | GradientTier::HostStore) => Some(lr),
            _ => None,
        };

        // Forward and loss.
        let aux_coef = self.decoder.spec.moe.as_ref().filter(|m| m.aux_in_loss).map(|m| m.aux_coef);
        self.micro.router.set_weight(aux_coef.map_or(0.0, |c| c / micro_total.max(1) as f32));
        let loss_sum = self.forward(g, Some((1.0 / trained as f32, early)))?;
        let aux_loss = self.micro.router.share().map(|a| a / micro_total.max(1) as f64);
        let aux_term = aux_coef.zip(aux_loss).map_or(0.0, |(c, a)| f64::from(c) * a);
        let loss = loss_sum / trained as f64 + aux_term;
        let forward_done = Instant::now();

        // Backward.
        self.backward(g, early)?;
        let backward_done = Instant::now();

        // The global norm: every unit's sum of squares was taken (each a host wait for its
        // backward) as its gradients completed.
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

        // Updates that waited for the norm.
        if early.is_none() && self.grads.lands {
            // Forward order: the next step needs unit 0 first.
            let step = self.step;
            let jobs = (0..self.shared.store.units()).map(move |unit| AdamJob {
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
                    self.shared.worker.submit(job)?;
                }
            }
        }

        let traffic = &mut self.clock.traffic;
        traffic.forward = forward_done - start;
        traffic.backward = backward_done - forward_done;
        if self.grads.lands {
            // Shared by every rank: the one that submits the updates accounts for them.
            traffic.optimizer_busy = self.shared.worker.take_busy();
            traffic.disk = self.shared.store.disk().map(|d| d.take_stats()).unwrap_or_default();
        }
        self.clock.traffic.optimizer_exposed = self.clock.exposed(self.b);
        let traffic = self.clock.traffic;
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
            compute_time: traffic.forward + traffic.backward,
            forward_time: traffic.forward,
            backward_time: traffic.backward,
            optimizer_time: traffic.optimizer_busy,
            optimizer_exposed: traffic.optimizer_exposed,
            h2d_bytes: traffic.h2d_bytes,
            d2h_bytes: traffic.d2h_bytes,
            timeline: self.take_timeline(),
            eval_loss: None,
        };
        Ok((metrics, traffic))
    }

    /// Embedding and layers for every micro-batch, keeping each layer's input as a checkpoint,
    /// then the head. Returns the summed loss. With `train` set (the loss scale, and the
    /// learning rate when updates follow the gradients as they land), the head also computes
    /// its gradients; without it (evaluation) no checkpoint leaves the device and no gradient
    /// is formed.
    fn forward(&mut self, g: usize, train: Option<(f32, Option<f32>)>) -> Result<f64> {
        let (b, layers) = (self.b, self.decoder.spec.layers);
        let host = self.ckpt.on_host();
        let keep = train.is_some();

        // Sync: compute waits for each unit's upload (`load_unit`); queuing an upload, the host
        // waits for the unit's update of the previous step (`prefetch`).
        let slot = self.load_unit(0)?;
        let started = Instant::now();
        self.micro.router.clear(b, g)?;
        let embedded = self.ckpt.embed_output();
        for mb in 0..g {
            if keep {
                self.check_interrupt()?;
            }
            let batch = &self.micro.batches[mb];
            let x = self.ckpt.inputs.get_mut(embedded, mb)?;
            self.decoder.embed_forward(b, x, self.slots.slot(slot), batch)?;
            if host && keep {
                let bytes = self.ckpt.copy_out(b, &self.streams, 0, mb, batch.tokens)?;
                self.clock.add_d2h(bytes);
            }
        }
        if host && keep {
            self.ckpt.copied_out(b, &self.streams.d2h, 0)?;
        }
        // The tied head reads the embedding table at the end of the forward.
        self.slots.keep_table(b, slot)?;
        self.slots.release(b, &self.streams.compute, slot)?;
        self.clock.span(0, "compute", started);
        // The next unit's upload overlaps this unit's compute.
        self.prefetch(1)?;

        // Layer l reads its input and writes layer l + 1's (see `Checkpoints::forward_io`).
        for l in 0..layers {
            let slot = self.load_unit(l + 1)?;
            let started = Instant::now();
            let (input, output) = self.ckpt.forward_io(l);
            let next = l + 1;
            let copy_out = keep && self.ckpt.copies_out(next);
            if host {
                // This layer overwrites the working set whose checkpoints the layer before the
                // last copied out: wait for those copies.
                self.ckpt.wait_work_free(b, &self.streams.compute, next % 2)?;
            }
            for mb in 0..g {
                if keep {
                    self.check_interrupt()?;
                }
                let batch = &self.micro.batches[mb];
                let (x_in, x_out) = self.ckpt.inputs.pair(input, output, mb)?;
                self.decoder.layer_forward(
                    b,
                    x_out,
                    x_in,
                    self.slots.slot(slot),
                    &mut self.micro.scratch,
                    LayerAt::packed(batch, l).with_router(self.micro.router.record(mb, keep)),
                )?;
                // A kept layer's forward state (or attention output) moves into its
                // micro-batch's kept set (buffer handles trade places: the scratch takes the
                // set's previous buffers).
                if keep {
                    self.ckpt.kept.swap(&mut self.micro.scratch, l, mb);
                }
                if copy_out {
                    let bytes = self.ckpt.copy_out(b, &self.streams, next, mb, batch.tokens)?;
                    self.clock.add_d2h(bytes);
                }
            }
            if copy_out {
                self.ckpt.copied_out(b, &self.streams.d2h, next % 2)?;
            }
            self.slots.release(b, &self.streams.compute, slot)?;
            self.clock.span(l + 1, "compute", started);
            self.prefetch(l + 2)?;
        }
        if host && keep {
            // The backward's checkpoint uploads (on h2d) wait for every copy out.
            self.ckpt.all_copied_out(b, &self.streams)?;
        }
        let loss = self.head(g, train)?;
        if !loss.is_finite() {
            return Err(Error::Numerical(format!("loss is {loss} at step {}", self.step + 1)));
        }
        Ok(loss)
    }

    /// Head forward and, when training, backward for every micro-batch: the loss, `dx[0]` for
    /// the top layer, and the head's gradients (a tied LM head's in its own accumulator).
    fn head(&mut self, g: usize, train: Option<(f32, Option<f32>)>) -> Result<f64> {
        let (b, layers) = (self.b, self.decoder.spec.layers);
        let head_unit = self.shared.layout.head_unit();
        let slot = self.load_unit(head_unit)?;
        let started = Instant::now();
        if train.is_some() {
            self.grads.begin(b, &self.shared.worker, head_unit)?;
            self.grads.begin_tied(b)?;
        }
        let mut loss = 0.0;
        self.micro.measure_aux(b, &self.decoder, g, train.is_some())?;
        for mb in 0..g {
            let x = self.ckpt.head_input(mb)?;
            let w = self.slots.head(slot);
            let batch = &self.micro.batches[mb];
            let Some((scale, _)) = train else {
                loss += self.decoder.head_forward(b, &mut self.micro.head, x, w, batch)?;
                continue;
            };
            let (head, embed) = self.grads.head_accs(head_unit);
            let grads = HeadGrads { scale, dx: &mut self.micro.dx[0][mb], head, embed };
            loss +=
                self.decoder.head_forward_backward(b, grads, &mut self.micro.head, x, w, batch)?;
        }
        self.slots.release(b, &self.streams.compute, slot)?;
        self.clock.span(head_unit, "compute", started);
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
        let host = self.ckpt.on_host();
        let passes = backward_passes(layers, self.ckpt.interval());
        // dx[cur][mb] holds the gradient with respect to the current layer's output.
        let mut cur = 0;
        let mut group = None;
        for (i, &Pass { layer: l, start, recompute }) in passes.iter().enumerate() {
            let slot = self.load_unit(l + 1)?;
            let started = Instant::now();
            if group != Some(start) {
                group = Some(start);
                if host {
                    // Compute waits for the group's checkpoints to come back.
                    let batches = &self.micro.batches[..g];
                    let bytes = self.ckpt.bring_in(b, &self.streams, start, batches)?;
                    self.clock.add_h2d(bytes);
                }
            }
            let input = self.ckpt.backward_input(l, start);
            if recompute {
                for mb in 0..g {
                    if early.is_none() {
                        self.check_interrupt()?;
                    }
                    let (x_in, x_out) = self.ckpt.inputs.pair(input, Act::Regen(l - start), mb)?;
                    let (w, batch) = (self.slots.slot(slot), &self.micro.batches[mb]);
                    let at = LayerAt::packed(batch, l).with_router(self.micro.router.complete(mb));
                    self.decoder.layer_forward(b, x_out, x_in, w, &mut self.micro.scratch, at)?;
                }
            } else {
                self.grads.begin(b, &self.shared.worker, l + 1)?;
                for mb in 0..g {
                    if early.is_none() {
                        self.check_interrupt()?;
                    }
                    let batch = &self.micro.batches[mb];
                    let x_in = self.ckpt.inputs.get(input, mb)?;
                    let w = self.slots.slot(slot);
                    let router = || self.micro.router.complete(mb);
                    // A kept layer's forward state is still on the device: no recompute, only
                    // its norms and activation derived again. A kept attention output is
                    // swapped in: the recompute skips the attention.
                    let kept = self.ckpt.kept.swap(&mut self.micro.scratch, l, mb);
                    if kept == Kept::Layer {
                        let scratch = &mut self.micro.scratch;
                        self.decoder.layer_rederive(b, x_in, w, scratch, l, batch)?;
                    } else {
                        self.decoder.layer_forward(
                            b,
                            &mut self.micro.layer_out,
                            x_in,
                            w,
                            &mut self.micro.scratch,
                            LayerAt::packed(batch, l)
                                .for_backward()
                                .with_router(router())
                                .with_kept_attention(kept == Kept::Attention),
                        )?;
                    }
                    let [d0, d1] = &mut self.micro.dx;
                    let (dx_out, dx_in) =
                        if cur == 0 { (&d0[mb], &mut d1[mb]) } else { (&d1[mb], &mut d0[mb]) };
                    let run = self.decoder.layer_backward(
                        b,
                        LayerGrads { dx_out, dx_in, weights: self.grads.acc(l + 1) },
                        x_in,
                        w,
                        &mut self.micro.scratch,
                        LayerAt::packed(batch, l).with_router(router()),
                    );
                    self.ckpt.kept.swap(&mut self.micro.scratch, l, mb);
                    run?;
                }
                cur = 1 - cur;
            }
            self.slots.release(b, &self.streams.compute, slot)?;
            self.clock.span(l + 1, "compute", started);
            if let Some(next) = passes.get(i + 1) {
                self.prefetch(next.layer + 1)?;
            }
            if !recompute {
                // Sync: the host waits for this unit's backward to measure its gradients; the
                // next unit's upload, queued above, keeps `h2d` busy meanwhile.
                self.grads_done(l + 1, early)?;
            }
        }

        // The embedding's gradient: a tied head's contribution first, then the scatter.
        let started = Instant::now();
        self.grads.begin(b, &self.shared.worker, 0)?;
        self.grads.seed_embedding(b)?;
        for mb in 0..g {
            self.decoder.embed_backward(
                b,
                self.grads.acc(0),
                &self.micro.dx[cur][mb],
                &self.micro.batches[mb],
            )?;
        }
        self.clock.span(0, "compute", started);
        self.grads_done(0, early)?;
        // Sync: the host waits for every gradient copy still in flight.
        let path = GradPath::new(b, &self.shared, &self.streams);
        self.grads.land(&path, &mut self.clock, |grads, path| grads.flush(path))
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
            self.micro.upload(self.b, chunk)?;
            sum += self.forward(chunk.len(), None)?;
        }
        Ok(sum / trained as f64)
    }

    /// Makes unit `u`'s current weights available to compute and returns their slot (see
    /// [`Streamer::prefetch`]). Compute waits for the upload.
    fn load_unit(&mut self, u: usize) -> Result<usize> {
        self.prefetch(u)?;
        self.slots.take(self.b, &self.streams.compute, u, self.step)
    }

    /// Queues unit `u`'s upload of this step's weights, unless already queued, while the
    /// current unit computes, so its weights are there when compute needs them. Waits (on the
    /// host) for the unit's pending update first.
    fn prefetch(&mut self, u: usize) -> Result<()> {
        let Some(upload) = self.slots.upload_target(u, self.step) else {
            return Ok(());
        };
        self.wait_updated(upload.unit)?;
        let (b, h2d) = (self.b, &self.streams.h2d);
        self.slots.upload(b, h2d, &self.shared, upload, &mut self.clock)
    }

    /// Blocks until unit `u` has had every update submitted so far, first landing its
    /// gradients (device store) so that update can start.
    fn wait_updated(&mut self, u: usize) -> Result<()> {
        self.pump_grads(Some(u))?;
        let (store, step) = (&self.shared.store, self.step);
        let compute = &self.streams.compute;
        self.clock.optimizer_wait(self.b, compute, || Ok(((), store.wait_applied(u, step)?)))
    }

    /// Unit `u`'s gradients are complete: see [`Grads::complete`]. `early` carries the learning
    /// rate when the update should follow the gradients as soon as they land (clipping off).
    fn grads_done(&mut self, u: usize, early: Option<f32>) -> Result<()> {
        let job = early.map(|lr| AdamJob {
            unit: u,
            step: self.step + 1,
            lr,
            coef: 1.0,
            grad: GradAt::Unit,
        });
        let path = GradPath::new(self.b, &self.shared, &self.streams);
        self.grads.complete(&path, &mut self.clock, self.peers.as_deref(), u, job)
    }

    /// Device store: lands gradients still on the device up to unit `upto` (all with `None`)
    /// and hands their updates over; see [`Grads::land_waiting`].
    fn pump_grads(&mut self, upto: Option<usize>) -> Result<()> {
        let path = GradPath::new(self.b, &self.shared, &self.streams);
        self.grads.land_waiting(&path, &mut self.clock, upto)
    }

    /// This step's spans plus the optimizer's updates that finished during it, in start order.
    fn take_timeline(&mut self) -> Vec<Span> {
        let updates = if self.grads.lands { self.shared.worker.take_spans() } else { Vec::new() };
        self.clock.take_timeline(updates)
    }

    /// Continues from a saved state: `step` optimizer steps taken; `moments(unit, m, v)` fills
    /// each unit's Adam moments (in host memory or on the disk tier, a unit at a time). The
    /// master weights came in through [`Streamer::new`].
    pub fn restore(&mut self, step: u64, moments: &mut FillMoments<'_>) -> Result<()> {
        if self.step != 0 {
            return Err(Error::invalid("a state can only be restored before the first step"));
        }
        let store = &self.shared.store;
        for u in 0..store.units() {
            store.set_moments(u, |m, v| moments(u, m, v))?;
        }
        self.step = step;
        store.set_applied(step)
    }

    /// Lands every gradient still waiting on the device and waits for every submitted update.
    fn settle(&mut self) -> Result<()> {
        self.pump_grads(None)?;
        for u in 0..self.shared.store.units() {
            self.shared.store.wait_applied(u, self.step)?;
        }
        Ok(())
    }

    /// Waits for every submitted update and returns the Adam moments per unit, `(m, v)`.
    pub fn moments(&mut self) -> Result<Moments> {
        self.settle()?;
        let (mut m, mut v) = (Vec::new(), Vec::new());
        for u in 0..self.shared.store.units() {
            self.shared.store.with_moments(u, |um, uv| {
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
        Ok(self.shared.store.clone())
    }

    /// Runs `f` on the weights as they stand after the steps taken, without changing any
    /// training state: the host store's master weights, streamed a layer at a time through
    /// this device ([`Streamed`]: the embedding and head stay on the device meanwhile), for a
    /// task evaluation between steps.
    pub fn with_host_model<R>(
        &mut self,
        f: impl FnOnce(&BatchModel<'_, B>, &mut Streamed<'_, B>) -> Result<R>,
    ) -> Result<R> {
        let store = self.settled_store()?;
        let mut units = Streamed::new(self.b, &self.shared.layout, &*store)?;
        let model = BatchModel { b: self.b, spec: &self.decoder.spec, decoder: &self.decoder };
        f(&model, &mut units)
    }

    /// Waits for every submitted update and returns the master weights.
    pub fn params(&mut self) -> Result<HostParams> {
        self.settle()?;
        let units = self.shared.store.snapshot()?;
        Ok(HostParams { layout: self.shared.layout.clone(), units })
    }

    /// Unit `u`'s gradients of the last step (before clipping, summed over its micro-batches),
    /// where the device store still holds them; the other gradient tiers hand each unit's to
    /// the optimizer as it finishes, so there they are an error.
    pub fn stored_gradients(&mut self, u: usize) -> Result<Vec<f32>> {
        if u >= self.shared.layout.units.len() {
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
        self.shared.worker.finish()?;
        Ok(params)
    }

    /// Waits for every transfer queued on the schedule's streams.
    fn drain(&self) -> Result<()> {
        // Any event marks a stream's end; between steps `activations_ready` guards nothing.
        let end = &self.ckpt.activations_ready;
        let Streams { h2d, compute, d2h } = &self.streams;
        for stream in [h2d, d2h, compute] {
            self.b.record(end, stream)?;
            self.b.synchronize(end)?;
        }
        Ok(())
    }
}

impl<B: Backend> Drop for Streamer<'_, B> {
    fn drop(&mut self) {
        // Copies in flight read or write host slabs and device buffers about to be freed.
        let _ = self.drain();
    }
}
