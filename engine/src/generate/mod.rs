//! Text generation with a KV cache on any backend (the CPU, or a GPU): a KV-cached forward that
//! matches the training forward's logits, greedy or temperature/top-p sampling, stopping at
//! end-of-sequence tokens.
//!
//! ```text
//! let generator = Generator::load_dir(dir)?;              // on the CPU
//! let generator = Generator::load_dir_on(Cuda::new(0)?, dir)?; // or on a GPU
//! let prompt = generator.prompt_ids("Hello", PromptStyle::Chat)?;
//! let out = generator.generate(&prompt, &GenerateOptions::greedy(32), &mut |_id| true)?;
//! ```
//! [`Generator::logits`] exposes the raw forward (perplexity, checks against transformers).

pub mod batch;
mod forward;
mod sample;

#[cfg(test)]
mod tests;

use std::path::Path;

pub use batch::{BatchLimits, HostUnits, Scored, Streamed};
pub use forward::KvCache;
pub use sample::{GenerateOptions, Sampler};

use crate::backend::Backend;
use crate::backend::cpu::Cpu;
use crate::data::{ChatTemplate, Message, Role, Tokenizer};
use crate::error::{Error, Result};
use crate::model::{HostParams, ModelLayout};
use crate::spec::ModelSpec;
use forward::Model;

/// How a prompt string becomes token ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptStyle {
    /// The text as is.
    Plain,
    /// One user turn in the model's chat template, with the generation prompt added.
    Chat,
}

/// A model ready to generate: its backend, the weights on it, the tokenizer if the folder has
/// one.
pub struct Generator<B: Backend = Cpu> {
    backend: B,
    model: Model<B>,
    tokenizer: Option<Tokenizer>,
}

impl<B: Backend> std::fmt::Debug for Generator<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generator")
            .field("backend", &self.backend.name())
            .field("family", &self.model.spec.family)
            .field("layers", &self.model.spec.layers)
            .field("tokenizer", &self.tokenizer)
            .finish()
    }
}

/// What [`Generator::generate`] produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// The new tokens, without the prompt (and without the stop token).
    pub ids: Vec<u32>,
    /// Whether generation ended on an end-of-sequence token rather than the length limit or the
    /// callback.
    pub stopped_at_eos: bool,
}

impl Generator<Cpu> {
    /// A generator on the CPU for `params` of the model `spec`, with an optional tokenizer.
    pub fn new(spec: ModelSpec, params: HostParams, tokenizer: Option<Tokenizer>) -> Result<Self> {
        Generator::on(Cpu, spec, params, tokenizer)
    }

    /// Loads a Hugging Face folder (config, weights and `tokenizer.json`) onto the CPU.
    pub fn load_dir(dir: &Path) -> Result<Self> {
        Generator::load_dir_on(Cpu, dir)
    }
}

impl<B: Backend> Generator<B> {
    /// A generator on `backend` for `params` of the model `spec`, with an optional tokenizer.
    /// The weights move onto the backend in its weight precision (bf16 on a GPU).
    pub fn on(
        backend: B,
        spec: ModelSpec,
        params: HostParams,
        tokenizer: Option<Tokenizer>,
    ) -> Result<Self> {
        let expected = ModelLayout::new(&spec);
        let sizes_match =
            params.units.iter().zip(&expected.units).all(|(slab, unit)| slab.len() == unit.len);
        if *params.layout != expected || params.units.len() != expected.units.len() || !sizes_match
        {
            return Err(Error::invalid("parameters do not match the model spec's layout"));
        }
        let model = Model::new(&backend, spec, params)?;
        Ok(Generator { backend, model, tokenizer })
    }

    /// Loads a Hugging Face folder (config, weights and `tokenizer.json`) onto `backend`.
    pub fn load_dir_on(backend: B, dir: &Path) -> Result<Self> {
        let (spec, params) = HostParams::load_dir(dir)?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        Generator::on(backend, spec, params, Some(tokenizer))
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.model.spec
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    fn require_tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer.as_ref().ok_or_else(|| Error::invalid("this generator has no tokenizer"))
    }

    /// An empty cache that allocates on first use and grows as positions arrive.
    pub fn cache(&self) -> KvCache<B> {
        KvCache::empty(self.model.spec.layers)
    }

    /// An empty cache with room for `positions` positions, allocated now (at most the model's
    /// context), so runs that stay within it allocate no cache memory.
    pub fn cache_for(&self, positions: usize) -> Result<KvCache<B>> {
        let positions = positions.min(self.model.spec.max_positions);
        KvCache::new(&self.backend, &self.model.spec, positions)
    }

    /// Runs `ids` after what `cache` holds and returns the logits `[ids.len(), V]` of every new
    /// position.
    pub fn logits(&self, cache: &mut KvCache<B>, ids: &[u32]) -> Result<Vec<f32>> {
        forward::forward(&self.backend, &self.model, cache, ids, ids.len())
    }

    /// As [`Generator::logits`], returning only the last position's logits `[V]`.
    pub fn next_logits(&self, cache: &mut KvCache<B>, ids: &[u32]) -> Result<Vec<f32>> {
        forward::forward(&self.backend, &self.model, cache, ids, 1)
    }

    /// The token ids of a prompt, plain or as one chat turn in the model's template.
    pub fn prompt_ids(&self, prompt: &str, style: PromptStyle) -> Result<Vec<u32>> {
        let tokenizer = self.require_tokenizer()?;
        let text = match style {
            PromptStyle::Plain => prompt.to_string(),
            PromptStyle::Chat => {
                return self.chat_ids(&[Message::new(Role::User, prompt)]);
            }
        };
        Ok(tokenizer.encode(&text)?.ids)
    }

    /// Whether the tokenizer carries a chat template (so [`Generator::chat_ids`] can be used).
    pub fn has_chat_template(&self) -> bool {
        self.tokenizer.as_ref().is_some_and(|t| t.chat_template().is_some())
    }

    /// The token ids of a conversation in the model's chat template, with the generation prompt
    /// added so the model answers as the assistant.
    pub fn chat_ids(&self, messages: &[Message]) -> Result<Vec<u32>> {
        let tokenizer = self.require_tokenizer()?;
        let template = ChatTemplate::from_tokenizer(tokenizer)?.ok_or_else(|| {
            Error::tokenizer(tokenizer.source(), "the model has no chat template")
        })?;
        let text = template.render(messages, true)?;
        Ok(tokenizer.encode(&text)?.ids)
    }

    /// The batched forward over this generator's resident weights.
    fn batched(&self) -> (batch::Model<'_, B>, batch::Resident<'_, B>) {
        let m = &self.model;
        let model = batch::Model { b: &self.backend, spec: &m.spec, decoder: &m.decoder };
        (model, batch::Resident(&m.units))
    }

    /// Generates after each of `prompts`, many at a time (see [`batch::generate_batch`]).
    pub fn generate_batch(
        &self,
        prompts: &[Vec<u32>],
        options: &GenerateOptions,
        limits: BatchLimits,
    ) -> Result<Vec<Generated>> {
        let (model, mut units) = self.batched();
        batch::generate_batch(&model, &mut units, prompts, options, &self.stop_ids(), limits)
    }

    /// The log-likelihood of each `(context, continuation)` (see [`batch::score_batch`]).
    pub fn score(
        &self,
        pairs: &[(Vec<u32>, Vec<u32>)],
        limits: BatchLimits,
    ) -> Result<Vec<Scored>> {
        let (model, mut units) = self.batched();
        batch::score_batch(&model, &mut units, pairs, limits)
    }

    /// Decodes ids to text with the generator's tokenizer.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.require_tokenizer()?.decode(ids)
    }

    /// The ids that end generation: the config's eos ids and the tokenizer's eos.
    pub fn stop_ids(&self) -> Vec<u32> {
        stop_ids(&self.model.spec, self.tokenizer.as_ref())
    }

    /// Generates up to `options.max_new_tokens` tokens after `prompt`. `on_token` sees each new
    /// token as it is chosen (for streaming) and returns false to stop early.
    pub fn generate(
        &self,
        prompt: &[u32],
        options: &GenerateOptions,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Generated> {
        if prompt.is_empty() {
            return Err(Error::invalid("the prompt has no tokens"));
        }
        let mut sampler = Sampler::new(options)?;
        let stop = self.stop_ids();
        // Room for the whole generation now: decoding then allocates nothing.
        let mut cache = self.cache_for(prompt.len() + options.max_new_tokens)?;
        let mut logits = self.next_logits(&mut cache, prompt)?;
        let mut ids = Vec::new();
        while ids.len() < options.max_new_tokens {
            let next = sampler.pick(&logits)?;
            if stop.contains(&next) {
                return Ok(Generated { ids, stopped_at_eos: true });
            }
            ids.push(next);
            if !on_token(next) || ids.len() == options.max_new_tokens {
                break;
            }
            if cache.len() + 1 > self.model.spec.max_positions {
                break;
            }
            logits = self.next_logits(&mut cache, &[next])?;
        }
        Ok(Generated { ids, stopped_at_eos: false })
    }
}

/// The ids that end generation for `spec` with `tokenizer`: the config's eos ids and the
/// tokenizer's eos.
pub fn stop_ids(spec: &ModelSpec, tokenizer: Option<&Tokenizer>) -> Vec<u32> {
    let mut ids = spec.eos_token_ids.clone();
    if let Some(id) = tokenizer.and_then(Tokenizer::eos_token_id)
        && !ids.contains(&id)
    {
        ids.push(id);
    }
    ids
}

/// Writes `input_ids` (I64 `[T]`) and `logits` (F32 `[T, V]`) as a safetensors file, for
/// comparing Sluice's forward with another implementation's on the same tokens.
pub fn write_logits(path: &Path, ids: &[u32], logits: &[f32], vocab: usize) -> Result<()> {
    use safetensors::tensor::{Dtype, TensorView};
    if vocab == 0 || logits.len() != ids.len() * vocab {
        return Err(Error::invalid(format!(
            "{} logits are not {} rows of {vocab}",
            logits.len(),
            ids.len()
        )));
    }
    let id_bytes: Vec<u8> = ids.iter().flat_map(|&i| i64::from(i).to_le_bytes()).collect();
    let logit_bytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
    fn view(dtype: Dtype, shape: Vec<usize>, data: &[u8]) -> Result<TensorView<'_>> {
        TensorView::new(dtype, shape, data)
            .map_err(|e| Error::invalid(format!("cannot describe tensor: {e}")))
    }
    let tensors = [
        ("input_ids", view(Dtype::I64, vec![ids.len()], &id_bytes)?),
        ("logits", view(Dtype::F32, vec![ids.len(), vocab], &logit_bytes)?),
    ];
    let bytes = safetensors::serialize(tensors, None)
        .map_err(|e| Error::invalid(format!("cannot serialise logits: {e}")))?;
    std::fs::write(path, bytes).map_err(|e| Error::io(path, e))
}
