//! Models by Hugging Face name: the Hub's HTTP API (`client.rs`), its cache folder layout
//! (`cache.rs`), and a pull that brings a repo's safetensors model into a cache (`pull.rs`).
//!
//! Pulls land in the layout `huggingface_hub` writes, so the appliance's own cache
//! (`DATA_DIR/hub`) and the user's (`~/.cache/huggingface/hub`) are read by the same code:
//!
//! ```text
//! models--Org--Name/
//!   refs/main                 the commit a branch or tag name stands for
//!   blobs/<sha256 or git sha1>   each file's bytes once (`.incomplete` while downloading)
//!   snapshots/<commit>/<file>    symlinks to ../../blobs/<hash>
//! ```
//!
//! Nothing here knows of HTTP handlers or users; the API and `sluice pull` call [`pull::pull`]
//! on a blocking thread.

pub mod cache;
pub mod client;
pub mod progress;
pub mod pull;

use std::fmt;

pub use cache::CachedModel;
pub use client::{Hub, HubToken};
pub use pull::{FileProgress, PullProgress, pull};

/// The Hub's public endpoint, used when `HF_ENDPOINT` names none.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Why a pull did not happen, in words for the person who asked for it.
#[derive(Debug)]
pub enum HubError {
    /// A repo id or revision that cannot name a model (refused before any request).
    BadName(String),
    /// The Hub has no such repo or revision.
    NotFound(String),
    /// The repo is gated or private and the token (or its absence) does not open it.
    Denied(String),
    /// The repo exists but Sluice cannot train it (no safetensors weights, no config.json).
    Unusable(String),
    /// A download whose bytes are not the ones the Hub announced.
    Checksum(String),
    /// The network, the Hub's answer, or the local disk.
    Failed(String),
}

impl fmt::Display for HubError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (HubError::BadName(m)
        | HubError::NotFound(m)
        | HubError::Denied(m)
        | HubError::Unusable(m)
        | HubError::Checksum(m)
        | HubError::Failed(m)) = self;
        f.write_str(m)
    }
}

impl std::error::Error for HubError {}

pub type HubResult<T> = Result<T, HubError>;

/// `Org/Name` (or a legacy one-part `Name`) as the Hub accepts it: letters, digits, `-`, `_`,
/// `.`, parts not starting or ending with `-` or `.`, no `--` or `..` (the cache layout uses
/// `--` as the separator), at most 96 characters.
pub fn check_repo(repo: &str) -> HubResult<()> {
    let bad = |why: &str| {
        Err(HubError::BadName(format!(
            "{repo:?} is not a Hugging Face model id ({why}); write it as Org/Name, e.g. \
             Qwen/Qwen2.5-7B-Instruct"
        )))
    };
    if repo.is_empty() || repo.len() > 96 {
        return bad("1 to 96 characters");
    }
    let parts: Vec<&str> = repo.split('/').collect();
    if parts.len() > 2 {
        return bad("at most one '/'");
    }
    for part in parts {
        if part.is_empty()
            || !part.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            return bad("letters, digits, '-', '_' and '.' only");
        }
        if part.starts_with(['-', '.']) || part.ends_with(['-', '.']) {
            return bad("a part may not start or end with '-' or '.'");
        }
        if part.contains("--") || part.contains("..") {
            return bad("no '--' or '..'");
        }
    }
    Ok(())
}

/// A branch, tag or commit name that is also one plain file name under `refs/`: letters,
/// digits, `-`, `_`, `.`, not starting with `.`, at most 100 characters.
pub fn check_revision(revision: &str) -> HubResult<()> {
    let ok = !revision.is_empty()
        && revision.len() <= 100
        && !revision.starts_with('.')
        && revision.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(HubError::BadName(format!(
            "revision {revision:?}: use a branch, tag or commit name of letters, digits, '-', '_' \
             or '.' (e.g. main)"
        )))
    }
}

/// A 40-hex-digit commit id, as the Hub's `sha` and the snapshot folders name them.
pub fn is_commit(text: &str) -> bool {
    text.len() == 40 && text.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::{check_repo, check_revision};

    #[test]
    fn repo_ids_follow_the_hub_rules() {
        for good in ["Qwen/Qwen2.5-7B-Instruct", "gpt2", "HuggingFaceTB/SmolLM2-135M", "a_b/c.d"] {
            assert!(check_repo(good).is_ok(), "{good}");
        }
        for bad in ["", "a/b/c", "/x", "x/", "a--b/c", "a/b..c", ".x/y", "a b/c", "a/é", "-a/b"] {
            assert!(check_repo(bad).is_err(), "{bad:?}");
        }
        assert!(check_revision("main").is_ok());
        assert!(check_revision("v1.0").is_ok());
        for bad in ["", "refs/pr/1", "..", ".git", "a b"] {
            assert!(check_revision(bad).is_err(), "{bad:?}");
        }
    }
}
