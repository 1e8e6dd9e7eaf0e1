//! MXFP4 pairs read through `TensorSource`: a file with `<name>_blocks` and `<name>_scales`
//! serves `<name>` dequantised, bit for bit as transformers' `_convert_moe_packed_tensors`
//! computes it, with its dequantised shape; every inconsistency is an error naming the tensors.

use std::fs;

use super::*;
use crate::weights::{INDEX_FILE, TensorSource};

const NAME: &str = "model.layers.0.mlp.experts.gate_up_proj";

/// The reference formula, written out for one element of the dequantised `[E, G·32, R]`
/// tensor from blocks `[E, R, G, 16]` and scales `[E, R, G]`: the code is nibble `k % 2` (low
/// first) of byte `(k % 32) / 2` of block `(e, r, k / 32)`, its FP4 value (sign, two exponent
/// bits with bias 1, one mantissa bit) times 2^(scale − 127) as an f32 power (inf for 255),
/// the product rounded to bf16 (the reference's dtype) and widened back.
fn reference_element(
    blocks: &[u8],
    scales: &[u8],
    dims: [usize; 3],
    e: usize,
    k: usize,
    r: usize,
) -> f32 {
    let [_, rows, groups] = dims;
    let block = (e * rows + r) * groups + k / 32;
    let byte = blocks[block * 16 + (k % 32) / 2];
    let code = if k.is_multiple_of(2) { byte & 0x0F } else { byte >> 4 };
    let (sign, exp, man) = (code >> 3, i32::from((code >> 1) & 3), f64::from(code & 1));
    let magnitude = if exp == 0 { 0.5 * man } else { (1.0 + 0.5 * man) * 2f64.powi(exp - 1) };
    let value = if sign == 1 { -magnitude } else { magnitude } as f32;
    let pow2 = 2f64.powi(i32::from(scales[block]) - 127) as f32;
    half::bf16::from_f32(value * pow2).to_f32()
}

/// A file holding `NAME` as an MXFP4 pair `[E, R, G, 16]` / `[E, R, G]`, plus a plain tensor.
fn packed_file(
    dir: &Path,
    dims: [usize; 3],
    blocks: &[u8],
    scales: &[u8],
) -> Result<PathBuf, Box<dyn std::error::Error>> {
    let [e, r, g] = dims;
    let bias = values(4, 1);
    let bias_bytes: Vec<u8> = bias.iter().flat_map(|x| x.to_le_bytes()).collect();
    let bytes = serialize_with_crate(&[
        (&format!("{NAME}_blocks"), Dtype::U8, vec![e, r, g, 16], blocks.to_vec()),
        (&format!("{NAME}_scales"), Dtype::U8, vec![e, r, g], scales.to_vec()),
        (&format!("{NAME}_bias"), Dtype::F32, vec![4], bias_bytes),
    ])?;
    let path = dir.join("model.safetensors");
    fs::write(&path, bytes)?;
    Ok(path)
}

#[test]
fn packed_pair_reads_as_the_reference_dequantises_it() -> TestResult {
    // Every byte value appears in the blocks (so every code in both nibbles), and the scales
    // run from the smallest (2^-127, subnormal products) through 2^0 to the largest (2^127,
    // overflowing products) and 255 (inf and NaN).
    let dims = [3, 6, 4];
    let [e_n, r_n, g_n] = dims;
    let blocks: Vec<u8> = (0..e_n * r_n * g_n * 16).map(|i| (i * 37 % 256) as u8).collect();
    let extremes = [0u8, 1, 2, 100, 120, 126, 127, 128, 130, 150, 253, 254, 255];
    let scales: Vec<u8> = (0..e_n * r_n * g_n).map(|i| extremes[i % extremes.len()]).collect();
    let dir = tempdir()?;
    packed_file(dir.path(), dims, &blocks, &scales)?;

    let src = TensorSource::open(dir.path())?;
    assert!(src.contains(NAME));
    assert_eq!(src.shape(NAME)?, [e_n, g_n * 32, r_n]);
    assert_eq!(src.numel(NAME)?, e_n * g_n * 32 * r_n);
    assert_eq!(src.dtype(NAME)?, Dtype::F4);
    // The stored tensors are still there under their own names.
    assert_eq!(
        src.names(),
        [format!("{NAME}_bias"), format!("{NAME}_blocks"), format!("{NAME}_scales")]
    );
    assert_eq!(src.dtype(&format!("{NAME}_blocks"))?, Dtype::U8);

    let got = src.read_f32(NAME)?;
    let (mut nans, mut infs, mut subnormals) = (0, 0, 0);
    for e in 0..e_n {
        for k in 0..g_n * 32 {
            for r in 0..r_n {
                let want = reference_element(&blocks, &scales, dims, e, k, r);
                let have = got[(e * g_n * 32 + k) * r_n + r];
                if want.is_nan() {
                    // PyTorch leaves a NaN's bits to its conversion path; Sluice's is canonical.
                    assert_eq!(have.to_bits(), 0x7FC0_0000, "[{e}, {k}, {r}]");
                    nans += 1;
                } else {
                    assert_eq!(have.to_bits(), want.to_bits(), "[{e}, {k}, {r}]: {have} vs {want}");
                    infs += usize::from(want.is_infinite());
                    subnormals += usize::from(want.is_subnormal());
                }
            }
        }
    }
    assert!(nans > 0 && infs > 0 && subnormals > 0, "{nans} {infs} {subnormals}");

    // Into a caller's buffer, the same; a buffer of the wrong size is refused.
    let mut into = vec![0.0; got.len()];
    src.read_f32_into(NAME, &mut into)?;
    assert_eq!(bits(&into), bits(&got));
    let (_, message) = weights_error(src.read_f32_into(NAME, &mut into[1..]));
    assert!(message.contains(NAME) && message.contains("destination holds"), "{message}");
    Ok(())
}

#[test]
fn a_pair_split_across_shards_is_found() -> TestResult {
    let dir = tempdir()?;
    let blocks: Vec<u8> = (0..2 * 3 * 16).map(|i| (i * 11 % 256) as u8).collect();
    let scales = vec![120u8, 127, 131, 90, 127, 140];
    let one = serialize_with_crate(&[(
        &format!("{NAME}_blocks"),
        Dtype::U8,
        vec![2, 3, 1, 16],
        blocks.clone(),
    )])?;
    let two = serialize_with_crate(&[(
        &format!("{NAME}_scales"),
        Dtype::U8,
        vec![2, 3, 1],
        scales.clone(),
    )])?;
    fs::write(dir.path().join("a.safetensors"), one)?;
    fs::write(dir.path().join("b.safetensors"), two)?;
    let index = serde_json::json!({ "weight_map": {
        format!("{NAME}_blocks"): "a.safetensors",
        format!("{NAME}_scales"): "b.safetensors",
    }});
    fs::write(dir.path().join(INDEX_FILE), index.to_string())?;

    let src = TensorSource::open(dir.path())?;
    assert_eq!(src.shape(NAME)?, [2, 32, 3]);
    let got = src.read_f32(NAME)?;
    for (i, have) in got.iter().enumerate() {
        let (e, k, r) = (i / 96, i / 3 % 32, i % 3);
        let want = reference_element(&blocks, &scales, [2, 3, 1], e, k, r);
        assert_eq!(have.to_bits(), want.to_bits(), "element {i}");
    }
    Ok(())
}

#[test]
fn a_stored_tensor_wins_over_a_pair_of_the_same_name() -> TestResult {
    let dir = tempdir()?;
    let plain = values(4, 3);
    let bytes = serialize_with_crate(&[
        ("w", Dtype::F32, vec![4], plain.iter().flat_map(|x| x.to_le_bytes()).collect()),
        ("w_blocks", Dtype::U8, vec![1, 1, 1, 16], vec![0x11; 16]),
        ("w_scales", Dtype::U8, vec![1, 1, 1], vec![127]),
    ])?;
    let path = dir.path().join("model.safetensors");
    fs::write(&path, bytes)?;
    let src = TensorSource::open(&path)?;
    assert_eq!(src.shape("w")?, [4]);
    assert_eq!(bits(&src.read_f32("w")?), bits(&plain));
    Ok(())
}

#[test]
fn inconsistent_pairs_are_errors_naming_both_tensors() -> TestResult {
    let dir = tempdir()?;
    let case = |tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]| -> Result<TensorSource, Box<dyn std::error::Error>> {
        let path = dir.path().join("model.safetensors");
        fs::write(&path, serialize_with_crate(tensors)?)?;
        Ok(TensorSource::open(&path)?)
    };
    let blocks = format!("{NAME}_blocks");
    let scales = format!("{NAME}_scales");

    // Scales for fewer groups than the blocks have (a truncated tensor): the file opens, and
    // asking for the tensor says what disagrees, however it is asked for.
    let src = case(&[
        (&blocks, Dtype::U8, vec![2, 4, 3, 16], vec![0; 2 * 4 * 3 * 16]),
        (&scales, Dtype::U8, vec![2, 4, 2], vec![127; 2 * 4 * 2]),
    ])?;
    assert!(src.contains(NAME));
    for result in
        [src.shape(NAME).map(drop), src.numel(NAME).map(drop), src.read_f32(NAME).map(drop)]
    {
        let (path, message) = weights_error(result);
        assert_eq!(path, dir.path().join("model.safetensors"));
        assert!(
            message.contains(NAME)
                && message.contains(&blocks)
                && message.contains(&scales)
                && message.contains("[2, 4, 2]")
                && message.contains("[2, 4, 3]"),
            "{message}"
        );
    }

    // Blocks of the wrong rank.
    let src = case(&[
        (&blocks, Dtype::U8, vec![2, 4, 48], vec![0; 2 * 4 * 48]),
        (&scales, Dtype::U8, vec![2, 4, 3], vec![127; 2 * 4 * 3]),
    ])?;
    let (_, message) = weights_error(src.shape(NAME));
    assert!(message.contains("4 dimensions") && message.contains("[2, 4, 48]"), "{message}");

    // Scales stored as something other than the reference's bytes.
    let src = case(&[
        (&blocks, Dtype::U8, vec![1, 1, 1, 16], vec![0; 16]),
        (&scales, Dtype::F8_E8M0, vec![1, 1, 1], vec![127]),
    ])?;
    let (_, message) = weights_error(src.read_f32(NAME));
    assert!(
        message.contains(&scales) && message.contains("F8_E8M0") && message.contains("U8"),
        "{message}"
    );

    // Half a pair: the tensor is missing, and the message says which half is there.
    let src = case(&[(&blocks, Dtype::U8, vec![1, 1, 1, 16], vec![0; 16])])?;
    assert!(!src.contains(NAME));
    let (_, message) = weights_error(src.shape(NAME));
    assert!(
        message.contains(&blocks) && message.contains(&scales) && message.contains("MXFP4"),
        "{message}"
    );
    Ok(())
}
