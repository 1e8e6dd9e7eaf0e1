//! Reading tensors from Hugging Face safetensors: one file, or a folder holding either
//! `model.safetensors` or `model.safetensors.index.json` and the shards it names.
//!
//! Files are memory-mapped once at open and every header is checked then (offsets agree with
//! shape and dtype, data lies inside the file), so a truncated download fails at open with a
//! message that says so, not halfway through loading a model.
//!
//! File layout (reference: the safetensors format spec): an 8-byte little-endian header length
//! `n`, `n` bytes of JSON mapping each tensor name to `{dtype, shape, data_offsets: [begin,
//! end]}` (offsets relative to the end of the header) plus an optional `__metadata__` entry,
//! then the data, little-endian, row-major.
//!
//! A tensor stored as an MXFP4 pair, `<name>_blocks` and `<name>_scales` (gpt-oss's experts),
//! is also served under `<name>`, dequantised to f32 as transformers does it ([`super::mxfp4`]),
//! with the dequantised shape. Nothing is decoded until it is read, and a pair is checked only
//! when its tensor is asked for, so a file whose other tensors happen to end in `_blocks` opens
//! as before.
//!
//! A multimodal checkpoint's text tensors (`language_model.model.*` or
//! `model.language_model.*`, see [`super::multimodal`]) are also served under the text model's
//! own names (`model.*`, `lm_head.weight`), so its text model loads as from its own folder.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::path::{Component, Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use rayon::prelude::*;
use serde::Deserialize;

use super::multimodal::TextPrefix;
use super::mxfp4::{self, Mxfp4Shape};
use crate::error::{Error, Result};

pub use safetensors::Dtype;

/// The single-file weights name transformers writes and looks for first.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint, mapping each tensor name to its shard file.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The little-endian u64 that opens every safetensors file.
const HEADER_LEN_BYTES: usize = 8;
/// The safetensors crate's own limit: a larger header length means a garbled file.
const MAX_HEADER_BYTES: usize = 100_000_000;
/// Elements converted per parallel task; large enough that scheduling costs nothing.
const CONVERT_CHUNK: usize = 1 << 16;
/// The suffixes of an MXFP4 pair's tensors, as gpt-oss's checkpoints name them
/// (`...experts.gate_up_proj_blocks`, `...experts.gate_up_proj_scales`).
const BLOCKS_SUFFIX: &str = "_blocks";
const SCALES_SUFFIX: &str = "_scales";

/// Read access to every tensor of a safetensors file or Hugging Face model folder.
///
/// The files stay memory-mapped for the life of the value; reads copy out of the mapping. The
/// type is `Send + Sync`, so tensors can be read from several threads at once.
pub struct TensorSource {
    /// What was opened: the index for a sharded model, else the safetensors file. Named in
    /// errors about a tensor's absence, since that is the file that lists the tensors.
    origin: PathBuf,
    files: Vec<MappedFile>,
    /// The tensors as stored.
    tensors: BTreeMap<String, TensorEntry>,
    /// Tensors stored as MXFP4 pairs, under the name they dequantise to; never a name in
    /// `tensors` (a tensor stored under its own name wins over a pair).
    packed: BTreeMap<String, PackedPair>,
    /// How a multimodal checkpoint names its text model, if this is one.
    text_prefix: Option<TextPrefix>,
    /// A multimodal checkpoint's text tensors by the text model's own name, to the name they
    /// are stored (or, for an MXFP4 pair, served) under; never a name in `tensors` or `packed`.
    aliases: BTreeMap<String, String>,
}

/// The two stored tensors of an MXFP4 pair.
#[derive(Debug, Clone)]
struct PackedPair {
    blocks_name: String,
    blocks: TensorEntry,
    scales_name: String,
    scales: TensorEntry,
}

struct MappedFile {
    path: PathBuf,
    map: Mmap,
}

#[derive(Debug, Clone)]
struct TensorEntry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range within the whole file (header included), checked to lie inside it.
    begin: usize,
    end: usize,
}

/// One header entry as written; the dtype stays a string so an unknown one can be named.
#[derive(Deserialize)]
struct RawTensorInfo {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: [usize; 2],
}

#[derive(Deserialize)]
struct RawIndex {
    weight_map: BTreeMap<String, String>,
}

impl TensorSource {
    /// Opens a model folder (`model.safetensors`, else `model.safetensors.index.json` and its
    /// shards) or a single `.safetensors` file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if !meta.is_dir() {
            return Self::open_single(path);
        }
        let single = path.join(SINGLE_FILE);
        if single.is_file() {
            return Self::open_single(&single);
        }
        let index = path.join(INDEX_FILE);
        if index.is_file() {
            return Self::open_sharded(&index);
        }
        Err(Error::weights(
            path,
            format!("no weights in this folder: looked for {SINGLE_FILE} and {INDEX_FILE}"),
        ))
    }

    fn open_single(path: &Path) -> Result<Self> {
        let (file, entries) = map_and_parse(path)?;
        let tensors = entries.into_iter().map(|(name, entry)| (name, entry.in_file(0))).collect();
        Self::assemble(path, vec![file], tensors)
    }

    /// The source over its mapped files, with the MXFP4 pairs among `tensors` found (a pair's
    /// tensors may lie in different shards) and a multimodal checkpoint's text tensors named.
    fn assemble(
        origin: &Path,
        files: Vec<MappedFile>,
        tensors: BTreeMap<String, TensorEntry>,
    ) -> Result<Self> {
        let mut packed = BTreeMap::new();
        for (blocks_name, blocks) in &tensors {
            let Some(base) = blocks_name.strip_suffix(BLOCKS_SUFFIX) else { continue };
            let scales_name = format!("{base}{SCALES_SUFFIX}");
            let Some(scales) = tensors.get(&scales_name) else { continue };
            if !tensors.contains_key(base) {
                let pair = PackedPair {
                    blocks_name: blocks_name.clone(),
                    blocks: blocks.clone(),
                    scales_name,
                    scales: scales.clone(),
                };
                packed.insert(base.to_string(), pair);
            }
        }
        let text_prefix = TextPrefix::detect(tensors.keys().map(String::as_str))
            .map_err(|message| Error::weights(origin, message))?;
        let mut aliases = BTreeMap::new();
        if let Some(prefix) = text_prefix {
            for stored in tensors.keys().chain(packed.keys()) {
                let Some(text) = prefix.text(stored) else { continue };
                if !tensors.contains_key(&text) && !packed.contains_key(&text) {
                    aliases.insert(text, stored.clone());
                }
            }
        }
        Ok(Self { origin: origin.to_path_buf(), files, tensors, packed, text_prefix, aliases })
    }

    fn open_sharded(index_path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(index_path).map_err(|e| Error::io(index_path, e))?;
        let index: RawIndex = serde_json::from_str(&text).map_err(|e| {
            Error::weights(
                index_path,
                format!("garbled index (expected {{\"weight_map\": {{tensor: shard file}}}}): {e}"),
            )
        })?;
        let folder = index_path.parent().unwrap_or(Path::new(""));

        // Each shard is mapped once, however many tensors it holds.
        let mut files = Vec::new();
        let mut headers = Vec::new();
        let mut shard_ids: BTreeMap<&str, usize> = BTreeMap::new();
        let mut tensors = BTreeMap::new();
        for (name, shard) in &index.weight_map {
            let id = match shard_ids.get(shard.as_str()) {
                Some(&id) => id,
                None => {
                    let shard_path = shard_path(index_path, folder, name, shard)?;
                    let (file, header) = map_and_parse(&shard_path)?;
                    files.push(file);
                    headers.push(header);
                    shard_ids.insert(shard, files.len() - 1);
                    files.len() - 1
                }
            };
            let entry = headers.get(id).and_then(|h| h.get(name)).ok_or_else(|| {
                let shard_path =
                    files.get(id).map_or_else(|| folder.join(shard), |f| f.path.clone());
                Error::weights(
                    shard_path,
                    format!("{INDEX_FILE} puts tensor '{name}' in this shard, but it is not there"),
                )
            })?;
            tensors.insert(name.clone(), entry.clone().in_file(id));
        }
        Self::assemble(index_path, files, tensors)
    }

    /// The names of the tensors as stored, sorted: an MXFP4 pair appears as its `_blocks` and
    /// `_scales` tensors, not under the name it is also served by.
    pub fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    /// Whether `name` can be read: a stored tensor, the tensor an MXFP4 pair dequantises to, or
    /// a multimodal checkpoint's text tensor by the text model's own name.
    pub fn contains(&self, name: &str) -> bool {
        let name = self.resolve(name);
        self.tensors.contains_key(name) || self.packed.contains_key(name)
    }

    /// How this multimodal checkpoint names its text model's tensors; `None` for any other
    /// checkpoint.
    pub fn text_prefix(&self) -> Option<TextPrefix> {
        self.text_prefix
    }

    /// The name `name` is stored (or served, for an MXFP4 pair) under: itself, or for a
    /// multimodal checkpoint's text tensor asked for by the text model's name, the prefixed one.
    fn resolve<'n>(&'n self, name: &'n str) -> &'n str {
        self.aliases.get(name).map_or(name, String::as_str)
    }

    /// A stored tensor as it lies in the file: its dtype, shape and bytes (borrowed from the
    /// mapping), for copying it unchanged.
    pub(crate) fn stored(&self, name: &str) -> Result<(Dtype, Vec<usize>, &[u8])> {
        let entry = self.entry(name)?;
        let (_, bytes) = self.bytes(name, entry)?;
        Ok((entry.dtype, entry.shape.clone(), bytes))
    }

    /// Number of tensors as stored (as [`names`](Self::names) lists them).
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The file or index that was opened.
    pub fn path(&self) -> &Path {
        &self.origin
    }

    /// The shape [`read_f32`](Self::read_f32) returns: as stored, or for an MXFP4 pair the
    /// dequantised `[experts, in, out]` (checking the pair's shapes and dtypes).
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        let name = self.resolve(name);
        match self.packed.get(name) {
            Some(pair) => Ok(self.packed_shape(name, pair)?.dequantized().to_vec()),
            None => Ok(self.entry(name)?.shape.clone()),
        }
    }

    /// The dtype stored in the file; [`Dtype::F4`] for a tensor stored as an MXFP4 pair.
    pub fn dtype(&self, name: &str) -> Result<Dtype> {
        let name = self.resolve(name);
        match self.packed.get(name) {
            Some(_) => Ok(Dtype::F4),
            None => Ok(self.entry(name)?.dtype),
        }
    }

    /// Number of elements (the product of [`shape`](Self::shape)).
    pub fn numel(&self, name: &str) -> Result<usize> {
        let name = self.resolve(name);
        match self.packed.get(name) {
            // At most twice the blocks' bytes, which lie inside the file, so a header cannot
            // make `read_f32` allocate more than 8 bytes per byte on disk.
            Some(pair) => Ok(self.packed_shape(name, pair)?.numel()),
            None => Ok(self.entry(name)?.shape.iter().product()),
        }
    }

    /// Reads a tensor as f32. BF16, F16 and F32 convert exactly; F64 rounds to nearest; an
    /// MXFP4 pair dequantises exactly as transformers does ([`super::mxfp4`]).
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>> {
        let mut out = vec![0.0; self.numel(name)?];
        self.read_f32_into(name, &mut out)?;
        Ok(out)
    }

    /// Like [`read_f32`](Self::read_f32), into a buffer the caller owns (a slab of the host
    /// store, say), whose length must equal the tensor's element count.
    pub fn read_f32_into(&self, name: &str, out: &mut [f32]) -> Result<()> {
        let name = self.resolve(name);
        if let Some(pair) = self.packed.get(name) {
            return self.read_packed_into(name, pair, out);
        }
        let entry = self.entry(name)?;
        let (file, bytes) = self.bytes(name, entry)?;
        let numel: usize = entry.shape.iter().product();
        check_destination(file, name, &entry.shape, numel, out.len())?;
        match entry.dtype {
            Dtype::F32 => convert::<4>(bytes, out, f32::from_le_bytes),
            Dtype::BF16 => convert::<2>(bytes, out, |b| bf16::from_le_bytes(b).to_f32()),
            Dtype::F16 => convert::<2>(bytes, out, |b| f16::from_le_bytes(b).to_f32()),
            // Rounds to nearest; no model ships F64 weights that need more than f32 to train.
            Dtype::F64 => convert::<8>(bytes, out, |b| f64::from_le_bytes(b) as f32),
            other => {
                return Err(Error::weights(
                    &file.path,
                    format!(
                        "tensor '{name}' has dtype {other}, which cannot be read as floats \
                         (supported: F32, BF16, F16, F64)"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Dequantises an MXFP4 pair straight into `out`: no copy of the tensor but `out` itself.
    fn read_packed_into(&self, name: &str, pair: &PackedPair, out: &mut [f32]) -> Result<()> {
        let shape = self.packed_shape(name, pair)?;
        let (file, blocks) = self.bytes(&pair.blocks_name, &pair.blocks)?;
        let (_, scales) = self.bytes(&pair.scales_name, &pair.scales)?;
        check_destination(file, name, &shape.dequantized(), shape.numel(), out.len())?;
        mxfp4::dequantize_into(&shape, blocks, scales, out)
            .map_err(|message| Error::weights(&file.path, format!("tensor '{name}': {message}")))
    }

    /// A pair's dimensions, after checking that both tensors are U8 and their shapes agree.
    /// Errors name the file of the blocks and both tensors.
    fn packed_shape(&self, name: &str, pair: &PackedPair) -> Result<Mxfp4Shape> {
        let path = &self.file(&pair.blocks)?.path;
        let err = |message: String| {
            Error::weights(
                path,
                format!(
                    "tensor '{name}' is stored as MXFP4 blocks '{}' {:?} and scales '{}' {:?}, \
                     which cannot be dequantised: {message}",
                    pair.blocks_name, pair.blocks.shape, pair.scales_name, pair.scales.shape
                ),
            )
        };
        // Only U8 is the reference's encoding: it reads the scales' bytes as integers
        // (`scales.to(torch.int32)`), which an F8_E8M0 tensor's conversion would not give.
        for (part, entry) in [(&pair.blocks_name, &pair.blocks), (&pair.scales_name, &pair.scales)]
        {
            if entry.dtype != Dtype::U8 {
                return Err(err(format!("'{part}' has dtype {}, expected U8", entry.dtype)));
            }
        }
        Mxfp4Shape::new(&pair.blocks.shape, &pair.scales.shape).map_err(err)
    }

    fn entry(&self, name: &str) -> Result<&TensorEntry> {
        self.tensors.get(name).ok_or_else(|| {
            // Half an MXFP4 pair is worth naming: it is why the tensor is missing.
            let half = [(BLOCKS_SUFFIX, SCALES_SUFFIX), (SCALES_SUFFIX, BLOCKS_SUFFIX)]
                .into_iter()
                .find(|(have, _)| self.tensors.contains_key(&format!("{name}{have}")));
            // A multimodal checkpoint's text tensor, asked for by the text model's name, is
            // missing under its stored name.
            let stored = self
                .text_prefix
                .filter(|p| p.text(name).is_none())
                .map(|p| p.stored(name))
                .filter(|s| s != name);
            let message = match (half, stored) {
                (Some((have, lack)), _) => format!(
                    "no tensor named '{name}': there is '{name}{have}' but not '{name}{lack}', \
                     the other half of the MXFP4 pair that would store it"
                ),
                (None, Some(stored)) => format!(
                    "no tensor named '{stored}', where this multimodal checkpoint would store \
                     its text model's '{name}'"
                ),
                (None, None) => format!("no tensor named '{name}'"),
            };
            Error::weights(&self.origin, message)
        })
    }

    /// A stored tensor's file and bytes.
    fn bytes(&self, name: &str, entry: &TensorEntry) -> Result<(&MappedFile, &[u8])> {
        let file = self.file(entry)?;
        let bytes = file.map.get(entry.begin..entry.end).ok_or_else(|| {
            Error::weights(&file.path, format!("tensor '{name}': data range outside the file"))
        })?;
        Ok((file, bytes))
    }

    fn file(&self, entry: &TensorEntry) -> Result<&MappedFile> {
        self.files.get(entry.file).ok_or_else(|| {
            Error::weights(&self.origin, format!("internal: shard {} not mapped", entry.file))
        })
    }
}

impl fmt::Debug for TensorSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TensorSource")
            .field("origin", &self.origin)
            .field("files", &self.files.len())
            .field("tensors", &self.tensors.len())
            .field("packed", &self.packed.len())
            .field("text_prefix", &self.text_prefix)
            .finish()
    }
}

impl TensorEntry {
    fn in_file(self, file: usize) -> Self {
        Self { file, ..self }
    }
}

/// Refuses a destination whose length is not the tensor's element count.
fn check_destination(
    file: &MappedFile,
    name: &str,
    shape: &[usize],
    numel: usize,
    len: usize,
) -> Result<()> {
    if len == numel {
        return Ok(());
    }
    Err(Error::weights(
        &file.path,
        format!(
            "tensor '{name}' has shape {shape:?} ({numel} elements) but the destination holds \
             {len}"
        ),
    ))
}

/// Resolves a shard named by the index, refusing names that leave the model folder.
fn shard_path(index_path: &Path, folder: &Path, tensor: &str, shard: &str) -> Result<PathBuf> {
    let relative = Path::new(shard);
    if shard.is_empty() || !relative.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(Error::weights(
            index_path,
            format!(
                "garbled index: tensor '{tensor}' is mapped to '{shard}', which is not a file \
                 name in the model folder"
            ),
        ));
    }
    let path = folder.join(relative);
    if !path.is_file() {
        return Err(Error::weights(
            index_path,
            format!(
                "index names shard '{shard}' (for tensor '{tensor}'), which does not exist: {}",
                path.display()
            ),
        ));
    }
    Ok(path)
}

/// Maps a safetensors file and validates its header against the file's length.
fn map_and_parse(path: &Path) -> Result<(MappedFile, BTreeMap<String, TensorEntry>)> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the mapping is read-only and lives as long as `MappedFile`. Memory-mapping is
    // sound only while no one truncates or rewrites the file; model files are not modified in
    // place (Sluice's writers replace files by rename, which leaves this mapping intact).
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    let entries = parse_header(path, &map)?;
    Ok((MappedFile { path: path.to_path_buf(), map }, entries))
}

fn parse_header(path: &Path, bytes: &[u8]) -> Result<BTreeMap<String, TensorEntry>> {
    let err = |message: String| Error::weights(path, message);
    let file_len = bytes.len();
    let Some((len_bytes, rest)) = bytes.split_first_chunk::<HEADER_LEN_BYTES>() else {
        return Err(err(format!(
            "truncated: the file is {file_len} bytes, too short for the 8-byte header length"
        )));
    };
    let header_len = u64::from_le_bytes(*len_bytes);
    let header_len =
        usize::try_from(header_len).ok().filter(|&n| n <= MAX_HEADER_BYTES).ok_or_else(|| {
            err(format!(
                "garbled header: it claims {header_len} bytes, over the \
                 {MAX_HEADER_BYTES}-byte limit"
            ))
        })?;
    let header = rest.get(..header_len).ok_or_else(|| {
        err(format!(
            "truncated: the header claims {header_len} bytes but the file has only {} after \
             the length",
            rest.len()
        ))
    })?;
    let raw: BTreeMap<String, serde_json::Value> = serde_json::from_slice(header)
        .map_err(|e| err(format!("garbled header (not a JSON object): {e}")))?;

    let data_start = HEADER_LEN_BYTES + header_len;
    let mut entries = BTreeMap::new();
    for (name, value) in raw {
        if name == "__metadata__" {
            continue;
        }
        let info: RawTensorInfo = serde_json::from_value(value)
            .map_err(|e| err(format!("garbled header: tensor '{name}': {e}")))?;
        let dtype: Dtype = serde_json::from_value(serde_json::Value::String(info.dtype.clone()))
            .map_err(|_| err(format!("tensor '{name}' has unknown dtype '{}'", info.dtype)))?;
        let [begin, end] = info.data_offsets;
        let expected = byte_size(dtype, &info.shape).ok_or_else(|| {
            err(format!(
                "garbled header: tensor '{name}': shape {:?} of {dtype} is not a whole number \
                 of bytes or overflows",
                info.shape
            ))
        })?;
        if end < begin || end - begin != expected {
            return Err(err(format!(
                "garbled header: tensor '{name}': data_offsets [{begin}, {end}] do not match \
                 shape {:?} of {dtype}, which needs {expected} bytes",
                info.shape
            )));
        }
        let abs_end = data_start.checked_add(end).filter(|&e| e <= file_len).ok_or_else(|| {
            err(format!(
                "truncated: tensor '{name}' ends at byte {} but the file has only {file_len} bytes",
                data_start.saturating_add(end)
            ))
        })?;
        let entry = TensorEntry {
            file: 0,
            dtype,
            shape: info.shape,
            begin: data_start + begin,
            end: abs_end,
        };
        entries.insert(name, entry);
    }
    Ok(entries)
}

fn byte_size(dtype: Dtype, shape: &[usize]) -> Option<usize> {
    let numel = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))?;
    let bits = numel.checked_mul(dtype.bitsize())?;
    bits.is_multiple_of(8).then_some(bits / 8)
}

/// Decodes little-endian `N`-byte elements into `out`, in parallel for large tensors. The
/// caller has checked `bytes.len() == out.len() * N`.
fn convert<const N: usize>(bytes: &[u8], out: &mut [f32], decode: impl Fn([u8; N]) -> f32 + Sync) {
    out.par_chunks_mut(CONVERT_CHUNK).zip(bytes.par_chunks(CONVERT_CHUNK * N)).for_each(
        |(out, bytes)| {
            let (elements, _) = bytes.as_chunks::<N>();
            for (o, &b) in out.iter_mut().zip(elements) {
                *o = decode(b);
            }
        },
    );
}
