//! Static files (stylesheet, scripts, the vendored chart library), embedded in the binary.
//!
//! Our own files keep stable URLs and are served with `Cache-Control: no-cache` and an ETag, so a
//! browser revalidates them with a cheap 304 and never runs a stale script after an upgrade.
//! Vendored files carry their version in the URL and are cached for a year.

use axum::extract::Path;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// The uPlot release in `web/static/vendor/uplot/`; part of its URLs.
pub(crate) const UPLOT_VERSION: &str = "1.6.32";

/// One embedded file, served at `/static/{path}`.
struct Asset {
    path: &'static str,
    body: &'static [u8],
    content_type: &'static str,
    /// The URL changes whenever the content does, so browsers may keep it forever.
    immutable: bool,
    /// Strong validator, computed at compile time from the content.
    etag: &'static str,
}

const CSS: &str = "text/css; charset=utf-8";
const JS: &str = "text/javascript; charset=utf-8";

macro_rules! asset {
    ($path:literal, $file:literal, $content_type:expr) => {
        asset!($path, $file, $content_type, false)
    };
    ($path:literal, $file:literal, $content_type:expr, $immutable:expr) => {
        Asset {
            path: $path,
            body: include_bytes!(concat!("../../../web/static/", $file)),
            content_type: $content_type,
            immutable: $immutable,
            etag: {
                const HEX: [u8; 18] =
                    etag_of(include_bytes!(concat!("../../../web/static/", $file)));
                match std::str::from_utf8(&HEX) {
                    Ok(text) => text,
                    Err(_) => panic!("an ETag is ASCII"),
                }
            },
        }
    };
}

const ASSETS: &[Asset] = &[
    asset!("app.css", "app.css", CSS),
    asset!("js/api.js", "js/api.js", JS),
    asset!("js/ui.js", "js/ui.js", JS),
    asset!("js/shell.js", "js/shell.js", JS),
    asset!("js/charts.js", "js/charts.js", JS),
    asset!("js/timeline.js", "js/timeline.js", JS),
    asset!("js/pages/setup.js", "js/pages/setup.js", JS),
    asset!("js/pages/login.js", "js/pages/login.js", JS),
    asset!("js/pages/dashboard.js", "js/pages/dashboard.js", JS),
    asset!("js/pages/datasets.js", "js/pages/datasets.js", JS),
    asset!("js/pages/dataset.js", "js/pages/dataset.js", JS),
    asset!("js/pages/models.js", "js/pages/models.js", JS),
    asset!("js/pages/new_job.js", "js/pages/new_job.js", JS),
    asset!("js/pages/job.js", "js/pages/job.js", JS),
    asset!("js/pages/job_fields.js", "js/pages/job_fields.js", JS),
    asset!("js/pages/answers.js", "js/pages/answers.js", JS),
    asset!("js/pages/users.js", "js/pages/users.js", JS),
    asset!("js/pages/account.js", "js/pages/account.js", JS),
    asset!("js/pages/compare.js", "js/pages/compare.js", JS),
    asset!("js/pages/storage.js", "js/pages/storage.js", JS),
    asset!("js/pages/demo.js", "js/pages/demo.js", JS),
    asset!("vendor/uplot-1.6.32/uPlot.iife.min.js", "vendor/uplot/uPlot.iife.min.js", JS, true),
    asset!("vendor/uplot-1.6.32/uPlot.min.css", "vendor/uplot/uPlot.min.css", CSS, true),
];

/// `"` + 16 hex digits of FNV-1a + `"`: an ETag that changes whenever the bytes do.
const fn etag_of(bytes: &[u8]) -> [u8; 18] {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u64;
        hash = hash.wrapping_mul(0x0100_0000_01b3);
        i += 1;
    }
    let digits = b"0123456789abcdef";
    let mut out = [b'"'; 18];
    let mut k = 0;
    while k < 16 {
        out[1 + k] = digits[((hash >> (60 - 4 * k)) & 0xf) as usize];
        k += 1;
    }
    out
}

/// `GET /static/{*path}`.
pub(crate) async fn serve(Path(path): Path<String>, headers: HeaderMap) -> Response {
    let Some(asset) = ASSETS.iter().find(|asset| asset.path == path) else {
        return super::not_found().await.into_response();
    };
    let cache = if asset.immutable { "public, max-age=31536000, immutable" } else { "no-cache" };
    let common = [
        (header::CACHE_CONTROL, HeaderValue::from_static(cache)),
        (header::ETAG, HeaderValue::from_static(asset.etag)),
        (header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff")),
    ];
    if matches_etag(&headers, asset.etag) {
        return (StatusCode::NOT_MODIFIED, common).into_response();
    }
    (common, [(header::CONTENT_TYPE, HeaderValue::from_static(asset.content_type))], asset.body)
        .into_response()
}

/// Whether `If-None-Match` names this ETag (a list, `*`, or weak forms all count).
fn matches_etag(headers: &HeaderMap, etag: &str) -> bool {
    headers
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(|tag| tag.trim().trim_start_matches("W/"))
        .any(|tag| tag == etag || tag == "*")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_asset_has_a_distinct_path_and_a_quoted_etag() {
        for (i, asset) in ASSETS.iter().enumerate() {
            assert!(!asset.body.is_empty(), "{} is empty", asset.path);
            assert_eq!(asset.etag.len(), 18, "{}", asset.path);
            assert!(asset.etag.starts_with('"') && asset.etag.ends_with('"'));
            assert!(
                ASSETS[i + 1..].iter().all(|other| other.path != asset.path),
                "{} listed twice",
                asset.path
            );
        }
    }

    #[test]
    fn vendored_paths_carry_the_uplot_version() {
        let vendored: Vec<_> = ASSETS.iter().filter(|asset| asset.immutable).collect();
        assert_eq!(vendored.len(), 2);
        for asset in vendored {
            assert!(asset.path.contains(&format!("uplot-{UPLOT_VERSION}/")), "{}", asset.path);
        }
    }

    #[test]
    fn etag_changes_with_content() {
        assert_ne!(etag_of(b"a"), etag_of(b"b"));
        assert_eq!(etag_of(b"abc"), etag_of(b"abc"));
    }

    #[test]
    fn if_none_match_accepts_lists_and_weak_tags() {
        let mut headers = HeaderMap::new();
        headers.insert(header::IF_NONE_MATCH, HeaderValue::from_static("\"x\", W/\"abc\""));
        assert!(matches_etag(&headers, "\"abc\""));
        assert!(!matches_etag(&headers, "\"abd\""));
        assert!(!matches_etag(&HeaderMap::new(), "\"abc\""));
    }
}
