//! The coarse operations one training step needs, behind one trait with two implementations:
//! `cpu` (the reference: f32, plain loops) and, on NVIDIA GPUs, `cuda`.
//!
//! Conventions, shared by every op on every backend:
//! - Arguments come in the order outputs, inputs, sizes. Every tensor is row-major; its shape is
//!   written beside it as `[rows, cols]`.
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
//! with f32 gradient accumulators on a GPU), chosen by [`FloatKind`] at allocation. The trait is
//! deliberately small: only what the decoder in `model` and the KV-cached inference forward in
//! `generate` call.

pub mod cpu;
pub mod cuda;

use std::ops::Range;

use crate::error::Result;
use crate::store::HostSlab;

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

/// Element type of weights on a device, and so of the host store's streaming copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    Bf16,
}

impl WeightDtype {
    pub fn bytes(self) -> usize {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::Bf16 => 2,
        }
    }
}

/// The activation of the gated MLP's gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GluAct {
    /// `silu(g) = g · sigmoid(g)` (SwiGLU: llama, qwen, mistral, phi3).
    Silu,
    /// `gelu(g)` with the tanh approximation (GeGLU: gemma's `gelu_pytorch_tanh`).
    GeluTanh,
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
/// ([`Backend::attention_decode`]): one sequence, no documents.
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

/// A compute device and its memory. Only the schedule in `train` drives it.
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

pub trait Backend: Send + Sync {
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
    /// for [`Backend::upload_on`] / [`Backend::download_on`]).
    fn elem_bytes(&self, kind: FloatKind) -> usize {
        match kind {
            FloatKind::Activation => self.weight_dtype().bytes(),
            FloatKind::Accum => 4,
        }
    }

    // ---- streams, events and asynchronous transfers (only the schedule calls these) --------

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
    /// [`Backend::upload_on`] and `staging` may be `None`.
    ///
    /// # Safety
    /// As [`Backend::upload_on`], and `staging` must not be read or written by work on another
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

    // ---- memory ---------------------------------------------------------------------------

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
    fn fill_zero(&self, dst: Self::ViewMut<'_>) -> Result<()>;
    /// `dst = src`, same length.
    fn copy(&self, dst: Self::ViewMut<'_>, src: Self::View<'_>) -> Result<()>;

    // ---- elementwise and reductions -------------------------------------------------------

    /// `out = a + b` (the residual connection), all `[n]`.
    fn add(&self, out: Self::ViewMut<'_>, a: Self::View<'_>, b: Self::View<'_>) -> Result<()>;
    /// `dst += src`, both `[n]` (gradients meeting at a residual fork).
    fn add_assign(&self, dst: Self::ViewMut<'_>, src: Self::View<'_>) -> Result<()>;
    /// Sum of all elements, accumulated in f64 on the host side of the call.
    fn sum(&self, src: Self::View<'_>) -> Result<f64>;
    /// Sum of squares of all elements (the gradient-norm reduction), in f64.
    fn sum_squares(&self, src: Self::View<'_>) -> Result<f64>;

    // ---- embedding ------------------------------------------------------------------------

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

    // ---- matmul and bias ------------------------------------------------------------------

    /// `out = inp · wᵀ`. out `[T, N]`, inp `[T, K]`, w `[N, K]` (PyTorch's `nn.Linear`).
    fn matmul_forward(
        &self,
        out: Self::ViewMut<'_>,
        inp: Self::View<'_>,
        w: Self::View<'_>,
        rows: usize,
        k: usize,
        n: usize,
    ) -> Result<()>;
    /// `dinp = dout · w` (overwrites) and `dw += doutᵀ · inp` (accumulates).
    /// dinp `[T, K]`, dw `[N, K]`, dout `[T, N]`, inp `[T, K]`, w `[N, K]`.
    #[allow(clippy::too_many_arguments)]
    fn matmul_backward(
        &self,
        dinp: Self::ViewMut<'_>,
        dw: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        inp: Self::View<'_>,
        w: Self::View<'_>,
        rows: usize,
        k: usize,
        n: usize,
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

    // ---- normalisation --------------------------------------------------------------------

    /// RMSNorm over the last dimension: `out = inp / sqrt(mean(inp²) + eps) * w`, and
    /// `rstd[r] = 1 / sqrt(mean(inp[r]²) + eps)` kept for the backward.
    /// out `[R, D]`, rstd `[R]` (Accum), inp `[R, D]`, w `[D]`.
    /// Reference: `LlamaRMSNorm` in transformers' modeling_llama.py.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_forward(
        &self,
        out: Self::ViewMut<'_>,
        rstd: Self::ViewMut<'_>,
        inp: Self::View<'_>,
        w: Self::View<'_>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()>;
    /// dinp `[R, D]` (overwrites), dw `[D]` (accumulates), dout `[R, D]`, inp `[R, D]`, w `[D]`,
    /// rstd `[R]`.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward(
        &self,
        dinp: Self::ViewMut<'_>,
        dw: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        inp: Self::View<'_>,
        w: Self::View<'_>,
        rstd: Self::View<'_>,
        rows: usize,
        dim: usize,
    ) -> Result<()>;
    /// Qwen3's per-head RMSNorm of the query and key heads inside a fused `qkv` row; the value
    /// heads are copied unchanged. out and inp `[T, Dqkv]`, rstd `[T, nq + nkv]` (Accum),
    /// w `[2 hd]` = `[q_norm (hd) | k_norm (hd)]`.
    fn head_rmsnorm_forward(
        &self,
        out: Self::ViewMut<'_>,
        rstd: Self::ViewMut<'_>,
        inp: Self::View<'_>,
        w: Self::View<'_>,
        shape: &AttentionShape,
        eps: f32,
    ) -> Result<()>;
    /// dinp `[T, Dqkv]` (overwrites; value heads pass through), dw `[2 hd]` (accumulates).
    #[allow(clippy::too_many_arguments)]
    fn head_rmsnorm_backward(
        &self,
        dinp: Self::ViewMut<'_>,
        dw: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        inp: Self::View<'_>,
        w: Self::View<'_>,
        rstd: Self::View<'_>,
        shape: &AttentionShape,
    ) -> Result<()>;

    // ---- rotary position embedding --------------------------------------------------------

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
    /// The transpose of [`Backend::rope_forward`]: rotates the gradient in place by `-angle`,
    /// scaled alike.
    fn rope_backward(
        &self,
        dqkv: Self::ViewMut<'_>,
        pos: &Self::Ints,
        inv_freq: Self::View<'_>,
        scale: f32,
        shape: &AttentionShape,
    ) -> Result<()>;

    // ---- attention ------------------------------------------------------------------------

    /// Causal grouped-query attention within documents, scale `1/sqrt(hd)`.
    /// out `[T, nq hd]`, lse `[T, nq]` (Accum: the log-sum-exp of each query's scaled scores),
    /// qkv `[T, Dqkv]` (after RoPE), cu_seqlens `[docs + 1]`.
    fn attention_forward(
        &self,
        out: Self::ViewMut<'_>,
        lse: Self::ViewMut<'_>,
        qkv: Self::View<'_>,
        cu_seqlens: &Self::Ints,
        shape: &AttentionShape,
    ) -> Result<()>;
    /// dqkv `[T, Dqkv]` (overwrites), dout `[T, nq hd]`, qkv, out and lse from the forward.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        dqkv: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        qkv: Self::View<'_>,
        out: Self::View<'_>,
        lse: Self::View<'_>,
        cu_seqlens: &Self::Ints,
        shape: &AttentionShape,
    ) -> Result<()>;

    /// Attention of `tokens` new queries at positions `past..past + tokens` against the keys
    /// and values of every position up to theirs (the inference forward's KV cache): causal,
    /// grouped-query, within the sliding window, scale `1/sqrt(hd)`; no lse (nothing runs
    /// backward). out `[tokens, nq hd]`, q `[tokens, nq hd]` (after RoPE), k_cache and v_cache
    /// `[past + tokens, nkv hd]` (keys after RoPE; the new tokens' rows already appended).
    fn attention_decode(
        &self,
        out: Self::ViewMut<'_>,
        q: Self::View<'_>,
        k_cache: Self::View<'_>,
        v_cache: Self::View<'_>,
        shape: &DecodeShape,
    ) -> Result<()>;

    // ---- MLP ------------------------------------------------------------------------------

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

    // ---- LM head and loss -----------------------------------------------------------------

    /// Cross-entropy of the LM head's logits `x · wᵀ` against `targets`, computed a chunk of the
    /// vocabulary or of the tokens at a time so `[T, V]` logits never exist at once.
    /// losses `[T]` (Accum; 0 where the target is [`IGNORE`]), lse `[T]` (Accum: log-sum-exp of
    /// each token's logits, kept for the backward), x `[T, H]`, w `[V, H]`, targets `[T]`.
    /// With `softcap`, the logits `z` become `cap · tanh(z / cap)` first (Gemma 2's
    /// `final_logit_softcapping`).
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_forward(
        &self,
        losses: Self::ViewMut<'_>,
        lse: Self::ViewMut<'_>,
        x: Self::View<'_>,
        w: Self::View<'_>,
        targets: &Self::Ints,
        tokens: usize,
        hidden: usize,
        vocab: usize,
        softcap: Option<f32>,
    ) -> Result<()>;
    /// Gradient of `scale · Σ_t losses[t]`: dx `[T, H]` (overwrites), dw `[V, H]`
    /// (accumulates). `scale` is 1 / (trained tokens in the whole optimizer step).
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_backward(
        &self,
        dx: Self::ViewMut<'_>,
        dw: Self::ViewMut<'_>,
        x: Self::View<'_>,
        w: Self::View<'_>,
        lse: Self::View<'_>,
        targets: &Self::Ints,
        scale: f32,
        tokens: usize,
        hidden: usize,
        vocab: usize,
        softcap: Option<f32>,
    ) -> Result<()>;
}
