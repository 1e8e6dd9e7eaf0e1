//! How long a task evaluation takes, predicted before it runs: the forwards the batched
//! generation or scoring will make (grouped exactly as `generate::batch` groups them), each
//! priced by the machine's rates. Generation is priced at its worst, every answer running to
//! `max_new_tokens`, so the figure is a bound an evaluation between steps stays under.

use crate::generate::BatchLimits;
use crate::generate::batch::groups;
pub use crate::plan::EvalTime;
use crate::plan::MachineRates;
use crate::spec::ModelSpec;

/// What an evaluation asks of the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EvalWork {
    /// Greedy answers of at most `new_tokens` tokens after prompts of these lengths.
    Generate { prompts: Vec<usize>, new_tokens: usize },
    /// Sequences of these lengths (context and continuation), `wanted` logit rows of each.
    Score { lengths: Vec<usize>, wanted: Vec<usize> },
}

/// One forward: `tokens` new tokens of `sequences` sequences after `past` cached positions in
/// all, and `rows` logit rows read.
#[derive(Debug, Clone, Copy)]
struct Forward {
    tokens: usize,
    sequences: usize,
    past: usize,
    rows: usize,
}

/// The forwards `work` makes within `limits`, as `generate_batch` and `score_batch` make them.
fn forwards(work: &EvalWork, limits: BatchLimits) -> Vec<Forward> {
    let mut out = Vec::new();
    match work {
        EvalWork::Generate { prompts, new_tokens } => {
            let n = prompts.len();
            for group in groups(&vec![1; n], limits.sequences, limits.sequences) {
                let lens = &prompts[group.clone()];
                for part in groups(lens, limits.tokens, lens.len()) {
                    let tokens: usize = lens[part.clone()].iter().sum();
                    let (sequences, rows) = (part.len(), part.len());
                    out.push(Forward { tokens, sequences, past: 0, rows });
                }
                // The prefill picks each answer's first token; every later one takes a forward.
                let prompt_tokens: usize = lens.iter().sum();
                for t in 1..*new_tokens {
                    let s = lens.len();
                    let past = prompt_tokens + s * t;
                    out.push(Forward { tokens: s, sequences: s, past, rows: s });
                }
            }
        }
        EvalWork::Score { lengths, wanted } => {
            for group in groups(lengths, limits.tokens, limits.sequences) {
                let tokens = lengths[group.clone()].iter().sum();
                let rows = wanted[group.clone()].iter().sum();
                out.push(Forward { tokens, sequences: group.len(), past: 0, rows });
            }
        }
    }
    out
}

/// The predicted time of `work` on a machine with `rates`, batched within `limits`, with the
/// layers `streamed` from host memory once per forward or resident.
pub fn predict(
    spec: &ModelSpec,
    rates: &MachineRates,
    limits: BatchLimits,
    streamed: bool,
    work: &EvalWork,
) -> EvalTime {
    let layer_params: f64 = (0..spec.layers).map(|l| spec.layer_params(l) as f64).sum();
    let head = (spec.hidden * spec.vocab) as f64;
    let attention_width = (spec.q_heads * spec.head_dim * spec.layers) as f64;
    let scoring = matches!(work, EvalWork::Score { .. });
    let mut time = EvalTime {
        forwards: 0,
        tokens: 0,
        rows: 0,
        seconds: 0.0,
        upload_s: 0.0,
        compute_s: 0.0,
        overhead_s: 0.0,
    };
    for f in forwards(work, limits) {
        time.forwards += 1;
        time.tokens += f.tokens;
        time.rows += f.rows;
        if streamed {
            time.upload_s += layer_params / rates.stream_params;
        }
        // Scores and values over the cached positions and the new ones (half of the new
        // tokens' own square on average, causal), 4 FLOPs a position and width.
        let mean_len = (f.past + f.tokens) / f.sequences.max(1);
        let attended = f.tokens as f64 * (f.past as f64 / f.sequences.max(1) as f64)
            + f.tokens as f64 * f.tokens as f64 / (2.0 * f.sequences.max(1) as f64);
        time.compute_s += 2.0 * layer_params * f.tokens as f64 / rates.gemm_flops
            + 2.0 * head * f.rows as f64 / rates.gemm_flops
            + 4.0 * attention_width * attended / rates.attention_forward_rate(mean_len);
        time.overhead_s += (f.sequences * spec.layers) as f64 * rates.sequence_layer_s
            + (f.rows * spec.vocab * 4) as f64 / rates.pcie_d2h;
        if scoring {
            time.overhead_s += (f.rows * spec.vocab) as f64 * rates.scored_logit_s;
        }
    }
    time.seconds = time.upload_s + time.compute_s + time.overhead_s;
    time
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::preset;

    const LIMITS: BatchLimits = BatchLimits { sequences: 4, tokens: 20 };

    #[test]
    fn generation_forwards_follow_the_batching() {
        // 6 prompts of 8 tokens: groups of 4 and 2; the first group's 32 prompt tokens prefill
        // in two forwards of 16 (the 20-token budget), the second's 16 in one; then 2 decode
        // forwards each for 3 new tokens.
        let work = EvalWork::Generate { prompts: vec![8; 6], new_tokens: 3 };
        let f = forwards(&work, LIMITS);
        let shape: Vec<(usize, usize)> = f.iter().map(|f| (f.tokens, f.sequences)).collect();
        assert_eq!(shape, [(16, 2), (16, 2), (4, 4), (4, 4), (16, 2), (2, 2), (2, 2)]);
        assert_eq!(f[3].past, 32 + 4 * 2);
    }

    #[test]
    fn scoring_forwards_follow_the_batching() {
        let work = EvalWork::Score { lengths: vec![10, 10, 10, 30], wanted: vec![2, 2, 2, 5] };
        let f = forwards(&work, LIMITS);
        let shape: Vec<(usize, usize, usize)> =
            f.iter().map(|f| (f.tokens, f.sequences, f.rows)).collect();
        // A sequence longer than the budget runs alone.
        assert_eq!(shape, [(20, 2, 4), (10, 1, 2), (30, 1, 5)]);
    }

    #[test]
    fn streaming_pays_an_upload_per_forward_and_decode_pays_per_sequence() {
        let spec = preset("qwen2.5-7b").unwrap();
        let rates = MachineRates::default();
        let work = EvalWork::Generate { prompts: vec![100; 64], new_tokens: 32 };
        let limits = BatchLimits { sequences: 64, tokens: 4096 };
        let resident = predict(&spec, &rates, limits, false, &work);
        let streamed = predict(&spec, &rates, limits, true, &work);
        assert_eq!(resident.forwards, 2 + 31);
        assert_eq!(streamed.forwards, resident.forwards);
        assert_eq!(resident.upload_s, 0.0);
        let layers: f64 = (0..spec.layers).map(|l| spec.layer_params(l) as f64).sum();
        let per_upload = layers / rates.stream_params;
        assert!((streamed.upload_s - 33.0 * per_upload).abs() < 1e-9);
        assert!((streamed.seconds - resident.seconds - streamed.upload_s).abs() < 1e-9);
        // Decode at 64 sequences is bound by the per-sequence work, not the GEMMs.
        assert!(resident.overhead_s > resident.compute_s);
    }
}
