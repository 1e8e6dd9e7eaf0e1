//! The fused update written out in AVX-512 intrinsics, 16 elements at a time, for two things the
//! compiler does not do on its own, which together took the update from 5.0-5.5 to 6.3 Gparam/s
//! on the GPU machine (16 threads, 1e9 parameters; `sluice bench adam`):
//! - streaming (non-temporal) stores for the bf16 copy: nothing on the CPU reads it back, so
//!   fetching its lines before overwriting them (read-for-ownership) is 2 wasted bytes of the
//!   32 an element would otherwise move; a few percent. Streaming master, m and v as well was
//!   slower: their lines were just read, so an ordinary store costs no extra traffic;
//! - software prefetch [`PREFETCH_BYTES`] ahead in each of the four arrays read, which keeps
//!   more misses in flight per core than the hardware prefetchers do; about 12%.
//!
//! The arithmetic is [`fused_element`]'s, operation for operation, in the same order and the same
//! IEEE single precision (vector multiply, add, divide, square root and fused multiply-add round
//! exactly as their scalar forms do), so the results are bit-identical to the portable body.

use std::arch::x86_64::*;

use super::{Chunk, Coeffs, fused_element};

/// How far ahead of the element being updated each array is prefetched. 1 KiB and 4 KiB measured
/// the same; the shorter distance wastes less at the end of each task.
const PREFETCH_BYTES: usize = 1024;

const LANES: usize = 16;

/// # Safety
/// The CPU must support AVX-512F and FMA.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn fused(c: Chunk<'_>, coeffs: &Coeffs, clip: f32) {
    if c.out.is_empty() {
        // SAFETY: this function's own requirement.
        unsafe { fused_impl::<false>(c, coeffs, clip) }
    } else {
        // SAFETY: as above.
        unsafe { fused_impl::<true>(c, coeffs, clip) }
    }
}

/// The update, writing the bf16 copy when `COPY` (then `out` has `p`'s length; else it is
/// empty and nothing is rounded).
///
/// # Safety
/// The CPU must support AVX-512F and FMA.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn fused_impl<const COPY: bool>(c: Chunk<'_>, coeffs: &Coeffs, clip: f32) {
    let Chunk { p, g, m, v, out } = c;
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    let mut none = [0u16; 1];
    // Without a copy every element writes its rounding to one discarded place.
    let out: &mut [u16] = if COPY { &mut out[..n] } else { &mut none };
    let at = |i: usize| if COPY { i } else { 0 };
    // Scalar elements until the bf16 copy reaches a 32-byte boundary, where 16 of its elements
    // fill one aligned store (streaming stores must be aligned).
    let head = if COPY { ((out.as_ptr() as usize).wrapping_neg() % 32 / 2).min(n) } else { 0 };
    for i in 0..head {
        fused_element(&mut p[i], g[i], &mut m[i], &mut v[i], &mut out[at(i)], coeffs, clip);
    }
    let end = head + (n - head) / LANES * LANES;

    let pp = p.as_mut_ptr();
    let gp = g.as_ptr();
    let mp = m.as_mut_ptr();
    let vp = v.as_mut_ptr();
    let op = out.as_mut_ptr();
    let clip_v = _mm512_set1_ps(clip);
    let decay = _mm512_set1_ps(coeffs.decay);
    let lerp = _mm512_set1_ps(coeffs.lerp_coeff);
    let beta2 = _mm512_set1_ps(coeffs.beta2);
    let one_minus_beta2 = _mm512_set1_ps(coeffs.one_minus_beta2);
    let bc2_sqrt = _mm512_set1_ps(coeffs.bc2_sqrt);
    let eps = _mm512_set1_ps(coeffs.eps);
    let neg_step = _mm512_set1_ps(coeffs.neg_step_size);
    let round = _mm512_set1_epi32(0x7FFF);
    let one = _mm512_set1_epi32(1);
    let quiet = _mm512_set1_epi32(0x0040);
    let ahead = PREFETCH_BYTES / 4;

    let mut i = head;
    while i < end {
        // A hint that never faults: past the arrays' end it is merely wasted, and
        // `wrapping_add` claims nothing about the address.
        _mm_prefetch::<_MM_HINT_T0>(gp.wrapping_add(i + ahead).cast());
        _mm_prefetch::<_MM_HINT_T0>(mp.wrapping_add(i + ahead).cast());
        _mm_prefetch::<_MM_HINT_T0>(vp.wrapping_add(i + ahead).cast());
        _mm_prefetch::<_MM_HINT_T0>(pp.wrapping_add(i + ahead).cast());
        // SAFETY: `i + LANES <= end <= n`, the length of all five arrays; unaligned loads.
        let (g, p, m, v) = unsafe {
            (
                _mm512_loadu_ps(gp.add(i)),
                _mm512_loadu_ps(pp.add(i)),
                _mm512_loadu_ps(mp.add(i)),
                _mm512_loadu_ps(vp.add(i)),
            )
        };
        // fused_element, operation for operation.
        let g = _mm512_mul_ps(g, clip_v);
        let decayed = _mm512_mul_ps(p, decay);
        let base = if coeffs.lerp_from_grad { g } else { m };
        let m_new = _mm512_fmadd_ps(lerp, _mm512_sub_ps(g, m), base);
        let v_new = _mm512_fmadd_ps(_mm512_mul_ps(one_minus_beta2, g), g, _mm512_mul_ps(v, beta2));
        let denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v_new), bc2_sqrt), eps);
        let p_new = _mm512_add_ps(decayed, _mm512_div_ps(_mm512_mul_ps(neg_step, m_new), denom));
        // SAFETY: in bounds as for the loads.
        unsafe {
            _mm512_storeu_ps(pp.add(i), p_new);
            _mm512_storeu_ps(mp.add(i), m_new);
            _mm512_storeu_ps(vp.add(i), v_new);
        }
        i += LANES;
        if !COPY {
            continue;
        }
        // bf16_bits: round to nearest even, NaN kept quiet.
        let bits = _mm512_castps_si512(p_new);
        let high = _mm512_srli_epi32::<16>(bits);
        let bias = _mm512_add_epi32(round, _mm512_and_si512(high, one));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, bias));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(p_new, p_new);
        let half = _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(high, quiet));
        let half = _mm512_cvtepi32_epi16(half);
        // SAFETY: in bounds as for the loads (`i` has moved on by LANES). The streaming store
        // needs `op + i` 32-byte aligned: the head ended on a 32-byte boundary and `i - head`
        // is a multiple of 16 two-byte elements.
        unsafe { _mm256_stream_si256(op.add(i - LANES).cast(), half) };
    }
    // Streaming stores are weakly ordered: fence them before the caller's synchronisation (the
    // end of the parallel loop, then the unit's lock) publishes the memory.
    _mm_sfence();
    for i in end..n {
        fused_element(&mut p[i], g[i], &mut m[i], &mut v[i], &mut out[at(i)], coeffs, clip);
    }
}
