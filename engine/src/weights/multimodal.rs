//! A multimodal checkpoint's text model, in and out.
//!
//! Gemma 3's `Gemma3ForConditionalGeneration` folders store their text model under a prefix,
//! spelled one of two ways (transformers' conversion mapping for the llava family, which gemma3
//! follows: `^language_model.model` to `model.language_model`, `^language_model.lm_head` to
//! `lm_head`, `^vision_tower` to `model.vision_tower`, `^multi_modal_projector` to
//! `model.multi_modal_projector`):
//! - the hub's original files (and what transformers 5's `save_pretrained` writes back by
//!   default): `language_model.model.layers.N.*`, `language_model.model.embed_tokens.weight`,
//!   `language_model.model.norm.weight`, sometimes `language_model.lm_head.weight`, beside
//!   `vision_tower.*` and `multi_modal_projector.*`;
//! - the class's own module paths since transformers 4.52, which files saved by 4.52-era
//!   releases, by transformers 5 with `save_original_format=False` and by tools that save the
//!   state dict as it is hold: `model.language_model.layers.N.*`,
//!   `model.language_model.embed_tokens.weight`, `model.language_model.norm.weight`,
//!   `lm_head.weight`, beside `model.vision_tower.*` and `model.multi_modal_projector.*`.
//!
//! A checkpoint is written in the spelling its weights were read in.
//!
//! [`TensorSource`] serves such a checkpoint's text tensors under the text model's own names as
//! well (`model.layers.N.*`, `lm_head.weight`), so the text model loads from it as from its own
//! folder. [`Passthrough`] keeps the other tensors (the vision tower and the projector, which
//! Sluice does not train) in the weights they came from, and writes a checkpoint back as the
//! wrapper: the wrapper's `config.json`, the text tensors under the names they were read from,
//! and the others copied through bit for bit, a tensor at a time out of the memory-mapped
//! source.

use std::path::Path;

use serde_json::Value;

use super::folder::{HfFolder, save_hf_folder};
use super::read::TensorSource;
use super::write::{TensorData, TensorRef};
use crate::error::{Error, Result};

/// The prefix of the hub's original spelling: `language_model.` + the text model's name.
const LANGUAGE_MODEL: &str = "language_model.";
/// The prefix of the module-path spelling, in place of the text model's `model.`.
const MODEL_LANGUAGE_MODEL: &str = "model.language_model.";
/// The text model's own prefix for everything but its head.
const TEXT_BODY: &str = "model.";
/// The head, stored under its own name in the later spelling.
const HEAD: &str = "lm_head.";

/// How a multimodal checkpoint names its text model's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextPrefix {
    /// `language_model.model.*` and `language_model.lm_head.weight` (the hub's original files).
    LanguageModel,
    /// `model.language_model.*` and `lm_head.weight` (the module paths since transformers 4.52).
    ModelLanguageModel,
}

impl TextPrefix {
    /// The spelling a checkpoint's tensor names use, `None` when none holds a text model under a
    /// prefix; `Err` naming one tensor of each when both spellings appear.
    pub(crate) fn detect<'a>(
        names: impl Iterator<Item = &'a str>,
    ) -> std::result::Result<Option<TextPrefix>, String> {
        let (mut legacy, mut nested) = (None, None);
        for name in names {
            if name.starts_with(LANGUAGE_MODEL) {
                legacy.get_or_insert(name);
            } else if name.starts_with(MODEL_LANGUAGE_MODEL) {
                nested.get_or_insert(name);
            }
        }
        match (legacy, nested) {
            (Some(a), Some(b)) => Err(format!(
                "the text model is stored under two prefixes at once ('{a}' and '{b}'), \
                 '{LANGUAGE_MODEL}' and '{MODEL_LANGUAGE_MODEL}', so which tensors are the text \
                 model's is unclear"
            )),
            (Some(_), None) => Ok(Some(TextPrefix::LanguageModel)),
            (None, Some(_)) => Ok(Some(TextPrefix::ModelLanguageModel)),
            (None, None) => Ok(None),
        }
    }

    /// The name a text model's tensor (`model.layers.0.input_layernorm.weight`,
    /// `lm_head.weight`) is stored under.
    pub fn stored(self, text: &str) -> String {
        match self {
            TextPrefix::LanguageModel => format!("{LANGUAGE_MODEL}{text}"),
            TextPrefix::ModelLanguageModel => match text.strip_prefix(TEXT_BODY) {
                Some(rest) => format!("{MODEL_LANGUAGE_MODEL}{rest}"),
                None => text.to_string(),
            },
        }
    }

    /// The text model's name of a stored tensor; `None` for a tensor that is not the text
    /// model's (the vision tower's, the projector's).
    pub fn text(self, stored: &str) -> Option<String> {
        match self {
            TextPrefix::LanguageModel => stored.strip_prefix(LANGUAGE_MODEL).map(str::to_string),
            TextPrefix::ModelLanguageModel => match stored.strip_prefix(MODEL_LANGUAGE_MODEL) {
                Some(rest) => Some(format!("{TEXT_BODY}{rest}")),
                None => stored.starts_with(HEAD).then(|| stored.to_string()),
            },
        }
    }
}

/// A multimodal model's tensors that Sluice does not train, kept in the weights they were read
/// from, and what writing a checkpoint back as the wrapper needs besides: its `config.json` and
/// how it names the text model.
pub struct Passthrough {
    /// Written as the checkpoint's `config.json` in place of the text model's.
    config: Value,
    prefix: TextPrefix,
    /// The model's weights, memory-mapped; the copied tensors are read out of them at each save.
    source: TensorSource,
    /// Stored names of the tensors copied through, sorted.
    copied: Vec<String>,
}

impl std::fmt::Debug for Passthrough {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Passthrough")
            .field("prefix", &self.prefix)
            .field("source", &self.source.path())
            .field("copied", &self.copied.len())
            .finish()
    }
}

impl Passthrough {
    /// The tensors of `source` that are not its text model's, to be written back with `config`
    /// (the wrapper's `config.json`, `ModelSpec::wrapper_config`). Weights that hold no text
    /// model under a multimodal prefix are refused: a checkpoint of them would name its text
    /// tensors where the wrapper's class does not look.
    pub fn new(config: Value, source: TensorSource) -> Result<Passthrough> {
        let prefix = source.text_prefix().ok_or_else(|| {
            Error::weights(
                source.path(),
                format!(
                    "config.json describes a multimodal model, but no tensor is stored under \
                     '{LANGUAGE_MODEL}' or '{MODEL_LANGUAGE_MODEL}', where its text model would \
                     be"
                ),
            )
        })?;
        let copied = source.names().into_iter().filter(|n| prefix.text(n).is_none()).collect();
        Ok(Passthrough { config, prefix, source, copied })
    }

    /// How the text model's tensors are named, in the weights read and in every checkpoint.
    pub fn prefix(&self) -> TextPrefix {
        self.prefix
    }

    /// The stored names of the tensors copied through (the vision tower's, the projector's),
    /// sorted.
    pub fn copied(&self) -> &[String] {
        &self.copied
    }

    /// Writes `text`, a text model's checkpoint (its tensors under its own names, as for a
    /// `...ForCausalLM` folder), as a checkpoint of the wrapper: the wrapper's `config.json`
    /// instead of `text.config`, the text tensors under the names they were read from (in
    /// `text.dtype`), then every copied tensor in its stored dtype, byte for byte. Atomic as
    /// [`save_hf_folder`] is; a copied tensor streams from the source's mapping to the file.
    pub fn save(&self, dest: impl AsRef<Path>, text: HfFolder<'_>) -> Result<()> {
        let names: Vec<String> = text.tensors.iter().map(|t| self.prefix.stored(t.name)).collect();
        let mut tensors: Vec<TensorRef<'_>> = text
            .tensors
            .iter()
            .zip(&names)
            .map(|(t, name)| TensorRef { name, shape: t.shape.clone(), data: t.data.clone() })
            .collect();
        for name in &self.copied {
            let (dtype, shape, bytes) = self.source.stored(name)?;
            tensors.push(TensorRef { name, shape, data: TensorData::Stored { dtype, bytes } });
        }
        let folder = HfFolder {
            tensors,
            dtype: text.dtype,
            max_shard_bytes: text.max_shard_bytes,
            config: self.config.clone(),
            extra_files: text.extra_files,
        };
        save_hf_folder(dest, &folder)
    }
}
