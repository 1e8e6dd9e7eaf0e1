//! Token samples packed into rows of exactly `seq_len` tokens, and rows into micro-batches.
//!
//! Samples go into rows in order (after an optional seeded shuffle); one that does not fit in
//! what is left of the current row starts the next row, so a document never crosses a row; one
//! longer than `seq_len` keeps its first `seq_len` tokens. Raw text is the exception
//! ([`Sample::continues`], pretraining): it fills what is left of the row and goes on in the
//! next, each part a document of its own, so nothing of it is cut and rows carry no padding
//! between texts. What is left at the end of a row is padding, a document of its own that is
//! never trained. Per row: ids, next-token targets
//! (`targets[t] = ids[t + 1]` when `t + 1` is in the same document and trained, else
//! [`IGNORE`]), positions restarting at 0 for each document, and document lengths.

use rand::SeedableRng;
use rand::seq::SliceRandom;

use super::prepare::{Prepared, Sample};
use crate::backend::IGNORE;
use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy)]
pub struct PackOptions {
    pub seq_len: usize,
    /// Shuffle samples with this seed before packing (ChaCha8: the same order on every machine).
    pub shuffle_seed: Option<u64>,
    /// Id written into padding (never trained; the pad or eos token keeps embeddings sane).
    pub pad_id: u32,
}

/// One packed row of `seq_len` tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub ids: Vec<i32>,       // [seq_len]
    pub targets: Vec<i32>,   // [seq_len]
    pub positions: Vec<i32>, // [seq_len]
    /// Lengths of the documents in the row, in order, padding included; they sum to `seq_len`.
    pub doc_lens: Vec<usize>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    pub records: usize,
    pub samples: usize,
    /// Sample tokens placed in rows (after truncation, padding excluded).
    pub tokens: usize,
    /// Targets that are not [`IGNORE`]: the tokens a step computes a loss on.
    pub trained_tokens: usize,
    /// Samples longer than `seq_len`, cut to their first `seq_len` tokens.
    pub truncated_samples: usize,
    pub dropped_tokens: usize,
    /// Raw texts that go on over a row boundary (none of their tokens are cut).
    pub continued_samples: usize,
    pub padding_tokens: usize,
    pub rows: usize,
    /// Conversations that never train the eos token (see [`Prepared::samples_without_eos`]).
    pub samples_without_eos: usize,
}

#[derive(Debug, Clone)]
pub struct Packed {
    pub seq_len: usize,
    pub rows: Vec<Row>,
    pub stats: Stats,
}

/// `M` rows flattened to `T = M * seq_len` tokens, with document bounds for attention.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MicroBatch {
    pub rows: usize,
    pub seq_len: usize,
    pub ids: Vec<i32>,       // [T]
    pub targets: Vec<i32>,   // [T]
    pub positions: Vec<i32>, // [T]
    /// `[docs + 1]`: document `d` is tokens `cu_seqlens[d]..cu_seqlens[d + 1]`; no document
    /// crosses a row boundary.
    pub cu_seqlens: Vec<i32>,
}

impl MicroBatch {
    /// Flattens `rows`, which must all be `seq_len` long with document lengths summing to it.
    pub fn from_rows(rows: &[Row]) -> Result<MicroBatch> {
        let seq_len = rows.first().map_or(0, |r| r.ids.len());
        if seq_len == 0 {
            return Err(Error::invalid("a micro-batch needs at least one non-empty row"));
        }
        let total = rows.len() * seq_len;
        let mut batch = MicroBatch {
            rows: rows.len(),
            seq_len,
            ids: Vec::with_capacity(total),
            targets: Vec::with_capacity(total),
            positions: Vec::with_capacity(total),
            cu_seqlens: vec![0],
        };
        let mut offset = 0usize;
        for (r, row) in rows.iter().enumerate() {
            let docs: usize = row.doc_lens.iter().sum();
            let lens = [row.ids.len(), row.targets.len(), row.positions.len(), docs];
            if lens.iter().any(|&n| n != seq_len) {
                return Err(Error::invalid(format!(
                    "row {r} of the micro-batch has ids/targets/positions/documents of {lens:?} tokens, expected {seq_len}"
                )));
            }
            batch.ids.extend_from_slice(&row.ids);
            batch.targets.extend_from_slice(&row.targets);
            batch.positions.extend_from_slice(&row.positions);
            for len in &row.doc_lens {
                offset += len;
                batch.cu_seqlens.push(to_i32(offset, "cu_seqlens")?);
            }
        }
        Ok(batch)
    }

    pub fn tokens(&self) -> usize {
        self.ids.len()
    }

    pub fn trained_tokens(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE).count()
    }
}

impl Packed {
    /// Micro-batches of `rows_per_batch` rows, in order; the last may have fewer.
    pub fn micro_batches(&self, rows_per_batch: usize) -> Result<Vec<MicroBatch>> {
        if rows_per_batch == 0 {
            return Err(Error::invalid("rows per micro-batch must be at least 1"));
        }
        self.rows.chunks(rows_per_batch).map(MicroBatch::from_rows).collect()
    }
}

/// What one sample gives training at `seq_len` were it to start a row, counted as [`pack`]
/// counts: tokens kept, targets trained (a token is one when it is trained and follows another
/// token of the same row part), tokens cut.
pub fn sample_counts(sample: &Sample, seq_len: usize) -> (usize, usize, usize) {
    let seq_len = seq_len.max(1);
    let kept = if sample.continues { sample.ids.len() } else { sample.ids.len().min(seq_len) };
    let trained = sample.trained[..kept.min(sample.trained.len())]
        .iter()
        .enumerate()
        .filter(|&(t, &trained)| trained && t % seq_len != 0)
        .count();
    (kept, trained, sample.ids.len() - kept)
}

/// Packs prepared samples into rows. Errors when `seq_len` is 0 or when no token is trained.
pub fn pack(prepared: Prepared, options: &PackOptions) -> Result<Packed> {
    let seq_len = options.seq_len;
    if seq_len == 0 {
        return Err(Error::invalid("sequence length must be at least 1"));
    }
    // Positions and cu_seqlens are i32 on every backend.
    to_i32(seq_len, "sequence length")?;
    let pad_id = to_i32(options.pad_id as usize, "pad id")?;
    let Prepared { path, records, mut samples, samples_without_eos } = prepared;
    if let Some(seed) = options.shuffle_seed {
        samples.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
    }

    let mut stats =
        Stats { records, samples: samples.len(), samples_without_eos, ..Stats::default() };
    let mut rows = Vec::new();
    let mut row = RowBuilder::new(seq_len);
    for sample in &samples {
        let Sample { ids, trained, continues } = sample;
        if ids.len() != trained.len() {
            return Err(Error::invalid(format!(
                "sample has {} ids but {} trained flags",
                ids.len(),
                trained.len()
            )));
        }
        if ids.is_empty() {
            continue;
        }
        if *continues {
            // Filled into what is left of the row, then on into fresh rows.
            let (mut start, mut parts) = (0, 0);
            while start < ids.len() {
                if row.len() == seq_len {
                    rows.push(row.finish(pad_id, &mut stats));
                    row = RowBuilder::new(seq_len);
                }
                let end = ids.len().min(start + seq_len - row.len());
                row.push_document(&ids[start..end], &trained[start..end])?;
                (start, parts) = (end, parts + 1);
            }
            stats.tokens += ids.len();
            stats.continued_samples += usize::from(parts > 1);
            continue;
        }
        let keep = ids.len().min(seq_len);
        if keep < ids.len() {
            stats.truncated_samples += 1;
            stats.dropped_tokens += ids.len() - keep;
        }
        if row.len() + keep > seq_len {
            rows.push(row.finish(pad_id, &mut stats));
            row = RowBuilder::new(seq_len);
        }
        row.push_document(&ids[..keep], &trained[..keep])?;
        stats.tokens += keep;
    }
    if row.len() > 0 {
        rows.push(row.finish(pad_id, &mut stats));
    }
    stats.rows = rows.len();
    stats.trained_tokens =
        rows.iter().map(|r| r.targets.iter().filter(|&&t| t != IGNORE).count()).sum();
    if stats.trained_tokens == 0 {
        return Err(Error::Dataset {
            path,
            message: format!(
                "no token is trained ({} samples, {} tokens): nothing to learn from",
                stats.samples, stats.tokens
            ),
        });
    }
    Ok(Packed { seq_len, rows, stats })
}

struct RowBuilder {
    seq_len: usize,
    row: Row,
}

impl RowBuilder {
    fn new(seq_len: usize) -> RowBuilder {
        let row = Row {
            ids: Vec::with_capacity(seq_len),
            targets: Vec::with_capacity(seq_len),
            positions: Vec::with_capacity(seq_len),
            doc_lens: Vec::new(),
        };
        RowBuilder { seq_len, row }
    }

    fn len(&self) -> usize {
        self.row.ids.len()
    }

    fn push_document(&mut self, ids: &[u32], trained: &[bool]) -> Result<()> {
        for (t, &id) in ids.iter().enumerate() {
            self.row.ids.push(to_i32(id as usize, "token id")?);
            // The token at t is trained to predict the token at t + 1.
            let target = match (ids.get(t + 1), trained.get(t + 1)) {
                (Some(&next), Some(true)) => to_i32(next as usize, "token id")?,
                _ => IGNORE,
            };
            self.row.targets.push(target);
            self.row.positions.push(to_i32(t, "position")?);
        }
        self.row.doc_lens.push(ids.len());
        Ok(())
    }

    fn finish(mut self, pad_id: i32, stats: &mut Stats) -> Row {
        let pad = self.seq_len - self.len();
        if pad > 0 {
            self.row.ids.extend(std::iter::repeat_n(pad_id, pad));
            self.row.targets.extend(std::iter::repeat_n(IGNORE, pad));
            // Positions are below seq_len, which was checked to fit in i32.
            self.row.positions.extend((0..pad).map(|p| p as i32));
            self.row.doc_lens.push(pad);
            stats.padding_tokens += pad;
        }
        self.row
    }
}

fn to_i32(value: usize, what: &str) -> Result<i32> {
    i32::try_from(value).map_err(|_| Error::invalid(format!("{what} {value} does not fit in i32")))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
#[path = "pack_tests.rs"]
mod tests;
