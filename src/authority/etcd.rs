//! The `etcd` backend: the same API over an etcd cluster, so several authority instances
//! can serve one cluster side by side (each is stateless).
//!
//! One etcd lease per grant. The lock key `/fencegate/locks/<scope>` is created, attached
//! to that lease, in a transaction that fails while the key exists; the token is the
//! key's create revision, which etcd makes unique and increasing across the cluster, so
//! every grant outranks every earlier one, whichever instance made it. Expiry is etcd's:
//! when the lease runs out, etcd deletes the key. `lock_delay` is a second key on a second
//! lease that outlives the first by `lock_delay`: an expiry leaves it behind for that long
//! (no clocks compared), a release deletes both.
//!
//! Tokens are `epoch:revision`. The epoch is the key `/fencegate/epoch` (absent: 0), read
//! with the scope's keys and compared unchanged in the granting transaction, so a grant
//! carries the epoch in force when it was made; `bump-epoch` raises it. A cluster restored
//! from a snapshot counts revisions from the snapshot again: after a bump, every later
//! token still outranks every earlier one.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse,
    WatchOptions,
};
use tokio::sync::watch;
use tokio::time::Instant;

use super::{AcquireRequest, AuthorityConfig, Grant, LockStatus, Outcome};
use crate::authority::metrics::AuthorityMetrics;
use crate::token::Token;

const LOCKS: &str = "/fencegate/locks/";
const DELAYS: &str = "/fencegate/delay/";
const EPOCH: &str = "/fencegate/epoch";
/// The shortest `retry_after` a busy answer gives.
const POLL: Duration = Duration::from_millis(50);
const RETRY: Duration = Duration::from_secs(1);
/// Immediate tries of a grant that lost a race after its look (see `acquire`).
const RACE_RETRIES: u32 = 3;
/// A waiting acquire watches the key that keeps its scope busy, and reads again when it
/// changes; it reads again after this long in any case (a watch that went quiet, a member
/// that lost its leader), so a wait costs at most a read a second, not leases.
const RECHECK: Duration = Duration::from_secs(1);
/// A waiting acquire tries again this soon after etcd could not answer.
const RETRY_WAITING: Duration = Duration::from_millis(250);

#[derive(Debug, thiserror::Error)]
#[error("etcd: {0}")]
pub struct EtcdError(String);

pub struct Etcd {
    members: Members,
    lock_delay: Duration,
    metrics: Arc<AuthorityMetrics>,
    /// The leases this process granted and has not seen end: etcd expires a lease
    /// without telling anyone, so an expiry is counted when this process sees the lease
    /// gone (a renew or release that finds it so, or the sweep, which asks etcd about the
    /// ones past their deadline). Bounded by [`MAX_TRACKED`].
    tracked: Mutex<HashMap<i64, Tracked>>,
}

/// A lease granted here, by this process's clock.
#[derive(Debug, Clone, Copy)]
struct Tracked {
    granted: Instant,
    deadline: Instant,
}

/// Most leases tracked for the expiry count; past it, new grants are not tracked (their
/// end is not counted) rather than memory growing.
const MAX_TRACKED: usize = 100_000;
/// Most leases the sweep asks etcd about per tick.
const SWEEP_BATCH: usize = 256;

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
    async fn connect(endpoints: &[String]) -> Result<Members, EtcdError> {
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
                    .map_err(|e| EtcdError(format!("{endpoint}: {e}")))?,
            );
        }
        if clients.is_empty() {
            return Err(EtcdError("no endpoints".into()));
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

/// What a read of a scope's keys found.
enum Look {
    Free(Epoch),
    Busy(Busy),
}

/// The epoch key as read: its value, and its mod revision for the grant to compare (0:
/// the key is absent, epoch 0).
#[derive(Debug, Clone, Copy)]
struct Epoch {
    value: u64,
    mod_revision: i64,
}

impl Epoch {
    fn of(kv: Option<&etcd_client::KeyValue>) -> Result<Epoch, String> {
        let Some(kv) = kv else {
            return Ok(Epoch {
                value: 0,
                mod_revision: 0,
            });
        };
        let value = std::str::from_utf8(kv.value())
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| format!("{EPOCH} holds {:?}, not an epoch", kv.value()))?;
        Ok(Epoch {
            value,
            mod_revision: kv.mod_revision(),
        })
    }
}

/// A scope seen busy: the key in the way (the lock key, or only the lock_delay key), the
/// revision it was seen at, and the lock's holder and lease (0: only the delay is left).
struct Busy {
    key: String,
    revision: i64,
    holder: Option<String>,
    lease: i64,
}

/// What the lock key holds besides its lease: who, the lock_delay lease (0: none), and
/// the epoch of its token (absent in keys written before epochs: 0).
#[derive(serde::Serialize, serde::Deserialize)]
struct Holding {
    #[serde(default)]
    epoch: u64,
    holder: String,
    delay_lease: i64,
    /// The lease id's secret part. etcd hands out lease ids in sequence: the id a client
    /// is given carries 128 random bits besides etcd's, and only a request with them
    /// renews or releases (SPEC §8). Kept as it is (anyone who reads the lock keys can
    /// write them too), so that the holder's status can show its whole id. Empty in keys
    /// written before: such a lease is `lost` to every renew and release.
    #[serde(default)]
    secret: String,
}

/// A lease id as clients see it: etcd's lease (hex), a `.`, and 128 random bits (hex).
fn parse_lease_id(id: &str) -> Option<(i64, &str)> {
    let (lease, secret) = id.split_once('.')?;
    let lease = i64::from_str_radix(lease, 16).ok()?;
    (secret.len() == 32 && secret.bytes().all(|b| b.is_ascii_hexdigit())).then_some((lease, secret))
}

/// Whether `secret` (from a client's lease id) is the one `holding` was granted with,
/// compared in constant time (no early exit tells how much of it matched).
fn secret_matches(holding: &Holding, secret: &str) -> bool {
    let (given, kept) = (secret.as_bytes(), holding.secret.as_bytes());
    given.len() == kept.len()
        && !kept.is_empty()
        && given
            .iter()
            .zip(kept)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

fn unavailable(e: impl std::fmt::Display) -> Outcome {
    Outcome::Unavailable {
        retry_after: RETRY,
        detail: format!("etcd: {e}"),
    }
}

/// Whole seconds, rounded up: etcd holds a lease at least as long as it was asked for.
fn seconds(d: Duration) -> i64 {
    let s = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    i64::try_from(s.max(1)).unwrap_or(i64::MAX)
}

/// Seconds of the lock_delay lease: the lock lease's own whole seconds plus the delay's, so
/// the delay key outlives the lock key by at least `lock_delay`. (Rounding up the sum
/// instead could swallow the delay: 10.6 s + 300 ms and 10.6 s both round to 11 s.)
fn delay_lease_seconds(ttl: Duration, lock_delay: Duration) -> i64 {
    seconds(ttl).saturating_add(seconds(lock_delay))
}

fn token_of(epoch: u64, revision: i64) -> Option<Token> {
    u64::try_from(revision).ok().map(|r| Token::new(epoch, r))
}

/// etcd answers a keep-alive of a revoked or expired lease with this error (ErrLeaseNotFound).
pub(crate) fn lease_not_found(e: &etcd_client::Error) -> bool {
    e.to_string().contains("lease not found")
}

fn lock_key(scope: &str) -> String {
    format!("{LOCKS}{scope}")
}

fn delay_key(scope: &str) -> String {
    format!("{DELAYS}{scope}")
}

impl Etcd {
    pub async fn connect(
        endpoints: &[String],
        config: &AuthorityConfig,
    ) -> Result<Etcd, EtcdError> {
        Ok(Etcd {
            members: Members::connect(endpoints).await?,
            lock_delay: config.lock_delay,
            metrics: Arc::default(),
            tracked: Mutex::new(HashMap::new()),
        })
    }

    /// Counts into `metrics` (the server's) instead of a private set.
    pub fn with_metrics(mut self, metrics: Arc<AuthorityMetrics>) -> Etcd {
        self.metrics = metrics;
        self
    }

    fn tracked(&self) -> MutexGuard<'_, HashMap<i64, Tracked>> {
        self.tracked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Is the etcd lease gone (expired or revoked)? `None`: etcd did not say.
    async fn lease_gone(&self, lease: i64) -> Option<bool> {
        match self
            .members
            .call(|mut c| async move { c.lease_time_to_live(lease, None).await })
            .await
        {
            Ok(r) => Some(r.ttl() <= 0),
            Err(e) if lease_not_found(&e) => Some(true),
            Err(_) => None,
        }
    }

    /// A renew or release of `lease` answered `lost`: if it is a lease granted here whose
    /// etcd lease is gone, it ended by expiry (a release would have been seen here).
    async fn lost(&self, lease: i64) {
        if !self.tracked().contains_key(&lease) {
            return;
        }
        if self.lease_gone(lease).await == Some(true) {
            self.ended_by_expiry(lease);
        }
    }

    fn ended_by_expiry(&self, lease: i64) {
        let Some(t) = self.tracked().remove(&lease) else {
            return;
        };
        let end = t.deadline.min(Instant::now());
        self.metrics
            .ended_by_expiry(end.saturating_duration_since(t.granted));
    }

    /// Every tick: reads the epoch (the gauge), and asks etcd about the tracked leases
    /// past their deadline: gone ones expired; live ones were renewed through another
    /// authority instance and get etcd's remaining time as their deadline.
    pub async fn sweep(&self) {
        let epoch = self
            .members
            .call(|mut c| async move { c.get(EPOCH, None).await })
            .await;
        if let Ok(r) = epoch
            && let Ok(e) = Epoch::of(r.kvs().first())
        {
            self.metrics.set_epoch(e.value);
        }
        let now = Instant::now();
        let due: Vec<i64> = self
            .tracked()
            .iter()
            .filter(|(_, t)| t.deadline <= now)
            .map(|(lease, _)| *lease)
            .take(SWEEP_BATCH)
            .collect();
        for lease in due {
            match self.lease_gone(lease).await {
                Some(true) => self.ended_by_expiry(lease),
                Some(false) => {
                    let left = self.remaining(lease).await.unwrap_or(RETRY);
                    if let Some(t) = self.tracked().get_mut(&lease) {
                        t.deadline = Instant::now() + left;
                    }
                }
                // etcd does not answer: the rest waits for the next tick.
                None => return,
            }
        }
    }

    /// Acquires, waiting up to `req.wait` for a busy scope (but not past `stop`). Each try
    /// reads the scope's keys first: leases are granted, and the transaction run, only
    /// when it looks free (the transaction still decides). While it is busy the wait
    /// watches the key in the way, so a release or an expiry is seen as it happens.
    pub async fn acquire(&self, req: &AcquireRequest, mut stop: watch::Receiver<bool>) -> Outcome {
        let until = Instant::now() + req.wait;
        // A grant that loses a race after its look (an epoch bump, or another grant,
        // between the two) is tried again at once a few times, even without a wait: the
        // next look tells a scope taken meanwhile from one that is still free.
        let mut raced = 0;
        loop {
            let busy = match self.look(&req.scope).await {
                Ok(Look::Free(epoch)) => match self.try_acquire(req, epoch).await {
                    // Taken between the look and the transaction: look again.
                    Outcome::Busy { .. }
                        if (Instant::now() < until || raced < RACE_RETRIES) && !*stop.borrow() =>
                    {
                        raced += 1;
                        continue;
                    }
                    outcome => return outcome,
                },
                Ok(Look::Busy(busy)) => busy,
                Err(e) => {
                    let outcome = unavailable(e);
                    let now = Instant::now();
                    if now >= until || *stop.borrow() {
                        return outcome;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep_until((now + RETRY_WAITING).min(until)) => {}
                        _ = stop.changed() => return outcome,
                    }
                    continue;
                }
            };
            let now = Instant::now();
            if now >= until || *stop.borrow() {
                return self.busy(busy).await;
            }
            tokio::select! {
                _ = self.changed(&busy, (now + RECHECK).min(until)) => {}
                _ = stop.changed() => return self.busy(busy).await,
            }
        }
    }

    /// One read of the scope's lock and lock_delay keys, and of the epoch.
    async fn look(&self, scope: &str) -> Result<Look, String> {
        let (key, delay) = (lock_key(scope), delay_key(scope));
        let read = Txn::new().and_then([
            TxnOp::get(key.as_str(), None),
            TxnOp::get(delay.as_str(), None),
            TxnOp::get(EPOCH, None),
        ]);
        let resp = self
            .members
            .call(|mut c| {
                let read = read.clone();
                async move { c.txn(read).await }
            })
            .await
            .map_err(|e| e.to_string())?;
        let revision = resp.header().map_or(0, |h| h.revision());
        let mut lock = None;
        let mut delayed = false;
        let mut epoch = Epoch::of(None)?;
        for op in resp.op_responses() {
            if let TxnOpResponse::Get(g) = op
                && let Some(kv) = g.kvs().first()
            {
                if kv.key() == EPOCH.as_bytes() {
                    epoch = Epoch::of(Some(kv))?;
                } else if kv.key() == key.as_bytes() {
                    let holder = serde_json::from_slice::<Holding>(kv.value())
                        .ok()
                        .map(|h| h.holder);
                    lock = Some((kv.lease(), holder));
                } else if kv.key() == delay.as_bytes() {
                    delayed = true;
                }
            }
        }
        Ok(match (lock, delayed) {
            (Some((lease, holder)), _) => Look::Busy(Busy {
                key,
                revision,
                holder,
                lease,
            }),
            // Only the lock_delay key is left: an expiry happened recently.
            (None, true) => Look::Busy(Busy {
                key: delay,
                revision,
                holder: None,
                lease: 0,
            }),
            (None, false) => {
                self.metrics.set_epoch(epoch.value);
                Look::Free(epoch)
            }
        })
    }

    /// The answer for a scope seen busy.
    async fn busy(&self, busy: Busy) -> Outcome {
        let retry_after = if busy.lease == 0 {
            self.lock_delay.max(POLL)
        } else {
            self.remaining(busy.lease).await.unwrap_or(RETRY).max(POLL)
        };
        Outcome::Busy {
            holder: busy.holder,
            retry_after,
        }
    }

    /// Resolves when `busy.key` changes after the read that saw it (a release, an expiry,
    /// a new holder), or at `by`, whichever comes first.
    async fn changed(&self, busy: &Busy, by: Instant) {
        let options = WatchOptions::new().with_start_revision(busy.revision.saturating_add(1));
        let watch = async {
            let mut stream = self
                .members
                .call(|mut c| {
                    let options = options.clone();
                    async move { c.watch(busy.key.as_str(), Some(options)).await }
                })
                .await?;
            while let Some(resp) = stream.message().await? {
                if !resp.events().is_empty() {
                    return Ok(true);
                }
                if resp.canceled() {
                    break;
                }
            }
            Ok::<bool, etcd_client::Error>(false)
        };
        let changed = tokio::select! {
            changed = watch => changed,
            _ = tokio::time::sleep_until(by) => return,
        };
        // A watch that fails or ends without an event is no reason to read again at once.
        if !matches!(changed, Ok(true)) {
            if let Err(e) = changed {
                tracing::debug!(key = %busy.key, error = %e, "etcd watch failed; reading again later");
            }
            tokio::time::sleep_until(by).await;
        }
    }

    /// Grants the scope if it is free and the epoch is still `epoch`.
    async fn try_acquire(&self, req: &AcquireRequest, epoch: Epoch) -> Outcome {
        let lease = match self
            .members
            .call(|mut c| async move { c.lease_grant(seconds(req.ttl), None).await })
            .await
        {
            Ok(l) => l.id(),
            Err(e) => return unavailable(e),
        };
        let delay_lease = if self.lock_delay.is_zero() {
            0
        } else {
            let seconds = delay_lease_seconds(req.ttl, self.lock_delay);
            match self
                .members
                .call(|mut c| async move { c.lease_grant(seconds, None).await })
                .await
            {
                Ok(l) => l.id(),
                Err(e) => {
                    self.revoke(&[lease]).await;
                    return unavailable(e);
                }
            }
        };
        let secret = crate::authority::lease_secret();
        let value = serde_json::json!({
            "holder": req.holder,
            "delay_lease": delay_lease,
            "epoch": epoch.value,
            "secret": secret,
        });
        let (key, delay) = (lock_key(&req.scope), delay_key(&req.scope));
        let mut puts = vec![TxnOp::put(
            key.as_str(),
            value.to_string(),
            Some(PutOptions::new().with_lease(lease)),
        )];
        if delay_lease != 0 {
            puts.push(TxnOp::put(
                delay.as_str(),
                "",
                Some(PutOptions::new().with_lease(delay_lease)),
            ));
        }
        let txn = Txn::new()
            .when([
                Compare::create_revision(key.as_str(), CompareOp::Equal, 0),
                Compare::create_revision(delay.as_str(), CompareOp::Equal, 0),
                // A bump since the look fails the grant (it is tried again): a token never
                // carries an epoch older than one already in force.
                Compare::mod_revision(EPOCH, CompareOp::Equal, epoch.mod_revision),
            ])
            .and_then(puts)
            .or_else([
                TxnOp::get(key.as_str(), None),
                TxnOp::get(delay.as_str(), None),
            ]);
        let resp = match self
            .members
            .call(|mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await
        {
            Ok(r) => r,
            Err(e) => {
                // The transaction may have applied: revoking frees the key again.
                self.revoke(&[lease, delay_lease]).await;
                return unavailable(e);
            }
        };
        if resp.succeeded() {
            // One put in one transaction: the key's create revision is the header's.
            let Some(token) = resp
                .header()
                .and_then(|h| token_of(epoch.value, h.revision()))
            else {
                self.revoke(&[lease, delay_lease]).await;
                return unavailable("transaction answer without a revision");
            };
            let granted = Instant::now();
            let mut tracked = self.tracked();
            if tracked.len() < MAX_TRACKED {
                tracked.insert(
                    lease,
                    Tracked {
                        granted,
                        deadline: granted + req.ttl,
                    },
                );
            }
            drop(tracked);
            return Outcome::Acquired(Grant {
                scope: req.scope.clone(),
                lease_id: format!("{lease:x}.{secret}"),
                token,
                ttl: req.ttl,
            });
        }
        self.revoke(&[lease, delay_lease]).await;
        let mut holder = None;
        let mut held_by = 0;
        for op in resp.op_responses() {
            if let TxnOpResponse::Get(g) = op
                && let Some(kv) = g.kvs().first()
                && kv.key() == key.as_bytes()
            {
                held_by = kv.lease();
                holder = serde_json::from_slice::<Holding>(kv.value())
                    .ok()
                    .map(|h| h.holder);
            }
        }
        let retry_after = if held_by == 0 {
            // Only the lock_delay key is left: an expiry happened recently.
            self.lock_delay.max(POLL)
        } else {
            self.remaining(held_by).await.unwrap_or(RETRY).max(POLL)
        };
        Outcome::Busy {
            holder,
            retry_after,
        }
    }

    async fn remaining(&self, lease: i64) -> Option<Duration> {
        let ttl = self
            .members
            .call(|mut c| async move { c.lease_time_to_live(lease, None).await })
            .await
            .ok()?
            .ttl();
        // "expires in under ttl + 1 seconds"
        u64::try_from(ttl)
            .ok()
            .map(|s| Duration::from_secs(s.saturating_add(1)))
    }

    async fn revoke(&self, leases: &[i64]) {
        for &id in leases.iter().filter(|id| **id != 0) {
            let revoked = self
                .members
                .call(|mut c| async move { c.lease_revoke(id).await })
                .await;
            if let Err(e) = revoked {
                tracing::debug!(lease = id, error = %e, "lease revoke failed; it expires by itself");
            }
        }
    }

    /// Keeps one lease alive once; answers its new ttl (None: expired or unknown).
    async fn keep_alive_once(&self, lease: i64) -> Result<Option<Duration>, etcd_client::Error> {
        // Keeping alive twice is keeping alive: the whole exchange may go to the next member.
        self.members
            .call(|mut c| async move {
                let (mut keeper, mut stream) = c.lease_keep_alive(lease).await?;
                keeper.keep_alive().await?;
                Ok(match stream.message().await? {
                    Some(r) if r.ttl() > 0 => u64::try_from(r.ttl()).ok().map(Duration::from_secs),
                    _ => None,
                })
            })
            .await
    }

    /// The lock key, if it belongs to exactly (lease, token): its holding.
    async fn current(
        &self,
        scope: &str,
        lease: i64,
        token: Token,
    ) -> Result<Option<Holding>, etcd_client::Error> {
        let key = lock_key(scope);
        let resp = self
            .members
            .call(|mut c| {
                let key = key.clone();
                async move { c.get(key, None).await }
            })
            .await?;
        Ok(resp.kvs().first().and_then(|kv| {
            let holding = serde_json::from_slice::<Holding>(kv.value()).ok()?;
            (kv.lease() == lease && token_of(holding.epoch, kv.create_revision()) == Some(token))
                .then_some(holding)
        }))
    }

    /// Extends the exact lease (of `holder`, when given); anything else is `lost`.
    pub async fn renew(
        &self,
        scope: &str,
        lease_id: &str,
        token: Token,
        ttl: Duration,
        holder: Option<&str>,
    ) -> Outcome {
        let Some((lease, secret)) = parse_lease_id(lease_id) else {
            return Outcome::Lost;
        };
        let outcome = self
            .renew_lease(scope, lease, secret, token, ttl, holder)
            .await;
        match &outcome {
            Outcome::Renewed { ttl } => {
                if let Some(t) = self.tracked().get_mut(&lease) {
                    t.deadline = Instant::now() + *ttl;
                }
            }
            Outcome::Lost => self.lost(lease).await,
            _ => {}
        }
        outcome
    }

    async fn renew_lease(
        &self,
        scope: &str,
        lease: i64,
        secret: &str,
        token: Token,
        ttl: Duration,
        holder: Option<&str>,
    ) -> Outcome {
        // Only the exact (lease_id, token) renews: a request naming the lease with another
        // token or scope must not keep the lease alive, so the key is looked at first.
        // The holder is part of the key's value, written once with it: (lease, token)
        // name one holding, whose holder cannot change.
        let holding = match self.current(scope, lease, token).await {
            Ok(Some(holding))
                if holder.is_none_or(|h| h == holding.holder)
                    && secret_matches(&holding, secret) =>
            {
                holding
            }
            Ok(_) => return Outcome::Lost,
            Err(e) => return unavailable(e),
        };
        // The lock_delay lease first: were the lock's lease extended and the delay's
        // keep-alive then to fail, the lock could outlive its delay, and the scope be
        // granted again with less than `lock_delay` after the holder's last renewal (or
        // stay held by a holder told it lost). Extending the delay alone only postpones
        // the next grant.
        if holding.delay_lease != 0 {
            match self.keep_alive_once(holding.delay_lease).await {
                Ok(Some(_)) => {}
                // The delay lease outlives the lock lease; losing it first means
                // something else revoked it: do not extend a lock without its delay.
                Ok(None) => return Outcome::Lost,
                Err(e) if lease_not_found(&e) => return Outcome::Lost,
                Err(e) => return unavailable(e),
            }
        }
        // Then keep the lock's lease alive, and look again: if the key is still ours after
        // a successful keep-alive, the lease was live and the key with it.
        let granted = match self.keep_alive_once(lease).await {
            Ok(Some(granted)) => granted,
            Ok(None) => return Outcome::Lost,
            Err(e) if lease_not_found(&e) => return Outcome::Lost,
            Err(e) => return unavailable(e),
        };
        match self.current(scope, lease, token).await {
            Ok(Some(_)) => Outcome::Renewed {
                ttl: ttl.min(granted),
            },
            Ok(None) => Outcome::Lost,
            Err(e) => unavailable(e),
        }
    }

    /// Ends the exact lease (of `holder`, when given); anything else is `lost`.
    pub async fn release(
        &self,
        scope: &str,
        lease_id: &str,
        token: Token,
        holder: Option<&str>,
    ) -> Outcome {
        let Some((lease, secret)) = parse_lease_id(lease_id) else {
            return Outcome::Lost;
        };
        let outcome = self
            .release_lease(scope, lease, secret, token, holder)
            .await;
        match &outcome {
            Outcome::Released => {
                let t = self.tracked().remove(&lease);
                if let Some(t) = t {
                    self.metrics.ended_by_release(t.granted.elapsed());
                }
            }
            Outcome::Lost => self.lost(lease).await,
            _ => {}
        }
        outcome
    }

    async fn release_lease(
        &self,
        scope: &str,
        lease: i64,
        secret: &str,
        token: Token,
        holder: Option<&str>,
    ) -> Outcome {
        let Ok(revision) = i64::try_from(token.counter) else {
            return Outcome::Lost;
        };
        let holding = match self.current(scope, lease, token).await {
            Ok(Some(h))
                if holder.is_none_or(|name| name == h.holder) && secret_matches(&h, secret) =>
            {
                h
            }
            Ok(_) => return Outcome::Lost,
            Err(e) => return unavailable(e),
        };
        let key = lock_key(scope);
        let txn = Txn::new()
            .when([
                Compare::create_revision(key.as_str(), CompareOp::Equal, revision),
                Compare::lease(key.as_str(), CompareOp::Equal, lease),
            ])
            .and_then([
                TxnOp::delete(key.as_str(), None),
                TxnOp::delete(delay_key(scope), None),
            ]);
        let deleted = self
            .members
            .call(|mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await;
        match deleted {
            Ok(r) if r.succeeded() => {
                self.revoke(&[lease, holding.delay_lease]).await;
                Outcome::Released
            }
            Ok(_) => Outcome::Lost,
            Err(e) => unavailable(e),
        }
    }

    pub async fn status(&self, scope: &str) -> Result<LockStatus, String> {
        let key = lock_key(scope);
        let resp = self
            .members
            .call(|mut c| {
                let key = key.clone();
                async move { c.get(key, Some(GetOptions::new())).await }
            })
            .await
            .map_err(|e| e.to_string())?;
        let Some(kv) = resp.kvs().first() else {
            return Ok(LockStatus {
                scope: scope.to_string(),
                holder: None,
                lease_id: None,
                token: None,
                remaining: None,
                // The cluster keeps no per-scope history once the key is gone; every
                // later grant outranks every earlier one anyway (cluster revisions).
                last_issued: None,
            });
        };
        let holding = serde_json::from_slice::<Holding>(kv.value()).ok();
        let token = holding
            .as_ref()
            .and_then(|h| token_of(h.epoch, kv.create_revision()));
        let lease_id = holding
            .as_ref()
            .map(|h| format!("{:x}.{}", kv.lease(), h.secret));
        Ok(LockStatus {
            scope: scope.to_string(),
            holder: holding.map(|h| h.holder),
            lease_id,
            token,
            remaining: self.remaining(kv.lease()).await,
            last_issued: token,
        })
    }
}

/// `fencegate authority bump-epoch` for the etcd backend: raises the epoch key to the
/// larger of its value + 1 and the time in ms since 1970 (as the `local` backend does: a
/// restored snapshot does not remember later bumps, the clock does), and answers it.
/// Authorities may keep running: each grant reads the epoch.
pub async fn bump_epoch(endpoints: &[String]) -> Result<u64, EtcdError> {
    let members = Members::connect(endpoints).await?;
    // Another bump at the same moment: read again and go above it.
    for _ in 0..10 {
        let resp = members
            .call(|mut c| async move { c.get(EPOCH, None).await })
            .await
            .map_err(|e| EtcdError(e.to_string()))?;
        let stored = Epoch::of(resp.kvs().first()).map_err(EtcdError)?;
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let next = stored
            .value
            .checked_add(1)
            .ok_or_else(|| EtcdError("the epoch is exhausted".into()))?
            .max(now_ms);
        let txn = Txn::new()
            .when([Compare::mod_revision(
                EPOCH,
                CompareOp::Equal,
                stored.mod_revision,
            )])
            .and_then([TxnOp::put(EPOCH, next.to_string(), None)]);
        let resp = members
            .call(|mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await
            .map_err(|e| EtcdError(e.to_string()))?;
        if resp.succeeded() {
            return Ok(next);
        }
    }
    Err(EtcdError(
        "the epoch kept changing under the bump; try again".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_delay_lease_outlives_the_lock_lease_by_the_whole_delay() {
        let ms = Duration::from_millis;
        // 10.6 s rounds up to 11 s; the 300 ms delay must still add a (whole) second.
        assert_eq!(seconds(ms(10_600)), 11);
        assert_eq!(delay_lease_seconds(ms(10_600), ms(300)), 12);
        assert_eq!(delay_lease_seconds(ms(10_000), ms(2_000)), 12);
        for (ttl, delay) in [
            (100, 1),
            (999, 1),
            (1_000, 999),
            (59_999, 1),
            (1_500, 1_500),
        ] {
            let (ttl, delay) = (ms(ttl), ms(delay));
            let gap = delay_lease_seconds(ttl, delay) - seconds(ttl);
            assert!(
                Duration::from_secs(u64::try_from(gap).unwrap()) >= delay,
                "{ttl:?} + {delay:?}"
            );
        }
    }
}
