//! llama.cpp's single-file format, read and written; importing a GGUF model and exporting a
//! checkpoint as GGUF, which need the model and the tokenizer, are [`crate::convert`]'s.
//!
//! - [`GgufFile`]: header, metadata of every type, tensor infos, memory-mapped data.
//! - [`GgmlType`] and [`dequantize`]: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, exactly
//!   as ggml's reference dequantisation.
//! - [`write_gguf`]: the file writer; [`quantize_into`]: the F16/Q8_0 encoders.

mod file;
mod quant;
mod quantize;
mod writer;

pub use file::{GgufFile, MetaValue, TensorInfo};
pub use quant::{GgmlType, dequantize};
pub use quantize::{Q8_0_BLOCK, quantize_into};
pub use writer::{ALIGNMENT, TensorPlan, write_gguf};
