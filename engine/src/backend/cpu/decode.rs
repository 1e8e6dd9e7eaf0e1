//! Attention of a few new queries against a key/value cache: the attention of the inference
//! forward in `generate`, for one sequence. Reference: `eager_attention_forward` in
//! transformers' modeling_llama.py as it runs during generation, where the `DynamicCache` has
//! appended the new keys and values before attention reads them: `softmax(q kᵀ · hd^-½ + mask) v`
//! in f32 over every cached position, query head `h` reading kv head `h / (nq / nkv)`
//! (`repeat_kv`), with the causal and sliding-window mask (the query at position `p` sees keys
//! `p − W < j ≤ p`).
//!
//! Every score, exponential and weighted sum is formed exactly as `attention_forward` forms it
//! for the same query (same dot product, same order), so a sequence attended whole, or as a
//! prompt followed by one token at a time, gives the same bits.

use rayon::prelude::*;

use super::attention::{axpy, capped, dot, sink};
use super::check;
use crate::backend::DecodeShape;
use crate::error::Result;

/// out `[tokens, nq hd]`, q `[tokens, nq hd]` (after RoPE), k_cache and v_cache
/// `[past + tokens, nkv hd]` (keys after RoPE, the new tokens' rows included).
pub fn attention_decode(
    out: &mut [f32],
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    sinks: Option<&[f32]>,
    shape: &DecodeShape,
) -> Result<()> {
    const OP: &str = "attention_decode";
    check::decode_shape(OP, shape)?;
    let (n, nq, nkv, hd) = (shape.tokens, shape.q_heads, shape.kv_heads, shape.head_dim);
    check::len(OP, "out", out.len(), &[n, nq, hd])?;
    check::len(OP, "q", q.len(), &[n, nq, hd])?;
    check::len(OP, "k_cache", k_cache.len(), &[shape.positions(), nkv, hd])?;
    check::len(OP, "v_cache", v_cache.len(), &[shape.positions(), nkv, hd])?;
    if let Some(sinks) = sinks {
        check::len(OP, "sinks", sinks.len(), &[nq])?;
    }
    if nq == 0 {
        return Ok(());
    }
    let (group, scale, cap) = (nq / nkv, shape.softmax_scale(), shape.softcap);
    let window = shape.window.unwrap_or(usize::MAX);
    // Key or value head `g` of position `j`.
    let row = |j: usize, g: usize| (j * nkv + g) * hd..(j * nkv + g + 1) * hd;
    out.par_chunks_mut(nq * hd).zip(q.par_chunks(nq * hd)).enumerate().for_each_init(
        Vec::new,
        |scores: &mut Vec<f32>, (i, (out, q))| {
            let p = shape.past + i;
            let keys = (p + 1).saturating_sub(window)..p + 1;
            for (h, o) in out.chunks_mut(hd).enumerate() {
                let (qh, g) = (&q[h * hd..(h + 1) * hd], h / group);
                scores.clear();
                scores.extend(
                    keys.clone().map(|j| capped(dot(qh, &k_cache[row(j, g)]) * scale, cap).0),
                );
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                o.fill(0.0);
                for (&pr, j) in scores.iter().zip(keys.clone()) {
                    axpy(o, pr / sum, &v_cache[row(j, g)]);
                }
                // As `attention_sinks_forward` after `attention_forward`, step for step.
                if let Some(sinks) = sinks {
                    let factor = sink(max + sum.ln(), sinks[h]).1;
                    o.iter_mut().for_each(|v| *v *= factor);
                }
            }
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::{rng, uniform};
    use crate::backend::cpu::{attention_forward, attention_sinks_forward};
    use crate::backend::{AttentionOut, AttentionShape};
    use crate::error::Result;

    /// One sequence of `shape.tokens` tokens: (q rows, key cache, value cache) cut out of fused
    /// `qkv` rows, as the inference forward appends them.
    fn split(qkv: &[f32], shape: &AttentionShape) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (nq, nkv, hd) = (shape.q_heads, shape.kv_heads, shape.head_dim);
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        for row in qkv.chunks_exact(shape.qkv_width()) {
            let (qr, kv) = row.split_at(nq * hd);
            let (kr, vr) = kv.split_at(nkv * hd);
            q.extend_from_slice(qr);
            k.extend_from_slice(kr);
            v.extend_from_slice(vr);
        }
        (q, k, v)
    }

    /// GQA with a window shorter than the sequence; no window; multi-query; one query head per
    /// kv head with an odd head size.
    fn shapes() -> Vec<AttentionShape> {
        let base = AttentionShape {
            tokens: 11,
            q_heads: 4,
            kv_heads: 2,
            head_dim: 6,
            docs: 1,
            window: None,
            scale_dim: None,
            softcap: None,
        };
        vec![
            AttentionShape { window: Some(3), ..base },
            base,
            AttentionShape { kv_heads: 1, head_dim: 8, window: Some(5), ..base },
            AttentionShape { q_heads: 3, kv_heads: 3, head_dim: 5, ..base },
            // Gemma's score scale and soft-cap.
            AttentionShape { scale_dim: Some(4), softcap: Some(1.0), window: Some(4), ..base },
        ]
    }

    /// Attention over a whole sequence equals the same sequence as a prompt of `prefill` tokens
    /// then one token at a time against the growing cache, bit for bit: every query's scores
    /// and sums are formed in the same order either way. With attention sinks too (GPT-OSS).
    #[test]
    fn a_prompt_then_single_tokens_equals_the_whole_sequence() -> Result<()> {
        let cases = shapes().into_iter().flat_map(|s| [(s, false), (s, true)]);
        for (n, (shape, with_sinks)) in cases.enumerate() {
            let sinks: Vec<f32> = (0..shape.q_heads).map(|h| h as f32 * 0.7 - 1.0).collect();
            let sinks = with_sinks.then_some(&sinks[..]);
            // Doubled so some softmax rows are far from uniform.
            let qkv: Vec<f32> = uniform(&mut rng(90 + n as u64), shape.tokens * shape.qkv_width())
                .iter()
                .map(|x| 2.0 * x)
                .collect();
            let t = shape.tokens as i32;
            let mut want = vec![f32::NAN; shape.tokens * shape.q_heads * shape.head_dim];
            let mut lse = vec![0.0; shape.tokens * shape.q_heads];
            attention_forward(
                AttentionOut { out: &mut want, lse: &mut lse },
                &qkv,
                &[0, t],
                &shape,
            )?;
            if let Some(sinks) = sinks {
                attention_sinks_forward(
                    AttentionOut { out: &mut want, lse: &mut lse },
                    sinks,
                    &shape,
                )?;
            }

            let (q, k, v) = split(&qkv, &shape);
            let (qw, kw) = (shape.q_heads * shape.head_dim, shape.kv_heads * shape.head_dim);
            for prefill in [1, 4, shape.tokens] {
                let mut got = vec![f32::NAN; want.len()];
                let mut past = 0;
                while past < shape.tokens {
                    let tokens = if past == 0 { prefill } else { 1 };
                    let decode = DecodeShape {
                        past,
                        tokens,
                        q_heads: shape.q_heads,
                        kv_heads: shape.kv_heads,
                        head_dim: shape.head_dim,
                        window: shape.window,
                        scale_dim: shape.scale_dim,
                        softcap: shape.softcap,
                    };
                    let end = past + tokens;
                    attention_decode(
                        &mut got[past * qw..end * qw],
                        &q[past * qw..end * qw],
                        &k[..end * kw],
                        &v[..end * kw],
                        sinks,
                        &decode,
                    )?;
                    past = end;
                }
                assert_eq!(got, want, "case {n}, prompt of {prefill}");
            }
        }
        Ok(())
    }

    #[test]
    fn bad_shapes_and_lengths_are_rejected() {
        let shape = DecodeShape {
            past: 3,
            tokens: 2,
            q_heads: 4,
            kv_heads: 2,
            head_dim: 6,
            window: None,
            scale_dim: None,
            softcap: None,
        };
        let (mut out, q) = (vec![0.0; 2 * 24], vec![0.0; 2 * 24]);
        let kv = vec![0.0; 5 * 12];
        let run = |out: &mut [f32], k: &[f32], shape: &DecodeShape| {
            attention_decode(out, &q, k, &kv, None, shape)
                .expect_err("must be rejected")
                .to_string()
        };
        let e = run(&mut out, &kv[12..], &shape);
        assert!(e.contains("attention_decode") && e.contains("`k_cache` has 48"), "{e}");
        let e = run(&mut out[1..], &kv, &shape);
        assert!(e.contains("`out`"), "{e}");
        let e = run(&mut out, &kv, &DecodeShape { window: Some(0), ..shape });
        assert!(e.contains("window"), "{e}");
        let e = run(&mut out, &kv, &DecodeShape { kv_heads: 3, ..shape });
        assert!(e.contains("not a multiple"), "{e}");
        let e = run(&mut out, &kv, &DecodeShape { past: usize::MAX, ..shape });
        assert!(e.contains("overflow"), "{e}");
        assert!(out.iter().all(|&x| x == 0.0), "a rejected call wrote its output");
    }
}
