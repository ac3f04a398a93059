//! The upstream connection pool for plain-HTTP upstreams.
//!
//! Each pooled connection is a hyper HTTP/1.1 client connection that is *not* given a task
//! of its own: the request that checks it out drives it — while waiting for the response
//! head, then from the response body as the downstream connection reads it — and puts it
//! back once the body has ended. A request's whole way through the proxy thus runs in the
//! downstream connection's task, as in an event-loop proxy, with no hand-off between tasks
//! (and threads) per request.
//!
//! Safety of reuse: a connection is pooled again only after its response body has ended
//! cleanly; one closed by the upstream while idle is noticed when it is next driven, and a
//! request that hyper hands back unsent is tried on another connection, so a stale pooled
//! connection never turns into an error or a duplicate write.

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
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

use crate::proxy::{Body, BoxError};
use crate::timer::ReadTimeout;

type Conn = http1::Connection<TokioIo<TcpStream>, Body>;

/// How a request to the upstream failed.
#[derive(Debug)]
pub enum SendError {
    /// Nothing reached the upstream (no connection, or the request was handed back unsent).
    NotSent(String),
    /// The request was (perhaps partly) sent; the upstream may have acted on it.
    Sent(hyper::Error),
}

struct Idle {
    /// By upstream authority (a handful: a list beats hashing). Boxed: connections move
    /// between the pool and responses by pointer, not by value.
    #[allow(clippy::vec_box)]
    by_host: Vec<(Authority, Vec<Box<Pooled>>)>,
}

/// One connection with its request handle.
struct Pooled {
    send: http1::SendRequest<Body>,
    conn: Conn,
    /// The connection future has completed (closed or failed); never poll it again.
    done: bool,
    idle_since: Instant,
}

impl Pooled {
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

pub struct Pool {
    idle: Mutex<Idle>,
    max_idle_per_host: usize,
    idle_timeout: Duration,
    connect_timeout: Duration,
}

/// How many times a request handed back unsent by a pooled connection is tried again;
/// the last try always uses a new connection.
const MAX_STALE_RETRIES: usize = 3;

/// How often idle connections are looked over.
pub const SWEEP_EVERY: Duration = Duration::from_secs(10);

impl Pool {
    pub fn new(
        max_idle_per_host: usize,
        idle_timeout: Duration,
        connect_timeout: Duration,
    ) -> Arc<Pool> {
        Arc::new(Pool {
            idle: Mutex::new(Idle {
                by_host: Vec::new(),
            }),
            max_idle_per_host,
            idle_timeout,
            connect_timeout,
        })
    }

    /// Sends `req` (origin-form URI) to `authority` and answers the response, whose body
    /// drives the connection and returns it to the pool when it ends. The body fails
    /// instead if a wait for more of it from the upstream lasts `read_timeout`. A new
    /// connection not made by `connect_by` is given up (the request was not sent).
    pub async fn send(
        self: &Arc<Pool>,
        authority: Option<&Authority>,
        mut req: Request<Body>,
        read_timeout: Duration,
        connect_by: Instant,
    ) -> Result<Response<PooledBody>, SendError> {
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
                    return Ok(resp.map(|inner| PooledBody {
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

    fn take(&self, authority: &Authority) -> Option<Box<Pooled>> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let list = idle
            .by_host
            .iter_mut()
            .find(|(a, _)| a.as_str() == authority.as_str())
            .map(|(_, list)| list)?;
        while let Some(p) = list.pop() {
            if p.idle_since.elapsed() < self.idle_timeout && !p.done && !p.send.is_closed() {
                return Some(p);
            }
        }
        None
    }

    fn put(&self, authority: Authority, mut pooled: Box<Pooled>) {
        // Ready: the last exchange is over both ways (a request body still being sent
        // after an early response would hold up the next user).
        if pooled.done || !pooled.send.is_ready() {
            return;
        }
        pooled.idle_since = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let at = idle
            .by_host
            .iter()
            .position(|(a, _)| a.as_str() == authority.as_str());
        let list = match at {
            Some(i) => &mut idle.by_host[i].1,
            None => {
                idle.by_host.push((authority, Vec::new()));
                let last = idle.by_host.len() - 1;
                &mut idle.by_host[last].1
            }
        };
        if list.len() < self.max_idle_per_host {
            list.push(pooled);
        }
    }

    /// Closes what has idled longer than the idle timeout (its upstream has likely closed
    /// its end), so idle sockets do not linger in CLOSE_WAIT. Each proxy worker runs it
    /// every [`SWEEP_EVERY`].
    pub fn sweep(&self) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let timeout = self.idle_timeout;
        idle.by_host.retain_mut(|(_, list)| {
            list.retain(|p| p.idle_since.elapsed() < timeout);
            !list.is_empty()
        });
    }

    /// Connections waiting in the pool.
    pub fn idle(&self) -> usize {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        idle.by_host.iter().map(|(_, list)| list.len()).sum()
    }

    async fn connect(
        &self,
        authority: &Authority,
        until: Instant,
    ) -> Result<Box<Pooled>, SendError> {
        let stream = connect_tcp(authority, self.connect_timeout, until)
            .await
            .map_err(SendError::NotSent)?;
        // Flattened writes, as on the listener (`server::http_builder`).
        let (send, conn) = http1::Builder::new()
            .writev(false)
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| SendError::NotSent(format!("connect to {authority}: {e}")))?;
        Ok(Box::new(Pooled {
            send,
            conn,
            done: false,
            idle_since: Instant::now(),
        }))
    }
}

/// A new TCP connection to a plain-HTTP upstream, with Nagle off, given up after `timeout`
/// or at `until` (the end of the exchange it is for), whichever comes first; on failure,
/// what went wrong (nothing was sent).
pub(crate) async fn connect_tcp(
    authority: &Authority,
    timeout: Duration,
    until: Instant,
) -> Result<TcpStream, String> {
    let port = authority.port_u16().unwrap_or(80);
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let until = Instant::now()
        .checked_add(timeout)
        .map_or(until, |t| t.min(until));
    // On the worker's deadline wheel, as the exchange's own deadline is: at `until` both
    // expire in one pass, and this one, polled first, says the request was never sent.
    let stream = crate::timer::timeout_at(until, TcpStream::connect((host, port)))
        .await
        .map_err(|_| format!("connect to {authority} timed out"))?
        .map_err(|e| format!("connect to {authority}: {e}"))?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// A response body from a pooled connection: reading it drives the connection, and its
/// end returns the connection to the pool.
pub struct PooledBody {
    inner: Incoming,
    /// Boxed once per connection: it moves between the pool and responses by pointer.
    conn: Option<Box<Pooled>>,
    pool: Arc<Pool>,
    authority: Authority,
    /// An upstream that stops sending mid-body would otherwise hold the client's
    /// connection and this one for as long as it keeps the socket open.
    read_timeout: ReadTimeout,
    /// False: the connection is closed at the end, not pooled.
    reuse: bool,
}

impl PooledBody {
    /// The connection is closed at the body's end instead of pooled (its response was one
    /// to be wary of: a length beside chunked).
    pub(crate) fn forbid_reuse(&mut self) {
        self.reuse = false;
    }

    fn release(&mut self) {
        if let Some(p) = self.conn.take()
            && self.reuse
        {
            self.pool.put(self.authority.clone(), p);
        }
    }
}

impl http_body::Body for PooledBody {
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

impl Drop for PooledBody {
    fn drop(&mut self) {
        // A body never polled to its end is reusable only if it had nothing left to read
        // (a 204, a HEAD, an empty body).
        if self.inner.is_end_stream() {
            self.release();
        }
    }
}
