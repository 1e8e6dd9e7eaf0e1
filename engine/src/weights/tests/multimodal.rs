//! A multimodal checkpoint's text model through `TensorSource` (served under the text model's
//! own names, from either prefix) and `Passthrough` (written back under the names read, the
//! other tensors copied through byte for byte).

use std::fs;

use serde_json::json;

use super::*;
use crate::weights::{
    CONFIG_FILE, HfFolder, INDEX_FILE, Passthrough, SINGLE_FILE, SaveDtype, TensorData,
    TensorSource, TextPrefix, write_safetensors,
};

/// The text model's names of a tiny model (tied: no head), as the layout names them.
const TEXT: [&str; 3] =
    ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "model.norm.weight"];

/// A tensor the text model does not read: its name, dtype and stored bytes.
type Other = (String, Dtype, Vec<u8>);

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A multimodal checkpoint: the text tensors under `prefix`, a bf16 vision weight, an i64
/// position table and an f32 projector, as the safetensors crate writes them.
fn wrapped_file(dir: &Path, prefix: TextPrefix) -> Result<Vec<Other>, Box<dyn std::error::Error>> {
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = TEXT
        .iter()
        .enumerate()
        .map(|(i, name)| {
            (prefix.stored(name), Dtype::F32, vec![2, 3], f32_bytes(&values(6, i as u32)))
        })
        .collect();
    let vision = match prefix {
        TextPrefix::LanguageModel => "vision_tower.vision_model",
        TextPrefix::ModelLanguageModel => "model.vision_tower.vision_model",
    };
    let projector = match prefix {
        TextPrefix::LanguageModel => "multi_modal_projector",
        TextPrefix::ModelLanguageModel => "model.multi_modal_projector",
    };
    let bf16: Vec<u8> = (0u16..10).flat_map(|i| (0x3f80 + 7 * i).to_le_bytes()).collect();
    let ids: Vec<u8> = (0i64..4).flat_map(|i| (i * 1_000_000_007).to_le_bytes()).collect();
    let others = vec![
        (format!("{vision}.encoder.layers.0.mlp.fc1.weight"), Dtype::BF16, vec![2, 5], bf16),
        (format!("{vision}.embeddings.position_ids"), Dtype::I64, vec![1, 4], ids),
        (
            format!("{projector}.mm_input_projection_weight"),
            Dtype::F32,
            vec![3],
            f32_bytes(&values(3, 9)),
        ),
    ];
    tensors.extend(others.iter().cloned());
    let views: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)> =
        tensors.iter().map(|(n, d, s, b)| (n.as_str(), *d, s.clone(), b.clone())).collect();
    fs::write(dir.join(SINGLE_FILE), serialize_with_crate(&views)?)?;
    Ok(others.into_iter().map(|(n, d, _, b)| (n, d, b)).collect())
}

#[test]
fn both_spellings_name_the_same_text_model() {
    for (prefix, stored) in [
        (TextPrefix::LanguageModel, "language_model.model.layers.0.input_layernorm.weight"),
        (TextPrefix::ModelLanguageModel, "model.language_model.layers.0.input_layernorm.weight"),
    ] {
        assert_eq!(prefix.stored("model.layers.0.input_layernorm.weight"), stored);
        assert_eq!(prefix.text(stored).as_deref(), Some("model.layers.0.input_layernorm.weight"));
    }
    // The head: under the language model before transformers 4.52, at the top since.
    assert_eq!(TextPrefix::LanguageModel.stored("lm_head.weight"), "language_model.lm_head.weight");
    assert_eq!(TextPrefix::ModelLanguageModel.stored("lm_head.weight"), "lm_head.weight");
    assert_eq!(
        TextPrefix::ModelLanguageModel.text("lm_head.weight").as_deref(),
        Some("lm_head.weight")
    );
    // The vision tower and projector are not the text model's.
    for name in ["vision_tower.a.weight", "multi_modal_projector.mm_soft_emb_norm.weight"] {
        assert_eq!(TextPrefix::LanguageModel.text(name), None);
        assert_eq!(TextPrefix::ModelLanguageModel.text(&format!("model.{name}")), None);
    }
}

#[test]
fn text_tensors_read_by_the_text_models_names_under_either_prefix() -> TestResult {
    for prefix in [TextPrefix::LanguageModel, TextPrefix::ModelLanguageModel] {
        let dir = tempdir()?;
        wrapped_file(dir.path(), prefix)?;
        let src = TensorSource::open(dir.path())?;
        assert_eq!(src.text_prefix(), Some(prefix));
        for (i, name) in TEXT.iter().enumerate() {
            assert!(src.contains(name), "{prefix:?} {name}");
            assert_eq!(src.shape(name)?, [2, 3]);
            assert_eq!(src.dtype(name)?, Dtype::F32);
            assert_eq!(bits(&src.read_f32(name)?), bits(&values(6, i as u32)), "{prefix:?} {name}");
            // The stored name still reads, and is the one listed.
            assert!(src.contains(&prefix.stored(name)));
            assert!(src.names().contains(&prefix.stored(name)));
        }
        assert!(!src.names().iter().any(|n| TEXT.contains(&n.as_str())), "listed as stored");
        // A missing text tensor is named as the checkpoint would store it.
        let (path, message) = weights_error(src.read_f32("model.layers.1.input_layernorm.weight"));
        assert_eq!(path, dir.path().join(SINGLE_FILE));
        let stored = prefix.stored("model.layers.1.input_layernorm.weight");
        assert!(message.contains(&format!("no tensor named '{stored}'")), "{message}");
        assert!(message.contains("'model.layers.1.input_layernorm.weight'"), "{message}");
    }
    Ok(())
}

#[test]
fn a_text_model_under_two_prefixes_is_refused() -> TestResult {
    let dir = tempdir()?;
    let one = f32_bytes(&[1.0]);
    let bytes = serialize_with_crate(&[
        ("language_model.model.norm.weight", Dtype::F32, vec![1], one.clone()),
        ("model.language_model.norm.weight", Dtype::F32, vec![1], one),
    ])?;
    fs::write(dir.path().join(SINGLE_FILE), bytes)?;
    let (_, message) = weights_error(TensorSource::open(dir.path()));
    assert!(message.contains("two prefixes"), "{message}");
    assert!(message.contains("'language_model.model.norm.weight'"), "{message}");
    Ok(())
}

/// Writes `trained` (one tensor per `TEXT` name) as a checkpoint of the wrapper read from
/// `dir`, sharded at `max_shard_bytes`.
fn save_wrapped(
    dir: &Path,
    out: &Path,
    trained: &[Vec<f32>],
    max_shard_bytes: usize,
) -> crate::Result<()> {
    let config = json!({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {"hidden_size": 3}});
    let keep = Passthrough::new(config, TensorSource::open(dir)?)?;
    let tensors = TEXT.iter().zip(trained).map(|(n, v)| tensor(n, &[2, 3], v)).collect();
    let text = HfFolder {
        tensors,
        dtype: SaveDtype::F32,
        max_shard_bytes,
        config: json!({"model_type": "gemma3_text"}),
        extra_files: vec![("processor_config.json".into(), b"{}".to_vec())],
    };
    keep.save(out, text)
}

#[test]
fn a_checkpoint_is_written_back_as_the_wrapper_with_the_rest_copied_byte_for_byte() -> TestResult {
    for prefix in [TextPrefix::LanguageModel, TextPrefix::ModelLanguageModel] {
        for max_shard_bytes in [usize::MAX, 40] {
            let dir = tempdir()?;
            let others = wrapped_file(dir.path(), prefix)?;
            let trained: Vec<Vec<f32>> = (0..3).map(|i| values(6, 20 + i)).collect();
            let out = dir.path().join("checkpoint");
            save_wrapped(dir.path(), &out, &trained, max_shard_bytes)?;

            let config: serde_json::Value =
                serde_json::from_str(&fs::read_to_string(out.join(CONFIG_FILE))?)?;
            assert_eq!(config["architectures"], json!(["Gemma3ForConditionalGeneration"]));
            assert_eq!(out.join(INDEX_FILE).exists(), max_shard_bytes == 40);
            assert!(out.join("processor_config.json").is_file());
            let back = TensorSource::open(&out)?;
            assert_eq!(back.text_prefix(), Some(prefix));
            let mut want: Vec<String> = TEXT.iter().map(|n| prefix.stored(n)).collect();
            want.extend(others.iter().map(|(n, _, _)| n.clone()));
            want.sort();
            assert_eq!(back.names(), want, "{prefix:?}: exactly the names read");
            for (name, values) in TEXT.iter().zip(&trained) {
                assert_eq!(bits(&back.read_f32(&prefix.stored(name))?), bits(values), "{name}");
            }
            for (name, dtype, bytes) in &others {
                let (got_dtype, _, got) = back.stored(name)?;
                assert_eq!((got_dtype, got), (*dtype, &bytes[..]), "{prefix:?} {name}");
            }
        }
    }
    Ok(())
}

#[test]
fn weights_without_a_prefixed_text_model_have_nothing_to_pass_through() -> TestResult {
    let dir = tempdir()?;
    let plain = values(6, 0);
    write_safetensors(
        dir.path(),
        &[tensor("model.norm.weight", &[6], &plain)],
        SaveDtype::F32,
        usize::MAX,
    )?;
    let src = TensorSource::open(dir.path())?;
    assert_eq!(src.text_prefix(), None);
    let (_, message) = weights_error(Passthrough::new(json!({}), src));
    assert!(message.contains("no tensor is stored under 'language_model.'"), "{message}");
    Ok(())
}

#[test]
fn stored_bytes_must_match_their_shape() -> TestResult {
    let dir = tempdir()?;
    let bytes = [0u8; 6];
    let t = TensorRef {
        name: "v",
        shape: vec![2, 2],
        data: TensorData::Stored { dtype: Dtype::BF16, bytes: &bytes },
    };
    let message = invalid_error(write_safetensors(dir.path(), &[t], SaveDtype::F32, usize::MAX));
    assert!(
        message.contains("'v'") && message.contains("BF16") && message.contains("6 bytes"),
        "{message}"
    );
    Ok(())
}
