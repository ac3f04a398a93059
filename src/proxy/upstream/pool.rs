//! One worker's idle connections to plain-HTTP upstreams, by authority: the pool that
//! both kinds of upstream connection wait in between exchanges — hyper's client
//! connections for requests whose body streams ([`super::streamed`]) and the lean
//! exchange's own ([`super::h1`]).
//!
//! The pool asks of a connection only what [`Connection`] says: whether it is still open
//! (taken out) and whether its last exchange left it fit for another (put back). Its
//! clock is the sweep count, not the time of day: each worker sweeps every
//! [`SWEEP_EVERY`], and a connection is closed by the first sweep after it has idled
//! `idle_timeout` (so `idle_timeout` to `idle_timeout` plus one sweep period after its
//! last use); one idled through that many sweeps is not taken out either. No clock is
//! read per request.
//!
//! Safety of reuse: a connection is pooled again only after its response body has ended
//! cleanly at a known boundary; one closed by the upstream while idle is noticed when it
//! is next taken out (or, for hyper's, when it is next driven), and a request that never
//! left is tried on another connection, so a stale pooled connection never turns into an
//! error or a duplicate write.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::uri::Authority;

/// How often idle connections are looked over.
pub const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// How many pooled connections a request that found them closed may try before a new
/// one (the last try always uses a new connection).
pub(crate) const MAX_STALE_RETRIES: usize = 3;

/// What the pool needs of a connection.
pub trait Connection {
    /// Whether a connection that waited in the pool can still carry a request (the
    /// upstream has not closed it while it was idle, as far as can be told without
    /// waiting).
    fn is_open(&self) -> bool;

    /// Whether a connection given back may wait in the pool: its last exchange is over
    /// both ways, with nothing read past the response's end.
    fn is_reusable(&self) -> bool;
}

/// A connection waiting in the pool.
struct Idle<C> {
    /// Boxed: connections move between the pool and response bodies by pointer.
    conn: Box<C>,
    /// The sweep count when it was put back.
    since: u64,
}

/// Idle connections of one kind `C`, by upstream authority.
pub struct Pool<C> {
    /// By upstream authority (a handful: a list beats hashing).
    idle: Mutex<Vec<(Authority, Vec<Idle<C>>)>>,
    max_idle_per_host: usize,
    /// Sweeps a connection may stay idle through (`idle_timeout` in sweep periods,
    /// rounded up).
    idle_sweeps: u64,
    /// Sweeps so far: the pool's clock.
    sweeps: AtomicU64,
    connect_timeout: Duration,
}

impl<C: Connection> Pool<C> {
    /// A pool that keeps at most `max_idle_per_host` idle connections per authority, for
    /// about `idle_timeout` each; new connections are given `connect_timeout`.
    pub fn new(
        max_idle_per_host: usize,
        idle_timeout: Duration,
        connect_timeout: Duration,
    ) -> Arc<Pool<C>> {
        let period = SWEEP_EVERY.as_millis().max(1);
        let idle_sweeps =
            u64::try_from(idle_timeout.as_millis().div_ceil(period)).unwrap_or(u64::MAX);
        Arc::new(Pool {
            idle: Mutex::new(Vec::new()),
            max_idle_per_host,
            idle_sweeps,
            sweeps: AtomicU64::new(0),
            connect_timeout,
        })
    }

    /// How long a new connection may take.
    pub(crate) fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The most recently used idle connection to `authority` that is still open, if any;
    /// the closed ones, and any past their idle time, are dropped on the way.
    pub(crate) fn take(&self, authority: &Authority) -> Option<Box<C>> {
        let now = self.sweeps.load(Ordering::Relaxed);
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let list = idle
            .iter_mut()
            .find(|(a, _)| a.as_str() == authority.as_str())
            .map(|(_, list)| list)?;
        while let Some(c) = list.pop() {
            if now - c.since <= self.idle_sweeps && c.conn.is_open() {
                return Some(c.conn);
            }
        }
        None
    }

    /// Gives a connection back after an exchange: it waits for the next one, unless its
    /// exchange left it unfit ([`Connection::is_reusable`]) or the authority has as many
    /// idle connections as it may.
    pub(crate) fn put(&self, authority: &Authority, conn: Box<C>) {
        // With descriptors scarce, an idle connection would hold one that a client (or a
        // busy exchange) needs more.
        if !conn.is_reusable() || crate::rt::fds::scarce() {
            return;
        }
        let since = self.sweeps.load(Ordering::Relaxed);
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let list = match idle
            .iter()
            .position(|(a, _)| a.as_str() == authority.as_str())
        {
            Some(i) => &mut idle[i].1,
            None => {
                idle.push((authority.clone(), Vec::new()));
                let last = idle.len() - 1;
                &mut idle[last].1
            }
        };
        if list.len() < self.max_idle_per_host {
            list.push(Idle { conn, since });
        }
    }

    /// One sweep (each proxy worker runs one every [`SWEEP_EVERY`]): closes the
    /// connections that have idled through `idle_timeout`'s worth of sweeps (their
    /// upstream has likely closed its end), so idle sockets do not linger in CLOSE_WAIT.
    pub fn sweep(&self) {
        let now = self.sweeps.fetch_add(1, Ordering::Relaxed) + 1;
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let keep = self.idle_sweeps;
        idle.retain_mut(|(_, list)| {
            list.retain(|c| now - c.since <= keep);
            !list.is_empty()
        });
    }

    /// Connections waiting in the pool.
    pub fn idle(&self) -> usize {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        idle.iter().map(|(_, list)| list.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;

    /// A connection whose state the test sets: open, and fit for reuse.
    struct Fake {
        id: u32,
        open: Arc<AtomicBool>,
        reusable: bool,
    }

    impl Connection for Fake {
        fn is_open(&self) -> bool {
            self.open.load(Ordering::Relaxed)
        }

        fn is_reusable(&self) -> bool {
            self.reusable
        }
    }

    fn fake(id: u32) -> Box<Fake> {
        Box::new(Fake {
            id,
            open: Arc::new(AtomicBool::new(true)),
            reusable: true,
        })
    }

    fn authority(s: &str) -> Authority {
        s.parse().unwrap()
    }

    #[test]
    fn connections_are_taken_last_in_first_out_by_authority_up_to_the_limit() {
        let pool = Pool::<Fake>::new(2, Duration::from_secs(60), Duration::from_secs(5));
        let (a, b) = (authority("a:80"), authority("b:80"));
        for id in 1..=3 {
            pool.put(&a, fake(id));
        }
        pool.put(&b, fake(9));
        assert_eq!(
            pool.idle(),
            3,
            "two for a (the third over the limit), one for b"
        );
        assert_eq!(pool.take(&a).map(|c| c.id), Some(2));
        assert_eq!(pool.take(&a).map(|c| c.id), Some(1));
        assert!(pool.take(&a).is_none());
        assert!(pool.take(&authority("c:80")).is_none());
        assert_eq!(pool.take(&b).map(|c| c.id), Some(9));
        assert_eq!(pool.idle(), 0);
    }

    #[test]
    fn closed_and_unfit_connections_are_not_reused() {
        let pool = Pool::<Fake>::new(8, Duration::from_secs(60), Duration::from_secs(5));
        let a = authority("a:80");
        let mut unfit = fake(1);
        unfit.reusable = false;
        pool.put(&a, unfit);
        assert_eq!(pool.idle(), 0, "an unfit connection is not kept");
        pool.put(&a, fake(2));
        let closed = fake(3);
        let open = closed.open.clone();
        pool.put(&a, closed);
        open.store(false, Ordering::Relaxed);
        assert_eq!(
            pool.take(&a).map(|c| c.id),
            Some(2),
            "the closed one is passed over and dropped"
        );
        assert_eq!(pool.idle(), 0);
    }

    /// The idle clock is the sweep count: 25 s at one sweep per 10 s is three sweeps; the
    /// fourth after a connection's return closes it, and a take after that many finds it
    /// gone as a sweep would.
    #[test]
    fn connections_idle_through_the_timeouts_worth_of_sweeps() {
        let pool = Pool::<Fake>::new(8, Duration::from_secs(25), Duration::from_secs(5));
        let a = authority("a:80");
        pool.put(&a, fake(1));
        pool.sweep();
        pool.put(&a, fake(2));
        pool.sweep();
        pool.sweep();
        assert_eq!(pool.idle(), 2, "not idle for long enough yet");
        pool.sweep();
        assert_eq!(
            pool.idle(),
            1,
            "the first, idle through four sweeps, is closed"
        );
        pool.sweep();
        assert_eq!(pool.idle(), 0);
        // Taken between sweeps: one past its sweeps is not handed out.
        pool.put(&a, fake(3));
        pool.sweeps.fetch_add(4, Ordering::Relaxed);
        assert!(pool.take(&a).is_none());
        pool.put(&a, fake(4));
        pool.sweeps.fetch_add(3, Ordering::Relaxed);
        assert_eq!(pool.take(&a).map(|c| c.id), Some(4));
    }
}
