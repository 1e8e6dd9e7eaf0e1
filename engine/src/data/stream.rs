//! Dataset files read record by record, for checks that must not hold a whole file in memory:
//! the appliance's upload lint and its preview, and training for tables. Memory is bounded by the
//! largest record, never by the file: JSON Lines are read one line at a time, a JSON array one
//! element at a time through serde_json's deserializer over the file, CSV and TSV one row at a
//! time ([`super::tabular`]) and Parquet row group by row group ([`super::parquet`]).
//!
//! Records, problems and their numbers are those of [`super::read_dataset`] (which training
//! uses for JSON, as it needs every record anyway), with one addition: a record longer than
//! [`MAX_RECORD_BYTES`] is refused. In JSON Lines it is a problem of its own line and reading
//! goes on; in a JSON array or a CSV file it ends the read with an error, since nothing after it
//! can be found without parsing through it.
//!
//! A table's columns, and a JSON file's keys when a mapping is given, are renamed to a format's
//! fields by [`Columns`] before a record is checked; a table's header without a mapping is
//! mapped automatically ([`Columns::auto`]).
//!
//! The format is decided by the first valid record, wherever it is, and a record before it is
//! checked against that format like any other. So a file is read twice: once up to its first
//! valid record (usually its first line), then from the start.

use std::cell::Cell;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use serde::de::{DeserializeSeed, Error as _, SeqAccess, Visitor};
use serde_json::Value;

use super::columns::Columns;
use super::formats::{
    Entry, Format, Layout, Parsed, Problem, Schema, check_record, no_records, registry_file,
    schema_of,
};
use super::{parquet, tabular, text};
use crate::error::{Error, Result};

/// The longest record read: a few times the longest conversation a 128k-token context holds,
/// even in escaped JSON. A record's parsed JSON costs a small multiple of its text, so this
/// bounds what one reader holds.
pub const MAX_RECORD_BYTES: usize = 8 << 20;

const BOM: &[u8] = "\u{feff}".as_bytes();

/// A record checked against the dataset's format: the record with its line, or what is wrong.
pub type Checked = std::result::Result<Entry, Problem>;

/// A dataset file whose layout and format are decided, ready to be read record by record.
#[derive(Debug, Clone)]
pub struct DatasetReader {
    path: PathBuf,
    layout: Layout,
    schema: Option<Schema>,
    /// The schema was detected from the file, not stated by a registry.
    detected: bool,
    /// A table's column names; empty for JSON and text.
    names: Vec<String>,
    /// How columns are renamed before a record is checked.
    columns: Columns,
}

impl DatasetReader {
    /// Opens a JSON Lines, JSON array, CSV, TSV or Parquet file and detects its format, reading
    /// up to its first valid record. A file without any record is an error.
    pub fn open(path: impl AsRef<Path>) -> Result<DatasetReader> {
        Self::open_mapped(path, &Columns::default())
    }

    /// [`Self::open`] with the file's columns renamed by `columns` (an empty mapping lets a
    /// table's header be mapped automatically). A mapped column the table lacks is an error.
    pub fn open_mapped(path: impl AsRef<Path>, columns: &Columns) -> Result<DatasetReader> {
        Self::open_with(path.as_ref(), None, columns)
    }

    /// Opens the dataset `name` of a LLaMA-Factory `dataset_info.json` registry, as
    /// [`super::read_registry_dataset`] resolves it.
    pub fn open_registry(registry: impl AsRef<Path>, name: &str) -> Result<DatasetReader> {
        let (file, schema) = registry_file(registry.as_ref(), name)?;
        Self::open_with(&file, Some(schema), &Columns::default())
    }

    fn open_with(path: &Path, schema: Option<Schema>, columns: &Columns) -> Result<DatasetReader> {
        let layout = layout_of(path)?;
        let names = column_names(path, layout)?;
        // A registry names its columns itself.
        let columns = match (&schema, layout.is_tabular() && columns.is_empty()) {
            (Some(_), _) => Columns::default(),
            (None, true) => Columns::auto(&names),
            (None, false) => columns.clone(),
        };
        if layout.is_tabular()
            && let Some(missing) = columns.missing(&names)
        {
            return Err(Error::Dataset {
                path: path.to_path_buf(),
                message: format!(
                    "the column mapping names {missing:?}, but the columns are: {}",
                    names.join(", ")
                ),
            });
        }
        let mut this = DatasetReader {
            path: path.to_path_buf(),
            layout,
            schema: None,
            detected: schema.is_none(),
            names,
            columns,
        };
        let mut any = false;
        let mut schema = schema;
        this.raw_records(|_, value| {
            any = true;
            if schema.is_none() {
                schema = schema_of(&value);
            }
            if schema.is_some() { ControlFlow::Break(()) } else { ControlFlow::Continue(()) }
        })?;
        if !any {
            return Err(no_records(path));
        }
        this.schema = schema;
        Ok(this)
    }

    /// A table's column names, as its header (or schema) gives them; empty for JSON.
    pub fn column_names(&self) -> &[String] {
        &self.names
    }

    /// The mapping records are read with: the one given, or a table's automatic one.
    pub fn columns(&self) -> &Columns {
        &self.columns
    }

    /// Every record, kept in memory: what training reads when the file is a table or mapped.
    pub fn read_all(&self) -> Result<Parsed> {
        let mut parsed = Parsed {
            path: self.path.clone(),
            layout: self.layout,
            format: self.format(),
            entries: Vec::new(),
            problems: Vec::new(),
        };
        self.for_each(|checked| {
            match checked {
                Ok(entry) => parsed.entries.push(entry),
                Err(problem) => parsed.problems.push(problem),
            }
            ControlFlow::Continue(())
        })?;
        Ok(parsed)
    }

    /// Calls `visit` with each record's line (or record or row number) and its JSON value, its
    /// columns renamed, or why it is not JSON, until it breaks.
    fn raw_records(
        &self,
        mut visit: impl FnMut(usize, std::result::Result<Value, String>) -> ControlFlow<()>,
    ) -> Result<()> {
        let path = self.path.as_path();
        let rename = self.layout.is_tabular() || !self.columns.is_empty();
        let mut visit = |line: usize, value: std::result::Result<Value, String>| {
            let value = match value {
                Ok(Value::Object(object)) if rename => {
                    Ok(Value::Object(self.columns.apply(object)))
                }
                other => other,
            };
            visit(line, value)
        };
        match self.layout {
            Layout::JsonLines | Layout::JsonArray => {
                let mut reader = open(path)?;
                skip_bom(path, &mut reader)?;
                if self.layout == Layout::JsonLines {
                    lines(path, reader, visit)
                } else {
                    skip_whitespace(path, &mut reader)?;
                    elements(path, reader, visit)
                }
            }
            Layout::Csv | Layout::Tsv => {
                let mut reader = open(path)?;
                skip_bom(path, &mut reader)?;
                let delimiter = if self.layout == Layout::Csv { b',' } else { b'\t' };
                tabular::rows(path, reader, delimiter, |(line, value)| visit(line, value))
            }
            Layout::Parquet => parquet::rows(path, |(line, value)| visit(line, value)),
            Layout::Text => text::documents(
                path,
                || {
                    let mut reader = open(path)?;
                    skip_bom(path, &mut reader)?;
                    Ok(reader)
                },
                visit,
            ),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// `None` when no record is valid.
    pub fn format(&self) -> Option<Format> {
        self.schema.as_ref().map(|s| s.format)
    }

    /// Calls `visit` with every record in file order, checked against the format, until it
    /// breaks. An error is about the file as a whole: it cannot be read, its JSON array is
    /// broken, or an array element is longer than [`MAX_RECORD_BYTES`].
    pub fn for_each(&self, mut visit: impl FnMut(Checked) -> ControlFlow<()>) -> Result<()> {
        self.raw_records(|line, value| {
            visit(match check_record(self.schema.as_ref(), self.detected, value) {
                Ok(record) => Ok(Entry { line, record }),
                Err(message) => Err(Problem { line, message }),
            })
        })
    }

    /// Reads every record and counts the valid and the bad ones, keeping the first `keep`
    /// problems.
    pub fn lint(&self, keep: usize) -> Result<Lint> {
        let mut lint = Lint {
            layout: self.layout,
            format: self.format(),
            column_names: self.names.clone(),
            columns: self.columns.clone(),
            records: 0,
            bad: 0,
            problems: Vec::new(),
        };
        self.for_each(|checked| {
            match checked {
                Ok(_) => lint.records += 1,
                Err(problem) => {
                    lint.bad += 1;
                    if lint.problems.len() < keep {
                        lint.problems.push(problem);
                    }
                }
            }
            ControlFlow::Continue(())
        })?;
        Ok(lint)
    }
}

/// What a lint found in a whole file.
#[derive(Debug, Clone)]
pub struct Lint {
    pub layout: Layout,
    /// `None` when no record is valid.
    pub format: Option<Format>,
    /// A table's column names; empty for JSON.
    pub column_names: Vec<String>,
    /// The mapping the records were read with.
    pub columns: Columns,
    /// Valid records.
    pub records: usize,
    /// Bad records, every one counted.
    pub bad: usize,
    /// The first bad records, as many as the lint was asked to keep.
    pub problems: Vec<Problem>,
}

impl Lint {
    /// One line per kept problem: `line 3: missing "output"`.
    pub fn problem_lines(&self) -> Vec<String> {
        self.problems.iter().map(|p| p.display(self.layout)).collect()
    }
}

fn open(path: &Path) -> Result<BufReader<File>> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    Ok(BufReader::with_capacity(64 << 10, file))
}

fn skip_bom(path: &Path, reader: &mut BufReader<File>) -> Result<()> {
    let start = reader.fill_buf().map_err(|e| Error::io(path, e))?;
    if start.starts_with(BOM) {
        reader.consume(BOM.len());
    }
    Ok(())
}

/// How a file is laid out: by its extension (`.csv`, `.tsv`, `.parquet`, `.txt`, `.jsonl`,
/// `.json`, as the appliance stores them), else by its first bytes: Parquet's magic, a JSON array's `[`
/// or a record's `{`, a first line with a tab (TSV) or a comma (CSV); anything else is read as
/// JSON Lines, so each bad line is reported as such.
pub fn layout_of(path: &Path) -> Result<Layout> {
    let extension = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
    let mut reader = open(path)?;
    let start = reader.fill_buf().map_err(|e| Error::io(path, e))?;
    let is_parquet = start.starts_with(parquet::MAGIC);
    match extension.as_deref() {
        Some("parquet") => return Ok(Layout::Parquet),
        Some("csv") => return Ok(Layout::Csv),
        Some("tsv") => return Ok(Layout::Tsv),
        Some("txt") => return Ok(Layout::Text),
        Some("jsonl" | "ndjson" | "json") => {}
        _ if is_parquet => return Ok(Layout::Parquet),
        _ => {}
    }
    skip_bom(path, &mut reader)?;
    let array = skip_whitespace(path, &mut reader)?;
    if array == Some(b'[') {
        return Ok(Layout::JsonArray);
    }
    if array == Some(b'{') || matches!(extension.as_deref(), Some("jsonl" | "ndjson" | "json")) {
        return Ok(Layout::JsonLines);
    }
    let buf = reader.fill_buf().map_err(|e| Error::io(path, e))?;
    let first_line = buf.split(|&b| b == b'\n').next().unwrap_or_default();
    Ok(if first_line.contains(&b'\t') {
        Layout::Tsv
    } else if first_line.contains(&b',') {
        Layout::Csv
    } else {
        Layout::JsonLines
    })
}

/// A table's column names; none for JSON.
fn column_names(path: &Path, layout: Layout) -> Result<Vec<String>> {
    match layout {
        Layout::JsonLines | Layout::JsonArray => Ok(Vec::new()),
        Layout::Csv | Layout::Tsv => {
            let mut reader = open(path)?;
            skip_bom(path, &mut reader)?;
            tabular::columns(path, reader, if layout == Layout::Csv { b',' } else { b'\t' })
        }
        Layout::Parquet => parquet::columns(path),
        Layout::Text => Ok(Vec::new()),
    }
}

/// Skips leading whitespace and returns the first other byte, if any. The whitespace holds
/// only blank lines, so line numbers do not matter here.
fn skip_whitespace(path: &Path, reader: &mut BufReader<File>) -> Result<Option<u8>> {
    loop {
        let buf = reader.fill_buf().map_err(|e| Error::io(path, e))?;
        if buf.is_empty() {
            return Ok(None);
        }
        match buf.iter().position(|b| !b.is_ascii_whitespace()) {
            Some(at) => {
                let first = buf[at];
                reader.consume(at);
                return Ok(Some(first));
            }
            None => {
                let all = buf.len();
                reader.consume(all);
            }
        }
    }
}

fn lines(
    path: &Path,
    reader: BufReader<File>,
    mut visit: impl FnMut(usize, std::result::Result<Value, String>) -> ControlFlow<()>,
) -> Result<()> {
    each_line(path, reader, |number, line| {
        let value = match line {
            _ if line.is_blank() => return ControlFlow::Continue(()),
            Line::Text(bytes) => std::str::from_utf8(bytes)
                .map_err(|e| format!("not valid UTF-8: {e}"))
                .and_then(|text| {
                    serde_json::from_str::<Value>(text).map_err(|e| format!("not valid JSON: {e}"))
                }),
            Line::TooLong(len) => Err(format!(
                "the line is {}, longer than the {} a record may be",
                mib(len),
                mib(MAX_RECORD_BYTES)
            )),
        };
        visit(number, value)
    })
}

/// One line as read: its bytes without the line end, or its length when past the limit.
pub(super) enum Line<'a> {
    Text(&'a [u8]),
    TooLong(usize),
}

impl Line<'_> {
    pub(super) fn is_blank(&self) -> bool {
        matches!(self, Line::Text(bytes) if bytes.iter().all(u8::is_ascii_whitespace))
    }
}

/// Calls `visit` with each line's 1-based number, holding at most [`MAX_RECORD_BYTES`] of it.
pub(super) fn each_line(
    path: &Path,
    mut reader: BufReader<File>,
    mut visit: impl FnMut(usize, Line) -> ControlFlow<()>,
) -> Result<()> {
    let io = |e| Error::io(path, e);
    let mut line = Vec::new();
    for number in 1.. {
        line.clear();
        // One byte past the limit tells a line of exactly the limit from a longer one.
        let mut limited = reader.by_ref().take(MAX_RECORD_BYTES as u64 + 1);
        if limited.read_until(b'\n', &mut line).map_err(io)? == 0 {
            break;
        }
        let ended = line.last() == Some(&b'\n');
        let read = if ended || line.len() <= MAX_RECORD_BYTES {
            let text = line.strip_suffix(b"\n").unwrap_or(&line);
            Line::Text(text.strip_suffix(b"\r").unwrap_or(text))
        } else {
            Line::TooLong(line.len() + reader.skip_until(b'\n').map_err(io)?)
        };
        if visit(number, read).is_break() {
            break;
        }
    }
    Ok(())
}

pub(super) fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1u32 << 20))
}

/// Streams the elements of the JSON array `reader` is positioned at (after any byte-order
/// mark). serde_json calls back for each element as it parses it, so stopping early is an error
/// the caller knows to ignore.
fn elements(
    path: &Path,
    reader: BufReader<File>,
    mut visit: impl FnMut(usize, std::result::Result<Value, String>) -> ControlFlow<()>,
) -> Result<()> {
    let since_record = Rc::new(Cell::new(0usize));
    let budget = Budget { inner: reader, since_record: Rc::clone(&since_record) };
    let mut deserializer = serde_json::Deserializer::from_reader(budget);
    let mut state = Elements { visit: &mut visit, since_record, number: 0, stopped: false };
    let result = (&mut state).deserialize(&mut deserializer).and_then(|()| deserializer.end());
    match result {
        Ok(()) => Ok(()),
        Err(_) if state.stopped => Ok(()),
        Err(e) if e.is_io() && state.since_record.get() > MAX_RECORD_BYTES => Err(Error::Dataset {
            path: path.to_path_buf(),
            message: format!(
                "record {} is longer than the {} a record may be",
                state.number + 1,
                mib(MAX_RECORD_BYTES)
            ),
        }),
        Err(e) if e.is_io() => Err(Error::io(path, e.into())),
        Err(e) => Err(Error::Dataset {
            path: path.to_path_buf(),
            message: format!("file starts with '[' but is not a valid JSON array: {e}"),
        }),
    }
}

/// Counts the bytes read since the last record ended and fails past [`MAX_RECORD_BYTES`], so
/// one huge element cannot be parsed into memory.
struct Budget {
    inner: BufReader<File>,
    since_record: Rc<Cell<usize>>,
}

impl Read for Budget {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        let total = self.since_record.get() + n;
        self.since_record.set(total);
        if total > MAX_RECORD_BYTES {
            return Err(std::io::Error::other("record too long"));
        }
        Ok(n)
    }
}

struct Elements<'v, F> {
    visit: &'v mut F,
    since_record: Rc<Cell<usize>>,
    /// Elements seen so far.
    number: usize,
    /// `visit` broke.
    stopped: bool,
}

impl<'de, F> DeserializeSeed<'de> for &mut Elements<'_, F>
where
    F: FnMut(usize, std::result::Result<Value, String>) -> ControlFlow<()>,
{
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de, F> Visitor<'de> for &mut Elements<'_, F>
where
    F: FnMut(usize, std::result::Result<Value, String>) -> ControlFlow<()>,
{
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON array of records")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(value) = seq.next_element::<Value>()? {
            self.number += 1;
            self.since_record.set(0);
            if (self.visit)(self.number, Ok(value)).is_break() {
                self.stopped = true;
                return Err(A::Error::custom("stopped by the reader"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
#[path = "stream_tests.rs"]
mod tests;
