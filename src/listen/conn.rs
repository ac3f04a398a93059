//! One connection's state, shared by the code that watches it: whether it speaks HTTP/2
//! (told by [`super::first_bytes`]), its open requests (counted by the service; watched by
//! [`super::h2_idle`] for the idle and send bounds and by the listener's limits for
//! eviction), and the flaws [`super::h1_scan`] found in its HTTP/1 request heads.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Waker;
use std::time::{Duration, Instant};

use super::share::Unit;

/// Why the listener refuses a request before its handler: a flaw of the head that hyper
/// hides from the service, or a client past its share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flaw {
    /// The target has a `#fragment`, which a client must not send.
    Fragment,
    /// Both `Content-Length` and `Transfer-Encoding`.
    LengthAndEncoding,
    /// The scan lost track of the connection's framing before this head (a length or a
    /// chunk it does not read as hyper does): what the head holds is unchecked, so the
    /// request is refused and the connection closed rather than trusted.
    Unfollowed,
    /// Not a flaw of the head: an HTTP/2 stream opened while its client holds its share
    /// of descriptors (see [`super::limits`]); refused, nothing forwarded.
    OverShare { held: usize },
}

/// The framing the scan read for the body after a head, noted for the fuzz targets
/// (`crate::fuzzing`).
#[cfg(feature = "fuzzing")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanFraming {
    /// No body.
    None,
    /// This many bytes.
    Length(u64),
    Chunked,
    /// Not followed: the next head is refused unchecked.
    Lost,
}

/// One connection's open requests, and whether it speaks HTTP/2.
#[derive(Default)]
pub struct Streams {
    pub(super) open: AtomicUsize,
    pub(super) h2: AtomicBool,
    /// The connection's task, woken when the last open request ends.
    pub(super) waker: Mutex<Option<Waker>>,
    /// How long a response body may wait for hyper to take more (`None`: no limit).
    pub(super) send_timeout: Option<Duration>,
    /// Response bodies waiting for hyper to ask for more (a frame handed over, or none asked
    /// for yet): body id, and since when. At most one entry per open stream.
    pub(super) waiting: Mutex<Vec<(u64, Instant)>>,
    pub(super) next_id: AtomicU64,
    /// Asked to close to make room (see [`Streams::evict`]).
    pub(super) evict: AtomicBool,
    /// HTTP/1 request heads with a flaw hyper hides (see [`crate::listen::h1_scan`]), by number,
    /// and whether there are any; the number of the next HTTP/1 request served.
    pub(super) flaws: Mutex<Vec<(u64, Flaw)>>,
    pub(super) flawed: AtomicBool,
    pub(super) served: AtomicU64,
    /// An HTTP/1 request head has begun to arrive and is not whole yet (its connection is
    /// not idle).
    pub(super) head: AtomicBool,
    /// Every request head the scan parsed, by number, with the framing it read for the
    /// body after it: what the fuzz targets hold against hyper's reading.
    #[cfg(feature = "fuzzing")]
    pub(crate) seen: Mutex<Vec<(u64, Vec<u8>, ScanFraming)>>,
}

impl Streams {
    pub fn new(send_timeout: Option<Duration>) -> Arc<Streams> {
        Arc::new(Streams {
            send_timeout,
            ..Streams::default()
        })
    }

    pub(super) fn waiting(&self) -> std::sync::MutexGuard<'_, Vec<(u64, Instant)>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Body `id` waits for hyper from now, if it did not already. Answers whether it is the
    /// only waiter: then the caller wakes the connection's task, which arms the deadline
    /// for it (bodies are polled in their streams' tasks, not the connection's).
    pub(super) fn note(waiting: &mut Vec<(u64, Instant)>, id: u64) -> bool {
        if waiting.iter().any(|&(i, _)| i == id) {
            return false;
        }
        waiting.push((id, Instant::now()));
        waiting.len() == 1
    }

    /// Wakes the connection's task.
    pub(super) fn wake_connection(&self) {
        let waker = self.waker.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Since when the longest-waiting response body has waited for hyper to take more.
    pub(super) fn oldest_waiting(&self) -> Option<Instant> {
        self.waiting().iter().map(|&(_, since)| since).min()
    }

    /// The connection began with the HTTP/2 preface.
    pub fn set_h2(&self) {
        self.h2.store(true, Ordering::Release);
    }

    /// Counts a request open until the answer is dropped, and with it what it holds of
    /// its client's share of descriptors, if anything.
    pub(crate) fn open(self: &Arc<Self>, held: Option<Unit>) -> StreamOpen {
        self.open.fetch_add(1, Ordering::AcqRel);
        StreamOpen(self.clone(), held)
    }

    /// Counts an HTTP/1 request while its handler runs (its answer's body is not followed:
    /// a connection asked to close after that finishes sending it, then closes). Ending,
    /// it wakes nobody: only an eviction looks at the count.
    pub fn in_handler(self: &Arc<Self>) -> InHandler {
        self.open.fetch_add(1, Ordering::AcqRel);
        InHandler(self.clone())
    }

    /// Whether the connection has nothing in hand (no open stream or request, no request
    /// head begun) and is not already asked to close;
    /// `h2` whether it must speak HTTP/2 (an idle HTTP/2 connection closes at once, an
    /// HTTP/1 one may still be sending an answer's body).
    pub(crate) fn evictable(&self, h2: bool) -> bool {
        self.h2.load(Ordering::Acquire) == h2
            && self.open.load(Ordering::Acquire) == 0
            && !self.head.load(Ordering::Acquire)
            && !self.evict.load(Ordering::Acquire)
    }

    /// An HTTP/1 request head has begun to arrive (`true`), or is whole or given up.
    pub(crate) fn head_begun(&self, begun: bool) {
        self.head.store(begun, Ordering::Release);
    }

    /// Asks the connection to close now, to make room for another: an HTTP/2 one with no
    /// open stream sends GOAWAY and is dropped; an HTTP/1 one closes once the answer it
    /// may be sending is done (at once, waiting for its next request).
    pub(crate) fn evict(&self) {
        self.evict.store(true, Ordering::Release);
        self.wake_connection();
    }
}

impl Streams {
    /// Notes that HTTP/1 request head number `n` has `flaw`.
    pub(crate) fn flaw(&self, n: u64, flaw: Flaw) {
        self.flaws
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((n, flaw));
        self.flawed.store(true, Ordering::Release);
    }

    /// The flaw of HTTP/1 request head number `n`, if it has one (taken).
    pub(crate) fn take_flaw(&self, n: u64) -> Option<Flaw> {
        if !self.flawed.load(Ordering::Acquire) {
            return None;
        }
        let mut flaws = self.flaws.lock().unwrap_or_else(|p| p.into_inner());
        let at = flaws.iter().position(|&(i, _)| i == n)?;
        Some(flaws.swap_remove(at).1)
    }

    /// The flaw of the next HTTP/1 request to be served, if its head has one. Called once
    /// per request, in order (HTTP/1 requests are served one at a time).
    pub(crate) fn next_request_flaw(&self) -> Option<Flaw> {
        let n = self.served.fetch_add(1, Ordering::Relaxed);
        self.take_flaw(n)
    }
}

/// An HTTP/1 request in its handler (see [`Streams::in_handler`]).
pub struct InHandler(Arc<Streams>);

impl Drop for InHandler {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An open request of an HTTP/2 connection (see [`Streams::open`]).
pub struct StreamOpen(
    pub(super) Arc<Streams>,
    /// Given back to the client's share when the answer is dropped.
    #[allow(dead_code)]
    Option<Unit>,
);

impl Drop for StreamOpen {
    fn drop(&mut self) {
        if self.0.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.wake_connection();
        }
    }
}
