//! Safetensors written and read back: bit-exact f32, sharding, bf16 rounding, files from the
//! `safetensors` crate, and refused inconsistencies.

use std::fs;

use half::{bf16, f16};
use safetensors::SafeTensors;

use super::*;
use crate::weights::{
    INDEX_FILE, SINGLE_FILE, SaveDtype, TensorSource, shard_file_name, write_safetensors,
};

/// f32 values that a careless conversion would change: signed zero, infinities, subnormals,
/// extremes and a NaN with a payload.
fn awkward_f32() -> Vec<f32> {
    vec![
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::from_bits(1),
        f32::MIN_POSITIVE,
        f32::MAX,
        f32::from_bits(0x7FC0_1234),
        1.0 + f32::EPSILON,
    ]
}

#[test]
fn f32_single_file_is_bit_exact() -> TestResult {
    let dir = tempdir()?;
    let a = awkward_f32();
    let b = values(12, 1);
    let scalar = [3.25f32];
    let t = [
        tensor("model.layers.0.b", &[3, 4], &b),
        tensor("a", &[2, 4], &a),
        tensor("scalar", &[], &scalar),
        tensor("empty", &[0, 5], &[]),
    ];
    write_safetensors(dir.path(), &t, SaveDtype::F32, 1 << 30)?;
    assert_eq!(listing(dir.path())?, [SINGLE_FILE]);

    let src = TensorSource::open(dir.path())?;
    assert_eq!(src.names(), ["a", "empty", "model.layers.0.b", "scalar"]);
    for t in &t {
        assert_eq!(src.shape(t.name)?, t.shape, "{}", t.name);
        assert_eq!(src.dtype(t.name)?, Dtype::F32);
        assert_eq!(bits(&src.read_f32(t.name)?), bits(t.data.as_slice().unwrap()), "{}", t.name);
    }

    // The safetensors crate's strict validation accepts the file and sees the metadata
    // transformers requires.
    let bytes = fs::read(dir.path().join(SINGLE_FILE))?;
    let (header_len, meta) = SafeTensors::read_metadata(&bytes)?;
    assert_eq!(header_len % 8, 0, "data must start 8-byte aligned");
    let format = meta.metadata().as_ref().and_then(|m| m.get("format"));
    assert_eq!(format.map(String::as_str), Some("pt"));
    Ok(())
}

#[test]
fn sharded_write_fills_shards_in_order_and_indexes_them() -> TestResult {
    let dir = tempdir()?;
    let (d0, d1, d2, d3) = (values(10, 0), values(12, 1), values(7, 2), values(5, 3));
    // 40, 48, 28, 20 bytes with a 60-byte limit: [t0] [t1] [t2 t3].
    let t = [
        tensor("t0", &[10], &d0),
        tensor("t1", &[3, 4], &d1),
        tensor("t2", &[7], &d2),
        tensor("t3", &[5, 1], &d3),
    ];
    write_safetensors(dir.path(), &t, SaveDtype::F32, 60)?;

    let shards: Vec<String> = (1..=3).map(|i| shard_file_name(i, 3)).collect();
    assert_eq!(shards[0], "model-00001-of-00003.safetensors");
    let mut expected_files = shards.clone();
    expected_files.push(INDEX_FILE.to_string());
    expected_files.sort();
    assert_eq!(listing(dir.path())?, expected_files, "no single file, no .tmp left");

    let index: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(dir.path().join(INDEX_FILE))?)?;
    assert_eq!(
        index,
        serde_json::json!({
            "metadata": { "total_size": 40 + 48 + 28 + 20 },
            "weight_map": {
                "t0": shards[0], "t1": shards[1], "t2": shards[2], "t3": shards[2],
            }
        })
    );

    let src = TensorSource::open(dir.path())?;
    assert_eq!(src.path(), dir.path().join(INDEX_FILE));
    assert_eq!(src.names(), ["t0", "t1", "t2", "t3"]);
    for t in &t {
        assert_eq!(src.shape(t.name)?, t.shape);
        assert_eq!(bits(&src.read_f32(t.name)?), bits(t.data.as_slice().unwrap()), "{}", t.name);
    }
    // A shard on its own is a valid safetensors file too.
    let only = TensorSource::open(dir.path().join(&shards[2]))?;
    assert_eq!(only.names(), ["t2", "t3"]);
    Ok(())
}

#[test]
fn a_tensor_larger_than_the_limit_gets_its_own_shard() -> TestResult {
    let dir = tempdir()?;
    // s0 and s1 fill the 16-byte limit exactly, which still fits (as in transformers).
    let (big, small) = (values(10, 0), values(2, 1));
    let t = [
        tensor("big0", &[10], &big),
        tensor("s0", &[2], &small),
        tensor("s1", &[2], &small),
        tensor("big1", &[10], &big),
    ];
    write_safetensors(dir.path(), &t, SaveDtype::F32, 16)?;
    let index: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(dir.path().join(INDEX_FILE))?)?;
    let shard = |name: &str| index["weight_map"][name].as_str().map(str::to_string);
    assert_eq!(shard("big0"), Some(shard_file_name(1, 3)));
    assert_eq!(shard("s0"), Some(shard_file_name(2, 3)));
    assert_eq!(shard("s1"), Some(shard_file_name(2, 3)));
    assert_eq!(shard("big1"), Some(shard_file_name(3, 3)));
    Ok(())
}

#[test]
fn bf16_rounds_to_nearest_even() -> TestResult {
    let dir = tempdir()?;
    let mut data = values(1000, 7);
    data.extend(awkward_f32());
    // Exact ties between two bf16 values: 1.0 + 2^-8 goes down to 1.0 (even mantissa),
    // the next tie goes up; just past a tie goes up. Truncation would get two of these wrong.
    let ties = [0x3F80_8000u32, 0x3F81_8000, 0x3F80_8001];
    data.extend(ties.map(f32::from_bits));
    let t = [tensor("w", &[data.len()], &data)];
    write_safetensors(dir.path(), &t, SaveDtype::Bf16, 1 << 30)?;

    let src = TensorSource::open(dir.path())?;
    assert_eq!(src.dtype("w")?, Dtype::BF16);
    let back = src.read_f32("w")?;
    assert_eq!(back.len(), data.len());
    for (i, (&x, &y)) in data.iter().zip(&back).enumerate() {
        let want = bf16::from_f32(x).to_f32();
        assert!(
            want.to_bits() == y.to_bits() || (want.is_nan() && y.is_nan()),
            "element {i}: {x:e} -> {y:e}, want {want:e}"
        );
    }
    let tail = back.get(back.len() - 3..).map(bits);
    assert_eq!(tail, Some(vec![0x3F80_0000, 0x3F82_0000, 0x3F81_0000]));

    let file_len = fs::metadata(dir.path().join(SINGLE_FILE))?.len() as usize;
    let (header_len, _) = SafeTensors::read_metadata(&fs::read(dir.path().join(SINGLE_FILE))?)?;
    assert_eq!(file_len, 8 + header_len + 2 * data.len(), "2 bytes per element");
    Ok(())
}

#[test]
fn reads_f16_bf16_and_f64_written_by_the_safetensors_crate() -> TestResult {
    let dir = tempdir()?;
    let x = [1.0f32, -2.5, 65504.0, 5.960_464_5e-8, f32::INFINITY, 0.1, -0.0];
    let f16_bytes: Vec<u8> = x.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect();
    let bf16_bytes: Vec<u8> = x.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect();
    let f64_values = [0.1f64, -1e300, 1e-50, 3.0];
    let f64_bytes: Vec<u8> = f64_values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let bytes = serialize_with_crate(&[
        ("half", Dtype::F16, vec![7], f16_bytes),
        ("brain", Dtype::BF16, vec![7, 1], bf16_bytes),
        ("double", Dtype::F64, vec![2, 2], f64_bytes),
    ])?;
    let path = dir.path().join("weights.safetensors");
    fs::write(&path, bytes)?;

    let src = TensorSource::open(&path)?;
    assert_eq!(src.dtype("half")?, Dtype::F16);
    let want: Vec<f32> = x.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
    assert_eq!(bits(&src.read_f32("half")?), bits(&want));
    assert_eq!(src.read_f32("half")?.get(3), Some(&5.960_464_5e-8), "f16 subnormal kept");
    let want: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    assert_eq!(bits(&src.read_f32("brain")?), bits(&want));
    let want: Vec<f32> = f64_values.iter().map(|&v| v as f32).collect();
    assert_eq!(bits(&src.read_f32("double")?), bits(&want));
    Ok(())
}

#[test]
fn read_into_checks_the_destination_length() -> TestResult {
    let dir = tempdir()?;
    let d = values(6, 0);
    write_safetensors(dir.path(), &[tensor("w", &[2, 3], &d)], SaveDtype::F32, 1 << 20)?;
    let src = TensorSource::open(dir.path())?;
    let mut out = vec![0.0; 6];
    src.read_f32_into("w", &mut out)?;
    assert_eq!(bits(&out), bits(&d));
    let (_, message) = weights_error(src.read_f32_into("w", &mut [0.0; 5]));
    assert!(
        message.contains("'w'") && message.contains("[2, 3]") && message.contains('5'),
        "{message}"
    );
    Ok(())
}

#[test]
fn rewriting_in_the_other_layout_removes_the_stale_one() -> TestResult {
    let dir = tempdir()?;
    let (old, new) = (values(8, 0), values(8, 1));
    write_safetensors(dir.path(), &[tensor("w", &[8], &old)], SaveDtype::F32, 1 << 20)?;
    let t = [tensor("w", &[8], &new), tensor("v", &[8], &new)];
    write_safetensors(dir.path(), &t, SaveDtype::F32, 32)?;
    assert!(!dir.path().join(SINGLE_FILE).exists());
    assert_eq!(bits(&TensorSource::open(dir.path())?.read_f32("w")?), bits(&new));

    write_safetensors(dir.path(), &[tensor("w", &[8], &old)], SaveDtype::F32, 1 << 20)?;
    assert!(!dir.path().join(INDEX_FILE).exists());
    assert_eq!(bits(&TensorSource::open(dir.path())?.read_f32("w")?), bits(&old));
    Ok(())
}

#[test]
fn writer_rejects_inconsistent_tensors() -> TestResult {
    let dir = tempdir()?;
    let d = values(6, 0);
    let check = |t: &[TensorRef<'_>], max: usize| {
        invalid_error(write_safetensors(dir.path(), t, SaveDtype::F32, max))
    };
    let message = check(&[tensor("w", &[2, 2], &d)], 1 << 20);
    assert!(
        message.contains("'w'") && message.contains("[2, 2]") && message.contains('6'),
        "{message}"
    );
    let message = check(&[tensor("w", &[6], &d), tensor("w", &[6], &d)], 1 << 20);
    assert!(message.contains("'w'") && message.contains("twice"), "{message}");
    let message = check(&[tensor("__metadata__", &[6], &d)], 1 << 20);
    assert!(message.contains("__metadata__"), "{message}");
    let message = check(&[tensor("w", &[6], &d)], 0);
    assert!(message.contains("max_shard_bytes"), "{message}");
    assert_eq!(listing(dir.path())?, Vec::<String>::new(), "nothing written");
    Ok(())
}

#[test]
fn no_tensors_still_makes_a_readable_file() -> TestResult {
    let dir = tempdir()?;
    write_safetensors(dir.path(), &[], SaveDtype::Bf16, 16)?;
    assert_eq!(listing(dir.path())?, [SINGLE_FILE]);
    assert!(TensorSource::open(dir.path())?.is_empty());
    Ok(())
}
