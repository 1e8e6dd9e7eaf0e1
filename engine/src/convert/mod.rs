//! GGUF import and export, above the modules they join: a llama.cpp GGUF file turned into an
//! ordinary Hugging Face folder, and a checkpoint folder written as GGUF. The file format itself
//! (reading, dequantising, writing, quantising) is [`crate::weights::gguf`]'s; this module adds
//! what needs the model's layout and the tokenizer.
//!
//! - [`import_gguf`]: a llama GGUF file to a folder that [`crate::model::HostParams::load_dir`]
//!   and [`crate::data::Tokenizer::from_dir`] read and transformers loads.
//! - [`export_gguf`]: a llama, mistral or qwen2 checkpoint folder to a GGUF file (F16 or Q8_0
//!   matrices) as llama.cpp's converter writes it.

mod export;
mod import;

#[cfg(test)]
mod export_tests;
#[cfg(test)]
mod tests;

pub use export::{ExportSummary, GgufType, export_gguf, permute_rows};
pub use import::{ImportSummary, convert, hf_config, import_gguf, unpermute_rows};
