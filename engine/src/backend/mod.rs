//! The coarse operations one training step needs, with two implementations: `cpu` (the
//! reference: f32, plain loops) and, on NVIDIA GPUs, `cuda`.
//!
//! The contract is split in two. [`Device`] is the device itself: its buffers and views,
//! synchronous and asynchronous transfers, streams, events and timing marks. The ops come in
//! families, one trait each, every one a subtrait of [`Device`]: [`ElementwiseOps`],
//! [`MatmulOps`], [`NormOps`], [`AttentionOps`], [`MoeOps`], [`LossOps`]. [`Backend`] is all
//! of them together and is implemented for every type that implements them, so code generic
//! over `B: Backend` calls every method; code holding a concrete backend imports the traits it
//! calls (`use backend::prelude::*` brings them all).
//!
//! Conventions, shared by every op on every backend:
//! - Arguments come in the order outputs, inputs, sizes. Every tensor is row-major; its shape is
//!   written beside it as `[rows, cols]`. An op that applies a weight takes its input and weight
//!   as [`Operands`], and its backward writes their gradients as [`Grads`]; the sizes of an op
//!   family travel as one shape ([`MatmulShape`], [`NormShape`], [`AttentionShape`],
//!   [`MoeShape`], [`LossShape`], ...).
//! - Parameter gradients accumulate (`+=`); activation gradients and forward outputs overwrite
//!   (`=`). Each op's doc names which of its outputs accumulate.
//! - `T` is the number of tokens in the micro-batch (rows of the packed batch, flattened), `H` the
//!   hidden size, `V` the vocabulary, `I` the MLP's intermediate size, `nq`/`nkv` the query and
//!   key/value head counts, `hd` the head dimension, `Dqkv = (nq + 2 nkv) hd`.
//! - The fused projection `qkv` stores each token's row as `[q heads | k heads | v heads]`, each
//!   head `hd` wide; `gate_up` stores each row as `[gate (I) | up (I)]`.
//! - Documents: `cu_seqlens[d]..cu_seqlens[d+1]` are the tokens of document `d`. A token attends
//!   to tokens of its own document at or before it, and with a sliding window `W` only to the `W`
//!   most recent of those (itself included), as Hugging Face's sliding-window mask does.
//! - Token ids, positions, targets and document bounds are `i32` on every backend; a target of
//!   [`IGNORE`] means the token is not trained.
//!
//! A backend stores floats in its own precision (f32 on the CPU; bf16 activations and weights
//! with f32 gradient accumulators on a GPU), chosen by [`FloatKind`] at allocation. The ops are
//! what the decoder in `model`, the schedule and the KV-cached inference forward in `generate`
//! call, and no more: 25 methods of [`Device`] and 43 ops.

pub mod cpu;
pub mod cuda;

/// Every trait of the backend, for code that calls ops on a concrete backend (`Cpu`, `Cuda`).
pub mod prelude {
    pub use super::{
        AttentionOps, Backend, Device, ElementwiseOps, LossOps, MatmulOps, MoeOps, NormOps,
    };
}

use std::ops::Range;

use crate::error::Result;
use crate::store::HostSlab;
pub use crate::store::WeightDtype;

/// Gemma 2's soft-cap `cap · tanh(z / cap)` as transformers writes it (`z / cap`, `tanh`,
/// `* cap`), and its derivative `1 − tanh²`: the CPU reference's capped ops and the decoder's
/// host-side logits share it.
pub fn softcap(z: f32, cap: f32) -> (f32, f32) {
    let t = (z / cap).tanh();
    (t * cap, 1.0 - t * t)
}

/// Target value of a token that carries no loss (prompt tokens, padding, document ends).
pub const IGNORE: i32 = -100;

/// What a float buffer holds, which decides its precision on backends that have a choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatKind {
    /// Weights, activations and their gradients: bf16 on a GPU.
    Activation,
    /// Weight-gradient accumulators, reductions and small tables such as RoPE frequencies: f32
    /// everywhere.
    Accum,
}

/// The activation of the gated MLP's gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GluAct {
    /// `silu(g) = g · sigmoid(g)` (SwiGLU: llama, qwen, mistral, phi3).
    Silu,
    /// `gelu(g)` with the tanh approximation (GeGLU: gemma's `gelu_pytorch_tanh`).
    GeluTanh,
    /// GPT-OSS's experts (`GptOssExperts._apply_gate`): the row's gate and up columns are
    /// interleaved (`[g0, u0, g1, u1, ...]`, not `[gate | up]`), `g = min(g, 7)`,
    /// `u = clamp(u, -7, 7)`, `out = (u + 1) · g · sigmoid(1.702 g)`.
    ClampedSwiglu,
}

/// GPT-OSS's clamped SwiGLU constants (`GptOssExperts.alpha`, `.limit`).
pub const CLAMPED_SWIGLU_ALPHA: f32 = 1.702;
pub const CLAMPED_SWIGLU_LIMIT: f32 = 7.0;

/// How a mixture-of-experts router turns a token's logits `z [E]` into its `k` experts and
/// their weights. Both pick the `k` largest logits in descending order (ties to the lower
/// expert index); `softmax(z)` is monotone, so picking by probability picks the same ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterKind {
    /// `p = softmax(z)` over all experts; the weights are the chosen `p`, divided by their
    /// sum when `renormalize` (Mixtral always; Qwen MoE's `norm_topk_prob`).
    SoftmaxTopK { renormalize: bool },
    /// The weights are `softmax` over the chosen logits alone (GPT-OSS's router).
    TopKSoftmax,
}

/// The shapes of a mixture-of-experts MLP call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeShape {
    /// Tokens in the micro-batch.
    pub tokens: usize,
    pub hidden: usize,
    /// Experts of the layer (`E`).
    pub experts: usize,
    /// Experts per token (`k`).
    pub top_k: usize,
    pub router: RouterKind,
}

impl MoeShape {
    /// Rows of the expert-sorted activations: one per (token, slot) pair, `T k`.
    pub fn rows(&self) -> usize {
        self.tokens * self.top_k
    }
}

/// How the experts' matrices of one projection sit in the layer's slab: `E` matrices one after
/// another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertLayout {
    /// `[E, N, K]`, each expert's `nn.Linear` weight: `out = inp · W_eᵀ` (Mixtral, Qwen MoE).
    Rows,
    /// `[E, K, N]`: `out = inp · W_e` (GPT-OSS's `gate_up_proj`, `down_proj`).
    Cols,
}

/// One grouped GEMM over expert-sorted rows: expert `e` multiplies rows
/// `offsets[e]..offsets[e + 1]` by its own matrix.
#[derive(Debug, Clone, Copy)]
pub struct GroupedShape<'a> {
    /// `[E + 1]`, non-decreasing, from [`MoeOps::moe_sort`]; the last entry is the row count.
    pub offsets: &'a [usize],
    /// Input width.
    pub k: usize,
    /// Output width.
    pub n: usize,
    pub layout: ExpertLayout,
}

impl GroupedShape<'_> {
    pub fn experts(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    pub fn rows(&self) -> usize {
        self.offsets.last().copied().unwrap_or(0)
    }
}

/// The shapes an attention call works on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionShape {
    /// Tokens in the micro-batch.
    pub tokens: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads; divides `q_heads` (grouped-query attention).
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Number of documents described by `cu_seqlens` (which has `docs + 1` entries).
    pub docs: usize,
    /// Sliding window in tokens, itself included; `None` for full causal attention.
    pub window: Option<usize>,
    /// Scores are scaled by `1 / sqrt(d)` for this `d`; `None` for the head dimension (Gemma's
    /// `query_pre_attn_scalar` sets another).
    pub scale_dim: Option<usize>,
    /// Scaled scores `s` become `cap · tanh(s / cap)` before the softmax (Gemma 2's
    /// `attn_logit_softcapping`); `None` leaves them alone.
    pub softcap: Option<f32>,
}

impl AttentionShape {
    /// Width of one token's fused `qkv` row.
    pub fn qkv_width(&self) -> usize {
        (self.q_heads + 2 * self.kv_heads) * self.head_dim
    }

    /// The factor the scores `q · k` are multiplied by before the softmax.
    pub fn softmax_scale(&self) -> f32 {
        softmax_scale(self.scale_dim.unwrap_or(self.head_dim))
    }
}

/// `1 / sqrt(d)` in f32 (transformers' `scaling = d ** -0.5`).
fn softmax_scale(d: usize) -> f32 {
    1.0 / (d as f32).sqrt()
}

/// The shapes of an attention call of a few new queries against a key/value cache
/// ([`AttentionOps::attention_decode`]): one sequence, no documents.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeShape {
    /// Positions already in the cache before the new tokens.
    pub past: usize,
    /// New query tokens, at positions `past..past + tokens`; the cache holds their keys too.
    pub tokens: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads; divides `q_heads` (grouped-query attention).
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Sliding window in tokens, itself included; `None` for full causal attention.
    pub window: Option<usize>,
    /// As [`AttentionShape::scale_dim`].
    pub scale_dim: Option<usize>,
    /// As [`AttentionShape::softcap`].
    pub softcap: Option<f32>,
}

impl DecodeShape {
    /// The factor the scores `q · k` are multiplied by before the softmax.
    pub fn softmax_scale(&self) -> f32 {
        softmax_scale(self.scale_dim.unwrap_or(self.head_dim))
    }

    /// Positions the cache holds for this call: `past + tokens`.
    pub fn positions(&self) -> usize {
        self.past + self.tokens
    }
}

impl AttentionShape {
    /// The same attention for `tokens` new queries at positions `past..past + tokens` against a
    /// key/value cache (one sequence, no documents).
    pub fn decode(&self, past: usize) -> DecodeShape {
        DecodeShape {
            past,
            tokens: self.tokens,
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            window: self.window,
            scale_dim: self.scale_dim,
            softcap: self.softcap,
        }
    }
}

/// The shape of `nn.Linear`'s product `out [rows, n] = inp [rows, k] · wᵀ`, w `[n, k]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatmulShape {
    /// Rows of the input and of the output (tokens).
    pub rows: usize,
    /// Input width, the dimension the product sums over.
    pub k: usize,
    /// Output width.
    pub n: usize,
}

/// The shape of an RMSNorm: `rows` rows of `dim` elements, each normalised as a whole.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormShape {
    pub rows: usize,
    pub dim: usize,
    /// Added to each row's mean square before the square root. The backward reads the forward's
    /// `rstd` instead, so the same shape serves both.
    pub eps: f32,
}

/// The shape of the LM head's cross-entropy: `tokens` rows of `hidden` against `vocab` logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossShape {
    pub tokens: usize,
    pub hidden: usize,
    pub vocab: usize,
    /// The logits `z` become `cap · tanh(z / cap)` before the softmax (Gemma 2's
    /// `final_logit_softcapping`); `None` leaves them alone.
    pub softcap: Option<f32>,
}

/// An op's input and the weight it applies to it, which its backward reads again. The two
/// views have a type each because a backend's views are invariant in their lifetime: the weight
/// (a view of a slab, often held across ops) must not stretch the borrow of the input.
#[derive(Debug, Clone, Copy)]
pub struct Operands<I, W = I> {
    pub inp: I,
    pub w: W,
}

/// What [`MatmulOps::matmul_forward_add`] adds to the product: a bias `[N]` broadcast over the
/// rows, and a residual `[T, N]`, each optional.
#[derive(Debug, Clone, Copy)]
pub struct Addends<V> {
    pub bias: Option<V>,
    pub residual: Option<V>,
}

/// What a backward writes for an input and the weight applied to it: `dinp`, which overwrites,
/// and `dw`, which accumulates where the weight is a parameter (each op's doc says which).
#[derive(Debug)]
pub struct Grads<M> {
    pub dinp: M,
    pub dw: M,
}

/// What the cross-entropy's forward writes per token: the loss (0 where the target is
/// [`IGNORE`]) and the log-sum-exp of the logits, both Accum `[T]`.
#[derive(Debug)]
pub struct LossOut<M> {
    pub losses: M,
    pub lse: M,
}

/// An attention's output and the log-sum-exp of each query's scaled scores: the forward writes
/// them, the sinks rescale them in place, and both backwards read them.
#[derive(Debug, Clone, Copy)]
pub struct AttentionOut<V> {
    /// `[T, nq hd]`.
    pub out: V,
    /// `[T, nq]` (Accum).
    pub lse: V,
}

/// A router's decisions as [`MoeOps::moe_route`] wrote them, which its backward reads.
#[derive(Debug, Clone, Copy)]
pub struct Routing<V, I> {
    /// `[T, k]` (Accum).
    pub weights: V,
    /// `[T, E]` (Accum).
    pub probs: V,
    /// `[T, k]`.
    pub experts: I,
}

/// One rank's link to the other ranks of a data-parallel group: sums a buffer over every rank,
/// in place. Implementations: NCCL on GPUs (`cuda::nccl`), shared memory between threads on the
/// CPU (`schedule::CpuGroup`).
pub trait AllReduce<B: Backend>: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// `x[i] = sum over ranks of x[i]`, queued on `b`'s compute stream after the work already
    /// there. Every rank calls it with the same length, in the same order; afterwards every
    /// rank holds the same bits.
    fn all_reduce_sum(&self, b: &B, x: B::ViewMut<'_>) -> Result<()>;
}

/// A compute device and its memory: buffers, transfers, streams, events and timing marks.
/// Only the schedule in `schedule` creates streams and events; the ops ([`Backend`]) run on
/// [`Device::compute_stream`].
pub trait Device: Send + Sync {
    /// An owned float buffer in device memory.
    type Floats: Send;
    /// An owned `i32` buffer in device memory.
    type Ints: Send;
    /// A read-only window into a float buffer.
    type View<'a>: Copy
    where
        Self: 'a;
    /// A writable window into a float buffer.
    type ViewMut<'a>
    where
        Self: 'a;

    /// An ordered queue of device work (a CUDA stream). The CPU backend runs everything in
    /// call order, so its streams and events are no-ops.
    type Stream;
    /// A point in a stream that other streams or the host can wait for.
    type Event;
    /// A point in a stream whose device time can be read back ([`Device::elapsed`]).
    type Mark;

    /// Human-readable name for messages ("cpu", "cuda:0 NVIDIA H200").
    fn name(&self) -> String;

    /// Whether every op has finished when its call returns (the CPU). A step may then be
    /// abandoned between any two ops with nothing left in flight.
    fn synchronous(&self) -> bool {
        false
    }

    /// The dtype of [`FloatKind::Activation`] buffers, in which weights are streamed.
    fn weight_dtype(&self) -> WeightDtype;

    /// Bytes per element of a float buffer of `kind` (what a host slab must hold per element
    /// for [`Device::upload_on`] / [`Device::download_on`]).
    fn elem_bytes(&self, kind: FloatKind) -> usize {
        match kind {
            FloatKind::Activation => self.weight_dtype().bytes(),
            FloatKind::Accum => 4,
        }
    }

    /// Page-locks a host slab so transfers can read and write it asynchronously at full speed;
    /// not write-combined, because the CPU reads it too. A no-op on the CPU.
    fn pin(&self, slab: &mut HostSlab) -> Result<()>;

    fn new_stream(&self) -> Result<Self::Stream>;

    fn new_event(&self) -> Result<Self::Event>;

    /// The stream every op below (memory, compute) is queued on; transfers on other streams
    /// are ordered against it with events.
    fn compute_stream(&self) -> Self::Stream;

    /// Marks the current end of `stream`'s work.
    fn record(&self, event: &Self::Event, stream: &Self::Stream) -> Result<()>;

    /// Work queued on `stream` after this call starts only once `event` has completed.
    fn wait(&self, stream: &Self::Stream, event: &Self::Event) -> Result<()>;

    /// Blocks the calling thread until `event` has completed.
    fn synchronize(&self, event: &Self::Event) -> Result<()>;

    /// Marks the current end of `stream`'s work, to time it with [`Device::elapsed`].
    fn mark(&self, stream: &Self::Stream) -> Result<Self::Mark>;

    /// The device time from mark `a` to mark `b`, both on one stream and `b` the later, once
    /// the stream has reached `b`: `None` where the ops run on the calling thread (the CPU),
    /// so that any host wait between two marks is time the device did nothing.
    fn elapsed(&self, a: &Self::Mark, b: &Self::Mark) -> Result<Option<std::time::Duration>>;

    /// Queues a copy of the view's length in elements from `src` (starting `offset` bytes in,
    /// in the buffer's own dtype) into `dst` on `stream`, and returns before it has run.
    ///
    /// # Safety
    /// The device reads `src` after this call returns: `src` must stay allocated and unchanged,
    /// and `dst` must not be freed, until an event recorded on `stream` after this call has
    /// completed.
    unsafe fn upload_on(
        &self,
        stream: &Self::Stream,
        dst: Self::ViewMut<'_>,
        src: &HostSlab,
        offset: usize,
    ) -> Result<()>;

    /// Queues a copy of the view's length in f32 elements from `src` (starting `offset` bytes
    /// in) into `dst`, converted to `dst`'s dtype on the device (round to nearest even, as
    /// `half::bf16::from_f32`), on `stream`, and returns before it has run. Where the dtypes
    /// differ the values pass through `staging`, an f32 buffer (`FloatKind::Accum`), a chunk
    /// of its length at a time; where they are the same (the CPU's f32 weights) this is
    /// [`Device::upload_on`] and `staging` may be `None`.
    ///
    /// # Safety
    /// As [`Device::upload_on`], and `staging` must not be read or written by work on another
    /// stream until an event recorded on `stream` after this call has completed.
    unsafe fn upload_f32_on(
        &self,
        stream: &Self::Stream,
        dst: Self::ViewMut<'_>,
        src: &HostSlab,
        offset: usize,
        staging: Option<&mut Self::Floats>,
    ) -> Result<()> {
        let _ = staging;
        if self.weight_dtype() != WeightDtype::F32 {
            return Err(crate::error::Error::invalid(format!(
                "{} does not implement casting uploads",
                self.name()
            )));
        }
        // SAFETY: the caller's obligations are `upload_on`'s.
        unsafe { self.upload_on(stream, dst, src, offset) }
    }

    /// Queues a copy of `src` (in its own dtype) into `dst` at `offset` bytes on `stream`, and
    /// returns before it has run.
    ///
    /// # Safety
    /// The device writes `dst` after this call returns: `dst` must stay allocated and must not
    /// be read or written, and `src` must not be freed, until an event recorded on `stream`
    /// after this call has completed.
    unsafe fn download_on(
        &self,
        stream: &Self::Stream,
        dst: &mut HostSlab,
        offset: usize,
        src: Self::View<'_>,
    ) -> Result<()>;

    /// A zero-filled float buffer of `len` elements.
    fn alloc(&self, len: usize, kind: FloatKind) -> Result<Self::Floats>;

    /// A buffer holding `src`'s values in the precision `kind` chooses. The CPU backend keeps
    /// the vector itself (no copy); others allocate and upload.
    fn upload_vec(&self, src: Vec<f32>, kind: FloatKind) -> Result<Self::Floats> {
        let mut buf = self.alloc(src.len(), kind)?;
        self.upload(self.view_mut(&mut buf, 0..src.len()), &src)?;
        Ok(buf)
    }

    /// A zero-filled int buffer of `len` elements.
    fn alloc_ints(&self, len: usize) -> Result<Self::Ints>;

    /// Number of elements in a float buffer.
    fn len(&self, buf: &Self::Floats) -> usize;

    fn view<'a>(&self, buf: &'a Self::Floats, range: Range<usize>) -> Self::View<'a>;

    fn view_mut<'a>(&self, buf: &'a mut Self::Floats, range: Range<usize>) -> Self::ViewMut<'a>;

    /// Host to device; `src.len()` must equal the view's length.
    fn upload(&self, dst: Self::ViewMut<'_>, src: &[f32]) -> Result<()>;

    /// Device to host; `dst.len()` must equal the view's length.
    fn download(&self, dst: &mut [f32], src: Self::View<'_>) -> Result<()>;

    /// Host to device for ints; `src.len()` must not exceed the buffer's length.
    fn upload_ints(&self, dst: &mut Self::Ints, src: &[i32]) -> Result<()>;
}

/// Elementwise ops and reductions: zero fills, copies, adds, sums, the embedding, biases,
/// the gated activations and RoPE.
pub trait ElementwiseOps: Device {
    /// `dst = 0`.
    fn fill_zero(&self, dst: Self::ViewMut<'_>) -> Result<()>;

    /// `dst = src`, same length.
    fn copy(&self, dst: Self::ViewMut<'_>, src: Self::View<'_>) -> Result<()>;

    /// `out = a + b` (the residual connection), all `[n]`.
    fn add(&self, out: Self::ViewMut<'_>, a: Self::View<'_>, b: Self::View<'_>) -> Result<()>;

    /// `dst += src`, both `[n]` (gradients meeting at a residual fork).
    fn add_assign(&self, dst: Self::ViewMut<'_>, src: Self::View<'_>) -> Result<()>;

    /// Sum of all elements, accumulated in f64 on the host side of the call.
    fn sum(&self, src: Self::View<'_>) -> Result<f64>;

    /// Sum of squares of all elements (the gradient-norm reduction), in f64.
    fn sum_squares(&self, src: Self::View<'_>) -> Result<f64>;

    /// `out[t] = scale · table[ids[t]]` (Gemma scales its embeddings by `sqrt(H)`; 1 elsewhere).
    /// out `[T, H]`, ids `[T]`, table `[V, H]`.
    fn embedding_forward(
        &self,
        out: Self::ViewMut<'_>,
        ids: &Self::Ints,
        table: Self::View<'_>,
        tokens: usize,
        hidden: usize,
        scale: f32,
    ) -> Result<()>;

    /// `dtable[ids[t]] += scale · dout[t]` (accumulates). dtable `[V, H]`, dout `[T, H]`.
    fn embedding_backward(
        &self,
        dtable: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        ids: &Self::Ints,
        tokens: usize,
        hidden: usize,
        scale: f32,
    ) -> Result<()>;

    /// `out[t] += bias` for every row. out `[T, N]`, bias `[N]`.
    fn bias_forward(
        &self,
        out: Self::ViewMut<'_>,
        bias: Self::View<'_>,
        rows: usize,
        n: usize,
    ) -> Result<()>;

    /// `dbias += Σ_t dout[t]` (accumulates). dbias `[N]`, dout `[T, N]`.
    fn bias_backward(
        &self,
        dbias: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        rows: usize,
        n: usize,
    ) -> Result<()>;

    /// Rotates the query and key heads of `qkv` `[T, Dqkv]` in place by `pos[t] * inv_freq[i]`,
    /// pairing element `i` with `i + r/2` (Hugging Face's `rotate_half`) where `r = 2 ·
    /// inv_freq.len() <= hd` is the rotary width (dims `r..hd` of a head pass through: partial
    /// rotary). The angle is formed in f32 as `(pos as f32) * inv_freq[i]`, as transformers
    /// does; cos and sin are multiplied by `scale` (transformers' `attention_scaling`) in f32.
    /// inv_freq `[r/2]` (Accum). Reference: `apply_rotary_pos_emb` in modeling_llama.py and
    /// modeling_phi3.py.
    fn rope_forward(
        &self,
        qkv: Self::ViewMut<'_>,
        pos: &Self::Ints,
        inv_freq: Self::View<'_>,
        scale: f32,
        shape: &AttentionShape,
    ) -> Result<()>;

    /// The transpose of [`ElementwiseOps::rope_forward`]: rotates the gradient in place by
    /// `-angle`, scaled alike.
    fn rope_backward(
        &self,
        dqkv: Self::ViewMut<'_>,
        pos: &Self::Ints,
        inv_freq: Self::View<'_>,
        scale: f32,
        shape: &AttentionShape,
    ) -> Result<()>;

    /// The gated MLP's activation: `out = act(gate) * up`. out `[T, I]`, gate_up `[T, 2I]`.
    /// Reference: `LlamaMLP` (SiLU) and `Gemma3MLP` (GELU, tanh approximation).
    fn glu_forward(
        &self,
        out: Self::ViewMut<'_>,
        gate_up: Self::View<'_>,
        rows: usize,
        inter: usize,
        act: GluAct,
    ) -> Result<()>;

    /// dgate_up `[T, 2I]` (overwrites), dout `[T, I]`, gate_up `[T, 2I]`.
    fn glu_backward(
        &self,
        dgate_up: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        gate_up: Self::View<'_>,
        rows: usize,
        inter: usize,
        act: GluAct,
    ) -> Result<()>;
}

/// `nn.Linear`'s product and its backward (cuBLASLt on a GPU).
pub trait MatmulOps: Device {
    /// `out = inp · wᵀ`. out `[T, N]`, inp `[T, K]`, w `[N, K]` (PyTorch's `nn.Linear`).
    fn matmul_forward(
        &self,
        out: Self::ViewMut<'_>,
        operands: Operands<Self::View<'_>, Self::View<'_>>,
        shape: &MatmulShape,
    ) -> Result<()>;

    /// `out = inp · wᵀ + bias + residual`, each addend where given: the projection that ends
    /// in a residual connection (`x1 = x + o(att)`), or one with a bias. The CUDA backend adds
    /// both in the GEMM's epilogue, where [`MatmulOps::matmul_forward`],
    /// [`ElementwiseOps::bias_forward`] and [`ElementwiseOps::add`] would move the output through
    /// memory twice more and round it three times (the epilogue rounds the residual's sum once;
    /// cuBLASLt may round the product before it adds a bias, within one more bf16 ulp).
    /// out `[T, N]`, inp `[T, K]`, w `[N, K]`, bias `[N]`, residual `[T, N]`.
    fn matmul_forward_add(
        &self,
        out: Self::ViewMut<'_>,
        operands: Operands<Self::View<'_>, Self::View<'_>>,
        addends: Addends<Self::View<'_>>,
        shape: &MatmulShape,
    ) -> Result<()>;

    /// `dinp = dout · w` (overwrites) and `dw += doutᵀ · inp` (accumulates).
    /// dinp `[T, K]`, dw `[N, K]`, dout `[T, N]`, inp `[T, K]`, w `[N, K]`.
    fn matmul_backward(
        &self,
        grads: Grads<Self::ViewMut<'_>>,
        dout: Self::View<'_>,
        operands: Operands<Self::View<'_>, Self::View<'_>>,
        shape: &MatmulShape,
    ) -> Result<()>;
}

/// RMSNorm, over whole rows and per head.
pub trait NormOps: Device {
    /// RMSNorm over the last dimension: `out = inp / sqrt(mean(inp²) + eps) * w`, and
    /// `rstd[r] = 1 / sqrt(mean(inp[r]²) + eps)` kept for the backward.
    /// out `[R, D]`, rstd `[R]` (Accum), inp `[R, D]`, w `[D]`.
    /// Reference: `LlamaRMSNorm` in transformers' modeling_llama.py.
    fn rmsnorm_forward(
        &self,
        out: Self::ViewMut<'_>,
        rstd: Self::ViewMut<'_>,
        operands: Operands<Self::View<'_>, Self::View<'_>>,
        shape: &NormShape,
    ) -> Result<()>;

    /// dinp `[R, D]` (overwrites), dw `[D]` (accumulates), dout `[R, D]`, inp `[R, D]`, w `[D]`,
    /// rstd `[R]`.
    fn rmsnorm_backward(
        &self,
        grads: Grads<Self::ViewMut<'_>>,
        dout: Self::View<'_>,
        operands: Operands<Self::View<'_>, Self::View<'_>>,
        rstd: Self::View<'_>,
        shape: &NormShape,
    ) -> Result<()>;

    /// [`NormOps::rmsnorm_backward`] with `dinp = (norm's input gradient) + residual`: the
    /// gradient of a residual stream that feeds both the norm and, around it, the next residual
    /// add, summed where the CUDA backend computes the first term instead of in another pass.
    /// residual `[R, D]`, the rest as for [`NormOps::rmsnorm_backward`].
    fn rmsnorm_backward_add(
        &self,
        grads: Grads<Self::ViewMut<'_>>,
        dout: Self::View<'_>,
        operands: Operands<Self::View<'_>, Self::View<'_>>,
        rstd: Self::View<'_>,
        residual: Self::View<'_>,
        shape: &NormShape,
    ) -> Result<()>;

    /// Qwen3's per-head RMSNorm of the query and key heads inside a fused `qkv` row; the value
    /// heads are copied unchanged. out and inp `[T, Dqkv]`, rstd `[T, nq + nkv]` (Accum),
    /// w `[2 hd]` = `[q_norm (hd) | k_norm (hd)]`.
    fn head_rmsnorm_forward(
        &self,
        out: Self::ViewMut<'_>,
        rstd: Self::ViewMut<'_>,
        operands: Operands<Self::View<'_>, Self::View<'_>>,
        shape: &AttentionShape,
        eps: f32,
    ) -> Result<()>;

    /// dinp `[T, Dqkv]` (overwrites; value heads pass through), dw `[2 hd]` (accumulates).
    fn head_rmsnorm_backward(
        &self,
        grads: Grads<Self::ViewMut<'_>>,
        dout: Self::View<'_>,
        operands: Operands<Self::View<'_>, Self::View<'_>>,
        rstd: Self::View<'_>,
        shape: &AttentionShape,
    ) -> Result<()>;
}

/// Attention over packed documents, against a KV cache, and attention sinks.
pub trait AttentionOps: Device {
    /// Causal grouped-query attention within documents, scale `1/sqrt(hd)`.
    /// att.out `[T, nq hd]`, att.lse `[T, nq]` (Accum: the log-sum-exp of each query's scaled
    /// scores), qkv `[T, Dqkv]` (after RoPE), cu_seqlens `[docs + 1]`.
    fn attention_forward(
        &self,
        att: AttentionOut<Self::ViewMut<'_>>,
        qkv: Self::View<'_>,
        cu_seqlens: &Self::Ints,
        shape: &AttentionShape,
    ) -> Result<()>;

    /// dqkv `[T, Dqkv]` (overwrites), dout `[T, nq hd]`, qkv and att from the forward.
    fn attention_backward(
        &self,
        dqkv: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        qkv: Self::View<'_>,
        att: AttentionOut<Self::View<'_>>,
        cu_seqlens: &Self::Ints,
        shape: &AttentionShape,
    ) -> Result<()>;

    /// Attention of `tokens` new queries at positions `past..past + tokens` against the keys
    /// and values of every position up to theirs (the inference forward's KV cache): causal,
    /// grouped-query, within the sliding window, scale `1/sqrt(hd)`; no lse (nothing runs
    /// backward). out `[tokens, nq hd]`, q `[tokens, nq hd]` (after RoPE), k_cache and v_cache
    /// `[past + tokens, nkv hd]` (keys after RoPE; the new tokens' rows already appended).
    /// With `sinks` `[nq]` (GPT-OSS), each head's softmax denominator also holds `exp(sink)`,
    /// as [`AttentionOps::attention_sinks_forward`] describes.
    fn attention_decode(
        &self,
        out: Self::ViewMut<'_>,
        q: Self::View<'_>,
        k_cache: Self::View<'_>,
        v_cache: Self::View<'_>,
        sinks: Option<Self::View<'_>>,
        shape: &DecodeShape,
    ) -> Result<()>;

    /// GPT-OSS's attention sinks, applied to [`AttentionOps::attention_forward`]'s results: head
    /// `h` has a learned logit `sinks[h]` in its softmax's denominator with no value behind it
    /// (`eager_attention_forward` in modeling_gpt_oss.py), so `lse' = log(exp(lse) +
    /// exp(sink))` and `out *= exp(lse - lse')`, both in place.
    /// [`AttentionOps::attention_backward`] given the new `out` and `lse` is then the backward of
    /// the sinked attention as it stands.
    /// att.out `[T, nq hd]`, att.lse `[T, nq]` (Accum), sinks `[nq]`.
    fn attention_sinks_forward(
        &self,
        att: AttentionOut<Self::ViewMut<'_>>,
        sinks: Self::View<'_>,
        shape: &AttentionShape,
    ) -> Result<()>;

    /// `dsinks[h] += -Σ_t exp(sinks[h] - lse[t, h]) · (dout[t, h] · out[t, h])` (accumulates),
    /// with `out` and `lse` as [`AttentionOps::attention_sinks_forward`] left them. dsinks `[nq]`
    /// (Accum), dout and att.out `[T, nq hd]`, att.lse `[T, nq]`.
    fn attention_sinks_backward(
        &self,
        dsinks: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        att: AttentionOut<Self::View<'_>>,
        sinks: Self::View<'_>,
        shape: &AttentionShape,
    ) -> Result<()>;
}

/// A mixture-of-experts MLP's routing, sorting, gathers, combines and grouped GEMMs.
///
/// A layer's MoE MLP: `z = x · Wrᵀ (+ br)` (matmul_forward), `moe_route` picks each token's
/// experts and weights, `moe_sort` orders the `T k` (token, slot) pairs by expert,
/// `moe_gather` copies each pair's input row into that order, two `grouped_matmul_forward`
/// around `glu_forward` run every expert on its rows, and `moe_combine` sums each token's
/// expert outputs by their weights. Reference: `MixtralSparseMoeBlock`,
/// `Qwen3MoeSparseMoeBlock`, `GptOssMLP` in transformers.
pub trait MoeOps: Device {
    /// Routing. probs `[T, E]` (Accum) = `softmax(logits)` in f32 (kept for the load-balancing
    /// loss and the backward), experts `[T, k]` the chosen experts in descending order of
    /// logit, weights `[T, k]` (Accum) as `shape.router` says. logits `[T, E]`.
    fn moe_route(
        &self,
        weights: Self::ViewMut<'_>,
        probs: Self::ViewMut<'_>,
        experts: &mut Self::Ints,
        logits: Self::View<'_>,
        shape: &MoeShape,
    ) -> Result<()>;

    /// dlogits `[T, E]` (overwrites): the gradient through the routing weights of `dweights`
    /// `[T, k]`, plus, with `aux = Some((counts, scale))`, the load-balancing loss's
    /// `scale · p_e (c_e − Σ_j p_j c_j)` where `c = counts [E]` (Accum) are the step's counts
    /// of pairs per expert (transformers' `load_balancing_loss_func`: the loss is
    /// `E Σ_e c_e P_e / N²`, `P_e` the summed probabilities, and the counts carry no gradient).
    /// `routing` is what [`MoeOps::moe_route`] wrote.
    fn moe_route_backward(
        &self,
        dlogits: Self::ViewMut<'_>,
        dweights: Self::View<'_>,
        routing: Routing<Self::View<'_>, &Self::Ints>,
        aux: Option<(Self::View<'_>, f32)>,
        shape: &MoeShape,
    ) -> Result<()>;

    /// The load-balancing loss's statistics, accumulated over layers: `stats[e] +=` the pairs
    /// routed to expert `e`, `stats[E + e] += Σ_t probs[t, e]`. stats `[2E]` (Accum).
    fn moe_router_stats(
        &self,
        stats: Self::ViewMut<'_>,
        probs: Self::View<'_>,
        experts: &Self::Ints,
        shape: &MoeShape,
    ) -> Result<()>;

    /// Orders the `T k` pairs (pair `p = t k + j` is token `t`'s `j`-th expert) by expert,
    /// keeping pair order within an expert: `order[r]` is the pair at sorted row `r`,
    /// `rows[p]` the sorted row of pair `p`. Returns the offsets `[E + 1]` on the host: expert
    /// `e`'s rows are `offsets[e]..offsets[e + 1]` (a GPU waits here for the routing).
    /// order and rows `[T k]`, experts `[T, k]`.
    fn moe_sort(
        &self,
        order: &mut Self::Ints,
        rows: &mut Self::Ints,
        experts: &Self::Ints,
        shape: &MoeShape,
    ) -> Result<Vec<usize>>;

    /// `xs[r] = x[order[r] / k]`. xs `[T k, H]`, x `[T, H]`.
    fn moe_gather(
        &self,
        xs: Self::ViewMut<'_>,
        x: Self::View<'_>,
        order: &Self::Ints,
        shape: &MoeShape,
    ) -> Result<()>;

    /// `dx[t] = Σ_j dxs[rows[t k + j]]`, j ascending (overwrites). dx `[T, H]`, dxs `[T k, H]`.
    fn moe_gather_backward(
        &self,
        dx: Self::ViewMut<'_>,
        dxs: Self::View<'_>,
        rows: &Self::Ints,
        shape: &MoeShape,
    ) -> Result<()>;

    /// `out[t] = Σ_j weights[t, j] · y[rows[t k + j]]`, j ascending (overwrites).
    /// out `[T, H]`, y `[T k, H]`, weights `[T, k]` (Accum).
    fn moe_combine(
        &self,
        out: Self::ViewMut<'_>,
        y: Self::View<'_>,
        weights: Self::View<'_>,
        rows: &Self::Ints,
        shape: &MoeShape,
    ) -> Result<()>;

    /// `dy[rows[t k + j]] = weights[t, j] · dout[t]` and `dweights[t, j] = dout[t] ·
    /// y[rows[t k + j]]` (both overwrite; the dot in f32): `grads.dinp` is dy `[T k, H]`,
    /// `grads.dw` dweights `[T, k]` (Accum). dout `[T, H]`.
    fn moe_combine_backward(
        &self,
        grads: Grads<Self::ViewMut<'_>>,
        dout: Self::View<'_>,
        y: Self::View<'_>,
        weights: Self::View<'_>,
        rows: &Self::Ints,
        shape: &MoeShape,
    ) -> Result<()>;

    /// Qwen2 MoE's gated shared expert: `out[t] += sigmoid(logits[t]) · y[t]` (accumulates onto
    /// the routed experts' output). out and y `[T, H]`, logits `[T]` (Accum); of the shape only
    /// `tokens` and `hidden` matter (the shared expert is not routed).
    /// Reference: `Qwen2MoeSparseMoeBlock.forward`.
    fn sigmoid_gate_forward(
        &self,
        out: Self::ViewMut<'_>,
        y: Self::View<'_>,
        logits: Self::View<'_>,
        shape: &MoeShape,
    ) -> Result<()>;

    /// `dy[t] = sigmoid(logits[t]) · dout[t]` and `dlogits[t] = σ'(logits[t]) · (dout[t] ·
    /// y[t])` with `σ' = σ (1 − σ)`, the dot in f32 (both overwrite). dy `[T, H]`, dlogits `[T]`.
    fn sigmoid_gate_backward(
        &self,
        dy: Self::ViewMut<'_>,
        dlogits: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        y: Self::View<'_>,
        logits: Self::View<'_>,
        shape: &MoeShape,
    ) -> Result<()>;

    /// Every expert's GEMM over its rows, `out[r] = inp[r] · W_e(ᵀ) (+ bias[e])` for `r` in
    /// expert `e`'s rows. out `[R, N]`, inp `[R, K]`, w `[E, N, K]` or `[E, K, N]` as
    /// `g.layout` says, bias `[E, N]`.
    fn grouped_matmul_forward(
        &self,
        out: Self::ViewMut<'_>,
        operands: Operands<Self::View<'_>, Self::View<'_>>,
        bias: Option<Self::View<'_>>,
        g: &GroupedShape<'_>,
    ) -> Result<()>;

    /// dinp `[R, K]` (overwrites), dw like w (accumulates).
    fn grouped_matmul_backward(
        &self,
        grads: Grads<Self::ViewMut<'_>>,
        dout: Self::View<'_>,
        operands: Operands<Self::View<'_>, Self::View<'_>>,
        g: &GroupedShape<'_>,
    ) -> Result<()>;

    /// `dbias[e] += Σ_{r in expert e's rows} dout[r]` (accumulates). dbias `[E, N]`,
    /// dout `[R, N]`.
    fn grouped_bias_backward(
        &self,
        dbias: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        g: &GroupedShape<'_>,
    ) -> Result<()>;
}

/// The LM head's chunked cross-entropy.
pub trait LossOps: Device {
    /// Cross-entropy of the LM head's logits `x · wᵀ` against `targets`, computed a chunk of the
    /// vocabulary or of the tokens at a time so `[T, V]` logits never exist at once.
    /// losses `[T]` (Accum; 0 where the target is [`IGNORE`]), lse `[T]` (Accum: log-sum-exp of
    /// each token's logits, kept for the backward), x = `operands.inp` `[T, H]`, w `[V, H]`,
    /// targets `[T]`. With `shape.softcap`, the logits `z` become `cap · tanh(z / cap)` first.
    fn cross_entropy_forward(
        &self,
        losses: Self::ViewMut<'_>,
        lse: Self::ViewMut<'_>,
        operands: Operands<Self::View<'_>, Self::View<'_>>,
        targets: &Self::Ints,
        shape: &LossShape,
    ) -> Result<()>;

    /// Gradient of `scale · Σ_t losses[t]`: dinp `[T, H]` (overwrites), dw `[V, H]`
    /// (accumulates). `scale` is 1 / (trained tokens in the whole optimizer step).
    fn cross_entropy_backward(
        &self,
        grads: Grads<Self::ViewMut<'_>>,
        operands: Operands<Self::View<'_>, Self::View<'_>>,
        lse: Self::View<'_>,
        targets: &Self::Ints,
        scale: f32,
        shape: &LossShape,
    ) -> Result<()>;

    /// [`LossOps::cross_entropy_forward`] followed by [`LossOps::cross_entropy_backward`] with
    /// the lse just written, bit for bit, for training's head, whose backward follows its
    /// forward at once: each chunk's logits are computed once instead of twice.
    fn cross_entropy_forward_backward(
        &self,
        out: LossOut<Self::ViewMut<'_>>,
        grads: Grads<Self::ViewMut<'_>>,
        operands: Operands<Self::View<'_>, Self::View<'_>>,
        targets: &Self::Ints,
        scale: f32,
        shape: &LossShape,
    ) -> Result<()>;
}

/// Everything a training step and the inference forward call: the device and every op family.
/// Implemented for every type that implements its parts, so `B: Backend` reaches every method.
pub trait Backend:
    Device + ElementwiseOps + MatmulOps + NormOps + AttentionOps + MoeOps + LossOps
{
}

impl<B> Backend for B where
    B: Device + ElementwiseOps + MatmulOps + NormOps + AttentionOps + MoeOps + LossOps
{
}
