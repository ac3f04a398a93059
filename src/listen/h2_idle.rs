//! An idle deadline for HTTP/2 connections.
//!
//! An HTTP/1 connection waiting for its next request is bounded by hyper's head timeout
//! (`header_read_timeout`). hyper's HTTP/2 server has no such bound: a client that opens
//! a connection and no stream, answering keep-alive pings, holds its connection slot for
//! good. Here the connection's first bytes tell whether it speaks HTTP/2 ([`Streams`] is
//! told by [`crate::listen::first_bytes::FirstBytes`]), the service counts its open requests (a
//! request is open until its response body is done), and [`IdleConn`] starts a graceful
//! shutdown (GOAWAY, then close) once an HTTP/2 connection has had no open request for
//! the idle limit.
//!
//! A client can also stall one stream and keep the connection alive: it reads the socket
//! and answers pings, but grants no flow-control window, so hyper never asks the response
//! body for more and the upstream connection behind it stays checked out. Each response
//! body notes when it has something for hyper that hyper has not come back for — a frame
//! it handed over, its first frame, or more from its source after a wait (hyper may wait
//! for the stream to have window before it comes back, so it may never come); a
//! connection with such a stream waiting longer than `send_timeout` is closed. A body
//! waiting on its own source is not waiting for the client: that wait is the upstream
//! read timeout's business.
//!
//! A closing HTTP/2 connection (idle, or told to drain) sends GOAWAY and a PING, and hyper
//! waits for the PING's answer before it closes; a client that stops answering would hold
//! the connection (and its slot) until hyper's keep-alive gives up, 40 s later. Once it
//! has no open stream, a closing connection is dropped at [`CLOSE_WITHIN`] (or the idle
//! limit, if shorter) after its GOAWAY, whatever the client does.
//!
//! And a connection with nothing in hand (HTTP/2: no open stream; HTTP/1: no request in
//! its handler) can be told to close at once ([`Streams::evict`]), to make room for a new
//! one when the listener is out of connection slots (see `server::ConnLimits`).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Frame, SizeHint};

use super::conn::{StreamOpen, Streams};
use crate::rt::drain::Drainable;
use crate::rt::timer::Deadline;

/// How long a closing HTTP/2 connection with no open stream may wait for its client
/// (the answer to the GOAWAY's PING) before it is dropped.
pub const CLOSE_WITHIN: Duration = Duration::from_secs(2);

/// The waker a response body's source is polled with: when the source has more after a
/// wait, the body waits for hyper from then on, and hyper is woken.
struct SourceWake {
    streams: Arc<Streams>,
    id: u64,
    /// A poll of the source is pending with this waker and hyper has not polled the body
    /// since. Changed under `streams.waiting`'s lock.
    armed: AtomicBool,
    /// The waker of the task hyper polls the body in.
    hyper: Mutex<Option<Waker>>,
}

impl std::task::Wake for SourceWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let first = {
            let mut waiting = self.streams.waiting();
            self.armed.swap(false, Ordering::AcqRel) && Streams::note(&mut waiting, self.id)
        };
        if first {
            self.streams.wake_connection();
        }
        let hyper = self.hyper.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(w) = hyper {
            w.wake();
        }
    }
}

/// A response body that keeps its request counted open until it is dropped (hyper drops
/// it once the stream has sent it, or is reset), and tells the connection while it has
/// something for hyper that hyper has not come for (see the module docs).
pub struct OpenBody<B> {
    inner: B,
    open: StreamOpen,
    /// With a `send_timeout`: the state its source's waker shares, and that waker.
    wake: Option<(Arc<SourceWake>, Waker)>,
}

impl<B: http_body::Body> OpenBody<B> {
    /// A body hyper has yet to ask for anything waits from now: with no window granted,
    /// hyper may never take what it asks for.
    pub fn new(inner: B, open: StreamOpen) -> OpenBody<B> {
        let streams = &open.0;
        let wake = streams.send_timeout.map(|_| {
            let state = Arc::new(SourceWake {
                streams: streams.clone(),
                id: streams.next_id.fetch_add(1, Ordering::Relaxed),
                armed: AtomicBool::new(false),
                hyper: Mutex::new(None),
            });
            let waker = Waker::from(state.clone());
            (state, waker)
        });
        if let Some((state, _)) = &wake
            && !inner.is_end_stream()
            && Streams::note(&mut streams.waiting(), state.id)
        {
            streams.wake_connection();
        }
        OpenBody { inner, open, wake }
    }
}

impl<B> OpenBody<B> {
    /// Hyper came for more (or the body is done): nothing of it waits for hyper now, and
    /// a wake of its source from an earlier poll no longer counts.
    fn taken(&self) {
        if let Some((state, _)) = &self.wake {
            let mut waiting = self.open.0.waiting();
            state.armed.store(false, Ordering::Release);
            waiting.retain(|&(i, _)| i != state.id);
        }
    }
}

impl<B> Drop for OpenBody<B> {
    fn drop(&mut self) {
        self.taken();
    }
}

impl<B: http_body::Body<Data = Bytes> + Unpin> http_body::Body for OpenBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        let Some((state, waker)) = &this.wake else {
            return Pin::new(&mut this.inner).poll_frame(cx);
        };
        this.taken();
        {
            let mut hyper = state.hyper.lock().unwrap_or_else(|p| p.into_inner());
            if !hyper.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                *hyper = Some(cx.waker().clone());
            }
        }
        // From here a wake of the source means it has more for a hyper that may not come.
        state.armed.store(true, Ordering::Release);
        let polled = Pin::new(&mut this.inner).poll_frame(&mut Context::from_waker(waker));
        if polled.is_ready() {
            // hyper may hold even the last frame until the stream has window; it drops the
            // body once that frame is sent.
            let more = matches!(&polled, Poll::Ready(Some(Ok(_))));
            let streams = &this.open.0;
            let first = {
                let mut waiting = streams.waiting();
                state.armed.store(false, Ordering::Release);
                // A frame handed over waits until hyper comes back (or drops the body once
                // it is sent); after the end nothing waits (whatever a wake during the poll
                // noted is undone).
                if more {
                    Streams::note(&mut waiting, state.id)
                } else {
                    waiting.retain(|&(i, _)| i != state.id);
                    false
                }
            };
            if first {
                streams.wake_connection();
            }
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

pin_project_lite::pin_project! {
    /// A connection that shuts down gracefully once it has been an idle HTTP/2 connection
    /// for `idle`, is dropped if it has not closed (with no open stream) soon after, and
    /// closes when evicted.
    pub struct IdleConn<C> {
        #[pin]
        conn: C,
        streams: Arc<Streams>,
        idle: Duration,
        deadline: Option<Deadline>,
        closing: bool,
        // Since the graceful shutdown began: when a connection with no open stream is
        // dropped.
        closed_by: Option<Deadline>,
        // The task's waker is in `streams` (HTTP/1: stored once).
        registered: bool,
        // When the stream waiting longest reaches `send_timeout`.
        stall: Option<(Instant, Deadline)>,
    }
}

impl<C> IdleConn<C> {
    pub fn new(conn: C, streams: Arc<Streams>, idle: Duration) -> IdleConn<C> {
        IdleConn {
            conn,
            streams,
            idle,
            deadline: None,
            closing: false,
            closed_by: None,
            registered: false,
            stall: None,
        }
    }
}

/// How long after its GOAWAY a closing connection with no open stream is dropped.
fn close_within(idle: Duration) -> Duration {
    idle.min(CLOSE_WITHIN)
}

impl<C, E> Future for IdleConn<C>
where
    C: Drainable<Output = Result<(), E>>,
    E: From<std::io::Error>,
{
    type Output = C::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let mut this = self.project();
        loop {
            if let Poll::Ready(out) = this.conn.as_mut().poll(cx) {
                return Poll::Ready(out);
            }
            // Looked at after the connection's poll: the one that read the preface has
            // just told whether this is HTTP/2.
            if !this.streams.h2.load(Ordering::Acquire) {
                // HTTP/1: only an eviction wakes this task; a task's waker stays the same.
                if !*this.registered {
                    *this.registered = true;
                    let mut w = this.streams.waker.lock().unwrap_or_else(|p| p.into_inner());
                    *w = Some(cx.waker().clone());
                }
                if !*this.closing && this.streams.evict.load(Ordering::Acquire) {
                    *this.closing = true;
                    this.conn.as_mut().graceful_shutdown();
                    continue;
                }
                return Poll::Pending;
            }
            // Bodies note their waits in their streams' tasks; a first waiter wakes this
            // one, so its waker is in place before the waiters are looked at.
            {
                let mut w = this.streams.waker.lock().unwrap_or_else(|p| p.into_inner());
                if !w.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    *w = Some(cx.waker().clone());
                }
            }
            match (this.streams.send_timeout, this.streams.oldest_waiting()) {
                (Some(limit), Some(since)) => {
                    let at = since + limit;
                    if this.stall.as_ref().is_none_or(|(a, _)| *a != at) {
                        *this.stall = Some((at, Deadline::at(at)));
                    }
                    if let Some((_, d)) = this.stall.as_mut()
                        && Pin::new(d).poll(cx).is_ready()
                    {
                        // Dropping the connection resets its streams and frees the
                        // upstream connections behind them.
                        return Poll::Ready(Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "an HTTP/2 stream took none of its answer within send_timeout",
                        )
                        .into()));
                    }
                }
                _ => *this.stall = None,
            }
            // Looked at after the waker is in place: the last request ending from now on
            // wakes this task.
            let open = this.streams.open.load(Ordering::Acquire);
            if open == 0 && this.streams.evict.load(Ordering::Acquire) {
                if !*this.closing {
                    *this.closing = true;
                    this.conn.as_mut().graceful_shutdown();
                    // Once more, so its GOAWAY is written; its client is not waited for.
                    if let Poll::Ready(out) = this.conn.as_mut().poll(cx) {
                        return Poll::Ready(out);
                    }
                }
                return Poll::Ready(Ok(()));
            }
            if *this.closing {
                if open > 0 {
                    return Poll::Pending;
                }
                let idle = *this.idle;
                let by = this
                    .closed_by
                    .get_or_insert_with(|| Deadline::after(close_within(idle)));
                if Pin::new(by).poll(cx).is_ready() {
                    return Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "an HTTP/2 connection did not close soon after its GOAWAY",
                    )
                    .into()));
                }
                return Poll::Pending;
            }
            if open > 0 {
                *this.deadline = None;
                return Poll::Pending;
            }
            let idle = *this.idle;
            let deadline = this.deadline.get_or_insert_with(|| Deadline::after(idle));
            if Pin::new(deadline).poll(cx).is_pending() {
                return Poll::Pending;
            }
            *this.closing = true;
            *this.deadline = None;
            *this.closed_by = Some(Deadline::after(close_within(idle)));
            this.conn.as_mut().graceful_shutdown();
        }
    }
}

impl<C, E> Drainable for IdleConn<C>
where
    C: Drainable<Output = Result<(), E>>,
    E: From<std::io::Error>,
{
    fn graceful_shutdown(self: Pin<&mut Self>) {
        let this = self.project();
        if !*this.closing {
            *this.closing = true;
            *this.closed_by = Some(Deadline::after(close_within(*this.idle)));
            this.conn.graceful_shutdown();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body::Body;
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    /// A source that has a chunk, or nothing yet, or is done, as the test says.
    #[derive(Default)]
    struct Source {
        chunk: Option<Bytes>,
        done: bool,
        waker: Option<Waker>,
    }

    #[derive(Clone, Default)]
    struct Feed(Arc<Mutex<Source>>);

    impl Feed {
        fn send(&self, data: &'static [u8]) {
            let mut s = self.0.lock().unwrap();
            s.chunk = Some(Bytes::from_static(data));
            if let Some(w) = s.waker.take() {
                w.wake();
            }
        }

        fn end(&self) {
            let mut s = self.0.lock().unwrap();
            s.done = true;
            if let Some(w) = s.waker.take() {
                w.wake();
            }
        }
    }

    impl http_body::Body for Feed {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            let mut s = self.0.lock().unwrap();
            if let Some(chunk) = s.chunk.take() {
                return Poll::Ready(Some(Ok(Frame::data(chunk))));
            }
            if s.done {
                return Poll::Ready(None);
            }
            s.waker = Some(cx.waker().clone());
            Poll::Pending
        }

        fn is_end_stream(&self) -> bool {
            let s = self.0.lock().unwrap();
            s.done && s.chunk.is_none()
        }
    }

    /// Counts its wakes: the task hyper would poll the body in, or the connection's.
    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn waiters(streams: &Streams) -> usize {
        streams.waiting().len()
    }

    #[test]
    fn a_body_whose_source_has_more_waits_for_hyper_even_if_hyper_does_not_come() {
        let streams = Streams::new(Some(Duration::from_secs(1)));
        let connection = Arc::new(Count::default());
        *streams.waker.lock().unwrap() = Some(Waker::from(connection.clone()));
        let feed = Feed::default();
        let mut body = OpenBody::new(feed.clone(), streams.open(None));
        // Not yet asked for anything: it waits for hyper, and the connection is told.
        assert_eq!(waiters(&streams), 1);
        assert_eq!(connection.0.load(Ordering::SeqCst), 1);

        let hyper = Arc::new(Count::default());
        let hyper_waker = Waker::from(hyper.clone());
        let mut cx = Context::from_waker(&hyper_waker);
        let mut body = Pin::new(&mut body);
        // Asked, and the source has nothing: the body waits on its source, not on hyper.
        assert!(body.as_mut().poll_frame(&mut cx).is_pending());
        assert_eq!(waiters(&streams), 0);
        // The source gets more. hyper is woken, but a stream with no window does not poll
        // its body: from now on the body waits for hyper, and the connection is told.
        feed.send(b"more");
        assert_eq!(hyper.0.load(Ordering::SeqCst), 1);
        assert_eq!(waiters(&streams), 1);
        assert_eq!(connection.0.load(Ordering::SeqCst), 2);

        // hyper comes: the frame is handed over, and the body waits for hyper to come back.
        assert!(matches!(
            body.as_mut().poll_frame(&mut cx),
            Poll::Ready(Some(Ok(_)))
        ));
        assert_eq!(waiters(&streams), 1);
        // It comes back; the source is dry again, then ends: nothing waits.
        assert!(body.as_mut().poll_frame(&mut cx).is_pending());
        assert_eq!(waiters(&streams), 0);
        feed.end();
        assert_eq!(waiters(&streams), 1);
        assert!(matches!(
            body.as_mut().poll_frame(&mut cx),
            Poll::Ready(None)
        ));
        assert_eq!(waiters(&streams), 0);
        // A late wake of the source, once hyper took the end, notes nothing.
        feed.send(b"late");
        assert_eq!(waiters(&streams), 0);
    }

    #[test]
    fn the_last_frame_waits_until_hyper_has_sent_it() {
        let streams = Streams::new(Some(Duration::from_secs(1)));
        let feed = Feed::default();
        feed.send(b"all of it");
        feed.end();
        let mut body = OpenBody::new(feed.clone(), streams.open(None));
        let hyper = Waker::from(Arc::new(Count::default()));
        assert!(matches!(
            Pin::new(&mut body).poll_frame(&mut Context::from_waker(&hyper)),
            Poll::Ready(Some(Ok(_)))
        ));
        assert!(body.is_end_stream());
        // hyper holds that frame until the stream has window: it still waits.
        assert_eq!(waiters(&streams), 1);
        // Sent, hyper drops the body.
        drop(body);
        assert_eq!(waiters(&streams), 0);
    }

    #[test]
    fn a_dropped_body_leaves_nothing_waiting() {
        let streams = Streams::new(Some(Duration::from_secs(1)));
        let feed = Feed::default();
        let mut body = OpenBody::new(feed.clone(), streams.open(None));
        let hyper = Waker::from(Arc::new(Count::default()));
        assert!(
            Pin::new(&mut body)
                .poll_frame(&mut Context::from_waker(&hyper))
                .is_pending()
        );
        drop(body);
        // The source's waker outlives the body; its wake must not note a body that is gone.
        feed.send(b"late");
        assert_eq!(waiters(&streams), 0);
        assert_eq!(streams.open.load(Ordering::SeqCst), 0);
    }
}
