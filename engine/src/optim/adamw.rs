//! Fused single-pass AdamW on f32 host tensors, with the arithmetic of PyTorch's
//! `torch.optim.AdamW` (single-tensor path, `_single_tensor_adam` in torch/optim/adam.py, torch
//! 2.11, CPU, float32).
//!
//! What torch computes, step by step, and in which precision (f64 = a Python float, f32 = a tensor
//! op; a Python float passed to a tensor op is first rounded to f32):
//! 1. `param.mul_(1 - lr * wd)`: the factor in f64, rounded to f32, one f32 multiply. Skipped
//!    when `wd == 0` (multiplying by 1.0 is exact, so we always multiply).
//! 2. `exp_avg.lerp_(grad, 1 - beta1)`: weight `w = f32(1 - beta1)`; torch's lerp is
//!    `fma(w, g - m, m)` when `|w| < 0.5`, else `fma(w - 1, g - m, g)` (ATen's `lerp_vec`; the
//!    scalar tail is contracted to the same FMA).
//! 3. `exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)`:
//!    `fma(f32(1 - beta2) * g, g, v * f32(beta2))`.
//! 4. `bias_correction{1,2} = 1 - beta**step`, `step_size = lr / bias_correction1`,
//!    `bias_correction2 ** 0.5`: all f64, with the C library's `pow` (as Rust's `powf`).
//! 5. `denom = (exp_avg_sq.sqrt() / f32(sqrt(bc2))) + f32(eps)`: f32 ops.
//! 6. `param.addcdiv_(exp_avg, denom, value=-step_size)`: `p + (f32(-step_size) * m) / denom`,
//!    no FMA.
//!
//! The one known difference: torch's f32 `sqrt` on the CPU goes through MKL and is not correctly
//! rounded (about 16% of results are 1 ulp off the IEEE square root, and which ones depends on
//! the CPU), while ours is IEEE. `m` and `v` therefore match torch bit for bit, and parameters
//! match to within an ulp or so per step (measured against torch 2.11.0 by the `adamw` golden
//! fixture).
//!
//! Hyperparameters are stored as f32 but torch holds them as Python floats: `beta1 = 0.9` is the
//! f64 nearest to 0.9, not the f32 nearest widened. Widening the f32 would shift the bias
//! corrections by ~2e-7 relative, so we recover the decimal the user wrote (the shortest decimal
//! that round-trips the f32) and parse it as f64; see [`as_written`].

use std::ops::Range;

use rayon::prelude::*;

use super::pool::AdamPool;
use crate::error::{Error, Result};

#[cfg(target_arch = "x86_64")]
mod avx512;

/// AdamW hyperparameters, named as in `torch.optim.AdamW`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    /// Peak learning rate (the schedule scales it).
    pub lr: f32,
    /// Decay of the first moment.
    pub beta1: f32,
    /// Decay of the second moment.
    pub beta2: f32,
    /// Added to the denominator, after the bias-corrected square root.
    pub eps: f32,
    /// Decoupled weight decay, applied only to tensors that [`decays`] selects.
    pub weight_decay: f32,
}

impl Default for AdamW {
    /// The fine-tuning defaults: lr 1e-5, betas (0.9, 0.999), eps 1e-8, no weight decay.
    fn default() -> Self {
        AdamW { lr: 1e-5, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
    }
}

impl AdamW {
    /// Rejects hyperparameters torch would reject (and a non-finite or negative lr or decay),
    /// naming the offending value.
    pub fn validate(&self) -> Result<()> {
        check_lr(self.lr)?;
        for (name, beta) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(Error::invalid(format!("AdamW {name} must be in [0, 1), got {beta}")));
            }
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(Error::invalid(format!(
                "AdamW eps must be finite and >= 0, got {}",
                self.eps
            )));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(Error::invalid(format!(
                "AdamW weight_decay must be finite and >= 0, got {}",
                self.weight_decay
            )));
        }
        Ok(())
    }
}

fn check_lr(lr: f32) -> Result<()> {
    if lr.is_finite() && lr >= 0.0 {
        Ok(())
    } else {
        Err(Error::invalid(format!("AdamW learning rate must be finite and >= 0, got {lr}")))
    }
}

/// Whether weight decay applies to a tensor of this shape: matrices and embeddings (2 or more
/// dimensions) decay; norm weights and biases (fewer) do not, as in the usual Hugging Face split.
pub fn decays(shape: &[usize]) -> bool {
    shape.len() >= 2
}

/// The f64 a Python user would have meant by this f32: the shortest decimal that round-trips the
/// f32 (Rust's `Display`), parsed as f64. `0.9f32` gives `0.9f64`, not `0.899999976...`.
pub fn as_written(x: f32) -> f64 {
    format!("{x}").parse().unwrap_or(f64::from(x))
}

/// Elements per rayon task: 4 arrays of 64 KiB, small enough to balance across threads and large
/// enough that scheduling costs nothing next to the memory traffic.
const CHUNK: usize = 16 * 1024;

/// Per-step scalars, computed once per call exactly as torch computes them (see the module doc).
#[derive(Debug, Clone, Copy)]
struct Coeffs {
    /// `f32(1 - lr * wd)`, or 1.0 when decay is off (torch skips the multiply; 1.0 is exact).
    decay: f32,
    /// lerp coefficient: `w` when `|w| < 0.5`, else `w - 1`.
    lerp_coeff: f32,
    /// lerp base: `m` (false) or `g` (true), torch's choice for large weights.
    lerp_from_grad: bool,
    beta2: f32,
    one_minus_beta2: f32,
    bc2_sqrt: f32,
    eps: f32,
    neg_step_size: f32,
}

impl Coeffs {
    fn new(hp: &AdamW, lr: f32, step: u64, decay: bool) -> Result<Self> {
        hp.validate()?;
        check_lr(lr)?;
        if step == 0 {
            return Err(Error::invalid("AdamW step is 1-based; got step 0"));
        }
        let lr = as_written(lr);
        let beta1 = as_written(hp.beta1);
        let beta2 = as_written(hp.beta2);
        let wd = as_written(hp.weight_decay);
        // torch keeps the step count in an f32 tensor and reads it back as a Python float.
        let t = step as f32 as f64;
        let bc1 = 1.0 - beta1.powf(t);
        let bc2 = 1.0 - beta2.powf(t);
        let w = (1.0 - beta1) as f32;
        let small = w.abs() < 0.5;
        Ok(Coeffs {
            decay: if decay && wd != 0.0 { (1.0 - lr * wd) as f32 } else { 1.0 },
            lerp_coeff: if small { w } else { w - 1.0 },
            lerp_from_grad: !small,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            bc2_sqrt: bc2.powf(0.5) as f32,
            eps: as_written(hp.eps) as f32,
            neg_step_size: (-(lr / bc1)) as f32,
        })
    }
}

/// The per-step arguments of [`adamw_step`] for one tensor.
#[derive(Debug, Clone, Copy)]
pub struct TensorStep {
    /// 1-based step count, including this step.
    pub step: u64,
    /// This step's learning rate (the schedule's value; `hp.lr` is not used).
    pub lr: f32,
    pub hp: AdamW,
    /// Whether weight decay applies to this tensor (see [`decays`]).
    pub decay: bool,
}

/// One AdamW step on one tensor, in place: `params`, `m` (first moment) and `v` (second moment)
/// are updated from `grads` as `args` says. Runs on the current rayon pool.
///
/// Errors if the four slices differ in length, `args.step` is 0, or a hyperparameter is out of
/// range; nothing is modified then.
pub fn adamw_step(
    params: &mut [f32], // [n]
    grads: &[f32],      // [n]
    m: &mut [f32],      // [n]
    v: &mut [f32],      // [n]
    args: &TensorStep,
) -> Result<()> {
    let n = params.len();
    if grads.len() != n || m.len() != n || v.len() != n {
        return Err(Error::invalid(format!(
            "AdamW tensor lengths differ: params {n}, grads {}, m {}, v {}",
            grads.len(),
            m.len(),
            v.len()
        )));
    }
    let c = Coeffs::new(&args.hp, args.lr, args.step, args.decay)?;
    params
        .par_chunks_mut(CHUNK)
        .zip(grads.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .for_each(|(((p, g), m), v)| update_chunk(p, g, m, v, &c));
    Ok(())
}

fn update_chunk(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: &Coeffs) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA, checked just above.
        unsafe { update_chunk_avx2_fma(p, g, m, v, c) };
        return;
    }
    update_body(p, g, m, v, c);
}

/// The same body compiled with FMA available, so `mul_add` becomes one vectorised instruction
/// instead of a call into the C library (the results are identical: both are fused).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn update_chunk_avx2_fma(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    c: &Coeffs,
) {
    update_body(p, g, m, v, c);
}

#[inline(always)]
fn update_body(
    p: &mut [f32], // [n]
    g: &[f32],     // [n]
    m: &mut [f32], // [n]
    v: &mut [f32], // [n]
    c: &Coeffs,
) {
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let decayed = *p * c.decay;
        let base = if c.lerp_from_grad { g } else { *m };
        let m_new = c.lerp_coeff.mul_add(g - *m, base);
        let v_new = (c.one_minus_beta2 * g).mul_add(g, *v * c.beta2);
        let denom = v_new.sqrt() / c.bc2_sqrt + c.eps;
        *p = decayed + (c.neg_step_size * m_new) / denom;
        *m = m_new;
        *v = v_new;
    }
}

/// One unit's optimizer state, updated in place by [`adamw_fused`]: all slices have the unit's
/// length.
#[derive(Debug)]
pub struct UnitState<'a> {
    /// fp32 master weights.
    pub master: &'a mut [f32], // [n]
    /// First moment.
    pub m: &'a mut [f32], // [n]
    /// Second moment.
    pub v: &'a mut [f32], // [n]
    /// The bf16 streaming copy (raw bits), overwritten with the new master rounded to nearest
    /// even; empty when the weights stream from the master (nothing to refresh).
    pub bf16: &'a mut [u16], // [n] or [0]
}

/// The per-step arguments of [`adamw_fused`].
#[derive(Debug, Clone, Copy)]
pub struct FusedStep<'a> {
    /// 1-based step count, including this step.
    pub step: u64,
    /// This step's learning rate (the schedule's value; `hp.lr` is not used).
    pub lr: f32,
    pub hp: AdamW,
    /// Global-norm clipping factor from [`super::clip_coef`]; 1.0 when clipping is off or did
    /// not trigger. The gradient is multiplied by it before use, exactly as [`super::scale`]
    /// would have done in a separate pass.
    pub clip_coef: f32,
    /// Element ranges that get weight decay (the unit's matrices, see [`decays`]), sorted and
    /// disjoint. Everything else (norms, biases, alignment padding) is updated without decay.
    pub decayed: &'a [Range<usize>],
}

/// Which instruction set the fused body is compiled for. Every variant computes the same IEEE
/// operations (multiply, add, divide, square root, fused multiply-add) element by element, so
/// the results are bit-identical; only the width of the registers differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    /// Written out in intrinsics, with streaming stores and prefetch (see `avx512.rs`).
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// The portable body, auto-vectorised for AVX2.
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
    Portable,
}

impl Isa {
    fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Isa::Avx2Fma;
            }
        }
        Isa::Portable
    }

    fn name(self) -> &'static str {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => "avx512",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => "avx2+fma",
            Isa::Portable => "portable",
        }
    }
}

/// The instruction set [`adamw_fused`] uses on this CPU ("avx512", "avx2+fma" or "portable").
pub fn fused_isa() -> &'static str {
    Isa::detect().name()
}

/// Elements per task of the fused update: 64 KiB of each f32 array. Measured on the GPU machine
/// (16 threads, 1e9 parameters): 4 Ki, 64 Ki and 256 Ki-element tasks were within noise of this;
/// one fixed range per thread instead of work stealing was 20 to 30% slower.
const FUSED_CHUNK: usize = 16 * 1024;

/// The fused AdamW update of one unit, in one pass over memory on `pool`: reads `grad`, m, v and
/// master; writes m, v, master and the bf16 streaming copy (unless it is empty). Per element the
/// arithmetic is exactly [`adamw_step`]'s on the gradient multiplied by `args.clip_coef`, so the result is
/// bit-identical to `scale` + `adamw_step` per tensor + a bf16 rounding pass, and does not
/// depend on the pool's size.
///
/// Errors (and changes nothing) if the slices differ in length, a decay range is out of bounds
/// or out of order, the clip coefficient is not finite and non-negative, `step` is 0, or a
/// hyperparameter is out of range.
pub fn adamw_fused(
    pool: &AdamPool,
    state: UnitState<'_>,
    grad: &[f32], // [n]
    args: &FusedStep<'_>,
) -> Result<()> {
    adamw_fused_from(pool, state, GradIn::F32(grad), args)
}

/// A unit's gradients as the fused update reads them.
#[derive(Debug, Clone, Copy)]
pub enum GradIn<'a> {
    F32(&'a [f32]),
    /// bf16 bits, each widened to the f32 it stands for (exactly) as its chunk is updated.
    Bf16(&'a [u16]),
}

impl GradIn<'_> {
    fn len(&self) -> usize {
        match self {
            GradIn::F32(g) => g.len(),
            GradIn::Bf16(g) => g.len(),
        }
    }
}

thread_local! {
    /// One chunk of widened bf16 gradients per optimizer thread, reused.
    static WIDE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`adamw_fused`] on gradients in either precision: with [`GradIn::Bf16`] the result is
/// bit-identical to [`adamw_fused`] on the same gradients widened to f32.
pub fn adamw_fused_from(
    pool: &AdamPool,
    state: UnitState<'_>,
    grad: GradIn<'_>,
    args: &FusedStep<'_>,
) -> Result<()> {
    let (plain, decayed) = check_fused(&state, grad.len(), args)?;
    let isa = Isa::detect();
    let UnitState { master, m, v, bf16 } = state;
    // One task: chunk `i` of every array, with its gradients as f32.
    let update = |i: usize, p: &mut [f32], m: &mut [f32], v: &mut [f32], out: &mut [u16]| {
        let start = i * FUSED_CHUNK;
        let range = start..start + p.len();
        let mut run = move |g: &[f32]| {
            let chunk = Chunk { p, g, m, v, out };
            for_each_span(chunk, start, args.decayed, |c, decay| {
                let coeffs = if decay { &decayed } else { &plain };
                fused_chunk(isa, c, coeffs, args.clip_coef);
            });
        };
        match grad {
            GradIn::F32(g) => run(&g[range]),
            GradIn::Bf16(g) => WIDE.with_borrow_mut(|wide| {
                wide.clear();
                wide.extend(g[range].iter().map(|&b| f32::from_bits(u32::from(b) << 16)));
                run(wide)
            }),
        }
    };
    pool.install(|| {
        if bf16.is_empty() {
            master
                .par_chunks_mut(FUSED_CHUNK)
                .zip(m.par_chunks_mut(FUSED_CHUNK))
                .zip(v.par_chunks_mut(FUSED_CHUNK))
                .enumerate()
                .for_each(|(i, ((p, m), v))| update(i, p, m, v, &mut []));
        } else {
            master
                .par_chunks_mut(FUSED_CHUNK)
                .zip(m.par_chunks_mut(FUSED_CHUNK))
                .zip(v.par_chunks_mut(FUSED_CHUNK))
                .zip(bf16.par_chunks_mut(FUSED_CHUNK))
                .enumerate()
                .for_each(|(i, (((p, m), v), out))| update(i, p, m, v, out));
        }
    });
    Ok(())
}

/// The same update on the calling thread with plain scalar code (no parallelism, no vector
/// instructions asked for): the baseline the benchmark compares [`adamw_fused`] against.
pub fn adamw_fused_scalar(
    state: UnitState<'_>,
    grad: &[f32], // [n]
    args: &FusedStep<'_>,
) -> Result<()> {
    let (plain, decayed) = check_fused(&state, grad.len(), args)?;
    let UnitState { master, m, v, bf16 } = state;
    let chunk = Chunk { p: master, g: grad, m, v, out: bf16 };
    for_each_span(chunk, 0, args.decayed, |c, decay| {
        let coeffs = if decay { &decayed } else { &plain };
        fused_scalar(c, coeffs, args.clip_coef);
    });
    Ok(())
}

/// Validates the arguments and returns the coefficients without and with decay.
fn check_fused(
    state: &UnitState<'_>,
    grads: usize,
    args: &FusedStep<'_>,
) -> Result<(Coeffs, Coeffs)> {
    let n = state.master.len();
    let copy = state.bf16.len();
    if grads != n || state.m.len() != n || state.v.len() != n || (copy != n && copy != 0) {
        return Err(Error::invalid(format!(
            "fused AdamW slice lengths differ: master {n}, grad {grads}, m {}, v {}, bf16 {}",
            state.m.len(),
            state.v.len(),
            state.bf16.len()
        )));
    }
    let mut end = 0;
    for r in args.decayed {
        if r.start < end || r.start > r.end || r.end > n {
            return Err(Error::invalid(format!(
                "fused AdamW decay range {r:?} is out of order or outside 0..{n}"
            )));
        }
        end = r.end;
    }
    if !(args.clip_coef.is_finite() && args.clip_coef >= 0.0) {
        return Err(Error::invalid(format!(
            "clip coefficient must be finite and >= 0, got {}",
            args.clip_coef
        )));
    }
    let plain = Coeffs::new(&args.hp, args.lr, args.step, false)?;
    let decayed = Coeffs::new(&args.hp, args.lr, args.step, true)?;
    Ok((plain, decayed))
}

/// Matching windows of the five arrays (`out` empty when there is no bf16 copy to write).
struct Chunk<'a> {
    p: &'a mut [f32],
    g: &'a [f32],
    m: &'a mut [f32],
    v: &'a mut [f32],
    out: &'a mut [u16],
}

impl<'a> Chunk<'a> {
    /// Splits off the first `k` elements.
    fn split(self, k: usize) -> (Chunk<'a>, Chunk<'a>) {
        let (p0, p1) = self.p.split_at_mut(k);
        let (g0, g1) = self.g.split_at(k);
        let (m0, m1) = self.m.split_at_mut(k);
        let (v0, v1) = self.v.split_at_mut(k);
        let (o0, o1) = if self.out.is_empty() {
            (Default::default(), self.out)
        } else {
            self.out.split_at_mut(k)
        };
        (
            Chunk { p: p0, g: g0, m: m0, v: v0, out: o0 },
            Chunk { p: p1, g: g1, m: m1, v: v1, out: o1 },
        )
    }
}

/// Calls `f` on the consecutive pieces of `chunk` (which starts at element `offset` of the unit)
/// with whether each piece lies inside a decayed range. `decayed` is sorted and disjoint.
fn for_each_span(
    chunk: Chunk<'_>,
    offset: usize,
    decayed: &[Range<usize>],
    mut f: impl FnMut(Chunk<'_>, bool),
) {
    let end = offset + chunk.p.len();
    let first = decayed.partition_point(|r| r.end <= offset);
    let mut rest = chunk;
    let mut at = offset;
    for r in decayed.get(first..).unwrap_or(&[]) {
        if r.start >= end {
            break;
        }
        let (start, stop) = (r.start.max(at), r.end.min(end));
        if start > at {
            let (plain, tail) = rest.split(start - at);
            f(plain, false);
            rest = tail;
        }
        if stop > start {
            let (dec, tail) = rest.split(stop - start);
            f(dec, true);
            rest = tail;
        }
        at = stop.max(at);
    }
    if !rest.p.is_empty() {
        f(rest, false);
    }
}

fn fused_chunk(isa: Isa, c: Chunk<'_>, coeffs: &Coeffs, clip: f32) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::detect` returned Avx512 only after checking AVX-512F and FMA.
        Isa::Avx512 => unsafe { avx512::fused(c, coeffs, clip) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::detect` returned Avx2Fma only after checking AVX2 and FMA.
        Isa::Avx2Fma => unsafe { fused_avx2_fma(c, coeffs, clip) },
        Isa::Portable => fused_body(c, coeffs, clip),
    }
}

/// The fused body compiled for AVX2 with FMA (8 lanes).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fused_avx2_fma(c: Chunk<'_>, coeffs: &Coeffs, clip: f32) {
    fused_body(c, coeffs, clip);
}

/// One element of the update; [`update_body`]'s arithmetic on the clipped gradient.
#[inline(always)]
fn fused_element(
    p: &mut f32,
    g: f32,
    m: &mut f32,
    v: &mut f32,
    out: &mut u16,
    c: &Coeffs,
    clip: f32,
) {
    let g = g * clip;
    let decayed = *p * c.decay;
    let base = if c.lerp_from_grad { g } else { *m };
    let m_new = c.lerp_coeff.mul_add(g - *m, base);
    let v_new = (c.one_minus_beta2 * g).mul_add(g, *v * c.beta2);
    let denom = v_new.sqrt() / c.bc2_sqrt + c.eps;
    let p_new = decayed + (c.neg_step_size * m_new) / denom;
    *p = p_new;
    *m = m_new;
    *v = v_new;
    *out = bf16_bits(p_new);
}

#[inline(always)]
fn fused_body(c: Chunk<'_>, coeffs: &Coeffs, clip: f32) {
    let Chunk { p, g, m, v, out } = c;
    let n = p.len();
    if out.is_empty() {
        let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
        // No copy to refresh: the rounding lands in a local the compiler drops.
        let mut none = 0;
        for i in 0..n {
            fused_element(&mut p[i], g[i], &mut m[i], &mut v[i], &mut none, coeffs, clip);
        }
        return;
    }
    // Equal lengths let the compiler drop the bounds checks and vectorise the loop.
    let (g, m, v, out) = (&g[..n], &mut m[..n], &mut v[..n], &mut out[..n]);
    for i in 0..n {
        fused_element(&mut p[i], g[i], &mut m[i], &mut v[i], &mut out[i], coeffs, clip);
    }
}

/// The scalar baseline: the same element function, kept out of line of any vectorisation by
/// handing every element through `black_box`.
fn fused_scalar(c: Chunk<'_>, coeffs: &Coeffs, clip: f32) {
    let Chunk { p, g, m, v, out } = c;
    if out.is_empty() {
        let mut none = 0;
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            fused_element(p, std::hint::black_box(g), m, v, &mut none, coeffs, clip);
        }
        return;
    }
    for ((((p, &g), m), v), out) in
        p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()).zip(out.iter_mut())
    {
        fused_element(p, std::hint::black_box(g), m, v, out, coeffs, clip);
    }
}

/// f32 to bf16 bits, rounding to nearest even (as `half::bf16::from_f32` and torch's `.to(
/// torch.bfloat16)`); NaN stays a quiet NaN of the same sign. Branch-free so it vectorises.
#[inline(always)]
pub fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16;
    let nan = (bits >> 16) | 0x0040;
    (if x.is_nan() { nan } else { rounded }) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hp() -> AdamW {
        AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 }
    }

    /// Distance in units in the last place, for finite values of the same sign.
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    fn run(decay: bool, hp: &AdamW, steps: &[[f32; 3]]) -> ([f32; 3], [f32; 3], [f32; 3]) {
        let mut p = [0.5f32, -1.25, 2.0];
        let (mut m, mut v) = ([0.0f32; 3], [0.0f32; 3]);
        for (i, g) in steps.iter().enumerate() {
            let args = TensorStep { step: i as u64 + 1, lr: hp.lr, hp: *hp, decay };
            adamw_step(&mut p, g, &mut m, &mut v, &args).expect("valid step");
        }
        (p, m, v)
    }

    const GRADS: [[f32; 3]; 2] = [[0.1, -0.2, 0.3], [-0.05, 0.4, 0.0]];

    #[test]
    fn two_steps_match_values_computed_by_hand() {
        // By hand, in exact arithmetic, for element 0 (p = 0.5, g1 = 0.1, g2 = -0.05):
        // step 1: p = 0.5 (1 - 1e-3) = 0.4995; m = 0.01; v = 5e-4;
        //         m^ = 0.01 / 0.1 = 0.1; v^ = 5e-4 / 0.05 = 0.01; p -= 1e-2 * 0.1 / (0.1 + 1e-8)
        //         -> p = 0.4895000001
        // step 2: p *= 0.999 -> 0.4890105000999; m = 0.009 - 0.005 = 0.004;
        //         v = 4.75e-4 + 1.25e-4 = 6e-4; m^ = 0.004 / 0.19; v^ = 6e-4 / 0.0975;
        //         p -= 1e-2 m^ / (sqrt(v^) + 1e-8)
        let (p, m, v) = run(true, &hp(), &GRADS);
        let exact_m = 0.004f64;
        let exact_v = 6e-4f64;
        let m_hat = exact_m / 0.19;
        let v_hat = exact_v / (1.0 - 0.95f64 * 0.95);
        let exact_p = 0.4895000001f64 * 0.999 - 1e-2 * m_hat / (v_hat.sqrt() + 1e-8);
        assert!((m[0] as f64 - exact_m).abs() < 1e-9, "m[0] = {}", m[0]);
        assert!((v[0] as f64 - exact_v).abs() < 1e-10, "v[0] = {}", v[0]);
        assert!((p[0] as f64 - exact_p).abs() < 1e-7, "p[0] = {} vs {exact_p}", p[0]);

        // The same two steps through torch 2.11.0 (torch.optim.AdamW, foreach=False, CPU f32):
        // m and v bit for bit; p within an ulp (torch's sqrt is not correctly rounded).
        let torch_p = [0.4863268f32, -1.241145, 1.9792256];
        let torch_m = [0.004f32, 0.022000002, 0.027];
        let torch_v = [0.0006f32, 0.009900001, 0.004275];
        for i in 0..3 {
            assert_eq!(m[i].to_bits(), torch_m[i].to_bits(), "m[{i}] {} vs {}", m[i], torch_m[i]);
            assert_eq!(v[i].to_bits(), torch_v[i].to_bits(), "v[{i}] {} vs {}", v[i], torch_v[i]);
            assert!(ulps(p[i], torch_p[i]) <= 1, "p[{i}] {} vs torch {}", p[i], torch_p[i]);
        }
    }

    #[test]
    fn decay_off_leaves_the_decay_term_out() {
        let no_wd = AdamW { weight_decay: 0.0, ..hp() };
        let (p_off, m_off, v_off) = run(false, &hp(), &GRADS);
        let (p_zero_wd, _, _) = run(true, &no_wd, &GRADS);
        let (p_on, m_on, v_on) = run(true, &hp(), &GRADS);
        assert_eq!(p_off, p_zero_wd, "decay = false must equal weight_decay = 0");
        assert_eq!((m_off, v_off), (m_on, v_on), "moments do not depend on decay");
        for i in 0..3 {
            assert_ne!(p_off[i], p_on[i], "decay must change element {i}");
        }
        // Decay shrinks magnitudes: |p_on| < |p_off| for these values.
        assert!(p_on.iter().zip(&p_off).all(|(a, b)| a.abs() < b.abs()), "{p_on:?} {p_off:?}");
    }

    #[test]
    fn large_lerp_weight_uses_torchs_other_branch() {
        // beta1 = 0.25 gives lerp weight 0.75 >= 0.5: torch computes g - (g - m)(1 - w) there.
        let hp = AdamW { beta1: 0.25, ..hp() };
        let (_, m, _) = run(true, &hp, &GRADS);
        // Values from torch 2.11.0, bit for bit.
        let torch_m = [-0.01875f32, 0.2625, 0.056250002];
        for i in 0..3 {
            assert_eq!(m[i].to_bits(), torch_m[i].to_bits(), "m[{i}] {} vs {}", m[i], torch_m[i]);
        }
    }

    #[test]
    fn fma_and_portable_bodies_agree_bit_for_bit() {
        let n = 1000;
        let g: Vec<f32> = (0..n).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3).collect();
        let p0: Vec<f32> = (0..n).map(|i| ((i * 104729 % 997) as f32 - 498.0) * 1e-2).collect();
        let c = Coeffs::new(&hp(), 1e-2, 3, true).expect("valid");
        let (mut p_a, mut m_a, mut v_a) = (p0.clone(), vec![0.01f32; n], vec![0.02f32; n]);
        let (mut p_b, mut m_b, mut v_b) = (p_a.clone(), m_a.clone(), v_a.clone());
        update_body(&mut p_a, &g, &mut m_a, &mut v_a, &c);
        update_chunk(&mut p_b, &g, &mut m_b, &mut v_b, &c);
        assert_eq!((p_a, m_a, v_a), (p_b, m_b, v_b));
    }

    #[test]
    fn bad_input_is_an_error_and_changes_nothing() {
        let mut p = [1.0f32, 2.0];
        let (mut m, mut v) = ([0.0f32; 2], [0.0f32; 2]);
        let args = TensorStep { step: 1, lr: 1e-3, hp: hp(), decay: true };
        let err = adamw_step(&mut p, &[0.1], &mut m, &mut v, &args).expect_err("length mismatch");
        assert!(err.to_string().contains("grads 1"), "{err}");
        let err = adamw_step(&mut p, &[0.1, 0.2], &mut m, &mut v, &TensorStep { step: 0, ..args })
            .expect_err("step 0");
        assert!(err.to_string().contains("1-based"), "{err}");
        let bad = TensorStep { hp: AdamW { beta2: 1.0, ..hp() }, ..args };
        let err = adamw_step(&mut p, &[0.1, 0.2], &mut m, &mut v, &bad).expect_err("beta2 = 1");
        assert!(err.to_string().contains("beta2"), "{err}");
        let err =
            adamw_step(&mut p, &[0.1, 0.2], &mut m, &mut v, &TensorStep { lr: f32::NAN, ..args })
                .expect_err("NaN lr");
        assert!(err.to_string().contains("learning rate"), "{err}");
        assert_eq!((p, m, v), ([1.0, 2.0], [0.0; 2], [0.0; 2]));
    }

    #[test]
    fn decimal_hyperparameters_widen_as_written() {
        assert_eq!(as_written(0.9), 0.9f64);
        assert_eq!(as_written(1e-8), 1e-8f64);
        assert_eq!(as_written(0.999), 0.999f64);
        assert_ne!(f64::from(0.9f32), 0.9f64, "plain widening differs, hence as_written");
    }

    #[test]
    fn decays_matrices_not_vectors() {
        assert!(decays(&[97, 48]));
        assert!(!decays(&[48]));
        assert!(!decays(&[]));
    }

    /// A unit-shaped problem: `n` elements with varied values, and decay on two ranges.
    struct Unit {
        master: Vec<f32>,
        grad: Vec<f32>,
        m: Vec<f32>,
        v: Vec<f32>,
        bf16: Vec<u16>,
    }

    impl Unit {
        fn new(n: usize) -> Unit {
            // A cheap deterministic generator spanning several magnitudes and both signs.
            let val = |i: usize, k: u64| {
                let x = (i as u64).wrapping_mul(6364136223846793005).wrapping_add(k);
                let x = (x >> 33) as f32 / (1u64 << 31) as f32 - 0.5;
                x * 10f32.powi((i % 7) as i32 - 4)
            };
            Unit {
                master: (0..n).map(|i| val(i, 1)).collect(),
                grad: (0..n).map(|i| val(i, 2)).collect(),
                m: (0..n).map(|i| val(i, 3) * 1e-2).collect(),
                v: (0..n).map(|i| val(i, 4).abs() * 1e-3).collect(),
                bf16: vec![0; n],
            }
        }

        /// The mutable state and the gradient, borrowed together.
        fn parts(&mut self) -> (UnitState<'_>, &[f32]) {
            let state = UnitState {
                master: &mut self.master,
                m: &mut self.m,
                v: &mut self.v,
                bf16: &mut self.bf16,
            };
            (state, &self.grad)
        }

        fn bits(&self) -> (Vec<u32>, Vec<u32>, Vec<u32>, Vec<u16>) {
            let b = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            (b(&self.master), b(&self.m), b(&self.v), self.bf16.clone())
        }
    }

    fn fused_on(pool: &AdamPool, u: &mut Unit, args: &FusedStep<'_>) -> Result<()> {
        let (state, grad) = u.parts();
        adamw_fused(pool, state, grad, args)
    }

    fn fused_args(decayed: &[Range<usize>], clip_coef: f32) -> FusedStep<'_> {
        FusedStep { step: 3, lr: 1e-2, hp: hp(), clip_coef, decayed }
    }

    #[test]
    fn fused_equals_scale_then_adamw_step_per_tensor_then_rounding() {
        // Ranges straddle the 16 Ki-element task boundary and leave undecayed gaps.
        let n = 3 * FUSED_CHUNK + 123;
        let decayed = [10..FUSED_CHUNK + 5, 2 * FUSED_CHUNK..2 * FUSED_CHUNK + 700, n - 50..n];
        let coef = 0.37;
        let pool = AdamPool::new(2).expect("pool");
        let mut fused = Unit::new(n);
        let mut want = Unit::new(n);
        fused_on(&pool, &mut fused, &fused_args(&decayed, coef)).expect("valid");

        // The unfused path, tensor by tensor: decayed ranges and the gaps between them.
        let mut g = want.grad.clone();
        crate::optim::scale(&mut g, coef);
        let mut cuts = vec![0];
        for r in &decayed {
            cuts.extend([r.start, r.end]);
        }
        cuts.push(n);
        for (k, w) in cuts.windows(2).enumerate() {
            let r = w[0]..w[1];
            let decay = k % 2 == 1;
            adamw_step(
                &mut want.master[r.clone()],
                &g[r.clone()],
                &mut want.m[r.clone()],
                &mut want.v[r.clone()],
                &TensorStep { step: 3, lr: 1e-2, hp: hp(), decay },
            )
            .expect("valid");
        }
        want.bf16 = want.master.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
        assert_eq!(fused.bits(), want.bits());
        // The test means something: decay and clipping both changed the result.
        let mut undecayed = Unit::new(n);
        fused_on(&pool, &mut undecayed, &fused_args(&[], coef)).expect("valid");
        assert_ne!(undecayed.master[20], fused.master[20]);
        assert_eq!(undecayed.master[5], fused.master[5]);
    }

    #[test]
    fn fused_result_does_not_depend_on_thread_count_or_instruction_set() {
        let n = 5 * FUSED_CHUNK + 7;
        let decayed = vec![100..4 * FUSED_CHUNK, 4 * FUSED_CHUNK + 1..4 * FUSED_CHUNK + 9];
        let run = |threads: usize| {
            let pool = AdamPool::new(threads).expect("pool");
            let mut u = Unit::new(n);
            fused_on(&pool, &mut u, &fused_args(&decayed, 1.0)).expect("valid");
            u.bits()
        };
        let one = run(1);
        assert_eq!(one, run(3));
        assert_eq!(one, run(8));

        let mut scalar = Unit::new(n);
        {
            let (st, g) = scalar.parts();
            adamw_fused_scalar(st, g, &fused_args(&decayed, 1.0))
        }
        .expect("valid");
        assert_eq!(one, scalar.bits(), "scalar baseline");

        // Every instruction set this CPU has, against the portable body.
        let c = Coeffs::new(&hp(), 1e-2, 3, true).expect("valid");
        let mut isas = vec![Isa::Portable, Isa::detect()];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            isas.push(Isa::Avx2Fma);
        }
        let mut results = Vec::new();
        for isa in isas {
            let mut u = Unit::new(n);
            let g = u.grad.clone();
            let chunk =
                Chunk { p: &mut u.master, g: &g, m: &mut u.m, v: &mut u.v, out: &mut u.bf16 };
            fused_chunk(isa, chunk, &c, 0.5);
            results.push((isa, u.bits()));
        }
        for (isa, r) in &results[1..] {
            assert!(*r == results[0].1, "{isa:?} differs from the portable body");
        }
    }

    #[test]
    fn bf16_gradients_update_as_their_f32_widening_does() {
        let n = 2 * FUSED_CHUNK + 77;
        let decayed = [3..FUSED_CHUNK + 9, 2 * FUSED_CHUNK..2 * FUSED_CHUNK + 30];
        let pool = AdamPool::new(3).expect("pool");
        let mut wide = Unit::new(n);
        // Gradients that bf16 holds exactly, so both runs see the same values.
        let bits: Vec<u16> = wide.grad.iter().map(|&g| bf16_bits(g)).collect();
        wide.grad = bits.iter().map(|&b| f32::from_bits(u32::from(b) << 16)).collect();
        let mut narrow = Unit::new(n);
        fused_on(&pool, &mut wide, &fused_args(&decayed, 0.8)).expect("valid");
        {
            let state = UnitState {
                master: &mut narrow.master,
                m: &mut narrow.m,
                v: &mut narrow.v,
                bf16: &mut narrow.bf16,
            };
            adamw_fused_from(&pool, state, GradIn::Bf16(&bits), &fused_args(&decayed, 0.8))
        }
        .expect("valid");
        assert_eq!(wide.bits(), narrow.bits());
        // And the rounding mattered: the f32 gradients give other weights.
        let mut exact = Unit::new(n);
        fused_on(&pool, &mut exact, &fused_args(&decayed, 0.8)).expect("valid");
        assert_ne!(exact.bits().0, wide.bits().0);
        let err = {
            let state = UnitState {
                master: &mut narrow.master,
                m: &mut narrow.m,
                v: &mut narrow.v,
                bf16: &mut narrow.bf16,
            };
            adamw_fused_from(&pool, state, GradIn::Bf16(&bits[1..]), &fused_args(&decayed, 0.8))
        }
        .expect_err("short gradients");
        assert!(err.to_string().contains("lengths differ"), "{err}");
    }

    #[test]
    fn without_a_copy_the_update_is_the_same_and_writes_no_copy() {
        // Odd offsets and lengths: the AVX-512 body's head, vector loop and tail all run.
        let n = 2 * FUSED_CHUNK + 333;
        let decayed = [5..FUSED_CHUNK + 17, n - 40..n];
        let pool = AdamPool::new(3).expect("pool");
        let mut with = Unit::new(n);
        fused_on(&pool, &mut with, &fused_args(&decayed, 0.6)).expect("valid");
        let mut without = Unit::new(n);
        without.bf16.clear();
        fused_on(&pool, &mut without, &fused_args(&decayed, 0.6)).expect("valid");
        let (a, b) = (with.bits(), without.bits());
        assert_eq!((&a.0, &a.1, &a.2), (&b.0, &b.1, &b.2));
        assert!(b.3.is_empty());
        // Every instruction set this CPU has, and the scalar baseline.
        let c = Coeffs::new(&hp(), 1e-2, 3, true).expect("valid");
        let mut isas = vec![Isa::Portable, Isa::detect()];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            isas.push(Isa::Avx2Fma);
        }
        for isa in isas {
            let run = |copy: bool| {
                let mut u = Unit::new(4099);
                if !copy {
                    u.bf16.clear();
                }
                let g = u.grad.clone();
                let (p, m, v) = (&mut u.master[3..], &mut u.m[3..], &mut u.v[3..]);
                let out: &mut [u16] = if copy { &mut u.bf16[3..] } else { &mut [] };
                fused_chunk(isa, Chunk { p, g: &g[3..], m, v, out }, &c, 0.5);
                let b = u.bits();
                (b.0, b.1, b.2)
            };
            assert_eq!(run(true), run(false), "{isa:?}");
        }
        let mut scalar = Unit::new(n);
        scalar.bf16.clear();
        {
            let (st, g) = scalar.parts();
            adamw_fused_scalar(st, g, &fused_args(&decayed, 0.6))
        }
        .expect("valid");
        assert_eq!(scalar.bits().0, a.0, "scalar baseline");
    }

    #[test]
    fn this_cpus_kernel_matches_the_portable_body_on_store_memory_and_special_values() {
        use crate::store::HostSlab;
        let n = 4003;
        let mut src = Unit::new(n);
        src.grad[7] = f32::NAN;
        src.grad[40] = f32::INFINITY;
        src.grad[41] = f32::NEG_INFINITY;
        src.grad[42] = 0.0;
        src.master[50] = f32::MAX;
        src.master[51] = -0.0;
        src.master[52] = 1e-40; // subnormal
        let c = Coeffs::new(&hp(), 1e-2, 3, true).expect("valid");
        // Page-aligned slabs, as in the store, entered at element 5: the AVX-512 body runs
        // elements 5..16 scalar until its bf16 stores are aligned, then 16 at a time, then 3
        // scalar at the end.
        let run = |isa: Isa| {
            let slab = |x: &[f32]| {
                let mut s = HostSlab::zeroed(x.len() * 4).expect("slab");
                s.as_f32_mut().copy_from_slice(x);
                s
            };
            let (mut p, mut m, mut v) = (slab(&src.master), slab(&src.m), slab(&src.v));
            let g = slab(&src.grad);
            let mut out = HostSlab::zeroed(n * 2).expect("slab");
            let chunk = Chunk {
                p: &mut p.as_f32_mut()[5..],
                g: &g.as_f32()[5..],
                m: &mut m.as_f32_mut()[5..],
                v: &mut v.as_f32_mut()[5..],
                out: &mut out.as_u16_mut()[5..],
            };
            fused_chunk(isa, chunk, &c, 0.5);
            let bits = |s: &HostSlab| s.as_f32().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            (bits(&p), bits(&m), bits(&v), out.as_u16().to_vec())
        };
        let want = run(Isa::Portable);
        let got = run(Isa::detect());
        assert!(got == want, "{:?} differs from the portable body", Isa::detect());
        assert!(f32::from_bits(want.0[7]).is_nan(), "the NaN gradient reached the result");
    }

    #[test]
    fn bf16_rounds_to_nearest_even_like_half() {
        let samples = [
            0.0f32,
            -0.0,
            1.0,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            1.0 + 3.0 * f32::EPSILON,
            -2.5e-41,
            f32::MAX,
            f32::MIN_POSITIVE,
            f32::INFINITY,
            f32::NEG_INFINITY,
            std::f32::consts::PI,
            -1e30,
        ];
        for x in samples.into_iter().chain((0..100_000).map(|i| f32::from_bits(i * 42_943 + 7))) {
            assert_eq!(
                bf16_bits(x),
                half::bf16::from_f32(x).to_bits(),
                "{x:e} ({:#x})",
                x.to_bits()
            );
        }
        // Ties: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7 and goes to the even one, 1.
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3F80);
        assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3F82);
        let nan = bf16_bits(f32::NAN);
        assert!(half::bf16::from_bits(nan).is_nan());
    }

    #[test]
    fn fused_rejects_bad_input_and_changes_nothing() {
        let pool = AdamPool::new(1).expect("pool");
        let mut u = Unit::new(8);
        let before = u.bits();
        let g = u.grad.clone();
        let short = &g[..7];
        let err =
            adamw_fused(&pool, u.parts().0, short, &fused_args(&[], 1.0)).expect_err("length");
        assert!(err.to_string().contains("grad 7"), "{err}");
        let err = adamw_fused(&pool, u.parts().0, &g, &fused_args(&[4..9, 9..9], 1.0))
            .expect_err("bounds");
        assert!(err.to_string().contains("4..9"), "{err}");
        let err = adamw_fused(&pool, u.parts().0, &g, &fused_args(&[4..6, 2..3], 1.0))
            .expect_err("order");
        assert!(err.to_string().contains("2..3"), "{err}");
        let err =
            adamw_fused(&pool, u.parts().0, &g, &fused_args(&[], f32::NAN)).expect_err("coef");
        assert!(err.to_string().contains("clip coefficient"), "{err}");
        let bad = FusedStep { step: 0, ..fused_args(&[], 1.0) };
        let err = adamw_fused(&pool, u.parts().0, &g, &bad).expect_err("step 0");
        assert!(err.to_string().contains("1-based"), "{err}");
        assert_eq!(u.bits(), before);
    }
}
