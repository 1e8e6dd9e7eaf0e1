//! A llama-architecture GGUF file to an ordinary Hugging Face folder: `config.json` from the
//! `llama.*` metadata, every tensor dequantised to f32 under its transformers name (with
//! llama.cpp's row permutation of the q and k projections undone), and the tokenizer files
//! rebuilt from the embedded vocabulary.

use std::collections::HashSet;
use std::path::Path;

use serde_json::{Value, json};

use crate::data::gguf_tokenizer::{GgufTokenizerFiles, tokenizer_from_gguf};
use crate::error::{Error, Result};
use crate::model::HostParams;
use crate::spec::ModelSpec;
use crate::weights::gguf::{GgufFile, MetaValue, TensorInfo};
use crate::weights::{DEFAULT_MAX_SHARD_BYTES, HfFolder, SaveDtype, save_hf_folder};

/// What an import produced.
#[derive(Debug, Clone)]
pub struct ImportSummary {
    pub spec: ModelSpec,
    /// GGUF tensor count by ggml type name, e.g. `("Q4_1", 210)`.
    pub tensor_types: Vec<(String, usize)>,
    pub vocab_size: usize,
}

/// Reads `gguf` and writes the Hugging Face folder `out` (f32 weights, `config.json`,
/// `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`).
pub fn import_gguf(gguf: &Path, out: &Path) -> Result<ImportSummary> {
    let file = GgufFile::open(gguf)?;
    let (spec, params, tokenizer) = convert(&file)?;
    let mut generation = serde_json::Map::new();
    if let Some(id) = tokenizer.bos_token_id {
        generation.insert("bos_token_id".into(), json!(id));
    }
    if let Some(id) = tokenizer.eos_token_id {
        generation.insert("eos_token_id".into(), json!(id));
    }
    if let Some(id) = tokenizer.pad_token_id {
        generation.insert("pad_token_id".into(), json!(id));
    }
    let generation = serde_json::to_vec_pretty(&Value::Object(generation))
        .map_err(|e| Error::invalid(format!("cannot serialise generation_config.json: {e}")))?;
    save_hf_folder(
        out,
        &HfFolder {
            tensors: params.tensor_refs(),
            dtype: SaveDtype::F32,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            config: spec.to_hf_config(),
            extra_files: vec![
                ("tokenizer.json".into(), tokenizer.tokenizer_json.clone()),
                ("tokenizer_config.json".into(), tokenizer.tokenizer_config_json.clone()),
                ("generation_config.json".into(), generation),
            ],
        },
    )?;
    let mut counts: Vec<(String, usize)> = Vec::new();
    for t in &file.tensors {
        match counts.iter_mut().find(|(n, _)| n == t.ggml_type.name()) {
            Some((_, c)) => *c += 1,
            None => counts.push((t.ggml_type.name().to_string(), 1)),
        }
    }
    Ok(ImportSummary { spec, tensor_types: counts, vocab_size: tokenizer.vocab_size })
}

/// The model spec, dequantised weights and rebuilt tokenizer of an open GGUF file.
pub fn convert(file: &GgufFile) -> Result<(ModelSpec, HostParams, GgufTokenizerFiles)> {
    let config = hf_config(file)?;
    let context = config.get("max_position_embeddings").and_then(Value::as_u64);
    let tokenizer = tokenizer_from_gguf(&file.metadata, file.path(), context.map(|c| c as usize))?;
    let config = with_token_ids(config, &tokenizer);
    let spec = ModelSpec::from_hf(config, file.path())?;
    if tokenizer.vocab_size != spec.vocab {
        return Err(Error::weights(
            file.path(),
            format!(
                "the tokenizer has {} tokens but the embedding has {} rows",
                tokenizer.vocab_size, spec.vocab
            ),
        ));
    }
    let params = load_params(file, &spec)?;
    Ok((spec, params, tokenizer))
}

fn with_token_ids(mut config: Value, tok: &GgufTokenizerFiles) -> Value {
    if let Value::Object(m) = &mut config {
        m.insert("bos_token_id".into(), json!(tok.bos_token_id));
        m.insert("eos_token_id".into(), json!(tok.eos_token_id));
        m.insert("pad_token_id".into(), json!(tok.pad_token_id));
    }
    config
}

/// `config.json` for transformers' `LlamaForCausalLM` from the `llama.*` metadata. Token ids are
/// added by the caller from the tokenizer metadata.
pub fn hf_config(file: &GgufFile) -> Result<Value> {
    let err = |m: String| Error::weights(file.path(), m);
    let arch = file.get("general.architecture").and_then(MetaValue::as_str);
    match arch {
        Some("llama") => {}
        Some(other) => {
            return Err(err(format!(
                "architecture {other:?} is not supported for GGUF import (only \"llama\")"
            )));
        }
        None => return Err(err("no general.architecture in the metadata".into())),
    }
    let int = |key: &str| -> Result<Option<u64>> {
        match file.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| err(format!("{key} is not a non-negative integer: {v:?}"))),
        }
    };
    let need = |key: &str| -> Result<u64> {
        int(key)?.ok_or_else(|| err(format!("metadata {key} is missing")))
    };
    let float = |key: &str| -> Result<Option<f64>> {
        match file.get(key) {
            None => Ok(None),
            // An f32 written as its shortest decimal: 1e-5, not 9.999999747378752e-6.
            Some(MetaValue::F32(v)) => Ok(format!("{v}").parse::<f64>().ok()),
            Some(v) => {
                v.as_f64().map(Some).ok_or_else(|| err(format!("{key} is not a number: {v:?}")))
            }
        }
    };
    let hidden = need("llama.embedding_length")?;
    let heads = need("llama.attention.head_count")?;
    let kv_heads = int("llama.attention.head_count_kv")?.unwrap_or(heads);
    let embed = file
        .tensor("token_embd.weight")
        .ok_or_else(|| err("tensor token_embd.weight is missing".into()))?;
    let vocab = match embed.shape().as_slice() {
        [v, h] if *h as u64 == hidden => *v as u64,
        other => {
            return Err(err(format!(
                "token_embd.weight has shape {other:?}, expected [vocab, {hidden}]"
            )));
        }
    };
    if file.tensor("rope_freqs.weight").is_some() {
        return Err(err(
            "the file has rope_freqs.weight (Llama 3.1 rope frequency factors), which GGUF \
             import does not support yet"
                .into(),
        ));
    }
    let theta = float("llama.rope.freq_base")?.unwrap_or(10_000.0);
    let mut rope = json!({"rope_type": "default", "rope_theta": theta});
    match file.get("llama.rope.scaling.type").and_then(MetaValue::as_str) {
        None | Some("none") => {}
        Some("linear") => {
            let factor = float("llama.rope.scaling.factor")?.ok_or_else(|| {
                err("linear rope scaling without llama.rope.scaling.factor".into())
            })?;
            rope = json!({"rope_type": "linear", "rope_theta": theta, "factor": factor});
        }
        Some(other) => {
            return Err(err(format!("rope scaling {other:?} is not supported (only linear)")));
        }
    }
    // Every size below must be justified by the tensor table (whose extents the reader already
    // bounded by the file's length), so a damaged header is refused before anything is sized
    // by it: no count exceeds the tensors' elements, and there are no more layers than tensors.
    let elements: u64 =
        file.tensors.iter().map(|t| t.shape().iter().product::<usize>() as u64).sum();
    let intermediate = need("llama.feed_forward_length")?;
    let layers = need("llama.block_count")?;
    let key_length = int("llama.attention.key_length")?;
    let bounded = |key: &str, value: u64, limit: u64, what: &str| -> Result<()> {
        if value > limit {
            return Err(err(format!(
                "metadata {key} = {value} is more than the file holds ({what}: {limit})"
            )));
        }
        Ok(())
    };
    bounded("llama.block_count", layers, file.tensors.len() as u64, "tensors")?;
    bounded("llama.attention.head_count", heads, hidden, "llama.embedding_length")?;
    bounded("llama.attention.head_count_kv", kv_heads, heads, "llama.attention.head_count")?;
    // hidden, heads >= 1 here: `need` refuses zeros only later, in ModelSpec, so guard the divisions.
    let per_row = elements / hidden.max(1);
    bounded("llama.feed_forward_length", intermediate, per_row, "elements per hidden row")?;
    if let Some(k) = key_length {
        bounded("llama.attention.key_length", k, per_row / heads.max(1), "elements per head")?;
    }
    let mut config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": int("llama.context_length")?.unwrap_or(2048),
        "rms_norm_eps": float("llama.attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5),
        "rope_parameters": rope,
        "hidden_act": "silu",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "initializer_range": 0.02,
        "use_cache": true,
        "tie_word_embeddings": file.tensor("output.weight").is_none(),
    });
    if let (Some(k), Value::Object(m)) = (key_length, &mut config) {
        m.insert("head_dim".into(), json!(k));
    }
    Ok(config)
}

/// How a GGUF tensor maps to a transformers tensor.
#[derive(Debug, Clone, PartialEq)]
struct Mapped {
    hf: String,
    /// Heads of llama.cpp's q/k row permutation to undo.
    unpermute_heads: Option<usize>,
}

fn map_name(gguf: &str, spec: &ModelSpec) -> Option<Mapped> {
    let plain = |hf: &str| Some(Mapped { hf: hf.to_string(), unpermute_heads: None });
    match gguf {
        "token_embd.weight" => return plain("model.embed_tokens.weight"),
        "output_norm.weight" => return plain("model.norm.weight"),
        "output.weight" => return plain("lm_head.weight"),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (hf, heads) = match part {
        "attn_norm.weight" => ("input_layernorm.weight", None),
        "attn_q.weight" => ("self_attn.q_proj.weight", Some(spec.q_heads)),
        "attn_k.weight" => ("self_attn.k_proj.weight", Some(spec.kv_heads)),
        "attn_v.weight" => ("self_attn.v_proj.weight", None),
        "attn_output.weight" => ("self_attn.o_proj.weight", None),
        "ffn_norm.weight" => ("post_attention_layernorm.weight", None),
        "ffn_gate.weight" => ("mlp.gate_proj.weight", None),
        "ffn_up.weight" => ("mlp.up_proj.weight", None),
        "ffn_down.weight" => ("mlp.down_proj.weight", None),
        _ => return None,
    };
    Some(Mapped { hf: format!("model.layers.{layer}.{hf}"), unpermute_heads: heads })
}

/// Undoes convert_hf_to_gguf.py's `permute` for llama q/k weights, which reorders each head's
/// rows from transformers' half-split RoPE layout (`rotate_half`: row `i` pairs with
/// `i + hd/2`) to llama.cpp's interleaved one (row `2i` pairs with `2i + 1`): within a head,
/// GGUF row `2i + s` is transformers row `s · hd/2 + i`. data `[heads · hd, cols]`.
pub fn unpermute_rows(data: &[f32], heads: usize, cols: usize) -> Result<Vec<f32>> {
    let rows = data.len().checked_div(cols).unwrap_or(0);
    if heads == 0 || cols == 0 || rows * cols != data.len() || !rows.is_multiple_of(2 * heads) {
        return Err(Error::invalid(format!(
            "cannot unpermute {} values as {heads} heads of rows of {cols}",
            data.len()
        )));
    }
    let hd = rows / heads;
    let half = hd / 2;
    let mut out = vec![0.0f32; data.len()];
    for h in 0..heads {
        for i in 0..half {
            for s in 0..2 {
                let src = (h * hd + 2 * i + s) * cols;
                let dst = (h * hd + s * half + i) * cols;
                out[dst..dst + cols].copy_from_slice(&data[src..src + cols]);
            }
        }
    }
    Ok(out)
}

fn load_params(file: &GgufFile, spec: &ModelSpec) -> Result<HostParams> {
    let err = |m: String| Error::weights(file.path(), m);
    let layout = std::sync::Arc::new(crate::model::ModelLayout::new(spec));
    // Every tensor is matched and its shape checked before the slabs are allocated, so their
    // size is one the file's own tensors justify.
    let mut placed = Vec::with_capacity(file.tensors.len());
    let mut filled = HashSet::new();
    for info in &file.tensors {
        let mapped = map_name(&info.name, spec).ok_or_else(|| {
            err(format!("tensor {} has no transformers llama counterpart", info.name))
        })?;
        let Some((unit, slot)) = layout.tensors().find(|(_, t)| t.name == mapped.hf) else {
            return Err(err(format!(
                "tensor {} ({}) does not belong to a model with this config (layers: {})",
                info.name, mapped.hf, spec.layers
            )));
        };
        let shape = info.shape();
        if shape != slot.shape {
            return Err(err(format!(
                "tensor {} has shape {:?} but the metadata implies {:?} for {}",
                info.name, shape, slot.shape, slot.name
            )));
        }
        if !filled.insert(mapped.hf.clone()) {
            return Err(err(format!("two tensors map to {}", mapped.hf)));
        }
        placed.push((info, mapped, unit, slot.range.clone(), shape.last().copied().unwrap_or(1)));
    }
    if let Some((_, missing)) = layout.tensors().find(|(_, t)| !filled.contains(&t.name)) {
        return Err(err(format!("no tensor for {} in the file", missing.name)));
    }
    let mut params = HostParams::zeros(layout);
    for (info, mapped, unit, range, cols) in placed {
        let data = dequantized(file, info, &mapped, cols)?;
        params.units[unit][range].copy_from_slice(&data);
    }
    Ok(params)
}

fn dequantized(
    file: &GgufFile,
    info: &TensorInfo,
    mapped: &Mapped,
    cols: usize,
) -> Result<Vec<f32>> {
    let data = file.tensor_f32(info)?;
    match mapped.unpermute_heads {
        Some(heads) => unpermute_rows(&data, heads, cols)
            .map_err(|e| Error::weights(file.path(), format!("tensor {}: {e}", info.name))),
        None => Ok(data),
    }
}
