//! The Hub's HTTP API, as far as a pull needs it: a repo's files at a revision
//! (`GET /api/models/{repo}/revision/{rev}?blobs=true`) and one file's bytes
//! (`GET /{repo}/resolve/{commit}/{file}`, resumed with a `Range` request). Blocking (ureq,
//! rustls with ring): callers run it on a thread of their own.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::time::Duration;

use ring::digest::{Context, SHA256};
use serde::Deserialize;
use ureq::Agent;
use ureq::http::{Response, StatusCode};

use super::{HubError, HubResult, is_commit};

/// An access token for gated and private repos. Its `Debug` never shows it, and nothing sends
/// it anywhere but the configured endpoint.
#[derive(Clone, Deserialize)]
#[serde(transparent)]
pub struct HubToken(String);

impl HubToken {
    /// `None` for an empty or blank value (an unset `HF_TOKEN=`).
    pub fn new(token: &str) -> Option<HubToken> {
        let token = token.trim();
        (!token.is_empty()).then(|| HubToken(token.to_string()))
    }
}

impl fmt::Debug for HubToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HubToken(hidden)")
    }
}

/// One file of a repo at a commit, as the Hub lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteFile {
    pub name: String,
    pub size: u64,
    /// The sha256 of an LFS file's bytes (what its blob is named after); `None` for a file
    /// kept in git, checked by size only.
    pub sha256: Option<String>,
    /// The blob's name in the cache: the sha256 for LFS files, the git blob id for others.
    pub blob: String,
}

/// A repo at one revision.
#[derive(Debug, Clone)]
pub struct RepoInfo {
    pub commit: String,
    pub files: Vec<RemoteFile>,
}

#[derive(Deserialize)]
struct RawInfo {
    sha: Option<String>,
    #[serde(default)]
    siblings: Vec<RawSibling>,
}

#[derive(Deserialize)]
struct RawSibling {
    rfilename: String,
    size: Option<u64>,
    #[serde(rename = "blobId")]
    blob_id: Option<String>,
    lfs: Option<RawLfs>,
}

#[derive(Deserialize)]
struct RawLfs {
    sha256: String,
    size: u64,
}

/// The largest answer read whole: a repo listing or a weight index.
const SMALL_LIMIT: u64 = 64 << 20;

/// Bytes copied between progress reports.
const CHUNK: usize = 1 << 20;

/// A Hub endpoint with its token.
#[derive(Debug, Clone)]
pub struct Hub {
    endpoint: String,
    token: Option<HubToken>,
    agent: Agent,
}

impl Hub {
    pub fn new(endpoint: &str, token: Option<HubToken>) -> Hub {
        let config = Agent::config_builder()
            // Statuses are read here: a 401 or 404 has its own message.
            .http_status_as_error(false)
            // LFS files redirect to a CDN with a signed URL: the token stays with the Hub.
            .redirect_auth_headers(ureq::config::RedirectAuthHeaders::SameHost)
            .timeout_connect(Some(Duration::from_secs(30)))
            .timeout_recv_response(Some(Duration::from_secs(120)))
            .timeout_per_read(Some(Duration::from_secs(120)))
            .user_agent(concat!("sluice/", env!("CARGO_PKG_VERSION")))
            .build();
        Hub { endpoint: endpoint.trim_end_matches('/').to_string(), token, agent: config.into() }
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn get(&self, url: &str, range_from: u64) -> HubResult<Response<ureq::Body>> {
        let mut request = self.agent.get(url);
        if let Some(HubToken(token)) = &self.token {
            request = request.header("Authorization", format!("Bearer {token}"));
        }
        if range_from > 0 {
            request = request.header("Range", format!("bytes={range_from}-"));
        }
        request.call().map_err(|err| {
            HubError::Failed(format!("cannot reach the Hub at {}: {err}", self.endpoint))
        })
    }

    /// The refusals every Hub answer can carry, in the user's words: the Hub's `X-Error-Code`
    /// first (it answers 401 for a repo that does not exist, so as not to reveal private ones).
    fn refusal(&self, response: &Response<ureq::Body>, repo: &str, revision: &str) -> HubError {
        let status = response.status();
        let code = response
            .headers()
            .get("x-error-code")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        let endpoint = &self.endpoint;
        if matches!(code, "RevisionNotFound" | "EntryNotFound") {
            return HubError::NotFound(format!(
                "{repo} has no revision {revision:?} on {endpoint}"
            ));
        }
        let denied = code == "GatedRepo"
            || status == StatusCode::FORBIDDEN
            || (status == StatusCode::UNAUTHORIZED && code != "RepoNotFound");
        if denied {
            return HubError::Denied(if self.token.is_some() {
                format!(
                    "{repo} is gated or private and the access token does not open it: accept \
                     its terms on the Hub with the token's account"
                )
            } else {
                format!(
                    "{repo} is gated or private: accept its terms on the Hub, then give the \
                     server an access token (HF_TOKEN or --hf-token)"
                )
            });
        }
        if code == "RepoNotFound"
            || status == StatusCode::NOT_FOUND
            || status == StatusCode::UNAUTHORIZED
        {
            return HubError::NotFound(format!(
                "no model {repo} on {endpoint} (check the name; a private repo needs an access \
                 token)"
            ));
        }
        HubError::Failed(format!("the Hub at {endpoint} answered {status} for {repo}"))
    }

    /// The repo's files at `revision` (a branch, tag or commit) and the commit it stands for.
    pub fn info(&self, repo: &str, revision: &str) -> HubResult<RepoInfo> {
        let url = format!(
            "{}/api/models/{repo}/revision/{}?blobs=true",
            self.endpoint,
            encode_segment(revision)
        );
        let mut response = self.get(&url, 0)?;
        if response.status() != StatusCode::OK {
            return Err(self.refusal(&response, repo, revision));
        }
        let garbled = |why: String| {
            HubError::Failed(format!("the Hub's listing of {repo} at {revision} is garbled: {why}"))
        };
        let text = response
            .body_mut()
            .with_config()
            .limit(SMALL_LIMIT)
            .read_to_string()
            .map_err(|e| garbled(e.to_string()))?;
        let raw: RawInfo = serde_json::from_str(&text).map_err(|e| garbled(e.to_string()))?;
        let commit =
            raw.sha.filter(|sha| is_commit(sha)).ok_or_else(|| garbled("no commit".into()))?;
        let mut files = Vec::new();
        for sibling in raw.siblings {
            let (sha256, size, blob) = match sibling.lfs {
                Some(lfs) => {
                    let sha = lfs.sha256.to_ascii_lowercase();
                    if sha.len() != 64 || !sha.bytes().all(|b| b.is_ascii_hexdigit()) {
                        return Err(garbled(format!("{}: bad sha256", sibling.rfilename)));
                    }
                    (Some(sha.clone()), lfs.size, sha)
                }
                None => {
                    let blob = sibling.blob_id.unwrap_or_default().to_ascii_lowercase();
                    let size = sibling
                        .size
                        .ok_or_else(|| garbled(format!("{}: no size", sibling.rfilename)))?;
                    if !is_commit(&blob) {
                        return Err(garbled(format!("{}: no blob id", sibling.rfilename)));
                    }
                    (None, size, blob)
                }
            };
            files.push(RemoteFile { name: sibling.rfilename, size, sha256, blob });
        }
        Ok(RepoInfo { commit, files })
    }

    fn resolve_url(&self, repo: &str, commit: &str, file: &str) -> String {
        format!("{}/{repo}/resolve/{commit}/{}", self.endpoint, encode_segment(file))
    }

    /// A small file (the weight index, config.json) as text; also how a pull learns, before
    /// downloading anything large, that the token opens a gated repo.
    pub fn fetch_text(&self, repo: &str, commit: &str, file: &str) -> HubResult<String> {
        let mut response = self.get(&self.resolve_url(repo, commit, file), 0)?;
        if response.status() != StatusCode::OK {
            return Err(self.refusal(&response, repo, commit));
        }
        response.body_mut().with_config().limit(SMALL_LIMIT).read_to_string().map_err(|e| {
            HubError::Failed(format!("cannot read {file} of {repo} from the Hub: {e}"))
        })
    }

    /// Downloads `file` into `partial`, going on from the bytes already there (a `Range`
    /// request; a server that ignores it sends everything again), reporting the bytes held after
    /// each chunk. On return the partial file holds exactly the announced bytes: the right size,
    /// and for LFS files the announced sha256. A wrong sha256 removes the partial file, so the
    /// next pull starts afresh.
    pub fn download(
        &self,
        repo: &str,
        commit: &str,
        file: &RemoteFile,
        partial: &Path,
        progress: &mut dyn FnMut(u64),
    ) -> HubResult<()> {
        let disk = |e: std::io::Error| {
            HubError::Failed(format!("cannot write {}: {e}", partial.display()))
        };
        let mut out =
            OpenOptions::new().create(true).read(true).append(true).open(partial).map_err(disk)?;
        let mut have = out.metadata().map_err(disk)?.len();
        if have > file.size {
            out.set_len(0).map_err(disk)?;
            have = 0;
        }
        let mut hasher = file.sha256.as_ref().map(|_| Context::new(&SHA256));
        if let Some(hasher) = hasher.as_mut()
            && have > 0
        {
            hash_prefix(&mut out, have, hasher).map_err(disk)?;
        }
        progress(have);
        if have < file.size {
            let mut response = self.get(&self.resolve_url(repo, commit, &file.name), have)?;
            match response.status() {
                StatusCode::PARTIAL_CONTENT if content_range_start(&response) == Some(have) => {}
                StatusCode::OK => {
                    // The whole file again: start over.
                    out.set_len(0).map_err(disk)?;
                    have = 0;
                    hasher = file.sha256.as_ref().map(|_| Context::new(&SHA256));
                }
                StatusCode::PARTIAL_CONTENT | StatusCode::RANGE_NOT_SATISFIABLE => {
                    // Not the range asked for: drop the partial file; the next pull starts anew.
                    drop(out);
                    let _ = std::fs::remove_file(partial);
                    return Err(HubError::Failed(format!(
                        "the Hub did not resume {} at byte {have}; pull again to start it afresh",
                        file.name
                    )));
                }
                _ => return Err(self.refusal(&response, repo, commit)),
            }
            if let Some(served) =
                response.headers().get("x-repo-commit").and_then(|v| v.to_str().ok())
                && served != commit
            {
                return Err(HubError::Failed(format!(
                    "the Hub served {} of commit {served}, not of {commit}",
                    file.name
                )));
            }
            let mut body = response.body_mut().as_reader();
            let mut buffer = vec![0u8; CHUNK];
            loop {
                let n = match body.read(&mut buffer) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        out.sync_all().map_err(disk)?;
                        return Err(HubError::Failed(format!(
                            "the download of {} broke off at byte {have} ({e}); pull again to \
                             resume it",
                            file.name
                        )));
                    }
                };
                let bytes = &buffer[..n];
                if have + n as u64 > file.size {
                    drop(out);
                    let _ = std::fs::remove_file(partial);
                    return Err(HubError::Checksum(format!(
                        "{} is larger than the {} bytes the Hub announced; the download was \
                         removed",
                        file.name, file.size
                    )));
                }
                out.write_all(bytes).map_err(disk)?;
                if let Some(hasher) = hasher.as_mut() {
                    hasher.update(bytes);
                }
                have += n as u64;
                progress(have);
            }
            out.sync_all().map_err(disk)?;
        }
        if have != file.size {
            return Err(HubError::Failed(format!(
                "the download of {} ended at {have} of {} bytes; pull again to resume it",
                file.name, file.size
            )));
        }
        if let (Some(hasher), Some(expected)) = (hasher, &file.sha256) {
            let got = hex(hasher.finish().as_ref());
            if &got != expected {
                drop(out);
                let _ = std::fs::remove_file(partial);
                return Err(HubError::Checksum(format!(
                    "checksum mismatch for {}: its sha256 is {got}, the Hub announced {expected}; \
                     the download was removed",
                    file.name
                )));
            }
        }
        Ok(())
    }
}

/// Feeds the first `len` bytes of `file` to `hasher`.
fn hash_prefix(file: &mut File, len: u64, hasher: &mut Context) -> std::io::Result<()> {
    file.seek(SeekFrom::Start(0))?;
    let mut reader = file.take(len);
    let mut buffer = vec![0u8; CHUNK];
    loop {
        let n = reader.read(&mut buffer)?;
        if n == 0 {
            return Ok(());
        }
        hasher.update(&buffer[..n]);
    }
}

/// The first byte of a 206's `Content-Range: bytes FIRST-LAST/SIZE`.
fn content_range_start(response: &Response<ureq::Body>) -> Option<u64> {
    let value = response.headers().get("content-range")?.to_str().ok()?;
    let range = value.strip_prefix("bytes ")?;
    range.split('-').next()?.trim().parse().ok()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A URL path segment: unreserved characters kept, every other byte percent-encoded.
fn encode_segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{HubToken, encode_segment, hex};

    #[test]
    fn tokens_never_print() {
        let token = HubToken::new(" hf_secret ").expect("token");
        assert_eq!(format!("{token:?}"), "HubToken(hidden)");
        assert!(HubToken::new("  ").is_none());
    }

    #[test]
    fn segments_and_digests_are_encoded() {
        assert_eq!(
            encode_segment("model-00001-of-00002.safetensors"),
            "model-00001-of-00002.safetensors"
        );
        assert_eq!(encode_segment("a b/c"), "a%20b%2Fc");
        assert_eq!(hex(&[0, 15, 255]), "000fff");
    }
}
