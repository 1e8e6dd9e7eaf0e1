//! The decoder's forward and backward, one unit at a time, on any [`Backend`].
//!
//! Each unit's compute is a stateless template bound to whatever weight slab it is given, so the
//! same functions serve the plain loop and the streaming schedule. A layer's internals live in a
//! [`LayerScratch`] that is overwritten by every call; the backward recomputes them from the
//! layer's input (activation checkpointing, one checkpoint per layer).
//!
//! This is the one definition of a layer. Training and evaluation attend over the micro-batch's
//! own packed rows ([`Keys::Packed`]); generation runs the same forward with its keys and values
//! in a cache ([`Keys::Cached`]), so a family's differences are written once. A recompute whose
//! attention output was kept from the forward ([`Keys::Kept`]) skips the attention.
//!
//! Mirrors `LlamaDecoderLayer` / `Qwen2DecoderLayer` / `Qwen3DecoderLayer` /
//! `MistralDecoderLayer` in transformers:
//! ```text
//! h   = rmsnorm(x, ln1)                         [T, H]
//! qkv = h · Wqkvᵀ (+ b)                         [T, Dqkv]
//! qkv = head_rmsnorm(qkv) (qwen3, gemma3); rope(qkv)
//! a   = attention(qkv)                          [T, nq hd]
//! x1  = x + post_attn(a · Woᵀ (+ bo))           [T, H]
//! g   = rmsnorm(x1, ln2) · Wgate_upᵀ            [T, 2I]
//! out = x1 + post_mlp(act(g) · Wdownᵀ)          [T, H]
//! ```
//! `post_attn` and `post_mlp` are Gemma's extra RMSNorms (`sandwich_norms`; the identity
//! elsewhere), `act` is SwiGLU or GeGLU, and Gemma's norms scale by `1 + w`, formed in f32 in a
//! scratch buffer before each norm (its gradient is the gradient of `w`).

use super::layout::{HeadRanges, LayerRanges, MlpRanges};
use super::moe::{MoeAt, MoeScratch, RouterStats};
use crate::backend::{
    Addends, AttentionOut, AttentionShape, Backend, DecodeShape, FloatKind, Grads, LossOut,
    LossShape, MatmulShape, NormShape, Operands,
};
use crate::error::Result;
use crate::spec::ModelSpec;

/// A micro-batch's token data on the device: `tokens` rows, documents by `cu_seqlens`.
pub struct DeviceBatch<B: Backend> {
    pub ids: B::Ints,
    pub positions: B::Ints,
    pub targets: B::Ints,
    pub cu_seqlens: B::Ints,
    pub tokens: usize,
    pub docs: usize,
    /// The largest position id (RoPE tables that depend on length read it).
    pub max_position: usize,
}

impl<B: Backend> DeviceBatch<B> {
    /// Room for up to `tokens` tokens (and as many documents).
    pub fn new(b: &B, tokens: usize) -> Result<Self> {
        Ok(DeviceBatch {
            ids: b.alloc_ints(tokens)?,
            positions: b.alloc_ints(tokens)?,
            targets: b.alloc_ints(tokens)?,
            cu_seqlens: b.alloc_ints(tokens + 1)?,
            tokens: 0,
            docs: 0,
            max_position: 0,
        })
    }

    /// Copies one micro-batch's host data in.
    pub fn upload(
        &mut self,
        b: &B,
        ids: &[i32],
        positions: &[i32],
        targets: &[i32],
        cu_seqlens: &[i32],
    ) -> Result<()> {
        b.upload_ints(&mut self.ids, ids)?;
        b.upload_ints(&mut self.positions, positions)?;
        b.upload_ints(&mut self.targets, targets)?;
        b.upload_ints(&mut self.cu_seqlens, cu_seqlens)?;
        self.tokens = ids.len();
        self.docs = cu_seqlens.len().saturating_sub(1);
        self.max_position = positions.iter().copied().max().unwrap_or(0).max(0) as usize;
        Ok(())
    }
}

/// One layer's intermediates and gradients for `tokens` tokens, reused by every layer.
pub struct LayerScratch<B: Backend> {
    ln1: B::Floats,              // [T, H]
    ln1_rstd: B::Floats,         // [T]
    qkv_pre: B::Floats,          // [T, Dqkv] before the q/k norm (qwen3 only)
    qk_rstd: B::Floats,          // [T, nq + nkv]
    qkv: B::Floats,              // [T, Dqkv] after the q/k norm and RoPE
    att: B::Floats,              // [T, nq hd]
    lse: B::Floats,              // [T, nq]
    x1: B::Floats,               // [T, H]
    pub(super) ln2: B::Floats,   // [T, H]
    ln2_rstd: B::Floats,         // [T]
    gate_up: B::Floats,          // [T, 2I]
    act: B::Floats,              // [T, I]
    pub(super) tmp_h: B::Floats, // [T, H]
    // gradients
    d_act: B::Floats,     // [T, I]
    d_gate_up: B::Floats, // [T, 2I]
    d_x1: B::Floats,      // [T, H]
    d_att: B::Floats,     // [T, nq hd]
    d_qkv: B::Floats,     // [T, Dqkv]
    d_qkv_pre: B::Floats, // [T, Dqkv]
    /// The new tokens' queries gathered contiguously for [`Keys::Cached`] (generation only).
    q: B::Floats, // [T, nq hd]
    // Gemma's post-attention and post-MLP norms: their inputs and rstd, and the gradient of
    // either input (one at a time).
    o_pre: B::Floats,            // [T, H]
    o_rstd: B::Floats,           // [T]
    pub(super) m_pre: B::Floats, // [T, H]
    m_rstd: B::Floats,           // [T]
    pub(super) d_pre: B::Floats, // [T, H]
    /// A norm's `offset + w` (Gemma), f32.
    norm_w: B::Floats, // [max(H, 2 hd)]
    /// Whether the q/k norm runs (qwen3, gemma3): a kept layer then keeps the projection's
    /// output (`qkv_pre`) and derives `qkv` and `qk_rstd` again, not keeping them.
    qk_norm: bool,
    /// A MoE model's routing and expert buffers.
    pub(super) moe: Option<MoeScratch<B>>,
    /// Device bytes these buffers take.
    pub bytes: usize,
}

/// What a [`LayerScratch`] is for, which decides the buffers it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ScratchUse {
    /// Forward and backward over packed rows: gradients and the attention's log-sum-exp.
    Training,
    /// Forward only against a key/value cache: gathered queries, no gradients.
    Generation,
    /// A layer's kept forward state for one micro-batch (see [`LayerScratch::for_kept`]).
    Kept,
}

impl<B: Backend> LayerScratch<B> {
    /// Buffers for the forward and backward of `tokens` packed tokens.
    pub fn new(b: &B, spec: &ModelSpec, tokens: usize) -> Result<Self> {
        Self::alloc(b, spec, tokens, ScratchUse::Training)
    }

    /// Buffers for the forward of up to `tokens` new tokens against a key/value cache.
    pub fn for_generation(b: &B, spec: &ModelSpec, tokens: usize) -> Result<Self> {
        Self::alloc(b, spec, tokens, ScratchUse::Generation)
    }

    /// What a layer's backward reads of its forward and cannot derive without a GEMM (q/k/v,
    /// or their projection before the q/k norm where there is one, the attention output and
    /// log-sum-exp, `x1`, the MLP's gate/up, Gemma's post-norm inputs), for one micro-batch of
    /// `tokens`: a layer whose activations are kept hands its forward's buffers to these (see
    /// [`LayerScratch::swap_kept`]) and runs its backward from them after
    /// [`Decoder::layer_rederive`], without the recompute. The two norms' outputs and the
    /// MLP's activation (and q/k/v after the q/k norm and RoPE) are not kept: they are a third
    /// of a layer's state and cost only elementwise passes to derive again. Dense MLPs only: a
    /// mixture of experts has no kept form.
    pub fn for_kept(b: &B, spec: &ModelSpec, tokens: usize) -> Result<Self> {
        if spec.moe.is_some() {
            return Err(crate::error::Error::invalid(
                "a mixture of experts' layer activations cannot be kept; they are recomputed",
            ));
        }
        Self::alloc(b, spec, tokens, ScratchUse::Kept)
    }

    /// Exchanges the forward state of `self` and `kept` (buffer handles, no copies): after a
    /// kept layer's forward, so the kept set holds it, and around its backward, so the backward
    /// reads it.
    pub fn swap_kept(&mut self, kept: &mut LayerScratch<B>) {
        use std::mem::swap;
        swap(&mut self.qkv_pre, &mut kept.qkv_pre);
        if !self.qk_norm {
            swap(&mut self.qkv, &mut kept.qkv);
        }
        swap(&mut self.att, &mut kept.att);
        swap(&mut self.lse, &mut kept.lse);
        swap(&mut self.x1, &mut kept.x1);
        swap(&mut self.gate_up, &mut kept.gate_up);
        swap(&mut self.o_pre, &mut kept.o_pre);
        swap(&mut self.o_rstd, &mut kept.o_rstd);
        swap(&mut self.m_pre, &mut kept.m_pre);
        swap(&mut self.m_rstd, &mut kept.m_rstd);
    }

    /// Exchanges the attention's output and log-sum-exp with `kept`'s (buffer handles, no
    /// copies): after a layer's forward, so `kept` holds them, and before its recompute, which
    /// then runs with [`Keys::Kept`] and skips the attention.
    pub fn swap_attention(&mut self, kept: &mut KeptAttention<B>) {
        std::mem::swap(&mut self.att, &mut kept.att);
        std::mem::swap(&mut self.lse, &mut kept.lse);
    }

    fn alloc(b: &B, spec: &ModelSpec, tokens: usize, purpose: ScratchUse) -> Result<Self> {
        // A model whose every layer is a mixture needs no dense MLP buffers.
        let i = if spec.all_sparse() { 0 } else { spec.intermediate };
        let (t, h) = (tokens, spec.hidden);
        let (dqkv, datt) = (spec.qkv_width(), spec.attn_width());
        let bytes = std::cell::Cell::new(0);
        let act = |n: usize| {
            bytes.set(bytes.get() + n * b.elem_bytes(FloatKind::Activation));
            b.alloc(n, FloatKind::Activation)
        };
        let acc = |n: usize| {
            bytes.set(bytes.get() + n * b.elem_bytes(FloatKind::Accum));
            b.alloc(n, FloatKind::Accum)
        };
        let qkv_pre_len = if spec.qk_norm { t * dqkv } else { 0 };
        let sandwich = usize::from(spec.sandwich_norms);
        let offset = usize::from(spec.norm_offset != 0.0);
        // Buffers only one use needs are empty in the other.
        let (train, generate, work) = match purpose {
            ScratchUse::Training => (1, 0, 1),
            ScratchUse::Generation => (0, 1, 1),
            ScratchUse::Kept => (0, 0, 0),
        };
        // The kept form holds the log-sum-exp the backward reads.
        let lse = if purpose == ScratchUse::Generation { 0 } else { t * spec.q_heads };
        let mut scratch = LayerScratch {
            ln1: act(work * t * h)?,
            ln1_rstd: acc(work * t)?,
            qkv_pre: act(qkv_pre_len)?,
            qk_rstd: acc(if spec.qk_norm { work * t * (spec.q_heads + spec.kv_heads) } else { 0 })?,
            // A kept layer with a q/k norm derives `qkv` again from `qkv_pre`.
            qkv: act(if spec.qk_norm && purpose == ScratchUse::Kept { 0 } else { t * dqkv })?,
            att: act(t * datt)?,
            lse: acc(lse)?,
            x1: act(t * h)?,
            ln2: act(work * t * h)?,
            ln2_rstd: acc(work * t)?,
            gate_up: act(t * 2 * i)?,
            act: act(work * t * i)?,
            tmp_h: act(work * t * h)?,
            d_act: act(train * t * i)?,
            d_gate_up: act(train * t * 2 * i)?,
            d_x1: act(train * t * h)?,
            d_att: act(train * t * datt)?,
            d_qkv: act(train * t * dqkv)?,
            d_qkv_pre: act(train * qkv_pre_len)?,
            q: act(generate * t * datt)?,
            o_pre: act(sandwich * t * h)?,
            o_rstd: acc(sandwich * t)?,
            m_pre: act(sandwich * t * h)?,
            m_rstd: acc(sandwich * t)?,
            d_pre: act(train * sandwich * t * h)?,
            norm_w: acc(work * offset * h.max(2 * spec.head_dim))?,
            qk_norm: spec.qk_norm,
            moe: None,
            bytes: 0,
        };
        scratch.bytes = bytes.get();
        if spec.moe.is_some() && purpose != ScratchUse::Kept {
            let (moe, moe_bytes) = MoeScratch::new(b, spec, t, purpose == ScratchUse::Training)?;
            scratch.moe = Some(moe);
            scratch.bytes += moe_bytes;
        }
        Ok(scratch)
    }
}

/// One layer's attention output and log-sum-exp for one micro-batch, kept from the forward to
/// the backward: the recompute of a layer whose activations are not kept then skips its
/// attention, which at long context is most of the recompute, for a few percent of a kept
/// layer's memory (see [`LayerScratch::swap_attention`]). Any family, mixtures of experts too.
pub struct KeptAttention<B: Backend> {
    att: B::Floats, // [T, nq hd]
    lse: B::Floats, // [T, nq]
    /// Device bytes these buffers take.
    pub bytes: usize,
}

impl<B: Backend> KeptAttention<B> {
    pub fn new(b: &B, spec: &ModelSpec, tokens: usize) -> Result<Self> {
        let (att, lse) = (tokens * spec.attn_width(), tokens * spec.q_heads);
        Ok(KeptAttention {
            att: b.alloc(att, FloatKind::Activation)?,
            lse: b.alloc(lse, FloatKind::Accum)?,
            bytes: att * b.elem_bytes(FloatKind::Activation) + lse * b.elem_bytes(FloatKind::Accum),
        })
    }
}

/// The head's intermediates.
pub struct HeadScratch<B: Backend> {
    normed: B::Floats, // [T, H]
    rstd: B::Floats,   // [T]
    losses: B::Floats, // [T]
    lse: B::Floats,    // [T]
    d_normed: B::Floats,
    /// The final norm's `offset + w` (Gemma), f32.
    norm_w: B::Floats, // [H]
    /// Device bytes these buffers take.
    pub bytes: usize,
}

impl<B: Backend> HeadScratch<B> {
    pub fn new(b: &B, spec: &ModelSpec, tokens: usize) -> Result<Self> {
        let norm_w = if spec.norm_offset != 0.0 { spec.hidden } else { 0 };
        Ok(HeadScratch {
            normed: b.alloc(tokens * spec.hidden, FloatKind::Activation)?,
            rstd: b.alloc(tokens, FloatKind::Accum)?,
            losses: b.alloc(tokens, FloatKind::Accum)?,
            lse: b.alloc(tokens, FloatKind::Accum)?,
            d_normed: b.alloc(tokens * spec.hidden, FloatKind::Activation)?,
            norm_w: b.alloc(norm_w, FloatKind::Accum)?,
            bytes: 2 * tokens * spec.hidden * b.elem_bytes(FloatKind::Activation)
                + (3 * tokens + norm_w) * b.elem_bytes(FloatKind::Accum),
        })
    }
}

/// Where a layer's attention finds its keys and values.
pub enum Keys<'a, B: Backend> {
    /// The micro-batch's own rows, documents by its `cu_seqlens` (training and evaluation); the
    /// log-sum-exp of every query is kept for the backward.
    Packed,
    /// As `Packed`, with the attention's output and log-sum-exp already in the scratch: this
    /// micro-batch's first forward computed them and the caller swapped them back in
    /// ([`LayerScratch::swap_attention`]), so the recompute skips the attention (and sinks).
    Kept,
    /// One sequence's key/value cache for this layer, `[capacity, nkv hd]` each (generation):
    /// the new tokens sit at positions `past..past + T`, append their keys (after RoPE) and
    /// values at row `past`, and attend to every cached row up to their own.
    Cached { k: &'a mut B::Floats, v: &'a mut B::Floats, past: usize },
    /// Several sequences at once (batched generation and scoring), their caches side by side in
    /// one key and one value buffer for this layer: the batch's rows are the sequences' new
    /// tokens one sequence after another; each sequence appends its keys and values after its
    /// own cached rows and attends only to them, so the projections and the MLP run once over
    /// every row.
    Batch { k: &'a mut B::Floats, v: &'a mut B::Floats, seqs: &'a [SeqRows] },
}

/// One sequence of a [`Keys::Batch`]: where its cache starts in the shared buffers (a row),
/// the positions already cached, and how many of the batch's rows are its new tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqRows {
    pub base: usize,
    pub past: usize,
    pub rows: usize,
}

/// Which layer a call runs, on which tokens, how its attention sees keys and values, what
/// a MoE layer's router keeps, and whether a forward needs the layer's output.
pub struct LayerAt<'a, B: Backend> {
    pub layer: usize,
    pub batch: &'a DeviceBatch<B>,
    pub keys: Keys<'a, B>,
    pub router: RouterStats<'a, B>,
    /// False for the recompute right before a backward, which reads the layer's internals but
    /// not its output: a dense MLP then stops at its activation, skipping the down projection
    /// (a third of the MLP's FLOPs), unless a post-MLP norm needs that projection's output.
    pub output: bool,
}

impl<'a, B: Backend> LayerAt<'a, B> {
    /// `layer` over the packed rows of `batch`, keeping no router statistics.
    pub fn packed(batch: &'a DeviceBatch<B>, layer: usize) -> Self {
        LayerAt { layer, batch, keys: Keys::Packed, router: RouterStats::Off, output: true }
    }

    /// The same for the recompute before the layer's backward: `x_out` is left unwritten.
    pub fn for_backward(mut self) -> Self {
        self.output = false;
        self
    }

    /// The same with the attention's output and log-sum-exp kept from the forward
    /// ([`Keys::Kept`]) when `kept`.
    pub fn with_kept_attention(mut self, kept: bool) -> Self {
        if kept {
            self.keys = Keys::Kept;
        }
        self
    }

    /// The same with the micro-batch's router statistics (`None` for a dense model).
    pub fn with_router(mut self, router: RouterStats<'a, B>) -> Self {
        self.router = router;
        self
    }
}

/// The weights the head reads: its own slab (final norm, untied LM head) and the embedding's,
/// whose table is the LM head when tied.
pub struct HeadWeights<'a, B: Backend> {
    pub head: &'a B::Floats,
    pub embed: &'a B::Floats,
}

impl<B: Backend> Clone for HeadWeights<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for HeadWeights<'_, B> {}

/// The gradients a layer's backward reads and writes.
pub struct LayerGrads<'a, B: Backend> {
    /// `∂L/∂x_out` `[T, H]`, from the layer above.
    pub dx_out: &'a B::Floats,
    /// `∂L/∂x_in` `[T, H]` (overwritten).
    pub dx_in: &'a mut B::Floats,
    /// The layer's weight gradients, a slab laid out like its weights (accumulated).
    pub weights: &'a mut B::Floats,
}

/// The gradients the head's backward reads and writes, for the loss `scale · Σ_t losses[t]`.
pub struct HeadGrads<'a, B: Backend> {
    /// `∂L/∂(Σ_t losses[t])`: 1 / (trained tokens in the whole optimizer step).
    pub scale: f32,
    /// `∂L/∂x` `[T, H]` (overwritten).
    pub dx: &'a mut B::Floats,
    /// The final norm's and an untied LM head's gradients, a slab laid out like the head's
    /// (accumulated).
    pub head: &'a mut B::Floats,
    /// A tied LM head's gradient: the embedding's slab (accumulated; required when tied,
    /// ignored otherwise).
    pub embed: Option<&'a mut B::Floats>,
}

/// The decoder bound to a spec and its RoPE tables on the device.
pub struct Decoder<B: Backend> {
    pub spec: ModelSpec,
    /// Per decoder layer.
    pub layers: Vec<LayerRanges>,
    pub head: HeadRanges,
    inv_freq: B::Floats, // [r / 2]
    /// Longrope: above this many positions a forward uses the second table.
    long_inv_freq: Option<(usize, B::Floats)>, // [r / 2]
    /// The sliding-window layers' own table (gemma3).
    local_inv_freq: Option<B::Floats>, // [r / 2]
    rope_scale: f32,
    /// `norm_offset` repeated, where norms scale by `offset + w` (f32).
    norm_offset: Option<B::Floats>, // [max(H, 2 hd)]
}

fn all<B: Backend>(b: &B, buf: &B::Floats, n: usize) -> std::ops::Range<usize> {
    debug_assert!(n <= b.len(buf));
    0..n
}

impl<B: Backend> Decoder<B> {
    pub fn new(
        b: &B,
        spec: &ModelSpec,
        layers: Vec<LayerRanges>,
        head: HeadRanges,
    ) -> Result<Self> {
        if layers.len() != spec.layers {
            return Err(crate::error::Error::invalid(format!(
                "{} layer layouts for a model of {} layers",
                layers.len(),
                spec.layers
            )));
        }
        let table = |freqs: Vec<f32>| -> Result<B::Floats> {
            let mut buf = b.alloc(freqs.len(), FloatKind::Accum)?;
            b.upload(b.view_mut(&mut buf, 0..freqs.len()), &freqs)?;
            Ok(buf)
        };
        let inv_freq = table(spec.inv_freq())?;
        let long_inv_freq = match spec.long_inv_freq() {
            Some((above, freqs)) => Some((above, table(freqs)?)),
            None => None,
        };
        let local_inv_freq = spec.local_inv_freq().map(table).transpose()?;
        let rope_scale = spec.rope_scale();
        let norm_offset = (spec.norm_offset != 0.0)
            .then(|| table(vec![spec.norm_offset; spec.hidden.max(2 * spec.head_dim)]))
            .transpose()?;
        Ok(Decoder {
            spec: spec.clone(),
            layers,
            head,
            inv_freq,
            long_inv_freq,
            local_inv_freq,
            rope_scale,
            norm_offset,
        })
    }

    /// The weight an RMSNorm multiplies by: the slab's own `w[range]`, or `offset + w` formed
    /// in `tmp` (f32) where norms are offset (Gemma's `1 + weight`, computed in f32 as
    /// `Gemma3RMSNorm` does).
    fn norm_weight<'a>(
        &self,
        b: &B,
        w: &'a B::Floats,
        range: &std::ops::Range<usize>,
        tmp: &'a mut B::Floats,
    ) -> Result<B::View<'a>> {
        match &self.norm_offset {
            None => Ok(b.view(w, range.clone())),
            Some(offset) => {
                let n = range.len();
                b.add(b.view_mut(tmp, 0..n), b.view(w, range.clone()), b.view(offset, 0..n))?;
                Ok(b.view(tmp, 0..n))
            }
        }
    }

    /// The RoPE frequencies `[r / 2]` a forward over `batch` uses: longrope's long table when
    /// its largest position is beyond the pretrained context (transformers'
    /// `longrope_frequency_update`: `max(position_ids) + 1 > original_max_position_embeddings`),
    /// else the one table.
    /// A sliding layer with a table of its own (gemma3) uses that one.
    fn inv_freq(&self, b: &B, batch: &DeviceBatch<B>, layer: usize) -> B::View<'_> {
        let half = self.spec.rotary_dim / 2;
        let sliding = self.spec.windows.get(layer).copied().flatten().is_some();
        if let (Some(local), true) = (&self.local_inv_freq, sliding) {
            return b.view(local, 0..half);
        }
        match &self.long_inv_freq {
            Some((above, long)) if batch.max_position + 1 > *above => b.view(long, 0..half),
            _ => b.view(&self.inv_freq, 0..half),
        }
    }

    fn ranges(&self, layer: usize) -> Result<&LayerRanges> {
        self.layers.get(layer).ok_or_else(|| {
            crate::error::Error::invalid(format!(
                "layer {layer} of a model of {} layers",
                self.layers.len()
            ))
        })
    }

    /// The mixture of layer `layer`, whose ranges say it is one.
    pub(super) fn moe_spec(&self, layer: usize) -> Result<&crate::spec::MoeSpec> {
        self.spec.moe_at(layer).ok_or_else(|| {
            crate::error::Error::invalid(format!("layer {layer} has MoE weights but no MoE spec"))
        })
    }

    /// The RMSNorms over the hidden size of `rows` tokens.
    fn norm_shape(&self, rows: usize) -> NormShape {
        NormShape { rows, dim: self.spec.hidden, eps: self.spec.rms_eps }
    }

    /// The LM head's cross-entropy over `tokens` tokens.
    fn loss_shape(&self, tokens: usize) -> LossShape {
        LossShape {
            tokens,
            hidden: self.spec.hidden,
            vocab: self.spec.vocab,
            softcap: self.spec.final_softcap,
        }
    }

    fn attention_shape(&self, batch: &DeviceBatch<B>, layer: usize) -> AttentionShape {
        AttentionShape {
            tokens: batch.tokens,
            q_heads: self.spec.q_heads,
            kv_heads: self.spec.kv_heads,
            head_dim: self.spec.head_dim,
            docs: batch.docs,
            window: self.spec.windows.get(layer).copied().flatten(),
            scale_dim: self.spec.scale_dim,
            softcap: self.spec.attn_softcap,
        }
    }

    /// `x = embed(ids)`. x `[T, H]`; `w` is the embedding slab.
    pub fn embed_forward(
        &self,
        b: &B,
        x: &mut B::Floats,
        w: &B::Floats,
        batch: &DeviceBatch<B>,
    ) -> Result<()> {
        let (t, h) = (batch.tokens, self.spec.hidden);
        let table = b.view(w, 0..self.spec.vocab * h);
        let scale = self.spec.embed_scale;
        b.embedding_forward(b.view_mut(x, 0..t * h), &batch.ids, table, t, h, scale)
    }

    /// `dw_embed += scatter(dx)`.
    pub fn embed_backward(
        &self,
        b: &B,
        grad: &mut B::Floats,
        dx: &B::Floats,
        batch: &DeviceBatch<B>,
    ) -> Result<()> {
        let (t, h) = (batch.tokens, self.spec.hidden);
        let dtable = b.view_mut(grad, 0..self.spec.vocab * h);
        let scale = self.spec.embed_scale;
        b.embedding_backward(dtable, b.view(dx, 0..t * h), &batch.ids, t, h, scale)
    }

    /// One decoder layer: `x_out = layer(x_in)`, leaving its internals in `s`. x `[T, H]`; `w`
    /// is the layer's slab.
    pub fn layer_forward(
        &self,
        b: &B,
        x_out: &mut B::Floats,
        x_in: &B::Floats,
        w: &B::Floats,
        s: &mut LayerScratch<B>,
        at: LayerAt<'_, B>,
    ) -> Result<()> {
        let spec = &self.spec;
        let LayerAt { layer, batch, keys, router, output } = at;
        let r = self.ranges(layer)?;
        let shape = self.attention_shape(batch, layer);
        let (t, h, i) = (batch.tokens, spec.hidden, spec.intermediate);
        let (dqkv, datt) = (spec.qkv_width(), spec.attn_width());
        let th = all(b, x_in, t * h);
        let wv = |range: &std::ops::Range<usize>| b.view(w, range.clone());
        let norm = self.norm_shape(t);

        self.norm1(b, x_in, w, s, r, t)?;
        // The projection lands in `qkv` directly unless a q/k norm needs its input kept.
        let proj = if spec.qk_norm { &mut s.qkv_pre } else { &mut s.qkv };
        b.matmul_forward_add(
            b.view_mut(proj, 0..t * dqkv),
            Operands { inp: b.view(&s.ln1, th.clone()), w: wv(&r.qkv_w) },
            Addends { bias: r.qkv_b.as_ref().map(wv), residual: None },
            &MatmulShape { rows: t, k: h, n: dqkv },
        )?;
        self.qk_norm_rope(b, w, s, r, batch, layer)?;
        let sinks = r.sinks.as_ref().map(|range| b.view(w, range.clone()));
        match keys {
            Keys::Packed => {
                b.attention_forward(
                    AttentionOut {
                        out: b.view_mut(&mut s.att, 0..t * datt),
                        lse: b.view_mut(&mut s.lse, 0..t * spec.q_heads),
                    },
                    b.view(&s.qkv, 0..t * dqkv),
                    &batch.cu_seqlens,
                    &shape,
                )?;
                if let Some(sinks) = sinks {
                    b.attention_sinks_forward(
                        AttentionOut {
                            out: b.view_mut(&mut s.att, 0..t * datt),
                            lse: b.view_mut(&mut s.lse, 0..t * spec.q_heads),
                        },
                        sinks,
                        &shape,
                    )?;
                }
            }
            Keys::Kept => {}
            Keys::Cached { k, v, past } => {
                let at = SeqRows { base: 0, past, rows: 0 };
                self.attend_cached(b, s, (k, v), sinks, &shape.decode(past), at)?
            }
            Keys::Batch { k, v, seqs } => {
                if seqs.iter().map(|q| q.rows).sum::<usize>() != t {
                    return Err(crate::error::Error::invalid(
                        "the sequences' rows do not add up to the batch's tokens",
                    ));
                }
                let mut first = 0;
                for q in seqs {
                    let decode = DecodeShape { tokens: q.rows, ..shape.decode(q.past) };
                    let sinks = r.sinks.as_ref().map(|range| b.view(w, range.clone()));
                    let at = SeqRows { rows: first, ..*q };
                    self.attend_cached(b, s, (&mut *k, &mut *v), sinks, &decode, at)?;
                    first += q.rows;
                }
            }
        }
        // x1 = x + o(att): the o projection adds the residual itself, unless a post-attention
        // norm comes between them (then it lands in `o_pre`).
        let o_shape = MatmulShape { rows: t, k: datt, n: h };
        let o_operands = Operands { inp: b.view(&s.att, 0..t * datt), w: wv(&r.o_w) };
        let o_bias = r.o_b.as_ref().map(wv);
        match &r.post_attn_norm {
            None => b.matmul_forward_add(
                b.view_mut(&mut s.x1, th.clone()),
                o_operands,
                Addends { bias: o_bias, residual: Some(b.view(x_in, th.clone())) },
                &o_shape,
            )?,
            Some(post) => {
                b.matmul_forward_add(
                    b.view_mut(&mut s.o_pre, th.clone()),
                    o_operands,
                    Addends { bias: o_bias, residual: None },
                    &o_shape,
                )?;
                let post_w = self.norm_weight(b, w, post, &mut s.norm_w)?;
                b.rmsnorm_forward(
                    b.view_mut(&mut s.tmp_h, th.clone()),
                    b.view_mut(&mut s.o_rstd, 0..t),
                    Operands { inp: b.view(&s.o_pre, th.clone()), w: post_w },
                    &norm,
                )?;
                b.add(
                    b.view_mut(&mut s.x1, th.clone()),
                    b.view(x_in, th.clone()),
                    b.view(&s.tmp_h, th.clone()),
                )?;
            }
        }

        self.norm2(b, w, s, r, t)?;
        // The MLP's output lands in `m_pre` when a post-MLP norm follows; otherwise a dense
        // MLP's down projection adds the residual itself and a MoE's lands in `tmp_h`.
        let into_pre = r.post_mlp_norm.is_some();
        match &r.mlp {
            MlpRanges::Dense { gate_up_w, down_w } => {
                b.matmul_forward(
                    b.view_mut(&mut s.gate_up, 0..t * 2 * i),
                    Operands { inp: b.view(&s.ln2, th.clone()), w: wv(gate_up_w) },
                    &MatmulShape { rows: t, k: h, n: 2 * i },
                )?;
                self.activation(b, s, t)?;
                if !output && !into_pre {
                    return Ok(());
                }
                let down = Operands { inp: b.view(&s.act, 0..t * i), w: wv(down_w) };
                let down_shape = MatmulShape { rows: t, k: i, n: h };
                if !into_pre {
                    // x_out = x1 + down(act), the residual added by the projection.
                    let residual = Some(b.view(&s.x1, th.clone()));
                    return b.matmul_forward_add(
                        b.view_mut(x_out, th),
                        down,
                        Addends { bias: None, residual },
                        &down_shape,
                    );
                }
                b.matmul_forward(b.view_mut(&mut s.m_pre, th.clone()), down, &down_shape)?;
            }
            MlpRanges::Moe(m) => {
                let moe = self.moe_spec(layer)?;
                let at = MoeAt { ranges: m, moe, tokens: t, post_norm: into_pre, router };
                self.moe_forward(b, w, s, at)?;
            }
        }
        if let Some(post) = &r.post_mlp_norm {
            let post_w = self.norm_weight(b, w, post, &mut s.norm_w)?;
            b.rmsnorm_forward(
                b.view_mut(&mut s.tmp_h, th.clone()),
                b.view_mut(&mut s.m_rstd, 0..t),
                Operands { inp: b.view(&s.m_pre, th.clone()), w: post_w },
                &norm,
            )?;
        }
        b.add(b.view_mut(x_out, th.clone()), b.view(&s.x1, th.clone()), b.view(&s.tmp_h, th))
    }

    /// A kept layer's state that [`LayerScratch::for_kept`] leaves out, derived again before
    /// its backward from what was kept: both norms' outputs and reciprocal RMS (from `x_in`
    /// and the kept `x1`), q/k/v after the q/k norm and RoPE (from the kept projection), and
    /// the MLP's activation (from the kept gate/up). The same ops on the same inputs as the
    /// forward, so the backward reads the same bits.
    pub fn layer_rederive(
        &self,
        b: &B,
        x_in: &B::Floats,
        w: &B::Floats,
        s: &mut LayerScratch<B>,
        layer: usize,
        batch: &DeviceBatch<B>,
    ) -> Result<()> {
        let r = self.ranges(layer)?;
        let t = batch.tokens;
        let MlpRanges::Dense { .. } = &r.mlp else {
            return Err(crate::error::Error::invalid(
                "a mixture of experts' layer keeps no activations to derive from",
            ));
        };
        self.norm1(b, x_in, w, s, r, t)?;
        if r.qk_norm.is_some() {
            self.qk_norm_rope(b, w, s, r, batch, layer)?;
        }
        self.norm2(b, w, s, r, t)?;
        self.activation(b, s, t)
    }

    /// `ln1 = rmsnorm(x_in)` of `t` tokens (and its reciprocal RMS).
    fn norm1(
        &self,
        b: &B,
        x_in: &B::Floats,
        w: &B::Floats,
        s: &mut LayerScratch<B>,
        r: &LayerRanges,
        t: usize,
    ) -> Result<()> {
        let th = all(b, x_in, t * self.spec.hidden);
        let ln1_w = self.norm_weight(b, w, &r.ln1, &mut s.norm_w)?;
        b.rmsnorm_forward(
            b.view_mut(&mut s.ln1, th.clone()),
            b.view_mut(&mut s.ln1_rstd, 0..t),
            Operands { inp: b.view(x_in, th), w: ln1_w },
            &self.norm_shape(t),
        )
    }

    /// `ln2 = rmsnorm(x1)` of `t` tokens (and its reciprocal RMS).
    fn norm2(
        &self,
        b: &B,
        w: &B::Floats,
        s: &mut LayerScratch<B>,
        r: &LayerRanges,
        t: usize,
    ) -> Result<()> {
        let th = 0..t * self.spec.hidden;
        let ln2_w = self.norm_weight(b, w, &r.ln2, &mut s.norm_w)?;
        b.rmsnorm_forward(
            b.view_mut(&mut s.ln2, th.clone()),
            b.view_mut(&mut s.ln2_rstd, 0..t),
            Operands { inp: b.view(&s.x1, th), w: ln2_w },
            &self.norm_shape(t),
        )
    }

    /// `qkv` from the projection: the q/k norm from `qkv_pre` where there is one, then RoPE.
    fn qk_norm_rope(
        &self,
        b: &B,
        w: &B::Floats,
        s: &mut LayerScratch<B>,
        r: &LayerRanges,
        batch: &DeviceBatch<B>,
        layer: usize,
    ) -> Result<()> {
        let spec = &self.spec;
        let shape = self.attention_shape(batch, layer);
        let qkv = 0..batch.tokens * spec.qkv_width();
        if let Some(norm) = &r.qk_norm {
            let heads = spec.q_heads + spec.kv_heads;
            let qk_w = self.norm_weight(b, w, norm, &mut s.norm_w)?;
            b.head_rmsnorm_forward(
                b.view_mut(&mut s.qkv, qkv.clone()),
                b.view_mut(&mut s.qk_rstd, 0..batch.tokens * heads),
                Operands { inp: b.view(&s.qkv_pre, qkv.clone()), w: qk_w },
                &shape,
                spec.rms_eps,
            )?;
        }
        b.rope_forward(
            b.view_mut(&mut s.qkv, qkv),
            &batch.positions,
            self.inv_freq(b, batch, layer),
            self.rope_scale,
            &shape,
        )
    }

    /// A dense MLP's gated activation `act = glu(gate_up)` of `t` tokens.
    fn activation(&self, b: &B, s: &mut LayerScratch<B>, t: usize) -> Result<()> {
        let i = self.spec.intermediate;
        b.glu_forward(
            b.view_mut(&mut s.act, 0..t * i),
            b.view(&s.gate_up, 0..t * 2 * i),
            t,
            i,
            self.spec.glu_act,
        )
    }

    /// Attention of `shape.tokens` new rows of `s.qkv` against a key/value cache: their keys
    /// and values go to the cache's rows `shape.past..`, their queries are gathered
    /// contiguously, and `s.att` gets the attention over every cached row up to each query's
    /// own.
    fn attend_cached(
        &self,
        b: &B,
        s: &mut LayerScratch<B>,
        (k_cache, v_cache): (&mut B::Floats, &mut B::Floats), // [capacity, nkv hd] each
        sinks: Option<B::View<'_>>,
        shape: &DecodeShape,
        // `rows` is the batch row of the sequence's first new token; `base` its cache's first row
        at: SeqRows,
    ) -> Result<()> {
        let (n, past, first, base) = (shape.tokens, shape.past, at.rows, at.base);
        let (dqkv, datt) = (self.spec.qkv_width(), self.spec.attn_width());
        let kv_width = shape.kv_heads * shape.head_dim;
        let (start, end) = (base * kv_width, (base + past + n) * kv_width);
        if end > b.len(k_cache).min(b.len(v_cache)) {
            return Err(crate::error::Error::invalid(format!(
                "the key/value cache holds {} positions, {} are needed",
                b.len(k_cache) / kv_width.max(1),
                base + past + n
            )));
        }
        // Each new row is `[q | k | v]`: its keys and values go to the next free cache rows.
        for t in 0..n {
            let (row, at) = ((first + t) * dqkv + datt, (base + past + t) * kv_width);
            let (k, v) = (row..row + kv_width, row + kv_width..row + 2 * kv_width);
            b.copy(b.view_mut(k_cache, at..at + kv_width), b.view(&s.qkv, k))?;
            b.copy(b.view_mut(v_cache, at..at + kv_width), b.view(&s.qkv, v))?;
        }
        // One token's queries are already contiguous; several tokens' are gathered.
        let q = if n == 1 {
            b.view(&s.qkv, first * dqkv..first * dqkv + datt)
        } else {
            for t in 0..n {
                let src = b.view(&s.qkv, (first + t) * dqkv..(first + t) * dqkv + datt);
                b.copy(b.view_mut(&mut s.q, t * datt..(t + 1) * datt), src)?;
            }
            b.view(&s.q, 0..n * datt)
        };
        b.attention_decode(
            b.view_mut(&mut s.att, first * datt..(first + n) * datt),
            q,
            b.view(k_cache, start..end),
            b.view(v_cache, start..end),
            sinks,
            shape,
        )
    }

    /// Backward of one layer whose internals `s` hold the forward of `x_in` (run
    /// [`Decoder::layer_forward`] first to recompute them): from `grads.dx_out`, overwrites
    /// `grads.dx_in` and accumulates the weight gradients into `grads.weights` (a slab laid out
    /// like `w`).
    pub fn layer_backward(
        &self,
        b: &B,
        grads: LayerGrads<'_, B>,
        x_in: &B::Floats,
        w: &B::Floats,
        s: &mut LayerScratch<B>,
        at: LayerAt<'_, B>,
    ) -> Result<()> {
        let spec = &self.spec;
        let LayerGrads { dx_out, dx_in, weights: grad } = grads;
        let LayerAt { layer, batch, keys, router, output: _ } = at;
        let r = self.ranges(layer)?;
        if !matches!(keys, Keys::Packed | Keys::Kept) {
            return Err(crate::error::Error::invalid(
                "a layer's backward runs over packed rows, not a key/value cache",
            ));
        }
        let shape = self.attention_shape(batch, layer);
        let (t, h, i) = (batch.tokens, spec.hidden, spec.intermediate);
        let (dqkv, datt) = (spec.qkv_width(), spec.attn_width());
        let th = all(b, x_in, t * h);
        let wv = |range: &std::ops::Range<usize>| b.view(w, range.clone());
        let norm = self.norm_shape(t);

        // MLP branch: out = x1 + post_mlp(down(act(gate_up(ln2(x1))))).
        let d_down = match &r.post_mlp_norm {
            Some(post) => {
                let post_w = self.norm_weight(b, w, post, &mut s.norm_w)?;
                b.rmsnorm_backward(
                    Grads {
                        dinp: b.view_mut(&mut s.d_pre, th.clone()),
                        dw: b.view_mut(grad, post.clone()),
                    },
                    b.view(dx_out, th.clone()),
                    Operands { inp: b.view(&s.m_pre, th.clone()), w: post_w },
                    b.view(&s.m_rstd, 0..t),
                    &norm,
                )?;
                b.view(&s.d_pre, th.clone())
            }
            None => b.view(dx_out, th.clone()),
        };
        match &r.mlp {
            MlpRanges::Dense { gate_up_w, down_w } => {
                b.matmul_backward(
                    Grads {
                        dinp: b.view_mut(&mut s.d_act, 0..t * i),
                        dw: b.view_mut(grad, down_w.clone()),
                    },
                    d_down,
                    Operands { inp: b.view(&s.act, 0..t * i), w: wv(down_w) },
                    &MatmulShape { rows: t, k: i, n: h },
                )?;
                b.glu_backward(
                    b.view_mut(&mut s.d_gate_up, 0..t * 2 * i),
                    b.view(&s.d_act, 0..t * i),
                    b.view(&s.gate_up, 0..t * 2 * i),
                    t,
                    i,
                    spec.glu_act,
                )?;
                // d(ln2 output) reuses tmp_h.
                b.matmul_backward(
                    Grads {
                        dinp: b.view_mut(&mut s.tmp_h, th.clone()),
                        dw: b.view_mut(grad, gate_up_w.clone()),
                    },
                    b.view(&s.d_gate_up, 0..t * 2 * i),
                    Operands { inp: b.view(&s.ln2, th.clone()), w: wv(gate_up_w) },
                    &MatmulShape { rows: t, k: h, n: 2 * i },
                )?;
            }
            MlpRanges::Moe(m) => {
                let (moe, post_norm) = (self.moe_spec(layer)?, r.post_mlp_norm.is_some());
                let at = MoeAt { ranges: m, moe, tokens: t, post_norm, router };
                self.moe_backward(b, grad, dx_out, w, s, at)?;
            }
        }
        let ln2_w = self.norm_weight(b, w, &r.ln2, &mut s.norm_w)?;
        // The residual carries dx_out straight to x1, beside the norm's gradient.
        b.rmsnorm_backward_add(
            Grads {
                dinp: b.view_mut(&mut s.d_x1, th.clone()),
                dw: b.view_mut(grad, r.ln2.clone()),
            },
            b.view(&s.tmp_h, th.clone()),
            Operands { inp: b.view(&s.x1, th.clone()), w: ln2_w },
            b.view(&s.ln2_rstd, 0..t),
            b.view(dx_out, th.clone()),
            &norm,
        )?;

        // Attention branch: x1 = x + post_attn(o(attention(rope(norm(qkv(ln1(x))))))).
        let d_o = match &r.post_attn_norm {
            Some(post) => {
                let post_w = self.norm_weight(b, w, post, &mut s.norm_w)?;
                b.rmsnorm_backward(
                    Grads {
                        dinp: b.view_mut(&mut s.d_pre, th.clone()),
                        dw: b.view_mut(grad, post.clone()),
                    },
                    b.view(&s.d_x1, th.clone()),
                    Operands { inp: b.view(&s.o_pre, th.clone()), w: post_w },
                    b.view(&s.o_rstd, 0..t),
                    &norm,
                )?;
                b.view(&s.d_pre, th.clone())
            }
            None => b.view(&s.d_x1, th.clone()),
        };
        if let Some(bias) = &r.o_b {
            b.bias_backward(b.view_mut(grad, bias.clone()), d_o, t, h)?;
        }
        b.matmul_backward(
            Grads {
                dinp: b.view_mut(&mut s.d_att, 0..t * datt),
                dw: b.view_mut(grad, r.o_w.clone()),
            },
            d_o,
            Operands { inp: b.view(&s.att, 0..t * datt), w: wv(&r.o_w) },
            &MatmulShape { rows: t, k: datt, n: h },
        )?;
        let att = AttentionOut {
            out: b.view(&s.att, 0..t * datt),
            lse: b.view(&s.lse, 0..t * spec.q_heads),
        };
        if let Some(sinks) = &r.sinks {
            b.attention_sinks_backward(
                b.view_mut(grad, sinks.clone()),
                b.view(&s.d_att, 0..t * datt),
                att,
                wv(sinks),
                &shape,
            )?;
        }
        b.attention_backward(
            b.view_mut(&mut s.d_qkv, 0..t * dqkv),
            b.view(&s.d_att, 0..t * datt),
            b.view(&s.qkv, 0..t * dqkv),
            att,
            &batch.cu_seqlens,
            &shape,
        )?;
        b.rope_backward(
            b.view_mut(&mut s.d_qkv, 0..t * dqkv),
            &batch.positions,
            self.inv_freq(b, batch, layer),
            self.rope_scale,
            &shape,
        )?;
        // Gradient with respect to the projection's output.
        let d_proj = if let Some(qk_norm) = &r.qk_norm {
            let heads = spec.q_heads + spec.kv_heads;
            let qk_w = self.norm_weight(b, w, qk_norm, &mut s.norm_w)?;
            b.head_rmsnorm_backward(
                Grads {
                    dinp: b.view_mut(&mut s.d_qkv_pre, 0..t * dqkv),
                    dw: b.view_mut(grad, qk_norm.clone()),
                },
                b.view(&s.d_qkv, 0..t * dqkv),
                Operands { inp: b.view(&s.qkv_pre, 0..t * dqkv), w: qk_w },
                b.view(&s.qk_rstd, 0..t * heads),
                &shape,
            )?;
            &s.d_qkv_pre
        } else {
            &s.d_qkv
        };
        if let Some(bias) = &r.qkv_b {
            b.bias_backward(b.view_mut(grad, bias.clone()), b.view(d_proj, 0..t * dqkv), t, dqkv)?;
        }
        // d(ln1 output) reuses tmp_h.
        b.matmul_backward(
            Grads {
                dinp: b.view_mut(&mut s.tmp_h, th.clone()),
                dw: b.view_mut(grad, r.qkv_w.clone()),
            },
            b.view(d_proj, 0..t * dqkv),
            Operands { inp: b.view(&s.ln1, th.clone()), w: wv(&r.qkv_w) },
            &MatmulShape { rows: t, k: h, n: dqkv },
        )?;
        let ln1_w = self.norm_weight(b, w, &r.ln1, &mut s.norm_w)?;
        b.rmsnorm_backward_add(
            Grads { dinp: b.view_mut(dx_in, th.clone()), dw: b.view_mut(grad, r.ln1.clone()) },
            b.view(&s.tmp_h, th.clone()),
            Operands { inp: b.view(x_in, th.clone()), w: ln1_w },
            b.view(&s.ln1_rstd, 0..t),
            b.view(&s.d_x1, th.clone()),
            &norm,
        )
    }

    /// The LM head's weight `[V, H]`: its own, or the embedding table when tied.
    fn lm_weight<'a>(&self, w: HeadWeights<'a, B>) -> (&'a B::Floats, std::ops::Range<usize>) {
        let n = self.spec.vocab * self.spec.hidden;
        match &self.head.lm_head {
            Some(range) => (w.head, range.clone()),
            None => (w.embed, 0..n),
        }
    }

    /// Final norm, LM head and cross-entropy; returns the sum of the token losses (f64).
    pub fn head_forward(
        &self,
        b: &B,
        s: &mut HeadScratch<B>,
        x: &B::Floats,
        w: HeadWeights<'_, B>,
        batch: &DeviceBatch<B>,
    ) -> Result<f64> {
        let (t, h) = (batch.tokens, self.spec.hidden);
        self.head_norm_forward(b, s, x, w.head, t)?;
        let (lm, lm_range) = self.lm_weight(w);
        b.cross_entropy_forward(
            b.view_mut(&mut s.losses, 0..t),
            b.view_mut(&mut s.lse, 0..t),
            Operands { inp: b.view(&s.normed, 0..t * h), w: b.view(lm, lm_range) },
            &batch.targets,
            &self.loss_shape(t),
        )?;
        b.sum(b.view(&s.losses, 0..t))
    }

    /// Backward of the head for the loss `grads.scale · Σ losses`: overwrites `grads.dx` and
    /// accumulates the weight gradients into `grads.head` and (a tied LM head's) `grads.embed`.
    /// Needs the scratch of [`Decoder::head_forward`] on the same batch.
    pub fn head_backward(
        &self,
        b: &B,
        grads: HeadGrads<'_, B>,
        s: &mut HeadScratch<B>,
        x: &B::Floats,
        w: HeadWeights<'_, B>,
        batch: &DeviceBatch<B>,
    ) -> Result<()> {
        let HeadGrads { scale, dx, head: head_grad, embed: embed_grad } = grads;
        let (t, h) = (batch.tokens, self.spec.hidden);
        let (lm, lm_range) = self.lm_weight(w);
        b.cross_entropy_backward(
            Grads {
                dinp: b.view_mut(&mut s.d_normed, 0..t * h),
                dw: self.lm_grad(b, head_grad, embed_grad)?,
            },
            Operands { inp: b.view(&s.normed, 0..t * h), w: b.view(lm, lm_range) },
            b.view(&s.lse, 0..t),
            &batch.targets,
            scale,
            &self.loss_shape(t),
        )?;
        self.head_norm_backward(b, dx, head_grad, s, x, w.head, t)
    }

    /// [`Decoder::head_forward`] then [`Decoder::head_backward`], the same bits, with the
    /// cross-entropy's two halves in one op that computes the logits once (training's head,
    /// whose backward follows its forward at once); returns the sum of the token losses.
    pub fn head_forward_backward(
        &self,
        b: &B,
        grads: HeadGrads<'_, B>,
        s: &mut HeadScratch<B>,
        x: &B::Floats,
        w: HeadWeights<'_, B>,
        batch: &DeviceBatch<B>,
    ) -> Result<f64> {
        let HeadGrads { scale, dx, head: head_grad, embed: embed_grad } = grads;
        let (t, h) = (batch.tokens, self.spec.hidden);
        self.head_norm_forward(b, s, x, w.head, t)?;
        let (lm, lm_range) = self.lm_weight(w);
        b.cross_entropy_forward_backward(
            LossOut { losses: b.view_mut(&mut s.losses, 0..t), lse: b.view_mut(&mut s.lse, 0..t) },
            Grads {
                dinp: b.view_mut(&mut s.d_normed, 0..t * h),
                dw: self.lm_grad(b, head_grad, embed_grad)?,
            },
            Operands { inp: b.view(&s.normed, 0..t * h), w: b.view(lm, lm_range) },
            &batch.targets,
            scale,
            &self.loss_shape(t),
        )?;
        self.head_norm_backward(b, dx, head_grad, s, x, w.head, t)?;
        b.sum(b.view(&s.losses, 0..t))
    }

    /// The final norm of the head's input: `s.normed` and `s.rstd` for `t` tokens of x.
    fn head_norm_forward(
        &self,
        b: &B,
        s: &mut HeadScratch<B>,
        x: &B::Floats,
        head: &B::Floats,
        t: usize,
    ) -> Result<()> {
        let h = self.spec.hidden;
        let norm_w = self.norm_weight(b, head, &self.head.norm, &mut s.norm_w)?;
        b.rmsnorm_forward(
            b.view_mut(&mut s.normed, 0..t * h),
            b.view_mut(&mut s.rstd, 0..t),
            Operands { inp: b.view(x, 0..t * h), w: norm_w },
            &self.norm_shape(t),
        )
    }

    /// The final norm's backward from `s.d_normed`: overwrites dx, accumulates the norm's
    /// weight gradient into the head's slab.
    #[allow(clippy::too_many_arguments)]
    fn head_norm_backward(
        &self,
        b: &B,
        dx: &mut B::Floats,
        head_grad: &mut B::Floats,
        s: &mut HeadScratch<B>,
        x: &B::Floats,
        head: &B::Floats,
        t: usize,
    ) -> Result<()> {
        let h = self.spec.hidden;
        let norm_w = self.norm_weight(b, head, &self.head.norm, &mut s.norm_w)?;
        b.rmsnorm_backward(
            Grads {
                dinp: b.view_mut(dx, 0..t * h),
                dw: b.view_mut(head_grad, self.head.norm.clone()),
            },
            b.view(&s.d_normed, 0..t * h),
            Operands { inp: b.view(x, 0..t * h), w: norm_w },
            b.view(&s.rstd, 0..t),
            &self.norm_shape(t),
        )
    }

    /// Where the LM head's weight gradient accumulates: the head's slab, or a tied head's
    /// embedding slab.
    fn lm_grad<'a>(
        &self,
        b: &B,
        head_grad: &'a mut B::Floats,
        embed_grad: Option<&'a mut B::Floats>,
    ) -> Result<B::ViewMut<'a>> {
        let n = self.spec.vocab * self.spec.hidden;
        match (&self.head.lm_head, embed_grad) {
            (Some(range), _) => Ok(b.view_mut(head_grad, range.clone())),
            (None, Some(embed_grad)) => Ok(b.view_mut(embed_grad, 0..n)),
            (None, None) => Err(crate::error::Error::invalid(
                "a tied LM head needs the embedding's gradient buffer",
            )),
        }
    }

    /// Logits `[rows, V]` of the head for inspection and generation (materialised; small
    /// batches) from the rows `rows` of x `[T, H]`, before a final soft-cap: pass them through
    /// [`Decoder::finish_logits`] once on the host.
    pub fn logits(
        &self,
        b: &B,
        out: &mut B::Floats,
        s: &mut HeadScratch<B>,
        x: &B::Floats,
        rows: std::ops::Range<usize>,
        w: HeadWeights<'_, B>,
    ) -> Result<()> {
        let (h, v) = (self.spec.hidden, self.spec.vocab);
        let tokens = rows.len();
        let norm_w = self.norm_weight(b, w.head, &self.head.norm, &mut s.norm_w)?;
        b.rmsnorm_forward(
            b.view_mut(&mut s.normed, 0..tokens * h),
            b.view_mut(&mut s.rstd, 0..tokens),
            Operands { inp: b.view(x, rows.start * h..rows.end * h), w: norm_w },
            &self.norm_shape(tokens),
        )?;
        let (lm, lm_range) = self.lm_weight(w);
        b.matmul_forward(
            b.view_mut(out, 0..tokens * v),
            Operands { inp: b.view(&s.normed, 0..tokens * h), w: b.view(lm, lm_range) },
            &MatmulShape { rows: tokens, k: h, n: v },
        )
    }

    /// Applies the final soft-cap (Gemma 2: `cap · tanh(z / cap)`) to logits read back from
    /// [`Decoder::logits`]; nothing for the other families.
    pub fn finish_logits(&self, logits: &mut [f32]) {
        if let Some(cap) = self.spec.final_softcap {
            logits.iter_mut().for_each(|z| *z = crate::backend::softcap(*z, cap).0);
        }
    }
}
