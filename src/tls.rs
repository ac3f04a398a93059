//! TLS with rustls (ring provider, or aws-lc-rs with the `aws-lc-rs` feature): the
//! listener's certificate and optional client-certificate check (`[server] tls`), re-read
//! on SIGHUP; and the client side of https upstreams (`[[upstream]] tls`: trusted CA, SNI
//! name, client certificate).
//!
//! Files are PEM. Parsing the config only names them (`listener_files`,
//! `upstream_tls_files`); every file is read and checked by the config's load step
//! (`check_listener_files`, `UpstreamTlsFiles::load`), so `check-config` reports a
//! missing or unreadable file with its key path, and a reload with a bad file is refused
//! before anything changes.

use std::fmt;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use hyper_rustls::{
    DefaultServerNameResolver, FixedServerNameResolver, HttpsConnector, ResolveServerName,
};
use hyper_util::client::legacy::connect::HttpConnector;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::ClientCertVerifier;
use rustls::{ClientConfig, ConfigBuilder, RootCertStore, ServerConfig, WantsVerifier};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde::Deserialize;
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::config::error::{ConfigError, Errors, Place};

/// TLS problems, each with the config key of the file at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsError(pub Vec<ConfigError>);

impl TlsError {
    fn one(path: impl Into<String>, message: impl Into<String>) -> TlsError {
        TlsError(vec![ConfigError {
            path: path.into(),
            message: message.into(),
        }])
    }
}

impl fmt::Display for TlsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, "; ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for TlsError {}

/// `tls = { cert = "...", key = "...", client_ca = "..." }` as written (in `[server]`,
/// `[admin]` or `[authority]`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawListenerTls {
    cert: String,
    key: String,
    client_ca: Option<String>,
    resumption: Option<bool>,
}

/// Where the listener's TLS material lives (resolved against the config file's directory).
/// Kept as paths, not contents: the files are read at start and again on every SIGHUP, so a
/// renewed certificate needs no restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerFiles {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of the leaf.
    pub key: PathBuf,
    /// PEM bundle of CAs whose client certificates are accepted. When set, a client without
    /// such a certificate fails the handshake: only known clients reach the proxy at all.
    pub client_ca: Option<PathBuf>,
    /// Session resumption (TLS 1.3 tickets, TLS 1.2 tickets and session ids), on unless
    /// `resumption = false`: a client that comes back skips the full handshake's
    /// signature and key exchange, as nginx's tickets let it.
    pub resumption: bool,
    /// The table these came from (`server.tls`, `admin.tls`, `authority.tls`): the key path
    /// of its errors.
    pub key_path: &'static str,
}

impl fmt::Display for ListenerFiles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tls cert {}", self.cert.display())?;
        if let Some(ca) = &self.client_ca {
            write!(f, ", client certificates from {}", ca.display())?;
        }
        if !self.resumption {
            write!(f, ", no session resumption")?;
        }
        Ok(())
    }
}

/// A listener's `tls` table (`key_path`, e.g. `server.tls`), its files named relative to
/// `base`; none is read here.
pub(crate) fn listener_files(
    raw: RawListenerTls,
    base: &Path,
    key_path: &'static str,
) -> ListenerFiles {
    ListenerFiles {
        cert: base.join(raw.cert),
        key: base.join(raw.key),
        client_ca: raw.client_ca.map(|ca| base.join(ca)),
        resumption: raw.resumption.unwrap_or(true),
        key_path,
    }
}

/// Reads a listener's files (the config's load step): every file must exist and parse, and
/// the key must fit the certificate. Its errors go at `at`.
pub(crate) fn check_listener_files(
    files: ListenerFiles,
    at: Place,
    errors: &mut Errors,
) -> Option<ListenerFiles> {
    match server_config(&files) {
        Ok(_) => Some(files),
        Err(TlsError(e)) => {
            errors.extend_at(at, e);
            None
        }
    }
}

/// The listener's TLS settings in force. The whole rustls config is swapped on reload, so a
/// new handshake uses the new certificate and client CA, while a connection already up
/// keeps the session it negotiated. A fresh config also starts a fresh session cache: no
/// session resumed after a reload skips the checks of the new files.
pub struct Listener {
    files: ListenerFiles,
    /// A client that opens a connection and never finishes the handshake would hold a
    /// connection slot; this bounds how long.
    handshake_timeout: Duration,
    current: ArcSwap<ServerConfig>,
}

impl Listener {
    pub fn load(files: ListenerFiles, handshake_timeout: Duration) -> Result<Listener, TlsError> {
        let config = server_config(&files)?;
        Ok(Listener {
            files,
            handshake_timeout,
            current: ArcSwap::from_pointee(config),
        })
    }

    /// Re-reads the files. On any error the running certificate is kept.
    pub fn reload(&self) -> Result<(), TlsError> {
        let config = server_config(&self.files)?;
        self.current.store(Arc::new(config));
        Ok(())
    }

    pub fn files(&self) -> &ListenerFiles {
        &self.files
    }

    /// The handshake of one accepted connection, bounded by the handshake timeout. The
    /// future owns what it needs, so it runs in the connection's own task.
    pub fn accept(
        &self,
        stream: TcpStream,
    ) -> impl Future<Output = io::Result<TlsStream<TcpStream>>> + Send + 'static {
        let acceptor = TlsAcceptor::from(self.current.load_full());
        let limit = self.handshake_timeout;
        async move {
            match tokio::time::timeout(limit, acceptor.accept(stream)).await {
                Ok(result) => result,
                Err(_) => Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("TLS handshake not finished within {limit:?}"),
                )),
            }
        }
    }
}

/// The crypto provider of every TLS config here: ring, or aws-lc-rs with the `aws-lc-rs`
/// cargo feature.
fn provider() -> Arc<CryptoProvider> {
    #[cfg(feature = "aws-lc-rs")]
    return Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    #[cfg(not(feature = "aws-lc-rs"))]
    return Arc::new(rustls::crypto::ring::default_provider());
}

/// The provider's session ticketer (TLS 1.3 and 1.2 tickets): keys made at random,
/// rotated every 6 hours.
fn ticketer() -> Result<Arc<dyn rustls::server::ProducesTickets>, rustls::Error> {
    #[cfg(feature = "aws-lc-rs")]
    return rustls::crypto::aws_lc_rs::Ticketer::new();
    #[cfg(not(feature = "aws-lc-rs"))]
    return rustls::crypto::ring::Ticketer::new();
}

/// Reads the listener's files into a rustls config, collecting every problem.
fn server_config(files: &ListenerFiles) -> Result<ServerConfig, TlsError> {
    let mut errors = Vec::new();
    let at = |key: &str| format!("{}.{key}", files.key_path);
    let certs = noted(&mut errors, at("cert"), read_certs(&files.cert));
    let key = noted(&mut errors, at("key"), read_key(&files.key));
    let verifier = match &files.client_ca {
        Some(ca) => noted(&mut errors, at("client_ca"), client_verifier(ca)).map(Some),
        None => Some(None),
    };
    let (Some(certs), Some(key), Some(verifier)) = (certs, key, verifier) else {
        return Err(TlsError(errors));
    };
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::one(files.key_path, e.to_string()))?;
    let builder = match verifier {
        Some(v) => builder.with_client_cert_verifier(v),
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(certs, key).map_err(|e| {
        TlsError::one(
            at("key"),
            format!(
                "{} does not fit the certificate in {}: {e}",
                files.key.display(),
                files.cert.display()
            ),
        )
    })?;
    // h2 first: clients that speak it get it; the auto server builder serves either.
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    if files.resumption {
        // Stateless tickets (keys made at random and rotated every 6 hours, per process and
        // per load of the files), and a bounded cache for clients that resume by id.
        config.ticketer = ticketer().map_err(|e| TlsError::one(files.key_path, e.to_string()))?;
        config.session_storage = rustls::server::ServerSessionMemoryCache::new(SESSIONS);
    } else {
        config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        config.send_tls13_tickets = 0;
    }
    Ok(config)
}

/// Sessions kept for resumption by id (TLS 1.2 clients without tickets); a few hundred
/// bytes each.
const SESSIONS: usize = 4096;

fn client_verifier(ca: &Path) -> Result<Arc<dyn ClientCertVerifier>, PemError> {
    let roots = read_roots(ca)?;
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
        .build()
        .map_err(|source| PemError::Verifier {
            path: ca.to_path_buf(),
            source,
        })
}

/// `[[upstream]] tls = { ca = "...", server_name = "...", cert = "...", key = "..." }`.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawUpstreamTls {
    ca: Option<String>,
    server_name: Option<String>,
    cert: Option<String>,
    key: Option<String>,
}

/// The client side of an https upstream, built when the config is read (start and
/// SIGHUP), so a rotated CA or client certificate is picked up by a reload.
#[derive(Clone)]
pub struct UpstreamTls {
    /// The CAs trusted for this upstream *instead of* the built-in Mozilla roots: a private
    /// CA should not widen to every public CA. `None`: the built-in roots.
    pub ca: Option<PathBuf>,
    /// The name sent as SNI and checked against the upstream's certificate, when it differs
    /// from the host in `url` (e.g. an IP address in the url).
    pub server_name: Option<ServerName<'static>>,
    /// The client certificate presented to the upstream, if any (its key is in `config`).
    pub client_cert: Option<PathBuf>,
    config: Arc<ClientConfig>,
}

impl fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("ca", &self.ca)
            .field("server_name", &self.server_name)
            .field("client_cert", &self.client_cert)
            .finish_non_exhaustive()
    }
}

impl fmt::Display for UpstreamTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.ca {
            Some(ca) => write!(f, "tls ca {}", ca.display())?,
            None => write!(f, "tls built-in roots")?,
        }
        if let Some(name) = &self.server_name {
            write!(f, ", server_name {}", name.to_str())?;
        }
        if let Some(cert) = &self.client_cert {
            write!(f, ", client cert {}", cert.display())?;
        }
        Ok(())
    }
}

/// An https upstream's `tls` table as parsed: the files it names (none read yet) and the
/// places kept for their errors.
#[derive(Debug)]
pub(crate) struct UpstreamTlsFiles {
    ca: Option<PathBuf>,
    server_name: Option<ServerName<'static>>,
    /// The client certificate and its key, when both are given.
    identity: Option<(PathBuf, PathBuf)>,
    client_cert: Option<PathBuf>,
    /// No error in the table itself: the files' contents decide.
    complete: bool,
    /// The upstream's key path (`upstream[0]`).
    path: String,
    ca_at: Place,
    identity_at: Place,
}

/// Validates an upstream's `tls` table, reading no file. Every https upstream gets TLS
/// settings (the defaults when the table is absent); a `tls` table on an http upstream is
/// an error.
pub(crate) fn upstream_tls_files(
    raw: Option<RawUpstreamTls>,
    https: bool,
    base: &Path,
    path: &str,
    errors: &mut Errors,
) -> Option<UpstreamTlsFiles> {
    if !https {
        if raw.is_some() {
            errors.push(format!("{path}.tls"), "TLS settings need an https:// url");
        }
        return None;
    }
    let raw = raw.unwrap_or_default();
    let mut complete = true;
    let key_path = |k: &str| format!("{path}.tls.{k}");
    let ca = raw.ca.map(|ca| base.join(ca));
    let ca_at = errors.place();
    let server_name = raw.server_name.and_then(|name| {
        ServerName::try_from(name.clone())
            .map_err(|_| {
                complete = false;
                errors.push(
                    key_path("server_name"),
                    format!("`{name}` is not a DNS name or IP address"),
                )
            })
            .ok()
    });
    let identity_at = errors.place();
    let client_cert = raw.cert.as_ref().map(|c| base.join(c));
    let identity = match (&client_cert, raw.key.map(|k| base.join(k))) {
        (Some(cert), Some(key)) => Some((cert.clone(), key)),
        (Some(_), None) => {
            complete = false;
            errors.push(
                key_path("key"),
                "missing: a client certificate needs its key",
            );
            None
        }
        (None, Some(_)) => {
            complete = false;
            errors.push(
                key_path("cert"),
                "missing: a client key needs its certificate",
            );
            None
        }
        (None, None) => None,
    };
    Some(UpstreamTlsFiles {
        ca,
        server_name,
        identity,
        client_cert,
        complete,
        path: path.to_string(),
        ca_at,
        identity_at,
    })
}

impl UpstreamTlsFiles {
    /// Reads the files (the config's load step) and builds the client's TLS config.
    pub(crate) fn load(self, errors: &mut Errors) -> Option<UpstreamTls> {
        let key_path = |k: &str| format!("{}.tls.{k}", self.path);
        let before = errors.len();
        let roots = match &self.ca {
            Some(ca) => noted_at(errors, self.ca_at, key_path("ca"), read_roots(ca)),
            None => Some(builtin_roots()),
        };
        let identity = match &self.identity {
            Some((cert, key)) => {
                let certs = noted_at(errors, self.identity_at, key_path("cert"), read_certs(cert));
                let key = noted_at(errors, self.identity_at, key_path("key"), read_key(key));
                Some(certs.zip(key))
            }
            None => Some(None),
        };
        let read = errors.len() == before;
        let (Some(roots), Some(identity), true, true) = (roots, identity, read, self.complete)
        else {
            return None;
        };
        let builder = client_builder().with_root_certificates(roots);
        let config = match identity {
            Some((certs, key)) => match builder.with_client_auth_cert(certs, key) {
                Ok(c) => c,
                Err(e) => {
                    errors.push_at(
                        self.identity_at,
                        key_path("key"),
                        format!("does not fit the client certificate: {e}"),
                    );
                    return None;
                }
            },
            None => builder.with_no_client_auth(),
        };
        Some(UpstreamTls {
            ca: self.ca,
            server_name: self.server_name,
            client_cert: self.client_cert,
            config: Arc::new(with_http1_alpn(config)),
        })
    }
}

/// Requests go to upstreams as HTTP/1.1 (see `proxy::forward`), so that is all we offer.
fn with_http1_alpn(mut config: ClientConfig) -> ClientConfig {
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    config
}

fn client_builder() -> ConfigBuilder<ClientConfig, WantsVerifier> {
    ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        // Fails only for a provider without TLS 1.2/1.3 suites; ring and aws-lc-rs have both,
        // and no file or peer can change that.
        .expect("the crypto provider supports the default protocol versions")
}

fn builtin_roots() -> RootCertStore {
    RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    }
}

/// The connector of an https upstream's client: TLS per `tls` (plain-HTTP upstreams go
/// through the pool in `proxy::upstream::pool`).
pub fn connector(
    mut http: HttpConnector,
    tls: &UpstreamTls,
) -> HttpsConnector<crate::rt::fds::Counted<HttpConnector>> {
    // The TLS layer decides the scheme; the TCP layer must let https URIs through.
    http.enforce_http(false);
    let resolver: Arc<dyn ResolveServerName + Send + Sync> = match &tls.server_name {
        Some(name) => Arc::new(FixedServerNameResolver::new(name.clone())),
        None => Arc::new(DefaultServerNameResolver::default()),
    };
    // Each connection counts against the process's budget of descriptors.
    HttpsConnector::new(
        crate::rt::fds::Counted(http),
        tls.config.clone(),
        true,
        resolver,
    )
}

/// Keeps a value, or notes its error under `path`.
fn noted<T>(
    errors: &mut Vec<ConfigError>,
    path: impl Into<String>,
    result: Result<T, PemError>,
) -> Option<T> {
    result
        .map_err(|e| {
            errors.push(ConfigError {
                path: path.into(),
                message: e.to_string(),
            })
        })
        .ok()
}

/// Keeps a value, or notes its error under `path` at a place kept for it.
fn noted_at<T>(
    errors: &mut Errors,
    at: Place,
    path: impl Into<String>,
    result: Result<T, PemError>,
) -> Option<T> {
    result
        .map_err(|e| errors.push_at(at, path, e.to_string()))
        .ok()
}

/// Why a PEM file named in the configuration cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PemError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is not valid PEM: {source}", path.display())]
    NotPem {
        path: PathBuf,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    #[error("no PEM CERTIFICATE in {}", path.display())]
    NoCertificate { path: PathBuf },
    /// Open to other users, owned by another, or unreadable.
    #[error(transparent)]
    NotPrivate(#[from] crate::config::value::ReadPrivateError),
    #[error("no PEM private key in {}", path.display())]
    NoKey { path: PathBuf },
    #[error("{} is not a valid PEM private key: {source}", path.display())]
    NotKey {
        path: PathBuf,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    #[error("{}: not a usable CA certificate: {source}", path.display())]
    NotCa {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("{}: {source}", path.display())]
    Verifier {
        path: PathBuf,
        #[source]
        source: rustls::server::VerifierBuilderError,
    },
}

fn read(path: &Path) -> Result<Vec<u8>, PemError> {
    crate::config::value::read_bounded(path, crate::config::value::MAX_FILE).map_err(|source| {
        PemError::Read {
            path: path.to_path_buf(),
            source,
        }
    })
}

/// Every `CERTIFICATE` block of a PEM file, in order; at least one.
fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, PemError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| PemError::NotPem {
            path: path.to_path_buf(),
            source,
        })?;
    if certs.is_empty() {
        return Err(PemError::NoCertificate {
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

/// The first private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, PemError> {
    let pem = crate::config::value::read_private(path, crate::config::value::MAX_FILE)
        .map_err(PemError::NotPrivate)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| match e {
        rustls_pki_types::pem::Error::NoItemsFound => PemError::NoKey {
            path: path.to_path_buf(),
        },
        source => PemError::NotKey {
            path: path.to_path_buf(),
            source,
        },
    })
}

/// A PEM bundle of CA certificates as trust anchors.
fn read_roots(path: &Path) -> Result<RootCertStore, PemError> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(path)? {
        roots.add(cert).map_err(|source| PemError::NotCa {
            path: path.to_path_buf(),
            source,
        })?;
    }
    Ok(roots)
}
