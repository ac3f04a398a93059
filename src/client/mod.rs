//! The Rust client: leases from the authority as capabilities ([`Lease`]), background
//! renewal ([`KeepAlive`]), and fenced requests through the proxy with typed results
//! ([`FencedHttp`], [`FenceResult`]).
//!
//! The client never trusts the server's clock: a lease's local deadline is measured from
//! when the request was *sent*, minus a margin for clock-rate uncertainty, so the client
//! always gives the lease up before the authority can grant it to someone else. That is
//! an optimisation, not the safety: a paused process can still act on a lease it no
//! longer holds, and only the fence at the destination stops it.

mod authority;
mod fenced;

pub use authority::{
    AcquireError, AuthorityClient, KeepAlive, Lease, LeaseLost, LockInfo, ReleaseError, RenewError,
};
pub use fenced::{Fence, FenceResult, FencedError, FencedHttp};

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Knobs shared by the clients.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Fixed allowance for clock uncertainty, subtracted from every local deadline.
    pub clock_margin: Duration,
    /// Allowance for clock-rate drift between client and authority, per mille of the ttl.
    pub drift_per_mille: u32,
    /// Bound on one request (plus `wait` for acquisitions).
    pub request_timeout: Duration,
    /// The token header the proxy reads (SPEC §1: configurable, `Fencing-Token` by default).
    pub token_header: http::HeaderName,
}

impl Default for ClientOptions {
    fn default() -> ClientOptions {
        ClientOptions {
            clock_margin: Duration::from_millis(20),
            drift_per_mille: 10,
            request_timeout: Duration::from_secs(30),
            token_header: http::HeaderName::from_static("fencing-token"),
        }
    }
}

impl ClientOptions {
    /// How long a lease granted for `ttl` may be relied on, measured from sending.
    pub fn usable(&self, ttl: Duration) -> Duration {
        let drift = ttl * self.drift_per_mille / 1000;
        ttl.saturating_sub(drift).saturating_sub(self.clock_margin)
    }
}

/// Why a base URL was refused.
#[derive(Debug, Clone, thiserror::Error)]
#[error("`{0}` is not an http://host:port URL")]
pub struct BadUrl(pub String);

type Http = HyperClient<HttpConnector, Full<Bytes>>;

fn http_client() -> Http {
    HyperClient::builder(TokioExecutor::new()).build_http()
}

/// `http://host:port` (a trailing `/` allowed), without path or query.
fn base_url(url: &str) -> Result<String, BadUrl> {
    let uri: http::Uri = url.parse().map_err(|_| BadUrl(url.to_string()))?;
    match (uri.scheme_str(), uri.authority()) {
        (Some("http"), Some(a)) if matches!(uri.path(), "" | "/") && uri.query().is_none() => {
            Ok(format!("http://{a}"))
        }
        _ => Err(BadUrl(url.to_string())),
    }
}

/// Seconds from a `Retry-After` header (the delta-seconds form only).
fn retry_after(headers: &http::HeaderMap) -> Option<Duration> {
    headers
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usable_time_is_conservative() {
        let o = ClientOptions::default();
        assert_eq!(
            o.usable(Duration::from_secs(10)),
            Duration::from_millis(10_000 - 100 - 20)
        );
        assert_eq!(o.usable(Duration::from_millis(10)), Duration::ZERO);
    }

    #[test]
    fn base_urls() {
        assert_eq!(
            base_url("http://127.0.0.1:7070/").unwrap(),
            "http://127.0.0.1:7070"
        );
        assert!(base_url("http://127.0.0.1:7070/v1").is_err());
        assert!(base_url("https://x").is_err());
        assert!(base_url("nonsense").is_err());
    }
}
