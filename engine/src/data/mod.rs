//! Everything between a dataset file and packed token rows.
//!
//! - [`formats`]: JSON Lines / JSON array files of alpaca, ShareGPT, OpenAI messages,
//!   prompt/completion or text records, and LLaMA-Factory `dataset_info.json` registries; bad
//!   records are collected with their line numbers (a lint), not stopped at.
//! - [`stream`]: the same records read one at a time, in memory bounded by the largest record
//!   rather than the file, for checks of files of any size (the appliance's lint and preview).
//! - [`tokenizer`]: a Hugging Face tokenizer folder (or the built-in [`tiny_tokenizer`]).
//! - [`template`]: the model's Jinja chat template rendered as transformers does, and the spans of
//!   assistant turns in the result (the loss mask).
//! - [`prepare`]: records to samples (token ids and which tokens are trained).
//! - [`pack`]: samples to rows of `seq_len` tokens with next-token targets, per-document positions
//!   and document bounds; rows to micro-batches.
//!
//! Invariants: a document never crosses a row; padding is its own document and never trained; a
//! target is [`crate::backend::IGNORE`] unless the next token is in the same document and trained.

pub mod formats;
pub mod gguf_tokenizer;
pub mod pack;
pub mod prepare;
pub mod stream;
pub mod template;
pub mod tokenizer;

use std::path::PathBuf;

pub use formats::{
    Entry, Format, Layout, Message, Parsed, Problem, Record, Role, read_dataset,
    read_registry_dataset, registry_names,
};
pub use pack::{MicroBatch, PackOptions, Packed, Row, Stats, pack};
pub use prepare::{PrepareOptions, Prepared, Preparer, Sample};
pub use stream::{Checked, DatasetReader, Lint, MAX_RECORD_BYTES};
pub use template::{ChatTemplate, Rendered, SpecialTokens};
pub use tokenizer::{Encoding, Tokenizer, tiny_tokenizer, tiny_tokenizer_files};

use crate::error::{Error, Result};

/// Where a dataset comes from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DatasetSource {
    /// A JSON Lines or JSON array file.
    File(PathBuf),
    /// Dataset `name` of a LLaMA-Factory `dataset_info.json` registry.
    Registry { registry: PathBuf, name: String },
}

impl DatasetSource {
    /// Reads and lints the whole dataset into memory without tokenizing it; [`Self::open`]
    /// reads it record by record instead.
    pub fn read(&self) -> Result<Parsed> {
        match self {
            DatasetSource::File(path) => read_dataset(path),
            DatasetSource::Registry { registry, name } => read_registry_dataset(registry, name),
        }
    }

    /// Opens the dataset for reading record by record, with the records and problems of
    /// [`Self::read`].
    pub fn open(&self) -> Result<DatasetReader> {
        match self {
            DatasetSource::File(path) => DatasetReader::open(path),
            DatasetSource::Registry { registry, name } => {
                DatasetReader::open_registry(registry, name)
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct DataOptions {
    pub seq_len: usize,
    /// Train prompt tokens too, not only assistant turns.
    pub train_on_prompt: bool,
    /// Shuffle samples with this seed before packing; `None` keeps file order.
    pub shuffle_seed: Option<u64>,
}

/// Reads, checks, tokenizes and packs a dataset. Any bad record is an error naming its line.
pub fn load(
    source: &DatasetSource,
    tokenizer: &Tokenizer,
    options: &DataOptions,
) -> Result<Packed> {
    if options.seq_len == 0 {
        return Err(Error::invalid("sequence length must be at least 1"));
    }
    let parsed = source.read()?;
    let path = parsed.path.clone();
    let entries = parsed.into_entries()?;
    let preparer =
        Preparer::new(tokenizer, PrepareOptions { train_on_prompt: options.train_on_prompt })?;
    let prepared = preparer.prepare(&path, &entries)?;
    let pack_options = PackOptions {
        seq_len: options.seq_len,
        shuffle_seed: options.shuffle_seed,
        pad_id: tokenizer.pad_token_id(),
    };
    pack(prepared, &pack_options)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
