//! Device time per op, from CUDA events on the compute stream, for `sluice bench train
//! --profile`.
//!
//! Off by default, and then free but for one relaxed load per op. On, every op of the backend
//! records a timing event before and after its kernels on the compute stream; [`Cuda::take_profile`]
//! waits for the stream and sums each op's event pairs by op and class. An op's time is what the
//! stream spent between its two events: its kernels, and any host time between their launches
//! when the stream ran dry (cuBLAS's heuristics, a host wait inside the op). The gaps between
//! ops (waits for transfers on other streams, host work between ops) are the window less the
//! ops' sum; each gap is also counted against the pair of ops around it ([`Gap`]), which says
//! where the stream waits: before a layer's first GEMM (its weights), after a reduction the host
//! reads back (a host sync), and so on.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use super::Cuda;
use super::device::{drv, err};
use crate::error::Result;
use crate::placement::causal_pairs;

/// The kernel classes a profile groups ops into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OpClass {
    Gemm,
    Attention,
    /// The chunked LM head: its GEMMs, softmax and loss together.
    Loss,
    Norm,
    Rope,
    /// Gated activations (SwiGLU, GeGLU) and sigmoid gates.
    Activation,
    Embedding,
    /// Routing, sorting, gathers and combines of a mixture of experts.
    Routing,
    /// Adds, copies, zero fills, biases.
    Elementwise,
    /// Sums and sums of squares read back to the host (gradient norms).
    Reduction,
}

/// One op's totals over a profile's window.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OpTime {
    pub op: &'static str,
    pub class: OpClass,
    pub calls: u64,
    pub seconds: f64,
    /// Floating-point operations of the calls, where the op counts them (GEMMs, attention,
    /// the LM head's GEMMs); 0 otherwise.
    pub flops: f64,
}

/// The stream's idle time between one op and the next, summed over every such pair.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Gap {
    /// The op that ended before the gap.
    pub after: &'static str,
    /// The op that started after it.
    pub before: &'static str,
    pub count: u64,
    pub seconds: f64,
    /// The longest single gap: says whether the time is many short waits or a few long ones.
    pub longest: f64,
}

/// What the compute stream did between two [`Cuda::take_profile`] calls.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct OpProfile {
    /// Per op, in class order, then by time.
    pub ops: Vec<OpTime>,
    /// From the first op's start to the last op's end.
    pub window_s: f64,
    /// Per pair of consecutive ops, the stream's idle time between them, longest first.
    pub gaps: Vec<Gap>,
}

impl OpProfile {
    /// The ops' time summed (each op's span once; ops on one stream do not overlap).
    pub fn busy_s(&self) -> f64 {
        self.ops.iter().map(|o| o.seconds).sum()
    }

    /// Per class: calls, seconds and FLOPs summed, in class order.
    pub fn classes(&self) -> Vec<(OpClass, u64, f64, f64)> {
        let mut by: BTreeMap<OpClass, (u64, f64, f64)> = BTreeMap::new();
        for o in &self.ops {
            let e = by.entry(o.class).or_default();
            e.0 += o.calls;
            e.1 += o.seconds;
            e.2 += o.flops;
        }
        by.into_iter().map(|(c, (n, s, f))| (c, n, s, f)).collect()
    }
}

struct Sample {
    op: &'static str,
    class: OpClass,
    flops: f64,
    start: CudaEvent,
    end: CudaEvent,
}

#[derive(Default)]
struct Pending {
    samples: Vec<Sample>,
    /// Events of resolved samples, recorded again rather than created again.
    free: Vec<CudaEvent>,
    /// Ops in progress on this backend: an op that calls another is timed once, as itself.
    depth: usize,
}

#[derive(Default)]
pub(super) struct Profiler {
    on: AtomicBool,
    pending: Mutex<Pending>,
}

/// Times one op from its creation to its drop; does nothing when profiling is off.
pub(super) struct Scope<'a> {
    /// Set when this scope entered the profiler's depth, which its drop leaves again.
    entered: Option<&'a Profiler>,
    /// The outermost op's start, when its event was recorded.
    live: Option<Live<'a>>,
}

struct Live<'a> {
    stream: &'a Arc<CudaStream>,
    op: &'static str,
    class: OpClass,
    flops: f64,
    start: CudaEvent,
}

impl Profiler {
    fn event(&self, ctx: &Arc<CudaContext>) -> Option<CudaEvent> {
        let reused = self.pending.lock().ok()?.free.pop();
        reused.or_else(|| ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).ok())
    }

    pub(super) fn scope<'a>(
        &'a self,
        ctx: &Arc<CudaContext>,
        stream: &'a Arc<CudaStream>,
        op: &'static str,
        class: OpClass,
        flops: f64,
    ) -> Scope<'a> {
        let idle = Scope { entered: None, live: None };
        if !self.on.load(Ordering::Relaxed) {
            return idle;
        }
        let outermost = {
            let Ok(mut p) = self.pending.lock() else { return idle };
            p.depth += 1;
            p.depth == 1
        };
        // A failed event only loses this sample: the profile is a diagnostic.
        let live = outermost
            .then(|| self.event(ctx))
            .flatten()
            .filter(|e| e.record(stream).is_ok())
            .map(|start| Live { stream, op, class, flops, start });
        Scope { entered: Some(self), live }
    }
}

impl Drop for Scope<'_> {
    fn drop(&mut self) {
        let Some(p) = self.entered else { return };
        let end = self.live.as_ref().and_then(|l| p.event(l.stream.context()));
        let Ok(mut pending) = p.pending.lock() else { return };
        pending.depth = pending.depth.saturating_sub(1);
        let Some(Live { stream, op, class, flops, start }) = self.live.take() else { return };
        match end.filter(|e| e.record(stream).is_ok()) {
            Some(end) => pending.samples.push(Sample { op, class, flops, start, end }),
            None => pending.free.push(start),
        }
    }
}

impl Cuda {
    /// Starts (or stops) timing every op on the compute stream; see [`Cuda::take_profile`].
    pub fn set_profiling(&self, on: bool) {
        self.profiler.on.store(on, Ordering::Relaxed);
    }

    /// Waits for the compute stream and returns the device time of every op timed since the
    /// last call, summed per op.
    pub fn take_profile(&self) -> Result<OpProfile> {
        self.synchronize()?;
        let samples = {
            let mut p = self
                .profiler
                .pending
                .lock()
                .map_err(|_| err("the op profiler's lock was poisoned"))?;
            std::mem::take(&mut p.samples)
        };
        let mut by: BTreeMap<(OpClass, &'static str), (u64, f64, f64)> = BTreeMap::new();
        let mut gaps: BTreeMap<(&'static str, &'static str), (u64, f64, f64)> = BTreeMap::new();
        let mut window = 0.0f64;
        if let Some(first) = samples.first() {
            for s in &samples {
                let ms = drv("reading an op's time", s.start.elapsed_ms(&s.end))?;
                let e = by.entry((s.class, s.op)).or_default();
                e.0 += 1;
                e.1 += f64::from(ms) / 1e3;
                e.2 += s.flops;
            }
            for pair in samples.windows(2) {
                let ms = drv("reading a gap", pair[0].end.elapsed_ms(&pair[1].start))?;
                let e = gaps.entry((pair[0].op, pair[1].op)).or_default();
                e.0 += 1;
                // Events on one stream complete in order; a negative reading is timer noise.
                let seconds = f64::from(ms.max(0.0)) / 1e3;
                e.1 += seconds;
                e.2 = e.2.max(seconds);
            }
            let last = &samples[samples.len() - 1];
            window = f64::from(drv("reading the window", first.start.elapsed_ms(&last.end))?) / 1e3;
        }
        let mut ops: Vec<OpTime> = by
            .into_iter()
            .map(|((class, op), (calls, seconds, flops))| OpTime {
                op,
                class,
                calls,
                seconds,
                flops,
            })
            .collect();
        ops.sort_by(|a, b| a.class.cmp(&b.class).then(b.seconds.total_cmp(&a.seconds)));
        let mut gaps: Vec<Gap> = gaps
            .into_iter()
            .map(|((after, before), (count, seconds, longest))| Gap {
                after,
                before,
                count,
                seconds,
                longest,
            })
            .collect();
        gaps.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        if let Ok(mut p) = self.profiler.pending.lock() {
            for s in samples {
                p.free.push(s.start);
                p.free.push(s.end);
            }
        }
        Ok(OpProfile { ops, window_s: window, gaps })
    }

    /// Times the op that holds the returned scope (see the module docs). Every method of the
    /// op traits (`ElementwiseOps`, `MatmulOps`, ...) opens one as its first statement, under
    /// the op's name as the profile reports it; `Device`'s methods are not ops and are not
    /// timed.
    pub(super) fn timed(&self, op: &'static str, class: OpClass, flops: f64) -> Scope<'_> {
        self.profiler.scope(&self.ctx, &self.compute, op, class, flops)
    }
}

/// Multiply-adds of causal (or windowed) attention over packed documents, as FLOPs of the
/// `Q Kᵀ` and `P V` products (`4 x pairs x heads x head_dim`): the forward's count; the backward
/// recomputes `Q Kᵀ` and forms four more products, 2.5 times as many.
pub(super) fn attention_flops(
    cu_seqlens: &[i32],
    q_heads: usize,
    head_dim: usize,
    window: Option<usize>,
) -> f64 {
    let window = window.map(|w| w as u64);
    let pairs: u64 =
        cu_seqlens.windows(2).map(|w| causal_pairs((w[1] - w[0]).max(0) as u64, window)).sum();
    4.0 * pairs as f64 * q_heads as f64 * head_dim as f64
}
