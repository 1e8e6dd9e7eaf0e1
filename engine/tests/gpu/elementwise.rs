//! Elementwise ops, reductions and memory: adds, copies, sums, and the errors bad arguments give.

use crate::common::*;

#[test]
pub(crate) fn add_copy_and_reductions() {
    let g = gpu();
    let mut r = rng(1);
    let n = 3 * 65536 + 77;
    let (a, b) = (uniform(&mut r, n, 2.0), uniform(&mut r, n, 2.0));
    for (ka, kb, ko) in [
        (Activation, Activation, Activation),
        (Activation, Accum, Accum),
        (Accum, Activation, Activation),
    ] {
        let (sa, sb) = (stored(&a, ka), stored(&b, kb));
        let want: Vec<f32> = sa.iter().zip(&sb).map(|(x, y)| x + y).collect();
        let (da, db) = (put(g, &a, ka), put(g, &b, kb));
        let mut out = nan(g, n, ko);
        g.add(all_mut(g, &mut out), all(g, &da), all(g, &db)).expect("add");
        // One rounding of the sum to the output's precision: 2^-9 of an element in bf16.
        let tol = if ko == Activation { 4e-3 } else { 1e-6 };
        check(&format!("add {ka:?}+{kb:?}->{ko:?}"), &get(g, &out), &want, tol);
        let mut acc = put(g, &a, ko);
        g.add_assign(all_mut(g, &mut acc), all(g, &db)).expect("add_assign");
        let want: Vec<f32> = stored(&a, ko).iter().zip(&sb).map(|(x, y)| x + y).collect();
        check(&format!("add_assign {ko:?}+={kb:?}"), &get(g, &acc), &want, tol);
    }
    // Casts through `copy`: f32 -> bf16 rounds to nearest even exactly as the host does.
    let src = put(g, &a, Accum);
    let mut dst = nan(g, n, Activation);
    g.copy(all_mut(g, &mut dst), all(g, &src)).expect("copy");
    check("copy f32->bf16 (cast)", &get(g, &dst), &round_bf16(&a), 0.0);
    let mut back = nan(g, n, Accum);
    g.copy(all_mut(g, &mut back), all(g, &dst)).expect("copy");
    check("copy bf16->f32 (cast)", &get(g, &back), &round_bf16(&a), 0.0);
    g.fill_zero(g.view_mut(&mut back, 5..n - 3)).expect("fill_zero");
    let got = get(g, &back);
    assert!(got[5..n - 3].iter().all(|&x| x == 0.0) && got[4] == round_bf16(&a)[4]);
    // Sums: f64 partials over fixed chunks on both sides; only the order differs (1e-12).
    let sa = round_bf16(&a);
    let want_sum: f64 = sa.iter().map(|&x| f64::from(x)).sum();
    let want_sq: f64 = sa.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
    let (s, sq) =
        (g.sum(all(g, &dst)).expect("sum"), g.sum_squares(all(g, &dst)).expect("sum_squares"));
    check("sum", &[s as f32], &[want_sum as f32], 1e-6);
    check("sum_squares", &[sq as f32], &[want_sq as f32], 1e-6);
    assert!(((sq - want_sq) / want_sq).abs() < 1e-12, "sum_squares {sq} vs {want_sq}");
}

#[test]
pub(crate) fn bad_arguments_are_errors_not_panics() {
    let g = gpu();
    let a = nan(g, 10, Activation);
    let mut o = nan(g, 9, Activation);
    let e = g.add(all_mut(g, &mut o), all(g, &a), all(g, &a)).expect_err("length mismatch");
    assert!(e.to_string().contains("add"), "{e}");
    let table = nan(g, 4 * 3, Activation);
    let mut out = nan(g, 2 * 3, Activation);
    let ids = ints(g, &[1, 4]);
    let e = g
        .embedding_forward(all_mut(g, &mut out), &ids, all(g, &table), 2, 3, 1.0)
        .expect_err("id 4");
    assert!(e.to_string().contains("`ids`[1] = 4"), "{e}");
    let shape = AttentionShape {
        tokens: 3,
        q_heads: 2,
        kv_heads: 1,
        head_dim: 64,
        docs: 1,
        window: None,
        scale_dim: None,
        softcap: None,
    };
    let qkv = nan(g, 3 * 4 * 64, Activation);
    let (mut o, mut l) = (nan(g, 3 * 2 * 64, Activation), nan(g, 6, Accum));
    let e = g
        .attention_forward(
            AttentionOut { out: all_mut(g, &mut o), lse: all_mut(g, &mut l) },
            all(g, &qkv),
            &ints(g, &[0, 2]),
            &shape,
        )
        .expect_err("cu_seqlens must end at 3");
    assert!(e.to_string().contains("cu_seqlens"), "{e}");
    let mut l16 = nan(g, 6, Activation);
    let e = g
        .attention_forward(
            AttentionOut { out: all_mut(g, &mut o), lse: all_mut(g, &mut l16) },
            all(g, &qkv),
            &ints(g, &[0, 3]),
            &shape,
        )
        .expect_err("lse must be f32");
    assert!(e.to_string().contains("`lse`"), "{e}");
}
