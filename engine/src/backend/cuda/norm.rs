//! RMSNorm and Qwen3's per-head q/k RMSNorm; the CPU twin is `backend/cpu/norm.rs`. Both run the
//! same two kernels over "rows of `dim` elements" (see `kernels/norm.cu`); the weight gradient is
//! summed per row chunk, then the chunks in order, so it is deterministic.

use cudarc::driver::LaunchConfig;

use super::device::{Arg, base_ptr, scratch};
use super::elementwise::COLUMN_CHUNKS;
use super::{Cuda, View, ViewMut, check};
use crate::backend::{AttentionShape, FloatKind};
use crate::error::Result;

/// How a norm call lays its rows out.
struct Rows {
    tokens: usize,
    stride: usize,
    heads: usize,
    /// Rows `h < nq` use the first weight vector, the others the second.
    nq: usize,
    dim: usize,
    /// Copy the tail of each token's row (the value heads) through unchanged.
    copy_tail: bool,
}

/// Threads per block for rows of `dim`: one element per thread up to 256, then 256 or more.
fn threads(dim: usize) -> u32 {
    dim.div_ceil(32).clamp(1, if dim > 4096 { 32 } else { 8 }) as u32 * 32
}

impl Cuda {
    #[allow(clippy::too_many_arguments)]
    fn norm_forward(
        &self,
        op: &str,
        out: &ViewMut<'_>,
        rstd: &ViewMut<'_>,
        inp: &View<'_>,
        w: &View<'_>,
        r: &Rows,
        eps: f32,
    ) -> Result<()> {
        let (o, rs) = (out.as_view(), rstd.as_view());
        check::kind(op, "rstd", &rs, FloatKind::Accum)?;
        let grid_y = r.heads + usize::from(r.copy_tail);
        self.launch(
            "rmsnorm_forward",
            LaunchConfig {
                grid_dim: (r.tokens as u32, grid_y as u32, 1),
                block_dim: (threads(r.dim), 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                Arg::Ptr(self.ptr(&o)),
                Arg::I32(o.is_f32()),
                Arg::Ptr(self.ptr(&rs)),
                Arg::Ptr(self.ptr(inp)),
                Arg::I32(inp.is_f32()),
                Arg::Ptr(self.ptr(w)),
                Arg::I32(w.is_f32()),
                Arg::I64(r.stride as i64),
                Arg::I32(check::int(op, "heads", r.heads)?),
                Arg::I32(check::int(op, "nq", r.nq)?),
                Arg::I32(check::int(op, "dim", r.dim)?),
                Arg::F32(eps),
                Arg::I32(i32::from(r.copy_tail)),
            ],
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn norm_backward(
        &self,
        op: &str,
        dinp: &ViewMut<'_>,
        dw: &ViewMut<'_>,
        dout: &View<'_>,
        inp: &View<'_>,
        w: &View<'_>,
        rstd: &View<'_>,
        r: &Rows,
    ) -> Result<()> {
        check::kind(op, "rstd", rstd, FloatKind::Accum)?;
        if r.tokens == 0 {
            return Ok(());
        }
        let wlen = w.len;
        let rows_per = r.tokens.div_ceil(COLUMN_CHUNKS.min(r.tokens));
        let chunks = r.tokens.div_ceil(rows_per);
        let partials = scratch::<f32>(&self.compute, chunks * wlen)?;
        let pp = base_ptr(&partials, &self.compute);
        let d = dinp.as_view();
        self.launch(
            "rmsnorm_backward",
            LaunchConfig {
                grid_dim: (chunks as u32, 1, 1),
                block_dim: (threads(r.dim), 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                Arg::Ptr(self.ptr(&d)),
                Arg::I32(d.is_f32()),
                Arg::Ptr(pp),
                Arg::I32(check::int(op, "w", wlen)?),
                Arg::Ptr(self.ptr(dout)),
                Arg::I32(dout.is_f32()),
                Arg::Ptr(self.ptr(inp)),
                Arg::I32(inp.is_f32()),
                Arg::Ptr(self.ptr(w)),
                Arg::I32(w.is_f32()),
                Arg::Ptr(self.ptr(rstd)),
                Arg::I64(r.tokens as i64),
                Arg::I64(rows_per as i64),
                Arg::I64(r.stride as i64),
                Arg::I32(check::int(op, "heads", r.heads)?),
                Arg::I32(check::int(op, "nq", r.nq)?),
                Arg::I32(check::int(op, "dim", r.dim)?),
                Arg::I32(i32::from(r.copy_tail)),
            ],
        )?;
        self.finish_columns(dw, pp, chunks, wlen)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn rmsnorm_forward_op(
        &self,
        out: ViewMut<'_>,
        rstd: ViewMut<'_>,
        inp: View<'_>,
        w: View<'_>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "rmsnorm_forward";
        check::nonzero(OP, "dim", dim)?;
        check::len(OP, "out", out.len, &[rows, dim])?;
        check::len(OP, "rstd", rstd.len, &[rows])?;
        check::len(OP, "inp", inp.len, &[rows, dim])?;
        check::len(OP, "w", w.len, &[dim])?;
        let r = Rows { tokens: rows, stride: dim, heads: 1, nq: 1, dim, copy_tail: false };
        self.norm_forward(OP, &out, &rstd, &inp, &w, &r, eps)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn rmsnorm_backward_op(
        &self,
        dinp: ViewMut<'_>,
        dw: ViewMut<'_>,
        dout: View<'_>,
        inp: View<'_>,
        w: View<'_>,
        rstd: View<'_>,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        const OP: &str = "rmsnorm_backward";
        check::nonzero(OP, "dim", dim)?;
        check::len(OP, "dinp", dinp.len, &[rows, dim])?;
        check::len(OP, "dw", dw.len, &[dim])?;
        check::len(OP, "dout", dout.len, &[rows, dim])?;
        check::len(OP, "inp", inp.len, &[rows, dim])?;
        check::len(OP, "w", w.len, &[dim])?;
        check::len(OP, "rstd", rstd.len, &[rows])?;
        let r = Rows { tokens: rows, stride: dim, heads: 1, nq: 1, dim, copy_tail: false };
        self.norm_backward(OP, &dinp, &dw, &dout, &inp, &w, &rstd, &r)
    }

    /// Checks a per-head norm's buffers and returns its row layout.
    fn head_rows(
        op: &str,
        shape: &AttentionShape,
        inp: usize,
        rstd: usize,
        w: usize,
    ) -> Result<Rows> {
        let width = check::attention_shape(op, shape)?;
        let heads = shape.q_heads + shape.kv_heads;
        check::len(op, "rstd", rstd, &[shape.tokens, heads])?;
        check::len(op, "w", w, &[2, shape.head_dim])?;
        check::len(op, "inp", inp, &[shape.tokens, width])?;
        Ok(Rows {
            tokens: shape.tokens,
            stride: width,
            heads,
            nq: shape.q_heads,
            dim: shape.head_dim,
            copy_tail: true,
        })
    }

    pub(super) fn head_rmsnorm_forward_op(
        &self,
        out: ViewMut<'_>,
        rstd: ViewMut<'_>,
        inp: View<'_>,
        w: View<'_>,
        shape: &AttentionShape,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "head_rmsnorm_forward";
        let r = Self::head_rows(OP, shape, inp.len, rstd.len, w.len)?;
        check::len(OP, "out", out.len, &[shape.tokens, r.stride])?;
        self.norm_forward(OP, &out, &rstd, &inp, &w, &r, eps)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn head_rmsnorm_backward_op(
        &self,
        dinp: ViewMut<'_>,
        dw: ViewMut<'_>,
        dout: View<'_>,
        inp: View<'_>,
        w: View<'_>,
        rstd: View<'_>,
        shape: &AttentionShape,
    ) -> Result<()> {
        const OP: &str = "head_rmsnorm_backward";
        let r = Self::head_rows(OP, shape, inp.len, rstd.len, w.len)?;
        check::len(OP, "dinp", dinp.len, &[shape.tokens, r.stride])?;
        check::len(OP, "dout", dout.len, &[shape.tokens, r.stride])?;
        check::len(OP, "dw", dw.len, &[2, shape.head_dim])?;
        self.norm_backward(OP, &dinp, &dw, &dout, &inp, &w, &rstd, &r)
    }
}
