//! Multipart uploads streamed to disk: a declared size over the limit is refused before
//! anything is read, a file field is counted against the limit as it arrives, and the temporary
//! file is deleted unless the upload is kept. Every other field is small (a name, at most a
//! small JSON document) and read into memory only up to its own limit. Used by dataset uploads
//! and GGUF model imports.
//!
//! The parser reads the body one network chunk at a time ([`BoundedMultipart`]): left to
//! itself it reads ahead as long as bytes are ready, so a fast client streaming one long field
//! would be buffered whole before the field's limit is ever checked.

use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::multipart::Field;
use axum::extract::{FromRequest, Multipart, Request};
use axum::http::{HeaderMap, header};
use futures_util::Stream;
use tokio::io::AsyncWriteExt;

use crate::error::{ApiError, ApiResult};

/// The most a field other than the file may hold; a name needs far less.
pub(crate) const FIELD_LIMIT: usize = 1 << 10;

/// The most a small document sent beside the file may hold (a dataset's `dataset_info.json`).
pub(crate) const DOCUMENT_LIMIT: usize = 256 << 10;

/// Multipart framing, the small fields and a document on top of the file itself.
pub(crate) const MULTIPART_OVERHEAD: u64 = (64 << 10) + DOCUMENT_LIMIT as u64;

/// Reads a small field chunk by chunk and refuses it with 400, naming it, once it passes
/// `limit` bytes: only the file is streamed to disk, so any other field must stay small in
/// memory. Bytes that are not UTF-8 become U+FFFD, as `Field::text` decodes them.
pub(crate) async fn read_small_field(field: &mut Field<'_>, limit: usize) -> ApiResult<String> {
    let mut bytes = Vec::new();
    while let Some(chunk) = field.chunk().await? {
        if bytes.len() + chunk.len() > limit {
            let name = field.name().unwrap_or_default();
            return Err(ApiError::bad_request(format!(
                "the multipart field {name:?} is longer than {limit} bytes"
            )));
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// The `Multipart` extractor over a body that hands the parser one chunk per poll, so what it
/// holds of a field is at most one chunk (a network read, 400 KiB at most from hyper) past
/// what the handler has taken.
pub(crate) struct BoundedMultipart(pub Multipart);

impl<S: Send + Sync> FromRequest<S> for BoundedMultipart {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        let request = request.map(|body| {
            Body::from_stream(OneChunkPerPoll { inner: body.into_data_stream(), yielded: false })
        });
        let multipart = Multipart::from_request(request, state)
            .await
            .map_err(|rejection| ApiError::bad_request(rejection.body_text()))?;
        Ok(Self(multipart))
    }
}

/// A stream that answers `Pending` (already woken) after each chunk it yields: the multipart
/// parser reads "while ready", and this makes it return to the handler after every chunk.
struct OneChunkPerPoll<S> {
    inner: S,
    yielded: bool,
}

impl<S: Stream + Unpin> Stream for OneChunkPerPoll<S> {
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        if self.yielded {
            self.yielded = false;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let item = std::task::ready!(Pin::new(&mut self.inner).poll_next(cx));
        self.yielded = item.is_some();
        Poll::Ready(item)
    }
}

/// What an upload of one `file` and an optional `name` sent.
pub(crate) struct Upload {
    /// The file, streamed to a temporary path; its size; the file name the client gave.
    pub file: (TempFile, u64, Option<String>),
    /// The `name` field as sent (callers trim it).
    pub name: Option<String>,
    /// Every other field, in the order sent, each at most [`FIELD_LIMIT`] bytes (a document
    /// [`DOCUMENT_LIMIT`]).
    pub fields: Vec<(String, String)>,
}

impl Upload {
    /// The last value sent for field `name`.
    pub fn field(&self, name: &str) -> Option<&str> {
        self.fields.iter().rev().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// Fields an upload may send besides its file and name: enough for any form, and a bound on
/// what a client can make the server hold.
pub(crate) const MAX_FIELDS: usize = 32;

/// Reads an upload of one `file` field, streamed to `temp` and counted against `limit`, and an
/// optional `name`; the fields named in `documents` are read up to [`DOCUMENT_LIMIT`], every
/// other one up to [`FIELD_LIMIT`]. `what` names the upload in the errors ("upload", "import").
pub(crate) async fn read_upload(
    BoundedMultipart(multipart): &mut BoundedMultipart,
    temp: PathBuf,
    limit: u64,
    what: &str,
    documents: &[&str],
) -> ApiResult<Upload> {
    let mut name = None;
    let mut file = None;
    let mut fields = Vec::new();
    while let Some(mut field) = multipart.next_field().await? {
        let field_name = field.name().map(str::to_string);
        match field_name.as_deref() {
            Some("file") => {
                if file.is_some() {
                    return Err(ApiError::bad_request(format!("send one file per {what}")));
                }
                let original = field.file_name().map(str::to_string);
                let (kept, size) = stream_to_temp(&mut field, temp.clone(), limit).await?;
                file = Some((kept, size, original));
            }
            Some("name") => name = Some(read_small_field(&mut field, FIELD_LIMIT).await?),
            other => {
                let document = other.is_some_and(|name| documents.contains(&name));
                let field_limit = if document { DOCUMENT_LIMIT } else { FIELD_LIMIT };
                let value = read_small_field(&mut field, field_limit).await?;
                if fields.len() == MAX_FIELDS {
                    return Err(ApiError::bad_request(format!(
                        "the {what} sends more than {MAX_FIELDS} fields"
                    )));
                }
                fields.push((field_name.unwrap_or_default(), value));
            }
        }
    }
    let Some(file) = file else {
        return Err(ApiError::bad_request(format!("the {what} needs a \"file\" field")));
    };
    Ok(Upload { file, name, fields })
}

/// Deletes the temporary file unless the upload is kept.
pub(crate) struct TempFile(pub(crate) Option<PathBuf>);

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// 413 before reading anything when the declared body is larger than `limit` allows.
pub(crate) fn refuse_declared_oversize(headers: &HeaderMap, limit: u64) -> ApiResult<()> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit.saturating_add(MULTIPART_OVERHEAD)) {
        return Err(too_large(limit));
    }
    Ok(())
}

/// Streams a multipart field into a new file at `path`, counting it against `limit` as it
/// arrives; returns the file (deleted on drop unless kept) and its size.
pub(crate) async fn stream_to_temp(
    field: &mut Field<'_>,
    path: PathBuf,
    limit: u64,
) -> ApiResult<(TempFile, u64)> {
    let temp = TempFile(Some(path.clone()));
    let mut out = tokio::fs::File::create(&path).await?;
    let mut size = 0u64;
    while let Some(chunk) = field.chunk().await? {
        size += chunk.len() as u64;
        if size > limit {
            return Err(too_large(limit));
        }
        out.write_all(&chunk).await?;
    }
    out.flush().await?;
    out.sync_all().await?;
    Ok((temp, size))
}

pub(crate) fn too_large(limit: u64) -> ApiError {
    ApiError::TooLarge(format!(
        "the file is larger than the upload limit of {} (set max_upload_mb to raise it)",
        human_bytes(limit)
    ))
}

fn human_bytes(bytes: u64) -> String {
    if bytes >= 1 << 20 {
        format!("{:.1} MiB", bytes as f64 / f64::from(1u32 << 20))
    } else {
        format!("{bytes} bytes")
    }
}
