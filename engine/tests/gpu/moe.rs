//! Mixture of experts: routing, sorting, gathers and combines, the shared expert's gate and the
//! grouped GEMMs.

use crate::common::*;

pub(crate) const ROUTERS: [RouterKind; 3] = [
    RouterKind::SoftmaxTopK { renormalize: false },
    RouterKind::SoftmaxTopK { renormalize: true },
    RouterKind::TopKSoftmax,
];

/// Router logits `[t, e]` (e ≥ 4) in bf16, as a GEMM leaves them, so ties occur among many
/// experts; row 0 is all ties and row 1 ties its two largest, where the lower index goes first.
pub(crate) fn router_logits(r: &mut ChaCha8Rng, t: usize, e: usize) -> Vec<f32> {
    let mut z = round_bf16(&uniform(r, t * e, 3.0));
    z[..e].fill(0.5);
    z[e + 3] = 4.0;
    z[e + 1] = 4.0;
    z
}

/// The CPU's routing: (weights, probs, experts).
pub(crate) fn cpu_route(z: &[f32], shape: &MoeShape) -> (Vec<f32>, Vec<f32>, Vec<i32>) {
    let (t, e, k) = (shape.tokens, shape.experts, shape.top_k);
    let (mut w, mut p, mut ids) = (vec![0.0; t * k], vec![0.0; t * e], vec![0; t * k]);
    Cpu::new().moe_route(&mut w, &mut p, &mut ids, z, shape).expect("cpu moe_route");
    (w, p, ids)
}

#[test]
pub(crate) fn moe_routing_and_its_backward() {
    let g = gpu();
    let c = Cpu::new();
    let mut r = rng(80);
    // A warp's lanes hold 1, 2 and 4 experts each.
    for (e, k) in [(8, 2), (64, 4), (128, 8)] {
        for router in ROUTERS {
            let shape = MoeShape { tokens: T, hidden: H, experts: e, top_k: k, router };
            let name = format!("E={e} k={k} {router:?}");
            let z = router_logits(&mut r, T, e);
            let (w, p, ids) = cpu_route(&z, &shape);
            assert_eq!(
                &ids[..k],
                &(0..k as i32).collect::<Vec<_>>()[..],
                "ties to the lower index"
            );
            assert_eq!(&ids[k..k + 2], &[1, 3], "ties to the lower index");
            let (mut wd, mut pd) = (nan(g, T * k, Accum), nan(g, T * e, Accum));
            let mut ids_d = ints(g, &vec![-1; T * k]);
            g.moe_route(
                all_mut(g, &mut wd),
                all_mut(g, &mut pd),
                &mut ids_d,
                all(g, &put(g, &z, Activation)),
                &shape,
            )
            .expect("gpu");
            // The same logits and the same order (Rust's total_cmp): the same experts exactly.
            assert_eq!(
                g.download_ints(&ids_d).expect("download_ints"),
                ids,
                "moe_route experts {name}"
            );
            // f32 softmaxes, sums in another order, exp an f32 ulp apart: f32 rounding.
            check(&format!("moe_route probs {name}"), &get(g, &pd), &p, 1e-5);
            check(&format!("moe_route weights {name}"), &get(g, &wd), &w, 1e-5);

            // The backward from identical inputs: the CPU's routing, uploaded.
            let dw = uniform(&mut r, T * k, 1.0);
            let counts: Vec<f32> = (0..e).map(|_| r.random_range(0..40) as f32).collect();
            let (wd, pd, ids_d) = (put(g, &w, Accum), put(g, &p, Accum), ints(g, &ids));
            let (dw_d, counts_d) = (put(g, &dw, Accum), put(g, &counts, Accum));
            for (aux, kind) in [(None, Accum), (Some(0.01f32), Accum), (Some(0.01), Activation)] {
                let mut want = vec![0.0; T * e];
                c.moe_route_backward(
                    &mut want,
                    &dw,
                    Routing { weights: &w, probs: &p, experts: &ids },
                    aux.map(|s| (&counts[..], s)),
                    &shape,
                )
                .expect("cpu");
                let mut dz = nan(g, T * e, kind);
                g.moe_route_backward(
                    all_mut(g, &mut dz),
                    all(g, &dw_d),
                    Routing { weights: all(g, &wd), probs: all(g, &pd), experts: &ids_d },
                    aux.map(|s| (all(g, &counts_d), s)),
                    &shape,
                )
                .expect("gpu");
                // f32 sums in another order; into bf16 (the router GEMM's operand), one rounding.
                let tol = if kind == Activation { 4e-3 } else { 1e-5 };
                let what = format!("moe_route_backward {name} aux={aux:?} -> {kind:?}");
                check(&what, &get(g, &dz), &want, tol);
            }

            let stats0: Vec<f32> = uniform(&mut r, 2 * e, 1.0);
            let mut want = stats0.clone();
            c.moe_router_stats(&mut want, &p, &ids, &shape).expect("cpu");
            let mut stats = put(g, &stats0, Accum);
            g.moe_router_stats(all_mut(g, &mut stats), all(g, &pd), &ids_d, &shape).expect("gpu");
            // Counts added at once rather than one by one, sums in another order: f32 rounding.
            check(&format!("moe_router_stats (accumulates) {name}"), &get(g, &stats), &want, 1e-6);
        }
    }
    // Bad shapes are errors, not panics.
    let bad = MoeShape { tokens: T, hidden: H, experts: 4, top_k: 5, router: ROUTERS[0] };
    let (mut wd, mut pd) = (nan(g, T * 5, Accum), nan(g, T * 4, Accum));
    let mut ids_d = ints(g, &vec![0; T * 5]);
    let z = put(g, &vec![0.0; T * 4], Activation);
    let e = g
        .moe_route(all_mut(g, &mut wd), all_mut(g, &mut pd), &mut ids_d, all(g, &z), &bad)
        .expect_err("top_k above the experts");
    assert!(e.to_string().contains("top_k"), "{e}");
}

/// `t` tokens' distinct experts, drawn from the first `used` of `e` so the others get no pairs.
pub(crate) fn random_experts(r: &mut ChaCha8Rng, t: usize, used: usize, k: usize) -> Vec<i32> {
    let mut ids = Vec::with_capacity(t * k);
    for _ in 0..t {
        let start = ids.len();
        while ids.len() < start + k {
            let x = r.random_range(0..used as i32);
            if !ids[start..].contains(&x) {
                ids.push(x);
            }
        }
    }
    ids
}

#[test]
pub(crate) fn moe_sort_matches_the_cpu_exactly() {
    let (g, c) = (gpu(), Cpu::new());
    let mut r = rng(81);
    // (tokens, experts, experts used, k): one chunk of the sort; many chunks with a quarter of
    // the experts empty; a large micro-batch's 64K pairs over 128 experts.
    for (t, e, used, k) in [(37, 8, 8, 2), (1500, 64, 48, 4), (8192, 128, 128, 8)] {
        let shape = MoeShape { tokens: t, hidden: H, experts: e, top_k: k, router: ROUTERS[2] };
        let pairs = t * k;
        let ids = random_experts(&mut r, t, used, k);
        let (mut order, mut rows) = (vec![-1; pairs], vec![-1; pairs]);
        let offsets = c.moe_sort(&mut order, &mut rows, &ids, &shape).expect("cpu");
        let ids_d = ints(g, &ids);
        let (mut order_d, mut rows_d) = (ints(g, &vec![-1; pairs]), ints(g, &vec![-1; pairs]));
        let got = g.moe_sort(&mut order_d, &mut rows_d, &ids_d, &shape).expect("gpu");
        let name = format!("moe_sort T={t} E={e} k={k}");
        assert_eq!(got, offsets, "{name}: offsets");
        assert_eq!(g.download_ints(&order_d).expect("download"), order, "{name}: order");
        assert_eq!(g.download_ints(&rows_d).expect("download"), rows, "{name}: rows");
        let secs = median_seconds(5, &mut || {
            g.moe_sort(&mut order_d, &mut rows_d, &ids_d, &shape).expect("gpu");
        });
        println!("{name}: {:.1} us per call, offsets read back included", secs * 1e6);
    }
    // An id outside 0..E is refused once the counts come back.
    let shape = MoeShape { tokens: 3, hidden: H, experts: 4, top_k: 2, router: ROUTERS[2] };
    let ids_d = ints(g, &[0, 1, 2, 4, 3, 0]);
    let (mut order_d, mut rows_d) = (ints(g, &[0; 6]), ints(g, &[0; 6]));
    let e = g.moe_sort(&mut order_d, &mut rows_d, &ids_d, &shape).expect_err("id 4 of 4 experts");
    assert!(e.to_string().contains("outside 0..4"), "{e}");
}

#[test]
pub(crate) fn moe_gather_and_combine() {
    let (g, c) = (gpu(), Cpu::new());
    let mut r = rng(82);
    let (e, k) = (8, 2);
    let router = RouterKind::SoftmaxTopK { renormalize: true };
    let shape = MoeShape { tokens: T, hidden: H, experts: e, top_k: k, router };
    let pairs = T * k;
    let z = router_logits(&mut r, T, e);
    let (w, _, ids) = cpu_route(&z, &shape);
    let (mut order, mut rows) = (vec![0; pairs], vec![0; pairs]);
    c.moe_sort(&mut order, &mut rows, &ids, &shape).expect("cpu");
    let (order_d, rows_d, w_d) = (ints(g, &order), ints(g, &rows), put(g, &w, Accum));

    let x = round_bf16(&uniform(&mut r, T * H, 1.0));
    let x_d = put(g, &x, Activation);
    let mut want = vec![0.0; pairs * H];
    c.moe_gather(&mut want, &x, &order, &shape).expect("cpu");
    let mut xs = nan(g, pairs * H, Activation);
    g.moe_gather(all_mut(g, &mut xs), all(g, &x_d), &order_d, &shape).expect("gpu");
    // Row copies in the same precision: exact.
    let gathered = get(g, &xs);
    check("moe_gather", &gathered, &want, 0.0);

    // The chain on the device alone: its own routing and sort (int buffers the host never
    // saw) gather the same rows.
    let mut ids_d = ints(g, &vec![-1; pairs]);
    let (mut wd2, mut pd2) = (nan(g, pairs, Accum), nan(g, T * e, Accum));
    g.moe_route(
        all_mut(g, &mut wd2),
        all_mut(g, &mut pd2),
        &mut ids_d,
        all(g, &put(g, &z, Activation)),
        &shape,
    )
    .expect("gpu");
    let (mut order2, mut rows2) = (ints(g, &vec![-1; pairs]), ints(g, &vec![-1; pairs]));
    g.moe_sort(&mut order2, &mut rows2, &ids_d, &shape).expect("gpu");
    let mut xs2 = nan(g, pairs * H, Activation);
    g.moe_gather(all_mut(g, &mut xs2), all(g, &x_d), &order2, &shape).expect("gpu");
    assert_eq!(get(g, &xs2), gathered, "gather after the device's own routing and sort");

    let dxs = round_bf16(&uniform(&mut r, pairs * H, 1.0));
    let mut want = vec![0.0; T * H];
    c.moe_gather_backward(&mut want, &dxs, &rows, &shape).expect("cpu");
    let mut dx = nan(g, T * H, Activation);
    g.moe_gather_backward(all_mut(g, &mut dx), all(g, &put(g, &dxs, Activation)), &rows_d, &shape)
        .expect("gpu");
    // k sums in f32, one bf16 rounding.
    check("moe_gather_backward", &get(g, &dx), &want, 4e-3);

    let y = round_bf16(&uniform(&mut r, pairs * H, 1.0));
    let y_d = put(g, &y, Activation);
    let mut want = vec![0.0; T * H];
    c.moe_combine(&mut want, &y, &w, &rows, &shape).expect("cpu");
    let mut out = nan(g, T * H, Activation);
    g.moe_combine(all_mut(g, &mut out), all(g, &y_d), all(g, &w_d), &rows_d, &shape).expect("gpu");
    check("moe_combine", &get(g, &out), &want, 4e-3);

    let dout = round_bf16(&uniform(&mut r, T * H, 1.0));
    let (mut want_dy, mut want_dw) = (vec![0.0; pairs * H], vec![0.0; pairs]);
    let want_grads = Grads { dinp: &mut want_dy[..], dw: &mut want_dw[..] };
    c.moe_combine_backward(want_grads, &dout, &y, &w, &rows, &shape).expect("cpu");
    let (mut dy, mut dw) = (nan(g, pairs * H, Activation), nan(g, pairs, Accum));
    g.moe_combine_backward(
        Grads { dinp: all_mut(g, &mut dy), dw: all_mut(g, &mut dw) },
        all(g, &put(g, &dout, Activation)),
        all(g, &y_d),
        all(g, &w_d),
        &rows_d,
        &shape,
    )
    .expect("gpu");
    check("moe_combine_backward dy", &get(g, &dy), &want_dy, 4e-3);
    // Dots of bf16 values (exact products) summed in f32 in another order.
    check("moe_combine_backward dweights (f32)", &get(g, &dw), &want_dw, 1e-5);
}

/// Qwen2 MoE's shared-expert gate: bf16 activations, f32 logits (some far in both tails).
#[test]
pub(crate) fn sigmoid_gate() {
    let (g, c) = (gpu(), Cpu::new());
    let mut r = rng(91);
    let y = round_bf16(&uniform(&mut r, T * H, 1.0));
    let base = round_bf16(&uniform(&mut r, T * H, 1.0));
    let mut z = uniform(&mut r, T, 4.0);
    z[0] = 30.0;
    z[1] = -30.0;
    let dout = round_bf16(&uniform(&mut r, T * H, 1.0));
    // The shared expert is not routed: of the shape only tokens and hidden matter.
    let shape =
        MoeShape { tokens: T, hidden: H, experts: 1, top_k: 1, router: RouterKind::TopKSoftmax };
    let mut want = base.clone();
    c.sigmoid_gate_forward(&mut want, &y, &z, &shape).expect("cpu");
    let (y_d, z_d, dout_d) = (put(g, &y, Activation), put(g, &z, Accum), put(g, &dout, Activation));
    let mut out_d = put(g, &base, Activation);
    g.sigmoid_gate_forward(all_mut(g, &mut out_d), all(g, &y_d), all(g, &z_d), &shape)
        .expect("gpu");
    // One product and one add rounded to bf16.
    check("sigmoid_gate_forward", &get(g, &out_d), &want, 4e-3);
    let (mut dy, mut dz) = (vec![0.0; T * H], vec![0.0; T]);
    c.sigmoid_gate_backward(&mut dy, &mut dz, &dout, &y, &z, &shape).expect("cpu");
    let (mut dy_d, mut dz_d) = (nan(g, T * H, Activation), nan(g, T, Activation));
    g.sigmoid_gate_backward(
        all_mut(g, &mut dy_d),
        all_mut(g, &mut dz_d),
        all(g, &dout_d),
        all(g, &y_d),
        all(g, &z_d),
        &shape,
    )
    .expect("gpu");
    check("sigmoid_gate_backward dy", &get(g, &dy_d), &dy, 4e-3);
    // The logit's gradient is an f32 dot of H products, stored in bf16.
    check("sigmoid_gate_backward dlogits", &get(g, &dz_d), &dz, 4e-3);
}

#[test]
pub(crate) fn grouped_matmul() {
    let (g, c) = (gpu(), Cpu::new());
    let mut r = rng(83);
    let k = H;
    // Five experts over 37 rows: experts with no rows first, inside and last; one with one row.
    // An odd output width leaves every GEMM to cuBLASLt, one per expert; with widths that are
    // multiples of 8 and grouping on, the bf16 outputs (the forward, the input gradient) take
    // one cuBLAS grouped GEMM, while f32 outputs (the forward into Accum, the weight gradients)
    // stay per expert.
    // Both ways of running aligned groups: the per-expert loop (the default) and one cuBLAS
    // grouped call.
    let patterns = [[0usize, 7, 0, 29, 1], [12, 0, 25, 0, 0]];
    let cases = [3 * 67, 2 * H].into_iter().flat_map(|n| patterns.map(|c| (n, c)));
    for ((n, counts), grouped) in cases.flat_map(|c| [(c, false), (c, true)]) {
        g.set_grouped_gemm(grouped);
        let mut offsets = vec![0usize];
        for x in counts {
            offsets.push(offsets[offsets.len() - 1] + x);
        }
        let (rows, e) = (offsets[counts.len()], counts.len());
        for layout in [ExpertLayout::Rows, ExpertLayout::Cols] {
            let gs = GroupedShape { offsets: &offsets, k, n, layout };
            let name = format!("{layout:?} {k}x{n} rows per expert {counts:?} grouped={grouped}");
            let inp = round_bf16(&uniform(&mut r, rows * k, 1.0));
            let w = round_bf16(&uniform(&mut r, e * n * k, 0.2));
            let bias = round_bf16(&uniform(&mut r, e * n, 1.0));
            let (inp_d, w_d, bias_d) =
                (put(g, &inp, Activation), put(g, &w, Activation), put(g, &bias, Activation));
            for (with_bias, kind) in [(false, Activation), (false, Accum), (true, Activation)] {
                let mut want = vec![0.0; rows * n];
                let b = with_bias.then_some(&bias[..]);
                c.grouped_matmul_forward(&mut want, Operands { inp: &inp, w: &w }, b, &gs)
                    .expect("cpu");
                let mut out = nan(g, rows * n, kind);
                let b = with_bias.then(|| all(g, &bias_d));
                g.grouped_matmul_forward(
                    all_mut(g, &mut out),
                    Operands { inp: all(g, &inp_d), w: all(g, &w_d) },
                    b,
                    &gs,
                )
                .expect("gpu");
                // As matmul_forward; with a bias, the sum's second bf16 rounding.
                let tol = match (with_bias, kind) {
                    (true, _) => 6e-3,
                    (false, Activation) => 4e-3,
                    (false, Accum) => 1e-5,
                };
                let what = format!("grouped_matmul_forward {name} bias={with_bias} -> {kind:?}");
                let got = get(g, &out);
                check(&what, &got, &want, tol);
                // No atomics in either library: a second run gives the same bits.
                let mut again = nan(g, rows * n, kind);
                g.grouped_matmul_forward(
                    all_mut(g, &mut again),
                    Operands { inp: all(g, &inp_d), w: all(g, &w_d) },
                    with_bias.then(|| all(g, &bias_d)),
                    &gs,
                )
                .expect("gpu");
                assert!(
                    get(g, &again).iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: two runs differ"
                );
            }

            let dout = round_bf16(&uniform(&mut r, rows * n, 1.0));
            let dw0 = uniform(&mut r, e * n * k, 1.0);
            let (mut want_di, mut want_dw) = (vec![0.0; rows * k], dw0.clone());
            c.grouped_matmul_backward(
                Grads { dinp: &mut want_di, dw: &mut want_dw },
                &dout,
                Operands { inp: &inp, w: &w },
                &gs,
            )
            .expect("cpu");
            let dout_d = put(g, &dout, Activation);
            let (mut di, mut dw) = (nan(g, rows * k, Activation), put(g, &dw0, Accum));
            g.grouped_matmul_backward(
                Grads { dinp: all_mut(g, &mut di), dw: all_mut(g, &mut dw) },
                all(g, &dout_d),
                Operands { inp: all(g, &inp_d), w: all(g, &w_d) },
                &gs,
            )
            .expect("gpu");
            check(&format!("grouped_matmul_backward dinp {name}"), &get(g, &di), &want_di, 4e-3);
            let got = get(g, &dw);
            // f32 accumulators with beta = 1: summation order only.
            check(&format!("grouped_matmul_backward dw {name}"), &got, &want_dw, 1e-5);
            for (x, &m) in counts.iter().enumerate() {
                let span = x * n * k..(x + 1) * n * k;
                if m == 0 {
                    assert_eq!(got[span.clone()], dw0[span], "{name}: expert {x} has no rows");
                }
            }

            let db0 = uniform(&mut r, e * n, 1.0);
            let mut want = db0.clone();
            c.grouped_bias_backward(&mut want, &dout, &gs).expect("cpu");
            let mut db = put(g, &db0, Accum);
            g.grouped_bias_backward(all_mut(g, &mut db), all(g, &dout_d), &gs).expect("gpu");
            // Column sums in a fixed order (f32 chunks, then f64), the CPU's in f64.
            check(
                &format!("grouped_bias_backward (accumulates) {name}"),
                &get(g, &db),
                &want,
                1e-6,
            );
        }
    }
    g.set_grouped_gemm(false);
}
