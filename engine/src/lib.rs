//! Sluice's training engine: everything needed to fine-tune a decoder-only language model,
//! with no notion of HTTP, databases, users or jobs.
//!
//! - [`spec`]: Hugging Face `config.json` to a resolved [`spec::ModelSpec`]; random-init presets.
//! - [`weights`]: safetensors in (single and sharded), Hugging Face folders out.
//! - [`data`]: dataset formats, tokenizer, chat templates, loss masks, packing.
//! - [`backend`]: the [`backend::Backend`] trait and its CPU reference implementation.
//! - [`model`]: parameter layout by unit and the decoder's forward and backward, generic over
//!   the backend.
//! - [`optim`]: AdamW (plain and fused with its own thread pool), gradient clipping,
//!   learning-rate schedules.
//! - [`store`]: the host store, home of master weights, Adam moments and gradients.
//! - [`step`]: what one optimizer step is configured with and reports.
//! - [`placement`]: where a step's state lives: checkpoint, gradient and weight tiers, the disk
//!   tier's space.
//! - [`schedule`]: the layer-major streaming step, generic over the backend.
//! - [`plan`]: the memory-hierarchy planner: placement, per-tier budgets, predicted step time.
//! - [`train`]: the trainer loop, its configuration and its observer events.
//! - [`convert`]: GGUF import and export.
//! - [`generate`]: KV-cached text generation on any backend (greedy and sampled), one sequence
//!   or batched, from resident or streamed weights.
//! - [`eval`]: task evaluation: the metrics (exact match, extracted answers, ROUGE-L, BLEU,
//!   multiple choice, perplexity, each as its reference implementation computes it), eval sets,
//!   and a model scored on them.

pub mod backend;
pub mod convert;
pub mod data;
pub mod error;
pub mod eval;
pub mod generate;
pub mod model;
pub mod optim;
/// Where a step's state lives: the tiers the planner chooses between and the streamer runs.
pub mod placement;
pub mod plan;
pub mod schedule;
pub mod spec;
/// What one optimizer step is configured with and reports: the types the trainer, the streamer
/// and the observers share.
pub mod step;
pub mod store;
pub mod train;
pub mod weights;

pub use error::{Error, Result};
