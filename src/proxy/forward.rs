//! Forwarding to upstreams: pooled clients (one shared by the http upstreams, one per https
//! upstream), absolute URIs, HTTP/1.1 to the upstream whatever the client spoke, hop-by-hop
//! headers removed, bodies streamed both ways.

use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, Uri, Version};
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::config::Upstream;
use crate::fence::InflightGuard;
use crate::proxy::{Body, BoxError};
use crate::tls::UpstreamTls;

pub type Client = HyperClient<HttpsConnector<HttpConnector>, Body>;

/// A pooled client. Plain-HTTP upstreams share one (`tls` = `None`) for the life of the
/// process; each https upstream gets its own, built with the routing table from its TLS
/// settings, so connections made under different CAs or client certificates never share a
/// pool, and a reload's new settings apply to new connections.
pub fn client(tls: Option<&UpstreamTls>) -> Client {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    let connector = crate::tls::connector(connector, tls);
    HyperClient::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(1024)
        .build(connector)
}

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1).
/// Constant names: removing by `&str` would parse the name again on every request.
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Removes hop-by-hop headers, including every name listed in `Connection` — read before
/// `Connection` itself is removed.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in listed {
        headers.remove(name);
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

/// Appends to a list header, folding any repeated lines into one list first.
fn append(headers: &mut HeaderMap, name: &'static str, value: &str) {
    let mut joined: Vec<&str> = headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    joined.push(value);
    if let Ok(v) = HeaderValue::from_str(&joined.join(", ")) {
        headers.insert(name, v);
    }
}

/// Headers in which a client could claim another address, host or scheme.
const FORWARDING: [HeaderName; 6] = [
    HeaderName::from_static("x-forwarded-for"),
    HeaderName::from_static("x-forwarded-proto"),
    HeaderName::from_static("x-forwarded-host"),
    HeaderName::from_static("x-forwarded-port"),
    header::FORWARDED,
    HeaderName::from_static("x-real-ip"),
];

/// Builds the upstream request. The path and query go out byte for byte as received;
/// Host is preserved (signatures such as SigV4 cover it), or taken from the h2 authority.
/// Forwarding headers are kept only from a trusted proxy. Answers the request and a flag
/// that turns true if the body outgrew `max_body` on the way.
pub fn upstream_request(
    req: Request<Body>,
    upstream: &Upstream,
    peer: IpAddr,
    tls: bool,
    trusted: bool,
    max_body: Option<u64>,
) -> Result<(Request<Body>, Arc<AtomicBool>), http::Error> {
    let (mut parts, body) = req.into_parts();
    // The path and query move over as they are (no re-parse, byte for byte); scheme and
    // authority come from the upstream's URL.
    let mut uri = Uri::builder().path_and_query(
        parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")),
    );
    if let Some(scheme) = upstream.url.scheme() {
        uri = uri.scheme(scheme.clone());
    }
    if let Some(authority) = upstream.url.authority() {
        uri = uri.authority(authority.clone());
    }
    let uri: Uri = uri.build()?;
    if !parts.headers.contains_key(header::HOST)
        && let Some(v) = parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    {
        parts.headers.insert(header::HOST, v);
    }
    strip_hop_by_hop(&mut parts.headers);
    if !trusted {
        for name in &FORWARDING {
            parts.headers.remove(name);
        }
    }
    append(&mut parts.headers, "x-forwarded-for", &peer.to_string());
    // The scheme of this hop is ours to tell, unless a trusted proxy in front said it.
    if !parts.headers.contains_key("x-forwarded-proto") {
        parts.headers.insert(
            "x-forwarded-proto",
            HeaderValue::from_static(if tls { "https" } else { "http" }),
        );
    }
    parts.uri = uri;
    parts.version = Version::HTTP_11;
    let tripped = Arc::new(AtomicBool::new(false));
    let body = match max_body {
        Some(limit) => LimitedBody {
            inner: body,
            left: limit,
            tripped: tripped.clone(),
        }
        .boxed(),
        None => body,
    };
    Ok((Request::from_parts(parts, body), tripped))
}

/// A request body that fails once it grows past a limit (for bodies without a length).
struct LimitedBody {
    inner: Body,
    left: u64,
    tripped: Arc<AtomicBool>,
}

impl http_body::Body for LimitedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let len = frame.data_ref().map_or(0, |d| d.len() as u64);
                if len > this.left {
                    this.tripped.store(true, Ordering::Release);
                    return Poll::Ready(Some(Err(
                        "request body exceeds the route's max_body".into()
                    )));
                }
                this.left -= len;
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Prepares an upstream response for the client; the guard (if any) stays counted
/// until the body has been fully read or dropped.
pub fn client_response(resp: Response<Incoming>, guard: Option<InflightGuard>) -> Response<Body> {
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    let body = GuardedBody { inner: body, guard };
    Response::from_parts(parts, body.boxed())
}

/// An upstream body that releases its generation's in-flight count when it ends.
struct GuardedBody {
    inner: Incoming,
    guard: Option<InflightGuard>,
}

impl http_body::Body for GuardedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => this.guard = None,
            _ => {}
        }
        polled.map(|o| o.map(|r| r.map_err(|e| Box::new(e) as BoxError)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
