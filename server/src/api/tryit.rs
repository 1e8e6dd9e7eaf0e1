//! `POST /api/jobs/{id}/checkpoints/{name}/generate` and `POST /api/jobs/{id}/base-model/
//! generate`: "try it" over HTTP, a checkpoint or the model the job started from. The request
//! is checked here and answered by the service in `crate::tryit` (device choice, the loaded
//! model, generation), as one JSON reply or as server-sent events.

use std::convert::Infallible;

use axum::Json;
use axum::extract::State;
use axum::http::header;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::json;
use sluice_engine::data::{Message, Role};
use sluice_engine::generate::GenerateOptions;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::AppState;
use crate::auth::CurrentUser;
use crate::error::{ApiError, ApiJson, ApiPath, ApiResult};
use crate::tryit::{self, Ask};

/// The most tokens one answer may have: enough to judge a checkpoint, short enough on a CPU.
pub const MAX_NEW_TOKENS: usize = 256;
/// The most messages a conversation may send, and their most text in all.
pub const MAX_MESSAGES: usize = 64;
pub const MAX_CONVERSATION_BYTES: usize = 64 << 10;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TryRequest {
    /// A text to continue (one user turn when the checkpoint has a chat template).
    #[serde(default)]
    prompt: Option<String>,
    /// A conversation ending with a user turn.
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    #[serde(default = "default_new_tokens")]
    max_new_tokens: usize,
    /// 0 (the default) is greedy.
    #[serde(default)]
    temperature: f32,
    /// Server-sent events (`start`, `token`..., `done` or `error`) instead of one JSON reply.
    #[serde(default)]
    stream: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatMessage {
    role: String,
    content: String,
}

fn default_new_tokens() -> usize {
    64
}

impl TryRequest {
    fn check(&self) -> ApiResult<Ask> {
        if self.max_new_tokens == 0 || self.max_new_tokens > MAX_NEW_TOKENS {
            return Err(ApiError::bad_request(format!(
                "max_new_tokens must be 1 to {MAX_NEW_TOKENS}"
            )));
        }
        if !self.temperature.is_finite() || !(0.0..=2.0).contains(&self.temperature) {
            return Err(ApiError::bad_request("temperature must be 0 to 2"));
        }
        let ask = match (&self.prompt, &self.messages) {
            (Some(_), Some(_)) => {
                return Err(ApiError::bad_request("give a prompt or messages, not both"));
            }
            (None, None) => {
                return Err(ApiError::bad_request("the request needs a prompt or messages"));
            }
            (Some(prompt), None) => Ask::Prompt(prompt.clone()),
            (None, Some(messages)) => Ask::Turns(turns(messages)?),
        };
        let last = match &ask {
            Ask::Prompt(p) => p.as_str(),
            Ask::Turns(t) => t.last().map_or("", |m| m.content.as_str()),
        };
        if last.trim().is_empty() {
            return Err(ApiError::bad_request("the prompt is empty"));
        }
        if last.len() > MAX_CONVERSATION_BYTES {
            return Err(ApiError::bad_request(format!(
                "the prompt is longer than {} KiB",
                MAX_CONVERSATION_BYTES >> 10
            )));
        }
        Ok(ask)
    }
}

fn turns(messages: &[ChatMessage]) -> ApiResult<Vec<Message>> {
    if messages.is_empty() || messages.len() > MAX_MESSAGES {
        return Err(ApiError::bad_request(format!("messages must hold 1 to {MAX_MESSAGES} turns")));
    }
    let bytes: usize = messages.iter().map(|m| m.content.len()).sum();
    if bytes > MAX_CONVERSATION_BYTES {
        return Err(ApiError::bad_request(format!(
            "the conversation is longer than {} KiB; start a new one",
            MAX_CONVERSATION_BYTES >> 10
        )));
    }
    let turns = messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match m.role.as_str() {
                "system" => Role::System,
                "user" => Role::User,
                "assistant" => Role::Assistant,
                other => {
                    return Err(ApiError::bad_request(format!(
                        "message {} has role {other:?}; roles are system, user and assistant",
                        i + 1
                    )));
                }
            };
            Ok(Message::new(role, m.content.clone()))
        })
        .collect::<ApiResult<Vec<_>>>()?;
    if turns.last().is_some_and(|m| m.role != Role::User) {
        return Err(ApiError::bad_request("messages must end with a user turn"));
    }
    Ok(turns)
}

/// `POST /api/jobs/{id}/checkpoints/{name}/generate`: see `crate::tryit`. 404 for a checkpoint
/// the user may not download; 400 for a request out of range; 409 when every device is
/// training; 422 when the folder cannot generate.
pub(crate) async fn generate(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath((id, name)): ApiPath<(i64, String)>,
    ApiJson(request): ApiJson<TryRequest>,
) -> ApiResult<Response> {
    let dir = super::access::checkpoint_dir(&state, &user, id, &name).await?;
    let ask = request.check()?;
    let generation =
        tryit::begin(&state, dir, &format!("checkpoint {name}"), ask, request.options()).await?;
    reply(generation, request.stream).await
}

/// `POST /api/jobs/{id}/base-model/generate`: the same request answered by the model the job
/// started from, to set beside a checkpoint's answer ("compare with the base model"), under
/// the same rules (one generation at a time, never on a training device). 404 for a job the
/// user may not see; 422 for a job with no base model folder (a preset's random weights, or a
/// folder deleted since).
pub(crate) async fn generate_base(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
    ApiJson(request): ApiJson<TryRequest>,
) -> ApiResult<Response> {
    let job = super::access::visible_job(&state, &user, id).await?;
    let ask = request.check()?;
    let dir = tryit::base_model_dir(&state, &job.model)?;
    let what = format!("the base model {}", job.model);
    let generation = tryit::begin(&state, dir, &what, ask, request.options()).await?;
    reply(generation, request.stream).await
}

impl TryRequest {
    fn options(&self) -> GenerateOptions {
        GenerateOptions {
            max_new_tokens: self.max_new_tokens,
            temperature: self.temperature,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// A generation as server-sent events (`stream`), or its `done` message as one JSON reply.
async fn reply(mut generation: tryit::Generation, stream: bool) -> ApiResult<Response> {
    if stream {
        let first = futures_util::stream::once(std::future::ready(Ok(generation.start)));
        let rest = UnboundedReceiverStream::new(generation.rest);
        let events = first.chain(rest).map(|item| {
            let (name, data) = match item {
                Ok(pair) => pair,
                Err(message) => ("error", json!({ "error": message })),
            };
            Ok::<_, Infallible>(Event::default().event(name).data(data.to_string()))
        });
        // The page decodes UTF-8; saying so keeps other readers from guessing Latin-1.
        let utf8 = [(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")];
        return Ok((utf8, Sse::new(events).keep_alive(KeepAlive::default())).into_response());
    }
    while let Some(item) = generation.rest.recv().await {
        match item {
            Ok(("done", reply)) => return Ok(Json(reply).into_response()),
            Ok(_) => {}
            Err(message) => return Err(generation.failed(message).into()),
        }
    }
    Err(ApiError::internal(anyhow::anyhow!("generation ended without an answer")))
}
