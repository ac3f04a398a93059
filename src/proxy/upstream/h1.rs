//! A lean HTTP/1.1 exchange with plain-HTTP upstreams, for requests whose body is in
//! memory: none, or one read whole (see `WHOLE_BODY` in the proxy) — nearly every
//! request. Request bodies that stream go through hyper's client connection instead
//! ([`super::streamed`]). Both kinds of connection wait in one kind of [`Pool`].
//!
//! An exchange is one `write` of the request head and body, then reads until the response
//! head parses (with httparse, as hyper's own parser does). The response body is then
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

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::Authority;
use http::{Method, Response, StatusCode, Version, request};
use http_body::{Frame, SizeHint};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::pool::{Connection, MAX_STALE_RETRIES, Pool};
use crate::proxy::BoxError;
use crate::timer::ReadTimeout;

/// Largest response head read.
const MAX_HEAD: usize = 64 * 1024;
/// Most response header lines.
const MAX_HEADERS: usize = 128;
/// Longest chunk-size line (with its extensions).
const MAX_CHUNK_LINE: usize = 4 * 1024;
/// Largest trailer section of a chunked body (trailers are read and dropped).
const MAX_TRAILERS: usize = 64 * 1024;
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
        let mut head = match read_head(&mut conn).await {
            Ok(head) => head,
            // A reused connection the upstream closed without a word as the request went
            // out (its keep-alive timeout racing ours): a safe method (RFC 9110 §9.2.1)
            // goes again on a new connection, as nginx does. Any other method may have
            // been acted on: answered as sent (504).
            Err(e) if e.unanswered && reused && is_safe(&parts.method) => {
                let (fresh, head) = Box::pin(self.send_fresh(authority, &out, connect_by)).await?;
                conn = fresh;
                head
            }
            Err(e) => return Err(e),
        };
        let framing = framing(
            head.status,
            parts.method == Method::HEAD,
            head.has_length,
            &mut head.headers,
        )
        .map_err(Error::sent)?;
        let reusable = head.keep_alive && framing.reusable;
        let mut response = Response::new(());
        *response.status_mut() = head.status;
        *response.version_mut() = Version::HTTP_11;
        *response.headers_mut() = head.headers;
        let mut body = H1Body {
            ready: None,
            state: framing.state,
            conn: Some(conn),
            reusable,
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
        connect_by: Instant,
    ) -> Result<(Box<H1Conn>, Head), Error> {
        let sent = |e: Error| Error::sent(e.detail);
        let mut conn = self.connect(authority, connect_by).await.map_err(sent)?;
        if let Err((_, e)) = write_all(&mut conn.io, out).await {
            return Err(Error::sent(format!("write to {authority}: {e}")));
        }
        let head = read_head(&mut conn).await?;
        Ok((conn, head))
    }

    async fn connect(&self, authority: &Authority, until: Instant) -> Result<Box<H1Conn>, Error> {
        let io = super::connect_tcp(authority, self.connect_timeout(), until)
            .await
            .map_err(Error::not_sent)?;
        Ok(Box::new(H1Conn {
            io,
            buf: BytesMut::with_capacity(READ_SIZE),
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

struct Head {
    status: StatusCode,
    headers: HeaderMap,
    /// HTTP/1.1 without `Connection: close`.
    keep_alive: bool,
    /// A `Content-Length` is among the headers.
    has_length: bool,
}

/// Safe methods (RFC 9110 §9.2.1): sent again when nothing came back.
fn is_safe(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}

/// Reads until a final (non-1xx) response head has arrived; consumes it from the buffer.
async fn read_head(conn: &mut H1Conn) -> Result<Head, Error> {
    let mut interim = false;
    loop {
        if let Some(head) = parse_head(&mut conn.buf)? {
            if head.status.is_informational() {
                // 100 Continue and friends: the final answer follows. (No upgrade is
                // ever asked for: `Upgrade` does not reach the upstream.)
                if head.status == StatusCode::SWITCHING_PROTOCOLS {
                    return Err(Error::sent("the upstream switched protocols unasked"));
                }
                interim = true;
                continue;
            }
            return Ok(head);
        }
        if conn.buf.len() >= MAX_HEAD {
            return Err(Error::sent("the upstream's response head is too large"));
        }
        match std::future::poll_fn(|cx| conn.poll_fill(cx)).await {
            Ok(0) => {
                let unanswered = conn.buf.is_empty() && !interim;
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

/// A whole response head at the start of `buf`, taken out of it; `None` if incomplete.
fn parse_head(buf: &mut BytesMut) -> Result<Option<Head>, Error> {
    let bad = |e: &dyn std::fmt::Display| {
        Error::sent(format!("malformed response from the upstream: {e}"))
    };
    let mut slots =
        [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut parsed,
        buf,
        &mut slots,
    ) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(bad(&e)),
    };
    let code = parsed.code.unwrap_or(0);
    let status = StatusCode::from_u16(code).map_err(|e| bad(&e))?;
    let minor = parsed.version.unwrap_or(0);
    // Where each header's name and value lie in the head, to take the values out of it
    // without a copy once the parse lets go of the buffer.
    // (A value that does not lie in the head — never, with httparse — is copied.)
    let base = buf.as_ptr() as usize;
    let mut spans = Vec::with_capacity(parsed.headers.len());
    for h in parsed.headers.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes()).map_err(|e| bad(&e))?;
        let span = (h.value.as_ptr() as usize)
            .checked_sub(base)
            .filter(|start| start + h.value.len() <= len)
            .map(|start| start..start + h.value.len());
        let value = match span {
            Some(span) => Err(span),
            None => Ok(HeaderValue::from_bytes(h.value).map_err(|e| bad(&e))?),
        };
        spans.push((name, value));
    }
    let head = buf.split_to(len).freeze();
    let mut headers = HeaderMap::with_capacity(spans.len());
    let mut close = minor == 0;
    let mut has_length = false;
    for (name, value) in spans {
        let value = match value {
            Ok(copied) => copied,
            Err(span) => HeaderValue::from_maybe_shared(head.slice(span)).map_err(|e| bad(&e))?,
        };
        if name == header::CONNECTION {
            let mut names_other = false;
            for t in value
                .as_bytes()
                .split(|&b| b == b',')
                .map(<[u8]>::trim_ascii)
            {
                if t.eq_ignore_ascii_case(b"close") {
                    close = true;
                } else if !t.is_empty() && !t.eq_ignore_ascii_case(b"keep-alive") {
                    names_other = true;
                }
            }
            // Hop-by-hop, and stripped before the client sees the response: one that names
            // no other header (`keep-alive`, `close`: nearly every response) is left out
            // here rather than removed from the map later.
            if !names_other {
                continue;
            }
        } else if name.as_str() == "keep-alive" {
            continue;
        }
        has_length |= name == header::CONTENT_LENGTH;
        headers.append(name, value);
    }
    Ok(Some(Head {
        status,
        headers,
        keep_alive: !close,
        has_length,
    }))
}

/// The lean exchange's checks of a response head, for one that hyper's client has read
/// (the streamed and https paths): hyper delimits the body itself, but leaves the framing
/// headers as the upstream sent them, for the client to be shown. They leave as
/// [`framing`] leaves them, or the response is refused as it would be here: an upgrade
/// nobody asked for (`Upgrade` never reaches the upstream), a transfer coding other than
/// chunked, a malformed or conflicting length. Answers whether the connection may carry
/// another request afterwards (not after a length beside chunked, as here).
pub(crate) fn check_framing(
    status: StatusCode,
    head_request: bool,
    headers: &mut HeaderMap,
) -> Result<bool, String> {
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err("the upstream switched protocols unasked".into());
    }
    let has_length = headers.contains_key(header::CONTENT_LENGTH);
    framing(status, head_request, has_length, headers).map(|f| f.reusable)
}

/// How a response body is delimited.
struct Framing {
    state: State,
    /// Its end is a known boundary (so the connection can carry another exchange).
    reusable: bool,
}

/// RFC 9112 §6.3.
/// Leaves one framing header as the client should see it: a length beside a transfer
/// coding is removed (§6.3 ¶3), a repeated length is one value.
fn framing(
    status: StatusCode,
    head_request: bool,
    has_length: bool,
    headers: &mut HeaderMap,
) -> Result<Framing, String> {
    if head_request || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        // No body, but a length the client is shown (the size of what a GET would get):
        // it is checked as any length is, or the client's side could not send it on.
        // (`has_length`: known from the parse, which spares a lookup on most answers.)
        if has_length {
            content_length(headers)?;
        }
        return Ok(Framing {
            state: State::Done,
            reusable: true,
        });
    }
    if headers.contains_key(header::TRANSFER_ENCODING) {
        let mut codings = Vec::new();
        for v in headers.get_all(header::TRANSFER_ENCODING) {
            let v = v
                .to_str()
                .map_err(|_| "malformed Transfer-Encoding from the upstream")?;
            codings.extend(v.split(',').map(str::trim).filter(|t| !t.is_empty()));
        }
        // Only chunked can be taken off here (the coding header goes, as hop-by-hop);
        // another coding, before chunked or instead of it, would reach the client still
        // applied and unannounced.
        if !matches!(codings.as_slice(), [only] if only.eq_ignore_ascii_case("chunked")) {
            return Err("a transfer coding other than chunked from the upstream".into());
        }
        // A length beside a transfer coding is a message to be wary of: dropped, and the
        // connection not used again.
        let had_length = headers.remove(header::CONTENT_LENGTH).is_some();
        return Ok(Framing {
            state: State::Chunked(Chunk::Size),
            reusable: !had_length,
        });
    }
    Ok(match content_length(headers)? {
        Some(0) => Framing {
            state: State::Done,
            reusable: true,
        },
        Some(n) => Framing {
            state: State::Length(n),
            reusable: true,
        },
        None => Framing {
            state: State::Close,
            reusable: false,
        },
    })
}

/// The response's `Content-Length`, if any; a length repeated (in one header or several)
/// is left as one value, and different or malformed values are an error.
fn content_length(headers: &mut HeaderMap) -> Result<Option<u64>, String> {
    let mut length = None;
    let mut values = 0;
    for v in headers.get_all(header::CONTENT_LENGTH) {
        let v = v
            .to_str()
            .map_err(|_| "malformed Content-Length from the upstream")?;
        for part in v.split(',') {
            let part = part.trim();
            let n = if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
                part.parse::<u64>().ok()
            } else {
                None
            }
            .ok_or("malformed Content-Length from the upstream")?;
            if length.is_some_and(|l| l != n) {
                return Err("conflicting Content-Length from the upstream".into());
            }
            length = Some(n);
            values += 1;
        }
    }
    if values > 1
        && let Some(n) = length
    {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
    }
    Ok(length)
}

enum State {
    /// This many bytes left.
    Length(u64),
    Chunked(Chunk),
    /// Up to the end of the stream.
    Close,
    Done,
}

enum Chunk {
    /// A chunk-size line is next.
    Size,
    /// This many bytes of chunk data left.
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    /// Trailer lines up to an empty one; this many bytes of them so far.
    Trailers(usize),
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

/// What the buffered bytes give a body in `state`.
enum Step {
    Data(Bytes),
    /// The state moved on; look again.
    Again,
    /// More bytes must be read first.
    More,
    /// The body ended (the chunked body's last line).
    End,
}

fn step(state: &mut State, buf: &mut BytesMut) -> Result<Step, BoxError> {
    // Up to `left` of the buffer, if it holds any.
    fn take(buf: &mut BytesMut, left: &mut u64) -> Option<Bytes> {
        if buf.is_empty() {
            return None;
        }
        let n = buf.len().min(usize::try_from(*left).unwrap_or(usize::MAX));
        *left -= n as u64;
        Some(buf.split_to(n).freeze())
    }
    Ok(match state {
        State::Done => Step::End,
        State::Length(left) => match take(buf, left) {
            Some(data) => {
                if *left == 0 {
                    *state = State::Done;
                }
                Step::Data(data)
            }
            None => Step::More,
        },
        State::Close if buf.is_empty() => Step::More,
        State::Close => Step::Data(buf.split().freeze()),
        State::Chunked(chunk) => match chunk {
            Chunk::Size => match httparse::parse_chunk_size(buf) {
                // As strict as hyper's decoder: a hex digit first, and no line feed before
                // the line's CRLF (httparse takes an empty line as size 0, and a bare LF
                // in an extension).
                Ok(httparse::Status::Complete((used, _)))
                    if !buf[0].is_ascii_hexdigit()
                        || used < 2
                        || &buf[used - 2..used] != b"\r\n"
                        || buf[..used - 2].contains(&b'\n') =>
                {
                    return Err("malformed chunk size from the upstream".into());
                }
                Ok(httparse::Status::Complete((used, size))) => {
                    buf.advance(used);
                    *chunk = if size == 0 {
                        Chunk::Trailers(0)
                    } else {
                        Chunk::Data(size)
                    };
                    Step::Again
                }
                Ok(httparse::Status::Partial) if buf.len() < MAX_CHUNK_LINE => Step::More,
                _ => return Err("malformed chunk size from the upstream".into()),
            },
            Chunk::Data(left) => match take(buf, left) {
                Some(data) => {
                    if *left == 0 {
                        *chunk = Chunk::DataEnd;
                    }
                    Step::Data(data)
                }
                None => Step::More,
            },
            Chunk::DataEnd if buf.len() < 2 => Step::More,
            Chunk::DataEnd if &buf[..2] == b"\r\n" => {
                buf.advance(2);
                *chunk = Chunk::Size;
                Step::Again
            }
            Chunk::DataEnd => return Err("malformed chunk from the upstream".into()),
            Chunk::Trailers(seen) => match buf.windows(2).position(|w| w == b"\r\n") {
                Some(0) => {
                    buf.advance(2);
                    Step::End
                }
                Some(line) if *seen + line + 2 <= MAX_TRAILERS => {
                    *seen += line + 2;
                    buf.advance(line + 2);
                    Step::Again
                }
                None if *seen + buf.len() <= MAX_TRAILERS => Step::More,
                _ => return Err("the upstream's trailers are too large".into()),
            },
        },
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn head(text: &str) -> Head {
        let mut buf = BytesMut::from(text.as_bytes());
        let head = parse_head(&mut buf).expect("parses").expect("complete");
        assert!(buf.is_empty());
        head
    }

    fn frame(
        status: u16,
        head_request: bool,
        lines: &[(&str, &str)],
    ) -> Result<(bool, bool), String> {
        let mut headers = HeaderMap::new();
        for (k, v) in lines {
            headers.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        let has_length = headers.contains_key(header::CONTENT_LENGTH);
        let f = framing(
            StatusCode::from_u16(status).unwrap(),
            head_request,
            has_length,
            &mut headers,
        )?;
        Ok((matches!(f.state, State::Done), f.reusable))
    }

    #[test]
    fn heads_parse_and_say_whether_the_connection_stays_open() {
        let h = head("HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: 1\r\nx-a: 2\r\n\r\n");
        assert_eq!(h.status, 200);
        assert!(h.keep_alive);
        assert_eq!(h.headers.get_all("x-a").iter().count(), 2);
        let h = head("HTTP/1.1 200 OK\r\nX-Empty:\r\nX-B:  b \r\n\r\n");
        assert_eq!(h.headers["x-empty"], "");
        assert_eq!(h.headers["x-b"], "b");
        assert!(!head("HTTP/1.1 200 OK\r\nConnection: keep-alive, Close\r\n\r\n").keep_alive);
        assert!(!head("HTTP/1.0 200 OK\r\n\r\n").keep_alive);
        // A Connection that names no other header, and Keep-Alive, are left out at once;
        // one that names another stays for the hop-by-hop strip to act on.
        let h = head("HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\n\r\n");
        assert!(h.keep_alive);
        assert!(h.headers.is_empty(), "{:?}", h.headers);
        let h = head("HTTP/1.1 200 OK\r\nConnection: close, X-A\r\nX-A: 1\r\n\r\n");
        assert!(!h.keep_alive);
        assert_eq!(h.headers["connection"], "close, X-A");
        let mut partial = BytesMut::from(&b"HTTP/1.1 200 OK\r\nContent-Le"[..]);
        assert!(parse_head(&mut partial).unwrap().is_none());
        for bad in [
            "HTTP/1.1 2000 OK\r\n\r\n",
            "HTTP/1.1 200 OK\r\nA B: c\r\n\r\n",
            "SSH-2.0\r\n\r\n",
        ] {
            assert!(
                parse_head(&mut BytesMut::from(bad.as_bytes())).is_err(),
                "{bad:?}"
            );
        }
    }

    /// Feeds `wire` in pieces of `piece` bytes; answers the body's data and whether it
    /// ended cleanly with nothing left over.
    fn decode(mut state: State, wire: &[u8], piece: usize) -> Result<(Vec<u8>, bool), BoxError> {
        let mut buf = BytesMut::new();
        let mut data = Vec::new();
        let mut fed = 0;
        loop {
            match step(&mut state, &mut buf)? {
                Step::Data(d) => data.extend_from_slice(&d),
                Step::Again => {}
                Step::End => return Ok((data, buf.is_empty() && fed == wire.len())),
                Step::More if fed == wire.len() => return Ok((data, false)),
                Step::More => {
                    let n = piece.min(wire.len() - fed);
                    buf.extend_from_slice(&wire[fed..fed + n]);
                    fed += n;
                }
            }
            if matches!(state, State::Done) {
                return Ok((data, buf.is_empty() && fed == wire.len()));
            }
        }
    }

    #[test]
    fn chunked_bodies_decode_in_any_pieces() {
        let wire = b"5;ext=1\r\nhello\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-T: 1\r\n\r\n";
        for piece in [1, 2, 3, 7, wire.len()] {
            let (data, clean) = decode(State::Chunked(Chunk::Size), wire, piece).unwrap();
            assert_eq!(
                data, b"helloabcdefghijklmnopqrstuvwxyz",
                "pieces of {piece}"
            );
            assert!(clean, "pieces of {piece}");
        }
        let (data, clean) = decode(State::Length(5), b"hello", 2).unwrap();
        assert_eq!((&data[..], clean), (&b"hello"[..], true));
        // Cut short: no clean end.
        let (_, clean) = decode(State::Chunked(Chunk::Size), b"5\r\nhel", 2).unwrap();
        assert!(!clean);
        // A stray empty line is not the last chunk; nor is a bare LF an end of line.
        for bad in [
            &b"zz\r\n"[..],
            b"5\r\nhelloXX0\r\n\r\n",
            b"10000000000000000\r\n",
            b"\r\n",
            b";x\r\n",
            b"3\r\nabc\r\n\r\n3\r\ndef\r\n0\r\n\r\n",
            b"3;a\nb\r\nabc\r\n0\r\n\r\n",
        ] {
            assert!(
                decode(State::Chunked(Chunk::Size), bad, 64).is_err(),
                "{bad:?}"
            );
        }
        let long_line = [b"1;".as_slice(), &[b'a'; MAX_CHUNK_LINE]].concat();
        assert!(decode(State::Chunked(Chunk::Size), &long_line, 512).is_err());
        let huge_trailers = [b"0\r\n".as_slice(), &[b'a'; MAX_TRAILERS + 1]].concat();
        assert!(decode(State::Chunked(Chunk::Size), &huge_trailers, 4096).is_err());
    }

    #[test]
    fn bodies_are_framed_as_rfc_9112_says() {
        // (ends at once, reusable)
        assert_eq!(
            frame(204, false, &[("content-length", "5")]),
            Ok((true, true))
        );
        assert_eq!(
            frame(200, true, &[("content-length", "5")]),
            Ok((true, true))
        );
        assert_eq!(frame(304, false, &[]), Ok((true, true)));
        assert_eq!(
            frame(200, false, &[("content-length", "0")]),
            Ok((true, true))
        );
        assert_eq!(
            frame(200, false, &[("content-length", "5")]),
            Ok((false, true))
        );
        assert_eq!(
            frame(200, false, &[("content-length", "5, 5")]),
            Ok((false, true))
        );
        // Chunked beside a length: read chunked, then close.
        assert_eq!(
            frame(
                200,
                false,
                &[("transfer-encoding", "chunked"), ("content-length", "5")]
            ),
            Ok((false, false))
        );
        // A coding that cannot be taken off here is refused; no length at all: up to the
        // end of the stream.
        assert!(frame(200, false, &[("transfer-encoding", "gzip")]).is_err());
        assert!(frame(200, false, &[("transfer-encoding", "chunked, gzip")]).is_err());
        assert!(frame(200, false, &[("transfer-encoding", "gzip, chunked")]).is_err());
        assert!(frame(200, false, &[("transfer-encoding", "chunked, chunked")]).is_err());
        assert!(
            frame(
                200,
                false,
                &[
                    ("transfer-encoding", "gzip"),
                    ("transfer-encoding", "chunked")
                ]
            )
            .is_err()
        );
        assert_eq!(
            frame(200, false, &[("transfer-encoding", "Chunked")]),
            Ok((false, true))
        );
        assert_eq!(frame(200, false, &[]), Ok((false, false)));
        // What the client is shown: one length, none beside chunked.
        let mut headers = HeaderMap::new();
        headers.append(header::CONTENT_LENGTH, HeaderValue::from_static("5, 5"));
        headers.append(header::CONTENT_LENGTH, HeaderValue::from_static("5"));
        framing(StatusCode::OK, false, true, &mut headers).unwrap();
        let lengths: Vec<_> = headers.get_all(header::CONTENT_LENGTH).iter().collect();
        assert_eq!(lengths, ["5"]);
        let mut headers = HeaderMap::new();
        headers.append(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        headers.append(header::CONTENT_LENGTH, HeaderValue::from_static("7"));
        framing(StatusCode::OK, false, true, &mut headers).unwrap();
        assert!(!headers.contains_key(header::CONTENT_LENGTH));
        for bad in ["5, 6", "-1", "x", "", "+5", "18446744073709551616"] {
            assert!(
                frame(200, false, &[("content-length", bad)]).is_err(),
                "{bad:?}"
            );
        }
    }
}
