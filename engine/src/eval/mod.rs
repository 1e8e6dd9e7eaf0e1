//! Task evaluation: whether a fine-tune made the model better at its task. `metrics` scores one
//! output against its reference (normalised matches, answer extraction, ROUGE-L, BLEU, multiple
//! choice by likelihood, perplexity); `task` turns an eval set's records into prompts, runs the
//! model through batched generation or scoring, and reports the figure with every record's
//! answer.

pub mod metrics;
pub mod task;
pub mod timing;

pub use task::{
    Answer, AnswerFormat, Batched, EvalItem, EvalMetric, Inference, Loaded, Prompt, TaskReport,
    TaskSettings, TaskTiming, choice_items, device_reserve, encode_pair, evaluate,
    items_from_entries, limits_between_steps, prompt_ids,
};
pub use timing::{EvalTime, EvalWork};
