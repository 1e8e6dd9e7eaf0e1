//! `sluice serve`: run the web appliance until Ctrl-C or SIGTERM.

use std::io::ErrorKind;
use std::path::PathBuf;

use anyhow::Context;
use tokio::net::TcpListener;
use tracing::{info, warn};

use crate::config::{Config, FileConfig};
use crate::{AppState, app};

#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// Address to listen on, as host:port [default: 127.0.0.1:8080].
    #[arg(long, env = "SLUICE_ADDR")]
    addr: Option<String>,

    /// Where Sluice keeps its database, uploads, runs and local models (models/<name>/); created
    /// if missing [default: ./sluice-data].
    #[arg(long, env = "SLUICE_DATA_DIR")]
    data_dir: Option<PathBuf>,

    /// TOML config file [default: DATA_DIR/sluice.toml when it exists]. Flags and SLUICE_*
    /// variables override it.
    #[arg(long, env = "SLUICE_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,

    /// Largest dataset upload, in MiB [default: 256].
    #[arg(long, env = "SLUICE_MAX_UPLOAD_MB")]
    max_upload_mb: Option<u64>,

    /// Hours a login lasts [default: 168].
    #[arg(long, env = "SLUICE_SESSION_HOURS")]
    session_hours: Option<u64>,

    /// Most optimizer steps one job may ask for [default: 1000000].
    #[arg(long, env = "SLUICE_MAX_STEPS")]
    max_steps: Option<u64>,

    /// Longest sequence length a job may ask for [default: 131072].
    #[arg(long, env = "SLUICE_MAX_SEQ_LEN")]
    max_seq_len: Option<usize>,

    /// Queued plus running jobs one user may have [default: 20].
    #[arg(long, env = "SLUICE_MAX_ACTIVE_JOBS")]
    max_active_jobs: Option<u32>,
}

impl ServeArgs {
    /// Defaults, then the config file, then environment and flags.
    fn config(&self) -> anyhow::Result<Config> {
        let mut config = Config::new(Config::DEFAULT_DATA_DIR);
        let file = match &self.config {
            Some(path) => Some(FileConfig::read(path)?),
            None => {
                let dir = self
                    .data_dir
                    .clone()
                    .unwrap_or_else(|| PathBuf::from(Config::DEFAULT_DATA_DIR));
                let path = dir.join("sluice.toml");
                if path.is_file() { Some(FileConfig::read(&path)?) } else { None }
            }
        };
        if let Some(file) = &file {
            config.apply_file(file);
        }
        let overrides = FileConfig {
            addr: self.addr.clone(),
            data_dir: self.data_dir.clone(),
            max_upload_mb: self.max_upload_mb,
            session_hours: self.session_hours,
            max_steps: self.max_steps,
            max_seq_len: self.max_seq_len,
            max_active_jobs_per_user: self.max_active_jobs,
        };
        config.apply_file(&overrides);
        Ok(config)
    }
}

pub(crate) fn run(args: ServeArgs) -> anyhow::Result<()> {
    let config = args.config()?;
    std::fs::create_dir_all(&config.data_dir).with_context(|| {
        format!("cannot create the data directory {}", config.data_dir.display())
    })?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(config))
}

async fn serve(config: Config) -> anyhow::Result<()> {
    let addr = config.addr.clone();
    let listener = TcpListener::bind(&addr).await.map_err(|err| {
        let hint = if err.kind() == ErrorKind::AddrInUse {
            " (choose another with --addr or SLUICE_ADDR)"
        } else {
            ""
        };
        anyhow::Error::new(err).context(format!("cannot listen on {addr}{hint}"))
    })?;
    let state = AppState::open(config).await?;
    crate::start(&state).await?;
    let local = listener.local_addr().context("cannot read the bound address")?;
    info!(
        data_dir = %state.data_dir().display(),
        "Sluice {} listening on http://{local}",
        env!("CARGO_PKG_VERSION")
    );
    let (stopping_tx, mut stopping) = tokio::sync::watch::channel(false);
    let server = axum::serve(listener, app(state)).with_graceful_shutdown(async move {
        shutdown_signal().await;
        let _ = stopping_tx.send(true);
    });
    // Live event streams never finish by themselves: after the signal they get a few seconds,
    // then the process stops anyway (a job still training is marked interrupted at next start).
    let grace = async {
        let _ = stopping.wait_for(|stopping| *stopping).await;
        tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    };
    tokio::select! {
        result = server => result.context("the server stopped with an error")?,
        () = grace => warn!("connections still open 5 s after the signal; stopping anyway"),
    }
    info!("stopped");
    Ok(())
}

/// Resolves on the first Ctrl-C or SIGTERM; `axum::serve` then stops accepting connections and
/// waits for in-flight requests. A signal that cannot be watched is logged and never fires, so
/// the other one still works.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(err) = tokio::signal::ctrl_c().await {
            warn!("cannot watch for Ctrl-C: {err}");
            std::future::pending::<()>().await;
        }
    };

    #[cfg(unix)]
    let terminate = async {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut sigterm) => {
                sigterm.recv().await;
            }
            Err(err) => {
                warn!("cannot watch for SIGTERM: {err}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();

    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
    info!("shutting down: finishing in-flight requests");
}
