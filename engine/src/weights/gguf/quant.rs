//! ggml tensor types and their dequantisation to f32, computed exactly as ggml's reference
//! `dequantize_row_*` functions in ggml-quants.c do (same block layouts, same f32 operations in
//! the same order), so an imported model holds the values llama.cpp itself would compute.
//!
//! Block layouts (little-endian, `f16` is IEEE half):
//! - `Q8_0`, 32 values, 34 bytes: `d: f16`, `qs: [i8; 32]`; `y = qs · d`.
//! - `Q4_0`, 32 values, 18 bytes: `d: f16`, `qs: [u8; 16]`; value `j < 16` is the low nibble
//!   of `qs[j]`, value `j + 16` the high nibble; `y = (q − 8) · d`.
//! - `Q4_1`, 32 values, 20 bytes: `d: f16`, `m: f16`, `qs` as Q4_0; `y = q · d + m`.
//! - `Q4_K`, 256 values, 144 bytes: `d: f16`, `dmin: f16`, `scales: [u8; 12]` (eight 6-bit
//!   scales and eight 6-bit mins, see [`scale_min_k4`]), `qs: [u8; 128]`; each 64 values take
//!   32 bytes of `qs`: low nibbles (sub-block `2k`) then high nibbles (sub-block `2k + 1`);
//!   `y = d·sc · q − dmin·m`.
//! - `Q5_K`, 256 values, 176 bytes: as Q4_K with `qh: [u8; 32]` before `qs`, supplying a fifth
//!   bit: for the `k`-th group of 64, bit `2k` of `qh[l]` for the low nibble, bit `2k + 1` for
//!   the high one.
//! - `Q6_K`, 256 values, 210 bytes: `ql: [u8; 128]`, `qh: [u8; 64]`, `scales: [i8; 16]`,
//!   `d: f16`; two halves of 128 values, each from 64 bytes of `ql`, 32 of `qh` and 8 scales;
//!   `y = d · sc · (q − 32)`.

use half::{bf16, f16};

/// The ggml types Sluice can dequantise, with their ids in GGUF tensor infos.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

const QK_K: usize = 256;

impl GgmlType {
    pub const ALL: [GgmlType; 9] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Bf16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];

    /// The `ggml_type` enum value (ggml.h).
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::Bf16 => 30,
        }
    }

    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|t| t.id() == id)
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Bf16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
        }
    }

    pub(crate) fn supported_names() -> String {
        GgmlType::ALL.map(GgmlType::name).join(", ")
    }

    /// Values per block.
    pub fn block_elements(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => 32,
            GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::Bf16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q8_0 => 34,
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
        }
    }
}

fn half(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Dequantises `elements` values of type `ty` from `bytes`, which must hold exactly their
/// blocks.
pub fn dequantize(ty: GgmlType, bytes: &[u8], elements: usize) -> Result<Vec<f32>, String> {
    let per = ty.block_elements();
    if !elements.is_multiple_of(per) {
        return Err(format!(
            "{elements} values are not a whole number of {} blocks of {per}",
            ty.name()
        ));
    }
    let expected = elements / per * ty.block_bytes();
    if bytes.len() != expected {
        return Err(format!(
            "{elements} {} values need {expected} bytes, found {}",
            ty.name(),
            bytes.len()
        ));
    }
    let mut out = vec![0.0f32; elements];
    let blocks = bytes.chunks_exact(ty.block_bytes()).zip(out.chunks_exact_mut(per));
    match ty {
        GgmlType::F32 => {
            blocks.for_each(|(b, y)| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        }
        GgmlType::F16 => blocks.for_each(|(b, y)| y[0] = half(b, 0)),
        GgmlType::Bf16 => blocks
            .for_each(|(b, y)| y[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()),
        GgmlType::Q8_0 => blocks.for_each(|(b, y)| q8_0(b, y)),
        GgmlType::Q4_0 => blocks.for_each(|(b, y)| q4_0(b, y)),
        GgmlType::Q4_1 => blocks.for_each(|(b, y)| q4_1(b, y)),
        GgmlType::Q4K => blocks.for_each(|(b, y)| q4_k(b, y)),
        GgmlType::Q5K => blocks.for_each(|(b, y)| q5_k(b, y)),
        GgmlType::Q6K => blocks.for_each(|(b, y)| q6_k(b, y)),
    }
    Ok(out)
}

/// block [34], y [32]. Reference: `dequantize_row_q8_0`.
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    for (y, &q) in y.iter_mut().zip(&b[2..34]) {
        *y = f32::from(q as i8) * d;
    }
}

/// block [18], y [32]. Reference: `dequantize_row_q4_0`.
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    let (lo, hi) = y.split_at_mut(16);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[2..18]) {
        *l = (i32::from(q & 0x0F) - 8) as f32 * d;
        *h = (i32::from(q >> 4) - 8) as f32 * d;
    }
}

/// block [20], y [32]. Reference: `dequantize_row_q4_1`.
fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    let (lo, hi) = y.split_at_mut(16);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[4..20]) {
        *l = f32::from(q & 0x0F) * d + m;
        *h = f32::from(q >> 4) * d + m;
    }
}

/// The `j`-th 6-bit scale and min of a K-quant's 12 packed bytes: for `j < 4` the low six bits
/// of bytes `j` and `j + 4`; otherwise a nibble of byte `j + 4` plus the top two bits of bytes
/// `j − 4` (scale) and `j` (min). Reference: `get_scale_min_k4`.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// block [144], y [256]. Reference: `dequantize_row_q4_K`.
fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (half(b, 0), half(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (k, (y, q)) in y.chunks_exact_mut(64).zip(qs.chunks_exact(32)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * k, scales);
        let (sc2, m2) = scale_min_k4(2 * k + 1, scales);
        let (d1, m1) = (d * f32::from(sc1), min * f32::from(m1));
        let (d2, m2) = (d * f32::from(sc2), min * f32::from(m2));
        let (lo, hi) = y.split_at_mut(32);
        for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(q) {
            *l = d1 * f32::from(q & 0x0F) - m1;
            *h = d2 * f32::from(q >> 4) - m2;
        }
    }
}

/// block [176], y [256]. Reference: `dequantize_row_q5_K`.
fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (half(b, 0), half(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (k, (y, ql)) in y.chunks_exact_mut(64).zip(qs.chunks_exact(32)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * k, scales);
        let (sc2, m2) = scale_min_k4(2 * k + 1, scales);
        let (d1, m1) = (d * f32::from(sc1), min * f32::from(m1));
        let (d2, m2) = (d * f32::from(sc2), min * f32::from(m2));
        let (u1, u2) = (1u8 << (2 * k), 2u8 << (2 * k));
        let (lo, hi) = y.split_at_mut(32);
        for (((l, h), &q), &bits) in lo.iter_mut().zip(hi.iter_mut()).zip(ql).zip(qh) {
            let extra_lo = if bits & u1 != 0 { 16 } else { 0 };
            let extra_hi = if bits & u2 != 0 { 16 } else { 0 };
            *l = d1 * f32::from((q & 0x0F) + extra_lo) - m1;
            *h = d2 * f32::from((q >> 4) + extra_hi) - m2;
        }
    }
}

/// block [210], y [256]. Reference: `dequantize_row_q6_K`.
fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = half(b, 208);
    for (n, y) in y.chunks_exact_mut(128).enumerate() {
        let ql = &b[64 * n..64 * n + 64];
        let qh = &b[128 + 32 * n..128 + 32 * n + 32];
        let sc = &b[192 + 8 * n..192 + 8 * n + 8];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i8 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            let s = |i: usize| f32::from(sc[is + i] as i8);
            y[l] = d * s(0) * f32::from(q1);
            y[l + 32] = d * s(2) * f32::from(q2);
            y[l + 64] = d * s(4) * f32::from(q3);
            y[l + 96] = d * s(6) * f32::from(q4);
        }
    }
}
