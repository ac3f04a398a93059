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

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

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
}

impl Streams {
    pub fn new() -> Arc<Streams> {
        Arc::default()
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
/// it once the stream has sent it, or is reset).
pub struct OpenBody<B> {
    inner: B,
    /// Held for its drop.
    _open: StreamOpen,
}

impl<B> OpenBody<B> {
    pub fn new(inner: B, open: StreamOpen) -> OpenBody<B> {
        OpenBody { inner, _open: open }
    }
}

impl<B: http_body::Body<Data = Bytes> + Unpin> http_body::Body for OpenBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
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
        }
    }
}

impl<C: Drainable> Future for IdleConn<C> {
    type Output = C::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let mut this = self.project();
        loop {
            if let Poll::Ready(out) = this.conn.as_mut().poll(cx) {
                return Poll::Ready(out);
            }
            // Looked at after the connection's poll: the one that read the preface has
            // just told whether this is HTTP/2.
            if *this.closing || !this.streams.h2.load(Ordering::Acquire) {
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

impl<C: Drainable> Drainable for IdleConn<C> {
    fn graceful_shutdown(self: Pin<&mut Self>) {
        let this = self.project();
        if !*this.closing {
            *this.closing = true;
            this.conn.graceful_shutdown();
        }
    }
}
