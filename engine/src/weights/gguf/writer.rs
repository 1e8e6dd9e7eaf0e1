//! Writing a GGUF file (version 3), the layout [`super::file`] reads: header, metadata, tensor
//! infos, then the data section at the next multiple of the alignment, each tensor at an
//! aligned offset. Reference: `gguf_writer.py` in gguf-py.
//!
//! Tensor offsets go in the header, so every tensor's size is known before any data is
//! written; the data itself is produced one tensor at a time by the caller, so a model is never
//! held in memory whole.

use std::io::{self, Write};

use super::file::MetaValue;
use super::quant::GgmlType;

/// The alignment of the data section and of every tensor in it (gguf-py's default).
pub const ALIGNMENT: usize = 32;

/// A tensor to write: its GGUF name, its row-major (PyTorch) shape and its encoding.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorPlan {
    pub name: String,
    pub shape: Vec<usize>,
    pub ggml_type: GgmlType,
}

impl TensorPlan {
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// Encoded size in bytes.
    pub fn bytes(&self) -> usize {
        self.elements() / self.ggml_type.block_elements() * self.ggml_type.block_bytes()
    }
}

/// Writes a whole GGUF file to `w`: `metadata` in the given order, then `tensors`, whose
/// encoded bytes `data(i)` returns for the i-th tensor (exactly [`TensorPlan::bytes`] of them;
/// anything else is an error, so offsets in the header never lie).
pub fn write_gguf(
    w: &mut impl Write,
    metadata: &[(String, MetaValue)],
    tensors: &[TensorPlan],
    mut data: impl FnMut(usize) -> io::Result<Vec<u8>>,
) -> io::Result<()> {
    let mut header = Vec::new();
    header.extend_from_slice(b"GGUF");
    header.extend_from_slice(&3u32.to_le_bytes());
    header.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    header.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata {
        put_string(&mut header, key);
        header.extend_from_slice(&type_id(value).to_le_bytes());
        put_value(&mut header, value)?;
    }
    let mut offset = 0usize;
    for t in tensors {
        put_string(&mut header, &t.name);
        header.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
        // GGUF lists extents fastest-varying first: the PyTorch shape reversed.
        for &d in t.shape.iter().rev() {
            header.extend_from_slice(&(d as u64).to_le_bytes());
        }
        header.extend_from_slice(&t.ggml_type.id().to_le_bytes());
        header.extend_from_slice(&(offset as u64).to_le_bytes());
        offset += t.bytes().next_multiple_of(ALIGNMENT);
    }
    header.resize(header.len().next_multiple_of(ALIGNMENT), 0);
    w.write_all(&header)?;
    for (i, t) in tensors.iter().enumerate() {
        let bytes = data(i)?;
        if bytes.len() != t.bytes() {
            return Err(io::Error::other(format!(
                "tensor {}: {} bytes encoded, {} expected",
                t.name,
                bytes.len(),
                t.bytes()
            )));
        }
        w.write_all(&bytes)?;
        let pad = bytes.len().next_multiple_of(ALIGNMENT) - bytes.len();
        w.write_all(&[0u8; ALIGNMENT][..pad])?;
    }
    Ok(())
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// The GGUF value type of `v` (gguf.h's `gguf_type`).
fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn put_value(out: &mut Vec<u8>, v: &MetaValue) -> io::Result<()> {
    match v {
        MetaValue::U8(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(u8::from(*x)),
        MetaValue::String(s) => put_string(out, s),
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Array(items) => {
            // An array holds one type; an empty one is written as an array of strings.
            let elem = items.first().map_or(8, type_id);
            if let Some(odd) = items.iter().find(|i| type_id(i) != elem) {
                return Err(io::Error::other(format!(
                    "a GGUF array holds one type: {} among {}",
                    odd.type_name(),
                    items[0].type_name()
                )));
            }
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item)?;
            }
        }
    }
    Ok(())
}
