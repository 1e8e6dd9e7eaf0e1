//! The streaming step, layer-major: each unit's weights visit the device once in the forward and
//! once in the backward of an optimizer step, whatever the number of micro-batches G, and every
//! other byte of state stays in the host store.
//!
//! ```text
//! forward   for unit u = 0..U-1: weights(u) -> slot; for b in 0..G: x[u+1][b] = f_u(x[u][b])
//! head      weights(head); for b: loss, dx[b], d_head += (f32)
//! backward  for layer l = L-1..0: weights(l) -> slot; for b: recompute f_l from x[l][b];
//!               dx[b] <- backprop(dx[b]); dW(l) += (f32 on the device)
//!           embedding: dW(0) += scatter(dx[b])
//!           each unit's gradients land in the host store when complete
//! optimizer clipping on:  after the backward, once the global norm is known, AdamW for units
//!                         0, 1, 2, ... on the optimizer worker, overlapping the next forward
//!           clipping off: AdamW(u) as soon as grads(u) land, overlapping the rest of the backward
//! ```
//! Only this module creates streams and events. Transfers run on `h2d` and `d2h`, compute on
//! `compute`; events are named after what they guard. Nothing is allocated on the device inside
//! the step: every buffer is sized when the streamer is built.

pub mod from_plan;
mod optimizer;

use std::sync::Arc;
use std::time::{Duration, Instant};

pub use optimizer::{AdamJob, OptimizerWorker};

use crate::backend::{Backend, FloatKind};
use crate::data::MicroBatch;
use crate::error::{Error, Result};
use crate::model::{Decoder, DeviceBatch, HeadScratch, HostParams, LayerScratch, ModelLayout};
use crate::optim::{AdamW, clip_coef, sum_of_squares};
use crate::spec::ModelSpec;
use crate::store::{HostSlab, HostStore};
use crate::train::{Span, StepMetrics, TrainConfig};

/// Adam's first and second moments, one vector per unit.
pub type Moments = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// Where the per-micro-batch layer inputs (activation checkpoints) live between the forward and
/// the backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    Device,
    Host,
}

/// How the streamer is laid out; the planner chooses these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleOptions {
    /// Largest micro-batch in tokens.
    pub max_tokens: usize,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    pub checkpoints: Tier,
    /// Threads of the optimizer worker's pool (0: one per core).
    pub optimizer_threads: usize,
    /// Units whose weights stay on the device: uploaded once per step (after their update)
    /// instead of once forward and once backward.
    pub resident: Vec<usize>,
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
    /// Part of that the schedule waited for (the rest was hidden behind device work).
    pub optimizer_exposed: Duration,
}

/// Events ordering the three streams, named after what they guard.
struct Events<B: Backend> {
    /// The upload into slot i has finished: compute may read it.
    weights_ready: [B::Event; 2],
    /// Compute has finished reading slot i: the next upload may overwrite it.
    slot_free: [B::Event; 2],
    /// A unit's gradients are complete on the device: d2h may copy them.
    grads_ready: B::Event,
    /// The gradient copy has finished: the accumulator may be reused and the host may read.
    grads_landed: B::Event,
    /// Checkpoint transfers (either direction) of the current unit have finished.
    checkpoints_moved: B::Event,
    /// A resident unit's new weights have arrived.
    resident_ready: B::Event,
    /// Compute has produced the activations a checkpoint copy reads.
    activations_ready: B::Event,
}

pub struct Streamer<'b, B: Backend> {
    b: &'b B,
    pub config: TrainConfig,
    options: ScheduleOptions,
    layout: Arc<ModelLayout>,
    decoder: Decoder<B>,
    store: Arc<HostStore>,
    worker: OptimizerWorker,
    /// Optimizer steps submitted.
    pub step: u64,
    h2d: B::Stream,
    compute: B::Stream,
    d2h: B::Stream,
    events: Events<B>,
    /// Unit weights on the device: slots 0 and 1 are the streaming double buffer, slots from 2
    /// on hold resident units.
    slots: Vec<B::Floats>,
    next_slot: usize,
    /// Per unit: its resident slot, if any, and the step whose weights that slot holds.
    resident_slot: Vec<Option<usize>>,
    resident_step: Vec<Option<u64>>,
    /// The embedding table kept on the device for a tied LM head.
    tied_table: Option<B::Floats>,
    /// f32 gradient accumulator of the unit being computed.
    grad_acc: B::Floats,
    /// The tied LM head's gradient, which joins the embedding's at the end of the backward.
    tied_grad: Option<B::Floats>,
    /// Device tier: `ckpt[c][b]` is the input of layer `c` (`c = layers`: of the head).
    ckpt_device: Vec<Vec<B::Floats>>,
    /// Host tier: the same, in host slabs; `work` holds the device copies in use.
    ckpt_host: Vec<Vec<HostSlab>>,
    work: [Vec<B::Floats>; 2],
    /// Activation gradients per micro-batch, flowing down the layers.
    dx: [Vec<B::Floats>; 2],
    layer_out: B::Floats,
    scratch: LayerScratch<B>,
    head: HeadScratch<B>,
    batches: Vec<DeviceBatch<B>>,
    traffic: StepTraffic,
    /// When the current step started, and what each unit did on each stream since.
    step_start: Instant,
    timeline: Vec<Span>,
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
        if options.max_tokens == 0 || options.grad_accum == 0 {
            return Err(Error::invalid("a step needs at least one micro-batch of one token"));
        }
        let layout = params.layout.clone();
        if *layout != ModelLayout::new(spec) {
            return Err(Error::invalid("parameters do not match the model spec's layout"));
        }
        let store = Arc::new(HostStore::new(params, b.weight_dtype())?);
        for u in 0..store.units() {
            let mut unit = store.lock(u)?;
            b.pin(&mut unit.stream)?;
            b.pin(&mut unit.grad)?;
        }
        let hyper = AdamW {
            lr: config.lr,
            beta1: config.beta1,
            beta2: config.beta2,
            eps: config.eps,
            weight_decay: config.weight_decay,
        };
        hyper.validate()?;
        let worker = OptimizerWorker::spawn(
            store.clone(),
            layout.clone(),
            hyper,
            options.optimizer_threads,
        )?;
        let decoder = Decoder::new(b, spec, layout.layer.clone(), layout.head.clone())?;

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
        let (ckpt_device, ckpt_host, work) = match options.checkpoints {
            Tier::Device => {
                let c = (0..=spec.layers).map(|_| per_mb(t * h)).collect::<Result<Vec<_>>>()?;
                (c, Vec::new(), [Vec::new(), Vec::new()])
            }
            Tier::Host => {
                let bytes = t * h * b.elem_bytes(FloatKind::Activation);
                let mut host = Vec::with_capacity(spec.layers + 1);
                for _ in 0..=spec.layers {
                    let mut row = Vec::with_capacity(g);
                    for _ in 0..g {
                        let mut slab = HostSlab::zeroed(bytes)?;
                        b.pin(&mut slab)?;
                        row.push(slab);
                    }
                    host.push(row);
                }
                (Vec::new(), host, [per_mb(t * h)?, per_mb(t * h)?])
            }
        };
        let tied = spec.tie_embeddings;
        let embed_len = layout.units[0].len;
        let units = layout.units.len();
        let mut slots = vec![act(largest)?, act(largest)?];
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
        let scratch = LayerScratch::new(b, spec, t)?;
        let head = HeadScratch::new(b, spec, t)?;
        // Token ids, positions, targets and document bounds: four i32 arrays per micro-batch.
        let batch_bytes = g * (4 * t + 1) * 4;
        let mut streamer = Streamer {
            b,
            config,
            options,
            decoder,
            store,
            worker,
            step: 0,
            h2d: b.new_stream()?,
            compute: b.new_stream()?,
            d2h: b.new_stream()?,
            events: Events {
                weights_ready: [b.new_event()?, b.new_event()?],
                slot_free: [b.new_event()?, b.new_event()?],
                grads_ready: b.new_event()?,
                grads_landed: b.new_event()?,
                checkpoints_moved: b.new_event()?,
                activations_ready: b.new_event()?,
                resident_ready: b.new_event()?,
            },
            slots,
            next_slot: 0,
            resident_slot,
            resident_step: vec![None; units],
            tied_table: if tied { Some(act(embed_len)?) } else { None },
            grad_acc: acc(largest)?,
            tied_grad: if tied { Some(acc(embed_len)?) } else { None },
            ckpt_device,
            ckpt_host,
            work,
            dx: [per_mb(t * h)?, per_mb(t * h)?],
            layer_out: act(t * h)?,
            device_bytes: 0,
            scratch,
            head,
            batches: (0..g).map(|_| DeviceBatch::new(b, t)).collect::<Result<_>>()?,
            traffic: StepTraffic::default(),
            step_start: Instant::now(),
            timeline: Vec::new(),
            layout,
        };
        streamer.device_bytes =
            counted.get() + streamer.scratch.bytes + streamer.head.bytes + batch_bytes;
        b.set_compute_stream(&streamer.compute)?;
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
    /// resident unit is uploaded only once per step, a streamed one into the next slot of the
    /// double buffer. Either waits for the unit's last update first.
    fn load_unit(&mut self, u: usize) -> Result<usize> {
        if let Some(slot) = self.resident_slot[u] {
            return self.load_resident(u, slot);
        }
        let (b, slot) = (self.b, self.next_slot);
        self.next_slot = 1 - slot;
        let waited = self.store.wait_applied(u, self.step)?;
        self.traffic.optimizer_exposed += waited;
        let len = self.layout.units[u].len;
        // The upload waits until compute has finished with the slot's previous unit.
        b.wait(&self.h2d, &self.events.slot_free[slot])?;
        let started = Instant::now();
        {
            let unit = self.store.lock(u)?;
            b.upload_on(&self.h2d, b.view_mut(&mut self.slots[slot], 0..len), &unit.stream, 0)?;
        }
        b.record(&self.events.weights_ready[slot], &self.h2d)?;
        self.span(u, "h2d", started);
        // Compute waits for the weights to arrive.
        b.wait(&self.compute, &self.events.weights_ready[slot])?;
        self.traffic.h2d_bytes += (len * self.b.weight_dtype().bytes()) as u64;
        Ok(slot)
    }

    fn load_resident(&mut self, u: usize, slot: usize) -> Result<usize> {
        if self.resident_step[u] == Some(self.step) {
            return Ok(slot);
        }
        let b = self.b;
        self.traffic.optimizer_exposed += self.store.wait_applied(u, self.step)?;
        let len = self.layout.units[u].len;
        // Compute may still read last step's weights: the upload waits for all work so far.
        b.record(&self.events.activations_ready, &self.compute)?;
        b.wait(&self.h2d, &self.events.activations_ready)?;
        let started = Instant::now();
        {
            let unit = self.store.lock(u)?;
            b.upload_on(&self.h2d, b.view_mut(&mut self.slots[slot], 0..len), &unit.stream, 0)?;
        }
        b.record(&self.events.resident_ready, &self.h2d)?;
        self.span(u, "h2d", started);
        b.wait(&self.compute, &self.events.resident_ready)?;
        self.resident_step[u] = Some(self.step);
        self.traffic.h2d_bytes += (len * b.weight_dtype().bytes()) as u64;
        Ok(slot)
    }

    /// Marks the end of compute's use of `slot` (resident slots need no mark).
    fn release_slot(&self, slot: usize) -> Result<()> {
        match self.events.slot_free.get(slot) {
            Some(event) => self.b.record(event, &self.compute),
            None => Ok(()),
        }
    }

    /// Copies unit `u`'s complete gradients (in `grad_acc`) into its host slab and records
    /// their sum of squares. Returns once they have landed.
    fn land_grads(&mut self, u: usize) -> Result<()> {
        let b = self.b;
        let len = self.layout.units[u].len;
        b.record(&self.events.grads_ready, &self.compute)?;
        b.wait(&self.d2h, &self.events.grads_ready)?;
        let started = Instant::now();
        let mut unit = self.store.lock(u)?;
        b.download_on(&self.d2h, &mut unit.grad, 0, b.view(&self.grad_acc, 0..len))?;
        b.record(&self.events.grads_landed, &self.d2h)?;
        // The host reads the gradients and the accumulator is zeroed next: both wait here.
        b.synchronize(&self.events.grads_landed)?;
        unit.grad_sumsq = sum_of_squares(unit.grad.as_f32());
        self.traffic.d2h_bytes += (len * 4) as u64;
        drop(unit);
        self.span(u, "d2h", started);
        Ok(())
    }

    fn zero_grad_acc(&mut self) -> Result<()> {
        let n = self.b.len(&self.grad_acc);
        self.b.fill_zero(self.b.view_mut(&mut self.grad_acc, 0..n))
    }

    /// Host tier: queues the copy of a freshly computed layer input `x` (`n` elements) to its
    /// host checkpoint, after the compute that produced it. Returns the bytes moved.
    #[allow(clippy::too_many_arguments)]
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
        b.download_on(d2h, dst, 0, b.view(x, 0..n))?;
        b.record(&events.checkpoints_moved, d2h)?;
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

    /// One optimizer step over the G micro-batches of `micro`.
    pub fn step(&mut self, micro: &[MicroBatch]) -> Result<(StepMetrics, StepTraffic)> {
        let start = Instant::now();
        let g = micro.len();
        if g == 0 || g > self.options.grad_accum {
            return Err(Error::invalid(format!(
                "a step takes 1 to {} micro-batches, got {g}",
                self.options.grad_accum
            )));
        }
        let trained: usize = micro.iter().map(MicroBatch::trained_tokens).sum();
        if trained == 0 {
            return Err(Error::invalid(
                "no token in this step carries loss (all are prompt or padding)",
            ));
        }
        let tokens: usize = micro.iter().map(|m| m.ids.len()).sum();
        self.traffic = StepTraffic::default();
        self.step_start = start;
        self.timeline.clear();
        self.upload_batches(micro)?;
        let lr = self.next_lr();
        let clip = self.config.max_grad_norm;

        let submit_early = clip.is_none();
        let loss_sum = self.forward(g, Some((1.0 / trained as f32, lr, submit_early)))?;
        let loss = loss_sum / trained as f64;
        let forward_done = Instant::now();
        self.backward(g, lr, submit_early)?;
        let backward_done = Instant::now();

        // The global norm, summed in unit order so it does not depend on landing order.
        let units = self.store.units();
        let mut total = 0.0;
        for u in 0..units {
            total += self.store.lock(u)?.grad_sumsq;
        }
        let mut grad_norm = total.sqrt();
        self.step += 1;
        match clip {
            Some(max_norm) => {
                let coef = clip_coef(grad_norm, max_norm)?;
                // Reported as torch's `clip_grad_norm_` returns it: an f32.
                grad_norm = f64::from(grad_norm as f32);
                // Forward order: the next step needs unit 0 first.
                for unit in 0..units {
                    self.worker.submit(AdamJob { unit, step: self.step, lr, coef })?;
                }
            }
            None if !grad_norm.is_finite() => {
                return Err(Error::Numerical(format!(
                    "gradient norm is {grad_norm} at step {}",
                    self.step
                )));
            }
            None => {}
        }
        self.traffic.forward = forward_done - start;
        self.traffic.backward = backward_done - forward_done;
        self.traffic.optimizer_busy = self.worker.take_busy();
        let elapsed = start.elapsed();
        let metrics = StepMetrics {
            step: self.step,
            loss,
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
    /// then the head. Returns the summed loss. With `train` set (the loss scale, the learning
    /// rate, and whether updates start as gradients land), the head also computes its gradients
    /// and lands them; without it (evaluation) no checkpoint leaves the device and no gradient
    /// is formed.
    fn forward(&mut self, g: usize, train: Option<(f32, f32, bool)>) -> Result<f64> {
        let (b, layers, h) = (self.b, self.decoder.spec.layers, self.decoder.spec.hidden);
        let host = self.options.checkpoints == Tier::Host;
        let keep = train.is_some();

        let slot = self.load_unit(0)?;
        let started = Instant::now();
        for mb in 0..g {
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
        if let Some(table) = &mut self.tied_table {
            // The tied head reads the embedding table at the end of the forward: keep a copy
            // while it is in the slot rather than streaming it a second time.
            let n = self.layout.units[0].len;
            b.copy(b.view_mut(table, 0..n), b.view(&self.slots[slot], 0..n))?;
        }
        self.release_slot(slot)?;
        self.span(0, "compute", started);

        // Layer l reads checkpoint l and writes checkpoint l + 1 (host tier: through the two
        // working sets, l's input in work[l % 2]).
        for l in 0..layers {
            let slot = self.load_unit(l + 1)?;
            let started = Instant::now();
            for mb in 0..g {
                let batch = &self.batches[mb];
                if host {
                    let [w0, w1] = &mut self.work;
                    let (x_in, x_out) =
                        if l % 2 == 0 { (&w0[mb], &mut w1[mb]) } else { (&w1[mb], &mut w0[mb]) };
                    self.decoder.layer_forward(
                        b,
                        x_out,
                        x_in,
                        &self.slots[slot],
                        &mut self.scratch,
                        batch,
                        l,
                    )?;
                    if !keep {
                        continue;
                    }
                    let n = batch.tokens * h;
                    let dst = &mut self.ckpt_host[l + 1][mb];
                    self.traffic.d2h_bytes += Self::checkpoint_out(
                        b,
                        &self.compute,
                        &self.d2h,
                        &self.events,
                        dst,
                        x_out,
                        n,
                    )?;
                } else {
                    let (done, rest) = self.ckpt_device.split_at_mut(l + 1);
                    let (x_in, x_out) = (&done[l][mb], &mut rest[0][mb]);
                    self.decoder.layer_forward(
                        b,
                        x_out,
                        x_in,
                        &self.slots[slot],
                        &mut self.scratch,
                        batch,
                        l,
                    )?;
                }
            }
            self.release_slot(slot)?;
            self.span(l + 1, "compute", started);
        }
        // Host checkpoints must be complete before their working copies are overwritten.
        b.synchronize(&self.events.checkpoints_moved)?;
        let loss = self.head(g, train.map(|(scale, _, _)| scale))?;
        if !loss.is_finite() {
            return Err(Error::Numerical(format!("loss is {loss} at step {}", self.step + 1)));
        }
        if let Some((_, lr, submit_early)) = train {
            let head_unit = self.layout.head_unit();
            self.land_grads(head_unit)?;
            if submit_early && self.tied_grad.is_none() {
                let job = AdamJob { unit: head_unit, step: self.step + 1, lr, coef: 1.0 };
                self.worker.submit(job)?;
            }
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

    /// Head forward and, with a loss `scale`, backward for every micro-batch: the loss, `dx[0]`
    /// for the top layer, and the head's gradients in `grad_acc` (a tied LM head's in
    /// `tied_grad`).
    fn head(&mut self, g: usize, scale: Option<f32>) -> Result<f64> {
        let (b, layers) = (self.b, self.decoder.spec.layers);
        let head_unit = self.layout.head_unit();
        let slot = self.load_unit(head_unit)?;
        let started = Instant::now();
        self.zero_grad_acc()?;
        if let Some(tied) = &mut self.tied_grad {
            let n = b.len(tied);
            b.fill_zero(b.view_mut(tied, 0..n))?;
        }
        let host = self.options.checkpoints == Tier::Host;
        let mut loss = 0.0;
        for mb in 0..g {
            let x = if host { &self.work[layers % 2][mb] } else { &self.ckpt_device[layers][mb] };
            let head_w = &self.slots[slot];
            // Untied heads never read the table argument.
            let table = self.tied_table.as_ref().unwrap_or(head_w);
            let batch = &self.batches[mb];
            loss += self.decoder.head_forward(b, &mut self.head, x, head_w, table, batch)?;
            let Some(scale) = scale else { continue };
            self.decoder.head_backward(
                b,
                &mut self.dx[0][mb],
                &mut self.grad_acc,
                self.tied_grad.as_mut(),
                &mut self.head,
                x,
                head_w,
                table,
                batch,
                scale,
            )?;
        }
        self.release_slot(slot)?;
        self.span(head_unit, "compute", started);
        Ok(loss)
    }

    /// Layers from the top down, recomputing each from its checkpoint, then the embedding.
    /// Each unit's gradients land in the host store as soon as they are complete.
    fn backward(&mut self, g: usize, lr: f32, submit_early: bool) -> Result<()> {
        let (b, layers, h) = (self.b, self.decoder.spec.layers, self.decoder.spec.hidden);
        let host = self.options.checkpoints == Tier::Host;
        let next_step = self.step + 1;
        // dx[cur][mb] holds the gradient with respect to the current layer's output.
        let mut cur = 0;
        for l in (0..layers).rev() {
            let slot = self.load_unit(l + 1)?;
            let started = Instant::now();
            self.zero_grad_acc()?;
            for mb in 0..g {
                let batch = &self.batches[mb];
                if host {
                    // Bring the checkpoint back into a working buffer compute no longer reads.
                    let n = batch.tokens * h;
                    b.record(&self.events.activations_ready, &self.compute)?;
                    b.wait(&self.h2d, &self.events.activations_ready)?;
                    let dst = b.view_mut(&mut self.work[0][mb], 0..n);
                    b.upload_on(&self.h2d, dst, &self.ckpt_host[l][mb], 0)?;
                    b.record(&self.events.checkpoints_moved, &self.h2d)?;
                    b.wait(&self.compute, &self.events.checkpoints_moved)?;
                    self.traffic.h2d_bytes += (n * b.elem_bytes(FloatKind::Activation)) as u64;
                }
                let x_in = if host { &self.work[0][mb] } else { &self.ckpt_device[l][mb] };
                let w = &self.slots[slot];
                self.decoder.layer_forward(
                    b,
                    &mut self.layer_out,
                    x_in,
                    w,
                    &mut self.scratch,
                    batch,
                    l,
                )?;
                let [d0, d1] = &mut self.dx;
                let (dx_out, dx_in) =
                    if cur == 0 { (&d0[mb], &mut d1[mb]) } else { (&d1[mb], &mut d0[mb]) };
                self.decoder.layer_backward(
                    b,
                    dx_in,
                    &mut self.grad_acc,
                    dx_out,
                    x_in,
                    w,
                    &mut self.scratch,
                    batch,
                    l,
                )?;
            }
            cur = 1 - cur;
            self.release_slot(slot)?;
            self.span(l + 1, "compute", started);
            self.land_grads(l + 1)?;
            if submit_early {
                self.worker.submit(AdamJob { unit: l + 1, step: next_step, lr, coef: 1.0 })?;
            }
        }

        // The embedding's gradient: a tied head's contribution first, then the scatter.
        let started = Instant::now();
        match &self.tied_grad {
            Some(tied) => {
                let n = b.len(tied);
                b.copy(b.view_mut(&mut self.grad_acc, 0..n), b.view(tied, 0..n))?;
            }
            None => self.zero_grad_acc()?,
        }
        for mb in 0..g {
            self.decoder.embed_backward(
                b,
                &mut self.grad_acc,
                &self.dx[cur][mb],
                &self.batches[mb],
            )?;
        }
        self.span(0, "compute", started);
        self.land_grads(0)?;
        if submit_early {
            self.worker.submit(AdamJob { unit: 0, step: next_step, lr, coef: 1.0 })?;
            if self.tied_grad.is_some() {
                let unit = self.layout.head_unit();
                self.worker.submit(AdamJob { unit, step: next_step, lr, coef: 1.0 })?;
            }
        }
        Ok(())
    }

    /// This step's spans plus the optimizer's updates that finished during it, in start order.
    fn take_timeline(&mut self) -> Vec<Span> {
        let origin = self.step_start;
        let at = |t: Instant| t.saturating_duration_since(origin).as_secs_f64();
        let mut spans = std::mem::take(&mut self.timeline);
        for (unit, from, to) in self.worker.take_spans() {
            spans.push(Span { unit, stream: "optimizer", start: at(from), end: at(to) });
        }
        spans.sort_by(|a, b| a.start.total_cmp(&b.start));
        spans
    }

    /// Continues from a saved state: `step` optimizer steps taken, Adam moments per unit. The
    /// master weights came in through [`Streamer::new`].
    pub fn restore(&mut self, step: u64, m: &[Vec<f32>], v: &[Vec<f32>]) -> Result<()> {
        if self.step != 0 {
            return Err(Error::invalid("a state can only be restored before the first step"));
        }
        if m.len() != self.store.units() || v.len() != self.store.units() {
            return Err(Error::invalid("the saved state has a different number of units"));
        }
        for (u, (m, v)) in m.iter().zip(v).enumerate() {
            let mut unit = self.store.lock(u)?;
            if m.len() != unit.m.len() || v.len() != unit.v.len() {
                return Err(Error::invalid(format!(
                    "the saved moments of unit {u} have the wrong size"
                )));
            }
            unit.m.copy_from_slice(m);
            unit.v.copy_from_slice(v);
        }
        self.step = step;
        self.store.set_applied(step)
    }

    /// Waits for every submitted update and returns the Adam moments per unit, `(m, v)`.
    pub fn moments(&mut self) -> Result<Moments> {
        let (mut m, mut v) = (Vec::new(), Vec::new());
        for u in 0..self.store.units() {
            self.store.wait_applied(u, self.step)?;
            let unit = self.store.lock(u)?;
            m.push(unit.m.clone());
            v.push(unit.v.clone());
        }
        Ok((m, v))
    }

    /// Waits for every submitted update and returns the master weights.
    pub fn params(&mut self) -> Result<HostParams> {
        for u in 0..self.store.units() {
            self.traffic.optimizer_exposed += self.store.wait_applied(u, self.step)?;
        }
        self.store.snapshot(self.layout.clone())
    }

    /// Stops the optimizer worker, surfacing any error it hit.
    pub fn finish(&mut self) -> Result<HostParams> {
        let params = self.params()?;
        self.worker.finish()?;
        Ok(params)
    }
}
