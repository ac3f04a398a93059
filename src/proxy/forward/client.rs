//! The upstream connections: this worker's plain-HTTP pools (a lean one for bodies in
//! memory, a streaming one), each https upstream's own hyper client, and one exchange
//! through either, its response's framing checked.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::headers::Added;
use crate::proxy::config::Upstream;
use crate::proxy::upstream::{self, H1Body, H1Pool, SendError, StreamedBody, StreamedPool};
use crate::proxy::{Body, BoxError};
use crate::rt::timer::ReadTimeout;
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

/// Sends a prepared request (see [`upstream_parts`](super::upstream_parts)) whose body is
/// `body`, in memory, to a plain-HTTP upstream through this thread's lean HTTP/1.1 pool.
/// Here and in [`send`], the upstream's `timeout` also bounds every wait for more of the
/// response body.
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
        upstream::check_framing(status, head_request, resp.headers_mut()).map_err(|e| {
            UpstreamError {
                not_sent: false,
                detail: e.to_string(),
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
