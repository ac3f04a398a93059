//! Acquiring a scope on etcd: a look at its keys, then (when it looks free) two leases
//! and one granting transaction; while it is busy, a watch on the key in the way.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse, WatchOptions};
use tokio::sync::watch;
use tokio::time::Instant;

use super::{
    BadEpoch, EPOCH, Epoch, Etcd, Holding, MAX_TRACKED, POLL, RETRY, Tracked, delay_key,
    delay_lease_seconds, lock_key, seconds, token_of, unavailable,
};
use crate::authority::{AcquireRequest, Grant, Outcome};

/// Immediate tries of a grant that lost a race after its look (see `acquire`).
const RACE_RETRIES: u32 = 3;
/// A waiting acquire watches the key that keeps its scope busy, and reads again when it
/// changes; it reads again after this long in any case (a watch that went quiet, a member
/// that lost its leader), so a wait costs at most a read a second, not leases.
const RECHECK: Duration = Duration::from_secs(1);
/// A waiting acquire tries again this soon after etcd could not answer.
const RETRY_WAITING: Duration = Duration::from_millis(250);

/// What a read of a scope's keys found.
enum Look {
    Free(Epoch),
    Busy(Busy),
}

/// Why a look at a scope's keys failed (its text follows `etcd: ` in the answer).
#[derive(Debug, thiserror::Error)]
enum LookError {
    #[error(transparent)]
    Etcd(#[from] etcd_client::Error),
    #[error(transparent)]
    Epoch(#[from] BadEpoch),
}

/// A scope seen busy: the key in the way (the lock key, or only the lock_delay key), the
/// revision it was seen at, and the lock's holder and lease (0: only the delay is left).
struct Busy {
    key: String,
    revision: i64,
    holder: Option<String>,
    lease: i64,
}

impl Etcd {
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
    async fn look(&self, scope: &str) -> Result<Look, LookError> {
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
            .await?;
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

    /// Grants the scope if it is free and the epoch is still `epoch`: two leases (the
    /// lock's, and the lock_delay's when there is one), then one transaction that writes
    /// the keys on them only while both keys are absent and the epoch unchanged.
    async fn try_acquire(&self, req: &AcquireRequest, epoch: Epoch) -> Outcome {
        let (lease, delay_lease) = match self.grant_leases(req.ttl).await {
            Ok(leases) => leases,
            Err(outcome) => return outcome,
        };
        let secret = crate::authority::lease_secret();
        let (key, delay) = (lock_key(&req.scope), delay_key(&req.scope));
        let holding = Holding {
            epoch: epoch.value,
            holder: req.holder.clone(),
            delay_lease,
            secret: secret.clone(),
        };
        let txn = grant_txn(&key, &delay, &holding, lease, epoch);
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
            self.track(lease, req.ttl);
            return Outcome::Acquired(Grant {
                scope: req.scope.clone(),
                lease_id: format!("{lease:x}.{secret}"),
                token,
                ttl: req.ttl,
            });
        }
        self.revoke(&[lease, delay_lease]).await;
        self.taken(&resp, &key).await
    }

    /// The lock's lease for `ttl`, and the lock_delay's (0: no `lock_delay`), which
    /// outlives it by the delay. A failure revokes what was granted.
    async fn grant_leases(&self, ttl: Duration) -> Result<(i64, i64), Outcome> {
        let lease = match self
            .members
            .call(|mut c| async move { c.lease_grant(seconds(ttl), None).await })
            .await
        {
            Ok(l) => l.id(),
            Err(e) => return Err(unavailable(e)),
        };
        if self.lock_delay.is_zero() {
            return Ok((lease, 0));
        }
        let seconds = delay_lease_seconds(ttl, self.lock_delay);
        match self
            .members
            .call(|mut c| async move { c.lease_grant(seconds, None).await })
            .await
        {
            Ok(l) => Ok((lease, l.id())),
            Err(e) => {
                self.revoke(&[lease]).await;
                Err(unavailable(e))
            }
        }
    }

    /// A lease granted here, tracked for the expiry count (up to [`MAX_TRACKED`]).
    fn track(&self, lease: i64, ttl: Duration) {
        let granted = Instant::now();
        let mut tracked = self.tracked();
        if tracked.len() < MAX_TRACKED {
            tracked.insert(
                lease,
                Tracked {
                    granted,
                    deadline: granted + ttl,
                },
            );
        }
    }

    /// The answer to a grant whose transaction failed: the scope was taken (or an expiry
    /// left its lock_delay key) since the look; `resp` holds what its keys are now.
    async fn taken(&self, resp: &etcd_client::TxnResponse, key: &str) -> Outcome {
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
}

/// The granting transaction: the lock key (holding `holding`, on `lease`) and the
/// lock_delay key (on `holding.delay_lease`, when there is one) are written only while
/// neither exists and the epoch key is as the look read it; else both are read back.
fn grant_txn(key: &str, delay: &str, holding: &Holding, lease: i64, epoch: Epoch) -> Txn {
    let value = serde_json::json!({
        "holder": holding.holder,
        "delay_lease": holding.delay_lease,
        "epoch": holding.epoch,
        "secret": holding.secret,
    });
    let mut puts = vec![TxnOp::put(
        key,
        value.to_string(),
        Some(PutOptions::new().with_lease(lease)),
    )];
    if holding.delay_lease != 0 {
        puts.push(TxnOp::put(
            delay,
            "",
            Some(PutOptions::new().with_lease(holding.delay_lease)),
        ));
    }
    Txn::new()
        .when([
            Compare::create_revision(key, CompareOp::Equal, 0),
            Compare::create_revision(delay, CompareOp::Equal, 0),
            // A bump since the look fails the grant (it is tried again): a token never
            // carries an epoch older than one already in force.
            Compare::mod_revision(EPOCH, CompareOp::Equal, epoch.mod_revision),
        ])
        .and_then(puts)
        .or_else([TxnOp::get(key, None), TxnOp::get(delay, None)])
}
