//! The LM head's chunked cross-entropy; the CPU twin with the derivation is
//! `backend/cpu/loss.rs`. A chunk of tokens at a time: its logits `[C, V]` (f32) come from one
//! cuBLASLt GEMM, a row kernel reduces them to lse and loss (forward) or to the logits'
//! gradient `G` (bf16, backward), and two GEMMs give `dx = G · w` and `dw += Gᵀ · x`. At most
//! `LOGITS_BUDGET` logits exist at once, whatever the vocabulary and the token count.

use cudarc::driver::LaunchConfig;

use super::device::{Arg, scratch};
use super::matmul::GemmCall;
use super::{Cuda, Floats, Ints, View, ViewMut, check};
use crate::backend::{FloatKind, Grads, IGNORE, LossShape, Operands};
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

    pub(super) fn cross_entropy_forward_op(
        &self,
        losses: ViewMut<'_>,
        lse: ViewMut<'_>,
        operands: Operands<View<'_>>,
        targets: &Ints,
        shape: &LossShape,
    ) -> Result<()> {
        const OP: &str = "cross_entropy_forward";
        Self::check_head(OP, &operands, targets, shape)?;
        let Operands { inp: x, w } = operands;
        let &LossShape { tokens, hidden, vocab, softcap } = shape;
        let (lo, ls) = (losses.as_view(), lse.as_view());
        check::len(OP, "losses", lo.len, &[tokens])?;
        check::len(OP, "lse", ls.len, &[tokens])?;
        check::kind(OP, "losses", &lo, FloatKind::Accum)?;
        check::kind(OP, "lse", &ls, FloatKind::Accum)?;
        if tokens == 0 {
            return Ok(());
        }
        let chunk = self.loss_chunk_tokens(tokens, vocab);
        let logits = Floats::F32(scratch::<f32>(&self.compute, chunk * vocab)?);
        let tp = self.ints_ptr(targets);
        for c0 in (0..tokens).step_by(chunk) {
            let m = chunk.min(tokens - c0);
            let xc = View { buf: x.buf, start: x.start + c0 * hidden, len: m * hidden };
            let z = scratch_view(&logits, m * vocab);
            self.gemm(
                OP,
                &GemmCall {
                    trans: (true, false),
                    dims: (vocab, m, hidden),
                    a: (w, hidden),
                    b: (xc, hidden),
                    c: (z, vocab),
                    accumulate: false,
                },
            )?;
            self.launch(
                "cross_entropy_rows",
                row_config(m),
                &[
                    Arg::Ptr(self.ptr(&lo) + 4 * c0 as u64),
                    Arg::Ptr(self.ptr(&ls) + 4 * c0 as u64),
                    Arg::Ptr(self.ptr(&z)),
                    Arg::Ptr(tp + 4 * c0 as u64),
                    Arg::I64(vocab as i64),
                    Arg::F32(softcap.unwrap_or(0.0)),
                ],
            )?;
        }
        Ok(())
    }

    pub(super) fn cross_entropy_backward_op(
        &self,
        grads: Grads<ViewMut<'_>>,
        operands: Operands<View<'_>>,
        lse: View<'_>,
        targets: &Ints,
        scale: f32,
        shape: &LossShape,
    ) -> Result<()> {
        const OP: &str = "cross_entropy_backward";
        let host = Self::check_head(OP, &operands, targets, shape)?;
        let Operands { inp: x, w } = operands;
        let &LossShape { tokens, hidden, vocab, softcap } = shape;
        let (dxv, dwv) = (grads.dinp.as_view(), grads.dw.as_view());
        check::len(OP, "dx", dxv.len, &[tokens, hidden])?;
        check::len(OP, "dw", dwv.len, &[vocab, hidden])?;
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
            let dxc = View { buf: dxv.buf, start: dxv.start + c0 * hidden, len: m * hidden };
            if host[c0..c0 + m].iter().all(|&y| y == IGNORE) {
                // Prompt-only chunks are common in fine-tuning; their gradient is exactly zero.
                self.zero_view(&dxc)?;
                continue;
            }
            let xc = View { buf: x.buf, start: x.start + c0 * hidden, len: m * hidden };
            let (z, g) = (scratch_view(&logits, m * vocab), scratch_view(&grad, m * vocab));
            self.gemm(
                OP,
                &GemmCall {
                    trans: (true, false),
                    dims: (vocab, m, hidden),
                    a: (w, hidden),
                    b: (xc, hidden),
                    c: (z, vocab),
                    accumulate: false,
                },
            )?;
            self.launch(
                "cross_entropy_grad_rows",
                row_config(m),
                &[
                    Arg::Ptr(self.ptr(&g)),
                    Arg::Ptr(self.ptr(&z)),
                    Arg::Ptr(self.ptr(&lse) + 4 * c0 as u64),
                    Arg::Ptr(tp + 4 * c0 as u64),
                    Arg::F32(scale),
                    Arg::I64(vocab as i64),
                    Arg::F32(softcap.unwrap_or(0.0)),
                ],
            )?;
            // dx = G · w: dxᵀ[H, m] = wᵀ · Gᵀ.
            self.gemm(
                OP,
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
                OP,
                &GemmCall {
                    trans: (false, true),
                    dims: (hidden, vocab, m),
                    a: (xc, hidden),
                    b: (g, vocab),
                    c: (dwv, hidden),
                    accumulate: true,
                },
            )?;
        }
        Ok(())
    }
}
