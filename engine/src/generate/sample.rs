//! Choosing the next token from logits: greedy (temperature 0) or sampled from the
//! temperature-scaled softmax restricted to the top-p nucleus, with a seeded generator so a seed
//! reproduces a generation.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    /// 0 picks the most likely token (greedy); otherwise logits are divided by it.
    pub temperature: f32,
    /// Sample only from the smallest set of most likely tokens whose probability reaches this
    /// (1 keeps every token).
    pub top_p: f32,
    pub seed: u64,
}

impl GenerateOptions {
    pub fn greedy(max_new_tokens: usize) -> GenerateOptions {
        GenerateOptions { max_new_tokens, temperature: 0.0, top_p: 1.0, seed: 0 }
    }
}

/// Picks tokens for one generation.
#[derive(Debug)]
pub struct Sampler {
    temperature: f32,
    top_p: f32,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(options: &GenerateOptions) -> Result<Sampler> {
        if !(options.temperature >= 0.0 && options.temperature.is_finite()) {
            return Err(Error::invalid(format!(
                "temperature must be 0 (greedy) or positive, got {}",
                options.temperature
            )));
        }
        if !(options.top_p > 0.0 && options.top_p <= 1.0) {
            return Err(Error::invalid(format!("top_p must be in (0, 1], got {}", options.top_p)));
        }
        Ok(Sampler {
            temperature: options.temperature,
            top_p: options.top_p,
            rng: ChaCha8Rng::seed_from_u64(options.seed),
        })
    }

    /// The next token id for logits `[V]`.
    pub fn pick(&mut self, logits: &[f32]) -> Result<u32> {
        if logits.is_empty() || logits.iter().any(|x| x.is_nan()) {
            return Err(Error::Numerical("logits are empty or NaN".into()));
        }
        if self.temperature == 0.0 {
            return Ok(argmax(logits));
        }
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, f64::from((l - max) / self.temperature).exp()))
            .collect();
        let total: f64 = probs.iter().map(|p| p.1).sum();
        // Most likely first; ties by id so the order (and the draw) is deterministic.
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut kept = 0;
        let mut mass = 0.0;
        for (_, p) in &probs {
            kept += 1;
            mass += p / total;
            if mass >= f64::from(self.top_p) {
                break;
            }
        }
        probs.truncate(kept.max(1));
        let nucleus: f64 = probs.iter().map(|p| p.1).sum();
        let mut draw = self.rng.random::<f64>() * nucleus;
        for &(id, p) in &probs {
            if draw < p {
                return Ok(id);
            }
            draw -= p;
        }
        // Rounding can leave a sliver past the last token; it belongs to the last one.
        Ok(probs.last().map_or(0, |p| p.0))
    }
}

/// The index of the largest value (the first on ties).
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}
