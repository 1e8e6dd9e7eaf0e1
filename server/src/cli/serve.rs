//! `sluice serve`: run the web appliance, over HTTP or HTTPS, until Ctrl-C or SIGTERM.

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::extract::connect_info::Connected;
use axum::serve::{IncomingStream, Listener, ListenerExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::{self, PemObject};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::server::TlsStream;
use tracing::{debug, info, warn};

use crate::config::{Config, FileConfig, TlsFiles};
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

    /// Serve HTTPS with this PEM certificate chain (leaf first); needs --tls-key.
    #[arg(long, env = "SLUICE_TLS_CERT", value_name = "FILE")]
    tls_cert: Option<PathBuf>,

    /// The PEM private key of --tls-cert (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "SLUICE_TLS_KEY", value_name = "FILE")]
    tls_key: Option<PathBuf>,

    /// The URL browsers use when a reverse proxy stands in front, e.g. https://sluice.example.com;
    /// an https:// URL makes login cookies Secure and sends HSTS.
    #[arg(long, env = "SLUICE_PUBLIC_URL", value_name = "URL")]
    public_url: Option<String>,

    /// The Hugging Face Hub that models are pulled from [default: https://huggingface.co].
    #[arg(long, env = "HF_ENDPOINT", value_name = "URL")]
    hf_endpoint: Option<String>,

    /// Access token for gated and private Hugging Face repos (prefer the variable: a flag shows
    /// in the process list). Never shown to users.
    #[arg(long, env = "HF_TOKEN", hide_env_values = true, value_name = "TOKEN")]
    hf_token: Option<String>,

    /// Your Hugging Face cache, whose models are listed too [default: HF_HOME/hub, else
    /// ~/.cache/huggingface/hub].
    #[arg(long, env = "HF_HUB_CACHE", value_name = "DIR")]
    hf_cache: Option<PathBuf>,

    /// The disk tier's folder, on a local SSD: jobs keep there the Adam moments host memory
    /// cannot hold (measured once per process, when a job first needs it; created if missing)
    /// [default: DATA_DIR/disk-tier].
    #[arg(long, env = "SLUICE_DISK_DIR", value_name = "DIR")]
    disk_dir: Option<PathBuf>,
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
        let overrides = FileConfig {
            addr: self.addr.clone(),
            data_dir: self.data_dir.clone(),
            max_upload_mb: self.max_upload_mb,
            session_hours: self.session_hours,
            max_steps: self.max_steps,
            max_seq_len: self.max_seq_len,
            max_active_jobs_per_user: self.max_active_jobs,
            max_streams_per_user: None,
            max_streams: None,
            tls_cert: self.tls_cert.clone(),
            tls_key: self.tls_key.clone(),
            public_url: self.public_url.clone(),
            keep_checkpoints: None,
            hf_endpoint: self.hf_endpoint.clone(),
            hf_token: self.hf_token.as_deref().and_then(crate::hub::HubToken::new),
            hf_cache: self.hf_cache.clone(),
            disk_dir: self.disk_dir.clone(),
            // Only in the config file: a list is no flag.
            webhook_private_hosts: None,
        };
        config.apply_file(&overrides.or(file.unwrap_or_default()))?;
        if config.hub.user_cache.is_none() {
            config.hub.user_cache = crate::hub::cache::user_cache_from_env();
        }
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
    // A bad certificate or key stops the start before anything is bound or opened.
    let tls = config.tls.as_ref().map(tls_acceptor).transpose()?;
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
    let stop = shutdown_signal();
    let scheme = if tls.is_some() { "https" } else { "http" };
    info!(
        data_dir = %state.data_dir().display(),
        public_url = state.config().public_url.as_deref().unwrap_or("none"),
        "Sluice {} listening on {scheme}://{local}",
        env!("CARGO_PKG_VERSION")
    );
    let router = app(state);
    // Tapped listeners, for two reasons: small writes (an event, a token) leave at once rather
    // than wait on Nagle's algorithm, and axum hands a tapped listener's peer address to
    // `ConnectInfo` (which login throttling reads) whatever the listener.
    match tls {
        Some(acceptor) => {
            let listener = TlsListener::new(listener, acceptor)
                .context("cannot read the bound address")?
                .tap_io(|tls| no_delay(tls.get_ref().0));
            serve_until_signal(listener, router, stop).await
        }
        None => serve_until_signal(listener.tap_io(|tcp| no_delay(tcp)), router, stop).await,
    }
}

fn no_delay(tcp: &TcpStream) {
    if let Err(err) = tcp.set_nodelay(true) {
        debug!("cannot set TCP_NODELAY: {err}");
    }
}

/// Serves until `stop` (Ctrl-C or SIGTERM), then lets in-flight requests finish.
async fn serve_until_signal<L>(
    listener: L,
    router: Router,
    stop: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()>
where
    L: Listener<Addr = SocketAddr>,
    for<'a> SocketAddr: Connected<IncomingStream<'a, L>>,
{
    let (stopping_tx, mut stopping) = tokio::sync::watch::channel(false);
    let service = router.into_make_service_with_connect_info::<SocketAddr>();
    let server = axum::serve(listener, service).with_graceful_shutdown(async move {
        stop.await;
        let _ = stopping_tx.send(true);
    });
    // Live event streams never finish by themselves: after the signal they get a few seconds,
    // then the process stops anyway (a job still training is marked interrupted at next start).
    let grace = async {
        let _ = stopping.wait_for(|stopping| *stopping).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
    };
    tokio::select! {
        result = server => result.context("the server stopped with an error")?,
        () = grace => warn!("connections still open 5 s after the signal; stopping anyway"),
    }
    info!("stopped");
    Ok(())
}

/// The TLS side of HTTPS from the configured PEM files, with rustls' safe defaults (TLS 1.2
/// and 1.3). Each error names the file at fault.
fn tls_acceptor(files: &TlsFiles) -> anyhow::Result<TlsAcceptor> {
    let (cert_path, key_path) = (files.cert.display(), files.key.display());
    let cert_pem = std::fs::read(&files.cert)
        .with_context(|| format!("cannot read the TLS certificate {cert_path}"))?;
    let certs = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("bad PEM in the TLS certificate {cert_path}"))?;
    anyhow::ensure!(
        !certs.is_empty(),
        "no certificate in {cert_path} (expected a PEM \"BEGIN CERTIFICATE\" block)"
    );
    let key_pem =
        std::fs::read(&files.key).with_context(|| format!("cannot read the TLS key {key_path}"))?;
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|err| match err {
        pem::Error::NoItemsFound => {
            anyhow::anyhow!("no private key in {key_path} (expected a PEM \"PRIVATE KEY\" block)")
        }
        err => anyhow::Error::new(err).context(format!("bad PEM in the TLS key {key_path}")),
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("rustls has no safe protocol version")?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|err| match err {
            rustls::Error::InconsistentKeys(_) => anyhow::anyhow!(
                "the TLS key {key_path} does not belong to the certificate {cert_path}"
            ),
            err => anyhow::Error::new(err).context(format!(
                "cannot use the TLS key {key_path} with the certificate {cert_path}"
            )),
        })?;
    // axum serves HTTP/1 only.
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(tls)))
}

/// How long a client may take over its TLS handshake before it is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepts TCP connections and completes each TLS handshake on a task of its own, so that a
/// client stalling its handshake never holds up the next connection; `axum::serve` takes the
/// finished streams. Dropping it (as `serve` does at shutdown) stops the accepting.
struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    fn new(mut tcp: TcpListener, acceptor: TlsAcceptor) -> std::io::Result<Self> {
        let local = tcp.local_addr()?;
        let (done, ready) = mpsc::channel(64);
        tokio::spawn(async move {
            loop {
                // axum's accept logs and retries errors such as too many open files.
                let (stream, remote) = tokio::select! {
                    accepted = Listener::accept(&mut tcp) => accepted,
                    () = done.closed() => break,
                };
                let (acceptor, done) = (acceptor.clone(), done.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let _ = done.send((tls, remote)).await;
                        }
                        // Scanners and plain-HTTP clients fail here all day: not worth a warning.
                        Ok(Err(err)) => debug!(%remote, "TLS handshake failed: {err}"),
                        Err(_) => debug!(%remote, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { ready, local })
    }
}

impl Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(connection) => connection,
            // The accepting task ended: no connection will come.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}

/// Resolves on the first Ctrl-C or SIGTERM; `axum::serve` then stops accepting connections and
/// waits for in-flight requests. The watchers are registered here, when it is called, not when
/// the future is first polled: the server calls it before it says it listens, so a signal sent
/// from then on stops it gracefully rather than finding the default action (which kills the
/// process). A signal that cannot be watched is logged and never fires, so the other still
/// works.
fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{Signal, SignalKind, signal};
        let watch = |kind: SignalKind, name: &str| match signal(kind) {
            Ok(watcher) => Some(watcher),
            Err(err) => {
                warn!("cannot watch for {name}: {err}");
                None
            }
        };
        async fn fired(watcher: Option<Signal>) {
            match watcher {
                Some(mut watcher) => {
                    watcher.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        }
        let interrupt = fired(watch(SignalKind::interrupt(), "Ctrl-C"));
        let terminate = fired(watch(SignalKind::terminate(), "SIGTERM"));
        async move {
            tokio::select! {
                () = interrupt => {}
                () = terminate => {}
            }
            info!("shutting down: finishing in-flight requests");
        }
    }
    #[cfg(not(unix))]
    async {
        if let Err(err) = tokio::signal::ctrl_c().await {
            warn!("cannot watch for Ctrl-C: {err}");
            std::future::pending::<()>().await;
        }
        info!("shutting down: finishing in-flight requests");
    }
}
