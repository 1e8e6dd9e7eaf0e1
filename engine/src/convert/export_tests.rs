//! The GGUF writer: the quantisers against plain reference loops, the q/k permutation against
//! the importer's inverse, and whole checkpoints written and read back through Sluice's own
//! importer.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use half::f16;

use super::*;
use crate::data::Tokenizer;
use crate::model::HostParams;
use crate::train::{ModelSource, load_model, save_checkpoint};
use crate::weights::SaveDtype;
use crate::weights::gguf::*;

/// Deterministic values of varied magnitude, with an all-zero block and an outlier.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    let mut out: Vec<f32> = (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
        })
        .collect();
    out[32..64].fill(0.0);
    out[70] = 3.5;
    out
}

/// ggml's `quantize_row_q8_0_ref`, written out element by element.
fn reference_q8_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for b in 0..x.len() / 32 {
        let block = &x[b * 32..(b + 1) * 32];
        let mut amax = 0.0f32;
        for &v in block {
            if v.abs() > amax {
                amax = v.abs();
            }
        }
        let d = amax / 127.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        out.extend(f16::from_f32(d).to_bits().to_le_bytes());
        for &v in block {
            let q = (v * id).round();
            assert!((-127.0..=127.0).contains(&q), "quant {q} out of range");
            out.push(q as i8 as u8);
        }
    }
    out
}

#[test]
fn q8_0_matches_the_reference_and_dequantises_within_half_a_step() {
    let x = values(32 * 40, 7);
    let mut bytes = Vec::new();
    quantize_into(GgmlType::Q8_0, &x, &mut bytes).unwrap();
    assert_eq!(bytes, reference_q8_0(&x));
    assert_eq!(bytes.len(), 40 * 34);
    let back = dequantize(GgmlType::Q8_0, &bytes, x.len()).unwrap();
    for (b, (xs, ys)) in x.chunks(32).zip(back.chunks(32)).enumerate() {
        let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        // Half a quantisation step, plus the scale's f16 rounding (2^-11 relative) times 127.
        let tol = amax / 127.0 * (0.5 + 127.0 / 2048.0) + 1e-12;
        for (j, (a, b2)) in xs.iter().zip(ys).enumerate() {
            assert!((a - b2).abs() <= tol, "block {b} value {j}: {a} vs {b2} (tol {tol})");
        }
    }
    // The zero block stays exactly zero; the outlier's block keeps its extreme exactly up to
    // the scale's rounding.
    assert!(back[32..64].iter().all(|&v| v == 0.0));
    assert!((back[70] - 3.5).abs() < 3.5 / 1024.0, "{}", back[70]);
}

#[test]
fn q8_0_refuses_a_ragged_row_and_f16_rounds_to_nearest() {
    let mut bytes = Vec::new();
    let err = quantize_into(GgmlType::Q8_0, &[1.0; 33], &mut bytes).unwrap_err();
    assert!(err.contains("33 values"), "{err}");
    let x = values(96, 3);
    let mut bytes = Vec::new();
    quantize_into(GgmlType::F16, &x, &mut bytes).unwrap();
    let back = dequantize(GgmlType::F16, &bytes, x.len()).unwrap();
    for (a, b) in x.iter().zip(&back) {
        assert_eq!(*b, f16::from_f32(*a).to_f32());
    }
    assert!(quantize_into(GgmlType::Q4_0, &x, &mut bytes).is_err());
}

#[test]
fn permutation_interleaves_the_halves_of_each_head_and_the_importer_undoes_it() {
    // Two heads of four rows, one column: within a head rows (0, 1 | 2, 3) pair as 0-2, 1-3.
    let rows: Vec<f32> = (0..8).map(|i| i as f32).collect();
    let p = permute_rows(&rows, 2, 1).unwrap();
    assert_eq!(p, [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
    let wide = values(3 * 8 * 5, 11);
    let back = unpermute_rows(&permute_rows(&wide, 3, 5).unwrap(), 3, 5).unwrap();
    assert_eq!(back, wide);
    assert!(permute_rows(&rows, 3, 1).is_err());
}

/// A tiny preset checkpoint (llama, tied, GQA) saved as transformers would, with the built-in
/// tokenizer; `edit` may change its config first.
fn checkpoint(root: &Path, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let model = load_model(&ModelSource::Preset("tiny".into()), 5).unwrap();
    let dir = root.join("checkpoint");
    save_checkpoint(&dir, &model, &model.params, SaveDtype::F32).unwrap();
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
    dir
}

fn tensors(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let (_, params) = HostParams::load_dir(dir).unwrap();
    params
        .tensor_refs()
        .into_iter()
        .map(|t| (t.name.to_string(), t.data.as_slice().unwrap().to_vec()))
        .collect()
}

#[test]
fn f16_and_q8_0_exports_import_back_with_the_same_tensors_and_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), |_| {});
    let original = tensors(&dir);
    for ty in [GgufType::F16, GgufType::Q8_0] {
        let out = tmp.path().join(format!("model-{ty}.gguf"));
        let summary = export_gguf(&dir, &out, ty).unwrap();
        assert_eq!(summary.architecture, "llama");
        assert_eq!(summary.bytes, std::fs::metadata(&out).unwrap().len());
        assert!(!tmp.path().join(format!("model-{ty}.gguf.tmp")).exists());

        let file = GgufFile::open(&out).unwrap();
        assert_eq!(file.version, 3);
        let meta = |k: &str| file.get(k).unwrap_or_else(|| panic!("{k} missing")).clone();
        assert_eq!(meta("general.architecture"), MetaValue::String("llama".into()));
        assert_eq!(
            meta("general.file_type").as_u64(),
            Some(if ty == GgufType::F16 { 1 } else { 7 })
        );
        assert_eq!(meta("llama.block_count").as_u64(), Some(4));
        assert_eq!(meta("llama.attention.head_count_kv").as_u64(), Some(2));
        assert_eq!(meta("tokenizer.ggml.model").as_str(), Some("gpt2"));
        assert_eq!(meta("tokenizer.ggml.pre").as_str(), Some("gpt2"));
        assert_eq!(meta("tokenizer.ggml.eos_token_id").as_u64(), Some(2));
        assert!(file.tensor("output.weight").is_none(), "tied embeddings write no output");
        let q = file.tensor("blk.0.attn_q.weight").unwrap();
        let want = if ty == GgufType::F16 { GgmlType::F16 } else { GgmlType::Q8_0 };
        assert_eq!(q.ggml_type, want);
        assert_eq!(file.tensor("blk.0.attn_norm.weight").unwrap().ggml_type, GgmlType::F32);
        let data_start = file.tensors.iter().map(|t| t.start).min().unwrap();
        assert!(file.tensors.iter().all(|t| (t.start - data_start) % ALIGNMENT == 0));

        let back = tmp.path().join(format!("imported-{ty}"));
        import_gguf(&out, &back).unwrap();
        let imported = tensors(&back);
        assert_eq!(imported.len(), original.len());
        for ((name, a), (name_b, b)) in original.iter().zip(&imported) {
            assert_eq!(name, name_b);
            let matrix = !name.ends_with("norm.weight");
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                // Rows are whole multiples of 32 and move whole, so a Q8_0 block is 32
                // consecutive values here too: half its step plus the scale's f16 rounding.
                let block = &a[i / 32 * 32..(i / 32 + 1) * 32];
                let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let ok = match (ty, matrix) {
                    (_, false) => x == y,
                    (GgufType::F16, true) => *y == f16::from_f32(*x).to_f32(),
                    (GgufType::Q8_0, true) => (x - y).abs() <= amax / 127.0 * 0.57,
                };
                assert!(ok, "{ty} {name}[{i}]: {x} vs {y}");
            }
        }
        let (a, b) = (Tokenizer::from_dir(&dir).unwrap(), Tokenizer::from_dir(&back).unwrap());
        let text = "Hello, world! <|im_start|>user\n12 apples<|im_end|>";
        assert_eq!(a.encode(text).unwrap().ids, b.encode(text).unwrap().ids);
        assert_eq!(a.chat_template(), b.chat_template());
        assert_eq!(b.eos_token(), Some("<|im_end|>"));
    }
}

#[test]
fn qwen2_is_written_unpermuted_with_its_biases_in_f32() {
    let tmp = tempfile::tempdir().unwrap();
    // The same shapes as Qwen2: q/k/v biases, which the tiny checkpoint then lacks, so they
    // are added as files of their own.
    let dir = checkpoint(tmp.path(), |c| {
        c["model_type"] = "qwen2".into();
        c["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
    });
    let spec = crate::spec::ModelSpec::from_path(&dir).unwrap();
    let params = HostParams::random(&spec, 9);
    crate::weights::write_safetensors(
        &dir,
        &params.tensor_refs(),
        SaveDtype::F32,
        crate::weights::DEFAULT_MAX_SHARD_BYTES,
    )
    .unwrap();
    let out = tmp.path().join("qwen2.gguf");
    assert_eq!(export_gguf(&dir, &out, GgufType::F16).unwrap().architecture, "qwen2");
    let file = GgufFile::open(&out).unwrap();
    assert_eq!(file.get("qwen2.context_length").and_then(MetaValue::as_u64), Some(2048));
    let bias = file.tensor("blk.1.attn_k.bias").unwrap();
    assert_eq!(bias.ggml_type, GgmlType::F32);
    let refs = params.tensor_refs();
    let hf = |n: &str| refs.iter().find(|t| t.name == n).unwrap().data.as_slice().unwrap();
    assert_eq!(file.tensor_f32(bias).unwrap(), hf("model.layers.1.self_attn.k_proj.bias"));
    let q = file.tensor_f32(file.tensor("blk.1.attn_q.weight").unwrap()).unwrap();
    let want: Vec<f32> = hf("model.layers.1.self_attn.q_proj.weight")
        .iter()
        .map(|&x| f16::from_f32(x).to_f32())
        .collect();
    assert_eq!(q, want, "qwen2 rows keep transformers' order");
}

#[test]
fn unsupported_checkpoints_and_types_are_refused_and_write_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), |c| {
        c["model_type"] = "qwen3".into();
        c["architectures"] = serde_json::json!(["Qwen3ForCausalLM"]);
    });
    let out = tmp.path().join("out.gguf");
    let err = export_gguf(&dir, &out, GgufType::Q8_0).unwrap_err().to_string();
    assert!(err.contains("qwen3"), "{err}");
    assert!(!out.exists());
    let err = export_gguf(&tmp.path().join("nowhere"), &out, GgufType::F16).unwrap_err();
    assert!(err.to_string().contains("nowhere"), "{err}");
    assert!(!out.exists());
    let err = "q4_k".parse::<GgufType>().unwrap_err().to_string();
    assert!(err.contains("f16, q8_0"), "{err}");
    assert_eq!("Q8_0".parse::<GgufType>().unwrap(), GgufType::Q8_0);
}
