use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What every handler can reach. Cheap to clone: handlers get a copy per request.
#[derive(Clone, Debug)]
pub struct AppState {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    data_dir: PathBuf,
}

impl AppState {
    /// `data_dir` must already exist; the `serve` subcommand creates it.
    pub fn new(data_dir: PathBuf) -> Self {
        Self { inner: Arc::new(Inner { data_dir }) }
    }

    /// Where the appliance keeps its database, uploads and runs.
    pub fn data_dir(&self) -> &Path {
        &self.inner.data_dir
    }
}
