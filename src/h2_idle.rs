//! An idle deadline for HTTP/2 connections.
//!
//! An HTTP/1 connection waiting for its next request is bounded by hyper's head timeout
//! (`header_read_timeout`). hyper's HTTP/2 server has no such bound: a client that opens
//! a connection and no stream, answering keep-alive pings, holds its connection slot for
//! good. Here the connection's first bytes tell whether it speaks HTTP/2 ([`Streams`] is
//! told by [`crate::first_bytes::FirstBytes`]), the service counts its open requests (a
//! request is open until its response body is done), and [`IdleConn`] starts a graceful
//! shutdown (GOAWAY, then close) once an HTTP/2 connection has had no open request for
//! the idle limit.
//!
//! A client can also stall one stream and keep the connection alive: it reads the socket
//! and answers pings, but grants no flow-control window, so hyper never asks the response
//! body for more and the upstream connection behind it stays checked out. Each response
//! body notes when it handed hyper data that hyper has not come back for; a connection
//! with such a stream waiting longer than `send_timeout` is closed.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Frame, SizeHint};

use crate::drain::Drainable;
use crate::timer::Deadline;

/// One connection's open requests, and whether it speaks HTTP/2.
#[derive(Default)]
pub struct Streams {
    open: AtomicUsize,
    h2: AtomicBool,
    /// The connection's task, woken when the last open request ends.
    waker: Mutex<Option<Waker>>,
    /// How long a response body may wait for hyper to take more (`None`: no limit).
    send_timeout: Option<Duration>,
    /// Response bodies waiting for hyper to ask for more (a frame handed over, or none asked
    /// for yet): body id, and since when. At most one entry per open stream.
    waiting: Mutex<Vec<(u64, Instant)>>,
    next_id: AtomicU64,
}

impl Streams {
    pub fn new(send_timeout: Option<Duration>) -> Arc<Streams> {
        Arc::new(Streams {
            send_timeout,
            ..Streams::default()
        })
    }

    fn waiting(&self) -> std::sync::MutexGuard<'_, Vec<(u64, Instant)>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Since when the longest-waiting response body has waited for hyper to take more.
    fn oldest_waiting(&self) -> Option<Instant> {
        self.waiting().iter().map(|&(_, since)| since).min()
    }

    /// The connection began with the HTTP/2 preface.
    pub fn set_h2(&self) {
        self.h2.store(true, Ordering::Release);
    }

    /// Counts a request open until the answer is dropped.
    pub fn open(self: &Arc<Self>) -> StreamOpen {
        self.open.fetch_add(1, Ordering::AcqRel);
        StreamOpen(self.clone())
    }
}

/// An open request of an HTTP/2 connection (see [`Streams::open`]).
pub struct StreamOpen(Arc<Streams>);

impl Drop for StreamOpen {
    fn drop(&mut self) {
        if self.0.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            let waker = self
                .0
                .waker
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            if let Some(w) = waker {
                w.wake();
            }
        }
    }
}

/// A response body that keeps its request counted open until it is dropped (hyper drops
/// it once the stream has sent it, or is reset), and tells the connection while hyper
/// holds a frame of it and has not asked for the next.
pub struct OpenBody<B> {
    inner: B,
    open: StreamOpen,
    id: u64,
    /// An entry of this body is in `Streams::waiting`.
    handed: bool,
}

impl<B: http_body::Body> OpenBody<B> {
    /// A body hyper has yet to ask for anything waits from now: with no window granted,
    /// hyper does not poll it at all.
    pub fn new(inner: B, open: StreamOpen) -> OpenBody<B> {
        let id = open.0.next_id.fetch_add(1, Ordering::Relaxed);
        let handed = open.0.send_timeout.is_some() && !inner.is_end_stream();
        if handed {
            open.0.waiting().push((id, Instant::now()));
        }
        OpenBody {
            inner,
            open,
            id,
            handed,
        }
    }
}

impl<B> OpenBody<B> {
    fn taken(&mut self) {
        if self.handed {
            self.handed = false;
            let id = self.id;
            self.open.0.waiting().retain(|&(i, _)| i != id);
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
        // hyper came back for more: the last frame went out (or has room to).
        this.taken();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = &polled
            && this.open.0.send_timeout.is_some()
            && !this.inner.is_end_stream()
        {
            this.handed = true;
            this.open.0.waiting().push((this.id, Instant::now()));
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
    /// for `idle`.
    pub struct IdleConn<C> {
        #[pin]
        conn: C,
        streams: Arc<Streams>,
        idle: Duration,
        deadline: Option<Deadline>,
        closing: bool,
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
            stall: None,
        }
    }
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
                return Poll::Pending;
            }
            // The bodies note their waits while the connection is polled, in this task.
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
            if *this.closing {
                return Poll::Pending;
            }
            {
                let mut w = this.streams.waker.lock().unwrap_or_else(|p| p.into_inner());
                if !w.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    *w = Some(cx.waker().clone());
                }
            }
            // Looked at after the waker is in place: the last request ending from now on
            // wakes this task.
            if this.streams.open.load(Ordering::Acquire) > 0 {
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
            this.conn.graceful_shutdown();
        }
    }
}
