//! Attention: every kernel family against the CPU, head sizes, masks, soft-caps and sinks.

use crate::common::*;

/// One attention check: the documents (`cu`, ending at the token count), the head layout, the
/// window, and `offset`, the element at which every operand's view starts inside its buffer
/// (an offset that breaks 16-byte alignment sends tensor-core head sizes to the scalar kernels).
#[derive(Clone, Copy)]
pub(crate) struct AttentionCase {
    cu: &'static [i32],
    nq: usize,
    nkv: usize,
    hd: usize,
    window: Option<usize>,
    offset: usize,
    /// Gemma's score scale (`1 / sqrt(scale_dim)`) and soft-cap.
    scale_dim: Option<usize>,
    softcap: Option<f32>,
}

/// 301 tokens: documents of 70, 0, 129 and 102 tokens, so document boundaries fall inside the
/// kernels' 16-, 32- and 64-token tiles, a document spans several tiles and the last tile is
/// partial.
pub(crate) const LONG_CU: [i32; 5] = [0, 70, 70, 199, 301];

pub(crate) fn attention_case(case: &AttentionCase, seed: u64) {
    let (g, c) = (gpu(), Cpu::new());
    let mut r = rng(seed);
    let AttentionCase { cu, nq, nkv, hd, window, offset, scale_dim, softcap } = *case;
    let t = *cu.last().expect("cu") as usize;
    let shape = AttentionShape {
        tokens: t,
        q_heads: nq,
        kv_heads: nkv,
        head_dim: hd,
        docs: cu.len() - 1,
        window,
        scale_dim,
        softcap,
    };
    let width = shape.qkv_width();
    let mut name = format!("T={t} hd={hd} nq={nq} nkv={nkv} window={window:?} offset={offset}");
    if softcap.is_some() {
        name += &format!(" scale_dim={scale_dim:?} softcap={softcap:?}");
    }
    // Scaled up so some softmax rows are far from uniform.
    let qkv = round_bf16(&uniform(&mut r, t * width, 2.5));
    let (mut want, mut want_lse) = (vec![0.0; t * nq * hd], vec![0.0; t * nq]);
    let want_att = AttentionOut { out: &mut want[..], lse: &mut want_lse[..] };
    c.attention_forward(want_att, &qkv, &cu.to_vec(), &shape).expect("cpu");
    let (qkv_d, cu_d) = (put_at(g, &qkv, offset, Activation), ints(g, cu));
    let forward = || {
        let mut out = put_at(g, &vec![f32::NAN; t * nq * hd], offset, Activation);
        let mut lse = put_at(g, &vec![f32::NAN; t * nq], offset, Accum);
        g.attention_forward(
            AttentionOut { out: from_mut(g, &mut out, offset), lse: from_mut(g, &mut lse, offset) },
            from(g, &qkv_d, offset),
            &cu_d,
            &shape,
        )
        .expect("gpu");
        (out, lse)
    };
    // The mma.sync kernels, then the Hopper ones where they run; the backward below starts
    // from the first.
    let default_forward = g.hopper_attention_forward();
    let mut first = None;
    for hopper in [false, true] {
        g.set_hopper_attention_forward(hopper);
        // The tensor-core kernels take 16-byte aligned views only (8 bf16 elements).
        if hopper && (offset % 8 != 0 || !g.hopper_attention_forward_for(&shape)) {
            continue;
        }
        let kernels = if hopper { "hopper" } else { "mma" };
        let (out, lse) = forward();
        let out_h = get(g, &out)[offset..].to_vec();
        let lse_h = get(g, &lse)[offset..].to_vec();
        // f32 math, two bf16 roundings: of P before P·V (as in FlashAttention; moves out_i by at
        // most 2^-9 Σ_j P_ij |v_j|) and of the output (2^-9 of itself): up to ~4e-3 of the scale.
        check(&format!("attention_forward {kernels} out {name}"), &out_h, &want, 6e-3);
        // Scores exact in f32 (bf16 products) summed in another order, exp2 for exp: f32 ulps.
        check(&format!("attention_forward {kernels} lse {name}"), &lse_h, &want_lse, 1e-5);
        let (again, again_lse) = forward();
        assert!(
            bits_equal(&get(g, &again)[offset..], &out_h)
                && bits_equal(&get(g, &again_lse)[offset..], &lse_h),
            "attention_forward {kernels} {name}: two runs differ"
        );
        first.get_or_insert((out, lse, out_h, lse_h));
    }
    g.set_hopper_attention_forward(default_forward);
    let (out, lse, out_h, lse_h) = first.expect("the mma.sync forward ran");

    // The backward from the GPU's own (bf16) forward output, as training runs it.
    let dout = round_bf16(&uniform(&mut r, t * nq * hd, 1.0));
    let mut want_d = vec![0.0; t * width];
    let att_h = AttentionOut { out: &out_h[..], lse: &lse_h[..] };
    c.attention_backward(&mut want_d, &dout, &qkv, att_h, &cu.to_vec(), &shape).expect("cpu");
    let dout_d = put_at(g, &dout, offset, Activation);
    // The split kernels, then the fused one where the head size has it (elsewhere the split
    // kernels again), then the Hopper ones where they run.
    let defaults = (g.fused_attention_backward(), g.hopper_attention_backward());
    for (kernels, fused, hopper) in
        [("split", false, false), ("fused", true, false), ("hopper", false, true)]
    {
        g.set_fused_attention_backward(fused);
        g.set_hopper_attention_backward(hopper);
        if hopper && (offset % 8 != 0 || !g.hopper_attention_backward_for(&shape)) {
            continue;
        }
        let mut runs = Vec::new();
        for _ in 0..2 {
            let mut d = put_at(g, &vec![f32::NAN; t * width], offset, Activation);
            g.attention_backward(
                from_mut(g, &mut d, offset),
                from(g, &dout_d, offset),
                from(g, &qkv_d, offset),
                AttentionOut { out: from(g, &out, offset), lse: from(g, &lse, offset) },
                &cu_d,
                &shape,
            )
            .expect("gpu");
            runs.push(get(g, &d)[offset..].to_vec());
        }
        // Sums of products over many keys, P and dS rounded to bf16 before their products (as
        // in FlashAttention), then a bf16 rounding: 1e-2 of the scale.
        check(&format!("attention_backward {kernels} dqkv {name}"), &runs[0], &want_d, 1e-2);
        // No atomics on the data: a second run gives the same bits.
        assert!(
            bits_equal(&runs[0], &runs[1]),
            "attention_backward {kernels} {name}: two runs differ"
        );
    }
    g.set_fused_attention_backward(defaults.0);
    g.set_hopper_attention_backward(defaults.1);
}

/// The fused backward against the split kernels on rows long enough for deep chains of key
/// blocks (128 keys each) adding to one query tile's dq, and many blocks waiting on each
/// other at once: the two agree to bf16 rounding and the fused one repeats its bits. The
/// Hopper kernels (sm_90) likewise.
#[test]
pub(crate) fn fused_and_hopper_attention_backward_match_the_split_kernels_on_long_rows() {
    let g = gpu();
    let cases: [(&[i32], usize, usize, usize, Option<usize>); 4] = [
        (&[0, 16384], 28, 4, 128, None),
        (&[0, 5000, 5000, 9001, 16384], 8, 1, 128, Some(3000)),
        (&[0, 1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192], 16, 16, 128, None),
        (&[0, 3000, 12289], 8, 2, 64, Some(700)),
    ];
    let defaults = (g.fused_attention_backward(), g.hopper_attention_backward());
    for (n, &(cu, nq, nkv, hd, window)) in cases.iter().enumerate() {
        let mut r = rng(500 + n as u64);
        let t = *cu.last().expect("cu") as usize;
        let shape = AttentionShape {
            tokens: t,
            q_heads: nq,
            kv_heads: nkv,
            head_dim: hd,
            docs: cu.len() - 1,
            window,
            scale_dim: None,
            softcap: None,
        };
        let name =
            format!("T={t} docs={} hd={hd} nq={nq} nkv={nkv} window={window:?}", cu.len() - 1);
        let qkv = put(g, &uniform(&mut r, t * shape.qkv_width(), 2.5), Activation);
        let cu_d = ints(g, cu);
        let (mut out, mut lse) = (nan(g, t * nq * hd, Activation), nan(g, t * nq, Accum));
        let att = AttentionOut { out: all_mut(g, &mut out), lse: all_mut(g, &mut lse) };
        g.attention_forward(att, all(g, &qkv), &cu_d, &shape).expect("forward");
        let dout = put(g, &uniform(&mut r, t * nq * hd, 1.0), Activation);
        let run = |fused: bool, hopper: bool| {
            g.set_fused_attention_backward(fused);
            g.set_hopper_attention_backward(hopper);
            let mut d = nan(g, t * shape.qkv_width(), Activation);
            g.attention_backward(
                all_mut(g, &mut d),
                all(g, &dout),
                all(g, &qkv),
                AttentionOut { out: all(g, &out), lse: all(g, &lse) },
                &cu_d,
                &shape,
            )
            .expect("backward");
            get(g, &d)
        };
        let split = run(false, false);
        let (a, b) = (run(true, false), run(true, false));
        // Ampere's sm_80 and Hopper give a block the fused kernel's shared memory.
        assert!(
            g.fused_attention_backward_for(&shape) || !matches!(g.arch(), "sm_80" | "sm_90"),
            "{name}: the fused kernel did not run on {}",
            g.arch()
        );
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "fused attention_backward {name}: two runs differ"
        );
        // The same sums in another order (dq over key blocks in f32 instead of over key tiles
        // in registers; dk and dv over query heads likewise), each rounded to bf16 once.
        check(&format!("fused vs split attention_backward {name}"), &a, &split, 1e-2);
        let (a, b) = (run(false, true), run(false, true));
        assert!(
            g.arch() != "sm_90" || g.hopper_attention_backward_for(&shape),
            "{name}: the Hopper kernels did not run on sm_90"
        );
        assert!(bits_equal(&a, &b), "hopper attention_backward {name}: two runs differ");
        // The split kernels' sums over tiles of other sizes, each rounded to bf16 once.
        check(&format!("hopper vs split attention_backward {name}"), &a, &split, 1e-2);
    }
    g.set_fused_attention_backward(defaults.0);
    g.set_hopper_attention_backward(defaults.1);
}

/// The Hopper forward against the mma.sync kernels on rows long enough for many key tiles per
/// query block, several documents and windows (tiles starting mid-document, warpgroups that
/// skip tiles their neighbours multiply): the two agree to bf16 rounding and repeat their bits.
#[test]
pub(crate) fn hopper_attention_forward_matches_the_mma_kernels_on_long_rows() {
    let g = gpu();
    let cases: [(&[i32], usize, usize, usize, Option<usize>); 4] = [
        (&[0, 16384], 28, 4, 128, None),
        (&[0, 5000, 5000, 9001, 16384], 8, 1, 128, Some(3000)),
        (&[0, 1000, 2048, 3077, 4096, 5120, 6100, 7168, 8192], 16, 16, 128, Some(200)),
        (&[0, 3000, 12289], 8, 2, 64, Some(700)),
    ];
    let default = g.hopper_attention_forward();
    for (n, &(cu, nq, nkv, hd, window)) in cases.iter().enumerate() {
        let mut r = rng(600 + n as u64);
        let t = *cu.last().expect("cu") as usize;
        let shape = AttentionShape {
            tokens: t,
            q_heads: nq,
            kv_heads: nkv,
            head_dim: hd,
            docs: cu.len() - 1,
            window,
            scale_dim: None,
            softcap: None,
        };
        let name =
            format!("T={t} docs={} hd={hd} nq={nq} nkv={nkv} window={window:?}", cu.len() - 1);
        let qkv = put(g, &uniform(&mut r, t * shape.qkv_width(), 2.5), Activation);
        let cu_d = ints(g, cu);
        let run = |hopper: bool| {
            g.set_hopper_attention_forward(hopper);
            let (mut out, mut lse) = (nan(g, t * nq * hd, Activation), nan(g, t * nq, Accum));
            let att = AttentionOut { out: all_mut(g, &mut out), lse: all_mut(g, &mut lse) };
            g.attention_forward(att, all(g, &qkv), &cu_d, &shape).expect("forward");
            (get(g, &out), get(g, &lse))
        };
        let (mma, mma_lse) = run(false);
        let (a, a_lse) = run(true);
        let (b, b_lse) = run(true);
        if g.arch() == "sm_90" {
            g.set_hopper_attention_forward(true);
            assert!(
                g.hopper_attention_forward_for(&shape),
                "{name}: the Hopper kernel did not run"
            );
        }
        assert!(
            bits_equal(&a, &b) && bits_equal(&a_lse, &b_lse),
            "hopper attention_forward {name}: two runs differ"
        );
        // The same sums in another order, P and the output each rounded to bf16 once.
        check(&format!("hopper vs mma attention_forward out {name}"), &a, &mma, 1e-2);
        check(&format!("hopper vs mma attention_forward lse {name}"), &a_lse, &mma_lse, 1e-5);
    }
    g.set_hopper_attention_forward(default);
}

#[test]
pub(crate) fn attention_head_dims_and_masks() {
    let base = AttentionCase {
        cu: &CU,
        nq: 6,
        nkv: 2,
        hd: 64,
        window: None,
        offset: 0,
        scale_dim: None,
        softcap: None,
    };
    // Gemma 2: scores scaled by 1/sqrt(32) at head_dim 64 and soft-capped at 2, low enough to
    // bend these scores.
    let gemma = AttentionCase { scale_dim: Some(32), softcap: Some(2.0), ..base };
    let cases = [
        // The tensor-core head sizes: short documents (one tile), GQA groups of 1 to 6 heads.
        AttentionCase { ..base },
        AttentionCase { window: Some(7), ..base },
        AttentionCase { hd: 128, ..base },
        AttentionCase { hd: 128, nkv: 1, window: Some(5), ..base },
        AttentionCase { hd: 80, nkv: 3, window: Some(9), ..base },
        AttentionCase { hd: 96, nkv: 6, ..base },
        AttentionCase { hd: 256, window: Some(11), ..base },
        // Documents across tiles, boundaries inside tiles, a partial last tile; windows shorter
        // and longer than a tile.
        AttentionCase { cu: &LONG_CU, ..base },
        AttentionCase { cu: &LONG_CU, window: Some(50), ..base },
        AttentionCase { cu: &LONG_CU, hd: 80, nkv: 1, window: Some(100), ..base },
        AttentionCase { cu: &LONG_CU, hd: 96, nkv: 3, ..base },
        AttentionCase { cu: &LONG_CU, hd: 128, nq: 8, nkv: 2, ..base },
        AttentionCase { cu: &LONG_CU, hd: 128, nkv: 6, window: Some(33), ..base },
        AttentionCase { cu: &LONG_CU, hd: 256, nq: 4, ..base },
        AttentionCase { cu: &LONG_CU, hd: 256, nq: 4, nkv: 1, window: Some(70), ..base },
        // The scalar kernels: head sizes that are not a multiple of 16 or have no tensor-core
        // instantiation, and a tensor-core size through views not aligned to 16 bytes.
        AttentionCase { hd: 32, ..base },
        AttentionCase { cu: &LONG_CU, hd: 40, window: Some(30), ..base },
        AttentionCase { hd: 112, nkv: 1, ..base },
        AttentionCase { hd: 200, window: Some(6), ..base },
        AttentionCase { cu: &LONG_CU, hd: 128, offset: 3, ..base },
        // Gemma's scale and soft-cap, on the tensor-core and the scalar kernels.
        AttentionCase { cu: &LONG_CU, window: Some(50), ..gemma },
        AttentionCase { cu: &LONG_CU, hd: 256, nq: 4, nkv: 1, window: Some(70), ..gemma },
        AttentionCase { hd: 40, ..gemma },
    ];
    for (n, case) in cases.iter().enumerate() {
        attention_case(case, 10 + n as u64);
    }
}

/// GPT-OSS's attention sinks after the attention on both backends: the op alone on the GPU's
/// own attention results, the chain attention → sinks against the CPU's, and the backward (the
/// sinks' gradient, and attention_backward given the sinked out and lse).
pub(crate) fn sinks_case(cu: &[i32], hd: usize, seed: u64) {
    let (g, c) = (gpu(), Cpu::new());
    let mut r = rng(seed);
    let t = *cu.last().expect("cu") as usize;
    let (nq, nkv) = (8, 2);
    let shape = AttentionShape {
        tokens: t,
        q_heads: nq,
        kv_heads: nkv,
        head_dim: hd,
        docs: cu.len() - 1,
        window: None,
        scale_dim: None,
        softcap: None,
    };
    let name = format!("T={t} hd={hd}");
    let qkv = round_bf16(&uniform(&mut r, t * shape.qkv_width(), 2.5));
    // Around the rows' own log-sum-exps (a few units), so the sinks take a real share.
    let sinks = round_bf16(&uniform(&mut r, nq, 3.0).iter().map(|s| s + 2.0).collect::<Vec<_>>());
    let (mut want, mut want_lse) = (vec![0.0; t * nq * hd], vec![0.0; t * nq]);
    let want_att = AttentionOut { out: &mut want[..], lse: &mut want_lse[..] };
    c.attention_forward(want_att, &qkv, &cu.to_vec(), &shape).expect("cpu");
    let want_att = AttentionOut { out: &mut want[..], lse: &mut want_lse[..] };
    c.attention_sinks_forward(want_att, &sinks, &shape).expect("cpu");

    let (qkv_d, cu_d, sinks_d) =
        (put(g, &qkv, Activation), ints(g, cu), put(g, &sinks, Activation));
    let (mut out, mut lse) = (nan(g, t * nq * hd, Activation), nan(g, t * nq, Accum));
    let att = AttentionOut { out: all_mut(g, &mut out), lse: all_mut(g, &mut lse) };
    g.attention_forward(att, all(g, &qkv_d), &cu_d, &shape).expect("gpu");
    let (mut alone, mut alone_lse) = (get(g, &out), get(g, &lse));
    let alone_att = AttentionOut { out: &mut alone[..], lse: &mut alone_lse[..] };
    c.attention_sinks_forward(alone_att, &sinks, &shape).expect("cpu");
    let att = AttentionOut { out: all_mut(g, &mut out), lse: all_mut(g, &mut lse) };
    g.attention_sinks_forward(att, all(g, &sinks_d), &shape).expect("gpu");
    let (out_h, lse_h) = (get(g, &out), get(g, &lse));
    // The op alone: one factor per row from exp and log (f32 ulps apart), one bf16 rounding.
    check(&format!("attention_sinks_forward out {name}"), &out_h, &alone, 5e-3);
    check(&format!("attention_sinks_forward lse {name}"), &lse_h, &alone_lse, 1e-5);
    // The chain: attention_forward's tolerance (6e-3) and the rescaled output's second rounding.
    check(&format!("attention + sinks out {name}"), &out_h, &want, 8e-3);
    check(&format!("attention + sinks lse {name}"), &lse_h, &want_lse, 1e-5);

    let dout = round_bf16(&uniform(&mut r, t * nq * hd, 1.0));
    let ds0 = uniform(&mut r, nq, 1.0);
    let mut want = ds0.clone();
    let att_h = AttentionOut { out: &out_h[..], lse: &lse_h[..] };
    c.attention_sinks_backward(&mut want, &dout, att_h, &sinks, &shape).expect("cpu");
    let dout_d = put(g, &dout, Activation);
    let mut runs = Vec::new();
    for _ in 0..2 {
        let mut ds = put(g, &ds0, Accum);
        g.attention_sinks_backward(
            all_mut(g, &mut ds),
            all(g, &dout_d),
            AttentionOut { out: all(g, &out), lse: all(g, &lse) },
            all(g, &sinks_d),
            &shape,
        )
        .expect("gpu");
        runs.push(get(g, &ds));
    }
    // Dots of bf16 values in f32, summed over tokens in another order: f32 rounding.
    check(&format!("attention_sinks_backward dsinks (accumulates) {name}"), &runs[0], &want, 1e-5);
    assert!(
        runs[0].iter().zip(&runs[1]).all(|(a, b)| a.to_bits() == b.to_bits()),
        "attention_sinks_backward {name}: two runs differ"
    );
    let mut want_d = vec![0.0; t * shape.qkv_width()];
    c.attention_backward(&mut want_d, &dout, &qkv, att_h, &cu.to_vec(), &shape).expect("cpu");
    let mut d = nan(g, t * shape.qkv_width(), Activation);
    g.attention_backward(
        all_mut(g, &mut d),
        all(g, &dout_d),
        all(g, &qkv_d),
        AttentionOut { out: all(g, &out), lse: all(g, &lse) },
        &cu_d,
        &shape,
    )
    .expect("gpu");
    // As attention_case's backward.
    check(&format!("attention_backward after sinks dqkv {name}"), &get(g, &d), &want_d, 1e-2);
}

#[test]
pub(crate) fn attention_sinks() {
    sinks_case(&CU, 64, 70); // the tensor-core kernels, short documents
    sinks_case(&LONG_CU, 64, 71); // 301 tokens: the backward's sum over many token chunks
    sinks_case(&LONG_CU, 40, 72); // the scalar kernels
}
