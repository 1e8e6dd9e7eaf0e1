//! Datasets as people have them: CSV, TSV and Parquet tables with their columns mapped to a
//! format, and lenient reading that skips invalid records (a real ShareGPT dump with an odd
//! conversation trains with it left out). Damaged files of every layout are errors, never panics.

#![allow(clippy::unwrap_used)]

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;
use proptest::prelude::*;
use sluice_engine::backend::cpu::Cpu;
use sluice_engine::data::{
    Columns, DataOptions, DatasetReader, DatasetSource, Entry, Format, Layout, Message, Problem,
    ReadOptions, Record, Role, load, tiny_tokenizer,
};
use sluice_engine::train::{Devices, Job, JobSettings, ModelSource, RunOptions};

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("write test file");
    path
}

fn read_all(reader: &DatasetReader) -> (Vec<Entry>, Vec<Problem>) {
    let (mut entries, mut problems) = (Vec::new(), Vec::new());
    reader
        .for_each(|checked| {
            match checked {
                Ok(entry) => entries.push(entry),
                Err(problem) => problems.push(problem),
            }
            ControlFlow::Continue(())
        })
        .expect("reads");
    (entries, problems)
}

fn alpaca(user: &str, assistant: &str) -> Record {
    Record::Conversation(vec![
        Message::new(Role::User, user),
        Message::new(Role::Assistant, assistant),
    ])
}

#[test]
fn csv_with_common_column_names_is_mapped_automatically_and_bad_rows_cite_their_lines() {
    let tmp = tempfile::tempdir().unwrap();
    // gsm8k's columns; a quoted field spans lines 3-4, so the next row starts on line 5.
    let csv = "question,answer\n\
               What is 2+2?,4\n\
               \"Two lines,\nwith a comma?\",\"yes, \"\"quoted\"\"\"\n\
               Only a question\n\
               \n\
               Last?,Yes.\n";
    let path = write(tmp.path(), "gsm.csv", csv.as_bytes());
    let reader = DatasetReader::open(&path).unwrap();
    assert_eq!(reader.layout(), Layout::Csv);
    assert_eq!(reader.format(), Some(Format::Alpaca));
    assert_eq!(reader.column_names(), ["question", "answer"]);
    assert_eq!(reader.columns().to_flag(), "instruction=question,output=answer");
    let (entries, problems) = read_all(&reader);
    let got: Vec<(usize, Record)> = entries.into_iter().map(|e| (e.line, e.record)).collect();
    assert_eq!(
        got,
        vec![
            (2, alpaca("What is 2+2?", "4")),
            (3, alpaca("Two lines,\nwith a comma?", "yes, \"quoted\"")),
            (7, alpaca("Last?", "Yes.")),
        ]
    );
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].line, 5);
    assert!(problems[0].message.contains("1 fields, the header 2"), "{problems:?}");

    // Training refuses it; the lenient source leaves line 5 out.
    let tok = tiny_tokenizer().unwrap();
    let options = DataOptions { seq_len: 128, train_on_prompt: false, shuffle_seed: None };
    let strict = DatasetSource::File(path.clone());
    let err = load(&strict, &tok, &options).unwrap_err().to_string();
    assert!(err.contains("line 5"), "{err}");
    let lenient = strict.with(ReadOptions { skip_invalid: true, ..ReadOptions::default() });
    assert_eq!(load(&lenient, &tok, &options).unwrap().stats.records, 3);
}

#[test]
fn tsv_with_an_explicit_mapping_and_a_mapping_naming_a_missing_column() {
    let tmp = tempfile::tempdir().unwrap();
    let tsv = "id\tq\tctx\tans\n1\tTranslate\tbonjour\thello\n2\tSum 1, 2\t\t3\n";
    let path = write(tmp.path(), "data.tsv", tsv.as_bytes());
    // The names mean nothing known: no format without a mapping, every row a problem.
    let unmapped = DatasetReader::open(&path).unwrap();
    assert_eq!(unmapped.format(), None);
    assert_eq!(unmapped.lint(10).unwrap().bad, 2);

    let columns = Columns::parse("instruction=q,input=ctx,output=ans").unwrap();
    let reader = DatasetReader::open_mapped(&path, &columns).unwrap();
    assert_eq!(reader.layout(), Layout::Tsv);
    let (entries, problems) = read_all(&reader);
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(entries[0].record, alpaca("Translate\nbonjour", "hello"));
    assert_eq!(entries[1].record, alpaca("Sum 1, 2", "3"));

    let wrong = Columns::parse("instruction=question,output=ans").unwrap();
    let err = DatasetReader::open_mapped(&path, &wrong).unwrap_err().to_string();
    assert!(err.contains("\"question\"") && err.contains("id, q, ctx, ans"), "{err}");
}

#[test]
fn a_mapping_applies_to_json_lines_in_training_and_in_the_reader_alike() {
    let tmp = tempfile::tempdir().unwrap();
    let jsonl = "{\"q\": \"Hi?\", \"a\": \"Hello.\"}\n{\"q\": \"Bye?\", \"a\": \"Bye.\"}\n";
    let path = write(tmp.path(), "qa.jsonl", jsonl.as_bytes());
    let columns = Columns::parse("prompt=q,completion=a").unwrap();
    let source = DatasetSource::File(path.clone())
        .with(ReadOptions { columns: columns.clone(), skip_invalid: false });
    let parsed = source.read().unwrap();
    assert_eq!(parsed.format, Some(Format::PromptCompletion));
    assert_eq!(parsed.entries.len(), 2);
    let (entries, _) = read_all(&source.open().unwrap());
    assert_eq!(entries, parsed.entries);
    // Without the mapping the records are of no format.
    assert!(DatasetSource::File(path).read().unwrap().format.is_none());
}

/// A Parquet file as Hugging Face datasets write them: string columns and a list of structs.
const CHAT_SCHEMA: &str = "message schema {
    REQUIRED BYTE_ARRAY question (UTF8);
    REQUIRED BYTE_ARRAY answer (UTF8);
}";

fn write_parquet(path: &Path, rows: &[(&str, &str)], per_group: usize, compression: Compression) {
    let schema = Arc::new(parse_message_type(CHAT_SCHEMA).unwrap());
    let props = Arc::new(WriterProperties::builder().set_compression(compression).build());
    let file = std::fs::File::create(path).unwrap();
    let mut writer = SerializedFileWriter::new(file, schema, props).unwrap();
    for group in rows.chunks(per_group) {
        let mut row_group = writer.next_row_group().unwrap();
        for column in 0..2 {
            let values: Vec<ByteArray> = group
                .iter()
                .map(|r| ByteArray::from(if column == 0 { r.0 } else { r.1 }))
                .collect();
            let mut col = row_group.next_column().unwrap().unwrap();
            col.typed::<ByteArrayType>().write_batch(&values, None, None).unwrap();
            col.close().unwrap();
        }
        row_group.close().unwrap();
    }
    writer.close().unwrap();
}

/// `messages: list<struct<role, content>>`, as chat datasets on the Hub hold conversations.
fn write_messages_parquet(path: &Path) {
    let schema = "message schema {
        REQUIRED group messages (LIST) {
            REPEATED group list {
                REQUIRED group element {
                    REQUIRED BYTE_ARRAY role (UTF8);
                    REQUIRED BYTE_ARRAY content (UTF8);
                }
            }
        }
    }";
    let schema = Arc::new(parse_message_type(schema).unwrap());
    let props = Arc::new(WriterProperties::builder().set_compression(Compression::SNAPPY).build());
    let file = std::fs::File::create(path).unwrap();
    let mut writer = SerializedFileWriter::new(file, schema, props).unwrap();
    let mut group = writer.next_row_group().unwrap();
    // Two rows: [user, assistant] and [user, user] (the second ends with the user: invalid).
    let roles = ["user", "assistant", "user", "user"].map(ByteArray::from);
    let contents = ["Capital of France?", "Paris.", "Hello?", "Anyone?"].map(ByteArray::from);
    let (def, rep) = ([1i16, 1, 1, 1], [0i16, 1, 0, 1]);
    for values in [&roles, &contents] {
        let mut col = group.next_column().unwrap().unwrap();
        col.typed::<ByteArrayType>().write_batch(values, Some(&def), Some(&rep)).unwrap();
        col.close().unwrap();
    }
    group.close().unwrap();
    writer.close().unwrap();
}

#[test]
fn parquet_rows_are_read_across_row_groups_with_snappy_and_zstd() {
    let tmp = tempfile::tempdir().unwrap();
    let rows: Vec<(String, String)> =
        (1..=25).map(|i| (format!("What is {i} squared?"), format!("{}", i * i))).collect();
    let rows: Vec<(&str, &str)> = rows.iter().map(|(q, a)| (q.as_str(), a.as_str())).collect();
    for (name, compression) in [
        ("snappy.parquet", Compression::SNAPPY),
        ("zstd.parquet", Compression::ZSTD(Default::default())),
    ] {
        let path = tmp.path().join(name);
        write_parquet(&path, &rows, 10, compression);
        let reader = DatasetReader::open(&path).unwrap();
        assert_eq!(reader.layout(), Layout::Parquet);
        assert_eq!(reader.column_names(), ["question", "answer"]);
        assert_eq!(reader.format(), Some(Format::Alpaca), "{name}");
        let (entries, problems) = read_all(&reader);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(entries.len(), 25);
        assert_eq!(entries[24].line, 25);
        assert_eq!(entries[24].record, alpaca("What is 25 squared?", "625"));
        // Read as training reads it, and found by its magic without the extension.
        let bare = tmp.path().join(format!("{name}-bare"));
        std::fs::copy(&path, &bare).unwrap();
        let parsed = DatasetSource::File(bare).read().unwrap();
        assert_eq!(parsed.entries, entries);
    }
}

#[test]
fn a_parquet_messages_column_is_a_conversation_and_rows_are_skipped_by_number() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("chat.parquet");
    write_messages_parquet(&path);
    let reader = DatasetReader::open(&path).unwrap();
    assert_eq!(reader.format(), Some(Format::Messages));
    let lint = reader.lint(10).unwrap();
    assert_eq!((lint.records, lint.bad), (1, 1));
    assert_eq!(
        lint.problem_lines(),
        ["row 2: conversation ends with a user message; the last message must be the assistant's"]
    );
    let source =
        DatasetSource::File(path).with(ReadOptions { skip_invalid: true, ..Default::default() });
    let parsed = source.read().unwrap();
    let entries = parsed.into_valid_entries().unwrap();
    assert_eq!(entries[0].record, alpaca("Capital of France?", "Paris."));
}

/// The first `n` records of the real ShareGPT dump (a JSON array, cut short in the package, so
/// it is read record by record rather than parsed whole).
fn sharegpt_prefix(n: usize) -> Vec<serde_json::Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../.cache/test-assets/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json");
    let mut file = std::fs::File::open(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch_test_assets.sh)", path.display()));
    let mut bytes = vec![0u8; 4 << 20];
    let read = std::io::Read::read(&mut file, &mut bytes).unwrap();
    bytes.truncate(read);
    let mut rest = &bytes[bytes.iter().position(|&b| b == b'[').unwrap() + 1..];
    let mut records = Vec::new();
    while records.len() < n {
        let mut stream =
            serde_json::Deserializer::from_slice(rest).into_iter::<serde_json::Value>();
        records.push(stream.next().unwrap().unwrap());
        rest = &rest[stream.byte_offset()..];
        let skip = rest.iter().position(|b| !b.is_ascii_whitespace() && *b != b',').unwrap();
        rest = &rest[skip..];
    }
    records
}

#[test]
fn a_real_sharegpt_dump_with_an_odd_conversation_trains_with_it_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    // Record 29 of the dump has an empty message: the only odd one of the first 30.
    let records = sharegpt_prefix(30);
    let bytes = serde_json::to_vec_pretty(&records).unwrap();
    let path = write(tmp.path(), "sharegpt.json", &bytes);

    let lint = DatasetReader::open(&path).unwrap().lint(10).unwrap();
    assert_eq!(lint.format, Some(Format::ShareGpt));
    assert_eq!((lint.records, lint.bad), (29, 1));
    assert_eq!(lint.problems[0].line, 29);
    assert!(lint.problems[0].message.contains("is empty"), "{:?}", lint.problems);

    let strict = DatasetSource::File(path.clone());
    let lenient = strict.clone().with(ReadOptions { skip_invalid: true, ..Default::default() });
    let tok = tiny_tokenizer().unwrap();
    let options = DataOptions { seq_len: 256, train_on_prompt: false, shuffle_seed: None };
    let err = load(&strict, &tok, &options).unwrap_err().to_string();
    assert!(err.contains("record 29"), "{err}");
    assert_eq!(load(&lenient, &tok, &options).unwrap().stats.records, 29);

    let job = Job {
        model: ModelSource::Preset("tiny".into()),
        data: lenient,
        eval_data: None,
        devices: Devices::Cpu,
        settings: JobSettings {
            seq_len: 64,
            micro_batch: 2,
            grad_accum: 1,
            steps: Some(2),
            ..JobSettings::default()
        },
    };
    let options = RunOptions::unplanned(job, tmp.path().join("run")).unwrap();
    let summary = sluice_engine::train::run(&Cpu::new(), &options, false, &mut ()).unwrap();
    assert_eq!(summary.steps, 2);
    assert!(summary.last_loss.is_finite());
}

/// A valid file of each layout, as bytes, for the mutation tests.
fn valid_files(dir: &Path) -> Vec<(&'static str, Vec<u8>)> {
    let parquet = dir.join("valid.parquet");
    write_parquet(&parquet, &[("q1", "a1"), ("q2", "a2"), ("q3", "a3")], 2, Compression::SNAPPY);
    let zstd = dir.join("valid-zstd.parquet");
    write_parquet(&zstd, &[("q1", "a1"), ("q2", "a2")], 1, Compression::ZSTD(Default::default()));
    vec![
        ("csv", b"instruction,output\nq1,a1\n\"q,2\",\"a\"\"2\"\n".to_vec()),
        ("tsv", b"prompt\tcompletion\nq1\ta1\nq2\ta2\n".to_vec()),
        ("jsonl", b"{\"text\": \"one\"}\n{\"text\": \"two\"}\n".to_vec()),
        ("json", b"[{\"text\": \"one\"}, {\"text\": \"two\"}]".to_vec()),
        ("parquet", std::fs::read(&parquet).unwrap()),
        ("parquet", std::fs::read(&zstd).unwrap()),
    ]
}

/// Everything a dataset can be asked, which must answer `Ok` or `Err` and never panic.
fn exercise(path: &Path) {
    let tok = tiny_tokenizer().unwrap();
    let options = DataOptions { seq_len: 32, train_on_prompt: false, shuffle_seed: None };
    if let Ok(reader) = DatasetReader::open(path) {
        let _ = reader.lint(5);
    }
    for skip_invalid in [false, true] {
        let source = DatasetSource::File(path.to_path_buf())
            .with(ReadOptions { skip_invalid, ..Default::default() });
        let _ = load(&source, &tok, &options);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_of_any_layout_are_errors_or_records_never_panics(
        bytes in proptest::collection::vec(any::<u8>(), 0..600),
        layout in 0usize..5,
        magic in any::<bool>(),
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let extension = ["csv", "tsv", "parquet", "jsonl", "bin"][layout];
        let mut bytes = bytes;
        if magic {
            // Parquet's magic at both ends gets the random middle past the first check.
            bytes.splice(0..0, *b"PAR1");
            bytes.extend_from_slice(b"PAR1");
        }
        exercise(&write(tmp.path(), &format!("random.{extension}"), &bytes));
    }

    #[test]
    fn mutated_valid_files_are_errors_or_records_never_panics(
        which in 0usize..6,
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in proptest::option::of(any::<prop::sample::Index>()),
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let files = valid_files(tmp.path());
        let (extension, mut bytes) = files[which].clone();
        for (at, value) in flips {
            let at = at.index(bytes.len());
            bytes[at] = value;
        }
        if let Some(cut) = cut {
            bytes.truncate(cut.index(bytes.len() + 1));
        }
        exercise(&write(tmp.path(), &format!("mutated.{extension}"), &bytes));
    }
}
