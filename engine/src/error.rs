//! The engine's one error type. Every variant carries enough context (which file, which tensor,
//! which line, expected versus actual) for a person to fix the input without reading code.

use std::path::PathBuf;

/// Result with the engine's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file or folder could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A model's `config.json` is missing, unparsable, unsupported or inconsistent.
    #[error("model config {path}: {message}")]
    Config { path: PathBuf, message: String },
    /// Weights are missing, truncated, of the wrong shape or of an unsupported dtype.
    #[error("weights {path}: {message}")]
    Weights { path: PathBuf, message: String },
    /// The tokenizer or chat template could not be loaded or applied.
    #[error("tokenizer {path}: {message}")]
    Tokenizer { path: PathBuf, message: String },
    /// A dataset record is malformed; `line` is 1-based (for JSON arrays, the record's index + 1).
    #[error("dataset {path}, line {line}: {message}")]
    DatasetRecord { path: PathBuf, line: usize, message: String },
    /// The dataset as a whole cannot be used (empty, unknown format, nothing to train on).
    #[error("dataset {path}: {message}")]
    Dataset { path: PathBuf, message: String },
    /// A training option is out of range (sequence length 0, batch too small, ...).
    #[error("invalid option: {0}")]
    Invalid(String),
    /// A backend operation failed (device out of memory, kernel launch failure, ...).
    #[error("backend {backend}: {message}")]
    Backend { backend: String, message: String },
    /// A numerical problem stopped training (non-finite loss or gradient).
    #[error("training stopped: {0}")]
    Numerical(String),
    /// A step was abandoned between micro-batches because the run was asked to stop; nothing
    /// of it was applied.
    #[error("the step was interrupted")]
    Interrupted,
}

impl Error {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }

    pub fn config(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Config { path: path.into(), message: message.into() }
    }

    pub fn weights(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Weights { path: path.into(), message: message.into() }
    }

    pub fn tokenizer(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Tokenizer { path: path.into(), message: message.into() }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Error::Invalid(message.into())
    }
}
