//! Records to samples: loss masks over the assistant turns of real chat templates, text and
//! prompt/completion samples, and record errors that carry their line.

use super::*;
use crate::data::formats::read_dataset;
use crate::data::template::SpecialTokens;
use crate::data::template::tests::qwen3_tokenizer;
use crate::data::tokenizer::tiny_tokenizer;

fn user(s: &str) -> Message {
    Message::new(Role::User, s)
}
fn assistant(s: &str) -> Message {
    Message::new(Role::Assistant, s)
}

/// Decodes each run of consecutive trained tokens.
fn trained_runs(tok: &Tokenizer, sample: &Sample) -> Vec<String> {
    let mut runs = Vec::new();
    let mut run: Vec<u32> = Vec::new();
    for (&id, &trained) in sample.ids.iter().zip(&sample.trained) {
        if trained {
            run.push(id);
        } else if !run.is_empty() {
            runs.push(tok.decode(&run).unwrap());
            run.clear();
        }
    }
    if !run.is_empty() {
        runs.push(tok.decode(&run).unwrap());
    }
    runs
}

fn check(tok: &Tokenizer, record: Record, options: PrepareOptions) -> Sample {
    let sample = Preparer::new(tok, options).unwrap().sample(&record).unwrap();
    assert_eq!(sample.ids.len(), sample.trained.len());
    sample
}

#[test]
fn chatml_mask_covers_exactly_the_assistant_turns() {
    let tok = tiny_tokenizer().unwrap();
    let conversation = Record::Conversation(vec![
        Message::new(Role::System, "Be brief."),
        user("What is 12 + 7?"),
        assistant("12 + 7 = 19. The answer is 19."),
        user("Spell 'gate' backwards."),
        assistant("'gate' backwards is 'etag'."),
    ]);
    let sample = check(&tok, conversation.clone(), PrepareOptions::default());
    assert_eq!(
        trained_runs(&tok, &sample),
        vec![
            "12 + 7 = 19. The answer is 19.<|im_end|>\n",
            "'gate' backwards is 'etag'.<|im_end|>\n"
        ]
    );
    assert_eq!(
        sample.ids.iter().zip(&sample.trained).filter(|(id, t)| **t && **id == 2).count(),
        2
    );

    let all = check(&tok, conversation, PrepareOptions { train_on_prompt: true });
    assert!(all.trained.iter().all(|&t| t));
    assert_eq!(all.ids, sample.ids);
}

#[test]
fn qwen3_mask_covers_every_turn_with_its_end_marker() {
    let tok = qwen3_tokenizer();
    let conversation = Record::Conversation(vec![
        user("Combien font 2 + 2 ?"),
        assistant("Ça fait 4 😀"),
        user("用中文说"),
        assistant("<think>\n简单\n</think>\n\n二加二等于四。"),
    ]);
    let sample = check(&tok, conversation, PrepareOptions::default());
    assert_eq!(
        trained_runs(&tok, &sample),
        vec!["Ça fait 4 😀<|im_end|>\n", "<think>\n简单\n</think>\n\n二加二等于四。<|im_end|>\n"]
    );
}

#[test]
fn text_and_prompt_completion_samples() {
    let tok = tiny_tokenizer().unwrap();
    let text = check(&tok, Record::Text("Layers stream.".into()), PrepareOptions::default());
    assert_eq!(text.ids.last(), Some(&2));
    assert!(text.trained.iter().all(|&t| t));
    assert_eq!(tok.decode(&text.ids).unwrap(), "Layers stream.<|im_end|>");

    // With a template, prompt/completion is a user/assistant conversation.
    let pc = Record::PromptCompletion { prompt: "Q: 9 * 3?".into(), completion: "27".into() };
    let sample = check(&tok, pc.clone(), PrepareOptions::default());
    assert_eq!(trained_runs(&tok, &sample), vec!["27<|im_end|>\n"]);
    assert!(tok.decode(&sample.ids).unwrap().starts_with("<|im_start|>user\nQ: 9 * 3?"));

    // Without one, it is prompt + completion + eos, the completion and eos trained.
    let plain = Tokenizer::from_bytes(
        include_bytes!("../../assets/tiny-tokenizer/tokenizer.json"),
        Some(br#"{"eos_token": "<|endoftext|>"}"#),
    )
    .unwrap();
    let pc = Record::PromptCompletion { prompt: "Q: 9 * 3?\nA:".into(), completion: " 27".into() };
    let sample = check(&plain, pc, PrepareOptions::default());
    assert_eq!(trained_runs(&plain, &sample), vec![" 27<|endoftext|>"]);
    assert_eq!(plain.decode(&sample.ids).unwrap(), "Q: 9 * 3?\nA: 27<|endoftext|>");

    let err = Preparer::new(&plain, PrepareOptions::default())
        .unwrap()
        .sample(&Record::Conversation(vec![user("a"), assistant("b")]))
        .unwrap_err();
    assert!(err.to_string().contains("no chat template"), "{err}");
}

#[test]
fn record_errors_carry_the_line_and_missing_eos_is_counted() {
    let tok = tiny_tokenizer().unwrap();
    let raising = ChatTemplate::new(
        "{% if messages|length > 2 %}{{ raise_exception('Only single turns') }}{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
        SpecialTokens::default(),
        "t",
    )
    .unwrap();
    let preparer = Preparer::with_template(&tok, raising, PrepareOptions::default());
    let entries = vec![
        Entry { line: 4, record: Record::Conversation(vec![user("a"), assistant("b")]) },
        Entry {
            line: 9,
            record: Record::Conversation(vec![
                user("a"),
                assistant("b"),
                user("c"),
                assistant("d"),
            ]),
        },
    ];
    match preparer.prepare(Path::new("d.jsonl"), &entries).unwrap_err() {
        Error::DatasetRecord { line, message, .. } => {
            assert_eq!(line, 9);
            assert!(message.contains("Only single turns"), "{message}");
        }
        other => panic!("expected a record error, got {other}"),
    }
    // This template never writes eos, so the first record cannot teach the model to stop.
    let prepared = preparer.prepare(Path::new("d.jsonl"), &entries[..1]).unwrap();
    assert_eq!(prepared.samples_without_eos, 1);
    // It also ignores add_generation_prompt, so the turn's header cannot be told from the reply
    // and is trained with it.
    assert_eq!(trained_runs(&tok, &prepared.samples[0]), vec!["assistant: b\n"]);
}

#[test]
fn demo_dataset_prepares_with_the_tiny_tokenizer() {
    let tok = tiny_tokenizer().unwrap();
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../datasets/demo-alpaca.jsonl");
    let parsed = read_dataset(&path).unwrap();
    let entries = parsed.into_entries().unwrap();
    assert_eq!(entries.len(), 1000);
    let prepared =
        Preparer::new(&tok, PrepareOptions::default()).unwrap().prepare(&path, &entries).unwrap();
    assert_eq!(prepared.samples_without_eos, 0);
    let tokens: usize = prepared.samples.iter().map(|s| s.ids.len()).sum();
    // The tokenizer was trained on this text: it should average well under 100 tokens a record.
    assert!(tokens < 100 * 1000, "{tokens} tokens");
    let unk_free =
        prepared.samples.iter().all(|s| s.ids.iter().all(|&id| (id as usize) < tok.vocab_size()));
    assert!(unk_free);
}

#[test]
fn a_reply_with_loss_weight_zero_is_context_not_a_target() {
    let tok = tiny_tokenizer().unwrap();
    let conversation = |first_trained: bool| {
        Record::Conversation(vec![
            user("What is 12 + 7?"),
            Message { trained: first_trained, ..assistant("It is 19.") },
            user("And 12 + 8?"),
            assistant("It is 20."),
        ])
    };
    let both = check(&tok, conversation(true), PrepareOptions::default());
    let last = check(&tok, conversation(false), PrepareOptions::default());
    assert_eq!(both.ids, last.ids, "the same text either way");
    assert_eq!(trained_runs(&tok, &both), vec!["It is 19.<|im_end|>\n", "It is 20.<|im_end|>\n"]);
    assert_eq!(trained_runs(&tok, &last), vec!["It is 20.<|im_end|>\n"]);
    // Training on the prompt trains everything, context replies included.
    let all = check(&tok, conversation(false), PrepareOptions { train_on_prompt: true });
    assert!(all.trained.iter().all(|&t| t));
}
