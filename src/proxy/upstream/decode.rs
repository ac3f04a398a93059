//! The lean exchange's HTTP/1.1 response decoding, without I/O: [`ResponseDecoder`]
//! reads a response head from the bytes an upstream sent (passing over 1xx interim
//! answers) and decides how its body is framed, RFC 9112 §6.3 — no body for a HEAD, 1xx,
//! 204 or 304; chunked if the transfer coding is chunked alone; else the
//! `Content-Length`; else up to the connection's end — and [`step`] takes a body so
//! framed out of the bytes that follow, as they arrive. [`super::h1::H1Body`] streams a
//! body by calling it as its connection reads.
//!
//! Heads are parsed with httparse, as hyper's own parser does, and the decoding is held
//! to hyper's client where both read a response; the property test below compares the
//! two on generated responses, and names where this one is stricter on purpose.

use bytes::{Buf, Bytes, BytesMut};
use http::StatusCode;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use crate::proxy::BoxError;

/// Largest response head read.
const MAX_HEAD: usize = 64 * 1024;
/// Most response header lines.
const MAX_HEADERS: usize = 128;
/// Longest chunk-size line (with its extensions).
const MAX_CHUNK_LINE: usize = 4 * 1024;
/// Largest trailer section of a chunked body (trailers are read and dropped): within
/// hyper's client's bound (16 KiB with the line ends), so that no body it refuses is
/// passed on as whole.
const MAX_TRAILERS: usize = 16 * 1024 - 2;
/// Most trailer lines (hyper's client's bound on header lines, which it holds trailers to).
const MAX_TRAILER_LINES: usize = 100;

struct Head {
    status: StatusCode,
    headers: HeaderMap,
    /// HTTP/1.1 without `Connection: close`.
    keep_alive: bool,
    /// A `Content-Length` is among the headers.
    has_length: bool,
}

/// Reads a response head and decides its body's framing: fed the bytes read so far,
/// again after each read, until it answers a [`Decoded`] head.
pub(super) struct ResponseDecoder {
    /// The request was a HEAD (its response has no body, whatever its head says).
    head_request: bool,
    /// An interim (1xx) response has been read and passed over.
    interim: bool,
}

/// A final response head, with how its body is framed.
pub(super) struct Decoded {
    pub status: StatusCode,
    /// The headers as the client should see them ([`framing`]).
    pub headers: HeaderMap,
    /// The body as it is to be read.
    pub body: State,
    /// The connection can carry another exchange after the body (HTTP/1.1 without
    /// `Connection: close`, and a body that ends at a known boundary).
    pub reusable: bool,
}

impl ResponseDecoder {
    pub(super) fn new(head_request: bool) -> ResponseDecoder {
        ResponseDecoder {
            head_request,
            interim: false,
        }
    }

    /// Whether an interim response came before the bytes now awaited.
    pub(super) fn saw_interim(&self) -> bool {
        self.interim
    }

    /// Takes the heads at the start of `buf` out of it: the final one, decoded, or
    /// `None` if it has not arrived whole yet (more must be read). An error is a response
    /// that cannot be passed on: malformed, too large, an unasked upgrade, or framed in a
    /// way that cannot be followed.
    pub(super) fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Decoded>, HeadError> {
        loop {
            let Some(mut head) = parse_head(buf)? else {
                if buf.len() >= MAX_HEAD {
                    return Err(HeadError::TooLarge);
                }
                return Ok(None);
            };
            if head.status.is_informational() {
                // 100 Continue and friends: the final answer follows. (No upgrade is ever
                // asked for: `Upgrade` does not reach the upstream.)
                if head.status == StatusCode::SWITCHING_PROTOCOLS {
                    return Err(FramingError::Upgrade.into());
                }
                self.interim = true;
                continue;
            }
            let framing = framing(
                head.status,
                self.head_request,
                head.has_length,
                &mut head.headers,
            )?;
            return Ok(Some(Decoded {
                status: head.status,
                headers: head.headers,
                body: framing.state,
                reusable: head.keep_alive && framing.reusable,
            }));
        }
    }
}

/// Why a response head cannot be passed on. Built only on failure: a head that reads
/// costs nothing here.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HeadError {
    #[error("malformed response from the upstream: {0}")]
    Parse(#[source] httparse::Error),
    #[error("malformed response from the upstream: {0}")]
    Status(#[source] http::status::InvalidStatusCode),
    #[error("malformed response from the upstream: {0}")]
    Name(#[source] http::header::InvalidHeaderName),
    #[error("malformed response from the upstream: {0}")]
    Value(#[source] http::header::InvalidHeaderValue),
    #[error("malformed response from the upstream: Transfer-Encoding in an HTTP/1.0 response")]
    ChunkedHttp10,
    #[error("the upstream's response head is too large")]
    TooLarge,
    #[error(transparent)]
    Framing(#[from] FramingError),
}

/// A whole response head at the start of `buf`, taken out of it; `None` if incomplete.
fn parse_head(buf: &mut BytesMut) -> Result<Option<Head>, HeadError> {
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
        Err(e) => return Err(HeadError::Parse(e)),
    };
    let code = parsed.code.unwrap_or(0);
    let status = StatusCode::from_u16(code).map_err(HeadError::Status)?;
    let minor = parsed.version.unwrap_or(0);
    // Where each header's name and value lie in the head, to take the values out of it
    // without a copy once the parse lets go of the buffer.
    // (A value that does not lie in the head — never, with httparse — is copied.)
    let base = buf.as_ptr() as usize;
    let mut spans = Vec::with_capacity(parsed.headers.len());
    for h in parsed.headers.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes()).map_err(HeadError::Name)?;
        let span = (h.value.as_ptr() as usize)
            .checked_sub(base)
            .filter(|start| start + h.value.len() <= len)
            .map(|start| start..start + h.value.len());
        let value = match span {
            Some(span) => Err(span),
            None => Ok(HeaderValue::from_bytes(h.value).map_err(HeadError::Value)?),
        };
        spans.push((name, value));
    }
    let head = buf.split_to(len).freeze();
    // Room for one more: the proxy adds `Fencing-Result` to every fenced answer, and a
    // map made for exactly the upstream's headers would grow (allocate anew) for it.
    let mut headers = HeaderMap::with_capacity(spans.len() + 1);
    let mut close = minor == 0;
    let mut has_length = false;
    for (name, value) in spans {
        let value = match value {
            Ok(copied) => copied,
            Err(span) => {
                HeaderValue::from_maybe_shared(head.slice(span)).map_err(HeadError::Value)?
            }
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
        if minor == 0 && name == header::TRANSFER_ENCODING {
            // RFC 9112 §6.1: framing that HTTP/1.0 has not got is faulty; hyper's client
            // refuses it too (found by the `response` fuzz target).
            return Err(HeadError::ChunkedHttp10);
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
) -> Result<bool, FramingError> {
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err(FramingError::Upgrade);
    }
    let has_length = headers.contains_key(header::CONTENT_LENGTH);
    framing(status, head_request, has_length, headers).map(|f| f.reusable)
}

/// Why a response's framing cannot be followed, or passed on as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum FramingError {
    #[error("the upstream switched protocols unasked")]
    Upgrade,
    #[error("malformed Transfer-Encoding from the upstream")]
    TransferEncoding,
    #[error("a transfer coding other than chunked from the upstream")]
    Coding,
    #[error("malformed Content-Length from the upstream")]
    Length,
    #[error("conflicting Content-Length from the upstream")]
    Conflicting,
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
) -> Result<Framing, FramingError> {
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
            let v = v.to_str().map_err(|_| FramingError::TransferEncoding)?;
            codings.extend(v.split(',').map(str::trim));
        }
        // Only chunked can be taken off here (the coding header goes, as hop-by-hop);
        // another coding, before chunked or instead of it, would reach the client still
        // applied and unannounced.
        // An empty element too (`chunked,`): hyper's client reads the last element, empty,
        // and so the body up to the connection's end (found by the `response` fuzz target).
        if !matches!(codings.as_slice(), [only] if only.eq_ignore_ascii_case("chunked")) {
            return Err(FramingError::Coding);
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
fn content_length(headers: &mut HeaderMap) -> Result<Option<u64>, FramingError> {
    let mut length = None;
    let mut values = 0;
    for v in headers.get_all(header::CONTENT_LENGTH) {
        let v = v.to_str().map_err(|_| FramingError::Length)?;
        for part in v.split(',') {
            let part = part.trim();
            let n = if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
                part.parse::<u64>().ok()
            } else {
                None
            }
            .ok_or(FramingError::Length)?;
            if length.is_some_and(|l| l != n) {
                return Err(FramingError::Conflicting);
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

/// How much of a body is left, and how it ends.
pub(super) enum State {
    /// This many bytes left.
    Length(u64),
    Chunked(Chunk),
    /// Up to the end of the stream.
    Close,
    Done,
}

pub(super) enum Chunk {
    /// A chunk-size line is next.
    Size,
    /// This many bytes of chunk data left.
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    /// Trailer lines up to an empty one; this many bytes and lines of them so far.
    Trailers(usize, usize),
}

/// What the buffered bytes give a body in `state`.
pub(super) enum Step {
    Data(Bytes),
    /// The state moved on; look again.
    Again,
    /// More bytes must be read first.
    More,
    /// The body ended (the chunked body's last line).
    End,
}

pub(super) fn step(state: &mut State, buf: &mut BytesMut) -> Result<Step, BoxError> {
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
                        Chunk::Trailers(0, 0)
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
            Chunk::Trailers(seen, lines) => match buf.windows(2).position(|w| w == b"\r\n") {
                Some(0) => {
                    buf.advance(2);
                    Step::End
                }
                Some(line) if *seen + line + 2 <= MAX_TRAILERS => {
                    // Dropped, but held to a header line's grammar as hyper's client
                    // holds them: a body it would refuse is not passed on as whole.
                    if !is_trailer_line(&buf[..line]) {
                        return Err("a malformed trailer from the upstream".into());
                    }
                    *lines += 1;
                    if *lines > MAX_TRAILER_LINES {
                        return Err("too many trailers from the upstream".into());
                    }
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

/// Whether `line` (without its CRLF) is one trailer field line as hyper's client reads
/// trailers: httparse's header grammar (a token, `:`, a value), one field per CRLF line
/// (no bare LF), a name and value `http` takes.
fn is_trailer_line(line: &[u8]) -> bool {
    if line.contains(&b'\n') {
        return false;
    }
    let mut text = Vec::with_capacity(line.len() + 4);
    text.extend_from_slice(line);
    text.extend_from_slice(b"\r\n\r\n");
    let mut slot = [httparse::EMPTY_HEADER; 1];
    match httparse::parse_headers(&text, &mut slot) {
        Ok(httparse::Status::Complete((_, [h]))) => {
            HeaderName::from_bytes(h.name.as_bytes()).is_ok()
                && HeaderValue::from_bytes(h.value).is_ok()
        }
        _ => false,
    }
}

/// A whole response as this decoder reads it from `pieces` (each as one read of the
/// connection, then its end): status, headers as the client is shown them, body. For the
/// fuzz target that holds it against hyper's client.
#[cfg(feature = "fuzzing")]
#[allow(clippy::type_complexity)]
pub(crate) fn decode_all(
    pieces: &[&[u8]],
    head_request: bool,
) -> Result<(u16, Vec<(String, Vec<u8>)>, Vec<u8>), DecodeAllError> {
    let mut pieces = pieces.iter();
    let mut buf = BytesMut::new();
    let mut decoder = ResponseDecoder::new(head_request);
    let decoded = loop {
        if let Some(d) = decoder.decode(&mut buf)? {
            break d;
        }
        match pieces.next() {
            Some(p) => buf.extend_from_slice(p),
            None => return Err(DecodeAllError::EndMidHead),
        }
    };
    let headers = decoded
        .headers
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect();
    let mut state = decoded.body;
    let mut body = Vec::new();
    // Bounded: each turn takes bytes, moves the state on, or feeds a piece; a chunk takes
    // at least three bytes, so a turn per byte and piece is more than enough.
    let turns = 16 + 4 * (buf.len() + pieces.as_slice().iter().map(|p| p.len() + 1).sum::<usize>());
    for _ in 0..turns {
        if matches!(state, State::Done) {
            return Ok((decoded.status.as_u16(), headers, body));
        }
        match step(&mut state, &mut buf).map_err(DecodeAllError::Body)? {
            Step::Data(d) => body.extend_from_slice(&d),
            Step::Again => {}
            Step::End => state = State::Done,
            Step::More => match pieces.next() {
                Some(p) => buf.extend_from_slice(p),
                None if matches!(state, State::Close) => state = State::Done,
                None => return Err(DecodeAllError::EndMidBody),
            },
        }
    }
    panic!("the body decoder went round without taking bytes");
}

/// Why [`decode_all`] read no whole response.
#[cfg(feature = "fuzzing")]
#[derive(Debug, thiserror::Error)]
pub(crate) enum DecodeAllError {
    #[error(transparent)]
    Head(#[from] HeadError),
    #[error("the end of the stream mid-head")]
    EndMidHead,
    #[error("{0}")]
    Body(#[source] BoxError),
    #[error("the end of the stream mid-body")]
    EndMidBody,
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
    ) -> Result<(bool, bool), FramingError> {
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
        // An empty element beside chunked: hyper's client reads no chunked framing then.
        assert!(frame(200, false, &[("transfer-encoding", "chunked,")]).is_err());
        assert!(frame(200, false, &[("transfer-encoding", ", chunked")]).is_err());
        // Chunked framing in an HTTP/1.0 response is faulty (RFC 9112 §6.1).
        let mut buf =
            BytesMut::from(&b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"[..]);
        assert!(parse_head(&mut buf).is_err());
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
        // Trailers are dropped, but one that is no header line (hyper's client refuses the
        // body then) fails the body too (found by the `response` fuzz target).
        for bad in [
            &b"2\r\nok\r\n0\r\nX-T+# 1\r\n\r\n"[..],
            b"0\r\nno colon\r\n\r\n",
            b"0\r\n folded: x\r\n\r\n",
            b"0\r\nX-A: 1\r\n: empty name\r\n\r\n",
            b"0\r\nX-A: 1\nX-B: 2\r\n\r\n",
        ] {
            assert!(
                decode(State::Chunked(Chunk::Size), bad, 64).is_err(),
                "{bad:?}"
            );
        }
        let (data, clean) = decode(
            State::Chunked(Chunk::Size),
            b"0\r\nX-A: 1\r\nx-b:\r\n\r\n",
            3,
        )
        .unwrap();
        assert!(data.is_empty() && clean);
        let long_line = [b"1;".as_slice(), &[b'a'; MAX_CHUNK_LINE]].concat();
        assert!(decode(State::Chunked(Chunk::Size), &long_line, 512).is_err());
        let many: Vec<u8> = [&b"0\r\n"[..], &b"x: 1\r\n".repeat(MAX_TRAILER_LINES)].concat();
        let (_, clean) = decode(
            State::Chunked(Chunk::Size),
            &[&many[..], b"\r\n"].concat(),
            512,
        )
        .unwrap();
        assert!(clean);
        let more = [&many[..], b"x: 1\r\n\r\n"].concat();
        assert!(decode(State::Chunked(Chunk::Size), &more, 512).is_err());
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

/// The decoder against hyper's client (`hyper::client::conn::http1` over an in-memory
/// pipe) on generated responses: chunked with extensions and trailers, lengths (repeated,
/// conflicting, malformed), chunked beside a length, bodies up to the connection's end,
/// bodiless answers, interim answers, bad chunk framing and early ends, each fed in
/// generated pieces. Both must agree on ok or error and, when ok, on the status, the
/// end-to-end headers and the body's bytes. Trailers are not compared: this decoder reads
/// and drops them (fencegate passes no response trailers on), where hyper hands them over.
/// Where this decoder refuses what hyper takes, on purpose, is written down with the
/// reason in `stricter_on_purpose`; it never takes what hyper refuses.
#[cfg(test)]
mod against_hyper {
    use proptest::prelude::*;
    use tokio::io::AsyncWriteExt;

    use super::*;

    /// A response as generated: its bytes, the request's method, and what is known of it.
    #[derive(Debug, Clone)]
    struct Case {
        wire: Vec<u8>,
        head_request: bool,
        /// Where the wire is cut into pieces (sorted offsets).
        splits: Vec<usize>,
        /// A chunk-size line longer than this decoder takes ([`MAX_CHUNK_LINE`]).
        long_chunk_line: bool,
        /// `Content-Length` values that are not all one decimal length.
        bad_length: bool,
    }

    /// What either side made of a response.
    #[derive(Debug, PartialEq)]
    struct Seen {
        status: u16,
        /// The `x-` headers, in order.
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
    }

    #[derive(Debug, Clone)]
    enum Framing {
        /// `Content-Length` lines as given (the right value, or not), then the body.
        Length(Vec<String>),
        /// Chunks (data, extension), trailer lines, with the last-chunk line as given.
        Chunked {
            chunks: Vec<(Vec<u8>, String)>,
            trailers: Vec<(String, String)>,
            /// A size line that is not a hex size in place of one chunk's.
            bad_size: Option<(usize, String)>,
            /// Also a `Content-Length` (a length beside chunked).
            length_too: bool,
        },
        /// No length at all: up to the connection's end.
        Close,
    }

    fn ext() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => Just(String::new()),
            2 => "[a-z]{1,6}".prop_map(|n| format!(";{n}")),
            2 => ("[a-z]{1,6}", "[a-z0-9]{1,6}").prop_map(|(n, v)| format!(";{n}={v}")),
            1 => ("[a-z]{1,6}", "[a-z0-9 ]{0,6}").prop_map(|(n, v)| format!(";{n}=\"{v}\"")),
            1 => (4000usize..4200).prop_map(|n| format!(";{}", "e".repeat(n))),
        ]
    }

    fn framing(body_len: usize) -> impl Strategy<Value = Framing> {
        let n = body_len.to_string();
        let right = n.clone();
        prop_oneof![
            4 => Just(Framing::Length(vec![right.clone()])),
            1 => Just(Framing::Length(vec![format!("{n}, {n}")])),
            1 => Just(Framing::Length(vec![n.clone(), n.clone()])),
            1 => Just(Framing::Length(vec![n.clone(), format!("{}", body_len + 1)])),
            1 => Just(Framing::Length(vec![format!("00{n}")])),
            1 => prop_oneof![
                Just("-1".to_string()),
                Just("+1".to_string()),
                Just("x".to_string()),
                Just(String::new()),
                Just("18446744073709551616".to_string()),
            ]
            .prop_map(|v| Framing::Length(vec![v])),
            5 => (
                prop::collection::vec((prop::collection::vec(any::<u8>(), 1..40), ext()), 0..4),
                prop::collection::vec(("x-t[a-z]{0,3}", "[a-z0-9]{0,8}"), 0..3),
                prop::option::weighted(
                    0.15,
                    (
                        0usize..4,
                        prop_oneof![
                            Just("zz".to_string()),
                            Just("-1".to_string()),
                            Just("".to_string()),
                            Just("10000000000000000".to_string()),
                            Just(";x".to_string()),
                            Just("0x5".to_string()),
                        ],
                    ),
                ),
                prop::bool::weighted(0.15),
            )
                .prop_map(|(chunks, trailers, bad_size, length_too)| Framing::Chunked {
                    chunks,
                    trailers,
                    bad_size,
                    length_too,
                }),
            2 => Just(Framing::Close),
        ]
    }

    fn case() -> impl Strategy<Value = Case> {
        (
            prop_oneof![
                6 => Just(200u16),
                1 => Just(201),
                1 => Just(204),
                1 => Just(304),
                1 => Just(404),
                1 => Just(503),
            ],
            prop::bool::weighted(0.1),
            prop::bool::weighted(0.15),
            prop::bool::weighted(0.15),
            prop::collection::vec(("x-[a-z]{1,4}", "[a-zA-Z0-9 ]{0,8}"), 0..3),
            prop::collection::vec(any::<u8>(), 0..64),
        )
            .prop_flat_map(|(status, head_request, interim, close, headers, body)| {
                (
                    Just((status, head_request, interim, close, headers)),
                    framing(body.len()),
                    Just(body),
                    // An early end: the wire cut this far before its end (often not).
                    prop::option::weighted(0.15, 1usize..12),
                    prop::collection::vec(any::<prop::sample::Index>(), 0..6),
                )
            })
            .prop_map(
                |((status, head_request, interim, close, headers), framing, body, cut, splits)| {
                    build(
                        status,
                        head_request,
                        interim,
                        close,
                        &headers,
                        &framing,
                        &body,
                        cut,
                        &splits,
                    )
                },
            )
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        status: u16,
        head_request: bool,
        interim: bool,
        close: bool,
        headers: &[(String, String)],
        framing: &Framing,
        body: &[u8],
        cut: Option<usize>,
        splits: &[prop::sample::Index],
    ) -> Case {
        let mut w = Vec::new();
        if interim {
            w.extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
        }
        w.extend_from_slice(format!("HTTP/1.1 {status} Whatever\r\n").as_bytes());
        for (k, v) in headers {
            w.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
        }
        if close {
            w.extend_from_slice(b"connection: close\r\n");
        }
        let mut long_chunk_line = false;
        let mut bad_length = false;
        match framing {
            Framing::Length(lines) => {
                let mut values = lines.iter().flat_map(|l| l.split(',')).map(str::trim);
                let first = values.next().unwrap_or_default();
                bad_length = first.is_empty()
                    || !first.bytes().all(|b| b.is_ascii_digit())
                    || first.parse::<u64>().is_err()
                    || values.any(|v| v != first);
                for l in lines {
                    w.extend_from_slice(format!("content-length: {l}\r\n\r\n").as_bytes());
                    w.truncate(w.len() - 2);
                }
                w.extend_from_slice(b"\r\n");
                w.extend_from_slice(body);
            }
            Framing::Chunked {
                chunks,
                trailers,
                bad_size,
                length_too,
            } => {
                w.extend_from_slice(b"transfer-encoding: chunked\r\n");
                if *length_too {
                    w.extend_from_slice(b"content-length: 3\r\n");
                }
                w.extend_from_slice(b"\r\n");
                for (i, (data, ext)) in chunks.iter().enumerate() {
                    long_chunk_line |= ext.len() + 8 > MAX_CHUNK_LINE;
                    match bad_size {
                        Some((at, bad)) if *at == i => {
                            w.extend_from_slice(format!("{bad}{ext}\r\n").as_bytes())
                        }
                        _ => w.extend_from_slice(format!("{:x}{ext}\r\n", data.len()).as_bytes()),
                    }
                    w.extend_from_slice(data);
                    w.extend_from_slice(b"\r\n");
                }
                match bad_size {
                    Some((at, bad)) if *at >= chunks.len() => {
                        w.extend_from_slice(format!("{bad}\r\n").as_bytes())
                    }
                    _ => w.extend_from_slice(b"0\r\n"),
                }
                for (k, v) in trailers {
                    w.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
                }
                w.extend_from_slice(b"\r\n");
            }
            Framing::Close => {
                w.extend_from_slice(b"\r\n");
                w.extend_from_slice(body);
            }
        }
        if let Some(cut) = cut {
            w.truncate(w.len().saturating_sub(cut));
        }
        let mut splits: Vec<usize> = splits.iter().map(|i| i.index(w.len() + 1)).collect();
        splits.sort_unstable();
        splits.dedup();
        Case {
            wire: w,
            head_request,
            splits,
            long_chunk_line,
            bad_length,
        }
    }

    /// The pieces of a case's wire.
    fn pieces(case: &Case) -> Vec<&[u8]> {
        let mut out = Vec::new();
        let mut at = 0;
        for &s in case.splits.iter().chain([&case.wire.len()]) {
            out.push(&case.wire[at..s]);
            at = s;
        }
        out
    }

    fn x_headers(headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
        headers
            .iter()
            .filter(|(k, _)| k.as_str().starts_with("x-"))
            .map(|(k, v)| (k.as_str().to_owned(), v.as_bytes().to_vec()))
            .collect()
    }

    /// This decoder, fed the pieces in turn as a connection would read them, then the end
    /// of the stream.
    fn ours(case: &Case) -> Result<Seen, String> {
        let mut pieces = pieces(case).into_iter();
        let mut buf = BytesMut::new();
        let mut decoder = ResponseDecoder::new(case.head_request);
        let decoded = loop {
            if let Some(d) = decoder.decode(&mut buf).map_err(|e| e.to_string())? {
                break d;
            }
            match pieces.next() {
                Some(p) => buf.extend_from_slice(p),
                None => return Err("the end of the stream mid-head".into()),
            }
        };
        let mut state = decoded.body;
        let mut body = Vec::new();
        // Bounded: each turn takes bytes, moves the state on, or feeds a piece.
        for _ in 0..10_000 {
            if matches!(state, State::Done) {
                return Ok(Seen {
                    status: decoded.status.as_u16(),
                    headers: x_headers(&decoded.headers),
                    body,
                });
            }
            match step(&mut state, &mut buf).map_err(|e| e.to_string())? {
                Step::Data(d) => body.extend_from_slice(&d),
                Step::Again => {}
                Step::End => state = State::Done,
                Step::More => match pieces.next() {
                    Some(p) => buf.extend_from_slice(p),
                    None if matches!(state, State::Close) => state = State::Done,
                    None => return Err("the end of the stream mid-body".into()),
                },
            }
        }
        Err("no end in sight".into())
    }

    /// hyper's client, reading the pieces from a pipe (each written after hyper has had a
    /// turn at the one before), then the end of the stream.
    async fn hypers(case: &Case) -> Result<Seen, String> {
        let (client, mut server) = tokio::io::duplex(1 << 20);
        let (mut send, conn) = hyper::client::conn::http1::handshake::<
            _,
            http_body_util::Empty<Bytes>,
        >(hyper_util::rt::TokioIo::new(client))
        .await
        .map_err(|e| e.to_string())?;
        let conn = tokio::spawn(conn);
        let method = if case.head_request {
            http::Method::HEAD
        } else {
            http::Method::GET
        };
        let req = http::Request::builder()
            .method(method)
            .uri("/")
            .header("host", "upstream")
            .body(http_body_util::Empty::new())
            .map_err(|e| e.to_string())?;
        let wire = case.clone();
        let writer = tokio::spawn(async move {
            for p in pieces(&wire) {
                if server.write_all(p).await.is_err() {
                    return;
                }
                for _ in 0..4 {
                    tokio::task::yield_now().await;
                }
            }
            let _ = server.shutdown().await;
            // Kept open for reading (hyper's request went into it) until hyper is done.
            let mut sink = Vec::new();
            let _ = tokio::io::AsyncReadExt::read_to_end(&mut server, &mut sink).await;
        });
        let result = async {
            let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
            let status = resp.status().as_u16();
            let headers = x_headers(resp.headers());
            let body = http_body_util::BodyExt::collect(resp.into_body())
                .await
                .map_err(|e| e.to_string())?
                .to_bytes()
                .to_vec();
            Ok(Seen {
                status,
                headers,
                body,
            })
        }
        .await;
        drop(send);
        conn.abort();
        writer.abort();
        result
    }

    /// Where this decoder is stricter than hyper's client on purpose: the reason, if
    /// `case` is such a response and hyper took it.
    fn stricter_on_purpose(case: &Case, hyper: &Seen) -> Option<&'static str> {
        let _ = hyper;
        if case.long_chunk_line {
            // hyper takes up to 16 KiB of chunk extensions over a whole body; this decoder
            // takes a chunk-size line (with its extensions) of at most 4 KiB, a bound on
            // what it buffers to find the line's end, and no client of fencegate is shown
            // extensions anyway.
            return Some("a chunk-size line over MAX_CHUNK_LINE");
        }
        if case.bad_length {
            // Lengths that disagree, or one that is no decimal number: RFC 9112 §6.3 ¶5
            // has a proxy discard such a response (it could frame the body differently
            // for the next hop), and fencegate refuses it on hyper's path too
            // (`check_framing`). hyper's client takes some (it reads no length at all on
            // a 204, a 304 or an answer to a HEAD, where this decoder checks the one the
            // client would be shown).
            return Some("conflicting or malformed Content-Length");
        }
        None
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn the_decoder_reads_responses_as_hypers_client_does(case in case()) {
            let rt = tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("a runtime");
            let theirs = rt.block_on(hypers(&case));
            let ours = ours(&case);
            match (&ours, &theirs) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a, b, "wire {:?}", String::from_utf8_lossy(&case.wire)),
                (Err(_), Err(_)) => {}
                (Err(e), Ok(b)) => prop_assert!(
                    stricter_on_purpose(&case, b).is_some(),
                    "refused ({e}) what hyper took: {b:?}; wire {:?}",
                    String::from_utf8_lossy(&case.wire)
                ),
                (Ok(a), Err(e)) => prop_assert!(
                    false,
                    "took ({a:?}) what hyper refused ({e}); wire {:?}",
                    String::from_utf8_lossy(&case.wire)
                ),
            }
        }
    }
}
