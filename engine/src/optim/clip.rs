//! Global-norm gradient clipping with the semantics of `torch.nn.utils.clip_grad_norm_` (norm
//! type 2): `total_norm = sqrt(sum of g^2 over every gradient)`, `clip_coef = max_norm /
//! (total_norm + 1e-6)` clamped to at most 1, every gradient multiplied by it.
//!
//! The sum of squares is accumulated in f64, where torch sums in f32. At billions of elements an
//! f32 running sum stops growing once it dwarfs each new square (and a single square of a value
//! above ~1.8e19 overflows f32), so the norm would depend on the model's size and on how the
//! tensors are split. In f64 the total is accurate far beyond f32's precision, so the rounded
//! result agrees with torch's to about an ulp. Partial sums are added in a fixed order, so the
//! norm does not depend on the number of threads (exact resume needs that).
//!
//! The streaming schedule knows the norm only after the last unit's backward, so the pieces are
//! public: [`sum_of_squares`] per tensor as gradients land, [`clip_coef`] once, [`scale`] per
//! tensor. [`clip_grad_norm`] does all three for gradients held together.

use rayon::prelude::*;

use crate::error::{Error, Result};

/// Elements per rayon task when summing or scaling.
const CHUNK: usize = 64 * 1024;

/// Sum of squares of one gradient, in f64, deterministic for a given length.
pub fn sum_of_squares(grad: &[f32]) -> f64 {
    let partials: Vec<f64> = grad
        .par_chunks(CHUNK)
        .map(|chunk| chunk.iter().map(|&g| f64::from(g) * f64::from(g)).sum::<f64>())
        .collect();
    partials.iter().sum()
}

/// The clipping factor for a total norm, as torch computes it in f32 (`max_norm / (norm +
/// 1e-6)`, at most 1). Errors if the norm is not finite (NaN or infinite gradients), so the
/// caller can skip the step instead of writing NaN into the weights.
pub fn clip_coef(total_norm: f64, max_norm: f32) -> Result<f32> {
    if !total_norm.is_finite() {
        return Err(Error::Numerical(format!("gradient norm is {total_norm}")));
    }
    if !(max_norm.is_finite() && max_norm > 0.0) {
        return Err(Error::invalid(format!("max_grad_norm must be > 0, got {max_norm}")));
    }
    let norm = total_norm as f32;
    Ok((max_norm / (norm + 1e-6)).min(1.0))
}

/// Multiplies a gradient by `coef` in place.
pub fn scale(grad: &mut [f32], coef: f32) {
    grad.par_chunks_mut(CHUNK).for_each(|chunk| chunk.iter_mut().for_each(|g| *g *= coef));
}

/// Clips the gradients together to a global L2 norm of at most `max_norm` and returns the norm
/// before clipping (the value to log). When the norm is not finite, returns
/// [`Error::Numerical`] and leaves the gradients untouched.
pub fn clip_grad_norm(grads: &mut [&mut [f32]], max_norm: f32) -> Result<f32> {
    let total: f64 = grads.iter().map(|g| sum_of_squares(g)).sum::<f64>().sqrt();
    let coef = clip_coef(total, max_norm)?;
    // torch multiplies even when the factor is 1; skipping it is bit-identical and saves a pass.
    if coef < 1.0 {
        for g in grads.iter_mut() {
            scale(g, coef);
        }
    }
    Ok(total as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clips_only_when_the_norm_exceeds_the_maximum() {
        // Norm of (3, 4, 12) is 13.
        let (mut a, mut b) = (vec![3.0f32, 4.0], vec![12.0f32]);
        let norm = clip_grad_norm(&mut [&mut a, &mut b], 100.0).expect("finite");
        assert_eq!(norm, 13.0);
        assert_eq!((a.as_slice(), b.as_slice()), ([3.0f32, 4.0].as_slice(), [12.0f32].as_slice()));

        let norm = clip_grad_norm(&mut [&mut a, &mut b], 1.0).expect("finite");
        assert_eq!(norm, 13.0, "returns the norm before clipping");
        let coef = 1.0f32 / (13.0 + 1e-6);
        assert_eq!(a, [3.0 * coef, 4.0 * coef]);
        assert_eq!(b, [12.0 * coef]);
        let after = (sum_of_squares(&a) + sum_of_squares(&b)).sqrt();
        assert!((after - 1.0).abs() < 1e-6, "clipped norm {after}");
    }

    #[test]
    fn coefficient_is_torchs_and_at_most_one() {
        assert_eq!(clip_coef(0.5, 1.0).expect("finite"), 1.0);
        assert_eq!(clip_coef(2.0, 1.0).expect("finite"), 1.0f32 / (2.0 + 1e-6));
        // Just below the maximum: 1 / (norm + 1e-6) is still above 1, so no clipping.
        assert_eq!(clip_coef(0.9999, 1.0).expect("finite"), 1.0);
    }

    #[test]
    fn non_finite_norm_is_an_error_and_changes_nothing() {
        let mut a = vec![1.0f32, f32::NAN];
        let mut b = vec![5.0f32];
        let err = clip_grad_norm(&mut [&mut a, &mut b], 1.0).expect_err("NaN gradient");
        assert!(matches!(err, Error::Numerical(_)), "{err}");
        assert!(err.to_string().contains("NaN"), "{err}");
        assert_eq!(b, [5.0]);
        let mut c = vec![f32::INFINITY];
        let err = clip_grad_norm(&mut [&mut c], 1.0).expect_err("infinite gradient");
        assert!(err.to_string().contains("inf"), "{err}");
        let err = clip_coef(1.0, 0.0).expect_err("max_norm 0");
        assert!(err.to_string().contains("max_grad_norm"), "{err}");
    }

    #[test]
    fn f64_sum_survives_values_whose_squares_overflow_f32() {
        let g = [3e19f32, 4e19];
        let norm = (sum_of_squares(&g)).sqrt();
        assert!((norm - 5e19).abs() / 5e19 < 1e-7, "{norm}");
    }

    #[test]
    fn sum_is_exact_across_chunks() {
        // 200k elements span several chunks; each square is 0.25, exactly representable.
        let g = vec![0.5f32; 200_000];
        assert_eq!(sum_of_squares(&g), 50_000.0);
    }
}
