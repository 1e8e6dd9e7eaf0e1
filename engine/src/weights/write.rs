//! Writing f32 tensors as Hugging Face safetensors, sharded as transformers shards them:
//! one file `model.safetensors`, or `model-00001-of-0000N.safetensors` shards plus
//! `model.safetensors.index.json` (reference: `PreTrainedModel.save_pretrained` and
//! `huggingface_hub.split_torch_state_dict_into_shards`).
//!
//! Every file is written atomically; for a sharded checkpoint the index is written last, so it
//! never names a shard that is not complete. A tensor may also be given as the bytes it is stored
//! as elsewhere ([`TensorData::Stored`]), copied in its own dtype: a multimodal model's vision
//! tower, which Sluice does not train.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::fs;
use std::io::{self, Write};
use std::path::Path;

use half::bf16;

use crate::error::{Error, Result};
use crate::weights::atomic::{sync_dir, write_file_atomically};
use crate::weights::read::{Dtype, INDEX_FILE, SINGLE_FILE};

/// transformers' default `max_shard_size` ("5GB").
pub const DEFAULT_MAX_SHARD_BYTES: usize = 5_000_000_000;

/// Elements encoded per write call: bounds the staging buffer, keeps writes large.
const ENCODE_CHUNK: usize = 1 << 20;
/// Bytes of a stored tensor copied per write call, so a large one pages through its source's
/// mapping a piece at a time.
const COPY_CHUNK: usize = 8 << 20;

/// The dtype tensors are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SaveDtype {
    /// Bit for bit the f32 values given.
    F32,
    /// Rounded to nearest, ties to even (as PyTorch's `.to(torch.bfloat16)`).
    Bf16,
}

impl std::fmt::Display for SaveDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SaveDtype::F32 => "f32",
            SaveDtype::Bf16 => "bf16",
        })
    }
}

impl SaveDtype {
    pub fn bytes_per_element(self) -> usize {
        match self {
            SaveDtype::F32 => 4,
            SaveDtype::Bf16 => 2,
        }
    }

    /// The name safetensors headers use.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            SaveDtype::F32 => "F32",
            SaveDtype::Bf16 => "BF16",
        }
    }
}

/// A named tensor to write: row-major data of the given shape, f32 values written in the
/// folder's [`SaveDtype`], or stored bytes written as they are.
#[derive(Clone)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub shape: Vec<usize>,
    pub data: TensorData<'a>,
}

/// Reads values `start..start + out.len()` of a tensor into `out`.
pub type ReadValues<'a> = &'a (dyn Fn(usize, &mut [f32]) -> Result<()> + Sync);

/// A tensor's values: in memory, or read a chunk at a time as they are written (a training
/// state saved straight from the host store and the disk tier, without a copy of it all), or
/// bytes in a dtype of their own, copied unchanged (a tensor of another checkpoint, from its
/// memory mapping).
#[derive(Clone)]
pub enum TensorData<'a> {
    Slice(&'a [f32]),
    Read { len: usize, read: ReadValues<'a> },
    Stored { dtype: Dtype, bytes: &'a [u8] },
}

impl<'a> TensorData<'a> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            TensorData::Slice(s) => s.len(),
            TensorData::Read { len, .. } => *len,
            TensorData::Stored { dtype, bytes } => bytes.len() * 8 / dtype.bitsize().max(1),
        }
    }

    /// Bytes in the file when written in `dtype` (a stored tensor keeps its own).
    fn bytes_as(&self, dtype: SaveDtype) -> usize {
        match self {
            TensorData::Stored { bytes, .. } => bytes.len(),
            _ => self.len() * dtype.bytes_per_element(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values, where they are in memory.
    pub fn as_slice(&self) -> Option<&'a [f32]> {
        match self {
            TensorData::Slice(s) => Some(s),
            TensorData::Read { .. } | TensorData::Stored { .. } => None,
        }
    }
}

impl<'a> From<&'a [f32]> for TensorData<'a> {
    fn from(s: &'a [f32]) -> Self {
        TensorData::Slice(s)
    }
}

impl std::fmt::Debug for TensorRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorRef")
            .field("name", &self.name)
            .field("shape", &self.shape)
            .field("len", &self.data.len())
            .finish()
    }
}

/// Writes `tensors` into the existing folder `dir` as `dtype`, starting a new shard whenever the
/// next tensor would take the current one past `max_shard_bytes` (a tensor larger than that
/// gets a shard of its own; tensors keep the given order and never split).
///
/// The weight files of the other layout are removed afterwards (a stale `model.safetensors`
/// would otherwise shadow a new sharded index for readers, which look for it first).
pub fn write_safetensors(
    dir: impl AsRef<Path>,
    tensors: &[TensorRef<'_>],
    dtype: SaveDtype,
    max_shard_bytes: usize,
) -> Result<()> {
    let dir = dir.as_ref();
    validate(tensors, max_shard_bytes)?;
    let shards = plan_shards(tensors, dtype, max_shard_bytes);

    if let [only] = shards.as_slice() {
        write_shard(&dir.join(SINGLE_FILE), only, dtype)?;
        remove_if_present(&dir.join(INDEX_FILE))?;
    } else {
        let count = shards.len();
        let mut weight_map = BTreeMap::new();
        for (i, shard) in shards.iter().enumerate() {
            let file_name = shard_file_name(i + 1, count);
            write_shard(&dir.join(&file_name), shard, dtype)?;
            for t in shard {
                weight_map.insert(t.name.to_string(), file_name.clone());
            }
        }
        let total_size: usize = tensors.iter().map(|t| t.data.bytes_as(dtype)).sum();
        let index = serde_json::json!({
            "metadata": { "total_size": total_size },
            "weight_map": weight_map,
        });
        write_json(&dir.join(INDEX_FILE), &index)?;
        remove_if_present(&dir.join(SINGLE_FILE))?;
    }
    sync_dir(dir)
}

/// `model-00001-of-00003.safetensors`, as transformers names shards.
pub fn shard_file_name(index: usize, count: usize) -> String {
    format!("model-{index:05}-of-{count:05}.safetensors")
}

/// Writes `value` as pretty JSON with a final newline, atomically (transformers' layout for
/// `config.json` and the index).
pub(crate) fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    write_file_atomically(path, |w| {
        serde_json::to_writer_pretty(&mut *w, value)?;
        w.write_all(b"\n")
    })
}

fn validate(tensors: &[TensorRef<'_>], max_shard_bytes: usize) -> Result<()> {
    if max_shard_bytes == 0 {
        return Err(Error::invalid("max_shard_bytes must be at least 1"));
    }
    let mut seen = HashSet::new();
    for t in tensors {
        if t.name.is_empty() || t.name == "__metadata__" {
            return Err(Error::invalid(format!(
                "tensor name '{}' cannot be stored in safetensors",
                t.name
            )));
        }
        if !seen.insert(t.name) {
            return Err(Error::invalid(format!("tensor '{}' is given twice", t.name)));
        }
        let numel = t.shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        if let TensorData::Stored { dtype, bytes } = t.data {
            let bits = numel.and_then(|n| n.checked_mul(dtype.bitsize()));
            let want = bits.filter(|b| b.is_multiple_of(8)).map(|b| b / 8);
            if want != Some(bytes.len()) {
                return Err(Error::invalid(format!(
                    "tensor '{}': shape {:?} of {dtype} does not match its {} bytes",
                    t.name,
                    t.shape,
                    bytes.len()
                )));
            }
        } else if numel != Some(t.data.len()) {
            return Err(Error::invalid(format!(
                "tensor '{}': shape {:?} does not match its {} values",
                t.name,
                t.shape,
                t.data.len()
            )));
        }
    }
    Ok(())
}

/// Groups tensors into shards, in order, greedily.
fn plan_shards<'t, 'a>(
    tensors: &'t [TensorRef<'a>],
    dtype: SaveDtype,
    max_shard_bytes: usize,
) -> Vec<Vec<&'t TensorRef<'a>>> {
    let mut shards: Vec<Vec<&TensorRef<'a>>> = Vec::new();
    let mut current_bytes = 0usize;
    for t in tensors {
        let bytes = t.data.bytes_as(dtype);
        match shards.last_mut() {
            Some(current) if current_bytes.saturating_add(bytes) <= max_shard_bytes => {
                current.push(t);
                current_bytes += bytes;
            }
            _ => {
                shards.push(vec![t]);
                current_bytes = bytes;
            }
        }
    }
    // No tensors still makes one (empty) file, so a reader finds weights where it looks.
    if shards.is_empty() {
        shards.push(Vec::new());
    }
    shards
}

fn write_shard(path: &Path, tensors: &[&TensorRef<'_>], dtype: SaveDtype) -> Result<()> {
    let header = header_bytes(tensors, dtype);
    write_file_atomically(path, |w| {
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        let mut staging = Vec::with_capacity(ENCODE_CHUNK * dtype.bytes_per_element());
        let mut encoded = |w: &mut std::io::BufWriter<fs::File>, values: &[f32]| {
            staging.clear();
            encode(values, dtype, &mut staging);
            w.write_all(&staging)
        };
        let mut values = Vec::new();
        for t in tensors {
            match t.data {
                TensorData::Slice(s) => {
                    for chunk in s.chunks(ENCODE_CHUNK) {
                        encoded(w, chunk)?;
                    }
                }
                TensorData::Read { len, read } => {
                    for start in (0..len).step_by(ENCODE_CHUNK) {
                        values.resize((len - start).min(ENCODE_CHUNK), 0.0);
                        read(start, &mut values).map_err(io::Error::other)?;
                        encoded(w, &values)?;
                    }
                }
                // Another checkpoint's bytes, in their own dtype, as they are.
                TensorData::Stored { bytes, .. } => {
                    for chunk in bytes.chunks(COPY_CHUNK) {
                        w.write_all(chunk)?;
                    }
                }
            }
        }
        Ok(())
    })
}

/// The JSON header, tensors in the given order (offsets ascending), padded with spaces to a
/// multiple of 8 bytes so the data starts aligned, as the safetensors serializer does.
fn header_bytes(tensors: &[&TensorRef<'_>], dtype: SaveDtype) -> Vec<u8> {
    // transformers refuses to load a file whose metadata lacks "format": "pt".
    let mut header = String::from(r#"{"__metadata__":{"format":"pt"}"#);
    let mut offset = 0usize;
    for t in tensors {
        let end = offset + t.data.bytes_as(dtype);
        let shape: Vec<String> = t.shape.iter().map(usize::to_string).collect();
        let stored_as = match t.data {
            TensorData::Stored { dtype, .. } => dtype.to_string(),
            _ => dtype.safetensors_name().to_string(),
        };
        // `write!` into a String cannot fail.
        let _ = write!(
            header,
            r#",{}:{{"dtype":"{stored_as}","shape":[{}],"data_offsets":[{offset},{end}]}}"#,
            serde_json::Value::from(t.name),
            shape.join(","),
        );
        offset = end;
    }
    header.push('}');
    let mut bytes = header.into_bytes();
    bytes.resize(bytes.len().next_multiple_of(8), b' ');
    bytes
}

fn encode(values: &[f32], dtype: SaveDtype, out: &mut Vec<u8>) {
    match dtype {
        SaveDtype::F32 => values.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        SaveDtype::Bf16 => {
            values.iter().for_each(|&x| out.extend_from_slice(&bf16::from_f32(x).to_le_bytes()))
        }
    }
}

fn remove_if_present(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(Error::io(path, e)),
        _ => Ok(()),
    }
}
