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
    /// Certificate chain and private key when the appliance serves HTTPS itself.
    pub tls: Option<TlsFiles>,
    /// The URL browsers use when it is not `addr` (behind a reverse proxy), without a trailing
    /// slash.
    pub public_url: Option<String>,
    pub limits: JobLimits,
    pub hub: HubSettings,
    /// The disk tier's folder, where jobs keep Adam moments that host memory cannot hold (on a
    /// local SSD); `None`: `DATA_DIR/disk-tier` ([`Config::disk_tier_dir`]).
    pub disk_dir: Option<PathBuf>,
    /// Hosts a webhook may reach although they are on this machine or a private network (a
    /// department's own relay), by name as the URL writes it; every other private, loopback or
    /// link-local target is refused (`webhooks.rs`).
    pub webhook_private_hosts: Vec<String>,
    /// Live views (a job's event stream) one user may hold open at once, and the server in all.
    pub max_streams_per_user: usize,
    pub max_streams: usize,
}

/// Where models by Hugging Face name come from.
#[derive(Debug, Clone)]
pub struct HubSettings {
    /// The Hub's URL without a trailing slash (`HF_ENDPOINT`).
    pub endpoint: String,
    /// For gated and private repos (`HF_TOKEN`); never shown to users or logged.
    pub token: Option<crate::hub::HubToken>,
    /// The user's own Hugging Face cache, read (never written) for models already there;
    /// `None` reads none.
    pub user_cache: Option<PathBuf>,
}

/// PEM files for HTTPS: the certificate chain (leaf first) and its private key.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// What one job may ask for.
#[derive(Debug, Clone)]
pub struct JobLimits {
    pub max_steps: u64,
    pub max_seq_len: usize,
    /// Queued plus running jobs one user may have at once.
    pub max_active_jobs_per_user: u32,
    /// Periodic checkpoints a run keeps: the latest N, plus the best by eval loss.
    pub keep_checkpoints: usize,
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
            tls: None,
            public_url: None,
            limits: JobLimits {
                max_steps: 1_000_000,
                max_seq_len: 131_072,
                max_active_jobs_per_user: 20,
                keep_checkpoints: 3,
            },
            // No user cache by default: `serve` finds it from the environment.
            hub: HubSettings {
                endpoint: crate::hub::DEFAULT_ENDPOINT.to_string(),
                token: None,
                user_cache: None,
            },
            disk_dir: None,
            webhook_private_hosts: Vec::new(),
            max_streams_per_user: 32,
            max_streams: 1024,
        }
    }

    /// The disk tier's folder: the one configured, else `DATA_DIR/disk-tier`.
    pub fn disk_tier_dir(&self) -> PathBuf {
        self.disk_dir.clone().unwrap_or_else(|| self.data_dir.join("disk-tier"))
    }

    /// Where the database lives.
    pub fn database_path(&self) -> PathBuf {
        self.data_dir.join("sluice.db")
    }

    /// The appliance's own Hugging Face cache, where pulls land.
    pub fn hub_dir(&self) -> PathBuf {
        self.data_dir.join("hub")
    }

    /// Applies the settings a config file states, with flags and variables merged in first
    /// ([`FileConfig::or`]: a certificate and its key may come from different places). Refuses a
    /// certificate without its key (or the reverse) and a public URL that is not http(s); TLS
    /// files or an https:// public URL turn `https` on.
    pub fn apply_file(&mut self, file: &FileConfig) -> anyhow::Result<()> {
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
        if let Some(n) = file.max_streams_per_user {
            anyhow::ensure!(n > 0, "max_streams_per_user must be at least 1");
            self.max_streams_per_user = n;
        }
        if let Some(n) = file.max_streams {
            anyhow::ensure!(n > 0, "max_streams must be at least 1");
            self.max_streams = n;
        }
        if let Some(n) = file.max_active_jobs_per_user {
            self.limits.max_active_jobs_per_user = n;
        }
        if let Some(n) = file.keep_checkpoints {
            anyhow::ensure!(n >= 1, "keep_checkpoints must be at least 1 (the latest checkpoint)");
            self.limits.keep_checkpoints = n;
        }
        match (&file.tls_cert, &file.tls_key) {
            (None, None) => {}
            (Some(cert), Some(key)) => {
                self.tls = Some(TlsFiles { cert: cert.clone(), key: key.clone() });
                self.https = true;
            }
            (Some(_), None) => anyhow::bail!(
                "tls_cert is set but tls_key is not: HTTPS needs both \
                 (--tls-key, SLUICE_TLS_KEY or tls_key in sluice.toml)"
            ),
            (None, Some(_)) => anyhow::bail!(
                "tls_key is set but tls_cert is not: HTTPS needs both \
                 (--tls-cert, SLUICE_TLS_CERT or tls_cert in sluice.toml)"
            ),
        }
        if let Some(endpoint) = &file.hf_endpoint {
            let lower = endpoint.to_ascii_lowercase();
            anyhow::ensure!(
                lower.starts_with("https://") || lower.starts_with("http://"),
                "hf_endpoint {endpoint:?} must start with https:// or http://"
            );
            self.hub.endpoint = endpoint.trim_end_matches('/').to_owned();
        }
        if let Some(token) = &file.hf_token {
            self.hub.token = Some(token.clone());
        }
        if let Some(dir) = &file.hf_cache {
            self.hub.user_cache = Some(dir.clone());
        }
        if let Some(dir) = &file.disk_dir {
            self.disk_dir = Some(dir.clone());
        }
        if let Some(hosts) = &file.webhook_private_hosts {
            for host in hosts {
                let bare = host.trim_start_matches('[').trim_end_matches(']');
                let ipv6 = bare.parse::<std::net::Ipv6Addr>().is_ok();
                anyhow::ensure!(
                    !bare.is_empty()
                        && !bare.contains(['/', '@', ' '])
                        && (ipv6 || !bare.contains(':')),
                    "webhook_private_hosts: {host:?} must be a host name or address, without a \
                     scheme, port or path"
                );
            }
            self.webhook_private_hosts.clone_from(hosts);
        }
        if let Some(url) = &file.public_url {
            let lower = url.to_ascii_lowercase();
            let (https, host) = if let Some(host) = lower.strip_prefix("https://") {
                (true, host)
            } else if let Some(host) = lower.strip_prefix("http://") {
                (false, host)
            } else {
                anyhow::bail!("public_url {url:?} must start with https:// or http://");
            };
            anyhow::ensure!(!host.trim_matches('/').is_empty(), "public_url {url:?} has no host");
            self.public_url = Some(url.trim_end_matches('/').to_owned());
            self.https |= https;
        }
        Ok(())
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
    pub max_streams_per_user: Option<usize>,
    pub max_streams: Option<usize>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub public_url: Option<String>,
    pub keep_checkpoints: Option<usize>,
    pub hf_endpoint: Option<String>,
    pub hf_token: Option<crate::hub::HubToken>,
    pub hf_cache: Option<PathBuf>,
    pub disk_dir: Option<PathBuf>,
    pub webhook_private_hosts: Option<Vec<String>>,
}

impl FileConfig {
    /// Each setting of `self`, else of `lower`: flags and variables over the file.
    pub fn or(self, lower: FileConfig) -> FileConfig {
        FileConfig {
            addr: self.addr.or(lower.addr),
            data_dir: self.data_dir.or(lower.data_dir),
            max_upload_mb: self.max_upload_mb.or(lower.max_upload_mb),
            session_hours: self.session_hours.or(lower.session_hours),
            max_steps: self.max_steps.or(lower.max_steps),
            max_seq_len: self.max_seq_len.or(lower.max_seq_len),
            max_active_jobs_per_user: self
                .max_active_jobs_per_user
                .or(lower.max_active_jobs_per_user),
            max_streams_per_user: self.max_streams_per_user.or(lower.max_streams_per_user),
            max_streams: self.max_streams.or(lower.max_streams),
            tls_cert: self.tls_cert.or(lower.tls_cert),
            tls_key: self.tls_key.or(lower.tls_key),
            public_url: self.public_url.or(lower.public_url),
            keep_checkpoints: self.keep_checkpoints.or(lower.keep_checkpoints),
            hf_endpoint: self.hf_endpoint.or(lower.hf_endpoint),
            hf_token: self.hf_token.or(lower.hf_token),
            hf_cache: self.hf_cache.or(lower.hf_cache),
            disk_dir: self.disk_dir.or(lower.disk_dir),
            webhook_private_hosts: self.webhook_private_hosts.or(lower.webhook_private_hosts),
        }
    }

    pub fn read(path: &Path) -> anyhow::Result<FileConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the config file {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("bad config file {}", path.display()))
    }
}
