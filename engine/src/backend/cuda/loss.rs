//! The LM head's chunked cross-entropy; the CPU twin with the derivation is
//! `backend/cpu/loss.rs`. A chunk of tokens at a time: its logits `[C, V]` (f32) come from one
//! cuBLASLt GEMM, a row kernel reduces them to lse and loss (forward) or to the logits'
//! gradient `G` (bf16, backward), and two GEMMs give `dx = G · w` and `dw += Gᵀ · x`. At most
//! `LOGITS_BUDGET` logits exist at once, whatever the vocabulary and the token count.

use cudarc::driver::LaunchConfig;

use super::device::{Arg, scratch};
use super::{Cuda, Floats, Ints, View, ViewMut, check};
use crate::backend::{FloatKind, IGNORE};
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
    #[allow(clippy::too_many_arguments)]
    fn check_head<'a>(
        op: &str,
        x: &View<'_>,
        w: &View<'_>,
        targets: &'a Ints,
        tokens: usize,
        hidden: usize,
        vocab: usize,
    ) -> Result<&'a [i32]> {
        check::nonzero(op, "hidden", hidden)?;
        check::nonzero(op, "vocab", vocab)?;
        check::len(op, "x", x.len, &[tokens, hidden])?;
        check::len(op, "w", w.len, &[vocab, hidden])?;
        let host = check::ints(op, "targets", &targets.host, tokens)?;
        check::targets(op, host, vocab)?;
        Ok(host)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn cross_entropy_forward_op(
        &self,
        losses: ViewMut<'_>,
        lse: ViewMut<'_>,
        x: View<'_>,
        w: View<'_>,
        targets: &Ints,
        tokens: usize,
        hidden: usize,
        vocab: usize,
        softcap: Option<f32>,
    ) -> Result<()> {
        const OP: &str = "cross_entropy_forward";
        Self::check_head(OP, &x, &w, targets, tokens, hidden, vocab)?;
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
                (true, false),
                (vocab, m, hidden),
                (&w, hidden),
                (&xc, hidden),
                (&z, vocab),
                false,
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

    #[allow(clippy::too_many_arguments)]
    pub(super) fn cross_entropy_backward_op(
        &self,
        dx: ViewMut<'_>,
        dw: ViewMut<'_>,
        x: View<'_>,
        w: View<'_>,
        lse: View<'_>,
        targets: &Ints,
        scale: f32,
        tokens: usize,
        hidden: usize,
        vocab: usize,
        softcap: Option<f32>,
    ) -> Result<()> {
        const OP: &str = "cross_entropy_backward";
        let host = Self::check_head(OP, &x, &w, targets, tokens, hidden, vocab)?;
        let (dxv, dwv) = (dx.as_view(), dw.as_view());
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
                (true, false),
                (vocab, m, hidden),
                (&w, hidden),
                (&xc, hidden),
                (&z, vocab),
                false,
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
                (false, false),
                (hidden, m, vocab),
                (&w, hidden),
                (&g, vocab),
                (&dxc, hidden),
                false,
            )?;
            // dw += Gᵀ · x: dwᵀ[H, V] += xᵀ · G.
            self.gemm(
                OP,
                (false, true),
                (hidden, vocab, m),
                (&xc, hidden),
                (&g, vocab),
                (&dwv, hidden),
                true,
            )?;
        }
        Ok(())
    }
}
