//! The appliance's settings, decided once at start: defaults, then the TOML config file, then
//! environment variables and flags (which clap merges; a flag wins over its variable).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use serde::Deserialize;

/// Everything the server needs to know besides its database.
#[derive(Debug, Clone)]
pub struct Config {
    /// Address to listen on, as host:port.
    pub addr: String,
    /// Database, uploads, runs and local model folders (`models/<name>/`).
    pub data_dir: PathBuf,
    /// Largest dataset upload accepted, in bytes.
    pub max_upload_bytes: u64,
    /// How long a session lasts after login.
    pub session_ttl: Duration,
    /// Whether browsers reach the appliance over HTTPS (served with TLS, or behind a proxy that
    /// terminates it): session cookies are then `Secure`, and HSTS is sent.
    pub https: bool,
    pub limits: JobLimits,
}

/// What one job may ask for.
#[derive(Debug, Clone)]
pub struct JobLimits {
    pub max_steps: u64,
    pub max_seq_len: usize,
    /// Queued plus running jobs one user may have at once.
    pub max_active_jobs_per_user: u32,
}

impl JobLimits {
    /// The engine's limits lowered to this appliance's.
    pub fn engine(&self) -> sluice_engine::train::Limits {
        sluice_engine::train::Limits::ENGINE.at_most(self.max_steps, self.max_seq_len)
    }
}

impl Config {
    pub const DEFAULT_ADDR: &'static str = "127.0.0.1:8080";
    pub const DEFAULT_DATA_DIR: &'static str = "./sluice-data";

    /// Defaults for everything but the data directory.
    pub fn new(data_dir: impl Into<PathBuf>) -> Config {
        Config {
            addr: Self::DEFAULT_ADDR.to_string(),
            data_dir: data_dir.into(),
            max_upload_bytes: 256 << 20,
            session_ttl: Duration::from_secs(7 * 24 * 3600),
            https: false,
            limits: JobLimits {
                max_steps: 1_000_000,
                max_seq_len: 131_072,
                max_active_jobs_per_user: 20,
            },
        }
    }

    /// Where the database lives.
    pub fn database_path(&self) -> PathBuf {
        self.data_dir.join("sluice.db")
    }

    /// Applies the settings a config file states.
    pub fn apply_file(&mut self, file: &FileConfig) {
        if let Some(addr) = &file.addr {
            self.addr.clone_from(addr);
        }
        if let Some(dir) = &file.data_dir {
            self.data_dir.clone_from(dir);
        }
        if let Some(mb) = file.max_upload_mb {
            self.max_upload_bytes = mb.saturating_mul(1 << 20);
        }
        if let Some(hours) = file.session_hours {
            self.session_ttl = Duration::from_secs(hours.saturating_mul(3600));
        }
        if let Some(n) = file.max_steps {
            self.limits.max_steps = n;
        }
        if let Some(n) = file.max_seq_len {
            self.limits.max_seq_len = n;
        }
        if let Some(n) = file.max_active_jobs_per_user {
            self.limits.max_active_jobs_per_user = n;
        }
    }
}

/// `sluice.toml`: every key optional, unknown keys refused (a typo should not pass silently).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub addr: Option<String>,
    pub data_dir: Option<PathBuf>,
    pub max_upload_mb: Option<u64>,
    pub session_hours: Option<u64>,
    pub max_steps: Option<u64>,
    pub max_seq_len: Option<usize>,
    pub max_active_jobs_per_user: Option<u32>,
}

impl FileConfig {
    pub fn read(path: &Path) -> anyhow::Result<FileConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the config file {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("bad config file {}", path.display()))
    }
}
