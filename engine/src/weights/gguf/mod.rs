//! GGUF in: llama.cpp's single-file format read, dequantised to f32 master weights, and turned
//! into an ordinary Hugging Face folder.
//!
//! - [`GgufFile`]: header, metadata of every type, tensor infos, memory-mapped data.
//! - [`GgmlType`] and [`dequantize`]: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, exactly
//!   as ggml's reference dequantisation.
//! - [`import_gguf`]: a llama GGUF file to a folder that [`crate::model::HostParams::load_dir`]
//!   and [`crate::data::Tokenizer::from_dir`] read and transformers loads.

mod file;
mod import;
mod quant;

#[cfg(test)]
mod tests;

pub use file::{GgufFile, MetaValue, TensorInfo};
pub use import::{ImportSummary, convert, hf_config, import_gguf, unpermute_rows};
pub use quant::{GgmlType, dequantize};
