//! Dataset files as people damage them (bytes changed, lines cut, random bytes) in every format
//! the reader takes: a list of problems or a dataset, never a panic.

use proptest::prelude::*;
use proptest::sample::Index;
use sluice_engine::data::DatasetSource;

/// One valid file per format the reader recognises.
const SEEDS: [&str; 6] = [
    "{\"instruction\": \"Add\", \"input\": \"2 and 2\", \"output\": \"4\"}\n\
     {\"instruction\": \"Greet\", \"output\": \"Hello!\"}\n",
    "{\"conversations\": [{\"from\": \"human\", \"value\": \"Hi\"}, {\"from\": \"gpt\", \"value\": \"Hello\"}]}\n",
    "{\"messages\": [{\"role\": \"system\", \"content\": \"Be kind\"}, {\"role\": \"user\", \"content\": \"Hi\"}, \
     {\"role\": \"assistant\", \"content\": \"Hello\"}]}\n",
    "{\"prompt\": \"2+2=\", \"completion\": \"4\"}\n{\"prompt\": \"3+3=\", \"completion\": \"6\"}\n",
    "{\"text\": \"Once upon a time.\"}\n{\"text\": \"The end.\"}\n",
    "[{\"instruction\": \"Add\", \"output\": \"4\"}, {\"prompt\": \"a\", \"completion\": \"b\"}]",
];

fn read(bytes: &[u8], name: &str) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).expect("writes");
    // Either answer is fine; a panic fails the property.
    let _ = DatasetSource::File(path).read();
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 192,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn a_damaged_dataset_is_read_or_refused(
        seed in 0..SEEDS.len(),
        edits in prop::collection::vec((any::<Index>(), any::<u8>()), 0..6),
        cut in prop::option::of(any::<Index>()),
        json in any::<bool>(),
    ) {
        let mut bytes = SEEDS[seed].as_bytes().to_vec();
        for (at, value) in edits {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        if let Some(cut) = cut {
            let len = cut.index(bytes.len());
            bytes.truncate(len);
        }
        read(&bytes, if json { "data.json" } else { "data.jsonl" });
    }

    #[test]
    fn random_bytes_are_read_or_refused(
        bytes in prop::collection::vec(any::<u8>(), 0..1024),
        json in any::<bool>(),
    ) {
        read(&bytes, if json { "data.json" } else { "data.jsonl" });
    }
}
