//! The decoder's forward and backward, one unit at a time, on any [`Backend`].
//!
//! Each unit's compute is a stateless template bound to whatever weight slab it is given, so the
//! same functions serve the plain loop and the streaming schedule. A layer's internals live in a
//! [`LayerScratch`] that is overwritten by every call; the backward recomputes them from the
//! layer's input (activation checkpointing, one checkpoint per layer).
//!
//! Mirrors `LlamaDecoderLayer` / `Qwen2DecoderLayer` / `Qwen3DecoderLayer` /
//! `MistralDecoderLayer` in transformers:
//! ```text
//! h   = rmsnorm(x, ln1)                         [T, H]
//! qkv = h · Wqkvᵀ (+ b)                         [T, Dqkv]
//! qkv = head_rmsnorm(qkv) (qwen3); rope(qkv)
//! a   = attention(qkv)                          [T, nq hd]
//! x1  = x + a · Woᵀ (+ bo)                      [T, H]
//! g   = rmsnorm(x1, ln2) · Wgate_upᵀ            [T, 2I]
//! out = x1 + swiglu(g) · Wdownᵀ                 [T, H]
//! ```

use super::layout::{HeadRanges, LayerRanges};
use crate::backend::{AttentionShape, Backend, FloatKind};
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
        Ok(())
    }
}

/// One layer's intermediates and gradients for `tokens` tokens, reused by every layer.
pub struct LayerScratch<B: Backend> {
    ln1: B::Floats,      // [T, H]
    ln1_rstd: B::Floats, // [T]
    qkv_pre: B::Floats,  // [T, Dqkv] before the q/k norm (qwen3 only)
    qk_rstd: B::Floats,  // [T, nq + nkv]
    qkv: B::Floats,      // [T, Dqkv] after the q/k norm and RoPE
    att: B::Floats,      // [T, nq hd]
    lse: B::Floats,      // [T, nq]
    x1: B::Floats,       // [T, H]
    ln2: B::Floats,      // [T, H]
    ln2_rstd: B::Floats, // [T]
    gate_up: B::Floats,  // [T, 2I]
    act: B::Floats,      // [T, I]
    tmp_h: B::Floats,    // [T, H]
    // gradients
    d_act: B::Floats,     // [T, I]
    d_gate_up: B::Floats, // [T, 2I]
    d_x1: B::Floats,      // [T, H]
    d_att: B::Floats,     // [T, nq hd]
    d_qkv: B::Floats,     // [T, Dqkv]
    d_qkv_pre: B::Floats, // [T, Dqkv]
    /// Device bytes these buffers take.
    pub bytes: usize,
}

impl<B: Backend> LayerScratch<B> {
    pub fn new(b: &B, spec: &ModelSpec, tokens: usize) -> Result<Self> {
        let (t, h, i) = (tokens, spec.hidden, spec.intermediate);
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
        let mut scratch = LayerScratch {
            ln1: act(t * h)?,
            ln1_rstd: acc(t)?,
            qkv_pre: act(qkv_pre_len)?,
            qk_rstd: acc(if spec.qk_norm { t * (spec.q_heads + spec.kv_heads) } else { 0 })?,
            qkv: act(t * dqkv)?,
            att: act(t * datt)?,
            lse: acc(t * spec.q_heads)?,
            x1: act(t * h)?,
            ln2: act(t * h)?,
            ln2_rstd: acc(t)?,
            gate_up: act(t * 2 * i)?,
            act: act(t * i)?,
            tmp_h: act(t * h)?,
            d_act: act(t * i)?,
            d_gate_up: act(t * 2 * i)?,
            d_x1: act(t * h)?,
            d_att: act(t * datt)?,
            d_qkv: act(t * dqkv)?,
            d_qkv_pre: act(qkv_pre_len)?,
            bytes: 0,
        };
        scratch.bytes = bytes.get();
        Ok(scratch)
    }
}

/// The head's intermediates.
pub struct HeadScratch<B: Backend> {
    normed: B::Floats, // [T, H]
    rstd: B::Floats,   // [T]
    losses: B::Floats, // [T]
    lse: B::Floats,    // [T]
    d_normed: B::Floats,
    /// Device bytes these buffers take.
    pub bytes: usize,
}

impl<B: Backend> HeadScratch<B> {
    pub fn new(b: &B, spec: &ModelSpec, tokens: usize) -> Result<Self> {
        Ok(HeadScratch {
            normed: b.alloc(tokens * spec.hidden, FloatKind::Activation)?,
            rstd: b.alloc(tokens, FloatKind::Accum)?,
            losses: b.alloc(tokens, FloatKind::Accum)?,
            lse: b.alloc(tokens, FloatKind::Accum)?,
            d_normed: b.alloc(tokens * spec.hidden, FloatKind::Activation)?,
            bytes: 2 * tokens * spec.hidden * b.elem_bytes(FloatKind::Activation)
                + 3 * tokens * b.elem_bytes(FloatKind::Accum),
        })
    }
}

/// The decoder bound to a spec and its RoPE table on the device.
pub struct Decoder<B: Backend> {
    pub spec: ModelSpec,
    pub layer: LayerRanges,
    pub head: HeadRanges,
    inv_freq: B::Floats, // [hd / 2]
}

fn all<B: Backend>(b: &B, buf: &B::Floats, n: usize) -> std::ops::Range<usize> {
    debug_assert!(n <= b.len(buf));
    0..n
}

impl<B: Backend> Decoder<B> {
    pub fn new(b: &B, spec: &ModelSpec, layer: LayerRanges, head: HeadRanges) -> Result<Self> {
        let freqs = spec.inv_freq();
        let mut inv_freq = b.alloc(freqs.len(), FloatKind::Accum)?;
        b.upload(b.view_mut(&mut inv_freq, 0..freqs.len()), &freqs)?;
        Ok(Decoder { spec: spec.clone(), layer, head, inv_freq })
    }

    fn attention_shape(&self, batch: &DeviceBatch<B>, layer: usize) -> AttentionShape {
        AttentionShape {
            tokens: batch.tokens,
            q_heads: self.spec.q_heads,
            kv_heads: self.spec.kv_heads,
            head_dim: self.spec.head_dim,
            docs: batch.docs,
            window: self.spec.windows.get(layer).copied().flatten(),
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
        b.embedding_forward(b.view_mut(x, 0..t * h), &batch.ids, table, t, h)
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
        b.embedding_backward(dtable, b.view(dx, 0..t * h), &batch.ids, t, h)
    }

    /// One decoder layer: `x_out = layer(x_in)`, leaving its internals in `s`.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_forward(
        &self,
        b: &B,
        x_out: &mut B::Floats,
        x_in: &B::Floats,
        w: &B::Floats,
        s: &mut LayerScratch<B>,
        batch: &DeviceBatch<B>,
        layer: usize,
    ) -> Result<()> {
        let spec = &self.spec;
        let r = &self.layer;
        let shape = self.attention_shape(batch, layer);
        let (t, h, i) = (batch.tokens, spec.hidden, spec.intermediate);
        let (dqkv, datt) = (spec.qkv_width(), spec.attn_width());
        let th = all(b, x_in, t * h);
        let wv = |range: &std::ops::Range<usize>| b.view(w, range.clone());

        b.rmsnorm_forward(
            b.view_mut(&mut s.ln1, th.clone()),
            b.view_mut(&mut s.ln1_rstd, 0..t),
            b.view(x_in, th.clone()),
            wv(&r.ln1),
            t,
            h,
            spec.rms_eps,
        )?;
        // The projection lands in `qkv` directly unless qwen3's q/k norm needs its input kept.
        let proj = if spec.qk_norm { &mut s.qkv_pre } else { &mut s.qkv };
        b.matmul_forward(
            b.view_mut(proj, 0..t * dqkv),
            b.view(&s.ln1, th.clone()),
            wv(&r.qkv_w),
            t,
            h,
            dqkv,
        )?;
        if let Some(bias) = &r.qkv_b {
            b.bias_forward(b.view_mut(proj, 0..t * dqkv), wv(bias), t, dqkv)?;
        }
        if let Some(norm) = &r.qk_norm {
            let heads = spec.q_heads + spec.kv_heads;
            b.head_rmsnorm_forward(
                b.view_mut(&mut s.qkv, 0..t * dqkv),
                b.view_mut(&mut s.qk_rstd, 0..t * heads),
                b.view(&s.qkv_pre, 0..t * dqkv),
                wv(norm),
                &shape,
                spec.rms_eps,
            )?;
        }
        b.rope_forward(
            b.view_mut(&mut s.qkv, 0..t * dqkv),
            &batch.positions,
            b.view(&self.inv_freq, 0..spec.head_dim / 2),
            &shape,
        )?;
        b.attention_forward(
            b.view_mut(&mut s.att, 0..t * datt),
            b.view_mut(&mut s.lse, 0..t * spec.q_heads),
            b.view(&s.qkv, 0..t * dqkv),
            &batch.cu_seqlens,
            &shape,
        )?;
        b.matmul_forward(
            b.view_mut(&mut s.tmp_h, th.clone()),
            b.view(&s.att, 0..t * datt),
            wv(&r.o_w),
            t,
            datt,
            h,
        )?;
        if let Some(bias) = &r.o_b {
            b.bias_forward(b.view_mut(&mut s.tmp_h, th.clone()), wv(bias), t, h)?;
        }
        b.add(
            b.view_mut(&mut s.x1, th.clone()),
            b.view(x_in, th.clone()),
            b.view(&s.tmp_h, th.clone()),
        )?;

        b.rmsnorm_forward(
            b.view_mut(&mut s.ln2, th.clone()),
            b.view_mut(&mut s.ln2_rstd, 0..t),
            b.view(&s.x1, th.clone()),
            wv(&r.ln2),
            t,
            h,
            spec.rms_eps,
        )?;
        b.matmul_forward(
            b.view_mut(&mut s.gate_up, 0..t * 2 * i),
            b.view(&s.ln2, th.clone()),
            wv(&r.gate_up_w),
            t,
            h,
            2 * i,
        )?;
        b.swiglu_forward(b.view_mut(&mut s.act, 0..t * i), b.view(&s.gate_up, 0..t * 2 * i), t, i)?;
        b.matmul_forward(
            b.view_mut(&mut s.tmp_h, th.clone()),
            b.view(&s.act, 0..t * i),
            wv(&r.down_w),
            t,
            i,
            h,
        )?;
        b.add(b.view_mut(x_out, th.clone()), b.view(&s.x1, th.clone()), b.view(&s.tmp_h, th))
    }

    /// Backward of one layer whose internals `s` hold the forward of `x_in` (run
    /// [`Decoder::layer_forward`] first to recompute them). `dx_in = ∂L/∂x_in` (overwritten);
    /// the layer's weight gradients accumulate into `grad` (a slab laid out like `w`).
    #[allow(clippy::too_many_arguments)]
    pub fn layer_backward(
        &self,
        b: &B,
        dx_in: &mut B::Floats,
        grad: &mut B::Floats,
        dx_out: &B::Floats,
        x_in: &B::Floats,
        w: &B::Floats,
        s: &mut LayerScratch<B>,
        batch: &DeviceBatch<B>,
        layer: usize,
    ) -> Result<()> {
        let spec = &self.spec;
        let r = &self.layer;
        let shape = self.attention_shape(batch, layer);
        let (t, h, i) = (batch.tokens, spec.hidden, spec.intermediate);
        let (dqkv, datt) = (spec.qkv_width(), spec.attn_width());
        let th = all(b, x_in, t * h);
        let wv = |range: &std::ops::Range<usize>| b.view(w, range.clone());

        // MLP branch: out = x1 + down(swiglu(gate_up(ln2(x1)))).
        b.matmul_backward(
            b.view_mut(&mut s.d_act, 0..t * i),
            b.view_mut(grad, r.down_w.clone()),
            b.view(dx_out, th.clone()),
            b.view(&s.act, 0..t * i),
            wv(&r.down_w),
            t,
            i,
            h,
        )?;
        b.swiglu_backward(
            b.view_mut(&mut s.d_gate_up, 0..t * 2 * i),
            b.view(&s.d_act, 0..t * i),
            b.view(&s.gate_up, 0..t * 2 * i),
            t,
            i,
        )?;
        // d(ln2 output) reuses tmp_h.
        b.matmul_backward(
            b.view_mut(&mut s.tmp_h, th.clone()),
            b.view_mut(grad, r.gate_up_w.clone()),
            b.view(&s.d_gate_up, 0..t * 2 * i),
            b.view(&s.ln2, th.clone()),
            wv(&r.gate_up_w),
            t,
            h,
            2 * i,
        )?;
        b.rmsnorm_backward(
            b.view_mut(&mut s.d_x1, th.clone()),
            b.view_mut(grad, r.ln2.clone()),
            b.view(&s.tmp_h, th.clone()),
            b.view(&s.x1, th.clone()),
            wv(&r.ln2),
            b.view(&s.ln2_rstd, 0..t),
            t,
            h,
        )?;
        // The residual carries dx_out straight to x1.
        b.add_assign(b.view_mut(&mut s.d_x1, th.clone()), b.view(dx_out, th.clone()))?;

        // Attention branch: x1 = x + o(attention(rope(norm(qkv(ln1(x)))))).
        if let Some(bias) = &r.o_b {
            b.bias_backward(b.view_mut(grad, bias.clone()), b.view(&s.d_x1, th.clone()), t, h)?;
        }
        b.matmul_backward(
            b.view_mut(&mut s.d_att, 0..t * datt),
            b.view_mut(grad, r.o_w.clone()),
            b.view(&s.d_x1, th.clone()),
            b.view(&s.att, 0..t * datt),
            wv(&r.o_w),
            t,
            datt,
            h,
        )?;
        b.attention_backward(
            b.view_mut(&mut s.d_qkv, 0..t * dqkv),
            b.view(&s.d_att, 0..t * datt),
            b.view(&s.qkv, 0..t * dqkv),
            b.view(&s.att, 0..t * datt),
            b.view(&s.lse, 0..t * spec.q_heads),
            &batch.cu_seqlens,
            &shape,
        )?;
        b.rope_backward(
            b.view_mut(&mut s.d_qkv, 0..t * dqkv),
            &batch.positions,
            b.view(&self.inv_freq, 0..spec.head_dim / 2),
            &shape,
        )?;
        // Gradient with respect to the projection's output.
        let d_proj = if let Some(norm) = &r.qk_norm {
            let heads = spec.q_heads + spec.kv_heads;
            b.head_rmsnorm_backward(
                b.view_mut(&mut s.d_qkv_pre, 0..t * dqkv),
                b.view_mut(grad, norm.clone()),
                b.view(&s.d_qkv, 0..t * dqkv),
                b.view(&s.qkv_pre, 0..t * dqkv),
                wv(norm),
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
            b.view_mut(&mut s.tmp_h, th.clone()),
            b.view_mut(grad, r.qkv_w.clone()),
            b.view(d_proj, 0..t * dqkv),
            b.view(&s.ln1, th.clone()),
            wv(&r.qkv_w),
            t,
            h,
            dqkv,
        )?;
        b.rmsnorm_backward(
            b.view_mut(dx_in, th.clone()),
            b.view_mut(grad, r.ln1.clone()),
            b.view(&s.tmp_h, th.clone()),
            b.view(x_in, th.clone()),
            wv(&r.ln1),
            b.view(&s.ln1_rstd, 0..t),
            t,
            h,
        )?;
        b.add_assign(b.view_mut(dx_in, th.clone()), b.view(&s.d_x1, th))
    }

    /// The LM head's weight `[V, H]`: its own, or the embedding table when tied.
    fn lm_weight<'a>(
        &self,
        head_w: &'a B::Floats,
        embed_w: &'a B::Floats,
    ) -> (&'a B::Floats, std::ops::Range<usize>) {
        let n = self.spec.vocab * self.spec.hidden;
        match &self.head.lm_head {
            Some(range) => (head_w, range.clone()),
            None => (embed_w, 0..n),
        }
    }

    /// Final norm, LM head and cross-entropy; returns the sum of the token losses (f64).
    pub fn head_forward(
        &self,
        b: &B,
        s: &mut HeadScratch<B>,
        x: &B::Floats,
        head_w: &B::Floats,
        embed_w: &B::Floats,
        batch: &DeviceBatch<B>,
    ) -> Result<f64> {
        let (t, h, v) = (batch.tokens, self.spec.hidden, self.spec.vocab);
        b.rmsnorm_forward(
            b.view_mut(&mut s.normed, 0..t * h),
            b.view_mut(&mut s.rstd, 0..t),
            b.view(x, 0..t * h),
            b.view(head_w, self.head.norm.clone()),
            t,
            h,
            self.spec.rms_eps,
        )?;
        let (lm, lm_range) = self.lm_weight(head_w, embed_w);
        b.cross_entropy_forward(
            b.view_mut(&mut s.losses, 0..t),
            b.view_mut(&mut s.lse, 0..t),
            b.view(&s.normed, 0..t * h),
            b.view(lm, lm_range),
            &batch.targets,
            t,
            h,
            v,
        )?;
        b.sum(b.view(&s.losses, 0..t))
    }

    /// Backward of the head for loss `scale · Σ losses`: `dx` overwritten; the final norm's and
    /// (untied) LM head's gradients accumulate into `head_grad`, a tied LM head's into
    /// `embed_grad` (required when tied, ignored otherwise). Needs the scratch of [`Decoder::head_forward`] on the same batch.
    #[allow(clippy::too_many_arguments)]
    pub fn head_backward(
        &self,
        b: &B,
        dx: &mut B::Floats,
        head_grad: &mut B::Floats,
        embed_grad: Option<&mut B::Floats>,
        s: &mut HeadScratch<B>,
        x: &B::Floats,
        head_w: &B::Floats,
        embed_w: &B::Floats,
        batch: &DeviceBatch<B>,
        scale: f32,
    ) -> Result<()> {
        let (t, h, v) = (batch.tokens, self.spec.hidden, self.spec.vocab);
        let (lm, lm_range) = self.lm_weight(head_w, embed_w);
        let d_lm = match (&self.head.lm_head, embed_grad) {
            (Some(range), _) => b.view_mut(head_grad, range.clone()),
            (None, Some(embed_grad)) => b.view_mut(embed_grad, 0..v * h),
            (None, None) => {
                return Err(crate::error::Error::invalid(
                    "a tied LM head needs the embedding's gradient buffer",
                ));
            }
        };
        b.cross_entropy_backward(
            b.view_mut(&mut s.d_normed, 0..t * h),
            d_lm,
            b.view(&s.normed, 0..t * h),
            b.view(lm, lm_range),
            b.view(&s.lse, 0..t),
            &batch.targets,
            scale,
            t,
            h,
            v,
        )?;
        b.rmsnorm_backward(
            b.view_mut(dx, 0..t * h),
            b.view_mut(head_grad, self.head.norm.clone()),
            b.view(&s.d_normed, 0..t * h),
            b.view(x, 0..t * h),
            b.view(head_w, self.head.norm.clone()),
            b.view(&s.rstd, 0..t),
            t,
            h,
        )
    }

    /// Logits `[T, V]` of the head for inspection and generation (materialised; small batches).
    #[allow(clippy::too_many_arguments)]
    pub fn logits(
        &self,
        b: &B,
        out: &mut B::Floats,
        s: &mut HeadScratch<B>,
        x: &B::Floats,
        head_w: &B::Floats,
        embed_w: &B::Floats,
        tokens: usize,
    ) -> Result<()> {
        let (h, v) = (self.spec.hidden, self.spec.vocab);
        b.rmsnorm_forward(
            b.view_mut(&mut s.normed, 0..tokens * h),
            b.view_mut(&mut s.rstd, 0..tokens),
            b.view(x, 0..tokens * h),
            b.view(head_w, self.head.norm.clone()),
            tokens,
            h,
            self.spec.rms_eps,
        )?;
        let (lm, lm_range) = self.lm_weight(head_w, embed_w);
        b.matmul_forward(
            b.view_mut(out, 0..tokens * v),
            b.view(&s.normed, 0..tokens * h),
            b.view(lm, lm_range),
            tokens,
            h,
            v,
        )
    }
}
