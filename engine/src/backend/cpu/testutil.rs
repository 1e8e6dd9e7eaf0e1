//! Helpers for the CPU ops' tests: a seeded RNG, central differences in f64, and a comparison
//! that reports where it fails.
//!
//! Gradient checks compare each f32 backward against central differences of a double-precision
//! twin of the forward (written in the op's test, and itself checked against the f32 forward).
//! In f64 with step `STEP = 1e-4`, the truncation error is O(h²) ≈ 1e-8 relative for these
//! smooth functions and the rounding error about 1e-16 / h ≈ 1e-12, so the reference is good to
//! ~1e-8 and what the comparison measures is the f32 op's own rounding: ~1e-7 per operation,
//! growing with the short sums here (the largest seen is 5e-7). `TOL = 1e-5` leaves room for
//! that, while a real mistake (a missing term, a wrong index) is off by O(1).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub(crate) const STEP: f64 = 1e-4;
pub(crate) const TOL: f64 = 1e-5;

pub(crate) fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// `n` values uniform in [-1, 1).
pub(crate) fn uniform(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

pub(crate) fn to_f64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

pub(crate) fn dot(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "dot of different lengths");
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `∂f/∂x` by central differences, one element at a time.
pub(crate) fn numeric_grad(x: &[f64], f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let mut probe = x.to_vec();
    (0..x.len())
        .map(|i| {
            probe[i] = x[i] + STEP;
            let up = f(&probe);
            probe[i] = x[i] - STEP;
            let down = f(&probe);
            probe[i] = x[i];
            (up - down) / (2.0 * STEP)
        })
        .collect()
}

/// Asserts `|actual − expected| ≤ tol · (1 + |expected|)` everywhere; on failure names the worst
/// index and the first pairs. Prints and returns the largest scaled error.
#[track_caller]
pub(crate) fn assert_close(what: &str, actual: &[f32], expected: &[f64], tol: f64) -> f64 {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths differ");
    let errors: Vec<f64> = actual
        .iter()
        .zip(expected)
        .map(|(&a, &e)| (f64::from(a) - e).abs() / (1.0 + e.abs()))
        .collect();
    let (worst, max) = errors
        .iter()
        .copied()
        .enumerate()
        .fold((0, 0.0f64), |best, (i, e)| if e > best.1 || e.is_nan() { (i, e) } else { best });
    eprintln!("{what}: max scaled error {max:.2e} over {} elements", actual.len());
    let pairs: Vec<_> = actual.iter().zip(expected).take(6).collect();
    assert!(
        max <= tol,
        "{what}: error {max:.3e} > {tol:.1e} at index {worst} (got {}, want {}); first pairs {pairs:?}",
        actual[worst],
        expected[worst],
    );
    max
}
