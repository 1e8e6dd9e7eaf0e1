//! The LM head's chunked cross-entropy.

use crate::common::*;

#[test]
pub(crate) fn cross_entropy() {
    let (g, c) = (gpu(), Cpu::new());
    let mut r = rng(6);
    let x = round_bf16(&uniform(&mut r, T * H, 1.0));
    let w = round_bf16(&uniform(&mut r, V * H, 0.3));
    // Tokens 8..16 are all ignored: with 8-token chunks one chunk carries no loss.
    let targets: Vec<i32> =
        (0..T)
            .map(|t| {
                if (8..16).contains(&t) || t % 7 == 3 {
                    IGNORE
                } else {
                    r.random_range(0..V as i32)
                }
            })
            .collect();
    // Plain, and with Gemma 2's final soft-cap low enough (2.0) to bend these logits.
    for cap in [None, Some(2.0)] {
        let shape = LossShape { tokens: T, hidden: H, vocab: V, softcap: cap };
        let (mut want_l, mut want_lse) = (vec![0.0; T], vec![0.0; T]);
        let operands = Operands { inp: &x[..], w: &w[..] };
        c.cross_entropy_forward(&mut want_l, &mut want_lse, operands, &targets, &shape)
            .expect("cpu");
        let dw0 = uniform(&mut r, V * H, 0.1);
        let scale = 1.0 / targets.iter().filter(|&&y| y != IGNORE).count() as f32;
        let (mut want_dx, mut want_dw) = (vec![0.0; T * H], dw0.clone());
        c.cross_entropy_backward(
            Grads { dinp: &mut want_dx, dw: &mut want_dw },
            operands,
            &want_lse,
            &targets,
            scale,
            &shape,
        )
        .expect("cpu");
        let (dx_in, dw_in, dt) =
            (put(g, &x, Activation), put(g, &w, Activation), ints(g, &targets));
        for (chunk, chunks) in [(1 << 26, "one chunk"), (8 * V, "8-token chunks")] {
            let label = format!("{chunks}, cap {cap:?}");
            g.set_loss_chunk_logits(chunk);
            let (mut l, mut lse) = (nan(g, T, Accum), nan(g, T, Accum));
            g.cross_entropy_forward(
                all_mut(g, &mut l),
                all_mut(g, &mut lse),
                Operands { inp: all(g, &dx_in), w: all(g, &dw_in) },
                &dt,
                &shape,
            )
            .expect("gpu");
            // f32 logits from a bf16 GEMM, f32 softmax: 1e-5 of the scale.
            check(&format!("cross_entropy_forward losses ({label})"), &get(g, &l), &want_l, 1e-5);
            check(&format!("cross_entropy_forward lse ({label})"), &get(g, &lse), &want_lse, 1e-5);
            let (mut dx, mut dw) = (nan(g, T * H, Activation), put(g, &dw0, Accum));
            g.cross_entropy_backward(
                Grads { dinp: all_mut(g, &mut dx), dw: all_mut(g, &mut dw) },
                Operands { inp: all(g, &dx_in), w: all(g, &dw_in) },
                all(g, &lse),
                &dt,
                scale,
                &shape,
            )
            .expect("gpu");
            // The logits' gradient is rounded to bf16 (2^-9 relative) before both GEMMs.
            check(&format!("cross_entropy_backward dx ({label})"), &get(g, &dx), &want_dx, 8e-3);
            check(&format!("cross_entropy_backward dw ({label})"), &get(g, &dw), &want_dw, 4e-3);
            // The fused op, as training's head runs it: the two ops' bits exactly.
            let (mut l2, mut lse2) = (nan(g, T, Accum), nan(g, T, Accum));
            let (mut dx2, mut dw2) = (nan(g, T * H, Activation), put(g, &dw0, Accum));
            g.cross_entropy_forward_backward(
                LossOut { losses: all_mut(g, &mut l2), lse: all_mut(g, &mut lse2) },
                Grads { dinp: all_mut(g, &mut dx2), dw: all_mut(g, &mut dw2) },
                Operands { inp: all(g, &dx_in), w: all(g, &dw_in) },
                &dt,
                scale,
                &shape,
            )
            .expect("gpu");
            for (what, fused, apart) in
                [("losses", &l2, &l), ("lse", &lse2, &lse), ("dx", &dx2, &dx), ("dw", &dw2, &dw)]
            {
                let (fused, apart) = (get(g, fused), get(g, apart));
                assert!(
                    fused.iter().zip(&apart).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "cross_entropy_forward_backward {what} ({label}) differs from the two ops"
                );
            }
        }
    }
    g.set_loss_chunk_logits(sluice_engine::placement::LOSS_CHUNK_LOGITS);
}
