//! Dataset formats read from files: every format's records, and each bad record reported with
//! its line or record number.

use super::*;

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../datasets/examples")
}

/// Writes `text` to a file named `name` in a fresh temp dir and reads it.
fn check(name: &str, text: &str) -> (tempfile::TempDir, Result<Parsed>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    let parsed = read_dataset(&path);
    (dir, parsed)
}

fn user(s: &str) -> Message {
    Message::new(Role::User, s)
}
fn assistant(s: &str) -> Message {
    Message::new(Role::Assistant, s)
}
fn system(s: &str) -> Message {
    Message::new(Role::System, s)
}

#[test]
fn alpaca_json_array_with_system_and_history() {
    let parsed = read_dataset(examples().join("alpaca.json")).unwrap();
    assert_eq!(parsed.layout, Layout::JsonArray);
    assert_eq!(parsed.format, Some(Format::Alpaca));
    assert!(parsed.problems.is_empty(), "{:?}", parsed.problems);
    let records: Vec<Record> = parsed.entries.iter().map(|e| e.record.clone()).collect();
    assert_eq!(
        records,
        vec![
            Record::Conversation(vec![
                user("What is 12 + 30?"),
                assistant("12 + 30 = 42. The answer is 42.")
            ]),
            Record::Conversation(vec![
                system("Be brief."),
                user("Write the given word in reverse order.\nstream"),
                assistant("stream reversed is maerts."),
            ]),
            Record::Conversation(vec![
                user("What is 12 + 30?"),
                assistant("42."),
                user("And what is 42 - 2?"),
                assistant("42 - 2 = 40."),
            ]),
        ]
    );
    assert_eq!(parsed.entries.iter().map(|e| e.line).collect::<Vec<_>>(), vec![1, 2, 3]);
}

#[test]
fn sharegpt_messages_prompt_completion_and_text() {
    let sharegpt = read_dataset(examples().join("sharegpt.jsonl")).unwrap();
    assert_eq!(sharegpt.format, Some(Format::ShareGpt));
    assert_eq!(sharegpt.layout, Layout::JsonLines);
    assert_eq!(
        sharegpt.entries[1].record,
        Record::Conversation(vec![
            system("You answer in one sentence."),
            user("Spell 'gate' backwards."),
            assistant("'gate' backwards is 'etag'."),
            user("And 'river'?"),
            assistant("'river' backwards is 'revir'."),
        ])
    );

    let messages = read_dataset(examples().join("messages.jsonl")).unwrap();
    assert_eq!(messages.format, Some(Format::Messages));
    assert_eq!(messages.entries.len(), 2);
    assert_eq!(
        messages.entries[0].record,
        Record::Conversation(vec![
            system("You are a helpful assistant."),
            user("Convert 3 kilometres to metres."),
            assistant("3 kilometres is 3 * 1000 = 3000 metres."),
        ])
    );

    let pc = read_dataset(examples().join("prompt-completion.jsonl")).unwrap();
    assert_eq!(pc.format, Some(Format::PromptCompletion));
    assert_eq!(
        pc.entries[0].record,
        Record::PromptCompletion {
            prompt: "Q: What is 9 * 3?\nA:".into(),
            completion: " 9 * 3 = 27.".into()
        }
    );

    let text = read_dataset(examples().join("text.jsonl")).unwrap();
    assert_eq!(text.format, Some(Format::Text));
    assert_eq!(text.entries.len(), 2);
    assert!(matches!(&text.entries[1].record, Record::Text(t) if t.starts_with("Each layer")));
}

#[test]
fn openai_content_parts_and_user_assistant_roles_in_sharegpt() {
    let (_dir, parsed) = check(
        "d.jsonl",
        r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}, {"role": "assistant", "content": "Hello"}]}
{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}, {"role": "assistant", "content": "Hello"}]}
"#,
    );
    let parsed = parsed.unwrap();
    assert_eq!(
        parsed.entries[0].record,
        Record::Conversation(vec![user("Hi there"), assistant("Hello")])
    );
    assert_eq!(parsed.problems.len(), 1);
    let said = &parsed.problems[0].message;
    assert!(said.contains("multimodal records are not supported"), "{said}");

    let (_dir, parsed) = check(
        "s.jsonl",
        r#"{"conversations": [{"from": "user", "value": "a"}, {"from": "assistant", "value": "b"}]}"#,
    );
    assert_eq!(
        parsed.unwrap().entries[0].record,
        Record::Conversation(vec![user("a"), assistant("b")])
    );
}

#[test]
fn every_bad_record_is_reported_with_its_line() {
    let text = [
        r#"{"instruction": "ok", "input": "", "output": "fine"}"#, // 1
        r#"{"instruction": "broken", "output": "#,                 // 2: not JSON
        "",                                                        // 3: blank, skipped
        r#"["not", "an", "object"]"#,                              // 4
        r#"{"instruction": "no output"}"#,                         // 5: missing field
        r#"{"instruction": 3, "output": "x"}"#,                    // 6: wrong type
        r#"{"instruction": "", "input": " ", "output": "x"}"#,     // 7: empty
        r#"{"instruction": "q", "output": ""}"#,                   // 8: empty output
        r#"{"conversations": [{"from": "human", "value": "hi"}]}"#, // 9: other format
        r#"{"instruction": "h", "output": "o", "history": [["q"]]}"#, // 10: bad history
        r#"{"instruction": "fine again", "output": "yes"}"#,       // 11
    ]
    .join("\n");
    let (_dir, parsed) = check("bad.jsonl", &text);
    let parsed = parsed.unwrap();
    assert_eq!(parsed.format, Some(Format::Alpaca));
    assert_eq!(parsed.entries.iter().map(|e| e.line).collect::<Vec<_>>(), vec![1, 11]);
    let got: Vec<(usize, &str)> =
        parsed.problems.iter().map(|p| (p.line, p.message.as_str())).collect();
    let expected: [(usize, &str); 8] = [
        (2, "not valid JSON"),
        (4, "record must be a JSON object, found an array"),
        (5, "missing \"output\""),
        (6, "\"instruction\" must be a string, found a number"),
        (7, "\"instruction\" and \"input\" are both empty"),
        (8, "\"output\" is empty"),
        (9, "looks like a sharegpt record, but the dataset is alpaca"),
        (10, "\"history\" item 1 must be a pair"),
    ];
    assert_eq!(got.len(), expected.len(), "{got:?}");
    for ((line, message), (want_line, want)) in got.iter().zip(expected) {
        assert_eq!(*line, want_line, "{message}");
        assert!(message.contains(want), "line {line}: {message:?} should contain {want:?}");
    }
    assert_eq!(parsed.problem_lines()[0].split(':').next(), Some("line 2"));

    let err = parsed.into_entries().unwrap_err();
    match err {
        Error::DatasetRecord { line, message, .. } => {
            assert_eq!(line, 2);
            assert!(message.ends_with("(and 7 more bad records)"), "{message}");
        }
        other => panic!("expected a record error, got {other}"),
    }
}

#[test]
fn conversation_problems_name_the_message() {
    let text = [
        r#"{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}"#,
        r#"{"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]}"#,
        r#"{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}, {"from": "human", "value": "more?"}]}"#,
        r#"{"conversations": []}"#,
        r#"{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]}"#,
        r#"{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": 5}]}"#,
        r#"{"conversations": "q"}"#,
        r#"{"conversations": [{"value": "q"}]}"#,
    ]
    .join("\n");
    let (_dir, parsed) = check("c.jsonl", &text);
    let parsed = parsed.unwrap();
    assert_eq!(parsed.format, Some(Format::ShareGpt));
    let got: Vec<(usize, &str)> =
        parsed.problems.iter().map(|p| (p.line, p.message.as_str())).collect();
    let expected: [(usize, &str); 7] = [
        (
            2,
            "message 2: unknown role \"bot\" (expected one of human, gpt, system, user, assistant)",
        ),
        (3, "conversation ends with a user message"),
        (4, "\"conversations\" is empty"),
        (5, "message 2 (assistant) is empty"),
        (6, "message 2: \"value\" must be a string, found a number"),
        (7, "\"conversations\" must be an array, found a string"),
        (8, "message 1: missing \"from\""),
    ];
    assert_eq!(got.len(), expected.len(), "{got:?}");
    for ((line, message), (want_line, want)) in got.iter().zip(expected) {
        assert_eq!(*line, want_line, "{message}");
        assert!(message.contains(want), "line {line}: {message:?} should contain {want:?}");
    }
}

#[test]
fn json_array_problems_cite_record_numbers() {
    let (_dir, parsed) = check("a.json", r#"[{"text": "one"}, 7, {"text": ""}, {"text": "four"}]"#);
    let parsed = parsed.unwrap();
    assert_eq!(parsed.layout, Layout::JsonArray);
    assert_eq!(parsed.problems.iter().map(|p| p.line).collect::<Vec<_>>(), vec![2, 3]);
    assert_eq!(
        parsed.problem_lines(),
        vec![
            "record 2: record must be a JSON object, found a number".to_string(),
            "record 3: \"text\" is empty".to_string(),
        ]
    );
    let err = parsed.into_entries().unwrap_err().to_string();
    assert!(err.contains("record 2: record must be a JSON object"), "{err}");

    let (_dir, parsed) = check("broken.json", r#"[{"text": "one"}, "#);
    let err = parsed.unwrap_err().to_string();
    assert!(err.contains("not a valid JSON array"), "{err}");
}

#[test]
fn format_comes_from_the_first_valid_record() {
    // Line 1 is not JSON and line 2 is an invalid sharegpt record; line 3 decides: text.
    let (_dir, parsed) = check(
        "f.jsonl",
        "nonsense\n{\"conversations\": []}\n{\"text\": \"hello\"}\n{\"unknown\": 1}\n",
    );
    let parsed = parsed.unwrap();
    assert_eq!(parsed.format, Some(Format::Text));
    assert_eq!(parsed.entries.len(), 1);
    assert_eq!(parsed.problems.iter().map(|p| p.line).collect::<Vec<_>>(), vec![1, 2, 4]);

    let (_dir, parsed) = check("none.jsonl", "{\"foo\": 1}\n{\"bar\": 2}\n");
    let parsed = parsed.unwrap();
    assert_eq!(parsed.format, None);
    assert!(
        parsed.problems[0].message.contains("unrecognised record with keys [foo]"),
        "{:?}",
        parsed.problems
    );
}

#[test]
fn empty_files_are_a_clear_error() {
    for (name, text) in [("e.jsonl", ""), ("blank.jsonl", "\n  \n\n"), ("e.json", "[]")] {
        let (_dir, parsed) = check(name, text);
        match parsed.unwrap_err() {
            Error::Dataset { message, .. } => assert_eq!(message, "contains no records", "{name}"),
            other => panic!("{name}: expected a dataset error, got {other}"),
        }
    }
    let err = read_dataset(examples().join("does-not-exist.jsonl")).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err}");
}

/// The one record of `openai-tags.jsonl`, as its registry entry's tags read it.
fn sum_conversation() -> Record {
    Record::Conversation(vec![
        system("Answer with the sum."),
        user("What is 2 + 2?"),
        assistant("2 + 2 = 4."),
    ])
}

#[test]
fn registry_resolves_files_columns_and_tags() {
    let registry = examples().join("dataset_info.json");
    assert_eq!(
        registry_names(&registry).unwrap(),
        vec!["alpaca_example", "custom_tags_example", "qa_columns_example", "sharegpt_example"]
    );

    let alpaca = read_registry_dataset(&registry, "alpaca_example").unwrap();
    assert_eq!(alpaca.format, Some(Format::Alpaca));
    assert_eq!(alpaca.entries.len(), 3);
    assert!(alpaca.path.ends_with("examples/alpaca.json"));

    let sharegpt = read_registry_dataset(&registry, "sharegpt_example").unwrap();
    assert_eq!(sharegpt.format, Some(Format::ShareGpt));
    assert_eq!(sharegpt.entries.len(), 2);

    let tags = read_registry_dataset(&registry, "custom_tags_example").unwrap();
    assert!(tags.problems.is_empty(), "{:?}", tags.problems);
    assert_eq!(tags.entries[0].record, sum_conversation());

    let qa = read_registry_dataset(&registry, "qa_columns_example").unwrap();
    assert_eq!(
        qa.entries[0].record,
        Record::Conversation(vec![
            user("How many metres are in 2 kilometres?"),
            assistant("2 kilometres is 2000 metres.")
        ])
    );

    let err = read_registry_dataset(&registry, "nope").unwrap_err().to_string();
    assert!(err.contains("no dataset named \"nope\" (registry has: alpaca_example, "), "{err}");
}

#[test]
fn an_uploaded_registry_is_reduced_to_the_entry_of_its_file() {
    let text = std::fs::read_to_string(examples().join("dataset_info.json")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(examples().join("openai-tags.jsonl"), dir.path().join("kept.jsonl")).unwrap();
    let registry = dir.path().join("kept.dataset_info.json");

    // Told by the uploaded file's name (directories ignored), then read as its entry maps it.
    let (single, name) =
        single_dataset_registry(&text, None, Some("C:\\data\\openai-tags.jsonl"), "kept.jsonl")
            .unwrap();
    assert_eq!(name, "custom_tags_example");
    std::fs::write(&registry, &single).unwrap();
    assert_eq!(registry_names(&registry).unwrap(), ["custom_tags_example"]);
    let parsed = read_registry_dataset(&registry, &name).unwrap();
    assert!(parsed.problems.is_empty(), "{:?}", parsed.problems);
    assert_eq!(parsed.entries[0].record, sum_conversation());

    // Named outright, whatever the file is called.
    let (single, name) =
        single_dataset_registry(&text, Some("qa_columns_example"), Some("x.jsonl"), "k.jsonl")
            .unwrap();
    assert_eq!(name, "qa_columns_example");
    let value: Value = serde_json::from_str(&single).unwrap();
    assert_eq!(value["qa_columns_example"]["file_name"], "k.jsonl");
    assert_eq!(value["qa_columns_example"]["columns"]["prompt"], "question");

    // Several entries and nothing to choose by, an unknown name, not a registry: errors that
    // say what to do.
    let err = single_dataset_registry(&text, None, Some("other.jsonl"), "k").unwrap_err();
    assert!(err.to_string().contains("name the dataset to use (it has: alpaca_example, "), "{err}");
    let err = single_dataset_registry(&text, Some("nope"), None, "k").unwrap_err();
    assert!(err.to_string().contains("no dataset named \"nope\""), "{err}");
    let err = single_dataset_registry("[1]", None, None, "k").unwrap_err();
    assert!(err.to_string().contains("must be a JSON object"), "{err}");
    let err = single_dataset_registry("{", None, None, "k").unwrap_err();
    assert!(err.to_string().contains("not valid JSON"), "{err}");
    // One entry is used whatever the file is called.
    let (_, name) =
        single_dataset_registry(r#"{"only": {"file_name": "a.json"}}"#, None, Some("b"), "k")
            .unwrap();
    assert_eq!(name, "only");
}

#[test]
fn registry_entries_that_cannot_be_used_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let registry = dir.path().join("dataset_info.json");
    std::fs::write(
        &registry,
        r#"{
            "hub": {"hf_hub_url": "someone/data"},
            "ranking": {"file_name": "x.jsonl", "formatting": "ranking"},
            "missing": {"file_name": "absent.jsonl"},
            "tagged": {"file_name": "t.jsonl", "formatting": "sharegpt", "tags": {"user_tag": "u", "assistant_tag": "a"}}
        }"#,
    )
    .unwrap();
    std::fs::write(dir.path().join("t.jsonl"), r#"{"conversations": [{"from": "u", "value": "q"}, {"from": "human", "value": "z"}, {"from": "a", "value": "r"}]}"#).unwrap();

    let err = read_registry_dataset(&registry, "hub").unwrap_err().to_string();
    assert!(err.contains("hub: only local datasets"), "{err}");
    let err = read_registry_dataset(&registry, "ranking").unwrap_err().to_string();
    assert!(err.contains("formatting \"ranking\" is not supported"), "{err}");
    let err = read_registry_dataset(&registry, "missing").unwrap_err();
    assert!(matches!(&err, Error::Io { path, .. } if path.ends_with("absent.jsonl")), "{err}");
    // Explicit tags replace the default role names: "human" is no longer a role.
    let tagged = read_registry_dataset(&registry, "tagged").unwrap();
    assert_eq!(tagged.problems.len(), 1);
    assert!(
        tagged.problems[0]
            .message
            .contains("unknown role \"human\" (expected one of u, a, system)"),
        "{:?}",
        tagged.problems
    );
}

/// LLaMA-Factory's preference, KTO and multimodal records look like alpaca or ShareGPT records
/// but must not be trained as such: each is refused for what it is, not for a missing field.
#[test]
fn preference_kto_and_multimodal_records_are_refused_for_what_they_are() {
    let text = [
        r#"{"instruction": "ok", "input": "", "output": "fine"}"#, // 1
        r#"{"instruction": "Pick", "input": "", "chosen": "good", "rejected": "bad"}"#, // 2
        r#"{"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "gpt", "value": "a"}, "rejected": {"from": "gpt", "value": "b"}}"#, // 3
        r#"{"instruction": "q", "output": "a wrong answer", "kto_tag": false}"#, // 4
        r#"{"instruction": "q", "output": "a right answer", "kto_tag": true}"#,  // 5
        r#"{"instruction": "<image>What is this?", "output": "A cat.", "images": ["cat.jpg"]}"#, // 6
        r#"{"instruction": "Listen", "output": "Rain.", "audios": ["rain.wav"]}"#, // 7
        r#"{"instruction": "No media", "output": "Fine.", "images": []}"#,         // 8
    ]
    .join("\n");
    let (_dir, parsed) = check("d.jsonl", &text);
    let parsed = parsed.unwrap();
    assert_eq!(parsed.format, Some(Format::Alpaca));
    assert_eq!(parsed.entries.iter().map(|e| e.line).collect::<Vec<_>>(), vec![1, 8]);
    let lines: Vec<usize> = parsed.problems.iter().map(|p| p.line).collect();
    assert_eq!(lines, vec![2, 3, 4, 5, 6, 7]);
    let message = |i: usize| parsed.problems[i].message.as_str();
    for i in [0, 1] {
        assert!(message(i).contains("preference data (chosen/rejected pairs"), "{}", message(i));
    }
    assert!(message(0).starts_with("\"chosen\": "), "{}", message(0));
    for i in [2, 3] {
        assert!(message(i).starts_with("\"kto_tag\": this is KTO-labelled data"), "{}", message(i));
    }
    assert!(message(4).starts_with("\"images\": multimodal records"), "{}", message(4));
    assert!(message(5).starts_with("\"audios\": multimodal records"), "{}", message(5));

    // A file of nothing but preference pairs: every record says so, none is trained.
    let (_dir, parsed) = check("p.jsonl", text.lines().nth(2).unwrap());
    let parsed = parsed.unwrap();
    assert_eq!(parsed.format, None);
    assert!(parsed.problems[0].message.contains("preference data"), "{:?}", parsed.problems);
}

#[test]
fn registry_entries_of_preference_kto_or_media_data_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let registry = dir.path().join("dataset_info.json");
    std::fs::write(
        &registry,
        r#"{
            "dpo": {"file_name": "d.jsonl", "ranking": true},
            "kto": {"file_name": "d.jsonl", "columns": {"kto_tag": "label"}},
            "mm": {"file_name": "d.jsonl", "formatting": "sharegpt", "columns": {"images": "pictures"}}
        }"#,
    )
    .unwrap();
    std::fs::write(dir.path().join("d.jsonl"), r#"{"instruction": "q", "output": "a"}"#).unwrap();
    let err = read_registry_dataset(&registry, "dpo").unwrap_err().to_string();
    assert!(err.contains("dpo: ranking: this is preference data"), "{err}");
    let err = read_registry_dataset(&registry, "kto").unwrap_err().to_string();
    assert!(err.contains("columns map \"kto_tag\": KTO-labelled data"), "{err}");
    let err = read_registry_dataset(&registry, "mm").unwrap_err().to_string();
    assert!(err.contains("columns map \"images\": multimodal datasets"), "{err}");
}

#[test]
fn llama_factory_v1_records_with_text_parts_and_per_message_loss_weights() {
    // LLaMA-Factory v1's record: content a list of typed parts, a loss_weight per message.
    let text = [
        r#"{"messages": [{"role": "user", "content": [{"type": "text", "value": "Hi"}]}, {"role": "assistant", "content": [{"type": "text", "value": "Hel"}, {"type": "text", "value": "lo"}], "loss_weight": 0.0}, {"role": "user", "content": [{"type": "text", "value": "Again"}], "loss_weight": 0}, {"role": "assistant", "content": [{"type": "text", "value": "Hello again"}], "loss_weight": 1.0}]}"#,
        r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "loss_weight": 0.5}]}"#,
        r#"{"messages": [{"role": "user", "content": "q", "loss_weight": 1}, {"role": "assistant", "content": "a"}]}"#,
        r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "reasoning", "value": "hmm"}, {"type": "text", "value": "a"}]}]}"#,
        r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "value": "x.png"}]}, {"role": "assistant", "content": "a"}]}"#,
        r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "loss_weight": "1"}]}"#,
    ]
    .join("\n");
    let (_dir, parsed) = check("v1.jsonl", &text);
    let parsed = parsed.unwrap();
    assert_eq!(parsed.format, Some(Format::Messages));
    let context = Message { trained: false, ..assistant("Hello") };
    assert_eq!(
        parsed.entries.iter().map(|e| e.record.clone()).collect::<Vec<_>>(),
        vec![Record::Conversation(vec![
            user("Hi"),
            context,
            user("Again"),
            assistant("Hello again")
        ])]
    );
    let problems: Vec<(usize, &str)> =
        parsed.problems.iter().map(|p| (p.line, p.message.as_str())).collect();
    let said = [
        (2, "message 2: \"loss_weight\" 0.5: only 0 (context) or 1 (trained) is supported"),
        (3, "message 1: \"loss_weight\" must be 0 on a user message"),
        (4, "message 2: \"content\" has a reasoning part, which is not supported yet"),
        (5, "message 1: \"content\" has a part of type image_url: multimodal records are not"),
        (6, "message 2: \"loss_weight\" must be a number, found a string"),
    ];
    assert_eq!(problems.len(), said.len(), "{problems:?}");
    for ((line, message), (want_line, want)) in problems.iter().zip(said) {
        assert_eq!(*line, want_line);
        assert!(message.starts_with(want), "line {line}: {message}");
    }
}
