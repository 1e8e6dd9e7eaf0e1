//! Chat templates rendered as Hugging Face transformers renders them, and the character spans of
//! the assistant turns in the result (the loss mask).
//!
//! transformers compiles templates in a Jinja2 sandbox with `trim_blocks=True`,
//! `lstrip_blocks=True` and the loop-controls extension, and adds `raise_exception`,
//! `strftime_now` and a `tojson` filter that writes JSON as Python's `json.dumps` does. Templates
//! call Python string methods (`startswith`, `split`, `strip`...), which minijinja-contrib's
//! pycompat callback provides.

use std::ops::Range;
use std::path::PathBuf;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};

use super::formats::{Message, Role};
use super::tokenizer::Tokenizer;
use crate::error::{Error, Result};

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template with the special token strings it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where the template came from, for error messages.
    origin: PathBuf,
    /// `bos_token`, `eos_token`, ... as transformers passes them; absent tokens stay undefined.
    special_tokens: Vec<(&'static str, String)>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("origin", &self.origin).finish()
    }
}

/// The special token strings a template can use; `None` leaves the variable undefined.
#[derive(Debug, Clone, Default)]
pub struct SpecialTokens {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub pad_token: Option<String>,
    pub unk_token: Option<String>,
}

/// A rendered conversation and the byte ranges of its assistant turns, in order. Each range
/// covers the assistant's reply and the end-of-turn text the template writes after it (such as
/// `<|im_end|>\n`), which must be trained so the model learns to stop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    pub text: String,
    pub assistant_spans: Vec<Range<usize>>,
}

impl ChatTemplate {
    /// Compiles `source`; `origin` names it in errors (the tokenizer folder, usually).
    pub fn new(
        source: &str,
        special_tokens: SpecialTokens,
        origin: impl Into<PathBuf>,
    ) -> Result<ChatTemplate> {
        let origin = origin.into();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned()).map_err(|e| {
            Error::tokenizer(&origin, format!("chat template does not compile: {}", describe(&e)))
        })?;
        let eos_token = special_tokens.eos_token.clone();
        let special_tokens = [
            ("bos_token", special_tokens.bos_token),
            ("eos_token", special_tokens.eos_token),
            ("pad_token", special_tokens.pad_token),
            ("unk_token", special_tokens.unk_token),
        ]
        .into_iter()
        .filter_map(|(name, token)| token.map(|t| (name, t)))
        .collect();
        Ok(ChatTemplate { env, origin, special_tokens, eos_token })
    }

    /// The tokenizer's own template, or `None` when it has none.
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Result<Option<ChatTemplate>> {
        let Some(source) = tokenizer.chat_template() else { return Ok(None) };
        let tokens = SpecialTokens {
            bos_token: tokenizer.bos_token().map(str::to_owned),
            eos_token: tokenizer.eos_token().map(str::to_owned),
            pad_token: tokenizer.pad_token().map(str::to_owned),
            unk_token: tokenizer.unk_token().map(str::to_owned),
        };
        ChatTemplate::new(source, tokens, tokenizer.source()).map(Some)
    }

    /// Renders `messages` as `tokenizer.apply_chat_template(messages, tokenize=False,
    /// add_generation_prompt=...)` does.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| Error::tokenizer(&self.origin, describe(&e)))?;
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| minijinja::context! { role => m.role.as_str(), content => m.content.as_str() })
            .collect();
        let mut ctx: Vec<(&str, Value)> = vec![
            ("messages", Value::from(messages)),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            ("tools", Value::from(())),
            ("documents", Value::from(())),
        ];
        ctx.extend(self.special_tokens.iter().map(|(k, v)| (*k, Value::from(v.as_str()))));
        let ctx: Value = ctx.into_iter().collect();
        template.render(ctx).map_err(|e| {
            Error::tokenizer(&self.origin, format!("chat template failed: {}", describe(&e)))
        })
    }

    /// Renders a whole conversation and finds each assistant turn in it.
    ///
    /// Per turn `i`, the text the template adds for it is `render(messages[..=i], false)` minus
    /// `render(messages[..i], true)` (the generation prompt is the turn's header, not trained),
    /// provided both are prefixes of the full rendering and the difference holds the reply. Templates that rewrite earlier turns
    /// once later ones exist (Qwen3 drops the `<think>` block of all but the last turn) break
    /// that; for such turns the reply is located in the full rendering after the previous span
    /// and extended to the end-of-turn text ([`ChatTemplate::locate_turn`]).
    pub fn render_with_spans(&self, messages: &[Message]) -> Result<Rendered> {
        let text = self.render(messages, false)?;
        let mut spans: Vec<Range<usize>> = Vec::new();
        for (i, message) in messages.iter().enumerate() {
            if message.role != Role::Assistant {
                continue;
            }
            let cursor = spans.last().map_or(0, |s| s.end);
            let before = self.render(&messages[..i], true).ok();
            let upto = self.render(&messages[..=i], false).ok();
            let by_prefix = match (&before, &upto) {
                (Some(b), Some(u))
                    if b.len() >= cursor
                        && u.starts_with(b.as_str())
                        && text.starts_with(u.as_str())
                        && reply_forms(&message.content)
                            .iter()
                            .any(|n| u[b.len()..].contains(n)) =>
                {
                    Some(b.len()..u.len())
                }
                _ => None,
            };
            let span = match by_prefix {
                Some(span) => span,
                None => self.locate_turn(messages, i, &text, cursor, upto.as_deref())?,
            };
            spans.push(span);
        }
        Ok(Rendered { text, assistant_spans: spans })
    }

    /// Finds assistant turn `i` in the final rendering `text`, at or after `cursor`: its content
    /// (as written, trimmed, or without a leading `<think>` block), from the end of the
    /// generation prompt before it, to the end-of-turn text after it (what the template wrote
    /// after the content when the turn was last, or else the eos token).
    fn locate_turn(
        &self,
        messages: &[Message],
        i: usize,
        text: &str,
        cursor: usize,
        upto: Option<&str>,
    ) -> Result<Range<usize>> {
        let needles = reply_forms(messages.get(i).map_or("", |m| m.content.as_str()));
        // The turn's header is the generation prompt: the reply is searched after it (so text
        // quoted in an earlier user message is not mistaken for it) and training starts there.
        let generation_prompt =
            match (self.render(&messages[..i], true), self.render(&messages[..i], false)) {
                (Ok(with), Ok(without)) => {
                    with.strip_prefix(without.as_str()).unwrap_or("").to_owned()
                }
                _ => String::new(),
            };
        let rest = text.get(cursor..).unwrap_or("");
        let header_end = [generation_prompt.as_str(), generation_prompt.trim()]
            .iter()
            .filter(|g| !g.is_empty())
            .find_map(|g| rest.find(g).map(|p| cursor + p + g.len()));
        let search_from = header_end.unwrap_or(cursor);
        let found = needles.iter().find_map(|n| {
            text.get(search_from..).and_then(|r| r.find(n)).map(|at| (search_from + at, *n))
        });
        let Some((at, needle)) = found else {
            return Err(Error::tokenizer(
                &self.origin,
                format!("assistant message {} is not in the rendered chat template", i + 1),
            ));
        };
        let start = header_end.unwrap_or(at);

        let mut end = at + needle.len();
        let suffix =
            upto.and_then(|u| u.rfind(needle).map(|p| &u[p + needle.len()..])).unwrap_or("");
        let after = &text[end..];
        if !suffix.is_empty() && after.starts_with(suffix) {
            end += suffix.len();
        } else if let Some(eos) = self.eos_token.as_deref().filter(|e| !e.is_empty()) {
            let trimmed = after.trim_start();
            if trimmed.starts_with(eos) {
                end += after.len() - trimmed.len() + eos.len();
            }
        }
        Ok(start..end)
    }
}

/// How a reply may appear in a rendering: as written, trimmed, or without its `<think>` block;
/// never empty.
fn reply_forms(content: &str) -> Vec<&str> {
    let mut forms = vec![content, content.trim()];
    if let Some((_, after)) = content.rsplit_once("</think>") {
        forms.push(after.trim());
    }
    forms.retain(|f| !f.is_empty());
    forms
}

/// A minijinja error as one line: the template's own message first (what `raise_exception` was
/// given), then where it happened.
fn describe(e: &minijinja::Error) -> String {
    let mut out = match e.detail() {
        Some(detail) if e.kind() == ErrorKind::InvalidOperation => detail.to_owned(),
        Some(detail) => format!("{}: {detail}", e.kind()),
        None => e.kind().to_string(),
    };
    if let Some(line) = e.line() {
        out.push_str(&format!(" (template line {line})"));
    }
    out
}

fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent)`, so
/// `", "` and `": "` separators, no HTML escaping, non-ASCII written as is.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    // Serialized directly (not through serde_json::Value, whose maps sort their keys) so keys
    // keep the order the template or data gave them, as Python's dicts do.
    let json = &value;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                serde_json::ser::PrettyFormatter::with_indent(&pad),
            );
            serde::Serialize::serialize(json, &mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonFormatter);
            serde::Serialize::serialize(json, &mut ser)
        }
    };
    written
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let text = String::from_utf8(out)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from_safe_string(text))
}

/// serde_json's compact output with Python's default separators.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// `strftime_now(format)`: the current UTC time formatted with the common strftime codes
/// (templates use it to print today's date in the system prompt).
fn strftime_now(format: String) -> std::result::Result<Value, minijinja::Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime(&format, secs).map(Value::from)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] =
    ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

fn strftime(format: &str, unix_secs: u64) -> std::result::Result<String, minijinja::Error> {
    let days = unix_secs / 86_400;
    let secs_of_day = unix_secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = ((days + 3) % 7) as usize;
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS[(month - 1) as usize];
    let weekday_name = WEEKDAYS[weekday];

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        // `%-d` (glibc: no padding) is common in templates.
        let mut spec = chars.next();
        let unpadded = spec == Some('-');
        if unpadded {
            spec = chars.next();
        }
        let num =
            |v: u64, width: usize| if unpadded { v.to_string() } else { format!("{v:0width$}") };
        match spec {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&num(year % 100, 2)),
            Some('m') => out.push_str(&num(month, 2)),
            Some('d') => out.push_str(&num(day, 2)),
            Some('j') => out.push_str(&num(day_of_year, 3)),
            Some('H') => out.push_str(&num(secs_of_day / 3600, 2)),
            Some('M') => out.push_str(&num(secs_of_day / 60 % 60, 2)),
            Some('S') => out.push_str(&num(secs_of_day % 60, 2)),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(weekday_name),
            Some('a') => out.push_str(&weekday_name[..3]),
            Some('%') => out.push('%'),
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported format code %{}",
                        other.map(String::from).unwrap_or_default()
                    ),
                ));
            }
        }
    }
    Ok(out)
}

/// Howard Hinnant's days-to-civil algorithm (proleptic Gregorian calendar).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: u64, month: u64, day: u64) -> u64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
#[path = "template_tests.rs"]
pub(crate) mod tests;
