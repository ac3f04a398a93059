//! The client's response to an upstream's answer: hop-by-hop headers removed, and a body
//! that holds the generation's in-flight count until it is over (or stalls, or a
//! cluster's stop cuts it), then completes it if the answer confirms its request.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Response;
use http::header;
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;

use super::body::Outgoing;
use super::client::Upstreamed;
use super::headers::strip_hop_by_hop;
use crate::fence::InflightGuard;
use crate::proxy::hop::Stop;
use crate::proxy::{Body, BoxError};
use crate::rt::timer::Deadline;

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
