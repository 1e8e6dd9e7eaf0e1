//! Parquet files (how Hugging Face datasets ship) as records: each row becomes a JSON object of
//! its columns (strings stay strings; a list of structs, such as a `messages` column, becomes a
//! list of objects), numbered from 1 across the file. Rows are decoded row group by row group
//! through the `parquet` crate's row API, so memory is bounded by a row group's pages, not the
//! file.
//!
//! A damaged file is an error, never a panic: the decoder works on untrusted bytes, and a panic
//! inside it (a corrupt page or footer it did not anticipate) is caught and reported as damage.

use std::fs::File;
use std::ops::ControlFlow;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

use ::parquet::file::reader::{FileReader, SerializedFileReader};

use super::tabular::RawRow;
use crate::error::{Error, Result};

/// The file's first bytes (and last four): `PAR1`.
pub(super) const MAGIC: &[u8; 4] = b"PAR1";

fn damaged(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::Dataset {
        path: path.to_path_buf(),
        message: format!("not a readable Parquet file: {what}"),
    }
}

/// Runs `f` over the decoder, with a panic inside it reported as a damaged file.
fn guarded<T>(path: &Path, f: impl FnOnce() -> ::parquet::errors::Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(err)) => Err(damaged(path, err)),
        Err(_) => Err(damaged(path, "the decoder failed on its contents")),
    }
}

fn open(path: &Path) -> Result<SerializedFileReader<File>> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    guarded(path, || SerializedFileReader::new(file))
}

/// The names of the top-level columns.
pub(super) fn columns(path: &Path) -> Result<Vec<String>> {
    let reader = open(path)?;
    let schema = reader.metadata().file_metadata().schema_descr();
    Ok(schema.root_schema().get_fields().iter().map(|f| f.name().to_string()).collect())
}

/// Calls `visit` with every row, until it breaks. A row that cannot be decoded ends the read
/// with an error: the rows after it are in the same damaged pages.
pub(super) fn rows(path: &Path, mut visit: impl FnMut(RawRow) -> ControlFlow<()>) -> Result<()> {
    let reader = open(path)?;
    let groups = reader.metadata().num_row_groups();
    let mut number = 0usize;
    for group in 0..groups {
        let group = guarded(path, || reader.get_row_group(group))?;
        let mut rows = guarded(path, || group.get_row_iter(None))?;
        loop {
            let row = match catch_unwind(AssertUnwindSafe(|| rows.next())) {
                Ok(None) => break,
                Ok(Some(Ok(row))) => row,
                Ok(Some(Err(err))) => {
                    return Err(damaged(path, format!("row {}: {err}", number + 1)));
                }
                Err(_) => {
                    return Err(damaged(
                        path,
                        format!("row {}: the decoder failed on its contents", number + 1),
                    ));
                }
            };
            number += 1;
            if visit((number, Ok(row.to_json_value()))).is_break() {
                return Ok(());
            }
        }
    }
    Ok(())
}
