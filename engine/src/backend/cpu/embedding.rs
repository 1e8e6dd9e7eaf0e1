//! Token embedding: a row lookup. Reference: `nn.Embedding` (`embed_tokens` in modeling_llama.py).

use rayon::prelude::*;

use super::check;
use crate::error::Result;

/// `out[t] = scale · table[ids[t]]` (Gemma's `Gemma3TextScaledWordEmbedding`: the lookup times
/// `sqrt(hidden)`; `scale` 1 is the plain lookup).
/// out `[tokens, hidden]`, ids `[tokens]` (a longer buffer's prefix), table `[V, hidden]`.
pub fn embedding_forward(
    out: &mut [f32],
    ids: &[i32],
    table: &[f32],
    tokens: usize,
    hidden: usize,
    scale: f32,
) -> Result<()> {
    const OP: &str = "embedding_forward";
    let vocab = table_rows(OP, table, hidden)?;
    check::len(OP, "out", out.len(), &[tokens, hidden])?;
    let ids = check::ints(OP, "ids", ids, tokens)?;
    check::ids(OP, "ids", ids, vocab)?;
    out.par_chunks_mut(hidden).zip(ids).for_each(|(row, &id)| {
        let start = id as usize * hidden;
        row.copy_from_slice(&table[start..start + hidden]);
        if scale != 1.0 {
            row.iter_mut().for_each(|x| *x *= scale);
        }
    });
    Ok(())
}

/// `dtable[ids[t]] += dout[t]` (accumulates). Tokens are visited in order, one thread, so a
/// repeated id sums its rows deterministically; this is `tokens x hidden` additions, negligible.
/// Each row is `scale · dout[t]` first, as autograd multiplies before the lookup's backward sums.
/// dtable `[V, hidden]`, dout `[tokens, hidden]`, ids `[tokens]`.
pub fn embedding_backward(
    dtable: &mut [f32],
    dout: &[f32],
    ids: &[i32],
    tokens: usize,
    hidden: usize,
    scale: f32,
) -> Result<()> {
    const OP: &str = "embedding_backward";
    let vocab = table_rows(OP, dtable, hidden)?;
    check::len(OP, "dout", dout.len(), &[tokens, hidden])?;
    let ids = check::ints(OP, "ids", ids, tokens)?;
    check::ids(OP, "ids", ids, vocab)?;
    for (grad, &id) in dout.chunks(hidden).zip(ids) {
        let start = id as usize * hidden;
        dtable[start..start + hidden].iter_mut().zip(grad).for_each(|(d, &g)| *d += g * scale);
    }
    Ok(())
}

/// Rows of a `[V, hidden]` table, whose length must be a whole number of rows.
fn table_rows(op: &str, table: &[f32], hidden: usize) -> Result<usize> {
    check::nonzero(op, "hidden", hidden)?;
    if !table.len().is_multiple_of(hidden) {
        return Err(check::err(
            op,
            format!("table has {} elements, not a whole number of rows of {hidden}", table.len()),
        ));
    }
    Ok(table.len() / hidden)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::{TOL, assert_close, numeric_grad, rng, to_f64, uniform};
    use crate::error::Result;

    const VOCAB: usize = 11;
    const HIDDEN: usize = 5;
    /// Id 3 appears three times, so its gradient rows must add up.
    const IDS: [i32; 7] = [3, 0, 3, 10, 7, 3, 1];

    #[test]
    fn forward_gathers_rows() -> Result<()> {
        let table = uniform(&mut rng(40), VOCAB * HIDDEN);
        let mut out = vec![f32::NAN; IDS.len() * HIDDEN];
        embedding_forward(&mut out, &IDS, &table, IDS.len(), HIDDEN, 1.0)?;
        for (row, &id) in out.chunks(HIDDEN).zip(&IDS) {
            let id = id as usize;
            assert_eq!(row, &table[id * HIDDEN..(id + 1) * HIDDEN]);
        }
        Ok(())
    }

    #[test]
    fn backward_accumulates_repeated_ids() -> Result<()> {
        let mut rng = rng(41);
        let (table, r, d0) = (
            uniform(&mut rng, VOCAB * HIDDEN),
            uniform(&mut rng, IDS.len() * HIDDEN),
            uniform(&mut rng, VOCAB * HIDDEN),
        );
        let r64 = to_f64(&r);
        let mut dtable = d0.clone();
        embedding_backward(&mut dtable, &r, &IDS, IDS.len(), HIDDEN, 1.0)?;
        let loss = |table: &[f64]| -> f64 {
            IDS.iter()
                .enumerate()
                .map(|(t, &id)| {
                    (0..HIDDEN)
                        .map(|h| table[id as usize * HIDDEN + h] * r64[t * HIDDEN + h])
                        .sum::<f64>()
                })
                .sum()
        };
        let grad = numeric_grad(&to_f64(&table), loss);
        let want: Vec<f64> = grad.iter().zip(&d0).map(|(g, &d)| g + f64::from(d)).collect();
        assert_close("embedding dtable (accumulated)", &dtable, &want, TOL);
        Ok(())
    }

    #[test]
    fn ids_outside_the_table_are_rejected() -> Result<()> {
        let table = vec![0.0; VOCAB * HIDDEN];
        let mut out = vec![0.0; 2 * HIDDEN];
        let e = embedding_forward(&mut out, &[1, VOCAB as i32], &table, 2, HIDDEN, 1.0)
            .expect_err("must be rejected");
        assert!(
            e.to_string().contains("embedding_forward")
                && e.to_string().contains("= 11 is outside 0..11"),
            "{e}"
        );
        let e = embedding_backward(&mut vec![0.0; VOCAB * HIDDEN], &out, &[-1, 0], 2, HIDDEN, 1.0)
            .expect_err("must be rejected");
        assert!(
            e.to_string().contains("embedding_backward") && e.to_string().contains("-1"),
            "{e}"
        );
        let e = embedding_forward(&mut out, &[1], &table, 2, HIDDEN, 1.0)
            .expect_err("must be rejected");
        assert!(e.to_string().contains("`ids`"), "{e}");
        Ok(())
    }

    #[test]
    fn a_longer_id_buffer_is_read_only_up_to_tokens() -> Result<()> {
        let table = uniform(&mut rng(42), VOCAB * HIDDEN);
        let mut out = vec![0.0; HIDDEN];
        embedding_forward(&mut out, &[2, 0, 0], &table, 1, HIDDEN, 1.0)?;
        assert_eq!(out, &table[2 * HIDDEN..3 * HIDDEN]);
        Ok(())
    }
}
