//! CSV and TSV files as records: the first row names the columns, every other row becomes a
//! JSON object of strings keyed by them, numbered by the line it starts on (a quoted field may
//! span lines). Rows are read one at a time through the `csv` crate, and no row may be longer
//! than [`MAX_RECORD_BYTES`]: an unclosed quote would otherwise read the rest of the file into
//! one field.

use std::cell::Cell;
use std::io::Read;
use std::ops::ControlFlow;
use std::path::Path;
use std::rc::Rc;

use serde_json::{Map, Value};

use super::stream::{MAX_RECORD_BYTES, mib};
use crate::error::{Error, Result};

/// A row's line and its JSON object, or why it is not a row.
pub(super) type RawRow = (usize, std::result::Result<Value, String>);

fn reader<R: Read>(input: R, delimiter: u8) -> (csv::Reader<Counted<R>>, Rc<Cell<usize>>) {
    let since_row = Rc::new(Cell::new(0));
    let counted = Counted { inner: input, since_row: Rc::clone(&since_row) };
    let reader = csv::ReaderBuilder::new()
        .delimiter(delimiter)
        .has_headers(true)
        // A row with another number of fields is a problem of that row, reported by us.
        .flexible(true)
        .from_reader(counted);
    (reader, since_row)
}

/// The column names of the header row.
pub(super) fn columns<R: Read>(path: &Path, input: R, delimiter: u8) -> Result<Vec<String>> {
    let (mut reader, since_row) = reader(input, delimiter);
    header(path, &mut reader, &since_row)
}

fn header<R: Read>(
    path: &Path,
    reader: &mut csv::Reader<Counted<R>>,
    since_row: &Cell<usize>,
) -> Result<Vec<String>> {
    let headers = match reader.byte_headers() {
        Ok(headers) => headers.clone(),
        Err(err) => return Err(csv_error(path, err, since_row.replace(0), 1)),
    };
    let fail = |message: String| Error::Dataset { path: path.to_path_buf(), message };
    let mut names: Vec<String> = Vec::with_capacity(headers.len());
    for (i, name) in headers.iter().enumerate() {
        let name = std::str::from_utf8(name)
            .map_err(|e| fail(format!("the header's column {} is not valid UTF-8: {e}", i + 1)))?;
        let name = name.trim().to_string();
        if name.is_empty() {
            return Err(fail(format!("the header's column {} has no name", i + 1)));
        }
        if names.contains(&name) {
            return Err(fail(format!("the header names column {name:?} twice")));
        }
        names.push(name);
    }
    if names.is_empty() {
        return Err(fail("the first row must name the columns".into()));
    }
    since_row.set(0);
    Ok(names)
}

/// Calls `visit` with every row after the header, until it breaks.
pub(super) fn rows<R: Read>(
    path: &Path,
    input: R,
    delimiter: u8,
    mut visit: impl FnMut(RawRow) -> ControlFlow<()>,
) -> Result<()> {
    // Every row then ends with a newline, which is what tells the line a row starts on.
    let (mut reader, since_row) = reader(input.chain(&b"\n"[..]), delimiter);
    let names = header(path, &mut reader, &since_row)?;
    let mut row = csv::ByteRecord::new();
    loop {
        let line = reader.position().line() as usize;
        let read = reader.read_byte_record(&mut row);
        // The parser counts newlines, blank lines before a row included; the row's own are
        // those inside its quoted fields and its end.
        let inside = row.as_slice().iter().filter(|&&b| b == b'\n').count();
        let start = (reader.position().line() as usize).saturating_sub(inside + 1).max(line);
        let row_bytes = since_row.replace(0);
        let value = match read {
            Ok(false) => return Ok(()),
            Ok(true) => object(&names, &row),
            Err(err) if matches!(err.kind(), csv::ErrorKind::Io(_)) => {
                return Err(csv_error(path, err, row_bytes, line));
            }
            Err(err) => Err(err.to_string()),
        };
        let line = start;
        if row.len() == 1 && row.as_slice().trim_ascii().is_empty() {
            continue;
        }
        if visit((line, value)).is_break() {
            return Ok(());
        }
    }
}

fn object(names: &[String], row: &csv::ByteRecord) -> std::result::Result<Value, String> {
    if row.len() != names.len() {
        return Err(format!("the row has {} fields, the header {}", row.len(), names.len()));
    }
    let mut object = Map::with_capacity(names.len());
    for (name, field) in names.iter().zip(row.iter()) {
        let text = std::str::from_utf8(field)
            .map_err(|e| format!("column {name:?} is not valid UTF-8: {e}"))?;
        object.insert(name.clone(), Value::String(text.to_string()));
    }
    Ok(Value::Object(object))
}

fn csv_error(path: &Path, err: csv::Error, row_bytes: usize, line: usize) -> Error {
    if row_bytes > MAX_RECORD_BYTES {
        return Error::Dataset {
            path: path.to_path_buf(),
            message: format!(
                "the row at line {line} is longer than the {} a record may be (an unclosed quote?)",
                mib(MAX_RECORD_BYTES)
            ),
        };
    }
    match err.into_kind() {
        csv::ErrorKind::Io(io) => Error::io(path, io),
        other => Error::Dataset { path: path.to_path_buf(), message: format!("{other:?}") },
    }
}

/// Counts the bytes handed to the parser since the last row ended and fails past
/// [`MAX_RECORD_BYTES`] (plus the parser's own buffer), so one row cannot fill memory.
struct Counted<R> {
    inner: R,
    since_row: Rc<Cell<usize>>,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        let total = self.since_row.get() + n;
        self.since_row.set(total);
        if total > MAX_RECORD_BYTES + (64 << 10) {
            return Err(std::io::Error::other("row too long"));
        }
        Ok(n)
    }
}
