//! HTTPS from the built `sluice` binary: certificates made at test time, a real TLS client, and
//! the failures a bad certificate setup must give at start.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};

/// A `sluice` command isolated from the caller's environment.
fn sluice() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_sluice"));
    for name in [
        "SLUICE_ADDR",
        "SLUICE_DATA_DIR",
        "SLUICE_CONFIG",
        "SLUICE_TLS_CERT",
        "SLUICE_TLS_KEY",
        "SLUICE_PUBLIC_URL",
    ] {
        command.env_remove(name);
    }
    command.env("RUST_LOG", "info");
    command
}

/// A self-signed certificate for `localhost` and its key, written as PEM files into `dir`.
struct TestCert {
    der: CertificateDer<'static>,
    cert: PathBuf,
    key: PathBuf,
}

fn make_cert(dir: &Path, name: &str) -> anyhow::Result<TestCert> {
    let made = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])?;
    let cert = dir.join(format!("{name}.crt"));
    let key = dir.join(format!("{name}.key"));
    std::fs::write(&cert, made.cert.pem())?;
    std::fs::write(&key, made.signing_key.serialize_pem())?;
    Ok(TestCert { der: made.cert.der().clone(), cert, key })
}

/// Kills the server if a test fails before it stops by itself.
struct Server {
    child: Child,
    addr: String,
    log: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `command` and waits for its "listening on <scheme>://" line, which names the port the
/// OS chose.
fn start(command: &mut Command, scheme: &str) -> anyhow::Result<Server> {
    let mut child =
        command.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn()?;
    let stderr = child.stderr.take().ok_or_else(|| anyhow::anyhow!("no stderr pipe"))?;
    let mut server = Server { child, addr: String::new(), log: String::new() };
    let (lines_tx, lines_rx) = mpsc::channel();
    // The pipe is drained to the end even once nobody listens: a server whose stderr closes
    // fails its next log write.
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });
    let marker = format!("listening on {scheme}://");
    loop {
        let line = lines_rx.recv_timeout(Duration::from_secs(30)).map_err(|err| {
            anyhow::anyhow!("no {marker:?} log line ({err}); log:\n{}", server.log)
        })?;
        server.log.push_str(&line);
        server.log.push('\n');
        if let Some((_, rest)) = line.split_once(&marker) {
            server.addr = rest.split_whitespace().next().unwrap_or_default().to_owned();
            return Ok(server);
        }
    }
}

/// `GET path` over TLS, trusting only `root` and checking the name `localhost`; the whole
/// response as text.
fn https_get(addr: &str, root: &CertificateDer<'static>, path: &str) -> anyhow::Result<String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(root.clone())?;
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = ServerName::try_from("localhost")?;
    let connection = rustls::ClientConnection::new(Arc::new(config), name)?;
    let tcp = TcpStream::connect(addr)?;
    // Well under the server's 10 s handshake timeout: a server that waits on another client's
    // handshake before it starts this one fails here.
    tcp.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut tls = rustls::StreamOwned::new(connection, tcp);
    tls.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes(),
    )?;
    let mut response = Vec::new();
    match tls.read_to_end(&mut response) {
        Ok(_) => {}
        // A server that closes without close_notify still sent the whole response.
        Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => {}
        Err(err) => return Err(err.into()),
    }
    Ok(String::from_utf8_lossy(&response).into_owned())
}

/// `GET path` over plain HTTP.
fn http_get(addr: &str, path: &str) -> anyhow::Result<String> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes(),
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response)
}

#[cfg(unix)]
fn stop_with_sigterm(server: &mut Server) -> anyhow::Result<()> {
    let pid = server.child.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status()?;
    anyhow::ensure!(killed.success(), "kill -TERM {pid} failed");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = server.child.try_wait()? {
            break status;
        }
        anyhow::ensure!(Instant::now() < deadline, "the server ignored SIGTERM for 10 s");
        std::thread::sleep(Duration::from_millis(20));
    };
    anyhow::ensure!(status.success(), "exit status {status} after SIGTERM; log:\n{}", server.log);
    Ok(())
}

#[cfg(unix)]
#[test]
fn serves_https_with_hsts_and_stops_cleanly_on_sigterm() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let cert = make_cert(dir.path(), "server")?;
    let mut server = start(
        sluice()
            .args(["serve", "--addr", "127.0.0.1:0", "--data-dir"])
            .arg(dir.path().join("data"))
            .arg("--tls-cert")
            .arg(&cert.cert)
            .arg("--tls-key")
            .arg(&cert.key),
        "https",
    )?;

    // A client that opens a connection and never starts its handshake holds up nobody.
    let stalled = TcpStream::connect(&server.addr)?;
    let response = https_get(&server.addr, &cert.der, "/healthz")
        .context("GET /healthz over TLS while another client stalls its handshake")?;
    assert!(response.starts_with("HTTP/1.1 200"), "response:\n{response}");
    assert!(response.contains(r#""status":"ok""#), "response:\n{response}");
    let lower = response.to_ascii_lowercase();
    assert!(lower.contains("strict-transport-security: max-age=31536000"), "{response}");
    assert!(lower.contains("x-content-type-options: nosniff"), "{response}");

    // Plain HTTP on the TLS port gets no reply, and the server carries on.
    assert!(http_get(&server.addr, "/healthz").map_or(true, |r| !r.contains("200 OK")));
    assert!(https_get(&server.addr, &cert.der, "/healthz")?.starts_with("HTTP/1.1 200"));

    drop(stalled);
    stop_with_sigterm(&mut server)
}

#[test]
fn tls_files_come_from_the_config_file_and_the_environment() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let cert = make_cert(dir.path(), "server")?;
    let data_dir = dir.path().join("data");
    std::fs::create_dir(&data_dir)?;
    let toml = format!("tls_cert = {:?}\n", cert.cert.display().to_string());
    std::fs::write(data_dir.join("sluice.toml"), toml)?;
    let server = start(
        sluice()
            .env("SLUICE_TLS_KEY", &cert.key)
            .args(["serve", "--addr", "127.0.0.1:0", "--data-dir"])
            .arg(&data_dir),
        "https",
    )?;
    let response = https_get(&server.addr, &cert.der, "/healthz")?;
    assert!(response.starts_with("HTTP/1.1 200"), "response:\n{response}");
    Ok(())
}

/// Starts `sluice serve` on a free port with `args`, expecting it to refuse.
fn refused(data_dir: &Path, args: &[&std::ffi::OsStr]) -> anyhow::Result<(Output, String)> {
    let output = sluice()
        .args(["serve", "--addr", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir)
        .args(args)
        .stdin(Stdio::null())
        .output()?;
    Ok((output.clone(), String::from_utf8_lossy(&output.stderr).into_owned()))
}

/// Exit code 1, one `error:` line that contains `needle`, never a panic.
fn assert_one_line_failure(output: &Output, stderr: &str, needle: &str) {
    assert_eq!(output.status.code(), Some(1), "stderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "stderr:\n{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 1, "stderr:\n{stderr}");
    assert!(errors[0].contains(needle), "{needle:?} not in:\n{stderr}");
}

#[test]
fn bad_tls_files_fail_at_start_naming_the_file() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let cert = make_cert(dir.path(), "server")?;
    let other = make_cert(dir.path(), "other")?;
    let missing = dir.path().join("missing.key");
    let not_pem = dir.path().join("not-pem.crt");
    std::fs::write(&not_pem, "this is not a certificate\n")?;
    let (cert_flag, key_flag) =
        (std::ffi::OsStr::new("--tls-cert"), std::ffi::OsStr::new("--tls-key"));

    let (output, stderr) =
        refused(&data, &[cert_flag, cert.cert.as_os_str(), key_flag, missing.as_os_str()])?;
    let expected = format!("cannot read the TLS key {}", missing.display());
    assert_one_line_failure(&output, &stderr, &expected);
    assert!(stderr.contains("No such file"), "stderr:\n{stderr}");

    let (output, stderr) =
        refused(&data, &[cert_flag, not_pem.as_os_str(), key_flag, cert.key.as_os_str()])?;
    assert_one_line_failure(&output, &stderr, &format!("no certificate in {}", not_pem.display()));

    let (output, stderr) =
        refused(&data, &[cert_flag, cert.cert.as_os_str(), key_flag, cert.cert.as_os_str()])?;
    let expected = format!("no private key in {}", cert.cert.display());
    assert_one_line_failure(&output, &stderr, &expected);

    // Two valid files that do not belong together.
    let (output, stderr) =
        refused(&data, &[cert_flag, cert.cert.as_os_str(), key_flag, other.key.as_os_str()])?;
    let expected = format!(
        "the TLS key {} does not belong to the certificate {}",
        other.key.display(),
        cert.cert.display()
    );
    assert_one_line_failure(&output, &stderr, &expected);

    let (output, stderr) = refused(&data, &[cert_flag, cert.cert.as_os_str()])?;
    assert_one_line_failure(&output, &stderr, "tls_cert is set but tls_key is not");
    Ok(())
}

#[test]
fn an_https_public_url_sends_hsts_over_plain_http() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    // Behind a proxy that terminates TLS, the appliance itself speaks plain HTTP.
    let server = start(
        sluice()
            .args(["serve", "--addr", "127.0.0.1:0", "--public-url", "https://sluice.example.com/"])
            .arg("--data-dir")
            .arg(&data),
        "http",
    )?;
    let response = http_get(&server.addr, "/healthz")?;
    assert!(response.starts_with("HTTP/1.1 200"), "response:\n{response}");
    let lower = response.to_ascii_lowercase();
    assert!(lower.contains("strict-transport-security: max-age=31536000"), "{response}");
    assert!(server.log.contains("https://sluice.example.com"), "log:\n{}", server.log);
    drop(server);

    let plain = start(
        sluice()
            .env("SLUICE_PUBLIC_URL", "http://sluice.lan:8080")
            .args(["serve", "--addr", "127.0.0.1:0", "--data-dir"])
            .arg(&data),
        "http",
    )?;
    let response = http_get(&plain.addr, "/healthz")?;
    assert!(response.starts_with("HTTP/1.1 200"), "response:\n{response}");
    assert!(!response.to_ascii_lowercase().contains("strict-transport-security"), "{response}");
    drop(plain);

    let url = std::ffi::OsStr::new("--public-url");
    let (output, stderr) = refused(&data, &[url, std::ffi::OsStr::new("sluice.example.com")])?;
    assert_one_line_failure(&output, &stderr, "must start with https:// or http://");
    Ok(())
}
