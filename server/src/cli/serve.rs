//! `sluice serve`: run the web appliance until Ctrl-C or SIGTERM.

use std::io::ErrorKind;
use std::path::PathBuf;

use anyhow::Context;
use tokio::net::TcpListener;
use tracing::{info, warn};

use crate::{AppState, app};

#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// Address to listen on, as host:port.
    #[arg(long, env = "SLUICE_ADDR", default_value = "127.0.0.1:8080")]
    addr: String,

    /// Where Sluice keeps its database, uploads and runs; created if missing.
    #[arg(long, env = "SLUICE_DATA_DIR", default_value = "./sluice-data")]
    data_dir: PathBuf,
}

pub(crate) fn run(args: ServeArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("cannot create the data directory {}", args.data_dir.display()))?;
    let state = AppState::new(args.data_dir);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(&args.addr, state))
}

async fn serve(addr: &str, state: AppState) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr).await.map_err(|err| {
        let hint = if err.kind() == ErrorKind::AddrInUse {
            " (choose another with --addr or SLUICE_ADDR)"
        } else {
            ""
        };
        anyhow::Error::new(err).context(format!("cannot listen on {addr}{hint}"))
    })?;
    let local = listener.local_addr().context("cannot read the bound address")?;
    info!(
        data_dir = %state.data_dir().display(),
        "Sluice {} listening on http://{local}",
        env!("CARGO_PKG_VERSION")
    );
    axum::serve(listener, app(state))
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("the server stopped with an error")?;
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
