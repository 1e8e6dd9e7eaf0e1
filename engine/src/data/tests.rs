//! The whole path, file to micro-batches.

use super::*;
use crate::backend::IGNORE;

fn datasets() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../datasets")
}

#[test]
fn demo_dataset_to_micro_batches() {
    let tok = tiny_tokenizer().unwrap();
    let source = DatasetSource::File(datasets().join("demo-alpaca.jsonl"));
    let options = DataOptions { seq_len: 256, train_on_prompt: false, shuffle_seed: Some(1) };
    let packed = load(&source, &tok, &options).unwrap();
    let s = packed.stats;
    assert_eq!(
        (s.records, s.samples, s.truncated_samples, s.samples_without_eos),
        (1000, 1000, 0, 0)
    );
    assert_eq!(s.rows, packed.rows.len());
    assert_eq!(s.tokens + s.padding_tokens, s.rows * 256);
    assert!(s.trained_tokens > 0 && s.trained_tokens < s.tokens);
    // Each sample ends with a trained <|im_end|>: at least one eos target per record.
    let eos = tok.eos_token_id().unwrap() as i32;
    let eos_targets: usize =
        packed.rows.iter().map(|r| r.targets.iter().filter(|&&t| t == eos).count()).sum();
    assert!(eos_targets >= 1000, "{eos_targets}");

    let batches = packed.micro_batches(4).unwrap();
    let trained: usize = batches.iter().map(MicroBatch::trained_tokens).sum();
    assert_eq!(trained, s.trained_tokens);
    assert!(batches.iter().all(|b| b.targets.iter().all(|&t| t == IGNORE || t >= 0)));

    let again = load(&source, &tok, &options).unwrap();
    assert_eq!(again.rows, packed.rows, "same seed, same rows");
}

#[test]
fn registry_source_and_train_on_prompt() {
    let tok = tiny_tokenizer().unwrap();
    let source = DatasetSource::Registry {
        registry: datasets().join("examples/dataset_info.json"),
        name: "sharegpt_example".into(),
    };
    let masked = load(
        &source,
        &tok,
        &DataOptions { seq_len: 128, train_on_prompt: false, shuffle_seed: None },
    )
    .unwrap();
    let full = load(
        &source,
        &tok,
        &DataOptions { seq_len: 128, train_on_prompt: true, shuffle_seed: None },
    )
    .unwrap();
    assert_eq!(masked.stats.tokens, full.stats.tokens);
    // All but each document's first token are trained with train_on_prompt.
    assert_eq!(full.stats.trained_tokens, full.stats.tokens - full.stats.samples);
    assert!(masked.stats.trained_tokens < full.stats.trained_tokens);
}

#[test]
fn zero_sequence_length_and_bad_records_are_errors() {
    let tok = tiny_tokenizer().unwrap();
    let source = DatasetSource::File(datasets().join("examples/text.jsonl"));
    let err = load(
        &source,
        &tok,
        &DataOptions { seq_len: 0, train_on_prompt: false, shuffle_seed: None },
    )
    .unwrap_err();
    assert!(matches!(err, Error::Invalid(_)), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.jsonl");
    std::fs::write(&path, "{\"text\": \"fine\"}\n{\"text\": 1}\n").unwrap();
    let err = load(
        &DatasetSource::File(path),
        &tok,
        &DataOptions { seq_len: 8, train_on_prompt: false, shuffle_seed: None },
    )
    .unwrap_err();
    assert!(matches!(err, Error::DatasetRecord { line: 2, .. }), "{err}");
}
