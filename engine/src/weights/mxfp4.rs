//! MXFP4, the format OpenAI's gpt-oss checkpoints store their experts' matrices in, dequantised
//! to f32 exactly as transformers does it: `_convert_moe_packed_tensors` in
//! `transformers/integrations/mxfp4.py` (5.x; through `Mxfp4Dequantize`, the path of
//! `Mxfp4Config(dequantize=True)`, which transformers asks for before training an MXFP4 model).
//!
//! A packed tensor is a pair: `<name>_blocks`, U8 `[E, R, G, B]`, and `<name>_scales`, U8
//! `[E, R, G]`. Each of the `B` bytes of a block holds two 4-bit FP4 (E2M1) codes, the low
//! nibble first, so a block is `2B` values (gpt-oss: `B = 16`, the MX block of 32), all
//! multiplied by one scale, an E8M0 exponent with bias 127. The reference lays the values of a
//! row out as `[E, R, G·2B]` and returns its transpose `[E, G·2B, R]`, the orientation of
//! `GptOssExperts`' parameters (`gate_up_proj` `[E, H, 2I]` from blocks `[E, 2I, H/32, 16]`,
//! `down_proj` `[E, I, H]` from `[E, H, I/32, 16]`):
//!
//! ```text
//! out[e][g·2B + j][r] = ldexp(FP4[code(blocks[e][r][g][j / 2], j % 2)], scales[e][r][g] − 127)
//! ```
//!
//! Exactness. The reference computes in bf16 whatever dtype the model is loaded in: the
//! `dtype` argument of `convert_moe_packed_tensors` defaults to bf16 and its caller
//! (`dequantize_convertops`) does not pass one, and the loader sets the result as the parameter
//! without a cast. Its `torch.ldexp(sub, exp, out=sub)` is `mul_out(sub, sub, pow(2.0, exp))`:
//! `pow(2.0, int32)` is an f32 tensor (2^e, exact since it is representable: a subnormal for
//! e = −127; inf for e = 128),
//! the product is formed in f32 (the promoted type) and rounded to bf16 on the way out. Every
//! FP4 value is `m·2^k` with a mantissa `m` of at most two significant bits, so the f32 product
//! is exact unless it overflows (then ±inf), and every finite product is also a bf16 value: the
//! largest is 1.5·2^127 and the smallest nonzero 2^-128, well above bf16's least subnormal
//! 2^-133, and two significant bits fit bf16's eight. The rounding to bf16 therefore changes
//! nothing, and this module's f32 result equals the reference's bf16 result widened to f32, bit
//! for bit (and equally the reference run with `dtype=torch.float32`). The one exception is NaN:
//! scale byte 255 makes the power of two infinite and a zero code times it NaN, whose bits
//! PyTorch leaves to the conversion path (0x7FC0 from `c10::BFloat16`'s scalar rounding, other
//! patterns from vectorised ones); this module returns the one quiet NaN
//! [`CANONICAL_NAN`], the scalar path's 0x7FC0 widened. Nonzero codes with scale 255 are ±inf,
//! as in the reference, even 0.5 whose exact product 2^127 would be finite: the reference forms
//! the infinite power of two before it multiplies. The OCP MX spec reserves scale 255 for NaN,
//! so a sound checkpoint never holds it; the edges are kept because the reference defines them.

use rayon::prelude::*;

/// The 16 FP4 E2M1 values by code, transformers' `FP4_VALUES`: sign bit 3, exponent bits 2-1
/// (bias 1), mantissa bit 0; code 0b0001 is the subnormal 0.5.
pub const FP4_E2M1: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// The E8M0 exponent bias: a scale byte `s` means 2^(s − 127). The reference subtracts 127
/// (its `scales.to(torch.int32) - 127`).
pub const SCALE_BIAS: i32 = 127;

/// The NaN a zero code with scale byte 255 decodes to: bf16 0x7FC0 widened (see the module's
/// notes on exactness).
pub const CANONICAL_NAN: f32 = f32::from_bits(0x7FC0_0000);

/// The dimensions of an MXFP4 pair: blocks `[experts, rows, groups, block_bytes]`, scales
/// `[experts, rows, groups]`. The dequantised tensor is `[experts, groups · 2 · block_bytes,
/// rows]`. Only [`Mxfp4Shape::new`] makes one, so every size below is known to fit a `usize`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mxfp4Shape {
    experts: usize,
    /// Output rows of each expert's matrix as stored (`2I` for gate_up_proj, `H` for down_proj);
    /// the last dimension after the reference's transpose.
    rows: usize,
    /// Scale groups along the input dimension.
    groups: usize,
    /// Bytes per block; each holds two values.
    block_bytes: usize,
}

impl Mxfp4Shape {
    /// Checks a pair's shapes as the reference does (`blocks.shape[:-1] == scales.shape`), and
    /// that the dequantised size is countable. The message names what is wrong; the caller
    /// adds the file and tensor names.
    pub fn new(blocks: &[usize], scales: &[usize]) -> Result<Self, String> {
        let &[experts, rows, groups, block_bytes] = blocks else {
            return Err(format!(
                "MXFP4 blocks must have 4 dimensions [experts, rows, groups, bytes], but have \
                 shape {blocks:?}"
            ));
        };
        if scales != &blocks[..3] {
            return Err(format!(
                "MXFP4 scales have shape {scales:?} but the blocks {blocks:?} need one scale per \
                 block, shape {:?}",
                &blocks[..3]
            ));
        }
        // The dequantised count bounds every other size (blocks, scales, each dimension).
        let fits = [experts, rows, groups, block_bytes, 2]
            .into_iter()
            .try_fold(1usize, |acc, d| acc.checked_mul(d))
            .is_some();
        if !fits {
            return Err(format!("MXFP4 blocks {blocks:?} dequantise to more elements than fit"));
        }
        Ok(Mxfp4Shape { experts, rows, groups, block_bytes })
    }

    /// Values per block (two per byte).
    pub fn block_values(&self) -> usize {
        2 * self.block_bytes
    }

    /// The dequantised tensor's shape, `[experts, groups · block_values, rows]`.
    pub fn dequantized(&self) -> [usize; 3] {
        [self.experts, self.groups * self.block_values(), self.rows]
    }

    /// Elements of the dequantised tensor.
    pub fn numel(&self) -> usize {
        self.blocks_len() * 2
    }

    /// Number of scales (bytes of the scales tensor).
    pub fn scales_len(&self) -> usize {
        self.experts * self.rows * self.groups
    }

    /// Bytes of the blocks tensor.
    pub fn blocks_len(&self) -> usize {
        self.scales_len() * self.block_bytes
    }
}

/// The scale 2^(s − 127) as the reference forms it, an f32 (`torch.pow(2.0, exp)`): the f32
/// whose biased exponent is `s` for 1..=254, the subnormal 2^-127 for 0, inf for 255 (2^128
/// overflows f32).
pub fn scale_factor(scale: u8) -> f32 {
    match scale {
        0 => f32::from_bits(1 << 22),
        255 => f32::INFINITY,
        s => f32::from_bits(u32::from(s) << 23),
    }
}

/// One value: FP4 code `code` (its low 4 bits) times scale byte `scale`'s power of two, formed
/// as the reference forms it (see the module's notes), NaN made [`CANONICAL_NAN`].
pub fn dequantize_value(code: u8, scale: u8) -> f32 {
    let value = FP4_E2M1[usize::from(code & 0x0F)] * scale_factor(scale);
    if value.is_nan() { CANONICAL_NAN } else { value }
}

/// The 16 values one scale byte gives the 16 codes.
fn scaled_table(scale: u8) -> [f32; 16] {
    std::array::from_fn(|code| dequantize_value(code as u8, scale))
}

/// Dequantises an MXFP4 pair into `out` in the reference's orientation, `[experts, groups ·
/// block_values, rows]` (see the module's formula). Lengths must agree with `shape`: `blocks`
/// `shape.blocks_len()` bytes, `scales` `shape.scales_len()`, `out` `shape.numel()` elements;
/// anything else is an error, and nothing is written.
///
/// Writes straight into `out` (a slab of the host store when loading), with no intermediate
/// copy: each parallel task owns one expert's `block_values` consecutive output rows (one
/// group), a contiguous stretch of `out`, and fills it row of the source by row of the source,
/// so the transpose's strided writes stay within that stretch.
pub fn dequantize_into(
    shape: &Mxfp4Shape,
    blocks: &[u8],
    scales: &[u8],
    out: &mut [f32],
) -> Result<(), String> {
    let numel = shape.numel();
    if blocks.len() != shape.blocks_len()
        || scales.len() != shape.scales_len()
        || out.len() != numel
    {
        return Err(format!(
            "MXFP4 {shape:?} needs {} block bytes, {} scales and room for {numel} values, but \
             got {}, {} and {}",
            shape.blocks_len(),
            shape.scales_len(),
            blocks.len(),
            scales.len(),
            out.len()
        ));
    }
    if numel == 0 {
        return Ok(());
    }
    let (rows, groups, block_bytes) = (shape.rows, shape.groups, shape.block_bytes);
    out.par_chunks_mut(shape.block_values() * rows).enumerate().for_each(|(task, stretch)| {
        let (expert, group) = (task / groups, task % groups);
        for row in 0..rows {
            // Block (expert, row, group) in the row-major `[E, R, G]` order of the scales.
            let block = (expert * rows + row) * groups + group;
            let table = scaled_table(scales[block]);
            let bytes = &blocks[block * block_bytes..(block + 1) * block_bytes];
            for (j, &byte) in bytes.iter().enumerate() {
                // Value 2j is the low nibble, 2j + 1 the high one (`sub[:, 0::2] = lut[lo]`).
                stretch[2 * j * rows + row] = table[usize::from(byte & 0x0F)];
                stretch[(2 * j + 1) * rows + row] = table[usize::from(byte >> 4)];
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use half::bf16;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;

    /// transformers' `_convert_moe_packed_tensors` step by step, written independently of the
    /// module: a bf16 lookup table, rows `[E·R·G, 2B]` filled low nibbles at even columns and
    /// high nibbles at odd ones, `ldexp` as PyTorch runs it (an f32 `pow(2.0, s − 127)`, the
    /// product in f32, rounded to bf16), reshaped to `[E, R, G·2B]` and transposed to
    /// `[E, G·2B, R]`. Returned widened to f32, as Sluice holds it.
    fn reference(blocks: &[u8], scales: &[u8], dims: [usize; 4]) -> Vec<f32> {
        const FP4_VALUES: [f64; 16] = [
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
        ];
        let [e_n, r_n, g_n, b_n] = dims;
        let lut: Vec<bf16> = FP4_VALUES.iter().map(|&v| bf16::from_f64(v)).collect();
        let rows_total = e_n * r_n * g_n;
        let mut rows = vec![bf16::ZERO; rows_total * 2 * b_n];
        for r in 0..rows_total {
            let exp = i32::from(scales[r]) - 127;
            // torch.pow(2.0, int32) is f32: f64's 2^exp is exact, and its cast to f32 is the
            // f32 power of two (a subnormal at -127, inf at 128).
            let pow2 = 2f64.powi(exp) as f32;
            for b in 0..b_n {
                let byte = blocks[r * b_n + b];
                for (col, idx) in [(2 * b, byte & 0x0F), (2 * b + 1, byte >> 4)] {
                    let v = lut[usize::from(idx)].to_f32() * pow2;
                    rows[r * 2 * b_n + col] = bf16::from_f32(v);
                }
            }
        }
        // view(E, R, G·2B), then transpose(1, 2).contiguous().
        let k_n = g_n * 2 * b_n;
        let mut out = vec![0.0f32; e_n * k_n * r_n];
        for e in 0..e_n {
            for r in 0..r_n {
                for k in 0..k_n {
                    out[(e * k_n + k) * r_n + r] = rows[(e * r_n + r) * k_n + k].to_f32();
                }
            }
        }
        out
    }

    /// Equal bit for bit, except that a NaN matches any NaN (the reference's NaN bits depend on
    /// PyTorch's conversion path; this module's are canonical).
    fn assert_same(got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            if w.is_nan() {
                assert_eq!(g.to_bits(), CANONICAL_NAN.to_bits(), "element {i}: want NaN");
            } else {
                assert_eq!(g.to_bits(), w.to_bits(), "element {i}: {g} vs {w}");
            }
        }
    }

    fn dequantize(blocks: &[u8], scales: &[u8], dims: [usize; 4]) -> Vec<f32> {
        let shape = Mxfp4Shape::new(&dims, &dims[..3]).expect("shape");
        let mut out = vec![f32::NAN; shape.numel()];
        dequantize_into(&shape, blocks, scales, &mut out).expect("dequantize");
        out
    }

    #[test]
    fn the_table_is_e2m1() {
        // Sign, two exponent bits with bias 1 (exponent 0 is subnormal: 0.5 · mantissa), one
        // mantissa bit: decoded from the bits, not copied.
        for code in 0u8..16 {
            let (sign, exp, man) = (code >> 3, (code >> 1) & 3, code & 1);
            let magnitude = if exp == 0 {
                0.5 * f32::from(man)
            } else {
                (1.0 + 0.5 * f32::from(man)) * 2f32.powi(i32::from(exp) - 1)
            };
            let value = if sign == 1 { -magnitude } else { magnitude };
            assert_eq!(FP4_E2M1[usize::from(code)].to_bits(), value.to_bits(), "code {code}");
        }
    }

    #[test]
    fn hand_computed_values() {
        // Scale 127 is 2^0: the table itself.
        assert_eq!(dequantize_value(0x7, 127), 6.0);
        assert_eq!(dequantize_value(0x9, 127), -0.5);
        // Only the low nibble of `code` counts.
        assert_eq!(dequantize_value(0xF3, 127), 1.5);
        assert_eq!(dequantize_value(0x5, 130), 24.0); // 3 · 2^3
        assert_eq!(dequantize_value(0xE, 120), -4.0 / 128.0); // -4 · 2^-7
        // Signed zeros keep their sign.
        assert_eq!(dequantize_value(0x0, 200).to_bits(), 0);
        assert_eq!(dequantize_value(0x8, 3).to_bits(), 0x8000_0000);
        // The smallest scale, 2^-127, is an f32 subnormal, and so are its products.
        assert_eq!(scale_factor(0).to_bits(), 0x0040_0000);
        assert_eq!(dequantize_value(0x1, 0).to_bits(), 0x0020_0000); // 2^-128
        assert_eq!(dequantize_value(0xB, 0).to_bits(), 0x8060_0000); // -1.5 · 2^-127
        assert_eq!(dequantize_value(0x7, 0).to_bits(), 0x0140_0000); // 6 · 2^-127 = 1.5 · 2^-125
        // The largest finite scale, 2^127: 1.5 · 2^127 is the largest finite value, 2 · 2^127
        // overflows to inf, as the f32 (and bf16) product does in the reference.
        assert_eq!(scale_factor(254).to_bits(), 0x7F00_0000);
        assert_eq!(dequantize_value(0x3, 254).to_bits(), 0x7F40_0000);
        assert_eq!(dequantize_value(0x4, 254), f32::INFINITY);
        assert_eq!(dequantize_value(0xF, 254), f32::NEG_INFINITY);
        // Scale 255: 2^128 is inf in f32, so nonzero codes are ±inf and zeros NaN.
        assert_eq!(scale_factor(255), f32::INFINITY);
        assert_eq!(dequantize_value(0x1, 255), f32::INFINITY);
        assert_eq!(dequantize_value(0x9, 255), f32::NEG_INFINITY);
        assert_eq!(dequantize_value(0x0, 255).to_bits(), CANONICAL_NAN.to_bits());
        assert_eq!(dequantize_value(0x8, 255).to_bits(), CANONICAL_NAN.to_bits());
    }

    #[test]
    fn every_code_and_scale_is_exact_in_bf16() {
        // The reference rounds each product to bf16; that rounding is the identity on every
        // value this module produces, so its f32 equals the reference's bf16 widened.
        for scale in 0..=255u8 {
            assert_eq!(scale_factor(scale), 2f64.powi(i32::from(scale) - SCALE_BIAS) as f32);
            for code in 0..16u8 {
                let v = dequantize_value(code, scale);
                let exact =
                    f64::from(FP4_E2M1[usize::from(code)]) * 2f64.powi(i32::from(scale) - 127);
                if v.is_nan() {
                    assert!(scale == 255 && code & 7 == 0, "NaN from code {code} scale {scale}");
                    continue;
                }
                assert_eq!(v.to_bits(), bf16::from_f32(v).to_f32().to_bits(), "{code} {scale}");
                // Exact where finite; inf where the true value passes f32's range, and for
                // every nonzero code at scale 255, whose power of two is already inf (so
                // 0.5 · 2^128 is inf, not the finite 2^127).
                let want = if scale == 255 || exact.abs() >= 2f64.powi(128) {
                    exact.signum() * f64::INFINITY
                } else {
                    exact
                };
                assert_eq!(f64::from(v), want, "code {code} scale {scale}");
            }
        }
    }

    #[test]
    fn one_block_lays_out_low_nibble_first_along_the_input_dimension() {
        // One expert, one row, one group of 2 bytes: codes 0x21 and 0x43 at scale 2^1, i.e.
        // values [FP4[1], FP4[2], FP4[3], FP4[4]] · 2 = [1, 2, 3, 4], as a column [4, 1].
        let out = dequantize(&[0x21, 0x43], &[128], [1, 1, 1, 2]);
        assert_eq!(out, [1.0, 2.0, 3.0, 4.0]);
        // Two rows: the transpose puts rows last, so values interleave row by row.
        let out = dequantize(&[0x21, 0x76], &[127, 126], [1, 2, 1, 1]);
        // Row 0: [0.5, 1]; row 1: [4, 6] · 2^-1 = [2, 3]. Output [2 values, 2 rows].
        assert_eq!(out, [0.5, 2.0, 1.0, 3.0]);
    }

    #[test]
    fn matches_the_reference_on_every_code_and_extreme_scales() {
        // gpt-oss's block of 16 bytes; every byte value appears (16 times, so every pair of
        // codes), and every scale byte once, 0, 1, 254 and 255 included.
        let dims = [4, 8, 8, 16];
        let blocks: Vec<u8> = (0..4 * 8 * 8 * 16).map(|i| (i * 7 % 256) as u8).collect();
        let scales: Vec<u8> = (0..4 * 8 * 8).map(|i| (i * 13 % 256) as u8).collect();
        assert_same(&dequantize(&blocks, &scales, dims), &reference(&blocks, &scales, dims));

        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for dims in [[1, 1, 1, 1], [2, 7, 3, 16], [4, 9, 2, 5], [1, 33, 6, 16]] {
            let n = dims[0] * dims[1] * dims[2];
            let blocks: Vec<u8> = (0..n * dims[3]).map(|_| rng.random()).collect();
            let scales: Vec<u8> = (0..n).map(|_| rng.random()).collect();
            assert_same(&dequantize(&blocks, &scales, dims), &reference(&blocks, &scales, dims));
        }
    }

    #[test]
    fn shapes_are_checked() {
        let shape = Mxfp4Shape::new(&[4, 64, 2, 16], &[4, 64, 2]).expect("shape");
        assert_eq!(shape.dequantized(), [4, 64, 64]);
        assert_eq!((shape.blocks_len(), shape.scales_len()), (4 * 64 * 2 * 16, 4 * 64 * 2));

        let message = Mxfp4Shape::new(&[4, 64, 32], &[4, 64]).expect_err("rank");
        assert!(message.contains("4 dimensions") && message.contains("[4, 64, 32]"), "{message}");
        let message = Mxfp4Shape::new(&[4, 64, 2, 16], &[4, 64, 1]).expect_err("scales");
        assert!(message.contains("[4, 64, 1]") && message.contains("[4, 64, 2]"), "{message}");
        let message = Mxfp4Shape::new(&[4, 64, 2, 16], &[4, 64, 2, 1]).expect_err("scales rank");
        assert!(message.contains("[4, 64, 2, 1]"), "{message}");
        let huge = usize::MAX / 4;
        let message = Mxfp4Shape::new(&[huge, 1, 1, 4], &[huge, 1, 1]).expect_err("overflow");
        assert!(message.contains("more elements than fit"), "{message}");

        // Wrong lengths are refused before anything is written.
        let mut out = vec![7.0; 64 * 64 * 4];
        let message = dequantize_into(&shape, &[0; 10], &[0; 512], &mut out).expect_err("short");
        assert!(message.contains("10"), "{message}");
        assert!(out.iter().all(|&x| x == 7.0));
        let message = dequantize_into(&shape, &vec![0; 4 * 64 * 2 * 16], &[0; 512], &mut out[1..])
            .expect_err("destination");
        assert!(message.contains("16383"), "{message}");
        // Empty tensors are fine.
        let empty = Mxfp4Shape::new(&[0, 3, 2, 16], &[0, 3, 2]).expect("empty");
        dequantize_into(&empty, &[], &[], &mut []).expect("nothing to do");
    }
}
