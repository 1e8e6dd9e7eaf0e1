//! A Hugging Face tokenizer folder: `tokenizer.json` (the `tokenizers` model) plus the settings
//! around it that transformers keeps in other files: special token strings and the chat template
//! (`tokenizer_config.json`, `special_tokens_map.json`, `chat_template.jinja`) and the eos id
//! (`generation_config.json`).

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};

/// Token ids of a text with the byte range of the text each token came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoding {
    pub ids: Vec<u32>,
    /// `[start, end)` byte offsets into the encoded text, one per id (`&text[start..end]` is the
    /// token's text; byte-level pieces of one character all carry that character's range).
    pub offsets: Vec<(usize, usize)>,
}

/// A loaded tokenizer with its special tokens and chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Where it was loaded from, for error messages (`<embedded>` for in-binary tokenizers).
    source: PathBuf,
    bos_token: Option<String>,
    eos_token: Option<String>,
    pad_token: Option<String>,
    unk_token: Option<String>,
    eos_token_id: Option<u32>,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.source)
            .field("vocab_size", &self.vocab_size())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("eos_token_id", &self.eos_token_id)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

static TINY_TOKENIZER_JSON: &[u8] = include_bytes!("../../assets/tiny-tokenizer/tokenizer.json");
static TINY_TOKENIZER_CONFIG: &[u8] =
    include_bytes!("../../assets/tiny-tokenizer/tokenizer_config.json");

/// The tiny byte-level BPE tokenizer built into the engine (vocabulary 2,048, ChatML template,
/// eos `<|im_end|>`), for demos and random-init models. Made by `scripts/make_tiny_tokenizer.py`.
pub fn tiny_tokenizer() -> Result<Tokenizer> {
    Tokenizer::from_bytes(TINY_TOKENIZER_JSON, Some(TINY_TOKENIZER_CONFIG))
}

/// The tiny tokenizer's files by name, for writing beside a checkpoint of a preset model.
pub fn tiny_tokenizer_files() -> [(&'static str, &'static [u8]); 2] {
    [("tokenizer.json", TINY_TOKENIZER_JSON), ("tokenizer_config.json", TINY_TOKENIZER_CONFIG)]
}

impl Tokenizer {
    /// Loads a tokenizer folder. Only `tokenizer.json` is required.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Tokenizer> {
        let dir = dir.as_ref();
        let tokenizer_path = dir.join("tokenizer.json");
        let tokenizer_json =
            std::fs::read(&tokenizer_path).map_err(|e| Error::io(&tokenizer_path, e))?;
        let config = read_json_if_present(&dir.join("tokenizer_config.json"))?;
        let special_map = read_json_if_present(&dir.join("special_tokens_map.json"))?;
        let generation = read_json_if_present(&dir.join("generation_config.json"))?;
        let template_path = dir.join("chat_template.jinja");
        let template_file = match std::fs::read_to_string(&template_path) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(Error::io(&template_path, e)),
        };
        let inner = parse_tokenizer_json(&tokenizer_json, &tokenizer_path)?;
        let config_path = dir.join("tokenizer_config.json");
        Tokenizer::assemble(
            inner,
            tokenizer_path,
            Settings {
                config: config.as_ref().map(|c| (c, config_path.as_path())),
                special_map: special_map.as_ref(),
                generation: generation.as_ref(),
                template_file,
            },
        )
    }

    /// Loads a tokenizer from the contents of `tokenizer.json` and, optionally,
    /// `tokenizer_config.json` (for tokenizers embedded in the binary).
    pub fn from_bytes(
        tokenizer_json: &[u8],
        tokenizer_config_json: Option<&[u8]>,
    ) -> Result<Tokenizer> {
        let source = PathBuf::from("<embedded>");
        let inner = parse_tokenizer_json(tokenizer_json, &source)?;
        let config = tokenizer_config_json
            .map(|bytes| {
                serde_json::from_slice::<Value>(bytes).map_err(|e| {
                    Error::tokenizer(
                        &source,
                        format!("tokenizer_config.json is not valid JSON: {e}"),
                    )
                })
            })
            .transpose()?;
        Tokenizer::assemble(
            inner,
            source.clone(),
            Settings {
                config: config.as_ref().map(|c| (c, source.as_path())),
                special_map: None,
                generation: None,
                template_file: None,
            },
        )
    }

    fn assemble(
        inner: tokenizers::Tokenizer,
        source: PathBuf,
        settings: Settings<'_>,
    ) -> Result<Tokenizer> {
        let config = settings.config.map(|(c, _)| c);
        let special = |key: &str| -> Option<String> {
            config
                .and_then(|c| token_string(c.get(key)))
                .or_else(|| settings.special_map.and_then(|m| token_string(m.get(key))))
        };
        let bos_token = special("bos_token");
        let eos_token = special("eos_token");
        let pad_token = special("pad_token");
        let unk_token = special("unk_token");

        let eos_token_id = match &eos_token {
            Some(token) => Some(inner.token_to_id(token).ok_or_else(|| {
                Error::tokenizer(&source, format!("eos token {token:?} is not in the vocabulary"))
            })?),
            // Some model folders only name the eos by id, in generation_config.json.
            None => settings.generation.and_then(|g| match g.get("eos_token_id") {
                Some(Value::Number(n)) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
                Some(Value::Array(ids)) => {
                    ids.first().and_then(Value::as_u64).and_then(|n| u32::try_from(n).ok())
                }
                _ => None,
            }),
        };

        // transformers prefers a separate chat_template.jinja over the config's entry.
        let chat_template = match settings.template_file {
            Some(text) => Some(text),
            None => match settings.config {
                Some((c, path)) => template_from_config(c, path)?,
                None => None,
            },
        };

        let mut inner = inner;
        // Truncation and padding saved in tokenizer.json would silently cut or pad samples;
        // packing decides lengths.
        inner
            .with_truncation(None)
            .map_err(|e| Error::tokenizer(&source, format!("cannot disable truncation: {e}")))?;
        inner.with_padding(None);

        Ok(Tokenizer {
            inner,
            source,
            bos_token,
            eos_token,
            pad_token,
            unk_token,
            eos_token_id,
            chat_template,
        })
    }

    /// Encodes `text` without adding special tokens (chat templates write them); special tokens
    /// written in the text, such as `<|im_start|>`, are recognised.
    pub fn encode(&self, text: &str) -> Result<Encoding> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::tokenizer(&self.source, format!("cannot encode text: {e}")))?;
        Ok(Encoding { ids: encoding.get_ids().to_vec(), offsets: encoding.get_offsets().to_vec() })
    }

    /// Decodes ids back to text, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::tokenizer(&self.source, format!("cannot decode ids: {e}")))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Number of ids the tokenizer can produce, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    pub fn pad_token(&self) -> Option<&str> {
        self.pad_token.as_deref()
    }

    pub fn unk_token(&self) -> Option<&str> {
        self.unk_token.as_deref()
    }

    /// Id used to fill the end of packed rows: the pad token, else eos, else 0. Never trained.
    pub fn pad_token_id(&self) -> u32 {
        self.pad_token
            .as_deref()
            .and_then(|t| self.token_to_id(t))
            .or(self.eos_token_id)
            .unwrap_or(0)
    }

    /// The Jinja chat template source, if the tokenizer has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Where the tokenizer was loaded from (`<embedded>` for [`Tokenizer::from_bytes`]).
    pub fn source(&self) -> &Path {
        &self.source
    }
}

struct Settings<'a> {
    config: Option<(&'a Value, &'a Path)>,
    special_map: Option<&'a Value>,
    generation: Option<&'a Value>,
    template_file: Option<String>,
}

fn parse_tokenizer_json(bytes: &[u8], path: &Path) -> Result<tokenizers::Tokenizer> {
    tokenizers::Tokenizer::from_bytes(bytes)
        .map_err(|e| Error::tokenizer(path, format!("cannot load tokenizer: {e}")))
}

fn read_json_if_present(path: &Path) -> Result<Option<Value>> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(path, e)),
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| Error::tokenizer(path, format!("not valid JSON: {e}")))
}

/// A special token as transformers writes it: a plain string or an `AddedToken` object.
fn token_string(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Object(map) => map.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

/// `chat_template` is a string, or a list of `{name, template}` of which `default` is used.
fn template_from_config(config: &Value, path: &Path) -> Result<Option<String>> {
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(entries)) => {
            let mut names = Vec::new();
            for entry in entries {
                let name = entry.get("name").and_then(Value::as_str);
                let template = entry.get("template").and_then(Value::as_str);
                match (name, template) {
                    (Some("default"), Some(t)) => return Ok(Some(t.to_owned())),
                    (Some(n), Some(_)) => names.push(n.to_owned()),
                    _ => {
                        return Err(Error::tokenizer(
                            path,
                            "chat_template list entries must be {\"name\": string, \"template\": string}",
                        ));
                    }
                }
            }
            Err(Error::tokenizer(
                path,
                format!(
                    "chat_template list has no entry named \"default\" (found: {})",
                    names.join(", ")
                ),
            ))
        }
        Some(other) => Err(Error::tokenizer(
            path,
            format!(
                "chat_template must be a string or a list of {{name, template}}, found {other}"
            ),
        )),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn qwen3_dir() -> PathBuf {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../.cache/test-assets/tokenizer-qwen3/package/models");
        assert!(
            dir.join("tokenizer.json").is_file(),
            "missing {}: run scripts/fetch_test_assets.sh",
            dir.display()
        );
        dir
    }

    #[test]
    fn tiny_tokenizer_has_chatml_specials() {
        let tok = tiny_tokenizer().unwrap();
        assert_eq!(tok.vocab_size(), 2048);
        assert_eq!(tok.token_to_id("<|endoftext|>"), Some(0));
        assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
        assert_eq!(tok.eos_token(), Some("<|im_end|>"));
        assert_eq!(tok.eos_token_id(), Some(2));
        assert_eq!(tok.pad_token_id(), 0);
        assert_eq!(tok.bos_token(), None);
        assert!(tok.chat_template().unwrap().contains("<|im_start|>"));
        // Special tokens written in the text are single ids; nothing is added around the text.
        let enc = tok.encode("<|im_start|>user\nhi<|im_end|>").unwrap();
        assert_eq!(enc.ids.first(), Some(&1));
        assert_eq!(enc.ids.last(), Some(&2));
    }

    #[test]
    fn qwen3_round_trips_accents_emoji_and_chinese() {
        let tok = Tokenizer::from_dir(qwen3_dir()).unwrap();
        assert_eq!(tok.eos_token(), Some("<|im_end|>"));
        assert_eq!(tok.eos_token_id(), Some(151645));
        assert_eq!(tok.pad_token(), Some("<|endoftext|>"));
        assert_eq!(tok.bos_token(), None);
        assert!(tok.vocab_size() > 151_000);
        // Known ids from the Qwen tokenizer: "Hello" is 9707, " world" is 1879.
        assert_eq!(tok.encode("Hello world").unwrap().ids, vec![9707, 1879]);
        for text in [
            "Crème brûlée à Zürich",
            "Streaming layers 🚀🔥 done",
            "你好，世界！模型训练",
            "mixed: ñ 😀 中文 end",
        ] {
            let enc = tok.encode(text).unwrap();
            assert_eq!(enc.ids.len(), enc.offsets.len());
            assert_eq!(tok.decode(&enc.ids).unwrap(), text);
            // Offsets are byte ranges of the text, in order and covering it.
            assert_eq!(enc.offsets.first().map(|o| o.0), Some(0));
            assert_eq!(enc.offsets.last().map(|o| o.1), Some(text.len()));
            assert!(
                enc.offsets
                    .iter()
                    .all(|&(s, e)| s <= e && text.is_char_boundary(s) && text.is_char_boundary(e))
            );
        }
    }

    #[test]
    fn config_tokens_may_be_objects_and_template_a_named_list() {
        let config = br#"{
            "eos_token": {"content": "<|im_end|>", "lstrip": false},
            "pad_token": "<|endoftext|>",
            "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
        }"#;
        let tok = Tokenizer::from_bytes(TINY_TOKENIZER_JSON, Some(config)).unwrap();
        assert_eq!(tok.eos_token(), Some("<|im_end|>"));
        assert_eq!(tok.eos_token_id(), Some(2));
        assert_eq!(tok.chat_template(), Some("D"));

        let no_default = br#"{"chat_template": [{"name": "tool_use", "template": "T"}]}"#;
        let err = Tokenizer::from_bytes(TINY_TOKENIZER_JSON, Some(no_default)).unwrap_err();
        assert!(err.to_string().contains("no entry named \"default\" (found: tool_use)"), "{err}");

        let bad_eos = br#"{"eos_token": "<nope>"}"#;
        let err = Tokenizer::from_bytes(TINY_TOKENIZER_JSON, Some(bad_eos)).unwrap_err();
        assert!(err.to_string().contains("eos token \"<nope>\" is not in the vocabulary"), "{err}");
    }

    #[test]
    fn folder_files_fill_in_template_and_eos() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), TINY_TOKENIZER_JSON).unwrap();
        std::fs::write(dir.path().join("generation_config.json"), br#"{"eos_token_id": [2, 0]}"#)
            .unwrap();
        std::fs::write(dir.path().join("chat_template.jinja"), "{{ messages[0].content }}")
            .unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.eos_token_id(), Some(2));
        assert_eq!(tok.chat_template(), Some("{{ messages[0].content }}"));

        std::fs::write(
            dir.path().join("special_tokens_map.json"),
            br#"{"eos_token": {"content": "<|endoftext|>"}}"#,
        )
        .unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.eos_token_id(), Some(0));

        let err = Tokenizer::from_dir(dir.path().join("missing")).unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err}");
    }
}
