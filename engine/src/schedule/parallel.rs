//! Data parallelism over the devices of one host: one [`Streamer`] per device, each on its own
//! host thread for the length of a step, sharing one host store and one optimizer worker.
//!
//! ```text
//! step      micro-batches split in contiguous shares, one per rank; loss scale 1 / (tokens
//!           trained by the whole step), so the per-rank gradients add up to the step's mean
//! each rank forward and backward of its share, streaming every unit's weights from the one
//!           host store over its own link
//! unit u    gradients complete on every rank -> all-reduce (sum) across ranks, in place ->
//!           every rank measures the same sum of squares; rank 0 alone lands it on the host
//!           and submits u's update; the others drop it
//! next step every rank waits for u's update before uploading u (the store's step counter)
//! ```
//!
//! An update never races a read: rank 0 submits unit u's update only once u's all-reduce has
//! completed on its device, and no rank's collective completes before every rank has queued its
//! own, after the last compute that reads u's weights this step; the next step's uploads of u
//! wait for the update on the shared store's step counter.
//!
//! Results: with one rank the all-reduce leaves the accumulator as it is, so the step equals the
//! single-device streamer's bit for bit. With N ranks the gradient of unit u is
//! `sum_r (sum over rank r's micro-batches)` instead of one running sum over all micro-batches:
//! the same value up to f32 rounding of the different association. For a fixed N and a fixed
//! split, every run gives the same bits (NCCL's ring order for a given communicator, rank order
//! on the CPU).
//!
//! A failure on one rank during a step leaves the others waiting in their next collective: the
//! driver checks everything it can (shares, sizes, tokens) before the ranks start.

use std::sync::{Arc, Barrier, RwLock};

use super::{ScheduleOptions, Shared, StepTraffic, Streamer};
use crate::backend::cpu::Cpu;
use crate::backend::{AllReduce, Backend};
use crate::data::MicroBatch;
use crate::error::{Error, Result};
use crate::model::HostParams;
use crate::spec::ModelSpec;
use crate::step::{StepMetrics, TrainConfig};

/// Splits `micro` into `ranks` contiguous shares whose sizes differ by at most one.
pub fn split_micro(micro: &[MicroBatch], ranks: usize) -> Vec<&[MicroBatch]> {
    let g = micro.len();
    (0..ranks).map(|r| &micro[r * g / ranks..(r + 1) * g / ranks]).collect()
}

/// Several streamers, one per device, training one model together.
pub struct DataParallel<'b, B: Backend> {
    ranks: Vec<Streamer<'b, B>>,
    /// Micro-batches per step over every rank.
    grad_accum: usize,
}

impl<'b, B: Backend> DataParallel<'b, B>
where
    Streamer<'b, B>: Send,
{
    /// One rank per backend; `peers[r]` is rank r's link to the others (rank r, world size
    /// `backends.len()`). `options.grad_accum` counts the micro-batches of a whole step, at
    /// least one per rank; each rank is sized for its largest share.
    pub fn new(
        backends: &[&'b B],
        peers: Vec<Box<dyn AllReduce<B> + 'b>>,
        spec: &ModelSpec,
        params: HostParams,
        config: TrainConfig,
        options: ScheduleOptions,
    ) -> Result<Self> {
        let world = backends.len();
        let Some(&first) = backends.first() else {
            return Err(Error::invalid("data parallelism needs at least one device"));
        };
        if peers.len() != world {
            return Err(Error::invalid(format!(
                "{world} devices but {} communicator ranks",
                peers.len()
            )));
        }
        for (r, p) in peers.iter().enumerate() {
            if p.rank() != r || p.world() != world {
                return Err(Error::invalid(format!(
                    "communicator {r} is rank {} of {}, expected rank {r} of {world}",
                    p.rank(),
                    p.world()
                )));
            }
        }
        let grad_accum = options.grad_accum;
        if grad_accum < world {
            return Err(Error::invalid(format!(
                "{world} devices need at least {world} micro-batches per step, got {grad_accum}"
            )));
        }
        let layout = params.layout.clone();
        // The store is pinned once, through the first device, as portable memory every device
        // can copy from.
        let (store, worker) = Streamer::shared_state(first, spec, params, &config, &options)?;
        let shared = Shared { layout, store, worker };
        let per_rank = ScheduleOptions { grad_accum: grad_accum.div_ceil(world), ..options };
        let mut ranks = Vec::with_capacity(world);
        for (&b, p) in backends.iter().zip(peers) {
            let (config, options) = (config.clone(), per_rank.clone());
            ranks.push(Streamer::with_state(b, spec, shared.clone(), Some(p), config, options)?);
        }
        Ok(DataParallel { ranks, grad_accum })
    }

    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// Rank 0's streamer: the store, the spec, the learning rate, per-unit gradient norms.
    pub fn lead(&self) -> &Streamer<'b, B> {
        &self.ranks[0]
    }

    /// Rank 0's streamer, to evaluate with between steps.
    pub fn lead_mut(&mut self) -> &mut Streamer<'b, B> {
        &mut self.ranks[0]
    }

    /// One optimizer step over the micro-batches of `micro`, shared among the ranks. The
    /// metrics are the step's (loss: the mean over every trained token; grad norm: of the
    /// summed gradients); the traffic is per rank.
    pub fn step(&mut self, micro: &[MicroBatch]) -> Result<(StepMetrics, Vec<StepTraffic>)> {
        let world = self.world();
        if micro.len() < world || micro.len() > self.grad_accum {
            return Err(Error::invalid(format!(
                "a step on {world} devices takes {world} to {} micro-batches, got {}",
                self.grad_accum,
                micro.len()
            )));
        }
        let trained: usize = micro.iter().map(MicroBatch::trained_tokens).sum();
        if trained == 0 {
            return Err(Error::invalid(
                "no token in this step carries loss (all are prompt or padding)",
            ));
        }
        let max_tokens = self.ranks[0].options.max_tokens;
        if let Some(mb) = micro.iter().find(|mb| mb.ids.len() > max_tokens) {
            return Err(Error::invalid(format!(
                "micro-batch of {} tokens exceeds the {max_tokens} the schedule was sized for",
                mb.ids.len()
            )));
        }
        let shares = split_micro(micro, world);
        let micro_total = micro.len();
        let results: Vec<Result<(StepMetrics, StepTraffic)>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .ranks
                .iter_mut()
                .zip(shares)
                .enumerate()
                .map(|(r, (rank, share))| {
                    std::thread::Builder::new()
                        .name(format!("sluice-rank-{r}"))
                        .spawn_scoped(s, move || rank.step_part(share, trained, micro_total))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| match h {
                    Ok(h) => h.join().unwrap_or_else(|_| Err(Error::invalid("a rank panicked"))),
                    Err(e) => Err(Error::invalid(format!("cannot start a rank's thread: {e}"))),
                })
                .collect()
        });
        let mut parts = Vec::with_capacity(world);
        for r in results {
            parts.push(r?);
        }
        let (mut metrics, _) = parts[0].clone();
        for (m, _) in &parts[1..] {
            // Each rank's loss is its tokens' part of the step's mean.
            metrics.loss += m.loss;
            metrics.aux_loss = metrics.aux_loss.zip(m.aux_loss).map(|(a, b)| a + b);
            metrics.tokens += m.tokens;
            metrics.elapsed = metrics.elapsed.max(m.elapsed);
            metrics.h2d_bytes += m.h2d_bytes;
            metrics.d2h_bytes += m.d2h_bytes;
        }
        metrics.trained_tokens = trained;
        Ok((metrics, parts.into_iter().map(|(_, t)| t).collect()))
    }

    /// Mean loss over held-out micro-batches, on rank 0.
    pub fn eval_loss(&mut self, micro: &[MicroBatch]) -> Result<f64> {
        self.ranks[0].eval_loss(micro)
    }

    /// Continues from a saved state (see [`Streamer::restore`]).
    pub fn restore(&mut self, step: u64, moments: &mut super::FillMoments<'_>) -> Result<()> {
        self.ranks[0].restore(step, moments)?;
        for rank in &mut self.ranks[1..] {
            rank.step = step;
        }
        Ok(())
    }

    /// Waits for every submitted update and returns the shared host store.
    pub fn settled_store(&mut self) -> Result<std::sync::Arc<crate::store::HostStore>> {
        self.settle()?;
        self.ranks[0].settled_store()
    }

    /// Waits for every submitted update and returns the master weights.
    pub fn params(&mut self) -> Result<HostParams> {
        self.settle()?;
        self.ranks[0].params()
    }

    /// Waits for every submitted update and returns the Adam moments per unit.
    pub fn moments(&mut self) -> Result<super::Moments> {
        self.settle()?;
        self.ranks[0].moments()
    }

    /// Stops the shared optimizer worker, surfacing any error it hit.
    pub fn finish(&mut self) -> Result<HostParams> {
        self.settle()?;
        self.ranks[0].finish()
    }

    fn settle(&mut self) -> Result<()> {
        self.ranks.iter_mut().try_for_each(Streamer::settle)
    }
}

/// A data-parallel group of CPU ranks in threads of one process: the CPU backend's
/// communicator, summing through shared memory.
pub struct CpuGroup;

impl CpuGroup {
    /// The `world` ranks' links, rank order.
    pub fn ranks(world: usize) -> Result<Vec<CpuPeer>> {
        if world == 0 {
            return Err(Error::invalid("a group needs at least one rank"));
        }
        let exchange = Arc::new(Exchange {
            barrier: Barrier::new(world),
            slots: (0..world).map(|_| RwLock::new(Vec::new())).collect(),
        });
        Ok((0..world).map(|rank| CpuPeer { rank, world, exchange: exchange.clone() }).collect())
    }
}

struct Exchange {
    barrier: Barrier,
    /// Each rank's contribution to the collective in progress.
    slots: Vec<RwLock<Vec<f32>>>,
}

/// One CPU rank's link to the others.
pub struct CpuPeer {
    rank: usize,
    world: usize,
    exchange: Arc<Exchange>,
}

impl AllReduce<Cpu> for CpuPeer {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, _b: &Cpu, x: &mut [f32]) -> Result<()> {
        let poisoned = || Error::invalid("a CPU rank failed during a collective");
        {
            let mut mine = self.exchange.slots[self.rank].write().map_err(|_| poisoned())?;
            mine.clear();
            mine.extend_from_slice(x);
        }
        // Every contribution is in place.
        self.exchange.barrier.wait();
        let slots = self
            .exchange
            .slots
            .iter()
            .map(|s| s.read().map_err(|_| poisoned()))
            .collect::<Result<Vec<_>>>()?;
        // Every rank sees the same lengths, so all of them return this error together.
        if let Some(r) = slots.iter().position(|s| s.len() != x.len()) {
            return Err(Error::invalid(format!(
                "all-reduce of {} values on rank {} but {} on rank {r}",
                x.len(),
                self.rank,
                slots[r].len()
            )));
        }
        // Rank order on every rank: all of them hold the same bits afterwards.
        for (i, out) in x.iter_mut().enumerate() {
            *out = slots[1..].iter().fold(slots[0][i], |acc, s| acc + s[i]);
        }
        drop(slots);
        // Nobody overwrites its slot with the next collective before every rank has read it.
        self.exchange.barrier.wait();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three ranks in threads: each ends with the sum of all contributions, the same bits on
    /// every rank, and a second collective right after the first does not mix them up.
    #[test]
    fn cpu_group_sums_across_threads() {
        let peers = CpuGroup::ranks(3).expect("group");
        let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = peers
                .iter()
                .map(|p| {
                    s.spawn(move || {
                        let r = p.rank() as f32;
                        let mut a = vec![r, 10.0 * r, 0.1 + r];
                        p.all_reduce_sum(&Cpu, &mut a).expect("first");
                        let mut b = vec![-r; 2];
                        p.all_reduce_sum(&Cpu, &mut b).expect("second");
                        (a, b)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        let want_a = [3.0, 30.0, 0.3 + 1.0 + 2.0];
        for (a, b) in &results {
            assert_eq!(a[..2], want_a[..2]);
            assert!((a[2] - want_a[2]).abs() < 1e-6, "{a:?}");
            assert_eq!(b, &vec![-3.0; 2]);
            assert_eq!(a[2].to_bits(), results[0].0[2].to_bits(), "ranks disagree");
        }
    }

    #[test]
    fn mismatched_lengths_are_an_error_on_every_rank() {
        let peers = CpuGroup::ranks(2).expect("group");
        let errors: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = peers
                .iter()
                .map(|p| {
                    s.spawn(move || {
                        let mut x = vec![1.0; 2 + p.rank()];
                        p.all_reduce_sum(&Cpu, &mut x).expect_err("lengths differ").to_string()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        assert!(errors.iter().all(|e| e.contains("all-reduce of")), "{errors:?}");
        assert!(CpuGroup::ranks(0).is_err());
    }

    #[test]
    fn shares_are_contiguous_and_balanced() {
        let mb = MicroBatch {
            rows: 1,
            seq_len: 1,
            ids: vec![0],
            targets: vec![0],
            positions: vec![0],
            cu_seqlens: vec![0, 1],
        };
        let micro = vec![mb; 5];
        let sizes: Vec<usize> = split_micro(&micro, 2).iter().map(|s| s.len()).collect();
        assert_eq!(sizes, [2, 3]);
        let sizes: Vec<usize> = split_micro(&micro, 5).iter().map(|s| s.len()).collect();
        assert_eq!(sizes, [1; 5]);
    }
}
