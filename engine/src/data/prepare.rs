//! Records to token samples: ids plus, per token, whether it is trained (predicted with a loss).
//!
//! Conversations go through the tokenizer's chat template and train the assistant turns (reply
//! and end-of-turn marker); prompt/completion becomes a user/assistant conversation when there is
//! a template, else `prompt + completion + eos` with the completion trained; plain text is
//! `text + eos`, all trained. A token is trained when its first byte lies in a trained span.

use std::ops::Range;
use std::path::{Path, PathBuf};

use super::formats::{Entry, Message, Record, Role};
use super::template::ChatTemplate;
use super::tokenizer::Tokenizer;
use crate::error::{Error, Result};

/// One tokenized record; `trained[t]` says whether token `t` is a training target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    pub ids: Vec<u32>,
    pub trained: Vec<bool>,
    /// Raw text (pretraining), which packing continues over rows: a part that does not fit
    /// the rest of a row goes on at the start of the next, and none of it is cut. Other
    /// samples never cross a row, and one longer than a row is cut.
    pub continues: bool,
}

impl Sample {
    /// A sample that never crosses a row.
    pub fn new(ids: Vec<u32>, trained: Vec<bool>) -> Sample {
        Sample { ids, trained, continues: false }
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub struct PrepareOptions {
    /// Train every token of conversations, the prompt included, not only assistant turns.
    pub train_on_prompt: bool,
}

/// The samples of a dataset, in record order, with what packing reports about them.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The dataset file, for errors about the dataset as a whole.
    pub path: PathBuf,
    pub records: usize,
    pub samples: Vec<Sample>,
    /// Conversations in which no trained token is the tokenizer's eos: a model trained on them
    /// does not learn to stop (the template does not end turns with eos).
    pub samples_without_eos: usize,
}

impl Prepared {
    /// Wraps hand-made samples (one record each).
    pub fn from_samples(path: impl Into<PathBuf>, samples: Vec<Sample>) -> Prepared {
        Prepared { path: path.into(), records: samples.len(), samples, samples_without_eos: 0 }
    }
}

/// Turns records into samples with a tokenizer and its chat template (compiled once).
#[derive(Debug)]
pub struct Preparer<'t> {
    tokenizer: &'t Tokenizer,
    template: Option<ChatTemplate>,
    options: PrepareOptions,
}

impl<'t> Preparer<'t> {
    pub fn new(tokenizer: &'t Tokenizer, options: PrepareOptions) -> Result<Preparer<'t>> {
        Ok(Preparer { tokenizer, template: ChatTemplate::from_tokenizer(tokenizer)?, options })
    }

    /// Uses `template` instead of the tokenizer's own.
    pub fn with_template(
        tokenizer: &'t Tokenizer,
        template: ChatTemplate,
        options: PrepareOptions,
    ) -> Preparer<'t> {
        Preparer { tokenizer, template: Some(template), options }
    }

    /// Tokenizes every entry; an entry that cannot be rendered or tokenized stops preparation
    /// with its line.
    pub fn prepare(&self, path: &Path, entries: &[Entry]) -> Result<Prepared> {
        let eos = self.tokenizer.eos_token_id();
        let mut samples = Vec::with_capacity(entries.len());
        let mut samples_without_eos = 0;
        for entry in entries {
            let sample = self.sample(&entry.record).map_err(|e| Error::DatasetRecord {
                path: path.to_path_buf(),
                line: entry.line,
                message: e.to_string(),
            })?;
            let ends_turns = eos.is_some_and(|eos| {
                sample.ids.iter().zip(&sample.trained).any(|(&id, &t)| t && id == eos)
            });
            if matches!(entry.record, Record::Conversation(_)) && !ends_turns {
                samples_without_eos += 1;
            }
            samples.push(sample);
        }
        Ok(Prepared {
            path: path.to_path_buf(),
            records: entries.len(),
            samples,
            samples_without_eos,
        })
    }

    /// Tokenizes one record.
    pub fn sample(&self, record: &Record) -> Result<Sample> {
        match record {
            Record::Conversation(messages) => self.conversation(messages),
            Record::PromptCompletion { prompt, completion } => match &self.template {
                Some(_) => self.conversation(&[
                    Message::new(Role::User, prompt.as_str()),
                    Message::new(Role::Assistant, completion.as_str()),
                ]),
                None => {
                    let text = format!("{prompt}{completion}");
                    let trained = if self.options.train_on_prompt {
                        0..text.len()
                    } else {
                        prompt.len()..text.len()
                    };
                    self.with_eos(&text, trained)
                }
            },
            Record::Text(text) => {
                Ok(Sample { continues: true, ..self.with_eos(text, 0..text.len())? })
            }
        }
    }

    fn conversation(&self, messages: &[Message]) -> Result<Sample> {
        let Some(template) = &self.template else {
            return Err(Error::tokenizer(
                self.tokenizer.source(),
                "the tokenizer has no chat template, which conversation datasets need",
            ));
        };
        let rendered = template.render_with_spans(messages)?;
        let encoding = self.tokenizer.encode(&rendered.text)?;
        let trained = if self.options.train_on_prompt {
            vec![true; encoding.ids.len()]
        } else {
            // One span per assistant message, in order; a reply kept as context is not trained.
            let replies = messages.iter().filter(|m| m.role == Role::Assistant);
            let spans: Vec<Range<usize>> = rendered
                .assistant_spans
                .iter()
                .zip(replies)
                .filter(|(_, reply)| reply.trained)
                .map(|(span, _)| span.clone())
                .collect();
            mask(&encoding.offsets, &spans)
        };
        Ok(Sample::new(encoding.ids, trained))
    }

    /// `text` then eos; tokens starting in `trained` and the eos are trained.
    fn with_eos(&self, text: &str, trained: Range<usize>) -> Result<Sample> {
        let Some(eos) = self.tokenizer.eos_token_id() else {
            return Err(Error::tokenizer(
                self.tokenizer.source(),
                "the tokenizer has no eos token, which is appended to text and completions",
            ));
        };
        let encoding = self.tokenizer.encode(text)?;
        let mut trained = if self.options.train_on_prompt {
            vec![true; encoding.ids.len()]
        } else {
            mask(&encoding.offsets, std::slice::from_ref(&trained))
        };
        let mut ids = encoding.ids;
        ids.push(eos);
        trained.push(true);
        Ok(Sample::new(ids, trained))
    }
}

/// `true` for each token whose first byte lies in one of `spans` (sorted, disjoint).
pub fn mask(offsets: &[(usize, usize)], spans: &[Range<usize>]) -> Vec<bool> {
    offsets.iter().map(|&(start, _)| spans.iter().any(|s| s.contains(&start))).collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
#[path = "prepare_tests.rs"]
mod tests;
