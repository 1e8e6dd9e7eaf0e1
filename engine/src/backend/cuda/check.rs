//! Argument checks of the CUDA ops, done on the host before anything is launched, so a rejected
//! call leaves its outputs untouched. Int buffers keep a host copy of what was uploaded, so ids,
//! targets and document bounds are checked without reading the device.

use super::View;
use crate::backend::{AttentionShape, FloatKind, IGNORE};
use crate::error::{Error, Result};

pub(super) fn err(op: &str, message: impl std::fmt::Display) -> Error {
    Error::Backend { backend: "cuda".into(), message: format!("{op}: {message}") }
}

pub(super) fn product(op: &str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| err(op, format!("sizes {dims:?} overflow")))
}

/// Checks that the buffer `name` holds exactly `Π dims` elements.
pub(super) fn len(op: &str, name: &str, actual: usize, dims: &[usize]) -> Result<()> {
    let expected = product(op, dims)?;
    if actual == expected {
        return Ok(());
    }
    let shape = dims.iter().map(usize::to_string).collect::<Vec<_>>().join(" x ");
    Err(err(op, format!("`{name}` has {actual} elements, expected {expected} ([{shape}])")))
}

pub(super) fn nonzero(op: &str, name: &str, value: usize) -> Result<()> {
    if value == 0 {
        return Err(err(op, format!("`{name}` must be at least 1")));
    }
    Ok(())
}

/// Checks that a buffer holds the precision a kernel reads or writes directly.
pub(super) fn kind(op: &str, name: &str, v: &View<'_>, want: FloatKind) -> Result<()> {
    if v.kind() == want {
        return Ok(());
    }
    let (got, want) = (describe(v.kind()), describe(want));
    Err(err(op, format!("`{name}` is {got}, this op needs {want}")))
}

fn describe(k: FloatKind) -> &'static str {
    match k {
        FloatKind::Activation => "bf16 (FloatKind::Activation)",
        FloatKind::Accum => "f32 (FloatKind::Accum)",
    }
}

/// A size passed to a kernel as a 32-bit int.
pub(super) fn int(op: &str, name: &str, value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| err(op, format!("`{name}` = {value} exceeds 2^31 - 1")))
}

/// The prefix of an int buffer's host copy that the op reads.
pub(super) fn ints<'a>(op: &str, name: &str, host: &'a [i32], needed: usize) -> Result<&'a [i32]> {
    host.get(..needed).ok_or_else(|| {
        err(op, format!("`{name}` has {} elements, expected at least {needed}", host.len()))
    })
}

pub(super) fn ids(op: &str, name: &str, ids: &[i32], rows: usize) -> Result<()> {
    match ids.iter().position(|&id| usize::try_from(id).map_or(true, |id| id >= rows)) {
        None => Ok(()),
        Some(t) => Err(err(op, format!("`{name}`[{t}] = {} is outside 0..{rows}", ids[t]))),
    }
}

pub(super) fn targets(op: &str, targets: &[i32], vocab: usize) -> Result<()> {
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

/// Checks the head counts and returns `Dqkv`.
pub(super) fn attention_shape(op: &str, shape: &AttentionShape) -> Result<usize> {
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

/// Checks `cu_seqlens`: `docs + 1` bounds from 0 to `tokens`, never decreasing.
pub(super) fn documents(op: &str, cu: &[i32], shape: &AttentionShape) -> Result<()> {
    let cu = ints(op, "cu_seqlens", cu, shape.docs + 1)?;
    if cu.first() != Some(&0) {
        return Err(err(op, format!("`cu_seqlens` must start at 0, got {cu:?}")));
    }
    for (d, pair) in cu.windows(2).enumerate() {
        if pair[1] < pair[0] {
            return Err(err(
                op,
                format!("`cu_seqlens` decreases at document {d}: {} then {}", pair[0], pair[1]),
            ));
        }
    }
    let last = cu.last().copied().unwrap_or(0);
    if usize::try_from(last).ok() != Some(shape.tokens) {
        return Err(err(
            op,
            format!("`cu_seqlens` must end at the token count {}, got {cu:?}", shape.tokens),
        ));
    }
    Ok(())
}
