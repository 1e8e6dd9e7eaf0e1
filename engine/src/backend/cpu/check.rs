//! Argument checks shared by the CPU ops. Every op validates all of its inputs before it writes
//! anything, so a rejected call leaves its outputs untouched.

use crate::backend::{AttentionShape, DecodeShape, IGNORE};
use crate::error::{Error, Result};

/// The backend error for `op`.
pub(crate) fn err(op: &str, message: impl std::fmt::Display) -> Error {
    Error::Backend { backend: "cpu".into(), message: format!("{op}: {message}") }
}

/// The product of `dims`, or an error if it overflows `usize`.
pub(crate) fn product(op: &str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| err(op, format!("sizes {dims:?} overflow")))
}

/// Checks that the float slice `name` holds exactly `Π dims` elements.
pub(crate) fn len(op: &str, name: &str, actual: usize, dims: &[usize]) -> Result<()> {
    let expected = product(op, dims)?;
    if actual == expected {
        return Ok(());
    }
    let shape = dims.iter().map(usize::to_string).collect::<Vec<_>>().join(" x ");
    Err(err(op, format!("`{name}` has {actual} elements, expected {expected} ([{shape}])")))
}

/// Int buffers may be allocated for the largest batch and filled only in part (see
/// `Device::upload_ints`), so they need at least `needed` elements and only that prefix is read.
pub(crate) fn ints<'a>(op: &str, name: &str, buf: &'a [i32], needed: usize) -> Result<&'a [i32]> {
    buf.get(..needed).ok_or_else(|| {
        err(op, format!("`{name}` has {} elements, expected at least {needed}", buf.len()))
    })
}

/// Checks that a size used as a divisor or a row width is not zero.
pub(crate) fn nonzero(op: &str, name: &str, value: usize) -> Result<()> {
    if value == 0 {
        return Err(err(op, format!("`{name}` must be at least 1")));
    }
    Ok(())
}

/// Checks every id against a table of `rows` rows.
pub(crate) fn ids(op: &str, name: &str, ids: &[i32], rows: usize) -> Result<()> {
    match ids.iter().position(|&id| usize::try_from(id).map_or(true, |id| id >= rows)) {
        None => Ok(()),
        Some(t) => Err(err(op, format!("`{name}`[{t}] = {} is outside 0..{rows}", ids[t]))),
    }
}

/// Checks every target: a row of the table or [`IGNORE`].
pub(crate) fn targets(op: &str, targets: &[i32], vocab: usize) -> Result<()> {
    let bad = targets
        .iter()
        .position(|&id| id != IGNORE && usize::try_from(id).map_or(true, |id| id >= vocab));
    match bad {
        None => Ok(()),
        Some(t) => Err(err(
            op,
            format!(
                "`targets`[{t}] = {} is neither in 0..{vocab} nor IGNORE ({IGNORE})",
                targets[t]
            ),
        )),
    }
}

/// Checks the head counts of an attention shape and returns `Dqkv`.
pub(crate) fn attention_shape(op: &str, shape: &AttentionShape) -> Result<usize> {
    nonzero(op, "head_dim", shape.head_dim)?;
    nonzero(op, "kv_heads", shape.kv_heads)?;
    if !shape.q_heads.is_multiple_of(shape.kv_heads) {
        return Err(err(
            op,
            format!("q_heads {} is not a multiple of kv_heads {}", shape.q_heads, shape.kv_heads),
        ));
    }
    if shape.window == Some(0) {
        return Err(err(op, "a sliding window of 0 tokens leaves a query nothing to attend to"));
    }
    product(op, &[shape.q_heads + 2 * shape.kv_heads, shape.head_dim])
}

/// Checks `cu_seqlens` (`docs + 1` bounds from 0 to `tokens`, non-decreasing) and returns, for
/// each token, the bounds `(first, end)` of its document.
pub(crate) fn documents(
    op: &str,
    cu_seqlens: &[i32],
    shape: &AttentionShape,
) -> Result<Vec<(usize, usize)>> {
    let cu = ints(op, "cu_seqlens", cu_seqlens, shape.docs + 1)?;
    if cu.first() != Some(&0) {
        return Err(err(op, format!("`cu_seqlens` must start at 0, got {cu:?}")));
    }
    let mut docs = Vec::with_capacity(shape.tokens);
    for (d, pair) in cu.windows(2).enumerate() {
        let (start, end) = (pair[0], pair[1]);
        if end < start {
            return Err(err(
                op,
                format!("`cu_seqlens` decreases at document {d}: {start} then {end}"),
            ));
        }
        // `start` is ≥ 0 here: the sequence starts at 0 and never decreases.
        let (start, end) = (start as usize, end as usize);
        if end > shape.tokens {
            return Err(err(
                op,
                format!("`cu_seqlens`[{}] = {end} exceeds the token count {}", d + 1, shape.tokens),
            ));
        }
        docs.resize(end, (start, end));
    }
    if docs.len() != shape.tokens {
        return Err(err(
            op,
            format!("`cu_seqlens` must end at the token count {}, got {cu:?}", shape.tokens),
        ));
    }
    Ok(docs)
}

/// Checks the head counts and window of a decode shape (as [`attention_shape`] does) and that
/// its positions fit `usize`.
pub(crate) fn decode_shape(op: &str, shape: &DecodeShape) -> Result<()> {
    let as_attention = AttentionShape {
        tokens: shape.tokens,
        q_heads: shape.q_heads,
        kv_heads: shape.kv_heads,
        head_dim: shape.head_dim,
        docs: 1,
        window: shape.window,
        scale_dim: shape.scale_dim,
        softcap: shape.softcap,
    };
    attention_shape(op, &as_attention)?;
    shape
        .past
        .checked_add(shape.tokens)
        .map(|_| ())
        .ok_or_else(|| err(op, format!("past {} + tokens {} overflow", shape.past, shape.tokens)))
}
