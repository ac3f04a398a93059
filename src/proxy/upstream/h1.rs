//! A lean HTTP/1.1 exchange with plain-HTTP upstreams, for requests whose body is in
//! memory: none, or one read whole (see `WHOLE_BODY` in the proxy) — nearly every
//! request. Request bodies that stream go through hyper's client connection instead
//! ([`super::streamed`]). Both kinds of connection wait in one kind of [`Pool`].
//!
//! An exchange is one `write` of the request head and body, then reads until the response
//! head parses (`decode.rs`, with httparse, as hyper's own parser does). The response body is then
//! read as the client's connection takes it, framed as RFC 9112 §6.3 says: no body for a
//! HEAD, 1xx, 204 or 304; chunked if the last transfer coding is chunked; else the
//! `Content-Length`; else up to the connection's end. A body already read with the head
//! is handed over whole, and its connection goes back to the pool at once. A wait for more
//! of a body lasts at most the upstream's timeout: past it the body fails, and its
//! connection is closed.
//!
//! Compared with driving hyper's client connection inline, this leaves out its message
//! queue, its state machine and its read/write strategies: a sixth of the proxy's
//! instructions per request (callgrind, sequential W1 requests: 39,065 → 32,468), with
//! the same system calls (one `sendto` and one `recvfrom` upstream; `strace -c`).
//!
//! Safety of reuse, as in [`super::pool`]: a connection is pooled again only after a
//! response that ended at a known boundary, with nothing read past it, on an HTTP/1.1
//! connection not marked `Connection: close`. A pooled connection the upstream closed
//! while idle is noticed before use (its socket turned readable: end of stream), without
//! a system call for a live one; a request whose write fails before its first byte left is
//! tried on another connection, any other failure is the request's.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderValue};
use http::uri::Authority;
use http::{Method, Response, Version, request};
use http_body::{Frame, SizeHint};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::decode::{Decoded, ResponseDecoder, State, Step, step};
use super::pool::{Connection, MAX_STALE_RETRIES, Pool};
use crate::proxy::BoxError;
use crate::rt::timer::ReadTimeout;

/// How much room a read is given.
const READ_SIZE: usize = 16 * 1024;

/// How an exchange failed.
#[derive(Debug)]
pub struct Error {
    /// Nothing reached the upstream (so it cannot act on the request).
    pub not_sent: bool,
    pub detail: String,
    /// The upstream closed the connection without a byte of answer.
    unanswered: bool,
}

impl Error {
    fn not_sent(detail: impl Into<String>) -> Error {
        Error {
            not_sent: true,
            detail: detail.into(),
            unanswered: false,
        }
    }

    fn sent(detail: impl Into<String>) -> Error {
        Error {
            not_sent: false,
            detail: detail.into(),
            unanswered: false,
        }
    }
}

/// One connection of the lean exchange.
pub struct H1Conn {
    io: TcpStream,
    /// Bytes read and not yet used.
    buf: BytesMut,
    /// Its descriptor, counted against the process's budget.
    _fd: crate::rt::fds::Fd,
}

impl H1Conn {
    /// Reads more into the buffer; `Ok(0)` at the end of the stream.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < READ_SIZE / 4 {
            self.buf.reserve(READ_SIZE);
        }
        let read = self.io.read_buf(&mut self.buf);
        std::pin::pin!(read).poll(cx)
    }

    /// Whether a connection that waited in the pool is still open: its socket has not
    /// turned readable (nothing, not even its end, arrived), or reads nothing yet.
    fn alive(&self) -> bool {
        // `try_read` answers WouldBlock without a system call while the socket has not
        // turned readable, and, unlike a readiness poll, never on a spent task budget.
        let mut probe = [0u8; 1];
        matches!(self.io.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }
}

impl Connection for H1Conn {
    /// Its socket has not turned readable (nothing, not even its end, arrived while it
    /// idled), or reads nothing yet.
    fn is_open(&self) -> bool {
        self.alive()
    }

    /// Nothing was read past the last response's end.
    fn is_reusable(&self) -> bool {
        self.buf.is_empty()
    }
}

/// The pool of the lean exchange's connections.
pub type H1Pool = Pool<H1Conn>;

impl Pool<H1Conn> {
    /// Sends a request (origin-form URI, headers prepared for the upstream) with `body` to
    /// `authority` and answers the response once its head has arrived. The response body
    /// fails if a wait for more of it from the upstream lasts `read_timeout`. A new
    /// connection not made by `connect_by` is given up (the request was not sent).
    pub async fn send(
        self: &Arc<Self>,
        authority: Option<&Authority>,
        parts: &request::Parts,
        extra: impl IntoIterator<Item = (&str, &HeaderValue)>,
        body: &Bytes,
        read_timeout: Duration,
        connect_by: Instant,
    ) -> Result<Response<H1Body>, Error> {
        let authority =
            authority.ok_or_else(|| Error::not_sent("upstream URL has no authority"))?;
        let out = encode(parts, extra, authority, body);
        let mut attempt = 0;
        let (mut conn, reused) = loop {
            attempt += 1;
            let pooled = if attempt <= MAX_STALE_RETRIES {
                self.take(authority)
            } else {
                None
            };
            let reused = pooled.is_some();
            let mut conn = match pooled {
                Some(c) => c,
                None => self.connect(authority, connect_by).await?,
            };
            match write_all(&mut conn.io, &out).await {
                Ok(()) => break (conn, reused),
                // Closed while idle, and nothing left: another connection may take it.
                Err((0, _)) if reused => continue,
                Err((0, e)) => return Err(Error::not_sent(format!("write to {authority}: {e}"))),
                Err((_, e)) => return Err(Error::sent(format!("write to {authority}: {e}"))),
            }
        };
        let head_request = parts.method == Method::HEAD;
        let head = match read_head(&mut conn, head_request).await {
            Ok(head) => head,
            // A reused connection the upstream closed without a word as the request went
            // out (its keep-alive timeout racing ours): a safe method (RFC 9110 §9.2.1)
            // goes again on a new connection, as nginx does. Any other method may have
            // been acted on: answered as sent (504).
            Err(e) if e.unanswered && reused && is_safe(&parts.method) => {
                let (fresh, head) =
                    Box::pin(self.send_fresh(authority, &out, head_request, connect_by)).await?;
                conn = fresh;
                head
            }
            Err(e) => return Err(e),
        };
        let mut response = Response::new(());
        *response.status_mut() = head.status;
        *response.version_mut() = Version::HTTP_11;
        *response.headers_mut() = head.headers;
        let mut body = H1Body {
            ready: None,
            state: head.body,
            conn: Some(conn),
            reusable: head.reusable,
            pool: self.clone(),
            authority: authority.clone(),
            read_timeout: ReadTimeout::new(read_timeout),
        };
        body.take_ready();
        Ok(response.map(|()| body))
    }

    /// [`Pool::send`]'s second try, on a new connection (kept out of its way). The
    /// request went out once already, so every failure here is one of a sent request.
    #[inline(never)]
    async fn send_fresh(
        &self,
        authority: &Authority,
        out: &[u8],
        head_request: bool,
        connect_by: Instant,
    ) -> Result<(Box<H1Conn>, Decoded), Error> {
        let sent = |e: Error| Error::sent(e.detail);
        let mut conn = self.connect(authority, connect_by).await.map_err(sent)?;
        if let Err((_, e)) = write_all(&mut conn.io, out).await {
            return Err(Error::sent(format!("write to {authority}: {e}")));
        }
        let head = read_head(&mut conn, head_request).await?;
        Ok((conn, head))
    }

    async fn connect(&self, authority: &Authority, until: Instant) -> Result<Box<H1Conn>, Error> {
        let (io, fd) = super::connect_tcp(authority, self.connect_timeout(), until)
            .await
            .map_err(|e| Error::not_sent(e.to_string()))?;
        Ok(Box::new(H1Conn {
            io,
            buf: BytesMut::with_capacity(READ_SIZE),
            _fd: fd,
        }))
    }
}

/// Writes all of `out`; on failure, how much had been written, and the error.
async fn write_all(io: &mut TcpStream, out: &[u8]) -> Result<(), (usize, io::Error)> {
    let mut written = 0;
    while written < out.len() {
        match io.write(&out[written..]).await {
            Ok(0) => {
                return Err((
                    written,
                    io::Error::new(io::ErrorKind::WriteZero, "connection closed"),
                ));
            }
            Ok(n) => written += n,
            Err(e) => return Err((written, e)),
        }
    }
    Ok(())
}

/// The request head (`parts`' headers, then `extra`: lowercase names of headers absent
/// from `parts`), and the body after it: one write.
/// The bytes [`Pool::send`] writes for a request, for the fuzz targets.
#[cfg(feature = "fuzzing")]
pub(crate) fn encode_for_fuzzing<'n, 'v>(
    parts: &request::Parts,
    extra: impl IntoIterator<Item = (&'n str, &'v HeaderValue)>,
    authority: &Authority,
    body: &Bytes,
) -> Vec<u8> {
    encode(parts, extra, authority, body)
}

fn encode<'n, 'v>(
    parts: &request::Parts,
    extra: impl IntoIterator<Item = (&'n str, &'v HeaderValue)>,
    authority: &Authority,
    body: &Bytes,
) -> Vec<u8> {
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut out = Vec::with_capacity(256 + body.len());
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    if !parts.headers.contains_key(header::HOST) {
        out.extend_from_slice(b"host: ");
        out.extend_from_slice(authority.as_str().as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    for (name, value) in &parts.headers {
        // A body in memory states its own length; without one, the client's
        // `Content-Length: 0` (if any) goes as sent.
        if !body.is_empty() && name == header::CONTENT_LENGTH {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    for (name, value) in extra {
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if !body.is_empty() {
        out.extend_from_slice(b"content-length: ");
        crate::token::push_decimal(&mut out, body.len() as u64);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    out
}

/// Safe methods (RFC 9110 §9.2.1): sent again when nothing came back.
fn is_safe(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}

/// Reads until a final (non-1xx) response head has arrived; consumes it from the buffer.
async fn read_head(conn: &mut H1Conn, head_request: bool) -> Result<Decoded, Error> {
    let mut decoder = ResponseDecoder::new(head_request);
    loop {
        if let Some(decoded) = decoder
            .decode(&mut conn.buf)
            .map_err(|e| Error::sent(e.to_string()))?
        {
            return Ok(decoded);
        }
        match std::future::poll_fn(|cx| conn.poll_fill(cx)).await {
            Ok(0) => {
                let unanswered = conn.buf.is_empty() && !decoder.saw_interim();
                let mut e = Error::sent(if unanswered {
                    "the upstream closed the connection before answering"
                } else {
                    "the upstream closed the connection mid-head"
                });
                e.unanswered = unanswered;
                return Err(e);
            }
            Ok(_) => {}
            Err(e) => return Err(Error::sent(format!("reading the upstream's answer: {e}"))),
        }
    }
}

/// A response body read from its upstream connection as it is polled; its end returns
/// the connection to the pool.
pub struct H1Body {
    /// Data already in hand, handed out first.
    ready: Option<Bytes>,
    state: State,
    conn: Option<Box<H1Conn>>,
    reusable: bool,
    pool: Arc<H1Pool>,
    authority: Authority,
    /// An upstream that stops sending mid-body would otherwise hold the client's
    /// connection and this one for as long as it keeps the socket open.
    read_timeout: ReadTimeout,
}

impl H1Body {
    /// Takes a length-delimited body that arrived whole with the head, so that the body
    /// is one frame and the connection goes back to the pool now.
    fn take_ready(&mut self) {
        if let (State::Length(n), Some(conn)) = (&self.state, &mut self.conn)
            && conn.buf.len() as u64 >= *n
        {
            // `n` fits: it is at most the buffer's length.
            self.ready = Some(conn.buf.split_to(*n as usize).freeze());
            self.state = State::Done;
        }
        if matches!(self.state, State::Done) {
            self.finish();
        }
    }

    /// The body has ended: the connection goes back to the pool if it can carry another
    /// exchange (nothing read past this response, which ended at a known boundary).
    fn finish(&mut self) {
        if let Some(conn) = self.conn.take()
            && self.reusable
        {
            self.pool.put(&self.authority, conn);
        }
    }

    /// The next piece of the body, or `None` at its end.
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Bytes>, BoxError>> {
        loop {
            if let Some(data) = self.ready.take() {
                return Poll::Ready(Ok(Some(data)));
            }
            if matches!(self.state, State::Done) {
                return Poll::Ready(Ok(None));
            }
            let Some(conn) = self.conn.as_mut() else {
                return Poll::Ready(Err("the upstream connection is gone".into()));
            };
            let step = match step(&mut self.state, &mut conn.buf) {
                Ok(step) => step,
                Err(e) => return Poll::Ready(Err(e)),
            };
            match step {
                Step::Data(data) => {
                    if matches!(self.state, State::Done) {
                        self.finish();
                    }
                    return Poll::Ready(Ok(Some(data)));
                }
                Step::Again => continue,
                Step::End => {
                    self.state = State::Done;
                    self.finish();
                    return Poll::Ready(Ok(None));
                }
                Step::More => {}
            }
            match conn.poll_fill(cx) {
                // Only here is the body waiting for the upstream: a client that reads
                // slowly is not polling at all.
                Poll::Pending => {
                    return self
                        .read_timeout
                        .poll_waiting(cx)
                        .map(|e| Err(Box::new(e) as BoxError));
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(Box::new(e))),
                Poll::Ready(Ok(0)) => {
                    if matches!(self.state, State::Close) {
                        self.state = State::Done;
                        self.conn = None;
                        return Poll::Ready(Ok(None));
                    }
                    return Poll::Ready(Err(
                        "the upstream closed the connection before the body's end".into(),
                    ));
                }
                Poll::Ready(Ok(_)) => self.read_timeout.progressed(),
            }
        }
    }
}

impl http_body::Body for H1Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match this.poll_next(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(Some(data))) => Poll::Ready(Some(Ok(Frame::data(data)))),
            Poll::Ready(Ok(None)) => Poll::Ready(None),
            Poll::Ready(Err(e)) => {
                // In no state to carry another exchange.
                this.conn = None;
                this.state = State::Done;
                Poll::Ready(Some(Err(e)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ready.is_none() && matches!(self.state, State::Done)
    }

    fn size_hint(&self) -> SizeHint {
        let ready = self.ready.as_ref().map_or(0, |b| b.len() as u64);
        match self.state {
            State::Done => SizeHint::with_exact(ready),
            State::Length(left) => SizeHint::with_exact(ready + left),
            _ => SizeHint::default(),
        }
    }
}
