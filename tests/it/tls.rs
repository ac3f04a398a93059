//! TLS: HTTPS on the listener (h1 and h2 by ALPN), client certificates, https upstreams
//! with a private CA, SNI override and client certificate, certificate reload without
//! dropping connections, and `check-config` errors for TLS files. Every certificate is
//! made here with rcgen; everything runs on loopback.

use crate::support;

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use fencegate::settings::Config;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::{Frame, SizeHint};
use http_body_util::{BodyExt, Either, Full};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::client::TlsStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use support::{BOUND, Double, config_text};

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A test certificate authority.
struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        Ca {
            issuer: CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap(),
        }
    }

    fn pem(&self) -> String {
        self.issuer.pem()
    }

    fn roots(&self) -> RootCertStore {
        let mut roots = RootCertStore::empty();
        roots.add(self.issuer.der().clone()).unwrap();
        roots
    }

    fn leaf(&self, cn: &str, names: &[&str], usage: ExtendedKeyUsagePurpose) -> Leaf {
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().clone(),
        }
    }

    fn server(&self, cn: &str, names: &[&str]) -> Leaf {
        self.leaf(cn, names, ExtendedKeyUsagePurpose::ServerAuth)
    }

    fn client(&self, cn: &str) -> Leaf {
        self.leaf(cn, &["client.test"], ExtendedKeyUsagePurpose::ClientAuth)
    }
}

/// A certificate and its key.
struct Leaf {
    cert_pem: String,
    key_pem: String,
    der: CertificateDer<'static>,
}

impl Leaf {
    /// Writes `NAME.pem` and `NAME.key` into `dir`.
    fn write(&self, dir: &Path, name: &str) {
        std::fs::write(dir.join(format!("{name}.pem")), &self.cert_pem).unwrap();
        crate::support::write_secret(dir.join(format!("{name}.key")), &self.key_pem);
    }

    fn chain(&self) -> Vec<CertificateDer<'static>> {
        vec![self.der.clone()]
    }

    fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()).unwrap()
    }
}

/// The config of a proxy in front of `upstream`, with `server_tls` added to `[server]`.
fn tls_config_text(upstream: SocketAddr, server_tls: &str) -> String {
    let text = config_text(upstream, "10s", "0s", "10s");
    let anchor = "trusted_proxies = [\"127.0.0.1\"]\n";
    assert!(text.contains(anchor));
    text.replace(anchor, &format!("{anchor}{server_tls}\n"))
}

/// A client config trusting `ca`, presenting `identity` if given, offering `alpn`.
fn client_tls(ca: &Ca, identity: Option<&Leaf>, alpn: &[&[u8]]) -> Arc<ClientConfig> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(ca.roots());
    let mut config = match identity {
        Some(leaf) => builder
            .with_client_auth_cert(leaf.chain(), leaf.key())
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

async fn connect(addr: SocketAddr, config: Arc<ClientConfig>) -> io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from("localhost").unwrap();
    tokio::time::timeout(BOUND, TlsConnector::from(config).connect(name, tcp))
        .await
        .map_err(|_| io::Error::other("handshake not finished within the bound"))?
}

/// The certificate the server presented on `stream`.
fn presented(stream: &TlsStream<TcpStream>) -> CertificateDer<'static> {
    stream
        .get_ref()
        .1
        .peer_certificates()
        .expect("server certificate")[0]
        .clone()
}

fn put(uri: &str, token: &str) -> Request<Full<Bytes>> {
    Request::put(uri)
        .header("host", "localhost")
        .header("fencing-token", token)
        .body(Full::new(Bytes::new()))
        .unwrap()
}

/// An HTTP/1.1 connection over an established TLS stream.
async fn h1(stream: TlsStream<TcpStream>) -> hyper::Result<H1> {
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    Ok(H1(send))
}

struct H1(hyper::client::conn::http1::SendRequest<Full<Bytes>>);

impl H1 {
    async fn send(&mut self, req: Request<Full<Bytes>>) -> hyper::Result<(StatusCode, String)> {
        let resp = tokio::time::timeout(BOUND, async {
            self.0.ready().await?;
            self.0.send_request(req).await
        })
        .await
        .expect("response within bound")?;
        Ok(summary(resp).await)
    }
}

/// Status and `Fencing-Result` of a response, body read to the end.
async fn summary(resp: Response<hyper::body::Incoming>) -> (StatusCode, String) {
    let status = resp.status();
    let result = resp
        .headers()
        .get("fencing-result")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let _ = resp.into_body().collect().await;
    (status, result)
}

/// Does a request over a client with `config` fail, at the handshake or right after it
/// (with TLS 1.3 a client learns of a refused certificate on its first read)?
async fn refused(addr: SocketAddr, config: Arc<ClientConfig>) -> bool {
    let Ok(stream) = connect(addr, config).await else {
        return true;
    };
    let Ok(mut conn) = h1(stream).await else {
        return true;
    };
    conn.send(put("/reports/r/x", "1")).await.is_err()
}

#[tokio::test]
async fn https_h1_and_h2_reach_the_upstream_as_https() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("test ca");
    ca.server("proxy", &["localhost", "127.0.0.1"])
        .write(dir.path(), "server");
    let text = tls_config_text(
        double.addr,
        r#"tls = { cert = "server.pem", key = "server.key" }"#,
    );
    let running = support::start(Config::parse(&text, dir.path()).unwrap()).await;

    // HTTP/1.1, chosen by ALPN.
    let stream = connect(running.proxy_addr, client_tls(&ca, None, &[b"http/1.1"]))
        .await
        .expect("TLS handshake");
    assert_eq!(stream.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let mut conn = h1(stream).await.unwrap();
    let (status, result) = conn.send(put("/reports/r/x", "5")).await.unwrap();
    assert_eq!((status.as_u16(), result.as_str()), (200, "accepted"));
    let seen = double.seen();
    assert_eq!(
        seen.last().unwrap().header("x-forwarded-proto"),
        Some("https")
    );

    // h2, chosen by ALPN when offered first.
    let stream = connect(
        running.proxy_addr,
        client_tls(&ca, None, &[b"h2", b"http/1.1"]),
    )
    .await
    .expect("TLS handshake");
    assert_eq!(stream.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let resp = tokio::time::timeout(
        BOUND,
        send.send_request(put("https://localhost/reports/r/y", "6")),
    )
    .await
    .expect("response within bound")
    .unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    let (status, result) = summary(resp).await;
    assert_eq!((status.as_u16(), result.as_str()), (200, "accepted"));
    let seen = double.seen();
    let last = seen.last().unwrap();
    assert_eq!(last.target, "/reports/r/y");
    assert_eq!(last.header("x-forwarded-proto"), Some("https"));

    // Plain HTTP to the TLS port gets no HTTP response.
    let (status, text) = support::raw(
        running.proxy_addr,
        b"GET /public/x HTTP/1.1\r\nHost: localhost\r\n\r\n",
    )
    .await;
    assert_eq!(status, 0, "plain HTTP must not be answered: {text:?}");
    assert!(!text.starts_with("HTTP/"));
    assert_eq!(double.seen().len(), 2, "nothing more reached the upstream");
    running.shutdown().await;
}

#[tokio::test]
async fn a_client_that_never_finishes_the_handshake_is_closed() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("test ca");
    ca.server("proxy", &["localhost"])
        .write(dir.path(), "server");
    let text = tls_config_text(
        double.addr,
        "header_read_timeout = \"200ms\"\ntls = { cert = \"server.pem\", key = \"server.key\" }",
    );
    let running = support::start(Config::parse(&text, dir.path()).unwrap()).await;
    let mut idle = TcpStream::connect(running.proxy_addr).await.unwrap();
    let mut buf = Vec::new();
    // The server closes the socket once the handshake timeout passes (EOF, or a reset).
    let closed = tokio::time::timeout(BOUND, idle.read_to_end(&mut buf)).await;
    assert!(closed.is_ok(), "a silent client kept its connection");
    assert!(buf.is_empty());
    running.shutdown().await;
}

#[tokio::test]
async fn client_certificates_are_required_with_client_ca() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("test ca");
    ca.server("proxy", &["localhost"])
        .write(dir.path(), "server");
    std::fs::write(dir.path().join("clients.pem"), ca.pem()).unwrap();
    let text = tls_config_text(
        double.addr,
        r#"tls = { cert = "server.pem", key = "server.key", client_ca = "clients.pem" }"#,
    );
    let running = support::start(Config::parse(&text, dir.path()).unwrap()).await;
    let addr = running.proxy_addr;

    assert!(
        refused(addr, client_tls(&ca, None, &[b"http/1.1"])).await,
        "a client without a certificate got through"
    );
    let stranger = Ca::new("unknown ca").client("stranger");
    assert!(
        refused(addr, client_tls(&ca, Some(&stranger), &[b"http/1.1"])).await,
        "a client with a certificate from another CA got through"
    );
    assert!(double.seen().is_empty());

    let known = ca.client("known");
    let stream = connect(addr, client_tls(&ca, Some(&known), &[b"http/1.1"]))
        .await
        .expect("handshake with a known client certificate");
    let mut conn = h1(stream).await.unwrap();
    let (status, result) = conn.send(put("/reports/r/x", "1")).await.unwrap();
    assert_eq!((status.as_u16(), result.as_str()), (200, "accepted"));
    assert_eq!(double.seen().len(), 1);
    running.shutdown().await;
}

/// An https upstream that wants a client certificate from `clients`; it records the
/// headers of what it is sent. A request for `/reports/stall/...` gets a [`Stalled`] body.
struct TlsUpstream {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<HeaderMap>>>,
}

impl TlsUpstream {
    async fn start(cert: &Leaf, clients: &Ca) -> TlsUpstream {
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(clients.roots()), provider())
                .build()
                .unwrap();
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_client_cert_verifier(verifier)
            .with_single_cert(cert.chain(), cert.key())
            .unwrap();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen: Arc<Mutex<Vec<HeaderMap>>> = Arc::default();
        let record = seen.clone();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                let record = record.clone();
                tokio::spawn(async move {
                    let Ok(stream) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                        let record = record.clone();
                        async move {
                            record.lock().unwrap().push(req.headers().clone());
                            let body = if req.uri().path().starts_with("/reports/stall/") {
                                Either::Right(Stalled { sent: false })
                            } else {
                                Either::Left(Full::new(Bytes::from("secure")))
                            };
                            Ok::<_, io::Error>(Response::new(body))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        TlsUpstream { addr, seen }
    }
}

/// A body announced as 10 bytes that sends 3, then nothing ever again.
struct Stalled {
    sent: bool,
}

impl http_body::Body for Stalled {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        if self.sent {
            return Poll::Pending;
        }
        self.sent = true;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"abc")))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(10)
    }
}

/// A proxy (plain HTTP in front) whose one upstream is `https://{addr}` with `tls`.
async fn proxy_to_https(dir: &Path, addr: SocketAddr, tls: &str) -> fencegate::app::Running {
    proxy_to_https_within(dir, addr, tls, "10s").await
}

/// [`proxy_to_https`] with the upstream `timeout` given.
async fn proxy_to_https_within(
    dir: &Path,
    addr: SocketAddr,
    tls: &str,
    timeout: &str,
) -> fencegate::app::Running {
    let text = config_text(addr, "10s", "0s", timeout).replace(
        &format!("url = \"http://{addr}\"\n"),
        &format!("url = \"https://{addr}\"\n{tls}\n"),
    );
    assert!(text.contains("https://"));
    support::start(Config::parse(&text, dir).unwrap()).await
}

#[tokio::test]
async fn https_upstream_with_private_ca_server_name_and_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("private ca");
    std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
    ca.client("fencegate").write(dir.path(), "client");
    // The upstream's certificate names only upstream.test, not the address in the url.
    let upstream = TlsUpstream::start(&ca.server("upstream", &["upstream.test"]), &ca).await;
    let running = proxy_to_https(
        dir.path(),
        upstream.addr,
        r#"tls = { ca = "ca.pem", server_name = "upstream.test", cert = "client.pem", key = "client.key" }"#,
    )
    .await;
    let client = support::Client::new(running.proxy_addr);
    let r = client.put("/reports/r/x", "3", "").await;
    assert_eq!(
        (r.status, r.result(), r.body.as_str()),
        (200, "accepted", "secure")
    );
    let seen = upstream.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0]
            .get("x-forwarded-proto")
            .and_then(|v| v.to_str().ok()),
        Some("http")
    );
    running.shutdown().await;

    // Without server_name the name checked is 127.0.0.1, which the certificate lacks.
    let dir2 = tempfile::tempdir().unwrap();
    std::fs::write(dir2.path().join("ca.pem"), ca.pem()).unwrap();
    ca.client("fencegate").write(dir2.path(), "client");
    let running = proxy_to_https(
        dir2.path(),
        upstream.addr,
        r#"tls = { ca = "ca.pem", cert = "client.pem", key = "client.key" }"#,
    )
    .await;
    let r = support::Client::new(running.proxy_addr)
        .put("/reports/r/x", "4", "")
        .await;
    assert_eq!(
        (r.status, r.result()),
        (502, "upstream_unavailable"),
        "{}",
        r.body
    );
    assert_eq!(upstream.seen.lock().unwrap().len(), 1);
    running.shutdown().await;
}

/// An https upstream's body that stalls mid-way is cut off after the upstream's timeout,
/// as a plain-HTTP one's is: the client's connection closes short of the length.
#[tokio::test]
async fn an_https_upstreams_stalled_body_is_cut_off() {
    use tokio::io::AsyncWriteExt;
    let timeout = std::time::Duration::from_millis(500);
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("private ca");
    std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
    ca.client("fencegate").write(dir.path(), "client");
    let upstream = TlsUpstream::start(&ca.server("upstream", &["upstream.test"]), &ca).await;
    let running = proxy_to_https_within(
        dir.path(),
        upstream.addr,
        r#"tls = { ca = "ca.pem", server_name = "upstream.test", cert = "client.pem", key = "client.key" }"#,
        "500ms",
    )
    .await;
    let mut s = TcpStream::connect(running.proxy_addr).await.unwrap();
    let sent = std::time::Instant::now();
    s.write_all(b"GET /reports/stall/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(BOUND, async {
        let mut chunk = [0u8; 4096];
        loop {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "still open after {BOUND:?}: {:?}",
            String::from_utf8_lossy(&got)
        )
    });
    let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
    assert!(text.starts_with("http/1.1 200"), "{text}");
    assert!(text.contains("content-length: 10\r\n"), "{text}");
    assert!(
        text.ends_with("\r\n\r\nabc"),
        "closed short of the length: {text:?}"
    );
    assert!(sent.elapsed() >= timeout, "{:?}", sent.elapsed());
    running.shutdown().await;
}

#[tokio::test]
async fn an_upstream_certificate_from_another_ca_is_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("private ca");
    std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
    ca.client("fencegate").write(dir.path(), "client");
    let impostor = Ca::new("impostor ca").server("upstream", &["upstream.test"]);
    let upstream = TlsUpstream::start(&impostor, &ca).await;
    let running = proxy_to_https(
        dir.path(),
        upstream.addr,
        r#"tls = { ca = "ca.pem", server_name = "upstream.test", cert = "client.pem", key = "client.key" }"#,
    )
    .await;
    let r = support::Client::new(running.proxy_addr)
        .put("/reports/r/x", "1", "")
        .await;
    assert_eq!(
        (r.status, r.result()),
        (502, "upstream_unavailable"),
        "{}",
        r.body
    );
    assert!(upstream.seen.lock().unwrap().is_empty());
    running.shutdown().await;
}

/// An https upstream that answers `/reports/KIND/...` with a scripted head: `te-and-length`
/// (chunked, with a wrong length beside it), `lengths` (one length said twice), `gzip` (a
/// coding other than chunked, body up to the end of the stream), `switch` (an upgrade
/// nobody asked for).
async fn scripted_https_upstream(cert: &Leaf) -> SocketAddr {
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(cert.chain(), cert.key())
        .unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut s) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut buf = Vec::new();
                loop {
                    // One request head (the proxy sends these requests without a body).
                    let end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        let mut chunk = [0u8; 4096];
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                    buf.drain(..end);
                    let path = head.split_whitespace().nth(1).unwrap_or("");
                    let (answer, close): (&[u8], bool) = match path.split('/').nth(2) {
                        Some("te-and-length") => (
                            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\nb\r\nhello world\r\n0\r\n\r\n",
                            false,
                        ),
                        Some("lengths") => (
                            b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nok",
                            false,
                        ),
                        Some("gzip") => (
                            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n\x1f\x8bcompressed",
                            true,
                        ),
                        Some("switch") => (
                            b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n",
                            true,
                        ),
                        _ => (b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n", false),
                    };
                    if s.write_all(answer).await.is_err() || s.flush().await.is_err() {
                        return;
                    }
                    if close {
                        let _ = s.shutdown().await;
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// An https upstream's answers (through hyper's client) get the framing checks of the
/// lean exchange: a length beside chunked goes, and the whole body arrives; a repeated
/// length is said once; a coding other than chunked and an unasked-for upgrade are
/// refused as a failed exchange.
#[tokio::test]
async fn an_https_upstreams_framing_headers_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("private ca");
    std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
    let upstream = scripted_https_upstream(&ca.server("upstream", &["upstream.test"])).await;
    let running = proxy_to_https(
        dir.path(),
        upstream,
        r#"tls = { ca = "ca.pem", server_name = "upstream.test" }"#,
    )
    .await;
    let client = support::Client::new(running.proxy_addr);
    let lengths = |r: &support::Resp| -> Vec<String> {
        r.headers
            .get_all("content-length")
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .collect()
    };

    let r = client.put("/reports/te-and-length/x", "1", "").await;
    assert_eq!(
        (r.status, r.result(), r.body.as_str()),
        (200, "accepted", "hello world"),
        "{r:?}"
    );
    assert!(lengths(&r).iter().all(|l| l == "11"), "{:?}", lengths(&r));

    let r = client.put("/reports/lengths/x", "1", "").await;
    assert_eq!(
        (r.status, r.result(), r.body.as_str()),
        (200, "accepted", "ok"),
        "{r:?}"
    );
    assert_eq!(lengths(&r), ["2"]);

    for kind in ["gzip", "switch"] {
        let r = client.put(&format!("/reports/{kind}/x"), "1", "").await;
        assert_eq!(
            (r.status, r.result()),
            (504, "upstream_timeout"),
            "{kind}: {r:?}"
        );
    }
    running.shutdown().await;
}

#[tokio::test]
async fn reload_swaps_the_certificate_for_new_connections_only() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("test ca");
    let a = ca.server("cert a", &["localhost"]);
    let b = ca.server("cert b", &["localhost"]);
    a.write(dir.path(), "server");
    let path = dir.path().join("fencegate.toml");
    std::fs::write(
        &path,
        tls_config_text(
            double.addr,
            r#"tls = { cert = "server.pem", key = "server.key" }"#,
        ),
    )
    .unwrap();
    let running = support::start(Config::load(&path).unwrap()).await;
    let addr = running.proxy_addr;
    let tls = client_tls(&ca, None, &[b"http/1.1"]);

    let stream = connect(addr, tls.clone()).await.unwrap();
    assert_eq!(presented(&stream), a.der);
    let mut old = h1(stream).await.unwrap();
    assert_eq!(old.send(put("/reports/r/x", "1")).await.unwrap().0, 200);

    b.write(dir.path(), "server");
    fencegate::app::reload(&running, &path);
    let metrics = &running.app.metrics;
    assert_eq!(metrics.reload_failures.load(Ordering::Relaxed), 0);

    let stream = connect(addr, tls.clone()).await.unwrap();
    assert_eq!(
        presented(&stream),
        b.der,
        "a new connection gets the new certificate"
    );
    let mut new = h1(stream).await.unwrap();
    assert_eq!(new.send(put("/reports/r/x", "2")).await.unwrap().0, 200);
    // The connection opened before the reload is still served.
    assert_eq!(old.send(put("/reports/r/x", "2")).await.unwrap().0, 200);

    // A broken certificate file is refused; the running certificate stays.
    std::fs::write(dir.path().join("server.pem"), "not a certificate").unwrap();
    fencegate::app::reload(&running, &path);
    assert_eq!(metrics.reload_failures.load(Ordering::Relaxed), 1);
    let stream = connect(addr, tls).await.unwrap();
    assert_eq!(presented(&stream), b.der);
    let mut conn = h1(stream).await.unwrap();
    assert_eq!(conn.send(put("/reports/r/x", "3")).await.unwrap().0, 200);
    running.shutdown().await;
}

fn check_config(path: &Path) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["check-config", "--config"])
        .arg(path)
        .output()
        .expect("run check-config");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_config_reports_tls_files_with_their_keys() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("test ca");
    ca.server("proxy", &["localhost"])
        .write(dir.path(), "server");
    std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
    let path = dir.path().join("fencegate.toml");
    let routes = r#"
[[route]]
name = "r"
path = "/r/{k}"
scope = "r/{k}"
upstream = "secure"
"#;

    let good = format!(
        r#"
[server]
listen = "127.0.0.1:8443"
tls = {{ cert = "server.pem", key = "server.key", client_ca = "ca.pem" }}
[store]
path = "marks.redb"
[[upstream]]
name = "secure"
url = "https://127.0.0.1:9443"
tls = {{ ca = "ca.pem", server_name = "objects.internal" }}
[[upstream]]
name = "public"
url = "https://objects.example"
{routes}"#
    );
    std::fs::write(&path, &good).unwrap();
    let (ok, stdout, stderr) = check_config(&path);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("client certificates from"), "{stdout}");
    assert!(stdout.contains("server_name objects.internal"), "{stdout}");
    assert!(stdout.contains("tls built-in roots"), "{stdout}");

    let bad = good
        .replace("cert = \"server.pem\"", "cert = \"missing.pem\"")
        .replace(
            "ca = \"ca.pem\", server_name",
            "ca = \"server.key\", server_name",
        )
        .replace("objects.internal", "not a name")
        .replace(
            "url = \"https://objects.example\"",
            "url = \"http://objects.example\"\ntls = { ca = \"ca.pem\" }",
        );
    std::fs::write(&path, bad).unwrap();
    let (ok, _, stderr) = check_config(&path);
    assert!(!ok);
    for want in [
        "server.tls.cert: cannot read",
        "missing.pem",
        "upstream[0].tls.ca: no PEM CERTIFICATE",
        "upstream[0].tls.server_name: `not a name`",
        "upstream[1].tls: TLS settings need an https:// url",
    ] {
        assert!(stderr.contains(want), "missing {want:?} in {stderr}");
    }

    // A key that is not the certificate's.
    let other = ca.server("other", &["localhost"]);
    crate::support::write_secret(dir.path().join("server.key"), other.key_pem);
    std::fs::write(&path, &good).unwrap();
    let (ok, _, stderr) = check_config(&path);
    assert!(!ok);
    assert!(stderr.contains("server.tls.key:"), "{stderr}");
    assert!(stderr.contains("does not fit"), "{stderr}");
}

/// `[admin]` and `[authority]` take a `tls` table as `[server]` does: HTTPS with the same
/// client-certificate check, plain HTTP unanswered, the files re-read on reload, and bad
/// files refused with their key path.
#[tokio::test]
async fn the_admin_and_authority_ports_take_a_tls_table_too() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("test ca");
    let a = ca.server("cert a", &["localhost"]);
    let b = ca.server("cert b", &["localhost"]);
    a.write(dir.path(), "server");
    std::fs::write(dir.path().join("clients.pem"), ca.pem()).unwrap();
    let tls = r#"tls = { cert = "server.pem", key = "server.key", client_ca = "clients.pem" }"#;
    let text = config_text(double.addr, "10s", "0s", "10s")
        .replace("[admin]\n", &format!("[admin]\n{tls}\n"))
        + &format!("\n[authority]\nlisten = \"127.0.0.1:0\"\n{tls}\n");
    let path = dir.path().join("fencegate.toml");
    std::fs::write(&path, &text).unwrap();
    let running = support::start(Config::load(&path).unwrap()).await;
    let known = ca.client("known");
    let ports = [
        ("admin", running.admin_addr, "/healthz"),
        (
            "authority",
            running.authority_addr.expect("authority"),
            "/v1/locks?scope=s",
        ),
    ];
    let get = |target: &str| {
        Request::get(format!("https://localhost{target}"))
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    for (port, addr, target) in ports {
        assert!(
            refused(addr, client_tls(&ca, None, &[b"http/1.1"])).await,
            "{port}: a client without a certificate got through"
        );
        let stream = connect(addr, client_tls(&ca, Some(&known), &[b"http/1.1"]))
            .await
            .expect("handshake");
        assert_eq!(presented(&stream), a.der);
        let mut conn = h1(stream).await.unwrap();
        let (status, _) = conn.send(get(target)).await.unwrap();
        assert_eq!(status.as_u16(), 200, "{port}");
        let (status, _) = support::raw(addr, b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n").await;
        assert_eq!(status, 0, "{port}: plain HTTP must not be answered");
    }
    // Reload: both ports present the new certificate to new connections.
    b.write(dir.path(), "server");
    fencegate::app::reload(&running, &path);
    assert_eq!(
        running.app.metrics.reload_failures.load(Ordering::Relaxed),
        0
    );
    for (port, addr, _) in ports {
        let stream = connect(addr, client_tls(&ca, Some(&known), &[b"http/1.1"]))
            .await
            .expect("handshake");
        assert_eq!(presented(&stream), b.der, "{port}: the new certificate");
    }
    running.shutdown().await;

    // A missing file, or an unknown key, is refused with its key path.
    let admin = format!("[admin]\n{tls}");
    let authority = format!("[authority]\nlisten = \"127.0.0.1:0\"\n{tls}");
    let missing = tls.replace("server.pem", "missing.pem");
    for (table, bad, key) in [
        (&admin, format!("[admin]\n{missing}"), "admin.tls.cert"),
        (
            &authority,
            format!("[authority]\nlisten = \"127.0.0.1:0\"\n{missing}"),
            "authority.tls.cert",
        ),
        (
            &authority,
            "[authority]\nlisten = \"127.0.0.1:0\"\ntls = { cert = \"a\", key = \"b\", other = 1 }"
                .into(),
            "authority.tls",
        ),
    ] {
        assert!(text.contains(table.as_str()));
        let errors =
            Config::parse(&text.replace(table.as_str(), &bad), dir.path()).expect_err("refused");
        assert!(errors.to_string().contains(key), "{key}: {errors}");
    }
}

/// A client config like [`client_tls`] (no identity, HTTP/1.1) for the given versions only.
fn client_tls_versions(
    ca: &Ca,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> Arc<ClientConfig> {
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(versions)
        .unwrap()
        .with_root_certificates(ca.roots())
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}

/// How a client's second connection (after a request on its first, which carries the
/// session tickets) is made: resumed or full.
async fn second_handshake(addr: SocketAddr, config: Arc<ClientConfig>) -> rustls::HandshakeKind {
    let stream = connect(addr, config.clone()).await.expect("TLS handshake");
    assert_eq!(
        stream.get_ref().1.handshake_kind(),
        Some(rustls::HandshakeKind::Full)
    );
    let mut conn = h1(stream).await.unwrap();
    let (status, _) = conn.send(put("/reports/r/x", "5")).await.unwrap();
    assert_eq!(status.as_u16(), 200);
    drop(conn);
    let stream = connect(addr, config).await.expect("TLS handshake");
    let kind = stream.get_ref().1.handshake_kind().expect("handshake done");
    let mut conn = h1(stream).await.unwrap();
    let (status, _) = conn.send(put("/reports/r/y", "5")).await.unwrap();
    assert_eq!(status.as_u16(), 200, "a resumed session serves requests");
    kind
}

/// A client that comes back resumes its session (TLS 1.3 and TLS 1.2 tickets), unless the
/// table says `resumption = false`.
#[tokio::test]
async fn a_returning_client_resumes_its_session_unless_turned_off() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("test ca");
    ca.server("proxy", &["localhost", "127.0.0.1"])
        .write(dir.path(), "server");
    for (table, want) in [
        (
            r#"tls = { cert = "server.pem", key = "server.key" }"#,
            rustls::HandshakeKind::Resumed,
        ),
        (
            r#"tls = { cert = "server.pem", key = "server.key", resumption = false }"#,
            rustls::HandshakeKind::Full,
        ),
    ] {
        let text = tls_config_text(double.addr, table);
        let running = support::start(Config::parse(&text, dir.path()).unwrap()).await;
        for versions in [
            &[&rustls::version::TLS13][..],
            &[&rustls::version::TLS12][..],
        ] {
            let config = client_tls_versions(&ca, versions);
            let kind = second_handshake(running.proxy_addr, config).await;
            assert_eq!(kind, want, "{table} {versions:?}");
        }
        running.shutdown().await;
    }
}

/// Tickets keep nothing on the server: more clients than a session cache holds (rustls's
/// default cache keeps 256) all resume.
#[tokio::test]
async fn tickets_resume_more_clients_than_a_session_cache_holds() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("test ca");
    ca.server("proxy", &["localhost", "127.0.0.1"])
        .write(dir.path(), "server");
    let text = tls_config_text(
        double.addr,
        r#"tls = { cert = "server.pem", key = "server.key" }"#,
    );
    let running = support::start(Config::parse(&text, dir.path()).unwrap()).await;
    let clients: Vec<_> = (0..300)
        .map(|_| client_tls_versions(&ca, &[&rustls::version::TLS13]))
        .collect();
    for config in &clients {
        let stream = connect(running.proxy_addr, config.clone())
            .await
            .expect("TLS");
        let mut conn = h1(stream).await.unwrap();
        let (status, _) = conn.send(put("/reports/r/x", "5")).await.unwrap();
        assert_eq!(status.as_u16(), 200);
    }
    let mut resumed = 0;
    for config in &clients {
        let stream = connect(running.proxy_addr, config.clone())
            .await
            .expect("TLS");
        if stream.get_ref().1.handshake_kind() == Some(rustls::HandshakeKind::Resumed) {
            resumed += 1;
        }
    }
    assert_eq!(resumed, clients.len());
    running.shutdown().await;
}

/// The load bench's TLS baseline (`Nginx::tls_proxy_pass`) serves HTTPS with the
/// certificate it is given, and resumes a returning client's session only when told to,
/// so that its full-handshake rows measure full handshakes.
#[tokio::test]
async fn the_benchs_nginx_tls_baseline_resumes_only_when_told_to() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("test ca");
    ca.server("nginx", &["localhost"])
        .write(dir.path(), "nginx");
    let null = support::nginx::Nginx::null().unwrap();
    for (resumption, want) in [
        (true, rustls::HandshakeKind::Resumed),
        (false, rustls::HandshakeKind::Full),
    ] {
        let tls = support::nginx::Tls {
            cert: dir.path().join("nginx.pem"),
            key: dir.path().join("nginx.key"),
            resumption,
        };
        let nginx = support::nginx::Nginx::tls_proxy_pass(null.port(), 1, tls).unwrap();
        let config = client_tls_versions(&ca, &[&rustls::version::TLS13]);
        // A request on the first connection: its response comes after the tickets.
        let stream = connect(nginx.addr(), config.clone()).await.expect("TLS");
        let mut conn = h1(stream).await.unwrap();
        let (status, _) = conn.send(put("/reports/r/x", "1")).await.unwrap();
        assert_eq!(status, StatusCode::NO_CONTENT, "the null backend's answer");
        drop(conn);
        let stream = connect(nginx.addr(), config).await.expect("TLS");
        let kind = stream.get_ref().1.handshake_kind();
        assert_eq!(kind, Some(want), "resumption = {resumption}");
    }
}

/// The budget of descriptors counts every connection, "the clients' and the upstream
/// ones": an https upstream's connections too. Ten requests whose https answers stall hold
/// ten client and ten upstream connections.
#[tokio::test]
async fn https_upstream_connections_count_against_the_budget() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("private ca");
    std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
    ca.client("fencegate").write(dir.path(), "client");
    let upstream = TlsUpstream::start(&ca.server("upstream", &["upstream.test"]), &ca).await;
    let running = proxy_to_https_within(
        dir.path(),
        upstream.addr,
        r#"tls = { ca = "ca.pem", server_name = "upstream.test", cert = "client.pem", key = "client.key" }"#,
        "60s",
    )
    .await;
    let admin = support::Client::new(running.admin_addr);
    let before = support::metric_value(
        &admin.get("/metrics").await.body,
        "fencegate_connection_fds",
    );
    let mut held = Vec::new();
    for i in 0..10 {
        let mut s = TcpStream::connect(running.proxy_addr).await.unwrap();
        s.write_all(
            format!("GET /reports/stall/x{i} HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
        // The head and the first bytes: the upstream connection is held.
        let mut chunk = [0u8; 4096];
        let n = tokio::time::timeout(BOUND, s.read(&mut chunk))
            .await
            .expect("answer in time")
            .unwrap();
        assert!(chunk[..n].starts_with(b"HTTP/1.1 200"));
        held.push(s);
    }
    let counted = support::metric_value(
        &admin.get("/metrics").await.body,
        "fencegate_connection_fds",
    ) - before;
    drop(held);
    running.shutdown().await;
    assert_eq!(counted, 20.0, "counted against the budget");
}
