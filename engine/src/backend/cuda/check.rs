//! Argument checks of the CUDA ops, done on the host before anything is launched, so a rejected
//! call leaves its outputs untouched. Int buffers keep a host copy of what was uploaded, so ids,
//! targets and document bounds are checked without reading the device.

use super::View;
use crate::backend::cpu::check as shared;
use crate::backend::{AttentionShape, DecodeShape, FloatKind};
use crate::error::{Error, Result};

pub(super) fn err(op: &str, message: impl std::fmt::Display) -> Error {
    Error::Backend { backend: "cuda".into(), message: format!("{op}: {message}") }
}

// The checks that do not depend on the device are the CPU reference's, relabelled so the
// message names this backend.

/// Turns the CPU checks' `Error::Backend { backend: "cpu" }` into one that names CUDA.
fn relabel<T>(r: Result<T>) -> Result<T> {
    r.map_err(|e| match e {
        Error::Backend { message, .. } => Error::Backend { backend: "cuda".into(), message },
        other => other,
    })
}

/// Checks that the buffer `name` holds exactly `Π dims` elements.
pub(super) fn len(op: &str, name: &str, actual: usize, dims: &[usize]) -> Result<()> {
    relabel(shared::len(op, name, actual, dims))
}

pub(super) fn nonzero(op: &str, name: &str, value: usize) -> Result<()> {
    relabel(shared::nonzero(op, name, value))
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
    relabel(shared::ints(op, name, host, needed))
}

pub(super) fn ids(op: &str, name: &str, ids: &[i32], rows: usize) -> Result<()> {
    relabel(shared::ids(op, name, ids, rows))
}

pub(super) fn targets(op: &str, targets: &[i32], vocab: usize) -> Result<()> {
    relabel(shared::targets(op, targets, vocab))
}

/// Checks the head counts and returns `Dqkv`.
pub(super) fn attention_shape(op: &str, shape: &AttentionShape) -> Result<usize> {
    relabel(shared::attention_shape(op, shape))
}

/// Checks `cu_seqlens`: `docs + 1` bounds from 0 to `tokens`, never decreasing.
pub(super) fn documents(op: &str, cu: &[i32], shape: &AttentionShape) -> Result<()> {
    relabel(shared::documents(op, cu, shape)).map(|_| ())
}

/// Checks the head counts and window of a decode shape.
pub(super) fn decode_shape(op: &str, shape: &DecodeShape) -> Result<()> {
    relabel(shared::decode_shape(op, shape))
}
