//! The store's handle, [`MarkStore`]: opening (a file, a test backend), queueing
//! advances, floors and idempotency records to the writer, and reading marks, records and
//! snapshots from redb with the journal's pending advances on top.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};

use redb::{ConcurrencyMode, Database, ReadableDatabase, ReadableTableMetadata, StorageBackend};
use tokio::sync::oneshot;

use crate::store::Mark;
use crate::store::journal::Pending;
use crate::store::quota::{self, RecordQuota, Tally, Volume};
use crate::token::Token;

use super::records::{RECORDS, tally_records};
use super::recover::{JournalFile, journal_path, recover};
use super::tables::Snapshot;
use super::tables::{builder, create_file, get_mark, initialize, list_marks};
use super::writer::Writer;
use super::writer::{Slot, StoreStats};
use super::{Claimed, Op, StoreError, read_err, writer_stopped};

pub(super) struct Inner {
    /// The database; none while the writer reopens it after a failure.
    pub(super) db: Slot,
    pub(super) stats: Arc<StoreStats>,
    pub(super) commits: Commits,
    pub(super) failed: Arc<AtomicBool>,
    pub(super) floor: Arc<AtomicU64>,
    /// Advances in the journal and not yet in redb: the highest token per scope.
    pub(super) pending: Arc<Mutex<Pending>>,
    /// What the idempotency records take (changed by the writer once committed).
    pub(super) tally: Arc<Mutex<Tally>>,
    /// The store file, once known: the writer reopens it after a failure.
    pub(super) reopen: Arc<Mutex<Option<PathBuf>>>,
}

/// Where commits happen.
pub(super) enum Commits {
    /// The writer thread (production): group commit, never on an async worker.
    Thread(mpsc::Sender<Op>),
    /// On the calling task, one op per commit: deterministic under a paused test clock,
    /// where waiting on another thread would let the clock jump.
    Inline(Mutex<Writer>),
}

/// A handle to the store; cheap to clone. The writer thread stops when the last handle drops.
#[derive(Clone)]
pub struct MarkStore {
    pub(super) inner: Arc<Inner>,
}

impl std::fmt::Debug for MarkStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MarkStore")
            .field("failed", &self.is_failed())
            .finish()
    }
}

impl MarkStore {
    /// Opens (or creates) the store file.
    pub fn open(path: &Path) -> Result<MarkStore, StoreError> {
        let open_err = |reason: String| StoreError::Open {
            path: path.display().to_string(),
            reason,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| open_err(e.to_string()))?;
        }
        if !path.exists() {
            create_file(path).map_err(|e| open_err(e.to_string()))?;
        }
        let db = builder()
            .create(path)
            .map_err(|e| open_err(e.to_string()))?;
        // Only once redb's lock is held: the journal belongs to whoever holds the store.
        let journal = JournalFile::open(&journal_path(path))
            .map_err(|e| open_err(format!("its journal {}: {e}", journal_path(path).display())))?;
        MarkStore::start(
            db,
            Some(journal),
            false,
            &journal_path(path).display().to_string(),
            Some(Volume::of(path)),
        )
        .map(|store| store.reopenable(path))
    }

    /// Opens a store on redb backends for the marks and the journal (tests inject failing
    /// disks this way).
    pub fn open_with_backends(
        backend: impl StorageBackend,
        journal: impl StorageBackend,
    ) -> Result<MarkStore, StoreError> {
        let mut b = Database::builder();
        b.set_concurrency_mode(ConcurrencyMode::ExclusiveWriter);
        b.set_check_integrity_on_open(true);
        let db = b
            .create_with_backend(backend)
            .map_err(|e| StoreError::Open {
                path: "<backend>".into(),
                reason: e.to_string(),
            })?;
        MarkStore::start(db, Some(journal), false, "<journal backend>", None)
    }

    /// Opens a store on any redb backend, without a journal: every batch is a redb commit
    /// (tests inject failing disks this way).
    pub fn open_with_backend(backend: impl StorageBackend) -> Result<MarkStore, StoreError> {
        MarkStore::with_backend(backend, false)
    }

    /// Like [`MarkStore::open_with_backend`], but commits on the calling task. Only for
    /// tests that run under a paused tokio clock; it blocks the caller for the commit.
    pub fn open_inline_with_backend(backend: impl StorageBackend) -> Result<MarkStore, StoreError> {
        MarkStore::with_backend(backend, true)
    }

    pub(super) fn with_backend(
        backend: impl StorageBackend,
        inline: bool,
    ) -> Result<MarkStore, StoreError> {
        let open_err = |reason: String| StoreError::Open {
            path: "<backend>".into(),
            reason,
        };
        let mut b = Database::builder();
        b.set_concurrency_mode(ConcurrencyMode::ExclusiveWriter);
        let db = b
            .create_with_backend(backend)
            .map_err(|e| open_err(e.to_string()))?;
        MarkStore::start(db, None::<JournalFile>, inline, "<backend>", None)
    }

    /// `name`: the journal's, for errors.
    pub(super) fn start(
        db: Database,
        journal: Option<impl StorageBackend>,
        inline: bool,
        name: &str,
        volume: Option<Volume>,
    ) -> Result<MarkStore, StoreError> {
        let open_err = |e: redb::Error| StoreError::Open {
            path: name.to_string(),
            reason: e.to_string(),
        };
        let floor = initialize(&db).map_err(open_err)?;
        let tally = Arc::new(Mutex::new(tally_records(&db).map_err(open_err)?));
        let stats = Arc::new(StoreStats::default());
        let db = Arc::new(db);
        let failed = Arc::new(AtomicBool::new(false));
        let floor = Arc::new(AtomicU64::new(floor));
        let pending = Arc::new(Mutex::new(Pending::new()));
        let journal = match journal {
            Some(file) => Some(recover(&db, file, name)?),
            None => None,
        };
        let slot: Slot = Arc::new(std::sync::RwLock::new(Some(db.clone())));
        let reopen = Arc::new(Mutex::new(None));
        let writer = Writer {
            db: db.clone(),
            slot: slot.clone(),
            reopen: reopen.clone(),
            failed: failed.clone(),
            floor: floor.clone(),
            stats: stats.clone(),
            journal,
            pending: pending.clone(),
            tally: tally.clone(),
            volume,
        };
        let commits = if inline {
            Commits::Inline(Mutex::new(writer))
        } else {
            let (tx, rx) = mpsc::channel();
            std::thread::Builder::new()
                .name("fencegate-marks".into())
                .spawn(move || writer.run(rx))
                .map_err(|e| open_err(redb::Error::Io(e)))?;
            Commits::Thread(tx)
        };
        drop(db);
        Ok(MarkStore {
            inner: Arc::new(Inner {
                db: slot,
                reopen,
                stats,
                commits,
                failed,
                floor,
                pending,
                tally,
            }),
        })
    }

    /// This store reopens the file at `path` after a failure.
    pub(super) fn reopenable(self, path: &Path) -> MarkStore {
        *self.inner.reopen.lock().unwrap_or_else(|p| p.into_inner()) = Some(path.to_path_buf());
        self
    }

    /// The underlying database, for other tables in the same file (the local lease
    /// authority keeps its counters here). Their write transactions queue behind ours.
    /// `None` only while the writer reopens the file after a failure (a handle taken here
    /// keeps it from doing so: the reopen then waits for a restart).
    pub fn database(&self) -> Option<Arc<Database>> {
        self.db().ok()
    }

    /// The database as it is now.
    pub(super) fn db(&self) -> Result<Arc<Database>, StoreError> {
        self.inner
            .db
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| StoreError::Failed("the store is being reopened".into()))
    }

    pub fn stats(&self) -> &StoreStats {
        &self.inner.stats
    }

    pub fn is_failed(&self) -> bool {
        self.inner.failed.load(Ordering::Acquire)
    }

    pub fn floor(&self) -> u64 {
        self.inner.floor.load(Ordering::Acquire)
    }

    /// Durably raises `scope` to at least `token`. Answers the stored mark, which may be
    /// higher than `token` if a higher advance got there first. Never lowers a mark.
    pub async fn advance(&self, scope: Arc<str>, token: Token) -> Result<Token, StoreError> {
        self.begin_advance(scope, Mark::of(token))?
            .await
            .unwrap_or_else(|_| Err(writer_stopped()))
            .map(|m| m.token)
    }

    /// [`advance`](MarkStore::advance) in two steps, for a whole [`Mark`] (a sequence is
    /// recorded with its token, in the same record): queue it now, read the stored mark
    /// from the receiver once committed. The commit lands whether or not anyone waits.
    pub fn begin_advance(
        &self,
        scope: Arc<str>,
        mark: Mark,
    ) -> Result<oneshot::Receiver<Result<Mark, StoreError>>, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.send(Op::Advance { scope, mark, reply })?;
        Ok(rx)
    }

    /// Durably raises the epoch floor to at least `epoch`; answers the floor in force.
    pub async fn raise_floor(&self, epoch: u64) -> Result<u64, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.send(Op::Floor { epoch, reply })?;
        rx.await
            .unwrap_or_else(|_| Err(StoreError::Failed("writer stopped".into())))
    }

    /// Idempotency: durably claims `key` for a new attempt unless a live record holds it
    /// (one equal to `replace_if` may be replaced). `value` starts with its expiry.
    /// Answers the record that stopped the claim, or `None` when claimed.
    pub async fn claim(
        &self,
        key: String,
        value: Vec<u8>,
        replace_if: Option<Vec<u8>>,
        now: u64,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        match self.claim_within(key, value, replace_if, now, None).await? {
            Claimed::Claimed => Ok(None),
            Claimed::Held(v) => Ok(Some(v)),
            Claimed::Rejected(r) => Err(StoreError::Failed(r.describe().into())),
        }
    }

    /// [`claim`](MarkStore::claim) of a record that counts against `client` and must stay
    /// within `quota`: past a bound (after the expired records are deleted), the claim is
    /// refused and nothing is written. Each key, in bytes, counts as `quota.reserve`
    /// until its completion is written ([`put_record`](MarkStore::put_record)).
    pub async fn claim_within(
        &self,
        key: String,
        value: Vec<u8>,
        replace_if: Option<Vec<u8>>,
        now: u64,
        quota: Option<(String, RecordQuota)>,
    ) -> Result<Claimed, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.send(Op::Claim {
            key,
            value,
            replace_if,
            now,
            quota,
            reply,
        })?;
        rx.await
            .unwrap_or_else(|_| Err(StoreError::Failed("writer stopped".into())))
    }

    /// What the idempotency records take: in total, and for `scope` and `client`.
    pub fn record_usage(
        &self,
        scope: &str,
        client: &str,
    ) -> (quota::Usage, quota::Usage, quota::Usage) {
        let tally = self.inner.tally.lock().unwrap_or_else(|p| p.into_inner());
        let (s, c) = tally.of(scope, client);
        (tally.total, s, c)
    }

    /// Scopes and clients that hold records (the tally's size).
    pub fn record_owners(&self) -> (usize, usize) {
        self.inner
            .tally
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .owners()
    }

    /// Idempotency: durably overwrites a claimed record (its expiry is kept).
    pub async fn put_record(&self, key: String, value: Vec<u8>) -> Result<(), StoreError> {
        let (reply, rx) = oneshot::channel();
        self.send(Op::Put { key, value, reply })?;
        rx.await
            .unwrap_or_else(|_| Err(StoreError::Failed("writer stopped".into())))
    }

    /// Idempotency: deletes up to `limit` records expired by `now` (unix seconds).
    pub async fn collect_records(&self, now: u64, limit: usize) -> Result<usize, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.send(Op::Collect { now, limit, reply })?;
        rx.await
            .unwrap_or_else(|_| Err(StoreError::Failed("writer stopped".into())))
    }

    /// A scope with a mark that starts with `prefix` (is `prefix`, when `exact`), other
    /// than `except`: the journal's advances not yet in redb, then redb's marks.
    pub fn marked_beneath(
        &self,
        prefix: &str,
        exact: bool,
        except: &str,
    ) -> Result<Option<String>, StoreError> {
        let matches = |s: &str| {
            s != except
                && if exact {
                    s == prefix
                } else {
                    s.starts_with(prefix)
                }
        };
        // Ordered: the scopes that start with `prefix` are one range of the map.
        let pending = self
            .inner
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .range::<str, _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .map(|(s, _)| s)
            .take_while(|s| s.starts_with(prefix))
            .find(|s| matches(s))
            .map(|s| s.to_string());
        if pending.is_some() {
            return Ok(pending);
        }
        Ok(list_marks(&*self.db()?, prefix, None, 2)?
            .into_iter()
            .map(|(s, _)| s)
            .find(|s| matches(s)))
    }

    /// The record under `key`, expired or not (the caller reads its expiry).
    pub fn record(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let txn = self.db()?.begin_read().map_err(read_err)?;
        let t = txn.open_table(RECORDS).map_err(read_err)?;
        Ok(t.get(key).map_err(read_err)?.map(|g| g.value().to_vec()))
    }

    /// Idempotency records on disk (for tests and metrics).
    pub fn record_count(&self) -> Result<u64, StoreError> {
        let txn = self.db()?.begin_read().map_err(read_err)?;
        let t = txn.open_table(RECORDS).map_err(read_err)?;
        t.len().map_err(read_err)
    }

    /// Commits what is queued and stops the writer, so that the file is closed cleanly
    /// once the last handle drops (no repair on the next open). It waits for those commits,
    /// and so for the disk: a caller that must not hang with a hung disk bounds the wait
    /// (server shutdown does). The last handle's drop writes and syncs the file too.
    pub async fn close(&self) {
        if let Commits::Thread(tx) = &self.inner.commits {
            let (reply, rx) = oneshot::channel();
            if tx.send(Op::Close { reply }).is_ok() {
                let _ = rx.await;
            }
        }
    }

    pub(super) fn send(&self, op: Op) -> Result<(), StoreError> {
        if self.is_failed() {
            return Err(StoreError::Failed("an earlier commit failed".into()));
        }
        match &self.inner.commits {
            Commits::Thread(tx) => tx.send(op).map_err(|_| {
                // The writer is gone (it panicked, or the store was closed): nothing can
                // be committed any more, which readiness and metrics must say.
                if !self.inner.failed.swap(true, Ordering::AcqRel) {
                    tracing::error!("the mark store's writer has stopped; the store refuses writes until restarted");
                }
                writer_stopped()
            }),
            Commits::Inline(writer) => {
                writer
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .commit(vec![op]);
                Ok(())
            }
        }
    }

    /// The durable mark of one scope.
    pub fn get(&self, scope: &str) -> Result<Option<Token>, StoreError> {
        Ok(self.get_mark(scope)?.map(|m| m.token))
    }

    /// The durable mark of one scope with its sequence.
    pub fn get_mark(&self, scope: &str) -> Result<Option<Mark>, StoreError> {
        if self.is_failed() {
            return Err(StoreError::Failed("an earlier commit failed".into()));
        }
        // The journal's view first, then redb's: a checkpoint commits to redb before it
        // forgets its advances, so one of the two shows every acknowledged advance.
        let journaled = self
            .inner
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(scope)
            .copied();
        Ok(journaled.max(get_mark(&*self.db()?, scope)?))
    }

    /// Applies the journal's advances to redb, so that redb alone shows every mark
    /// acknowledged before the call ([`list`](MarkStore::list) and
    /// [`snapshot`](MarkStore::snapshot) read redb alone), and answers a snapshot taken
    /// right after it, before anything else is committed: the floor and every mark as of
    /// one moment (a backup).
    pub async fn checkpoint(&self) -> Result<Snapshot, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.send(Op::Checkpoint { reply })?;
        rx.await.unwrap_or_else(|_| Err(writer_stopped()))
    }

    /// Marks in scope order, starting after `after` (exclusive) and with `prefix`, as redb
    /// has them: after a [`checkpoint`](MarkStore::checkpoint), every mark.
    pub fn list(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Token)>, StoreError> {
        list_marks(&*self.db()?, prefix, after, limit)
    }

    /// The epoch floor and every mark as of one moment (a backup), as redb has them: after
    /// a [`checkpoint`](MarkStore::checkpoint), every mark.
    pub fn snapshot(&self) -> Result<Snapshot, StoreError> {
        Snapshot::of(&*self.db()?)
    }
}
