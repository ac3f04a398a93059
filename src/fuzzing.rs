//! Entry points for the fuzz targets in `fuzz/` (feature `fuzzing`, never in a release):
//! the parsers that are not public, each run as the proxy runs it, beside a second
//! reader of the same bytes, and the oracle that holds the two to one answer. A finding
//! is an `Err` naming what differed; the targets panic with it.
//!
//! - [`head_scan`]: a connection's bytes through [`crate::listen::h1_scan`] and hyper's
//!   server, with the listener's refusal of a flawed head;
//! - [`forwarded`]: a request head as hyper hands it, through the upstream head's
//!   preparation and the lean exchange's encoder, read back with httparse;
//! - [`response_ours`] and [`response_hypers`]: upstream bytes through the lean exchange's decoder and hyper's client.

use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Method, Uri, Version};
use http_body_util::BodyExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, ReadBuf};

pub use crate::listen::conn::ScanFraming;
use crate::listen::conn::Streams;
use crate::listen::h1_scan::Scan;

/// A finding, or why a reader refused the bytes: the text the fuzz targets panic with.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Mismatch(pub String);

impl From<String> for Mismatch {
    fn from(text: String) -> Mismatch {
        Mismatch(text)
    }
}

impl From<&str> for Mismatch {
    fn from(text: &str) -> Mismatch {
        Mismatch(text.to_owned())
    }
}

thread_local! {
    static RT: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap_or_else(|e| panic!("a runtime: {e}"));
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    RT.with(|rt| rt.block_on(f))
}

/// `bytes` cut at `splits` (offsets, any order, out of range ones ignored).
pub fn pieces<'a>(bytes: &'a [u8], splits: &[usize]) -> Vec<&'a [u8]> {
    let mut cuts: Vec<usize> = splits
        .iter()
        .copied()
        .filter(|&s| s < bytes.len())
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut out = Vec::with_capacity(cuts.len() + 1);
    let mut at = 0;
    for c in cuts.into_iter().chain([bytes.len()]) {
        out.push(&bytes[at..c]);
        at = c;
    }
    out
}

/// A request as hyper handed it to the service.
#[derive(Debug)]
pub struct Handed {
    pub number: u64,
    pub method: Method,
    pub uri: Uri,
    pub version: Version,
    /// Sorted (name, value) pairs.
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Result<Vec<u8>, String>,
}

/// What one connection's bytes came to.
#[derive(Debug, Default)]
pub struct HeadRun {
    /// Requests handed on (not refused), in order.
    pub handed: Vec<Handed>,
    /// Requests refused for a flaw the scan noted: their numbers.
    pub refused: Vec<u64>,
    /// The heads the scan parsed: number, bytes, framing read.
    pub seen: Vec<(u64, Vec<u8>, ScanFraming)>,
}

/// The server side of a connection, with what it reads fed to a [`Scan`], as
/// [`crate::listen::first_bytes::FirstBytes`] feeds it.
struct Scanned<S> {
    io: S,
    scan: Scan,
}

impl<S: AsyncRead + tokio::io::AsyncWrite + Unpin> AsyncRead for Scanned<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = r {
            this.scan.feed(&buf.filled()[before..]);
        }
        r
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Scanned<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, data)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Longest request head, as `server.max_header_bytes` sets by default.
const MAX_HEAD: usize = 64 << 10;

fn sorted_headers(headers: &http::HeaderMap) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = headers
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect();
    out.sort();
    out
}

/// Serves one HTTP/1 connection whose client sends `pieces` (each written after the
/// server had a turn at the one before) and then ends its side: hyper's server with the
/// listener's HTTP/1 settings, the head scan on what it reads, and the listener's
/// refusal (400, `Connection: close`) of a request whose head has a flaw.
pub fn head_scan(pieces: &[&[u8]]) -> HeadRun {
    block_on(async {
        let (client, server) = tokio::io::duplex(1 << 20);
        let streams = Streams::new(None);
        let io = Scanned {
            io: server,
            scan: Scan::new(streams.clone(), MAX_HEAD),
        };
        let run = Arc::new(Mutex::new(HeadRun::default()));
        let (svc_streams, svc_run) = (streams.clone(), run.clone());
        let served = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
            let streams = svc_streams.clone();
            let run = svc_run.clone();
            // HTTP/1 requests are served in order, one at a time, as the listener counts them.
            let number = served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            async move {
                if streams.next_request_flaw().is_some() {
                    run.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .refused
                        .push(number);
                    let mut resp = hyper::Response::new(http_body_util::Full::new(Bytes::new()));
                    *resp.status_mut() = http::StatusCode::BAD_REQUEST;
                    resp.headers_mut()
                        .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
                    return Ok::<_, Infallible>(resp);
                }
                let (parts, body) = req.into_parts();
                let body = body
                    .collect()
                    .await
                    .map(|b| b.to_bytes().to_vec())
                    .map_err(|e| e.to_string());
                run.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .handed
                    .push(Handed {
                        number,
                        method: parts.method,
                        uri: parts.uri,
                        version: parts.version,
                        headers: sorted_headers(&parts.headers),
                        body,
                    });
                Ok(hyper::Response::new(
                    http_body_util::Full::new(Bytes::new()),
                ))
            }
        });
        let mut h1 = hyper::server::conn::http1::Builder::new();
        h1.max_buf_size(MAX_HEAD).writev(false);
        let conn = h1.serve_connection(hyper_util::rt::TokioIo::new(io), svc);
        let owned: Vec<Vec<u8>> = pieces.iter().map(|p| p.to_vec()).collect();
        let client = async move {
            let (mut rd, mut wr) = tokio::io::split(client);
            let write = async move {
                for p in owned {
                    if wr.write_all(&p).await.is_err() {
                        return;
                    }
                    for _ in 0..4 {
                        tokio::task::yield_now().await;
                    }
                }
                let _ = wr.shutdown().await;
            };
            let read = async move {
                let mut sink = Vec::new();
                let _ = rd.read_to_end(&mut sink).await;
            };
            tokio::join!(write, read);
        };
        let (_, _) = tokio::join!(conn, client);
        let mut out = std::mem::take(&mut *run.lock().unwrap_or_else(|p| p.into_inner()));
        out.seen = std::mem::take(&mut *streams.seen.lock().unwrap_or_else(|p| p.into_inner()));
        out
    })
}

/// A request head as httparse reads it: method, target, minor version, headers (names
/// lowercased, in the head's order).
type ParsedHead = (String, String, u8, Vec<(String, Vec<u8>)>);

fn parse_request_head(head: &[u8]) -> Result<(ParsedHead, usize), Mismatch> {
    let mut slots = [httparse::EMPTY_HEADER; 256];
    let mut req = httparse::Request::new(&mut slots);
    let n = match req.parse(head) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Err("partial".into()),
        Err(e) => return Err(e.to_string().into()),
    };
    let headers: Vec<(String, Vec<u8>)> = req
        .headers
        .iter()
        .map(|h| (h.name.to_ascii_lowercase(), h.value.to_vec()))
        .collect();
    Ok((
        (
            req.method.unwrap_or_default().to_owned(),
            req.path.unwrap_or_default().to_owned(),
            req.version.unwrap_or(1),
            headers,
        ),
        n,
    ))
}

/// Holds a [`head_scan`] run to its promise: every request hyper handed on was seen by
/// the scan as the same head (method, target, version, header set), with its body framed
/// alike, or it was refused.
pub fn check_head_run(run: &HeadRun) -> Result<(), Mismatch> {
    for h in &run.handed {
        let Some((_, head, framing)) = run.seen.iter().find(|(n, _, _)| *n == h.number) else {
            return Err(format!(
                "hyper handed on request {} ({} {}), which the scan did not see",
                h.number, h.method, h.uri
            )
            .into());
        };
        let ((method, target, minor, headers), len) = parse_request_head(head).map_err(|e| {
            format!(
                "request {}: the scan's head does not parse ({e}): {:?}",
                h.number,
                String::from_utf8_lossy(head)
            )
        })?;
        if len != head.len() {
            return Err(format!(
                "request {}: the scan's head ends at {}, httparse's at {len}",
                h.number,
                head.len()
            )
            .into());
        }
        // hyper keeps the first of several `Content-Length` lines of one value (however
        // spelled: `4`, `004`).
        let mut headers = headers;
        let number = |v: &[u8]| {
            std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
        };
        let mut first_length = None;
        let mut kept: Vec<(String, Vec<u8>)> = Vec::new();
        for (k, v) in &headers {
            if k == "content-length" {
                match (&first_length, number(v)) {
                    (Some(n), Some(m)) if *n == Some(m) => continue,
                    (None, m) => first_length = Some(m),
                    _ => {}
                }
            }
            kept.push((k.clone(), v.clone()));
        }
        headers = kept;
        headers.sort();
        let uri = Uri::try_from(target.as_str()).map_err(|e| e.to_string());
        let version = if minor == 0 {
            Version::HTTP_10
        } else {
            Version::HTTP_11
        };
        if method != h.method.as_str()
            || uri.as_ref() != Ok(&h.uri)
            || version != h.version
            || headers != h.headers
        {
            return Err(format!(
                "request {}: hyper read {} {} {:?} {:?}, the scan's head is {:?}",
                h.number,
                h.method,
                h.uri,
                h.version,
                h.headers,
                String::from_utf8_lossy(head)
            )
            .into());
        }
        if let (ScanFraming::Length(n), Ok(body)) = (framing, &h.body)
            && body.len() as u64 != *n
        {
            return Err(format!(
                "request {}: the scan read a body of {n} bytes, hyper one of {}",
                h.number,
                body.len()
            )
            .into());
        }
        if matches!(framing, ScanFraming::None) && matches!(&h.body, Ok(b) if !b.is_empty()) {
            return Err(format!(
                "request {}: the scan read no body, hyper one of {} bytes",
                h.number,
                h.body.as_ref().map_or(0, Vec::len)
            )
            .into());
        }
    }
    Ok(())
}

/// The upstream the forwarded requests go to.
fn upstream() -> crate::proxy::config::Upstream {
    crate::proxy::config::Upstream {
        name: "u".into(),
        url: Uri::from_static("http://127.0.0.1:9"),
        timeout: std::time::Duration::from_secs(1),
        tls: None,
        distinct_hosts: false,
    }
}

/// A request head (`head`, whole) and its body as hyper would hand them to the proxy, the
/// upstream head prepared from it ([`crate::proxy::forward::upstream_parts`]) and written
/// by the lean exchange; read back with httparse, it must be one request, with the
/// method, target, `Host`, token and body that the fence decided on. `None`: not a head
/// hyper hands on, or one the fence refuses (two hosts, two tokens). `trusted`: the
/// client is a trusted proxy.
pub fn forwarded(head: &[u8], body: &[u8], trusted: bool) -> Option<Result<(), Mismatch>> {
    let ((method, target, minor, headers), _) = parse_request_head(head).ok()?;
    // hyper hands on at most `server.max_headers` (100 by default).
    if headers.len() > 100 {
        return None;
    }
    let method = Method::from_bytes(method.as_bytes()).ok()?;
    let uri = Uri::try_from(target.as_str()).ok()?;
    let mut b = http::Request::builder()
        .method(method.clone())
        .uri(uri.clone())
        .version(if minor == 0 {
            Version::HTTP_10
        } else {
            Version::HTTP_11
        });
    // hyper hands a body it read whole with the length it read.
    let mut tokens = Vec::new();
    let mut hosts = Vec::new();
    for (name, value) in &headers {
        match name.as_str() {
            "content-length" | "transfer-encoding" => continue,
            "fencing-token" => tokens.push(value.clone()),
            "host" => hosts.push(value.clone()),
            _ => {}
        }
        b = b.header(name.as_str(), HeaderValue::from_bytes(value).ok()?);
    }
    if !body.is_empty() {
        b = b.header("content-length", body.len());
    }
    // The fence refuses a request with two tokens, a malformed one or two hosts.
    let [token] = tokens.as_slice() else {
        return None;
    };
    crate::token::Token::parse(token).ok()?;
    if hosts.len() > 1 {
        return None;
    }
    let decided_host = match hosts.first() {
        Some(h) => h.clone(),
        None => uri.authority()?.as_str().as_bytes().to_vec(),
    };
    let (mut parts, ()) = b.body(()).ok()?.into_parts();
    let upstream = upstream();
    let peer = std::net::IpAddr::from([192, 0, 2, 1]);
    let added =
        crate::proxy::forward::upstream_parts(&mut parts, &upstream, peer, false, trusted, false)
            .ok()?;
    let authority = upstream.url.authority()?;
    let body = Bytes::copy_from_slice(body);
    let out =
        crate::proxy::upstream::h1::encode_for_fuzzing(&parts, added.pairs(), authority, &body);
    Some(check_forwarded(
        &out,
        &method,
        &uri,
        &decided_host,
        token,
        &body,
    ))
}

fn check_forwarded(
    out: &[u8],
    method: &Method,
    uri: &Uri,
    host: &[u8],
    token: &[u8],
    body: &[u8],
) -> Result<(), Mismatch> {
    let show = || String::from_utf8_lossy(out).into_owned();
    let ((m, target, _, headers), len) = parse_request_head(out)
        .map_err(|e| format!("forwarded head does not parse ({e}): {:?}", show()))?;
    let want_target = uri.path_and_query().map_or("/", |p| p.as_str());
    if m != method.as_str() || target != want_target {
        return Err(format!(
            "forwarded {m} {target}, decided {method} {want_target}: {:?}",
            show()
        )
        .into());
    }
    let all = |name: &str| -> Vec<&Vec<u8>> {
        headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v)
            .collect()
    };
    if !all("transfer-encoding").is_empty() {
        return Err(format!("forwarded with Transfer-Encoding: {:?}", show()).into());
    }
    let lengths = all("content-length");
    let length = match lengths.as_slice() {
        [] => 0,
        [one] => std::str::from_utf8(one)
            .ok()
            .and_then(|s| s.parse::<usize>().ok())
            .ok_or_else(|| format!("forwarded a malformed length: {:?}", show()))?,
        _ => return Err(format!("forwarded two lengths: {:?}", show()).into()),
    };
    if length != body.len() || out.len() != len + length || out[len..] != *body {
        return Err(format!(
            "forwarded body is not the request's ({} bytes decided): {:?}",
            body.len(),
            show()
        )
        .into());
    }
    let hosts = all("host");
    if hosts.as_slice() != [&host.to_vec()] {
        return Err(format!(
            "forwarded Host {hosts:?}, decided {:?}: {:?}",
            String::from_utf8_lossy(host),
            show()
        )
        .into());
    }
    let tokens = all("fencing-token");
    if tokens.iter().any(|t| t.as_slice() != token) || tokens.len() > 1 {
        return Err(format!(
            "forwarded tokens {tokens:?}, decided {:?}: {:?}",
            String::from_utf8_lossy(token),
            show()
        )
        .into());
    }
    for name in [
        "upgrade",
        "connection",
        "expect",
        "te",
        "trailer",
        "fencegate-peer",
    ] {
        if !all(name).is_empty() && name != "fencegate-peer" {
            return Err(format!("forwarded a hop-by-hop {name}: {:?}", show()).into());
        }
    }
    Ok(())
}

/// A response as a reader made it out: status, headers (sorted, without the framing and
/// hop-by-hop ones), body.
pub type Response = (u16, Vec<(String, Vec<u8>)>, Vec<u8>);

const FRAMING: [&str; 4] = [
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
];

fn comparable(mut r: Response) -> Response {
    r.1.retain(|(k, _)| !FRAMING.contains(&k.as_str()));
    r.1.sort();
    r
}

/// The lean exchange's decoder on `pieces` of an upstream's answer to a GET (a HEAD if
/// `head_request`), each one read, then the connection's end.
pub fn response_ours(pieces: &[&[u8]], head_request: bool) -> Result<Response, Mismatch> {
    crate::proxy::upstream::decode_all(pieces, head_request)
        .map(comparable)
        .map_err(|e| Mismatch(e.to_string()))
}

/// hyper's client on the same pieces.
pub fn response_hypers(pieces: &[&[u8]], head_request: bool) -> Result<Response, Mismatch> {
    let owned: Vec<Vec<u8>> = pieces.iter().map(|p| p.to_vec()).collect();
    block_on(async move {
        let (client, server) = tokio::io::duplex(1 << 20);
        let (mut send, conn) = hyper::client::conn::http1::handshake::<
            _,
            http_body_util::Empty<Bytes>,
        >(hyper_util::rt::TokioIo::new(client))
        .await
        .map_err(|e| Mismatch(e.to_string()))?;
        let method = if head_request {
            Method::HEAD
        } else {
            Method::GET
        };
        let req = http::Request::builder()
            .method(method)
            .uri("/")
            .header("host", "upstream")
            .body(http_body_util::Empty::new())
            .map_err(|e| Mismatch(e.to_string()))?;
        let server = async move {
            let (mut rd, mut wr) = tokio::io::split(server);
            let write = async move {
                for p in owned {
                    if wr.write_all(&p).await.is_err() {
                        return;
                    }
                    for _ in 0..4 {
                        tokio::task::yield_now().await;
                    }
                }
                let _ = wr.shutdown().await;
            };
            let read = async move {
                let mut sink = Vec::new();
                let _ = rd.read_to_end(&mut sink).await;
            };
            tokio::join!(write, read);
        };
        let exchange = async move {
            let r = async {
                let resp = send
                    .send_request(req)
                    .await
                    .map_err(|e| Mismatch(e.to_string()))?;
                let status = resp.status().as_u16();
                let headers = resp
                    .headers()
                    .iter()
                    .map(|(k, v)| (k.as_str().to_owned(), v.as_bytes().to_vec()))
                    .collect();
                let body = resp
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| Mismatch(e.to_string()))?
                    .to_bytes()
                    .to_vec();
                Ok((status, headers, body))
            }
            .await;
            drop(send);
            r
        };
        let conn = async move {
            let _ = conn.await;
        };
        let (r, _, _) = tokio::join!(exchange, conn, server);
        r.map(comparable)
    })
}
