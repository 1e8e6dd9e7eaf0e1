//! The decoder's inference forward with a key/value cache, on any [`Backend`]: the ops of the
//! training forward ([`crate::model::Decoder::layer_forward`]) in the same order, except that
//! each layer appends the new tokens' keys and values to the cache and attention reads every
//! earlier position from there ([`Backend::attention_decode`]), so each new token costs one row
//! of work per layer.
//!
//! The cache lives on the backend, one key and one value buffer per layer, sized when it is made
//! (for a generation: prompt + new tokens) so decoding allocates nothing; appending is a copy at
//! the next free row. The working buffers are kept with the cache and reused by every call that
//! fits them.

use std::ops::Range;
use std::sync::Arc;

use crate::backend::cpu::Cpu;
use crate::backend::{AttentionShape, Backend, DecodeShape, FloatKind};
use crate::error::{Error, Result};
use crate::model::{HostParams, ModelLayout};
use crate::spec::ModelSpec;

use FloatKind::{Accum, Activation};

/// A model's weights on a backend: one buffer per unit (the host slabs, in the backend's
/// weight precision) and the RoPE frequencies.
pub(super) struct Model<B: Backend> {
    pub spec: ModelSpec,
    layout: Arc<ModelLayout>,
    units: Vec<B::Floats>,
    inv_freq: B::Floats, // [hd / 2]
}

impl<B: Backend> Model<B> {
    /// Moves `params` onto the backend (the CPU keeps the slabs themselves).
    pub fn new(b: &B, spec: ModelSpec, params: HostParams) -> Result<Self> {
        let layout = params.layout.clone();
        let units = params
            .units
            .into_iter()
            .map(|unit| b.upload_vec(unit, Activation))
            .collect::<Result<Vec<_>>>()?;
        let inv_freq = b.upload_vec(spec.inv_freq(), Accum)?;
        Ok(Model { spec, layout, units, inv_freq })
    }
}

/// Keys and values of every position seen so far, per layer, on the backend: `k[l]` and `v[l]`
/// are `[capacity, nkv hd]`, of which the first `len` rows are filled (keys after RoPE).
pub struct KvCache<B: Backend = Cpu> {
    layers: usize,
    k: Vec<B::Floats>,
    v: Vec<B::Floats>,
    len: usize,
    capacity: usize,
    work: Option<Work<B>>,
}

impl<B: Backend> std::fmt::Debug for KvCache<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("layers", &self.layers)
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl<B: Backend> KvCache<B> {
    /// An empty cache of `layers` layers that allocates on first use.
    pub(super) fn empty(layers: usize) -> Self {
        KvCache { layers, k: Vec::new(), v: Vec::new(), len: 0, capacity: 0, work: None }
    }

    /// An empty cache for `spec` with room for `capacity` positions (allocated now).
    pub(super) fn new(b: &B, spec: &ModelSpec, capacity: usize) -> Result<Self> {
        let mut cache = KvCache::empty(spec.layers);
        if capacity > 0 {
            cache.reserve(b, spec, capacity)?;
        }
        Ok(cache)
    }

    /// Positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the cache holds before it must grow.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets every position (start a new sequence); keeps the buffers.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Makes room for `positions` positions, keeping what is cached. A cache made for a whole
    /// generation never grows; one made empty doubles, so growing costs amortised O(1) per token.
    fn reserve(&mut self, b: &B, spec: &ModelSpec, positions: usize) -> Result<()> {
        if positions <= self.capacity {
            return Ok(());
        }
        let capacity = positions.max(2 * self.capacity).min(spec.max_positions.max(positions));
        let width = spec.kv_heads * spec.head_dim;
        let filled = 0..self.len * width;
        let grow = |old: Option<&B::Floats>| -> Result<B::Floats> {
            let mut new = b.alloc(capacity * width, Activation)?;
            if let Some(old) = old {
                b.copy(b.view_mut(&mut new, filled.clone()), b.view(old, filled.clone()))?;
            }
            Ok(new)
        };
        let k = (0..spec.layers).map(|l| grow(self.k.get(l))).collect::<Result<Vec<_>>>()?;
        let v = (0..spec.layers).map(|l| grow(self.v.get(l))).collect::<Result<Vec<_>>>()?;
        (self.k, self.v, self.capacity) = (k, v, capacity);
        Ok(())
    }
}

/// One call's intermediates for up to `tokens` tokens and `rows` logit rows.
struct Work<B: Backend> {
    tokens: usize,
    rows: usize,
    ids: B::Ints,       // [n]
    positions: B::Ints, // [n]
    x: B::Floats,       // [n, H] the residual stream
    normed: B::Floats,  // [n, H]
    rstd: B::Floats,    // [n]
    qkv_pre: B::Floats, // [n, Dqkv] before the q/k norm (qwen3 only)
    qk_rstd: B::Floats, // [n, nq + nkv]
    qkv: B::Floats,     // [n, Dqkv] after the q/k norm and RoPE
    q: B::Floats,       // [n, nq hd] the queries, contiguous
    att: B::Floats,     // [n, nq hd]
    tmp: B::Floats,     // [n, H]
    gate_up: B::Floats, // [n, 2I]
    act: B::Floats,     // [n, I]
    logits: B::Floats,  // [rows, V]
}

impl<B: Backend> Work<B> {
    fn new(b: &B, spec: &ModelSpec, tokens: usize, rows: usize) -> Result<Self> {
        let (n, h, i) = (tokens, spec.hidden, spec.intermediate);
        let (dqkv, datt) = (spec.qkv_width(), spec.attn_width());
        let qk = if spec.qk_norm { 1 } else { 0 };
        Ok(Work {
            tokens,
            rows,
            ids: b.alloc_ints(n)?,
            positions: b.alloc_ints(n)?,
            x: b.alloc(n * h, Activation)?,
            normed: b.alloc(n * h, Activation)?,
            rstd: b.alloc(n, Accum)?,
            qkv_pre: b.alloc(qk * n * dqkv, Activation)?,
            qk_rstd: b.alloc(qk * n * (spec.q_heads + spec.kv_heads), Accum)?,
            qkv: b.alloc(n * dqkv, Activation)?,
            q: b.alloc(n * datt, Activation)?,
            att: b.alloc(n * datt, Activation)?,
            tmp: b.alloc(n * h, Activation)?,
            gate_up: b.alloc(n * 2 * i, Activation)?,
            act: b.alloc(n * i, Activation)?,
            // f32 on every backend: sampling reads them.
            logits: b.alloc(rows * spec.vocab, Accum)?,
        })
    }
}

/// Runs `ids` at positions `cache.len()..`, appends their keys and values to the cache and
/// returns the logits `[rows, V]` of the last `rows` new positions. The cache is unchanged
/// (same length) when this fails.
pub(super) fn forward<B: Backend>(
    b: &B,
    model: &Model<B>,
    cache: &mut KvCache<B>,
    ids: &[u32],
    rows: usize,
) -> Result<Vec<f32>> {
    let spec = &model.spec;
    let n = ids.len();
    if n == 0 || rows == 0 || rows > n {
        return Err(Error::invalid(format!("cannot return {rows} logit rows for {n} new tokens")));
    }
    if cache.layers != spec.layers {
        return Err(Error::invalid(format!(
            "the cache was made for {} layers, the model has {}",
            cache.layers, spec.layers
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
    let ids_i32: Vec<i32> = ids
        .iter()
        .map(|&id| {
            i32::try_from(id).map_err(|_| Error::invalid(format!("token id {id} too large")))
        })
        .collect::<Result<_>>()?;
    let positions: Vec<i32> = (start..start + n)
        .map(|p| i32::try_from(p).map_err(|_| Error::invalid("position too large")))
        .collect::<Result<_>>()?;

    cache.reserve(b, spec, start + n)?;
    if cache.work.as_ref().is_none_or(|w| w.tokens < n || w.rows < rows) {
        let (tokens, old_rows) = cache.work.as_ref().map_or((0, 0), |w| (w.tokens, w.rows));
        cache.work = None; // free the old buffers before allocating larger ones
        cache.work = Some(Work::new(b, spec, tokens.max(n), old_rows.max(rows))?);
    }
    let KvCache { k: k_cache, v: v_cache, work, .. } = cache;
    let w = work.as_mut().ok_or_else(|| Error::invalid("no working buffers"))?;
    b.upload_ints(&mut w.ids, &ids_i32)?;
    b.upload_ints(&mut w.positions, &positions)?;

    let (h, inter, hd) = (spec.hidden, spec.intermediate, spec.head_dim);
    let (dqkv, datt) = (spec.qkv_width(), spec.attn_width());
    let kv_width = spec.kv_heads * hd;
    let layout = &model.layout;
    let r = &layout.layer;
    let th = 0..n * h;
    let table = b.view(&model.units[0], 0..spec.vocab * h);
    b.embedding_forward(b.view_mut(&mut w.x, th.clone()), &w.ids, table, n, h)?;

    for l in 0..spec.layers {
        let unit = &model.units[l + 1];
        let wv = |range: &Range<usize>| b.view(unit, range.clone());
        let window = spec.windows.get(l).copied().flatten();
        let shape = AttentionShape {
            tokens: n,
            q_heads: spec.q_heads,
            kv_heads: spec.kv_heads,
            head_dim: hd,
            docs: 1,
            window,
        };
        b.rmsnorm_forward(
            b.view_mut(&mut w.normed, th.clone()),
            b.view_mut(&mut w.rstd, 0..n),
            b.view(&w.x, th.clone()),
            wv(&r.ln1),
            n,
            h,
            spec.rms_eps,
        )?;
        // The projection lands in `qkv` directly unless qwen3's q/k norm reads it afterwards.
        let proj = if spec.qk_norm { &mut w.qkv_pre } else { &mut w.qkv };
        b.matmul_forward(
            b.view_mut(proj, 0..n * dqkv),
            b.view(&w.normed, th.clone()),
            wv(&r.qkv_w),
            n,
            h,
            dqkv,
        )?;
        if let Some(bias) = &r.qkv_b {
            b.bias_forward(b.view_mut(proj, 0..n * dqkv), wv(bias), n, dqkv)?;
        }
        if let Some(norm) = &r.qk_norm {
            let heads = spec.q_heads + spec.kv_heads;
            b.head_rmsnorm_forward(
                b.view_mut(&mut w.qkv, 0..n * dqkv),
                b.view_mut(&mut w.qk_rstd, 0..n * heads),
                b.view(&w.qkv_pre, 0..n * dqkv),
                wv(norm),
                &shape,
                spec.rms_eps,
            )?;
        }
        b.rope_forward(
            b.view_mut(&mut w.qkv, 0..n * dqkv),
            &w.positions,
            b.view(&model.inv_freq, 0..hd / 2),
            &shape,
        )?;

        // Each new row is `[q | k | v]`: its keys and values go to the next free cache rows.
        for t in 0..n {
            let (row, at) = (t * dqkv + datt, (start + t) * kv_width);
            let (k, v) = (row..row + kv_width, row + kv_width..row + 2 * kv_width);
            b.copy(b.view_mut(&mut k_cache[l], at..at + kv_width), b.view(&w.qkv, k))?;
            b.copy(b.view_mut(&mut v_cache[l], at..at + kv_width), b.view(&w.qkv, v))?;
        }
        // One token's queries are already contiguous; several tokens' are gathered.
        let q = if n == 1 {
            b.view(&w.qkv, 0..datt)
        } else {
            for t in 0..n {
                let src = b.view(&w.qkv, t * dqkv..t * dqkv + datt);
                b.copy(b.view_mut(&mut w.q, t * datt..(t + 1) * datt), src)?;
            }
            b.view(&w.q, 0..n * datt)
        };
        let cached = 0..(start + n) * kv_width;
        b.attention_decode(
            b.view_mut(&mut w.att, 0..n * datt),
            q,
            b.view(&k_cache[l], cached.clone()),
            b.view(&v_cache[l], cached),
            &DecodeShape {
                past: start,
                tokens: n,
                q_heads: spec.q_heads,
                kv_heads: spec.kv_heads,
                head_dim: hd,
                window,
            },
        )?;
        b.matmul_forward(
            b.view_mut(&mut w.tmp, th.clone()),
            b.view(&w.att, 0..n * datt),
            wv(&r.o_w),
            n,
            datt,
            h,
        )?;
        if let Some(bias) = &r.o_b {
            b.bias_forward(b.view_mut(&mut w.tmp, th.clone()), wv(bias), n, h)?;
        }
        b.add_assign(b.view_mut(&mut w.x, th.clone()), b.view(&w.tmp, th.clone()))?;

        b.rmsnorm_forward(
            b.view_mut(&mut w.normed, th.clone()),
            b.view_mut(&mut w.rstd, 0..n),
            b.view(&w.x, th.clone()),
            wv(&r.ln2),
            n,
            h,
            spec.rms_eps,
        )?;
        b.matmul_forward(
            b.view_mut(&mut w.gate_up, 0..n * 2 * inter),
            b.view(&w.normed, th.clone()),
            wv(&r.gate_up_w),
            n,
            h,
            2 * inter,
        )?;
        b.swiglu_forward(
            b.view_mut(&mut w.act, 0..n * inter),
            b.view(&w.gate_up, 0..n * 2 * inter),
            n,
            inter,
        )?;
        b.matmul_forward(
            b.view_mut(&mut w.tmp, th.clone()),
            b.view(&w.act, 0..n * inter),
            wv(&r.down_w),
            n,
            inter,
            h,
        )?;
        b.add_assign(b.view_mut(&mut w.x, th.clone()), b.view(&w.tmp, th.clone()))?;
    }

    let head = &model.units[layout.head_unit()];
    b.rmsnorm_forward(
        b.view_mut(&mut w.normed, 0..rows * h),
        b.view_mut(&mut w.rstd, 0..rows),
        b.view(&w.x, (n - rows) * h..n * h),
        b.view(head, layout.head.norm.clone()),
        rows,
        h,
        spec.rms_eps,
    )?;
    let lm = match &layout.head.lm_head {
        Some(range) => b.view(head, range.clone()),
        None => table,
    };
    let logits = 0..rows * spec.vocab;
    b.matmul_forward(
        b.view_mut(&mut w.logits, logits.clone()),
        b.view(&w.normed, 0..rows * h),
        lm,
        rows,
        h,
        spec.vocab,
    )?;
    let mut out = vec![0.0f32; rows * spec.vocab];
    b.download(&mut out, b.view(&w.logits, logits))?;
    cache.len += n;
    Ok(out)
}
