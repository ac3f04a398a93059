//! The `local` backend: one process grants leases; per-scope counters live in redb, in
//! the same file as the marks, and each is committed durably before its grant is answered.
//!
//! Leases live in memory and expire by the monotonic clock. A restarted authority has
//! forgotten them, so it waits out `max_ttl` (plus `lock_delay`) before granting a scope
//! that has been granted before: a lease from before the restart may still be live. After
//! `bump-epoch` (a restore) it cannot know which scopes were granted, so it waits for all.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use super::{AcquireRequest, AuthorityConfig, Grant, LockStatus, Outcome};
use crate::authority::metrics::AuthorityMetrics;
use crate::token::Token;

/// scope → (epoch, counter) of the last token issued, and the run (`boot`) that issued it.
/// Never lowered.
const COUNTERS: TableDefinition<&str, (u64, u64, u64)> = TableDefinition::new("authority_counters");
/// `epoch`: the epoch of new tokens. `boot`: counts authority start-ups. `restored`: 1 after `bump-epoch` until an authority
/// has run for `max_ttl` (every scope may have had a live lease when the copy was made).
const META: TableDefinition<&str, u64> = TableDefinition::new("authority_meta");

/// How soon a caller may retry a scope whose grant is being committed right now.
const PENDING_RETRY: Duration = Duration::from_millis(5);
/// How soon to retry after the store failed.
const STORE_RETRY: Duration = Duration::from_secs(1);

/// Why the `local` backend failed: its store (redb, or the blocking task that ran it),
/// the store file for `bump-epoch`, or a counter at its end.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LocalError {
    #[error("authority store: {0}")]
    Store(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("cannot open {path}: {source} (is the server still running? stop it first)")]
    Open {
        path: String,
        #[source]
        source: OpenError,
    },
    #[error("the token counter of scope `{0}` is exhausted")]
    Exhausted(String),
}

/// Why `bump-epoch` could not open the store file.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("no such file")]
    Missing,
    #[error(transparent)]
    Database(#[from] redb::DatabaseError),
}

fn store_err(e: impl std::error::Error + Send + Sync + 'static) -> LocalError {
    LocalError::Store(Box::new(e))
}

/// What the authority knows of one scope in memory.
#[derive(Debug, Clone)]
enum Slot {
    /// A grant is being committed; nobody else may be granted meanwhile.
    Pending {
        holder: String,
    },
    Held(Lease),
    /// Expired without release: not granted again before `until` (lock_delay).
    Delayed {
        until: Instant,
    },
}

#[derive(Debug, Clone)]
struct Lease {
    holder: String,
    lease_id: String,
    token: Token,
    /// When it was granted: its age at its end is counted.
    granted: Instant,
    deadline: Instant,
}

/// A scope's `Pending` slot while its acquisition commits; see [`Local::try_acquire`].
struct PendingSlot<'a> {
    local: &'a Local,
    scope: &'a str,
    armed: bool,
}

impl Drop for PendingSlot<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut slots = self.local.slots();
        if matches!(slots.get(self.scope), Some(Slot::Pending { .. })) {
            slots.remove(self.scope);
        }
        drop(slots);
        self.local.changed.notify_waiters();
    }
}

pub struct Local {
    db: Arc<Database>,
    lock_delay: Duration,
    /// Until then, a scope that may have a live lease from before start-up is not granted.
    recovering_until: Instant,
    /// After a restore: every scope is treated as possibly held until `recovering_until`.
    restored: bool,
    epoch: u64,
    /// This run: a counter written by an earlier run may belong to a live lease.
    boot: u64,
    slots: Mutex<HashMap<String, Slot>>,
    /// Woken on every release and every grant, so waiting acquirers look again.
    changed: Notify,
    lease_seq: AtomicU64,
    /// Expiries and lease ages are counted here, where the clock and the sweep are.
    metrics: Arc<AuthorityMetrics>,
}

impl Local {
    /// Creates the tables (if needed), reads the epoch, and starts the restart wait.
    pub async fn open(db: Arc<Database>, config: &AuthorityConfig) -> Result<Local, LocalError> {
        let started = Instant::now();
        let init_db = db.clone();
        let (epoch, boot, restored) = tokio::task::spawn_blocking(move || initialize(&init_db))
            .await
            .map_err(store_err)??;
        let wait = config.max_ttl + config.lock_delay;
        if restored {
            // Once one authority has waited out every lease of the restored copy, the
            // flag has served; clearing it spares the next restart from waiting for all.
            // Weak: this timer must not keep the store file open after shutdown.
            let db = Arc::downgrade(&db);
            tokio::spawn(async move {
                tokio::time::sleep(wait).await;
                let Some(db) = db.upgrade() else { return };
                let cleared = tokio::task::spawn_blocking(move || clear_restored(&db)).await;
                if let Ok(Err(e)) | Err(e) = cleared.map_err(store_err) {
                    tracing::warn!(error = %e, "could not clear the restored flag");
                }
            });
        }
        Ok(Local {
            db,
            lock_delay: config.lock_delay,
            recovering_until: started + wait,
            restored,
            epoch,
            boot,
            slots: Mutex::new(HashMap::new()),
            changed: Notify::new(),
            lease_seq: AtomicU64::new(0),
            metrics: Arc::default(),
        })
    }

    /// Counts into `metrics` (the server's) instead of a private set.
    pub fn with_metrics(mut self, metrics: Arc<AuthorityMetrics>) -> Local {
        metrics.set_epoch(self.epoch);
        self.metrics = metrics;
        self
    }

    /// A lease that ended by expiry, without a release: counted once, when its slot
    /// leaves `Held`.
    fn expired(&self, lease: &Lease) {
        self.metrics
            .ended_by_expiry(lease.deadline.saturating_duration_since(lease.granted));
    }

    fn slots(&self) -> MutexGuard<'_, HashMap<String, Slot>> {
        // A panic while holding the lock leaves consistent data: every update is one insert.
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// 128 random bits (SPEC §8: the lease id is the holder's only proof when the
    /// authority has no clients), and the sequence number, which keeps ids apart even
    /// should the system's randomness fail.
    fn new_lease_id(&self) -> String {
        let seq = self.lease_seq.fetch_add(1, Ordering::Relaxed);
        format!(
            "{}{:08x}",
            crate::authority::lease_secret(),
            seq & 0xffff_ffff
        )
    }

    /// Acquires, waiting up to `req.wait` for a busy scope.
    pub async fn acquire(&self, req: &AcquireRequest, mut stop: watch::Receiver<bool>) -> Outcome {
        let until = Instant::now() + req.wait;
        loop {
            // Listen before looking, so a release between the look and the wait is not missed.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let outcome = self.try_acquire(req).await;
            let retry_after = match &outcome {
                Outcome::Busy { retry_after, .. } | Outcome::Unavailable { retry_after, .. } => {
                    *retry_after
                }
                _ => return outcome,
            };
            let now = Instant::now();
            if now >= until || *stop.borrow() {
                return outcome;
            }
            let wake = (now + retry_after).min(until);
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep_until(wake) => {}
                _ = stop.changed() => return outcome,
            }
        }
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Outcome {
        let now = Instant::now();
        // Read before locking (a read transaction, no disk write): only in the restart window.
        let recovering = now < self.recovering_until
            && (self.restored
                || match self.last_issue(&req.scope) {
                    Ok(last) => last.is_some_and(|(_, boot)| boot != self.boot),
                    Err(e) => {
                        return Outcome::Unavailable {
                            retry_after: STORE_RETRY,
                            detail: e.to_string(),
                        };
                    }
                });
        {
            let mut slots = self.slots();
            if let Some(busy) = self.busy(&mut slots, &req.scope, now) {
                return busy;
            }
            if recovering {
                return Outcome::Busy {
                    holder: None,
                    retry_after: self.recovering_until - now,
                };
            }
            slots.insert(
                req.scope.clone(),
                Slot::Pending {
                    holder: req.holder.clone(),
                },
            );
        }
        // A caller that goes away during the commit (its future dropped) must not leave
        // the scope pending forever: the guard takes the slot back. The commit itself runs
        // on a blocking thread and completes anyway; the token it issues is never granted,
        // and the next grant's is higher.
        let mut pending = PendingSlot {
            local: self,
            scope: &req.scope,
            armed: true,
        };
        let db = self.db.clone();
        let scope = req.scope.clone();
        let (epoch, boot) = (self.epoch, self.boot);
        let issued = tokio::task::spawn_blocking(move || issue(&db, &scope, epoch, boot))
            .await
            .map_err(store_err)
            .and_then(|r| r);
        pending.armed = false;
        let mut slots = self.slots();
        let outcome = match issued {
            Ok(token) => {
                let granted = Instant::now();
                let lease = Lease {
                    holder: req.holder.clone(),
                    lease_id: self.new_lease_id(),
                    token,
                    // From after the commit: the authority's view of the lease ends no
                    // earlier than any view the holder can have (it measures from sending).
                    granted,
                    deadline: granted + req.ttl,
                };
                let grant = Grant {
                    scope: req.scope.clone(),
                    lease_id: lease.lease_id.clone(),
                    token,
                    ttl: req.ttl,
                };
                slots.insert(req.scope.clone(), Slot::Held(lease));
                Outcome::Acquired(grant)
            }
            Err(e) => {
                tracing::warn!(scope = %req.scope, error = %e, "lease counter commit failed");
                slots.remove(&req.scope);
                Outcome::Unavailable {
                    retry_after: STORE_RETRY,
                    detail: e.to_string(),
                }
            }
        };
        drop(slots);
        self.changed.notify_waiters();
        outcome
    }

    /// `Some(busy)` when the scope is held, pending or delayed; tidies expired slots.
    fn busy(
        &self,
        slots: &mut HashMap<String, Slot>,
        scope: &str,
        now: Instant,
    ) -> Option<Outcome> {
        let slot = slots.get(scope)?.clone();
        match slot {
            Slot::Pending { holder } => Some(Outcome::Busy {
                holder: Some(holder),
                retry_after: PENDING_RETRY,
            }),
            Slot::Held(lease) if lease.deadline > now => Some(Outcome::Busy {
                holder: Some(lease.holder),
                retry_after: lease.deadline - now,
            }),
            Slot::Held(lease) => {
                self.expired(&lease);
                let until = lease.deadline + self.lock_delay;
                if until > now {
                    slots.insert(scope.to_string(), Slot::Delayed { until });
                    Some(Outcome::Busy {
                        holder: None,
                        retry_after: until - now,
                    })
                } else {
                    slots.remove(scope);
                    None
                }
            }
            Slot::Delayed { until } if until > now => Some(Outcome::Busy {
                holder: None,
                retry_after: until - now,
            }),
            Slot::Delayed { .. } => {
                slots.remove(scope);
                None
            }
        }
    }

    /// Extends the exact live lease (of `holder`, when given); anything else is `lost` and
    /// changes nothing.
    pub fn renew(
        &self,
        scope: &str,
        lease_id: &str,
        token: Token,
        ttl: Duration,
        holder: Option<&str>,
    ) -> Outcome {
        let now = Instant::now();
        let mut slots = self.slots();
        match slots.get_mut(scope) {
            Some(Slot::Held(lease))
                if lease.lease_id == lease_id
                    && lease.token == token
                    && lease.deadline > now
                    && holder.is_none_or(|h| h == lease.holder) =>
            {
                lease.deadline = now + ttl;
                Outcome::Renewed { ttl }
            }
            _ => Outcome::Lost,
        }
    }

    /// Ends the exact live lease (of `holder`, when given) at once (no lock_delay: the
    /// holder says it is done).
    pub fn release(
        &self,
        scope: &str,
        lease_id: &str,
        token: Token,
        holder: Option<&str>,
    ) -> Outcome {
        let now = Instant::now();
        let mut slots = self.slots();
        match slots.get(scope) {
            Some(Slot::Held(lease))
                if lease.lease_id == lease_id
                    && lease.token == token
                    && lease.deadline > now
                    && holder.is_none_or(|h| h == lease.holder) =>
            {
                let age = now.saturating_duration_since(lease.granted);
                slots.remove(scope);
                drop(slots);
                self.metrics.ended_by_release(age);
                self.changed.notify_waiters();
                Outcome::Released
            }
            _ => Outcome::Lost,
        }
    }

    pub fn status(&self, scope: &str) -> Result<LockStatus, LocalError> {
        let last_issued = self.last_issued(scope)?;
        let now = Instant::now();
        let held = match self.slots().get(scope) {
            Some(Slot::Held(l)) if l.deadline > now => Some(l.clone()),
            _ => None,
        };
        Ok(LockStatus {
            scope: scope.to_string(),
            holder: held.as_ref().map(|l| l.holder.clone()),
            lease_id: held.as_ref().map(|l| l.lease_id.clone()),
            token: held.as_ref().map(|l| l.token),
            remaining: held.as_ref().map(|l| l.deadline - now),
            last_issued,
        })
    }

    /// Drops slots that no longer hold anything, so memory follows the live leases only;
    /// counts the expiries that no acquire has looked at yet.
    pub fn sweep(&self) {
        let now = Instant::now();
        let lock_delay = self.lock_delay;
        self.slots().retain(|_, slot| match slot {
            Slot::Pending { .. } => true,
            Slot::Held(l) if l.deadline > now => true,
            Slot::Held(l) => {
                self.expired(l);
                let until = l.deadline + lock_delay;
                *slot = Slot::Delayed { until };
                until > now
            }
            Slot::Delayed { until } => *until > now,
        });
    }

    /// The last token issued for `scope` (from disk).
    pub fn last_issued(&self, scope: &str) -> Result<Option<Token>, LocalError> {
        Ok(self.last_issue(scope)?.map(|(t, _)| t))
    }

    /// The last token issued for `scope` and the run that issued it.
    fn last_issue(&self, scope: &str) -> Result<Option<(Token, u64)>, LocalError> {
        let txn = self.db.begin_read().map_err(store_err)?;
        let table = match txn.open_table(COUNTERS) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
            Err(e) => return Err(store_err(e)),
        };
        Ok(table.get(scope).map_err(store_err)?.map(|g| {
            let (e, c, boot) = g.value();
            (Token::new(e, c), boot)
        }))
    }

    /// The epoch of new tokens.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
}

fn write_txn(db: &Database) -> Result<redb::WriteTransaction, LocalError> {
    let mut txn = db.begin_write().map_err(store_err)?;
    txn.set_durability(Durability::Immediate)
        .map_err(store_err)?;
    Ok(txn)
}

/// Creates the tables and counts this start-up; answers (epoch, boot, restored).
fn initialize(db: &Database) -> Result<(u64, u64, bool), LocalError> {
    let txn = write_txn(db)?;
    let got = {
        txn.open_table(COUNTERS).map_err(store_err)?;
        let mut meta = txn.open_table(META).map_err(store_err)?;
        let get = |key: &str| -> Result<u64, LocalError> {
            Ok(meta
                .get(key)
                .map_err(store_err)?
                .map(|g| g.value())
                .unwrap_or(0))
        };
        let (epoch, boot, restored) = (get("epoch")?, get("boot")?, get("restored")?);
        let boot = boot.wrapping_add(1);
        meta.insert("boot", boot).map_err(store_err)?;
        (epoch, boot, restored != 0)
    };
    txn.commit().map_err(store_err)?;
    Ok(got)
}

fn clear_restored(db: &Database) -> Result<(), LocalError> {
    let txn = write_txn(db)?;
    txn.open_table(META)
        .map_err(store_err)?
        .insert("restored", 0)
        .map_err(store_err)?;
    txn.commit().map_err(store_err)
}

/// Issues the next token of `scope` and makes it durable. Blocking: never call it on an
/// async worker thread.
fn issue(db: &Database, scope: &str, epoch: u64, boot: u64) -> Result<Token, LocalError> {
    let txn = write_txn(db)?;
    let token = {
        let mut counters = txn.open_table(COUNTERS).map_err(store_err)?;
        let last = counters.get(scope).map_err(store_err)?.map(|g| g.value());
        let token = match last {
            None => Token::new(epoch, 1),
            // The counter keeps counting across epochs; the epoch never goes back.
            Some((e, c, _)) => Token::new(
                epoch.max(e),
                c.checked_add(1)
                    .ok_or_else(|| LocalError::Exhausted(scope.to_string()))?,
            ),
        };
        counters
            .insert(scope, (token.epoch, token.counter, boot))
            .map_err(store_err)?;
        token
    };
    // Fail closed: an error here answers `unavailable`; a commit that failed but became
    // durable anyway only means that a token value is skipped.
    txn.commit().map_err(store_err)?;
    Ok(token)
}

/// Raises the epoch and marks the store restored. The store file must not be open
/// elsewhere (the server must be stopped).
///
/// The new epoch is the larger of the stored one plus one and the time in milliseconds
/// since 1970. A restored copy does not remember the bumps made after it was taken: were
/// the same backup restored twice, a plain increment would hand out the first bump's
/// epoch again, below tokens already issued under it. The clock stands in for that memory.
pub fn bump_epoch(path: &Path) -> Result<u64, LocalError> {
    bump_epoch_at_least(path, 0)
}

/// [`bump_epoch`] to an epoch of at least `min` (`store recover`: new tokens must pass the
/// floor it raised).
pub fn bump_epoch_at_least(path: &Path, min: u64) -> Result<u64, LocalError> {
    let open_err = |source: OpenError| LocalError::Open {
        path: path.display().to_string(),
        source,
    };
    if !path.exists() {
        return Err(open_err(OpenError::Missing));
    }
    let db = Database::open(path).map_err(|e| open_err(e.into()))?;
    let txn = write_txn(&db)?;
    let epoch = {
        txn.open_table(COUNTERS).map_err(store_err)?;
        let mut meta = txn.open_table(META).map_err(store_err)?;
        let current = meta.get("epoch").map_err(store_err)?.map(|g| g.value());
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let next = current
            .unwrap_or(0)
            .checked_add(1)
            .ok_or_else(|| LocalError::Exhausted("<epoch>".into()))?
            .max(now_ms)
            .max(min);
        meta.insert("epoch", next).map_err(store_err)?;
        meta.insert("restored", 1).map_err(store_err)?;
        next
    };
    txn.commit().map_err(store_err)?;
    Ok(epoch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::authority::Backend;

    fn config(max_ttl: u64, lock_delay: u64) -> AuthorityConfig {
        AuthorityConfig {
            clients: Vec::new(),
            signing_key: None,
            listen: ([127, 0, 0, 1], 0).into(),
            backend: Backend::Local,
            max_ttl: Duration::from_secs(max_ttl),
            lock_delay: Duration::from_secs(lock_delay),
            tls: None,
        }
    }

    fn memory_db() -> Arc<Database> {
        Arc::new(
            Database::builder()
                .create_with_backend(redb::backends::InMemoryBackend::new())
                .unwrap(),
        )
    }

    fn req(scope: &str, holder: &str, ttl: u64, wait: u64) -> AcquireRequest {
        AcquireRequest {
            scope: scope.into(),
            holder: holder.into(),
            ttl: Duration::from_secs(ttl),
            wait: Duration::from_secs(wait),
        }
    }

    fn no_stop() -> watch::Receiver<bool> {
        let (tx, rx) = watch::channel(false);
        std::mem::forget(tx);
        rx
    }

    fn grant(o: Outcome) -> Grant {
        match o {
            Outcome::Acquired(g) => g,
            other => panic!("expected a grant, got {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn grants_expire_by_the_monotonic_clock() {
        let local = Local::open(memory_db(), &config(60, 0)).await.unwrap();
        let a = grant(local.acquire(&req("s", "a", 10, 0), no_stop()).await);
        assert_eq!(a.token, Token::new(0, 1));
        match local.acquire(&req("s", "b", 10, 0), no_stop()).await {
            Outcome::Busy {
                holder,
                retry_after,
            } => {
                assert_eq!(holder.as_deref(), Some("a"));
                assert!(
                    retry_after <= Duration::from_secs(10) && retry_after > Duration::from_secs(9)
                );
            }
            other => panic!("{other:?}"),
        }
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(
            local.renew("s", &a.lease_id, a.token, Duration::from_secs(5), None),
            Outcome::Lost
        );
        let b = grant(local.acquire(&req("s", "b", 10, 0), no_stop()).await);
        assert_eq!(b.token, Token::new(0, 2));
        assert_eq!(
            local.release("s", &a.lease_id, a.token, None),
            Outcome::Lost
        );
        assert_eq!(local.last_issued("s").unwrap(), Some(Token::new(0, 2)));
    }

    /// An acquisition whose caller goes away while its token commits (an HTTP client that
    /// disconnects drops the handler's future) leaves the scope free, not pending forever.
    /// An in-memory disk whose syncs wait while it is held: a commit stopped mid-way.
    #[derive(Debug, Clone, Default)]
    struct HeldDisk {
        inner: Arc<redb::backends::InMemoryBackend>,
        held: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
    }

    impl HeldDisk {
        fn set_held(&self, held: bool) {
            *self.held.0.lock().unwrap() = held;
            self.held.1.notify_all();
        }
    }

    impl redb::StorageBackend for HeldDisk {
        fn len(&self) -> std::io::Result<u64> {
            self.inner.len()
        }
        fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
            self.inner.read(offset, out)
        }
        fn set_len(&self, len: u64) -> std::io::Result<()> {
            self.inner.set_len(len)
        }
        fn sync_data(&self) -> std::io::Result<()> {
            let (held, released) = &*self.held;
            let mut h = held.lock().unwrap();
            while *h {
                h = released.wait(h).unwrap();
            }
            drop(h);
            self.inner.sync_data()
        }
        fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            self.inner.write(offset, data)
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_acquire_dropped_during_its_commit_leaves_the_scope_free() {
        let disk = HeldDisk::default();
        let db = Database::builder()
            .create_with_backend(disk.clone())
            .unwrap();
        let local = Local::open(Arc::new(db), &config(60, 0)).await.unwrap();
        // The commit cannot land while the disk is held: the acquisition is certainly
        // dropped mid-commit.
        disk.set_held(true);
        let dropped = tokio::time::timeout(
            Duration::ZERO,
            local.acquire(&req("s", "a", 10, 0), no_stop()),
        )
        .await;
        assert!(dropped.is_err(), "dropped while committing: {dropped:?}");
        disk.set_held(false);
        // Granted at once (before, the slot stayed pending: busy, forever). The dropped
        // acquisition's commit may have issued a token of its own; it is never granted.
        let b = grant(local.acquire(&req("s", "b", 10, 0), no_stop()).await);
        assert!(b.token >= Token::new(0, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn only_the_exact_lease_renews_or_releases() {
        let local = Local::open(memory_db(), &config(60, 0)).await.unwrap();
        let a = grant(local.acquire(&req("s", "a", 10, 0), no_stop()).await);
        let ttl = Duration::from_secs(10);
        assert_eq!(local.renew("s", "other", a.token, ttl, None), Outcome::Lost);
        assert_eq!(
            local.renew("s", &a.lease_id, Token::new(0, 9), ttl, None),
            Outcome::Lost
        );
        assert_eq!(
            local.renew("t", &a.lease_id, a.token, ttl, None),
            Outcome::Lost
        );
        assert_eq!(local.release("s", "other", a.token, None), Outcome::Lost);
        // The exact lease, under another holder's name: lost, and nothing changes.
        assert_eq!(
            local.renew("s", &a.lease_id, a.token, ttl, Some("b")),
            Outcome::Lost
        );
        assert_eq!(
            local.release("s", &a.lease_id, a.token, Some("b")),
            Outcome::Lost
        );
        tokio::time::advance(Duration::from_secs(8)).await;
        assert_eq!(
            local.renew("s", &a.lease_id, a.token, ttl, Some("a")),
            Outcome::Renewed { ttl }
        );
        tokio::time::advance(Duration::from_secs(8)).await;
        // Still held: the renewal moved the deadline to 18 s.
        assert!(matches!(
            local.acquire(&req("s", "b", 10, 0), no_stop()).await,
            Outcome::Busy { .. }
        ));
        assert_eq!(
            local.release("s", &a.lease_id, a.token, None),
            Outcome::Released
        );
        assert_eq!(
            local.release("s", &a.lease_id, a.token, None),
            Outcome::Lost
        );
        // Released, not expired: no lock_delay applies.
        let b = grant(local.acquire(&req("s", "b", 10, 0), no_stop()).await);
        assert_eq!(b.token, Token::new(0, 2));
    }

    #[tokio::test(start_paused = true)]
    async fn lock_delay_follows_an_expiry_without_release() {
        let local = Local::open(memory_db(), &config(60, 5)).await.unwrap();
        grant(local.acquire(&req("s", "a", 10, 0), no_stop()).await);
        tokio::time::advance(Duration::from_secs(11)).await;
        match local.acquire(&req("s", "b", 10, 0), no_stop()).await {
            Outcome::Busy {
                holder: None,
                retry_after,
            } => assert_eq!(retry_after, Duration::from_secs(4)),
            other => panic!("{other:?}"),
        }
        let start = Instant::now();
        let b = grant(local.acquire(&req("s", "b", 10, 30), no_stop()).await);
        assert_eq!(Instant::now() - start, Duration::from_secs(4));
        assert_eq!(b.token, Token::new(0, 2));
    }

    /// An expiry nobody looks at is counted by the sweep, once; a release is not an expiry.
    #[tokio::test(start_paused = true)]
    async fn the_sweep_counts_an_expiry_once() {
        let metrics = Arc::new(AuthorityMetrics::default());
        let local = Local::open(memory_db(), &config(60, 5))
            .await
            .unwrap()
            .with_metrics(metrics.clone());
        grant(local.acquire(&req("s", "a", 10, 0), no_stop()).await);
        let t = grant(local.acquire(&req("t", "a", 10, 0), no_stop()).await);
        assert_eq!(
            local.release("t", &t.lease_id, t.token, None),
            Outcome::Released
        );
        local.sweep();
        assert_eq!(metrics.expiries(), 0);
        tokio::time::advance(Duration::from_secs(11)).await;
        local.sweep();
        assert_eq!(metrics.expiries(), 1);
        // Within lock_delay the scope stays busy; neither a look nor a sweep counts again.
        assert!(matches!(
            local.acquire(&req("s", "b", 10, 0), no_stop()).await,
            Outcome::Busy { holder: None, .. }
        ));
        tokio::time::advance(Duration::from_secs(5)).await;
        local.sweep();
        grant(local.acquire(&req("s", "b", 10, 0), no_stop()).await);
        assert_eq!(metrics.expiries(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_acquire_gets_the_scope_on_release() {
        let local = Arc::new(Local::open(memory_db(), &config(60, 0)).await.unwrap());
        let a = grant(local.acquire(&req("s", "a", 50, 0), no_stop()).await);
        let start = Instant::now();
        let waiter = {
            let local = local.clone();
            tokio::spawn(async move { local.acquire(&req("s", "b", 10, 30), no_stop()).await })
        };
        // Let the waiter reach its wait (it is parked on the notify or the timer).
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(
            local.release("s", &a.lease_id, a.token, None),
            Outcome::Released
        );
        let b = grant(waiter.await.unwrap());
        assert_eq!(b.token, Token::new(0, 2));
        assert!(Instant::now() - start < Duration::from_secs(2));
        // And a wait that runs out answers busy with the time left on the lease.
        match local.acquire(&req("s", "c", 10, 3), no_stop()).await {
            Outcome::Busy { holder, .. } => assert_eq!(holder.as_deref(), Some("b")),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_restart_waits_out_leases_that_may_be_live() {
        let db = memory_db();
        let before = Local::open(db.clone(), &config(60, 2)).await.unwrap();
        grant(before.acquire(&req("old", "a", 60, 0), no_stop()).await);
        drop(before); // a crash: the lease table is gone, the counters are not
        let after = Local::open(db.clone(), &config(60, 2)).await.unwrap();
        match after.acquire(&req("old", "b", 10, 0), no_stop()).await {
            Outcome::Busy {
                holder: None,
                retry_after,
            } => assert_eq!(retry_after, Duration::from_secs(62)),
            other => panic!("{other:?}"),
        }
        // A scope never granted cannot have a live lease.
        assert_eq!(
            grant(after.acquire(&req("new", "b", 10, 0), no_stop()).await).token,
            Token::new(0, 1)
        );
        tokio::time::advance(Duration::from_secs(62)).await;
        assert_eq!(
            grant(after.acquire(&req("old", "b", 10, 0), no_stop()).await).token,
            Token::new(0, 2)
        );
    }
}
