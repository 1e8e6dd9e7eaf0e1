//! Column mapping: a table's columns (CSV, TSV, Parquet, or a JSON record's keys) read as the
//! fields of a known format. `instruction=question,output=answer` reads the `question` column as
//! alpaca's `instruction` and `answer` as its `output`; once renamed, a record is detected and
//! checked like any other.
//!
//! Without an explicit mapping a table's header is mapped automatically when its names are the
//! usual ones of Hugging Face datasets (`question`/`answer`, `instruction`/`response`/`context`,
//! `problem`/`solution`, `prompt`/`response`).

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// The fields a column can be mapped to: those of every format [`super::Format`] reads.
pub const ROLES: [&str; 10] = [
    "instruction",
    "input",
    "output",
    "system",
    "history",
    "prompt",
    "completion",
    "text",
    "messages",
    "conversations",
];

/// Roles whose value is a list; a table cell holding them is JSON text, parsed when it is one.
const LIST_ROLES: [&str; 3] = ["messages", "conversations", "history"];

/// Role → column. Empty: the records' own keys are the fields.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct Columns(BTreeMap<String, String>);

impl Columns {
    /// `role=column` pairs separated by commas: `instruction=question,output=answer`. Roles are
    /// [`ROLES`]; a column may be any name, but not empty, and no role may be given twice.
    pub fn parse(text: &str) -> Result<Columns> {
        let mut map = BTreeMap::new();
        for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((role, column)) = pair.split_once('=') else {
                return Err(Error::invalid(format!(
                    "column mapping {pair:?} must be role=column, e.g. instruction=question"
                )));
            };
            Self::insert(&mut map, role.trim(), column.trim())?;
        }
        Ok(Columns(map))
    }

    /// From `(role, column)` pairs, with the checks of [`Self::parse`]; a pair with an empty
    /// column is left out (a form's "not mapped").
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<Columns> {
        let mut map = BTreeMap::new();
        for (role, column) in pairs {
            if !column.trim().is_empty() {
                Self::insert(&mut map, role.trim(), column.trim())?;
            }
        }
        Ok(Columns(map))
    }

    fn insert(map: &mut BTreeMap<String, String>, role: &str, column: &str) -> Result<()> {
        if !ROLES.contains(&role) {
            return Err(Error::invalid(format!(
                "unknown role {role:?} in the column mapping (roles: {})",
                ROLES.join(", ")
            )));
        }
        if column.is_empty() {
            return Err(Error::invalid(format!("role {role:?} is mapped to an empty column name")));
        }
        if map.insert(role.to_string(), column.to_string()).is_some() {
            return Err(Error::invalid(format!("role {role:?} is mapped twice")));
        }
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `(role, column)` pairs, by role.
    pub fn pairs(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(r, c)| (r.as_str(), c.as_str()))
    }

    /// As [`Self::parse`] reads it: `instruction=question,output=answer`.
    pub fn to_flag(&self) -> String {
        self.pairs().map(|(r, c)| format!("{r}={c}")).collect::<Vec<_>>().join(",")
    }

    /// The mapping a table with these column names most likely means, or none when its names
    /// are already a format's or nothing matches. Aliases are tried in order of how specific
    /// they are to a role.
    pub fn auto(columns: &[String]) -> Columns {
        let has = |name: &str| columns.iter().any(|c| c == name);
        if has("messages") || has("conversations") || (has("prompt") && has("completion")) {
            return Columns::default();
        }
        let first = |names: &[&'static str]| -> Option<&'static str> {
            names.iter().copied().find(|n| has(n))
        };
        let instruction = first(&["instruction", "question", "prompt", "query", "problem"]);
        let output = first(&["output", "response", "answer", "completion", "solution"]);
        let (Some(instruction), Some(output)) = (instruction, output) else {
            return Columns::default();
        };
        let mut map = BTreeMap::new();
        map.insert("instruction".to_string(), instruction.to_string());
        map.insert("output".to_string(), output.to_string());
        if let Some(input) = first(&["input", "context"]).filter(|c| *c != instruction) {
            map.insert("input".to_string(), input.to_string());
        }
        if let Some(system) = first(&["system", "system_prompt"]) {
            map.insert("system".to_string(), system.to_string());
        }
        // A column already named for its role needs no mapping.
        map.retain(|role, column| role != column);
        Columns(map)
    }

    /// The first mapped column not among `columns`, for an error before any row is read.
    pub fn missing<'c>(&'c self, columns: &[String]) -> Option<&'c str> {
        self.0.values().map(String::as_str).find(|c| !columns.iter().any(|have| have == c))
    }

    /// The record with its mapped columns renamed to their roles (the other keys stay), and a
    /// list role that holds JSON text parsed.
    pub fn apply(&self, mut record: Map<String, Value>) -> Map<String, Value> {
        if !self.0.is_empty() {
            let taken: Vec<(String, Option<Value>)> =
                self.0.iter().map(|(role, column)| (role.clone(), record.remove(column))).collect();
            for (role, value) in taken {
                match value {
                    Some(value) => record.insert(role, value),
                    // Mapped but absent here: the format's own check says the role is missing.
                    None => record.remove(&role),
                };
            }
        }
        for role in LIST_ROLES {
            if let Some(Value::String(text)) = record.get(role)
                && text.trim_start().starts_with('[')
                && let Ok(list @ Value::Array(_)) = serde_json::from_str::<Value>(text)
            {
                record.insert(role.to_string(), list);
            }
        }
        record
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn parses_pairs_and_refuses_unknown_roles_and_repeats() {
        let columns = Columns::parse("instruction=question, output = answer").unwrap();
        assert_eq!(columns.to_flag(), "instruction=question,output=answer");
        let err = Columns::parse("question=instruction").unwrap_err().to_string();
        assert!(err.contains("unknown role \"question\""), "{err}");
        let err = Columns::parse("output=a,output=b").unwrap_err().to_string();
        assert!(err.contains("mapped twice"), "{err}");
        let err = Columns::parse("output").unwrap_err().to_string();
        assert!(err.contains("role=column"), "{err}");
        let err = Columns::parse("output=").unwrap_err().to_string();
        assert!(err.contains("empty column"), "{err}");
        assert!(Columns::parse("").unwrap().is_empty());
    }

    #[test]
    fn automatic_mapping_knows_common_hugging_face_names() {
        let gsm8k = Columns::auto(&names(&["question", "answer"]));
        assert_eq!(gsm8k.to_flag(), "instruction=question,output=answer");
        let dolly = Columns::auto(&names(&["instruction", "context", "response", "category"]));
        assert_eq!(dolly.to_flag(), "input=context,output=response");
        assert!(Columns::auto(&names(&["instruction", "input", "output"])).is_empty());
        assert!(Columns::auto(&names(&["messages"])).is_empty());
        assert!(Columns::auto(&names(&["prompt", "completion"])).is_empty());
        assert!(Columns::auto(&names(&["a", "b"])).is_empty());
    }

    #[test]
    fn apply_renames_and_parses_json_lists() {
        let columns = Columns::parse("instruction=q,output=a,messages=chat").unwrap();
        let record = serde_json::json!({"q": "Hi?", "a": "Hello.", "id": 3,
            "chat": "[{\"role\": \"user\", \"content\": \"x\"}]"});
        let Value::Object(record) = record else { unreachable!() };
        let applied = columns.apply(record);
        assert_eq!(applied["instruction"], "Hi?");
        assert_eq!(applied["output"], "Hello.");
        assert_eq!(applied["id"], 3);
        assert!(applied["messages"].is_array());
        assert!(!applied.contains_key("q") && !applied.contains_key("chat"));
    }
}
