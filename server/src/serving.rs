//! Serving: completions and chat answers from a checkpoint or model folder, for the
//! OpenAI-compatible endpoint (`api::openai`, which turns requests into the asks here and the
//! answers into OpenAI's JSON). Prompts as text or token ids, echo with the log-probability of
//! every prompt token (what likelihood benchmarks read), sampling (greedy, temperature, top-p,
//! seed), stop sequences, and text streamed as it is made.
//!
//! Training comes first, by the try-it service's rules (`tryit::with_model`, whose model slot
//! and device choice this shares): a request never takes a device a job trains on, is starting
//! on, or a queued job waits for, and answers [`ServeError::Busy`] (with a time to come back)
//! when every device it could use is taken so. One model works at a time and requests wait
//! their turn in arrival order, a bounded number of them for a bounded time. A request already
//! running stops as soon as the dispatcher finds a queued job waiting for its device (checked
//! before every forward: each prompt, each new token), and is Busy, so a job waits at most one
//! forward, never for chat traffic to end. Each request's work is bounded too: at most
//! [`MAX_TOKENS`] new tokens per prompt, within the model's context.
//!
//! No HTTP here: failures are [`ServeError`], which `api/errors.rs` maps.

use std::path::PathBuf;

use sluice_engine::backend::Backend;
use sluice_engine::data::{Message, Tokenizer};
use sluice_engine::generate::{GenerateOptions, Generator, Sampler};
use tokio::sync::mpsc;

use crate::AppState;
use crate::tryit::{self, Device, Loaded, TryError};

/// The most new tokens one prompt may ask for, whatever the model's context.
pub const MAX_TOKENS: usize = 4096;

/// New tokens a chat answer may have when the request sets no limit (within the context).
pub const DEFAULT_CHAT_TOKENS: usize = 512;

/// How new tokens are chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0 is greedy.
    pub temperature: f32,
    /// In (0, 1]; 1 keeps every token.
    pub top_p: f32,
    pub seed: u64,
}

/// How an answer is made after its prompt.
#[derive(Debug, Clone)]
pub struct Decode {
    /// The most new tokens; `None`: as many as the context holds, at most
    /// [`DEFAULT_CHAT_TOKENS`].
    pub max_tokens: Option<usize>,
    /// The request's name for `max_tokens`, for errors.
    pub max_tokens_param: &'static str,
    /// Texts that end the answer where they first appear (not included).
    pub stops: Vec<String>,
    pub sampling: Sampling,
    /// Log-probabilities of each token, with the `k` most likely tokens at its place.
    pub logprobs: Option<usize>,
}

/// A prompt as the request gave it.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Text, tokenized as is (no chat template, no special tokens added).
    Text(String),
    /// Token ids of the model's tokenizer.
    Ids(Vec<u32>),
}

/// A completion request: each prompt is continued on its own.
#[derive(Debug, Clone)]
pub struct CompletionAsk {
    pub prompts: Vec<Prompt>,
    /// The answer starts with the prompt (and its log-probabilities, the first token's `None`).
    pub echo: bool,
    pub decode: Decode,
}

/// A chat request: the conversation in the model's chat template, answered as the assistant.
#[derive(Debug, Clone)]
pub struct ChatAsk {
    pub messages: Vec<Message>,
    pub decode: Decode,
}

/// What a streamed answer continues.
#[derive(Debug, Clone)]
pub enum StreamAsk {
    Completion { prompt: Prompt, echo: bool, decode: Decode },
    Chat(ChatAsk),
}

/// Why an answer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// The model's end-of-sequence token, or a stop sequence.
    Stop,
    /// The token limit or the model's context.
    Length,
}

/// One token of an answer with its log-probability.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token's text, decoded alone.
    pub token: String,
    /// `None` for the first token of an echoed prompt, which nothing precedes.
    pub logprob: Option<f32>,
    /// The most likely tokens at its place, most likely first (empty for the first echoed
    /// token).
    pub top: Vec<(String, f32)>,
    /// Characters of the answer's text before this token.
    pub offset: usize,
}

/// One prompt's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// The echoed prompt, if asked, then the new text.
    pub text: String,
    pub finish: Finish,
    pub prompt_tokens: usize,
    /// New tokens made (an end-of-sequence token is not counted).
    pub completion_tokens: usize,
    /// Echoed and new tokens, when log-probabilities were asked for. An end-of-sequence token
    /// that ended the answer is listed (as OpenAI's completions did), though not in `text`.
    pub logprobs: Option<Vec<TokenLogprob>>,
}

/// What a stream sends: `Started`, then `Text`..., then `Done`; an `Err` ends it early.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Started { prompt_tokens: usize },
    Text(String),
    Done { finish: Finish, completion_tokens: usize },
}

/// An answer being made, its prompt checked and its model loaded.
#[derive(Debug)]
pub struct Streaming {
    pub prompt_tokens: usize,
    /// Text pieces, then `Done`, or an error.
    pub rest: mpsc::UnboundedReceiver<Result<Piece, ServeError>>,
}

/// Why a request gets no answer.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The request does not fit this model: `param` names the field (the prompt is longer than
    /// the context, the model has no chat template).
    #[error("{message}")]
    Invalid { param: &'static str, message: String },
    /// The model folder cannot generate.
    #[error("{0}")]
    Unusable(String),
    /// Training has the devices, or too many requests wait; try again after `retry_after_s`.
    #[error("{message}")]
    Busy { message: String, retry_after_s: u64 },
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

impl From<TryError> for ServeError {
    fn from(err: TryError) -> Self {
        match err {
            TryError::Unusable { .. } | TryError::NoBaseModel(_) => {
                ServeError::Unusable(err.to_string())
            }
            TryError::Busy { message, retry_after_s } => {
                ServeError::Busy { message, retry_after_s }
            }
            TryError::Internal(err) => ServeError::Internal(err),
        }
    }
}

fn invalid(param: &'static str, message: impl Into<String>) -> ServeError {
    ServeError::Invalid { param, message: message.into() }
}

fn engine(err: sluice_engine::Error) -> ServeError {
    ServeError::Unusable(err.to_string())
}

/// Answers each prompt of `ask` with the model in `dir` (called `name` in errors).
pub async fn complete(
    state: &AppState,
    dir: PathBuf,
    name: &str,
    ask: CompletionAsk,
) -> Result<Vec<Answer>, ServeError> {
    tryit::with_model(state, dir, name, move |model, device| match model {
        Loaded::Cpu(g) => complete_on(g, device, &ask),
        Loaded::Cuda(g) => complete_on(g, device, &ask),
    })
    .await?
}

/// Answers the conversation of `ask` with the model in `dir` (called `name` in errors).
pub async fn chat(
    state: &AppState,
    dir: PathBuf,
    name: &str,
    ask: ChatAsk,
) -> Result<Answer, ServeError> {
    tryit::with_model(state, dir, name, move |model, device| match model {
        Loaded::Cpu(g) => chat_on(g, device, &ask),
        Loaded::Cuda(g) => chat_on(g, device, &ask),
    })
    .await?
}

/// Starts answering `ask` piece by piece; returns once the prompt is checked and the model
/// loaded (errors until then are the whole answer), with the rest to come.
pub async fn stream(
    state: &AppState,
    dir: PathBuf,
    name: &str,
    ask: StreamAsk,
) -> Result<Streaming, ServeError> {
    let (sender, mut receiver) = mpsc::unbounded_channel();
    let work = tryit::with_model(state, dir, name, move |model, device| {
        let outcome = match model {
            Loaded::Cpu(g) => stream_on(g, device, &ask, &sender),
            Loaded::Cuda(g) => stream_on(g, device, &ask, &sender),
        };
        if let Err(err) = outcome {
            let _ = sender.send(Err(err));
        }
    });
    match tryit::first_item(work, &mut receiver).await? {
        Some(Ok(Piece::Started { prompt_tokens })) => {
            Ok(Streaming { prompt_tokens, rest: receiver })
        }
        Some(Err(err)) => Err(err),
        Some(Ok(other)) => Err(anyhow::anyhow!("a stream began with {other:?}").into()),
        None => Err(anyhow::anyhow!("the answer ended unannounced").into()),
    }
}

fn complete_on<B: Backend>(
    g: &Generator<B>,
    device: &Device,
    ask: &CompletionAsk,
) -> Result<Vec<Answer>, ServeError> {
    let prepared = ask
        .prompts
        .iter()
        .map(|prompt| prepare_prompt(g, prompt, &ask.decode))
        .collect::<Result<Vec<_>, _>>()?;
    prepared
        .iter()
        .map(|(prompt, max_new)| {
            answer(g, device, prompt, ask.echo, &ask.decode, *max_new, &mut |_| true)
        })
        .collect()
}

fn chat_on<B: Backend>(
    g: &Generator<B>,
    device: &Device,
    ask: &ChatAsk,
) -> Result<Answer, ServeError> {
    let (prompt, max_new) = prepare_chat(g, ask)?;
    answer(g, device, &prompt, false, &ask.decode, max_new, &mut |_| true)
}

fn stream_on<B: Backend>(
    g: &Generator<B>,
    device: &Device,
    ask: &StreamAsk,
    sender: &mpsc::UnboundedSender<Result<Piece, ServeError>>,
) -> Result<(), ServeError> {
    let (prompt, echo, decode, max_new) = match ask {
        StreamAsk::Completion { prompt, echo, decode } => {
            let (prompt, max_new) = prepare_prompt(g, prompt, decode)?;
            (prompt, *echo, decode, max_new)
        }
        StreamAsk::Chat(chat) => {
            let (prompt, max_new) = prepare_chat(g, chat)?;
            (prompt, false, &chat.decode, max_new)
        }
    };
    let started = Piece::Started { prompt_tokens: prompt.ids.len() };
    if sender.send(Ok(started)).is_err() {
        return Ok(());
    }
    // A reader that went away stops the answer.
    let mut on_text = |text: &str| sender.send(Ok(Piece::Text(text.to_string()))).is_ok();
    let answer = answer(g, device, &prompt, echo, decode, max_new, &mut on_text)?;
    let done = Piece::Done { finish: answer.finish, completion_tokens: answer.completion_tokens };
    let _ = sender.send(Ok(done));
    Ok(())
}

/// A prompt's ids, and its text where the request gave text (with each token's byte range).
struct Prepared {
    ids: Vec<u32>,
    text: Option<(String, Vec<(usize, usize)>)>,
}

fn tokenizer<B: Backend>(g: &Generator<B>) -> Result<&Tokenizer, ServeError> {
    g.tokenizer().ok_or_else(|| ServeError::Unusable("the model folder has no tokenizer".into()))
}

/// The prompt's tokens and the new tokens it may have, checked against the model's context.
fn prepare_prompt<B: Backend>(
    g: &Generator<B>,
    prompt: &Prompt,
    decode: &Decode,
) -> Result<(Prepared, usize), ServeError> {
    let tokenizer = tokenizer(g)?;
    let prepared = match prompt {
        Prompt::Text(text) => {
            let encoding = tokenizer.encode(text).map_err(engine)?;
            Prepared { ids: encoding.ids, text: Some((text.clone(), encoding.offsets)) }
        }
        Prompt::Ids(ids) => {
            let vocab = g.spec().vocab.min(tokenizer.vocab_size().max(1));
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(invalid(
                    "prompt",
                    format!("token id {bad} is not in this model's vocabulary of {vocab}"),
                ));
            }
            Prepared { ids: ids.clone(), text: None }
        }
    };
    let max_new = room(g, prepared.ids.len(), decode, "prompt")?;
    Ok((prepared, max_new))
}

fn prepare_chat<B: Backend>(
    g: &Generator<B>,
    ask: &ChatAsk,
) -> Result<(Prepared, usize), ServeError> {
    if !g.has_chat_template() {
        return Err(invalid(
            "model",
            "this model has no chat template: use /v1/completions with a prompt",
        ));
    }
    let ids = g.chat_ids(&ask.messages).map_err(|e| invalid("messages", e.to_string()))?;
    let max_new = room(g, ids.len(), &ask.decode, "messages")?;
    Ok((Prepared { ids, text: None }, max_new))
}

/// The new tokens a prompt of `len` tokens may have: the request's limit, checked against the
/// model's context, or what fits (at most [`DEFAULT_CHAT_TOKENS`]).
fn room<B: Backend>(
    g: &Generator<B>,
    len: usize,
    decode: &Decode,
    prompt_param: &'static str,
) -> Result<usize, ServeError> {
    let context = g.spec().max_positions;
    if len == 0 {
        return Err(invalid(prompt_param, "the prompt is empty: it has no tokens"));
    }
    if len > context {
        return Err(invalid(
            prompt_param,
            format!("the prompt is {len} tokens and this model reads at most {context}"),
        ));
    }
    let room = context - len;
    match decode.max_tokens {
        Some(wanted) if wanted > room => Err(invalid(
            decode.max_tokens_param,
            format!(
                "{} is {wanted}, but the prompt is {len} tokens and this model reads at most \
                 {context}: at most {room} new tokens fit",
                decode.max_tokens_param
            ),
        )),
        Some(wanted) => Ok(wanted),
        None => Ok(room.min(DEFAULT_CHAT_TOKENS)),
    }
}

/// Refuses to go on when a queued job waits for the device.
fn yield_to_training(device: &Device) -> Result<(), ServeError> {
    if device.job_waiting() {
        return Err(ServeError::Busy {
            message: format!(
                "a training job is waiting for {}: this request stopped so the job can start",
                device.id
            ),
            retry_after_s: 60,
        });
    }
    Ok(())
}

/// Answers one prompt: its echo and log-probabilities if asked, then up to `max_new` new tokens
/// until the end-of-sequence token or a stop sequence. `on_text` gets the answer's text as it
/// becomes final (never a piece a stop sequence could still cut) and returns false to stop.
fn answer<B: Backend>(
    g: &Generator<B>,
    device: &Device,
    prompt: &Prepared,
    echo: bool,
    decode: &Decode,
    max_new: usize,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<Answer, ServeError> {
    let tokenizer = tokenizer(g)?;
    let ids = &prompt.ids;
    let top_k = decode.logprobs;
    let mut logprobs = top_k.map(|_| Vec::new());
    let text = if echo { echo_text(tokenizer, prompt, logprobs.as_mut())? } else { String::new() };
    let ended = |text: String, logprobs| Answer {
        text,
        finish: Finish::Length,
        prompt_tokens: ids.len(),
        completion_tokens: 0,
        logprobs,
    };
    let echo_logprobs = echo && top_k.is_some();
    if !echo_logprobs && max_new == 0 {
        if echo {
            on_text(&text);
        }
        return Ok(ended(text, logprobs));
    }
    yield_to_training(device)?;
    let mut cache = g.cache_for(ids.len() + max_new).map_err(engine)?;
    let mut logits = if echo_logprobs {
        let vocab = g.spec().vocab;
        let rows = g.logits(&mut cache, ids).map_err(engine)?;
        if let Some(list) = logprobs.as_mut() {
            // Row t - 1 predicts token t; the first token has nothing before it.
            for (t, entry) in list.iter_mut().enumerate().skip(1) {
                let row = &rows[(t - 1) * vocab..t * vocab];
                let dist = Dist::of(row);
                entry.logprob = Some(dist.logprob(row, ids[t]));
                entry.top = dist.top(row, top_k.unwrap_or(0), tokenizer)?;
            }
        }
        rows[(ids.len() - 1) * vocab..].to_vec()
    } else {
        g.next_logits(&mut cache, ids).map_err(engine)?
    };
    if echo && !on_text(&text) {
        return Ok(ended(text, logprobs));
    }
    if max_new == 0 {
        return Ok(ended(text, logprobs));
    }

    let options = GenerateOptions {
        max_new_tokens: max_new,
        temperature: decode.sampling.temperature,
        top_p: decode.sampling.top_p,
        seed: decode.sampling.seed,
    };
    let mut sampler = Sampler::new(&options).map_err(engine)?;
    let stop_ids = g.stop_ids();
    let echoed_chars = text.chars().count();
    let first_new = logprobs.as_ref().map_or(0, Vec::len);
    // Seeded with the prompt's last tokens, so the first new token decodes in context (a
    // tokenizer that drops a word's leading space at the start of a text keeps it here).
    let mut detok = Detokenizer::after(tokenizer, &ids[ids.len().saturating_sub(4)..]);
    let mut stops = StopScan::new(&decode.stops);
    let mut sent = 0;
    let mut made = 0;
    // Characters of the new text before each new token.
    let mut starts = Vec::new();
    let mut finish = Finish::Length;
    let mut cut = None;
    loop {
        let next = sampler.pick(&logits).map_err(engine)?;
        if let (Some(list), Some(k)) = (logprobs.as_mut(), top_k) {
            let dist = Dist::of(&logits);
            list.push(TokenLogprob {
                token: piece(tokenizer, next)?,
                logprob: Some(dist.logprob(&logits, next)),
                top: dist.top(&logits, k, tokenizer)?,
                offset: echoed_chars + detok.chars,
            });
        }
        if stop_ids.contains(&next) {
            finish = Finish::Stop;
            break;
        }
        made += 1;
        starts.push(detok.chars);
        detok.push(next)?;
        if let Some(at) = stops.find(&detok.text) {
            cut = Some(at);
            finish = Finish::Stop;
            break;
        }
        let safe = detok.text.len() - stops.held_back(&detok.text);
        if safe > sent {
            if !on_text(&detok.text[sent..safe]) {
                break;
            }
            sent = safe;
        }
        if made == max_new {
            break;
        }
        yield_to_training(device)?;
        logits = g.next_logits(&mut cache, &[next]).map_err(engine)?;
    }
    match cut {
        Some(at) => {
            detok.text.truncate(at);
            // Tokens that begin past the cut are not the answer's.
            let kept_chars = detok.text.chars().count();
            let kept = starts.iter().take_while(|&&start| start < kept_chars).count();
            if let Some(list) = logprobs.as_mut() {
                list.truncate(first_new + kept);
            }
        }
        None => detok.finish()?,
    }
    if detok.text.len() > sent {
        on_text(&detok.text[sent..]);
    }
    let mut text = text;
    text.push_str(&detok.text);
    Ok(Answer { text, finish, prompt_tokens: ids.len(), completion_tokens: made, logprobs })
}

/// The prompt's text as echoed, and its tokens' entries (log-probabilities filled in later).
fn echo_text(
    tokenizer: &Tokenizer,
    prompt: &Prepared,
    logprobs: Option<&mut Vec<TokenLogprob>>,
) -> Result<String, ServeError> {
    let entry = |id: u32, offset: usize| -> Result<TokenLogprob, ServeError> {
        Ok(TokenLogprob { token: piece(tokenizer, id)?, logprob: None, top: Vec::new(), offset })
    };
    match &prompt.text {
        Some((text, spans)) => {
            if let Some(list) = logprobs {
                // Byte offsets into the text, as characters.
                for (&id, &(start, _)) in prompt.ids.iter().zip(spans) {
                    let start = text.get(..start).map_or(0, |head| head.chars().count());
                    list.push(entry(id, start)?);
                }
            }
            Ok(text.clone())
        }
        None => {
            let mut detok = Detokenizer::after(tokenizer, &[]);
            let mut starts = Vec::with_capacity(prompt.ids.len());
            for &id in &prompt.ids {
                starts.push(detok.chars);
                detok.push(id)?;
            }
            detok.finish()?;
            if let Some(list) = logprobs {
                for (&id, start) in prompt.ids.iter().zip(starts) {
                    list.push(entry(id, start)?);
                }
            }
            Ok(detok.text)
        }
    }
}

/// One token's text, decoded alone (a piece of a character shows as U+FFFD).
fn piece(tokenizer: &Tokenizer, id: u32) -> Result<String, ServeError> {
    tokenizer.decode(&[id]).map_err(engine)
}

/// A row of logits as log-probabilities: `logprob = logit - log Σ exp(logits)`.
struct Dist {
    log_total: f32,
}

impl Dist {
    fn of(row: &[f32]) -> Dist {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = row.iter().map(|&x| f64::from(x - max).exp()).sum();
        Dist { log_total: max + sum.ln() as f32 }
    }

    fn logprob(&self, row: &[f32], id: u32) -> f32 {
        row[id as usize] - self.log_total
    }

    /// The `k` most likely tokens as (text, log-probability), most likely first; ties by id.
    fn top(
        &self,
        row: &[f32],
        k: usize,
        tokenizer: &Tokenizer,
    ) -> Result<Vec<(String, f32)>, ServeError> {
        let mut best: Vec<u32> = Vec::with_capacity(k + 1);
        for id in 0..row.len() as u32 {
            let value = row[id as usize];
            if best.len() == k && best.last().is_none_or(|&b| row[b as usize] >= value) {
                continue;
            }
            let at = best.partition_point(|&b| row[b as usize] >= value);
            best.insert(at, id);
            best.truncate(k);
        }
        best.into_iter().map(|id| Ok((piece(tokenizer, id)?, self.logprob(row, id)))).collect()
    }
}

/// Text from token ids as they arrive, a piece at a time: a token's text is what decoding it
/// after a few tokens before it adds, so characters split over tokens and words whose leading
/// space depends on what precedes them come out as whole decoding gives them. `chars` counts
/// the characters of `text`.
struct Detokenizer<'t> {
    tokenizer: &'t Tokenizer,
    ids: Vec<u32>,
    /// Where the window decoded for context starts, and where its already-shown part ends.
    prefix: usize,
    read: usize,
    text: String,
    chars: usize,
}

impl<'t> Detokenizer<'t> {
    /// A detokenizer whose text begins after `context` (ids already shown elsewhere).
    fn after(tokenizer: &'t Tokenizer, context: &[u32]) -> Self {
        Detokenizer {
            tokenizer,
            ids: context.to_vec(),
            prefix: 0,
            read: context.len(),
            text: String::new(),
            chars: 0,
        }
    }

    fn decode(&self, ids: &[u32]) -> Result<String, ServeError> {
        self.tokenizer.decode(ids).map_err(engine)
    }

    fn push(&mut self, id: u32) -> Result<(), ServeError> {
        self.ids.push(id);
        let before = self.decode(&self.ids[self.prefix..self.read])?;
        let now = self.decode(&self.ids[self.prefix..])?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') {
            if let Some(delta) = now.strip_prefix(before.as_str()) {
                self.chars += delta.chars().count();
                self.text.push_str(delta);
            }
            self.prefix = self.read;
            self.read = self.ids.len();
        }
        Ok(())
    }

    /// Shows what is left (a character still incomplete shows as U+FFFD).
    fn finish(&mut self) -> Result<(), ServeError> {
        if self.read == self.ids.len() {
            return Ok(());
        }
        let before = self.decode(&self.ids[self.prefix..self.read])?;
        let now = self.decode(&self.ids[self.prefix..])?;
        if let Some(delta) = now.strip_prefix(before.as_str()) {
            self.chars += delta.chars().count();
            self.text.push_str(delta);
        }
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(())
    }
}

/// Stop sequences over a growing text.
struct StopScan<'s> {
    stops: &'s [String],
    longest: usize,
    /// Where the next search may start: a stop found later starts past here.
    searched: usize,
}

impl<'s> StopScan<'s> {
    fn new(stops: &'s [String]) -> Self {
        let longest = stops.iter().map(String::len).max().unwrap_or(0);
        StopScan { stops, longest, searched: 0 }
    }

    /// Where the earliest stop sequence in `text` starts, if one does.
    fn find(&mut self, text: &str) -> Option<usize> {
        if self.stops.is_empty() {
            return None;
        }
        let mut from = self.searched;
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        let found =
            self.stops.iter().filter_map(|s| text[from..].find(s.as_str()).map(|i| from + i)).min();
        self.searched = text.len().saturating_sub(self.longest.saturating_sub(1));
        found
    }

    /// Bytes at the end of `text` that begin some stop sequence, so cannot be shown yet.
    fn held_back(&self, text: &str) -> usize {
        self.stops
            .iter()
            .flat_map(|stop| {
                (1..stop.len().min(text.len() + 1))
                    .rev()
                    .find(|&n| stop.is_char_boundary(n) && text.ends_with(&stop[..n]))
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_are_found_across_pieces_and_held_back_until_decided() {
        let stops = vec!["\n\n".to_string(), "END".to_string()];
        let mut scan = StopScan::new(&stops);
        assert_eq!(scan.find("Hello"), None);
        assert_eq!(scan.held_back("Hello"), 0);
        assert_eq!(scan.held_back("Hello E"), 1);
        assert_eq!(scan.held_back("Hello EN"), 2);
        assert_eq!(scan.held_back("Hello\n"), 1);
        assert_eq!(scan.find("Hello EN"), None);
        assert_eq!(scan.find("Hello ENDING"), Some(6));
        let mut scan = StopScan::new(&stops);
        assert_eq!(scan.find("a\n\nb END"), Some(1));
        let none: Vec<String> = Vec::new();
        let mut scan = StopScan::new(&none);
        assert_eq!(scan.find("anything"), None);
        assert_eq!(scan.held_back("anything"), 0);
    }

    #[test]
    fn log_probabilities_sum_to_one_and_the_top_is_sorted() {
        let row = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let dist = Dist::of(&row);
        let total: f64 =
            (0..row.len() as u32).map(|i| f64::from(dist.logprob(&row, i)).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        let tokenizer = sluice_engine::data::tiny_tokenizer().expect("tiny tokenizer");
        let top = dist.top(&row, 3, &tokenizer).expect("top");
        let values: Vec<f32> = top.iter().map(|t| t.1).collect();
        assert_eq!(
            values,
            vec![dist.logprob(&row, 1), dist.logprob(&row, 3), dist.logprob(&row, 2)]
        );
        assert!(dist.top(&row, 0, &tokenizer).expect("top").is_empty());
    }

    #[test]
    fn the_detokenizer_gives_whole_decoding_a_piece_at_a_time() {
        let tokenizer = sluice_engine::data::tiny_tokenizer().expect("tiny tokenizer");
        for text in ["Hello there, world!", "naïve café ☕ 🎉 done", "  two  spaces\nand lines"]
        {
            let ids = tokenizer.encode(text).expect("encodes").ids;
            let mut detok = Detokenizer::after(&tokenizer, &[]);
            for &id in &ids {
                detok.push(id).expect("pushes");
            }
            detok.finish().expect("finishes");
            assert_eq!(detok.text, tokenizer.decode(&ids).expect("decodes"), "{text}");
            assert_eq!(detok.chars, detok.text.chars().count());
        }
    }
}
