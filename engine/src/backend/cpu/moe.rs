//! A mixture-of-experts MLP's routing, dispatch and expert GEMMs. Reference:
//! `MixtralTopKRouter` / `MixtralExperts` (and their Qwen MoE twins) and `GptOssTopKRouter` /
//! `GptOssExperts` in transformers, and `load_balancing_loss_func` for the auxiliary loss.
//!
//! transformers loops over experts and `index_add_`s each expert's weighted output into its
//! tokens; here the `T k` (token, slot) pairs are sorted by expert once (a stable counting
//! sort), each expert multiplies a contiguous block of rows, and every token sums its `k`
//! outputs in slot order, so nothing depends on thread timing.
//!
//! Routing backward, per token with chosen experts `e_j` and `p = softmax(z)`:
//! - SoftmaxTopK, `w_j = p_{e_j}`: `dp_{e_j} = dw_j`; renormalised, `w_j = p_{e_j} / S` with
//!   `S = Σ_j p_{e_j}`: `dp_{e_j} = (dw_j − Σ_i dw_i w_i) / S`; then
//!   `dz = p ⊙ (dp − Σ_e p_e dp_e)`.
//! - TopKSoftmax, `w = softmax(z_chosen)`: `dz_{e_j} = w_j (dw_j − Σ_i w_i dw_i)`, 0 elsewhere.
//! - The load-balancing loss `E Σ_e c_e P_e / N²` (counts `c` carry no gradient) adds
//!   `scale · p_e (c_e − Σ_j p_j c_j)`, its gradient through the softmax.

use rayon::prelude::*;

use super::check::{self, err};
use super::matmul::{linear, linear_dinp, linear_dw, linear_kn, linear_kn_dinp, linear_kn_dw};
use crate::backend::{ExpertLayout, Grads, GroupedShape, MoeShape, Operands, RouterKind, Routing};
use crate::error::Result;

fn check_shape(op: &str, shape: &MoeShape) -> Result<()> {
    check::nonzero(op, "experts", shape.experts)?;
    if shape.top_k == 0 || shape.top_k > shape.experts {
        return Err(err(
            op,
            format!("top_k {} must be in 1..={} (the experts)", shape.top_k, shape.experts),
        ));
    }
    Ok(())
}

/// The chosen experts of one token's logits: the `k` largest, descending, ties to the lower
/// index (a stable sort of the indices by logit).
fn top_k(z: &[f32], k: usize, chosen: &mut Vec<usize>) {
    chosen.clear();
    chosen.extend(0..z.len());
    chosen.sort_by(|&a, &b| z[b].total_cmp(&z[a]).then(a.cmp(&b)));
    chosen.truncate(k);
}

fn softmax(z: &[f32], out: &mut [f32]) {
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for (o, &x) in out.iter_mut().zip(z) {
        *o = (x - max).exp();
        sum += *o;
    }
    out.iter_mut().for_each(|o| *o /= sum);
}

/// weights `[T, k]`, probs `[T, E]`, experts `[T, k]` (written), logits `[T, E]`.
pub fn moe_route(
    weights: &mut [f32],
    probs: &mut [f32],
    experts: &mut [i32],
    logits: &[f32],
    shape: &MoeShape,
) -> Result<()> {
    const OP: &str = "moe_route";
    check_shape(OP, shape)?;
    let (t, e, k) = (shape.tokens, shape.experts, shape.top_k);
    check::len(OP, "weights", weights.len(), &[t, k])?;
    check::len(OP, "probs", probs.len(), &[t, e])?;
    check::len(OP, "logits", logits.len(), &[t, e])?;
    let experts = experts
        .get_mut(..t * k)
        .ok_or_else(|| err(OP, format!("experts holds fewer than {} ids", t * k)))?;
    weights
        .par_chunks_mut(k)
        .zip(probs.par_chunks_mut(e))
        .zip(experts.par_chunks_mut(k))
        .zip(logits.par_chunks(e))
        .for_each_init(Vec::new, |chosen, (((w, p), ids), z)| {
            softmax(z, p);
            top_k(z, k, chosen);
            for (id, &c) in ids.iter_mut().zip(chosen.iter()) {
                *id = c as i32;
            }
            match shape.router {
                RouterKind::SoftmaxTopK { renormalize } => {
                    for (w, &c) in w.iter_mut().zip(chosen.iter()) {
                        *w = p[c];
                    }
                    if renormalize {
                        let s: f32 = w.iter().sum();
                        w.iter_mut().for_each(|w| *w /= s);
                    }
                }
                RouterKind::TopKSoftmax => {
                    let top: Vec<f32> = chosen.iter().map(|&c| z[c]).collect();
                    softmax(&top, w);
                }
            }
        });
    Ok(())
}

/// The chosen experts of a token, checked against the expert count.
fn chosen_ids(op: &str, ids: &[i32], experts: usize) -> Result<()> {
    match ids.iter().find(|&&i| i < 0 || i as usize >= experts) {
        Some(bad) => Err(err(op, format!("expert id {bad} is outside 0..{experts}"))),
        None => Ok(()),
    }
}

/// dlogits `[T, E]` (overwrites), dweights and routing.weights `[T, k]`, routing.probs
/// `[T, E]`, routing.experts `[T, k]`, aux: counts `[E]` and the loss gradient's scale.
pub fn moe_route_backward(
    dlogits: &mut [f32],
    dweights: &[f32],
    routing: Routing<&[f32], &[i32]>,
    aux: Option<(&[f32], f32)>,
    shape: &MoeShape,
) -> Result<()> {
    const OP: &str = "moe_route_backward";
    let Routing { weights, probs, experts } = routing;
    check_shape(OP, shape)?;
    let (t, e, k) = (shape.tokens, shape.experts, shape.top_k);
    check::len(OP, "dlogits", dlogits.len(), &[t, e])?;
    check::len(OP, "dweights", dweights.len(), &[t, k])?;
    check::len(OP, "weights", weights.len(), &[t, k])?;
    check::len(OP, "probs", probs.len(), &[t, e])?;
    let experts = check::ints(OP, "experts", experts, t * k)?;
    chosen_ids(OP, experts, e)?;
    if let Some((counts, _)) = aux {
        check::len(OP, "counts", counts.len(), &[e])?;
    }
    dlogits
        .par_chunks_mut(e)
        .zip(dweights.par_chunks(k))
        .zip(weights.par_chunks(k))
        .zip(probs.par_chunks(e))
        .zip(experts.par_chunks(k))
        .for_each_init(
            || vec![0f32; e],
            |dp, ((((dz, dw), w), p), ids)| {
                match shape.router {
                    RouterKind::SoftmaxTopK { renormalize } => {
                        dp.fill(0.0);
                        if renormalize {
                            let s: f32 = ids.iter().map(|&i| p[i as usize]).sum();
                            let dot: f32 = dw.iter().zip(w).map(|(a, b)| a * b).sum();
                            for (&i, &g) in ids.iter().zip(dw) {
                                dp[i as usize] = (g - dot) / s;
                            }
                        } else {
                            for (&i, &g) in ids.iter().zip(dw) {
                                dp[i as usize] = g;
                            }
                        }
                        let dot: f32 = p.iter().zip(dp.iter()).map(|(a, b)| a * b).sum();
                        for ((z, &p), &d) in dz.iter_mut().zip(p).zip(dp.iter()) {
                            *z = p * (d - dot);
                        }
                    }
                    RouterKind::TopKSoftmax => {
                        dz.fill(0.0);
                        let dot: f32 = dw.iter().zip(w).map(|(a, b)| a * b).sum();
                        for ((&i, &g), &w) in ids.iter().zip(dw).zip(w) {
                            dz[i as usize] = w * (g - dot);
                        }
                    }
                }
                if let Some((c, scale)) = aux {
                    let dot: f32 = p.iter().zip(c).map(|(a, b)| a * b).sum();
                    for ((z, &p), &c) in dz.iter_mut().zip(p).zip(c) {
                        *z += scale * p * (c - dot);
                    }
                }
            },
        );
    Ok(())
}

/// stats `[2E]` (accumulates): pair counts per expert, then summed probabilities.
pub fn moe_router_stats(
    stats: &mut [f32],
    probs: &[f32],
    experts: &[i32],
    shape: &MoeShape,
) -> Result<()> {
    const OP: &str = "moe_router_stats";
    check_shape(OP, shape)?;
    let (t, e, k) = (shape.tokens, shape.experts, shape.top_k);
    check::len(OP, "stats", stats.len(), &[2, e])?;
    check::len(OP, "probs", probs.len(), &[t, e])?;
    let experts = check::ints(OP, "experts", experts, t * k)?;
    chosen_ids(OP, experts, e)?;
    let (counts, sums) = stats.split_at_mut(e);
    for &i in experts {
        counts[i as usize] += 1.0;
    }
    // Summed token by token in order, in f64, like the other reductions of this backend.
    let mut acc = vec![0f64; e];
    for row in probs.chunks(e) {
        acc.iter_mut().zip(row).for_each(|(a, &p)| *a += f64::from(p));
    }
    sums.iter_mut().zip(acc).for_each(|(s, a)| *s += a as f32);
    Ok(())
}

/// order and rows `[T k]` (written), experts `[T, k]`; returns offsets `[E + 1]`.
pub fn moe_sort(
    order: &mut [i32],
    rows: &mut [i32],
    experts: &[i32],
    shape: &MoeShape,
) -> Result<Vec<usize>> {
    const OP: &str = "moe_sort";
    check_shape(OP, shape)?;
    let (pairs, e) = (shape.rows(), shape.experts);
    let experts = check::ints(OP, "experts", experts, pairs)?;
    chosen_ids(OP, experts, e)?;
    let too_short = |name: &str| err(OP, format!("{name} holds fewer than {pairs} entries"));
    let order = order.get_mut(..pairs).ok_or_else(|| too_short("order"))?;
    let rows = rows.get_mut(..pairs).ok_or_else(|| too_short("rows"))?;
    let mut offsets = vec![0usize; e + 1];
    for &i in experts {
        offsets[i as usize + 1] += 1;
    }
    for x in 1..=e {
        offsets[x] += offsets[x - 1];
    }
    let mut next = offsets.clone();
    for (p, &i) in experts.iter().enumerate() {
        let r = next[i as usize];
        next[i as usize] += 1;
        order[r] = p as i32;
        rows[p] = r as i32;
    }
    Ok(offsets)
}

/// A permutation's entries, checked to index `n` rows.
fn rows_of<'a>(op: &str, name: &str, idx: &'a [i32], len: usize, n: usize) -> Result<&'a [i32]> {
    let idx = check::ints(op, name, idx, len)?;
    match idx.iter().find(|&&r| r < 0 || r as usize >= n) {
        Some(bad) => Err(err(op, format!("{name} entry {bad} is outside 0..{n}"))),
        None => Ok(idx),
    }
}

/// xs `[T k, H]`, x `[T, H]`, order `[T k]`.
pub fn moe_gather(xs: &mut [f32], x: &[f32], order: &[i32], shape: &MoeShape) -> Result<()> {
    const OP: &str = "moe_gather";
    check_shape(OP, shape)?;
    let (t, h, pairs) = (shape.tokens, shape.hidden, shape.rows());
    check::len(OP, "xs", xs.len(), &[pairs, h])?;
    check::len(OP, "x", x.len(), &[t, h])?;
    let order = rows_of(OP, "order", order, pairs, pairs)?;
    if h == 0 {
        return Ok(());
    }
    xs.par_chunks_mut(h).zip(order).for_each(|(row, &p)| {
        let src = p as usize / shape.top_k;
        row.copy_from_slice(&x[src * h..(src + 1) * h]);
    });
    Ok(())
}

/// dx `[T, H]` (overwrites), dxs `[T k, H]`, rows `[T k]`.
pub fn moe_gather_backward(
    dx: &mut [f32],
    dxs: &[f32],
    rows: &[i32],
    shape: &MoeShape,
) -> Result<()> {
    const OP: &str = "moe_gather_backward";
    check_shape(OP, shape)?;
    let (t, h, k, pairs) = (shape.tokens, shape.hidden, shape.top_k, shape.rows());
    check::len(OP, "dx", dx.len(), &[t, h])?;
    check::len(OP, "dxs", dxs.len(), &[pairs, h])?;
    let rows = rows_of(OP, "rows", rows, pairs, pairs)?;
    if h == 0 {
        return Ok(());
    }
    dx.par_chunks_mut(h).zip(rows.par_chunks(k)).for_each(|(d, slots)| {
        d.fill(0.0);
        for &r in slots {
            let r = r as usize;
            d.iter_mut().zip(&dxs[r * h..(r + 1) * h]).for_each(|(d, &g)| *d += g);
        }
    });
    Ok(())
}

/// out `[T, H]` (overwrites), y `[T k, H]`, weights `[T, k]`, rows `[T k]`.
pub fn moe_combine(
    out: &mut [f32],
    y: &[f32],
    weights: &[f32],
    rows: &[i32],
    shape: &MoeShape,
) -> Result<()> {
    const OP: &str = "moe_combine";
    check_shape(OP, shape)?;
    let (t, h, k, pairs) = (shape.tokens, shape.hidden, shape.top_k, shape.rows());
    check::len(OP, "out", out.len(), &[t, h])?;
    check::len(OP, "y", y.len(), &[pairs, h])?;
    check::len(OP, "weights", weights.len(), &[t, k])?;
    let rows = rows_of(OP, "rows", rows, pairs, pairs)?;
    if h == 0 {
        return Ok(());
    }
    out.par_chunks_mut(h).zip(rows.par_chunks(k)).zip(weights.par_chunks(k)).for_each(
        |((o, slots), w)| {
            o.fill(0.0);
            for (&r, &w) in slots.iter().zip(w) {
                let r = r as usize;
                o.iter_mut().zip(&y[r * h..(r + 1) * h]).for_each(|(o, &y)| *o += w * y);
            }
        },
    );
    Ok(())
}

/// dy = `grads.dinp` `[T k, H]` and dweights = `grads.dw` `[T, k]` (overwrite), dout `[T, H]`,
/// y `[T k, H]`, weights `[T, k]`, rows `[T k]`.
pub fn moe_combine_backward(
    grads: Grads<&mut [f32]>,
    dout: &[f32],
    y: &[f32],
    weights: &[f32],
    rows: &[i32],
    shape: &MoeShape,
) -> Result<()> {
    const OP: &str = "moe_combine_backward";
    let Grads { dinp: dy, dw: dweights } = grads;
    check_shape(OP, shape)?;
    let (t, h, k, pairs) = (shape.tokens, shape.hidden, shape.top_k, shape.rows());
    check::len(OP, "dy", dy.len(), &[pairs, h])?;
    check::len(OP, "dweights", dweights.len(), &[t, k])?;
    check::len(OP, "dout", dout.len(), &[t, h])?;
    check::len(OP, "y", y.len(), &[pairs, h])?;
    check::len(OP, "weights", weights.len(), &[t, k])?;
    let rows = rows_of(OP, "rows", rows, pairs, pairs)?;
    if h == 0 {
        dweights.fill(0.0);
        return Ok(());
    }
    // Every sorted row belongs to exactly one pair: scatter through the inverse permutation.
    let mut pair_of = vec![0usize; pairs];
    for (p, &r) in rows.iter().enumerate() {
        pair_of[r as usize] = p;
    }
    dy.par_chunks_mut(h).zip(&pair_of).for_each(|(d, &p)| {
        let (w, src) = (weights[p], &dout[(p / k) * h..(p / k + 1) * h]);
        d.iter_mut().zip(src).for_each(|(d, &g)| *d = w * g);
    });
    dweights.par_chunks_mut(k).zip(rows.par_chunks(k)).enumerate().for_each(
        |(tok, (dw, slots))| {
            let g = &dout[tok * h..(tok + 1) * h];
            for (d, &r) in dw.iter_mut().zip(slots) {
                let r = r as usize;
                *d = g.iter().zip(&y[r * h..(r + 1) * h]).map(|(a, b)| a * b).sum();
            }
        },
    );
    Ok(())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// out `[T, H]` (accumulates `sigmoid(logits[t]) · y[t]`), y `[T, H]`, logits `[T]`; of the
/// shape only `tokens` and `hidden` are read.
pub fn sigmoid_gate_forward(
    out: &mut [f32],
    y: &[f32],
    logits: &[f32],
    shape: &MoeShape,
) -> Result<()> {
    const OP: &str = "sigmoid_gate_forward";
    let (rows, n) = (shape.tokens, shape.hidden);
    check::len(OP, "out", out.len(), &[rows, n])?;
    check::len(OP, "y", y.len(), &[rows, n])?;
    check::len(OP, "logits", logits.len(), &[rows])?;
    if n == 0 {
        return Ok(());
    }
    out.par_chunks_mut(n).zip(y.par_chunks(n)).zip(logits).for_each(|((o, y), &z)| {
        let g = sigmoid(z);
        o.iter_mut().zip(y).for_each(|(o, &y)| *o += g * y);
    });
    Ok(())
}

/// dy `[T, H]` and dlogits `[T]` (overwrite), dout and y `[T, H]`, logits `[T]`.
pub fn sigmoid_gate_backward(
    dy: &mut [f32],
    dlogits: &mut [f32],
    dout: &[f32],
    y: &[f32],
    logits: &[f32],
    shape: &MoeShape,
) -> Result<()> {
    const OP: &str = "sigmoid_gate_backward";
    let (rows, n) = (shape.tokens, shape.hidden);
    check::len(OP, "dy", dy.len(), &[rows, n])?;
    check::len(OP, "dlogits", dlogits.len(), &[rows])?;
    check::len(OP, "dout", dout.len(), &[rows, n])?;
    check::len(OP, "y", y.len(), &[rows, n])?;
    check::len(OP, "logits", logits.len(), &[rows])?;
    if n == 0 {
        dlogits.fill(0.0);
        return Ok(());
    }
    dy.par_chunks_mut(n)
        .zip(dlogits.par_iter_mut())
        .zip(dout.par_chunks(n).zip(y.par_chunks(n)))
        .zip(logits)
        .for_each(|(((dy, dz), (d, y)), &z)| {
            let g = sigmoid(z);
            dy.iter_mut().zip(d).for_each(|(dy, &d)| *dy = g * d);
            let dot: f32 = d.iter().zip(y).map(|(a, b)| a * b).sum();
            *dz = g * (1.0 - g) * dot;
        });
    Ok(())
}

fn check_grouped(op: &str, g: &GroupedShape<'_>) -> Result<()> {
    check::nonzero(op, "experts", g.experts())?;
    if g.offsets[0] != 0 || g.offsets.windows(2).any(|w| w[1] < w[0]) {
        return Err(err(op, "offsets must start at 0 and never decrease"));
    }
    Ok(())
}

/// out `[R, N]`, inp `[R, K]`, w `[E, N, K]` or `[E, K, N]`, bias `[E, N]`.
pub fn grouped_matmul_forward(
    out: &mut [f32],
    operands: Operands<&[f32]>,
    bias: Option<&[f32]>,
    g: &GroupedShape<'_>,
) -> Result<()> {
    const OP: &str = "grouped_matmul_forward";
    let Operands { inp, w } = operands;
    check_grouped(OP, g)?;
    let (r, k, n, e) = (g.rows(), g.k, g.n, g.experts());
    check::len(OP, "out", out.len(), &[r, n])?;
    check::len(OP, "inp", inp.len(), &[r, k])?;
    check::len(OP, "w", w.len(), &[e, n, k])?;
    if let Some(bias) = bias {
        check::len(OP, "bias", bias.len(), &[e, n])?;
    }
    for x in 0..e {
        let rows = g.offsets[x]..g.offsets[x + 1];
        let m = rows.len();
        let (o, i) = (&mut out[rows.start * n..rows.end * n], &inp[rows.start * k..rows.end * k]);
        let we = &w[x * n * k..(x + 1) * n * k];
        match g.layout {
            ExpertLayout::Rows => linear(o, i, we, m, k, n)?,
            ExpertLayout::Cols => linear_kn(o, i, we, m, k, n)?,
        }
        if let (Some(bias), true) = (bias, n > 0) {
            let b = &bias[x * n..(x + 1) * n];
            o.par_chunks_mut(n).for_each(|row| row.iter_mut().zip(b).for_each(|(o, &b)| *o += b));
        }
    }
    Ok(())
}

/// dinp `[R, K]` (overwrites), dw like w (accumulates), dout `[R, N]`, inp `[R, K]`.
pub fn grouped_matmul_backward(
    grads: Grads<&mut [f32]>,
    dout: &[f32],
    operands: Operands<&[f32]>,
    g: &GroupedShape<'_>,
) -> Result<()> {
    const OP: &str = "grouped_matmul_backward";
    let Grads { dinp, dw } = grads;
    let Operands { inp, w } = operands;
    check_grouped(OP, g)?;
    let (r, k, n, e) = (g.rows(), g.k, g.n, g.experts());
    check::len(OP, "dinp", dinp.len(), &[r, k])?;
    check::len(OP, "dw", dw.len(), &[e, n, k])?;
    check::len(OP, "dout", dout.len(), &[r, n])?;
    check::len(OP, "inp", inp.len(), &[r, k])?;
    check::len(OP, "w", w.len(), &[e, n, k])?;
    for x in 0..e {
        let rows = g.offsets[x]..g.offsets[x + 1];
        let m = rows.len();
        let di = &mut dinp[rows.start * k..rows.end * k];
        let (d, i) = (&dout[rows.start * n..rows.end * n], &inp[rows.start * k..rows.end * k]);
        let (we, dwe) = (&w[x * n * k..(x + 1) * n * k], &mut dw[x * n * k..(x + 1) * n * k]);
        match g.layout {
            ExpertLayout::Rows => {
                linear_dinp(di, d, we, m, k, n)?;
                linear_dw(dwe, d, i, m, k, n)?;
            }
            ExpertLayout::Cols => {
                linear_kn_dinp(di, d, we, m, k, n)?;
                linear_kn_dw(dwe, d, i, m, k, n)?;
            }
        }
    }
    Ok(())
}

/// dbias `[E, N]` (accumulates; each expert's rows summed in order, in f64), dout `[R, N]`.
pub fn grouped_bias_backward(dbias: &mut [f32], dout: &[f32], g: &GroupedShape<'_>) -> Result<()> {
    const OP: &str = "grouped_bias_backward";
    check_grouped(OP, g)?;
    let (r, n, e) = (g.rows(), g.n, g.experts());
    check::len(OP, "dbias", dbias.len(), &[e, n])?;
    check::len(OP, "dout", dout.len(), &[r, n])?;
    if n == 0 {
        return Ok(());
    }
    dbias.par_chunks_mut(n).enumerate().for_each(|(x, db)| {
        let mut acc = vec![0f64; n];
        for row in dout[g.offsets[x] * n..g.offsets[x + 1] * n].chunks(n) {
            acc.iter_mut().zip(row).for_each(|(a, &v)| *a += f64::from(v));
        }
        db.iter_mut().zip(acc).for_each(|(b, a)| *b += a as f32);
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::{assert_close, numeric_grad, rng, to_f64, uniform};

    fn shape(tokens: usize, router: RouterKind) -> MoeShape {
        MoeShape { tokens, hidden: 5, experts: 4, top_k: 2, router }
    }

    const ROUTERS: [RouterKind; 3] = [
        RouterKind::SoftmaxTopK { renormalize: false },
        RouterKind::SoftmaxTopK { renormalize: true },
        RouterKind::TopKSoftmax,
    ];

    fn route(logits: &[f32], s: &MoeShape) -> (Vec<f32>, Vec<f32>, Vec<i32>) {
        let mut w = vec![0.0; s.rows()];
        let mut p = vec![0.0; s.tokens * s.experts];
        let mut ids = vec![0; s.rows()];
        moe_route(&mut w, &mut p, &mut ids, logits, s).unwrap();
        (w, p, ids)
    }

    #[test]
    fn routing_picks_the_largest_logits_in_order_and_weighs_them_as_each_router_does() {
        let z = [0.5f32, 2.0, -1.0, 1.0];
        let e: Vec<f32> = z.iter().map(|x| x.exp()).collect();
        let total: f32 = e.iter().sum();
        for router in ROUTERS {
            let (w, p, ids) = route(&z, &shape(1, router));
            assert_eq!(ids, [1, 3]);
            assert!((p[1] - e[1] / total).abs() < 1e-6);
            let expected = match router {
                RouterKind::SoftmaxTopK { renormalize: false } => [e[1] / total, e[3] / total],
                _ => [e[1] / (e[1] + e[3]), e[3] / (e[1] + e[3])],
            };
            assert!((w[0] - expected[0]).abs() < 1e-6 && (w[1] - expected[1]).abs() < 1e-6);
        }
        // Ties go to the lower index.
        let (_, _, ids) = route(&[1.0, 3.0, 3.0, 0.0], &shape(1, ROUTERS[0]));
        assert_eq!(ids, [1, 2]);
    }

    /// The routing backward, with and without the auxiliary term, against central differences
    /// of `Σ dweights · weights + scale Σ_e c_e p_e` in f64 through the f32 forward (the chosen
    /// experts stay put under the small steps: the logits are well separated).
    #[test]
    fn routing_backward_matches_numeric_gradients() {
        let mut r = rng(5);
        let s0 = shape(3, ROUTERS[0]);
        let logits: Vec<f32> = (0..12).map(|i| (i * 7 % 12) as f32 * 0.3 - 1.5).collect();
        let dw = uniform(&mut r, s0.rows());
        let counts = [3.0f32, 1.0, 0.0, 2.0];
        for router in ROUTERS {
            for aux in [None, Some(0.7f32)] {
                let s = shape(3, router);
                let (w, p, ids) = route(&logits, &s);
                let mut dz = vec![0.0; 12];
                let a = aux.map(|scale| (&counts[..], scale));
                let routing = Routing { weights: &w[..], probs: &p[..], experts: &ids[..] };
                moe_route_backward(&mut dz, &dw, routing, a, &s).unwrap();
                let f = |z: &[f64]| {
                    let z32: Vec<f32> = z.iter().map(|&x| x as f32).collect();
                    let (w, p, _) = route(&z32, &s);
                    let mut v: f64 = w.iter().zip(&dw).map(|(&a, &b)| f64::from(a * b)).sum();
                    if let Some(scale) = aux {
                        let pc: f64 = p
                            .chunks(4)
                            .flat_map(|row| {
                                row.iter().zip(&counts).map(|(&p, &c)| f64::from(p * c))
                            })
                            .sum();
                        v += f64::from(scale) * pc;
                    }
                    v
                };
                let numeric = numeric_grad(&to_f64(&logits), f);
                assert_close(&format!("{router:?} aux {aux:?}"), &dz, &numeric, 2e-2);
            }
        }
    }

    #[test]
    fn sort_gather_combine_and_their_backwards_agree_with_a_per_token_loop() {
        let mut r = rng(9);
        let s = shape(6, ROUTERS[1]);
        let logits = uniform(&mut r, 6 * 4);
        let (w, _, ids) = route(&logits, &s);
        let (mut order, mut rows) = (vec![0; 12], vec![0; 12]);
        let offsets = moe_sort(&mut order, &mut rows, &ids, &s).unwrap();
        assert_eq!(offsets.len(), 5);
        assert_eq!(offsets[4], 12);
        for x in 0..4 {
            for row in offsets[x]..offsets[x + 1] {
                assert_eq!(ids[order[row] as usize], x as i32, "row {row} belongs to expert {x}");
                assert_eq!(rows[order[row] as usize], row as i32);
            }
            // Stable: pairs keep their order within an expert.
            assert!(order[offsets[x]..offsets[x + 1]].windows(2).all(|p| p[0] < p[1]));
        }
        let x = uniform(&mut r, 6 * 5);
        let mut xs = vec![0.0; 12 * 5];
        moe_gather(&mut xs, &x, &order, &s).unwrap();
        // Each expert output row is its input row times (1 + expert id): combine must give
        // Σ_j w_j (1 + e_j) x_t.
        let y: Vec<f32> = xs
            .chunks(5)
            .zip(&order)
            .flat_map(|(row, &p)| {
                let f = (1 + ids[p as usize]) as f32;
                row.iter().map(move |v| v * f)
            })
            .collect();
        let mut out = vec![0.0; 30];
        moe_combine(&mut out, &y, &w, &rows, &s).unwrap();
        for t in 0..6 {
            let f: f32 = (0..2).map(|j| w[t * 2 + j] * (1 + ids[t * 2 + j]) as f32).sum();
            for c in 0..5 {
                assert!((out[t * 5 + c] - f * x[t * 5 + c]).abs() < 1e-5);
            }
        }
        let dout = uniform(&mut r, 30);
        let (mut dy, mut dwts) = (vec![0.0; 60], vec![0.0; 12]);
        let grads = Grads { dinp: &mut dy[..], dw: &mut dwts[..] };
        moe_combine_backward(grads, &dout, &y, &w, &rows, &s).unwrap();
        let mut dx = vec![0.0; 30];
        moe_gather_backward(&mut dx, &dy, &rows, &s).unwrap();
        for t in 0..6 {
            for j in 0..2 {
                let row = rows[t * 2 + j] as usize;
                let dot: f32 = (0..5).map(|c| dout[t * 5 + c] * y[row * 5 + c]).sum();
                assert!((dwts[t * 2 + j] - dot).abs() < 1e-5);
            }
            for c in 0..5 {
                let sum: f32 = (0..2).map(|j| w[t * 2 + j]).sum::<f32>() * dout[t * 5 + c];
                assert!((dx[t * 5 + c] - sum).abs() < 1e-5, "dx is Σ_j w_j dout");
            }
        }
    }

    #[test]
    fn grouped_matmul_runs_each_expert_on_its_rows_in_both_layouts() {
        let mut r = rng(3);
        let offsets = [0usize, 3, 3, 7];
        let (k, n) = (4, 5);
        let inp = uniform(&mut r, 7 * k);
        let w = uniform(&mut r, 3 * n * k);
        let bias = uniform(&mut r, 3 * n);
        for layout in [ExpertLayout::Rows, ExpertLayout::Cols] {
            let g = GroupedShape { offsets: &offsets, k, n, layout };
            let mut out = vec![0.0; 7 * n];
            grouped_matmul_forward(&mut out, Operands { inp: &inp, w: &w }, Some(&bias), &g)
                .unwrap();
            let at = |x: usize, o: usize, i: usize| match layout {
                ExpertLayout::Rows => w[x * n * k + o * k + i],
                ExpertLayout::Cols => w[x * n * k + i * n + o],
            };
            for row in 0..7 {
                let x = if row < 3 { 0 } else { 2 };
                for o in 0..n {
                    let v: f32 = (0..k).map(|i| inp[row * k + i] * at(x, o, i)).sum::<f32>()
                        + bias[x * n + o];
                    assert!((out[row * n + o] - v).abs() < 1e-5, "{layout:?} row {row}");
                }
            }
            let dout = uniform(&mut r, 7 * n);
            let (mut dinp, mut dw, mut db) =
                (vec![0.0; 7 * k], vec![0.0; 3 * n * k], vec![0.0; 3 * n]);
            let grads = Grads { dinp: &mut dinp[..], dw: &mut dw[..] };
            grouped_matmul_backward(grads, &dout, Operands { inp: &inp, w: &w }, &g).unwrap();
            grouped_bias_backward(&mut db, &dout, &g).unwrap();
            // The idle expert 1 gets no gradient.
            assert!(dw[n * k..2 * n * k].iter().all(|&v| v == 0.0));
            assert!(db[n..2 * n].iter().all(|&v| v == 0.0));
            for o in 0..n {
                let v: f32 = (0..3).map(|row| dout[row * n + o]).sum();
                assert!((db[o] - v).abs() < 1e-5, "expert 0's bias gradient");
            }
            for row in 0..7 {
                let x = if row < 3 { 0 } else { 2 };
                for i in 0..k {
                    let v: f32 = (0..n).map(|o| dout[row * n + o] * at(x, o, i)).sum();
                    assert!((dinp[row * k + i] - v).abs() < 1e-5);
                }
            }
            for o in 0..n {
                for i in 0..k {
                    let v: f32 = (3..7).map(|row| dout[row * n + o] * inp[row * k + i]).sum();
                    let idx = match layout {
                        ExpertLayout::Rows => 2 * n * k + o * k + i,
                        ExpertLayout::Cols => 2 * n * k + i * n + o,
                    };
                    assert!((dw[idx] - v).abs() < 1e-5, "{layout:?} dw");
                }
            }
        }
    }

    /// The shared expert's gate against central differences of `Σ r · (out + σ(z) y)`.
    #[test]
    fn sigmoid_gate_matches_numeric_gradients() {
        let mut r = rng(12);
        let (rows, n) = (5, 7);
        let s = MoeShape { tokens: rows, hidden: n, ..shape(rows, ROUTERS[0]) };
        let (y, z) = (uniform(&mut r, rows * n), uniform(&mut r, rows));
        let (base, d) = (uniform(&mut r, rows * n), uniform(&mut r, rows * n));
        let mut out = base.clone();
        sigmoid_gate_forward(&mut out, &y, &z, &s).unwrap();
        for t in 0..rows {
            let g = 1.0 / (1.0 + (-z[t]).exp());
            for c in 0..n {
                let want = base[t * n + c] + g * y[t * n + c];
                assert!((out[t * n + c] - want).abs() < 1e-6, "forward");
            }
        }
        let (mut dy, mut dz) = (vec![f32::NAN; rows * n], vec![f32::NAN; rows]);
        sigmoid_gate_backward(&mut dy, &mut dz, &d, &y, &z, &s).unwrap();
        let loss = |yv: &[f64], zv: &[f64]| -> f64 {
            (0..rows * n).map(|i| f64::from(d[i]) * yv[i] / (1.0 + (-zv[i / n]).exp())).sum()
        };
        let (y64, z64) = (to_f64(&y), to_f64(&z));
        assert_close("dy", &dy, &numeric_grad(&y64, |v| loss(v, &z64)), 1e-3);
        assert_close("dlogits", &dz, &numeric_grad(&z64, |v| loss(&y64, v)), 1e-3);
    }

    #[test]
    fn bad_expert_ids_and_offsets_are_errors() {
        let s = shape(1, ROUTERS[0]);
        let (mut o, mut r) = (vec![0; 2], vec![0; 2]);
        let e = moe_sort(&mut o, &mut r, &[0, 4], &s).unwrap_err().to_string();
        assert!(e.contains("expert id 4"), "{e}");
        let g = GroupedShape { offsets: &[0, 2, 1], k: 1, n: 1, layout: ExpertLayout::Rows };
        let e =
            grouped_matmul_forward(&mut [0.0], Operands { inp: &[0.0], w: &[0.0; 2] }, None, &g)
                .unwrap_err();
        assert!(e.to_string().contains("never decrease"), "{e}");
    }
}
