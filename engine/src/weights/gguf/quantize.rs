//! f32 to the ggml types an export writes, computed as ggml's reference quantisers
//! (`quantize_row_q8_0_ref` in ggml-quants.c) and gguf-py's `quants.py` do, so a file written
//! here holds the bytes llama.cpp's own converter would write for the same values.

use half::f16;

use super::quant::GgmlType;

/// Values per Q8_0 block.
pub const Q8_0_BLOCK: usize = 32;

/// Appends `values` encoded as `ty` (F32, F16 or Q8_0) to `out`. The caller has checked that a
/// Q8_0 row is a whole number of blocks; a ragged tail is an `Err`, never a short block.
pub fn quantize_into(ty: GgmlType, values: &[f32], out: &mut Vec<u8>) -> Result<(), String> {
    match ty {
        GgmlType::F32 => values.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        // Round to nearest, ties to even, as numpy's `astype(np.float16)`.
        GgmlType::F16 => {
            values.iter().for_each(|&x| out.extend_from_slice(&f16::from_f32(x).to_le_bytes()))
        }
        GgmlType::Q8_0 => {
            if !values.len().is_multiple_of(Q8_0_BLOCK) {
                return Err(format!(
                    "{} values are not a whole number of Q8_0 blocks of {Q8_0_BLOCK}",
                    values.len()
                ));
            }
            out.reserve(values.len() / Q8_0_BLOCK * GgmlType::Q8_0.block_bytes());
            values.chunks_exact(Q8_0_BLOCK).for_each(|block| q8_0_block(block, out));
        }
        other => return Err(format!("Sluice does not write {} tensors", other.name())),
    }
    Ok(())
}

/// One Q8_0 block: `d = amax / 127` stored as f16, `qs[j] = round(x[j] · (1 / d))` with
/// C's `roundf` (halves away from zero, as Rust's `f32::round`). The f32 `d`, not its f16
/// rounding, scales the quants, as ggml does.
fn q8_0_block(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
    // |x · id| ≤ 127 up to rounding, so the cast never saturates in a way that matters.
    out.extend(x.iter().map(|&v| (v * id).round() as i8 as u8));
}
