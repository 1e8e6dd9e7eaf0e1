//! Reading a GGUF file (llama.cpp's single-file model format, versions 2 and 3): the header, the
//! metadata key/value pairs (every value type, arrays included), the tensor infos and the
//! aligned data section. Reference: `gguf.c` in ggml and the GGUF specification in ggml's docs.
//!
//! Layout (little-endian): magic `GGUF`, version `u32`, tensor count `u64`, metadata count `u64`;
//! each metadata pair is a string key, a `u32` value type and the value; each tensor info is a
//! string name, `u32` dimension count, that many `u64` extents (`ne[0]` varies fastest), a `u32`
//! ggml type and a `u64` offset from the start of the data section, which begins at the next
//! multiple of `general.alignment` (default 32) after the infos. Strings are a `u64` byte length
//! and UTF-8 bytes without a terminator.
//!
//! Every count and length is checked against the bytes that remain before anything is
//! allocated, so a truncated or garbled file fails with the offset where it went wrong.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::quant::GgmlType;
use crate::error::{Error, Result};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetaValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer, if it is an integer that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as a float, if it is a float or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The GGUF name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::F32(_) => "f32",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(_) => "array",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F64(_) => "f64",
        }
    }
}

/// Where a tensor's data lies and how it is encoded.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Extents as GGUF stores them: `dims[0]` varies fastest (the row length).
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Byte range inside the file.
    pub start: usize,
    pub len: usize,
}

impl TensorInfo {
    pub fn elements(&self) -> usize {
        self.dims.iter().product::<u64>() as usize
    }

    /// The row-major shape PyTorch uses: the GGUF extents reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// An open GGUF file: parsed header and metadata, tensor data memory-mapped.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    /// In file order.
    pub tensors: Vec<TensorInfo>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens and parses `path`; tensor data is read on demand by [`GgufFile::tensor_f32`].
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the mapping is read-only and lives as long as `GgufFile`. Memory-mapping is
        // sound only while no one truncates or rewrites the file; a model file being imported
        // is not modified in place.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let (version, metadata, tensors) = parse(&map).map_err(|m| Error::weights(path, m))?;
        Ok(GgufFile { path: path.to_path_buf(), map, version, metadata, tensors })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor (their length was checked at open).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        self.map.get(info.start..info.start + info.len).unwrap_or_default()
    }

    /// A tensor dequantised to f32, in GGUF's element order (row-major over the reversed dims).
    pub fn tensor_f32(&self, info: &TensorInfo) -> Result<Vec<f32>> {
        super::quant::dequantize(info.ggml_type, self.tensor_bytes(info), info.elements())
            .map_err(|m| Error::weights(&self.path, format!("tensor {}: {m}", info.name)))
    }
}

type Parsed = (u32, BTreeMap<String, MetaValue>, Vec<TensorInfo>);

/// Parses the whole header; errors are plain messages that the caller prefixes with the path.
pub(crate) fn parse(bytes: &[u8]) -> std::result::Result<Parsed, String> {
    let mut r = Reader { bytes, pos: 0 };
    let magic = r.take(4, "magic")?;
    if magic != MAGIC {
        return Err(format!("not a GGUF file (starts with {magic:02x?}, expected \"GGUF\")"));
    }
    let version = r.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(format!("GGUF version {version} is not supported (only 2 and 3)"));
    }
    let tensor_count = r.u64("tensor count")?;
    let kv_count = r.u64("metadata count")?;
    let mut metadata = BTreeMap::new();
    for i in 0..kv_count {
        let key = r.string(&format!("key of metadata entry {i}"))?;
        let ty = r.u32(&format!("type of metadata {key:?}"))?;
        let value = r.value(ty, &key, 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(format!("metadata key {key:?} appears twice"));
        }
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => v
            .as_u64()
            .filter(|a| *a > 0 && a.is_power_of_two())
            .ok_or_else(|| format!("general.alignment must be a power of two, got {v:?}"))?,
    };
    // Each info takes at least 24 bytes; refuse counts the file cannot hold before allocating.
    if tensor_count > (r.remaining() / 24) as u64 {
        return Err(format!(
            "tensor count {tensor_count} cannot fit in the {} bytes left (truncated file?)",
            r.remaining()
        ));
    }
    let mut raw = Vec::with_capacity(tensor_count as usize);
    for i in 0..tensor_count {
        let name = r.string(&format!("name of tensor {i}"))?;
        let n_dims = r.u32(&format!("dimension count of tensor {name}"))?;
        if n_dims == 0 || n_dims > 4 {
            return Err(format!("tensor {name} has {n_dims} dimensions (GGUF allows 1 to 4)"));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(r.u64(&format!("extents of tensor {name}"))?);
        }
        let ty = r.u32(&format!("type of tensor {name}"))?;
        let ggml_type = GgmlType::from_id(ty).ok_or_else(|| {
            format!(
                "tensor {name} has ggml type {ty}, which Sluice cannot dequantise (supported: {})",
                GgmlType::supported_names()
            )
        })?;
        let offset = r.u64(&format!("offset of tensor {name}"))?;
        raw.push((name, dims, ggml_type, offset));
    }
    let data_start = (r.pos as u64).div_ceil(alignment) * alignment;
    let mut tensors = Vec::with_capacity(raw.len());
    for (name, dims, ggml_type, offset) in raw {
        let elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
        let elements = elements
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("tensor {name} has invalid extents {dims:?}"))?;
        let row = dims[0];
        if row % ggml_type.block_elements() as u64 != 0 {
            return Err(format!(
                "tensor {name}: row length {row} is not a multiple of {}'s block of {}",
                ggml_type.name(),
                ggml_type.block_elements()
            ));
        }
        if offset % alignment != 0 {
            return Err(format!("tensor {name}: offset {offset} is not aligned to {alignment}"));
        }
        let len = (elements / ggml_type.block_elements() as u64)
            .checked_mul(ggml_type.block_bytes() as u64)
            .ok_or_else(|| format!("tensor {name} has extents {dims:?} too large to address"))?;
        let start = data_start.checked_add(offset);
        let end = start.and_then(|s| s.checked_add(len));
        match (start, end) {
            (Some(start), Some(end)) if end <= bytes.len() as u64 => tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                start: start as usize,
                len: len as usize,
            }),
            _ => {
                return Err(format!(
                    "tensor {name} ({} bytes at offset {offset} of the data section) runs past \
                     the end of the file ({} bytes): truncated file",
                    len,
                    bytes.len()
                ));
            }
        }
    }
    Ok((version, metadata, tensors))
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

/// Arrays nested deeper than this are refused (GGUF writers produce depth 1).
const MAX_DEPTH: usize = 4;

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> std::result::Result<&'a [u8], String> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or_else(|| {
            format!(
                "truncated file: {what} needs {n} bytes at offset {} but only {} remain",
                self.pos,
                self.remaining()
            )
        })?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> std::result::Result<[u8; N], String> {
        let s = self.take(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> std::result::Result<String, String> {
        let len = self.u64(what)?;
        let len = usize::try_from(len).map_err(|_| format!("{what}: length {len} too large"))?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| format!("{what} is not UTF-8: {e}"))
    }

    fn value(
        &mut self,
        ty: u32,
        key: &str,
        depth: usize,
    ) -> std::result::Result<MetaValue, String> {
        let what = &format!("value of metadata {key:?}");
        Ok(match ty {
            0 => MetaValue::U8(u8::from_le_bytes(self.array(what)?)),
            1 => MetaValue::I8(i8::from_le_bytes(self.array(what)?)),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => MetaValue::U32(u32::from_le_bytes(self.array(what)?)),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)? {
                [0] => MetaValue::Bool(false),
                [1] => MetaValue::Bool(true),
                [b] => return Err(format!("{what}: bool byte {b} is neither 0 nor 1")),
            },
            8 => MetaValue::String(self.string(what)?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(format!("{what}: arrays nested deeper than {MAX_DEPTH}"));
                }
                let elem = self.u32(what)?;
                let n = self.u64(what)?;
                // Every element takes at least one byte: a larger count means a garbled file.
                if n > self.remaining() as u64 {
                    return Err(format!(
                        "truncated file: {what} claims {n} elements but only {} bytes remain",
                        self.remaining()
                    ));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(u64::from_le_bytes(self.array(what)?)),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(what)?)),
            other => return Err(format!("{what} has unknown value type {other}")),
        })
    }
}
