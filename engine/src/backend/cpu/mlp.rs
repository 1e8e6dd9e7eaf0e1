//! The gated MLP's activation, SwiGLU: `silu(gate) * up`.
//! Reference: `LlamaMLP.forward` in transformers' modeling_llama.py,
//! `down_proj(act_fn(gate_proj(x)) * up_proj(x))` with `act_fn = silu`; here `gate_proj` and
//! `up_proj` are one fused projection whose rows are `[gate (I) | up (I)]`.
//!
//! Backward, with `σ = sigmoid(g)` and `silu(g) = g σ`:
//! `d silu / dg = σ + g σ (1 − σ) = σ (1 + g (1 − σ))`, so
//! `dgate = dout · up · σ (1 + g (1 − σ))` and `dup = dout · silu(g)`.

use rayon::prelude::*;

use super::check;
use crate::error::Result;

fn sigmoid(x: f32) -> f32 {
    // For very negative x, exp(-x) overflows to inf and the result is the correct limit 0.
    1.0 / (1.0 + (-x).exp())
}

/// `out = silu(gate) * up`.
/// out `[rows, inter]`, gate_up `[rows, 2 inter]`.
pub fn swiglu_forward(out: &mut [f32], gate_up: &[f32], rows: usize, inter: usize) -> Result<()> {
    const OP: &str = "swiglu_forward";
    check::len(OP, "out", out.len(), &[rows, inter])?;
    check::len(OP, "gate_up", gate_up.len(), &[rows, 2, inter])?;
    if inter == 0 {
        return Ok(());
    }
    out.par_chunks_mut(inter).zip(gate_up.par_chunks(2 * inter)).for_each(|(out, gate_up)| {
        let (gate, up) = gate_up.split_at(inter);
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = g * sigmoid(g) * u;
        }
    });
    Ok(())
}

/// dgate_up `[rows, 2 inter]` (overwrites), dout `[rows, inter]`, gate_up `[rows, 2 inter]`.
pub fn swiglu_backward(
    dgate_up: &mut [f32],
    dout: &[f32],
    gate_up: &[f32],
    rows: usize,
    inter: usize,
) -> Result<()> {
    const OP: &str = "swiglu_backward";
    check::len(OP, "dgate_up", dgate_up.len(), &[rows, 2, inter])?;
    check::len(OP, "dout", dout.len(), &[rows, inter])?;
    check::len(OP, "gate_up", gate_up.len(), &[rows, 2, inter])?;
    if inter == 0 {
        return Ok(());
    }
    dgate_up
        .par_chunks_mut(2 * inter)
        .zip(dout.par_chunks(inter))
        .zip(gate_up.par_chunks(2 * inter))
        .for_each(|((dgate_up, dout), gate_up)| {
            let (dgate, dup) = dgate_up.split_at_mut(inter);
            let (gate, up) = gate_up.split_at(inter);
            for i in 0..inter {
                let (g, u, d) = (gate[i], up[i], dout[i]);
                let s = sigmoid(g);
                dgate[i] = d * u * s * (1.0 + g * (1.0 - s));
                dup[i] = d * g * s;
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::{
        TOL, assert_close, dot, numeric_grad, rng, to_f64, uniform,
    };
    use crate::error::Result;

    const ROWS: usize = 7;
    const INTER: usize = 10;

    /// Double-precision twin of `swiglu_forward`.
    fn swiglu64(gate_up: &[f64]) -> Vec<f64> {
        gate_up
            .chunks(2 * INTER)
            .flat_map(|row| {
                let (gate, up) = row.split_at(INTER);
                gate.iter().zip(up).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u).collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn forward_and_backward_match_twin() -> Result<()> {
        let mut rng = rng(20);
        // Gates over [-4, 4) reach both tails of the sigmoid.
        let gate_up: Vec<f32> =
            uniform(&mut rng, ROWS * 2 * INTER).iter().map(|v| 4.0 * v).collect();
        let r = uniform(&mut rng, ROWS * INTER);
        let (gu64, r64) = (to_f64(&gate_up), to_f64(&r));
        let mut out = vec![f32::NAN; ROWS * INTER];
        swiglu_forward(&mut out, &gate_up, ROWS, INTER)?;
        assert_close("swiglu forward", &out, &swiglu64(&gu64), TOL);

        let mut d = vec![f32::NAN; ROWS * 2 * INTER];
        swiglu_backward(&mut d, &r, &gate_up, ROWS, INTER)?;
        assert_close("swiglu dgate_up", &d, &numeric_grad(&gu64, |x| dot(&swiglu64(x), &r64)), TOL);
        Ok(())
    }

    #[test]
    fn extreme_gates_stay_finite() -> Result<()> {
        let gate_up = [-200.0, 200.0, 1.0, 1.0];
        let mut out = [0.0; 2];
        swiglu_forward(&mut out, &gate_up, 1, 2)?;
        assert_eq!(out, [0.0, 200.0]);
        let mut d = [f32::NAN; 4];
        swiglu_backward(&mut d, &[1.0, 1.0], &gate_up, 1, 2)?;
        assert!(d.iter().all(|v| v.is_finite()), "{d:?}");
        Ok(())
    }

    #[test]
    fn wrong_length_is_rejected() -> Result<()> {
        let e = swiglu_backward(&mut [0.0; 20], &[0.0; 10], &[0.0; 19], 1, 10)
            .expect_err("must be rejected");
        assert!(
            e.to_string().contains("swiglu_backward") && e.to_string().contains("`gate_up`"),
            "{e}"
        );
        Ok(())
    }
}
