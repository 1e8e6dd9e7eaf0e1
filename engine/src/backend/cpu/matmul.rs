//! Linear layers and their bias: `out = inp · wᵀ + bias`, PyTorch's `nn.Linear` with `w` stored
//! `[out_features, in_features]` as in Hugging Face checkpoints.
//!
//! The GEMMs go through `matrixmultiply::sgemm` (a packed, SIMD micro-kernel GEMM) on row blocks
//! spread over rayon's threads. Each block contracts over the whole inner dimension, so every
//! output element is summed in the same order however the rows are split.

use rayon::prelude::*;

use super::check::{self, err};
use super::elementwise::{ROWS_PER_PARTIAL, add_assign, add_partials};
use crate::backend::{Addends, Grads, MatmulShape, Operands};
use crate::error::Result;

/// Fewest rows worth a task of their own: below this, packing the right operand again for
/// another block costs more than the extra thread gains.
const MIN_BLOCK_ROWS: usize = 16;

/// Rows per parallel block: about two blocks per thread so a busy core does not stall the rest.
fn block_rows(rows: usize) -> usize {
    rows.div_ceil(2 * rayon::current_num_threads()).max(MIN_BLOCK_ROWS)
}

/// A `rows x cols` matrix read from `data` at `data[r * rs + c * cs]`.
#[derive(Clone, Copy)]
struct Operand<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl Operand<'_> {
    /// Whether every element the strides address lies inside `data`.
    fn fits(&self) -> bool {
        if self.rows == 0 || self.cols == 0 {
            return true;
        }
        let last = (self.rows - 1)
            .checked_mul(self.rs)
            .zip((self.cols - 1).checked_mul(self.cs))
            .and_then(|(r, c)| r.checked_add(c));
        last.is_some_and(|last| last < self.data.len())
    }

    fn strides(&self) -> Result<(isize, isize)> {
        let rs = isize::try_from(self.rs).map_err(|_| err("gemm", "row stride overflows"))?;
        let cs = isize::try_from(self.cs).map_err(|_| err("gemm", "column stride overflows"))?;
        Ok((rs, cs))
    }
}

/// `c = a · b + beta · c` for a row-major, contiguous `c` of `a.rows x b.cols`. With
/// `beta == 0` the old contents of `c` are not read (NaN included).
fn gemm(c: &mut [f32], a: Operand<'_>, b: Operand<'_>, beta: f32) -> Result<()> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if b.rows != k || Some(c.len()) != m.checked_mul(n) || !a.fits() || !b.fits() {
        return Err(err("gemm", format!("operands do not fit: [{m}, {k}] x [{}, {n}]", b.rows)));
    }
    let (rsa, csa) = a.strides()?;
    let (rsb, csb) = b.strides()?;
    let rsc = isize::try_from(n).map_err(|_| err("gemm", "output row stride overflows"))?;
    // SAFETY: `fits` proved that every element of A (m x k) and B (k x n) addressed through its
    // strides lies inside its slice, and C is exactly m x n elements, row-major, so row stride n
    // and column stride 1 address only `c`. C is a unique borrow and does not alias A or B.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.data.as_ptr(),
            rsa,
            csa,
            b.data.as_ptr(),
            rsb,
            csb,
            beta,
            c.as_mut_ptr(),
            rsc,
            1,
        );
    }
    Ok(())
}

/// `out = inp · b` for a row-major `inp` `[rows, b.rows]` and any operand `b`, split over row
/// blocks, each contracting over all of `b.rows`. out `[rows, b.cols]`.
fn rows_times(out: &mut [f32], inp: &[f32], b: Operand<'_>, rows: usize) -> Result<()> {
    let (k, n) = (b.rows, b.cols);
    if rows == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        out.fill(0.0);
        return Ok(());
    }
    let block = block_rows(rows);
    out.par_chunks_mut(block * n).zip(inp.par_chunks(block * k)).try_for_each(|(out, inp)| {
        let m = out.len() / n;
        gemm(out, Operand { data: inp, rows: m, cols: k, rs: k, cs: 1 }, b, 0.0)
    })
}

/// `c += xᵀ · y` for row-major `x` `[rows, a]` and `y` `[rows, n]`, split over blocks of rows
/// of `c` `[a, n]`; each block sums over all `rows`.
fn transposed_times(
    c: &mut [f32],
    x: &[f32],
    y: &[f32],
    rows: usize,
    a: usize,
    n: usize,
) -> Result<()> {
    if a == 0 || n == 0 {
        return Ok(());
    }
    let y = Operand { data: y, rows, cols: n, rs: n, cs: 1 };
    let block = block_rows(a);
    c.par_chunks_mut(block * n).enumerate().try_for_each(|(b, c)| {
        let first = b * block;
        let m = c.len() / n;
        // Rows first..first+m of xᵀ are columns of x: start at column `first`, step 1 along
        // the block and `a` from one row of x to the next.
        let x_t =
            Operand { data: x.get(first..).unwrap_or_default(), rows: m, cols: rows, rs: 1, cs: a };
        gemm(c, x_t, y, 1.0)
    })
}

/// `out = inp · wᵀ`, split over row blocks. Lengths must already be checked.
/// out `[rows, n]`, inp `[rows, k]`, w `[n, k]`.
pub(crate) fn linear(
    out: &mut [f32],
    inp: &[f32],
    w: &[f32],
    rows: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    rows_times(out, inp, Operand { data: w, rows: k, cols: n, rs: 1, cs: k }, rows)
}

/// `dinp = dout · w`, split over row blocks. Lengths must already be checked.
/// dinp `[rows, k]`, dout `[rows, n]`, w `[n, k]`.
pub(crate) fn linear_dinp(
    dinp: &mut [f32],
    dout: &[f32],
    w: &[f32],
    rows: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    rows_times(dinp, dout, Operand { data: w, rows: n, cols: k, rs: k, cs: 1 }, rows)
}

/// `dw += doutᵀ · inp`, split over blocks of rows of `dw`; each block sums over all `rows`.
/// Lengths must already be checked.
/// dw `[n, k]`, dout `[rows, n]`, inp `[rows, k]`.
pub(crate) fn linear_dw(
    dw: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    rows: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    transposed_times(dw, dout, inp, rows, n, k)
}

/// `out = inp · w` with `w` stored `[k, n]` (GPT-OSS's expert matrices), split over row
/// blocks. Lengths must already be checked. out `[rows, n]`, inp `[rows, k]`, w `[k, n]`.
pub(crate) fn linear_kn(
    out: &mut [f32],
    inp: &[f32],
    w: &[f32],
    rows: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    rows_times(out, inp, Operand { data: w, rows: k, cols: n, rs: n, cs: 1 }, rows)
}

/// `dinp = dout · wᵀ` with `w` stored `[k, n]`. dinp `[rows, k]`, dout `[rows, n]`.
pub(crate) fn linear_kn_dinp(
    dinp: &mut [f32],
    dout: &[f32],
    w: &[f32],
    rows: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    rows_times(dinp, dout, Operand { data: w, rows: n, cols: k, rs: 1, cs: n }, rows)
}

/// `dw += inpᵀ · dout` with `dw` stored `[k, n]`, split over blocks of rows of `dw`; each
/// block sums over all `rows`. dw `[k, n]`, dout `[rows, n]`, inp `[rows, k]`.
pub(crate) fn linear_kn_dw(
    dw: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    rows: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    transposed_times(dw, inp, dout, rows, k, n)
}

/// `out = inp · wᵀ`. Reference: `nn.Linear` as used by every projection in modeling_llama.py.
/// out `[rows, n]`, inp `[rows, k]`, w `[n, k]`.
pub fn matmul_forward(
    out: &mut [f32],
    operands: Operands<&[f32]>,
    shape: &MatmulShape,
) -> Result<()> {
    const OP: &str = "matmul_forward";
    let Operands { inp, w } = operands;
    let &MatmulShape { rows, k, n } = shape;
    check::len(OP, "out", out.len(), &[rows, n])?;
    check::len(OP, "inp", inp.len(), &[rows, k])?;
    check::len(OP, "w", w.len(), &[n, k])?;
    linear(out, inp, w, rows, k, n)
}

/// `out = inp · wᵀ + bias + residual`, each addend where given, added in that order (as
/// [`matmul_forward`], [`bias_forward`] and `x + out` give it). Reference: the projections that
/// end in a residual add, `hidden_states = residual + self.o_proj(...)` in modeling_llama.py.
/// out `[rows, n]`, inp `[rows, k]`, w `[n, k]`, bias `[n]`, residual `[rows, n]`.
pub fn matmul_forward_add(
    out: &mut [f32],
    operands: Operands<&[f32]>,
    addends: Addends<&[f32]>,
    shape: &MatmulShape,
) -> Result<()> {
    const OP: &str = "matmul_forward_add";
    let &MatmulShape { rows, n, .. } = shape;
    // Checked before the product writes anything.
    if let Some(bias) = addends.bias {
        check::len(OP, "bias", bias.len(), &[n])?;
    }
    if let Some(residual) = addends.residual {
        check::len(OP, "residual", residual.len(), &[rows, n])?;
    }
    matmul_forward(out, operands, shape)?;
    if let Some(bias) = addends.bias {
        bias_forward(out, bias, rows, n)?;
    }
    match addends.residual {
        Some(residual) => add_assign(out, residual),
        None => Ok(()),
    }
}

/// `dinp = dout · w` (overwrites) and `dw += doutᵀ · inp` (accumulates).
/// dinp `[rows, k]`, dw `[n, k]`, dout `[rows, n]`, inp `[rows, k]`, w `[n, k]`.
pub fn matmul_backward(
    grads: Grads<&mut [f32]>,
    dout: &[f32],
    operands: Operands<&[f32]>,
    shape: &MatmulShape,
) -> Result<()> {
    const OP: &str = "matmul_backward";
    let Grads { dinp, dw } = grads;
    let Operands { inp, w } = operands;
    let &MatmulShape { rows, k, n } = shape;
    check::len(OP, "dinp", dinp.len(), &[rows, k])?;
    check::len(OP, "dw", dw.len(), &[n, k])?;
    check::len(OP, "dout", dout.len(), &[rows, n])?;
    check::len(OP, "inp", inp.len(), &[rows, k])?;
    check::len(OP, "w", w.len(), &[n, k])?;
    linear_dinp(dinp, dout, w, rows, k, n)?;
    linear_dw(dw, dout, inp, rows, k, n)
}

/// `out[t] += bias` for every row.
/// out `[rows, n]`, bias `[n]`.
pub fn bias_forward(out: &mut [f32], bias: &[f32], rows: usize, n: usize) -> Result<()> {
    const OP: &str = "bias_forward";
    check::len(OP, "out", out.len(), &[rows, n])?;
    check::len(OP, "bias", bias.len(), &[n])?;
    if n == 0 {
        return Ok(());
    }
    out.par_chunks_mut(n).for_each(|row| row.iter_mut().zip(bias).for_each(|(o, &b)| *o += b));
    Ok(())
}

/// `dbias += Σ_t dout[t]` (accumulates), summed in f64.
/// dbias `[n]`, dout `[rows, n]`.
pub fn bias_backward(dbias: &mut [f32], dout: &[f32], rows: usize, n: usize) -> Result<()> {
    const OP: &str = "bias_backward";
    check::len(OP, "dbias", dbias.len(), &[n])?;
    check::len(OP, "dout", dout.len(), &[rows, n])?;
    if n == 0 {
        return Ok(());
    }
    let partials: Vec<Vec<f64>> = dout
        .par_chunks(ROWS_PER_PARTIAL * n)
        .map(|chunk| {
            let mut acc = vec![0.0f64; n];
            for row in chunk.chunks(n) {
                acc.iter_mut().zip(row).for_each(|(a, &g)| *a += f64::from(g));
            }
            acc
        })
        .collect();
    add_partials(dbias, &partials);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::{
        TOL, assert_close, dot, numeric_grad, rng, to_f64, uniform,
    };
    use crate::error::Result;

    /// Double-precision twin of `matmul_forward`: out `[rows, n]` = inp `[rows, k]` · w `[n, k]`ᵀ.
    fn linear64(inp: &[f64], w: &[f64], rows: usize, k: usize, n: usize) -> Vec<f64> {
        let mut out = vec![0.0; rows * n];
        for t in 0..rows {
            for j in 0..n {
                out[t * n + j] = dot(&inp[t * k..(t + 1) * k], &w[j * k..(j + 1) * k]);
            }
        }
        out
    }

    // 37 rows make several row blocks; k and n are odd so no SIMD width divides them.
    const ROWS: usize = 37;
    const K: usize = 13;
    const N: usize = 11;
    const SHAPE: MatmulShape = MatmulShape { rows: ROWS, k: K, n: N };

    #[test]
    fn forward_matches_twin() -> Result<()> {
        let mut rng = rng(1);
        let (inp, w) = (uniform(&mut rng, ROWS * K), uniform(&mut rng, N * K));
        let mut out = vec![f32::NAN; ROWS * N];
        matmul_forward(&mut out, Operands { inp: &inp, w: &w }, &SHAPE)?;
        assert_close(
            "matmul forward",
            &out,
            &linear64(&to_f64(&inp), &to_f64(&w), ROWS, K, N),
            TOL,
        );
        Ok(())
    }

    #[test]
    fn backward_matches_finite_differences_and_accumulates() -> Result<()> {
        let mut rng = rng(2);
        let (inp, w, r) =
            (uniform(&mut rng, ROWS * K), uniform(&mut rng, N * K), uniform(&mut rng, ROWS * N));
        let dw0 = uniform(&mut rng, N * K);
        let (inp64, w64, r64) = (to_f64(&inp), to_f64(&w), to_f64(&r));
        let mut dinp = vec![f32::NAN; ROWS * K];
        let mut dw = dw0.clone();
        let grads = Grads { dinp: &mut dinp[..], dw: &mut dw[..] };
        matmul_backward(grads, &r, Operands { inp: &inp, w: &w }, &SHAPE)?;

        let want_dinp = numeric_grad(&inp64, |x| dot(&linear64(x, &w64, ROWS, K, N), &r64));
        let grad_w = numeric_grad(&w64, |w| dot(&linear64(&inp64, w, ROWS, K, N), &r64));
        let want_dw: Vec<f64> = grad_w.iter().zip(&dw0).map(|(g, &d)| g + f64::from(d)).collect();
        assert_close("matmul dinp", &dinp, &want_dinp, TOL);
        assert_close("matmul dw (accumulated onto non-zero)", &dw, &want_dw, TOL);
        Ok(())
    }

    #[test]
    fn weight_gradient_splits_over_many_row_blocks() -> Result<()> {
        // n = 70 rows of dw make several blocks, checking the dout column offsets of each.
        let (rows, k, n) = (5, 3, 70);
        let mut rng = rng(3);
        let (inp, dout) = (uniform(&mut rng, rows * k), uniform(&mut rng, rows * n));
        let mut dw = vec![0.0; n * k];
        linear_dw(&mut dw, &dout, &inp, rows, k, n)?;
        let want: Vec<f64> = (0..n * k)
            .map(|e| {
                (0..rows)
                    .map(|t| f64::from(dout[t * n + e / k]) * f64::from(inp[t * k + e % k]))
                    .sum()
            })
            .collect();
        assert_close("matmul dw blocks", &dw, &want, TOL);
        Ok(())
    }

    #[test]
    fn empty_inner_dimension_gives_zeros() -> Result<()> {
        let mut out = vec![f32::NAN; 6];
        matmul_forward(
            &mut out,
            Operands { inp: &[], w: &[] },
            &MatmulShape { rows: 2, k: 0, n: 3 },
        )?;
        assert_eq!(out, vec![0.0; 6]);
        Ok(())
    }

    #[test]
    fn bias_forward_and_backward() -> Result<()> {
        let mut rng = rng(4);
        let (out0, bias, dout, db0) = (
            uniform(&mut rng, ROWS * N),
            uniform(&mut rng, N),
            uniform(&mut rng, ROWS * N),
            uniform(&mut rng, N),
        );
        let mut out = out0.clone();
        bias_forward(&mut out, &bias, ROWS, N)?;
        let want: Vec<f64> =
            (0..ROWS * N).map(|e| f64::from(out0[e]) + f64::from(bias[e % N])).collect();
        assert_close("bias forward", &out, &want, TOL);

        // The loss Σ (x + bias)·R is linear in bias; its gradient is Σ_t R[t].
        let r64 = to_f64(&dout);
        let mut db = db0.clone();
        bias_backward(&mut db, &dout, ROWS, N)?;
        let grad = numeric_grad(&to_f64(&bias), |b| {
            (0..ROWS * N).map(|e| (f64::from(out0[e]) + b[e % N]) * r64[e]).sum()
        });
        let want: Vec<f64> = grad.iter().zip(&db0).map(|(g, &d)| g + f64::from(d)).collect();
        assert_close("bias dbias (accumulated)", &db, &want, TOL);
        Ok(())
    }

    #[test]
    fn wrong_length_names_the_op_and_the_tensor() -> Result<()> {
        let mut out = vec![0.0; ROWS * N];
        let (inp, w) = (vec![0.0; ROWS * K], vec![0.0; N * K - 1]);
        let e = matmul_forward(&mut out, Operands { inp: &inp, w: &w }, &SHAPE)
            .expect_err("must be rejected");
        let msg = e.to_string();
        assert!(
            msg.contains("matmul_forward") && msg.contains("`w`") && msg.contains("142"),
            "{msg}"
        );
        let mut dw = vec![0.0; N * K];
        let grads = Grads { dinp: &mut out[..], dw: &mut dw[..] };
        let e = matmul_backward(grads, &[], Operands { inp: &[], w: &[] }, &SHAPE)
            .expect_err("must be rejected");
        assert!(e.to_string().contains("matmul_backward"), "{e}");
        let e = bias_backward(&mut [0.0; 3], &[0.0; 7], 2, 3).expect_err("must be rejected");
        assert!(e.to_string().contains("bias_backward"), "{e}");
        Ok(())
    }
}
