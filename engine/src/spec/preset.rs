//! Random-init shapes by name: a tiny model for demos and tests, and the shapes of well-known
//! models for planning and benchmarks. Each preset is written as the `config.json` the real model
//! ships, so it goes through the same resolution as a model folder.

use std::path::Path;

use serde_json::{Value, json};

use super::ModelSpec;
use crate::error::{Error, Result};

/// Preset names with a one-line description each.
pub const PRESETS: &[(&str, &str)] = &[
    ("tiny", "4-layer llama-family model (1.0M params, tied embeddings) for demos and tests"),
    ("qwen2.5-0.5b", "Qwen2.5-0.5B shape (tied embeddings, q/k/v bias)"),
    ("qwen2.5-1.5b", "Qwen2.5-1.5B shape"),
    ("qwen2.5-3b", "Qwen2.5-3B shape"),
    ("qwen2.5-7b", "Qwen2.5-7B shape"),
    ("qwen2.5-14b", "Qwen2.5-14B shape"),
    ("qwen2.5-32b", "Qwen2.5-32B shape"),
    ("qwen2.5-72b", "Qwen2.5-72B shape"),
    ("llama3-8b", "Llama-3.1-8B shape (llama3 RoPE scaling)"),
    ("llama3-70b", "Llama-3.1-70B shape (llama3 RoPE scaling)"),
    ("qwen3-8b", "Qwen3-8B shape (q/k RMSNorm)"),
    ("mistral-7b", "Mistral-7B-v0.1 shape (4096-token sliding window)"),
    ("phi-4", "Phi-4 (14B) shape (fused qkv_proj and gate_up_proj)"),
    ("gemma-2-9b", "Gemma 2 9B shape (soft-capped scores and logits, alternating windows)"),
    ("gemma-3-1b", "Gemma 3 1B shape (5 local layers to 1 global, GeGLU, sandwich norms)"),
    ("gemma-3-12b", "Gemma 3 12B text shape (local and global RoPE, linear scaling 8)"),
    ("mixtral-8x7b", "Mixtral 8x7B shape (8 experts, top 2: 46.7B params, 12.9B active)"),
    ("qwen3-30b-a3b", "Qwen3-30B-A3B shape (128 experts, top 8: 30.5B params, 3.3B active)"),
    ("gpt-oss-20b", "gpt-oss-20b shape (32 experts, top 4, sinks, YaRN: 20.9B params)"),
    ("gpt-oss-120b", "gpt-oss-120b shape (128 experts, top 4, sinks, YaRN: 116.8B params)"),
];

/// gpt-oss's `config.json` for a size (both releases share all but depth and experts).
fn gpt_oss(layers: usize, experts: usize) -> Value {
    let types: Vec<&str> = (0..layers)
        .map(|i| if i % 2 == 0 { "sliding_attention" } else { "full_attention" })
        .collect();
    json!({
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
        "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": experts, "num_experts_per_tok": 4,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "sliding_window": 128,
        "layer_types": types, "attention_bias": true, "swiglu_limit": 7.0,
        "tie_word_embeddings": false, "router_aux_loss_coef": 0.9,
        "output_router_logits": false,
        "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": false,
        },
        "bos_token_id": 199998, "eos_token_id": 200002,
    })
}

/// The sizes that tell one release of a family from another.
struct Size {
    hidden: usize,
    inter: usize,
    layers: usize,
    heads: usize,
    kv: usize,
    vocab: usize,
}

/// Gemma 3's text `config.json` for a size, as transformers 5 writes it: every sixth layer
/// global (full attention, RoPE base 1e6 with `scaling`), the rest local (a sliding window of
/// `window`, base 1e4).
fn gemma3(size: Size, window: usize, global_rope: Value) -> Value {
    let Size { hidden, inter, layers, heads, kv, vocab } = size;
    let types: Vec<&str> = (0..layers)
        .map(|i| if (i + 1) % 6 == 0 { "full_attention" } else { "sliding_attention" })
        .collect();
    json!({
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
        "hidden_activation": "gelu_pytorch_tanh", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": 256, "query_pre_attn_scalar": 256,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "sliding_window": window,
        "layer_types": types, "tie_word_embeddings": true,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": global_rope,
        },
        "bos_token_id": 2, "eos_token_id": [1, 106],
    })
}

/// Qwen2.5's `config.json` for a size: the releases up to 3B tie their embeddings (`tied`), and
/// those from 14B up use an `rms_norm_eps` of 1e-5 (`eps`).
fn qwen2(size: Size, tied: bool, eps: f64) -> Value {
    let Size { hidden, inter, layers, heads, kv, vocab } = size;
    json!({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu",
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "max_position_embeddings": 32768, "rms_norm_eps": eps, "rope_theta": 1000000.0,
        "tie_word_embeddings": tied, "use_sliding_window": false, "sliding_window": 32768,
        "max_window_layers": layers, "bos_token_id": 151643, "eos_token_id": 151645,
    })
}

/// Llama 3.1's `config.json` for a size: 128K positions through llama3 RoPE scaling.
fn llama3(hidden: usize, inter: usize, layers: usize, heads: usize) -> Value {
    json!({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
        "vocab_size": 128256, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": false, "bos_token_id": 128000, "eos_token_id": 128009,
    })
}

/// The raw `config.json` of a preset, or `None` for an unknown name.
fn preset_config(name: &str) -> Option<Value> {
    Some(match name {
        "tiny" => json!({
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
            "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 352,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": true, "bos_token_id": null, "eos_token_id": 2,
        }),
        "qwen2.5-0.5b" => qwen2(
            Size { hidden: 896, inter: 4864, layers: 24, heads: 14, kv: 2, vocab: 151936 },
            true,
            1e-6,
        ),
        "qwen2.5-1.5b" => qwen2(
            Size { hidden: 1536, inter: 8960, layers: 28, heads: 12, kv: 2, vocab: 151936 },
            true,
            1e-6,
        ),
        "qwen2.5-3b" => qwen2(
            Size { hidden: 2048, inter: 11008, layers: 36, heads: 16, kv: 2, vocab: 151936 },
            true,
            1e-6,
        ),
        "qwen2.5-7b" => qwen2(
            Size { hidden: 3584, inter: 18944, layers: 28, heads: 28, kv: 4, vocab: 152064 },
            false,
            1e-6,
        ),
        "qwen2.5-14b" => qwen2(
            Size { hidden: 5120, inter: 13824, layers: 48, heads: 40, kv: 8, vocab: 152064 },
            false,
            1e-5,
        ),
        "qwen2.5-32b" => qwen2(
            Size { hidden: 5120, inter: 27648, layers: 64, heads: 40, kv: 8, vocab: 152064 },
            false,
            1e-5,
        ),
        "qwen2.5-72b" => qwen2(
            Size { hidden: 8192, inter: 29568, layers: 80, heads: 64, kv: 8, vocab: 152064 },
            false,
            1e-5,
        ),
        "llama3-8b" => llama3(4096, 14336, 32, 32),
        "llama3-70b" => llama3(8192, 28672, 80, 64),
        "qwen3-8b" => json!({
            "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_act": "silu",
            "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": false, "use_sliding_window": false,
            "bos_token_id": 151643, "eos_token_id": 151645,
        }),
        "mistral-7b" => json!({
            "model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_act": "silu",
            "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "sliding_window": 4096, "tie_word_embeddings": false,
            "bos_token_id": 1, "eos_token_id": 2,
        }),
        "phi-4" => json!({
            "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_act": "silu",
            "vocab_size": 100352, "hidden_size": 5120, "intermediate_size": 17920,
            "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 10,
            "max_position_embeddings": 16384, "original_max_position_embeddings": 16384,
            "rms_norm_eps": 1e-5, "rope_theta": 250000.0, "tie_word_embeddings": false,
            "bos_token_id": 100257, "eos_token_id": 100265,
        }),
        "gemma-2-9b" => json!({
            "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
            "hidden_activation": "gelu_pytorch_tanh", "vocab_size": 256000, "hidden_size": 3584,
            "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "sliding_window": 4096, "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0, "tie_word_embeddings": true,
            "bos_token_id": 2, "eos_token_id": [1, 107],
        }),
        "gemma-3-1b" => gemma3(
            Size { hidden: 1152, inter: 6912, layers: 26, heads: 4, kv: 1, vocab: 262144 },
            512,
            json!({"rope_type": "default", "rope_theta": 1000000.0}),
        ),
        "gemma-3-12b" => gemma3(
            Size { hidden: 3840, inter: 15360, layers: 48, heads: 16, kv: 8, vocab: 262208 },
            1024,
            json!({"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}),
        ),
        "mixtral-8x7b" => json!({
            "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
            "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": null,
            "router_aux_loss_coef": 0.02, "output_router_logits": false,
            "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2,
        }),
        "qwen3-30b-a3b" => json!({
            "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
            "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
            "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
            "num_experts_per_tok": 8, "norm_topk_prob": true, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
            "output_router_logits": false, "tie_word_embeddings": false,
            "bos_token_id": 151643, "eos_token_id": 151645,
        }),
        "gpt-oss-20b" => gpt_oss(24, 32),
        "gpt-oss-120b" => gpt_oss(36, 128),
        _ => return None,
    })
}

/// The spec of a named preset.
pub fn preset(name: &str) -> Result<ModelSpec> {
    let raw = preset_config(name).ok_or_else(|| {
        Error::invalid(format!(
            "unknown preset {name:?}; presets: {}",
            PRESETS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
        ))
    })?;
    ModelSpec::from_hf(raw, Path::new(&format!("preset:{name}")))
}
