//! Dataset files to records: JSON Lines or a JSON array whose records are alpaca, ShareGPT,
//! OpenAI `messages`, prompt/completion or plain text, and LLaMA-Factory `dataset_info.json`
//! registries that name such files and map their columns.
//!
//! The format is decided by the first valid record; every other record is checked against it and
//! each bad one becomes a [`Problem`] with its line (JSON Lines) or record number (JSON array,
//! index + 1), so a lint shows them all at once.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    /// The role name chat templates expect.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: Role,
    pub content: String,
    /// An assistant message that is a training target (LLaMA-Factory's per-message
    /// `loss_weight` 1, the default); 0 keeps a reply as context only. Always true for the
    /// other roles, which are never trained (but with `train_on_prompt`, which trains all).
    pub trained: bool,
}

impl Message {
    pub fn new(role: Role, content: impl Into<String>) -> Message {
        Message { role, content: content.into(), trained: true }
    }
}

/// One training example, whatever file format it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// Messages ending with an assistant turn; a system message, if any, comes first.
    Conversation(Vec<Message>),
    PromptCompletion {
        prompt: String,
        completion: String,
    },
    /// Raw text, trained in full.
    Text(String),
}

/// A record with the line (or, for JSON arrays, the record number) it came from, 1-based.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub line: usize,
    pub record: Record,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `instruction`, `input`, `output`, optional `system` and `history` `[[q, a], ...]`.
    Alpaca,
    /// `conversations: [{from, value}]` with human/gpt/system (or user/assistant) roles.
    ShareGpt,
    /// OpenAI chat: `messages: [{role, content}]`.
    Messages,
    PromptCompletion,
    Text,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::Alpaca => "alpaca",
            Format::ShareGpt => "sharegpt",
            Format::Messages => "messages",
            Format::PromptCompletion => "prompt/completion",
            Format::Text => "text",
        }
    }
}

/// How records are laid out in the file; decides whether problems cite lines, records or rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    JsonLines,
    JsonArray,
    /// Comma-separated values with a header row.
    Csv,
    /// Tab-separated values with a header row.
    Tsv,
    Parquet,
    /// Plain text (`.txt`): one document per line, or per block of lines where blank lines
    /// separate blocks of several lines; each is a `text` record numbered by its first line.
    Text,
}

impl Layout {
    /// What a [`Problem`]'s number counts: `line`, `record` (of a JSON array) or `row` (of a
    /// Parquet file).
    pub fn unit(self) -> &'static str {
        match self {
            Layout::JsonLines | Layout::Csv | Layout::Tsv | Layout::Text => "line",
            Layout::JsonArray => "record",
            Layout::Parquet => "row",
        }
    }

    /// A table whose columns are named once for every row.
    pub fn is_tabular(self) -> bool {
        matches!(self, Layout::Csv | Layout::Tsv | Layout::Parquet)
    }

    /// JSON Lines or a JSON array: records as they are written, each an object.
    pub fn is_json(self) -> bool {
        matches!(self, Layout::JsonLines | Layout::JsonArray)
    }

    /// Every layout, in the order [`Self::extension`]s are tried.
    pub const ALL: [Layout; 6] = [
        Layout::JsonLines,
        Layout::JsonArray,
        Layout::Csv,
        Layout::Tsv,
        Layout::Parquet,
        Layout::Text,
    ];

    /// The usual file extension, which is also how a file's layout is recognised first.
    pub fn extension(self) -> &'static str {
        match self {
            Layout::JsonLines => "jsonl",
            Layout::JsonArray => "json",
            Layout::Csv => "csv",
            Layout::Tsv => "tsv",
            Layout::Parquet => "parquet",
            Layout::Text => "txt",
        }
    }

    /// `jsonl`, `json`, `csv`, `tsv`, `parquet` or `txt`, as [`Self::extension`] names them.
    pub fn name(self) -> &'static str {
        self.extension()
    }
}

/// A bad record: 1-based line (JSON Lines) or record number (JSON array) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub line: usize,
    pub message: String,
}

impl Problem {
    /// As a lint report shows it: `line 3: missing "output"`.
    pub fn display(&self, layout: Layout) -> String {
        format!("{} {}: {}", layout.unit(), self.line, self.message)
    }
}

/// A dataset file read and checked: its valid records and a problem for every bad one.
#[derive(Debug, Clone)]
pub struct Parsed {
    pub path: PathBuf,
    pub layout: Layout,
    /// `None` when no record is valid.
    pub format: Option<Format>,
    pub entries: Vec<Entry>,
    pub problems: Vec<Problem>,
}

impl Parsed {
    /// One line per problem, as a lint report shows them: `line 3: missing "output"`.
    pub fn problem_lines(&self) -> Vec<String> {
        self.problems.iter().map(|p| p.display(self.layout)).collect()
    }

    /// The valid records, or the first problem as an error when there is any (saying how many
    /// more there are): training does not silently skip bad records.
    pub fn into_entries(self) -> Result<Vec<Entry>> {
        if let Some(first) = self.problems.first() {
            let more = self.problems.len() - 1;
            let mut message = first.message.clone();
            if self.layout.unit() != "line" {
                message = format!("{} {}: {message}", self.layout.unit(), first.line);
            }
            if more > 0 {
                message.push_str(&format!(" (and {more} more bad records)"));
            }
            return Err(Error::DatasetRecord { path: self.path, line: first.line, message });
        }
        Ok(self.entries)
    }

    /// The valid records, the bad ones skipped; an error only when no record is valid.
    pub fn into_valid_entries(self) -> Result<Vec<Entry>> {
        if self.entries.is_empty() {
            let message = match self.problems.first() {
                Some(first) => format!(
                    "no record is valid, so none is left to train on once the {} bad ones are \
                     skipped (the first: {})",
                    self.problems.len(),
                    first.display(self.layout)
                ),
                None => "contains no records".into(),
            };
            return Err(Error::Dataset { path: self.path, message });
        }
        Ok(self.entries)
    }
}

/// Reads a JSON Lines file or a JSON array file and detects its format.
pub fn read_dataset(path: impl AsRef<Path>) -> Result<Parsed> {
    read_with(path.as_ref(), None)
}

/// Reads the dataset `name` of a LLaMA-Factory `dataset_info.json` registry; its `file_name` is
/// relative to the registry's folder.
pub fn read_registry_dataset(registry: impl AsRef<Path>, name: &str) -> Result<Parsed> {
    let (file, schema) = registry_file(registry.as_ref(), name)?;
    read_with(&file, Some(schema))
}

/// The file dataset `name` of `registry` names, and the schema its entry maps.
pub(super) fn registry_file(registry: &Path, name: &str) -> Result<(PathBuf, Schema)> {
    let info = read_registry(registry)?;
    let Some(entry) = info.get(name) else {
        let mut names: Vec<&str> = info.keys().map(String::as_str).collect();
        names.sort_unstable();
        return Err(Error::Dataset {
            path: registry.to_path_buf(),
            message: format!("no dataset named {name:?} (registry has: {})", names.join(", ")),
        });
    };
    let fail = |message: String| Error::Dataset {
        path: registry.to_path_buf(),
        message: format!("{name}: {message}"),
    };
    let entry = entry.as_object().ok_or_else(|| fail("entry must be an object".into()))?;
    let file_name = match entry.get("file_name") {
        Some(Value::String(f)) => f,
        Some(_) => return Err(fail("file_name must be a string".into())),
        None if ["hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name"]
            .iter()
            .any(|k| entry.contains_key(*k)) =>
        {
            return Err(fail(
                "only local datasets (file_name) are supported, not hub or script datasets".into(),
            ));
        }
        None => return Err(fail("missing file_name".into())),
    };
    refuse_unhonoured_keys(entry).map_err(fail)?;
    let schema = Schema::from_registry(entry).map_err(fail)?;
    let dir = registry.parent().unwrap_or(Path::new("."));
    let file = dir.join(file_name);
    if file.is_dir() {
        return Err(fail(format!(
            "{} is a folder; only single-file datasets are supported",
            file.display()
        )));
    }
    Ok((file, schema))
}

/// Refuses, by name, a key of a LLaMA-Factory registry entry that reading its local file whole
/// would not honour, or that LLaMA-Factory does not know: ignored, it would train on other data
/// than the entry says.
fn refuse_unhonoured_keys(entry: &Map<String, Value>) -> std::result::Result<(), String> {
    for (key, value) in entry {
        match key.as_str() {
            "file_name" | "formatting" | "ranking" | "columns" | "tags" => {}
            // Where LLaMA-Factory would fetch the dataset instead; the local file is what was
            // given here.
            "hf_hub_url" | "ms_hub_url" | "om_hub_url" | "script_url" | "cloud_file_name" => {}
            // A local JSON, CSV, Parquet or text file has one split, `train`.
            "split" if value.as_str() == Some("train") => {}
            "split" => {
                return Err(format!(
                    "split {value}: a local file has only the train split; give that split's \
                     own file"
                ));
            }
            "subset" | "folder" => {
                return Err(format!(
                    "{key} {value}: names part of a hub dataset, but a local file is read whole"
                ));
            }
            "num_samples" => {
                return Err(format!(
                    "num_samples {value}: sampling records is not supported; give a file of the \
                     records to train on"
                ));
            }
            other => {
                return Err(format!(
                    "unknown key {other:?} (LLaMA-Factory's entries have file_name, formatting, \
                     ranking, columns, tags, split, subset, folder, num_samples and hub urls)"
                ));
            }
        }
    }
    Ok(())
}

/// A `dataset_info.json` registry reduced to the one entry an upload of one data file uses,
/// that entry's `file_name` replaced by `stored_as` (the file's name where it is kept beside the
/// registry). The entry is `name` when given, else the one whose `file_name` is the uploaded
/// file's own name (`file_name`, directories ignored), else the only entry. Returns the new
/// registry's JSON and the entry's name; the entry's mapping is checked when it is read.
pub fn single_dataset_registry(
    registry: &str,
    name: Option<&str>,
    file_name: Option<&str>,
    stored_as: &str,
) -> Result<(String, String)> {
    let info: Map<String, Value> = match serde_json::from_str(registry) {
        Ok(Value::Object(map)) => map,
        Ok(_) => return Err(Error::invalid("dataset_info.json must be a JSON object")),
        Err(e) => return Err(Error::invalid(format!("dataset_info.json is not valid JSON: {e}"))),
    };
    let mut names: Vec<&str> = info.keys().map(String::as_str).collect();
    names.sort_unstable();
    let listed = names.join(", ");
    let base = |path: &str| path.rsplit(['/', '\\']).next().unwrap_or(path).to_string();
    let chosen = match name.map(str::trim).filter(|n| !n.is_empty()) {
        Some(name) if info.contains_key(name) => name.to_string(),
        Some(name) => {
            return Err(Error::invalid(format!(
                "dataset_info.json has no dataset named {name:?} (it has: {listed})"
            )));
        }
        None => {
            let uploaded = file_name.map(base);
            let matching: Vec<&str> = names
                .iter()
                .copied()
                .filter(|n| {
                    let entry_file = info[*n].get("file_name").and_then(Value::as_str);
                    uploaded.is_some() && entry_file.map(base) == uploaded
                })
                .collect();
            match (matching.as_slice(), names.as_slice()) {
                ([one], _) | ([], [one]) => (*one).to_string(),
                ([], []) => return Err(Error::invalid("dataset_info.json names no dataset")),
                _ => {
                    return Err(Error::invalid(format!(
                        "dataset_info.json names several datasets; name the dataset to use \
                         (it has: {listed})"
                    )));
                }
            }
        }
    };
    let mut entry = info[&chosen].clone();
    if let Some(object) = entry.as_object_mut()
        && object.contains_key("file_name")
    {
        object.insert("file_name".into(), Value::String(stored_as.to_string()));
    }
    let single = Value::Object(Map::from_iter([(chosen.clone(), entry)]));
    Ok((single.to_string(), chosen))
}

/// Dataset names in a `dataset_info.json` registry, sorted.
pub fn registry_names(registry: impl AsRef<Path>) -> Result<Vec<String>> {
    let mut names: Vec<String> = read_registry(registry.as_ref())?.keys().cloned().collect();
    names.sort_unstable();
    Ok(names)
}

fn read_registry(path: &Path) -> Result<Map<String, Value>> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    match serde_json::from_slice(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(Error::Dataset {
            path: path.to_path_buf(),
            message: "registry must be a JSON object".into(),
        }),
        Err(e) => Err(Error::Dataset {
            path: path.to_path_buf(),
            message: format!("registry is not valid JSON: {e}"),
        }),
    }
}

/// A record's line (or record number) and its JSON value, or why it is not JSON.
type RawRecord = (usize, Result<Value, String>);

/// Splits the file into records.
fn split_records(path: &Path, bytes: &[u8]) -> Result<(Layout, Vec<RawRecord>)> {
    let bytes = bytes.strip_prefix("\u{feff}".as_bytes()).unwrap_or(bytes);
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    if first == Some(&b'[') {
        let values: Vec<Value> = serde_json::from_slice(bytes).map_err(|e| Error::Dataset {
            path: path.to_path_buf(),
            message: format!("file starts with '[' but is not a valid JSON array: {e}"),
        })?;
        let items = values.into_iter().enumerate().map(|(i, v)| (i + 1, Ok(v))).collect();
        return Ok((Layout::JsonArray, items));
    }
    let mut items = Vec::new();
    for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let parsed = std::str::from_utf8(line)
            .map_err(|e| format!("not valid UTF-8: {e}"))
            .and_then(|text| {
                serde_json::from_str::<Value>(text).map_err(|e| format!("not valid JSON: {e}"))
            });
        items.push((i + 1, parsed));
    }
    Ok((Layout::JsonLines, items))
}

fn read_with(path: &Path, schema: Option<Schema>) -> Result<Parsed> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let (layout, items) = split_records(path, &bytes)?;
    if items.is_empty() {
        return Err(no_records(path));
    }
    // A registry states the format; otherwise it is detected, and a record of another format is
    // worth pointing out as such.
    let detected = schema.is_none();
    let schema = schema.or_else(|| items.iter().find_map(|(_, value)| schema_of(value)));
    let mut parsed = Parsed {
        path: path.to_path_buf(),
        layout,
        format: schema.as_ref().map(|s| s.format),
        entries: Vec::with_capacity(items.len()),
        problems: Vec::new(),
    };
    for (line, value) in items {
        match check_record(schema.as_ref(), detected, value) {
            Ok(record) => parsed.entries.push(Entry { line, record }),
            Err(message) => parsed.problems.push(Problem { line, message }),
        }
    }
    Ok(parsed)
}

pub(super) fn no_records(path: &Path) -> Error {
    Error::Dataset { path: path.to_path_buf(), message: "contains no records".into() }
}

/// The schema `value` is a valid record of, if any: the first such record decides a file's
/// format.
pub(super) fn schema_of(value: &Result<Value, String>) -> Option<Schema> {
    let object = value.as_ref().ok()?.as_object()?;
    let schema = Schema::detect(object)?;
    schema.parse(object).ok().map(|_| schema)
}

/// One record checked against the dataset's schema (`None` when no record is valid);
/// `detected` says the schema came from the file, not a registry, so a record of another
/// format is worth pointing out as such.
pub(super) fn check_record(
    schema: Option<&Schema>,
    detected: bool,
    value: Result<Value, String>,
) -> std::result::Result<Record, String> {
    let value = value?;
    let Value::Object(object) = value else {
        return Err(format!("record must be a JSON object, found {}", kind(&value)));
    };
    // Checked before the format, whose own complaint (a missing "output", a conversation that
    // ends with the user) would hide what the record really is.
    if let Some(reason) = untrainable(&object) {
        return Err(reason);
    }
    match schema {
        Some(schema) => schema.parse(&object).map_err(|message| {
            match Schema::detect(&object).map(|s| s.format) {
                Some(own) if detected && own != schema.format => format!(
                    "{message} (this looks like a {} record, but the dataset is {}, \
                     decided by its first valid record)",
                    own.name(),
                    schema.format.name()
                ),
                _ => message,
            }
        }),
        None => Err(unrecognised(&object)),
    }
}

/// Fields of LLaMA-Factory's other dataset kinds, which read as one of the supported formats
/// but mean something supervised fine-tuning must not train on.
const PREFERENCE_FIELDS: [&str; 2] = ["chosen", "rejected"];
const KTO_FIELD: &str = "kto_tag";
const MEDIA_FIELDS: [&str; 3] = ["images", "videos", "audios"];

/// Why a record of another training method or of media cannot be trained on, if it is one:
/// preference pairs would train a single answer or none, a `kto_tag: false` example would be
/// learned as a good answer, and media placeholders (`<image>`) would be learned as text.
fn untrainable(object: &Map<String, Value>) -> Option<String> {
    if let Some(field) = PREFERENCE_FIELDS.iter().find(|f| object.contains_key(**f)) {
        return Some(format!(
            "\"{field}\": this is preference data (chosen/rejected pairs, as for DPO), which \
             supervised fine-tuning cannot train on"
        ));
    }
    if object.contains_key(KTO_FIELD) {
        return Some(format!(
            "\"{KTO_FIELD}\": this is KTO-labelled data, whose false examples must not be \
             learned as targets; supervised fine-tuning cannot train on it"
        ));
    }
    // An empty list (or null) carries no media: mixed datasets give text-only records one.
    let has_media = |value: &Value| match value {
        Value::Null => false,
        Value::Array(items) => !items.is_empty(),
        Value::String(s) => !s.trim().is_empty(),
        _ => true,
    };
    if let Some(field) = MEDIA_FIELDS.iter().find(|f| object.get(**f).is_some_and(has_media)) {
        return Some(format!(
            "\"{field}\": multimodal records are not supported; the models trained here read \
             text only"
        ));
    }
    None
}

fn unrecognised(object: &Map<String, Value>) -> String {
    let keys: Vec<&str> = object.keys().map(String::as_str).collect();
    if Schema::detect(object).is_some() {
        return "invalid record and no valid record to decide the dataset's format".into();
    }
    format!(
        "unrecognised record with keys [{}]: expected alpaca (instruction, output), sharegpt \
         (conversations), messages, prompt/completion or text",
        keys.join(", ")
    )
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Where a format's fields are and what its role names mean.
#[derive(Debug, Clone)]
pub(super) struct Schema {
    pub(super) format: Format,
    fields: Fields,
}

#[derive(Debug, Clone)]
enum Fields {
    Alpaca {
        prompt: String,
        query: String,
        response: String,
        history: String,
        system: String,
    },
    Conversation {
        messages: String,
        system: String,
        role_tag: String,
        content_tag: String,
        roles: Vec<(String, Role)>,
    },
    PromptCompletion,
    /// Raw text in `text`, followed by `query` when a registry maps one (LLaMA-Factory joins a
    /// prompt and its query with a newline).
    Text {
        text: String,
        query: Option<String>,
    },
}

impl Schema {
    fn detect(object: &Map<String, Value>) -> Option<Schema> {
        if object.contains_key("messages") {
            Some(Schema::messages())
        } else if object.contains_key("conversations") {
            Some(Schema::sharegpt(Map::new(), Map::new()))
        } else if object.contains_key("instruction") {
            Some(Schema::alpaca(Map::new()))
        } else if object.contains_key("prompt") && object.contains_key("completion") {
            Some(Schema { format: Format::PromptCompletion, fields: Fields::PromptCompletion })
        } else if object.contains_key("text") {
            Some(Schema::text("text", None))
        } else {
            None
        }
    }

    fn messages() -> Schema {
        let roles =
            [("system", Role::System), ("user", Role::User), ("assistant", Role::Assistant)];
        Schema {
            format: Format::Messages,
            fields: Fields::Conversation {
                messages: "messages".into(),
                system: "system".into(),
                role_tag: "role".into(),
                content_tag: "content".into(),
                roles: roles.iter().map(|(n, r)| (n.to_string(), *r)).collect(),
            },
        }
    }

    /// ShareGPT with LLaMA-Factory's defaults; without explicit tags the OpenAI role names are
    /// accepted too, as many ShareGPT exports use them.
    fn sharegpt(columns: Map<String, Value>, tags: Map<String, Value>) -> Schema {
        let col = |key: &str, default: &str| column(&columns, key, default);
        let tag = |key: &str, default: &str| column(&tags, key, default);
        let mut roles = vec![
            (tag("user_tag", "human"), Role::User),
            (tag("assistant_tag", "gpt"), Role::Assistant),
            (tag("system_tag", "system"), Role::System),
        ];
        if tags.is_empty() {
            roles.push(("user".into(), Role::User));
            roles.push(("assistant".into(), Role::Assistant));
        }
        Schema {
            format: Format::ShareGpt,
            fields: Fields::Conversation {
                messages: col("messages", "conversations"),
                system: col("system", "system"),
                role_tag: tag("role_tag", "from"),
                content_tag: tag("content_tag", "value"),
                roles,
            },
        }
    }

    fn text(text: &str, query: Option<String>) -> Schema {
        Schema { format: Format::Text, fields: Fields::Text { text: text.into(), query } }
    }

    fn alpaca(columns: Map<String, Value>) -> Schema {
        let col = |key: &str, default: &str| column(&columns, key, default);
        Schema {
            format: Format::Alpaca,
            fields: Fields::Alpaca {
                prompt: col("prompt", "instruction"),
                query: col("query", "input"),
                response: col("response", "output"),
                history: col("history", "history"),
                system: col("system", "system"),
            },
        }
    }

    fn from_registry(entry: &Map<String, Value>) -> std::result::Result<Schema, String> {
        let object = |key: &str| match entry.get(key) {
            None | Some(Value::Null) => Ok(Map::new()),
            Some(Value::Object(map)) => Ok(map.clone()),
            Some(_) => Err(format!("{key} must be an object")),
        };
        if entry.get("ranking").is_some_and(|r| r.as_bool() == Some(true)) {
            return Err("ranking: this is preference data (chosen/rejected pairs, as for DPO), \
                        which supervised fine-tuning cannot train on"
                .into());
        }
        let (columns, tags) = (object("columns")?, object("tags")?);
        // A mapped column of another dataset kind would be read under a name the record check
        // does not know, so such an entry is refused as a whole.
        if let Some(key) = columns.keys().find(|k| {
            PREFERENCE_FIELDS.contains(&k.as_str())
                || k.as_str() == KTO_FIELD
                || MEDIA_FIELDS.contains(&k.as_str())
        }) {
            let what = if MEDIA_FIELDS.contains(&key.as_str()) {
                "multimodal datasets are not supported; the models trained here read text only"
            } else if key == KTO_FIELD {
                "KTO-labelled data, whose false examples must not be learned as targets, is not \
                 supported"
            } else {
                "preference data (chosen/rejected pairs, as for DPO) is not supported"
            };
            return Err(format!("columns map {key:?}: {what}"));
        }
        for (key, value) in columns.iter().chain(tags.iter()) {
            if !value.is_string() && !value.is_null() {
                return Err(format!("column or tag {key:?} must be a string"));
            }
        }
        let named = |key: &str| columns.get(key).and_then(Value::as_str).map(str::to_string);
        match entry.get("formatting").map(|f| f.as_str()) {
            // LLaMA-Factory leaves a column the mapping does not name unset: a prompt with no
            // response is pretraining text (its README's `columns: {prompt: text}`).
            None | Some(Some("alpaca"))
                if entry.contains_key("columns") && named("response").is_none() =>
            {
                match named("prompt") {
                    Some(prompt) => Ok(Schema::text(&prompt, named("query"))),
                    None => Err("columns map neither \"prompt\" nor \"response\": \
                                 nothing to train on"
                        .into()),
                }
            }
            None | Some(Some("alpaca")) => Ok(Schema::alpaca(columns)),
            Some(Some("sharegpt")) => Ok(Schema::sharegpt(columns, tags)),
            Some(Some(other)) => {
                Err(format!("formatting {other:?} is not supported (alpaca or sharegpt)"))
            }
            Some(None) => Err("formatting must be a string".into()),
        }
    }

    fn parse(&self, object: &Map<String, Value>) -> std::result::Result<Record, String> {
        match &self.fields {
            Fields::Alpaca { prompt, query, response, history, system } => {
                let instruction = required_string(object, prompt)?;
                let input = optional_string(object, query)?.unwrap_or("");
                let output = required_string(object, response)?;
                let mut messages = Vec::new();
                if let Some(system) =
                    optional_string(object, system)?.filter(|s| !s.trim().is_empty())
                {
                    messages.push(Message::new(Role::System, system));
                }
                for (i, pair) in optional_array(object, history)?.iter().enumerate() {
                    let pair = pair.as_array().filter(|p| p.len() == 2);
                    match pair.map(|p| (&p[0], &p[1])) {
                        Some((Value::String(q), Value::String(a)))
                            if !q.trim().is_empty() && !a.trim().is_empty() =>
                        {
                            messages.push(Message::new(Role::User, q.as_str()));
                            messages.push(Message::new(Role::Assistant, a.as_str()));
                        }
                        _ => {
                            return Err(format!(
                                "\"{history}\" item {} must be a pair of non-empty strings [query, response]",
                                i + 1
                            ));
                        }
                    }
                }
                let user = match (instruction.trim().is_empty(), input.trim().is_empty()) {
                    (true, true) => {
                        return Err(format!("\"{prompt}\" and \"{query}\" are both empty"));
                    }
                    (false, true) => instruction.to_owned(),
                    (true, false) => input.to_owned(),
                    (false, false) => format!("{instruction}\n{input}"),
                };
                if output.trim().is_empty() {
                    return Err(format!("\"{response}\" is empty"));
                }
                messages.push(Message::new(Role::User, user));
                messages.push(Message::new(Role::Assistant, output));
                Ok(Record::Conversation(messages))
            }
            Fields::Conversation { messages: key, system, role_tag, content_tag, roles } => {
                let list = match object.get(key.as_str()) {
                    Some(Value::Array(list)) => list,
                    Some(other) => {
                        return Err(format!("\"{key}\" must be an array, found {}", kind(other)));
                    }
                    None => return Err(format!("missing \"{key}\"")),
                };
                if list.is_empty() {
                    return Err(format!("\"{key}\" is empty"));
                }
                let mut messages = Vec::with_capacity(list.len() + 1);
                if let Some(system) =
                    optional_string(object, system)?.filter(|s| !s.trim().is_empty())
                {
                    messages.push(Message::new(Role::System, system));
                }
                for (i, item) in list.iter().enumerate() {
                    let n = i + 1;
                    let Some(item) = item.as_object() else {
                        return Err(format!("message {n} must be an object, found {}", kind(item)));
                    };
                    let role_name = match item.get(role_tag.as_str()) {
                        Some(Value::String(r)) => r,
                        Some(other) => {
                            return Err(format!(
                                "message {n}: \"{role_tag}\" must be a string, found {}",
                                kind(other)
                            ));
                        }
                        None => return Err(format!("message {n}: missing \"{role_tag}\"")),
                    };
                    let Some(role) =
                        roles.iter().find(|(name, _)| name == role_name).map(|(_, r)| *r)
                    else {
                        let known: Vec<&str> = roles.iter().map(|(n, _)| n.as_str()).collect();
                        return Err(format!(
                            "message {n}: unknown role {role_name:?} (expected one of {})",
                            known.join(", ")
                        ));
                    };
                    let content = message_content(item.get(content_tag.as_str()))
                        .map_err(|e| format!("message {n}: \"{content_tag}\" {e}"))?;
                    if content.trim().is_empty() {
                        if role == Role::System {
                            continue;
                        }
                        return Err(format!("message {n} ({}) is empty", role.as_str()));
                    }
                    let trained = loss_weight(item.get("loss_weight"), role)
                        .map_err(|e| format!("message {n}: \"loss_weight\" {e}"))?;
                    messages.push(Message { trained, ..Message::new(role, content) });
                }
                match messages.last().map(|m| m.role) {
                    Some(Role::Assistant) => Ok(Record::Conversation(messages)),
                    Some(role) => Err(format!(
                        "conversation ends with a {} message; the last message must be the assistant's",
                        role.as_str()
                    )),
                    None => Err(format!("\"{key}\" has no non-empty message")),
                }
            }
            Fields::PromptCompletion => {
                let prompt = required_string(object, "prompt")?;
                let completion = required_string(object, "completion")?;
                if completion.trim().is_empty() {
                    return Err("\"completion\" is empty".into());
                }
                Ok(Record::PromptCompletion {
                    prompt: prompt.to_owned(),
                    completion: completion.to_owned(),
                })
            }
            Fields::Text { text, query } => {
                let mut document = required_string(object, text)?.to_owned();
                if let Some(query) = query
                    && let Some(more) = optional_string(object, query)?.filter(|q| !q.is_empty())
                {
                    document = format!("{document}\n{more}");
                }
                if document.trim().is_empty() {
                    return Err(format!("\"{text}\" is empty"));
                }
                Ok(Record::Text(document))
            }
        }
    }
}

fn column(map: &Map<String, Value>, key: &str, default: &str) -> String {
    map.get(key).and_then(Value::as_str).unwrap_or(default).to_owned()
}

fn required_string<'a>(
    object: &'a Map<String, Value>,
    key: &str,
) -> std::result::Result<&'a str, String> {
    match object.get(key) {
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(format!("\"{key}\" must be a string, found {}", kind(other))),
        None => Err(format!("missing \"{key}\"")),
    }
}

fn optional_string<'a>(
    object: &'a Map<String, Value>,
    key: &str,
) -> std::result::Result<Option<&'a str>, String> {
    match object.get(key) {
        Some(Value::String(s)) => Ok(Some(s)),
        None | Some(Value::Null) => Ok(None),
        Some(other) => Err(format!("\"{key}\" must be a string, found {}", kind(other))),
    }
}

fn optional_array<'a>(
    object: &'a Map<String, Value>,
    key: &str,
) -> std::result::Result<&'a [Value], String> {
    match object.get(key) {
        Some(Value::Array(a)) => Ok(a),
        None | Some(Value::Null) => Ok(&[]),
        Some(other) => Err(format!("\"{key}\" must be an array, found {}", kind(other))),
    }
}

/// A message's content: a string, or OpenAI's list of parts of which only text is supported.
/// Whether a message with LLaMA-Factory's `loss_weight` is trained: 1 (an assistant
/// message's default) or 0 (context only). Other weights would scale the message's loss,
/// which training here does not do, so they are refused rather than rounded.
fn loss_weight(value: Option<&Value>, role: Role) -> std::result::Result<bool, String> {
    let assistant = role == Role::Assistant;
    match value.map(|v| (v, v.as_f64())) {
        None | Some((Value::Null, _)) => Ok(true),
        // Only an assistant message's flag means anything; the others keep the default.
        Some((_, Some(0.0))) => Ok(!assistant),
        Some((_, Some(w))) if w == 1.0 && assistant => Ok(true),
        Some((_, Some(_))) if !assistant => Err(format!(
            "must be 0 on a {} message: only assistant messages are trained",
            role.as_str()
        )),
        Some((v, Some(_))) => {
            Err(format!("{v}: only 0 (context) or 1 (trained) is supported, not a weighted loss"))
        }
        Some((v, None)) => Err(format!("must be a number, found {}", kind(v))),
    }
}

/// A message's text: a string, or a list of text parts (OpenAI's `{"type": "text", "text"}`
/// or LLaMA-Factory v1's `{"type": "text", "value"}`), joined.
fn message_content(value: Option<&Value>) -> std::result::Result<String, String> {
    match value {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                let kind = part.get("type").and_then(Value::as_str);
                let value = part.get("text").or_else(|| part.get("value")).and_then(Value::as_str);
                match (kind, value) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (Some("reasoning"), _) => {
                        return Err("has a reasoning part, which is not supported yet".into());
                    }
                    (Some("tool_call"), _) => {
                        return Err("has a tool call, which is not supported yet".into());
                    }
                    (Some(media), _) if media.ends_with("_url") || media.starts_with("image") => {
                        return Err(format!(
                            "has a part of type {media}: multimodal records are not supported; \
                             the models trained here read text only"
                        ));
                    }
                    _ => {
                        return Err("parts must be {\"type\": \"text\", \"text\" or \"value\": \
                                    string}"
                            .into());
                    }
                }
            }
            Ok(text)
        }
        Some(other) => Err(format!("must be a string, found {}", kind(other))),
        None => Err("is missing".into()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
#[path = "formats_tests.rs"]
mod tests;
