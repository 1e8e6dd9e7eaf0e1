//! Hand-made GGUF files with known values: every quant type packed by the test from chosen
//! integers and scales (so the expected f32 values are exact), a tiny llama model imported end
//! to end, and malformed files.

#![allow(clippy::unwrap_used)]

use std::path::Path;

use half::{bf16, f16};

use super::*;
use crate::data::Tokenizer;
use crate::model::HostParams;
use crate::weights::gguf::*;

/// A deterministic stream of small integers.
struct Ints(u64);

impl Ints {
    fn next(&mut self, below: u32) -> u32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 33) % u64::from(below)) as u32
    }
}

fn h(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_bits().to_le_bytes()
}

/// Packs `n` values of `ty` from random quants and returns the bytes and the exact values.
fn encode(ty: GgmlType, n: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
    let mut r = Ints(seed);
    let mut bytes = Vec::new();
    let mut want = vec![0.0f32; n];
    let per = ty.block_elements();
    for (b, y) in want.chunks_mut(per).enumerate() {
        match ty {
            GgmlType::F32 => {
                y[0] = r.next(1000) as f32 / 8.0 - 60.0;
                bytes.extend(y[0].to_le_bytes());
            }
            GgmlType::F16 => {
                y[0] = r.next(1000) as f32 / 16.0 - 30.0;
                bytes.extend(h(y[0]));
            }
            GgmlType::Bf16 => {
                y[0] = r.next(256) as f32 / 4.0 - 32.0;
                bytes.extend(bf16::from_f32(y[0]).to_bits().to_le_bytes());
            }
            GgmlType::Q8_0 => {
                bytes.extend(h(0.5));
                for v in y.iter_mut() {
                    let q = r.next(256) as i32 - 128;
                    bytes.push(q as i8 as u8);
                    *v = q as f32 * 0.5;
                }
            }
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let q: Vec<u8> = (0..32).map(|_| r.next(16) as u8).collect();
                if ty == GgmlType::Q4_0 {
                    bytes.extend(h(0.25));
                } else {
                    bytes.extend(h(0.5));
                    bytes.extend(h(-2.0));
                }
                for j in 0..16 {
                    bytes.push(q[j] | (q[j + 16] << 4));
                }
                for (v, &q) in y.iter_mut().zip(&q) {
                    *v = if ty == GgmlType::Q4_0 {
                        (f32::from(q) - 8.0) * 0.25
                    } else {
                        f32::from(q) * 0.5 - 2.0
                    };
                }
            }
            GgmlType::Q4K | GgmlType::Q5K => {
                let bits = if ty == GgmlType::Q4K { 16 } else { 32 };
                let sc: Vec<u8> = (0..8).map(|_| r.next(64) as u8).collect();
                let m: Vec<u8> = (0..8).map(|_| r.next(64) as u8).collect();
                let q: Vec<u8> = (0..256).map(|_| r.next(bits) as u8).collect();
                bytes.extend(h(0.5));
                bytes.extend(h(0.25));
                let mut scales = [0u8; 12];
                for j in 0..4 {
                    scales[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
                    scales[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
                    scales[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4);
                }
                bytes.extend(scales);
                // Value 64k + l (l < 32) is sub-block 2k in the low nibble of qs[32k + l];
                // value 64k + 32 + l is sub-block 2k + 1 in its high nibble.
                let mut qs = [0u8; 128];
                let mut qh = [0u8; 32];
                for (i, &q) in q.iter().enumerate() {
                    let (k, hi, l) = (i / 64, (i % 64) / 32, i % 32);
                    qs[32 * k + l] |= (q & 15) << (4 * hi);
                    if q & 16 != 0 {
                        qh[l] |= 1 << (2 * k + hi);
                    }
                    let s = 2 * k + hi;
                    y[i] = 0.5 * f32::from(sc[s]) * f32::from(q) - 0.25 * f32::from(m[s]);
                }
                if ty == GgmlType::Q5K {
                    bytes.extend(qh);
                }
                bytes.extend(qs);
            }
            GgmlType::Q6K => {
                let sc: Vec<i8> = (0..16).map(|_| (r.next(64) as i32 - 32) as i8).collect();
                let q: Vec<u8> = (0..256).map(|_| r.next(64) as u8).collect();
                let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
                for (i, &q) in q.iter().enumerate() {
                    // Half n of 128 values; quarter c of 32 values; position l in it.
                    let (n, c, l) = (i / 128, (i % 128) / 32, i % 32);
                    let byte = 64 * n + l + if c % 2 == 1 { 32 } else { 0 };
                    ql[byte] |= (q & 15) << if c >= 2 { 4 } else { 0 };
                    qh[32 * n + l] |= (q >> 4) << (2 * c);
                    let s = sc[8 * n + l / 16 + 2 * c];
                    y[i] = 0.125 * f32::from(s) * (f32::from(q) - 32.0);
                }
                bytes.extend(ql);
                bytes.extend(qh);
                bytes.extend(sc.iter().map(|&s| s as u8));
                bytes.extend(h(0.125));
            }
        }
        let _ = b;
    }
    (bytes, want)
}

#[test]
fn every_type_dequantises_to_the_packed_values() {
    for ty in GgmlType::ALL {
        let n = 512;
        let (bytes, want) = encode(ty, n, ty.id().into());
        assert_eq!(bytes.len(), n / ty.block_elements() * ty.block_bytes(), "{}", ty.name());
        let got = dequantize(ty, &bytes, n).unwrap();
        assert_eq!(got, want, "{}", ty.name());
        let err = dequantize(ty, &bytes[..bytes.len() - 1], n).unwrap_err();
        assert!(err.contains("bytes"), "{err}");
    }
}

/// Writes GGUF v3: metadata then tensors, data aligned to 32.
struct Writer {
    kv: Vec<(String, MetaValue)>,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn put_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend(x.to_le_bytes()),
        MetaValue::I16(x) => out.extend(x.to_le_bytes()),
        MetaValue::U32(x) => out.extend(x.to_le_bytes()),
        MetaValue::I32(x) => out.extend(x.to_le_bytes()),
        MetaValue::F32(x) => out.extend(x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(u8::from(*x)),
        MetaValue::String(s) => put_str(out, s),
        MetaValue::Array(items) => {
            out.extend(items.first().map_or(4, type_id).to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            items.iter().for_each(|i| put_value(out, i));
        }
        MetaValue::U64(x) => out.extend(x.to_le_bytes()),
        MetaValue::I64(x) => out.extend(x.to_le_bytes()),
        MetaValue::F64(x) => out.extend(x.to_le_bytes()),
    }
}

impl Writer {
    fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kv.len() as u64).to_le_bytes());
        for (k, v) in &self.kv {
            put_str(&mut out, k);
            out.extend(type_id(v).to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0u64;
        for (name, dims, ty, data) in &self.tensors {
            put_str(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
            out.extend(ty.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offset += (data.len() as u64).div_ceil(32) * 32;
        }
        out.resize(out.len().div_ceil(32) * 32, 0);
        for (_, _, _, data) in &self.tensors {
            out.extend(data);
            out.resize(out.len().div_ceil(32) * 32, 0);
        }
        out
    }
}

fn s(x: &str) -> MetaValue {
    MetaValue::String(x.into())
}

const HIDDEN: u64 = 256;
const TOKENS: [&str; 8] = ["<|end|>", "a", "b", "c", "Ġ", "ab", "Ġa", "abc"];

/// A one-layer llama (hidden 256, 2 heads of 128, 1 kv head, vocabulary 8) whose tensors use
/// every supported type; returns the file and the expected transformers tensors.
fn tiny_llama() -> (Writer, Vec<(String, Vec<f32>)>) {
    let kv = vec![
        ("general.architecture".into(), s("llama")),
        ("general.alignment".into(), MetaValue::U32(32)),
        ("llama.context_length".into(), MetaValue::U32(128)),
        ("llama.embedding_length".into(), MetaValue::U32(HIDDEN as u32)),
        ("llama.block_count".into(), MetaValue::U32(1)),
        ("llama.feed_forward_length".into(), MetaValue::U32(256)),
        ("llama.attention.head_count".into(), MetaValue::U32(2)),
        ("llama.attention.head_count_kv".into(), MetaValue::U32(1)),
        ("llama.rope.freq_base".into(), MetaValue::F32(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon".into(), MetaValue::F32(1e-5)),
        ("tokenizer.ggml.model".into(), s("gpt2")),
        ("tokenizer.ggml.pre".into(), s("smollm")),
        ("tokenizer.ggml.tokens".into(), MetaValue::Array(TOKENS.iter().map(|t| s(t)).collect())),
        (
            "tokenizer.ggml.token_type".into(),
            MetaValue::Array([3, 1, 1, 1, 1, 1, 1, 1].map(MetaValue::I32).to_vec()),
        ),
        ("tokenizer.ggml.merges".into(), MetaValue::Array(vec![s("a b"), s("Ġ a"), s("ab c")])),
        ("tokenizer.ggml.eos_token_id".into(), MetaValue::U32(0)),
        ("tokenizer.chat_template".into(), s("{% for m in messages %}{{ m.content }}{% endfor %}")),
    ];
    let specs: [(&str, &str, u64, GgmlType, Option<usize>); 11] = [
        ("token_embd.weight", "model.embed_tokens.weight", 8, GgmlType::Q8_0, None),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight", 0, GgmlType::F32, None),
        (
            "blk.0.attn_q.weight",
            "model.layers.0.self_attn.q_proj.weight",
            256,
            GgmlType::Q4_0,
            Some(2),
        ),
        (
            "blk.0.attn_k.weight",
            "model.layers.0.self_attn.k_proj.weight",
            128,
            GgmlType::Q4_1,
            Some(1),
        ),
        ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight", 128, GgmlType::Q4K, None),
        (
            "blk.0.attn_output.weight",
            "model.layers.0.self_attn.o_proj.weight",
            256,
            GgmlType::Q5K,
            None,
        ),
        (
            "blk.0.ffn_norm.weight",
            "model.layers.0.post_attention_layernorm.weight",
            0,
            GgmlType::Bf16,
            None,
        ),
        ("blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj.weight", 256, GgmlType::Q6K, None),
        ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight", 256, GgmlType::F16, None),
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", 256, GgmlType::Bf16, None),
        ("output_norm.weight", "model.norm.weight", 0, GgmlType::F32, None),
    ];
    let mut tensors = Vec::new();
    let mut expected = Vec::new();
    for (seed, (gguf, hf, rows, ty, heads)) in specs.into_iter().enumerate() {
        let dims = if rows == 0 { vec![HIDDEN] } else { vec![HIDDEN, rows] };
        let n = dims.iter().product::<u64>() as usize;
        let (bytes, values) = encode(ty, n, seed as u64 + 100);
        let values = match heads {
            // convert_hf_to_gguf.py's permute: within a head, transformers row s·hd/2 + i is
            // stored as row 2i + s, so transformers row r comes from that stored row.
            Some(heads) => {
                let hd = rows as usize / heads;
                let mut hf_rows = vec![0.0; n];
                for r in 0..rows as usize {
                    let (head, within) = (r / hd, r % hd);
                    let (s, i) = (within / (hd / 2), within % (hd / 2));
                    let stored = head * hd + 2 * i + s;
                    hf_rows[r * 256..(r + 1) * 256]
                        .copy_from_slice(&values[stored * 256..(stored + 1) * 256]);
                }
                hf_rows
            }
            None => values,
        };
        tensors.push((gguf.to_string(), dims, ty.id(), bytes));
        expected.push((hf.to_string(), values));
    }
    (Writer { kv, tensors }, expected)
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn a_tiny_llama_of_every_type_imports_to_a_loadable_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let (writer, expected) = tiny_llama();
    let path = write(tmp.path(), "tiny.gguf", &writer.bytes());
    let out = tmp.path().join("model");
    let summary = import_gguf(&path, &out).unwrap();
    assert_eq!(summary.tensor_types.iter().map(|t| t.1).sum::<usize>(), 11);

    let (spec, params) = HostParams::load_dir(&out).unwrap();
    assert!(spec.tie_embeddings);
    assert_eq!((spec.hidden, spec.q_heads, spec.kv_heads, spec.head_dim), (256, 2, 1, 128));
    assert_eq!(spec.max_positions, 128);
    assert_eq!(spec.rms_eps, 1e-5);
    for (name, want) in &expected {
        assert_eq!(params.get(name).unwrap(), want.as_slice(), "{name}");
    }

    let tok = Tokenizer::from_dir(&out).unwrap();
    assert_eq!(tok.encode("abc a").unwrap().ids, vec![7, 6]);
    assert_eq!(tok.encode("<|end|>ab").unwrap().ids, vec![0, 5]);
    assert_eq!(tok.eos_token(), Some("<|end|>"));
    assert!(tok.chat_template().is_some());
}

#[test]
fn unpermute_inverts_the_llama_cpp_row_order() {
    // Two heads of four rows (one column): stored order per head is [r0, r2, r1, r3].
    let stored = [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0];
    assert_eq!(unpermute_rows(&stored, 2, 1).unwrap(), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
    assert!(unpermute_rows(&stored, 3, 1).is_err());
}

#[test]
fn metadata_of_every_type_reads_back() {
    let values = vec![
        MetaValue::U8(7),
        MetaValue::I8(-7),
        MetaValue::U16(700),
        MetaValue::I16(-700),
        MetaValue::U32(70_000),
        MetaValue::I32(-70_000),
        MetaValue::F32(1.5),
        MetaValue::Bool(true),
        s("text ✓"),
        MetaValue::Array(vec![MetaValue::U64(1), MetaValue::U64(2)]),
        MetaValue::U64(1 << 40),
        MetaValue::I64(-(1 << 40)),
        MetaValue::F64(-2.25),
        MetaValue::Array(vec![MetaValue::Array(vec![s("nested")])]),
    ];
    let kv: Vec<(String, MetaValue)> =
        values.iter().enumerate().map(|(i, v)| (format!("k{i:02}"), v.clone())).collect();
    let bytes = Writer { kv, tensors: vec![] }.bytes();
    let tmp = tempfile::tempdir().unwrap();
    let file = GgufFile::open(write(tmp.path(), "meta.gguf", &bytes)).unwrap();
    assert_eq!(file.version, 3);
    for (i, v) in values.iter().enumerate() {
        assert_eq!(file.get(&format!("k{i:02}")), Some(v));
    }
}

fn import_error(bytes: &[u8]) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let path = write(tmp.path(), "bad.gguf", bytes);
    import_gguf(&path, &tmp.path().join("out")).unwrap_err().to_string()
}

#[test]
fn malformed_and_unsupported_files_are_clear_errors() {
    let (writer, _) = tiny_llama();
    let good = writer.bytes();

    let err = import_error(&good[..good.len() - 100]);
    assert!(err.contains("truncated") && err.contains("bad.gguf"), "{err}");
    let err = import_error(&good[..200]);
    assert!(err.contains("truncated"), "{err}");
    let err = import_error(b"GGML\x03\0\0\0");
    assert!(err.contains("not a GGUF file"), "{err}");

    let (mut w, _) = tiny_llama();
    w.kv[0].1 = s("gpt2");
    let err = import_error(&w.bytes());
    assert!(err.contains("architecture \"gpt2\" is not supported"), "{err}");

    let (mut w, _) = tiny_llama();
    w.tensors[4].2 = 6; // Q5_0
    let err = import_error(&w.bytes());
    assert!(err.contains("ggml type 6") && err.contains("blk.0.attn_v.weight"), "{err}");

    let (mut w, _) = tiny_llama();
    w.tensors.remove(9);
    let err = import_error(&w.bytes());
    assert!(err.contains("model.layers.0.mlp.down_proj.weight"), "{err}");

    let (mut w, _) = tiny_llama();
    w.kv.retain(|(k, _)| k != "tokenizer.ggml.merges");
    let err = import_error(&w.bytes());
    assert!(err.contains("tokenizer.ggml.merges is missing"), "{err}");

    // Sizes the tensor table cannot justify are refused before anything is sized by them (a
    // damaged size once asked for a slab larger than memory and aborted the test process).
    for (at, key, value) in [
        (4, "llama.block_count", u32::MAX),
        (5, "llama.feed_forward_length", 1 << 31),
        (6, "llama.attention.head_count", 1 << 20),
    ] {
        let (mut w, _) = tiny_llama();
        assert_eq!(w.kv[at].0, key);
        w.kv[at].1 = MetaValue::U32(value);
        let err = import_error(&w.bytes());
        assert!(err.contains(key) && err.contains("more than the file holds"), "{err}");
    }

    let (mut w, _) = tiny_llama();
    w.kv[11].1 = s("falcon");
    let err = import_error(&w.bytes());
    assert!(err.contains("\"falcon\" is not supported"), "{err}");
}

/// Damaged files (bytes changed in the header and metadata, or cut anywhere) and random bytes
/// are an error or, where the damage is harmless, a model; never a panic or an allocation the
/// file's sizes did not justify.
mod damaged {
    use proptest::prelude::*;
    use proptest::sample::Index;

    use super::*;

    fn import(bytes: &[u8]) -> crate::error::Result<()> {
        let tmp = tempfile::tempdir().expect("temp dir");
        let path = write(tmp.path(), "damaged.gguf", bytes);
        import_gguf(&path, &tmp.path().join("out")).map(|_| ())
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 96,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn a_damaged_tiny_llama_imports_or_is_refused(
            edits in prop::collection::vec((any::<Index>(), any::<u8>()), 1..6),
            cut in prop::option::of(any::<Index>()),
        ) {
            let mut bytes = tiny_llama().0.bytes();
            // The header, metadata and tensor table come first; damage there is what a parser
            // must survive (changed tensor data is just other numbers).
            let head = bytes.len().min(2048);
            for (at, value) in edits {
                bytes[at.index(head)] = value;
            }
            if let Some(cut) = cut {
                let len = cut.index(bytes.len());
                bytes.truncate(len);
            }
            let _ = import(&bytes);
        }

        #[test]
        fn random_bytes_are_refused(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
            prop_assert!(import(&bytes).is_err());
        }

        #[test]
        fn random_bytes_after_the_magic_are_refused(
            tail in prop::collection::vec(any::<u8>(), 0..2048),
        ) {
            let mut bytes = b"GGUF\x03\0\0\0".to_vec();
            bytes.extend(tail);
            let _ = import(&bytes);
        }
    }
}
