//! Batched inference for evaluation and serving: many sequences in one layer-major forward,
//! each with its own key/value rows ([`Keys::Batch`]), so every projection and MLP runs once
//! over all the sequences' new tokens and each layer's weights are read once per forward for
//! the whole batch.
//!
//! The weights come from [`Units`]: [`Resident`] (every unit already on the backend, a loaded
//! [`super::Generator`]) or [`Streamed`] (the embedding and head on the backend, each layer
//! uploaded from host memory into one slot as the forward reaches it, as training streams
//! them), so a model that does not fit the device is evaluated with one layer there at a time.
//!
//! Two uses: [`generate_batch`] (prompts prefilled in groups within a token budget, then one
//! token per sequence per forward until each stops) and [`score_batch`] (the log-likelihood of
//! a continuation after a context, lm-evaluation-harness's `loglikelihood`).

use std::ops::Range;

use crate::backend::{Backend, FloatKind, IGNORE};
use crate::error::{Error, Result};
use crate::model::{
    Decoder, DeviceBatch, HeadScratch, HeadWeights, HostParams, Keys, LayerAt, LayerScratch,
    ModelLayout, RouterStats, SeqRows,
};
use crate::spec::ModelSpec;
use crate::store::HostStore;

use super::Generated;
use super::sample::{GenerateOptions, Sampler};

use FloatKind::{Accum, Activation};

/// Logit rows computed at once: a chunk of at most this many bytes of f32 logits (and at least
/// one row), so scoring long continuations never holds `[tokens, V]` logits at once.
const LOGIT_CHUNK_BYTES: usize = 64 << 20;

/// Model units on the host, read one at a time: the f32 weights of unit `u` (0 the embedding,
/// `1..=layers` the layers, the last the head).
pub trait HostUnits: Sync {
    fn units(&self) -> usize;
    /// Calls `f` with unit `u`'s f32 weights.
    fn with_unit(&self, u: usize, f: &mut dyn FnMut(&[f32]) -> Result<()>) -> Result<()>;
}

impl HostUnits for HostParams {
    fn units(&self) -> usize {
        self.units.len()
    }
    fn with_unit(&self, u: usize, f: &mut dyn FnMut(&[f32]) -> Result<()>) -> Result<()> {
        let unit = self.units.get(u).ok_or_else(|| Error::invalid(format!("no unit {u}")))?;
        f(unit)
    }
}

impl HostUnits for HostStore {
    fn units(&self) -> usize {
        HostStore::units(self)
    }
    /// The master weights, under the unit's lock (the optimizer does not write them meanwhile).
    fn with_unit(&self, u: usize, f: &mut dyn FnMut(&[f32]) -> Result<()>) -> Result<()> {
        let state = self.lock(u)?;
        f(state.master.as_f32())
    }
}

/// Where a batched forward finds each unit's weights on the backend.
pub trait Units<B: Backend> {
    /// Layer `l`'s slab (unit `l + 1`), ready for compute until the next call.
    fn layer(&mut self, b: &B, l: usize) -> Result<&B::Floats>;
    fn embed(&self) -> &B::Floats;
    fn head(&self) -> &B::Floats;
    /// Device bytes the weights hold.
    fn device_bytes(&self, b: &B) -> usize;
    /// Whether each forward uploads the layers from host memory.
    fn streamed(&self) -> bool;
}

/// Every unit on the backend already.
pub struct Resident<'a, B: Backend>(pub &'a [B::Floats]);

impl<B: Backend> Units<B> for Resident<'_, B> {
    fn layer(&mut self, _b: &B, l: usize) -> Result<&B::Floats> {
        self.0.get(l + 1).ok_or_else(|| Error::invalid(format!("no layer {l}")))
    }
    fn embed(&self) -> &B::Floats {
        &self.0[0]
    }
    fn head(&self) -> &B::Floats {
        &self.0[self.0.len() - 1]
    }
    fn device_bytes(&self, b: &B) -> usize {
        self.0.iter().map(|u| b.len(u) * b.elem_bytes(Activation)).sum()
    }
    fn streamed(&self) -> bool {
        false
    }
}

/// The embedding and head on the backend; each layer uploaded from the host into one slot when
/// the forward reaches it (once per forward, whatever the batch).
pub struct Streamed<'h, B: Backend> {
    host: &'h dyn HostUnits,
    embed: B::Floats,
    head: B::Floats,
    slot: B::Floats,
    /// The layer the slot holds, so consecutive calls for the same layer upload once.
    holds: Option<usize>,
}

impl<'h, B: Backend> Streamed<'h, B> {
    /// Uploads the embedding and head of `host` (laid out as `layout`) and makes a slot as
    /// large as the largest layer.
    pub fn new(b: &B, layout: &ModelLayout, host: &'h dyn HostUnits) -> Result<Self> {
        let units = layout.units.len();
        if host.units() != units || units < 2 {
            return Err(Error::invalid(format!(
                "the host holds {} units, the model has {units}",
                host.units()
            )));
        }
        let upload = |u: usize| -> Result<B::Floats> {
            let mut out = None;
            host.with_unit(u, &mut |w| {
                out = Some(b.upload_vec(w.to_vec(), Activation)?);
                Ok(())
            })?;
            out.ok_or_else(|| Error::invalid(format!("unit {u} was not read")))
        };
        let largest = layout.units[1..units - 1].iter().map(|u| u.len).max().unwrap_or(0);
        Ok(Streamed {
            host,
            embed: upload(0)?,
            head: upload(units - 1)?,
            slot: b.alloc(largest.max(1), Activation)?,
            holds: None,
        })
    }
}

impl<B: Backend> Units<B> for Streamed<'_, B> {
    fn layer(&mut self, b: &B, l: usize) -> Result<&B::Floats> {
        if self.holds != Some(l) {
            self.holds = None;
            let slot = &mut self.slot;
            self.host.with_unit(l + 1, &mut |w| {
                if w.len() > b.len(slot) {
                    return Err(Error::invalid(format!("layer {l} is larger than its slot")));
                }
                b.upload(b.view_mut(slot, 0..w.len()), w)
            })?;
            self.holds = Some(l);
        }
        Ok(&self.slot)
    }
    fn embed(&self) -> &B::Floats {
        &self.embed
    }
    fn head(&self) -> &B::Floats {
        &self.head
    }
    fn device_bytes(&self, b: &B) -> usize {
        [&self.embed, &self.head, &self.slot].iter().map(|u| b.len(u)).sum::<usize>()
            * b.elem_bytes(Activation)
    }
    fn streamed(&self) -> bool {
        true
    }
}

/// What a batched forward runs with: the backend, the model's shape and its decoder.
pub struct Model<'a, B: Backend> {
    pub b: &'a B,
    pub spec: &'a ModelSpec,
    pub decoder: &'a Decoder<B>,
}

/// Bounds of one batched call: sequences at once and new tokens per forward (a prefill of
/// more prompt tokens than this runs in several forwards).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    pub sequences: usize,
    pub tokens: usize,
}

impl BatchLimits {
    pub fn check(&self) -> Result<()> {
        if self.sequences == 0 || self.tokens == 0 {
            return Err(Error::invalid("a batch needs room for at least one sequence and token"));
        }
        Ok(())
    }
}

/// Keys and values of a batch of sequences: per layer one buffer holding every sequence's rows
/// side by side (sequence `i` from row `seqs[i].base`, `capacity[i]` rows).
struct BatchCache<B: Backend> {
    k: Vec<B::Floats>,
    v: Vec<B::Floats>,
    seqs: Vec<SeqRows>, // `rows` unused here; `past` is the sequence's cached length
    capacity: Vec<usize>,
}

impl<B: Backend> BatchCache<B> {
    fn new(b: &B, spec: &ModelSpec, capacity: &[usize]) -> Result<Self> {
        let width = spec.kv_heads * spec.head_dim;
        let total: usize = capacity.iter().sum();
        let mut seqs = Vec::with_capacity(capacity.len());
        let mut base = 0;
        for &c in capacity {
            seqs.push(SeqRows { base, past: 0, rows: 0 });
            base += c;
        }
        let alloc = || b.alloc(total.max(1) * width, Activation);
        let k = (0..spec.layers).map(|_| alloc()).collect::<Result<Vec<_>>>()?;
        let v = (0..spec.layers).map(|_| alloc()).collect::<Result<Vec<_>>>()?;
        Ok(BatchCache { k, v, seqs, capacity: capacity.to_vec() })
    }
}

/// One forward's buffers for up to `tokens` new tokens and `rows` logit rows at a time.
struct Work<B: Backend> {
    tokens: usize,
    rows: usize,
    batch: DeviceBatch<B>,
    x: [B::Floats; 2],
    layer: LayerScratch<B>,
    head: HeadScratch<B>,
    gathered: B::Floats, // [rows, H] the hidden rows whose logits are wanted
    logits: B::Floats,   // [rows, V]
}

impl<B: Backend> Work<B> {
    fn new(b: &B, spec: &ModelSpec, tokens: usize) -> Result<Self> {
        let rows = logit_rows(spec).min(tokens).max(1);
        Ok(Work {
            tokens,
            rows,
            batch: DeviceBatch::new(b, tokens)?,
            x: [
                b.alloc(tokens * spec.hidden, Activation)?,
                b.alloc(tokens * spec.hidden, Activation)?,
            ],
            layer: LayerScratch::for_generation(b, spec, tokens)?,
            head: HeadScratch::new(b, spec, rows)?,
            gathered: b.alloc(rows * spec.hidden, Activation)?,
            logits: b.alloc(rows * spec.vocab, Accum)?,
        })
    }
}

/// Called with (sequence, row of its new tokens, logits `[V]`).
type OnLogits<'a> = dyn FnMut(usize, usize, &[f32]) -> Result<()> + 'a;

fn logit_rows(spec: &ModelSpec) -> usize {
    (LOGIT_CHUNK_BYTES / (4 * spec.vocab.max(1))).max(1)
}

/// Runs `new[i]` after what sequence `i` has cached (an empty slice leaves it alone), all in
/// one layer-major pass, and hands `on_logits(i, row, logits)` the logits `[V]` of the rows
/// `want[i]` (indices into `new[i]`), in order.
fn forward<B: Backend, U: Units<B>>(
    m: &Model<'_, B>,
    units: &mut U,
    cache: &mut BatchCache<B>,
    work: &mut Option<Work<B>>,
    new: &[&[u32]],
    want: &[Range<usize>],
    on_logits: &mut OnLogits<'_>,
) -> Result<()> {
    let (b, spec, d) = (m.b, m.spec, m.decoder);
    if new.len() != cache.seqs.len() || want.len() != new.len() {
        return Err(Error::invalid("one slice of new tokens and one row range per sequence"));
    }
    let mut ids = Vec::new();
    let mut positions = Vec::new();
    let mut cu_seqlens = vec![0i32];
    let mut active = Vec::new(); // (sequence, its first batch row)
    for (i, tokens) in new.iter().enumerate() {
        if tokens.is_empty() {
            continue;
        }
        let seq = cache.seqs[i];
        let end = seq.past + tokens.len();
        if end > cache.capacity[i] || end > spec.max_positions {
            return Err(Error::invalid(format!(
                "{end} positions exceed the sequence's room of {} (the model's context is {})",
                cache.capacity[i], spec.max_positions
            )));
        }
        if want[i].end > tokens.len() {
            return Err(Error::invalid("a wanted logit row is past the sequence's new tokens"));
        }
        active.push((i, ids.len()));
        for (t, &id) in tokens.iter().enumerate() {
            ids.push(i32::try_from(id).map_err(|_| Error::invalid(format!("token id {id}")))?);
            positions.push(i32::try_from(seq.past + t).map_err(|_| Error::invalid("position"))?);
        }
        cu_seqlens.push(i32::try_from(ids.len()).map_err(|_| Error::invalid("too many tokens"))?);
    }
    let t = ids.len();
    if t == 0 {
        return Ok(());
    }
    if work.as_ref().is_none_or(|w| w.tokens < t) {
        *work = None; // free the old buffers before allocating larger ones
        *work = Some(Work::new(b, spec, t)?);
    }
    let w = work.as_mut().ok_or_else(|| Error::invalid("no working buffers"))?;
    w.batch.upload(b, &ids, &positions, &vec![IGNORE; t], &cu_seqlens)?;
    let rows: Vec<SeqRows> =
        active.iter().map(|&(i, _)| SeqRows { rows: new[i].len(), ..cache.seqs[i] }).collect();

    let [x, x_next] = &mut w.x;
    d.embed_forward(b, x, units.embed(), &w.batch)?;
    for l in 0..spec.layers {
        let weights = units.layer(b, l)?;
        let keys = Keys::Batch { k: &mut cache.k[l], v: &mut cache.v[l], seqs: &rows };
        let at =
            LayerAt { layer: l, batch: &w.batch, keys, router: RouterStats::Off, output: true };
        d.layer_forward(b, x_next, x, weights, &mut w.layer, at)?;
        std::mem::swap(x, x_next);
    }

    // The wanted rows, gathered a chunk at a time so the head's product is one GEMM per chunk.
    let h = spec.hidden;
    let wanted: Vec<(usize, usize, usize)> = active
        .iter()
        .flat_map(|&(i, first)| want[i].clone().map(move |r| (i, r, first + r)))
        .collect();
    let mut host = vec![0.0f32; w.rows * spec.vocab];
    for chunk in wanted.chunks(w.rows) {
        for (j, &(_, _, row)) in chunk.iter().enumerate() {
            b.copy(
                b.view_mut(&mut w.gathered, j * h..(j + 1) * h),
                b.view(x, row * h..(row + 1) * h),
            )?;
        }
        let weights = HeadWeights { head: units.head(), embed: units.embed() };
        d.logits(b, &mut w.logits, &mut w.head, &w.gathered, 0..chunk.len(), weights)?;
        let out = &mut host[..chunk.len() * spec.vocab];
        b.download(out, b.view(&w.logits, 0..chunk.len() * spec.vocab))?;
        d.finish_logits(out);
        for (j, &(i, r, _)) in chunk.iter().enumerate() {
            on_logits(i, r, &out[j * spec.vocab..(j + 1) * spec.vocab])?;
        }
    }
    for &(i, _) in &active {
        cache.seqs[i].past += new[i].len();
    }
    Ok(())
}

/// Groups of consecutive items whose `cost` sums to at most `budget` (an item larger than the
/// budget alone), at most `max` items each.
pub(crate) fn groups(costs: &[usize], budget: usize, max: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut sum = 0;
    for (i, &c) in costs.iter().enumerate() {
        if i > start && (sum + c > budget || i - start == max) {
            out.push(start..i);
            (start, sum) = (i, 0);
        }
        sum += c;
    }
    if start < costs.len() {
        out.push(start..costs.len());
    }
    out
}

/// Generates after each of `prompts`, `limits.sequences` at a time: each group's prompts are
/// prefilled (in forwards of at most `limits.tokens` prompt tokens), then every unfinished
/// sequence takes one token per forward until it stops at an end token or `max_new_tokens`.
/// Each sequence samples with its own [`Sampler`] seeded by `options.seed` and its index, so a
/// prompt's answer does not depend on its neighbours.
pub fn generate_batch<B: Backend, U: Units<B>>(
    m: &Model<'_, B>,
    units: &mut U,
    prompts: &[Vec<u32>],
    options: &GenerateOptions,
    stop: &[u32],
    limits: BatchLimits,
) -> Result<Vec<Generated>> {
    limits.check()?;
    let spec = m.spec;
    for (i, p) in prompts.iter().enumerate() {
        if p.is_empty() {
            return Err(Error::invalid(format!("prompt {i} has no tokens")));
        }
        if p.len() >= spec.max_positions {
            return Err(Error::invalid(format!(
                "prompt {i} has {} tokens; the model's context is {}",
                p.len(),
                spec.max_positions
            )));
        }
    }
    let mut out = Vec::with_capacity(prompts.len());
    let mut work = None;
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    for group in groups(&vec![1; prompts.len()], limits.sequences, limits.sequences) {
        let prompts = &prompts[group.clone()];
        let capacity: Vec<usize> = prompts
            .iter()
            .map(|p| (p.len() + options.max_new_tokens).min(spec.max_positions))
            .collect();
        let mut cache = BatchCache::new(m.b, spec, &capacity)?;
        let mut samplers = group
            .clone()
            .map(|i| {
                let seed = options.seed.wrapping_add(i as u64);
                Sampler::new(&GenerateOptions { seed, ..options.clone() })
            })
            .collect::<Result<Vec<_>>>()?;
        let n = prompts.len();
        let mut next: Vec<Option<u32>> = vec![None; n];
        let mut results: Vec<Generated> =
            vec![Generated { ids: Vec::new(), stopped_at_eos: false }; n];
        let mut pick = |i: usize, logits: &[f32], next: &mut Vec<Option<u32>>| -> Result<()> {
            next[i] = Some(samplers[i].pick(logits)?);
            Ok(())
        };
        // Prefill: the prompts in forwards of at most `limits.tokens` tokens, each sequence
        // whole in one forward (a longer prompt alone), the last row's logits kept.
        for part in groups(&lens[group.clone()], limits.tokens, n) {
            let new: Vec<&[u32]> =
                (0..n).map(|i| if part.contains(&i) { &prompts[i][..] } else { &[][..] }).collect();
            let want: Vec<Range<usize>> =
                (0..n)
                    .map(|i| {
                        if part.contains(&i) {
                            prompts[i].len() - 1..prompts[i].len()
                        } else {
                            0..0
                        }
                    })
                    .collect();
            let mut chosen = vec![None; n];
            forward(m, units, &mut cache, &mut work, &new, &want, &mut |i, _, logits| {
                pick(i, logits, &mut chosen)
            })?;
            for i in part {
                next[i] = chosen[i];
            }
        }
        let mut done = vec![options.max_new_tokens == 0; n];
        loop {
            // Take each sequence's chosen token, or finish it.
            let mut feed: Vec<Vec<u32>> = vec![Vec::new(); n];
            for i in 0..n {
                if done[i] {
                    continue;
                }
                let Some(id) = next[i].take() else { continue };
                if stop.contains(&id) {
                    (done[i], results[i].stopped_at_eos) = (true, true);
                    continue;
                }
                results[i].ids.push(id);
                let room = cache.seqs[i].past < capacity[i];
                if results[i].ids.len() >= options.max_new_tokens || !room {
                    done[i] = true;
                    continue;
                }
                feed[i].push(id);
            }
            if done.iter().all(|&d| d) {
                break;
            }
            let new: Vec<&[u32]> = feed.iter().map(Vec::as_slice).collect();
            let want: Vec<Range<usize>> =
                feed.iter().map(|f| if f.is_empty() { 0..0 } else { 0..1 }).collect();
            let mut chosen = vec![None; n];
            forward(m, units, &mut cache, &mut work, &new, &want, &mut |i, _, logits| {
                pick(i, logits, &mut chosen)
            })?;
            next = chosen;
        }
        out.extend(results);
    }
    Ok(out)
}

/// The log-likelihood of a continuation after its context.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scored {
    /// Σ log p(continuation token | everything before it), in nats.
    pub logprob: f64,
    /// Whether every continuation token was the most likely one (lm-evaluation-harness's
    /// `is_greedy`).
    pub greedy: bool,
    /// Continuation tokens scored.
    pub tokens: usize,
}

/// The log-likelihood of each `(context, continuation)` pair, sequences batched within
/// `limits` (each pair one sequence of `context + continuation` tokens, its continuation's
/// rows' logits read). The context must not be empty (the first token has nothing to be
/// predicted from) and the continuation must not be empty.
pub fn score_batch<B: Backend, U: Units<B>>(
    m: &Model<'_, B>,
    units: &mut U,
    pairs: &[(Vec<u32>, Vec<u32>)],
    limits: BatchLimits,
) -> Result<Vec<Scored>> {
    limits.check()?;
    let spec = m.spec;
    let mut seqs = Vec::with_capacity(pairs.len());
    for (i, (context, continuation)) in pairs.iter().enumerate() {
        if context.is_empty() || continuation.is_empty() {
            return Err(Error::invalid(format!("item {i}: an empty context or continuation")));
        }
        let whole: Vec<u32> = context.iter().chain(continuation).copied().collect();
        if whole.len() > spec.max_positions {
            return Err(Error::invalid(format!(
                "item {i} has {} tokens; the model's context is {}",
                whole.len(),
                spec.max_positions
            )));
        }
        seqs.push(whole);
    }
    let lens: Vec<usize> = seqs.iter().map(Vec::len).collect();
    let mut out = vec![Scored { logprob: 0.0, greedy: true, tokens: 0 }; pairs.len()];
    let mut work = None;
    for group in groups(&lens, limits.tokens, limits.sequences) {
        let seqs = &seqs[group.clone()];
        let mut cache = BatchCache::new(m.b, spec, &lens[group.clone()])?;
        let new: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
        // Row r predicts token r + 1: the continuation's tokens are predicted by the rows from
        // the context's last one up to the one before the end.
        let want: Vec<Range<usize>> =
            group.clone().map(|i| pairs[i].0.len() - 1..lens[i] - 1).collect();
        let first = group.start;
        forward(m, units, &mut cache, &mut work, &new, &want, &mut |i, r, logits| {
            let target = seqs[i][r + 1] as usize;
            let Some(&z) = logits.get(target) else {
                return Err(Error::invalid(format!("token {target} is outside the vocabulary")));
            };
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
            let scored = &mut out[first + i];
            scored.logprob += f64::from(z - max) - sum.ln();
            scored.greedy &= super::sample::argmax(logits) as usize == target;
            scored.tokens += 1;
            Ok(())
        })?;
    }
    Ok(out)
}
