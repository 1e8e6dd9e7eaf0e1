//! Checkpoint exports through the API: an f32 checkpoint downloaded as bf16 (one file and the
//! archive), and as a GGUF file that Sluice's importer reads back.

use std::io::Read;
use std::path::Path;

use axum::http::{StatusCode, header};
use sluice_engine::convert::import_gguf;
use sluice_engine::model::HostParams;
use sluice_engine::weights::gguf::{GgufFile, MetaValue};
use sluice_engine::weights::{
    DEFAULT_MAX_SHARD_BYTES, Dtype, SaveDtype, TensorSource, write_safetensors,
};

use crate::common::{TestApp, tiny_job};

/// bf16 of `x`, rounded to nearest with ties to even, from the bits (no library).
fn bf16_round(x: f32) -> f32 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    f32::from_bits(rounded << 16)
}

/// The dtype of every tensor in a safetensors file given as bytes.
fn dtypes(bytes: &[u8]) -> Vec<String> {
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).expect("header");
    let mut out: Vec<String> = header
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(_, v)| v["dtype"].as_str().unwrap_or_default().to_string())
        .collect();
    out.dedup();
    out
}

/// Checks a downloaded bf16 file against the f32 checkpoint it came from, value by value.
fn check_bf16(bytes: &[u8], f32_params: &HostParams, scratch: &Path) -> anyhow::Result<()> {
    assert_eq!(dtypes(bytes), ["BF16"]);
    let file = scratch.join("download.safetensors");
    std::fs::write(&file, bytes)?;
    let source = TensorSource::open(&file)?;
    for t in f32_params.tensor_refs() {
        assert_eq!(source.dtype(t.name)?, Dtype::BF16, "{}", t.name);
        assert_eq!(source.shape(t.name)?, t.shape, "{}", t.name);
        let got = source.read_f32(t.name)?;
        for (i, (x, y)) in t.data.as_slice().expect("in memory").iter().zip(&got).enumerate() {
            assert_eq!(*y, bf16_round(*x), "{}[{i}]: {x}", t.name);
        }
    }
    Ok(())
}

#[tokio::test]
async fn an_f32_checkpoint_downloads_as_bf16_and_as_gguf() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let dataset = admin.demo_dataset().await?;
    let id = admin.submit(tiny_job(dataset, 2)).await?;
    admin.wait_job(id, 120, |j| j["status"] == "completed").await?;

    // The checkpoint as a job saving f32 leaves it.
    let dir = app.state.runs_dir().join(id.to_string()).join("final");
    let (_, params) = HostParams::load_dir(&dir)?;
    write_safetensors(&dir, &params.tensor_refs(), SaveDtype::F32, DEFAULT_MAX_SHARD_BYTES)?;
    let on_disk = std::fs::read(dir.join("model.safetensors"))?;
    assert_eq!(dtypes(&on_disk), ["F32"]);
    let scratch = tempfile::tempdir()?;

    let base = format!("/api/jobs/{id}/checkpoints/final");
    let bf16 = admin.get(&format!("{base}/files/model.safetensors?dtype=bf16")).await?;
    assert_eq!(bf16.status, StatusCode::OK, "{}", bf16.text());
    assert_eq!(bf16.header(header::CONTENT_LENGTH), bf16.body.len().to_string());
    assert!(bf16.body.len() < on_disk.len() / 2 + 4096, "{} bytes", bf16.body.len());
    check_bf16(&bf16.body, &params, scratch.path())?;

    // f32 on request, and by default: the bytes as saved.
    for query in ["?dtype=f32", ""] {
        let f32 = admin.get(&format!("{base}/files/model.safetensors{query}")).await?;
        assert_eq!(f32.status, StatusCode::OK);
        assert_eq!(&f32.body[..], &on_disk[..], "{query:?}");
    }
    // Files that are not weights come as they are.
    let config = admin.get(&format!("{base}/files/config.json?dtype=bf16")).await?;
    assert_eq!(&config.body[..], &std::fs::read(dir.join("config.json"))?[..]);
    let bad = admin.get(&format!("{base}/files/model.safetensors?dtype=f64")).await?;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert!(bad.error().contains("bf16, f32"), "{}", bad.error());

    // The archive in bf16: the weights converted, the rest as saved.
    let archive = admin.get(&format!("{base}/archive?dtype=bf16")).await?;
    assert_eq!(archive.status, StatusCode::OK, "{}", archive.text());
    let mut tar = tar::Archive::new(&archive.body[..]);
    let mut names = Vec::new();
    for entry in tar.entries()? {
        let mut entry = entry?;
        let name = entry.path()?.to_string_lossy().into_owned();
        let mut bytes = Vec::new();
        entry.read_to_end(&mut bytes)?;
        if name == "final/model.safetensors" {
            check_bf16(&bytes, &params, scratch.path())?;
        } else if name == "final/config.json" {
            assert_eq!(bytes, std::fs::read(dir.join("config.json"))?);
        }
        names.push(name);
    }
    assert!(names.iter().any(|n| n == "final/model.safetensors"), "{names:?}");
    assert!(names.iter().any(|n| n == "final/tokenizer.json"), "{names:?}");

    // GGUF: Q8_0 by default, F16 on request; each imports back with the checkpoint's shape.
    for (query, file_type) in [("", 7), ("?type=f16", 1)] {
        let reply = admin.get(&format!("{base}/gguf{query}")).await?;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        assert_eq!(reply.header(header::CONTENT_LENGTH), reply.body.len().to_string());
        assert!(reply.header(header::CONTENT_DISPOSITION).ends_with(".gguf\""));
        let path = scratch.path().join(format!("model-{file_type}.gguf"));
        std::fs::write(&path, &reply.body)?;
        let gguf = GgufFile::open(&path)?;
        assert_eq!(gguf.get("general.architecture"), Some(&MetaValue::String("llama".into())));
        assert_eq!(gguf.get("general.file_type").and_then(MetaValue::as_u64), Some(file_type));
        let back = scratch.path().join(format!("imported-{file_type}"));
        let summary = import_gguf(&path, &back)?;
        assert_eq!(summary.spec.layers, 4);
    }
    let bad = admin.get(&format!("{base}/gguf?type=q4_k")).await?;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert!(bad.error().contains("f16, q8_0"), "{}", bad.error());
    let missing = admin.get(&format!("/api/jobs/{id}/checkpoints/nope/gguf")).await?;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    // Nothing of the exports stays behind in the runs folder.
    let leftovers: Vec<_> = std::fs::read_dir(app.state.runs_dir())?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".gguf-export"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    Ok(())
}
