//! Parquet files (how Hugging Face datasets ship) as records: each row becomes a JSON object of
//! its columns (strings stay strings; a list of structs, such as a `messages` column, becomes a
//! list of objects), numbered from 1 across the file. Rows are decoded row group by row group
//! through the `parquet` crate's row API, so memory is bounded by a row group's pages, not the
//! file.
//!
//! A damaged file is an error, never a panic: the decoder works on untrusted bytes, and a panic
//! inside it (a corrupt page or footer it did not anticipate) is caught and reported as damage.
//!
//! A few kilobytes of Parquet can inflate to gigabytes (a zstd page of one repeated string) or
//! describe millions of rows (a dictionary of one value), which no upload limit on the file's
//! size would catch. So before a row is decoded, the file's row count is read from its footer and
//! every page's header is read from the file itself (not the footer's totals, which a file may
//! misstate): the decoder allocates what a page header declares, so a page declared larger than
//! [`MAX_PAGE_BYTES`], a file over [`MAX_PARQUET_ROWS`] rows or inflating past
//! [`MAX_PARQUET_BYTES`] is refused without inflating anything. While rows are read, a row whose
//! JSON is longer than [`MAX_RECORD_BYTES`] is a problem of that row, as a long line is in JSON
//! Lines, and rows past the limits (should the footer have understated them) end the read.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::ops::ControlFlow;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

use ::parquet::file::reader::{FileReader, SerializedFileReader};

use super::stream::{MAX_RECORD_BYTES, mib};
use super::tabular::RawRow;
use crate::error::{Error, Result};

/// The file's first bytes (and last four): `PAR1`.
pub(super) const MAGIC: &[u8; 4] = b"PAR1";

/// The most rows a Parquet file may have. JSON Lines, JSON and CSV spend bytes of the file on
/// every record, so the upload's size limit bounds their records; Parquet's encodings do not.
/// Two million is more than a fine-tuning set has, and far less than a bomb of tiny rows.
pub const MAX_PARQUET_ROWS: usize = 2_000_000;

/// The largest page, decompressed: a page holds at least one cell, and a cell no more than a
/// record, so four records' worth leaves writers their usual pages and refuses an inflated one.
pub const MAX_PAGE_BYTES: usize = 4 * MAX_RECORD_BYTES;

/// The most a Parquet file's data may inflate to, in its pages and again in its rows' JSON:
/// several times the text of the largest JSON Lines upload the appliance takes by default.
pub const MAX_PARQUET_BYTES: u64 = 4 << 30;

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

fn refused(path: &Path, message: String) -> Error {
    Error::Dataset { path: path.to_path_buf(), message }
}

/// Opens the file and checks its row count and every page's declared size against the limits,
/// before anything is decompressed.
fn open(path: &Path) -> Result<SerializedFileReader<File>> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let pages = file.try_clone().map_err(|e| Error::io(path, e))?;
    let reader = guarded(path, || SerializedFileReader::new(file))?;
    let rows = reader.metadata().file_metadata().num_rows();
    if !matches!(usize::try_from(rows), Ok(rows) if rows <= MAX_PARQUET_ROWS) {
        return Err(refused(
            path,
            format!(
                "the file has {rows} rows, more than the {MAX_PARQUET_ROWS} a Parquet dataset \
                 may have"
            ),
        ));
    }
    let mut pages = BufReader::with_capacity(8 << 10, pages);
    let mut inflated = 0u64;
    for group in reader.metadata().row_groups() {
        for column in group.columns() {
            let (start, length) = column.byte_range();
            let name = column.column_path().string();
            check_pages(path, &mut pages, start, length, &name, &mut inflated)?;
        }
    }
    Ok(reader)
}

/// Reads the headers of a column chunk's pages (at `start`, `length` bytes) and refuses a page
/// that declares more than [`MAX_PAGE_BYTES`] decompressed, or a running total past
/// [`MAX_PARQUET_BYTES`].
fn check_pages(
    path: &Path,
    file: &mut BufReader<File>,
    start: u64,
    length: u64,
    column: &str,
    inflated: &mut u64,
) -> Result<()> {
    let end = start.checked_add(length).ok_or_else(|| damaged(path, "a column's size"))?;
    file.seek(SeekFrom::Start(start)).map_err(|e| Error::io(path, e))?;
    let mut at = start;
    while at < end {
        let mut header = Compact { inner: &mut *file, read: 0 };
        let (uncompressed, compressed) = header.page_sizes().map_err(|e| {
            damaged(path, format!("column {column:?}: a page header at byte {at}: {e}"))
        })?;
        if uncompressed > MAX_PAGE_BYTES as u64 {
            return Err(refused(
                path,
                format!(
                    "column {column:?} has a page that inflates to {}, more than the {} a page \
                     may be",
                    mib_u64(uncompressed),
                    mib(MAX_PAGE_BYTES)
                ),
            ));
        }
        *inflated += uncompressed;
        if *inflated > MAX_PARQUET_BYTES {
            return Err(refused(
                path,
                format!(
                    "the file's pages inflate to more than the {} a Parquet dataset may hold",
                    mib_u64(MAX_PARQUET_BYTES)
                ),
            ));
        }
        at = at.saturating_add(header.read).saturating_add(compressed);
        let skip = i64::try_from(compressed).map_err(|_| damaged(path, "a page's size"))?;
        file.seek_relative(skip).map_err(|e| Error::io(path, e))?;
    }
    Ok(())
}

fn mib_u64(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1u32 << 20))
}

/// Just enough of Thrift's compact protocol to read a `PageHeader`'s two sizes and skip the
/// rest of it, without allocating for anything the header declares (the `parquet` crate keeps
/// its own reader private).
struct Compact<R> {
    inner: R,
    /// Bytes of the header read so far.
    read: u64,
}

/// Structs nested deeper than this are not a page header.
const MAX_DEPTH: u32 = 16;

impl<R: Read> Compact<R> {
    /// The `PageHeader`'s `uncompressed_page_size` (field 2) and `compressed_page_size` (3).
    fn page_sizes(&mut self) -> std::io::Result<(u64, u64)> {
        let (mut uncompressed, mut compressed) = (None, None);
        let mut id = 0i16;
        loop {
            let head = self.byte()?;
            if head == 0 {
                break;
            }
            let kind = head & 0x0f;
            id = match head >> 4 {
                0 => i16::try_from(zigzag(self.varint()?)).map_err(|_| invalid("a field id"))?,
                delta => id.wrapping_add(i16::from(delta)),
            };
            match (id, kind) {
                (2, 5) => uncompressed = Some(zigzag(self.varint()?)),
                (3, 5) => compressed = Some(zigzag(self.varint()?)),
                _ => self.skip(kind, 0)?,
            }
        }
        let size = |value: Option<i64>, what: &str| {
            value
                .and_then(|v| u64::try_from(v).ok())
                .ok_or_else(|| invalid(&format!("no valid {what} page size")))
        };
        Ok((size(uncompressed, "uncompressed")?, size(compressed, "compressed")?))
    }

    fn byte(&mut self) -> std::io::Result<u8> {
        let mut byte = [0u8];
        self.inner.read_exact(&mut byte)?;
        self.read += 1;
        Ok(byte[0])
    }

    fn varint(&mut self) -> std::io::Result<u64> {
        let mut value = 0u64;
        for shift in (0..70).step_by(7) {
            let byte = self.byte()?;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(invalid("a varint longer than ten bytes"))
    }

    fn skip_bytes(&mut self, n: u64) -> std::io::Result<()> {
        let copied = std::io::copy(&mut (&mut self.inner).take(n), &mut std::io::sink())?;
        self.read += copied;
        if copied < n {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(())
    }

    /// Skips a value of compact type `kind` (a boolean field's value is in its type).
    fn skip(&mut self, kind: u8, depth: u32) -> std::io::Result<()> {
        if depth > MAX_DEPTH {
            return Err(invalid("nested too deep"));
        }
        match kind {
            1 | 2 => Ok(()),
            3 => self.byte().map(drop),
            4..=6 => self.varint().map(drop),
            7 => self.skip_bytes(8),
            8 => {
                let n = self.varint()?;
                self.skip_bytes(n)
            }
            9 | 10 => {
                let head = self.byte()?;
                let n = match head >> 4 {
                    15 => self.varint()?,
                    n => u64::from(n),
                };
                self.skip_elements(head & 0x0f, n, depth)
            }
            11 => {
                let n = self.varint()?;
                if n > 0 {
                    let kinds = self.byte()?;
                    for _ in 0..n {
                        self.skip_element(kinds >> 4, depth)?;
                        self.skip_element(kinds & 0x0f, depth)?;
                    }
                }
                Ok(())
            }
            12 => loop {
                let head = self.byte()?;
                if head == 0 {
                    return Ok(());
                }
                if head >> 4 == 0 {
                    self.varint()?;
                }
                self.skip(head & 0x0f, depth + 1)?;
            },
            _ => Err(invalid("an unknown field type")),
        }
    }

    /// Skips `n` elements of a list or set; each costs at least one byte, so a huge `n` ends at
    /// the end of the file.
    fn skip_elements(&mut self, kind: u8, n: u64, depth: u32) -> std::io::Result<()> {
        for _ in 0..n {
            self.skip_element(kind, depth)?;
        }
        Ok(())
    }

    /// In a collection, a boolean takes a byte of its own.
    fn skip_element(&mut self, kind: u8, depth: u32) -> std::io::Result<()> {
        match kind {
            1 | 2 => self.byte().map(drop),
            kind => self.skip(kind, depth + 1),
        }
    }
}

fn zigzag(n: u64) -> i64 {
    ((n >> 1) as i64) ^ -((n & 1) as i64)
}

fn invalid(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string())
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
    let mut decoded = 0u64;
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
            if number > MAX_PARQUET_ROWS {
                return Err(refused(
                    path,
                    format!(
                        "the file has more than the {MAX_PARQUET_ROWS} rows a Parquet dataset may have"
                    ),
                ));
            }
            let value = row.to_json_value();
            let size = json_size(&value);
            decoded = decoded.saturating_add(size as u64);
            if decoded > MAX_PARQUET_BYTES {
                return Err(refused(
                    path,
                    format!(
                        "the rows up to row {number} add up to more than the {} a Parquet \
                         dataset may hold",
                        mib_u64(MAX_PARQUET_BYTES)
                    ),
                ));
            }
            let value = if size > MAX_RECORD_BYTES {
                Err(format!(
                    "the row is {}, longer than the {} a record may be",
                    mib(size),
                    mib(MAX_RECORD_BYTES)
                ))
            } else {
                Ok(value)
            };
            if visit((number, value)).is_break() {
                return Ok(());
            }
        }
    }
    Ok(())
}

/// The length of `value` written as JSON, counted without writing it anywhere.
fn json_size(value: &serde_json::Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing to a counter cannot fail, and a `Value` always serializes.
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}
