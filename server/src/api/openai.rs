//! `/v1/...`: an OpenAI-compatible endpoint, so OpenAI's clients and tools that speak its API
//! (lm-evaluation-harness's `local-completions`) use the appliance's models:
//!
//! - `GET /v1/models`, `GET /v1/models/{id}`: what the caller may read.
//! - `POST /v1/completions`: `prompt` (a string, a list of strings, a list of token ids or a
//!   list of such lists: one choice per prompt, in order), `max_tokens` (default 16; 0 with
//!   `echo` scores a prompt without generating), `echo`, `logprobs` (0 to 5), `temperature`,
//!   `top_p`, `seed`, `stop`, `n` (1), `stream` (one prompt).
//! - `POST /v1/chat/completions`: `messages` through the model's chat template, `stream`,
//!   `stop`, `max_tokens`/`max_completion_tokens` (default: what fits, at most
//!   `serving::DEFAULT_CHAT_TOKENS`), `temperature`, `top_p`, `seed`, `logprobs` with
//!   `top_logprobs` (not with `stream`).
//!
//! Model ids: a checkpoint is `job-<id>/<checkpoint>` (`job-7/final`, `job-7/checkpoint-200`),
//! readable by the job's owner and the admins, as everywhere in the API; a model on the
//! appliance has the id jobs name it by (`local:<folder>` for a folder under `models/`, GGUF
//! imports included; `hf:Org/Name@revision` for a pulled snapshot), readable by every user.
//! A model the caller may not read answers exactly like one that does not exist: 404
//! `model_not_found` with `param: "model"`.
//!
//! Only API tokens (`Authorization: Bearer sluice_...`) are accepted here, never the session
//! cookie, so no request here can be forged by another site and the CSRF guard lets `/v1/`
//! pass. Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with
//! `param` naming the field at fault. Unknown fields are ignored (clients send many); a known
//! field of the wrong type or out of range is a 400 naming it; features not served (`n` other
//! than 1, penalties, tools) are a 400 naming the field rather than silently ignored.
//!
//! Training first: the work runs through `crate::serving`, whose rule is try-it's. A request
//! never takes a device a job trains on, is starting on, or a queued job waits for; when every
//! device it could use is so taken (or too many requests wait for the one model slot) it
//! answers 503 with `Retry-After` (the training job's estimated time left, within 10 s and 10
//! min), and a running request stops with the same 503 as soon as a job is queued for its
//! device.

use std::convert::Infallible;
use std::path::PathBuf;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};
use sluice_engine::data::{Message, Role};
use sluice_engine::train::ModelSource;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tracing::error;

use crate::AppState;
use crate::auth::tokens;
use crate::error::ApiError;
use crate::models;
use crate::serving::{
    self, Answer, ChatAsk, CompletionAsk, Decode, Finish, Piece, Prompt, Sampling, StreamAsk,
    Streaming, TokenLogprob,
};
use crate::store::users::User;

/// The most prompts one completion request may carry.
pub const MAX_PROMPTS: usize = 128;
/// The most messages one chat request may carry.
pub const MAX_MESSAGES: usize = 256;
/// The most text one request's prompts or messages may hold in all.
pub const MAX_TEXT_BYTES: usize = 1 << 20;
/// The most stop sequences (OpenAI's limit).
pub const MAX_STOPS: usize = 4;
/// The most alternatives per token: `logprobs` of a completion, `top_logprobs` of a chat.
pub const MAX_LOGPROBS: usize = 5;
pub const MAX_TOP_LOGPROBS: usize = 20;

pub(crate) fn router() -> axum::Router<AppState> {
    axum::Router::new()
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*id}", get(get_model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .method_not_allowed_fallback(|method: axum::http::Method| async move {
            OpenAiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("{method} is not allowed here"),
                None,
            )
        })
}

/// An error in OpenAI's shape, with its status (and `Retry-After` for 503).
#[derive(Debug)]
pub(crate) struct OpenAiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    pub retry_after_s: Option<u64>,
}

impl OpenAiError {
    pub fn new(status: StatusCode, message: impl Into<String>, param: Option<&str>) -> Self {
        OpenAiError {
            status,
            message: message.into(),
            param: param.map(str::to_string),
            code: None,
            retry_after_s: None,
        }
    }

    /// 400 naming the field at fault.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        OpenAiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.into()),
            code: Some("invalid_value"),
            retry_after_s: None,
        }
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        OpenAiError {
            code: Some("invalid_api_key"),
            ..OpenAiError::new(StatusCode::UNAUTHORIZED, message, None)
        }
    }

    /// 404 for a model that does not exist or that the caller may not read: the same answer.
    pub fn model_not_found(id: &str) -> Self {
        OpenAiError {
            code: Some("model_not_found"),
            ..OpenAiError::new(
                StatusCode::NOT_FOUND,
                format!("the model {id:?} does not exist or you do not have access to it"),
                Some("model"),
            )
        }
    }

    pub fn internal(err: impl std::fmt::Display) -> Self {
        error!("internal error under /v1/: {err:#}");
        OpenAiError::new(StatusCode::INTERNAL_SERVER_ERROR, INTERNAL, None)
    }

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// What a client sees of a 5xx.
const INTERNAL: &str = "internal server error; the server log has the details";

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        let body = Json(self.body());
        match self.retry_after_s {
            Some(s) => (self.status, [(header::RETRY_AFTER, s.to_string())], body).into_response(),
            None => (self.status, body).into_response(),
        }
    }
}

impl From<ApiError> for OpenAiError {
    fn from(err: ApiError) -> Self {
        match err {
            ApiError::Internal(err) => OpenAiError::internal(err),
            other => {
                let status = other.status();
                let message = match other {
                    ApiError::BadRequest(m)
                    | ApiError::Unauthorized(m)
                    | ApiError::Forbidden(m)
                    | ApiError::NotFound(m)
                    | ApiError::Conflict(m)
                    | ApiError::TooLarge(m)
                    | ApiError::TooMany(m) => m,
                    ApiError::Unprocessable { message, .. } => message,
                    ApiError::Internal(_) => INTERNAL.into(),
                };
                OpenAiError::new(status, message, None)
            }
        }
    }
}

/// Unknown `/v1/` paths.
pub(crate) fn no_route(path: &str) -> Response {
    OpenAiError::new(StatusCode::NOT_FOUND, format!("no route {path}"), None).into_response()
}

/// The user of the request's API token; 401 without one (a session cookie does not count).
pub(crate) struct Caller(User);

impl FromRequestParts<AppState> for Caller {
    type Rejection = OpenAiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, OpenAiError> {
        let Some(bearer) = tokens::bearer(&parts.headers) else {
            return Err(OpenAiError::unauthorized(
                "this endpoint needs an API token: send `Authorization: Bearer sluice_...` (make \
                 one on your account page); the session cookie is not accepted here",
            ));
        };
        match tokens::authenticate(state, &bearer).await {
            Ok(user) => Ok(Caller(user)),
            Err(ApiError::Unauthorized(message)) => Err(OpenAiError::unauthorized(message)),
            Err(other) => Err(other.into()),
        }
    }
}

// --- models ----------------------------------------------------------------------------------

/// A model as `/v1/models` lists it.
fn model_entry(id: &str, created: i64, owned_by: &str) -> Value {
    json!({"id": id, "object": "model", "created": created, "owned_by": owned_by})
}

/// Every model the caller may read: their checkpoints (every job's for an admin), then the
/// appliance's models with weights (not the random-weight presets).
async fn readable(state: &AppState, user: &User) -> Result<Vec<Value>, OpenAiError> {
    let checkpoints = super::access::readable_checkpoints(state, user).await?;
    let mut list: Vec<Value> = checkpoints
        .iter()
        .map(|c| model_entry(&checkpoint_id(c.job_id, &c.name), c.job_created_at, &c.owner))
        .collect();
    let state = state.clone();
    let shared = tokio::task::spawn_blocking(move || models::all(&state))
        .await
        .map_err(OpenAiError::internal)?;
    list.extend(
        shared.iter().filter(|m| m.kind == "local").map(|m| model_entry(&m.id, 0, "sluice")),
    );
    Ok(list)
}

fn checkpoint_id(job: i64, name: &str) -> String {
    format!("job-{job}/{name}")
}

/// `GET /v1/models`.
async fn list_models(
    State(state): State<AppState>,
    Caller(user): Caller,
) -> Result<Json<Value>, OpenAiError> {
    let data = readable(&state, &user).await?;
    Ok(Json(json!({"object": "list", "data": data})))
}

/// `GET /v1/models/{id}`.
async fn get_model(
    State(state): State<AppState>,
    Caller(user): Caller,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<Value>, OpenAiError> {
    let found = readable(&state, &user).await?.into_iter().find(|m| m["id"] == id.as_str());
    found.map(Json).ok_or_else(|| OpenAiError::model_not_found(&id))
}

/// The folder of model `id` if the caller may read it; 404 `model_not_found` otherwise.
async fn model_dir(state: &AppState, user: &User, id: &str) -> Result<PathBuf, OpenAiError> {
    let missing = || OpenAiError::model_not_found(id);
    if let Some(rest) = id.strip_prefix("job-") {
        let (job, name) = rest.split_once('/').ok_or_else(missing)?;
        let job: i64 = job.parse().map_err(|_| missing())?;
        return match super::access::checkpoint_dir(state, user, job, name).await {
            Ok(dir) => Ok(dir),
            Err(ApiError::NotFound(_)) => Err(missing()),
            Err(other) => Err(other.into()),
        };
    }
    if !(id.starts_with("local:") || id.starts_with("hf:")) {
        return Err(missing());
    }
    let (state, owned) = (state.clone(), id.to_string());
    let source = tokio::task::spawn_blocking(move || models::source(&state, &owned))
        .await
        .map_err(OpenAiError::internal)?;
    match source {
        Ok(ModelSource::Dir(dir)) => Ok(dir),
        _ => Err(missing()),
    }
}

// --- request fields --------------------------------------------------------------------------

/// A request body: a JSON object whose fields are read one by one, so a wrong one is named and
/// unknown ones are ignored.
struct Fields(Map<String, Value>);

impl Fields {
    fn parse(body: Result<Bytes, BytesRejection>) -> Result<Fields, OpenAiError> {
        let body = body.map_err(|e| OpenAiError::new(e.status(), e.body_text(), None))?;
        match serde_json::from_slice::<Value>(&body) {
            Ok(Value::Object(map)) => Ok(Fields(map)),
            Ok(_) => Err(OpenAiError::new(
                StatusCode::BAD_REQUEST,
                "the body must be a JSON object",
                None,
            )),
            Err(e) => Err(OpenAiError::new(
                StatusCode::BAD_REQUEST,
                format!("the body is not valid JSON: {e}"),
                None,
            )),
        }
    }

    /// Field `name` as a `T`; `None` when absent or null.
    fn get<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, OpenAiError> {
        match self.0.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => typed(name, value).map(Some),
        }
    }

    fn required<T: DeserializeOwned>(&self, name: &str) -> Result<T, OpenAiError> {
        self.get(name)?.ok_or_else(|| OpenAiError::invalid(name, format!("{name} is required")))
    }

    fn model(&self) -> Result<String, OpenAiError> {
        let model: String = self.required("model")?;
        if model.is_empty() {
            return Err(OpenAiError::invalid("model", "model is empty"));
        }
        Ok(model)
    }

    /// `n` (and `best_of`): only 1 is served.
    fn one(&self, name: &str) -> Result<(), OpenAiError> {
        match self.get::<u64>(name)? {
            None | Some(1) => Ok(()),
            Some(n) => Err(OpenAiError::invalid(
                name,
                format!(
                    "{name} is {n}: only {name}=1 is supported; send the request again for more answers"
                ),
            )),
        }
    }

    /// Penalties and logit biases change sampling in ways not served; refused rather than
    /// ignored, unless they are their neutral values.
    fn unsupported_sampling(&self) -> Result<(), OpenAiError> {
        for name in ["presence_penalty", "frequency_penalty", "repetition_penalty"] {
            let neutral = if name == "repetition_penalty" { 1.0 } else { 0.0 };
            if self.get::<f64>(name)?.is_some_and(|v| v != neutral) {
                return Err(OpenAiError::invalid(name, format!("{name} is not supported")));
            }
        }
        if self.get::<Map<String, Value>>("logit_bias")?.is_some_and(|m| !m.is_empty()) {
            return Err(OpenAiError::invalid("logit_bias", "logit_bias is not supported"));
        }
        Ok(())
    }

    fn sampling(&self) -> Result<Sampling, OpenAiError> {
        let temperature = self.get::<f32>("temperature")?.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(OpenAiError::invalid(
                "temperature",
                format!("temperature is {temperature}: it must be 0 to 2"),
            ));
        }
        let top_p = self.get::<f32>("top_p")?.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(OpenAiError::invalid(
                "top_p",
                format!("top_p is {top_p}: it must be more than 0 and at most 1"),
            ));
        }
        // Any integer; without one, each request samples differently.
        let seed = match self.get::<i64>("seed")? {
            Some(seed) => seed as u64,
            None => rand::random(),
        };
        Ok(Sampling { temperature, top_p, seed })
    }

    fn stops(&self) -> Result<Vec<String>, OpenAiError> {
        let stops = match self.0.get("stop") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(stop)) => vec![stop.clone()],
            Some(value) => typed::<Vec<String>>("stop", value)?,
        };
        if stops.len() > MAX_STOPS {
            return Err(OpenAiError::invalid(
                "stop",
                format!("stop has {} sequences: at most {MAX_STOPS}", stops.len()),
            ));
        }
        if stops.iter().any(String::is_empty) {
            return Err(OpenAiError::invalid("stop", "a stop sequence is empty"));
        }
        Ok(stops)
    }

    /// A token limit: at most `serving::MAX_TOKENS`, and at least `min`.
    fn max_tokens(&self, name: &'static str, min: usize) -> Result<Option<usize>, OpenAiError> {
        let Some(n) = self.get::<u64>(name)? else { return Ok(None) };
        let max = serving::MAX_TOKENS;
        if n < min as u64 || n > max as u64 {
            return Err(OpenAiError::invalid(
                name,
                format!("{name} is {n}: it must be {min} to {max} (and fit the model's context)"),
            ));
        }
        Ok(Some(n as usize))
    }

    fn stream(&self) -> Result<(bool, bool), OpenAiError> {
        let stream = self.get::<bool>("stream")?.unwrap_or(false);
        let usage = match self.get::<Map<String, Value>>("stream_options")? {
            Some(options) => match options.get("include_usage") {
                None | Some(Value::Null) => false,
                Some(v) => typed::<bool>("stream_options.include_usage", v)?,
            },
            None => false,
        };
        Ok((stream, usage))
    }
}

fn typed<T: DeserializeOwned>(name: &str, value: &Value) -> Result<T, OpenAiError> {
    serde_json::from_value(value.clone())
        .map_err(|e| OpenAiError::invalid(name, format!("{name}: {e}")))
}

/// `prompt`: a string, a list of strings, a list of token ids, or a list of such lists.
fn prompts(fields: &Fields) -> Result<Vec<Prompt>, OpenAiError> {
    let value = fields.0.get("prompt").filter(|v| !v.is_null());
    let Some(value) = value else {
        return Err(OpenAiError::invalid("prompt", "prompt is required"));
    };
    let wrong = || {
        OpenAiError::invalid(
            "prompt",
            "prompt must be a string, a list of strings, a list of token ids or a list of lists \
             of token ids",
        )
    };
    let id = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
    let prompts = match value {
        Value::String(text) => vec![Prompt::Text(text.clone())],
        Value::Array(items) if items.is_empty() => {
            return Err(OpenAiError::invalid("prompt", "prompt is an empty list"));
        }
        Value::Array(items) if items.iter().all(Value::is_number) => {
            vec![Prompt::Ids(items.iter().map(id).collect::<Option<_>>().ok_or_else(wrong)?)]
        }
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::String(text) => Ok(Prompt::Text(text.clone())),
                Value::Array(ids) => {
                    Ok(Prompt::Ids(ids.iter().map(id).collect::<Option<_>>().ok_or_else(wrong)?))
                }
                _ => Err(wrong()),
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(wrong()),
    };
    if prompts.len() > MAX_PROMPTS {
        return Err(OpenAiError::invalid(
            "prompt",
            format!("prompt has {} prompts: at most {MAX_PROMPTS} per request", prompts.len()),
        ));
    }
    let bytes: usize = prompts
        .iter()
        .map(|p| match p {
            Prompt::Text(t) => t.len(),
            Prompt::Ids(ids) => ids.len() * 4,
        })
        .sum();
    if bytes > MAX_TEXT_BYTES {
        return Err(OpenAiError::invalid(
            "prompt",
            format!("the prompts are longer than {} KiB in all", MAX_TEXT_BYTES >> 10),
        ));
    }
    Ok(prompts)
}

/// `messages`: roles system (or developer), user and assistant; content a string or a list of
/// text parts.
fn messages(fields: &Fields) -> Result<Vec<Message>, OpenAiError> {
    let items: Vec<Value> = fields.required("messages")?;
    if items.is_empty() || items.len() > MAX_MESSAGES {
        return Err(OpenAiError::invalid(
            "messages",
            format!("messages has {} turns: it must have 1 to {MAX_MESSAGES}", items.len()),
        ));
    }
    let mut bytes = 0;
    let mut turns = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = |field: &str| format!("messages[{i}].{field}");
        let Value::Object(message) = item else {
            return Err(OpenAiError::invalid(format!("messages[{i}]"), "a message is an object"));
        };
        let role = match message.get("role").and_then(Value::as_str) {
            Some("system" | "developer") => Role::System,
            Some("user") => Role::User,
            Some("assistant") => Role::Assistant,
            Some(other) => {
                return Err(OpenAiError::invalid(
                    at("role"),
                    format!(
                        "role {other:?} is not supported: roles are system, developer, user and assistant"
                    ),
                ));
            }
            None => return Err(OpenAiError::invalid(at("role"), "role must be a string")),
        };
        let content = match message.get("content") {
            Some(Value::String(text)) => text.clone(),
            Some(Value::Null) | None if role == Role::Assistant => String::new(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, part) in parts.iter().enumerate() {
                    match (part.get("type").and_then(Value::as_str), part.get("text")) {
                        (Some("text"), Some(Value::String(t))) => text.push_str(t),
                        _ => {
                            return Err(OpenAiError::invalid(
                                format!("messages[{i}].content[{j}]"),
                                "only text parts are supported: {\"type\": \"text\", \"text\": ...}",
                            ));
                        }
                    }
                }
                text
            }
            _ => {
                return Err(OpenAiError::invalid(
                    at("content"),
                    "content must be a string or a list of text parts",
                ));
            }
        };
        bytes += content.len();
        turns.push(Message::new(role, content));
    }
    if bytes > MAX_TEXT_BYTES {
        return Err(OpenAiError::invalid(
            "messages",
            format!("the messages are longer than {} KiB in all", MAX_TEXT_BYTES >> 10),
        ));
    }
    Ok(turns)
}

// --- completions -----------------------------------------------------------------------------

/// A reply's id and time.
struct Stamp {
    id: String,
    created: i64,
}

impl Stamp {
    fn new(prefix: &str) -> Stamp {
        let token = crate::auth::session::random_token();
        Stamp { id: format!("{prefix}-{}", &token[..24]), created: crate::db::now() }
    }
}

fn finish_reason(finish: Finish) -> &'static str {
    match finish {
        Finish::Stop => "stop",
        Finish::Length => "length",
    }
}

fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// `choices[i].logprobs` of a completion: parallel lists, the first echoed token's `null`.
fn completion_logprobs(list: &[TokenLogprob]) -> Value {
    let top = |t: &TokenLogprob| {
        if t.logprob.is_none() || t.top.is_empty() {
            return Value::Null;
        }
        let mut map = Map::new();
        for (token, logprob) in &t.top {
            map.entry(token.clone()).or_insert(json!(logprob));
        }
        Value::Object(map)
    };
    json!({
        "tokens": list.iter().map(|t| t.token.as_str()).collect::<Vec<_>>(),
        "token_logprobs": list.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": list.iter().map(top).collect::<Vec<_>>(),
        "text_offset": list.iter().map(|t| t.offset).collect::<Vec<_>>(),
    })
}

/// `POST /v1/completions`.
async fn completions(
    State(state): State<AppState>,
    Caller(user): Caller,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, OpenAiError> {
    let fields = Fields::parse(body)?;
    let model = fields.model()?;
    let prompts = prompts(&fields)?;
    fields.one("n")?;
    fields.one("best_of")?;
    fields.unsupported_sampling()?;
    if fields.get::<String>("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(OpenAiError::invalid("suffix", "suffix is not supported"));
    }
    let echo = fields.get::<bool>("echo")?.unwrap_or(false);
    let logprobs = fields.get::<u64>("logprobs")?;
    if let Some(n) = logprobs.filter(|&n| n > MAX_LOGPROBS as u64) {
        return Err(OpenAiError::invalid(
            "logprobs",
            format!("logprobs is {n}: it must be 0 to {MAX_LOGPROBS}"),
        ));
    }
    let decode = Decode {
        max_tokens: Some(fields.max_tokens("max_tokens", 0)?.unwrap_or(16)),
        max_tokens_param: "max_tokens",
        stops: fields.stops()?,
        sampling: fields.sampling()?,
        logprobs: logprobs.map(|n| n as usize),
    };
    let (stream, include_usage) = fields.stream()?;
    let dir = model_dir(&state, &user, &model).await?;
    if stream {
        if decode.logprobs.is_some() {
            return Err(OpenAiError::invalid("logprobs", "logprobs is not supported with stream"));
        }
        let [prompt] = <[Prompt; 1]>::try_from(prompts).map_err(|_| {
            OpenAiError::invalid("prompt", "stream answers one prompt: send one per request")
        })?;
        let ask = StreamAsk::Completion { prompt, echo, decode };
        let streaming = serving::stream(&state, dir, &model, ask).await?;
        return Ok(stream_reply(
            streaming,
            Stamp::new("cmpl"),
            model,
            Shape::Completion,
            include_usage,
        ));
    }
    let ask = CompletionAsk { prompts, echo, decode };
    let answers = serving::complete(&state, dir, &model, ask).await?;
    let stamp = Stamp::new("cmpl");
    let choices: Vec<Value> = answers
        .iter()
        .enumerate()
        .map(|(index, a)| {
            json!({
                "text": a.text,
                "index": index,
                "logprobs": a.logprobs.as_deref().map(completion_logprobs),
                "finish_reason": finish_reason(a.finish),
            })
        })
        .collect();
    let prompt_tokens = answers.iter().map(|a| a.prompt_tokens).sum();
    let completion_tokens = answers.iter().map(|a| a.completion_tokens).sum();
    Ok(Json(json!({
        "id": stamp.id,
        "object": "text_completion",
        "created": stamp.created,
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }))
    .into_response())
}

// --- chat ------------------------------------------------------------------------------------

/// `choices[0].logprobs` of a chat answer: one entry per new token.
fn chat_logprobs(list: &[TokenLogprob]) -> Value {
    let entry = |token: &str, logprob: f32| json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()});
    let content: Vec<Value> = list
        .iter()
        .map(|t| {
            let mut item = entry(&t.token, t.logprob.unwrap_or(0.0));
            item["top_logprobs"] = t.top.iter().map(|(tok, lp)| entry(tok, *lp)).collect();
            item
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// `POST /v1/chat/completions`.
async fn chat_completions(
    State(state): State<AppState>,
    Caller(user): Caller,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, OpenAiError> {
    let fields = Fields::parse(body)?;
    let model = fields.model()?;
    let messages = messages(&fields)?;
    fields.one("n")?;
    fields.unsupported_sampling()?;
    if fields.get::<Vec<Value>>("tools")?.is_some_and(|t| !t.is_empty()) {
        return Err(OpenAiError::invalid("tools", "tools are not supported"));
    }
    if let Some(format) = fields.get::<Map<String, Value>>("response_format")?
        && format.get("type").is_some_and(|t| t != "text")
    {
        return Err(OpenAiError::invalid(
            "response_format",
            "only the text response format is supported",
        ));
    }
    // max_completion_tokens is the current name; max_tokens the older one.
    let (max_tokens, max_tokens_param) = match fields.max_tokens("max_completion_tokens", 1)? {
        Some(n) => (Some(n), "max_completion_tokens"),
        None => (fields.max_tokens("max_tokens", 1)?, "max_tokens"),
    };
    let logprobs = fields.get::<bool>("logprobs")?.unwrap_or(false);
    let top = fields.get::<u64>("top_logprobs")?;
    if let Some(n) = top {
        if n > MAX_TOP_LOGPROBS as u64 {
            return Err(OpenAiError::invalid(
                "top_logprobs",
                format!("top_logprobs is {n}: it must be 0 to {MAX_TOP_LOGPROBS}"),
            ));
        }
        if !logprobs {
            return Err(OpenAiError::invalid("top_logprobs", "top_logprobs needs logprobs: true"));
        }
    }
    let decode = Decode {
        max_tokens,
        max_tokens_param,
        stops: fields.stops()?,
        sampling: fields.sampling()?,
        logprobs: logprobs.then(|| top.unwrap_or(0) as usize),
    };
    let (stream, include_usage) = fields.stream()?;
    if stream && logprobs {
        return Err(OpenAiError::invalid("logprobs", "logprobs is not supported with stream"));
    }
    let dir = model_dir(&state, &user, &model).await?;
    let ask = ChatAsk { messages, decode };
    if stream {
        let streaming = serving::stream(&state, dir, &model, StreamAsk::Chat(ask)).await?;
        return Ok(stream_reply(
            streaming,
            Stamp::new("chatcmpl"),
            model,
            Shape::Chat,
            include_usage,
        ));
    }
    let answer: Answer = serving::chat(&state, dir, &model, ask).await?;
    let stamp = Stamp::new("chatcmpl");
    Ok(Json(json!({
        "id": stamp.id,
        "object": "chat.completion",
        "created": stamp.created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": answer.text, "refusal": null},
            "logprobs": answer.logprobs.as_deref().map(chat_logprobs),
            "finish_reason": finish_reason(answer.finish),
        }],
        "usage": usage(answer.prompt_tokens, answer.completion_tokens),
    }))
    .into_response())
}

// --- streams ---------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    Completion,
    Chat,
}

/// Server-sent events in OpenAI's chunk shape: `data: {chunk}` lines, an error as `data:
/// {"error": ...}`, and `data: [DONE]` last.
fn stream_reply(
    streaming: Streaming,
    stamp: Stamp,
    model: String,
    shape: Shape,
    include_usage: bool,
) -> Response {
    let prompt_tokens = streaming.prompt_tokens;
    let chunk = move |choices: Value, usage_value: Option<Value>| {
        let object = match shape {
            Shape::Completion => "text_completion",
            Shape::Chat => "chat.completion.chunk",
        };
        let mut chunk = json!({
            "id": stamp.id,
            "object": object,
            "created": stamp.created,
            "model": model,
            "choices": choices,
        });
        if let Some(u) = usage_value {
            chunk["usage"] = u;
        }
        chunk
    };
    let choice = move |text: Option<&str>, finish: Option<Finish>| match shape {
        Shape::Completion => json!([{
            "text": text.unwrap_or(""),
            "index": 0,
            "logprobs": null,
            "finish_reason": finish.map(finish_reason),
        }]),
        Shape::Chat => {
            let delta = match text {
                Some(t) => json!({"content": t}),
                None => json!({}),
            };
            json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish.map(finish_reason)}])
        }
    };
    let mut first = Vec::new();
    if shape == Shape::Chat {
        let opening = json!([{
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": null,
            "finish_reason": null,
        }]);
        first.push(chunk(opening, None));
    }
    let first = futures_util::stream::iter(first);
    let rest = UnboundedReceiverStream::new(streaming.rest).flat_map(move |item| {
        let out: Vec<Value> = match item {
            Ok(Piece::Started { .. }) => Vec::new(),
            Ok(Piece::Text(text)) => vec![chunk(choice(Some(&text), None), None)],
            Ok(Piece::Done { finish, completion_tokens }) => {
                let mut out = vec![chunk(choice(None, Some(finish)), None)];
                if include_usage {
                    out.push(chunk(json!([]), Some(usage(prompt_tokens, completion_tokens))));
                }
                out
            }
            Err(err) => vec![OpenAiError::from(err).body()],
        };
        futures_util::stream::iter(out)
    });
    let events = first
        .chain(rest)
        .map(|value| Event::default().data(value.to_string()))
        .chain(futures_util::stream::once(std::future::ready(Event::default().data("[DONE]"))))
        .map(Ok::<_, Infallible>);
    let utf8 = [(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")];
    (utf8, Sse::new(events).keep_alive(KeepAlive::default())).into_response()
}
