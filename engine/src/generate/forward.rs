//! The decoder's inference forward with a key/value cache, on any [`Backend`]. Each layer is the
//! training forward itself ([`Decoder::layer_forward`]) with [`Keys::Cached`]: the new tokens
//! append their keys and values to the cache and attend to every earlier position there
//! ([`AttentionOps::attention_decode`]), so each new token costs one row of work per layer and a
//! family's layer is defined once, for training and generation alike.
//!
//! The cache lives on the backend, one key and one value buffer per layer, sized when it is made
//! (for a generation: prompt + new tokens) so decoding allocates nothing; appending is a copy at
//! the next free row. The working buffers are kept with the cache and reused by every call that
//! fits them.

use crate::backend::cpu::Cpu;
use crate::backend::{Backend, FloatKind, IGNORE};
use crate::error::{Error, Result};
use crate::model::{
    Decoder, DeviceBatch, HeadScratch, HeadWeights, HostParams, Keys, LayerAt, LayerScratch,
    RouterStats,
};
use crate::spec::ModelSpec;

use FloatKind::{Accum, Activation};

/// A model's weights on a backend: one buffer per unit (the host slabs, in the backend's
/// weight precision) and the decoder that reads them.
pub(super) struct Model<B: Backend> {
    pub spec: ModelSpec,
    pub decoder: Decoder<B>,
    pub units: Vec<B::Floats>,
}

impl<B: Backend> Model<B> {
    /// Moves `params` onto the backend (the CPU keeps the slabs themselves).
    pub fn new(b: &B, spec: ModelSpec, params: HostParams) -> Result<Self> {
        let layout = params.layout.clone();
        let decoder = Decoder::new(b, &spec, layout.layers.clone(), layout.head.clone())?;
        let units = params
            .units
            .into_iter()
            .map(|unit| b.upload_vec(unit, Activation))
            .collect::<Result<Vec<_>>>()?;
        Ok(Model { spec, decoder, units })
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
    batch: DeviceBatch<B>, // ids and positions of the new tokens
    x: [B::Floats; 2],     // [n, H] the residual stream, into and out of a layer
    layer: LayerScratch<B>,
    head: HeadScratch<B>,
    logits: B::Floats, // [rows, V]
}

impl<B: Backend> Work<B> {
    fn new(b: &B, spec: &ModelSpec, tokens: usize, rows: usize) -> Result<Self> {
        let n = tokens * spec.hidden;
        Ok(Work {
            tokens,
            rows,
            batch: DeviceBatch::new(b, tokens)?,
            x: [b.alloc(n, Activation)?, b.alloc(n, Activation)?],
            layer: LayerScratch::for_generation(b, spec, tokens)?,
            head: HeadScratch::new(b, spec, rows)?,
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
    let n_i32 = i32::try_from(n).map_err(|_| Error::invalid("too many new tokens"))?;

    cache.reserve(b, spec, start + n)?;
    if cache.work.as_ref().is_none_or(|w| w.tokens < n || w.rows < rows) {
        let (tokens, old_rows) = cache.work.as_ref().map_or((0, 0), |w| (w.tokens, w.rows));
        cache.work = None; // free the old buffers before allocating larger ones
        cache.work = Some(Work::new(b, spec, tokens.max(n), old_rows.max(rows))?);
    }
    let KvCache { k: k_cache, v: v_cache, work, .. } = cache;
    let w = work.as_mut().ok_or_else(|| Error::invalid("no working buffers"))?;
    // Targets and documents are the training forward's; one sequence, nothing trained.
    w.batch.upload(b, &ids_i32, &positions, &vec![IGNORE; n], &[0, n_i32])?;

    let d = &model.decoder;
    let embed = &model.units[0];
    let [x, x_next] = &mut w.x;
    d.embed_forward(b, x, embed, &w.batch)?;
    for (l, (k, v)) in k_cache.iter_mut().zip(v_cache.iter_mut()).enumerate() {
        let keys = Keys::Cached { k, v, past: start };
        let at =
            LayerAt { layer: l, batch: &w.batch, keys, router: RouterStats::Off, output: true };
        d.layer_forward(b, x_next, x, &model.units[l + 1], &mut w.layer, at)?;
        std::mem::swap(x, x_next);
    }

    let head = &model.units[model.units.len() - 1];
    let weights = HeadWeights { head, embed };
    d.logits(b, &mut w.logits, &mut w.head, x, n - rows..n, weights)?;
    let logits = 0..rows * spec.vocab;
    let mut out = vec![0.0f32; rows * spec.vocab];
    b.download(&mut out, b.view(&w.logits, logits))?;
    d.finish_logits(&mut out);
    cache.len += n;
    Ok(out)
}
