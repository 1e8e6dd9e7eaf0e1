//! The gated MLP's activation: `act(gate) * up`, with SiLU (SwiGLU; `LlamaMLP.forward` in
//! transformers' modeling_llama.py, `down_proj(act_fn(gate_proj(x)) * up_proj(x))`) or GELU
//! with the tanh approximation (GeGLU; `Gemma3MLP`, `gelu_pytorch_tanh`); here `gate_proj` and
//! `up_proj` are one fused projection whose rows are `[gate (I) | up (I)]`.
//!
//! Backward: `dgate = dout · up · act'(g)` and `dup = dout · act(g)`, with
//! - SiLU, `σ = sigmoid(g)`, `silu(g) = g σ`: `silu'(g) = σ + g σ (1 − σ) = σ (1 + g (1 − σ))`;
//! - GELU (tanh), `u = β (g + κ g³)`, `t = tanh(u)`, `gelu(g) = ½ g (1 + t)`:
//!   `gelu'(g) = ½ (1 + t) + ½ g (1 − t²) β (1 + 3 κ g²)`, with `β = sqrt(2/π)`, `κ = 0.044715`
//!   (PyTorch's `GeluType::Tanh` in f32).

use rayon::prelude::*;

use super::check;
use crate::backend::{CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT, GluAct};
use crate::error::Result;

fn sigmoid(x: f32) -> f32 {
    // For very negative x, exp(-x) overflows to inf and the result is the correct limit 0.
    1.0 / (1.0 + (-x).exp())
}

const GELU_BETA: f32 = 0.797_884_6; // sqrt(2 / pi)
const GELU_KAPPA: f32 = 0.044715;

/// Where a row's `i`-th gate and up values sit: `[gate (I) | up (I)]`, or interleaved
/// `[g0, u0, g1, u1, ...]` for GPT-OSS's experts.
fn columns(i: usize, inter: usize, act: GluAct) -> (usize, usize) {
    match act {
        GluAct::ClampedSwiglu => (2 * i, 2 * i + 1),
        GluAct::Silu | GluAct::GeluTanh => (i, inter + i),
    }
}

/// `out = f(g, u)` and its partial derivatives `(∂/∂g, ∂/∂u)`: `act(g) · u` for the plain
/// activations; GPT-OSS's `(clamp(u, −7, 7) + 1) · g' σ(1.702 g')` with `g' = min(g, 7)`,
/// whose clamps pass the gradient only inside their bounds, bounds included (torch's `clamp`).
fn gated(g: f32, u: f32, act: GluAct) -> (f32, f32, f32) {
    if act == GluAct::ClampedSwiglu {
        let (alpha, limit) = (CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT);
        let gc = g.min(limit);
        let uc = u.clamp(-limit, limit);
        let s = sigmoid(gc * alpha);
        let glu = gc * s;
        let dglu = s + gc * alpha * s * (1.0 - s);
        let dg = if g <= limit { (uc + 1.0) * dglu } else { 0.0 };
        let du = if (-limit..=limit).contains(&u) { glu } else { 0.0 };
        return ((uc + 1.0) * glu, dg, du);
    }
    let (a, da) = activation(g, act);
    (a * u, da * u, a)
}

/// `act(g)` and `act'(g)`.
fn activation(g: f32, act: GluAct) -> (f32, f32) {
    match act {
        GluAct::ClampedSwiglu => {
            let s = sigmoid(g * CLAMPED_SWIGLU_ALPHA);
            (g * s, s + g * CLAMPED_SWIGLU_ALPHA * s * (1.0 - s))
        }
        GluAct::Silu => {
            let s = sigmoid(g);
            (g * s, s * (1.0 + g * (1.0 - s)))
        }
        GluAct::GeluTanh => {
            let t = (GELU_BETA * (g + GELU_KAPPA * g * g * g)).tanh();
            let d = 0.5 * (1.0 + t)
                + 0.5 * g * (1.0 - t * t) * GELU_BETA * (1.0 + 3.0 * GELU_KAPPA * g * g);
            (0.5 * g * (1.0 + t), d)
        }
    }
}

/// `out = act(gate) * up`.
/// out `[rows, inter]`, gate_up `[rows, 2 inter]`.
pub fn glu_forward(
    out: &mut [f32],
    gate_up: &[f32],
    rows: usize,
    inter: usize,
    act: GluAct,
) -> Result<()> {
    const OP: &str = "glu_forward";
    check::len(OP, "out", out.len(), &[rows, inter])?;
    check::len(OP, "gate_up", gate_up.len(), &[rows, 2, inter])?;
    if inter == 0 {
        return Ok(());
    }
    out.par_chunks_mut(inter).zip(gate_up.par_chunks(2 * inter)).for_each(|(out, gate_up)| {
        for (i, o) in out.iter_mut().enumerate() {
            let (gi, ui) = columns(i, inter, act);
            *o = gated(gate_up[gi], gate_up[ui], act).0;
        }
    });
    Ok(())
}

/// dgate_up `[rows, 2 inter]` (overwrites), dout `[rows, inter]`, gate_up `[rows, 2 inter]`.
pub fn glu_backward(
    dgate_up: &mut [f32],
    dout: &[f32],
    gate_up: &[f32],
    rows: usize,
    inter: usize,
    act: GluAct,
) -> Result<()> {
    const OP: &str = "glu_backward";
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
            for (i, &d) in dout.iter().enumerate() {
                let (gi, ui) = columns(i, inter, act);
                let (_, dg, du) = gated(gate_up[gi], gate_up[ui], act);
                dgate_up[gi] = d * dg;
                dgate_up[ui] = d * du;
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

    /// Double-precision twin of `glu_forward`: SiLU, GELU as its tanh formula, and GPT-OSS's
    /// clamped SwiGLU on interleaved columns as `GptOssExperts._apply_gate` writes it.
    fn glu64(gate_up: &[f64], act: GluAct) -> Vec<f64> {
        let f = |g: f64, u: f64| match act {
            GluAct::Silu => g / (1.0 + (-g).exp()) * u,
            GluAct::GeluTanh => {
                let beta = (2.0 / std::f64::consts::PI).sqrt();
                0.5 * g * (1.0 + (beta * (g + 0.044715 * g * g * g)).tanh()) * u
            }
            GluAct::ClampedSwiglu => {
                let g = g.min(7.0);
                let u = u.clamp(-7.0, 7.0);
                (u + 1.0) * g / (1.0 + (-1.702 * g).exp())
            }
        };
        gate_up
            .chunks(2 * INTER)
            .flat_map(|row| {
                (0..INTER).map(|i| match act {
                    GluAct::ClampedSwiglu => f(row[2 * i], row[2 * i + 1]),
                    _ => f(row[i], row[INTER + i]),
                })
            })
            .collect()
    }

    #[test]
    fn forward_and_backward_match_twin() -> Result<()> {
        for act in [GluAct::Silu, GluAct::GeluTanh, GluAct::ClampedSwiglu] {
            let mut rng = rng(20);
            // Gates over [-4, 4) reach both tails of the sigmoid and of tanh; the clamped
            // variant's values reach past its limits of ±7.
            let spread = if act == GluAct::ClampedSwiglu { 10.0 } else { 4.0 };
            let gate_up: Vec<f32> =
                uniform(&mut rng, ROWS * 2 * INTER).iter().map(|v| spread * v).collect();
            if act == GluAct::ClampedSwiglu {
                assert!(gate_up.iter().any(|v| *v > 7.0) && gate_up.iter().any(|v| *v < -7.0));
            }
            let r = uniform(&mut rng, ROWS * INTER);
            let (gu64, r64) = (to_f64(&gate_up), to_f64(&r));
            let mut out = vec![f32::NAN; ROWS * INTER];
            glu_forward(&mut out, &gate_up, ROWS, INTER, act)?;
            assert_close(&format!("{act:?} forward"), &out, &glu64(&gu64, act), TOL);

            let mut d = vec![f32::NAN; ROWS * 2 * INTER];
            glu_backward(&mut d, &r, &gate_up, ROWS, INTER, act)?;
            let want = numeric_grad(&gu64, |x| dot(&glu64(x, act), &r64));
            assert_close(&format!("{act:?} dgate_up"), &d, &want, TOL);
        }
        Ok(())
    }

    #[test]
    fn extreme_gates_stay_finite() -> Result<()> {
        let gate_up = [-200.0, 200.0, 1.0, 1.0];
        for act in [GluAct::Silu, GluAct::GeluTanh] {
            let mut out = [0.0; 2];
            glu_forward(&mut out, &gate_up, 1, 2, act)?;
            assert_eq!(out, [0.0, 200.0], "{act:?}");
            let mut d = [f32::NAN; 4];
            glu_backward(&mut d, &[1.0, 1.0], &gate_up, 1, 2, act)?;
            assert!(d.iter().all(|v| v.is_finite()), "{act:?}: {d:?}");
        }
        Ok(())
    }

    #[test]
    fn wrong_length_is_rejected() -> Result<()> {
        let e = glu_backward(&mut [0.0; 20], &[0.0; 10], &[0.0; 19], 1, 10, GluAct::Silu)
            .expect_err("must be rejected");
        assert!(
            e.to_string().contains("glu_backward") && e.to_string().contains("`gate_up`"),
            "{e}"
        );
        Ok(())
    }
}
