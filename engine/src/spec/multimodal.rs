//! Multimodal model folders whose text model Sluice trains.
//!
//! Gemma 3's 4B, 12B and 27B releases are `Gemma3ForConditionalGeneration` folders (model_type
//! `gemma3`): the text model's `gemma3_text` config sits under `text_config`, beside a vision
//! tower's (`vision_config`) and the image token settings. Sluice resolves the text model as it
//! would a `Gemma3ForCausalLM` folder and records the wrapper ([`Multimodal`]), so that a
//! checkpoint is written back as the wrapper, its vision tower and projector copied through
//! untouched (`weights::Passthrough`). Other multimodal families are refused by name.

use serde_json::{Map, Value, json};

use super::Family;

/// A multimodal wrapper whose text model Sluice trains.
struct Wrapper {
    /// The wrapper's `model_type`.
    model_type: &'static str,
    /// The class transformers loads it as.
    architecture: &'static str,
    /// The family of the text model under `text_config`.
    text: Family,
}

const WRAPPERS: [Wrapper; 1] = [Wrapper {
    model_type: "gemma3",
    architecture: "Gemma3ForConditionalGeneration",
    text: Family::Gemma3,
}];

/// Token ids a composite config keeps at its top level: the text model inherits them where its
/// `text_config` leaves them out (Gemma 3's hub configs put `eos_token_id: [1, 106]` there).
const INHERITED: [&str; 3] = ["bos_token_id", "eos_token_id", "pad_token_id"];

/// A model read from a multimodal folder: what a checkpoint needs to be written back as that
/// folder's class.
#[derive(Debug, Clone, PartialEq)]
pub struct Multimodal {
    /// The wrapper's `model_type` (`gemma3`).
    pub model_type: &'static str,
    /// The class transformers loads it as (`Gemma3ForConditionalGeneration`).
    pub architecture: &'static str,
    /// The wrapper's `config.json` as read: `text_config`, `vision_config` and the rest
    /// untouched.
    pub config: Value,
}

/// The text model's config inside a wrapper config, and the wrapper; `Ok(None)` when `raw` is
/// not a wrapper Sluice knows. The text config is `text_config` as written, with the
/// `model_type` it implies, the token ids it inherits from the top level, the top level's
/// `tie_word_embeddings` (transformers 5 ties `lm_head` to the embedding by the wrapper's own
/// flag, `Gemma3Config.tie_word_embeddings`, default true), and no soft-capped logits.
pub(super) fn unwrap_text(raw: &Value) -> Result<Option<(Value, Multimodal)>, String> {
    let model_type = raw.get("model_type").and_then(Value::as_str);
    let Some(wrapper) = WRAPPERS.iter().find(|w| Some(w.model_type) == model_type) else {
        return Ok(None);
    };
    let (name, arch) = (wrapper.model_type, wrapper.architecture);
    if let Some(other) = architectures(raw).into_iter().find(|a| *a != arch) {
        return Err(format!(
            "architecture {other:?} of model_type {name:?} is not supported: of {name} folders \
             Sluice trains {arch}'s text model"
        ));
    }
    let Some(Value::Object(text_config)) = raw.get("text_config") else {
        return Err(format!(
            "a {name} ({arch}) config needs text_config, the text model's config, as an object"
        ));
    };
    let text_type = wrapper.text.model_type();
    let mut text = text_config.clone();
    match text.get("model_type") {
        None => {
            text.insert("model_type".into(), json!(text_type));
        }
        Some(t) if t.as_str() == Some(text_type) => {}
        Some(t) => {
            return Err(format!(
                "text_config.model_type of a {name} config must be {text_type:?}, got {t}"
            ));
        }
    }
    for key in INHERITED {
        if let (false, Some(v)) = (text.contains_key(key), raw.get(key)) {
            text.insert(key.into(), v.clone());
        }
    }
    let tie = raw.get("tie_word_embeddings").cloned().unwrap_or(json!(true));
    text.insert("tie_word_embeddings".into(), tie);
    // Gemma3ForConditionalGeneration.forward returns lm_head's logits as they are, whatever
    // text_config's final_logit_softcapping (modeling_gemma3.py, transformers 5.25): the model
    // trained is the one that class runs.
    text.insert("final_logit_softcapping".into(), Value::Null);
    let multimodal = Multimodal { model_type: name, architecture: arch, config: raw.clone() };
    Ok(Some((Value::Object(text), multimodal)))
}

/// Why a config of an unsupported `model_type` is refused when it is a multimodal one (it has a
/// `text_config`, a `vision_config` or an `audio_config`, or a `...ForConditionalGeneration`
/// class); `None` for any other config.
pub(super) fn unsupported(raw: &Value, model_type: &str) -> Option<String> {
    let parts = ["text_config", "vision_config", "audio_config"];
    let archs = architectures(raw);
    let composite = parts.iter().any(|k| raw.get(k).is_some_and(Value::is_object))
        || archs.iter().any(|a| a.ends_with("ForConditionalGeneration"));
    if !composite {
        return None;
    }
    let class = archs.first().map(|a| format!(" ({a})")).unwrap_or_default();
    let accepted: Vec<String> =
        WRAPPERS.iter().map(|w| format!("{} ({})", w.model_type, w.architecture)).collect();
    Some(format!(
        "multimodal model_type {model_type:?}{class} is not supported; of multimodal folders \
         Sluice trains only the text model of {}",
        accepted.join(", ")
    ))
}

/// The class names a config lists (`architectures`), or none.
fn architectures(raw: &Value) -> Vec<&str> {
    raw.get("architectures")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// `raw` with `defaults` filled in where a key is absent (an explicit null stays null).
pub(super) fn with_defaults(raw: &Value, defaults: &[(&str, Value)]) -> Value {
    let mut map = match raw {
        Value::Object(map) => map.clone(),
        _ => Map::new(),
    };
    for (key, value) in defaults {
        map.entry(*key).or_insert_with(|| value.clone());
    }
    Value::Object(map)
}

/// `Gemma3TextConfig`'s defaults (transformers 5.25, configuration_gemma3.py) for the fields
/// Sluice reads, which a `text_config` of a hub folder mostly leaves out (the 4B's names its
/// sizes and its window, and takes its heads, vocabulary and head size from here). Its RoPE
/// bases (1e6 for the global layers, 1e4 for the local ones) are `resolve_rope`'s.
pub(super) fn gemma3_text_defaults() -> [(&'static str, Value); 14] {
    [
        ("vocab_size", json!(262_208)),
        ("hidden_size", json!(2304)),
        ("intermediate_size", json!(9216)),
        ("num_hidden_layers", json!(26)),
        ("num_attention_heads", json!(8)),
        ("num_key_value_heads", json!(4)),
        ("head_dim", json!(256)),
        ("max_position_embeddings", json!(131_072)),
        ("rms_norm_eps", json!(1e-6)),
        ("query_pre_attn_scalar", json!(256)),
        ("sliding_window", json!(4096)),
        ("pad_token_id", json!(0)),
        ("eos_token_id", json!(1)),
        ("bos_token_id", json!(2)),
    ]
}
