//! Packing samples into rows: targets, positions and document bounds on hand-made rows,
//! truncation, padding that is never trained, and deterministic shuffles.

use super::*;

const I: i32 = IGNORE;

fn sample(ids: &[u32], trained: &[u8]) -> Sample {
    Sample::new(ids.to_vec(), trained.iter().map(|&t| t == 1).collect())
}

fn check(samples: Vec<Sample>, seq_len: usize) -> Result<Packed> {
    let options = PackOptions { seq_len, shuffle_seed: None, pad_id: 0 };
    pack(Prepared::from_samples("test.jsonl", samples), &options)
}

#[test]
fn hand_made_rows_targets_positions_and_documents() {
    let packed = check(
        vec![
            sample(&[10, 11, 12], &[0, 1, 1]), // prompt 10, trained 11 12
            sample(&[20, 21], &[0, 1]),        // fits after the first: row 0 = 5 tokens
            sample(&[30, 31, 32, 33], &[1, 0, 1, 1]), // does not fit in 1 left: starts row 1
        ],
        6,
    )
    .unwrap();
    assert_eq!(packed.rows.len(), 2);
    let r0 = &packed.rows[0];
    assert_eq!(r0.ids, vec![10, 11, 12, 20, 21, 0]);
    assert_eq!(r0.targets, vec![11, 12, I, 21, I, I]);
    assert_eq!(r0.positions, vec![0, 1, 2, 0, 1, 0]);
    assert_eq!(r0.doc_lens, vec![3, 2, 1]);
    let r1 = &packed.rows[1];
    assert_eq!(r1.ids, vec![30, 31, 32, 33, 0, 0]);
    // The first token of a document is never a target: nothing before it in the document.
    assert_eq!(r1.targets, vec![I, 32, 33, I, I, I]);
    assert_eq!(r1.positions, vec![0, 1, 2, 3, 0, 1]);
    assert_eq!(r1.doc_lens, vec![4, 2]);

    assert_eq!(
        packed.stats,
        Stats {
            records: 3,
            samples: 3,
            tokens: 9,
            trained_tokens: 5,
            truncated_samples: 0,
            dropped_tokens: 0,
            continued_samples: 0,
            padding_tokens: 3,
            rows: 2,
            samples_without_eos: 0,
        }
    );

    let batch = MicroBatch::from_rows(&packed.rows).unwrap();
    assert_eq!((batch.rows, batch.seq_len, batch.tokens()), (2, 6, 12));
    assert_eq!(batch.cu_seqlens, vec![0, 3, 5, 6, 10, 12]);
    assert_eq!(&batch.ids[6..], &r1.ids[..]);
    assert_eq!(batch.trained_tokens(), 5);
}

#[test]
fn long_samples_are_truncated_and_counted() {
    let packed =
        check(vec![sample(&[1, 2, 3, 4, 5, 6, 7], &[1; 7]), sample(&[8, 9], &[1, 1])], 4).unwrap();
    assert_eq!(packed.rows[0].ids, vec![1, 2, 3, 4]);
    assert_eq!(packed.rows[0].targets, vec![2, 3, 4, I]);
    assert_eq!(packed.rows[1].ids, vec![8, 9, 0, 0]);
    assert_eq!(packed.stats.truncated_samples, 1);
    assert_eq!(packed.stats.dropped_tokens, 3);
    assert_eq!(packed.stats.tokens, 6);
}

fn text(ids: std::ops::Range<u32>) -> Sample {
    let ids: Vec<u32> = ids.collect();
    Sample { trained: vec![true; ids.len()], ids, continues: true }
}

#[test]
fn raw_text_goes_on_over_rows_and_nothing_of_it_is_cut() {
    // 7 tokens of text, a 2-token conversation, then 6 more of text, in rows of 4: the first
    // text fills row 0 and goes on in row 1; the conversation does not fit what is left of
    // row 1 (1 token) and starts row 2, after which the second text fills the rest.
    let packed = check(vec![text(1..8), sample(&[50, 51], &[0, 1]), text(20..26)], 4).unwrap();
    let rows: Vec<_> = packed.rows.iter().map(|r| (r.ids.clone(), r.doc_lens.clone())).collect();
    assert_eq!(
        rows,
        vec![
            (vec![1, 2, 3, 4], vec![4]),
            (vec![5, 6, 7, 0], vec![3, 1]),
            (vec![50, 51, 20, 21], vec![2, 2]),
            (vec![22, 23, 24, 25], vec![4]),
        ]
    );
    // Each part is a document of its own: positions restart, and the first token of a part is
    // not a target (what came before it is in another row).
    assert_eq!(packed.rows[1].positions, vec![0, 1, 2, 0]);
    assert_eq!(packed.rows[1].targets, vec![6, 7, I, I]);
    assert_eq!(packed.rows[3].targets, vec![23, 24, 25, I]);
    let stats = packed.stats;
    assert_eq!((stats.tokens, stats.truncated_samples, stats.dropped_tokens), (15, 0, 0));
    assert_eq!((stats.continued_samples, stats.padding_tokens), (2, 1));
    // What a text gives training, counted alone as the preview counts it: every token kept,
    // each part's first token untrained.
    assert_eq!(sample_counts(&text(1..8), 4), (7, 5, 0));
    assert_eq!(sample_counts(&sample(&[1, 2, 3, 4, 5, 6, 7], &[1; 7]), 4), (4, 3, 3));
    assert_eq!(packed.stats.trained_tokens, 3 + 2 + 1 + 1 + 3);
}

#[test]
fn no_document_crosses_a_row_and_padding_is_never_trained() {
    // Lengths 1..=9 in a pseudo-random order, all trained, into rows of 8.
    let samples: Vec<Sample> = (0..60u32)
        .map(|i| {
            let len = (i * 7 % 9 + 1) as usize;
            let ids: Vec<u32> = (0..len as u32).map(|t| 100 + i * 10 + t).collect();
            Sample::new(ids, vec![true; len])
        })
        .collect();
    let packed = check(samples, 8).unwrap();
    let mut docs_seen = 0;
    for row in &packed.rows {
        assert_eq!(row.ids.len(), 8);
        assert_eq!(row.doc_lens.iter().sum::<usize>(), 8);
        let mut start = 0;
        for &len in &row.doc_lens {
            let doc = &row.ids[start..start + len];
            let is_padding = doc.iter().all(|&id| id == 0);
            if is_padding {
                assert!(row.targets[start..start + len].iter().all(|&t| t == I));
            } else {
                docs_seen += 1;
                // Every token of a document comes from one sample: ids share their hundreds.
                assert!(doc.iter().all(|&id| (id - 100) / 10 == (doc[0] - 100) / 10), "{doc:?}");
            }
            assert_eq!(row.positions[start..start + len], (0..len as i32).collect::<Vec<_>>()[..]);
            start += len;
        }
    }
    assert_eq!(docs_seen, 60);
    let long = (0..60u32).filter(|i| i * 7 % 9 + 1 > 8).count();
    assert_eq!(packed.stats.truncated_samples, long, "only the length-9 samples are cut");
    assert_eq!(packed.stats.dropped_tokens, long);
    let batches = packed.micro_batches(3).unwrap();
    assert_eq!(batches.iter().map(|b| b.rows).sum::<usize>(), packed.rows.len());
    for batch in &batches {
        assert_eq!(*batch.cu_seqlens.last().unwrap() as usize, batch.tokens());
        // Row boundaries are document boundaries.
        for r in 0..batch.rows {
            assert!(batch.cu_seqlens.contains(&((r * 8) as i32)));
        }
    }
}

#[test]
fn bad_options_and_untrained_datasets_are_errors() {
    let err = check(vec![sample(&[1, 2], &[1, 1])], 0).unwrap_err();
    assert!(matches!(err, Error::Invalid(ref m) if m.contains("sequence length")), "{err}");

    let err = check(vec![sample(&[1, 2], &[1, 0]), sample(&[3], &[1])], 4).unwrap_err();
    assert!(
        matches!(err, Error::Dataset { ref message, .. } if message.starts_with("no token is trained")),
        "{err}"
    );

    let err = check(vec![sample(&[1, 2], &[1])], 4).unwrap_err();
    assert!(err.to_string().contains("2 ids but 1 trained flags"), "{err}");

    let packed = check(vec![sample(&[1, 2], &[1, 1])], 4).unwrap();
    assert!(packed.micro_batches(0).is_err());
    let mut bad = packed.rows.clone();
    bad[0].doc_lens = vec![3];
    assert!(MicroBatch::from_rows(&bad).unwrap_err().to_string().contains("expected 4"));
    assert!(MicroBatch::from_rows(&[]).is_err());
}

#[test]
fn shuffle_is_deterministic_per_seed() {
    let samples: Vec<Sample> = (0..20u32).map(|i| sample(&[i, i], &[1, 1])).collect();
    let order = |seed| {
        let options = PackOptions { seq_len: 2, shuffle_seed: seed, pad_id: 0 };
        let packed = pack(Prepared::from_samples("t", samples.clone()), &options).unwrap();
        packed.rows.iter().map(|r| r.ids[0]).collect::<Vec<_>>()
    };
    assert_eq!(order(None), (0..20).collect::<Vec<_>>());
    assert_eq!(order(Some(7)), order(Some(7)));
    assert_ne!(order(Some(7)), order(None));
    assert_ne!(order(Some(7)), order(Some(8)));
}
