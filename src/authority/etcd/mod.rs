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
//!
//! `acquire` holds the look, the grant and the wait; `lease` the renew and the release;
//! `members` the client per member that every call goes through.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp};
use tokio::time::Instant;

use super::{AuthorityConfig, LockStatus, Outcome};
use crate::authority::metrics::AuthorityMetrics;
use crate::token::Token;

mod acquire;
mod lease;
mod members;

pub(crate) use members::Members;

const LOCKS: &str = "/fencegate/locks/";
const DELAYS: &str = "/fencegate/delay/";
const EPOCH: &str = "/fencegate/epoch";
/// The shortest `retry_after` a busy answer gives.
const POLL: Duration = Duration::from_millis(50);
const RETRY: Duration = Duration::from_secs(1);

/// Why the etcd backend could not connect, or `bump-epoch` could not raise the epoch.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EtcdError {
    #[error("etcd: {endpoint}: {source}")]
    Connect {
        endpoint: String,
        #[source]
        source: etcd_client::Error,
    },
    #[error("etcd: no endpoints")]
    NoEndpoints,
    #[error("etcd: {0}")]
    Call(#[source] etcd_client::Error),
    #[error("etcd: {0}")]
    Epoch(#[from] BadEpoch),
    #[error("etcd: the epoch is exhausted")]
    EpochExhausted,
    #[error("etcd: the epoch kept changing under the bump; try again")]
    EpochRaced,
}

/// The epoch key holds what is not an epoch (its bytes).
#[derive(Debug, thiserror::Error)]
#[error("{} holds {:?}, not an epoch", EPOCH, .0)]
pub struct BadEpoch(Vec<u8>);

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

/// The epoch key as read: its value, and its mod revision for the grant to compare (0:
/// the key is absent, epoch 0).
#[derive(Debug, Clone, Copy)]
struct Epoch {
    value: u64,
    mod_revision: i64,
}

impl Epoch {
    fn of(kv: Option<&etcd_client::KeyValue>) -> Result<Epoch, BadEpoch> {
        let Some(kv) = kv else {
            return Ok(Epoch {
                value: 0,
                mod_revision: 0,
            });
        };
        let value = std::str::from_utf8(kv.value())
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| BadEpoch(kv.value().to_vec()))?;
        Ok(Epoch {
            value,
            mod_revision: kv.mod_revision(),
        })
    }
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

    pub async fn status(&self, scope: &str) -> Result<LockStatus, etcd_client::Error> {
        let key = lock_key(scope);
        let resp = self
            .members
            .call(|mut c| {
                let key = key.clone();
                async move { c.get(key, Some(GetOptions::new())).await }
            })
            .await?;
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
            .map_err(EtcdError::Call)?;
        let stored = Epoch::of(resp.kvs().first())?;
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let next = stored
            .value
            .checked_add(1)
            .ok_or(EtcdError::EpochExhausted)?
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
            .map_err(EtcdError::Call)?;
        if resp.succeeded() {
            return Ok(next);
        }
    }
    Err(EtcdError::EpochRaced)
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
