//! Forwarding to upstreams: pooled clients (one shared by the http upstreams, one per https
//! upstream), absolute URIs, HTTP/1.1 to the upstream whatever the client spoke, hop-by-hop
//! headers removed, bodies streamed both ways.

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, Uri, Version};
use http_body::{Frame, SizeHint};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::config::Upstream;
use super::hop::{FENCEGATE_PEER, Stop};
use super::problem::{self, Outcome};
use super::{FENCING_RESULT, Plan, Table};
use crate::fence::InflightGuard;
use crate::metrics::Metrics;
use crate::proxy::upstream::{self, H1Body, H1Pool, SendError, StreamedBody, StreamedPool};
use crate::proxy::{Body, BoxError};
use crate::rt::timer::{Deadline, ReadTimeout};
use crate::tls::UpstreamTls;

pub type Client = HyperClient<HttpsConnector<crate::rt::fds::Counted<HttpConnector>>, Body>;

thread_local! {
    /// The plain-HTTP upstreams' connections, one pool per thread: a worker's connections
    /// are registered with its own runtime, and only its own requests drive them.
    static POOL: Arc<StreamedPool> = StreamedPool::new(1024, Duration::from_secs(60), Duration::from_secs(5));
}

thread_local! {
    /// The same upstreams' connections for requests whose body is in memory (`h1`).
    static H1: Arc<H1Pool> = H1Pool::new(1024, Duration::from_secs(60), Duration::from_secs(5));
}

/// Closes this thread's idle upstream connections that are past the idle timeout.
pub fn sweep_idle() {
    POOL.with(|pool| pool.sweep());
    H1.with(|pool| pool.sweep());
}

/// How an upstream exchange failed.
pub struct UpstreamError {
    /// Nothing reached the upstream: nothing to settle.
    pub not_sent: bool,
    pub detail: String,
}

/// An upstream's response, from the pool or from an https client.
pub enum Upstreamed {
    Pooled(Response<StreamedBody>),
    H1(Response<H1Body>),
    Tls(Response<TlsBody>),
}

impl Upstreamed {
    pub fn status(&self) -> http::StatusCode {
        match self {
            Upstreamed::Pooled(r) => r.status(),
            Upstreamed::H1(r) => r.status(),
            Upstreamed::Tls(r) => r.status(),
        }
    }
}

/// Sends a prepared request (see [`upstream_parts`]) whose body is `body`, in memory, to a
/// plain-HTTP upstream through this thread's lean HTTP/1.1 pool. Here and in [`send`], the
/// upstream's `timeout` also bounds every wait for more of the response body.
pub async fn send_whole(
    upstream: &Upstream,
    parts: &http::request::Parts,
    added: &Added,
    body: &Bytes,
    connect_by: Instant,
) -> Result<Upstreamed, UpstreamError> {
    H1.with(Arc::clone)
        .send(
            upstream.url.authority(),
            parts,
            added.pairs(),
            body,
            upstream.timeout,
            connect_by,
        )
        .await
        .map(Upstreamed::H1)
        .map_err(|e| UpstreamError {
            not_sent: e.not_sent,
            detail: e.detail,
        })
}

/// Sends a prepared request through the https upstream's client if it has one (absolute
/// URI), else through this thread's plain-HTTP pool (origin form, to `upstream`).
pub async fn send(
    upstream: &Upstream,
    tls_client: Option<&Client>,
    req: Request<Body>,
    connect_by: Instant,
) -> Result<Upstreamed, UpstreamError> {
    let head_request = req.method() == http::Method::HEAD;
    match tls_client {
        Some(c) => c
            .request(req)
            .await
            .map_err(|e| UpstreamError {
                not_sent: e.is_connect(),
                detail: error_chain(&e),
            })
            .and_then(|r| checked(r, head_request).map(|(r, _)| r))
            .map(|resp| {
                Upstreamed::Tls(resp.map(|inner| TlsBody {
                    inner,
                    read_timeout: ReadTimeout::new(upstream.timeout),
                }))
            }),
        None => POOL
            .with(Arc::clone)
            .send(upstream.url.authority(), req, upstream.timeout, connect_by)
            .await
            .map_err(|e| match e {
                SendError::NotSent(detail) => UpstreamError {
                    not_sent: true,
                    detail,
                },
                SendError::Sent(e) => UpstreamError {
                    not_sent: false,
                    detail: error_chain(&e),
                },
            })
            .and_then(|r| checked(r, head_request))
            .map(|(mut resp, reusable)| {
                if !reusable {
                    resp.body_mut().forbid_reuse();
                }
                Upstreamed::Pooled(resp)
            }),
    }
}

/// A response from hyper's client with its framing headers checked as the lean exchange
/// checks its own ([`upstream::check_framing`]): hyper has delimited the body, but a length
/// left beside the coding it took off would frame the body again, wrongly, on the way to
/// the client. A refused response fails the exchange after the request was sent (the
/// upstream may have acted on it), as on the lean exchange. Also answers whether the
/// connection may be used again (an https client's pool decides that for itself).
fn checked<B>(
    mut resp: Response<B>,
    head_request: bool,
) -> Result<(Response<B>, bool), UpstreamError> {
    let status = resp.status();
    let reusable =
        upstream::check_framing(status, head_request, resp.headers_mut()).map_err(|detail| {
            UpstreamError {
                not_sent: false,
                detail,
            }
        })?;
    Ok((resp, reusable))
}

/// A response body from an https upstream's client, failing if a wait for more of it
/// lasts the upstream's timeout. Failing drops it unfinished, so the client does not pool
/// its connection again (an HTTP/2 upstream gets its stream reset).
pub struct TlsBody {
    inner: Incoming,
    read_timeout: ReadTimeout,
}

impl http_body::Body for TlsBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.read_timeout.progressed();
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(Box::new(e)))),
            Poll::Ready(None) => Poll::Ready(None),
            // Waiting for the upstream (a client that reads slowly is not polling at all).
            Poll::Pending => this
                .read_timeout
                .poll_waiting(cx)
                .map(|e| Some(Err(Box::new(e) as BoxError))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// The client of one https upstream, built with the routing table from its TLS settings,
/// so connections made under different CAs or client certificates never share a pool,
/// and a reload's new settings apply to new connections.
pub fn client(tls: &UpstreamTls) -> Client {
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
static HOP_BY_HOP: [HeaderName; 9] = [
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

/// The position of `name` in [`HOP_BY_HOP`]: one match on the name's text (a length
/// check, then at most a few byte comparisons) instead of comparing it with every entry.
fn hop_by_hop_index(name: &str) -> Option<usize> {
    match name {
        "connection" => Some(0),
        "keep-alive" => Some(1),
        "proxy-connection" => Some(2),
        "proxy-authenticate" => Some(3),
        "proxy-authorization" => Some(4),
        "te" => Some(5),
        "trailer" => Some(6),
        "transfer-encoding" => Some(7),
        "upgrade" => Some(8),
        _ => None,
    }
}

/// Removes hop-by-hop headers, including every name listed in `Connection` — read before
/// `Connection` itself is removed.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the names present decides which to remove (most messages carry none,
    // or only `Connection`), instead of a hash lookup per listed name.
    let mut present = [false; HOP_BY_HOP.len()];
    for name in headers.keys() {
        if let Some(i) = hop_by_hop_index(name.as_str()) {
            present[i] = true;
        }
    }
    strip_present(headers, present);
}

/// [`strip_hop_by_hop`] once the hop-by-hop names present are known (`present`, indexed
/// like [`HOP_BY_HOP`]). Answers whether it removed a name listed in `Connection`, which
/// may be any header at all.
fn strip_present(headers: &mut HeaderMap, present: [bool; HOP_BY_HOP.len()]) -> bool {
    if present == [false; HOP_BY_HOP.len()] {
        return false;
    }
    let mut listed_any = false;
    if present[0] {
        // `keep-alive` (already in the fixed list) and `close` are the usual options; neither
        // needs a name parsed, so the common `Connection: keep-alive` costs no allocation.
        // Split as bytes: one element that is not visible ASCII (which `to_str` refuses)
        // must not hide the names listed beside it.
        let listed: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .flat_map(|v| v.as_bytes().split(|b| *b == b','))
            .map(<[u8]>::trim_ascii)
            .filter(|t| !t.eq_ignore_ascii_case(b"keep-alive") && !t.eq_ignore_ascii_case(b"close"))
            // Lowercased: names match whatever their case.
            .filter_map(|t| HeaderName::from_bytes(t).ok())
            // Host chose the route and so the scope: the upstream must see the same one
            // (an upstream that fell back to its own authority could read the path as
            // another resource, under another scope).
            .filter(|n| *n != header::HOST)
            .collect();
        for name in listed {
            listed_any |= headers.remove(name).is_some();
        }
    }
    for (name, _) in HOP_BY_HOP.iter().zip(present).filter(|(_, p)| *p) {
        headers.remove(name);
    }
    listed_any
}

/// The names [`upstream_request`] acts on, found in one pass over a request's headers
/// (each name compared by its text) instead of a hash lookup each.
#[derive(Default)]
struct Names {
    /// Hop-by-hop names present, indexed like [`HOP_BY_HOP`].
    hop_by_hop: [bool; HOP_BY_HOP.len()],
    host: bool,
    /// Any of [`FORWARDING`].
    forwarding: bool,
    forwarded_for: bool,
    forwarded_proto: bool,
    expect: bool,
    /// A `cookie` field (HTTP/2 clients send one per cookie).
    cookie: bool,
}

impl Names {
    fn of(headers: &HeaderMap) -> Names {
        let mut names = Names::default();
        for name in headers.keys() {
            match name.as_str() {
                "host" => names.host = true,
                "x-forwarded-for" => {
                    names.forwarding = true;
                    names.forwarded_for = true;
                }
                "x-forwarded-proto" => {
                    names.forwarding = true;
                    names.forwarded_proto = true;
                }
                "x-forwarded-host" | "x-forwarded-port" | "forwarded" | "x-real-ip" => {
                    names.forwarding = true;
                }
                "expect" => names.expect = true,
                "cookie" => names.cookie = true,
                other => {
                    if let Some(i) = hop_by_hop_index(other) {
                        names.hop_by_hop[i] = true;
                    }
                }
            }
        }
        names
    }
}

/// Appends to a list header (`present`: the map holds it already), folding any repeated
/// lines into one list first.
fn append(headers: &mut HeaderMap, name: &HeaderName, value: HeaderValue, present: bool) {
    if !present {
        headers.insert(name, value);
        return;
    }
    let mut joined: Vec<&str> = headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    let Ok(own) = value.to_str() else {
        return;
    };
    joined.push(own);
    if let Ok(v) = HeaderValue::from_str(&joined.join(", ")) {
        headers.insert(name, v);
    }
}

thread_local! {
    /// The last client address seen on this thread as a header value: a connection's
    /// requests (and most of a worker's, behind a load balancer) share it.
    static PEER_VALUE: std::cell::RefCell<Option<(IpAddr, HeaderValue)>> =
        const { std::cell::RefCell::new(None) };
}

/// `peer` as an `X-Forwarded-For` element.
fn peer_value(peer: IpAddr) -> HeaderValue {
    PEER_VALUE.with(|cache| {
        let mut cache = cache.borrow_mut();
        if let Some((ip, v)) = cache.as_ref()
            && *ip == peer
        {
            return v.clone();
        }
        let v = HeaderValue::from_str(&peer.to_string())
            .unwrap_or_else(|_| HeaderValue::from_static("unknown"));
        *cache = Some((peer, v.clone()));
        v
    })
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Headers in which a client could claim another address, host or scheme.
static FORWARDING: [HeaderName; 6] = [
    X_FORWARDED_FOR,
    X_FORWARDED_PROTO,
    HeaderName::from_static("x-forwarded-host"),
    HeaderName::from_static("x-forwarded-port"),
    header::FORWARDED,
    HeaderName::from_static("x-real-ip"),
];

/// What became of a request body on its way to the upstream through hyper's client.
#[derive(Debug, Default)]
pub struct Outgoing {
    /// The body outgrew the route's `max_body` on the way.
    tripped: AtomicBool,
    /// hyper's client took the body's end: every byte of it was handed to the
    /// connection. An answer that completes before this did not see the whole request
    /// (SPEC §3, invariant 3).
    written: AtomicBool,
}

impl Outgoing {
    pub fn tripped(&self) -> bool {
        self.tripped.load(Ordering::Acquire)
    }

    pub fn written(&self) -> bool {
        self.written.load(Ordering::Acquire)
    }
}

/// A request body that notes in [`Outgoing::written`] when its end is taken.
struct Writing<B> {
    inner: B,
    outgoing: Arc<Outgoing>,
}

impl<B> http_body::Body for Writing<B>
where
    B: http_body::Body<Data = Bytes, Error = BoxError> + Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        // hyper ends the message after a frame that leaves the body at its end, without
        // polling for `None`; a failed body never ends.
        if matches!(polled, Poll::Ready(None))
            || (matches!(polled, Poll::Ready(Some(Ok(_)))) && this.inner.is_end_stream())
        {
            this.outgoing.written.store(true, Ordering::Release);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The upstream request for hyper's client, from a head prepared by [`upstream_parts`]
/// and the body to stream. Answers the request and what becomes of its body on the way:
/// whether it outgrew `max_body`, and whether it was all written.
pub fn upstream_request(
    mut parts: http::request::Parts,
    body: Body,
    max_body: Option<u64>,
) -> (Request<Body>, Arc<Outgoing>) {
    // hyper's client sends a GET or HEAD whose body has no known length as if it had
    // none, and drops the body. A chunked GET (or an HTTP/2 one with data and no length)
    // goes upstream as received instead: chunked, since the length is not known.
    if matches!(parts.method, http::Method::GET | http::Method::HEAD)
        && http_body::Body::size_hint(&body).exact().is_none()
        && !http_body::Body::is_end_stream(&body)
    {
        parts.headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
    }
    let outgoing = Arc::new(Outgoing::default());
    // An empty body is never polled: there is nothing to write.
    if http_body::Body::is_end_stream(&body) {
        outgoing.written.store(true, Ordering::Release);
        return (Request::from_parts(parts, body), outgoing);
    }
    let body = match max_body {
        // Fails at the frame that takes the body past `limit` (a body without a length;
        // one with a length over it was refused before): the flag tells that failure
        // from the client's own.
        Some(limit) => {
            let watch = outgoing.clone();
            Writing {
                inner: Limited::new(body, usize::try_from(limit).unwrap_or(usize::MAX)).map_err(
                    move |e| {
                        if e.is::<LengthLimitError>() {
                            watch.tripped.store(true, Ordering::Release);
                        }
                        e
                    },
                ),
                outgoing: outgoing.clone(),
            }
            .boxed()
        }
        None => Writing {
            inner: body,
            outgoing: outgoing.clone(),
        }
        .boxed(),
    };
    (Request::from_parts(parts, body), outgoing)
}

/// The head of the upstream request, made from the client's. The path and query go out
/// byte for byte as received; Host is preserved (signatures such as SigV4 cover it), or
/// taken from the h2 authority. Forwarding headers are kept only from a trusted proxy.
/// The URI is in origin form for the pools, absolute (`absolute`) for an https
/// upstream's client.
pub fn upstream_parts(
    parts: &mut http::request::Parts,
    upstream: &Upstream,
    peer: IpAddr,
    tls: bool,
    trusted: bool,
    absolute: bool,
) -> Result<Added, http::Error> {
    // The path and query move over as they are (no re-parse, byte for byte).
    let path = parts
        .uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
    let uri = if absolute {
        let mut uri = Uri::builder().path_and_query(path);
        if let Some(scheme) = upstream.url.scheme() {
            uri = uri.scheme(scheme.clone());
        }
        if let Some(authority) = upstream.url.authority() {
            uri = uri.authority(authority.clone());
        }
        uri.build()?
    } else {
        Uri::from(path)
    };
    let mut names = Names::of(&parts.headers);
    if !names.host
        && let Some(v) = parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    {
        parts.headers.insert(header::HOST, v);
    }
    if strip_present(&mut parts.headers, names.hop_by_hop) {
        // `Connection` listed other names, forwarding headers among them perhaps.
        names = Names::of(&parts.headers);
    }
    if !trusted && names.forwarding {
        for name in &FORWARDING {
            parts.headers.remove(name);
        }
        names.forwarded_for = false;
        names.forwarded_proto = false;
    }
    // New names (the usual case) are left to the caller to add: see [`Added`].
    let mut added = Added::default();
    if names.forwarded_for {
        append(&mut parts.headers, &X_FORWARDED_FOR, peer_value(peer), true);
    } else {
        added.forwarded_for = Some(peer_value(peer));
    }
    // The scheme of this hop is ours to tell, unless a trusted proxy in front said it.
    // (An untrusted client's own was removed above.)
    if !trusted || !names.forwarded_proto {
        added.forwarded_proto = Some(HeaderValue::from_static(if tls { "https" } else { "http" }));
    }
    // The proxy has answered `100-continue` itself (hyper does, as the body is read) and
    // sends the whole body at once: an upstream told to expect it could answer first and
    // read the body as a request of its own.
    if names.expect {
        parts.headers.remove(header::EXPECT);
    }
    // HTTP/2 splits cookies over several fields; HTTP/1.1 wants one (RFC 9113 §8.2.3).
    if parts.version == Version::HTTP_2
        && names.cookie
        && parts
            .headers
            .get_all(header::COOKIE)
            .iter()
            .nth(1)
            .is_some()
    {
        let joined: Vec<u8> = parts
            .headers
            .get_all(header::COOKIE)
            .iter()
            .map(HeaderValue::as_bytes)
            .collect::<Vec<_>>()
            .join(&b"; "[..]);
        if let Ok(v) = HeaderValue::from_bytes(&joined) {
            parts.headers.insert(header::COOKIE, v);
        }
    }
    parts.uri = uri;
    parts.version = Version::HTTP_11;
    Ok(added)
}

/// The forwarding headers [`upstream_parts`] adds to a request that carried neither
/// name (or whose own was removed). Kept out of the header map for the lean exchange,
/// which writes them after the request's own headers: a map insert, and often the map's
/// growth, saved per request. Requests that go through hyper's client put them in the
/// map ([`Added::put_into`]).
#[derive(Debug, Default)]
pub struct Added {
    forwarded_for: Option<HeaderValue>,
    forwarded_proto: Option<HeaderValue>,
}

impl Added {
    /// The headers as (name, value) pairs, for the lean exchange's encoder.
    pub fn pairs(&self) -> impl Iterator<Item = (&'static str, &HeaderValue)> {
        [
            ("x-forwarded-for", self.forwarded_for.as_ref()),
            ("x-forwarded-proto", self.forwarded_proto.as_ref()),
        ]
        .into_iter()
        .filter_map(|(name, value)| Some((name, value?)))
    }

    /// Puts the headers into `headers`, where neither name is present.
    pub fn put_into(self, headers: &mut HeaderMap) {
        if let Some(v) = self.forwarded_for {
            headers.insert(X_FORWARDED_FOR, v);
        }
        if let Some(v) = self.forwarded_proto {
            headers.insert(X_FORWARDED_PROTO, v);
        }
    }
}

/// Whether an upstream's answer confirms that its request was applied, which is known
/// only once the answer is over (SPEC §3, invariant 3). One that does not leaves the
/// generation indeterminate: its guard drops uncompleted, and the scope settles before a
/// higher generation goes, as after an exchange that ended without an answer.
pub struct Confirms {
    /// 202 Accepted: taken to be applied later, which nothing will tell us.
    queued: bool,
    /// The request body on its way through hyper's client: an answer that completes
    /// before it was all written was given without the whole request. `None`: it was
    /// written whole before the answer was read (the lean exchange).
    outgoing: Option<Arc<Outgoing>>,
}

impl Confirms {
    pub fn new(status: http::StatusCode, outgoing: Option<Arc<Outgoing>>) -> Confirms {
        Confirms {
            queued: status == http::StatusCode::ACCEPTED,
            outgoing,
        }
    }

    /// Completes `guard` if the answer, now over, confirms its request; dropped either
    /// way (uncompleted, the scope settles).
    fn finish(&self, mut guard: InflightGuard) {
        if !self.queued && self.outgoing.as_ref().is_none_or(|o| o.written()) {
            guard.complete();
        }
    }
}

/// Prepares an upstream response for the client; the guard (if any) stays counted
/// until the body has been fully read or dropped, or has made no progress for `stall`,
/// and is then completed if the answer `confirms` its request. With a `stop` (an
/// exchange admitted under a cluster's ownership), a body still being read from the
/// upstream when the stop fires is cut: see [`Cuttable`].
pub fn client_response(
    resp: Upstreamed,
    guard: Option<InflightGuard>,
    confirms: Confirms,
    stall: Duration,
    client: http::Version,
    stop: Option<Stop>,
) -> Response<Body> {
    fn guarded<B>(
        resp: Response<B>,
        guard: Option<InflightGuard>,
        confirms: Confirms,
        stall: Duration,
        client: http::Version,
        stop: Option<Stop>,
    ) -> Response<Body>
    where
        B: http_body::Body<Data = Bytes> + Send + Sync + Unpin + 'static,
        B::Error: Into<BoxError>,
    {
        let (mut parts, body) = resp.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        // A body with nothing to read (a 204, a HEAD, an empty body) lets go at once.
        let held = match guard {
            Some(guard) if !body.is_end_stream() => {
                let held = Arc::new(Held {
                    guard: Mutex::new(Some(guard)),
                    confirms,
                });
                let mut deadline = Deadline::after(stall);
                arm(&held, &mut deadline);
                Some((held, deadline, stall))
            }
            Some(guard) => {
                confirms.finish(guard);
                None
            }
            None => None,
        };
        let hold_back = holds_back(client, &parts.headers);
        let cut = match (&held, stop) {
            (Some((held, _, _)), Some(stop)) => Some((held.clone(), stop)),
            // Nothing left to read from the upstream (or unfenced): nothing to cut.
            _ => None,
        };
        let body = GuardedBody {
            inner: body,
            held,
            hold_back,
            failed: None,
        };
        let body = match cut {
            None => body.boxed(),
            Some((held, stop)) => Cuttable::new(body, held, stop, hold_back).boxed(),
        };
        Response::from_parts(parts, body)
    }
    match resp {
        Upstreamed::Pooled(r) => guarded(r, guard, confirms, stall, client, stop),
        Upstreamed::H1(r) => guarded(r, guard, confirms, stall, client, stop),
        Upstreamed::Tls(r) => guarded(r, guard, confirms, stall, client, stop),
    }
}

/// A response body admitted under a cluster's ownership (SPEC §10): the exchange is in
/// flight until its body has been read from the upstream to its end, and it races the
/// ownership's stop all that time, not only until the head. The race is the upstream's,
/// not the client's: a watcher task awaits the stop, whether or not the client is reading
/// (a client that stops reading stops the relay, not a backend that still has room in
/// the sockets' buffers to go on sending). When the stop fires first, the upstream body is
/// dropped there and then, which closes its connection (a backend still sending sees its
/// writes fail), the generation's count is let go of uncompleted (its outcome is not
/// known: the scope settles), and the client's body fails: an HTTP/1.1 client sees the
/// connection close before the body's end (never a complete message: see
/// [`holds_back`]), an HTTP/2 client its stream reset. A body read from the upstream to
/// its end before the stop is the client's whole, however late the client reads it.
struct Cuttable<B> {
    shared: Arc<Mutex<CutState<B>>>,
    watcher: tokio::task::JoinHandle<()>,
    /// Whether the error is held back for one poll ([`holds_back`]).
    hold_back: bool,
}

struct CutState<B> {
    /// The body, until the stop cuts it.
    body: Option<GuardedBody<B>>,
    /// Read from the upstream to its end (or failed): the stop has nothing left to cut.
    ended: bool,
    cut: bool,
    /// The client's task, when it last waited for the upstream.
    waker: Option<std::task::Waker>,
}

impl<B> Cuttable<B>
where
    B: http_body::Body<Data = Bytes> + Send + Sync + Unpin + 'static,
{
    fn new(body: GuardedBody<B>, held: Arc<Held>, stop: Stop, hold_back: bool) -> Cuttable<B> {
        let shared = Arc::new(Mutex::new(CutState {
            body: Some(body),
            ended: false,
            cut: false,
            waker: None,
        }));
        let watcher = tokio::spawn({
            let shared = shared.clone();
            async move {
                let mut stop = stop;
                (&mut stop).await;
                let (body, waker) = {
                    let mut st = shared.lock().unwrap_or_else(|p| p.into_inner());
                    if st.ended {
                        return;
                    }
                    st.cut = true;
                    (st.body.take(), st.waker.take())
                };
                // Uncompleted first: the body's own release would complete it.
                held.abandon();
                drop(body);
                // Held until the upstream side is gone: a hand-off counts the stops.
                drop(stop);
                if let Some(waker) = waker {
                    waker.wake();
                }
            }
        });
        Cuttable {
            shared,
            watcher,
            hold_back,
        }
    }
}

impl<B> Drop for Cuttable<B> {
    fn drop(&mut self) {
        self.watcher.abort();
        // The body goes now (its count released as a client that went away releases
        // it), not when the aborted watcher is dropped.
        let body = self
            .shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .body
            .take();
        drop(body);
    }
}

impl<B> http_body::Body for Cuttable<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let mut st = this.shared.lock().unwrap_or_else(|p| p.into_inner());
        if st.cut {
            if std::mem::take(&mut this.hold_back) {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            st.cut = false;
            st.ended = true;
            return Poll::Ready(Some(Err(
                "this instance's ownership of the scope's shard ended mid-body".into(),
            )));
        }
        let Some(body) = st.body.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(&mut *body).poll_frame(cx);
        let ended = match &polled {
            Poll::Pending => false,
            Poll::Ready(Some(Ok(_))) => body.is_end_stream(),
            Poll::Ready(None | Some(Err(_))) => true,
        };
        if ended {
            st.ended = true;
            this.watcher.abort();
        } else if polled.is_pending() && !st.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker()))
        {
            st.waker = Some(cx.waker().clone());
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        let st = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        !st.cut && st.body.as_ref().is_none_or(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let st = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        st.body
            .as_ref()
            .map_or_else(SizeHint::default, |b| b.size_hint())
    }
}

/// Whether a response body that fails may hold its error back one poll, so that what came
/// before it (the head at least) reaches the client first: see `GuardedBody`'s `poll_frame`.
/// Not for an HTTP/1.0 client of a response without `Content-Length` (`headers`: the
/// response's), which ends where the connection closes: a cut there would read as the
/// body's end, where no answer at all cannot.
pub fn holds_back(client: http::Version, headers: &http::HeaderMap) -> bool {
    client != http::Version::HTTP_10 || headers.contains_key(header::CONTENT_LENGTH)
}

/// The body of a response whose upstream body failed before it was answered (read whole
/// first, as for a request with an `Idempotency-Key`): the head goes out, then the error
/// ends the connection short of the message's end. The error is held back one poll as in
/// [`GuardedBody`] when `hold_back` ([`holds_back`]).
pub struct CutShort {
    error: Option<BoxError>,
    hold_back: bool,
}

impl CutShort {
    pub fn new(error: BoxError, hold_back: bool) -> CutShort {
        CutShort {
            error: Some(error),
            hold_back,
        }
    }
}

impl http_body::Body for CutShort {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if std::mem::take(&mut this.hold_back) {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        Poll::Ready(this.error.take().map(Err))
    }
}

/// A fenced response's in-flight count, shared by its body and its stall deadline: a
/// body that stops moving (a client that stopped reading: paused, as the very owner that
/// fencing is for may be) lets go of it as a client that went away would, so that a newer
/// generation is not held up for as long as the old owner keeps its connection open. The
/// upstream has already answered; only the delivery of its body is left.
struct Held {
    guard: Mutex<Option<InflightGuard>>,
    /// Decides, once the answer is over, whether it confirmed its request.
    confirms: Confirms,
}

impl Held {
    /// Lets go of the count uncompleted: the exchange was given up mid-body.
    fn abandon(&self) {
        drop(self.guard.lock().unwrap_or_else(|p| p.into_inner()).take());
    }

    fn release(&self) {
        let guard = self.guard.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(guard) = guard {
            self.confirms.finish(guard);
        }
    }
}

/// The deadline fired: the body made no progress in time.
impl std::task::Wake for Held {
    fn wake(self: Arc<Self>) {
        self.release();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.release();
    }
}

/// Arms `deadline` to release `held` when it passes.
fn arm(held: &Arc<Held>, deadline: &mut Deadline) {
    let waker = std::task::Waker::from(held.clone());
    let _ = Pin::new(deadline).poll(&mut Context::from_waker(&waker));
}

/// An upstream body that releases its generation's in-flight count when it ends (or
/// stalls; see [`Held`]).
struct GuardedBody<B> {
    inner: B,
    /// For a fenced response: its count, the stall deadline, and the stall limit.
    held: Option<(Arc<Held>, Deadline, Duration)>,
    /// Whether an error is held back for one poll ([`holds_back`]).
    hold_back: bool,
    /// An error held back for one poll: see `GuardedBody`'s `poll_frame`.
    failed: Option<BoxError>,
}

impl<B> GuardedBody<B> {
    fn release(&mut self) {
        if let Some((held, _, _)) = self.held.take() {
            held.release();
        }
    }
}

impl<B> Drop for GuardedBody<B> {
    fn drop(&mut self) {
        self.release();
    }
}

impl<B> http_body::Body for GuardedBody<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Some(e) = this.failed.take() {
            return Poll::Ready(Some(Err(e)));
        }
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if this.hold_back
            && let Poll::Ready(Some(Err(e))) = polled
        {
            // The upstream closed or broke its framing. hyper's HTTP/1 server flushes
            // what it buffered (the head, the data before) only once a poll of the body
            // returns pending, and drops that buffer with the connection on an error: an
            // upstream that fails right after its head would leave the client with no
            // answer at all, not even the status of what it may have done. Held back for
            // one poll, everything before the failure goes out first, then the connection
            // closes short of the message's end (never a complete message).
            this.release();
            this.failed = Some(e.into());
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        match &polled {
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => this.release(),
            Poll::Ready(Some(Ok(_))) => {
                if this.inner.is_end_stream() {
                    this.release();
                } else if let Some((held, deadline, stall)) = this.held.as_mut() {
                    deadline.reset(Instant::now() + *stall);
                    arm(held, deadline);
                }
            }
            Poll::Pending => {}
        }
        polled.map(|o| o.map(|r| r.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Request bodies of known length up to this size are read whole before forwarding.
const WHOLE_BODY: u64 = 64 * 1024;

/// Reads a body of known length whole (hyper holds a body to its Content-Length). Stops
/// as soon as the body says it has ended, without a poll for its end; one data frame,
/// the usual case for a small body, is kept as it is.
async fn read_whole(mut body: Body) -> Result<Bytes, BoxError> {
    let mut first: Option<Bytes> = None;
    let mut joined = bytes::BytesMut::new();
    while !http_body::Body::is_end_stream(&body) {
        let Some(frame) = body.frame().await else {
            break;
        };
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        match first.take() {
            None if joined.is_empty() => first = Some(data),
            earlier => {
                if let Some(earlier) = earlier {
                    joined.extend_from_slice(&earlier);
                }
                joined.extend_from_slice(&data);
            }
        }
    }
    Ok(first.unwrap_or_else(|| joined.freeze()))
}

/// The forwarding stage and what it reports to (the upstream connections are the
/// worker's pool, or the https upstream's client in the routing table).
#[derive(Clone)]
pub(crate) struct Forwarder {
    pub(super) metrics: Arc<Metrics>,
}

impl Forwarder {
    /// Forwards an admitted request. (A plain function returning its future, as
    /// [`Proxy::handle`](super::Proxy::handle).)
    #[allow(clippy::manual_async_fn)]
    #[inline(always)]
    pub(crate) fn forward<'a>(
        &'a self,
        table: Arc<Table>,
        req: Request<Body>,
        plan: Plan,
        conn: crate::proxy::fence::Conn,
    ) -> impl Future<Output = Response<Body>> + Send + 'a {
        async move {
            let (peer, tls) = (conn.peer, conn.tls);
            let Plan {
                route,
                op,
                mut guard,
                scope,
                token,
                hop,
                stop,
                ..
            } = plan;
            let fenced = guard.is_some();
            let table = &*table;
            let config = &table.config;
            let row = &table.rows[route];
            let max_body = config.routes[route].max_body;
            let upstream_index = config.routes[route].upstream;
            // A hop goes to the shard's owner instead (SPEC §10), plain HTTP, and may
            // wait there for older generations to drain before the owner's own exchange.
            let hop_upstream;
            let (upstream, tls_client) = match &hop {
                Some(h) => {
                    let route_upstream = &config.upstreams[upstream_index];
                    hop_upstream = Upstream {
                        name: String::new(),
                        url: h.url.clone(),
                        timeout: route_upstream
                            .timeout
                            .saturating_add(config.fencing.drain_timeout),
                        tls: None,
                        distinct_hosts: route_upstream.distinct_hosts,
                    };
                    (&hop_upstream, None)
                }
                None => (
                    &config.upstreams[upstream_index],
                    table.clients[upstream_index].as_ref(),
                ),
            };
            // The path is named only in an S3 error document: copied only on such routes.
            let resource = (config.routes[route].errors != problem::Dialect::Problem)
                .then(|| req.uri().path().to_owned());
            let fail = |outcome: Outcome| table.refuse(route, op, outcome, resource.as_deref());
            // An authenticated peer hands on its client's forwarding headers.
            let trusted = conn.hop
                || config
                    .trusted_proxies
                    .iter()
                    .any(|net| net.contains(peer.ip()));
            // A small HTTP/1 body of known length is read whole before the request goes
            // upstream. An upstream may answer without reading a body (nginx's `return`, an
            // early error): part of it would then stay unread on the client's connection,
            // which hyper closes after the response, and a client that already sent its next
            // request on it sees a broken pipe. Larger or unsized bodies are streamed, and so
            // is every HTTP/2 body (an unread one ends its own stream only). Request trailers
            // are not passed on either way (`Trailer` is stripped, and hyper's client sends
            // only declared ones): the fence reads the head alone, and a trailer field could
            // carry what it refuses there.
            let whole = req.version() <= http::Version::HTTP_11;
            // The upstream timeout counts from here: reading the body is part of the exchange
            // (as it was when the body streamed upstream), and the clock is read once.
            let started = Instant::now();
            // A connection not made by the exchange's end is given up on its own, so that
            // the request is known not to have reached the upstream: 502 and no settle,
            // rather than the exchange's 504 (outcome unknown).
            let connect_by = started
                .checked_add(upstream.timeout)
                .unwrap_or(started + Duration::from_secs(86_400 * 365));
            let (mut parts, body) = req.into_parts();
            let client_version = parts.version;
            // The peer credential is a cluster's own: never a client's, and never sent
            // upstream; a hop carries this cluster's. (A lone instance gives the header
            // no meaning and leaves it be.)
            if config.clustered {
                parts.headers.remove(FENCEGATE_PEER);
            }
            if let Some(h) = &hop {
                parts.headers.insert(FENCEGATE_PEER, h.key.clone());
            }
            // The body in memory (none, or a small one read whole), or still to stream.
            let body: Result<Bytes, Body> = if http_body::Body::is_end_stream(&body) {
                Ok(Bytes::new())
            } else {
                match http_body::Body::size_hint(&body).exact() {
                    Some(len)
                        if whole && len <= WHOLE_BODY && max_body.is_none_or(|m| len <= m) =>
                    {
                        let read = crate::rt::timer::timeout_from(
                            started,
                            upstream.timeout,
                            read_whole(body),
                        )
                        .await;
                        match read {
                            Ok(Ok(bytes)) => Ok(bytes),
                            Ok(Err(_)) | Err(_) => {
                                if let Some(g) = guard.as_mut() {
                                    g.not_forwarded();
                                }
                                return fail(Outcome::InvalidRequest {
                                    detail: "the request body could not be read (in time)".into(),
                                });
                            }
                        }
                    }
                    _ => Err(body),
                }
            };
            let added = match upstream_parts(
                &mut parts,
                upstream,
                peer.ip(),
                tls,
                trusted,
                tls_client.is_some(),
            ) {
                Ok(added) => added,
                Err(e) => {
                    if let Some(g) = guard.as_mut() {
                        g.not_forwarded();
                    }
                    return fail(Outcome::InvalidRequest {
                        detail: format!("cannot forward: {e}"),
                    });
                }
            };
            // The exchange, spelled once and expanded twice: inline for a request without
            // a `stop` (every request of a lone instance: its awaits stay in this future,
            // with no nested one), and inside the race for one with it.
            macro_rules! exchange {
                () => {
                    match (body, tls_client) {
                        // A plain-HTTP upstream and a body in hand: the lean exchange.
                        (Ok(bytes), None) => {
                            let r = crate::rt::timer::timeout_from(
                                started,
                                upstream.timeout,
                                send_whole(upstream, &parts, &added, &bytes, connect_by),
                            )
                            .await;
                            (r.map_err(drop), None)
                        }
                        (body, tls_client) => {
                            let body = match body {
                                Ok(bytes) => http_body_util::Full::new(bytes)
                                    .map_err(|never| match never {})
                                    .boxed(),
                                Err(streamed) => streamed,
                            };
                            added.put_into(&mut parts.headers);
                            let (out, outgoing) = upstream_request(parts, body, max_body);
                            // Boxed: hyper's client exchange makes a large future, which
                            // would make every request's future (moved whole on its way to
                            // hyper) that large.
                            let r = crate::rt::timer::timeout_from(
                                started,
                                upstream.timeout,
                                Box::pin(send(upstream, tls_client, out, connect_by)),
                            )
                            .await;
                            (r.map_err(drop), Some(outgoing))
                        }
                    }
                };
            }
            // In a cluster, an owner whose ownership ends mid-exchange (its self-fencing
            // deadline, or its shard's hand-off cutting what did not drain; SPEC §10)
            // gives the exchange up there and then: the shard's next owner may start
            // admitting once that ownership could have expired. Boxed, so that the race
            // takes no room in a lone instance's request future.
            // The stop goes on with the response body, which races it too (see
            // [`Cuttable`]); one that fired here is done with.
            let (((result, outgoing), stopped), stop) = match stop {
                None => ((exchange!(), false), None),
                Some(mut stop) => {
                    Box::pin(async move {
                        let r = tokio::select! {
                            biased;
                            () = &mut stop => ((Err(()), None), true),
                            r = async { exchange!() } => (r, false),
                        };
                        let stop = (!r.1).then_some(stop);
                        (r, stop)
                    })
                    .await
                }
            };
            self.metrics
                .upstream_seconds
                .observe_duration(started.elapsed());
            match result {
                Ok(Ok(resp)) => {
                    // The guard is completed, or not, when the answer is over.
                    let confirms = Confirms::new(resp.status(), outgoing);
                    row.count(
                        op,
                        match (fenced, hop.is_some()) {
                            (_, true) => "forwarded_to_owner",
                            (true, _) => "accepted",
                            _ => "unfenced",
                        },
                    );
                    // A body that stops moving for the upstream's timeout lets go of its generation.
                    let mut resp = client_response(
                        resp,
                        guard,
                        confirms,
                        upstream.timeout,
                        client_version,
                        stop,
                    );
                    if hop.is_some() {
                        // The owner decided: its Fencing-Result is the answer's.
                    } else if fenced {
                        resp.headers_mut()
                            .insert(FENCING_RESULT, HeaderValue::from_static("accepted"));
                    } else {
                        // The header is fencegate's word: an upstream's own must not make an
                        // unfenced answer look fenced.
                        resp.headers_mut().remove(FENCING_RESULT);
                    }
                    resp
                }
                // The body outgrew the route's limit mid-stream: the upstream saw an incomplete
                // message, which it cannot apply, so there is nothing to settle.
                Ok(Err(_)) if outgoing.as_ref().is_some_and(|o| o.tripped()) => {
                    if let Some(g) = guard.as_mut() {
                        g.complete();
                    }
                    fail(Outcome::PayloadTooLarge {
                        limit: max_body.unwrap_or(0),
                    })
                }
                // The owner could not be reached: nothing was decided, retry.
                Ok(Err(e)) if e.not_sent && hop.is_some() => {
                    tracing::debug!(owner = hop.as_ref().map(|h| h.owner.as_str()), error = %e.detail, "hop to the shard's owner not sent");
                    fail(Outcome::Unavailable {
                        scope: scope.unwrap_or_default(),
                        token: token.unwrap_or(crate::token::Token::new(0, 0)),
                    })
                }
                Ok(Err(e)) if e.not_sent => {
                    // Never reached the upstream: nothing to settle, and the token was not
                    // used (the answer says retry).
                    if let Some(g) = guard.as_mut() {
                        g.not_forwarded();
                    }
                    upstream_failure(&upstream.name, &e.detail);
                    fail(Outcome::UpstreamUnavailable {
                        scope,
                        detail: "the connection (or its TLS handshake) failed".into(),
                    })
                }
                // Sent, then reset or timed out: the upstream may still apply it. The guard
                // drops uncompleted, so the scope settles before a newer generation goes.
                Ok(Err(e)) => {
                    upstream_failure(&upstream.name, &e.detail);
                    fail(Outcome::UpstreamTimeout {
                        scope,
                        detail: "the exchange ended without a response".into(),
                    })
                }
                Err(()) if stopped => fail(Outcome::UpstreamTimeout {
                    scope,
                    detail: "this instance's ownership of the scope's shard ended mid-exchange"
                        .into(),
                }),
                Err(()) => fail(Outcome::UpstreamTimeout {
                    scope,
                    detail: format!("no response within {:?}", upstream.timeout),
                }),
            }
        }
    }
}

/// Logs why an exchange with `upstream` failed: addresses, TLS and socket details are
/// for the operator's log, never for the client's answer. At most one line a second
/// (an upstream that is down fails every request), with the count of those not logged.
fn upstream_failure(upstream: &str, detail: &str) {
    use std::sync::atomic::AtomicU64;
    static LAST: AtomicU64 = AtomicU64::new(0);
    static QUIET: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if LAST.swap(now, Ordering::Relaxed) == now {
        QUIET.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let unlogged = QUIET.swap(0, Ordering::Relaxed);
    tracing::warn!(upstream, detail, unlogged, "upstream exchange failed");
}

/// The forwarder as the binary calls it (see [`crate::proxy::fence::Stage`]).
impl crate::proxy::fence::Stage<Body> for Forwarder {
    // Forced inline, as the idempotency stage's: with the exchange's future returned as
    // it is, 29,285 instructions per W1 request against 29,597 with neither (see
    // docs/PERFORMANCE.md).
    #[inline(always)]
    fn serve(
        &self,
        a: crate::proxy::fence::Admitted<Body>,
    ) -> impl Future<Output = Response<Body>> + Send + '_ {
        let crate::proxy::fence::Admitted {
            req,
            table,
            plan,
            conn,
        } = a;
        // The exchange's own future, not one wrapped around it: one state machine less
        // per request.
        self.forward(table, req, plan, conn)
    }
}

/// The forwarder as the innermost service of the stack: an admitted request's upstream
/// exchange. Always ready; its refusals are responses.
impl tower::Service<crate::proxy::fence::Admitted<Body>> for Forwarder {
    type Response = Response<Body>;
    type Error = std::convert::Infallible;
    // Boxed: the exchange's future is large, and the fence's (which holds this one)
    // would be that large.
    type Future = std::pin::Pin<
        Box<dyn Future<Output = Result<Response<Body>, std::convert::Infallible>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), std::convert::Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, a: crate::proxy::fence::Admitted<Body>) -> Self::Future {
        let fwd = self.clone();
        Box::pin(async move {
            let crate::proxy::fence::Admitted {
                req,
                table,
                plan,
                conn,
            } = a;
            Ok(fwd.forward(table, req, plan, conn).await)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hop_by_hop_match_agrees_with_the_list() {
        for (i, name) in HOP_BY_HOP.iter().enumerate() {
            assert_eq!(hop_by_hop_index(name.as_str()), Some(i), "{name}");
        }
        for name in [
            header::HOST,
            header::CONTENT_LENGTH,
            header::CONTENT_TYPE,
            HeaderName::from_static("fencing-token"),
            HeaderName::from_static("x-connection"),
            HeaderName::from_static("tes"),
        ] {
            assert_eq!(hop_by_hop_index(name.as_str()), None, "{name}");
        }
    }

    /// What reaches the upstream: no `Expect` (the proxy sends the whole body at once),
    /// and an HTTP/2 request's cookie fields as one `cookie` line.
    #[test]
    fn expect_goes_and_http2_cookies_are_joined() {
        let upstream = crate::settings::Config::parse(
            "[store]\npath = \"m.redb\"\n[[upstream]]\nname = \"u\"\nurl = \"http://127.0.0.1:1\"\n[[route]]\nname = \"r\"\npath = \"/{*p}\"\nscope = \"s\"\nupstream = \"u\"\n",
            std::path::Path::new("."),
        )
        .unwrap()
        .upstreams
        .remove(0);
        for (version, cookie) in [
            (Version::HTTP_2, vec!["a=1; b=2; c=3"]),
            (Version::HTTP_11, vec!["a=1; b=2", "c=3"]),
        ] {
            let (mut parts, ()) = Request::builder()
                .version(version)
                .uri("http://h/x")
                .header("expect", "100-continue")
                .header("cookie", "a=1; b=2")
                .header("cookie", "c=3")
                .body(())
                .unwrap()
                .into_parts();
            upstream_parts(
                &mut parts,
                &upstream,
                IpAddr::from([127, 0, 0, 1]),
                false,
                false,
                false,
            )
            .unwrap();
            assert!(!parts.headers.contains_key(header::EXPECT));
            let cookies: Vec<_> = parts.headers.get_all(header::COOKIE).iter().collect();
            assert_eq!(cookies, cookie, "{version:?}");
        }
    }

    /// A streamed body (no length): its frames, ready one after another.
    struct Frames(std::collections::VecDeque<Result<Frame<Bytes>, BoxError>>);

    impl http_body::Body for Frames {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            Poll::Ready(self.get_mut().0.pop_front())
        }
    }

    /// `pieces` as a body without a length, then a failure of the client's if `fail`.
    fn streamed(pieces: &[&'static [u8]], fail: bool) -> Body {
        let mut frames: std::collections::VecDeque<_> = pieces
            .iter()
            .map(|p| Ok(Frame::data(Bytes::from_static(p))))
            .collect();
        if fail {
            frames.push_back(Err("the client went away".into()));
        }
        Frames(frames).boxed()
    }

    /// What reaches the upstream of a streamed body under `max_body`: the data before the
    /// frame that takes it past the limit, then an error that sets the flag; a client's
    /// own failure does not.
    #[tokio::test]
    async fn a_streamed_body_fails_at_the_frame_past_max_body_and_says_so() {
        let (parts, ()) = Request::builder()
            .method("PUT")
            .uri("/x")
            .body(())
            .unwrap()
            .into_parts();
        for (pieces, fail, limit, data, tripped) in [
            (&[&b"abc"[..], b"de"][..], false, 5, &b"abcde"[..], false),
            (&[&b"abc"[..], b"def"][..], false, 5, &b"abc"[..], true),
            (&[&b"abcdef"[..]][..], false, 5, &b""[..], true),
            (&[&b"ab"[..]][..], true, 5, &b"ab"[..], false),
        ] {
            let (req, outgoing) =
                upstream_request(parts.clone(), streamed(pieces, fail), Some(limit));
            let mut body = req.into_body();
            let mut seen = Vec::new();
            let mut failed = false;
            while let Some(frame) = body.frame().await {
                match frame {
                    Ok(f) => seen.extend_from_slice(f.data_ref().unwrap()),
                    Err(_) => {
                        failed = true;
                        break;
                    }
                }
            }
            assert_eq!(seen, data, "{pieces:?}");
            assert_eq!(failed, tripped || fail, "{pieces:?}");
            assert_eq!(outgoing.tripped(), tripped, "{pieces:?}");
            assert_eq!(outgoing.written(), !failed, "{pieces:?}");
        }
    }

    #[test]
    fn every_hop_by_hop_header_and_every_name_listed_in_connection_is_removed() {
        let mut headers = HeaderMap::new();
        for name in &HOP_BY_HOP {
            headers.append(name, HeaderValue::from_static("1"));
        }
        headers.append(header::CONNECTION, HeaderValue::from_static("close, X-A"));
        headers.append(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive,x-b"),
        );
        // An element that is not ASCII does not hide the names beside it.
        headers.append(
            header::CONNECTION,
            HeaderValue::from_bytes(b"X-C,\t\xff , x-d").unwrap(),
        );
        for name in ["x-a", "x-b", "x-c", "x-d", "x-kept"] {
            headers.append(name, HeaderValue::from_static("1"));
        }
        strip_hop_by_hop(&mut headers);
        let left: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(left, ["x-kept"]);
    }
}
