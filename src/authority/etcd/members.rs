//! One etcd client per member, used one at a time, moving on from a member that cannot
//! be reached or has no leader. The authority's etcd backend and the cluster's ownership,
//! registry and marks talk to etcd through it.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

use super::EtcdError;

/// One client per member, used one at a time. A client balanced over every member keeps
/// sending requests to a member that is gone (a refused connection leaves it with the
/// least load, so it is picked first): after one member of three died, most requests
/// failed. Here requests go to one member until it cannot be reached, has no leader or
/// lets a request time out; then to the next, and a request that never reached a member is
/// tried on the next at once. The cluster's ownership (`crate::cluster::ownership`) talks
/// to etcd the same way.
pub(crate) struct Members {
    clients: Vec<Client>,
    current: AtomicUsize,
}

/// gRPC's status codes that tell a member should be left for the next.
const CANCELLED: i32 = 1;
const DEADLINE_EXCEEDED: i32 = 4;
const UNAVAILABLE: i32 = 14;

/// The member could not be reached, answered for a cluster it has lost (no leader), or did
/// not answer in time (a stopped or cut-off member whose connection stays up; tonic reports
/// its own request timeout as CANCELLED "Timeout expired"): the next member should be
/// asked from now on.
fn member_unusable(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::TransportError(_) => true,
        etcd_client::Error::GRpcStatus(s) => match s.code() as i32 {
            UNAVAILABLE | DEADLINE_EXCEEDED => true,
            CANCELLED => s.message().to_ascii_lowercase().contains("timeout expired"),
            _ => false,
        },
        _ => false,
    }
}

/// The request never reached the member (no connection): trying it on another member
/// cannot apply it twice.
fn never_sent(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::TransportError(_) => true,
        etcd_client::Error::GRpcStatus(s) => {
            // What tonic says when it could not connect (not "connection reset" and the
            // like, which may come after the request went out).
            let m = s.message().to_ascii_lowercase();
            s.code() as i32 == UNAVAILABLE
                && [
                    "tcp connect error",
                    "error trying to connect",
                    "connection refused",
                ]
                .iter()
                .any(|p| m.contains(p))
        }
        _ => false,
    }
}

impl Members {
    pub(super) async fn connect(endpoints: &[String]) -> Result<Members, EtcdError> {
        Members::connect_with_timeout(endpoints, Duration::from_secs(5)).await
    }

    /// Like `connect`, with `timeout` for each request (a member that lets one time out is
    /// left for the next).
    pub(crate) async fn connect_with_timeout(
        endpoints: &[String],
        timeout: Duration,
    ) -> Result<Members, EtcdError> {
        let options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(timeout)
            // A connection to a member that stopped answering fails instead of hanging on.
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
            .with_keep_alive_while_idle(true)
            // A member cut off from the leader refuses instead of answering stale data.
            .with_require_leader(true);
        let mut clients = Vec::with_capacity(endpoints.len());
        for endpoint in endpoints {
            clients.push(
                Client::connect([endpoint.as_str()], Some(options.clone()))
                    .await
                    .map_err(|source| EtcdError::Connect {
                        endpoint: endpoint.clone(),
                        source,
                    })?,
            );
        }
        if clients.is_empty() {
            return Err(EtcdError::NoEndpoints);
        }
        Ok(Members {
            clients,
            current: AtomicUsize::new(0),
        })
    }

    /// Leaves the current member for the next (a caller's own deadline passed on it).
    pub(crate) fn skip(&self) {
        let i = self.current.load(Ordering::Acquire);
        let n = self.clients.len();
        let _ =
            self.current
                .compare_exchange(i, (i % n + 1) % n, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Runs `op` on the current member; moves on from a member that is unusable, and tries
    /// a request that never reached one on the next (each member once at most).
    pub(crate) async fn call<T, F, Fut>(&self, op: F) -> Result<T, etcd_client::Error>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let n = self.clients.len();
        let mut tries = 0;
        loop {
            let i = self.current.load(Ordering::Acquire) % n;
            let result = op(self.clients[i].clone()).await;
            let Err(e) = &result else {
                return result;
            };
            if member_unusable(e) {
                // Unless another request moved on already.
                let _ = self.current.compare_exchange(
                    i,
                    (i + 1) % n,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
            tries += 1;
            if tries >= n || !never_sent(e) {
                return result;
            }
        }
    }
}
