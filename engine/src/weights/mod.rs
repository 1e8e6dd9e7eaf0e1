//! Weights in and out, in Hugging Face's safetensors layout.
//!
//! - [`TensorSource`] reads a model folder (single `model.safetensors`, or a sharded
//!   `model.safetensors.index.json` and its shards) or one `.safetensors` file, memory-mapped,
//!   converting BF16/F16/F32/F64 to f32. Headers are validated at open: truncated or garbled
//!   files fail there, naming the file. Tensors stored as MXFP4 pairs (`<name>_blocks` and
//!   `<name>_scales`, gpt-oss's experts) are served under `<name>`, dequantised by [`mxfp4`]
//!   exactly as transformers dequantises them.
//! - [`write_safetensors`] writes f32 tensors as F32 or BF16 (round to nearest even), sharded
//!   and indexed as transformers does, each file atomically.
//! - [`save_hf_folder`] writes a whole checkpoint folder (weights, `config.json`, tokenizer and
//!   template files) that transformers loads as is, never leaving a half-written checkpoint
//!   under its final name.
//! - [`Bf16Safetensors`] reads an f32 safetensors file as its bf16 twin, converted while read
//!   (downloads in bf16 of checkpoints saved in f32).
//! - [`multimodal`]: a multimodal checkpoint's text model (Gemma 3's
//!   `Gemma3ForConditionalGeneration`) is read under either of its prefixes ([`TextPrefix`]), and
//!   [`Passthrough`] writes checkpoints back as the wrapper, the vision tower and projector copied
//!   through bit for bit.

mod atomic;
mod bf16_stream;

pub use atomic::write_file_atomically;
pub use bf16_stream::Bf16Safetensors;
mod folder;
pub mod gguf;
pub mod multimodal;
pub mod mxfp4;
mod read;
mod write;

#[cfg(test)]
mod tests;

pub use folder::{CONFIG_FILE, HfFolder, save_hf_folder};
pub use multimodal::{Passthrough, TextPrefix};
pub use read::{Dtype, INDEX_FILE, SINGLE_FILE, TensorSource};
pub use write::{
    DEFAULT_MAX_SHARD_BYTES, ReadValues, SaveDtype, TensorData, TensorRef, shard_file_name,
    write_safetensors,
};
