//! RMSNorm and Qwen3's per-head q/k RMSNorm; the CPU twin is `backend/cpu/norm.rs`. Both run the
//! same two kernels over "rows of `dim` elements" (see `kernels/norm.cu`); the weight gradient is
//! summed per row chunk, then the chunks in order, so it is deterministic. Plain RMSNorm on bf16
//! rows of whole 16-byte vectors takes the `_vec` kernels instead, with the same chunks.

use cudarc::driver::LaunchConfig;

use super::device::{base_ptr, scratch};
use super::elementwise::COLUMN_CHUNKS;
use super::kernel;
use super::profile::OpClass;
use super::{Cuda, View, ViewMut, check};
use crate::backend::{
    AttentionShape, ElementwiseOps, FloatKind, Grads, NormOps, NormShape, Operands,
};
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

/// The gradients a norm's backward receives: `dout` through the norm, and optionally the
/// residual stream's, which reaches its input around it.
#[derive(Clone, Copy)]
struct Incoming<'a, 'b> {
    dout: &'a View<'b>,
    residual: Option<&'a View<'b>>,
}

/// Threads per block for rows of `dim`: one element per thread up to 256, then 256 or more.
fn threads(dim: usize) -> u32 {
    dim.div_ceil(32).clamp(1, if dim > 4096 { 32 } else { 8 }) as u32 * 32
}

/// 16-byte vectors each thread of `rmsnorm_forward_vec` holds (NORM_FWD_VPT) and its block limit
/// (`__launch_bounds__`); likewise for `rmsnorm_backward_vec`.
const FWD_VPT: usize = 4;
const FWD_MAX_THREADS: usize = 1024;
const BWD_VPT: usize = 2;
const BWD_MAX_THREADS: usize = 512;

/// Threads per block of a `_vec` kernel whose threads hold `vpt` vectors of a row of `dim`, or
/// `None` for head norms and for rows that do not fit or are not whole vectors. More vectors per
/// thread keep more bytes in flight; the forward holds 4 (Qwen2.5-7B's 3584: 128 threads), the
/// backward, which also holds 4 rows and the weight-gradient columns, 2 (224 threads).
fn vec_threads(r: &Rows, vpt: usize, max_threads: usize) -> Option<u32> {
    if r.heads != 1 || r.copy_tail || r.stride != r.dim || !r.dim.is_multiple_of(8) {
        return None;
    }
    let threads = (r.dim / 8).div_ceil(vpt).next_multiple_of(32);
    (threads <= max_threads).then_some(threads as u32)
}

impl Cuda {
    fn norm_forward(
        &self,
        op: &str,
        out: &ViewMut<'_>,
        rstd: &ViewMut<'_>,
        operands: &Operands<View<'_>>,
        r: &Rows,
        eps: f32,
    ) -> Result<()> {
        let Operands { inp, w } = operands;
        let (o, rs) = (out.as_view(), rstd.as_view());
        check::kind(op, "rstd", &rs, FloatKind::Accum)?;
        if let Some(threads) = vec_threads(r, FWD_VPT, FWD_MAX_THREADS)
            && self.vectors(&[&o, inp, w])
        {
            return self.launch(
                LaunchConfig {
                    grid_dim: (r.tokens as u32, 1, 1),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: 0,
                },
                kernel::rmsnorm_forward_vec {
                    out: self.ptr(&o),
                    rstd: self.ptr(&rs),
                    inp: self.ptr(inp),
                    w: self.ptr(w),
                    vecs: check::int(op, "dim", r.dim / 8)?,
                    eps,
                },
            );
        }
        let grid_y = r.heads + usize::from(r.copy_tail);
        self.launch(
            LaunchConfig {
                grid_dim: (r.tokens as u32, grid_y as u32, 1),
                block_dim: (threads(r.dim), 1, 1),
                shared_mem_bytes: 0,
            },
            kernel::rmsnorm_forward {
                out: self.ptr(&o),
                out_f32: o.is_f32(),
                rstd: self.ptr(&rs),
                inp: self.ptr(inp),
                inp_f32: inp.is_f32(),
                w: self.ptr(w),
                w_f32: w.is_f32(),
                stride: r.stride as i64,
                heads: check::int(op, "heads", r.heads)?,
                nq: check::int(op, "nq", r.nq)?,
                dim: check::int(op, "dim", r.dim)?,
                eps,
                copy_tail: i32::from(r.copy_tail),
            },
        )
    }

    /// The backward; with a residual gradient, the `_vec` kernel also adds it to `dinp` and
    /// this answers true, or it answers false and the caller adds it (the other kernel has no
    /// such input).
    fn norm_backward(
        &self,
        op: &str,
        grads: &Grads<ViewMut<'_>>,
        incoming: Incoming<'_, '_>,
        operands: &Operands<View<'_>>,
        rstd: &View<'_>,
        r: &Rows,
    ) -> Result<bool> {
        let Incoming { dout, residual } = incoming;
        let Grads { dinp, dw } = grads;
        let Operands { inp, w } = operands;
        check::kind(op, "rstd", rstd, FloatKind::Accum)?;
        if r.tokens == 0 {
            return Ok(true);
        }
        let wlen = w.len;
        let rows_per = r.tokens.div_ceil(COLUMN_CHUNKS.min(r.tokens));
        let chunks = r.tokens.div_ceil(rows_per);
        let partials = scratch::<f32>(&self.compute, chunks * wlen)?;
        let pp = base_ptr(&partials, &self.compute);
        let d = dinp.as_view();
        if let Some(threads) = vec_threads(r, BWD_VPT, BWD_MAX_THREADS)
            && self.vectors(&[&d, dout, inp, w])
            && residual.is_none_or(|res| self.vectors(&[res]))
        {
            self.launch(
                LaunchConfig {
                    grid_dim: (chunks as u32, 1, 1),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: 0,
                },
                kernel::rmsnorm_backward_vec {
                    dinp: self.ptr(&d),
                    residual: residual.map_or(0, |res| self.ptr(res)),
                    partials: pp,
                    dout: self.ptr(dout),
                    inp: self.ptr(inp),
                    w: self.ptr(w),
                    rstd: self.ptr(rstd),
                    tokens: r.tokens as i64,
                    rows_per: rows_per as i64,
                    vecs: check::int(op, "dim", r.dim / 8)?,
                },
            )?;
            self.finish_columns(dw, pp, chunks, wlen)?;
            return Ok(true);
        }
        self.launch(
            LaunchConfig {
                grid_dim: (chunks as u32, 1, 1),
                block_dim: (threads(r.dim), 1, 1),
                shared_mem_bytes: 0,
            },
            kernel::rmsnorm_backward {
                dinp: self.ptr(&d),
                dinp_f32: d.is_f32(),
                partials: pp,
                wlen: check::int(op, "w", wlen)?,
                dout: self.ptr(dout),
                dout_f32: dout.is_f32(),
                inp: self.ptr(inp),
                inp_f32: inp.is_f32(),
                w: self.ptr(w),
                w_f32: w.is_f32(),
                rstd: self.ptr(rstd),
                tokens: r.tokens as i64,
                rows_per: rows_per as i64,
                stride: r.stride as i64,
                heads: check::int(op, "heads", r.heads)?,
                nq: check::int(op, "nq", r.nq)?,
                dim: check::int(op, "dim", r.dim)?,
                copy_tail: i32::from(r.copy_tail),
            },
        )?;
        self.finish_columns(dw, pp, chunks, wlen)?;
        Ok(residual.is_none())
    }

    /// Checks a whole-row RMSNorm backward's buffers and runs it (see `norm_backward`).
    fn plain_norm_backward(
        &self,
        op: &str,
        grads: &Grads<ViewMut<'_>>,
        incoming: Incoming<'_, '_>,
        operands: &Operands<View<'_>>,
        rstd: &View<'_>,
        shape: &NormShape,
    ) -> Result<bool> {
        let &NormShape { rows, dim, .. } = shape;
        check::nonzero(op, "dim", dim)?;
        check::len(op, "dinp", grads.dinp.len, &[rows, dim])?;
        check::len(op, "dw", grads.dw.len, &[dim])?;
        check::len(op, "dout", incoming.dout.len, &[rows, dim])?;
        if let Some(residual) = incoming.residual {
            check::len(op, "residual", residual.len, &[rows, dim])?;
        }
        check::len(op, "inp", operands.inp.len, &[rows, dim])?;
        check::len(op, "w", operands.w.len, &[dim])?;
        check::len(op, "rstd", rstd.len, &[rows])?;
        let r = Rows { tokens: rows, stride: dim, heads: 1, nq: 1, dim, copy_tail: false };
        self.norm_backward(op, grads, incoming, operands, rstd, &r)
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
}

impl NormOps for Cuda {
    fn rmsnorm_forward(
        &self,
        out: ViewMut<'_>,
        rstd: ViewMut<'_>,
        operands: Operands<View<'_>>,
        shape: &NormShape,
    ) -> Result<()> {
        let _t = self.timed("rmsnorm_forward", OpClass::Norm, 0.0);
        const OP: &str = "rmsnorm_forward";
        let &NormShape { rows, dim, eps } = shape;
        check::nonzero(OP, "dim", dim)?;
        check::len(OP, "out", out.len, &[rows, dim])?;
        check::len(OP, "rstd", rstd.len, &[rows])?;
        check::len(OP, "inp", operands.inp.len, &[rows, dim])?;
        check::len(OP, "w", operands.w.len, &[dim])?;
        let r = Rows { tokens: rows, stride: dim, heads: 1, nq: 1, dim, copy_tail: false };
        self.norm_forward(OP, &out, &rstd, &operands, &r, eps)
    }

    fn rmsnorm_backward(
        &self,
        grads: Grads<ViewMut<'_>>,
        dout: View<'_>,
        operands: Operands<View<'_>>,
        rstd: View<'_>,
        shape: &NormShape,
    ) -> Result<()> {
        let _t = self.timed("rmsnorm_backward", OpClass::Norm, 0.0);
        let incoming = Incoming { dout: &dout, residual: None };
        self.plain_norm_backward("rmsnorm_backward", &grads, incoming, &operands, &rstd, shape)
            .map(drop)
    }

    fn rmsnorm_backward_add(
        &self,
        grads: Grads<ViewMut<'_>>,
        dout: View<'_>,
        operands: Operands<View<'_>>,
        rstd: View<'_>,
        residual: View<'_>,
        shape: &NormShape,
    ) -> Result<()> {
        let _t = self.timed("rmsnorm_backward", OpClass::Norm, 0.0);
        const OP: &str = "rmsnorm_backward_add";
        let incoming = Incoming { dout: &dout, residual: Some(&residual) };
        if self.plain_norm_backward(OP, &grads, incoming, &operands, &rstd, shape)? {
            return Ok(());
        }
        self.add_assign(grads.dinp, residual)
    }

    fn head_rmsnorm_forward(
        &self,
        out: ViewMut<'_>,
        rstd: ViewMut<'_>,
        operands: Operands<View<'_>>,
        shape: &AttentionShape,
        eps: f32,
    ) -> Result<()> {
        let _t = self.timed("head_rmsnorm_forward", OpClass::Norm, 0.0);
        const OP: &str = "head_rmsnorm_forward";
        let r = Self::head_rows(OP, shape, operands.inp.len, rstd.len, operands.w.len)?;
        check::len(OP, "out", out.len, &[shape.tokens, r.stride])?;
        self.norm_forward(OP, &out, &rstd, &operands, &r, eps)
    }

    fn head_rmsnorm_backward(
        &self,
        grads: Grads<ViewMut<'_>>,
        dout: View<'_>,
        operands: Operands<View<'_>>,
        rstd: View<'_>,
        shape: &AttentionShape,
    ) -> Result<()> {
        let _t = self.timed("head_rmsnorm_backward", OpClass::Norm, 0.0);
        const OP: &str = "head_rmsnorm_backward";
        let r = Self::head_rows(OP, shape, operands.inp.len, rstd.len, operands.w.len)?;
        check::len(OP, "dinp", grads.dinp.len, &[shape.tokens, r.stride])?;
        check::len(OP, "dout", dout.len, &[shape.tokens, r.stride])?;
        check::len(OP, "dw", grads.dw.len, &[2, shape.head_dim])?;
        let incoming = Incoming { dout: &dout, residual: None };
        self.norm_backward(OP, &grads, incoming, &operands, &rstd, &r).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(dim: usize) -> Rows {
        Rows { tokens: 8, stride: dim, heads: 1, nq: 1, dim, copy_tail: false }
    }

    /// The limits here are the kernels' own: `#define`s and `__launch_bounds__` in norm.cu.
    #[test]
    fn vector_limits_match_the_kernels() {
        let src = include_str!("kernels/norm.cu");
        assert!(src.contains(&format!("#define NORM_FWD_VPT {FWD_VPT}\n")));
        assert!(src.contains(&format!("#define NORM_BWD_VPT {BWD_VPT}\n")));
        let bounds = |name: &str| {
            let at = src.find(&format!("{name}(")).expect(name);
            let before = &src[..at];
            let open = before.rfind("__launch_bounds__(").expect("bounds") + 18;
            before[open..].split(')').next().and_then(|n| n.parse::<usize>().ok())
        };
        assert_eq!(bounds("rmsnorm_forward_vec"), Some(FWD_MAX_THREADS));
        assert_eq!(bounds("rmsnorm_backward_vec"), Some(BWD_MAX_THREADS));
    }

    #[test]
    fn vector_kernels_take_whole_vectors_of_plain_rows_that_fit() {
        assert_eq!(vec_threads(&plain(3584), FWD_VPT, FWD_MAX_THREADS), Some(128));
        assert_eq!(vec_threads(&plain(3584), BWD_VPT, BWD_MAX_THREADS), Some(224));
        assert_eq!(vec_threads(&plain(96), FWD_VPT, FWD_MAX_THREADS), Some(32));
        assert_eq!(vec_threads(&plain(32768), FWD_VPT, FWD_MAX_THREADS), Some(1024));
        assert_eq!(vec_threads(&plain(8192), BWD_VPT, BWD_MAX_THREADS), Some(512));
        assert_eq!(vec_threads(&plain(16384), BWD_VPT, BWD_MAX_THREADS), None);
        assert_eq!(vec_threads(&plain(100), FWD_VPT, FWD_MAX_THREADS), None);
        let heads = Rows { heads: 8, nq: 6, stride: 1024, ..plain(128) };
        assert_eq!(vec_threads(&heads, FWD_VPT, FWD_MAX_THREADS), None);
    }
}
