//! A user's webhook: a URL that gets a JSON `POST` when one of their jobs ends.
//!
//! Deliveries run on their own tokio task, each attempt on a blocking thread through `ureq`
//! (rustls with ring, or plain `http://`), with a short timeout and a few retries spaced out,
//! so a slow or dead receiver never holds the queue or a handler. The outcome of the latest
//! delivery (after its retries) is kept in the `webhooks` row for the account page, and a
//! failure is logged.
//!
//! A webhook is a request the appliance makes on a user's behalf, so it must not become a
//! probe of the network the appliance sits in (its own API on the loopback, a cloud's metadata
//! service, a department's intranet). Each attempt resolves the host itself, refuses it when
//! any address is loopback, link-local, private, unique-local, shared (CGNAT), multicast,
//! unspecified or reserved (in any notation: `2130706433`, `::ffff:127.0.0.1` and `0x7f.1` all
//! resolve to 127.0.0.1), and connects only to the addresses it checked, so a DNS answer that
//! changes in between cannot swap them. Redirects are not followed: a 3xx is a failure. An
//! admin may name hosts that may be private (`webhook_private_hosts`), for a department's own
//! relay. The user sees only whether a delivery was delivered or failed, with a reason that
//! says nothing of what answered (no status code, no "connection refused"); the details are
//! logged for the admin.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::time::Duration;

use serde_json::Value;
use tracing::{info, warn};

use crate::AppState;
use crate::db::now;
use crate::store::webhooks as store;
pub use crate::store::webhooks::WebhookView;

/// The longest URL accepted.
pub const MAX_URL_LEN: usize = 2048;

/// One attempt's limit, from connecting to the end of the reply.
const TIMEOUT: Duration = Duration::from_secs(5);

/// The pauses before the second and the third attempt.
const RETRY_AFTER: [Duration; 2] = [Duration::from_secs(1), Duration::from_secs(4)];

/// Why a webhook could not be read or set; `api/errors.rs` gives each its status.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    /// The URL is not one webhooks may go to: why, for the user.
    #[error("url: {0}")]
    Url(String),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

pub type WebhookResult<T> = Result<T, WebhookError>;

/// A webhook URL: `http://` or `https://` with a host, at most [`MAX_URL_LEN`] bytes, and no
/// user name or password in it (they would be shown on the account page).
pub fn check_url(url: &str) -> WebhookResult<String> {
    let url = url.trim();
    let refuse = |why: &str| WebhookError::Url(why.to_string());
    if url.len() > MAX_URL_LEN {
        return Err(refuse(&format!("at most {MAX_URL_LEN} characters")));
    }
    let uri: axum::http::Uri = url
        .parse()
        .map_err(|_| refuse(&format!("{url:?} is not a URL (such as https://example.com/hook)")))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(refuse("must start with https:// or http://"));
    }
    let Some(authority) = uri.authority() else { return Err(refuse("has no host")) };
    if authority.as_str().contains('@') {
        return Err(refuse("must not carry a user name or password"));
    }
    if authority.host().is_empty() {
        return Err(refuse("has no host"));
    }
    Ok(url.to_string())
}

/// Refuses a URL whose host resolves (now) to an address webhooks may not reach, unless an
/// admin named the host, so a user learns at once rather than at the first delivery; a host
/// that does not resolve yet is left to the delivery, which checks again every time.
async fn check_target(state: &AppState, url: &str) -> WebhookResult<()> {
    let Some(target) = Target::of(url) else { return Ok(()) };
    if target.is_named_in(&state.config().webhook_private_hosts) {
        return Ok(());
    }
    let Ok(addrs) = tokio::net::lookup_host((target.host.as_str(), target.port)).await else {
        return Ok(());
    };
    if addrs.into_iter().any(|a| !reachable(a.ip())) {
        return Err(WebhookError::Url(NOT_ALLOWED.into()));
    }
    Ok(())
}

/// Why a target is refused, as the user is told.
const NOT_ALLOWED: &str = "webhooks go only to public addresses, not to this machine or a \
                           private network (an administrator can allow a named host)";

/// A URL's host (an IPv6 address without its brackets) and port.
struct Target {
    host: String,
    port: u16,
}

impl Target {
    fn of(url: &str) -> Option<Target> {
        let uri: axum::http::Uri = url.parse().ok()?;
        let default = match uri.scheme_str()? {
            "https" => 443,
            "http" => 80,
            _ => return None,
        };
        let host = uri.host()?.trim_start_matches('[').trim_end_matches(']').to_string();
        Some(Target { host, port: uri.port_u16().unwrap_or(default) })
    }

    fn is_named_in(&self, allowed: &[String]) -> bool {
        allowed.iter().any(|name| {
            name.trim_start_matches('[').trim_end_matches(']').eq_ignore_ascii_case(&self.host)
        })
    }
}

/// Whether a webhook may be sent to `ip`: a public unicast address. An IPv6 address that
/// carries an IPv4 one (mapped, compatible, NAT64, 6to4) is judged by that.
pub fn reachable(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => reachable_v4(v4),
        IpAddr::V6(v6) => reachable_v6(v6),
    }
}

fn reachable_v4(ip: Ipv4Addr) -> bool {
    let [a, b, ..] = ip.octets();
    let this_network = a == 0;
    let shared = a == 100 && (64..128).contains(&b);
    let reserved = a >= 240;
    !(this_network
        || ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || shared
        || ip.is_multicast()
        || reserved)
}

fn reachable_v6(ip: Ipv6Addr) -> bool {
    let s = ip.segments();
    let octets = ip.octets();
    let embedded =
        |at: usize| Ipv4Addr::new(octets[at], octets[at + 1], octets[at + 2], octets[at + 3]);
    if let Some(v4) = ip.to_ipv4_mapped() {
        return reachable_v4(v4);
    }
    // IPv4-compatible (::a.b.c.d, which also covers :: and ::1) and NAT64 (64:ff9b::/96).
    if s[..6] == [0; 6] || s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return reachable_v4(embedded(12));
    }
    // 6to4 (2002:a.b.c.d::/48).
    if s[0] == 0x2002 {
        return reachable_v4(embedded(2));
    }
    let unique_local = s[0] & 0xfe00 == 0xfc00;
    let link_local = s[0] & 0xffc0 == 0xfe80;
    let site_local = s[0] & 0xffc0 == 0xfec0;
    !(ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_multicast()
        || unique_local
        || link_local
        || site_local)
}

/// `user_id`'s webhook, if they set one.
pub async fn get(state: &AppState, user_id: i64) -> WebhookResult<Option<WebhookView>> {
    Ok(store::get(state.pool(), user_id).await?)
}

/// Sets `user_id`'s webhook to `url` (checked), or removes it. A new URL starts with no
/// delivery result.
pub async fn set(state: &AppState, user_id: i64, url: Option<&str>) -> WebhookResult<()> {
    match url.map(str::trim).filter(|u| !u.is_empty()) {
        None => {
            store::delete(state.pool(), user_id).await?;
        }
        Some(url) => {
            let url = check_url(url)?;
            check_target(state, &url).await?;
            store::set(state.pool(), user_id, &url, now()).await?;
        }
    }
    Ok(())
}

/// The outcome of a delivery, as the user sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    pub ok: bool,
    /// [`DELIVERED`], [`FAILED`] or [`REFUSED`]: nothing of what answered.
    pub result: String,
}

pub const DELIVERED: &str = "delivered";
pub const FAILED: &str = "failed: the receiver could not be reached or did not accept it";
pub const REFUSED: &str = "failed: webhooks go only to public addresses, not to this machine \
                           or a private network";

/// Posts `body` to `user_id`'s webhook, if they have one, on a task of its own: up to three
/// attempts, then the outcome is stored. Returns at once.
pub fn send_later(state: &AppState, user_id: i64, job_id: Option<i64>, body: Value) {
    let state = state.clone();
    tokio::spawn(async move {
        let hook = match get(&state, user_id).await {
            Ok(Some(hook)) => hook,
            Ok(None) => return,
            Err(err) => {
                warn!("webhook of user {user_id}: cannot read it: {err:?}");
                return;
            }
        };
        let allowed = state.config().webhook_private_hosts.clone();
        let delivery = deliver(&hook.url, &body, 1 + RETRY_AFTER.len(), allowed).await;
        record(&state, user_id, &hook.url, job_id, &delivery).await;
    });
}

/// Posts `body` to `user_id`'s webhook once and waits for the outcome (the account page's
/// "send a test"). `None` when they have no webhook.
pub async fn send_now(
    state: &AppState,
    user_id: i64,
    body: &Value,
) -> WebhookResult<Option<Delivery>> {
    let Some(hook) = get(state, user_id).await? else { return Ok(None) };
    let allowed = state.config().webhook_private_hosts.clone();
    let delivery = deliver(&hook.url, body, 1, allowed).await;
    record(state, user_id, &hook.url, None, &delivery).await;
    Ok(Some(delivery))
}

/// Up to `attempts` posts of `body` to `url`, until one is answered 2xx, or a 4xx other than
/// 408 and 429 (or a 3xx) says that trying again would not help, or the target is refused.
/// What went wrong is logged; the delivery says only delivered or failed.
async fn deliver(url: &str, body: &Value, attempts: usize, allowed: Vec<String>) -> Delivery {
    let bytes = body.to_string().into_bytes();
    let mut delivery = Delivery { ok: false, result: FAILED.into() };
    for attempt in 0..attempts {
        if attempt > 0 {
            tokio::time::sleep(RETRY_AFTER[(attempt - 1).min(RETRY_AFTER.len() - 1)]).await;
        }
        let (target, bytes, allowed) = (url.to_string(), bytes.clone(), allowed.clone());
        let outcome = tokio::task::spawn_blocking(move || post(&target, &bytes, &allowed)).await;
        let (ok, again, result, detail) = match outcome {
            Ok(Ok(status)) => {
                let again = status >= 500 || status == 408 || status == 429;
                let ok = (200..300).contains(&status);
                (ok, again, if ok { DELIVERED } else { FAILED }, format!("HTTP {status}"))
            }
            Ok(Err(Failure::Refused(why))) => (false, false, REFUSED, why),
            Ok(Err(Failure::Failed(why))) => (false, true, FAILED, why),
            Err(err) => (false, false, FAILED, format!("the sending thread failed: {err}")),
        };
        if !ok {
            warn!("webhook to {url}: attempt {} of {attempts} failed: {detail}", attempt + 1);
        }
        delivery = Delivery { ok, result: result.to_string() };
        if ok || !again {
            break;
        }
    }
    delivery
}

/// Why an attempt did not get an answer, for the log.
#[derive(Debug)]
enum Failure {
    /// The target may not be reached; trying again would not change that.
    Refused(String),
    Failed(String),
}

/// One post to the addresses `url`'s host resolves to, once every one is checked (or the host
/// is one of `allowed`); `Ok` with the status code of whatever answered.
fn post(url: &str, body: &[u8], allowed: &[String]) -> Result<u16, Failure> {
    let target = Target::of(url).ok_or_else(|| Failure::Refused(format!("not a URL: {url}")))?;
    let addrs: Vec<SocketAddr> = (target.host.as_str(), target.port)
        .to_socket_addrs()
        .map_err(|e| Failure::Failed(format!("cannot resolve {}: {e}", target.host)))?
        .collect();
    if addrs.is_empty() {
        return Err(Failure::Failed(format!("{} resolves to no address", target.host)));
    }
    let named = target.is_named_in(allowed);
    if let Some(bad) = addrs.iter().find(|a| !reachable(a.ip()) && !named) {
        return Err(Failure::Refused(format!("{} resolves to {}", target.host, bad.ip())));
    }
    // Multicast and unspecified addresses are no one's service, named or not.
    if let Some(bad) = addrs.iter().find(|a| a.ip().is_multicast() || a.ip().is_unspecified()) {
        return Err(Failure::Refused(format!("{} resolves to {}", target.host, bad.ip())));
    }
    let config = ureq::Agent::config_builder()
        .timeout_global(Some(TIMEOUT))
        .http_status_as_error(false)
        .max_redirects(0)
        // A proxy would be connected to at the checked addresses, and would pick its own.
        .proxy(None)
        .user_agent(concat!("sluice-webhook/", env!("CARGO_PKG_VERSION")))
        .build();
    let agent = ureq::Agent::with_parts(
        config,
        ureq::unversioned::transport::DefaultConnector::new(),
        Checked(addrs),
    );
    agent
        .post(url)
        .header("content-type", "application/json")
        .send(body)
        .map(|reply| reply.status().as_u16())
        .map_err(|err| Failure::Failed(err.to_string()))
}

/// A resolver that answers the addresses already checked, whatever DNS says by now.
#[derive(Debug)]
struct Checked(Vec<SocketAddr>);

impl ureq::unversioned::resolver::Resolver for Checked {
    fn resolve(
        &self,
        _uri: &axum::http::Uri,
        _config: &ureq::config::Config,
        _timeout: ureq::unversioned::transport::NextTimeout,
    ) -> Result<ureq::unversioned::resolver::ResolvedSocketAddrs, ureq::Error> {
        let mut addrs = self.empty();
        for addr in &self.0 {
            // ureq keeps a handful of addresses; the rest are not tried.
            if addrs.try_push(*addr).is_err() {
                break;
            }
        }
        Ok(addrs)
    }
}

/// Stores the outcome, unless the webhook was changed meanwhile; a failure is logged.
async fn record(
    state: &AppState,
    user_id: i64,
    url: &str,
    job_id: Option<i64>,
    delivery: &Delivery,
) {
    let about = job_id.map_or_else(|| "a test".to_string(), |id| format!("job {id}"));
    if delivery.ok {
        info!(user_id, job = job_id, "webhook for {about} delivered: {}", delivery.result);
    } else {
        warn!(user_id, job = job_id, "webhook for {about} failed: {}", delivery.result);
    }
    // Deliveries run side by side and retries take their time: one about a job that ended
    // earlier must not replace the outcome of one about a job that ended later.
    let stored =
        store::record(state.pool(), user_id, url, job_id, now(), delivery.ok, &delivery.result)
            .await;
    if let Err(err) = stored {
        warn!("webhook of user {user_id}: cannot store the outcome: {err:?}");
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked() {
        assert_eq!(
            check_url(" https://example.com/hook ").ok().as_deref(),
            Some("https://example.com/hook")
        );
        assert!(check_url("http://127.0.0.1:9000/x?y=1").is_ok());
        for bad in [
            "",
            "example.com/hook",
            "ftp://example.com/",
            "https://",
            "https://u:p@host/",
            "http:///x",
        ] {
            assert!(check_url(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(check_url(&format!("https://h/{}", "a".repeat(MAX_URL_LEN))).is_err());
    }

    #[test]
    fn only_public_unicast_addresses_are_reachable() {
        let refused = [
            "0.0.0.0",
            "0.1.2.3",
            "127.0.0.1",
            "127.255.0.9",
            "10.1.2.3",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.0.1",
            "169.254.169.254",
            "100.64.0.1",
            "100.127.0.1",
            "224.0.0.1",
            "239.255.255.250",
            "240.0.0.1",
            "255.255.255.255",
            "::",
            "::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "::ffff:169.254.169.254",
            "::127.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "2002:7f00:1::",
            "fe80::1",
            "febf::1",
            "fec0::1",
            "fc00::1",
            "fd12:3456::1",
            "ff02::1",
            "ff0e::1",
        ];
        for ip in refused {
            assert!(!reachable(ip.parse().unwrap()), "{ip} is reachable");
        }
        let public = [
            "8.8.8.8",
            "93.184.215.14",
            "172.32.0.1",
            "100.128.0.1",
            "169.255.0.1",
            "2606:4700:4700::1111",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "2002:808:808::",
        ];
        for ip in public {
            assert!(reachable(ip.parse().unwrap()), "{ip} is refused");
        }
    }

    #[test]
    fn a_delivery_resolves_and_checks_the_host_itself() {
        // Whatever was checked when the URL was set, a delivery checks again: nothing connects.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        for url in [
            format!("http://localhost:{port}/"),
            format!("http://2130706433:{port}/"),
            format!("http://[::ffff:127.0.0.1]:{port}/"),
        ] {
            match post(&url, b"{}", &[]) {
                Err(Failure::Refused(why)) => assert!(why.contains("resolves to"), "{url}: {why}"),
                other => panic!("{url}: {other:?}"),
            }
        }
        assert!(listener.accept().is_err(), "a refused target was connected to");
        // Named by the admin: posted to, and the closed connection is a plain failure.
        drop(listener);
        match post(&format!("http://localhost:{port}/"), b"{}", &["LocalHost".into()]) {
            Err(Failure::Failed(_)) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn targets_are_read_from_urls() {
        let target = Target::of("http://[::1]:9/x").unwrap();
        assert_eq!((target.host.as_str(), target.port), ("::1", 9));
        let target = Target::of("https://2130706433/").unwrap();
        assert_eq!((target.host.as_str(), target.port), ("2130706433", 443));
        assert!(target.is_named_in(&["2130706433".into()]));
        assert!(!target.is_named_in(&["127.0.0.1".into()]));
    }
}
