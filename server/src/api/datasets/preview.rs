//! `GET /api/datasets/{id}/preview`: the first records as the model will see them (its chat
//! template applied, trained text marked) and token statistics over the dataset. The answer
//! says which tokenizer and chat template rendered them: a model folder's own, or for a preset
//! (which has none) the built-in tiny tokenizer and its ChatML template.
//!
//! The file is read record by record and only up to the records the statistics cover; each
//! sample's length goes into the running totals and the histogram as it is tokenized, and only
//! the samples shown are kept. Two previews run at once; later requests wait their turn.

use std::ops::ControlFlow;

use axum::Json;
use axum::extract::State;
use serde::{Deserialize, Serialize};
use sluice_engine::data::{DatasetSource, PrepareOptions, Preparer, Sample, Tokenizer};
use sluice_engine::train::ModelSource;
use tokio::sync::Semaphore;

use crate::AppState;
use crate::auth::CurrentUser;
use crate::datasets::{strip_path, visible};
use crate::error::{ApiError, ApiPath, ApiQuery, ApiResult};
use crate::models;

/// Records tokenized for the statistics; past this the numbers describe a prefix of the file.
const STATS_RECORDS: usize = 10_000;
/// Records read at most, bad ones (which a lenient upload skips) included, so a file of
/// millions of bad records costs no more than one of good ones.
const READ_RECORDS: usize = 2 * STATS_RECORDS;
const MAX_LIMIT: usize = 50;
/// Histogram buckets below `seq_len` (one more counts the samples that get truncated).
const BUCKETS: usize = 8;

/// A preview holds a tokenizer, one record and its encoding, and the samples it shows; two at
/// once bound what a burst of previews costs, and a request past them waits for a place rather
/// than failing, as a preview is quick.
static PREVIEWS: Semaphore = Semaphore::const_new(2);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PreviewQuery {
    model: String,
    #[serde(default = "default_limit")]
    limit: usize,
    /// The engine's default, as for a job.
    #[serde(default = "default_seq_len")]
    seq_len: usize,
    #[serde(default)]
    train_on_prompt: bool,
}

fn default_limit() -> usize {
    5
}

fn default_seq_len() -> usize {
    sluice_engine::train::JobSettings::default().seq_len
}

#[derive(Debug, Serialize)]
pub(super) struct Preview {
    samples: Vec<PreviewSample>,
    stats: PreviewStats,
    rendered_with: RenderedWith,
}

/// The tokenizer and chat template the samples went through: the ones training uses.
#[derive(Debug, Serialize)]
struct RenderedWith {
    model: String,
    /// `model`: the model folder's own files; `builtin`: a preset's stand-in, the built-in
    /// tiny tokenizer with its ChatML template.
    source: &'static str,
    /// Where the chat template came from, or `null` when the tokenizer has none (then
    /// conversations cannot be rendered, and prompt/completion and text are plain text).
    template_file: Option<&'static str>,
    /// The template's Jinja source.
    chat_template: Option<String>,
    /// One sentence for the page.
    summary: String,
}

#[derive(Debug, Serialize)]
struct PreviewSample {
    /// Line (JSON Lines) or record number (JSON array) in the file.
    line: usize,
    tokens: usize,
    segments: Vec<Segment>,
}

#[derive(Debug, Serialize, PartialEq)]
struct Segment {
    text: String,
    trained: bool,
}

#[derive(Debug, Serialize)]
struct PreviewStats {
    /// Every record of the file, as the lint counted them when it was uploaded.
    records: usize,
    /// Records the statistics cover (all, up to 10,000).
    measured: usize,
    /// Tokens kept after truncation to `seq_len`.
    tokens: usize,
    /// Tokens a loss is computed on: trained, and after another token of the same row.
    trained_tokens: usize,
    /// Samples longer than `seq_len`, which lose their end.
    truncated: usize,
    /// Texts longer than `seq_len`, which go on in the next row and lose nothing.
    continued: usize,
    seq_len: usize,
    lengths: Vec<Bucket>,
}

/// Samples whose token count lies in `min..=max`.
#[derive(Debug, Serialize)]
struct Bucket {
    min: usize,
    max: usize,
    count: usize,
}

pub(super) async fn preview(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
    ApiQuery(query): ApiQuery<PreviewQuery>,
) -> ApiResult<Json<Preview>> {
    let dataset = visible(&state, &user, id).await?;
    if query.seq_len == 0 || query.seq_len > state.config().limits.max_seq_len {
        return Err(ApiError::bad_request(format!(
            "seq_len must be between 1 and {}",
            state.config().limits.max_seq_len
        )));
    }
    let source = dataset.source(&state);
    // The lint counted every record at upload, and a dataset's file never changes: the preview
    // need not read past the records it measures.
    let records = usize::try_from(dataset.records).unwrap_or(0);
    let permit = PREVIEWS.acquire().await.map_err(ApiError::internal)?;
    let preview = tokio::task::spawn_blocking(move || -> ApiResult<Preview> {
        // Held by the work itself: a client that goes away does not free its place early.
        let _permit = permit;
        let model = models::resolve(&state, &query.model)?;
        let tokenizer = model.tokenizer().map_err(|e| {
            ApiError::unprocessable(format!("cannot load the model's tokenizer: {e}"))
        })?;
        let rendered_with = rendered_with(&query.model, &model.source, &tokenizer);
        let (samples, stats) = build(&tokenizer, &source, records, &query)?;
        Ok(Preview { samples, stats, rendered_with })
    })
    .await??;
    Ok(Json(preview))
}

fn rendered_with(id: &str, source: &ModelSource, tokenizer: &Tokenizer) -> RenderedWith {
    let chat_template = tokenizer.chat_template().map(str::to_owned);
    let (source, template_file, summary) = match source {
        ModelSource::Dir(dir) => {
            let file = if dir.join("chat_template.jinja").is_file() {
                "chat_template.jinja"
            } else {
                "tokenizer_config.json"
            };
            match chat_template {
                Some(_) => (
                    "model",
                    Some(file),
                    format!("Rendered with {id}'s own tokenizer and chat template ({file})."),
                ),
                None => (
                    "model",
                    None,
                    format!(
                        "{id}'s tokenizer has no chat template: prompt/completion and text \
                         records are plain text, and conversations cannot be rendered."
                    ),
                ),
            }
        }
        ModelSource::Preset(_) => (
            "builtin",
            chat_template.as_ref().map(|_| "built-in"),
            format!(
                "{id} is a random-init preset without a tokenizer of its own: rendered with the \
                 built-in tiny tokenizer ({} tokens) and its ChatML template, as training on it \
                 uses.",
                tokenizer.vocab_size()
            ),
        ),
    };
    RenderedWith { model: id.to_string(), source, template_file, chat_template, summary }
}

fn build(
    tokenizer: &Tokenizer,
    source: &DatasetSource,
    records: usize,
    query: &PreviewQuery,
) -> ApiResult<(Vec<PreviewSample>, PreviewStats)> {
    let refuse = |e: sluice_engine::Error| ApiError::unprocessable(strip_path(&e.to_string()));
    let reader = source.open().map_err(refuse)?;
    let preparer =
        Preparer::new(tokenizer, PrepareOptions { train_on_prompt: query.train_on_prompt })
            .map_err(refuse)?;
    let seq_len = query.seq_len;
    let limit = query.limit.min(MAX_LIMIT);

    let mut samples = Vec::new();
    let mut lengths = Histogram::new(seq_len);
    let (mut tokens, mut trained_tokens, mut truncated, mut continued) = (0, 0, 0, 0);
    let mut failed = None;
    let mut read = 0;
    reader
        .for_each(|checked| {
            read += 1;
            // A bad record was refused at upload, or skipped by a lenient one as training skips it.
            let Ok(entry) = checked else {
                return if read >= READ_RECORDS {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                };
            };
            let shown = preparer
                .sample(&entry.record)
                .map_err(|e| ApiError::unprocessable(format!("line {}: {e}", entry.line)))
                .and_then(|sample| {
                    let len = sample.ids.len();
                    lengths.add(len);
                    // Counted as training counts them (`pack`): a text longer than a row goes
                    // on in the next, anything else is cut.
                    let (kept, trained, cut) =
                        sluice_engine::data::pack::sample_counts(&sample, seq_len);
                    tokens += kept;
                    trained_tokens += trained;
                    truncated += usize::from(cut > 0);
                    continued += usize::from(sample.continues && len > seq_len);
                    if samples.len() < limit {
                        let segments = segments(tokenizer, &sample).map_err(refuse)?;
                        samples.push(PreviewSample { line: entry.line, tokens: len, segments });
                    }
                    Ok(())
                });
            if let Err(err) = shown {
                failed = Some(err);
                return ControlFlow::Break(());
            }
            if lengths.count() == STATS_RECORDS || read >= READ_RECORDS {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .map_err(refuse)?;
    if let Some(err) = failed {
        return Err(err);
    }
    let stats = PreviewStats {
        records,
        measured: lengths.count(),
        tokens,
        trained_tokens,
        truncated,
        continued,
        seq_len,
        lengths: lengths.buckets(),
    };
    Ok((samples, stats))
}

/// Runs of tokens with the same trained flag, decoded to text. Each run is the difference of
/// two decoded prefixes, so a character split across tokens of two runs is not garbled.
fn segments(tokenizer: &Tokenizer, sample: &Sample) -> sluice_engine::Result<Vec<Segment>> {
    let mut out: Vec<Segment> = Vec::new();
    let mut previous = String::new();
    let mut start = 0;
    while start < sample.ids.len() {
        let trained = sample.trained.get(start).copied().unwrap_or(false);
        let mut end = start + 1;
        while end < sample.ids.len() && sample.trained.get(end).copied().unwrap_or(false) == trained
        {
            end += 1;
        }
        let text = tokenizer.decode(&sample.ids[..end])?;
        let piece = match text.strip_prefix(previous.as_str()) {
            Some(rest) => rest.to_string(),
            None => tokenizer.decode(&sample.ids[start..end])?,
        };
        out.push(Segment { text: piece, trained });
        previous = text;
        start = end;
    }
    Ok(out)
}

/// Sample lengths counted into `BUCKETS` equal buckets over `1..=seq_len`, then one for longer
/// samples if there are any, as they are seen.
struct Histogram {
    seq_len: usize,
    width: usize,
    counts: [usize; BUCKETS],
    over: usize,
    longest: usize,
}

impl Histogram {
    fn new(seq_len: usize) -> Histogram {
        let width = seq_len.div_ceil(BUCKETS).max(1);
        Histogram { seq_len, width, counts: [0; BUCKETS], over: 0, longest: 0 }
    }

    fn add(&mut self, len: usize) {
        self.longest = self.longest.max(len);
        if len > self.seq_len {
            self.over += 1;
        } else if let Some(count) = self.counts.get_mut(len.saturating_sub(1) / self.width) {
            *count += 1;
        }
    }

    /// Samples added.
    fn count(&self) -> usize {
        self.counts.iter().sum::<usize>() + self.over
    }

    fn buckets(&self) -> Vec<Bucket> {
        let width = self.width;
        let mut buckets: Vec<Bucket> = (0..BUCKETS)
            .map(|i| Bucket {
                min: i * width + 1,
                max: ((i + 1) * width).min(self.seq_len),
                count: self.counts[i],
            })
            .filter(|b| b.min <= b.max)
            .collect();
        if self.over > 0 {
            buckets.push(Bucket { min: self.seq_len + 1, max: self.longest, count: self.over });
        }
        buckets
    }
}

#[cfg(test)]
mod tests {
    use super::Histogram;

    #[test]
    fn histogram_covers_every_length_once() {
        let lengths = [1, 8, 9, 16, 64, 65, 300];
        let mut histogram = Histogram::new(64);
        lengths.iter().for_each(|&len| histogram.add(len));
        assert_eq!(histogram.count(), lengths.len());
        let buckets = histogram.buckets();
        assert_eq!(buckets.len(), 9);
        assert_eq!(buckets.iter().map(|b| b.count).sum::<usize>(), lengths.len());
        assert_eq!((buckets[0].min, buckets[0].max, buckets[0].count), (1, 8, 2));
        assert_eq!((buckets[1].min, buckets[1].max, buckets[1].count), (9, 16, 2));
        assert_eq!((buckets[7].min, buckets[7].max, buckets[7].count), (57, 64, 1));
        assert_eq!((buckets[8].min, buckets[8].max, buckets[8].count), (65, 300, 2));
    }

    #[test]
    fn short_sequences_have_fewer_buckets_and_none_for_longer_when_nothing_is() {
        let mut histogram = Histogram::new(4);
        [1, 2, 4, 4].iter().for_each(|&len| histogram.add(len));
        let buckets: Vec<(usize, usize, usize)> =
            histogram.buckets().iter().map(|b| (b.min, b.max, b.count)).collect();
        assert_eq!(buckets, vec![(1, 1, 1), (2, 2, 1), (3, 3, 0), (4, 4, 2)]);
    }
}
