//! The embedding, the GEMMs (plain and with the epilogue's addends) and the bias ops.

use crate::common::*;

#[test]
pub(crate) fn embedding() {
    let (g, c) = (gpu(), Cpu::new());
    let mut r = rng(2);
    let table = round_bf16(&uniform(&mut r, V * H, 1.0));
    // Repeated ids: their gradient rows must add up, in token order.
    let ids: Vec<i32> =
        (0..T).map(|t| if t % 5 == 0 { 7 } else { r.random_range(0..V as i32) }).collect();
    let mut want = vec![0.0; T * H];
    c.embedding_forward(&mut want, &ids, &table, T, H, 8.0).expect("cpu");
    let (dt, di) = (put(g, &table, Activation), ints(g, &ids));
    let mut out = nan(g, T * H, Activation);
    g.embedding_forward(all_mut(g, &mut out), &di, all(g, &dt), T, H, 8.0).expect("gpu");
    check("embedding_forward (a copy: exact)", &get(g, &out), &want, 0.0);

    let dout = round_bf16(&uniform(&mut r, T * H, 1.0));
    let d0 = uniform(&mut r, V * H, 0.1);
    let mut want = d0.clone();
    c.embedding_backward(&mut want, &dout, &ids, T, H, 8.0).expect("cpu");
    let mut dtab = put(g, &d0, Accum);
    g.embedding_backward(all_mut(g, &mut dtab), all(g, &put(g, &dout, Activation)), &di, T, H, 8.0)
        .expect("gpu");
    // Same f32 additions in the same order as the CPU: exact.
    check("embedding_backward (f32, accumulates)", &get(g, &dtab), &want, 0.0);
}

#[test]
pub(crate) fn matmul_and_bias() {
    let (g, c) = (gpu(), Cpu::new());
    let mut r = rng(3);
    let (k, n) = (H, 3 * 67);
    let (inp, w) =
        (round_bf16(&uniform(&mut r, T * k, 1.0)), round_bf16(&uniform(&mut r, n * k, 0.2)));
    let shape = MatmulShape { rows: T, k, n };
    let mut want = vec![0.0; T * n];
    c.matmul_forward(&mut want, Operands { inp: &inp, w: &w }, &shape).expect("cpu");
    let (di, dw) = (put(g, &inp, Activation), put(g, &w, Activation));
    for kind in [Activation, Accum] {
        let mut out = nan(g, T * n, kind);
        g.matmul_forward(
            all_mut(g, &mut out),
            Operands { inp: all(g, &di), w: all(g, &dw) },
            &shape,
        )
        .expect("gpu");
        // f32 accumulation on both sides; a bf16 output adds its rounding (2^-9 per element).
        let tol = if kind == Activation { 4e-3 } else { 1e-5 };
        check(&format!("matmul_forward -> {kind:?}"), &get(g, &out), &want, tol);
    }
    let dout = round_bf16(&uniform(&mut r, T * n, 1.0));
    let dw0 = uniform(&mut r, n * k, 1.0);
    let (mut want_dinp, mut want_dw) = (vec![0.0; T * k], dw0.clone());
    c.matmul_backward(
        Grads { dinp: &mut want_dinp, dw: &mut want_dw },
        &dout,
        Operands { inp: &inp, w: &w },
        &shape,
    )
    .expect("cpu");
    let mut ddinp = nan(g, T * k, Activation);
    let mut ddw = put(g, &dw0, Accum);
    g.matmul_backward(
        Grads { dinp: all_mut(g, &mut ddinp), dw: all_mut(g, &mut ddw) },
        all(g, &put(g, &dout, Activation)),
        Operands { inp: all(g, &di), w: all(g, &dw) },
        &shape,
    )
    .expect("gpu");
    check("matmul_backward dinp (bf16)", &get(g, &ddinp), &want_dinp, 4e-3);
    // f32 accumulator with beta = 1: summation order only.
    check("matmul_backward dw (f32, accumulates)", &get(g, &ddw), &want_dw, 1e-5);

    // A view that starts at an odd element offset (alignment 2 bytes) must work too.
    let mut big = nan(g, 1 + T * n, Activation);
    let operands = Operands { inp: all(g, &di), w: all(g, &dw) };
    g.matmul_forward(g.view_mut(&mut big, 1..1 + T * n), operands, &shape).expect("unaligned");
    check("matmul_forward (unaligned output view)", &get(g, &big)[1..], &want, 4e-3);

    let bias = round_bf16(&uniform(&mut r, n, 1.0));
    let base = round_bf16(&uniform(&mut r, T * n, 1.0));
    let mut want = base.clone();
    c.bias_forward(&mut want, &bias, T, n).expect("cpu");
    let mut out = put(g, &base, Activation);
    g.bias_forward(all_mut(g, &mut out), all(g, &put(g, &bias, Activation)), T, n).expect("gpu");
    check("bias_forward", &get(g, &out), &want, 4e-3);
    let db0 = uniform(&mut r, n, 1.0);
    let mut want = db0.clone();
    c.bias_backward(&mut want, &dout, T, n).expect("cpu");
    let mut db = put(g, &db0, Accum);
    g.bias_backward(all_mut(g, &mut db), all(g, &put(g, &dout, Activation)), T, n).expect("gpu");
    check("bias_backward (f32, accumulates)", &get(g, &db), &want, 1e-6);
}

/// The projection with its bias and residual added in the GEMM's epilogue, against the CPU
/// twin (product, bias, residual added in turn): every combination, a bias the epilogue cannot
/// take (2-byte aligned), and f32 outputs, which take the separate kernels.
#[test]
pub(crate) fn matmul_forward_add_matches_the_separate_ops() {
    let (g, c) = (gpu(), Cpu::new());
    let mut r = rng(31);
    for n in [3 * 67, 136] {
        let k = H;
        let shape = MatmulShape { rows: T, k, n };
        let (inp, w) =
            (round_bf16(&uniform(&mut r, T * k, 1.0)), round_bf16(&uniform(&mut r, n * k, 0.2)));
        let bias = round_bf16(&uniform(&mut r, n, 1.0));
        let residual = round_bf16(&uniform(&mut r, T * n, 4.0));
        let (di, dw) = (put(g, &inp, Activation), put(g, &w, Activation));
        let dres = put(g, &residual, Activation);
        for bias_at in [0, 1] {
            let dbias = put_at(g, &bias, bias_at, Activation);
            for (with_bias, with_res) in [(true, false), (false, true), (true, true)] {
                let addends = Addends {
                    bias: with_bias.then_some(bias.as_slice()),
                    residual: with_res.then_some(residual.as_slice()),
                };
                let mut want = vec![0.0; T * n];
                c.matmul_forward_add(&mut want, Operands { inp: &inp, w: &w }, addends, &shape)
                    .expect("cpu");
                for kind in [Activation, Accum] {
                    let mut out = nan(g, T * n, kind);
                    g.matmul_forward_add(
                        all_mut(g, &mut out),
                        Operands { inp: all(g, &di), w: all(g, &dw) },
                        Addends {
                            bias: with_bias.then(|| from(g, &dbias, bias_at)),
                            residual: with_res.then(|| all(g, &dres)),
                        },
                        &shape,
                    )
                    .expect("gpu");
                    // A bf16 output: the residual's sum is rounded once (2^-8 of its size at
                    // most); a bias may add a second rounding (the separate bias kernel after
                    // the GEMM's output, and cuBLASLt's bias epilogue at n = 201 both measured
                    // 3.5e-3 to 4.7e-3, one bf16 ulp). An f32 output: summation order only.
                    let tol = match kind {
                        Activation if with_bias => 8e-3,
                        Activation => 4e-3,
                        _ => 1e-5,
                    };
                    let what = format!(
                        "matmul_forward_add n={n} bias={with_bias} (at {bias_at}) \
                         residual={with_res} -> {kind:?}"
                    );
                    check(&what, &get(g, &out), &want, tol);
                }
            }
        }
    }
    // Bad lengths are errors that write nothing.
    let shape = MatmulShape { rows: T, k: H, n: 8 };
    let (di, dw) = (put(g, &vec![0.5; T * H], Activation), put(g, &vec![0.5; 8 * H], Activation));
    let short = put(g, &[1.0; 7], Activation);
    let mut out = put(g, &vec![3.0; T * 8], Activation);
    let err = g
        .matmul_forward_add(
            all_mut(g, &mut out),
            Operands { inp: all(g, &di), w: all(g, &dw) },
            Addends { bias: Some(all(g, &short)), residual: None },
            &shape,
        )
        .expect_err("a bias of 7 for 8 columns");
    assert!(err.to_string().contains("bias"), "{err}");
    assert!(get(g, &out).iter().all(|&v| v == 3.0), "the output was written");
}
