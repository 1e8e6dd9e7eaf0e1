//! The LM head and its cross-entropy, a chunk of tokens at a time so the `[T, V]` logits never
//! exist at once: at most `CHUNK_TOKENS x V` of them do (64 MB for a 128k vocabulary).
//! Reference: `LlamaForCausalLM.forward` (`lm_head`, then `loss_function`, i.e.
//! `ForCausalLMLoss` / `fixed_cross_entropy` in transformers' loss_utils.py: cross-entropy in f32
//! with `ignore_index = -100`). Targets here are already shifted: `targets[t]` is the token that
//! follows token `t`.
//!
//! Backward, with logits `z_t = w x_t`, `loss_t = lse_t − z_{t,y_t}` and the caller's `scale`:
//! `∂(scale · loss_t)/∂z_{t,v} = scale · (softmax(z_t)_v − [v = y_t])` =: `G_{t,v}`, recomputed
//! from the kept `lse_t` (`softmax_v = exp(z_{t,v} − lse_t)`); `G_t = 0` for ignored tokens.
//! Then `dx = G · w` and `dw += Gᵀ · x`, the two halves of a linear layer's backward.

use rayon::prelude::*;

use super::check;
use super::matmul::{linear, linear_dinp, linear_dw};
use crate::backend::{Grads, IGNORE, LossShape, Operands, softcap as capped};
use crate::error::Result;

/// Tokens whose logits are materialised together: enough rows for the GEMMs to run at full speed
/// on every thread, few enough to keep the scratch small.
pub const CHUNK_TOKENS: usize = 128;

/// `log Σ_v exp(z_v)`, with the max subtracted and the sum in f64.
fn log_sum_exp(z: &[f32]) -> f32 {
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = z.iter().map(|&v| f64::from((v - max).exp())).sum();
    max + sum.ln() as f32
}

/// Checks the shared arguments and returns the targets prefix actually used.
fn check_args<'a>(
    op: &str,
    operands: Operands<&[f32]>,
    targets: &'a [i32],
    shape: &LossShape,
) -> Result<&'a [i32]> {
    let Operands { inp: x, w } = operands;
    let &LossShape { tokens, hidden, vocab, .. } = shape;
    check::nonzero(op, "hidden", hidden)?;
    check::nonzero(op, "vocab", vocab)?;
    check::len(op, "x", x.len(), &[tokens, hidden])?;
    check::len(op, "w", w.len(), &[vocab, hidden])?;
    let targets = check::ints(op, "targets", targets, tokens)?;
    check::targets(op, targets, vocab)?;
    Ok(targets)
}

/// losses `[T]` (0 where the target is IGNORE), lse `[T]`, x = `operands.inp` `[T, H]`,
/// w `[V, H]`, targets `[T]`.
pub fn cross_entropy_forward(
    losses: &mut [f32],
    lse: &mut [f32],
    operands: Operands<&[f32]>,
    targets: &[i32],
    shape: &LossShape,
) -> Result<()> {
    const OP: &str = "cross_entropy_forward";
    let targets = check_args(OP, operands, targets, shape)?;
    let Operands { inp: x, w } = operands;
    let &LossShape { tokens, hidden, vocab, softcap } = shape;
    check::len(OP, "losses", losses.len(), &[tokens])?;
    check::len(OP, "lse", lse.len(), &[tokens])?;
    let mut logits = vec![0.0f32; CHUNK_TOKENS.min(tokens) * vocab];
    let chunks = losses
        .chunks_mut(CHUNK_TOKENS)
        .zip(lse.chunks_mut(CHUNK_TOKENS))
        .zip(x.chunks(CHUNK_TOKENS * hidden))
        .zip(targets.chunks(CHUNK_TOKENS));
    for (((losses, lse), x), targets) in chunks {
        let m = losses.len();
        let logits = &mut logits[..m * vocab];
        linear(logits, x, w, m, hidden, vocab)?;
        if let Some(cap) = softcap {
            logits.par_iter_mut().for_each(|z| *z = capped(*z, cap).0);
        }
        logits.par_chunks(vocab).zip(losses).zip(lse).zip(targets).for_each(
            |(((z, loss), lse), &y)| {
                *lse = log_sum_exp(z);
                // `y` was checked to be IGNORE or in 0..vocab.
                *loss = if y == IGNORE { 0.0 } else { *lse - z[y as usize] };
            },
        );
    }
    Ok(())
}

/// Gradient of `scale · Σ_t losses[t]`: dx = `grads.dinp` `[T, H]` (overwrites), dw `[V, H]`
/// (accumulates), x = `operands.inp` `[T, H]`, w `[V, H]`, lse `[T]` (from the forward),
/// targets `[T]`.
pub fn cross_entropy_backward(
    grads: Grads<&mut [f32]>,
    operands: Operands<&[f32]>,
    lse: &[f32],
    targets: &[i32],
    scale: f32,
    shape: &LossShape,
) -> Result<()> {
    const OP: &str = "cross_entropy_backward";
    let targets = check_args(OP, operands, targets, shape)?;
    let Grads { dinp: dx, dw } = grads;
    let Operands { inp: x, w } = operands;
    let &LossShape { tokens, hidden, vocab, softcap } = shape;
    check::len(OP, "dx", dx.len(), &[tokens, hidden])?;
    check::len(OP, "dw", dw.len(), &[vocab, hidden])?;
    check::len(OP, "lse", lse.len(), &[tokens])?;
    let mut grads = vec![0.0f32; CHUNK_TOKENS.min(tokens) * vocab];
    let chunks = dx
        .chunks_mut(CHUNK_TOKENS * hidden)
        .zip(x.chunks(CHUNK_TOKENS * hidden))
        .zip(lse.chunks(CHUNK_TOKENS))
        .zip(targets.chunks(CHUNK_TOKENS));
    for (((dx, x), lse), targets) in chunks {
        if targets.iter().all(|&y| y == IGNORE) {
            // Prompt-only chunks are common in fine-tuning; their gradient is exactly zero.
            dx.fill(0.0);
            continue;
        }
        let m = targets.len();
        let grads = &mut grads[..m * vocab];
        linear(grads, x, w, m, hidden, vocab)?;
        grads.par_chunks_mut(vocab).zip(lse).zip(targets).for_each(|((g, &lse), &y)| {
            if y == IGNORE {
                g.fill(0.0);
                return;
            }
            match softcap {
                None => {
                    g.iter_mut().for_each(|z| *z = (*z - lse).exp() * scale);
                    // `y` was checked to be IGNORE or in 0..vocab.
                    g[y as usize] -= scale;
                }
                // d/dz of cap · tanh(z / cap) is 1 − tanh².
                Some(cap) => {
                    for (v, z) in g.iter_mut().enumerate() {
                        let (c, slope) = capped(*z, cap);
                        let onehot = if v == y as usize { scale } else { 0.0 };
                        *z = ((c - lse).exp() * scale - onehot) * slope;
                    }
                }
            }
        });
        linear_dinp(dx, grads, w, m, hidden, vocab)?;
        linear_dw(dw, grads, x, m, hidden, vocab)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::{TOL, assert_close, numeric_grad, rng, to_f64, uniform};
    use crate::error::Result;
    use rand::Rng;

    // More than two chunks of tokens, the middle one entirely ignored (the skipped path), the
    // last one partial.
    const TOKENS: usize = 2 * CHUNK_TOKENS + 44;
    const HIDDEN: usize = 5;
    const VOCAB: usize = 37;

    fn shape(softcap: Option<f32>) -> LossShape {
        LossShape { tokens: TOKENS, hidden: HIDDEN, vocab: VOCAB, softcap }
    }

    fn targets() -> Vec<i32> {
        let mut rng = rng(90);
        (0..TOKENS)
            .map(|t| {
                let ignored = (CHUNK_TOKENS..2 * CHUNK_TOKENS).contains(&t) || t % 5 == 0;
                if ignored { IGNORE } else { rng.random_range(0..VOCAB as i32) }
            })
            .collect()
    }

    /// Direct twin on the materialised `[T, V]` logits: log-softmax in f64.
    /// Returns (losses `[T]`, lse `[T]`).
    /// With a soft-cap, the logits are `cap · tanh(z / cap)` first.
    fn cross_entropy64(
        x: &[f64],
        w: &[f64],
        targets: &[i32],
        softcap: Option<f32>,
    ) -> (Vec<f64>, Vec<f64>) {
        let cap = |z: f64| softcap.map_or(z, |c| f64::from(c) * (z / f64::from(c)).tanh());
        let logits: Vec<Vec<f64>> = x
            .chunks(HIDDEN)
            .map(|x| {
                w.chunks(HIDDEN).map(|w| cap(x.iter().zip(w).map(|(a, b)| a * b).sum())).collect()
            })
            .collect();
        logits
            .iter()
            .zip(targets)
            .map(|(z, &y)| {
                let lse = z.iter().map(|v| v.exp()).sum::<f64>().ln();
                (if y == IGNORE { 0.0 } else { lse - z[y as usize] }, lse)
            })
            .unzip()
    }

    fn inputs() -> (Vec<f32>, Vec<f32>) {
        let mut rng = rng(91);
        // Scaled up so the softmax is far from uniform.
        let x = uniform(&mut rng, TOKENS * HIDDEN).iter().map(|v| 3.0 * v).collect();
        (x, uniform(&mut rng, VOCAB * HIDDEN))
    }

    /// Without a cap, and with one (2.0) that the logits of `inputs` exceed, so it bends them.
    const CAPS: [Option<f32>; 2] = [None, Some(2.0)];

    #[test]
    fn forward_matches_log_softmax_of_materialised_logits() -> Result<()> {
        for cap in CAPS {
            forward_case(cap)?;
        }
        Ok(())
    }

    fn forward_case(cap: Option<f32>) -> Result<()> {
        let ((x, w), targets) = (inputs(), targets());
        let (mut losses, mut lse) = (vec![f32::NAN; TOKENS], vec![f32::NAN; TOKENS]);
        let operands = Operands { inp: &x[..], w: &w[..] };
        cross_entropy_forward(&mut losses, &mut lse, operands, &targets, &shape(cap))?;
        let (want_losses, want_lse) = cross_entropy64(&to_f64(&x), &to_f64(&w), &targets, cap);
        assert_close(&format!("cross-entropy losses, cap {cap:?}"), &losses, &want_losses, TOL);
        assert_close(&format!("cross-entropy lse, cap {cap:?}"), &lse, &want_lse, TOL);
        assert!(losses.iter().zip(&targets).all(|(&l, &y)| y != IGNORE || l == 0.0));
        Ok(())
    }

    #[test]
    fn backward_matches_finite_differences() -> Result<()> {
        for cap in CAPS {
            backward_case(cap)?;
        }
        Ok(())
    }

    fn backward_case(cap: Option<f32>) -> Result<()> {
        let ((x, w), targets) = (inputs(), targets());
        let trained = targets.iter().filter(|&&y| y != IGNORE).count();
        let scale = 1.0 / trained as f32;
        let (mut losses, mut lse) = (vec![0.0; TOKENS], vec![0.0; TOKENS]);
        let operands = Operands { inp: &x[..], w: &w[..] };
        cross_entropy_forward(&mut losses, &mut lse, operands, &targets, &shape(cap))?;
        let dw0 = uniform(&mut rng(92), VOCAB * HIDDEN);
        let (mut dx, mut dw) = (vec![f32::NAN; TOKENS * HIDDEN], dw0.clone());
        let grads = Grads { dinp: &mut dx[..], dw: &mut dw[..] };
        cross_entropy_backward(grads, operands, &lse, &targets, scale, &shape(cap))?;

        let (x64, w64) = (to_f64(&x), to_f64(&w));
        let loss = |x: &[f64], w: &[f64]| {
            f64::from(scale) * cross_entropy64(x, w, &targets, cap).0.iter().sum::<f64>()
        };
        let want_dx = numeric_grad(&x64, |x| loss(x, &w64));
        let grad_w = numeric_grad(&w64, |w| loss(&x64, w));
        let want_dw: Vec<f64> = grad_w.iter().zip(&dw0).map(|(g, &d)| g + f64::from(d)).collect();
        assert_close("cross-entropy dx", &dx, &want_dx, TOL);
        assert_close("cross-entropy dw (accumulated)", &dw, &want_dw, TOL);
        let ignored_rows = dx.chunks(HIDDEN).zip(&targets).filter(|(_, y)| **y == IGNORE);
        assert!(
            ignored_rows.flat_map(|(row, _)| row).all(|&g| g == 0.0),
            "ignored tokens get no gradient"
        );
        Ok(())
    }

    #[test]
    fn targets_outside_the_vocabulary_are_rejected() -> Result<()> {
        let (x, w) = (vec![0.0; 2 * HIDDEN], vec![0.0; VOCAB * HIDDEN]);
        let (mut losses, mut lse) = (vec![0.0; 2], vec![0.0; 2]);
        for bad in [VOCAB as i32, -1] {
            let e = cross_entropy_forward(
                &mut losses,
                &mut lse,
                Operands { inp: &x, w: &w },
                &[0, bad],
                &LossShape { tokens: 2, ..shape(None) },
            )
            .expect_err("must be rejected");
            assert!(
                e.to_string().contains("cross_entropy_forward")
                    && e.to_string().contains("`targets`[1]"),
                "{e}"
            );
        }
        let mut dx = vec![0.0; 2 * HIDDEN];
        let mut dw = vec![0.0; VOCAB * HIDDEN - 1];
        let e = cross_entropy_backward(
            Grads { dinp: &mut dx, dw: &mut dw },
            Operands { inp: &x, w: &w },
            &lse,
            &[0, 1],
            1.0,
            &LossShape { tokens: 2, ..shape(None) },
        )
        .expect_err("must be rejected");
        assert!(
            e.to_string().contains("cross_entropy_backward") && e.to_string().contains("`dw`"),
            "{e}"
        );
        Ok(())
    }
}
