//! A user's webhook: a URL that gets a JSON `POST` when one of their jobs ends.
//!
//! Deliveries run on their own tokio task, each attempt on a blocking thread through `ureq`
//! (rustls with ring, or plain `http://`), with a short timeout and a few retries spaced out,
//! so a slow or dead receiver never holds the queue or a handler. The outcome of the latest
//! delivery (after its retries) is kept in the `webhooks` row for the account page, and a
//! failure is logged. Redirects are not followed: the URL the user gave is the one posted to.
//!
//! URLs aimed at this machine (loopback, private ranges) are allowed: a webhook carries no
//! credential, its body is fixed by the appliance, and its sender sees only the receiver's
//! status code or the kind of failure, so it reveals no more than which local ports answer,
//! which anyone with an account on the appliance's host could find out anyway; and a hook to
//! a local relay (a chat bridge, a script) is a legitimate use.

use std::time::Duration;

use serde_json::Value;
use tracing::{info, warn};

use crate::AppState;
use crate::db::now;
use crate::error::{ApiError, ApiResult};
use crate::store::webhooks as store;
pub use crate::store::webhooks::WebhookView;

/// The longest URL accepted.
pub const MAX_URL_LEN: usize = 2048;

/// One attempt's limit, from connecting to the end of the reply.
const TIMEOUT: Duration = Duration::from_secs(5);

/// The pauses before the second and the third attempt.
const RETRY_AFTER: [Duration; 2] = [Duration::from_secs(1), Duration::from_secs(4)];

/// A webhook URL: `http://` or `https://` with a host, at most [`MAX_URL_LEN`] bytes, and no
/// user name or password in it (they would be shown on the account page).
pub fn check_url(url: &str) -> ApiResult<String> {
    let url = url.trim();
    let refuse = |why: &str| ApiError::bad_request(format!("url: {why}"));
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

/// `user_id`'s webhook, if they set one.
pub async fn get(state: &AppState, user_id: i64) -> ApiResult<Option<WebhookView>> {
    Ok(store::get(state.pool(), user_id).await?)
}

/// Sets `user_id`'s webhook to `url` (checked), or removes it. A new URL starts with no
/// delivery result.
pub async fn set(state: &AppState, user_id: i64, url: Option<&str>) -> ApiResult<()> {
    match url.map(str::trim).filter(|u| !u.is_empty()) {
        None => {
            store::delete(state.pool(), user_id).await?;
        }
        Some(url) => {
            let url = check_url(url)?;
            store::set(state.pool(), user_id, &url, now()).await?;
        }
    }
    Ok(())
}

/// The outcome of a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    pub ok: bool,
    /// "HTTP 204", or why it failed.
    pub result: String,
}

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
        let delivery = deliver(&hook.url, &body, 1 + RETRY_AFTER.len()).await;
        record(&state, user_id, &hook.url, job_id, &delivery).await;
    });
}

/// Posts `body` to `user_id`'s webhook once and waits for the outcome (the account page's
/// "send a test"). `None` when they have no webhook.
pub async fn send_now(state: &AppState, user_id: i64, body: &Value) -> ApiResult<Option<Delivery>> {
    let Some(hook) = get(state, user_id).await? else { return Ok(None) };
    let delivery = deliver(&hook.url, body, 1).await;
    record(state, user_id, &hook.url, None, &delivery).await;
    Ok(Some(delivery))
}

/// Up to `attempts` posts of `body` to `url`, until one is answered 2xx or a 4xx other than
/// 408 and 429 says that trying again would not help.
async fn deliver(url: &str, body: &Value, attempts: usize) -> Delivery {
    let bytes = body.to_string().into_bytes();
    let mut delivery = Delivery { ok: false, result: "not sent".into() };
    for attempt in 0..attempts {
        if attempt > 0 {
            tokio::time::sleep(RETRY_AFTER[(attempt - 1).min(RETRY_AFTER.len() - 1)]).await;
        }
        let (url, bytes) = (url.to_string(), bytes.clone());
        let outcome = tokio::task::spawn_blocking(move || post(&url, &bytes)).await;
        let (ok, again, result) = match outcome {
            Ok(Ok(status)) => {
                let again = status >= 500 || status == 408 || status == 429;
                ((200..300).contains(&status), again, format!("HTTP {status}"))
            }
            Ok(Err(why)) => (false, true, why),
            Err(err) => (false, false, format!("the sending thread failed: {err}")),
        };
        delivery = Delivery { ok, result };
        if ok || !again {
            break;
        }
    }
    delivery
}

/// One post; `Ok` with the status code of whatever answered.
fn post(url: &str, body: &[u8]) -> Result<u16, String> {
    let agent = ureq::Agent::new_with_config(
        ureq::Agent::config_builder()
            .timeout_global(Some(TIMEOUT))
            .http_status_as_error(false)
            .max_redirects(0)
            .user_agent(concat!("sluice-webhook/", env!("CARGO_PKG_VERSION")))
            .build(),
    );
    agent
        .post(url)
        .header("content-type", "application/json")
        .send(body)
        .map(|reply| reply.status().as_u16())
        .map_err(|err| match err {
            ureq::Error::Timeout(_) => format!("no answer within {} s", TIMEOUT.as_secs()),
            ureq::Error::ConnectionFailed => "cannot connect".to_string(),
            ureq::Error::Io(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                "cannot connect: connection refused".to_string()
            }
            ureq::Error::Io(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                format!("no answer within {} s", TIMEOUT.as_secs())
            }
            ureq::Error::HostNotFound => "unknown host".to_string(),
            other => other.to_string(),
        })
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
}
