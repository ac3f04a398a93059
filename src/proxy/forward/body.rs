//! The request body on its way upstream: in memory (none, or a small one read whole,
//! for the lean exchange) or streamed through hyper's client, held to the route's
//! `max_body` and watched until it is all written.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Version};
use http_body::{Frame, SizeHint};
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::proxy::{Body, BoxError};

/// The request body as it goes upstream.
pub(super) enum Outbound {
    /// None, or a small one read whole: the lean exchange can send it.
    Whole(Bytes),
    /// Still to stream, through hyper's client.
    Streamed(Body),
}

impl Outbound {
    /// The body for hyper's client.
    pub(super) fn into_body(self) -> Body {
        match self {
            Outbound::Whole(bytes) => http_body_util::Full::new(bytes)
                .map_err(|never| match never {})
                .boxed(),
            Outbound::Streamed(body) => body,
        }
    }
}

/// What the take-the-body phase decided: the body as it goes, or one to read whole first
/// (which the caller awaits, within the upstream's timeout).
pub(super) enum Taken {
    Ready(Outbound),
    ReadWhole(Body),
}

/// Decides how the request body goes. A small HTTP/1 body of known length is read whole
/// before the request goes upstream. An upstream may answer without reading a body
/// (nginx's `return`, an early error): part of it would then stay unread on the client's
/// connection, which hyper closes after the response, and a client that already sent its
/// next request on it sees a broken pipe. Larger or unsized bodies are streamed, and so
/// is every HTTP/2 body (an unread one ends its own stream only). Request trailers are not
/// passed on either way (`Trailer` is stripped, and hyper's client sends only declared
/// ones): the fence reads the head alone, and a trailer field could carry what it refuses
/// there.
pub(super) fn take(body: Body, version: Version, max_body: Option<u64>) -> Taken {
    if http_body::Body::is_end_stream(&body) {
        return Taken::Ready(Outbound::Whole(Bytes::new()));
    }
    match http_body::Body::size_hint(&body).exact() {
        Some(len)
            if version <= Version::HTTP_11
                && len <= WHOLE_BODY
                && max_body.is_none_or(|m| len <= m) =>
        {
            Taken::ReadWhole(body)
        }
        _ => Taken::Ready(Outbound::Streamed(body)),
    }
}

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

/// The upstream request for hyper's client, from a head prepared by
/// [`upstream_parts`](super::upstream_parts) and the body to stream. Answers the request
/// and what becomes of its body on the way: whether it outgrew `max_body`, and whether it
/// was all written.
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

/// Request bodies of known length up to this size are read whole before forwarding.
const WHOLE_BODY: u64 = 64 * 1024;

/// Reads a body of known length whole (hyper holds a body to its Content-Length). Stops
/// as soon as the body says it has ended, without a poll for its end; one data frame,
/// the usual case for a small body, is kept as it is.
pub(super) async fn read_whole(mut body: Body) -> Result<Bytes, BoxError> {
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
