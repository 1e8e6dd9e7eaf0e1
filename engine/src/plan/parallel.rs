//! Data parallelism in the planner: N GPUs of one host share each step's micro-batches. Each GPU
//! runs the one-GPU schedule on its share (the largest, `ceil(G / N)` micro-batches) with the
//! whole model streaming over its own PCIe link, so it is planned as one GPU with that share,
//! with three differences:
//!
//! - **Host memory bandwidth is shared.** Every link's DMA reads (h2d) or writes (d2h) the one
//!   host store. A host copy at `host_memcpy` bytes/s reads and writes each byte, so host memory
//!   moves `2 x host_memcpy` bytes/s; N links with both directions busy get `1 / 2N` of that
//!   each way, or their own PCIe rate if lower (one GPU keeps its PCIe rate).
//! - **Gradients are summed across GPUs** before rank 0 lands them: a ring all-reduce moves
//!   `2 (N - 1) / N` of the f32 gradients through each GPU, on the compute stream, so it adds to
//!   the step. Its rate, [`ALLREDUCE_BUS_BYTES`], is an assumption (only one GPU is lent here).
//! - **Every GPU keeps its own host checkpoints**: the other N - 1 GPUs' copies are added to the
//!   pinned host budget, and the plan is made again with that room taken if they overflow.
//!
//! The step time is the whole step's; its PCIe and GPU figures are one GPU's (rank 0's, which
//! also lands the gradients).
//!
//! Not modelled: the CPU AdamW competing with the DMA for host memory bandwidth, and NUMA (the
//! measured host has one node).

use serde::Serialize;

use super::{BatchShape, CheckpointTier, MachineRates, PlanInput, Verdict, plan_one};
use crate::error::{Error, Result};

/// Bytes/s of an all-reduce's bus bandwidth (nccl-tests' "busbw") assumed between the GPUs of
/// one host: NVLink-connected H100/H200s measure several hundred GB/s, PCIe peer links tens;
/// 100 GB/s sits between and is not a measurement.
pub const ALLREDUCE_BUS_BYTES: f64 = 100e9;

/// How a step is shared among several GPUs, and what that gains.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Parallel {
    pub gpus: usize,
    /// Micro-batches of the largest share.
    pub micro_batches_per_gpu: usize,
    /// Each GPU's PCIe rate per direction once the links share host memory bandwidth.
    pub link_bytes_per_s: f64,
    /// Seconds per step of summing the gradients across GPUs.
    pub allreduce_s: f64,
    /// One GPU's predicted step for the same batch; `None` if it does not fit one GPU.
    pub one_gpu_step_s: Option<f64>,
    /// `one_gpu_step_s / step`.
    pub speedup: Option<f64>,
}

/// Each direction's rate of one of `gpus` links sharing host memory bandwidth.
pub fn link_rates(r: &MachineRates, gpus: usize) -> (f64, f64) {
    if gpus <= 1 {
        return (r.pcie_h2d, r.pcie_d2h);
    }
    let share = 2.0 * r.host_memcpy / (2 * gpus) as f64;
    (r.pcie_h2d.min(share), r.pcie_d2h.min(share))
}

pub(super) fn plan(input: &PlanInput<'_>) -> Result<Verdict> {
    let (n, b) = (input.gpus, input.batch);
    input.batch.validate(input.spec)?;
    input.rates.validate()?;
    if b.grad_accum < n {
        return Err(Error::invalid(format!(
            "{n} GPUs need at least {n} micro-batches per step (grad_accum), got {}",
            b.grad_accum
        )));
    }
    let (pcie_h2d, pcie_d2h) = link_rates(&input.rates, n);
    let share = BatchShape { grad_accum: b.grad_accum.div_ceil(n), ..b };
    let rates = MachineRates { pcie_h2d, pcie_d2h, ..input.rates };
    let rank = PlanInput { batch: share, rates, gpus: 1, ..input.clone() };
    let others = (n - 1) as u64;
    let host_ckpt = |v: &Verdict| match v {
        Verdict::Fits(p) if p.placement.checkpoints == CheckpointTier::Host => {
            others * p.budget.pinned_host.part("checkpoints")
        }
        _ => 0,
    };
    let mut verdict = plan_one(&rank)?;
    let extra = host_ckpt(&verdict);
    if let Verdict::Fits(p) = &verdict
        && p.budget.host_used() + extra > p.budget.host_capacity
    {
        let mut tighter = rank.clone();
        tighter.memory.host_bytes = tighter.memory.host_bytes.saturating_sub(extra);
        verdict = plan_one(&tighter)?;
    }
    let Verdict::Fits(mut p) = verdict else { return Ok(verdict) };
    let extra = host_ckpt(&Verdict::Fits(p.clone()));
    if extra > 0 {
        let pinned = &mut p.budget.pinned_host;
        pinned.parts.push(super::Part {
            name: format!("checkpoints of the other {others} GPU(s)"),
            bytes: extra,
        });
        pinned.used += extra;
    }
    let host = input.memory.host_bytes;
    p.budget.host_capacity = host;
    p.budget.pinned_host.capacity = host.saturating_sub(p.budget.pageable_host.used);
    p.budget.pageable_host.capacity = host.saturating_sub(p.budget.pinned_host.used);

    let ring = 2.0 * (n - 1) as f64 / n as f64;
    let allreduce_s = ring * 4.0 * p.model.params as f64 / ALLREDUCE_BUS_BYTES;
    let tokens = b.step_tokens();
    let scale = tokens as f64 / share.step_tokens() as f64;
    let t = &mut p.time;
    t.total_s += allreduce_s;
    t.gpu_idle_s += allreduce_s;
    t.flops *= scale;
    t.tokens_per_s = tokens as f64 / t.total_s;
    t.model_tflops = 6.0 * p.model.active_params as f64 * tokens as f64 / t.total_s / 1e12;
    let one_gpu_step_s = match plan_one(&PlanInput { gpus: 1, ..input.clone() })? {
        Verdict::Fits(one) => Some(one.time.total_s),
        Verdict::Refused(_) => None,
    };
    p.parallel = Some(Parallel {
        gpus: n,
        micro_batches_per_gpu: share.grad_accum,
        link_bytes_per_s: pcie_h2d,
        allreduce_s,
        one_gpu_step_s,
        speedup: one_gpu_step_s.map(|one| one / p.time.total_s),
    });
    p.batch = b;
    p.tokens_per_step = tokens;
    p.rates = input.rates;
    Ok(Verdict::Fits(p))
}
