//! Weight gradients between the device and the optimizer, in the three tiers the planner
//! chooses from (see [`GradientTier`]):
//!
//! - **device store**: one f32 accumulator per unit; gradients wait on the device until the
//!   global norm is known, then land unit by unit, in forward order, in the host ring while the
//!   next step's forward runs ([`Grads::pump`]);
//! - **host store**: two accumulators used in turn; each unit's gradients ship to its own host
//!   slab as soon as they are complete, overlapping the next unit's backward;
//! - **host ring** (clipping off): the same two accumulators, landing in the two-slot ring and
//!   handed to the optimizer at once;
//! - **bf16 host store**: as the host store, but each unit's gradients are rounded into a
//!   weight-dtype buffer on the device once their fp32 sum of squares is taken, and ship at half
//!   the bytes to half-size slabs.
//!
//! A *lane* is a landing path with its own event and at most one copy in flight: with two
//! accumulators lane `i` copies accumulator `i`; the device store has one lane per ring slot,
//! so up to ring slots - 1 units land ahead of the one the forward needs and the optimizer
//! never waits for a copy. Finishing a lane waits for its copy and hands the unit's update to
//! the optimizer. Ring slots rotate independently of lanes, so an update may lag its landing by
//! a few units before the schedule waits for a free slot.
//!
//! With data parallelism each unit's gradients are first summed over the ranks (on compute),
//! then every rank measures the sum and rank 0 alone lands it. A tied LM head's gradient has
//! its own accumulator, which joins the embedding's at the end of the backward.
//!
//! Events owned here, one of each per lane: `ready` (compute has finished the gradients the
//! lane copies) and `landed` (the lane's copy has finished).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::clock::Clock;
use super::{AdamJob, GradAt, OptimizerWorker, Shared, Streams};
use crate::backend::{AllReduce, Backend, FloatKind};
use crate::error::{Error, Result};
use crate::placement::GradientTier;
use crate::store::HostStore;

/// A copy in flight on a lane: the unit, and the update to submit once it has landed (none when
/// the update waits for the global norm).
#[derive(Debug, Clone, Copy)]
struct Landing {
    unit: usize,
    job: Option<AdamJob>,
}

/// A unit whose gradients are complete on the device (two-accumulator tiers) but whose copy is
/// not queued yet: it is queued once the next unit's backward is (see [`Grads::end`]).
#[derive(Debug, Clone, Copy)]
struct Pending {
    unit: usize,
    lane: usize,
    job: Option<AdamJob>,
}

/// What shipping a unit's gradients needs of the schedule: the backend, the host store they land
/// in, the optimizer worker their updates go to, and the two streams each copy is ordered
/// between (queued on `d2h` after `compute`'s backward).
pub(super) struct GradPath<'a, B: Backend> {
    pub b: &'a B,
    pub store: &'a HostStore,
    pub worker: &'a OptimizerWorker,
    pub compute: &'a B::Stream,
    pub d2h: &'a B::Stream,
}

impl<'a, B: Backend> GradPath<'a, B> {
    pub fn new(b: &'a B, shared: &'a Shared, streams: &'a Streams<B>) -> Self {
        GradPath {
            b,
            store: &shared.store,
            worker: &shared.worker,
            compute: &streams.compute,
            d2h: &streams.d2h,
        }
    }
}

/// What [`Grads::end`] and [`Grads::pump`] report back to the schedule.
#[derive(Debug, Default, Clone)]
pub(super) struct Landed {
    pub bytes: u64,
    /// Units whose gradients were shipped.
    pub units: Vec<usize>,
    /// Time the schedule waited for the optimizer to free a ring slot.
    pub waited: Duration,
}

pub(super) struct Grads<B: Backend> {
    pub tier: GradientTier,
    /// Device store: one accumulator per unit. Otherwise: two, used in turn.
    acc: Vec<B::Floats>,
    /// bf16 host store: per accumulator, the weight-dtype buffer its gradients are rounded
    /// into and shipped from. Empty otherwise.
    rounded: Vec<B::Floats>,
    lens: Vec<usize>,
    /// The accumulator the current unit uses (two-accumulator tiers).
    current: usize,
    next_lane: usize,
    in_flight: Vec<Option<Landing>>,
    /// The ring slot the next landing uses.
    next_slot: usize,
    /// Slots of the host ring (device store: one lane each).
    ring_slots: usize,
    /// Per lane, compute has finished the gradients the lane copies: the copy may start.
    ready: Vec<B::Event>,
    /// Two-accumulator tiers: the unit whose copy waits for the next unit's backward to be
    /// queued.
    pending: Option<Pending>,
    /// A lane's copy has finished: its destination may be read, its source reused.
    landed: Vec<B::Event>,
    /// Whether this rank lands gradients (data parallelism: rank 0 alone does; the others only
    /// contribute to the sum and measure it).
    pub lands: bool,
    /// Per unit, this step's sum of squared gradients.
    pub sumsq: Vec<f64>,
    /// Device store: updates whose gradients still wait on the device, in forward order.
    waiting: VecDeque<AdamJob>,
    /// The tied LM head's gradient, which joins the embedding's at the end of the backward.
    tied: Option<B::Floats>,
}

impl<B: Backend> Grads<B> {
    /// Allocates the accumulators for `tier`, and a tied LM head's (`tied`: the embedding's
    /// length); returns them with their device bytes.
    pub fn new(
        b: &B,
        tier: GradientTier,
        ring_slots: usize,
        lens: Vec<usize>,
        lands: bool,
        tied: Option<usize>,
    ) -> Result<(Grads<B>, usize)> {
        let largest = lens.iter().copied().max().unwrap_or(0);
        let sizes: Vec<usize> = match tier {
            GradientTier::DeviceStore => lens.clone(),
            GradientTier::HostStore | GradientTier::HostStoreBf16 | GradientTier::HostRing => {
                vec![largest; 2]
            }
        };
        let acc = sizes.iter().map(|&n| b.alloc(n, FloatKind::Accum)).collect::<Result<_>>()?;
        let mut bytes = sizes.iter().sum::<usize>() * b.elem_bytes(FloatKind::Accum);
        let rounded = if tier == GradientTier::HostStoreBf16 {
            bytes += 2 * largest * b.elem_bytes(FloatKind::Activation);
            vec![b.alloc(largest, FloatKind::Activation)?, b.alloc(largest, FloatKind::Activation)?]
        } else {
            Vec::new()
        };
        let tied = match tied {
            Some(n) => {
                bytes += n * b.elem_bytes(FloatKind::Accum);
                Some(b.alloc(n, FloatKind::Accum)?)
            }
            None => None,
        };
        let units = lens.len();
        let lanes = if tier == GradientTier::DeviceStore { ring_slots } else { 2 };
        let grads = Grads {
            tier,
            lands,
            acc,
            rounded,
            lens,
            current: 0,
            next_lane: 0,
            in_flight: vec![None; lanes],
            next_slot: 0,
            ring_slots,
            ready: (0..lanes).map(|_| b.new_event()).collect::<Result<_>>()?,
            pending: None,
            landed: (0..lanes).map(|_| b.new_event()).collect::<Result<_>>()?,
            sumsq: vec![0.0; units],
            waiting: VecDeque::new(),
            tied,
        };
        Ok((grads, bytes))
    }

    fn per_unit(&self) -> bool {
        self.tier == GradientTier::DeviceStore
    }

    /// The accumulator unit `u` computes into, after [`Grads::begin`].
    pub fn acc(&mut self, u: usize) -> &mut B::Floats {
        let i = if self.per_unit() { u } else { self.current };
        &mut self.acc[i]
    }

    /// The head's accumulator and a tied head's, after [`Grads::begin`] and
    /// [`Grads::begin_tied`].
    pub fn head_accs(&mut self, u: usize) -> (&mut B::Floats, Option<&mut B::Floats>) {
        let i = if self.per_unit() { u } else { self.current };
        (&mut self.acc[i], self.tied.as_mut())
    }

    /// Zeroes a tied head's accumulator before the head's backward.
    pub fn begin_tied(&mut self, b: &B) -> Result<()> {
        if let Some(tied) = &mut self.tied {
            let n = b.len(tied);
            b.fill_zero(b.view_mut(tied, 0..n))?;
        }
        Ok(())
    }

    /// A tied head's gradient becomes the start of the embedding's (unit 0's accumulator,
    /// after [`Grads::begin`]), to which the scatter then adds.
    pub fn seed_embedding(&mut self, b: &B) -> Result<()> {
        let i = if self.per_unit() { 0 } else { self.current };
        if let Some(tied) = &self.tied {
            let n = b.len(tied);
            b.copy(b.view_mut(&mut self.acc[i], 0..n), b.view(tied, 0..n))?;
        }
        Ok(())
    }

    /// Prepares unit `u`'s accumulator: zeroed, and (two accumulators) no longer being copied.
    pub fn begin(&mut self, b: &B, worker: &OptimizerWorker, u: usize) -> Result<()> {
        if self.per_unit() {
            self.check_drained()?;
        } else {
            let lane = self.take_lane();
            self.finish(b, worker, lane)?;
            self.current = lane;
        }
        let acc = self.acc(u);
        let n = b.len(acc);
        b.fill_zero(b.view_mut(acc, 0..n))
    }

    fn take_lane(&mut self) -> usize {
        let lane = self.next_lane;
        self.next_lane = (lane + 1) % self.landed.len();
        lane
    }

    fn take_slot(&mut self) -> usize {
        let slot = self.next_slot;
        self.next_slot = (slot + 1) % self.ring_slots.max(1);
        slot
    }

    /// Unit `u`'s gradients are complete on this rank: summed over the ranks through `peers`,
    /// then measured and landed as [`Grads::end`] says, with `job` the update to follow them
    /// as soon as they land (clipping off).
    pub fn complete(
        &mut self,
        path: &GradPath<'_, B>,
        clock: &mut Clock<B>,
        peers: Option<&dyn AllReduce<B>>,
        u: usize,
        job: Option<AdamJob>,
    ) -> Result<()> {
        if let Some(peers) = peers {
            // Every rank sums the same units in the same order, so the collectives pair up;
            // each rank then measures (and rank 0 lands) the sum over all micro-batches.
            let len = self.lens[u];
            peers.all_reduce_sum(path.b, path.b.view_mut(self.acc(u), 0..len))?;
        }
        self.land(path, clock, |grads, path| grads.end(path, u, job))
    }

    /// Device store: lands gradients still on the device up to unit `upto` (all with `None`)
    /// and hands their updates over; see [`Grads::pump`].
    pub fn land_waiting(
        &mut self,
        path: &GradPath<'_, B>,
        clock: &mut Clock<B>,
        upto: Option<usize>,
    ) -> Result<()> {
        if !self.has_waiting() {
            return Ok(());
        }
        self.land(path, clock, |grads, path| grads.pump(path, upto))
    }

    /// Runs `f`, which ships gradients along `path`: its waits for ring slots count as waits
    /// for the optimizer, its bytes as d2h traffic, and each unit it shipped gets a d2h span on
    /// the timeline.
    pub fn land(
        &mut self,
        path: &GradPath<'_, B>,
        clock: &mut Clock<B>,
        f: impl FnOnce(&mut Self, &GradPath<'_, B>) -> Result<Landed>,
    ) -> Result<()> {
        let started = Instant::now();
        let landed = clock.optimizer_wait(path.b, path.compute, || {
            let landed = f(self, path)?;
            let waited = landed.waited;
            Ok((landed, waited))
        })?;
        clock.add_d2h(landed.bytes);
        for &u in &landed.units {
            clock.span(u, "d2h", started);
        }
        Ok(())
    }

    /// Unit `u`'s gradients are complete (queued on `path.compute`): records their sum of
    /// squares and, in the host tiers, ships them: to the unit's own slab, or to a ring slot
    /// with the update `job` that consumes them. The device store keeps them where they are.
    ///
    /// A unit's copy is queued at the next call (or [`Grads::flush`]), once the next unit's
    /// backward is queued ahead of it. Queued here, right after the host has waited for the
    /// device, the copy left the compute stream idle for about the copy's time after every
    /// unit: in a profiled step of Qwen2.5-7B at 2 x 32,768 tokens on the H100, 0.514 s in 29
    /// gaps (longest 39 ms, the 2.2 GB head), against 0.001 s queued one unit later.
    pub fn end(
        &mut self,
        path: &GradPath<'_, B>,
        u: usize,
        job: Option<AdamJob>,
    ) -> Result<Landed> {
        let (b, worker) = (path.b, path.worker);
        let len = self.lens[u];
        let landed = self.ship_pending(path)?;
        if !self.per_unit() && self.lands {
            // Recorded now, behind this unit's backward and ahead of the next unit's.
            self.mark_ready(path, self.current, self.current, len)?;
        }
        // Waits for the unit's backward: the schedule prefetched the next unit's weights before
        // calling this, so the device keeps copying while the host waits.
        self.sumsq[u] = b.sum_squares(b.view(self.acc(u), 0..len))?;
        if self.per_unit() || !self.lands {
            return Ok(landed);
        }
        let lane = self.current;
        self.pending = Some(Pending { unit: u, lane, job });
        // The previous unit's copy has had a whole backward to finish: hand it over now rather
        // than one unit later.
        self.finish(b, worker, 1 - lane)?;
        Ok(landed)
    }

    /// Queues the copy of the pending unit's gradients, if any (see [`Grads::end`]).
    fn ship_pending(&mut self, path: &GradPath<'_, B>) -> Result<Landed> {
        let mut landed = Landed::default();
        let Some(Pending { unit: u, lane, job }) = self.pending.take() else {
            return Ok(landed);
        };
        let dest = match self.tier {
            GradientTier::HostRing => {
                let slot = self.take_slot();
                landed.waited = path.store.ring().acquire(slot)?;
                GradAt::Ring(slot)
            }
            _ => GradAt::Unit,
        };
        landed.bytes = self.queue_copy(path, lane, lane, u, dest)?;
        landed.units.push(u);
        let job = job.map(|j| AdamJob { grad: dest, ..j });
        self.in_flight[lane] = Some(Landing { unit: u, job });
        Ok(landed)
    }

    /// Marks on `path.compute` that accumulator `acc`'s first `len` gradients are complete,
    /// rounding them first in the bf16 host store: `lane`'s copy of them may start from there.
    fn mark_ready(
        &mut self,
        path: &GradPath<'_, B>,
        lane: usize,
        acc: usize,
        len: usize,
    ) -> Result<()> {
        let b = path.b;
        if let Some(rounded) = self.rounded.get_mut(acc) {
            // Queued on compute after the gradients, and read by the copy only after it: the
            // buffer is reused only once this lane's copy has finished (`begin`).
            b.copy(b.view_mut(rounded, 0..len), b.view(&self.acc[acc], 0..len))?;
        }
        b.record(&self.ready[lane], path.compute)
    }

    /// Queues the copy of accumulator `acc` (unit `u`'s gradients) to `dest` on `path.d2h`,
    /// after the compute that produced them (`lane`'s [`Grads::mark_ready`], which the caller
    /// queued); returns the bytes.
    fn queue_copy(
        &mut self,
        path: &GradPath<'_, B>,
        lane: usize,
        acc: usize,
        u: usize,
        dest: GradAt,
    ) -> Result<u64> {
        let GradPath { b, store, d2h, .. } = *path;
        let len = self.lens[u];
        let elem = if self.rounded.is_empty() { 4 } else { b.elem_bytes(FloatKind::Activation) };
        b.wait(d2h, &self.ready[lane])?;
        let src = match self.rounded.get(acc) {
            Some(rounded) => b.view(rounded, 0..len),
            None => b.view(&self.acc[acc], 0..len),
        };
        match dest {
            GradAt::Unit => {
                let mut unit = store.lock(u)?;
                // SAFETY: the slab lives in the store for the whole run and nothing reads it
                // before `finish` has synchronized `landed[lane]`; the accumulator is reused
                // only after that too (`begin`), and the schedule drains every stream before
                // dropping either.
                unsafe { b.download_on(d2h, &mut unit.grad, 0, src)? };
            }
            GradAt::Ring(slot) => {
                let mut slab = store.ring().lock(slot)?;
                // SAFETY: as above; the ring slot is taken (`acquire`) and stays so until the
                // optimizer, which gets it only after `finish`, releases it.
                unsafe { b.download_on(d2h, &mut slab, 0, src)? };
            }
        }
        b.record(&self.landed[lane], d2h)?;
        Ok((len * elem) as u64)
    }

    /// Waits for `lane`'s copy, if any, and submits the update waiting on it.
    fn finish(&mut self, b: &B, worker: &OptimizerWorker, lane: usize) -> Result<()> {
        if let Some(landing) = self.in_flight[lane].take() {
            b.synchronize(&self.landed[lane])?;
            if let Some(job) = landing.job {
                worker.submit(job)?;
            }
        }
        Ok(())
    }

    /// Queues the pending copy, waits for every copy in flight and submits their updates.
    pub fn flush(&mut self, path: &GradPath<'_, B>) -> Result<Landed> {
        let landed = self.ship_pending(path)?;
        let (b, worker) = (path.b, path.worker);
        for i in 0..self.landed.len() {
            let lane = (self.next_lane + i) % self.landed.len();
            self.finish(b, worker, lane)?;
        }
        Ok(landed)
    }

    /// Device store: queues every unit's update (forward order) for [`Grads::pump`].
    pub fn defer(&mut self, jobs: impl IntoIterator<Item = AdamJob>) {
        self.waiting.extend(jobs);
    }

    /// Device store: lands waiting gradients in the ring, in forward order, until units `upto`
    /// to `upto + ring slots - 1` are landed or in flight (all of them with `None`), and submits
    /// the update of every landed unit but the newest (and of unit `upto` in any case). Unit
    /// `upto`'s update is then queued, so the caller may wait for it, while the updates of the
    /// next units queue behind it and their copies run.
    pub fn pump(&mut self, path: &GradPath<'_, B>, upto: Option<usize>) -> Result<Landed> {
        let (b, store, worker) = (path.b, path.store, path.worker);
        let mut landed = Landed::default();
        let bound = upto.unwrap_or(usize::MAX);
        let lanes = self.landed.len();
        while let Some(job) = self.waiting.front().copied() {
            if job.unit > bound.saturating_add(lanes - 1) {
                break;
            }
            self.waiting.pop_front();
            let lane = self.take_lane();
            // Submits the update that used this lane's ring slot, so acquiring it cannot wait
            // on an update nobody has queued.
            self.finish(b, worker, lane)?;
            landed.waited += store.ring().acquire(lane)?;
            let dest = GradAt::Ring(lane);
            self.mark_ready(path, lane, job.unit, self.lens[job.unit])?;
            landed.bytes += self.queue_copy(path, lane, job.unit, job.unit, dest)?;
            landed.units.push(job.unit);
            let job = AdamJob { grad: dest, ..job };
            self.in_flight[lane] = Some(Landing { unit: job.unit, job: Some(job) });
        }
        // Hand over, oldest first, every landing but the one just queued (their copies have had
        // a unit's compute to finish), and that one too if the caller needs its unit now.
        for i in 0..lanes {
            let lane = (self.next_lane + i) % lanes;
            let newest = i == lanes - 1;
            if self.in_flight[lane].is_some_and(|l| !newest || l.unit <= bound) {
                self.finish(b, worker, lane)?;
            }
        }
        Ok(landed)
    }

    /// Device store: unit `u`'s gradients of the last backward, read back to the host (they
    /// stay on the device until the next backward zeroes them); `None` in the other tiers,
    /// whose accumulators are reused unit after unit.
    pub fn read_stored(&mut self, b: &B, u: usize) -> Result<Option<Vec<f32>>> {
        if !self.per_unit() {
            return Ok(None);
        }
        let len = self.lens[u];
        let mut out = vec![0.0; len];
        b.download(&mut out, b.view(self.acc(u), 0..len))?;
        Ok(Some(out))
    }

    /// Whether updates still wait for their gradients to leave the device.
    pub fn has_waiting(&self) -> bool {
        !self.waiting.is_empty()
            || self.pending.is_some()
            || self.in_flight.iter().any(Option::is_some)
    }

    /// Sum of every unit's squared gradients, in unit order (so it does not depend on when
    /// each landed).
    pub fn total_sumsq(&self) -> f64 {
        self.sumsq.iter().sum()
    }

    /// The device buffers are about to be reused for a new backward: nothing may still wait.
    pub fn check_drained(&self) -> Result<()> {
        if self.has_waiting() {
            return Err(Error::invalid("gradients of the previous step are still on the device"));
        }
        Ok(())
    }
}
