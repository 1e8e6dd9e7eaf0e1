//! The LM head's chunked cross-entropy; the CPU twin with the derivation is
//! `backend/cpu/loss.rs`. A chunk of tokens at a time: its logits `[C, V]` (f32) come from one
//! cuBLASLt GEMM, a row kernel reduces them to lse and loss (forward) or to the logits'
//! gradient `G` (bf16, backward), and two GEMMs give `dx = G · w` and `dw += Gᵀ · x`. At most
//! `LOGITS_BUDGET` logits exist at once, whatever the vocabulary and the token count. Training's
//! head runs both in one pass (`cross_entropy_forward_backward_op`), computing each chunk's
//! logits once instead of once in each direction.

use cudarc::driver::LaunchConfig;

use super::device::scratch;
use super::kernel;
use super::matmul::GemmCall;
use super::profile::OpClass;
use super::{Cuda, Floats, Ints, View, ViewMut, check};
use crate::backend::{FloatKind, Grads, IGNORE, LossOps, LossOut, LossShape, Operands};
use crate::error::Result;

/// Default logits per chunk: the planner's budget for the head's workspace.
pub(super) const LOGITS_BUDGET: usize = crate::placement::LOSS_CHUNK_LOGITS;

fn row_config(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (512, 1, 1), shared_mem_bytes: 0 }
}

/// A view of the scratch logits as the trait's float type, for the GEMM helper.
fn scratch_view(buf: &Floats, len: usize) -> View<'_> {
    View { buf, start: 0, len }
}

impl Cuda {
    fn check_head<'a>(
        op: &str,
        operands: &Operands<View<'_>>,
        targets: &'a Ints,
        shape: &LossShape,
    ) -> Result<&'a [i32]> {
        let Operands { inp: x, w } = operands;
        let &LossShape { tokens, hidden, vocab, .. } = shape;
        check::nonzero(op, "hidden", hidden)?;
        check::nonzero(op, "vocab", vocab)?;
        check::len(op, "x", x.len, &[tokens, hidden])?;
        check::len(op, "w", w.len, &[vocab, hidden])?;
        let host = check::ints(op, "targets", &targets.host, tokens)?;
        check::targets(op, host, vocab)?;
        Ok(host)
    }

    /// Checks the per-token outputs; returns them as views.
    fn check_loss_out<'a>(
        op: &str,
        out: &'a LossOut<ViewMut<'_>>,
        tokens: usize,
    ) -> Result<(View<'a>, View<'a>)> {
        let (lo, ls) = (out.losses.as_view(), out.lse.as_view());
        check::len(op, "losses", lo.len, &[tokens])?;
        check::len(op, "lse", ls.len, &[tokens])?;
        check::kind(op, "losses", &lo, FloatKind::Accum)?;
        check::kind(op, "lse", &ls, FloatKind::Accum)?;
        Ok((lo, ls))
    }

    /// Checks the gradients' extents; returns them as views.
    fn check_head_grads<'a>(
        op: &str,
        grads: &'a Grads<ViewMut<'_>>,
        shape: &LossShape,
    ) -> Result<(View<'a>, View<'a>)> {
        let &LossShape { tokens, hidden, vocab, .. } = shape;
        let (dx, dw) = (grads.dinp.as_view(), grads.dw.as_view());
        check::len(op, "dx", dx.len, &[tokens, hidden])?;
        check::len(op, "dw", dw.len, &[vocab, hidden])?;
        Ok((dx, dw))
    }

    /// Rows `c0..c0 + m` of a `[T, hidden]` view.
    fn chunk_rows<'a>(x: &View<'a>, c0: usize, m: usize, hidden: usize) -> View<'a> {
        View { buf: x.buf, start: x.start + c0 * hidden, len: m * hidden }
    }

    /// A chunk's logits `z [m, V] = xc · wᵀ` (f32).
    fn chunk_logits(
        &self,
        op: &str,
        w: View<'_>,
        xc: View<'_>,
        z: View<'_>,
        m: usize,
    ) -> Result<()> {
        let (vocab, hidden) = (z.len / m, xc.len / m);
        self.gemm(
            op,
            &GemmCall {
                trans: (true, false),
                dims: (vocab, m, hidden),
                a: (w, hidden),
                b: (xc, hidden),
                c: (z, vocab),
                accumulate: false,
            },
        )
    }

    /// A chunk's gradients from the logits' gradient `g [m, V]` (bf16): `dxc = g · w`
    /// (overwrites) and `dw += gᵀ · xc`, with `operands` the chunk's x and the whole w.
    fn chunk_grads(
        &self,
        op: &str,
        operands: Operands<View<'_>>,
        g: View<'_>,
        dxc: View<'_>,
        dw: View<'_>,
        m: usize,
    ) -> Result<()> {
        let Operands { inp: xc, w } = operands;
        let (vocab, hidden) = (g.len / m, xc.len / m);
        // dx = G · w: dxᵀ[H, m] = wᵀ · Gᵀ.
        self.gemm(
            op,
            &GemmCall {
                trans: (false, false),
                dims: (hidden, m, vocab),
                a: (w, hidden),
                b: (g, vocab),
                c: (dxc, hidden),
                accumulate: false,
            },
        )?;
        // dw += Gᵀ · x: dwᵀ[H, V] += xᵀ · G.
        self.gemm(
            op,
            &GemmCall {
                trans: (false, true),
                dims: (hidden, vocab, m),
                a: (xc, hidden),
                b: (g, vocab),
                c: (dw, hidden),
                accumulate: true,
            },
        )
    }
}

impl LossOps for Cuda {
    fn cross_entropy_forward(
        &self,
        losses: ViewMut<'_>,
        lse: ViewMut<'_>,
        operands: Operands<View<'_>>,
        targets: &Ints,
        shape: &LossShape,
    ) -> Result<()> {
        let &LossShape { tokens, hidden, vocab, .. } = shape;
        let _t = self.timed(
            "cross_entropy_forward",
            OpClass::Loss,
            2.0 * (tokens * hidden * vocab) as f64,
        );
        const OP: &str = "cross_entropy_forward";
        Self::check_head(OP, &operands, targets, shape)?;
        let Operands { inp: x, w } = operands;
        let &LossShape { tokens, hidden, vocab, softcap } = shape;
        let out = LossOut { losses, lse };
        let (lo, ls) = Self::check_loss_out(OP, &out, tokens)?;
        if tokens == 0 {
            return Ok(());
        }
        let chunk = self.loss_chunk_tokens(tokens, vocab);
        let logits = Floats::F32(scratch::<f32>(&self.compute, chunk * vocab)?);
        let tp = self.ints_ptr(targets);
        for c0 in (0..tokens).step_by(chunk) {
            let m = chunk.min(tokens - c0);
            let z = scratch_view(&logits, m * vocab);
            self.chunk_logits(OP, w, Self::chunk_rows(&x, c0, m, hidden), z, m)?;
            self.launch(
                row_config(m),
                kernel::cross_entropy_rows {
                    losses: self.ptr(&lo) + 4 * c0 as u64,
                    lse: self.ptr(&ls) + 4 * c0 as u64,
                    logits: self.ptr(&z),
                    targets: tp + 4 * c0 as u64,
                    vocab: vocab as i64,
                    cap: softcap.unwrap_or(0.0),
                },
            )?;
        }
        Ok(())
    }

    fn cross_entropy_backward(
        &self,
        grads: Grads<ViewMut<'_>>,
        operands: Operands<View<'_>>,
        lse: View<'_>,
        targets: &Ints,
        scale: f32,
        shape: &LossShape,
    ) -> Result<()> {
        let &LossShape { tokens, hidden, vocab, .. } = shape;
        let _t = self.timed(
            "cross_entropy_backward",
            OpClass::Loss,
            6.0 * (tokens * hidden * vocab) as f64,
        );
        const OP: &str = "cross_entropy_backward";
        let host = Self::check_head(OP, &operands, targets, shape)?;
        let Operands { inp: x, w } = operands;
        let &LossShape { tokens, hidden, vocab, softcap } = shape;
        let (dxv, dwv) = Self::check_head_grads(OP, &grads, shape)?;
        check::len(OP, "lse", lse.len, &[tokens])?;
        check::kind(OP, "lse", &lse, FloatKind::Accum)?;
        if tokens == 0 {
            return Ok(());
        }
        let chunk = self.loss_chunk_tokens(tokens, vocab);
        let logits = Floats::F32(scratch::<f32>(&self.compute, chunk * vocab)?);
        let grad = Floats::Bf16(scratch::<u16>(&self.compute, chunk * vocab)?);
        let tp = self.ints_ptr(targets);
        for c0 in (0..tokens).step_by(chunk) {
            let m = chunk.min(tokens - c0);
            let dxc = Self::chunk_rows(&dxv, c0, m, hidden);
            if host[c0..c0 + m].iter().all(|&y| y == IGNORE) {
                // Prompt-only chunks are common in fine-tuning; their gradient is exactly zero.
                self.zero_view(&dxc)?;
                continue;
            }
            let xc = Self::chunk_rows(&x, c0, m, hidden);
            let (z, g) = (scratch_view(&logits, m * vocab), scratch_view(&grad, m * vocab));
            self.chunk_logits(OP, w, xc, z, m)?;
            self.launch(
                row_config(m),
                kernel::cross_entropy_grad_rows {
                    grad: self.ptr(&g),
                    logits: self.ptr(&z),
                    lse: self.ptr(&lse) + 4 * c0 as u64,
                    targets: tp + 4 * c0 as u64,
                    scale,
                    vocab: vocab as i64,
                    cap: softcap.unwrap_or(0.0),
                },
            )?;
            self.chunk_grads(OP, Operands { inp: xc, w }, g, dxc, dwv, m)?;
        }
        Ok(())
    }

    /// The forward and the backward over each chunk's logits computed once: the same kernels'
    /// arithmetic (`row_lse`, `row_grad` in `loss.cu`) and the same GEMMs as the two ops, so
    /// the same bits.
    fn cross_entropy_forward_backward(
        &self,
        out: LossOut<ViewMut<'_>>,
        grads: Grads<ViewMut<'_>>,
        operands: Operands<View<'_>>,
        targets: &Ints,
        scale: f32,
        shape: &LossShape,
    ) -> Result<()> {
        let &LossShape { tokens, hidden, vocab, .. } = shape;
        let _t = self.timed(
            "cross_entropy_forward_backward",
            OpClass::Loss,
            6.0 * (tokens * hidden * vocab) as f64,
        );
        const OP: &str = "cross_entropy_forward_backward";
        let host = Self::check_head(OP, &operands, targets, shape)?;
        let Operands { inp: x, w } = operands;
        let &LossShape { tokens, hidden, vocab, softcap } = shape;
        let (lo, ls) = Self::check_loss_out(OP, &out, tokens)?;
        let (dxv, dwv) = Self::check_head_grads(OP, &grads, shape)?;
        if tokens == 0 {
            return Ok(());
        }
        let chunk = self.loss_chunk_tokens(tokens, vocab);
        let logits = Floats::F32(scratch::<f32>(&self.compute, chunk * vocab)?);
        let grad = Floats::Bf16(scratch::<u16>(&self.compute, chunk * vocab)?);
        let tp = self.ints_ptr(targets);
        for c0 in (0..tokens).step_by(chunk) {
            let m = chunk.min(tokens - c0);
            let xc = Self::chunk_rows(&x, c0, m, hidden);
            let (z, g) = (scratch_view(&logits, m * vocab), scratch_view(&grad, m * vocab));
            self.chunk_logits(OP, w, xc, z, m)?;
            self.launch(
                row_config(m),
                kernel::cross_entropy_loss_grad_rows {
                    losses: self.ptr(&lo) + 4 * c0 as u64,
                    lse: self.ptr(&ls) + 4 * c0 as u64,
                    grad: self.ptr(&g),
                    logits: self.ptr(&z),
                    targets: tp + 4 * c0 as u64,
                    scale,
                    vocab: vocab as i64,
                    cap: softcap.unwrap_or(0.0),
                },
            )?;
            let dxc = Self::chunk_rows(&dxv, c0, m, hidden);
            if host[c0..c0 + m].iter().all(|&y| y == IGNORE) {
                // As the backward: a chunk without a trained token has exactly zero gradients.
                self.zero_view(&dxc)?;
                continue;
            }
            self.chunk_grads(OP, Operands { inp: xc, w }, g, dxc, dwv, m)?;
        }
        Ok(())
    }
}
