//! What every handler and service reaches: [`AppState`], plain data (config, SQLite pool,
//! GPUs, queue, live job news, the try-it slot, pulls under way) opened with nothing running.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use sqlx::SqlitePool;
use tokio::sync::broadcast;

use crate::config::Config;
use crate::db;
use crate::gpus::Gpus;
use crate::jobs::queue::Queue;
use crate::tryit::slot::TryIt;
use crate::watchers::Watchers;

/// Live job news for SSE viewers: one broadcast channel for all jobs, filtered per viewer.
#[derive(Debug, Clone)]
pub struct JobMessage {
    pub job_id: i64,
    /// "metric", "status" or "log": the SSE event name.
    pub kind: &'static str,
    /// JSON for metric and status, text for log.
    pub data: String,
}

/// Messages a viewer may fall behind by before it loses the oldest.
const BROADCAST_CAPACITY: usize = 4096;

/// What every handler can reach. Cheap to clone: handlers get a copy per request.
#[derive(Clone, Debug)]
pub struct AppState {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: Config,
    pool: SqlitePool,
    gpus: Gpus,
    queue: Queue,
    events: broadcast::Sender<JobMessage>,
    tryit: TryIt,
    pulls: crate::hub::progress::Pulls,
    watchers: Watchers,
}

impl AppState {
    /// Opens the appliance in `config.data_dir` with the GPUs NVML finds.
    pub async fn open(config: Config) -> anyhow::Result<AppState> {
        Self::open_with(config, Gpus::detect()).await
    }

    /// Creates the data directory's layout and opens and migrates the database; nothing runs
    /// until [`crate::start`].
    pub async fn open_with(config: Config, gpus: Gpus) -> anyhow::Result<AppState> {
        for dir in [
            config.data_dir.clone(),
            config.data_dir.join("datasets"),
            config.data_dir.join("runs"),
        ] {
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("cannot create the data directory {}", dir.display()))?;
        }
        let pool = db::open(&config.database_path()).await?;
        // Jobs stored before their summaries were kept (migration 0010) get theirs now.
        crate::store::jobs::summarise_again(&mut *pool.acquire().await?, None)
            .await
            .context("cannot summarise the jobs' metrics")?;
        let queue = Queue::default();
        let (events, _) = broadcast::channel(BROADCAST_CAPACITY);
        let tryit = TryIt::default();
        let pulls = crate::hub::progress::Pulls::default();
        let watchers = Watchers::new(config.max_streams_per_user, config.max_streams);
        let inner = Inner { config, pool, gpus, queue, events, tryit, pulls, watchers };
        Ok(AppState { inner: Arc::new(inner) })
    }

    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// Where the appliance keeps its database, uploads and runs.
    pub fn data_dir(&self) -> &Path {
        &self.inner.config.data_dir
    }

    pub fn datasets_dir(&self) -> PathBuf {
        self.data_dir().join("datasets")
    }

    pub fn runs_dir(&self) -> PathBuf {
        self.data_dir().join("runs")
    }

    /// Local Hugging Face model folders, one per subfolder.
    pub fn models_dir(&self) -> PathBuf {
        self.data_dir().join("models")
    }

    pub fn pool(&self) -> &SqlitePool {
        &self.inner.pool
    }

    pub fn gpus(&self) -> &Gpus {
        &self.inner.gpus
    }

    pub fn queue(&self) -> &Queue {
        &self.inner.queue
    }

    /// The model kept loaded for "try it".
    pub fn tryit(&self) -> &TryIt {
        &self.inner.tryit
    }

    /// Models being pulled from the Hugging Face Hub.
    pub fn pulls(&self) -> &crate::hub::progress::Pulls {
        &self.inner.pulls
    }

    /// Sends news of a job to whoever watches; nobody watching is fine.
    pub fn publish(&self, job_id: i64, kind: &'static str, data: String) {
        let _ = self.inner.events.send(JobMessage { job_id, kind, data });
    }

    pub fn subscribe(&self) -> broadcast::Receiver<JobMessage> {
        self.inner.events.subscribe()
    }

    /// The live streams open now, and their caps.
    pub fn watchers(&self) -> &Watchers {
        &self.inner.watchers
    }
}
