//! Damaged or incomplete safetensors files and folders, each refused with the file, tensor or
//! dtype named.

use std::fs;
use std::path::PathBuf;

use super::*;
use crate::weights::{
    INDEX_FILE, SINGLE_FILE, SaveDtype, TensorSource, shard_file_name, write_safetensors,
};

/// A single-file model in a fresh folder; returns the folder and the file.
fn single(name: &str, n: usize) -> std::io::Result<(tempfile::TempDir, PathBuf)> {
    let dir = tempdir()?;
    let data = values(n, 0);
    write_safetensors(dir.path(), &[tensor(name, &[n], &data)], SaveDtype::F32, 1 << 20)
        .map_err(std::io::Error::other)?;
    let file = dir.path().join(SINGLE_FILE);
    Ok((dir, file))
}

/// A three-shard model (tensors t0, t1, t2, one per shard).
fn sharded() -> std::io::Result<tempfile::TempDir> {
    let dir = tempdir()?;
    let data = values(4, 0);
    let t = [tensor("t0", &[4], &data), tensor("t1", &[4], &data), tensor("t2", &[4], &data)];
    write_safetensors(dir.path(), &t, SaveDtype::F32, 16).map_err(std::io::Error::other)?;
    Ok(dir)
}

fn truncate(path: &std::path::Path, len: usize) -> std::io::Result<()> {
    let bytes = fs::read(path)?;
    fs::write(path, bytes.get(..len).unwrap_or(&bytes))
}

#[test]
fn file_cut_in_the_data_is_truncated() -> TestResult {
    let (dir, file) = single("model.embed", 16)?;
    let len = fs::metadata(&file)?.len() as usize;
    truncate(&file, len - 3)?;
    let (path, message) = weights_error(TensorSource::open(dir.path()));
    assert_eq!(path, file);
    assert!(message.contains("truncated") && message.contains("'model.embed'"), "{message}");
    Ok(())
}

#[test]
fn file_cut_in_the_header_is_truncated() -> TestResult {
    let (_dir, file) = single("w", 4)?;
    truncate(&file, 20)?;
    let (path, message) = weights_error(TensorSource::open(&file));
    assert_eq!(path, file);
    assert!(message.contains("truncated") && message.contains("header"), "{message}");

    truncate(&file, 5)?;
    let (_, message) = weights_error(TensorSource::open(&file));
    assert!(message.contains("truncated") && message.contains("5 bytes"), "{message}");
    Ok(())
}

#[test]
fn garbled_header_is_reported() -> TestResult {
    let (_dir, file) = single("w", 4)?;
    let mut bytes = fs::read(&file)?;
    // Same length, not JSON: the length prefix still fits, so only parsing can catch it.
    if let Some(b) = bytes.get_mut(8..18) {
        b.copy_from_slice(b"{not json,");
    }
    fs::write(&file, &bytes)?;
    let (path, message) = weights_error(TensorSource::open(&file));
    assert_eq!(path, file);
    assert!(message.contains("garbled header"), "{message}");
    Ok(())
}

#[test]
fn offsets_that_disagree_with_the_shape_are_garbled() -> TestResult {
    let dir = tempdir()?;
    let header = br#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0; 16]);
    let file = dir.path().join("x.safetensors");
    fs::write(&file, &bytes)?;
    let (_, message) = weights_error(TensorSource::open(&file));
    assert!(
        message.contains("garbled header")
            && message.contains("'w'")
            && message.contains("16 bytes"),
        "{message}"
    );
    Ok(())
}

#[test]
fn unknown_dtype_is_named() -> TestResult {
    let dir = tempdir()?;
    let header = br#"{"w":{"dtype":"F8_E4M3FNUZ","shape":[2],"data_offsets":[0,2]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0; 2]);
    let file = dir.path().join("x.safetensors");
    fs::write(&file, &bytes)?;
    let (_, message) = weights_error(TensorSource::open(&file));
    assert!(message.contains("'w'") && message.contains("F8_E4M3FNUZ"), "{message}");
    Ok(())
}

#[test]
fn unsupported_dtype_fails_on_read_naming_tensor_and_dtype() -> TestResult {
    let dir = tempdir()?;
    let ints: Vec<u8> = [1i32, -2, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
    let fp8 = vec![0x38u8; 2];
    let bytes = serialize_with_crate(&[
        ("position_ids", Dtype::I32, vec![3], ints),
        ("scale", Dtype::F8_E4M3, vec![2], fp8),
    ])?;
    let file = dir.path().join(SINGLE_FILE);
    fs::write(&file, bytes)?;
    let src = TensorSource::open(dir.path())?;
    assert_eq!(src.dtype("position_ids")?, Dtype::I32);
    assert_eq!(src.shape("position_ids")?, [3]);
    let (path, message) = weights_error(src.read_f32("position_ids"));
    assert_eq!(path, file);
    assert!(message.contains("'position_ids'") && message.contains("I32"), "{message}");
    let (_, message) = weights_error(src.read_f32("scale"));
    assert!(message.contains("'scale'") && message.contains("F8_E4M3"), "{message}");
    Ok(())
}

#[test]
fn missing_tensor_names_tensor_and_file() -> TestResult {
    let (dir, file) = single("w", 4)?;
    let src = TensorSource::open(dir.path())?;
    assert!(src.contains("w") && !src.contains("lm_head.weight"));
    let (path, message) = weights_error(src.read_f32("lm_head.weight"));
    assert_eq!(path, file);
    assert!(message.contains("'lm_head.weight'"), "{message}");
    let (_, message) = weights_error(src.shape("lm_head.weight"));
    assert!(message.contains("'lm_head.weight'"), "{message}");

    let dir = sharded()?;
    let (path, _) = weights_error(TensorSource::open(dir.path())?.dtype("t9"));
    assert_eq!(path, dir.path().join(INDEX_FILE));
    Ok(())
}

#[test]
fn folder_without_weights_says_what_it_looked_for() -> TestResult {
    let dir = tempdir()?;
    fs::write(dir.path().join("config.json"), "{}")?;
    let (path, message) = weights_error(TensorSource::open(dir.path()));
    assert_eq!(path, dir.path());
    assert!(message.contains(SINGLE_FILE) && message.contains(INDEX_FILE), "{message}");

    let missing = dir.path().join("nowhere");
    assert!(matches!(TensorSource::open(&missing), Err(Error::Io { path, .. }) if path == missing));
    Ok(())
}

#[test]
fn index_naming_a_missing_shard() -> TestResult {
    let dir = sharded()?;
    fs::remove_file(dir.path().join(shard_file_name(2, 3)))?;
    let (path, message) = weights_error(TensorSource::open(dir.path()));
    assert_eq!(path, dir.path().join(INDEX_FILE));
    assert!(
        message.contains(&shard_file_name(2, 3))
            && message.contains("'t1'")
            && message.contains("does not exist"),
        "{message}"
    );
    Ok(())
}

#[test]
fn index_pointing_outside_the_folder_is_refused() -> TestResult {
    let dir = sharded()?;
    let index = serde_json::json!({ "weight_map": { "t0": "../elsewhere.safetensors" } });
    fs::write(dir.path().join(INDEX_FILE), index.to_string())?;
    let (_, message) = weights_error(TensorSource::open(dir.path()));
    assert!(message.contains("../elsewhere.safetensors") && message.contains("'t0'"), "{message}");
    Ok(())
}

#[test]
fn garbled_index_is_reported() -> TestResult {
    let dir = sharded()?;
    fs::write(dir.path().join(INDEX_FILE), r#"{"weight_map": ["#)?;
    let (path, message) = weights_error(TensorSource::open(dir.path()));
    assert_eq!(path, dir.path().join(INDEX_FILE));
    assert!(message.contains("garbled index"), "{message}");

    fs::write(dir.path().join(INDEX_FILE), r#"{"metadata": {}}"#)?;
    let (_, message) = weights_error(TensorSource::open(dir.path()));
    assert!(message.contains("garbled index") && message.contains("weight_map"), "{message}");
    Ok(())
}

#[test]
fn index_placing_a_tensor_in_the_wrong_shard() -> TestResult {
    let dir = sharded()?;
    let mut index: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(dir.path().join(INDEX_FILE))?)?;
    index["weight_map"]["t0"] = shard_file_name(3, 3).into();
    fs::write(dir.path().join(INDEX_FILE), index.to_string())?;
    let (path, message) = weights_error(TensorSource::open(dir.path()));
    assert_eq!(path, dir.path().join(shard_file_name(3, 3)));
    assert!(message.contains("'t0'") && message.contains("not there"), "{message}");
    Ok(())
}

/// Damaged safetensors (header bytes changed, the file cut anywhere) and random bytes open as
/// an error, or read as some numbers where the damage is harmless; never a panic.
mod damaged {
    use proptest::prelude::*;
    use proptest::sample::Index;

    use super::*;

    fn read_all(dir: &std::path::Path) -> crate::error::Result<()> {
        let source = TensorSource::open(dir)?;
        for name in ["t0", "t1", "t2"] {
            source.read_f32(name)?;
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 128,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn a_damaged_file_reads_or_is_refused(
            edits in prop::collection::vec((any::<Index>(), any::<u8>()), 1..6),
            cut in prop::option::of(any::<Index>()),
        ) {
            let dir = tempdir().expect("temp dir");
            let data = values(4, 0);
            let t = [tensor("t0", &[4], &data), tensor("t1", &[2, 2], &data), tensor("t2", &[4], &data)];
            write_safetensors(dir.path(), &t, SaveDtype::F32, 1 << 20).expect("writes");
            let file = dir.path().join(SINGLE_FILE);
            let mut bytes = fs::read(&file).expect("reads");
            // The length prefix and the JSON header come first.
            let head = bytes.len().min(400);
            for (at, value) in edits {
                bytes[at.index(head)] = value;
            }
            if let Some(cut) = cut {
                let len = cut.index(bytes.len());
                bytes.truncate(len);
            }
            fs::write(&file, &bytes).expect("writes");
            let _ = read_all(dir.path());
        }

        #[test]
        fn random_bytes_are_refused(bytes in prop::collection::vec(any::<u8>(), 0..1024)) {
            let dir = tempdir().expect("temp dir");
            fs::write(dir.path().join(SINGLE_FILE), &bytes).expect("writes");
            prop_assert!(read_all(dir.path()).is_err());
        }
    }
}
