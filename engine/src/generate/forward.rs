//! The decoder's inference forward on the CPU with a key/value cache: the same math as the
//! training forward ([`crate::model::Decoder::layer_forward`], built from the CPU backend's free
//! functions), except that attention reads every earlier position from the cache instead of the
//! current batch, so each new token costs one row of work per layer.

use crate::backend::AttentionShape;
use crate::backend::cpu::{
    bias_forward, embedding_forward, head_rmsnorm_forward, matmul_forward, rmsnorm_forward,
    rope_forward, swiglu_forward,
};
use crate::error::{Error, Result};
use crate::model::HostParams;
use crate::spec::ModelSpec;

/// Keys and values of every position seen so far, per layer: `k[l]` and `v[l]` are
/// `[len, nkv · hd]` (after RoPE for keys).
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
}

impl KvCache {
    pub fn new(layers: usize) -> KvCache {
        KvCache { k: vec![Vec::new(); layers], v: vec![Vec::new(); layers], len: 0 }
    }

    /// Positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every position (start a new sequence).
    pub fn clear(&mut self) {
        self.k.iter_mut().chain(self.v.iter_mut()).for_each(Vec::clear);
        self.len = 0;
    }
}

/// Runs `ids` at positions `cache.len()..` and appends their keys and values to the cache.
/// Returns the logits `[rows, V]` of the last `rows` new positions.
pub(super) fn forward(
    spec: &ModelSpec,
    params: &HostParams,
    inv_freq: &[f32],
    cache: &mut KvCache,
    ids: &[u32],
    rows: usize,
) -> Result<Vec<f32>> {
    let n = ids.len();
    if n == 0 || rows == 0 || rows > n {
        return Err(Error::invalid(format!("cannot return {rows} logit rows for {n} new tokens")));
    }
    if cache.k.len() != spec.layers {
        return Err(Error::invalid(format!(
            "the cache was made for {} layers, the model has {}",
            cache.k.len(),
            spec.layers
        )));
    }
    let start = cache.len;
    if start + n > spec.max_positions {
        return Err(Error::invalid(format!(
            "{} tokens exceed the model's context of {} positions",
            start + n,
            spec.max_positions
        )));
    }
    let (h, inter, hd) = (spec.hidden, spec.intermediate, spec.head_dim);
    let (dqkv, datt) = (spec.qkv_width(), spec.attn_width());
    let kv_width = spec.kv_heads * hd;
    let layout = &params.layout;
    let r = &layout.layer;

    let ids_i32: Vec<i32> = ids
        .iter()
        .map(|&id| {
            i32::try_from(id).map_err(|_| Error::invalid(format!("token id {id} too large")))
        })
        .collect::<Result<_>>()?;
    let positions: Vec<i32> = (start..start + n)
        .map(|p| i32::try_from(p).map_err(|_| Error::invalid("position too large")))
        .collect::<Result<_>>()?;
    let embed = &params.units[0];
    let table = &embed[..spec.vocab * h];

    let mut x = vec![0.0f32; n * h]; // [n, H]
    embedding_forward(&mut x, &ids_i32, table, n, h)?;
    let mut normed = vec![0.0f32; n * h];
    let mut rstd = vec![0.0f32; n];
    let mut qkv_pre = vec![0.0f32; if spec.qk_norm { n * dqkv } else { 0 }];
    let mut qk_rstd =
        vec![0.0f32; if spec.qk_norm { n * (spec.q_heads + spec.kv_heads) } else { 0 }];
    let mut qkv = vec![0.0f32; n * dqkv];
    let mut att = vec![0.0f32; n * datt];
    let mut tmp = vec![0.0f32; n * h];
    let mut gate_up = vec![0.0f32; n * 2 * inter];
    let mut act = vec![0.0f32; n * inter];

    for l in 0..spec.layers {
        let w = &params.units[l + 1];
        let shape = AttentionShape {
            tokens: n,
            q_heads: spec.q_heads,
            kv_heads: spec.kv_heads,
            head_dim: hd,
            docs: 1,
            window: spec.windows.get(l).copied().flatten(),
        };
        rmsnorm_forward(&mut normed, &mut rstd, &x, &w[r.ln1.clone()], n, h, spec.rms_eps)?;
        let proj = if spec.qk_norm { &mut qkv_pre } else { &mut qkv };
        matmul_forward(proj, &normed, &w[r.qkv_w.clone()], n, h, dqkv)?;
        if let Some(bias) = &r.qkv_b {
            bias_forward(proj, &w[bias.clone()], n, dqkv)?;
        }
        if let Some(norm) = &r.qk_norm {
            head_rmsnorm_forward(
                &mut qkv,
                &mut qk_rstd,
                &qkv_pre,
                &w[norm.clone()],
                &shape,
                spec.rms_eps,
            )?;
        }
        rope_forward(&mut qkv, &positions, inv_freq, &shape)?;
        let (ck, cv) = (&mut cache.k[l], &mut cache.v[l]);
        for row in qkv.chunks_exact(dqkv) {
            let (_, kv) = row.split_at(datt);
            let (k, v) = kv.split_at(kv_width);
            ck.extend_from_slice(k);
            cv.extend_from_slice(v);
        }
        cached_attention(&mut att, &qkv, ck, cv, spec, start, shape.window);

        matmul_forward(&mut tmp, &att, &w[r.o_w.clone()], n, datt, h)?;
        if let Some(bias) = &r.o_b {
            bias_forward(&mut tmp, &w[bias.clone()], n, h)?;
        }
        x.iter_mut().zip(&tmp).for_each(|(x, t)| *x += t);

        rmsnorm_forward(&mut normed, &mut rstd, &x, &w[r.ln2.clone()], n, h, spec.rms_eps)?;
        matmul_forward(&mut gate_up, &normed, &w[r.gate_up_w.clone()], n, h, 2 * inter)?;
        swiglu_forward(&mut act, &gate_up, n, inter)?;
        matmul_forward(&mut tmp, &act, &w[r.down_w.clone()], n, inter, h)?;
        x.iter_mut().zip(&tmp).for_each(|(x, t)| *x += t);
    }
    cache.len += n;

    let head = &params.units[layout.head_unit()];
    let last = &x[(n - rows) * h..];
    let mut out_norm = vec![0.0f32; rows * h];
    let mut out_rstd = vec![0.0f32; rows];
    rmsnorm_forward(
        &mut out_norm,
        &mut out_rstd,
        last,
        &head[layout.head.norm.clone()],
        rows,
        h,
        spec.rms_eps,
    )?;
    let lm = match &layout.head.lm_head {
        Some(range) => &head[range.clone()],
        None => table,
    };
    let mut logits = vec![0.0f32; rows * spec.vocab];
    matmul_forward(&mut logits, &out_norm, lm, rows, h, spec.vocab)?;
    Ok(logits)
}

/// Attention of the new queries over the cache, as `attention_forward` computes it for one
/// document (reference: `eager_attention_forward` in transformers' modeling_llama.py): query at
/// position `p` sees keys `max(0, p + 1 − W)..=p`; scores `q · k / sqrt(hd)` in f32, softmax
/// with the maximum subtracted, then the probability-weighted sum of values.
/// att `[n, nq hd]`, qkv `[n, Dqkv]` (after RoPE), keys/values `[start + n, nkv hd]`.
fn cached_attention(
    att: &mut [f32],
    qkv: &[f32],
    keys: &[f32],
    values: &[f32],
    spec: &ModelSpec,
    start: usize,
    window: Option<usize>,
) {
    use rayon::prelude::*;
    let (hd, nq) = (spec.head_dim, spec.q_heads);
    let group = spec.q_heads / spec.kv_heads;
    let (dqkv, kv_width) = (spec.qkv_width(), spec.kv_heads * hd);
    let scale = 1.0 / (hd as f32).sqrt();
    let window = window.unwrap_or(usize::MAX);
    att.par_chunks_mut(nq * hd).zip(qkv.par_chunks(dqkv)).enumerate().for_each_init(
        Vec::new,
        |scores: &mut Vec<f32>, (i, (out, row))| {
            let p = start + i;
            let first = (p + 1).saturating_sub(window);
            for (hq, o) in out.chunks_mut(hd).enumerate() {
                let q = &row[hq * hd..(hq + 1) * hd];
                let g = hq / group;
                let key = |j: usize| &keys[j * kv_width + g * hd..j * kv_width + (g + 1) * hd];
                let value = |j: usize| &values[j * kv_width + g * hd..j * kv_width + (g + 1) * hd];
                scores.clear();
                scores.extend((first..=p).map(|j| dot(q, key(j)) * scale));
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                o.fill(0.0);
                for (&pr, j) in scores.iter().zip(first..=p) {
                    let alpha = pr / sum;
                    o.iter_mut().zip(value(j)).for_each(|(o, &v)| *o += alpha * v);
                }
            }
        },
    );
}

/// The dot product with eight partial sums, summed in the same order as the CPU backend's
/// attention, so cached and uncached scores agree bit for bit.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8.remainder().iter().zip(b8.remainder()).map(|(x, y)| x * y).sum();
    let mut lanes = [0.0f32; 8];
    for (x, y) in a8.zip(b8) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}
