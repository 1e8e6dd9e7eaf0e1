//! Helpers shared by the streaming tests.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use sluice_engine::backend::IGNORE;
use sluice_engine::data::MicroBatch;

/// A micro-batch of 2 rows of 16 tokens, each row two documents, a third of targets untrained.
pub fn micro_batch(rng: &mut ChaCha8Rng, vocab: usize) -> MicroBatch {
    let (rows, seq) = (2, 16);
    let mut mb = MicroBatch {
        rows,
        seq_len: seq,
        ids: Vec::new(),
        targets: Vec::new(),
        positions: Vec::new(),
        cu_seqlens: vec![0],
    };
    for r in 0..rows {
        let split = rng.random_range(3..seq - 3);
        for (start, len) in [(0, split), (split, seq - split)] {
            for p in 0..len {
                mb.ids.push(rng.random_range(0..vocab) as i32);
                mb.positions.push(p as i32);
                let last = p + 1 == len;
                let trained = !last && rng.random_range(0..3) > 0;
                mb.targets.push(if trained { rng.random_range(0..vocab) as i32 } else { IGNORE });
            }
            mb.cu_seqlens.push((r * seq + start + len) as i32);
        }
    }
    mb
}
