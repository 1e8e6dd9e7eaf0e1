//! A Hugging Face `tokenizer.json` and `tokenizer_config.json` rebuilt from the tokenizer a
//! GGUF file embeds (`tokenizer.ggml.*` and `tokenizer.chat_template`).
//!
//! Only byte-level BPE (`tokenizer.ggml.model = "gpt2"`) is rebuilt: the vocabulary is the token
//! list (ids are positions), the merges are `tokenizer.ggml.merges` in rank order, control tokens
//! (`token_type` 3) become special added tokens and user-defined ones (4) plain added tokens.
//! The pre-tokenizer is chosen by `tokenizer.ggml.pre` to match llama.cpp's split for that name
//! (llama-vocab.cpp): `smollm`, `starcoder`, `refact` and `codeshell` isolate every digit and then
//! apply GPT-2's split, which is what SmolLM2's own `tokenizer.json` does with
//! `Digits(individual_digits)` followed by `ByteLevel(use_regex)`; `default`/`gpt2` is GPT-2's
//! split alone; `llama-bpe`/`llama3` and `qwen2` are their published split patterns.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Map, Value, json};

use crate::error::{Error, Result};
use crate::weights::gguf::MetaValue;

/// GGUF `token_type` values (llama.cpp's `llama_token_type`).
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

/// Llama 3's split pattern (tokenizer.json of Meta-Llama-3).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split pattern (tokenizer.json of Qwen2): digits one at a time.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The rebuilt tokenizer files and the special ids the model config names.
#[derive(Debug, Clone)]
pub struct GgufTokenizerFiles {
    pub tokenizer_json: Vec<u8>,
    pub tokenizer_config_json: Vec<u8>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    pub vocab_size: usize,
}

/// Rebuilds the tokenizer files from GGUF metadata; `origin` names the file in errors and
/// `model_max_length` (the context length) goes into `tokenizer_config.json`.
pub fn tokenizer_from_gguf(
    meta: &BTreeMap<String, MetaValue>,
    origin: &Path,
    model_max_length: Option<usize>,
) -> Result<GgufTokenizerFiles> {
    let err = |m: String| Error::tokenizer(origin, m);
    let model = meta.get("tokenizer.ggml.model").and_then(MetaValue::as_str);
    match model {
        Some("gpt2") => {}
        Some(other) => {
            return Err(err(format!(
                "tokenizer.ggml.model {other:?} is not supported (only byte-level BPE, \"gpt2\")"
            )));
        }
        None => return Err(err("the file has no tokenizer (tokenizer.ggml.model)".into())),
    }
    let tokens = string_array(meta, "tokenizer.ggml.tokens").map_err(err)?;
    let merges = string_array(meta, "tokenizer.ggml.merges").map_err(err)?;
    let types: Vec<i64> = match meta.get("tokenizer.ggml.token_type") {
        None => vec![1; tokens.len()],
        Some(v) => v
            .as_array()
            .ok_or_else(|| err("tokenizer.ggml.token_type is not an array".into()))?
            .iter()
            .map(|t| t.as_i64().ok_or_else(|| err(format!("token type {t:?} is not an integer"))))
            .collect::<Result<_>>()?,
    };
    if types.len() != tokens.len() {
        return Err(err(format!(
            "tokenizer.ggml.token_type has {} entries but there are {} tokens",
            types.len(),
            tokens.len()
        )));
    }
    let pre = meta.get("tokenizer.ggml.pre").and_then(MetaValue::as_str).unwrap_or("default");
    let pre_tokenizer = pre_tokenizer(pre).map_err(err)?;

    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (id, (token, &ty)) in tokens.iter().zip(&types).enumerate() {
        if vocab.insert(token.clone(), json!(id)).is_some() {
            return Err(err(format!("token {token:?} appears twice in tokenizer.ggml.tokens")));
        }
        if ty == TOKEN_CONTROL || ty == TOKEN_USER_DEFINED {
            added.push(json!({
                "id": id,
                "content": token,
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": ty != TOKEN_CONTROL,
                "special": ty == TOKEN_CONTROL,
            }));
        }
    }

    let id_of = |key: &str| -> Result<Option<u32>> {
        let Some(v) = meta.get(key) else { return Ok(None) };
        let id = v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| err(format!("{key} is not a token id: {v:?}")))?;
        if id as usize >= tokens.len() {
            return Err(err(format!("{key} = {id} is outside the {} tokens", tokens.len())));
        }
        Ok(Some(id))
    };
    let bos = id_of("tokenizer.ggml.bos_token_id")?;
    let eos = id_of("tokenizer.ggml.eos_token_id")?;
    let pad = id_of("tokenizer.ggml.padding_token_id")?;
    let unk = id_of("tokenizer.ggml.unknown_token_id")?;
    let name = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize)).cloned();
    let flag = |key: &str| meta.get(key).and_then(MetaValue::as_bool).unwrap_or(false);
    let add_bos = flag("tokenizer.ggml.add_bos_token") && bos.is_some();
    let add_eos = flag("tokenizer.ggml.add_eos_token") && eos.is_some();

    // transformers adds bos/eos through the post-processor; byte-level's own post-processor
    // only fixes offsets.
    let post_processor = if add_bos || add_eos {
        let mut single = Vec::new();
        let mut specials = Map::new();
        for (on, id) in [(add_bos, bos), (add_eos, eos)] {
            if let (true, Some(id), Some(tok)) = (on, id, name(id)) {
                specials.insert(tok.clone(), json!({"id": tok, "ids": [id], "tokens": [tok]}));
            }
        }
        if let (true, Some(tok)) = (add_bos, name(bos)) {
            single.push(json!({"SpecialToken": {"id": tok, "type_id": 0}}));
        }
        single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
        if let (true, Some(tok)) = (add_eos, name(eos)) {
            single.push(json!({"SpecialToken": {"id": tok, "type_id": 0}}));
        }
        let mut pair = single.clone();
        pair.push(json!({"Sequence": {"id": "B", "type_id": 1}}));
        json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials})
    } else {
        json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true})
    };

    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": if pre == "qwen2" { json!({"type": "NFC"}) } else { Value::Null },
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": name(unk),
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        },
    });

    let mut added_decoder = Map::new();
    for a in &added {
        if let Some(id) = a.get("id") {
            let mut entry = a.clone();
            if let Value::Object(m) = &mut entry {
                m.remove("id");
            }
            added_decoder.insert(id.to_string(), entry);
        }
    }
    let mut config = json!({
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "added_tokens_decoder": added_decoder,
        "bos_token": name(bos),
        "eos_token": name(eos),
        "pad_token": name(pad),
        "unk_token": name(unk),
        "clean_up_tokenization_spaces": false,
        "tokenizer_class": "PreTrainedTokenizerFast",
    });
    if let (Some(n), Value::Object(m)) = (model_max_length, &mut config) {
        m.insert("model_max_length".into(), json!(n));
    }
    if let Some(t) = meta.get("tokenizer.chat_template") {
        let t = t.as_str().ok_or_else(|| err("tokenizer.chat_template is not a string".into()))?;
        if let Value::Object(m) = &mut config {
            m.insert("chat_template".into(), json!(t));
        }
    }
    let to_bytes = |v: &Value| {
        serde_json::to_vec_pretty(v).map_err(|e| err(format!("cannot serialise JSON: {e}")))
    };
    Ok(GgufTokenizerFiles {
        tokenizer_json: to_bytes(&tokenizer)?,
        tokenizer_config_json: to_bytes(&config)?,
        bos_token_id: bos,
        eos_token_id: eos,
        pad_token_id: pad,
        vocab_size: tokens.len(),
    })
}

fn string_array(
    meta: &BTreeMap<String, MetaValue>,
    key: &str,
) -> std::result::Result<Vec<String>, String> {
    let v = meta.get(key).ok_or_else(|| format!("{key} is missing"))?;
    let items =
        v.as_array().ok_or_else(|| format!("{key} is a {}, not an array", v.type_name()))?;
    items
        .iter()
        .enumerate()
        .map(|(i, s)| {
            s.as_str().map(str::to_owned).ok_or_else(|| format!("{key}[{i}] is not a string"))
        })
        .collect()
}

/// The `tokenizers` pre-tokenizer matching llama.cpp's split for `pre`.
pub(crate) fn pre_tokenizer(pre: &str) -> std::result::Result<Value, String> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |pattern: &str| json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false});
    Ok(match pre {
        "default" | "gpt2" | "gpt-2" => byte_level(true),
        "smollm" | "starcoder" | "refact" | "codeshell" => json!({
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)],
        }),
        "llama-bpe" | "llama3" => json!({
            "type": "Sequence",
            "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false)],
        }),
        "qwen2" => json!({
            "type": "Sequence",
            "pretokenizers": [split(QWEN2_SPLIT), byte_level(false)],
        }),
        other => {
            return Err(format!(
                "tokenizer.ggml.pre {other:?} is not supported (supported: default, gpt2, smollm, \
                 starcoder, refact, codeshell, llama-bpe, llama3, qwen2)"
            ));
        }
    })
}
