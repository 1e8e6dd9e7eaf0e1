//! RMSNorm over the hidden size, and Qwen3's per-head RMSNorm of queries and keys.
//! Reference: `LlamaRMSNorm` in transformers' modeling_llama.py
//! (`w * (x * rsqrt(mean(x²) + eps))`, computed in f32), and `Qwen3Attention` in
//! modeling_qwen3.py, which applies `q_norm`/`k_norm` (RMSNorms over `head_dim`) to each query and
//! key head before RoPE.
//!
//! Backward of one row, `y_i = w_i x_i r` with `r = (Σ_j x_j² / D + eps)^(-1/2)`:
//! `∂r/∂x_j = −r³ x_j / D`, hence
//! `dx_j = r w_j g_j − (r³ / D) x_j Σ_i g_i w_i x_i` and `dw_i += g_i x_i r`.

use rayon::prelude::*;

use super::check;
use super::elementwise::{ROWS_PER_PARTIAL, add_assign, add_partials};
use crate::backend::{AttentionShape, Grads, NormShape, Operands};
use crate::error::Result;

/// Normalises one row and returns its `r = 1 / sqrt(mean(x²) + eps)`; the mean is summed in f64.
/// out `[D]`, x `[D]`, w `[D]`.
fn row_forward(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) -> f32 {
    let sum_sq: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let mean = sum_sq / x.len() as f64;
    let r = (1.0 / (mean + f64::from(eps)).sqrt()) as f32;
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = wi * (xi * r);
    }
    r
}

/// Backward of one row: overwrites `dx`, adds into the f64 accumulator `dw`.
/// dx `[D]`, dw `[D]`, g `[D]`, x `[D]`, w `[D]`.
fn row_backward(dx: &mut [f32], dw: &mut [f64], g: &[f32], x: &[f32], w: &[f32], r: f32) {
    let gwx: f64 =
        g.iter().zip(w).zip(x).map(|((&g, &w), &x)| f64::from(g * w) * f64::from(x)).sum();
    let c = (f64::from(r).powi(3) * gwx / x.len() as f64) as f32;
    for i in 0..x.len() {
        dx[i] = r * w[i] * g[i] - c * x[i];
        dw[i] += f64::from(g[i] * x[i] * r);
    }
}

/// `out = inp / sqrt(mean(inp²) + eps) * w`, and `rstd[r]` kept for the backward.
/// out `[rows, dim]`, rstd `[rows]`, inp `[rows, dim]`, w `[dim]`.
pub fn rmsnorm_forward(
    out: &mut [f32],
    rstd: &mut [f32],
    operands: Operands<&[f32]>,
    shape: &NormShape,
) -> Result<()> {
    const OP: &str = "rmsnorm_forward";
    let Operands { inp, w } = operands;
    let &NormShape { rows, dim, eps } = shape;
    check::nonzero(OP, "dim", dim)?;
    check::len(OP, "out", out.len(), &[rows, dim])?;
    check::len(OP, "rstd", rstd.len(), &[rows])?;
    check::len(OP, "inp", inp.len(), &[rows, dim])?;
    check::len(OP, "w", w.len(), &[dim])?;
    out.par_chunks_mut(dim).zip(rstd.par_iter_mut()).zip(inp.par_chunks(dim)).for_each(
        |((out, r), x)| {
            *r = row_forward(out, x, w, eps);
        },
    );
    Ok(())
}

/// dinp `[rows, dim]` (overwrites), dw `[dim]` (accumulates), dout `[rows, dim]`,
/// inp `[rows, dim]`, w `[dim]`, rstd `[rows]`.
pub fn rmsnorm_backward(
    grads: Grads<&mut [f32]>,
    dout: &[f32],
    operands: Operands<&[f32]>,
    rstd: &[f32],
    shape: &NormShape,
) -> Result<()> {
    const OP: &str = "rmsnorm_backward";
    let Grads { dinp, dw } = grads;
    let Operands { inp, w } = operands;
    let &NormShape { rows, dim, .. } = shape;
    check::nonzero(OP, "dim", dim)?;
    check::len(OP, "dinp", dinp.len(), &[rows, dim])?;
    check::len(OP, "dw", dw.len(), &[dim])?;
    check::len(OP, "dout", dout.len(), &[rows, dim])?;
    check::len(OP, "inp", inp.len(), &[rows, dim])?;
    check::len(OP, "w", w.len(), &[dim])?;
    check::len(OP, "rstd", rstd.len(), &[rows])?;
    let chunk = ROWS_PER_PARTIAL * dim;
    let partials: Vec<Vec<f64>> = dinp
        .par_chunks_mut(chunk)
        .zip(dout.par_chunks(chunk))
        .zip(inp.par_chunks(chunk))
        .zip(rstd.par_chunks(ROWS_PER_PARTIAL))
        .map(|(((dinp, dout), inp), rstd)| {
            let mut acc = vec![0.0f64; dim];
            for (((dx, g), x), &r) in
                dinp.chunks_mut(dim).zip(dout.chunks(dim)).zip(inp.chunks(dim)).zip(rstd)
            {
                row_backward(dx, &mut acc, g, x, w, r);
            }
            acc
        })
        .collect();
    add_partials(dw, &partials);
    Ok(())
}

/// [`rmsnorm_backward`], then `dinp += residual`. residual `[rows, dim]`.
pub fn rmsnorm_backward_add(
    grads: Grads<&mut [f32]>,
    dout: &[f32],
    operands: Operands<&[f32]>,
    rstd: &[f32],
    residual: &[f32],
    shape: &NormShape,
) -> Result<()> {
    check::len("rmsnorm_backward_add", "residual", residual.len(), &[shape.rows, shape.dim])?;
    let Grads { dinp, dw } = grads;
    rmsnorm_backward(Grads { dinp: &mut *dinp, dw }, dout, operands, rstd, shape)?;
    add_assign(dinp, residual)
}

/// Checks the buffers of a per-head norm and returns `(Dqkv, normed heads per token)`.
fn head_shape(
    op: &str,
    shape: &AttentionShape,
    qkv: usize,
    rstd: usize,
    w: usize,
) -> Result<(usize, usize)> {
    let width = check::attention_shape(op, shape)?;
    let heads = shape.q_heads + shape.kv_heads;
    check::len(op, "rstd", rstd, &[shape.tokens, heads])?;
    check::len(op, "w", w, &[2, shape.head_dim])?;
    check::len(op, "inp", qkv, &[shape.tokens, width])?;
    Ok((width, heads))
}

/// RMSNorm of each query head with `q_norm` and each key head with `k_norm`; value heads are
/// copied unchanged.
/// out `[T, Dqkv]`, rstd `[T, nq + nkv]`, inp `[T, Dqkv]`, w `[2 hd]` = `[q_norm | k_norm]`.
pub fn head_rmsnorm_forward(
    out: &mut [f32],
    rstd: &mut [f32],
    operands: Operands<&[f32]>,
    shape: &AttentionShape,
    eps: f32,
) -> Result<()> {
    const OP: &str = "head_rmsnorm_forward";
    let Operands { inp, w } = operands;
    let (width, heads) = head_shape(OP, shape, inp.len(), rstd.len(), w.len())?;
    check::len(OP, "out", out.len(), &[shape.tokens, width])?;
    let (hd, nq) = (shape.head_dim, shape.q_heads);
    let (q_norm, k_norm) = w.split_at(hd);
    out.par_chunks_mut(width).zip(rstd.par_chunks_mut(heads)).zip(inp.par_chunks(width)).for_each(
        |((out, rstd), inp)| {
            let normed = heads * hd;
            for (h, ((o, x), r)) in
                out[..normed].chunks_mut(hd).zip(inp.chunks(hd)).zip(rstd).enumerate()
            {
                *r = row_forward(o, x, if h < nq { q_norm } else { k_norm }, eps);
            }
            out[normed..].copy_from_slice(&inp[normed..]);
        },
    );
    Ok(())
}

/// dinp `[T, Dqkv]` (overwrites; value heads pass through), dw `[2 hd]` (accumulates),
/// dout `[T, Dqkv]`, inp `[T, Dqkv]`, w `[2 hd]`, rstd `[T, nq + nkv]`.
pub fn head_rmsnorm_backward(
    grads: Grads<&mut [f32]>,
    dout: &[f32],
    operands: Operands<&[f32]>,
    rstd: &[f32],
    shape: &AttentionShape,
) -> Result<()> {
    const OP: &str = "head_rmsnorm_backward";
    let Grads { dinp, dw } = grads;
    let Operands { inp, w } = operands;
    let (width, heads) = head_shape(OP, shape, inp.len(), rstd.len(), w.len())?;
    check::len(OP, "dinp", dinp.len(), &[shape.tokens, width])?;
    check::len(OP, "dout", dout.len(), &[shape.tokens, width])?;
    check::len(OP, "dw", dw.len(), &[2, shape.head_dim])?;
    let (hd, nq) = (shape.head_dim, shape.q_heads);
    let normed = heads * hd;
    let chunk = ROWS_PER_PARTIAL * width;
    let partials: Vec<Vec<f64>> = dinp
        .par_chunks_mut(chunk)
        .zip(dout.par_chunks(chunk))
        .zip(inp.par_chunks(chunk))
        .zip(rstd.par_chunks(ROWS_PER_PARTIAL * heads))
        .map(|(((dinp, dout), inp), rstd)| {
            let mut acc = vec![0.0f64; 2 * hd];
            let rows = dinp.chunks_mut(width).zip(dout.chunks(width)).zip(inp.chunks(width));
            for (((dx, g), x), rstd) in rows.zip(rstd.chunks(heads)) {
                for (h, &r) in rstd.iter().enumerate() {
                    let head = h * hd..(h + 1) * hd;
                    let (w, acc) = if h < nq {
                        (&w[..hd], &mut acc[..hd])
                    } else {
                        (&w[hd..], &mut acc[hd..])
                    };
                    row_backward(&mut dx[head.clone()], acc, &g[head.clone()], &x[head], w, r);
                }
                dx[normed..].copy_from_slice(&g[normed..]);
            }
            acc
        })
        .collect();
    add_partials(dw, &partials);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::{
        TOL, assert_close, dot, numeric_grad, rng, to_f64, uniform,
    };
    use crate::error::Result;

    const EPS: f32 = 1e-5;

    /// Double-precision twin of one RMSNorm row.
    fn row64(x: &[f64], w: &[f64]) -> Vec<f64> {
        let r =
            1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + f64::from(EPS)).sqrt();
        x.iter().zip(w).map(|(x, w)| w * x * r).collect()
    }

    fn rmsnorm64(x: &[f64], w: &[f64], dim: usize) -> Vec<f64> {
        x.chunks(dim).flat_map(|row| row64(row, w)).collect()
    }

    const SHAPE: AttentionShape = AttentionShape {
        tokens: 7,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 6,
        docs: 1,
        window: None,
        scale_dim: None,
        softcap: None,
    };

    /// Double-precision twin of `head_rmsnorm_forward`.
    fn head64(x: &[f64], w: &[f64]) -> Vec<f64> {
        let (hd, nq) = (SHAPE.head_dim, SHAPE.q_heads);
        let normed = (nq + SHAPE.kv_heads) * hd;
        let mut out = Vec::new();
        for row in x.chunks(SHAPE.qkv_width()) {
            for (h, head) in row[..normed].chunks(hd).enumerate() {
                out.extend(row64(head, if h < nq { &w[..hd] } else { &w[hd..] }));
            }
            out.extend_from_slice(&row[normed..]);
        }
        out
    }

    #[test]
    fn rmsnorm_forward_and_backward_match_twin() -> Result<()> {
        let (rows, dim) = (7, 12);
        let mut rng = rng(10);
        let (x, w, r, dw0) = (
            uniform(&mut rng, rows * dim),
            uniform(&mut rng, dim),
            uniform(&mut rng, rows * dim),
            uniform(&mut rng, dim),
        );
        let (x64, w64, r64) = (to_f64(&x), to_f64(&w), to_f64(&r));
        let (mut out, mut rstd) = (vec![f32::NAN; rows * dim], vec![f32::NAN; rows]);
        let shape = NormShape { rows, dim, eps: EPS };
        rmsnorm_forward(&mut out, &mut rstd, Operands { inp: &x, w: &w }, &shape)?;
        assert_close("rmsnorm forward", &out, &rmsnorm64(&x64, &w64, dim), TOL);
        let want_rstd: Vec<f64> = x64
            .chunks(dim)
            .map(|row| {
                1.0 / (row.iter().map(|v| v * v).sum::<f64>() / dim as f64 + f64::from(EPS)).sqrt()
            })
            .collect();
        assert_close("rmsnorm rstd", &rstd, &want_rstd, TOL);

        let (mut dx, mut dw) = (vec![f32::NAN; rows * dim], dw0.clone());
        let grads = Grads { dinp: &mut dx[..], dw: &mut dw[..] };
        rmsnorm_backward(grads, &r, Operands { inp: &x, w: &w }, &rstd, &shape)?;
        let want_dx = numeric_grad(&x64, |x| dot(&rmsnorm64(x, &w64, dim), &r64));
        let grad_w = numeric_grad(&w64, |w| dot(&rmsnorm64(&x64, w, dim), &r64));
        let want_dw: Vec<f64> = grad_w.iter().zip(&dw0).map(|(g, &d)| g + f64::from(d)).collect();
        assert_close("rmsnorm dinp", &dx, &want_dx, TOL);
        assert_close("rmsnorm dw (accumulated)", &dw, &want_dw, TOL);
        Ok(())
    }

    #[test]
    fn head_rmsnorm_forward_and_backward_match_twin() -> Result<()> {
        let (t, width, heads, hd) = (SHAPE.tokens, SHAPE.qkv_width(), 6, SHAPE.head_dim);
        let mut rng = rng(11);
        let (x, w, r, dw0) = (
            uniform(&mut rng, t * width),
            uniform(&mut rng, 2 * hd),
            uniform(&mut rng, t * width),
            uniform(&mut rng, 2 * hd),
        );
        let (x64, w64, r64) = (to_f64(&x), to_f64(&w), to_f64(&r));
        let (mut out, mut rstd) = (vec![f32::NAN; t * width], vec![f32::NAN; t * heads]);
        head_rmsnorm_forward(&mut out, &mut rstd, Operands { inp: &x, w: &w }, &SHAPE, EPS)?;
        assert_close("head_rmsnorm forward", &out, &head64(&x64, &w64), TOL);

        let (mut dx, mut dw) = (vec![f32::NAN; t * width], dw0.clone());
        let grads = Grads { dinp: &mut dx[..], dw: &mut dw[..] };
        head_rmsnorm_backward(grads, &r, Operands { inp: &x, w: &w }, &rstd, &SHAPE)?;
        let want_dx = numeric_grad(&x64, |x| dot(&head64(x, &w64), &r64));
        let grad_w = numeric_grad(&w64, |w| dot(&head64(&x64, w), &r64));
        let want_dw: Vec<f64> = grad_w.iter().zip(&dw0).map(|(g, &d)| g + f64::from(d)).collect();
        assert_close("head_rmsnorm dinp", &dx, &want_dx, TOL);
        assert_close("head_rmsnorm dw (accumulated)", &dw, &want_dw, TOL);
        Ok(())
    }

    #[test]
    fn wrong_lengths_are_rejected_before_writing() -> Result<()> {
        let mut out = vec![1.0; 12];
        let shape = NormShape { rows: 2, dim: 6, eps: EPS };
        let e = rmsnorm_forward(
            &mut out,
            &mut [0.0; 2],
            Operands { inp: &[0.0; 12], w: &[0.0; 5] },
            &shape,
        )
        .expect_err("must be rejected");
        assert!(e.to_string().contains("rmsnorm_forward") && e.to_string().contains("`w`"), "{e}");
        assert_eq!(out, vec![1.0; 12], "a rejected call must not write");
        let width = SHAPE.qkv_width();
        let e = head_rmsnorm_backward(
            Grads { dinp: &mut vec![0.0; 7 * width], dw: &mut [0.0; 12] },
            &vec![0.0; 7 * width],
            Operands { inp: &vec![0.0; 7 * width], w: &[0.0; 12] },
            &[0.0; 41],
            &SHAPE,
        )
        .expect_err("must be rejected");
        assert!(
            e.to_string().contains("head_rmsnorm_backward") && e.to_string().contains("`rstd`"),
            "{e}"
        );
        Ok(())
    }
}
