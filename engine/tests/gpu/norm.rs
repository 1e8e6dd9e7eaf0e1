//! RMSNorm (plain, per head, with the residual's gradient), RoPE and the gated activations.

use crate::common::*;

#[test]
pub(crate) fn rmsnorm() {
    let (g, c) = (gpu(), Cpu::new());
    let mut r = rng(4);
    let eps = 1e-6;
    let x = round_bf16(&uniform(&mut r, T * H, 2.0));
    let w = round_bf16(&uniform(&mut r, H, 1.0).iter().map(|v| 1.0 + v).collect::<Vec<_>>());
    let shape = NormShape { rows: T, dim: H, eps };
    let (mut want, mut want_r) = (vec![0.0; T * H], vec![0.0; T]);
    c.rmsnorm_forward(&mut want, &mut want_r, Operands { inp: &x, w: &w }, &shape).expect("cpu");
    let (dx, dw) = (put(g, &x, Activation), put(g, &w, Activation));
    let (mut out, mut rstd) = (nan(g, T * H, Activation), nan(g, T, Accum));
    g.rmsnorm_forward(
        all_mut(g, &mut out),
        all_mut(g, &mut rstd),
        Operands { inp: all(g, &dx), w: all(g, &dw) },
        &shape,
    )
    .expect("gpu");
    check("rmsnorm_forward out (bf16)", &get(g, &out), &want, 4e-3);
    check("rmsnorm_forward rstd (f32)", &get(g, &rstd), &want_r, 1e-5);

    let dout = round_bf16(&uniform(&mut r, T * H, 1.0));
    let dw0 = uniform(&mut r, H, 1.0);
    let (mut want_dx, mut want_dw) = (vec![0.0; T * H], dw0.clone());
    c.rmsnorm_backward(
        Grads { dinp: &mut want_dx, dw: &mut want_dw },
        &dout,
        Operands { inp: &x, w: &w },
        &want_r,
        &shape,
    )
    .expect("cpu");
    let (mut ddx, mut ddw) = (nan(g, T * H, Activation), put(g, &dw0, Accum));
    g.rmsnorm_backward(
        Grads { dinp: all_mut(g, &mut ddx), dw: all_mut(g, &mut ddw) },
        all(g, &put(g, &dout, Activation)),
        Operands { inp: all(g, &dx), w: all(g, &dw) },
        all(g, &rstd),
        &shape,
    )
    .expect("gpu");
    // dx is a difference of two terms of similar size: 2 bf16 ulps of the scale.
    check("rmsnorm_backward dinp (bf16)", &get(g, &ddx), &want_dx, 8e-3);
    check("rmsnorm_backward dw (f32, accumulates)", &get(g, &ddw), &want_dw, 1e-5);

    // With the residual stream's gradient added: the vector kernel adds it (H = 96), the other
    // kernel leaves it to an add (rows of 100 are not whole 16-byte vectors).
    for dim in [H, 100] {
        let shape = NormShape { rows: T, dim, eps };
        let x = round_bf16(&uniform(&mut r, T * dim, 2.0));
        let w = round_bf16(&uniform(&mut r, dim, 1.0).iter().map(|v| 1.0 + v).collect::<Vec<_>>());
        let dout = round_bf16(&uniform(&mut r, T * dim, 1.0));
        let residual = round_bf16(&uniform(&mut r, T * dim, 1.0));
        let (mut rs, mut scratch) = (vec![0.0; T], vec![0.0; T * dim]);
        c.rmsnorm_forward(&mut scratch, &mut rs, Operands { inp: &x, w: &w }, &shape).expect("cpu");
        let dw0 = uniform(&mut r, dim, 1.0);
        let (mut want_dx, mut want_dw) = (vec![0.0; T * dim], dw0.clone());
        c.rmsnorm_backward_add(
            Grads { dinp: &mut want_dx, dw: &mut want_dw },
            &dout,
            Operands { inp: &x, w: &w },
            &rs,
            &residual,
            &shape,
        )
        .expect("cpu");
        let (mut ddx, mut ddw) = (nan(g, T * dim, Activation), put(g, &dw0, Accum));
        g.rmsnorm_backward_add(
            Grads { dinp: all_mut(g, &mut ddx), dw: all_mut(g, &mut ddw) },
            all(g, &put(g, &dout, Activation)),
            Operands { inp: all(g, &put(g, &x, Activation)), w: all(g, &put(g, &w, Activation)) },
            all(g, &put(g, &rs, Accum)),
            all(g, &put(g, &residual, Activation)),
            &shape,
        )
        .expect("gpu");
        check(&format!("rmsnorm_backward_add dinp dim={dim}"), &get(g, &ddx), &want_dx, 8e-3);
        check(&format!("rmsnorm_backward_add dw dim={dim}"), &get(g, &ddw), &want_dw, 1e-5);
    }

    // Qwen3's per-head norm, value heads passing through.
    for hd in [64, 128] {
        let shape = AttentionShape {
            tokens: T,
            q_heads: 6,
            kv_heads: 2,
            head_dim: hd,
            docs: 4,
            window: None,
            scale_dim: None,
            softcap: None,
        };
        let width = shape.qkv_width();
        let x = round_bf16(&uniform(&mut r, T * width, 2.0));
        let w = round_bf16(&uniform(&mut r, 2 * hd, 1.0));
        let (mut want, mut want_r) = (vec![0.0; T * width], vec![0.0; T * 8]);
        c.head_rmsnorm_forward(&mut want, &mut want_r, Operands { inp: &x, w: &w }, &shape, eps)
            .expect("cpu");
        let (dx, dw) = (put(g, &x, Activation), put(g, &w, Activation));
        let (mut out, mut rstd) = (nan(g, T * width, Activation), nan(g, T * 8, Accum));
        g.head_rmsnorm_forward(
            all_mut(g, &mut out),
            all_mut(g, &mut rstd),
            Operands { inp: all(g, &dx), w: all(g, &dw) },
            &shape,
            eps,
        )
        .expect("gpu");
        check(&format!("head_rmsnorm_forward out hd={hd}"), &get(g, &out), &want, 4e-3);
        check(&format!("head_rmsnorm_forward rstd hd={hd}"), &get(g, &rstd), &want_r, 1e-5);
        let dout = round_bf16(&uniform(&mut r, T * width, 1.0));
        let dw0 = uniform(&mut r, 2 * hd, 1.0);
        let (mut want_dx, mut want_dw) = (vec![0.0; T * width], dw0.clone());
        c.head_rmsnorm_backward(
            Grads { dinp: &mut want_dx, dw: &mut want_dw },
            &dout,
            Operands { inp: &x, w: &w },
            &want_r,
            &shape,
        )
        .expect("cpu");
        let (mut ddx, mut ddw) = (nan(g, T * width, Activation), put(g, &dw0, Accum));
        g.head_rmsnorm_backward(
            Grads { dinp: all_mut(g, &mut ddx), dw: all_mut(g, &mut ddw) },
            all(g, &put(g, &dout, Activation)),
            Operands { inp: all(g, &dx), w: all(g, &dw) },
            all(g, &rstd),
            &shape,
        )
        .expect("gpu");
        check(&format!("head_rmsnorm_backward dinp hd={hd}"), &get(g, &ddx), &want_dx, 8e-3);
        check(&format!("head_rmsnorm_backward dw hd={hd}"), &get(g, &ddw), &want_dw, 1e-5);
    }
}

#[test]
pub(crate) fn rope_and_glu() {
    let (g, c) = (gpu(), Cpu::new());
    let mut r = rng(5);
    // Full rotary, then Phi-3's partial rotary (3/4 of the head) with longrope's cos/sin scale.
    for (hd, rotary, scale) in [(64, 64, 1.0), (128, 128, 1.0), (128, 96, 1.19)] {
        let shape = AttentionShape {
            tokens: T,
            q_heads: 6,
            kv_heads: 2,
            head_dim: hd,
            docs: 4,
            window: None,
            scale_dim: None,
            softcap: None,
        };
        let width = shape.qkv_width();
        let inv: Vec<f32> =
            (0..rotary / 2).map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / rotary as f32)).collect();
        // Positions up to a few thousand, as in long documents: the angle is formed in f32.
        let pos: Vec<i32> = positions().iter().map(|p| p * 97).collect();
        let x = round_bf16(&uniform(&mut r, T * width, 1.0));
        let what = format!("hd={hd} rotary={rotary} scale={scale}");
        let mut want = x.clone();
        c.rope_forward(&mut want, &pos, &inv, scale, &shape).expect("cpu");
        let (dinv, dpos) = (put(g, &inv, Accum), ints(g, &pos));
        let mut q = put(g, &x, Activation);
        g.rope_forward(all_mut(g, &mut q), &dpos, all(g, &dinv), scale, &shape).expect("gpu");
        check(&format!("rope_forward {what}"), &get(g, &q), &want, 5e-3);
        let mut want_b = x.clone();
        c.rope_backward(&mut want_b, &pos, &inv, scale, &shape).expect("cpu");
        let mut dq = put(g, &x, Activation);
        g.rope_backward(all_mut(g, &mut dq), &dpos, all(g, &dinv), scale, &shape).expect("gpu");
        check(&format!("rope_backward {what}"), &get(g, &dq), &want_b, 5e-3);
    }
    for act in [GluAct::Silu, GluAct::GeluTanh] {
        let gu = round_bf16(&uniform(&mut r, T * 2 * I, 4.0));
        let mut want = vec![0.0; T * I];
        c.glu_forward(&mut want, &gu, T, I, act).expect("cpu");
        let dgu_in = put(g, &gu, Activation);
        let mut out = nan(g, T * I, Activation);
        g.glu_forward(all_mut(g, &mut out), all(g, &dgu_in), T, I, act).expect("gpu");
        check(&format!("glu_forward {act:?}"), &get(g, &out), &want, 5e-3);
        let dout = round_bf16(&uniform(&mut r, T * I, 1.0));
        let mut want = vec![0.0; T * 2 * I];
        c.glu_backward(&mut want, &dout, &gu, T, I, act).expect("cpu");
        let mut d = nan(g, T * 2 * I, Activation);
        g.glu_backward(
            all_mut(g, &mut d),
            all(g, &put(g, &dout, Activation)),
            all(g, &dgu_in),
            T,
            I,
            act,
        )
        .expect("gpu");
        check(&format!("glu_backward {act:?}"), &get(g, &d), &want, 5e-3);
    }
}

/// GPT-OSS's clamped SwiGLU on interleaved gate/up columns, with values past the clamps at ±7
/// and some exactly on them (bf16 holds 7 exactly), where torch's clamp still passes the
/// gradient.
#[test]
pub(crate) fn clamped_swiglu() {
    let (g, c) = (gpu(), Cpu::new());
    let mut r = rng(7);
    let act = GluAct::ClampedSwiglu;
    let mut gu = round_bf16(&uniform(&mut r, T * 2 * I, 10.0));
    // Every 13th value onto a bound: 13 ≡ 1 (mod 4), so gates (even) and ups (odd) each get both.
    for (i, v) in gu.iter_mut().enumerate().step_by(13) {
        *v = if i % 4 < 2 { 7.0 } else { -7.0 };
    }
    assert!(gu.iter().any(|&v| v > 7.0) && gu.iter().any(|&v| v < -7.0));
    let mut want = vec![0.0; T * I];
    c.glu_forward(&mut want, &gu, T, I, act).expect("cpu");
    let dgu_in = put(g, &gu, Activation);
    let mut out = nan(g, T * I, Activation);
    g.glu_forward(all_mut(g, &mut out), all(g, &dgu_in), T, I, act).expect("gpu");
    // f32 math with exp an f32 ulp apart between the GPU and the host, one bf16 rounding.
    check("glu_forward ClampedSwiglu", &get(g, &out), &want, 5e-3);
    let dout = round_bf16(&uniform(&mut r, T * I, 1.0));
    let mut want = vec![0.0; T * 2 * I];
    c.glu_backward(&mut want, &dout, &gu, T, I, act).expect("cpu");
    let mut d = nan(g, T * 2 * I, Activation);
    g.glu_backward(
        all_mut(g, &mut d),
        all(g, &put(g, &dout, Activation)),
        all(g, &dgu_in),
        T,
        I,
        act,
    )
    .expect("gpu");
    let got = get(g, &d);
    check("glu_backward ClampedSwiglu", &got, &want, 5e-3);
    // Where a clamp stops the gradient, both sides write an exact zero.
    let stopped = want.iter().filter(|&&w| w == 0.0).count();
    assert!(stopped > T, "the inputs should reach past the clamps ({stopped} zero gradients)");
    for (i, (&a, &b)) in got.iter().zip(&want).enumerate() {
        assert!(b != 0.0 || a == 0.0, "glu_backward ClampedSwiglu element {i}: gpu {a}, cpu 0");
    }
}
