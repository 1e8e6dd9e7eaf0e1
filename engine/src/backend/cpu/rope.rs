//! Rotary position embedding of the query and key heads of a fused `qkv` row, in place.
//! Reference: `apply_rotary_pos_emb` and `rotate_half` in transformers' modeling_llama.py:
//! `q * cos + rotate_half(q) * sin` with `rotate_half(x) = cat(−x[r/2:], x[:r/2])`, so element
//! `i < r/2` is paired with `i + r/2` and turned by `θ_i = pos · inv_freq[i]`:
//! `(a, b) ↦ (a cos θ − b sin θ, b cos θ + a sin θ)`. `LlamaRotaryEmbedding` forms θ in f32 as
//! `inv_freq.float() @ position_ids.float()`, and so do we. `r = 2 · inv_freq.len()` is the
//! rotary width: all of `hd` usually, its leading part with a partial rotary factor (Phi-3's
//! `apply_rotary_pos_emb` rotates `q[..., :r]` and passes the rest through). cos and sin are
//! multiplied by `scale` (transformers' `attention_scaling`, 1 for most RoPE types) in f32
//! before use.
//!
//! The rotation by `+θ` scaled by `s` has as its transpose the rotation by `−θ` scaled by `s`,
//! which is the backward.

use rayon::prelude::*;

use super::check;
use crate::backend::AttentionShape;
use crate::error::Result;

/// Rotates query and key heads by `+θ` (forward) or `−θ` (backward), scaled by `scale`.
fn rotate(
    op: &str,
    qkv: &mut [f32],
    pos: &[i32],
    inv_freq: &[f32],
    scale: f32,
    shape: &AttentionShape,
    sign: f32,
) -> Result<()> {
    let width = check::attention_shape(op, shape)?;
    let hd = shape.head_dim;
    if !hd.is_multiple_of(2) {
        return Err(check::err(op, format!("head_dim {hd} must be even for rotary embedding")));
    }
    let half = inv_freq.len();
    if half == 0 || 2 * half > hd {
        return Err(check::err(
            op,
            format!("`inv_freq` has {half} frequencies; a head of {hd} takes 1 to {}", hd / 2),
        ));
    }
    check::len(op, "qkv", qkv.len(), &[shape.tokens, width])?;
    let pos = check::ints(op, "pos", pos, shape.tokens)?;
    let rotated = (shape.q_heads + shape.kv_heads) * hd;
    qkv.par_chunks_mut(width).zip(pos).for_each_init(
        || vec![(0.0f32, 0.0f32); half],
        |cos_sin, (row, &p)| {
            for (cs, &f) in cos_sin.iter_mut().zip(inv_freq) {
                let theta = p as f32 * f;
                *cs = (theta.cos() * scale, sign * (theta.sin() * scale));
            }
            for head in row[..rotated].chunks_mut(hd) {
                let (lo, hi) = head[..2 * half].split_at_mut(half);
                for ((a, b), &(cos, sin)) in lo.iter_mut().zip(hi.iter_mut()).zip(cos_sin.iter()) {
                    let (x, y) = (*a, *b);
                    *a = x * cos - y * sin;
                    *b = y * cos + x * sin;
                }
            }
        },
    );
    Ok(())
}

/// Rotates the query and key heads in place by `pos[t] * inv_freq[i]`, cos and sin scaled by
/// `scale`. qkv `[T, Dqkv]`, pos `[T]`, inv_freq `[r / 2]` with `r <= hd`.
pub fn rope_forward(
    qkv: &mut [f32],
    pos: &[i32],
    inv_freq: &[f32],
    scale: f32,
    shape: &AttentionShape,
) -> Result<()> {
    rotate("rope_forward", qkv, pos, inv_freq, scale, shape, 1.0)
}

/// The transpose of [`rope_forward`]: rotates the gradient in place by `−θ`, scaled alike.
/// dqkv `[T, Dqkv]`, pos `[T]`, inv_freq `[r / 2]`.
pub fn rope_backward(
    dqkv: &mut [f32],
    pos: &[i32],
    inv_freq: &[f32],
    scale: f32,
    shape: &AttentionShape,
) -> Result<()> {
    rotate("rope_backward", dqkv, pos, inv_freq, scale, shape, -1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::{
        TOL, assert_close, dot, numeric_grad, rng, to_f64, uniform,
    };
    use crate::error::Result;

    const SHAPE: AttentionShape = AttentionShape {
        tokens: 7,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 8,
        docs: 2,
        window: None,
        scale_dim: None,
        softcap: None,
    };
    /// Positions restart with the second document, as packing writes them.
    const POS: [i32; 7] = [0, 1, 2, 0, 1, 2, 3];

    /// `LlamaRotaryEmbedding`'s default frequencies, `1 / 10000^(2i / hd)`.
    fn inv_freq() -> Vec<f32> {
        let hd = SHAPE.head_dim as f32;
        (0..SHAPE.head_dim / 2).map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / hd)).collect()
    }

    /// Double-precision twin: `q cos + rotate_half(q) sin` on every q and k head, the angle formed
    /// in f32 as the contract says.
    fn rope64(x: &[f64], inv_freq: &[f32]) -> Vec<f64> {
        let (hd, half) = (SHAPE.head_dim, SHAPE.head_dim / 2);
        let rotated = (SHAPE.q_heads + SHAPE.kv_heads) * hd;
        let mut out = x.to_vec();
        for (row, &p) in out.chunks_mut(SHAPE.qkv_width()).zip(&POS) {
            for head in row[..rotated].chunks_mut(hd) {
                let orig = head.to_vec();
                for i in 0..hd {
                    let theta = f64::from(p as f32 * inv_freq[i % half]);
                    let rotate_half = if i < half { -orig[i + half] } else { orig[i - half] };
                    head[i] = orig[i] * theta.cos() + rotate_half * theta.sin();
                }
            }
        }
        out
    }

    #[test]
    fn forward_matches_twin_and_leaves_values_alone() -> Result<()> {
        let width = SHAPE.qkv_width();
        let x = uniform(&mut rng(30), SHAPE.tokens * width);
        let mut y = x.clone();
        rope_forward(&mut y, &POS, &inv_freq(), 1.0, &SHAPE)?;
        assert_close("rope forward", &y, &rope64(&to_f64(&x), &inv_freq()), TOL);
        let values = (SHAPE.q_heads + SHAPE.kv_heads) * SHAPE.head_dim;
        for (a, b) in y.chunks(width).zip(x.chunks(width)) {
            assert_eq!(a[values..], b[values..], "value heads must not rotate");
        }
        Ok(())
    }

    #[test]
    fn backward_is_the_transpose() -> Result<()> {
        let mut rng = rng(31);
        let n = SHAPE.tokens * SHAPE.qkv_width();
        let (x, r) = (uniform(&mut rng, n), uniform(&mut rng, n));
        let r64 = to_f64(&r);
        let mut d = r.clone();
        rope_backward(&mut d, &POS, &inv_freq(), 1.0, &SHAPE)?;
        let want = numeric_grad(&to_f64(&x), |x| dot(&rope64(x, &inv_freq()), &r64));
        assert_close("rope dqkv", &d, &want, TOL);
        Ok(())
    }

    #[test]
    fn forward_then_backward_returns_the_input() -> Result<()> {
        let x = uniform(&mut rng(32), SHAPE.tokens * SHAPE.qkv_width());
        let mut y = x.clone();
        rope_forward(&mut y, &POS, &inv_freq(), 1.0, &SHAPE)?;
        assert_ne!(y, x, "positions > 0 must rotate something");
        rope_backward(&mut y, &POS, &inv_freq(), 1.0, &SHAPE)?;
        // Two f32 rotations: each output is a 2-term dot product, ~2 ulp per rotation.
        assert_close("rope round trip", &y, &to_f64(&x), 1e-6);
        Ok(())
    }

    #[test]
    fn bad_arguments_are_rejected() -> Result<()> {
        let n = SHAPE.tokens * SHAPE.qkv_width();
        let e = rope_forward(&mut vec![0.0; n], &POS[..6], &inv_freq(), 1.0, &SHAPE)
            .expect_err("must be rejected");
        assert!(e.to_string().contains("rope_forward") && e.to_string().contains("`pos`"), "{e}");
        let odd = AttentionShape { head_dim: 7, ..SHAPE };
        let e = rope_backward(&mut vec![0.0; 7 * odd.qkv_width()], &POS, &[0.0; 3], 1.0, &odd)
            .expect_err("must be rejected");
        assert!(e.to_string().contains("rope_backward") && e.to_string().contains("even"), "{e}");
        Ok(())
    }
}
