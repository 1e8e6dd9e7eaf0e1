//! A Hugging Face checkpoint folder of a llama-family model (llama, mistral, qwen2) to one GGUF
//! file, written as llama.cpp's `convert_hf_to_gguf.py` writes it: the `<arch>.*` hyper
//! parameters, the byte-level BPE tokenizer as `tokenizer.ggml.*`, tensors under llama.cpp's
//! names, 2-D tensors in F16 or Q8_0 (a row that is not a whole number of Q8_0 blocks falls back
//! to F16, as the converter does) and 1-D tensors (norms, biases) in F32.
//!
//! Mistral is written as the `llama` architecture, as the converter does; for `llama` the q and
//! k rows are permuted from transformers' half-split RoPE layout to llama.cpp's interleaved one
//! (`LlamaModel.permute`), the exact inverse of [`super::unpermute_rows`]. `qwen2` uses the
//! half-split layout in llama.cpp too and is written unpermuted.
//!
//! Tensors are read, converted and written one at a time, so memory holds at most one tensor
//! in f32 and its encoding; the file is written under a temporary name and renamed when whole.

use std::path::Path;

use serde_json::Value;

use crate::data::Tokenizer;
use crate::data::gguf_tokenizer::pre_tokenizer;
use crate::error::{Error, Result};
use crate::model::ModelLayout;
use crate::spec::{Family, ModelSpec, RopeScaling};
use crate::weights::gguf::{
    GgmlType, MetaValue, Q8_0_BLOCK, TensorPlan, quantize_into, write_gguf,
};
use crate::weights::{TensorSource, write_file_atomically};

/// llama.cpp's `llama_token_type` values.
const TOKEN_NORMAL: i32 = 1;
const TOKEN_CONTROL: i32 = 3;
const TOKEN_USER_DEFINED: i32 = 4;
const TOKEN_UNUSED: i32 = 5;

/// gguf-py's `GGML_QUANT_VERSION`.
const QUANT_VERSION: u32 = 2;

/// The pre-tokenizer names llama.cpp knows that Sluice can recognise in a `tokenizer.json`,
/// tried in this order (the first whose split matches is written).
const PRE_NAMES: [&str; 4] = ["gpt2", "smollm", "llama-bpe", "qwen2"];

/// What the weight matrices are stored as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufType {
    F16,
    Q8_0,
}

impl GgufType {
    /// The name on the command line and in URLs.
    pub fn name(self) -> &'static str {
        match self {
            GgufType::F16 => "f16",
            GgufType::Q8_0 => "q8_0",
        }
    }

    /// `general.file_type` (llama.cpp's `LLAMA_FTYPE_MOSTLY_*`).
    fn file_type(self) -> u32 {
        match self {
            GgufType::F16 => 1,
            GgufType::Q8_0 => 7,
        }
    }
}

impl std::str::FromStr for GgufType {
    type Err = Error;

    fn from_str(s: &str) -> Result<GgufType> {
        match s.to_ascii_lowercase().as_str() {
            "f16" => Ok(GgufType::F16),
            "q8_0" => Ok(GgufType::Q8_0),
            _ => Err(Error::invalid(format!("GGUF type {s:?} is not one of f16, q8_0"))),
        }
    }
}

impl std::fmt::Display for GgufType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What an export wrote.
#[derive(Debug, Clone)]
pub struct ExportSummary {
    /// `general.architecture`.
    pub architecture: &'static str,
    pub tensors: usize,
    /// The file's size.
    pub bytes: u64,
}

/// Everything about a checkpoint the file is built from, checked before anything is written.
struct Plan {
    arch: &'static str,
    metadata: Vec<(String, MetaValue)>,
    /// (transformers name, GGUF tensor, heads of the q/k permutation).
    tensors: Vec<(String, TensorPlan, Option<usize>)>,
}

/// Writes the checkpoint folder `checkpoint` as the GGUF file `out`, matrices as `ty`.
pub fn export_gguf(checkpoint: &Path, out: &Path, ty: GgufType) -> Result<ExportSummary> {
    let source = TensorSource::open(checkpoint)?;
    let plan = plan(checkpoint, &source, ty)?;
    let gguf_tensors: Vec<TensorPlan> = plan.tensors.iter().map(|(_, t, _)| t.clone()).collect();
    // The writer speaks io::Error; an engine error met while encoding is kept whole here.
    let mut failure = None;
    let written = write_file_atomically(out, |w| {
        write_gguf(w, &plan.metadata, &gguf_tensors, |i| {
            let (hf, t, permute) = &plan.tensors[i];
            encode(&source, hf, t, *permute).map_err(|e| {
                let message = e.to_string();
                failure = Some(e);
                std::io::Error::other(message)
            })
        })
    });
    if let Some(e) = failure {
        return Err(e);
    }
    written?;
    let bytes = std::fs::metadata(out).map_err(|e| Error::io(out, e))?.len();
    Ok(ExportSummary { architecture: plan.arch, tensors: plan.tensors.len(), bytes })
}

fn encode(
    source: &TensorSource,
    hf: &str,
    t: &TensorPlan,
    permute_heads: Option<usize>,
) -> Result<Vec<u8>> {
    let mut data = source.read_f32(hf)?;
    if let Some(heads) = permute_heads {
        let cols = if t.shape.len() == 2 { t.shape[1] } else { 1 };
        data = permute_rows(&data, heads, cols)?;
    }
    let mut bytes = Vec::with_capacity(t.bytes());
    quantize_into(t.ggml_type, &data, &mut bytes)
        .map_err(|m| Error::weights(source.path(), format!("tensor {hf}: {m}")))?;
    Ok(bytes)
}

/// convert_hf_to_gguf.py's `LlamaModel.permute`: within each head, transformers row
/// `s · hd/2 + i` becomes GGUF row `2i + s`. data `[heads · hd, cols]`.
pub fn permute_rows(data: &[f32], heads: usize, cols: usize) -> Result<Vec<f32>> {
    let rows = data.len().checked_div(cols).unwrap_or(0);
    if heads == 0 || cols == 0 || rows * cols != data.len() || !rows.is_multiple_of(2 * heads) {
        return Err(Error::invalid(format!(
            "cannot permute {} values as {heads} heads of rows of {cols}",
            data.len()
        )));
    }
    let hd = rows / heads;
    let half = hd / 2;
    let mut out = vec![0.0f32; data.len()];
    for h in 0..heads {
        for i in 0..half {
            for s in 0..2 {
                let dst = (h * hd + 2 * i + s) * cols;
                let src = (h * hd + s * half + i) * cols;
                out[dst..dst + cols].copy_from_slice(&data[src..src + cols]);
            }
        }
    }
    Ok(out)
}

fn plan(dir: &Path, source: &TensorSource, ty: GgufType) -> Result<Plan> {
    let spec = ModelSpec::from_path(dir)?;
    let err = |m: String| Error::config(dir, m);
    let arch = match spec.family {
        Family::Llama | Family::Mistral => "llama",
        Family::Qwen2 => "qwen2",
        Family::Qwen3
        | Family::Phi3
        | Family::Gemma2
        | Family::Gemma3
        | Family::Mixtral
        | Family::Qwen3Moe
        | Family::Qwen2Moe
        | Family::GptOss => {
            return Err(err(format!(
                "GGUF export supports llama, mistral and qwen2 checkpoints, not {}",
                spec.family.model_type()
            )));
        }
    };
    if spec.qk_norm || spec.o_bias {
        return Err(err("GGUF export does not write q/k norms or an o_proj bias".into()));
    }
    let mut metadata = Vec::new();
    let mut put = |k: &str, v: MetaValue| metadata.push((k.to_string(), v));
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
    put("general.architecture", MetaValue::String(arch.into()));
    put("general.type", MetaValue::String("model".into()));
    put("general.name", MetaValue::String(name.unwrap_or_else(|| "model".into())));
    let u32_of = |what: &str, n: usize| {
        u32::try_from(n).map(MetaValue::U32).map_err(|_| err(format!("{what} {n} is too large")))
    };
    let a = |key: &str| format!("{arch}.{key}");
    put(&a("vocab_size"), u32_of("vocabulary", spec.vocab)?);
    put(&a("context_length"), u32_of("context", spec.max_positions)?);
    put(&a("embedding_length"), u32_of("hidden size", spec.hidden)?);
    put(&a("block_count"), u32_of("layer count", spec.layers)?);
    put(&a("feed_forward_length"), u32_of("intermediate size", spec.intermediate)?);
    put(&a("rope.dimension_count"), u32_of("head size", spec.head_dim)?);
    put(&a("attention.head_count"), u32_of("head count", spec.q_heads)?);
    put(&a("attention.head_count_kv"), u32_of("kv head count", spec.kv_heads)?);
    put(&a("attention.key_length"), u32_of("head size", spec.head_dim)?);
    put(&a("attention.value_length"), u32_of("head size", spec.head_dim)?);
    put(&a("rope.freq_base"), MetaValue::F32(spec.rope_theta as f32));
    put(&a("attention.layer_norm_rms_epsilon"), MetaValue::F32(spec.rms_eps));
    if spec.rotary_dim != spec.head_dim {
        return Err(err("GGUF export does not write partial rotary embeddings".into()));
    }
    match &spec.rope_scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => {
            put(&a("rope.scaling.type"), MetaValue::String("linear".into()));
            put(&a("rope.scaling.factor"), MetaValue::F32(*factor as f32));
        }
        RopeScaling::Llama3 { .. } | RopeScaling::LongRope { .. } | RopeScaling::Yarn { .. } => {
            return Err(err(
                "GGUF export does not write rope frequency factors (Llama 3.1, longrope, yarn) yet"
                    .into(),
            ));
        }
    }
    put("general.file_type", MetaValue::U32(ty.file_type()));
    put("general.quantization_version", MetaValue::U32(QUANT_VERSION));
    for (k, v) in tokenizer_metadata(dir, spec.vocab)? {
        put(&k, v);
    }

    let layout = ModelLayout::new(&spec);
    let mut tensors = Vec::new();
    for (_, slot) in layout.tensors() {
        let (gguf, permute) = gguf_name(&slot.name, &spec, arch)
            .ok_or_else(|| err(format!("tensor {} has no llama.cpp name", slot.name)))?;
        let stored = source.shape(&slot.name)?;
        if stored != slot.shape {
            return Err(Error::weights(
                source.path(),
                format!(
                    "tensor {} has shape {stored:?} but config.json implies {:?}",
                    slot.name, slot.shape
                ),
            ));
        }
        let ggml_type = match (slot.shape.as_slice(), ty) {
            ([_], _) => GgmlType::F32,
            ([.., row], GgufType::Q8_0) if row % Q8_0_BLOCK == 0 => GgmlType::Q8_0,
            _ => GgmlType::F16,
        };
        tensors.push((
            slot.name.clone(),
            TensorPlan { name: gguf, shape: slot.shape.clone(), ggml_type },
            permute,
        ));
    }
    Ok(Plan { arch, metadata, tensors })
}

/// llama.cpp's name of a transformers tensor (`TensorNameMap` in gguf-py), and for `llama`
/// the heads of the q/k row permutation.
fn gguf_name(hf: &str, spec: &ModelSpec, arch: &str) -> Option<(String, Option<usize>)> {
    match hf {
        "model.embed_tokens.weight" => return Some(("token_embd.weight".into(), None)),
        "model.norm.weight" => return Some(("output_norm.weight".into(), None)),
        "lm_head.weight" => return Some(("output.weight".into(), None)),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (stem, suffix) = part.rsplit_once('.')?;
    let permuted = |heads| (arch == "llama").then_some(heads);
    let (name, permute) = match stem {
        "input_layernorm" => ("attn_norm", None),
        "self_attn.q_proj" => ("attn_q", permuted(spec.q_heads)),
        "self_attn.k_proj" => ("attn_k", permuted(spec.kv_heads)),
        "self_attn.v_proj" => ("attn_v", None),
        "self_attn.o_proj" => ("attn_output", None),
        "post_attention_layernorm" => ("ffn_norm", None),
        "mlp.gate_proj" => ("ffn_gate", None),
        "mlp.up_proj" => ("ffn_up", None),
        "mlp.down_proj" => ("ffn_down", None),
        _ => return None,
    };
    Some((format!("blk.{layer}.{name}.{suffix}"), permute))
}

/// `tokenizer.ggml.*` and `tokenizer.chat_template` from the folder's `tokenizer.json`
/// (byte-level BPE only: GGUF's `gpt2` model), padded with unused tokens to the embedding's
/// `vocab` rows as the converter pads.
fn tokenizer_metadata(dir: &Path, vocab: usize) -> Result<Vec<(String, MetaValue)>> {
    let path = dir.join("tokenizer.json");
    let err = |m: String| Error::tokenizer(&path, m);
    let text = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
    let json: Value =
        serde_json::from_slice(&text).map_err(|e| err(format!("not valid JSON: {e}")))?;
    let model = &json["model"];
    if model["type"].as_str() != Some("BPE") || model["byte_fallback"].as_bool() == Some(true) {
        return Err(err(
            "GGUF export writes byte-level BPE tokenizers only (llama.cpp's \"gpt2\" model)".into(),
        ));
    }
    let pre = PRE_NAMES
        .into_iter()
        .find(|name| {
            pre_tokenizer(name)
                .is_ok_and(|v| split_signature(&v) == split_signature(&json["pre_tokenizer"]))
        })
        .ok_or_else(|| {
            err(format!(
                "the pre-tokenizer {} matches none that llama.cpp names (Sluice recognises {})",
                json["pre_tokenizer"],
                PRE_NAMES.join(", ")
            ))
        })?;

    let mut tokens: Vec<Option<(String, i32)>> = vec![None; vocab];
    let mut place = |id: &Value, token: &str, ty: i32| -> Result<()> {
        let slot = id.as_u64().and_then(|i| tokens.get_mut(i as usize)).ok_or_else(|| {
            err(format!("token {token:?} has id {id}, outside the {vocab} rows of the embedding"))
        })?;
        *slot = Some((token.to_string(), ty));
        Ok(())
    };
    let entries =
        model["vocab"].as_object().ok_or_else(|| err("model.vocab is not an object".into()))?;
    for (token, id) in entries {
        place(id, token, TOKEN_NORMAL)?;
    }
    for added in json["added_tokens"].as_array().into_iter().flatten() {
        let token = added["content"]
            .as_str()
            .ok_or_else(|| err(format!("added token {added} has no content")))?;
        let ty = if added["special"].as_bool() == Some(true) {
            TOKEN_CONTROL
        } else {
            TOKEN_USER_DEFINED
        };
        place(&added["id"], token, ty)?;
    }
    let (mut names, mut types) = (Vec::with_capacity(vocab), Vec::with_capacity(vocab));
    for (id, entry) in tokens.into_iter().enumerate() {
        let (token, ty) = entry.unwrap_or_else(|| (format!("[PAD{id}]"), TOKEN_UNUSED));
        names.push(MetaValue::String(token));
        types.push(MetaValue::I32(ty));
    }
    let merges = model["merges"]
        .as_array()
        .ok_or_else(|| err("model.merges is not an array".into()))?
        .iter()
        .map(|m| match m {
            Value::String(s) => Ok(MetaValue::String(s.clone())),
            Value::Array(pair) => match pair.as_slice() {
                [Value::String(a), Value::String(b)] => Ok(MetaValue::String(format!("{a} {b}"))),
                _ => Err(err(format!("merge {m} is not two tokens"))),
            },
            _ => Err(err(format!("merge {m} is not two tokens"))),
        })
        .collect::<Result<Vec<_>>>()?;

    let mut out = vec![
        ("tokenizer.ggml.model".to_string(), MetaValue::String("gpt2".into())),
        ("tokenizer.ggml.pre".to_string(), MetaValue::String(pre.into())),
        ("tokenizer.ggml.tokens".to_string(), MetaValue::Array(names)),
        ("tokenizer.ggml.token_type".to_string(), MetaValue::Array(types)),
        ("tokenizer.ggml.merges".to_string(), MetaValue::Array(merges)),
    ];
    // Special tokens as Sluice resolves them (tokenizer_config.json, then the other files).
    let tokenizer = Tokenizer::from_dir(dir)?;
    let id = |t: Option<&str>| t.and_then(|t| tokenizer.token_to_id(t));
    let bos = id(tokenizer.bos_token());
    for (key, value) in [
        ("tokenizer.ggml.bos_token_id", bos),
        ("tokenizer.ggml.eos_token_id", tokenizer.eos_token_id()),
        ("tokenizer.ggml.unknown_token_id", id(tokenizer.unk_token())),
        ("tokenizer.ggml.padding_token_id", id(tokenizer.pad_token())),
    ] {
        if let Some(v) = value {
            out.push((key.to_string(), MetaValue::U32(v)));
        }
    }
    if bos.is_some() {
        out.push(("tokenizer.ggml.add_bos_token".into(), MetaValue::Bool(adds_bos(dir, &json)?)));
    }
    if let Some(t) = tokenizer.chat_template() {
        out.push(("tokenizer.chat_template".into(), MetaValue::String(t.to_string())));
    }
    Ok(out)
}

/// Whether encoding prepends bos: `add_bos_token` in `tokenizer_config.json`, else a
/// `TemplateProcessing` post-processor that starts with a special token (Llama 3's way).
fn adds_bos(dir: &Path, tokenizer: &Value) -> Result<bool> {
    let path = dir.join("tokenizer_config.json");
    if let Ok(text) = std::fs::read(&path) {
        let config: Value = serde_json::from_slice(&text)
            .map_err(|e| Error::tokenizer(&path, format!("not valid JSON: {e}")))?;
        if let Some(b) = config["add_bos_token"].as_bool() {
            return Ok(b);
        }
    }
    let post = &tokenizer["post_processor"];
    let template = std::iter::once(post)
        .chain(post["processors"].as_array().into_iter().flatten())
        .find(|p| p["type"] == "TemplateProcessing");
    Ok(template.is_some_and(|t| t["single"][0].get("SpecialToken").is_some()))
}

/// What a pre-tokenizer does to text, without the fields that do not change the split
/// (offset trimming): one entry per step of a `Sequence`.
fn split_signature(pre: &Value) -> Vec<String> {
    let steps: Vec<&Value> = match pre["type"].as_str() {
        Some("Sequence") => pre["pretokenizers"].as_array().into_iter().flatten().collect(),
        _ => vec![pre],
    };
    steps
        .into_iter()
        .map(|s| match s["type"].as_str() {
            Some("ByteLevel") => format!(
                "bytelevel prefix={} regex={}",
                s["add_prefix_space"].as_bool().unwrap_or(true),
                s["use_regex"].as_bool().unwrap_or(true)
            ),
            Some("Digits") => {
                format!("digits individual={}", s["individual_digits"].as_bool().unwrap_or(false))
            }
            Some("Split") => format!(
                "split {} {} invert={}",
                s["pattern"],
                s["behavior"],
                s["invert"].as_bool().unwrap_or(false)
            ),
            _ => s.to_string(),
        })
        .collect()
}
