//! Everything between a dataset file and packed token rows.
//!
//! - [`formats`]: JSON Lines / JSON array files of alpaca, ShareGPT, OpenAI messages,
//!   prompt/completion or text records, and LLaMA-Factory `dataset_info.json` registries; bad
//!   records are collected with their line numbers (a lint), not stopped at.
//! - [`stream`]: the same records read one at a time, in memory bounded by the largest record
//!   rather than the file, for checks of files of any size (the appliance's lint and preview);
//!   CSV and TSV (`tabular`) and Parquet (`parquet`) files are read this way too.
//! - [`columns`]: a table's columns (or a JSON file's keys) renamed to a format's fields.
//! - [`tokenizer`]: a Hugging Face tokenizer folder (or the built-in [`tiny_tokenizer`]).
//! - [`template`]: the model's Jinja chat template rendered as transformers does, and the spans of
//!   assistant turns in the result (the loss mask).
//! - [`prepare`]: records to samples (token ids and which tokens are trained).
//! - [`pack`]: samples to rows of `seq_len` tokens with next-token targets, per-document positions
//!   and document bounds; rows to micro-batches.
//!
//! Invariants: a document never crosses a row; padding is its own document and never trained; a
//! target is [`crate::backend::IGNORE`] unless the next token is in the same document and trained.

pub mod columns;
pub mod formats;
pub mod gguf_tokenizer;
pub mod pack;
mod parquet;
pub mod prepare;
pub mod stream;
mod tabular;
pub mod template;
mod text;
pub mod tokenizer;

use std::path::{Path, PathBuf};

pub use columns::Columns;
pub use formats::{
    Entry, Format, Layout, Message, Parsed, Problem, Record, Role, read_dataset,
    read_registry_dataset, registry_names, single_dataset_registry,
};
pub use pack::{MicroBatch, PackOptions, Packed, Row, Stats, pack};
pub use parquet::{MAX_PAGE_BYTES, MAX_PARQUET_BYTES, MAX_PARQUET_ROWS};
pub use prepare::{PrepareOptions, Prepared, Preparer, Sample};
pub use stream::{Checked, DatasetReader, Lint, MAX_RECORD_BYTES, layout_of};
pub use template::{ChatTemplate, Rendered, SpecialTokens};
pub use tokenizer::{Encoding, Tokenizer, tiny_tokenizer, tiny_tokenizer_files};

use crate::error::{Error, Result};

/// Where a dataset comes from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DatasetSource {
    /// A JSON Lines, JSON array, CSV, TSV or Parquet file.
    File(PathBuf),
    /// Dataset `name` of a LLaMA-Factory `dataset_info.json` registry.
    Registry { registry: PathBuf, name: String },
    /// Another source read with options: mapped columns, bad records skipped. Made by
    /// [`DatasetSource::with`], which never nests it.
    With { source: Box<DatasetSource>, read: ReadOptions },
}

/// How a dataset's records are read, beyond where they are.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReadOptions {
    /// Columns renamed to a format's fields (for a file, not a registry, which maps its own).
    #[serde(default, skip_serializing_if = "Columns::is_empty")]
    pub columns: Columns,
    /// Leave out invalid records instead of refusing the dataset. Which records are invalid is
    /// decided by the same checks as the lint's, so training skips exactly the records a
    /// lenient upload listed.
    #[serde(default)]
    pub skip_invalid: bool,
}

impl DatasetSource {
    /// This source read with `read` (replacing any options it had).
    pub fn with(self, read: ReadOptions) -> DatasetSource {
        let base = match self {
            DatasetSource::With { source, .. } => *source,
            other => other,
        };
        if read == ReadOptions::default() {
            base
        } else {
            DatasetSource::With { source: Box::new(base), read }
        }
    }

    /// The file or registry, and the options it is read with.
    fn parts(&self) -> (Base<'_>, ReadOptions) {
        match self {
            DatasetSource::File(path) => (Base::File(path), ReadOptions::default()),
            DatasetSource::Registry { registry, name } => {
                (Base::Registry(registry, name), ReadOptions::default())
            }
            DatasetSource::With { source, read } => (source.parts().0, read.clone()),
        }
    }

    /// The file read, or the registry that names it.
    pub fn path(&self) -> &Path {
        match self.parts().0 {
            Base::File(path) | Base::Registry(path, _) => path,
        }
    }

    /// The options records are read with.
    pub fn read_options(&self) -> ReadOptions {
        self.parts().1
    }

    /// Reads and lints the whole dataset into memory without tokenizing it; [`Self::open`]
    /// reads it record by record instead. Tables and mapped files are read through
    /// [`DatasetReader`], and so is text; plain JSON whole, as it always was.
    pub fn read(&self) -> Result<Parsed> {
        match self.parts() {
            (Base::File(path), read) if read.columns.is_empty() && layout_of(path)?.is_json() => {
                read_dataset(path)
            }
            (Base::Registry(registry, name), _)
                if layout_of(&formats::registry_file(registry, name)?.0)?.is_json() =>
            {
                read_registry_dataset(registry, name)
            }
            _ => self.open()?.read_all(),
        }
    }

    /// Opens the dataset for reading record by record, with the records and problems of
    /// [`Self::read`].
    pub fn open(&self) -> Result<DatasetReader> {
        match self.parts() {
            (Base::File(path), read) => DatasetReader::open_mapped(path, &read.columns),
            (Base::Registry(registry, name), _) => DatasetReader::open_registry(registry, name),
        }
    }

    /// Whether invalid records are left out rather than refused.
    pub fn skips_invalid(&self) -> bool {
        self.parts().1.skip_invalid
    }
}

/// What a [`DatasetSource`] comes down to once its options are set aside.
enum Base<'a> {
    File(&'a Path),
    Registry(&'a Path, &'a str),
}

#[derive(Debug, Clone, Copy)]
pub struct DataOptions {
    pub seq_len: usize,
    /// Train prompt tokens too, not only assistant turns.
    pub train_on_prompt: bool,
    /// Shuffle samples with this seed before packing; `None` keeps file order.
    pub shuffle_seed: Option<u64>,
}

/// Reads, checks, tokenizes and packs a dataset. Any bad record is an error naming its line,
/// unless the source skips invalid records.
pub fn load(
    source: &DatasetSource,
    tokenizer: &Tokenizer,
    options: &DataOptions,
) -> Result<Packed> {
    if options.seq_len == 0 {
        return Err(Error::invalid("sequence length must be at least 1"));
    }
    let (path, entries) = read_entries(source)?;
    pack_entries(&path, &entries, tokenizer, options)
}

/// Reads and checks a dataset's records (leaving out invalid ones if the source says so), with
/// the path its problems cite.
pub fn read_entries(source: &DatasetSource) -> Result<(PathBuf, Vec<Entry>)> {
    let parsed = source.read()?;
    let path = parsed.path.clone();
    let entries = if source.skips_invalid() {
        parsed.into_valid_entries()?
    } else {
        parsed.into_entries()?
    };
    Ok((path, entries))
}

/// Tokenizes and packs records read by [`read_entries`].
pub fn pack_entries(
    path: &Path,
    entries: &[Entry],
    tokenizer: &Tokenizer,
    options: &DataOptions,
) -> Result<Packed> {
    if options.seq_len == 0 {
        return Err(Error::invalid("sequence length must be at least 1"));
    }
    let preparer =
        Preparer::new(tokenizer, PrepareOptions { train_on_prompt: options.train_on_prompt })?;
    let prepared = preparer.prepare(path, entries)?;
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
