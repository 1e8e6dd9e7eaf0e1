//! CSV and TSV files as records: the first row names the columns, every other row becomes a
//! JSON object of strings keyed by them, numbered by the line it starts on (a quoted field may
//! span lines). Rows are read one at a time through the `csv` crate, and no row may be longer
//! than [`MAX_RECORD_BYTES`]: an unclosed quote would otherwise read the rest of the file into
//! one field.
//!
//! The `csv` crate reads a quote inside an unquoted field (`say "hi"`) or after a closing quote
//! (`"hi" there`) as text, so a stray quote would pass unnoticed and a file whose quoting went
//! wrong would be learned as written. Each row's own bytes are kept until it is parsed and
//! checked against RFC 4180's rule (a field with a quote is quoted whole, its quotes doubled);
//! a row that breaks it is a problem of that row.

use std::cell::{Cell, RefCell};
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
    let counted = Counted {
        inner: input,
        since_row: Rc::clone(&since_row),
        raw: Rc::new(RefCell::new(Raw::default())),
    };
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
    let raw = Rc::clone(&reader.get_ref().raw);
    raw.borrow_mut().forget_before(reader.position().byte());
    let mut row = csv::ByteRecord::new();
    loop {
        let line = reader.position().line() as usize;
        let read = reader.read_byte_record(&mut row);
        // The parser counts newlines, blank lines before a row included; the row's own are
        // those inside its quoted fields and its end.
        let inside = row.as_slice().iter().filter(|&&b| b == b'\n').count();
        let start = (reader.position().line() as usize).saturating_sub(inside + 1).max(line);
        let row_bytes = since_row.replace(0);
        let end = reader.position().byte();
        let begin = row.position().map_or(end, csv::Position::byte);
        let stray = raw.borrow().bytes(begin, end).and_then(|bytes| stray_quote(bytes, delimiter));
        raw.borrow_mut().forget_before(end);
        let value = match read {
            Ok(false) => return Ok(()),
            Ok(true) => match stray {
                Some(field) => Err(stray_message(&names, field)),
                None => object(&names, &row),
            },
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

fn stray_message(names: &[String], field: usize) -> String {
    let column = match names.get(field) {
        Some(name) => format!("column {name:?}"),
        None => format!("field {}", field + 1),
    };
    format!(
        "{column} has a stray quote: a field with a quote in it must be quoted whole, with its \
         quotes doubled (\"say \"\"hi\"\"\")"
    )
}

/// The index of the first field of `row` (its raw bytes, terminator included) that breaks
/// RFC 4180's quoting: a quote inside an unquoted field, text after a closing quote, or a quote
/// never closed.
fn stray_quote(row: &[u8], delimiter: u8) -> Option<usize> {
    let mut field = 0;
    let mut bytes = row.iter().copied().peekable();
    let mut at_start = true;
    while let Some(byte) = bytes.next() {
        match byte {
            b'"' if at_start => {
                loop {
                    match bytes.next() {
                        None => return Some(field),
                        Some(b'"') if bytes.peek() == Some(&b'"') => {
                            bytes.next();
                        }
                        Some(b'"') => break,
                        Some(_) => {}
                    }
                }
                match bytes.peek() {
                    None | Some(b'\n' | b'\r') => {}
                    Some(&next) if next == delimiter => {}
                    Some(_) => return Some(field),
                }
                at_start = false;
            }
            b'"' => return Some(field),
            b'\n' | b'\r' => {
                // Blank lines before the row are read with it.
                field = 0;
                at_start = true;
            }
            _ if byte == delimiter => {
                field += 1;
                at_start = true;
            }
            _ => at_start = false,
        }
    }
    None
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
///
/// It also keeps the bytes handed over since the last row ended, for [`stray_quote`]: no more
/// than that row and the parser's read-ahead.
struct Counted<R> {
    inner: R,
    since_row: Rc<Cell<usize>>,
    raw: Rc<RefCell<Raw>>,
}

/// Bytes of the input from the offset `start` on.
#[derive(Default)]
struct Raw {
    start: u64,
    kept: Vec<u8>,
}

impl Raw {
    /// The bytes from offset `begin` to `end`, when they are all kept.
    fn bytes(&self, begin: u64, end: u64) -> Option<&[u8]> {
        let from = usize::try_from(begin.checked_sub(self.start)?).ok()?;
        let to = usize::try_from(end.checked_sub(self.start)?).ok()?;
        self.kept.get(from..to)
    }

    fn forget_before(&mut self, offset: u64) {
        let drop = usize::try_from(offset.saturating_sub(self.start)).unwrap_or(usize::MAX);
        let drop = drop.min(self.kept.len());
        self.kept.drain(..drop);
        self.start += drop as u64;
    }
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(read) = buf.get(..n) {
            self.raw.borrow_mut().kept.extend_from_slice(read);
        }
        let total = self.since_row.get() + n;
        self.since_row.set(total);
        if total > MAX_RECORD_BYTES + (64 << 10) {
            return Err(std::io::Error::other("row too long"));
        }
        Ok(n)
    }
}
