//! A client's share of descriptors: what its connections, its HTTP/2 streams and the
//! exchanges that go on after it has gone hold, counted on one number per client that
//! streams and exchanges update without a lock (see [`super::limits`] for the rule).

use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use crate::rt::fds::Pool;

/// Where clients are listed: told when a client with no connection left gives back the
/// last of what it held, so that it may be unlisted.
pub(super) trait Unlist: Send + Sync {
    fn unlist_if_idle(&self, held: &Arc<Held>);
}

/// Descriptors a client holds, against its share.
#[derive(Debug)]
pub struct Held {
    pub(super) n: AtomicUsize,
    pub(super) share: usize,
    /// Where the client is listed, so that the last count given back after its last
    /// connection has closed (an exchange that went on without it) can unlist it.
    pub(super) ip: IpAddr,
    pub(super) limits: Weak<dyn Unlist>,
    /// The budget the client's connections draw on.
    pub(super) pool: Pool,
}

/// What a connection counts against its client's share: itself and the upstream
/// connection its request may hold.
pub(super) const PER_CONNECTION: usize = 2;

impl Held {
    /// One more, held until the [`Unit`] is dropped: by an HTTP/2 stream until its answer
    /// is dropped, or by an exchange that goes on after its client has gone (an idempotent
    /// request's, which records the answer for the retry) until it ends. Past the share,
    /// what the client holds: the stream is refused, the exchange must not start.
    pub fn one_more(self: &Arc<Self>) -> Result<Unit, usize> {
        self.take(1).map(|()| Unit(self.clone()))
    }

    /// Takes `k` more if the client then holds no more than its share, nor more than
    /// the budget has left free for the others; else answers what it holds.
    pub(super) fn take(&self, k: usize) -> Result<(), usize> {
        let cap = self.share.min(self.pool.free());
        self.n
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n + k <= cap).then_some(n + k)
            })
            .map(|_| ())
    }

    /// Gives `k` back; the last one of a client with no connection left unlists it.
    pub(super) fn give_back(self: &Arc<Self>, k: usize) {
        if self.n.fetch_sub(k, Ordering::AcqRel) == k
            && let Some(limits) = self.limits.upgrade()
        {
            limits.unlist_if_idle(self);
        }
    }
}

/// One descriptor a client holds beyond its connections' (an HTTP/2 stream's, or an
/// exchange's that goes on without its client), given back when dropped.
#[derive(Debug)]
pub struct Unit(Arc<Held>);

impl Drop for Unit {
    fn drop(&mut self) {
        self.0.give_back(1);
    }
}

/// Why a client past its share of descriptors is refused (see [`super::limits`]).
pub fn over_share(held: usize) -> String {
    format!(
        "this client (its address, or its IPv6 /64) holds {held} file descriptors, as many as it may (two per connection, one per open HTTP/2 stream or exchange going on without its client, and never more than are left free for other clients); nothing was forwarded. Retry once one of its requests has ended"
    )
}
