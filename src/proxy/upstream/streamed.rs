//! hyper's HTTP/1.1 client connections, for requests whose body streams.
//!
//! Each pooled connection is *not* given a task of its own: the request that takes it
//! from the [`Pool`] drives it — while waiting for the response head, then from the
//! response body as the downstream connection reads it — and puts it back once the body
//! has ended. A request's whole way through the proxy thus runs in the downstream
//! connection's task, as in an event-loop proxy, with no hand-off between tasks (and
//! threads) per request. A request that hyper hands back unsent from a pooled connection
//! (closed while idle, noticed as it is driven) is tried on another.

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::Authority;
use http::{HeaderValue, Request, Response, header};
use http_body::{Body as _, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::pool::{Connection, MAX_STALE_RETRIES, Pool};
use crate::proxy::{Body, BoxError};
use crate::rt::timer::ReadTimeout;

/// The pool of hyper's client connections.
pub type StreamedPool = Pool<StreamedConn>;

/// How a request to the upstream failed.
#[derive(Debug)]
pub enum SendError {
    /// Nothing reached the upstream (no connection, or the request was handed back unsent).
    NotSent(String),
    /// The request was (perhaps partly) sent; the upstream may have acted on it.
    Sent(hyper::Error),
}

/// One hyper client connection with its request handle.
pub struct StreamedConn {
    send: http1::SendRequest<Body>,
    conn: http1::Connection<TokioIo<TcpStream>, Body>,
    /// The connection future has completed (closed or failed); never poll it again.
    done: bool,
    /// Its descriptor, counted against the process's budget.
    _fd: crate::rt::fds::Fd,
}

impl StreamedConn {
    /// Drives the connection's I/O; returns `true` once it has ended.
    fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.done
            && let Poll::Ready(result) = Pin::new(&mut self.conn).poll(cx)
        {
            if let Err(e) = result {
                tracing::debug!(error = %e, "upstream connection ended with an error");
            }
            self.done = true;
        }
        self.done
    }
}

impl Connection for StreamedConn {
    fn is_open(&self) -> bool {
        !self.done && !self.send.is_closed()
    }

    /// Ready: the last exchange is over both ways (a request body still being sent after
    /// an early response would hold up the next user).
    fn is_reusable(&self) -> bool {
        !self.done && self.send.is_ready()
    }
}

impl Pool<StreamedConn> {
    /// Sends `req` (origin-form URI) to `authority` and answers the response, whose body
    /// drives the connection and returns it to the pool when it ends. The body fails
    /// instead if a wait for more of it from the upstream lasts `read_timeout`. A new
    /// connection not made by `connect_by` is given up (the request was not sent).
    pub async fn send(
        self: &Arc<Self>,
        authority: Option<&Authority>,
        mut req: Request<Body>,
        read_timeout: Duration,
        connect_by: Instant,
    ) -> Result<Response<StreamedBody>, SendError> {
        let authority = authority
            .cloned()
            .ok_or_else(|| SendError::NotSent("upstream URL has no authority".into()))?;
        if !req.headers().contains_key(header::HOST)
            && let Ok(v) = HeaderValue::from_str(authority.as_str())
        {
            req.headers_mut().insert(header::HOST, v);
        }
        let mut attempt = 0;
        loop {
            attempt += 1;
            let taken = if attempt <= MAX_STALE_RETRIES {
                self.take(&authority)
            } else {
                None
            };
            let (mut pooled, reused) = match taken {
                Some(p) => (p, true),
                None => (self.connect(&authority, connect_by).await?, false),
            };
            // Drive the connection until it takes a request (or turns out closed).
            let ready = poll_fn(|cx| {
                if pooled.drive(cx) {
                    return Poll::Ready(false);
                }
                match pooled.send.poll_ready(cx) {
                    Poll::Ready(r) => Poll::Ready(r.is_ok()),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await;
            if !ready {
                if reused {
                    continue;
                }
                return Err(SendError::NotSent(
                    "the upstream closed a new connection".into(),
                ));
            }
            let mut response = std::pin::pin!(pooled.send.try_send_request(req));
            let result = poll_fn(|cx| {
                pooled.drive(cx);
                response.as_mut().poll(cx)
            })
            .await;
            match result {
                Ok(resp) => {
                    let pool = Arc::clone(self);
                    return Ok(resp.map(|inner| StreamedBody {
                        inner,
                        conn: Some(pooled),
                        pool,
                        authority,
                        read_timeout: ReadTimeout::new(read_timeout),
                        reuse: true,
                    }));
                }
                Err(mut e) => match e.take_message() {
                    Some(back) if reused => req = back,
                    Some(_) => {
                        return Err(SendError::NotSent(e.into_error().to_string()));
                    }
                    None => return Err(SendError::Sent(e.into_error())),
                },
            }
        }
    }

    async fn connect(
        &self,
        authority: &Authority,
        until: Instant,
    ) -> Result<Box<StreamedConn>, SendError> {
        let (stream, fd) = super::connect_tcp(authority, self.connect_timeout(), until)
            .await
            .map_err(|e| SendError::NotSent(e.to_string()))?;
        // Flattened writes, as on the listener (`server::http_builder`).
        let (send, conn) = http1::Builder::new()
            .writev(false)
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| SendError::NotSent(format!("connect to {authority}: {e}")))?;
        Ok(Box::new(StreamedConn {
            send,
            conn,
            done: false,
            _fd: fd,
        }))
    }
}

/// A response body from a pooled connection: reading it drives the connection, and its
/// end returns the connection to the pool.
pub struct StreamedBody {
    inner: Incoming,
    /// Boxed once per connection: it moves between the pool and responses by pointer.
    conn: Option<Box<StreamedConn>>,
    pool: Arc<StreamedPool>,
    authority: Authority,
    /// An upstream that stops sending mid-body would otherwise hold the client's
    /// connection and this one for as long as it keeps the socket open.
    read_timeout: ReadTimeout,
    /// False: the connection is closed at the end, not pooled.
    reuse: bool,
}

impl StreamedBody {
    /// The connection is closed at the body's end instead of pooled (its response was one
    /// to be wary of: a length beside chunked).
    pub(crate) fn forbid_reuse(&mut self) {
        self.reuse = false;
    }

    fn release(&mut self) {
        if let Some(p) = self.conn.take()
            && self.reuse
        {
            self.pool.put(&self.authority, p);
        }
    }
}

impl http_body::Body for StreamedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Some(p) = this.conn.as_mut() {
            p.drive(cx);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(None) => {
                this.release();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                // The connection is in no state to be reused.
                this.conn = None;
                Poll::Ready(Some(Err(Box::new(e))))
            }
            Poll::Ready(Some(Ok(frame))) => {
                this.read_timeout.progressed();
                if this.inner.is_end_stream() {
                    this.release();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            // Waiting for the upstream (a client that reads slowly is not polling at all).
            Poll::Pending => match this.read_timeout.poll_waiting(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(e) => {
                    // Mid-body: the connection is closed, never pooled.
                    this.conn = None;
                    Poll::Ready(Some(Err(Box::new(e))))
                }
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for StreamedBody {
    fn drop(&mut self) {
        // A body never polled to its end is reusable only if it had nothing left to read
        // (a 204, a HEAD, an empty body).
        if self.inner.is_end_stream() {
            self.release();
        }
    }
}
