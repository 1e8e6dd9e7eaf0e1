//! Task evaluation: scoring a model's outputs against references. [`metrics`] holds the scoring
//! functions themselves, pure functions over text and numbers that follow the implementations
//! published scores come from (SQuAD's script, rouge-score, sacrebleu, lm-evaluation-harness), so
//! a number Sluice reports can be set beside one computed elsewhere.

pub mod metrics;
