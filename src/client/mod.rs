//! The Rust client: leases from the authority as capabilities ([`Lease`]), background
//! renewal ([`KeepAlive`]), and fenced requests through the proxy with typed results
//! ([`FencedHttp`], [`FenceResult`]). Both speak http or https ([`ClientTls`]: a custom
//! CA, an optional client certificate); the authority client sends its bearer secret
//! ([`ClientOptions::bearer`]) and a lease's proof travels with every fenced request.
//!
//! The client never trusts the server's clock: a lease's local deadline is measured from
//! when the request was *sent*, minus a margin for clock-rate uncertainty, so the client
//! always gives the lease up before the authority can grant it to someone else. That is
//! an optimisation, not the safety: a paused process can still act on a lease it no
//! longer holds, and only the fence at the destination stops it.

mod authority;
mod fenced;

pub use authority::{
    AcquireError, AuthorityClient, CallError, KeepAlive, Lease, LeaseLost, LockInfo, ReleaseError,
    RenewError, StatusError,
};
pub use fenced::{Fence, FenceResult, FencedError, FencedHttp};

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

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
    /// The authority client's secret (`[[authority.client]] token_file`), sent as
    /// `Authorization: Bearer` on every authority call; never to the proxy.
    pub bearer: Option<Secret>,
    /// How https URLs are trusted; `None`: the built-in (Mozilla) roots, no client
    /// certificate.
    pub tls: Option<ClientTls>,
}

/// A secret that `Debug` does not print.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// TLS for https URLs: the CAs trusted *instead of* the built-in roots (a private CA
/// should not widen to every public one), and an optional client certificate.
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls").finish_non_exhaustive()
    }
}

/// Why TLS settings were refused.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct TlsSetupError(pub String);

impl ClientTls {
    /// `ca`: a PEM bundle of the CAs to trust (`None`: the built-in roots). `identity`:
    /// a PEM certificate chain and its private key, for listeners that ask for one.
    pub fn new(
        ca: Option<&Path>,
        identity: Option<(&Path, &Path)>,
    ) -> Result<ClientTls, TlsSetupError> {
        let read = |p: &Path| {
            crate::config::value::read_bounded(p, crate::config::value::MAX_FILE)
                .map_err(|e| TlsSetupError(format!("cannot read {}: {e}", p.display())))
        };
        let certs = |p: &Path| -> Result<Vec<CertificateDer<'static>>, TlsSetupError> {
            let pem = read(p)?;
            let certs = CertificateDer::pem_slice_iter(&pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| TlsSetupError(format!("{} is not valid PEM: {e}", p.display())))?;
            if certs.is_empty() {
                return Err(TlsSetupError(format!(
                    "no PEM CERTIFICATE in {}",
                    p.display()
                )));
            }
            Ok(certs)
        };
        let roots = match ca {
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in certs(ca)? {
                    roots.add(c).map_err(|e| {
                        TlsSetupError(format!(
                            "{}: not a usable CA certificate: {e}",
                            ca.display()
                        ))
                    })?;
                }
                roots
            }
            None => rustls::RootCertStore {
                roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
            },
        };
        let builder = tls_builder().with_root_certificates(roots);
        let config = match identity {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = certs(cert)?;
                let key = PrivateKeyDer::from_pem_slice(&read(key)?).map_err(|e| {
                    TlsSetupError(format!("{}: no usable PEM private key: {e}", key.display()))
                })?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    TlsSetupError(format!("the key does not fit the client certificate: {e}"))
                })?
            }
        };
        Ok(ClientTls::of(config))
    }

    /// The built-in roots, no client certificate.
    fn builtin() -> ClientTls {
        ClientTls::of(
            tls_builder()
                .with_root_certificates(rustls::RootCertStore {
                    roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
                })
                .with_no_client_auth(),
        )
    }

    fn of(config: rustls::ClientConfig) -> ClientTls {
        ClientTls {
            config: Arc::new(config),
        }
    }
}

fn tls_builder() -> rustls::ConfigBuilder<rustls::ClientConfig, rustls::WantsVerifier> {
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        // Fails only for a provider without TLS 1.2/1.3 suites; ring has both, and no file
        // or peer can change that.
        .expect("the ring provider supports the default protocol versions")
}

impl Default for ClientOptions {
    fn default() -> ClientOptions {
        ClientOptions {
            clock_margin: Duration::from_millis(20),
            drift_per_mille: 10,
            request_timeout: Duration::from_secs(30),
            token_header: http::HeaderName::from_static("fencing-token"),
            bearer: None,
            tls: None,
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
#[error("`{0}` is not an http://host:port or https://host:port URL")]
pub struct BadUrl(pub String);

type Http = HyperClient<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// One client for http and https URLs (https trusted as `tls` says).
fn http_client(tls: Option<&ClientTls>) -> Http {
    let config = match tls {
        Some(t) => t.config.clone(),
        None => ClientTls::builtin().config,
    };
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config((*config).clone())
        .https_or_http()
        // HTTP/1.1 only (offered by ALPN): one request at a time per connection is all a
        // lease holder needs.
        .enable_http1()
        .wrap_connector(http);
    HyperClient::builder(TokioExecutor::new()).build(connector)
}

/// `http://host:port` or `https://host:port` (a trailing `/` allowed), without path or
/// query.
fn base_url(url: &str) -> Result<String, BadUrl> {
    let uri: http::Uri = url.parse().map_err(|_| BadUrl(url.to_string()))?;
    match (uri.scheme_str(), uri.authority()) {
        (Some(scheme @ ("http" | "https")), Some(a))
            if matches!(uri.path(), "" | "/") && uri.query().is_none() =>
        {
            Ok(format!("{scheme}://{a}"))
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
        assert_eq!(base_url("https://x:7443").unwrap(), "https://x:7443");
        assert!(base_url("ftp://x").is_err());
        assert!(base_url("nonsense").is_err());
    }
}
