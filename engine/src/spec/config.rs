//! `config.json` as Hugging Face writes it: every field optional, names as transformers spells
//! them. Resolution into a [`super::ModelSpec`] decides each default once.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The fields of a Hugging Face decoder config that Sluice reads. Unknown fields are ignored
/// when reading and kept verbatim by [`super::ModelSpec::to_hf_config`]'s caller when exporting.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
pub struct HfConfig {
    pub model_type: Option<String>,
    pub architectures: Option<Vec<String>>,
    pub vocab_size: Option<usize>,
    pub hidden_size: Option<usize>,
    pub intermediate_size: Option<usize>,
    pub num_hidden_layers: Option<usize>,
    pub num_attention_heads: Option<usize>,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub hidden_act: Option<String>,
    pub max_position_embeddings: Option<usize>,
    pub rms_norm_eps: Option<f64>,
    pub rope_theta: Option<f64>,
    /// Legacy (transformers 4) form of the RoPE settings.
    pub rope_scaling: Option<Value>,
    /// transformers 5 form: `{"rope_type": ..., "rope_theta": ..., "factor": ...}`.
    pub rope_parameters: Option<Value>,
    /// Phi-3 (older configs): the share of each head RoPE rotates; transformers 5 moves it into
    /// `rope_parameters`.
    pub partial_rotary_factor: Option<f64>,
    /// Phi-3: the pretrained context, where longrope switches from short to long factors.
    pub original_max_position_embeddings: Option<usize>,
    /// Gemma: the MLP's activation (`hidden_act` is ignored by its modeling code).
    pub hidden_activation: Option<String>,
    /// Gemma: attention scores are scaled by `query_pre_attn_scalar ** -0.5`.
    pub query_pre_attn_scalar: Option<Value>,
    /// Gemma 3: bidirectional attention (its vision towers; refused).
    pub use_bidirectional_attention: Option<bool>,
    /// Gemma 3 (transformers 4): the sliding layers' RoPE base.
    pub rope_local_base_freq: Option<f64>,
    /// Gemma 3 (transformers 4): every `sliding_window_pattern`-th layer is a full-attention one.
    pub sliding_window_pattern: Option<usize>,
    pub tie_word_embeddings: Option<bool>,
    /// Llama: bias on q, k, v and o projections.
    pub attention_bias: Option<bool>,
    pub mlp_bias: Option<bool>,
    pub sliding_window: Option<Value>,
    /// Qwen2/Qwen3: whether `sliding_window` applies at all.
    pub use_sliding_window: Option<bool>,
    /// Qwen2/Qwen3: layers at or above this index use the sliding window.
    pub max_window_layers: Option<usize>,
    /// transformers 5: per-layer `"full_attention"` or `"sliding_attention"`.
    pub layer_types: Option<Vec<String>>,
    pub bos_token_id: Option<Value>,
    pub eos_token_id: Option<Value>,
    pub pad_token_id: Option<Value>,
    /// Mixtral, GPT-OSS: experts per MoE layer.
    pub num_local_experts: Option<usize>,
    /// Qwen MoE: experts per MoE layer.
    pub num_experts: Option<usize>,
    pub num_experts_per_tok: Option<usize>,
    /// Qwen MoE: each expert's intermediate size (`intermediate_size` is the dense layers').
    pub moe_intermediate_size: Option<usize>,
    /// Qwen MoE: renormalise the chosen experts' probabilities.
    pub norm_topk_prob: Option<bool>,
    /// Qwen MoE: layers whose MLP is dense.
    pub mlp_only_layers: Option<Vec<usize>>,
    /// Qwen MoE: every `decoder_sparse_step`-th layer is a mixture.
    pub decoder_sparse_step: Option<usize>,
    /// Qwen2 MoE: bias on the q, k and v projections.
    pub qkv_bias: Option<bool>,
    /// Qwen2 MoE: the shared expert's intermediate size.
    pub shared_expert_intermediate_size: Option<usize>,
    pub router_aux_loss_coef: Option<f64>,
    /// transformers adds the load-balancing loss to the loss only when this is set.
    pub output_router_logits: Option<bool>,
    pub torch_dtype: Option<String>,
    pub dtype: Option<String>,
}
