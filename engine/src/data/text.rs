//! Plain-text datasets (`.txt`), as pretraining documents. One document per line, as Hugging
//! Face's `text` loader reads such a file; where blank lines separate blocks of several lines
//! (paragraphs, pasted files), one document per block, its lines joined by newlines. Each
//! document is a `{"text": …}` record numbered by its first line, so it goes through the same
//! checks as a JSON `text` record. Memory is bounded by the longest document, which may be at
//! most [`MAX_RECORD_BYTES`]; a longer one is a problem of its own and reading goes on.

use std::fs::File;
use std::io::BufReader;
use std::ops::ControlFlow;
use std::path::Path;

use serde_json::{Value, json};

use super::stream::{Line, MAX_RECORD_BYTES, each_line, mib};
use crate::error::Result;

/// Whether `reader`'s documents are blocks: some blank line separates text, and some block has
/// more than one line. Reads only as far as it takes to see both.
fn in_blocks(path: &Path, reader: BufReader<File>) -> Result<bool> {
    let (mut blank_between, mut several, mut previous_text, mut seen_text) =
        (false, false, false, false);
    let mut blank_since_text = false;
    each_line(path, reader, |_, line| {
        if line.is_blank() {
            blank_since_text |= seen_text;
            previous_text = false;
        } else {
            several |= previous_text;
            blank_between |= blank_since_text;
            (previous_text, seen_text) = (true, true);
        }
        if blank_between && several { ControlFlow::Break(()) } else { ControlFlow::Continue(()) }
    })?;
    Ok(blank_between && several)
}

/// A document being gathered: the number of its first line, its bytes, and its length when it
/// has gone past the limit (its bytes are then no longer kept).
#[derive(Default)]
struct Document {
    first: usize,
    bytes: Vec<u8>,
    too_long: Option<usize>,
}

impl Document {
    fn add(&mut self, number: usize, line: Line) {
        let (empty, len) = (
            self.bytes.is_empty() && self.too_long.is_none(),
            match &line {
                Line::Text(bytes) => bytes.len(),
                Line::TooLong(len) => *len,
            },
        );
        if empty {
            self.first = number;
        }
        let total = self.too_long.unwrap_or(self.bytes.len()) + usize::from(!empty) + len;
        match line {
            Line::Text(bytes) if self.too_long.is_none() && total <= MAX_RECORD_BYTES => {
                if !empty {
                    self.bytes.push(b'\n');
                }
                self.bytes.extend_from_slice(bytes);
            }
            _ => {
                self.bytes = Vec::new();
                self.too_long = Some(total);
            }
        }
    }

    /// The record, or why there is none; `None` when nothing was gathered.
    fn take(&mut self) -> Option<(usize, std::result::Result<Value, String>)> {
        let Document { first, bytes, too_long } = std::mem::take(self);
        if bytes.is_empty() && too_long.is_none() {
            return None;
        }
        let record = match too_long {
            Some(len) => Err(format!(
                "the document is {}, longer than the {} a record may be",
                mib(len),
                mib(MAX_RECORD_BYTES)
            )),
            None => String::from_utf8(bytes)
                .map(|text| json!({ "text": text }))
                .map_err(|e| format!("not valid UTF-8: {}", e.utf8_error())),
        };
        Some((first, record))
    }
}

/// Calls `visit` with each document of the text file `path` (its first line's number and its
/// `{"text"}` record, or why it cannot be one) until it breaks. `open` opens the file past any
/// byte-order mark.
pub(super) fn documents(
    path: &Path,
    open: impl Fn() -> Result<BufReader<File>>,
    mut visit: impl FnMut(usize, std::result::Result<Value, String>) -> ControlFlow<()>,
) -> Result<()> {
    let blocks = in_blocks(path, open()?)?;
    let mut document = Document::default();
    let mut stopped = false;
    each_line(path, open()?, |number, line| {
        let blank = line.is_blank();
        if !blank {
            document.add(number, line);
        }
        if (blank || !blocks)
            && let Some((first, record)) = document.take()
            && visit(first, record).is_break()
        {
            stopped = true;
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    })?;
    if !stopped && let Some((first, record)) = document.take() {
        let _ = visit(first, record);
    }
    Ok(())
}
