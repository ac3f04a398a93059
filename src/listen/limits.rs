//! Connection admission: how many connections a listener takes, in total and per client,
//! and how many file descriptors one client may hold through them (its connections and the
//! upstream connections their requests hold), so that one client cannot take every socket.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::config::ServerConfig;
use super::conn::Streams;
pub use super::share::Held;
use super::share::{PER_CONNECTION, Unlist};
use crate::rt::fds::Pool;

/// Connection admission: a total bound and a per-client-IP bound, so one client cannot
/// take every socket.
///
/// Out of slots, a listener makes room as nginx does with its "reusable" connections: it
/// closes a connection that has nothing in hand (an HTTP/2 one with no open stream, else
/// an HTTP/1 one with no request in its handler) and gives its slot to the new one. Idle
/// connections are cheap to reopen and are what a client can hold the most of for the
/// least; busy ones are bounded by the request timeouts. The per-client bounds are not
/// made room for: a client past them is refused, which costs only that client.
///
/// A client's share of descriptors: each of its connections counts two (itself, and the
/// upstream connection its request may hold: one at a time over HTTP/1), each open HTTP/2
/// stream one more (the upstream connection it may hold until its answer's body is done),
/// each exchange that goes on after its client has gone one more (see
/// [`Held::one_more`]). A client holds at most `server.max_descriptors_per_ip` (no bound
/// by default) and never more than the process's budget has left free
/// ([`Pool::free`]): one address alone takes at most half the budget, and n
/// addresses leave at least 1/(n+1) of it to everyone else. A connection past it is closed
/// at accept; a stream past it is answered a refusal (see
/// [`Flaw::OverShare`](super::Flaw::OverShare)) and nothing is forwarded.
pub struct ConnLimits {
    total: Arc<Semaphore>,
    per_ip: Mutex<HashMap<IpAddr, PerClient>>,
    max_per_ip: usize,
    /// Descriptors one client may hold through this listener.
    share: usize,
    /// The budget of descriptors the listener's connections draw on.
    pool: Pool,
    /// The admitted connections' states (by slot; free slots listed), made at admission
    /// so that one on its way to a worker can already make room.
    conns: Mutex<Listed>,
    /// For the connections' [`Streams`].
    send_timeout: Option<Duration>,
}

/// The admitted connections' states, by slot, and the free slots.
#[derive(Default)]
struct Listed {
    list: Vec<Option<Arc<Streams>>>,
    free: Vec<usize>,
}

/// How long a new connection waits, at accept, for the slot of one asked to make room
/// (which closes at its next poll).
const RECLAIM_WAIT: Duration = Duration::from_millis(500);

/// Why [`ConnLimits::admit`] refused.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Full {
    Total,
    PerClient,
    /// The client holds its share of descriptors.
    Share,
    /// The listener's budget of descriptors is spent ([`crate::rt::fds`]).
    Descriptors,
}

/// One client's connections, and the descriptors they hold (shared with its connections,
/// whose streams count on it without taking the map's lock).
struct PerClient {
    conns: usize,
    held: Arc<Held>,
}

/// Held by a connection's task; gives its slots back when the connection ends.
pub(crate) struct ConnSlot {
    _permit: OwnedSemaphorePermit,
    /// The connection's descriptor, counted against its listener's budget.
    _fd: crate::rt::fds::Fd,
    limits: Arc<ConnLimits>,
    ip: IpAddr,
    /// The client's count of descriptors, on which this connection holds
    /// [`PER_CONNECTION`].
    held: Arc<Held>,
    /// The connection's state, and where it is listed in `limits.conns`.
    streams: Arc<Streams>,
    listed: usize,
}

impl ConnSlot {
    /// The connection's state, which it keeps up to date.
    pub(crate) fn streams(&self) -> &Arc<Streams> {
        &self.streams
    }

    /// The client's count of descriptors, for its HTTP/2 streams and the exchanges that go
    /// on without it.
    pub(crate) fn held(&self) -> &Arc<Held> {
        &self.held
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        {
            let mut conns = self.limits.conns.lock().unwrap_or_else(|p| p.into_inner());
            conns.list[self.listed] = None;
            conns.free.push(self.listed);
        }
        {
            let mut map = self.limits.per_ip.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(client) = map.get_mut(&self.ip) {
                client.conns -= 1;
            }
        }
        self.held.give_back(PER_CONNECTION);
    }
}

impl ConnLimits {
    /// `[server]`'s bounds: `max_connections`, `max_connections_per_ip`,
    /// `max_descriptors_per_ip` and `send_timeout`.
    /// `pool`: the budget of descriptors its connections draw on.
    pub fn for_server(server: &ServerConfig, pool: Pool) -> Arc<ConnLimits> {
        let share = server.max_descriptors_per_ip.unwrap_or(usize::MAX);
        ConnLimits::in_pool(
            server.max_connections,
            server.max_connections_per_ip,
            share,
            Some(server.send_timeout),
            pool,
        )
    }

    /// `share`: descriptors one client may hold ([`PER_CONNECTION`] per connection, one
    /// per open HTTP/2 stream); `send_timeout`: the bound of the connections' HTTP/2
    /// streams (see [`Streams`]).
    pub fn new(
        total: usize,
        per_ip: usize,
        share: usize,
        send_timeout: Option<Duration>,
    ) -> Arc<ConnLimits> {
        ConnLimits::in_pool(total, per_ip, share, send_timeout, Pool::Proxy)
    }

    fn in_pool(
        total: usize,
        per_ip: usize,
        share: usize,
        send_timeout: Option<Duration>,
        pool: Pool,
    ) -> Arc<ConnLimits> {
        Arc::new(ConnLimits {
            total: Arc::new(Semaphore::new(total)),
            per_ip: Mutex::new(HashMap::new()),
            max_per_ip: per_ip,
            share: share.max(PER_CONNECTION),
            pool,
            conns: Mutex::default(),
            send_timeout,
        })
    }

    pub(crate) fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<ConnSlot, Full> {
        let permit = self
            .total
            .clone()
            .try_acquire_owned()
            .map_err(|_| Full::Total)?;
        self.admit_with(permit, ip)
    }

    fn admit_with(
        self: &Arc<Self>,
        permit: OwnedSemaphorePermit,
        ip: IpAddr,
    ) -> Result<ConnSlot, Full> {
        let ip = client_of(ip);
        // Past the budget the connection is closed here, so that the reserve stays for the
        // listeners, the store and the log.
        let fd = self.pool.take().ok_or(Full::Descriptors)?;
        let mut map = self.per_ip.lock().unwrap_or_else(|p| p.into_inner());
        let client = map.entry(ip).or_insert_with(|| PerClient {
            conns: 0,
            held: Arc::new(Held {
                n: AtomicUsize::new(0),
                share: self.share,
                ip,
                limits: Arc::downgrade(self) as Weak<dyn Unlist>,
                pool: self.pool,
            }),
        });
        if client.conns >= self.max_per_ip {
            return Err(Full::PerClient);
        }
        // Under the map's lock no other connection of the client is admitted; its streams
        // may take (never beyond the share) or give back meanwhile.
        if client.held.take(PER_CONNECTION).is_err() {
            if client.conns == 0 && client.held.n.load(Ordering::Acquire) == 0 {
                map.remove(&ip);
            }
            return Err(Full::Share);
        }
        client.conns += 1;
        let held = client.held.clone();
        drop(map);
        let streams = Streams::new(self.send_timeout);
        let listed = {
            let mut conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
            let Listed { list, free } = &mut *conns;
            match free.pop() {
                Some(i) => {
                    list[i] = Some(streams.clone());
                    i
                }
                None => {
                    list.push(Some(streams.clone()));
                    list.len() - 1
                }
            }
        };
        Ok(ConnSlot {
            _permit: permit,
            _fd: fd,
            limits: self.clone(),
            ip,
            held,
            streams,
            listed,
        })
    }

    /// [`ConnLimits::admit`], and when every slot is taken, the slot of a connection with
    /// nothing in hand, asked to close for it (waiting at most [`RECLAIM_WAIT`]).
    pub(crate) async fn admit_or_reclaim(self: &Arc<Self>, ip: IpAddr) -> Result<ConnSlot, Full> {
        match self.admit(ip) {
            Err(Full::Total) => {}
            other => return other,
        }
        if !self.reclaim_one() {
            return Err(Full::Total);
        }
        match tokio::time::timeout(RECLAIM_WAIT, self.total.clone().acquire_owned()).await {
            Ok(Ok(permit)) => self.admit_with(permit, ip),
            _ => Err(Full::Total),
        }
    }

    /// Asks one connection with nothing in hand to close: an idle HTTP/2 one first (it
    /// closes at once), else an HTTP/1 one between requests. Answers whether there was one.
    fn reclaim_one(&self) -> bool {
        let conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        let pick = [true, false].into_iter().find_map(|h2| {
            conns
                .list
                .iter()
                .flatten()
                .find(|s| s.evictable(h2))
                .cloned()
        });
        drop(conns);
        match pick {
            Some(streams) => {
                streams.evict();
                true
            }
            None => false,
        }
    }
}

impl Unlist for ConnLimits {
    /// Unlists a client with no connection left and nothing held: its exchanges went on
    /// after its last connection closed, and the last of them has ended. (Both are looked
    /// at under the map's lock, where admission counts them, so a client admitted again
    /// meanwhile is kept.)
    fn unlist_if_idle(&self, held: &Arc<Held>) {
        let mut map = self.per_ip.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(client) = map.get(&held.ip)
            && client.conns == 0
            && Arc::ptr_eq(&client.held, held)
            && held.n.load(Ordering::Acquire) == 0
        {
            map.remove(&held.ip);
        }
    }
}

/// The client an address counts for in `max_connections_per_ip`: one IPv4 address, or one
/// IPv6 /64 (a host is handed a whole /64 and may use any address in it); an IPv4-mapped
/// IPv6 address is its IPv4 one. The idempotency records' per-client bounds count the
/// same client.
pub(crate) fn client_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6(std::net::Ipv6Addr::from(
            u128::from(v6) & !((1u128 << 64) - 1),
        )),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_client_is_an_ipv4_address_or_an_ipv6_slash_64() {
        let limits = ConnLimits::new(100, 2, usize::MAX, None);
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let a = limits.admit(ip("2001:db8:1:2::1")).expect("first");
        let b = limits.admit(ip("2001:db8:1:2:ffff::9")).expect("second");
        assert!(
            limits.admit(ip("2001:db8:1:2:1:2:3:4")).is_err(),
            "same /64"
        );
        assert!(limits.admit(ip("2001:db8:1:3::1")).is_ok(), "another /64");
        drop(a);
        assert!(limits.admit(ip("2001:db8:1:2::7")).is_ok(), "a slot freed");
        drop(b);
        let v4 = limits.admit(ip("192.0.2.7")).expect("v4");
        let _mapped = limits.admit(ip("::ffff:192.0.2.7")).expect("mapped");
        assert!(
            limits.admit(ip("192.0.2.7")).is_err(),
            "mapped counts as v4"
        );
        assert!(limits.admit(ip("192.0.2.8")).is_ok());
        drop(v4);
    }

    #[test]
    fn a_client_holds_two_per_connection_and_one_per_stream_within_its_share() {
        let limits = ConnLimits::new(100, 100, 6, None);
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let a = limits.admit(ip("192.0.2.1")).expect("first");
        let b = limits.admit(ip("192.0.2.1")).expect("second");
        // 4 of 6 held: a third connection reaches the share, a fourth is past it.
        let c = limits.admit(ip("192.0.2.1")).expect("third, at the share");
        assert_eq!(limits.admit(ip("192.0.2.1")).err(), Some(Full::Share));
        drop(c);
        let streams: Vec<_> = (0..2)
            .map(|_| a.held().one_more().expect("stream"))
            .collect();
        assert_eq!(b.held().one_more().err(), Some(6), "one client, one share");
        // Another client has its own.
        let _other = limits.admit(ip("192.0.2.2")).expect("another client");
        drop(streams);
        let s = b.held().one_more().expect("given back");
        // A connection's two come back when it closes, and a closed client starts afresh.
        drop(b);
        let _c = limits.admit(ip("192.0.2.1")).expect("room again");
        drop((s, a, _c));
        assert!(
            limits
                .per_ip
                .lock()
                .unwrap()
                .get(&ip("192.0.2.1"))
                .is_none()
        );
    }
}
