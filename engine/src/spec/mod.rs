//! A model's shape and family behaviour, resolved once from Hugging Face's `config.json`.
//!
//! One decoder serves every supported family; what differs between families is data here:
//! q/k/v biases (qwen2), per-head q/k RMSNorm (qwen3), a sliding window (mistral), RoPE scaling
//! (llama3, linear and Phi-3's longrope), partial rotary embedding, projections stored fused in
//! the checkpoint (phi3), tied embeddings. Every default is decided in [`ModelSpec::from_hf`] and
//! nowhere else. A multimodal folder whose text model Sluice trains (Gemma 3's
//! `Gemma3ForConditionalGeneration`) resolves to its text model's spec, which records the
//! wrapper ([`Multimodal`]).

mod config;
mod multimodal;
mod preset;

use std::path::Path;

use serde_json::{Value, json};

pub use config::HfConfig;
pub use multimodal::Multimodal;
pub use preset::{PRESETS, preset};

use crate::backend::{ExpertLayout, GluAct, RouterKind};
use crate::error::{Error, Result};

/// The decoder families Sluice trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Qwen2,
    Qwen3,
    Mistral,
    /// Phi-3, Phi-3.5 and Phi-4.
    Phi3,
    /// Gemma 2 (`Gemma2ForCausalLM`).
    Gemma2,
    /// Gemma 3's text model (`Gemma3ForCausalLM`, and inside `Gemma3ForConditionalGeneration`
    /// folders: see [`Multimodal`]).
    Gemma3,
    /// Mixtral's sparse mixture of experts.
    Mixtral,
    /// Qwen3's mixture of experts (`Qwen3MoeForCausalLM`).
    Qwen3Moe,
    /// Qwen2's (and Qwen1.5's) mixture of experts, with a gated shared expert
    /// (`Qwen2MoeForCausalLM`).
    Qwen2Moe,
    /// OpenAI's gpt-oss: experts, attention sinks, alternating sliding and full attention.
    GptOss,
}

impl Family {
    pub const ALL: [Family; 11] = [
        Family::Llama,
        Family::Qwen2,
        Family::Qwen3,
        Family::Mistral,
        Family::Phi3,
        Family::Gemma2,
        Family::Gemma3,
        Family::Mixtral,
        Family::Qwen3Moe,
        Family::Qwen2Moe,
        Family::GptOss,
    ];

    /// The `model_type` transformers writes.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Mistral => "mistral",
            Family::Phi3 => "phi3",
            Family::Gemma2 => "gemma2",
            Family::Gemma3 => "gemma3_text",
            Family::Mixtral => "mixtral",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Qwen2Moe => "qwen2_moe",
            Family::GptOss => "gpt_oss",
        }
    }

    /// The class transformers instantiates (`architectures[0]`).
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Phi3 => "Phi3ForCausalLM",
            Family::Gemma2 => "Gemma2ForCausalLM",
            Family::Gemma3 => "Gemma3ForCausalLM",
            Family::Mixtral => "MixtralForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
            Family::Qwen2Moe => "Qwen2MoeForCausalLM",
            Family::GptOss => "GptOssForCausalLM",
        }
    }

    fn from_model_type(model_type: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|f| f.model_type() == model_type)
    }
}

/// How RoPE frequencies are rescaled for long context.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        factor: f64,
    },
    /// Llama 3.1's piecewise rescaling of low frequencies.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_positions: f64,
    },
    /// YaRN (`_compute_yarn_parameters`): each frequency blended between itself and itself
    /// divided by `factor` by a linear ramp over the dimensions between the correction range
    /// of `beta_fast` and `beta_slow` rotations, and cos and sin multiplied by
    /// `attention_factor`.
    Yarn {
        factor: f64,
        beta_fast: f64,
        beta_slow: f64,
        original_max_positions: f64,
        truncate: bool,
        attention_factor: f64,
    },
    /// Phi-3's LongRoPE: frequency `i` divided by `short[i]` while a forward's positions stay
    /// within `original_max_positions`, by `long[i]` beyond (transformers chooses per forward,
    /// from the largest position id), and cos and sin multiplied by `attention_factor`.
    LongRope {
        short: Vec<f64>,
        long: Vec<f64>,
        original_max_positions: usize,
        attention_factor: f64,
    },
}

/// RoPE of the sliding-window layers where it differs from the full-attention layers' (Gemma 3's
/// local layers: their own base, no scaling).
#[derive(Debug, Clone, PartialEq)]
pub struct LocalRope {
    pub theta: f64,
    pub scaling: RopeScaling,
}

/// A mixture-of-experts MLP's shape and behaviour.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeSpec {
    /// Experts per MoE layer (`E`).
    pub experts: usize,
    /// Experts per token (`k`).
    pub top_k: usize,
    /// Each expert's intermediate size.
    pub inter: usize,
    pub router: RouterKind,
    /// The router's logits have a bias (GPT-OSS).
    pub router_bias: bool,
    /// The experts' projections have biases (GPT-OSS).
    pub expert_bias: bool,
    /// How the experts' matrices are stored (and so laid out in the slab).
    pub layout: ExpertLayout,
    /// `router_aux_loss_coef`: the load-balancing loss's weight.
    pub aux_coef: f32,
    /// Whether the loss includes `aux_coef` times the load-balancing loss: transformers adds it
    /// only with `output_router_logits`; it is reported either way.
    pub aux_in_loss: bool,
    /// Per layer: whether its MLP is the mixture (Qwen MoE's `mlp_only_layers` and
    /// `decoder_sparse_step` make some dense).
    pub sparse: Vec<bool>,
    /// Qwen2 MoE's shared expert: a dense gated MLP of this intermediate size that every token
    /// also goes through, its output scaled by `sigmoid(x · w_gate)`.
    pub shared_inter: Option<usize>,
}

impl MoeSpec {
    /// Layers whose MLP is the mixture.
    pub fn sparse_layers(&self) -> usize {
        self.sparse.iter().filter(|&&s| s).count()
    }
}

/// A validated, fully resolved model description.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    pub family: Family,
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    /// Leading dimensions of each head that RoPE rotates (`partial_rotary_factor · head_dim`;
    /// the rest pass through unrotated).
    pub rotary_dim: usize,
    /// RoPE of the layers with a sliding window, when it is not the one above (gemma3).
    pub local_rope: Option<LocalRope>,
    pub max_positions: usize,
    pub tie_embeddings: bool,
    /// Bias on the q, k and v projections (qwen2; llama with `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection (llama with `attention_bias`).
    pub o_bias: bool,
    /// Per-head RMSNorm on queries and keys before RoPE (qwen3).
    pub qk_norm: bool,
    /// The checkpoint stores q, k, v as one `qkv_proj` and gate, up as one `gate_up_proj`
    /// (phi3); the slab layout is the same either way.
    pub fused_checkpoint: bool,
    /// RMSNorms scale by `norm_offset + weight`: 1 for Gemma (`Gemma3RMSNorm`, whose weights
    /// start at 0), 0 elsewhere.
    pub norm_offset: f32,
    /// The embedding lookup is multiplied by this: `sqrt(hidden)` for Gemma, 1 elsewhere.
    pub embed_scale: f32,
    /// The gated MLP's activation (SiLU; GELU-tanh for Gemma).
    pub glu_act: GluAct,
    /// RMSNorms after attention and after the MLP too, before each residual add (Gemma's
    /// `post_attention_layernorm`, `post_feedforward_layernorm`); the MLP's input norm is then
    /// `pre_feedforward_layernorm`.
    pub sandwich_norms: bool,
    /// Attention scores scaled by `1 / sqrt(scale_dim)` instead of `1 / sqrt(head_dim)`
    /// (Gemma's `query_pre_attn_scalar`).
    pub scale_dim: Option<usize>,
    /// Scaled attention scores become `cap · tanh(s / cap)` (Gemma 2's `attn_logit_softcapping`).
    pub attn_softcap: Option<f32>,
    /// The logits become `cap · tanh(z / cap)` (Gemma 2's `final_logit_softcapping`).
    pub final_softcap: Option<f32>,
    /// Per layer: the sliding window in tokens, or `None` for full causal attention.
    pub windows: Vec<Option<usize>>,
    /// The mixture of experts, for the MoE families.
    pub moe: Option<MoeSpec>,
    /// Every attention head has a learned sink logit (GPT-OSS's `self_attn.sinks`).
    pub attn_sinks: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The `config.json` this spec was read from, kept so an export writes back every field;
    /// for a multimodal folder, its text model's part (`text_config` with what it inherits from
    /// the top level, see [`Multimodal`]).
    pub raw: Value,
    /// The multimodal wrapper the text model was read from, whose class and config a checkpoint
    /// is written back as; `None` for a text model's own folder.
    pub multimodal: Option<Multimodal>,
}

impl ModelSpec {
    /// Reads and resolves `DIR/config.json` (or the file itself if `path` is a file).
    pub fn from_path(path: &Path) -> Result<ModelSpec> {
        let file = if path.is_dir() { path.join("config.json") } else { path.to_path_buf() };
        let text = std::fs::read_to_string(&file).map_err(|e| Error::io(&file, e))?;
        let raw: Value = serde_json::from_str(&text)
            .map_err(|e| Error::config(&file, format!("not valid JSON: {e}")))?;
        ModelSpec::from_hf(raw, &file)
    }

    /// Resolves a parsed `config.json`; `origin` names it in errors. A multimodal wrapper's
    /// config (Gemma 3's `gemma3`) resolves to its text model, from `text_config`.
    pub fn from_hf(raw: Value, origin: &Path) -> Result<ModelSpec> {
        let Some((text, wrapper)) =
            multimodal::unwrap_text(&raw).map_err(|m| Error::config(origin, m))?
        else {
            return ModelSpec::resolve(raw, origin);
        };
        let mut spec = ModelSpec::resolve(text, origin).map_err(|e| match e {
            Error::Config { path, message } => {
                Error::config(path, format!("text_config: {message}"))
            }
            other => other,
        })?;
        spec.multimodal = Some(wrapper);
        Ok(spec)
    }

    /// Resolves a text model's config.
    fn resolve(raw: Value, origin: &Path) -> Result<ModelSpec> {
        let err = |m: String| Error::config(origin, m);
        let cfg: HfConfig = serde_json::from_value(raw.clone())
            .map_err(|e| err(format!("unexpected field type: {e}")))?;
        let model_type = cfg.model_type.clone().ok_or_else(|| err("no model_type".into()))?;
        let model_type = model_type.as_str();
        let family = Family::from_model_type(model_type).ok_or_else(|| {
            err(multimodal::unsupported(&raw, model_type).unwrap_or_else(|| {
                format!(
                    "unsupported model_type {model_type:?}; supported: {}",
                    Family::ALL.map(Family::model_type).join(", ")
                )
            }))
        })?;
        // Gemma3TextConfig gives every field a default, which a multimodal folder's
        // `text_config` relies on; the other families' sizes must be written out.
        let cfg: HfConfig = match family {
            Family::Gemma3 => {
                let defaulted =
                    multimodal::with_defaults(&raw, &multimodal::gemma3_text_defaults());
                serde_json::from_value(defaulted)
                    .map_err(|e| err(format!("unexpected field type: {e}")))?
            }
            _ => cfg,
        };
        let need = |v: Option<usize>, name: &str| {
            v.filter(|&n| n > 0).ok_or_else(|| err(format!("{name} is missing or zero")))
        };
        let vocab = need(cfg.vocab_size, "vocab_size")?;
        let hidden = need(cfg.hidden_size, "hidden_size")?;
        let intermediate = need(cfg.intermediate_size, "intermediate_size")?;
        let layers = need(cfg.num_hidden_layers, "num_hidden_layers")?;
        let q_heads = need(cfg.num_attention_heads, "num_attention_heads")?;
        let kv_heads = need(cfg.num_key_value_heads.or(Some(q_heads)), "num_key_value_heads")?;
        if q_heads % kv_heads != 0 {
            return Err(err(format!(
                "num_attention_heads ({q_heads}) is not a multiple of num_key_value_heads ({kv_heads})"
            )));
        }
        let head_dim = match cfg.head_dim {
            Some(d) => d,
            None if hidden % q_heads == 0 => hidden / q_heads,
            None => {
                return Err(err(format!(
                    "hidden_size ({hidden}) is not divisible by num_attention_heads ({q_heads}) and no head_dim is given"
                )));
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(err(format!(
                "head_dim must be even and non-zero for RoPE, got {head_dim}"
            )));
        }
        let gemma = matches!(family, Family::Gemma2 | Family::Gemma3);
        // Gemma reads `hidden_activation` (its `hidden_act` is a leftover of older configs).
        let act = if gemma {
            cfg.hidden_activation.as_deref().or(cfg.hidden_act.as_deref())
        } else {
            cfg.hidden_act.as_deref()
        };
        let glu_act = match act {
            // GptOssExperts ignores `hidden_act`: its activation is the clamped SwiGLU.
            _ if family == Family::GptOss => GluAct::ClampedSwiglu,
            None if gemma => GluAct::GeluTanh,
            None | Some("silu") | Some("swish") => GluAct::Silu,
            Some("gelu_pytorch_tanh") | Some("gelu_tanh") => GluAct::GeluTanh,
            Some(other) => {
                return Err(err(format!(
                    "hidden activation {other:?} is not supported (silu, gelu_pytorch_tanh)"
                )));
            }
        };
        // Gemma2Config caps scores at 50 and logits at 30 unless told otherwise (null: no cap);
        // Gemma3TextConfig caps nothing by default; other families have no caps.
        // Read from the raw config: serde makes an explicit null and an absent key both `None`.
        let softcap = |key: &str, gemma2_default: f32| match raw.get(key) {
            None if family == Family::Gemma2 => Ok(Some(gemma2_default)),
            None | Some(Value::Null) => Ok(None),
            Some(_) if !gemma => Err(err(format!("{key} is not supported for {model_type}"))),
            Some(v) => v
                .as_f64()
                .filter(|c| *c > 0.0 && c.is_finite())
                .map(|c| Some(c as f32))
                .ok_or_else(|| err(format!("{key} must be a positive number or null, got {v}"))),
        };
        let attn_softcap = softcap("attn_logit_softcapping", 50.0)?;
        let final_softcap = softcap("final_logit_softcapping", 30.0)?;
        if cfg.use_bidirectional_attention == Some(true) {
            return Err(err("use_bidirectional_attention = true is not supported".into()));
        }
        let scale_dim = match (&cfg.query_pre_attn_scalar, gemma) {
            (Some(v), true) => Some(v.as_u64().filter(|&d| d > 0).ok_or_else(|| {
                err(format!("query_pre_attn_scalar must be a positive integer, got {v}"))
            })? as usize),
            // Gemma2Config's and Gemma3TextConfig's default.
            (None, true) => Some(256),
            (_, false) => None,
        };
        if cfg.mlp_bias == Some(true) {
            return Err(err("mlp_bias = true is not supported".into()));
        }
        let rms_eps = cfg.rms_norm_eps.unwrap_or(1e-6);
        if !(rms_eps > 0.0 && rms_eps < 1.0) {
            return Err(err(format!("rms_norm_eps must be in (0, 1), got {rms_eps}")));
        }
        let max_positions = cfg.max_position_embeddings.unwrap_or(4096);
        let rope = resolve_rope(&cfg, family, max_positions).map_err(err)?;
        let (rope_theta, rope_scaling) = (rope.theta, rope.scaling);
        // transformers: `dim = int(head_dim * partial_rotary_factor)`, truncated.
        let rotary_dim = (head_dim as f64 * rope.partial_rotary_factor) as usize;
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) || rotary_dim > head_dim {
            return Err(err(format!(
                "partial_rotary_factor {} gives {rotary_dim} rotary dimensions of head_dim \
                 {head_dim}; they must be even, non-zero and at most head_dim",
                rope.partial_rotary_factor
            )));
        }
        if let RopeScaling::LongRope { short, long, .. } = &rope_scaling
            && (short.len() != rotary_dim / 2 || long.len() != rotary_dim / 2)
        {
            return Err(err(format!(
                "longrope needs {} short and long factors (rotary dimensions / 2), got {} and {}",
                rotary_dim / 2,
                short.len(),
                long.len()
            )));
        }
        // GptOssConfig defaults attention_bias to true, every other config to false.
        let attention_bias = cfg.attention_bias.unwrap_or(family == Family::GptOss);
        let (qkv_bias, o_bias, qk_norm) = match family {
            Family::Llama | Family::Mistral => (attention_bias, attention_bias, false),
            Family::Qwen2 => (true, false, false),
            Family::Qwen3 => (attention_bias, attention_bias, true),
            // modeling_phi3: qkv_proj and o_proj without bias.
            Family::Phi3 => (false, false, false),
            Family::Gemma2 => (attention_bias, attention_bias, false),
            Family::Gemma3 => (attention_bias, attention_bias, true),
            Family::Mixtral => (false, false, false),
            Family::Qwen3Moe => (attention_bias, attention_bias, true),
            // Qwen2MoeAttention: q, k, v biases by `qkv_bias` (default true), none on o.
            Family::Qwen2Moe => (cfg.qkv_bias.unwrap_or(true), false, false),
            // GptOssAttention: every projection has a bias when attention_bias (the released
            // checkpoints set it).
            Family::GptOss => (attention_bias, attention_bias, false),
        };
        let moe = resolve_moe(&cfg, family, layers, intermediate).map_err(err)?;
        let local_rope =
            if family == Family::Gemma3 { resolve_local_rope(&cfg).map_err(err)? } else { None };
        let windows = resolve_windows(&cfg, family, layers).map_err(err)?;
        // Every supported family's config class defaults to untied embeddings but Gemma's.
        let tie_embeddings = cfg.tie_word_embeddings.unwrap_or(gemma);
        let ids = |v: &Option<Value>| -> Vec<u32> {
            match v {
                Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
                Some(Value::Array(a)) => {
                    a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect()
                }
                _ => Vec::new(),
            }
        };
        Ok(ModelSpec {
            family,
            vocab,
            hidden,
            intermediate,
            layers,
            q_heads,
            kv_heads,
            head_dim,
            rms_eps: rms_eps as f32,
            rope_theta,
            rope_scaling,
            rotary_dim,
            local_rope,
            max_positions,
            tie_embeddings,
            qkv_bias,
            o_bias,
            qk_norm,
            fused_checkpoint: family == Family::Phi3,
            norm_offset: if gemma { 1.0 } else { 0.0 },
            // Gemma3TextScaledWordEmbedding: `hidden_size ** 0.5`, held as an f32 tensor.
            embed_scale: if gemma { (hidden as f64).sqrt() as f32 } else { 1.0 },
            glu_act,
            sandwich_norms: gemma,
            scale_dim,
            attn_softcap,
            final_softcap,
            windows,
            moe,
            attn_sinks: family == Family::GptOss,
            bos_token_id: ids(&cfg.bos_token_id).first().copied(),
            eos_token_ids: ids(&cfg.eos_token_id),
            raw,
            multimodal: None,
        })
    }

    /// The same model cut to its first `layers` decoder layers (a reduced-depth shape for
    /// checks and benchmarks): the config's per-layer lists are cut alike and the result is
    /// resolved again.
    pub fn with_layers(&self, layers: usize) -> Result<ModelSpec> {
        if layers == 0 || layers > self.layers {
            return Err(Error::invalid(format!(
                "a reduced depth must be 1 to {} layers, got {layers}",
                self.layers
            )));
        }
        let mut raw = self.to_hf_config();
        if let Value::Object(map) = &mut raw {
            map.insert("num_hidden_layers".into(), json!(layers));
            if let Some(Value::Array(types)) = map.get_mut("layer_types") {
                types.truncate(layers);
            }
            if let Some(Value::Array(dense)) = map.get_mut("mlp_only_layers") {
                dense.retain(|l| l.as_u64().is_some_and(|l| (l as usize) < layers));
            }
        }
        ModelSpec::from_hf(
            raw,
            Path::new(&format!("{} cut to {layers} layers", self.family.model_type())),
        )
    }

    /// Width of one token's fused q, k, v projection.
    pub fn qkv_width(&self) -> usize {
        (self.q_heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Width of the attention output (the o projection's input).
    pub fn attn_width(&self) -> usize {
        self.q_heads * self.head_dim
    }

    /// Parameters of decoder layer `layer` (MoE layers hold their router and experts; Qwen MoE
    /// mixes them with dense ones).
    pub fn layer_params(&self, layer: usize) -> usize {
        let h = self.hidden;
        let mut n = 2 * h // the two RMSNorms
            + self.qkv_width() * h
            + h * self.attn_width()
            + self.mlp_params(layer);
        if self.qkv_bias {
            n += self.qkv_width();
        }
        if self.o_bias {
            n += h;
        }
        if self.qk_norm {
            n += 2 * self.head_dim;
        }
        if self.sandwich_norms {
            n += 2 * h;
        }
        if self.attn_sinks {
            n += self.q_heads;
        }
        n
    }

    /// Whether every layer's MLP is a mixture of experts (no dense MLP anywhere).
    pub fn all_sparse(&self) -> bool {
        self.moe.as_ref().is_some_and(|m| m.sparse.iter().all(|&s| s))
    }

    /// The MoE of layer `layer`, if its MLP is one.
    pub fn moe_at(&self, layer: usize) -> Option<&MoeSpec> {
        self.moe.as_ref().filter(|m| m.sparse.get(layer).copied().unwrap_or(false))
    }

    /// Parameters of layer `layer`'s MLP: the dense gated MLP, or the router and every expert.
    pub fn mlp_params(&self, layer: usize) -> usize {
        let h = self.hidden;
        match self.moe_at(layer) {
            None => 3 * self.intermediate * h,
            Some(m) => {
                let router = h + usize::from(m.router_bias);
                let expert = 3 * m.inter * h + usize::from(m.expert_bias) * (2 * m.inter + h);
                let shared = m.shared_inter.map_or(0, |s| 3 * s * h + h);
                m.experts * (router + expert) + shared
            }
        }
    }

    /// Parameters one token's MLP multiplies by in layer `layer`: the dense MLP's, or its `k`
    /// experts' and the router's (what a step's GEMM FLOPs count).
    pub fn active_mlp_params(&self, layer: usize) -> usize {
        match self.moe_at(layer) {
            None => 3 * self.intermediate * self.hidden,
            Some(m) => {
                let shared = m.shared_inter.map_or(0, |s| 3 * s * self.hidden + self.hidden);
                m.top_k * 3 * m.inter * self.hidden + m.experts * self.hidden + shared
            }
        }
    }

    /// Parameters each token computes with: all of a dense model's; a mixture of experts counts
    /// only the `k` experts a token is routed to (and the router), which is what FLOPs and
    /// TFLOPS figures use.
    pub fn active_params(&self) -> usize {
        let idle: usize = (0..self.layers)
            .filter_map(|l| self.moe_at(l))
            .map(|m| {
                let expert = 3 * m.inter * self.hidden
                    + usize::from(m.expert_bias) * (2 * m.inter + self.hidden);
                (m.experts - m.top_k) * expert
            })
            .sum();
        self.total_params() - idle
    }

    /// Total trainable parameters (a tied LM head counted once).
    pub fn total_params(&self) -> usize {
        let embed = self.vocab * self.hidden;
        let head = if self.tie_embeddings { 0 } else { embed };
        embed + (0..self.layers).map(|l| self.layer_params(l)).sum::<usize>() + self.hidden + head
    }

    /// RoPE inverse frequencies `[rotary_dim / 2]`, computed in f32 as transformers'
    /// `_compute_default_rope_parameters`, `_compute_linear_scaling_rope_parameters`,
    /// `_compute_llama3_parameters` and `_compute_longrope_parameters` (its short factors) do
    /// (modeling_rope_utils.py).
    pub fn inv_freq(&self) -> Vec<f32> {
        self.inv_freq_of(self.rope_theta, &self.rope_scaling)
    }

    /// The sliding-window layers' own RoPE frequencies `[rotary_dim / 2]`, where they have
    /// their own (gemma3's local layers).
    pub fn local_inv_freq(&self) -> Option<Vec<f32>> {
        self.local_rope.as_ref().map(|r| self.inv_freq_of(r.theta, &r.scaling))
    }

    fn inv_freq_of(&self, theta: f64, scaling: &RopeScaling) -> Vec<f32> {
        let plain = self.plain_inv_freq(theta);
        match scaling {
            RopeScaling::None => plain,
            RopeScaling::Linear { factor } => plain.iter().map(|f| f / *factor as f32).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_positions,
            } => {
                let factor = *factor as f32;
                let (low, high) = (*low_freq_factor as f32, *high_freq_factor as f32);
                let old_len = *original_max_positions as f32;
                let low_freq_wavelen = old_len / low;
                let high_freq_wavelen = old_len / high;
                plain
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        let scaled = if wavelen > low_freq_wavelen { f / factor } else { f };
                        let medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
                        if medium {
                            let smooth = (old_len / wavelen - low) / (high - low);
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        } else {
                            scaled
                        }
                    })
                    .collect()
            }
            RopeScaling::LongRope { short, .. } => self.longrope_inv_freq(theta, short),
            RopeScaling::Yarn {
                factor,
                beta_fast,
                beta_slow,
                original_max_positions,
                truncate,
                ..
            } => {
                let dim = self.rotary_dim as f64;
                // find_correction_dim / find_correction_range, in f64 as Python computes them.
                let correction = |rotations: f64| {
                    dim * (original_max_positions / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (correction(*beta_fast), correction(*beta_slow));
                if *truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                let base = theta as f32;
                let factor = *factor as f32;
                (0..self.rotary_dim / 2)
                    .map(|i| {
                        let pos_freq = base.powf((2 * i) as f32 / self.rotary_dim as f32);
                        let extrapolation = 1.0 / pos_freq;
                        let interpolation = 1.0 / (factor * pos_freq);
                        // linear_ramp_factor: (i − low) / (high − low) in f32, clamped to [0, 1].
                        let ramp =
                            ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                        let extra = 1.0 - ramp;
                        interpolation * (1.0 - extra) + extrapolation * extra
                    })
                    .collect()
            }
        }
    }

    /// Where RoPE switches to other frequencies, and those frequencies `[rotary_dim / 2]`
    /// (longrope's long factors): a forward whose largest position id `p` has `p + 1` above the
    /// returned count uses them. `None` when one table serves every length.
    pub fn long_inv_freq(&self) -> Option<(usize, Vec<f32>)> {
        match &self.rope_scaling {
            RopeScaling::LongRope { long, original_max_positions, .. } => {
                Some((*original_max_positions, self.longrope_inv_freq(self.rope_theta, long)))
            }
            _ => None,
        }
    }

    /// The factor cos and sin are multiplied by (transformers' `attention_scaling`).
    pub fn rope_scale(&self) -> f32 {
        match &self.rope_scaling {
            RopeScaling::LongRope { attention_factor, .. }
            | RopeScaling::Yarn { attention_factor, .. } => *attention_factor as f32,
            _ => 1.0,
        }
    }

    /// `1 / theta^(2i / dim)` over the rotary dimensions, in f32.
    fn plain_inv_freq(&self, theta: f64) -> Vec<f32> {
        let dim = self.rotary_dim;
        let base = theta as f32;
        (0..dim / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32)).collect()
    }

    /// `1 / (factor_i · theta^(2i / dim))`, in f32 as `_compute_longrope_parameters`.
    fn longrope_inv_freq(&self, theta: f64, factors: &[f64]) -> Vec<f32> {
        let dim = self.rotary_dim;
        let base = theta as f32;
        factors
            .iter()
            .enumerate()
            .map(|(i, &ext)| 1.0 / (ext as f32 * base.powf((2 * i) as f32 / dim as f32)))
            .collect()
    }

    /// The `config.json` to write beside exported weights: the original fields, with the
    /// resolved values that transformers needs spelled out. For a model read from a multimodal
    /// folder this is its text model's own (a `Gemma3ForCausalLM` folder, what the training
    /// state is saved as); its checkpoints carry [`ModelSpec::wrapper_config`].
    pub fn to_hf_config(&self) -> Value {
        let mut out = match &self.raw {
            Value::Object(_) => self.raw.clone(),
            _ => json!({}),
        };
        if let Value::Object(map) = &mut out {
            map.insert("model_type".into(), json!(self.family.model_type()));
            map.insert("architectures".into(), json!([self.family.architecture()]));
            map.insert("torch_dtype".into(), json!("float32"));
            map.remove("dtype");
            map.insert("tie_word_embeddings".into(), json!(self.tie_embeddings));
        }
        out
    }

    /// For a model read from a multimodal folder, the `config.json` its checkpoints carry: the
    /// wrapper's as it was read (`architectures`, `text_config`, `vision_config` and the rest
    /// untouched) but for the dtype at its top level, float32 as in [`ModelSpec::to_hf_config`]
    /// (transformers 5 loads a composite model in the top level's dtype); `None` for a text
    /// model's own folder.
    pub fn wrapper_config(&self) -> Option<Value> {
        let mut out = self.multimodal.as_ref()?.config.clone();
        if let Value::Object(map) = &mut out {
            map.insert("torch_dtype".into(), json!("float32"));
            map.remove("dtype");
        }
        Some(out)
    }
}

/// The mixture of experts a config describes, for the MoE families.
fn resolve_moe(
    cfg: &HfConfig,
    family: Family,
    layers: usize,
    intermediate: usize,
) -> std::result::Result<Option<MoeSpec>, String> {
    let (experts, top_k, inter, router, coef) = match family {
        Family::Mixtral => (
            cfg.num_local_experts.unwrap_or(8),
            cfg.num_experts_per_tok.unwrap_or(2),
            intermediate,
            RouterKind::SoftmaxTopK { renormalize: true },
            0.001,
        ),
        // transformers 5 writes `num_local_experts` for Qwen MoE too; older configs
        // `num_experts`.
        Family::Qwen2Moe => (
            cfg.num_experts.or(cfg.num_local_experts).unwrap_or(60),
            cfg.num_experts_per_tok.unwrap_or(4),
            cfg.moe_intermediate_size.unwrap_or(1408),
            RouterKind::SoftmaxTopK { renormalize: cfg.norm_topk_prob.unwrap_or(false) },
            0.001,
        ),
        Family::Qwen3Moe => (
            cfg.num_experts.or(cfg.num_local_experts).unwrap_or(128),
            cfg.num_experts_per_tok.unwrap_or(8),
            cfg.moe_intermediate_size.unwrap_or(768),
            RouterKind::SoftmaxTopK { renormalize: cfg.norm_topk_prob.unwrap_or(false) },
            0.001,
        ),
        Family::GptOss => (
            cfg.num_local_experts.unwrap_or(128),
            cfg.num_experts_per_tok.unwrap_or(4),
            intermediate,
            RouterKind::TopKSoftmax,
            0.001,
        ),
        _ => return Ok(None),
    };
    if experts == 0 || inter == 0 {
        return Err("a mixture of experts needs experts and a non-zero intermediate size".into());
    }
    if top_k == 0 || top_k > experts {
        return Err(format!("num_experts_per_tok must be in 1..={experts}, got {top_k}"));
    }
    // Only Qwen2MoeSparseMoeBlock has a shared expert (Qwen2MoeConfig's default is 5632); the
    // other families' configs have no such field.
    let shared_inter = match family {
        Family::Qwen2Moe => {
            Some(cfg.shared_expert_intermediate_size.unwrap_or(5632)).filter(|&n| n > 0)
        }
        _ => None,
    };
    let aux_coef = cfg.router_aux_loss_coef.unwrap_or(coef);
    if !aux_coef.is_finite() || aux_coef < 0.0 {
        return Err(format!("router_aux_loss_coef must be a non-negative number, got {aux_coef}"));
    }
    // Qwen3MoeDecoderLayer: a mixture unless listed in mlp_only_layers or off the sparse step.
    let step = cfg.decoder_sparse_step.unwrap_or(1).max(1);
    let dense = cfg.mlp_only_layers.clone().unwrap_or_default();
    let sparse = (0..layers)
        .map(|l| {
            let qwen = matches!(family, Family::Qwen3Moe | Family::Qwen2Moe);
            !qwen || (!dense.contains(&l) && (l + 1) % step == 0)
        })
        .collect();
    let gpt_oss = family == Family::GptOss;
    Ok(Some(MoeSpec {
        experts,
        top_k,
        inter,
        router,
        router_bias: gpt_oss,
        expert_bias: gpt_oss,
        layout: if gpt_oss { ExpertLayout::Cols } else { ExpertLayout::Rows },
        aux_coef: aux_coef as f32,
        aux_in_loss: cfg.output_router_logits.unwrap_or(false),
        sparse,
        shared_inter,
    }))
}

/// RoPE as a config describes it.
struct ResolvedRope {
    theta: f64,
    scaling: RopeScaling,
    partial_rotary_factor: f64,
}

fn resolve_rope(
    cfg: &HfConfig,
    family: Family,
    max_positions: usize,
) -> std::result::Result<ResolvedRope, String> {
    // transformers 5 folds theta and scaling into `rope_parameters`; older configs use
    // `rope_theta` + `rope_scaling`. Accept both, preferring the newer one. Gemma 3 nests one
    // set per layer type: the full-attention layers' is the model's RoPE, the sliding layers'
    // its `local_rope`.
    let params =
        cfg.rope_parameters.as_ref().or(cfg.rope_scaling.as_ref()).filter(|v| !v.is_null());
    let params = params.map(|p| p.get("full_attention").filter(|v| v.is_object()).unwrap_or(p));
    // Gemma3TextConfig's `default_theta["global"]`; every other config class defaults to 1e4.
    let default_theta = if family == Family::Gemma3 { 1_000_000.0 } else { 10_000.0 };
    resolve_rope_params(cfg, params, cfg.rope_theta.unwrap_or(default_theta), max_positions)
}

/// The sliding layers' RoPE of a Gemma 3 config: `rope_parameters.sliding_attention`
/// (transformers 5), else `rope_local_base_freq` without scaling (transformers 4); its base
/// defaults to `rope_local_base_freq`, then 1e4, as `Gemma3TextConfig.convert_rope_params_to_dict`
/// does.
fn resolve_local_rope(cfg: &HfConfig) -> std::result::Result<Option<LocalRope>, String> {
    let nested = cfg.rope_parameters.as_ref().and_then(|p| p.get("sliding_attention"));
    let base = cfg.rope_local_base_freq.unwrap_or(10_000.0);
    let (theta, scaling) = match nested.filter(|v| v.is_object()) {
        Some(p) => {
            let r = resolve_rope_params(cfg, Some(p), base, usize::MAX)?;
            (r.theta, r.scaling)
        }
        None => (base, RopeScaling::None),
    };
    if theta.is_nan() || theta <= 0.0 {
        return Err(format!("the sliding layers' rope_theta must be positive, got {theta}"));
    }
    Ok(Some(LocalRope { theta, scaling }))
}

/// RoPE from one parameter object (`rope_parameters`, or the legacy `rope_scaling`), with
/// `theta` (the config's top-level base or its default) and the config's other top-level
/// fields as fallbacks.
fn resolve_rope_params(
    cfg: &HfConfig,
    params: Option<&Value>,
    theta: f64,
    max_positions: usize,
) -> std::result::Result<ResolvedRope, String> {
    let theta = params.and_then(|p| p.get("rope_theta")).and_then(Value::as_f64).unwrap_or(theta);
    if theta.is_nan() || theta <= 0.0 {
        return Err(format!("rope_theta must be positive, got {theta}"));
    }
    let partial_rotary_factor = params
        .and_then(|p| p.get("partial_rotary_factor"))
        .and_then(Value::as_f64)
        .or(cfg.partial_rotary_factor)
        .unwrap_or(1.0);
    if !(partial_rotary_factor > 0.0 && partial_rotary_factor <= 1.0) {
        return Err(format!(
            "partial_rotary_factor must be in (0, 1], got {partial_rotary_factor}"
        ));
    }
    let resolved = |scaling| ResolvedRope { theta, scaling, partial_rotary_factor };
    let Some(p) = params else { return Ok(resolved(RopeScaling::None)) };
    let kind =
        p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
    let num = |key: &str| -> std::result::Result<f64, String> {
        p.get(key)
            .and_then(Value::as_f64)
            .filter(|x| *x > 0.0)
            .ok_or_else(|| format!("rope scaling {kind:?} needs a positive {key}"))
    };
    let factors = |key: &str| -> std::result::Result<Vec<f64>, String> {
        let list = p
            .get(key)
            .and_then(Value::as_array)
            .ok_or_else(|| format!("rope scaling {kind:?} needs {key}, a list of numbers"))?;
        list.iter()
            .map(|x| x.as_f64().filter(|f| *f > 0.0))
            .collect::<Option<Vec<f64>>>()
            .ok_or_else(|| format!("{key} must hold positive numbers only"))
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: num("factor")? },
        "llama3" => {
            let s = RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_positions: num("original_max_position_embeddings")?,
            };
            if let RopeScaling::Llama3 { low_freq_factor, high_freq_factor, .. } = s
                && high_freq_factor <= low_freq_factor
            {
                return Err("llama3 rope scaling needs high_freq_factor > low_freq_factor".into());
            }
            s
        }
        // Phi-3 writes "su" in older configs, "longrope" in newer ones.
        "longrope" | "su" => {
            let original = p
                .get("original_max_position_embeddings")
                .and_then(Value::as_u64)
                .map(|n| n as usize)
                .or(cfg.original_max_position_embeddings)
                .filter(|&n| n > 1)
                .ok_or("longrope needs original_max_position_embeddings (more than 1)")?;
            // `_compute_longrope_parameters`: without an explicit factor, the ratio of the
            // context to the pretrained one; without an explicit attention factor,
            // sqrt(1 + ln(factor) / ln(original)), or 1 when the context is not extended.
            let factor = match p.get("factor").and_then(Value::as_f64) {
                Some(f) => f,
                None => max_positions as f64 / original as f64,
            };
            let attention_factor = match p.get("attention_factor").and_then(Value::as_f64) {
                Some(a) => a,
                None if factor <= 1.0 => 1.0,
                None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
            };
            RopeScaling::LongRope {
                short: factors("short_factor")?,
                long: factors("long_factor")?,
                original_max_positions: original,
                attention_factor,
            }
        }
        "yarn" => {
            let factor = num("factor")?;
            let original_max_positions = num("original_max_position_embeddings")?;
            let opt = |key: &str| p.get(key).and_then(Value::as_f64).filter(|x| *x != 0.0);
            // get_mscale: 0.1 · mscale · ln(scale) + 1 above a factor of 1.
            let mscale =
                |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
            let attention_factor =
                match (opt("attention_factor"), opt("mscale"), opt("mscale_all_dim")) {
                    (Some(a), _, _) => a,
                    (None, Some(m), Some(all)) => mscale(factor, m) / mscale(factor, all),
                    _ => mscale(factor, 1.0),
                };
            RopeScaling::Yarn {
                factor,
                beta_fast: opt("beta_fast").unwrap_or(32.0),
                beta_slow: opt("beta_slow").unwrap_or(1.0),
                original_max_positions,
                truncate: p.get("truncate").and_then(Value::as_bool).unwrap_or(true),
                attention_factor,
            }
        }
        other => {
            return Err(format!(
                "rope scaling {other:?} is not supported (supported: default, linear, llama3, \
                 longrope, yarn)"
            ));
        }
    };
    Ok(resolved(scaling))
}

fn resolve_windows(
    cfg: &HfConfig,
    family: Family,
    layers: usize,
) -> std::result::Result<Vec<Option<usize>>, String> {
    let window = match &cfg.sliding_window {
        None | Some(Value::Null) => None,
        // Qwen2-MoE's configs write 0 beside `use_sliding_window: false`: no window.
        Some(v) if v.as_u64() == Some(0) && cfg.use_sliding_window != Some(true) => None,
        Some(v) => Some(
            v.as_u64()
                .filter(|&w| w > 0)
                .ok_or_else(|| format!("sliding_window must be a positive integer, got {v}"))?
                as usize,
        ),
    };
    if let Some(types) = &cfg.layer_types {
        if types.len() != layers {
            return Err(format!(
                "layer_types has {} entries but num_hidden_layers is {layers}",
                types.len()
            ));
        }
        return types
            .iter()
            .map(|t| match t.as_str() {
                "full_attention" => Ok(None),
                "sliding_attention" => window.map(Some).ok_or_else(|| {
                    "a layer uses sliding_attention but sliding_window is not set".to_string()
                }),
                other => Err(format!("layer type {other:?} is not supported")),
            })
            .collect();
    }
    Ok(match family {
        Family::Llama => vec![None; layers],
        // modeling_phi3 and modeling_mixtral pass the config's sliding window (if any) to
        // every layer.
        Family::Mistral | Family::Phi3 | Family::Mixtral => vec![window; layers],
        // GptOssConfig: even layers slide, odd ones attend to everything.
        Family::GptOss => {
            let window = window.ok_or("gpt_oss needs sliding_window")?;
            (0..layers).map(|i| (i % 2 == 0).then_some(window)).collect()
        }
        Family::Qwen2 | Family::Qwen3 | Family::Qwen3Moe | Family::Qwen2Moe => {
            // modeling_qwen2: sliding only when enabled, and only from max_window_layers up.
            let from = cfg.max_window_layers.unwrap_or(layers);
            (0..layers)
                .map(
                    |i| {
                        if cfg.use_sliding_window == Some(true) && i >= from {
                            window
                        } else {
                            None
                        }
                    },
                )
                .collect()
        }
        // Gemma2Config (transformers 4): even layers slide, odd ones attend to everything.
        Family::Gemma2 => {
            let window = window.ok_or("gemma2 needs sliding_window")?;
            (0..layers).map(|i| (i % 2 == 0).then_some(window)).collect()
        }
        // Gemma3TextConfig (transformers 4): layer i slides unless (i + 1) is a multiple of
        // sliding_window_pattern (6 by default).
        Family::Gemma3 => {
            let pattern = cfg.sliding_window_pattern.unwrap_or(6).max(1);
            let window = window.ok_or("gemma3 needs sliding_window")?;
            (0..layers).map(|i| ((i + 1) % pattern != 0).then_some(window)).collect()
        }
    })
}

#[cfg(test)]
mod tests;
