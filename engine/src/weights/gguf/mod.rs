//! GGUF in and out: llama.cpp's single-file format read, dequantised to f32 master weights, and
//! turned into an ordinary Hugging Face folder; and a checkpoint folder written as GGUF.
//!
//! - [`GgufFile`]: header, metadata of every type, tensor infos, memory-mapped data.
//! - [`GgmlType`] and [`dequantize`]: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, exactly
//!   as ggml's reference dequantisation.
//! - [`import_gguf`]: a llama GGUF file to a folder that [`crate::model::HostParams::load_dir`]
//!   and [`crate::data::Tokenizer::from_dir`] read and transformers loads.
//! - [`export_gguf`]: a llama, mistral or qwen2 checkpoint folder to a GGUF file (F16 or Q8_0
//!   matrices) as llama.cpp's converter writes it; [`write_gguf`] is the file writer beneath
//!   and [`quantize_into`] the F16/Q8_0 encoders.

mod export;
mod file;
mod import;
mod quant;
mod quantize;
mod writer;

#[cfg(test)]
mod export_tests;
#[cfg(test)]
mod tests;

pub use export::{ExportSummary, GgufType, export_gguf, permute_rows};
pub use file::{GgufFile, MetaValue, TensorInfo};
pub use import::{ImportSummary, convert, hf_config, import_gguf, unpermute_rows};
pub use quant::{GgmlType, dequantize};
pub use quantize::{Q8_0_BLOCK, quantize_into};
pub use writer::{ALIGNMENT, TensorPlan, write_gguf};
