//! What the model and the batch shape imply, before any placement is chosen: parameters per
//! unit, FLOPs per unit visit, and the byte size of every buffer the schedule allocates.
//!
//! Units are indexed as in `model::layout`: 0 is the embedding, 1..=L the decoder layers, L+1
//! the head. Buffers on the device hold activations in bf16 (2 bytes) and reductions and
//! gradient accumulators in fp32 (4 bytes), as the CUDA backend allocates them.

use serde::Serialize;

use super::MachineRates;
use crate::error::{Error, Result};
pub use crate::placement::causal_pairs;
use crate::spec::ModelSpec;

/// bf16 bytes per element.
pub const BF16: u64 = 2;
/// fp32 bytes per element.
pub const F32: u64 = 4;
/// The `i32` arrays each micro-batch keeps on the device: ids, positions, targets and document
/// bounds (at most one per token, plus one).
pub const TOKEN_ARRAYS: u64 = 4;

/// Sequence length, rows per micro-batch and micro-batches per optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BatchShape {
    pub seq_len: usize,
    pub micro_batch: usize,
    pub grad_accum: usize,
}

impl BatchShape {
    /// Tokens in one micro-batch (`M x S`).
    pub fn micro_tokens(&self) -> u64 {
        self.micro_batch as u64 * self.seq_len as u64
    }

    /// Tokens in one optimizer step (`G x M x S`).
    pub fn step_tokens(&self) -> u64 {
        self.grad_accum as u64 * self.micro_tokens()
    }

    /// The largest shapes the engine runs; a deployment may only lower them
    /// (`train::Limits`). Every planned size below stays far inside u64 with these.
    pub const MAX_SEQ_LEN: usize = 1 << 20;
    pub const MAX_MICRO_BATCH: usize = 4096;
    pub const MAX_GRAD_ACCUM: usize = 65_536;
    /// Tokens in one micro-batch (`seq_len x micro_batch`).
    pub const MAX_MICRO_TOKENS: usize = 1 << 24;

    /// Refuses a size outside `1..=max` for each of `[seq_len, micro_batch, grad_accum]`, and a
    /// micro-batch of more than `max_micro_tokens` tokens, with the message the API and the
    /// command line show.
    pub fn check_sizes(&self, max: [usize; 3], max_micro_tokens: usize) -> Result<()> {
        let sizes = [
            ("seq_len", self.seq_len, max[0]),
            ("micro_batch", self.micro_batch, max[1]),
            ("grad_accum", self.grad_accum, max[2]),
        ];
        for (name, value, max) in sizes {
            if !(1..=max).contains(&value) {
                return Err(Error::invalid(format!(
                    "{name} must be between 1 and {max}, got {value}"
                )));
            }
        }
        let tokens = self.micro_tokens();
        if tokens > max_micro_tokens as u64 {
            return Err(Error::invalid(format!(
                "seq_len x micro_batch must be at most {max_micro_tokens} tokens, got {tokens}"
            )));
        }
        Ok(())
    }

    /// Refuses sizes beyond the engine's ceilings and a sequence longer than the model's
    /// positions.
    pub fn validate(&self, spec: &ModelSpec) -> Result<()> {
        self.check_sizes(
            [Self::MAX_SEQ_LEN, Self::MAX_MICRO_BATCH, Self::MAX_GRAD_ACCUM],
            Self::MAX_MICRO_TOKENS,
        )?;
        if self.seq_len > spec.max_positions {
            return Err(Error::invalid(format!(
                "seq_len {} exceeds the model's max_position_embeddings {}",
                self.seq_len, spec.max_positions
            )));
        }
        Ok(())
    }
}

/// One unit's size and work.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UnitInfo {
    pub name: String,
    /// Trainable parameters the unit owns (a tied LM head belongs to the embedding).
    pub params: u64,
    /// Parameters that are GEMM operands in this unit's compute (the tied LM head counts here,
    /// in the head; an embedding lookup is not a GEMM).
    pub gemm_params: u64,
    /// The part of `gemm_params` the recompute before a layer's backward multiplies by: all
    /// but a dense MLP's down projection, whose output the backward does not read (unless a
    /// post-MLP norm does: Gemma).
    pub recompute_gemm_params: u64,
}

/// Everything the placement search needs, derived once from the spec and the batch shape.
#[derive(Debug, Clone)]
pub struct Sizes {
    pub units: Vec<UnitInfo>,
    pub layers: usize,
    pub hidden: u64,
    pub vocab: u64,
    pub tied: bool,
    pub params: u64,
    /// Parameters a token computes with (a mixture of experts' routed experts only).
    pub active_params: u64,
    pub batch: BatchShape,
    /// Device bytes of one layer's scratch for one micro-batch.
    pub layer_scratch: u64,
    /// Device bytes of one layer's kept forward state for one micro-batch (0: a mixture of
    /// experts, whose activations are always recomputed).
    pub kept_layer: u64,
    /// Device bytes of one layer's kept attention output and log-sum-exp for one micro-batch.
    pub kept_attention: u64,
    /// Device bytes of the head's norm and chunked cross-entropy workspace on a GPU.
    pub head_workspace: u64,
    /// The same on the CPU backend, whose chunks are smaller.
    pub head_workspace_host: u64,
    /// Device bytes the GPU's fused attention backward needs for its f32 sums beyond what the
    /// LM head's logits chunk leaves in the allocator's pool (0 on the CPU, and for most
    /// shapes); see [`attention_sums_bytes`].
    pub attention_sums: u64,
    /// Attention FLOPs of one layer's forward over the whole step (all micro-batches).
    pub attention_fwd_flops: f64,
    /// Whether attention is soft-capped (Gemma 2), which the GPU runs on its scalar kernels.
    pub capped_attention: bool,
    /// Bytes the elementwise kernels of one layer's forward move over the whole step, averaged
    /// over the layers (see `elementwise_bytes`).
    pub elementwise_fwd_bytes: f64,
    /// The same for one layer's backward, without its recomputed forward.
    pub elementwise_bwd_bytes: f64,
    /// The same for what a kept layer derives again before its backward (its two norms, its
    /// MLP's activation, and its q/k norm and RoPE where there is a q/k norm; see
    /// `kept_layer_bytes`).
    pub elementwise_rederive_bytes: f64,
}

impl Sizes {
    /// The attention FLOP/s of this model on a machine, (forward, backward): the scalar
    /// kernels' both ways when soft-capped.
    pub fn attention_rates(&self, r: &MachineRates) -> (f64, f64) {
        if self.capped_attention {
            (r.scalar_attention_flops, r.scalar_attention_flops)
        } else {
            let s = self.batch.seq_len;
            (r.attention_forward_rate(s), r.attention_backward_rate(s))
        }
    }

    pub fn new(spec: &ModelSpec, batch: BatchShape) -> Sizes {
        let (elementwise_fwd_bytes, elementwise_bwd_bytes, elementwise_rederive_bytes) =
            elementwise_bytes(spec, batch.step_tokens());
        let (h, v) = (spec.hidden as u64, spec.vocab as u64);
        let attn_gemm = (spec.qkv_width() as u64 + spec.attn_width() as u64) * h;
        let unit = |name: String, params: u64, gemm_params: u64| UnitInfo {
            name,
            params,
            gemm_params,
            recompute_gemm_params: gemm_params,
        };
        let mut units = vec![unit("embedding".into(), v * h, 0)];
        for l in 0..spec.layers {
            // A MoE layer holds every expert but each token multiplies by its k experts'.
            let gemm_params = attn_gemm + spec.active_mlp_params(l) as u64;
            let skipped_down = if spec.moe_at(l).is_none() && !spec.sandwich_norms {
                spec.intermediate as u64 * h
            } else {
                0
            };
            units.push(UnitInfo {
                recompute_gemm_params: gemm_params - skipped_down,
                ..unit(format!("layer {l}"), spec.layer_params(l) as u64, gemm_params)
            });
        }
        let head_params = h + if spec.tie_embeddings { 0 } else { v * h };
        units.push(unit("head".into(), head_params, v * h));
        let params = units.iter().map(|u| u.params).sum();
        Sizes {
            units,
            layers: spec.layers,
            hidden: h,
            vocab: v,
            tied: spec.tie_embeddings,
            params,
            active_params: spec.active_params() as u64,
            batch,
            layer_scratch: layer_scratch_bytes(spec, batch.micro_tokens()),
            kept_layer: kept_layer_bytes(spec, batch.micro_tokens()),
            kept_attention: kept_attention_bytes(spec, batch.micro_tokens()),
            head_workspace: head_workspace_bytes(
                spec,
                batch.micro_tokens(),
                crate::placement::LOSS_CHUNK_LOGITS as u64 / (spec.vocab as u64).max(1),
            ),
            head_workspace_host: head_workspace_bytes(
                spec,
                batch.micro_tokens(),
                crate::backend::cpu::LOSS_CHUNK_TOKENS as u64,
            ),
            attention_sums: attention_sums_bytes(
                spec,
                batch.micro_tokens(),
                crate::placement::LOSS_CHUNK_LOGITS as u64 / (spec.vocab as u64).max(1),
            ),
            attention_fwd_flops: attention_fwd_flops(spec, batch),
            capped_attention: spec.attn_softcap.is_some(),
            elementwise_fwd_bytes,
            elementwise_bwd_bytes,
            elementwise_rederive_bytes,
        }
    }

    pub fn head(&self) -> usize {
        self.units.len() - 1
    }

    /// Bytes of one unit-boundary activation for all micro-batches: `G x [M S, H]` in bf16.
    pub fn activation_set(&self) -> u64 {
        self.batch.step_tokens() * self.hidden * BF16
    }

    /// Bytes of one unit-boundary activation for one micro-batch.
    pub fn activation_one(&self) -> u64 {
        self.batch.micro_tokens() * self.hidden * BF16
    }

    /// Parameters that must be on the device while unit `u` computes: its own, plus the tied
    /// embedding table for the head.
    pub fn visit_params(&self, u: usize, embedding_resident: bool) -> u64 {
        let own = self.units.get(u).map_or(0, |x| x.params);
        if u == self.head() && self.tied && !embedding_resident {
            own + self.vocab * self.hidden
        } else {
            own
        }
    }
}

/// `LayerScratch` in `model::decoder`, for `t` tokens: every activation buffer in bf16, the
/// norms' reciprocal RMS and attention's log-sum-exp in f32, plus the attention backward's
/// row sums `D = rowsum(dO * O)` (`[T, nq]`, f32) that a fused kernel keeps.
pub fn layer_scratch_bytes(spec: &ModelSpec, t: u64) -> u64 {
    let h = spec.hidden as u64;
    let i = if spec.all_sparse() { 0 } else { spec.intermediate as u64 };
    let (dqkv, datt) = (spec.qkv_width() as u64, spec.attn_width() as u64);
    let qk = u64::from(spec.qk_norm);
    let nq = spec.q_heads as u64;
    let sandwich = u64::from(spec.sandwich_norms);
    // ln1, x1, ln2, tmp_h, d_x1 | qkv, d_qkv (+ qkv_pre, d_qkv_pre) | att, d_att |
    // gate_up, d_gate_up (2I each), act, d_act | Gemma's o_pre, m_pre, d_pre
    let bf16_elems = t * (5 * h + (2 + 2 * qk) * dqkv + 2 * datt + 6 * i + 3 * sandwich * h);
    // ln1_rstd, ln2_rstd | qk_rstd | lse | D | Gemma's o_rstd, m_rstd
    let f32_elems = t * (2 + qk * (nq + spec.kv_heads as u64) + 2 * nq + 2 * sandwich);
    // Gemma's `1 + w` of one norm at a time.
    let norm_w =
        if spec.norm_offset != 0.0 { spec.hidden.max(2 * spec.head_dim) as u64 } else { 0 };
    bf16_elems * BF16 + (f32_elems + norm_w) * F32 + moe_scratch_bytes(spec, t)
}

/// `LayerScratch::for_kept` in `model::decoder`, for `t` tokens: what a layer's backward reads
/// of its forward and cannot derive again without a GEMM. bf16: x1 (H), q/k/v (before the q/k
/// norm where there is one), the attention output, gate/up (2I), Gemma's post-norm inputs;
/// f32: attention's log-sum-exp, Gemma's post-norms' reciprocal RMS. Each buffer is counted at
/// the device allocator's 2 MiB granularity: a model keeps up to layers x micro-batches of these
/// sets, so rounding is not negligible. 0 for a mixture of experts.
pub fn kept_layer_bytes(spec: &ModelSpec, t: u64) -> u64 {
    if spec.moe.is_some() {
        return 0;
    }
    let (h, i) = (spec.hidden as u64, spec.intermediate as u64);
    let (dqkv, datt) = (spec.qkv_width() as u64, spec.attn_width() as u64);
    let nq = spec.q_heads as u64;
    let sandwich = spec.sandwich_norms;
    let bf16 = [h, dqkv, datt, 2 * i];
    let bf16_opt = [(sandwich, h), (sandwich, h)];
    let f32s = [nq];
    let f32_opt = [(sandwich, 1), (sandwich, 1)];
    let buf = |elems: u64, size: u64| (t * elems * size).next_multiple_of(ALLOC_GRANULARITY);
    bf16.iter().map(|&e| buf(e, BF16)).sum::<u64>()
        + bf16_opt.iter().filter(|o| o.0).map(|o| buf(o.1, BF16)).sum::<u64>()
        + f32s.iter().map(|&e| buf(e, F32)).sum::<u64>()
        + f32_opt.iter().filter(|o| o.0).map(|o| buf(o.1, F32)).sum::<u64>()
}

/// `KeptAttention` in `model::decoder`, for `t` tokens: the attention output (bf16) and its
/// log-sum-exp (f32), each at the allocator's granularity.
pub fn kept_attention_bytes(spec: &ModelSpec, t: u64) -> u64 {
    let (datt, nq) = (spec.attn_width() as u64, spec.q_heads as u64);
    let buf = |elems: u64, size: u64| (t * elems * size).next_multiple_of(ALLOC_GRANULARITY);
    buf(datt, BF16) + buf(nq, F32)
}

/// The device allocator's granularity, to which every kept buffer is rounded up.
const ALLOC_GRANULARITY: u64 = 2 << 20;

/// `MoeScratch` in `model::moe` for `t` tokens: every token is routed to `k` experts, so the
/// expert activations are `t k` rows whatever the router's counts (each expert's share of them
/// varies, their sum does not). Per token: router logits `[E]` (f32) and their gradient (bf16),
/// probabilities `[E]` and weights and their gradient `[k]` (f32), three `i32` indices per
/// routed row; per routed row: the gathered input, the expert output and their gradients
/// `[H]`, the gate/up projection and its gradient `[2I]`, the activation and its gradient `[I]`
/// (bf16). Qwen2 MoE's shared expert adds, per token, its gate/up projection, activation and
/// output and their gradients (bf16) and its gate logit (f32) and that logit's gradient (bf16).
fn moe_scratch_bytes(spec: &ModelSpec, t: u64) -> u64 {
    let Some(m) = &spec.moe else { return 0 };
    let (h, e, k, i) = (spec.hidden as u64, m.experts as u64, m.top_k as u64, m.inter as u64);
    let rows = t * k;
    let shared = match m.shared_inter {
        Some(si) => t * ((6 * si as u64 + 2 * h + 1) * BF16 + F32),
        None => 0,
    };
    t * (e * BF16 + (2 * e + 2 * k) * F32) + rows * (3 * 4 + (4 * h + 6 * i) * BF16) + shared
}

/// `HeadScratch` for `t` tokens (normed input and its gradient in bf16; rstd, losses and lse in
/// f32) plus one chunk of up to `chunk` tokens' logits: `[chunk, V]` f32 and its bf16 gradient.
pub fn head_workspace_bytes(spec: &ModelSpec, t: u64, chunk: u64) -> u64 {
    let (h, v) = (spec.hidden as u64, spec.vocab as u64);
    let chunk = t.min(chunk.max(1));
    2 * t * h * BF16 + 3 * t * F32 + chunk * v * (F32 + BF16)
}

/// The fused attention backward's f32 sums of dq, dk and dv for `t` tokens (`[t, q/k/v
/// width]`, a temporary from the stream-ordered pool) beyond the LM head's chunk of up to
/// `chunk` tokens' logits, a temporary of the same pool that every micro-batch's head frees
/// before the layers' backward: the pool serves the one from the other's memory.
pub fn attention_sums_bytes(spec: &ModelSpec, t: u64, chunk: u64) -> u64 {
    let width = ((spec.q_heads + 2 * spec.kv_heads) * spec.head_dim) as u64;
    let logits = t.min(chunk.max(1)) * spec.vocab as u64 * (F32 + BF16);
    (t * width * F32).saturating_sub(logits)
}

/// Bytes a layer's elementwise kernels read and write for `t` tokens, averaged over the
/// layers, forward and backward: per token, each RMSNorm reads and writes `H` (its backward
/// reads two rows and writes one), RoPE reads and writes its columns, the gated activation
/// reads `2I` and writes `I` (its backward reads `3I`, writes `2I`), in bf16. The q/k/v bias
/// is added in its GEMM's epilogue (its backward reads its columns). A residual add that
/// follows a projection directly is the GEMM's C, one more row read; one after a post-norm
/// (Gemma) or a mixture of experts is a kernel of its own that reads two rows and writes one.
/// In the backward each residual's gradient is one more row the norm's backward reads. A
/// mixture of experts counts the intermediate width of the experts each token reaches.
fn elementwise_bytes(spec: &ModelSpec, t: u64) -> (f64, f64, f64) {
    let h = spec.hidden as f64;
    let qkv = spec.qkv_width() as f64;
    let rotated = ((spec.q_heads + spec.kv_heads) * spec.head_dim) as f64;
    let bias = if spec.qkv_bias { qkv } else { 0.0 };
    let norms = 2.0 + 2.0 * f64::from(u8::from(spec.sandwich_norms));
    let qk_norm = if spec.qk_norm { rotated } else { 0.0 };
    let layers = spec.layers.max(1);
    let inter: f64 = (0..layers).map(|l| spec.active_mlp_params(l) as f64 / (3.0 * h)).sum::<f64>()
        / layers as f64;
    let moe_share =
        (0..layers).filter(|&l| spec.moe_at(l).is_some()).count() as f64 / layers as f64;
    let add = |separate: f64| separate * 3.0 * h + (1.0 - separate) * h;
    let post = f64::from(u8::from(spec.sandwich_norms));
    let residuals = add(post) + add(post.max(moe_share));
    let fwd = norms * 2.0 * h + 2.0 * (rotated + qk_norm) + 3.0 * inter + residuals;
    let bwd = norms * 3.0 * h + bias + 2.0 * (rotated + qk_norm) + 5.0 * inter + 2.0 * h;
    // A kept layer's two norms (read and write H each) and activation (read 2I, write I), and
    // with a q/k norm that norm and RoPE, as in the forward.
    let qk_again = if spec.qk_norm { 2.0 * (rotated + qk_norm) } else { 0.0 };
    let rederive = 2.0 * 2.0 * h + 3.0 * inter + qk_again;
    let b = (t * BF16) as f64;
    (fwd * b, bwd * b, rederive * b)
}

/// Forward attention FLOPs of every layer summed, averaged per layer, for the whole step:
/// `QK^T` and `PV` are `2 x hd` FLOPs per head per query-key pair each.
fn attention_fwd_flops(spec: &ModelSpec, batch: BatchShape) -> f64 {
    let rows = (batch.grad_accum * batch.micro_batch) as f64;
    let per_pair = 4.0 * (spec.head_dim * spec.q_heads) as f64;
    let total: f64 = spec
        .windows
        .iter()
        .map(|w| causal_pairs(batch.seq_len as u64, w.map(|w| w as u64)) as f64)
        .sum();
    rows * per_pair * total / spec.layers.max(1) as f64
}
