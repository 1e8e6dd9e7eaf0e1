//! Causal grouped-query attention over packed documents, with an optional sliding window.
//! Reference: `eager_attention_forward` in transformers' modeling_llama.py
//! (`softmax(q kᵀ · hd^-½ + mask) v` in f32, key/value heads repeated `nq / nkv` times by
//! `repeat_kv`, so query head `h` reads kv head `h / (nq / nkv)`), with the mask of packed
//! documents and of Hugging Face's sliding window: query `i` sees key `j` when both are in the
//! same document and `i − W < j ≤ i`.
//!
//! Only the keys a query can see are scored, one scratch row per query; no `[T, T]` matrix.
//! The forward keeps `lse_i = log Σ_j exp(s_ij)` of the scaled scores `s_ij`, so the backward
//! recomputes the probabilities `P_ij = exp(s_ij − lse_i)` exactly (FlashAttention-2).
//!
//! Backward, per head, with `o_i = Σ_j P_ij v_j` and `g_i = dout_i`:
//! `dv_j = Σ_i P_ij g_i`; `dP_ij = g_i · v_j`; softmax's Jacobian gives
//! `dS_ij = P_ij (dP_ij − Σ_l P_il dP_il) = P_ij (dP_ij − D_i)` with
//! `D_i = Σ_l P_il (g_i · v_l) = g_i · o_i`; then `dq_i = scale Σ_j dS_ij k_j` and
//! `dk_j = scale Σ_i dS_ij q_i`. Each token's row of `dqkv` is computed by one task: its `dq`
//! as a query (over its keys) and its `dk`, `dv` as a key (over the queries that see it), so no
//! two tasks write the same element and the sums run in a fixed order.

use std::ops::Range;

use rayon::prelude::*;

use super::check;
use crate::backend::{AttentionOut, AttentionShape};
use crate::error::Result;

/// Where each head of a token lives inside the fused `qkv` rows, and which tokens see which.
struct Layout<'a> {
    qkv: &'a [f32],
    width: usize,
    hd: usize,
    nq: usize,
    nkv: usize,
    /// Query heads per kv head.
    group: usize,
    window: usize,
    /// `(first, end)` of the document of each token.
    docs: Vec<(usize, usize)>,
}

impl<'a> Layout<'a> {
    fn new(op: &str, qkv: &'a [f32], cu_seqlens: &[i32], shape: &AttentionShape) -> Result<Self> {
        let width = check::attention_shape(op, shape)?;
        check::len(op, "qkv", qkv.len(), &[shape.tokens, width])?;
        Ok(Layout {
            qkv,
            width,
            hd: shape.head_dim,
            nq: shape.q_heads,
            nkv: shape.kv_heads,
            group: shape.q_heads / shape.kv_heads,
            window: shape.window.unwrap_or(usize::MAX),
            docs: check::documents(op, cu_seqlens, shape)?,
        })
    }

    fn head(&self, t: usize, slot: usize) -> &'a [f32] {
        let start = t * self.width + slot * self.hd;
        &self.qkv[start..start + self.hd]
    }
    fn q(&self, t: usize, h: usize) -> &'a [f32] {
        self.head(t, h)
    }
    fn k(&self, t: usize, g: usize) -> &'a [f32] {
        self.head(t, self.nq + g)
    }
    fn v(&self, t: usize, g: usize) -> &'a [f32] {
        self.head(t, self.nq + self.nkv + g)
    }

    /// The keys query `i` attends to: its document's tokens in `i − W < j ≤ i`.
    fn keys(&self, i: usize) -> Range<usize> {
        let first = self.docs[i].0.max((i + 1).saturating_sub(self.window));
        first..i + 1
    }
    /// The queries that attend to key `j`: its document's tokens in `j ≤ i < j + W`.
    fn queries(&self, j: usize) -> Range<usize> {
        j..self.docs[j].1.min(j.saturating_add(self.window))
    }
}

/// Dot product over eight independent partial sums: one running f32 sum must be added in order,
/// eight can fill the SIMD lanes (a several-fold speed-up on head-sized vectors).
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8.remainder().iter().zip(b8.remainder()).map(|(x, y)| x * y).sum();
    let mut lanes = [0.0f32; 8];
    for (x, y) in a8.zip(b8) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `acc += alpha · x`.
pub(super) fn axpy(acc: &mut [f32], alpha: f32, x: &[f32]) {
    acc.iter_mut().zip(x).for_each(|(a, &x)| *a += alpha * x);
}

/// A scaled score after the optional soft-cap (`cap · tanh(s / cap)`, Gemma 2's
/// `attn_logit_softcapping` as its eager attention computes it), and the cap's slope.
pub(super) fn capped(s: f32, cap: Option<f32>) -> (f32, f32) {
    match cap {
        None => (s, 1.0),
        Some(c) => crate::backend::softcap(s, c),
    }
}

/// att.out `[T, nq hd]`, att.lse `[T, nq]`, qkv `[T, Dqkv]` (after RoPE), cu_seqlens
/// `[docs + 1]`.
pub fn attention_forward(
    att: AttentionOut<&mut [f32]>,
    qkv: &[f32],
    cu_seqlens: &[i32],
    shape: &AttentionShape,
) -> Result<()> {
    const OP: &str = "attention_forward";
    let AttentionOut { out, lse } = att;
    let at = Layout::new(OP, qkv, cu_seqlens, shape)?;
    let (hd, nq) = (at.hd, at.nq);
    check::len(OP, "out", out.len(), &[shape.tokens, nq, hd])?;
    check::len(OP, "lse", lse.len(), &[shape.tokens, nq])?;
    if nq == 0 {
        return Ok(());
    }
    let scale = shape.softmax_scale();
    let cap = shape.softcap;
    out.par_chunks_mut(nq * hd).zip(lse.par_chunks_mut(nq)).enumerate().for_each_init(
        Vec::new,
        |scores: &mut Vec<f32>, (i, (out, lse))| {
            let keys = at.keys(i);
            for (h, (o, lse)) in out.chunks_mut(hd).zip(lse.iter_mut()).enumerate() {
                let (q, g) = (at.q(i, h), h / at.group);
                scores.clear();
                scores.extend(keys.clone().map(|j| capped(dot(q, at.k(j, g)) * scale, cap).0));
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                o.fill(0.0);
                for (&p, j) in scores.iter().zip(keys.clone()) {
                    axpy(o, p / sum, at.v(j, g));
                }
                *lse = max + sum.ln();
            }
        },
    );
    Ok(())
}

/// dqkv `[T, Dqkv]` (overwrites), dout `[T, nq hd]`, qkv `[T, Dqkv]`, att.out `[T, nq hd]`,
/// att.lse `[T, nq]` (the last three from the forward), cu_seqlens `[docs + 1]`.
pub fn attention_backward(
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    att: AttentionOut<&[f32]>,
    cu_seqlens: &[i32],
    shape: &AttentionShape,
) -> Result<()> {
    const OP: &str = "attention_backward";
    let AttentionOut { out, lse } = att;
    let at = Layout::new(OP, qkv, cu_seqlens, shape)?;
    let (hd, nq, nkv, t) = (at.hd, at.nq, at.nkv, shape.tokens);
    check::len(OP, "dqkv", dqkv.len(), &[t, at.width])?;
    check::len(OP, "dout", dout.len(), &[t, nq, hd])?;
    check::len(OP, "out", out.len(), &[t, nq, hd])?;
    check::len(OP, "lse", lse.len(), &[t, nq])?;
    let scale = shape.softmax_scale();
    let row = |i: usize, h: usize| (i * nq + h) * hd..(i * nq + h + 1) * hd;
    // D_i = dout_i · out_i for every query and head.
    let d: Vec<f32> = (0..t * nq)
        .into_par_iter()
        .map(|ih| dot(&dout[ih * hd..][..hd], &out[ih * hd..][..hd]))
        .collect();
    // P_ij and dS_ij of query i, head h against key j (kv head g = h / group); with a soft-cap,
    // dS carries the cap's slope 1 − tanh² back to the scaled score.
    let cap = shape.softcap;
    let p_ds = |i: usize, h: usize, j: usize| {
        let g = h / at.group;
        let (s, slope) = capped(dot(at.q(i, h), at.k(j, g)) * scale, cap);
        let p = (s - lse[i * nq + h]).exp();
        let dp = dot(&dout[row(i, h)], at.v(j, g));
        (p, p * (dp - d[i * nq + h]) * slope)
    };
    dqkv.par_chunks_mut(at.width).enumerate().for_each(|(n, grads)| {
        let (dq, rest) = grads.split_at_mut(nq * hd);
        let (dk, dv) = rest.split_at_mut(nkv * hd);
        dq.fill(0.0);
        dk.fill(0.0);
        dv.fill(0.0);
        // Token n as a query.
        for (h, dq) in dq.chunks_mut(hd).enumerate() {
            for j in at.keys(n) {
                let (_, ds) = p_ds(n, h, j);
                axpy(dq, scale * ds, at.k(j, h / at.group));
            }
        }
        // Token n as a key, for each query head of its kv head's group.
        for (g, (dk, dv)) in dk.chunks_mut(hd).zip(dv.chunks_mut(hd)).enumerate() {
            for h in g * at.group..(g + 1) * at.group {
                for i in at.queries(n) {
                    let (p, ds) = p_ds(i, h, n);
                    axpy(dk, scale * ds, at.q(i, h));
                    axpy(dv, p, &dout[row(i, h)]);
                }
            }
        }
    });
    Ok(())
}

/// A sink's effect on one query head: the new log-sum-exp `lse' = log(exp(lse) + exp(sink))`
/// and the factor `exp(lse − lse')` its output is multiplied by.
pub(super) fn sink(lse: f32, sink: f32) -> (f32, f32) {
    let m = lse.max(sink);
    let new = m + ((lse - m).exp() + (sink - m).exp()).ln();
    (new, (lse - new).exp())
}

/// GPT-OSS's attention sinks applied to a finished attention (`eager_attention_forward` in
/// modeling_gpt_oss.py appends `sinks[h]` to every row of scores, softmaxes, and drops it).
/// att.out `[T, nq hd]` and att.lse `[T, nq]` in place, sinks `[nq]`.
pub fn attention_sinks_forward(
    att: AttentionOut<&mut [f32]>,
    sinks: &[f32],
    shape: &AttentionShape,
) -> Result<()> {
    const OP: &str = "attention_sinks_forward";
    let AttentionOut { out, lse } = att;
    let (t, nq, hd) = (shape.tokens, shape.q_heads, shape.head_dim);
    check::len(OP, "out", out.len(), &[t, nq, hd])?;
    check::len(OP, "lse", lse.len(), &[t, nq])?;
    check::len(OP, "sinks", sinks.len(), &[nq])?;
    if nq == 0 || hd == 0 {
        return Ok(());
    }
    out.par_chunks_mut(nq * hd).zip(lse.par_chunks_mut(nq)).for_each(|(out, lse)| {
        for ((o, l), &s) in out.chunks_mut(hd).zip(lse.iter_mut()).zip(sinks) {
            let (new, factor) = sink(*l, s);
            o.iter_mut().for_each(|v| *v *= factor);
            *l = new;
        }
    });
    Ok(())
}

/// dsinks `[nq]` (accumulates; summed over tokens in order, in f64), dout and att.out
/// `[T, nq hd]`, att.lse `[T, nq]` (after the sinks), sinks `[nq]`.
pub fn attention_sinks_backward(
    dsinks: &mut [f32],
    dout: &[f32],
    att: AttentionOut<&[f32]>,
    sinks: &[f32],
    shape: &AttentionShape,
) -> Result<()> {
    const OP: &str = "attention_sinks_backward";
    let AttentionOut { out, lse } = att;
    let (t, nq, hd) = (shape.tokens, shape.q_heads, shape.head_dim);
    check::len(OP, "dsinks", dsinks.len(), &[nq])?;
    check::len(OP, "dout", dout.len(), &[t, nq, hd])?;
    check::len(OP, "out", out.len(), &[t, nq, hd])?;
    check::len(OP, "lse", lse.len(), &[t, nq])?;
    check::len(OP, "sinks", sinks.len(), &[nq])?;
    if nq == 0 || hd == 0 {
        return Ok(());
    }
    let mut acc = vec![0f64; nq];
    for tok in 0..t {
        for h in 0..nq {
            let at = (tok * nq + h) * hd..(tok * nq + h + 1) * hd;
            let p = (sinks[h] - lse[tok * nq + h]).exp();
            acc[h] -= f64::from(p * dot(&dout[at.clone()], &out[at]));
        }
    }
    dsinks.iter_mut().zip(acc).for_each(|(d, a)| *d += a as f32);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::{TOL, assert_close, numeric_grad, rng, to_f64, uniform};
    use crate::error::Result;

    /// Seven tokens in two documents (3 + 4), GQA with two query heads per kv head, a window of 3.
    const SHAPE: AttentionShape = AttentionShape {
        tokens: 7,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 6,
        docs: 2,
        window: Some(3),
        scale_dim: None,
        softcap: None,
    };
    const CU: [i32; 3] = [0, 3, 7];

    /// Naive double-precision twin: the full `[T, T]` masked score matrix per head, then a softmax
    /// over each row. Returns (out `[T, nq hd]`, lse `[T, nq]`).
    fn attention64(qkv: &[f64], cu: &[i32], shape: &AttentionShape) -> (Vec<f64>, Vec<f64>) {
        attention64_sinks(qkv, cu, shape, None)
    }

    /// The twin with GPT-OSS's sinks as its eager attention writes them: one more column of
    /// scores per row holding `sinks[h]`, softmaxed with the rest and then dropped.
    fn attention64_sinks(
        qkv: &[f64],
        cu: &[i32],
        shape: &AttentionShape,
        sinks: Option<&[f64]>,
    ) -> (Vec<f64>, Vec<f64>) {
        let (t, nq, nkv, hd) = (shape.tokens, shape.q_heads, shape.kv_heads, shape.head_dim);
        let width = shape.qkv_width();
        let doc = |i: usize| cu.iter().filter(|&&c| c as usize <= i).count();
        let window = shape.window.unwrap_or(usize::MAX);
        let visible = |i: usize, j: usize| doc(i) == doc(j) && j <= i && i - j < window;
        let at = |tok: usize, slot: usize, e: usize| qkv[tok * width + slot * hd + e];
        let (mut out, mut lse) = (vec![0.0; t * nq * hd], vec![0.0; t * nq]);
        for h in 0..nq {
            let g = h / (nq / nkv);
            let mut scores = vec![vec![f64::NEG_INFINITY; t]; t];
            for (i, row) in scores.iter_mut().enumerate() {
                for (j, s) in row.iter_mut().enumerate() {
                    if visible(i, j) {
                        let raw = (0..hd).map(|e| at(i, h, e) * at(j, nq + g, e)).sum::<f64>()
                            / (hd as f64).sqrt();
                        *s = shape.softcap.map_or(raw, |c| {
                            let c = f64::from(c);
                            c * (raw / c).tanh()
                        });
                    }
                }
            }
            let sink = sinks.map_or(f64::NEG_INFINITY, |s| s[h]);
            for (i, row) in scores.iter().enumerate() {
                let max = row.iter().copied().fold(sink, f64::max);
                let sum: f64 =
                    row.iter().map(|s| (s - max).exp()).sum::<f64>() + (sink - max).exp();
                lse[i * nq + h] = max + sum.ln();
                for (j, s) in row.iter().enumerate() {
                    let p = (s - max).exp() / sum;
                    for e in 0..hd {
                        out[(i * nq + h) * hd + e] += p * at(j, nq + nkv + g, e);
                    }
                }
            }
        }
        (out, lse)
    }

    fn inputs(seed: u64, shape: &AttentionShape) -> Vec<f32> {
        // Doubled so some rows of the softmax are far from uniform.
        uniform(&mut rng(seed), shape.tokens * shape.qkv_width()).iter().map(|v| 2.0 * v).collect()
    }

    fn forward(qkv: &[f32], cu: &[i32], shape: &AttentionShape) -> Result<(Vec<f32>, Vec<f32>)> {
        let mut out = vec![f32::NAN; shape.tokens * shape.q_heads * shape.head_dim];
        let mut lse = vec![f32::NAN; shape.tokens * shape.q_heads];
        attention_forward(AttentionOut { out: &mut out, lse: &mut lse }, qkv, cu, shape)?;
        Ok((out, lse))
    }

    /// The configurations every check runs on: documents and window; one long document without a
    /// window; an empty document in the middle; multi-query attention (one kv head).
    fn cases() -> Vec<(AttentionShape, Vec<i32>)> {
        vec![
            (SHAPE, CU.to_vec()),
            (AttentionShape { docs: 1, window: None, ..SHAPE }, vec![0, 7]),
            (AttentionShape { docs: 3, window: Some(2), ..SHAPE }, vec![0, 4, 4, 7]),
            (AttentionShape { kv_heads: 1, head_dim: 8, ..SHAPE }, CU.to_vec()),
            // Gemma 2's soft-cap, low enough (1.0) to bend these scores.
            (AttentionShape { softcap: Some(1.0), ..SHAPE }, CU.to_vec()),
        ]
    }

    #[test]
    fn forward_matches_naive_masked_attention() -> Result<()> {
        for (n, (shape, cu)) in cases().iter().enumerate() {
            let qkv = inputs(50 + n as u64, shape);
            let (out, lse) = forward(&qkv, cu, shape)?;
            let (want_out, want_lse) = attention64(&to_f64(&qkv), cu, shape);
            assert_close(&format!("attention out, case {n}"), &out, &want_out, TOL);
            assert_close(&format!("attention lse, case {n}"), &lse, &want_lse, TOL);
        }
        Ok(())
    }

    #[test]
    fn backward_matches_finite_differences() -> Result<()> {
        for (n, (shape, cu)) in cases().iter().enumerate() {
            let qkv = inputs(60 + n as u64, shape);
            let r = uniform(&mut rng(70 + n as u64), shape.tokens * shape.q_heads * shape.head_dim);
            let r64 = to_f64(&r);
            let (out, lse) = forward(&qkv, cu, shape)?;
            let mut dqkv = vec![f32::NAN; qkv.len()];
            attention_backward(
                &mut dqkv,
                &r,
                &qkv,
                AttentionOut { out: &out, lse: &lse },
                cu,
                shape,
            )?;
            let want = numeric_grad(&to_f64(&qkv), |x| {
                attention64(x, cu, shape).0.iter().zip(&r64).map(|(o, r)| o * r).sum()
            });
            assert_close(&format!("attention dqkv (dq, dk, dv), case {n}"), &dqkv, &want, TOL);
        }
        Ok(())
    }

    /// GPT-OSS's sinks: the forward against the twin's extra score column, and the backward
    /// (the plain backward on the sinked output and lse, plus the sinks' own gradient) against
    /// finite differences of both the inputs and the sinks.
    #[test]
    fn sinks_match_the_eager_extra_column_forward_and_backward() -> Result<()> {
        for (n, (shape, cu)) in cases().iter().enumerate() {
            let qkv = inputs(150 + n as u64, shape);
            let sinks: Vec<f32> = (0..shape.q_heads).map(|h| 0.8 * h as f32 - 1.2).collect();
            let (mut out, mut lse) = forward(&qkv, cu, shape)?;
            attention_sinks_forward(AttentionOut { out: &mut out, lse: &mut lse }, &sinks, shape)?;
            let (q64, s64) = (to_f64(&qkv), to_f64(&sinks));
            let (want_out, want_lse) = attention64_sinks(&q64, cu, shape, Some(&s64));
            assert_close(&format!("sinked out, case {n}"), &out, &want_out, TOL);
            assert_close(&format!("sinked lse, case {n}"), &lse, &want_lse, TOL);

            let r = uniform(&mut rng(160 + n as u64), out.len());
            let r64 = to_f64(&r);
            let loss = |q: &[f64], s: &[f64]| -> f64 {
                let o = attention64_sinks(q, cu, shape, Some(s)).0;
                o.iter().zip(&r64).map(|(o, r)| o * r).sum()
            };
            let mut dqkv = vec![f32::NAN; qkv.len()];
            attention_backward(
                &mut dqkv,
                &r,
                &qkv,
                AttentionOut { out: &out, lse: &lse },
                cu,
                shape,
            )?;
            let want = numeric_grad(&q64, |x| loss(x, &s64));
            assert_close(&format!("sinked dqkv, case {n}"), &dqkv, &want, TOL);
            let mut dsinks = vec![0.5f32; shape.q_heads];
            let att = AttentionOut { out: &out[..], lse: &lse[..] };
            attention_sinks_backward(&mut dsinks, &r, att, &sinks, shape)?;
            let want: Vec<f64> =
                numeric_grad(&s64, |s| loss(&q64, s)).iter().map(|g| g + 0.5).collect();
            assert_close(&format!("dsinks (accumulated onto 0.5), case {n}"), &dsinks, &want, TOL);
        }
        Ok(())
    }

    #[test]
    fn packed_documents_match_documents_run_alone() -> Result<()> {
        let qkv = inputs(80, &SHAPE);
        let (packed, packed_lse) = forward(&qkv, &CU, &SHAPE)?;
        let (width, out_width) = (SHAPE.qkv_width(), SHAPE.q_heads * SHAPE.head_dim);
        for pair in CU.windows(2) {
            let (a, b) = (pair[0] as usize, pair[1] as usize);
            let alone = AttentionShape { tokens: b - a, docs: 1, ..SHAPE };
            let (out, lse) = forward(&qkv[a * width..b * width], &[0, (b - a) as i32], &alone)?;
            assert_close(
                "packed vs alone",
                &packed[a * out_width..b * out_width],
                &to_f64(&out),
                1e-6,
            );
            assert_close("packed vs alone lse", &packed_lse[a * 4..b * 4], &to_f64(&lse), 1e-6);
        }
        Ok(())
    }

    #[test]
    fn a_window_covering_the_sequence_is_no_window() -> Result<()> {
        let full = AttentionShape { window: None, ..SHAPE };
        let qkv = inputs(81, &full);
        let want = forward(&qkv, &CU, &full)?;
        for w in [4, 7, 100] {
            assert_eq!(
                forward(&qkv, &CU, &AttentionShape { window: Some(w), ..SHAPE })?,
                want,
                "window {w}"
            );
        }
        let (narrow, _) = forward(&qkv, &CU, &AttentionShape { window: Some(2), ..SHAPE })?;
        assert_ne!(narrow, want.0, "a window shorter than a document must change the output");
        Ok(())
    }

    #[test]
    fn bad_document_bounds_and_shapes_are_rejected() -> Result<()> {
        let qkv = inputs(82, &SHAPE);
        let mut out = vec![0.0; 7 * 24];
        let mut lse = vec![0.0; 7 * 4];
        let bad: [(&[i32], &str); 4] = [
            (&[0, 5, 3], "decreases"),
            (&[0, 3, 6], "must end at the token count 7"),
            (&[1, 3, 7], "must start at 0"),
            (&[0, 3], "`cu_seqlens` has 2 elements"),
        ];
        for (cu, why) in bad {
            let att = AttentionOut { out: &mut out[..], lse: &mut lse[..] };
            let e =
                attention_forward(att, &qkv, cu, &SHAPE).expect_err("must be rejected").to_string();
            assert!(e.contains("attention_forward") && e.contains(why), "{cu:?}: {e}");
        }
        let att = AttentionOut { out: &mut out[..], lse: &mut lse[..] };
        let e = attention_forward(att, &qkv, &[0, 3, 9], &SHAPE).expect_err("must be rejected");
        assert!(e.to_string().contains("exceeds the token count"), "{e}");
        let e = attention_forward(
            AttentionOut { out: &mut out, lse: &mut lse },
            &qkv,
            &CU,
            &AttentionShape { window: Some(0), ..SHAPE },
        )
        .expect_err("must be rejected");
        assert!(e.to_string().contains("window"), "{e}");
        let e = attention_forward(
            AttentionOut { out: &mut out, lse: &mut lse },
            &qkv,
            &CU,
            &AttentionShape { q_heads: 3, ..SHAPE },
        )
        .expect_err("must be rejected");
        assert!(e.to_string().contains("not a multiple"), "{e}");
        let att = AttentionOut { out: &out[..], lse: &lse[1..] };
        let e = attention_backward(&mut vec![0.0; qkv.len()], &out, &qkv, att, &CU, &SHAPE)
            .expect_err("must be rejected");
        assert!(
            e.to_string().contains("attention_backward") && e.to_string().contains("`lse`"),
            "{e}"
        );
        Ok(())
    }
}
