//! Tables that would cost far more to read than their size: a Parquet file of a few kilobytes
//! whose one zstd cell inflates to 400 MiB, one of five million rows, a row past the record
//! limit, and CSV rows whose quoting went wrong. Each is refused (or its row reported) with the
//! limit it broke named, before the bomb is inflated.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;
use sluice_engine::data::{DatasetReader, MAX_PARQUET_ROWS, MAX_RECORD_BYTES};

/// A Parquet file of one `text` column holding `rows` batches of values, zstd-compressed.
fn parquet(path: &Path, batches: impl IntoIterator<Item = Vec<ByteArray>>, dictionary: bool) {
    let schema = "message schema { REQUIRED BYTE_ARRAY text (UTF8); }";
    let schema = Arc::new(parse_message_type(schema).unwrap());
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(Default::default()))
        .set_dictionary_enabled(dictionary)
        .set_statistics_enabled(EnabledStatistics::None)
        .build();
    let file = std::fs::File::create(path).unwrap();
    let mut writer = SerializedFileWriter::new(file, schema, Arc::new(props)).unwrap();
    let mut group = writer.next_row_group().unwrap();
    let mut column = group.next_column().unwrap().unwrap();
    for batch in batches {
        column.typed::<ByteArrayType>().write_batch(&batch, None, None).unwrap();
    }
    column.close().unwrap();
    group.close().unwrap();
    writer.close().unwrap();
}

fn refusal(path: &Path) -> String {
    match DatasetReader::open(path) {
        Ok(_) => panic!("{} was accepted", path.display()),
        Err(err) => err.to_string(),
    }
}

fn temp(name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    (dir, path)
}

#[test]
fn a_parquet_cell_that_inflates_to_400_mib_is_refused_without_inflating_it() {
    let (_dir, path) = temp("bomb.parquet");
    let cell = ByteArray::from(vec![b'a'; 400 << 20]);
    parquet(&path, [vec![cell]], false);
    let size = std::fs::metadata(&path).unwrap().len();
    assert!(size < 64 << 10, "the bomb is {size} bytes");

    let started = Instant::now();
    let message = refusal(&path);
    assert!(
        message.contains("column \"text\" has a page that inflates to 400.0 MiB, more than the 32.0 MiB a page may be"),
        "{message}"
    );
    // Inflating 400 MiB of zstd takes a good fraction of a second; reading headers does not.
    assert!(started.elapsed().as_millis() < 200, "{:?}", started.elapsed());
}

#[test]
fn a_parquet_file_of_five_million_rows_is_refused_by_its_row_count() {
    let (_dir, path) = temp("rows.parquet");
    let batch = vec![ByteArray::from("x"); 500_000];
    parquet(&path, std::iter::repeat_n(batch, 10), true);
    let size = std::fs::metadata(&path).unwrap().len();
    assert!(size < 64 << 10, "{size} bytes");
    let message = refusal(&path);
    assert!(
        message.contains(&format!(
            "the file has 5000000 rows, more than the {MAX_PARQUET_ROWS} a Parquet dataset may have"
        )),
        "{message}"
    );
}

#[test]
fn a_parquet_row_longer_than_a_record_may_be_is_a_problem_of_its_row() {
    let (_dir, path) = temp("long.parquet");
    let long = ByteArray::from(vec![b'a'; MAX_RECORD_BYTES + 1]);
    let rows = vec![ByteArray::from("short"), long, ByteArray::from("short too")];
    parquet(&path, [rows], false);
    let lint = DatasetReader::open(&path).unwrap().lint(10).unwrap();
    assert_eq!((lint.records, lint.bad), (2, 1), "{:?}", lint.problems);
    assert_eq!(lint.problems[0].line, 2);
    assert!(
        lint.problems[0]
            .message
            .starts_with("the row is 8.0 MiB, longer than the 8.0 MiB a record may be"),
        "{:?}",
        lint.problems
    );
}

#[test]
fn a_csv_field_with_a_stray_quote_is_a_problem_of_its_row() {
    let (_dir, path) = temp("quotes.csv");
    let csv = "instruction,output\n\
               \"Say \"\"hi\"\"\",\"Hi,\nthere\"\n\
               Say \"hi\",Hi\n\
               \"Say\" hi,Hi\n\
               plain,\"quoted\"\n";
    std::fs::write(&path, csv).unwrap();
    let lint = DatasetReader::open(&path).unwrap().lint(10).unwrap();
    let problems: Vec<(usize, &str)> =
        lint.problems.iter().map(|p| (p.line, p.message.as_str())).collect();
    assert_eq!(lint.records, 2, "{problems:?}");
    let stray = "column \"instruction\" has a stray quote: a field with a quote in it must be \
                 quoted whole, with its quotes doubled (\"say \"\"hi\"\"\")";
    assert_eq!(problems, vec![(4, stray), (5, stray)]);
}

#[test]
fn a_csv_quote_never_closed_is_a_problem_of_its_row() {
    let (_dir, path) = temp("unclosed.csv");
    std::fs::write(&path, "instruction,output\nfine,yes\nalso fine,\"no\n").unwrap();
    let lint = DatasetReader::open(&path).unwrap().lint(10).unwrap();
    assert_eq!((lint.records, lint.bad), (1, 1), "{:?}", lint.problems);
    assert_eq!(lint.problems[0].line, 3);
    assert!(
        lint.problems[0].message.contains("column \"output\" has a stray quote"),
        "{:?}",
        lint.problems
    );
}
