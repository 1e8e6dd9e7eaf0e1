//! The record-by-record reader against the whole-file reader: the same records and problems,
//! lines cited, over-long lines and JSON arrays, early stops and the lint's counts.

use super::*;
use crate::data::formats::{Parsed, read_dataset, read_registry_dataset};
use crate::data::{DatasetSource, Record};

fn datasets() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../datasets")
}

/// Every record the reader visits, split into entries and problems.
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
        .unwrap();
    (entries, problems)
}

/// The reader visits exactly the whole-file reader's records and problems, and its lint counts
/// them.
fn check_same(what: &str, reader: &DatasetReader, parsed: &Parsed) {
    assert_eq!(reader.layout(), parsed.layout, "{what}");
    assert_eq!(reader.format(), parsed.format, "{what}");
    let (entries, problems) = read_all(reader);
    assert_eq!(entries, parsed.entries, "{what}");
    assert_eq!(problems, parsed.problems, "{what}");
    let lint = reader.lint(3).unwrap();
    assert_eq!((lint.records, lint.bad), (parsed.entries.len(), parsed.problems.len()), "{what}");
    let first: Vec<String> = parsed.problem_lines().into_iter().take(3).collect();
    assert_eq!(lint.problem_lines(), first, "{what}");
}

/// Writes `text` to a file named `name` in a fresh temp dir.
fn write(name: &str, text: &[u8]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    (dir, path)
}

#[test]
fn fixtures_read_the_same_as_the_whole_file_reader() {
    let mut files = vec![datasets().join("demo-alpaca.jsonl")];
    for entry in std::fs::read_dir(datasets().join("examples")).unwrap() {
        let path = entry.unwrap().path();
        if !path.ends_with("dataset_info.json") {
            files.push(path);
        }
    }
    assert!(files.len() >= 8, "{files:?}");
    // Some files use columns only their registry entry maps: read plainly, all their records
    // are problems, which must match too.
    for path in &files {
        let parsed = read_dataset(path).unwrap();
        check_same(&path.display().to_string(), &DatasetReader::open(path).unwrap(), &parsed);
    }

    let registry = datasets().join("examples/dataset_info.json");
    for name in crate::data::registry_names(&registry).unwrap() {
        let parsed = read_registry_dataset(&registry, &name).unwrap();
        let source = DatasetSource::Registry { registry: registry.clone(), name: name.clone() };
        check_same(&name, &source.open().unwrap(), &parsed);
    }
}

#[test]
fn bad_records_read_the_same_as_the_whole_file_reader() {
    let cases: [(&str, &str); 7] = [
        (
            "bad.jsonl",
            concat!(
                "{\"instruction\": \"ok\", \"input\": \"\", \"output\": \"fine\"}\n",
                "{\"instruction\": \"broken\", \"output\": \n",
                "\n",
                "[\"not\", \"an\", \"object\"]\n",
                "{\"instruction\": \"no output\"}\n",
                "{\"instruction\": 3, \"output\": \"x\"}\n",
                "{\"conversations\": [{\"from\": \"human\", \"value\": \"hi\"}]}\n",
                "{\"instruction\": \"h\", \"output\": \"o\", \"history\": [[\"q\"]]}\n",
                "{\"instruction\": \"fine again\", \"output\": \"yes\"}",
            ),
        ),
        // The first valid record comes last: the records before it are checked against its
        // format, which the reader only learns at the end of its first pass.
        (
            "late.jsonl",
            "nonsense\n{\"conversations\": []}\n{\"instruction\": \"x\"}\n\n\
             {\"text\": \"hello\"}\n",
        ),
        ("none.jsonl", "{\"foo\": 1}\n{\"bar\": 2}\n7\n"),
        (
            "crlf.jsonl",
            "\u{feff}{\"text\": \"a\"}\r\n\r\n{\"text\": 2}\r\n  \t\r\n{\"text\": \"c\"}\r\n",
        ),
        ("array.json", r#"[{"text": "one"}, 7, {"text": ""}, {"text": "four"}, null]"#),
        (
            "bom-array.json",
            "\u{feff}\n  [{\"prompt\": \"p\", \"completion\": \"c\"}, {\"prompt\": 1}]\n",
        ),
        (
            "late-array.json",
            concat!(
                r#"[1, [2], {"text": ""}, {"messages": [{"role": "user", "content": "q"}, "#,
                r#"{"role": "assistant", "content": "a"}]}]"#
            ),
        ),
    ];
    for (name, text) in cases {
        let (_dir, path) = write(name, text.as_bytes());
        let parsed = read_dataset(&path).unwrap();
        check_same(name, &DatasetReader::open(&path).unwrap(), &parsed);
    }
}

#[test]
fn problems_cite_the_line_they_are_on() {
    // A byte-order mark, CRLF endings, blank lines, bytes that are not UTF-8 and a last line
    // without a newline.
    let mut text = b"\xef\xbb\xbf{\"text\": \"one\"}\r\n\r\n{\"text\": 5}\r\n".to_vec();
    text.extend(b"\n   \n{\"text\": \"\xff\"}\n{\"text\": \"seven\"}\n{\"tex\": \"eight\"}");
    let (_dir, path) = write("lines.jsonl", &text);
    let reader = DatasetReader::open(&path).unwrap();
    assert_eq!(reader.format(), Some(Format::Text));
    let (entries, problems) = read_all(&reader);
    assert_eq!(entries.iter().map(|e| e.line).collect::<Vec<_>>(), vec![1, 7]);
    assert_eq!(entries[0].record, Record::Text("one".into()));
    let got: Vec<(usize, &str)> = problems.iter().map(|p| (p.line, p.message.as_str())).collect();
    assert_eq!(got.len(), 3, "{got:?}");
    assert_eq!(got[0], (3, "\"text\" must be a string, found a number"));
    assert_eq!(got[1].0, 6);
    assert!(got[1].1.starts_with("not valid UTF-8"), "{got:?}");
    assert_eq!(got[2], (8, "missing \"text\""));
    assert_eq!(read_dataset(&path).unwrap().problems, problems);
}

/// A JSON Lines text record of exactly `len` bytes.
fn text_line(len: usize) -> String {
    let frame = r#"{"text": ""}"#.len();
    format!(r#"{{"text": "{}"}}"#, "x".repeat(len - frame))
}

#[test]
fn a_line_longer_than_a_record_may_be_is_a_problem_of_its_own() {
    let lines = [
        text_line(30),
        text_line(MAX_RECORD_BYTES + 1),
        text_line(MAX_RECORD_BYTES),
        text_line(MAX_RECORD_BYTES + (3 << 20)),
        text_line(20),
    ];
    let text = lines.join("\n");
    let (_dir, path) = write("long.jsonl", text.as_bytes());
    let reader = DatasetReader::open(&path).unwrap();
    let (entries, problems) = read_all(&reader);
    assert_eq!(entries.iter().map(|e| e.line).collect::<Vec<_>>(), vec![1, 3, 5]);
    assert_eq!(problems.iter().map(|p| p.line).collect::<Vec<_>>(), vec![2, 4]);
    assert!(
        problems[0].message.contains("longer than the 8.0 MiB a record may be"),
        "{problems:?}"
    );
    assert!(problems[1].message.starts_with("the line is 11.0 MiB"), "{problems:?}");
    let lint = reader.lint(100).unwrap();
    assert_eq!((lint.records, lint.bad), (3, 2));
}

#[test]
fn a_json_array_streams_and_its_errors_are_about_the_file() {
    let long =
        format!(r#"[{{"text": "a"}}, {}, {{"text": "c"}}]"#, text_line(MAX_RECORD_BYTES + 1));
    let (_dir, path) = write("long.json", long.as_bytes());
    // The first record decides the format; the long one stops the read.
    let reader = DatasetReader::open(&path).unwrap();
    let mut seen = Vec::new();
    let err = reader
        .for_each(|checked| {
            seen.push(checked.map(|e| e.line));
            ControlFlow::Continue(())
        })
        .unwrap_err();
    assert_eq!(seen, vec![Ok(1)]);
    match err {
        Error::Dataset { message, .. } => {
            assert_eq!(message, "record 2 is longer than the 8.0 MiB a record may be");
        }
        other => panic!("expected a dataset error, got {other}"),
    }

    for (name, text) in [
        ("broken.json", r#"[{"text": "one"}, {"text": "#),
        ("trailing.json", r#"[{"text": "one"}] {"text": "two"}"#),
        ("no-comma.json", r#"[{"text": "one"} {"text": "two"}]"#),
    ] {
        let (_dir, path) = write(name, text.as_bytes());
        let whole = read_dataset(&path).unwrap_err().to_string();
        assert!(whole.contains("not a valid JSON array"), "{name}: {whole}");
        let err = DatasetReader::open(&path).and_then(|r| r.lint(10)).unwrap_err().to_string();
        assert!(
            err.contains("file starts with '[' but is not a valid JSON array"),
            "{name}: {err}"
        );
    }

    for (name, text) in [("e.json", " [ ] "), ("e.jsonl", ""), ("blank.jsonl", "\n \r\n\t\n")] {
        let (_dir, path) = write(name, text.as_bytes());
        match DatasetReader::open(&path).unwrap_err() {
            Error::Dataset { message, .. } => assert_eq!(message, "contains no records", "{name}"),
            other => panic!("{name}: expected a dataset error, got {other}"),
        }
    }
    let err = DatasetReader::open(datasets().join("absent.jsonl")).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err}");
}

#[test]
fn visiting_stops_when_asked() {
    for path in [datasets().join("demo-alpaca.jsonl"), datasets().join("examples/alpaca.json")] {
        let reader = DatasetReader::open(&path).unwrap();
        let mut lines = Vec::new();
        reader
            .for_each(|checked| {
                lines.push(checked.map(|e| e.line).unwrap_or(0));
                if lines.len() == 2 { ControlFlow::Break(()) } else { ControlFlow::Continue(()) }
            })
            .unwrap();
        assert_eq!(lines, vec![1, 2], "{}", path.display());
    }
}

#[test]
fn lint_counts_every_problem_and_keeps_the_first() {
    let text: String = (1..=250)
        .map(|i| if i % 2 == 1 { "{\"text\": \"fine\"}\n" } else { "{\"text\": 1}\n" })
        .collect();
    let (_dir, path) = write("many.jsonl", text.as_bytes());
    let lint = DatasetReader::open(&path).unwrap().lint(100).unwrap();
    assert_eq!((lint.layout, lint.format), (Layout::JsonLines, Some(Format::Text)));
    assert_eq!((lint.records, lint.bad, lint.problems.len()), (125, 125, 100));
    let lines = lint.problem_lines();
    assert_eq!(lines[0], "line 2: \"text\" must be a string, found a number");
    assert!(lines[99].starts_with("line 200: "), "{}", lines[99]);

    let (_dir, path) = write("many.json", br#"[{"text": "a"}, 1, 2, {"text": "d"}]"#);
    let lint = DatasetReader::open(&path).unwrap().lint(1).unwrap();
    assert_eq!((lint.records, lint.bad), (2, 2));
    assert_eq!(
        lint.problem_lines(),
        vec!["record 2: record must be a JSON object, found a number"]
    );
}

/// The streaming reader (what uploads lint and large datasets train from) refuses preference,
/// KTO and multimodal records as the whole-file reader does, with the same reasons.
#[test]
fn preference_kto_and_multimodal_records_are_refused_record_by_record() {
    let text = concat!(
        r#"{"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "gpt", "value": "a"}, "rejected": {"from": "gpt", "value": "b"}}"#,
        "\n",
        r#"{"instruction": "q", "output": "a", "kto_tag": false}"#,
        "\n",
        r#"{"messages": [{"role": "user", "content": "<video>What happens?"}, {"role": "assistant", "content": "A goal."}], "videos": ["goal.mp4"]}"#,
        "\n",
        r#"{"instruction": "q", "output": "a"}"#,
        "\n",
    );
    let (_dir, path) = write("d.jsonl", text.as_bytes());
    let reader = DatasetReader::open(&path).unwrap();
    check_same("special records", &reader, &read_dataset(&path).unwrap());
    let lint = reader.lint(10).unwrap();
    assert_eq!((lint.format, lint.records, lint.bad), (Some(Format::Alpaca), 1, 3));
    let lines = lint.problem_lines();
    assert!(lines[0].starts_with("line 1: \"chosen\": this is preference data"), "{lines:?}");
    assert!(lines[1].starts_with("line 2: \"kto_tag\": this is KTO-labelled data"), "{lines:?}");
    assert!(lines[2].starts_with("line 3: \"videos\": multimodal records"), "{lines:?}");
}

/// Texts or problems, each with the line it starts on.
type Numbered = Vec<(usize, String)>;

/// The documents of a text file: (first line, text) and (first line, problem).
fn documents(text: &[u8]) -> (Numbered, Numbered) {
    let (_dir, path) = write("corpus.txt", text);
    let reader = DatasetReader::open(&path).unwrap();
    assert_eq!((reader.layout(), reader.format()), (Layout::Text, Some(Format::Text)));
    let (entries, problems) = read_all(&reader);
    let entries = entries
        .into_iter()
        .map(|e| match e.record {
            Record::Text(text) => (e.line, text),
            other => panic!("not text: {other:?}"),
        })
        .collect();
    // Training reads it the same way, through the reader.
    let parsed = DatasetSource::File(path.clone()).read().unwrap();
    assert_eq!(parsed.layout, Layout::Text);
    (entries, problems.into_iter().map(|p| (p.line, p.message)).collect())
}

#[test]
fn a_text_file_is_a_document_per_line_or_per_blank_line_block() {
    // One per line, as Hugging Face's text loader reads it; blank lines are not documents,
    // and neither line ends nor a byte-order mark are part of one.
    let (docs, problems) = documents(b"\xef\xbb\xbfThe first.\r\n\nThe second.\n\n  \nThe third.");
    let want = [(1, "The first."), (3, "The second."), (6, "The third.")];
    assert_eq!(docs, want.map(|(l, t)| (l, t.to_string())));
    assert!(problems.is_empty());
    // Blank lines between blocks of several lines: a document per block, numbered by its
    // first line, its lines joined.
    let (docs, _) = documents(b"\nTitle\nbody one\nbody two\n\n\nSecond\n\nThird\nend\n");
    let want = [(2, "Title\nbody one\nbody two"), (7, "Second"), (9, "Third\nend")];
    assert_eq!(docs, want.map(|(l, t)| (l, t.to_string())));
    // Lines with no blank between them stay documents of their own.
    let (docs, _) = documents(b"a\nb\nc\n");
    assert_eq!(docs.len(), 3);
}

#[test]
fn a_bad_text_document_is_a_problem_of_its_own() {
    let mut text = b"fine\n\nbad \xff byte\nstill bad\n\n".to_vec();
    text.extend_from_slice(&vec![b'x'; MAX_RECORD_BYTES + 1]);
    text.extend_from_slice(b"\n\nlast\nblock\n");
    let (docs, problems) = documents(&text);
    assert_eq!(docs, vec![(1, "fine".to_string()), (8, "last\nblock".to_string())]);
    assert_eq!(problems.len(), 2, "{problems:?}");
    assert_eq!(problems[0].0, 3);
    assert!(problems[0].1.starts_with("not valid UTF-8"), "{problems:?}");
    assert_eq!(problems[1].0, 6);
    assert!(problems[1].1.contains("longer than the 8.0 MiB a record may be"), "{problems:?}");
}

#[test]
fn a_registry_that_maps_only_a_prompt_is_pretraining_text() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("c4.jsonl"),
        "{\"text\": \"A document.\"}\n{\"text\": \"Another\", \"extra\": \"more\"}\n{\"text\": 3}\n",
    )
    .unwrap();
    let registry = dir.path().join("dataset_info.json");
    let entry = |columns: &str| {
        std::fs::write(
            &registry,
            format!(r#"{{"c4": {{"file_name": "c4.jsonl", "columns": {columns}}}}}"#),
        )
        .unwrap();
    };
    // LLaMA-Factory's own pretraining entry (its data README's `columns: {prompt: text}`).
    entry(r#"{"prompt": "text"}"#);
    let parsed = read_registry_dataset(&registry, "c4").unwrap();
    assert_eq!(parsed.format, Some(Format::Text));
    let texts: Vec<_> = parsed.entries.iter().map(|e| e.record.clone()).collect();
    assert_eq!(texts, vec![Record::Text("A document.".into()), Record::Text("Another".into())]);
    assert_eq!(parsed.problems.len(), 1);
    assert_eq!(parsed.problems[0].line, 3);
    assert!(parsed.problems[0].message.contains("\"text\" must be a string"), "{parsed:?}");
    let reader = DatasetReader::open_registry(&registry, "c4").unwrap();
    check_same("registry text", &reader, &parsed);
    // A query column joins the prompt with a newline, as LLaMA-Factory's prompt does.
    entry(r#"{"prompt": "text", "query": "extra"}"#);
    let parsed = read_registry_dataset(&registry, "c4").unwrap();
    assert_eq!(parsed.entries[1].record, Record::Text("Another\nmore".into()));
    // Neither a prompt nor a response: nothing to train on, said so.
    entry(r#"{"system": "text"}"#);
    let err = read_registry_dataset(&registry, "c4").unwrap_err().to_string();
    assert!(err.contains("columns map neither \"prompt\" nor \"response\""), "{err}");
}

#[test]
fn registry_keys_that_reading_the_file_would_not_honour_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.jsonl"), "{\"instruction\": \"q\", \"output\": \"a\"}\n")
        .unwrap();
    let registry = dir.path().join("dataset_info.json");
    let read = |extra: &str| {
        let entry = format!(r#"{{"a": {{"file_name": "a.jsonl"{extra}}}}}"#);
        std::fs::write(&registry, entry).unwrap();
        read_registry_dataset(&registry, "a").map(|p| p.entries.len()).map_err(|e| e.to_string())
    };
    // What LLaMA-Factory's own entries carry, read as it reads a local file.
    assert_eq!(read(r#", "split": "train", "hf_hub_url": "org/a", "ranking": false"#), Ok(1));
    for (extra, said) in [
        (r#", "split": "test""#, "split \"test\": a local file has only the train split"),
        (r#", "subset": "main""#, "subset \"main\": names part of a hub dataset"),
        (r#", "folder": "x""#, "folder \"x\": names part of a hub dataset"),
        (r#", "num_samples": 100"#, "num_samples 100: sampling records is not supported"),
        (r#", "colums": {}"#, "unknown key \"colums\""),
    ] {
        let err = read(extra).unwrap_err();
        assert!(err.contains(&format!("a: {said}")), "{extra}: {err}");
        // The record-by-record reader refuses the same way.
        assert!(DatasetReader::open_registry(&registry, "a").is_err(), "{extra}");
    }
}
