//! A task evaluation: an eval set's records answered (or their choices scored) by the model as it
//! stands, and scored by the metric a job picks. The same code scores the base model before the
//! first step, the model every `eval_every` steps and after the last, and a checkpoint from
//! the command line (`sluice eval`).
//!
//! The model is reached through [`Inference`], batched generation and log-likelihood scoring:
//! a loaded [`Generator`] (resident weights) or a training run's host store streamed a layer at
//! a time ([`crate::generate::Streamed`]).

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::metrics::{self, Extractor};
use super::timing::{EvalTime, EvalWork};
use crate::backend::Backend;
use crate::data::{ChatTemplate, Entry, Message, Record, Role, Tokenizer};
use crate::error::{Error, Result};
use crate::generate::batch::{Model as BatchModel, Units, generate_batch, score_batch};
use crate::generate::{BatchLimits, GenerateOptions, Generator, Scored};
use crate::plan::MachineRates;
use crate::spec::ModelSpec;

/// The figure a task evaluation reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvalMetric {
    /// No task evaluation: the held-out loss only.
    #[default]
    Loss,
    /// The answer equals the reference after normalisation (case, punctuation, articles,
    /// whitespace).
    ExactMatch,
    /// The normalised reference appears in the normalised answer.
    Contains,
    /// A final answer pulled out of the output (`eval_answer`) equals the reference's.
    Extract,
    /// ROUGE-L F-measure against the reference.
    RougeL,
    /// Corpus BLEU against the references (0 to 100).
    Bleu,
    /// Multiple choice by log-likelihood (`acc`, and `acc_norm` beside it).
    Choice,
    /// Perplexity of the references after their prompts.
    Perplexity,
}

impl EvalMetric {
    pub const NAMES: [&'static str; 8] =
        ["loss", "exact_match", "contains", "extract", "rouge_l", "bleu", "choice", "perplexity"];
    const ALL: [EvalMetric; 8] = [
        EvalMetric::Loss,
        EvalMetric::ExactMatch,
        EvalMetric::Contains,
        EvalMetric::Extract,
        EvalMetric::RougeL,
        EvalMetric::Bleu,
        EvalMetric::Choice,
        EvalMetric::Perplexity,
    ];

    /// Whether the model writes answers (rather than its likelihoods being read).
    pub fn generates(self) -> bool {
        matches!(
            self,
            Self::ExactMatch | Self::Contains | Self::Extract | Self::RougeL | Self::Bleu
        )
    }

    /// Whether a larger figure is better (all but perplexity).
    pub fn higher_is_better(self) -> bool {
        self != Self::Perplexity
    }
}

impl fmt::Display for EvalMetric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = Self::ALL.iter().position(|m| m == self).unwrap_or(0);
        f.write_str(Self::NAMES[i])
    }
}

impl FromStr for EvalMetric {
    type Err = Error;
    fn from_str(s: &str) -> Result<EvalMetric> {
        let word = s.replace('-', "_");
        Self::NAMES.iter().position(|n| *n == word).map(|i| Self::ALL[i]).ok_or_else(|| {
            Error::invalid(format!("eval_metric {s:?}: expected one of {}", Self::NAMES.join(", ")))
        })
    }
}

/// How `extract` pulls a final answer out of an output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnswerFormat {
    /// GSM8K's `#### 42`.
    Gsm8k,
    /// The last number.
    #[default]
    LastNumber,
    /// The last `\boxed{...}`.
    Boxed,
    /// `eval_pattern`, a regular expression (its first group, else the whole match).
    Regex,
}

impl AnswerFormat {
    pub const NAMES: [&'static str; 4] = ["gsm8k", "last_number", "boxed", "regex"];
}

/// What a task evaluation is asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskSettings {
    pub metric: EvalMetric,
    pub answer: AnswerFormat,
    pub pattern: Option<String>,
    /// Tokens an answer may take.
    pub max_new_tokens: usize,
    /// Records of the eval set scored (the first ones).
    pub records: usize,
}

impl TaskSettings {
    /// The extractor `extract` uses; a pattern that does not compile names `eval_pattern`.
    pub fn extractor(&self) -> Result<Extractor> {
        match (self.answer, &self.pattern) {
            (AnswerFormat::Regex, Some(pattern)) => Extractor::regex(pattern).map_err(|e| {
                let why = match &e {
                    Error::Invalid(message) => message.clone(),
                    other => other.to_string(),
                };
                Error::invalid(format!("eval_pattern: {}", strip_field(&why)))
            }),
            (AnswerFormat::Regex, None) => {
                Err(Error::invalid("eval_pattern: eval_answer regex needs a pattern"))
            }
            (AnswerFormat::Gsm8k, _) => Ok(Extractor::Gsm8k),
            (AnswerFormat::LastNumber, _) => Ok(Extractor::LastNumber),
            (AnswerFormat::Boxed, _) => Ok(Extractor::Boxed),
        }
    }
}

/// The message without the metrics module's own name for the pattern.
fn strip_field(message: &str) -> &str {
    message.strip_prefix("answer_pattern: ").unwrap_or(message)
}

/// What the model is asked: a conversation in its chat template, or text continued as is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Chat(Vec<Message>),
    Plain(String),
}

impl Prompt {
    /// The text shown for it: the last user turn, or the whole plain text.
    pub fn shown(&self) -> String {
        match self {
            Prompt::Chat(messages) => messages
                .iter()
                .rev()
                .find(|m| m.role == Role::User)
                .map_or_else(String::new, |m| m.content.clone()),
            Prompt::Plain(text) => text.clone(),
        }
    }
}

/// One record of an eval set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvalItem {
    /// The record's line (or record number) in its file.
    pub line: usize,
    pub prompt: Prompt,
    /// The expected answer (for `choice`, the right choice's text).
    pub reference: String,
    /// For `choice`: the choices and the right one's index.
    pub choices: Vec<String>,
    pub answer: Option<usize>,
}

/// The eval items of a dataset's records for `metric`: a conversation's last assistant turn is
/// the reference for the turns before it, a completion the reference for its prompt. Text
/// records have no prompt to answer and are refused (for every metric but perplexity, which
/// cannot use them either: it scores references after prompts). `choice` needs records with
/// choices: see [`choice_items`].
pub fn items_from_entries(entries: &[Entry], metric: EvalMetric) -> Result<Vec<EvalItem>> {
    if metric == EvalMetric::Choice {
        return Err(Error::invalid(
            "eval_metric choice needs an evaluation dataset whose records have `choices` and an \
             `answer` (JSON Lines: {\"question\": ..., \"choices\": [...], \"answer\": 0})",
        ));
    }
    entries
        .iter()
        .map(|entry| {
            let (prompt, reference) = match &entry.record {
                Record::Conversation(messages) => {
                    let (last, before) = messages.split_last().ok_or_else(|| {
                        Error::invalid(format!("record {} has no messages", entry.line))
                    })?;
                    (Prompt::Chat(before.to_vec()), last.content.clone())
                }
                Record::PromptCompletion { prompt, completion } => {
                    (Prompt::Plain(prompt.clone()), completion.clone())
                }
                Record::Text(_) => {
                    return Err(Error::invalid(format!(
                        "eval_metric {metric}: record {} is plain text, with no prompt and \
                         reference to compare; use a dataset of questions and answers",
                        entry.line
                    )));
                }
            };
            Ok(EvalItem { line: entry.line, prompt, reference, choices: Vec::new(), answer: None })
        })
        .collect()
}

/// Multiple-choice items from a JSON Lines (or JSON array) file: each record an object with the
/// question in `question` (or `query`, `prompt`), `choices` a list of strings, and `answer` the
/// right choice's index or its text. The question is the context as written; each choice is
/// scored as `" " + choice` after it, as lm-evaluation-harness's default `target_delimiter`.
pub fn choice_items(path: &Path) -> Result<Vec<EvalItem>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let trimmed = text.trim_start();
    let records: Vec<(usize, Value)> = if trimmed.starts_with('[') {
        let all: Vec<Value> = serde_json::from_str(trimmed)
            .map_err(|e| Error::invalid(format!("{}: not a JSON array: {e}", path.display())))?;
        all.into_iter().enumerate().map(|(i, v)| (i + 1, v)).collect()
    } else {
        let mut out = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let value = serde_json::from_str(line)
                .map_err(|e| Error::invalid(format!("line {}: not JSON: {e}", i + 1)))?;
            out.push((i + 1, value));
        }
        out
    };
    if records.is_empty() {
        return Err(Error::invalid("the evaluation dataset has no records"));
    }
    records.into_iter().map(|(line, value)| choice_item(line, &value)).collect()
}

fn choice_item(line: usize, value: &Value) -> Result<EvalItem> {
    let bad = |what: String| Error::invalid(format!("line {line}: {what}"));
    let question = ["question", "query", "prompt"]
        .iter()
        .find_map(|k| value.get(k).and_then(Value::as_str))
        .ok_or_else(|| bad("no `question` (or `query`, `prompt`) text".into()))?;
    let choices: Vec<String> = value
        .get("choices")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("no `choices` list: eval_metric choice needs one per record".into()))?
        .iter()
        .map(|c| c.as_str().map(str::to_string))
        .collect::<Option<_>>()
        .ok_or_else(|| bad("`choices` must be a list of strings".into()))?;
    if choices.len() < 2 {
        return Err(bad(format!("`choices` has {} entries; at least 2 are needed", choices.len())));
    }
    let answer = match value.get("answer") {
        Some(Value::Number(n)) => n.as_u64().map(|n| n as usize).filter(|&n| n < choices.len()),
        Some(Value::String(s)) => choices.iter().position(|c| c == s),
        _ => None,
    }
    .ok_or_else(|| {
        bad(format!("`answer` must be a choice's index (0 to {}) or its text", choices.len() - 1))
    })?;
    Ok(EvalItem {
        line,
        prompt: Prompt::Plain(question.to_string()),
        reference: choices[answer].clone(),
        choices,
        answer: Some(answer),
    })
}

/// One record's outcome, for the answers table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    pub line: usize,
    pub prompt: String,
    pub reference: String,
    /// The model's answer (for `choice`, the choice it picked).
    pub output: String,
    /// The record's score under the metric (1 or 0 for the matches and `choice`, a sentence's
    /// ROUGE-L or BLEU, the reference's perplexity).
    pub score: f64,
}

/// A task evaluation's result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskReport {
    pub metric: EvalMetric,
    /// The metric's figure over the set: a fraction for the matches and `choice` (`acc`), mean
    /// ROUGE-L, corpus BLEU (0-100), perplexity.
    pub score: f64,
    /// Other figures beside it (`acc_norm` for `choice`).
    pub extra: BTreeMap<String, f64>,
    pub answers: Vec<Answer>,
    /// How long the generation or scoring took, beside its prediction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timing: Option<TaskTiming>,
}

/// A task evaluation's measured time and the time predicted for it before it ran.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TaskTiming {
    /// Wall seconds of the batched generation or scoring (not the metric's own arithmetic).
    pub seconds: f64,
    pub predicted: Option<EvalTime>,
}

/// What a task evaluation runs on: batched greedy generation and log-likelihood scoring.
pub trait Inference {
    fn tokenizer(&self) -> &Tokenizer;
    /// Greedy answers (new token ids, without the end token) after each prompt.
    fn generate(&mut self, prompts: &[Vec<u32>], max_new_tokens: usize) -> Result<Vec<Vec<u32>>>;
    /// The log-likelihood of each continuation after its context.
    fn score(&mut self, pairs: &[(Vec<u32>, Vec<u32>)]) -> Result<Vec<Scored>>;
    /// The model's context in tokens.
    fn max_positions(&self) -> usize;
    /// The predicted time of `work` on this model, where the machine's rates are known.
    fn predict(&self, work: &EvalWork) -> Option<EvalTime> {
        let _ = work;
        None
    }
}

/// A loaded generator as [`Inference`], batched within `limits`.
pub struct Loaded<'g, B: Backend> {
    generator: &'g Generator<B>,
    tokenizer: &'g Tokenizer,
    limits: BatchLimits,
    rates: MachineRates,
}

impl<'g, B: Backend> Loaded<'g, B> {
    /// A generator with a tokenizer, as [`Inference`], on a machine of `rates`.
    pub fn new(
        generator: &'g Generator<B>,
        limits: BatchLimits,
        rates: MachineRates,
    ) -> Result<Self> {
        let tokenizer = generator
            .tokenizer()
            .ok_or_else(|| Error::invalid("the model has no tokenizer to evaluate with"))?;
        Ok(Loaded { generator, tokenizer, limits, rates })
    }
}

impl<B: Backend> Inference for Loaded<'_, B> {
    fn tokenizer(&self) -> &Tokenizer {
        self.tokenizer
    }
    fn generate(&mut self, prompts: &[Vec<u32>], max_new_tokens: usize) -> Result<Vec<Vec<u32>>> {
        let options = GenerateOptions::greedy(max_new_tokens);
        let out = self.generator.generate_batch(prompts, &options, self.limits)?;
        Ok(out.into_iter().map(|g| g.ids).collect())
    }
    fn score(&mut self, pairs: &[(Vec<u32>, Vec<u32>)]) -> Result<Vec<Scored>> {
        self.generator.score(pairs, self.limits)
    }
    fn max_positions(&self) -> usize {
        self.generator.spec().max_positions
    }
    fn predict(&self, work: &EvalWork) -> Option<EvalTime> {
        let spec = self.generator.spec();
        Some(super::timing::predict(spec, &self.rates, self.limits, false, work))
    }
}

/// A batched forward over any weights ([`Units`]: resident or streamed from the host) as
/// [`Inference`].
pub struct Batched<'a, 'm, B: Backend, U: Units<B>> {
    pub model: &'a BatchModel<'m, B>,
    pub units: &'a mut U,
    pub tokenizer: &'a Tokenizer,
    pub limits: BatchLimits,
    pub rates: MachineRates,
}

impl<B: Backend, U: Units<B>> Inference for Batched<'_, '_, B, U> {
    fn tokenizer(&self) -> &Tokenizer {
        self.tokenizer
    }
    fn generate(&mut self, prompts: &[Vec<u32>], max_new_tokens: usize) -> Result<Vec<Vec<u32>>> {
        let stop = crate::generate::stop_ids(self.model.spec, Some(self.tokenizer));
        let options = GenerateOptions::greedy(max_new_tokens);
        let out = generate_batch(self.model, self.units, prompts, &options, &stop, self.limits)?;
        Ok(out.into_iter().map(|g| g.ids).collect())
    }
    fn score(&mut self, pairs: &[(Vec<u32>, Vec<u32>)]) -> Result<Vec<Scored>> {
        score_batch(self.model, self.units, pairs, self.limits)
    }
    fn max_positions(&self) -> usize {
        self.model.spec.max_positions
    }
    fn predict(&self, work: &EvalWork) -> Option<EvalTime> {
        let (spec, streamed) = (self.model.spec, self.units.streamed());
        Some(super::timing::predict(spec, &self.rates, self.limits, streamed, work))
    }
}

/// How many sequences and new tokens a task evaluation between training steps runs at once,
/// at most: the planner reserves device memory for this much ([`device_reserve`]).
pub const BETWEEN_STEPS: BatchLimits = BatchLimits { sequences: 32, tokens: 4096 };

/// Device bytes a task evaluation between steps may take beside the training's own buffers,
/// with `limits` and room for `positions` positions a sequence: the embedding and head
/// (bf16), one layer's slot, every sequence's keys and values, one forward's working buffers
/// and a chunk of f32 logits. The planner leaves this much of the device free.
pub fn device_reserve(spec: &ModelSpec, limits: BatchLimits, positions: usize) -> u64 {
    const BF16: usize = 2;
    let embed = spec.vocab * spec.hidden;
    let head = spec.hidden + if spec.tie_embeddings { 0 } else { embed };
    let layer = (0..spec.layers).map(|l| spec.layer_params(l)).max().unwrap_or(0);
    let kv = limits.sequences * positions * spec.layers * 2 * spec.kv_heads * spec.head_dim;
    // A layer's forward buffers per token: the residual stream twice, the norms, q/k/v, the
    // attention output, the MLP's gate/up and activation (a generous bound for every family).
    let per_token = 8 * spec.hidden + 2 * spec.qkv_width() + 3 * spec.intermediate;
    let work = limits.tokens * per_token;
    let logits = 64 << 20;
    ((embed + head + layer + kv + work) * BF16 + logits) as u64
}

/// The batch of a task evaluation between steps: [`BETWEEN_STEPS`], with fewer sequences when
/// the prompts are longer than the `planned` positions a sequence, so the keys and values stay
/// within what the planner reserved.
pub fn limits_between_steps(planned: usize, longest: usize) -> BatchLimits {
    let need = longest.max(1);
    let sequences =
        (BETWEEN_STEPS.sequences * planned.max(1) / need).clamp(1, BETWEEN_STEPS.sequences);
    BatchLimits { sequences, ..BETWEEN_STEPS }
}

/// The token ids of a prompt: a conversation in the chat template with the generation prompt,
/// plain text as is. The prompt must leave room for `room` new tokens in the context.
pub fn prompt_ids(tokenizer: &Tokenizer, prompt: &Prompt) -> Result<Vec<u32>> {
    let text = match prompt {
        Prompt::Chat(messages) => {
            let template = ChatTemplate::from_tokenizer(tokenizer)?.ok_or_else(|| {
                Error::invalid("the model has no chat template, which a conversation needs")
            })?;
            template.render(messages, true)?
        }
        Prompt::Plain(text) => text.clone(),
    };
    Ok(tokenizer.encode(&text)?.ids)
}

/// A context and continuation as lm-evaluation-harness splits them (`_encode_pair`): trailing
/// spaces of the context move to the continuation, the whole is tokenized at once, and the
/// continuation is what follows the context's own tokens.
pub fn encode_pair(
    tokenizer: &Tokenizer,
    context: &str,
    continuation: &str,
) -> Result<(Vec<u32>, Vec<u32>)> {
    let trimmed = context.trim_end_matches(' ');
    let moved = &context[trimmed.len()..];
    let continuation = format!("{moved}{continuation}");
    let whole = tokenizer.encode(&format!("{trimmed}{continuation}"))?.ids;
    let context_ids = tokenizer.encode(trimmed)?.ids;
    if context_ids.len() >= whole.len() {
        return Err(Error::invalid("a choice adds no tokens after its question"));
    }
    Ok((context_ids.clone(), whole[context_ids.len()..].to_vec()))
}

/// `model`'s scores of `pairs`, timed beside their prediction.
fn timed_score(
    model: &mut dyn Inference,
    pairs: &[(Vec<u32>, Vec<u32>)],
) -> Result<(Vec<Scored>, TaskTiming)> {
    let lengths = pairs.iter().map(|(c, x)| c.len() + x.len()).collect();
    let wanted = pairs.iter().map(|(_, x)| x.len()).collect();
    let predicted = model.predict(&EvalWork::Score { lengths, wanted });
    let start = Instant::now();
    let scored = model.score(pairs)?;
    Ok((scored, TaskTiming { seconds: start.elapsed().as_secs_f64(), predicted }))
}

/// Scores `items` (the first `settings.records`) by `settings.metric` with `model`.
pub fn evaluate(
    model: &mut dyn Inference,
    settings: &TaskSettings,
    items: &[EvalItem],
) -> Result<TaskReport> {
    let items = &items[..items.len().min(settings.records)];
    if items.is_empty() {
        return Err(Error::invalid("the evaluation set has no records"));
    }
    let metric = settings.metric;
    let context = model.max_positions();
    let too_long = |item: &EvalItem, tokens: usize| {
        Error::invalid(format!(
            "eval record {}: the prompt and answer take {tokens} tokens; the model's context is \
             {context}",
            item.line
        ))
    };
    match metric {
        EvalMetric::Loss => Err(Error::invalid("eval_metric loss has no task evaluation")),
        EvalMetric::Choice => {
            let mut pairs = Vec::new();
            for item in items {
                if item.choices.len() < 2 || item.answer.is_none() {
                    return Err(Error::invalid(format!(
                        "eval_metric choice: record {} has no choices",
                        item.line
                    )));
                }
                let question = item.prompt.shown();
                for choice in &item.choices {
                    let pair = encode_pair(model.tokenizer(), &question, &format!(" {choice}"))?;
                    if pair.0.is_empty() {
                        return Err(Error::invalid(format!(
                            "eval record {}: an empty question",
                            item.line
                        )));
                    }
                    if pair.0.len() + pair.1.len() > context {
                        return Err(too_long(item, pair.0.len() + pair.1.len()));
                    }
                    pairs.push(pair);
                }
            }
            let (scored, timing) = timed_score(model, &pairs)?;
            let (mut acc, mut acc_norm, mut answers) = (0.0, 0.0, Vec::new());
            let mut at = 0;
            for item in items {
                let n = item.choices.len();
                let logprobs: Vec<f64> = scored[at..at + n].iter().map(|s| s.logprob).collect();
                at += n;
                // acc_norm divides by the choice's own length, without the delimiter.
                let texts: Vec<&str> = item.choices.iter().map(String::as_str).collect();
                let pick = metrics::pick_choice(&logprobs, &texts)?;
                let right = item.answer.unwrap_or(usize::MAX);
                let hit = f64::from(u8::from(pick.acc == right));
                acc += hit;
                acc_norm += f64::from(u8::from(pick.acc_norm == right));
                answers.push(Answer {
                    line: item.line,
                    prompt: item.prompt.shown(),
                    reference: item.reference.clone(),
                    output: item.choices[pick.acc].clone(),
                    score: hit,
                });
            }
            let n = items.len() as f64;
            let extra = BTreeMap::from([("acc_norm".to_string(), acc_norm / n)]);
            Ok(TaskReport { metric, score: acc / n, extra, answers, timing: Some(timing) })
        }
        EvalMetric::Perplexity => {
            let mut pairs = Vec::new();
            for item in items {
                let context_ids = prompt_ids(model.tokenizer(), &item.prompt)?;
                let reference = model.tokenizer().encode(&item.reference)?.ids;
                if context_ids.is_empty() || reference.is_empty() {
                    return Err(Error::invalid(format!(
                        "eval record {}: an empty prompt or reference",
                        item.line
                    )));
                }
                if context_ids.len() + reference.len() > context {
                    return Err(too_long(item, context_ids.len() + reference.len()));
                }
                pairs.push((context_ids, reference));
            }
            let (scored, timing) = timed_score(model, &pairs)?;
            let (nll, tokens) =
                scored.iter().fold((0.0, 0), |(n, t), s| (n - s.logprob, t + s.tokens));
            let answers = items
                .iter()
                .zip(&scored)
                .map(|(item, s)| {
                    Ok(Answer {
                        line: item.line,
                        prompt: item.prompt.shown(),
                        reference: item.reference.clone(),
                        output: String::new(),
                        score: metrics::perplexity(-s.logprob, s.tokens)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let score = metrics::perplexity(nll, tokens)?;
            Ok(TaskReport { metric, score, extra: BTreeMap::new(), answers, timing: Some(timing) })
        }
        _ => {
            let extractor = settings.extractor()?;
            let mut prompts = Vec::with_capacity(items.len());
            for item in items {
                let ids = prompt_ids(model.tokenizer(), &item.prompt)?;
                if ids.is_empty() {
                    return Err(Error::invalid(format!(
                        "eval record {}: an empty prompt",
                        item.line
                    )));
                }
                if ids.len() >= context {
                    return Err(too_long(item, ids.len()));
                }
                prompts.push(ids);
            }
            let lengths = prompts.iter().map(Vec::len).collect();
            let work = EvalWork::Generate { prompts: lengths, new_tokens: settings.max_new_tokens };
            let predicted = model.predict(&work);
            let start = Instant::now();
            let outputs = model.generate(&prompts, settings.max_new_tokens)?;
            let timing = TaskTiming { seconds: start.elapsed().as_secs_f64(), predicted };
            let outputs: Vec<String> = outputs
                .iter()
                .map(|ids| model.tokenizer().decode(ids).map(|t| t.trim().to_string()))
                .collect::<Result<_>>()?;
            let answers: Vec<Answer> = items
                .iter()
                .zip(&outputs)
                .map(|(item, output)| {
                    let (o, r) = (output.as_str(), item.reference.as_str());
                    let score = match metric {
                        EvalMetric::ExactMatch => metrics::exact_match(o, r),
                        EvalMetric::Contains => metrics::contains(o, r),
                        EvalMetric::Extract => metrics::extracted_match(&extractor, o, r),
                        EvalMetric::RougeL => metrics::rouge_l(o, r),
                        _ => metrics::sentence_bleu(o, r),
                    };
                    Answer {
                        line: item.line,
                        prompt: item.prompt.shown(),
                        reference: item.reference.clone(),
                        output: output.clone(),
                        score,
                    }
                })
                .collect();
            let score = if metric == EvalMetric::Bleu {
                let refs: Vec<&str> = items.iter().map(|i| i.reference.as_str()).collect();
                let outs: Vec<&str> = outputs.iter().map(String::as_str).collect();
                metrics::corpus_bleu(&outs, &refs)?
            } else {
                answers.iter().map(|a| a.score).sum::<f64>() / answers.len() as f64
            };
            Ok(TaskReport { metric, score, extra: BTreeMap::new(), answers, timing: Some(timing) })
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::data::tiny_tokenizer;
    use crate::model::HostParams;
    use crate::spec::{ModelSpec, preset};

    fn tiny() -> Generator {
        let spec: ModelSpec = preset("tiny").unwrap();
        let params = HostParams::random(&spec, 5);
        Generator::new(spec, params, Some(tiny_tokenizer().unwrap())).unwrap()
    }

    const LIMITS: BatchLimits = BatchLimits { sequences: 3, tokens: 64 };

    #[test]
    fn the_reserve_between_steps_counts_the_weights_caches_and_buffers() {
        let spec = preset("qwen2.5-7b").unwrap();
        let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
        let reserve = gib(device_reserve(&spec, BETWEEN_STEPS, 256 + 128));
        // Untied embedding and head 2 x 1.02 GiB, a 0.43 GiB layer, 32 x 384 positions of
        // 28 layers' keys and values (0.66 GiB), 4096 tokens of buffers, 64 MiB of logits.
        assert!((3.5..5.0).contains(&reserve), "{reserve:.2} GiB");
        // Longer prompts: fewer sequences, never none.
        assert_eq!(limits_between_steps(384, 384).sequences, 32);
        assert_eq!(limits_between_steps(384, 768).sequences, 16);
        assert_eq!(limits_between_steps(384, 100_000).sequences, 1);
        assert_eq!(limits_between_steps(384, 10).sequences, 32);
    }

    #[test]
    fn records_become_prompts_and_references() {
        let entries = vec![
            Entry {
                line: 3,
                record: Record::Conversation(vec![
                    Message::new(Role::System, "be brief"),
                    Message::new(Role::User, "2+2?"),
                    Message::new(Role::Assistant, "4"),
                ]),
            },
            Entry {
                line: 4,
                record: Record::PromptCompletion {
                    prompt: "Q: 3+3? A:".into(),
                    completion: " 6".into(),
                },
            },
        ];
        let items = items_from_entries(&entries, EvalMetric::ExactMatch).unwrap();
        assert_eq!(items[0].prompt.shown(), "2+2?");
        assert_eq!(items[0].reference, "4");
        assert!(matches!(&items[0].prompt, Prompt::Chat(m) if m.len() == 2));
        assert_eq!(items[1].prompt, Prompt::Plain("Q: 3+3? A:".into()));
        assert_eq!((items[1].line, items[1].reference.as_str()), (4, " 6"));
        let text = [Entry { line: 9, record: Record::Text("words".into()) }];
        let err = items_from_entries(&text, EvalMetric::RougeL).unwrap_err().to_string();
        assert!(err.contains("record 9") && err.contains("plain text"), "{err}");
    }

    #[test]
    fn choice_records_name_their_line_and_field() {
        let ok = json_item(r#"{"query": "Sky?", "choices": ["blue", "red"], "answer": "red"}"#);
        let item = ok.unwrap();
        assert_eq!((item.answer, item.reference.as_str()), (Some(1), "red"));
        for (line, field) in [
            (r#"{"choices": ["a", "b"], "answer": 0}"#, "question"),
            (r#"{"question": "q", "choices": ["a"], "answer": 0}"#, "at least 2"),
            (r#"{"question": "q", "choices": ["a", 3], "answer": 0}"#, "list of strings"),
            (r#"{"question": "q", "choices": ["a", "b"], "answer": "c"}"#, "answer"),
        ] {
            let err = json_item(line).unwrap_err().to_string();
            assert!(err.contains("line 7") && err.contains(field), "{line}: {err}");
        }
    }

    fn json_item(line: &str) -> Result<EvalItem> {
        choice_item(7, &serde_json::from_str(line).unwrap())
    }

    #[test]
    fn a_pair_splits_as_lm_evaluation_harness_does() {
        let tok = tiny_tokenizer().unwrap();
        // The context's trailing space moves to the continuation.
        let (context, continuation) = encode_pair(&tok, "The sky is ", "blue").unwrap();
        assert_eq!(context, tok.encode("The sky is").unwrap().ids);
        let whole = tok.encode("The sky is blue").unwrap().ids;
        assert_eq!([context.clone(), continuation].concat(), whole);
    }

    #[test]
    fn multiple_choice_picks_the_most_likely_choice() {
        let g = tiny();
        let items = vec![
            EvalItem {
                line: 1,
                prompt: Prompt::Plain("Colour of the sky:".into()),
                reference: "blue".into(),
                choices: vec!["blue".into(), "a very long green answer".into()],
                answer: Some(0),
            },
            EvalItem {
                line: 2,
                prompt: Prompt::Plain("Two and two:".into()),
                reference: "four".into(),
                choices: vec!["three".into(), "four".into(), "five".into()],
                answer: Some(1),
            },
        ];
        let settings = TaskSettings {
            metric: EvalMetric::Choice,
            answer: AnswerFormat::LastNumber,
            pattern: None,
            max_new_tokens: 4,
            records: 10,
        };
        let report =
            evaluate(&mut Loaded::new(&g, LIMITS, MachineRates::cpu()).unwrap(), &settings, &items)
                .unwrap();
        // The same figures from the scores themselves.
        let tok = g.tokenizer().unwrap();
        let (mut acc, mut acc_norm) = (0.0, 0.0);
        for item in &items {
            let pairs: Vec<_> = item
                .choices
                .iter()
                .map(|c| encode_pair(tok, &item.prompt.shown(), &format!(" {c}")).unwrap())
                .collect();
            let scored = g.score(&pairs, LIMITS).unwrap();
            let best = |f: &dyn Fn(usize) -> f64| {
                (0..scored.len()).fold(0, |b, i| if f(i) > f(b) { i } else { b })
            };
            let pick = best(&|i| scored[i].logprob);
            let pick_norm = best(&|i| scored[i].logprob / item.choices[i].len() as f64);
            acc += f64::from(u8::from(Some(pick) == item.answer)) / 2.0;
            acc_norm += f64::from(u8::from(Some(pick_norm) == item.answer)) / 2.0;
            let answer = report.answers.iter().find(|a| a.line == item.line).unwrap();
            assert_eq!(answer.output, item.choices[pick]);
        }
        assert_eq!(report.score, acc);
        assert_eq!(report.extra["acc_norm"], acc_norm);
    }

    #[test]
    fn generated_answers_are_scored_one_by_one_and_over_the_set() {
        let g = tiny();
        let items: Vec<EvalItem> = ["a", "bb", "ccc"]
            .iter()
            .enumerate()
            .map(|(i, p)| EvalItem {
                line: i + 1,
                prompt: Prompt::Chat(vec![Message::new(Role::User, *p)]),
                reference: "the same words".into(),
                choices: Vec::new(),
                answer: None,
            })
            .collect();
        for metric in [EvalMetric::ExactMatch, EvalMetric::RougeL, EvalMetric::Bleu] {
            let settings = TaskSettings {
                metric,
                answer: AnswerFormat::LastNumber,
                pattern: None,
                max_new_tokens: 5,
                records: 2,
            };
            let report = evaluate(
                &mut Loaded::new(&g, LIMITS, MachineRates::cpu()).unwrap(),
                &settings,
                &items,
            )
            .unwrap();
            assert_eq!(report.answers.len(), 2, "records caps the set");
            for a in &report.answers {
                let want = match metric {
                    EvalMetric::ExactMatch => metrics::exact_match(&a.output, &a.reference),
                    EvalMetric::RougeL => metrics::rouge_l(&a.output, &a.reference),
                    _ => metrics::sentence_bleu(&a.output, &a.reference),
                };
                assert_eq!(a.score, want);
            }
            if metric == EvalMetric::Bleu {
                let outs: Vec<&str> = report.answers.iter().map(|a| a.output.as_str()).collect();
                let refs = vec!["the same words"; 2];
                assert_eq!(report.score, metrics::corpus_bleu(&outs, &refs).unwrap());
            }
        }
    }
}
