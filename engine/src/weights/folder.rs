//! Saving a whole Hugging Face checkpoint folder (weights, `config.json`, tokenizer and
//! template files) so that the final name only ever holds a complete checkpoint.
//!
//! Everything is written into the sibling `.<name>.partial` and fsynced; only then does it take
//! the final name. An existing checkpoint is first renamed to `.<name>.old`, the new one renamed
//! in, and the old one removed. A crash therefore leaves either the old checkpoint or the new
//! one under `<name>`, except in the instant between the two renames, when `<name>` is absent
//! and the old checkpoint is intact under `.<name>.old`.

use std::ffi::OsString;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::weights::atomic::{sync_dir, write_file_atomically};
use crate::weights::read::{INDEX_FILE, SINGLE_FILE};
use crate::weights::write::{SaveDtype, TensorRef, write_json, write_safetensors};

/// The file transformers reads the architecture from.
pub const CONFIG_FILE: &str = "config.json";
/// The `config.json` key under which transformers records how a checkpoint's weights are
/// quantized.
const QUANTIZATION_KEY: &str = "quantization_config";

/// Everything a checkpoint folder holds.
#[derive(Debug, Clone)]
pub struct HfFolder<'a> {
    pub tensors: Vec<TensorRef<'a>>,
    pub dtype: SaveDtype,
    /// See [`write_safetensors`]; [`DEFAULT_MAX_SHARD_BYTES`](super::DEFAULT_MAX_SHARD_BYTES)
    /// matches transformers.
    pub max_shard_bytes: usize,
    /// Written as `config.json`, pretty-printed.
    pub config: serde_json::Value,
    /// Other files written verbatim, as (file name, bytes): `tokenizer.json`,
    /// `tokenizer_config.json`, `special_tokens_map.json`, `chat_template.jinja`,
    /// `generation_config.json`, whichever the caller has.
    pub extra_files: Vec<(String, Vec<u8>)>,
}

/// Writes `files` as the checkpoint folder `dest`, replacing any existing one only once the new
/// one is complete on disk. The parent folder is created if needed.
pub fn save_hf_folder(dest: impl AsRef<Path>, files: &HfFolder<'_>) -> Result<()> {
    let dest = dest.as_ref();
    check_extra_names(files)?;
    let name = dest.file_name().ok_or_else(|| {
        Error::invalid(format!("checkpoint folder {} has no final name", dest.display()))
    })?;
    let parent = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    fs::create_dir_all(&parent).map_err(|e| Error::io(&parent, e))?;
    let partial = parent.join(hidden_sibling(name, "partial"));
    let old = parent.join(hidden_sibling(name, "old"));

    // A `.partial` can only be left by a save that crashed; it holds nothing worth keeping.
    remove_any(&partial)?;
    fs::create_dir(&partial).map_err(|e| Error::io(&partial, e))?;
    if let Err(e) = fill(&partial, files) {
        // Best effort: the original error is the one worth reporting.
        let _ = fs::remove_dir_all(&partial);
        return Err(e);
    }

    if fs::symlink_metadata(dest).is_ok() {
        remove_any(&old)?;
        fs::rename(dest, &old).map_err(|e| Error::io(dest, e))?;
        if let Err(e) = fs::rename(&partial, dest) {
            // Put the previous checkpoint back rather than leave the name empty.
            let _ = fs::rename(&old, dest);
            return Err(Error::io(dest, e));
        }
        sync_dir(&parent)?;
        remove_any(&old)?;
    } else {
        fs::rename(&partial, dest).map_err(|e| Error::io(dest, e))?;
    }
    sync_dir(&parent)
}

fn fill(dir: &Path, files: &HfFolder<'_>) -> Result<()> {
    write_safetensors(dir, &files.tensors, files.dtype, files.max_shard_bytes)?;
    write_json(&dir.join(CONFIG_FILE), &unquantized_config(&files.config))?;
    for (name, bytes) in &files.extra_files {
        write_file_atomically(&dir.join(name), |w| w.write_all(bytes))?;
    }
    sync_dir(dir)
}

/// The config without `quantization_config`. The tensors written here are plain F32 or BF16,
/// whatever the model was read from; a `quantization_config` carried over from the source
/// (gpt-oss's `{"quant_method": "mxfp4"}`, whose experts [`TensorSource`](super::TensorSource)
/// dequantised) would make transformers look for packed `_blocks` and `_scales` tensors that
/// are not there.
fn unquantized_config(config: &serde_json::Value) -> std::borrow::Cow<'_, serde_json::Value> {
    match config {
        serde_json::Value::Object(map) if map.contains_key(QUANTIZATION_KEY) => {
            let mut map = map.clone();
            map.remove(QUANTIZATION_KEY);
            std::borrow::Cow::Owned(serde_json::Value::Object(map))
        }
        _ => std::borrow::Cow::Borrowed(config),
    }
}

/// Extra files must be plain names that do not collide with the weights, the config or each
/// other.
fn check_extra_names(files: &HfFolder<'_>) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for (name, _) in &files.extra_files {
        let plain = !name.is_empty()
            && name != "."
            && name != ".."
            && !name.contains(['/', '\\'])
            && !name.ends_with(".tmp");
        if !plain {
            return Err(Error::invalid(format!(
                "extra checkpoint file '{name}' must be a plain file name"
            )));
        }
        let reserved = name == CONFIG_FILE
            || name == SINGLE_FILE
            || name == INDEX_FILE
            || (name.starts_with("model-") && name.ends_with(".safetensors"));
        if reserved {
            return Err(Error::invalid(format!(
                "extra checkpoint file '{name}' would overwrite the weights or config"
            )));
        }
        if !seen.insert(name.as_str()) {
            return Err(Error::invalid(format!("extra checkpoint file '{name}' is given twice")));
        }
    }
    Ok(())
}

/// `.<name>.<suffix>`: hidden, beside the destination, on the same file system so the rename
/// is atomic.
fn hidden_sibling(name: &std::ffi::OsStr, suffix: &str) -> OsString {
    let mut s = OsString::from(".");
    s.push(name);
    s.push(".");
    s.push(suffix);
    s
}

/// Removes a file or folder tree if present.
fn remove_any(path: &Path) -> Result<()> {
    let result = match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    };
    result.map_err(|e| Error::io(path, e))
}
