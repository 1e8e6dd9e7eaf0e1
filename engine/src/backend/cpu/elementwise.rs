//! Residual additions and the reductions behind loss and gradient-norm bookkeeping.
//!
//! Reductions run over fixed-size chunks whose partial sums are combined in chunk order, so a
//! result does not depend on how many threads computed it.

use rayon::prelude::*;

use super::check;
use crate::error::Result;

/// Elements per partial sum: large enough to amortise a task, small enough to spread over cores;
/// the same as `optim::sum_of_squares`, so a norm summed here equals the reference loop's bits.
const SUM_CHUNK: usize = 1 << 16;

/// Rows per partial sum of a column reduction (bias and norm-weight gradients).
pub(crate) const ROWS_PER_PARTIAL: usize = 64;

/// `out = a + b`.
/// out `[n]`, a `[n]`, b `[n]`.
pub fn add(out: &mut [f32], a: &[f32], b: &[f32]) -> Result<()> {
    const OP: &str = "add";
    check::len(OP, "a", a.len(), &[out.len()])?;
    check::len(OP, "b", b.len(), &[out.len()])?;
    out.par_iter_mut().zip(a).zip(b).for_each(|((o, &a), &b)| *o = a + b);
    Ok(())
}

/// `dst += src`.
/// dst `[n]`, src `[n]`.
pub fn add_assign(dst: &mut [f32], src: &[f32]) -> Result<()> {
    check::len("add_assign", "src", src.len(), &[dst.len()])?;
    dst.par_iter_mut().zip(src).for_each(|(d, &s)| *d += s);
    Ok(())
}

/// `Σ src`, accumulated in f64.
/// src `[n]`.
pub fn sum(src: &[f32]) -> Result<f64> {
    Ok(chunked_sum(src, |x| x))
}

/// `Σ src²`, accumulated in f64.
/// src `[n]`.
pub fn sum_squares(src: &[f32]) -> Result<f64> {
    Ok(chunked_sum(src, |x| x * x))
}

fn chunked_sum(src: &[f32], f: impl Fn(f64) -> f64 + Sync) -> f64 {
    let partials: Vec<f64> =
        src.par_chunks(SUM_CHUNK).map(|c| c.iter().map(|&x| f(f64::from(x))).sum()).collect();
    partials.iter().sum()
}

/// Adds per-chunk f64 partial sums into an f32 accumulator, in chunk order.
/// dst `[n]`, each partial `[n]`.
pub(crate) fn add_partials(dst: &mut [f32], partials: &[Vec<f64>]) {
    for (j, d) in dst.iter_mut().enumerate() {
        let total: f64 = partials.iter().map(|p| p[j]).sum();
        *d = (f64::from(*d) + total) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::{assert_close, rng, to_f64, uniform};
    use crate::error::Result;

    #[test]
    fn add_and_add_assign() -> Result<()> {
        let mut rng = rng(100);
        let (a, b) = (uniform(&mut rng, 9), uniform(&mut rng, 9));
        let mut out = vec![f32::NAN; 9];
        add(&mut out, &a, &b)?;
        let want: Vec<f64> = a.iter().zip(&b).map(|(&a, &b)| f64::from(a) + f64::from(b)).collect();
        assert_close("add", &out, &want, 1e-7);
        let mut dst = a.clone();
        add_assign(&mut dst, &b)?;
        assert_eq!(dst, out);
        let e = add(&mut out, &a, &b[1..]).expect_err("must be rejected");
        assert!(e.to_string().contains("add") && e.to_string().contains("`b`"), "{e}");
        Ok(())
    }

    #[test]
    fn sums_are_accumulated_in_f64() -> Result<()> {
        // 1 + 2^-24 · 2^20: in f32 each tiny term would vanish against the 1.
        let mut x = vec![2f32.powi(-24); 1 << 20];
        x[0] = 1.0;
        let want = 1.0 + f64::from(2f32.powi(-24)) * ((1 << 20) - 1) as f64;
        assert_eq!(sum(&x)?, want);
        let y = uniform(&mut rng(101), 3 * SUM_CHUNK + 5);
        let want: f64 = to_f64(&y).iter().map(|v| v * v).sum();
        assert!((sum_squares(&y)? - want).abs() < 1e-9 * want, "sum_squares");
        Ok(())
    }
}
