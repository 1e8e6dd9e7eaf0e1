//! Predicted step time: a small discrete-event model of the layer-major schedule.
//!
//! Four resources run in parallel, each working through its queue in issue order: the GPU's
//! compute stream, the host-to-device copy engine, the device-to-host copy engine and the CPU
//! optimizer pool. Every task waits for what it depends on (weights uploaded, a slot freed,
//! gradients landed, the global norm known), exactly the events the schedule waits on. Several
//! steps are simulated and the steady-state period between two steps' starts is the step time,
//! so the optimizer's overlap with the next forward is counted as it happens.
//!
//! Compute per unit visit, with `N` tokens per step and `p` GEMM parameters: a layer's forward
//! is `2 p N` GEMM FLOPs plus its attention; its backward recomputes the forward and then runs
//! `4 p N` (both input and weight gradients) plus an attention backward of 2.5 forwards' FLOPs
//! (FlashAttention-2's backward is five matmuls to the forward's two); a layer whose
//! activations are kept skips the recompute, one whose attention output is kept skips the
//! recompute's attention. The head runs forward, loss and backward in one visit, each chunk's
//! logits computed once: `2 + 4 = 6 p N`, at the LM head's own measured rate (its chunks'
//! softmax and loss sit between the GEMMs). Each layer visit adds its elementwise kernels'
//! bytes (norms, RoPE, biases, the gated activation, residual adds: the forward's once more in
//! the backward, for the recompute) at their measured effective bandwidth, and attention's
//! forward and backward run at their own measured rates for the row length.
//! The embedding is a lookup and a scatter-add, no GEMM: free next to the layers.
//!
//! The disk tier: a unit whose Adam moments live on the disk has them read (m and v, 8 bytes
//! per parameter, each rounded up to a page) before its update and written back after it. The
//! optimizer worker reads the next disk unit's moments ahead while it updates this one and
//! writes the last one's behind, with several direct-I/O requests in flight, so in steady
//! state the disk and the AdamW pipeline: a disk unit's update is modelled as one CPU task of
//! `max(adam, read + write)`, where `read` and `write` are its bytes at the tier's measured
//! rates (the disk moves one direction at a time as far as the model is concerned). A run of
//! disk units therefore paces the CPU queue at the disk's speed, and the next forward's
//! uploads wait for it as they wait for any update. The disk's busy seconds per step
//! (`disk`) and its bytes (`disk_bytes`, read plus written) are kept apart from AdamW's own
//! time (`adam`), so the plan can say which of the two bounds the step. Not modelled: the
//! first read of a step not being hidden behind an update (one unit's read, next to a step of
//! many), and the page cache (direct I/O bypasses it).

use super::budget::{Layout, disk_unit_bytes};
use super::rates::{DiskSpace, MachineRates};
use super::sizes::{BF16, F32, Sizes};
use super::{CheckpointTier, GradientTier};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Res {
    Gpu = 0,
    H2d = 1,
    D2h = 2,
    Cpu = 3,
}

/// The task graph as it is built: each task's end time, and when each resource frees up.
struct Graph {
    end: Vec<f64>,
    start: Vec<f64>,
    free: [f64; 4],
    busy: [f64; 4],
}

impl Graph {
    fn task(&mut self, res: Res, secs: f64, deps: &[Option<usize>]) -> usize {
        let ready = deps.iter().flatten().map(|&d| self.end[d]).fold(0.0, f64::max);
        let start = ready.max(self.free[res as usize]);
        self.free[res as usize] = start + secs;
        self.busy[res as usize] += secs;
        self.start.push(start);
        self.end.push(start + secs);
        self.end.len() - 1
    }
}

/// What one steady-state step costs.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepCost {
    /// Seconds between the starts of two consecutive steps.
    pub step: f64,
    /// The layers' GEMMs (forward, recompute, backward) at the GEMM rate.
    pub gemm: f64,
    /// The LM head's visit: its GEMMs with the softmax and loss, at the head's rate.
    pub head: f64,
    /// The layers' attention, forward (and recompute) and backward at their own rates.
    pub attention: f64,
    /// The FLOPs of that attention (a backward counted as 2.5 forwards).
    pub attention_flops: f64,
    /// The layers' elementwise kernels.
    pub elementwise: f64,
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    pub h2d: f64,
    pub d2h: f64,
    /// AdamW's own seconds (every unit's update at `adam_params`), without waiting on the disk.
    pub adam: f64,
    /// Seconds the disk tier is busy reading and writing moments, and its bytes (both ways).
    pub disk: f64,
    pub disk_bytes: u64,
}

/// Steps simulated; the period is measured between the starts of the last two, after the
/// pipeline has filled.
const STEPS: usize = 4;

/// Simulates the schedule for `layout` with the machine's disk tier `disk` (where the layout
/// puts moments there); `adam_scale` multiplies AdamW's own durations (0 to measure how much
/// of it is exposed; a disk unit's I/O stays).
pub fn simulate(
    s: &Sizes,
    l: &Layout,
    r: &MachineRates,
    disk: Option<&DiskSpace>,
    adam_scale: f64,
) -> StepCost {
    let n = s.batch.step_tokens() as f64;
    let units = s.units.len();
    let head = s.head();
    let (fwd_rate, bwd_rate) = s.attention_rates(r);
    // A layer's forward attention, and its backward (2.5 forwards' FLOPs at the backward's rate).
    let attn = s.attention_fwd_flops / fwd_rate;
    let attn_bwd = 2.5 * s.attention_fwd_flops / bwd_rate;
    let gemm = |u: usize| s.units[u].gemm_params as f64 * n / r.gemm_flops;
    let regemm = |u: usize| s.units[u].recompute_gemm_params as f64 * n / r.gemm_flops;
    let ew_fwd = s.elementwise_fwd_bytes / r.elementwise_bytes;
    let ew_bwd = s.elementwise_bwd_bytes / r.elementwise_bytes;
    let ew_rederive = s.elementwise_rederive_bytes / r.elementwise_bytes;
    let fwd_secs = |u: usize| match u {
        0 => 0.0,
        u if u == head => 6.0 * s.units[u].gemm_params as f64 * n / r.head_flops,
        u => 2.0 * gemm(u) + attn + ew_fwd,
    };
    // A kept layer's backward skips the recompute of its forward, deriving again only its
    // elementwise parts (norms, activation, q/k norm and RoPE).
    let kept = |u: usize| l.kept.get(u).copied().unwrap_or(false);
    // A kept attention output spares the recompute its attention.
    let kept_attention = |u: usize| l.kept_attention.get(u).copied().unwrap_or(false);
    // Forward attentions a layer runs: its forward, and the recompute's unless spared.
    let attn_forwards = |u: usize| if kept(u) || kept_attention(u) { 1.0 } else { 2.0 };
    // What a layer's backward runs before its own ops: (GEMM seconds, elementwise seconds).
    let recompute = |u: usize| if kept(u) { (0.0, ew_rederive) } else { (2.0 * regemm(u), ew_fwd) };
    let bwd_secs = |u: usize| match u {
        0 => 0.0,
        u => {
            let (re_gemm, re_ew) = recompute(u);
            4.0 * gemm(u) + re_gemm + (attn_forwards(u) - 1.0) * attn + attn_bwd + re_ew + ew_bwd
        }
    };
    let resident = |u: usize| l.resident.get(u).copied().unwrap_or(false);
    let emb_resident = l.embedding_resident();
    let host_ckpt = l.checkpoints == CheckpointTier::Host;
    // With K > 1 a streamed layer is uploaded once more, for the segment's recompute pass.
    let bwd_uploads = |u: usize| if l.interval > 1 && u != 0 { 2 } else { 1 };
    // Bytes per parameter per upload: bf16 from a streaming copy, fp32 from the master.
    let wb = l.weights.bytes();
    // Bytes per parameter of gradients shipped as each unit finishes.
    let grad_bytes = if l.gradients == GradientTier::HostStoreBf16 { BF16 } else { F32 };

    let mut g = Graph { end: Vec::new(), start: Vec::new(), free: [0.0; 4], busy: [0.0; 4] };
    let mut adam_done: Vec<Option<usize>> = vec![None; units];
    let mut slot_users: Vec<usize> = Vec::new();
    let mut step_starts = Vec::new();
    let mut cost = StepCost::default();
    let adam = |u: usize| adam_scale * s.units[u].params as f64 / r.adam_params;
    // A disk unit's moments read before its update and written after it (bytes each way).
    let io = |u: usize| -> f64 {
        let bytes = disk_unit_bytes(s, l, u) as f64;
        match disk {
            Some(d) if bytes > 0.0 => {
                bytes / d.read_bytes_per_s as f64 + bytes / d.write_bytes_per_s as f64
            }
            _ => 0.0,
        }
    };
    // The CPU queue's task for unit u's update: the disk pipelines with AdamW (module docs).
    let update_secs = |u: usize| adam(u).max(io(u));
    let as_they_land = l.gradients == GradientTier::HostRing;

    for _ in 0..STEPS {
        let busy_before = g.busy;
        let (mut h2d_bytes, mut d2h_bytes) = (0u64, 0u64);
        // The two weight slots alternate between streamed visits: a slot is free once the
        // visit two back has finished computing.
        let slot_free = |users: &Vec<usize>| users.len().checked_sub(2).map(|k| users[k]);
        // Gradient-accumulator users in order (head, then the backward visits), their landings
        // on the host and, when updates run as gradients land, the updates that free the ring.
        let mut acc_users: Vec<usize> = Vec::new();
        let mut landings: Vec<usize> = Vec::new();
        let mut ring_adams: Vec<usize> = Vec::new();
        // Ships unit `u`'s gradients after `visit`; when updates run as gradients land, starts
        // the update too (a landing slot frees when the update two back is done).
        let mut ship_grads =
            |g: &mut Graph, u: usize, visit: usize| -> (u64, usize, Option<usize>) {
                let bytes = s.units[u].params * grad_bytes;
                let ring_free = if as_they_land {
                    ring_adams.len().checked_sub(2).map(|k| ring_adams[k])
                } else {
                    None
                };
                let landed = g.task(Res::D2h, bytes as f64 / r.pcie_d2h, &[Some(visit), ring_free]);
                let update =
                    as_they_land.then(|| g.task(Res::Cpu, update_secs(u), &[Some(landed)]));
                ring_adams.extend(update);
                (bytes, landed, update)
            };

        // Forward: each unit's updated weights go up (after its update), then it computes
        // every micro-batch; the head also runs its loss and backward in the same visit.
        for u in 0..units {
            let weights = if resident(u) {
                g.task(Res::H2d, (s.units[u].params * wb) as f64 / r.pcie_h2d, &[adam_done[u]])
            } else {
                let table = (u == head && s.tied && !emb_resident).then_some(adam_done[0]);
                let bytes = s.visit_params(u, emb_resident) * wb;
                h2d_bytes += bytes;
                let deps = [adam_done[u], slot_free(&slot_users), table.flatten()];
                g.task(Res::H2d, bytes as f64 / r.pcie_h2d, &deps)
            };
            if resident(u) {
                h2d_bytes += s.units[u].params * wb;
            }
            let visit = g.task(Res::Gpu, fwd_secs(u), &[Some(weights)]);
            if u == 0 {
                step_starts.push(g.start[visit]);
            }
            if !resident(u) {
                slot_users.push(visit);
            }
            if host_ckpt && u < head {
                // This unit's output is the next one's checkpointed input.
                d2h_bytes += s.activation_set();
                g.task(Res::D2h, s.activation_set() as f64 / r.pcie_d2h, &[Some(visit)]);
            }
            if u == head {
                acc_users.push(visit);
                if l.gradients != GradientTier::DeviceStore {
                    let (bytes, landed, update) = ship_grads(&mut g, u, visit);
                    d2h_bytes += bytes;
                    landings.push(landed);
                    if update.is_some() {
                        adam_done[u] = update;
                    }
                }
            }
        }

        // Backward, last layer first: recompute from the checkpoint, then the gradients.
        let mut last_visit = None;
        for u in (0..head).rev() {
            let weights = (!resident(u)).then(|| {
                let bytes = bwd_uploads(u) * s.units[u].params * wb;
                h2d_bytes += bytes;
                g.task(Res::H2d, bytes as f64 / r.pcie_h2d, &[slot_free(&slot_users)])
            });
            let ckpt = (host_ckpt && u > 0).then(|| {
                h2d_bytes += s.activation_set();
                g.task(Res::H2d, s.activation_set() as f64 / r.pcie_h2d, &[])
            });
            // Double-buffered accumulators: the one two visits back must have shipped.
            let acc_free = match l.gradients {
                GradientTier::DeviceStore => None,
                _ => acc_users.len().checked_sub(2).and_then(|k| landings.get(k).copied()),
            };
            let visit = g.task(Res::Gpu, bwd_secs(u), &[weights, ckpt, acc_free, last_visit]);
            if !resident(u) {
                slot_users.push(visit);
            }
            last_visit = Some(visit);
            acc_users.push(visit);
            if l.gradients != GradientTier::DeviceStore {
                let (bytes, landed, update) = ship_grads(&mut g, u, visit);
                d2h_bytes += bytes;
                landings.push(landed);
                if update.is_some() {
                    adam_done[u] = update;
                }
            }
        }

        match l.gradients {
            GradientTier::HostRing => {}
            GradientTier::HostStore | GradientTier::HostStoreBf16 => {
                // The norm is known once the embedding's gradients (the last) have landed;
                // the updates then run in forward order, overlapped with the next forward.
                let all_landed = landings.last().copied();
                for (u, done) in adam_done.iter_mut().enumerate() {
                    *done = Some(g.task(Res::Cpu, update_secs(u), &[all_landed, last_visit]));
                }
            }
            GradientTier::DeviceStore => {
                // Gradients wait on the device until the norm is known after the embedding's
                // backward, then ship in forward order through a landing ring of two slots.
                let mut adams: Vec<usize> = Vec::new();
                for (u, done) in adam_done.iter_mut().enumerate() {
                    let bytes = s.units[u].params * F32;
                    d2h_bytes += bytes;
                    let ring_free = u.checked_sub(2).map(|j| adams[j]);
                    let landed =
                        g.task(Res::D2h, bytes as f64 / r.pcie_d2h, &[last_visit, ring_free]);
                    let a = g.task(Res::Cpu, update_secs(u), &[Some(landed)]);
                    adams.push(a);
                    *done = Some(a);
                }
            }
        }

        cost = StepCost {
            step: 0.0,
            gemm: (1..head).map(|u| 6.0 * gemm(u) + recompute(u).0).sum(),
            head: fwd_secs(head),
            attention: (1..head).map(|u| attn_forwards(u) * attn + attn_bwd).sum(),
            attention_flops: (1..head)
                .map(|u| (attn_forwards(u) + 2.5) * s.attention_fwd_flops)
                .sum(),
            elementwise: (1..head).map(|u| ew_fwd + recompute(u).1 + ew_bwd).sum(),
            h2d_bytes,
            d2h_bytes,
            h2d: g.busy[Res::H2d as usize] - busy_before[Res::H2d as usize],
            d2h: g.busy[Res::D2h as usize] - busy_before[Res::D2h as usize],
            // Every unit is updated once a step.
            adam: (0..units).map(adam).sum(),
            disk: (0..units).map(io).sum(),
            disk_bytes: (0..units).map(|u| 2 * disk_unit_bytes(s, l, u)).sum(),
        };
    }
    let k = step_starts.len();
    cost.step = (step_starts[k - 1] - step_starts[k - 3]) / 2.0;
    cost
}
