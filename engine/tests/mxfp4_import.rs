//! A gpt-oss folder whose experts are stored as MXFP4 pairs (`gate_up_proj_blocks` /
//! `_scales`, `down_proj_blocks` / `_scales`, as OpenAI released gpt-oss) loads to the same
//! parameters, bit for bit, as the same model stored dequantised.
//!
//! Quantising arbitrary floats is lossy, so the experts are built the other way round: random
//! FP4 codes and scales, dequantised here by the reference formula (transformers'
//! `_convert_moe_packed_tensors`), and written both ways.

use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use sluice_engine::model::HostParams;
use sluice_engine::spec::ModelSpec;
use sluice_engine::weights::{
    DEFAULT_MAX_SHARD_BYTES, HfFolder, SaveDtype, TensorSource, save_hf_folder, write_safetensors,
};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// One MXFP4 pair: blocks `[E, R, G, 16]`, scales `[E, R, G]`.
struct Packed {
    dims: [usize; 3],
    blocks: Vec<u8>,
    scales: Vec<u8>,
}

impl Packed {
    /// Random codes (every byte value equally likely) and scales over every finite exponent
    /// (scale bytes 0..=254: subnormal products at the bottom, overflow to inf at the top).
    fn random(rng: &mut ChaCha8Rng, dims: [usize; 3]) -> Packed {
        let n = dims.iter().product::<usize>();
        let blocks = (0..n * 16).map(|_| rng.random()).collect();
        let scales = (0..n).map(|_| rng.random_range(0..=254)).collect();
        Packed { dims, blocks, scales }
    }

    /// The reference's dequantisation in its `[E, G·32, R]` orientation: element `[e, k, r]` is
    /// FP4 code `k % 2` (low nibble first) of byte `(k % 32) / 2` of block `(e, r, k / 32)`
    /// times 2^(scale − 127). For scales below 255 the exact product, rounded to f32, is the
    /// reference's value (exact, or inf on overflow).
    fn dequantised(&self) -> Vec<f32> {
        const FP4: [f64; 16] = [
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
        ];
        let [e_n, r_n, g_n] = self.dims;
        let mut out = Vec::with_capacity(e_n * g_n * 32 * r_n);
        for e in 0..e_n {
            for k in 0..g_n * 32 {
                for r in 0..r_n {
                    let block = (e * r_n + r) * g_n + k / 32;
                    let byte = self.blocks[block * 16 + (k % 32) / 2];
                    let code = if k.is_multiple_of(2) { byte & 0x0F } else { byte >> 4 };
                    let exp = i32::from(self.scales[block]) - 127;
                    out.push((FP4[usize::from(code)] * 2f64.powi(exp)) as f32);
                }
            }
        }
        out
    }
}

fn golden_config() -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/golden/gpt_oss/config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    // MXFP4 packs the input dimension in blocks of 32: gate_up_proj's is the hidden size (48
    // in the fixture), down_proj's the intermediate size (32).
    config["hidden_size"] = 64.into();
    Ok(config)
}

fn write_config(dir: &Path, config: &serde_json::Value) -> TestResult {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(config)?)?;
    Ok(())
}

fn bits(p: &HostParams) -> Vec<u32> {
    p.units.iter().flatten().map(|x| x.to_bits()).collect()
}

#[test]
fn mxfp4_experts_load_like_the_same_experts_stored_dequantised() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let (dense_dir, packed_dir): (PathBuf, PathBuf) =
        (tmp.path().join("dense"), tmp.path().join("mxfp4"));
    let mut config = golden_config()?;
    write_config(&dense_dir, &config)?;
    // What the released checkpoints carry; the loader goes by the tensors it finds.
    config["quantization_config"] = serde_json::json!({
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    });
    write_config(&packed_dir, &config)?;

    let spec = ModelSpec::from_path(&dense_dir)?;
    let mut params = HostParams::random(&spec, 3);
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let h = spec.hidden;
    let mut packed = Vec::new(); // (name, pair)
    for l in 0..spec.layers {
        let moe = spec.moe_at(l).ok_or("gpt_oss layers are all MoE")?;
        let (e, i) = (moe.experts, moe.inter);
        for (proj, dims) in [("gate_up_proj", [e, 2 * i, h / 32]), ("down_proj", [e, h, i / 32])] {
            let name = format!("model.layers.{l}.mlp.experts.{proj}");
            let pair = Packed::random(&mut rng, dims);
            let layout = params.layout.clone();
            let (u, slot) =
                layout.tensors().find(|(_, t)| t.name == name).ok_or("expert tensor in layout")?;
            params.units[u][slot.range.clone()].copy_from_slice(&pair.dequantised());
            packed.push((name, pair));
        }
    }

    write_safetensors(&dense_dir, &params.tensor_refs(), SaveDtype::F32, usize::MAX)?;

    // The MXFP4 folder: two shards, the scales apart from their blocks, as a sharded release
    // may put them.
    let refs = params.tensor_refs();
    let f32_bytes: Vec<(String, Vec<usize>, Vec<u8>)> = refs
        .iter()
        .filter(|t| packed.iter().all(|(name, _)| name != t.name))
        .map(|t| {
            (
                t.name.to_string(),
                t.shape.clone(),
                t.data
                    .as_slice()
                    .expect("in memory")
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect(),
            )
        })
        .collect();
    let mut first = Vec::new();
    let mut second = Vec::new();
    for (name, shape, bytes) in &f32_bytes {
        first.push((name.clone(), TensorView::new(Dtype::F32, shape.clone(), bytes)?));
    }
    for (name, pair) in &packed {
        let [e, r, g] = pair.dims;
        first.push((
            format!("{name}_blocks"),
            TensorView::new(Dtype::U8, vec![e, r, g, 16], &pair.blocks)?,
        ));
        second.push((
            format!("{name}_scales"),
            TensorView::new(Dtype::U8, vec![e, r, g], &pair.scales)?,
        ));
    }
    let shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
    let mut weight_map = serde_json::Map::new();
    for (shard, views) in shards.iter().zip([first, second]) {
        for (name, _) in &views {
            weight_map.insert(name.clone(), (*shard).into());
        }
        std::fs::write(packed_dir.join(shard), safetensors::serialize(views, None)?)?;
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(packed_dir.join("model.safetensors.index.json"), index.to_string())?;

    let (dense_spec, dense) = HostParams::load_dir(&dense_dir)?;
    let (packed_spec, from_mxfp4) = HostParams::load_dir(&packed_dir)?;
    let mut unquantized = packed_spec.clone();
    if let serde_json::Value::Object(raw) = &mut unquantized.raw {
        raw.remove("quantization_config");
    }
    assert_eq!(unquantized, dense_spec, "the two configs differ only in quantization_config");
    assert_eq!(bits(&dense), bits(&params), "the dense folder reads back as written");
    assert!(bits(&from_mxfp4) == bits(&params), "MXFP4 experts load to other values");
    // The experts did span the edges: subnormal, infinite and ordinary values.
    let all: Vec<f32> = packed.iter().flat_map(|(_, p)| p.dequantised()).collect();
    assert!(all.iter().any(|x| x.is_subnormal()) && all.iter().any(|x| x.is_infinite()));

    // Saved again, the model is an ordinary float checkpoint: dequantised experts under their
    // own names, and no quantization_config to send transformers looking for packed ones.
    let saved = tmp.path().join("saved");
    let folder = HfFolder {
        tensors: from_mxfp4.tensor_refs(),
        dtype: SaveDtype::F32,
        max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
        config: packed_spec.to_hf_config(),
        extra_files: Vec::new(),
    };
    save_hf_folder(&saved, &folder)?;
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(saved.join("config.json"))?)?;
    assert!(config.get("quantization_config").is_none(), "{config}");
    let source = TensorSource::open(&saved)?;
    assert!(source.names().iter().all(|n| !n.ends_with("_blocks") && !n.ends_with("_scales")));
    let (_, reloaded) = HostParams::load_dir(&saved)?;
    assert!(bits(&reloaded) == bits(&params));
    Ok(())
}
