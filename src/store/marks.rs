//! The durable mark store: per-scope high-water marks in redb.
//!
//! One writer thread owns every write transaction. Callers queue advances; the writer takes
//! everything queued, applies the max per scope in one transaction, commits with immediate
//! durability (one fsync for the whole batch: group commit), and only then answers. A
//! failed commit fails the store closed: redb says a failed commit may still be durable,
//! so nothing in memory may be trusted to match the disk until the file is opened again:
//! by the writer itself once the volume has room ([`Writer::reopen`]), or by a restart. A
//! writer that panics or stops fails the store closed for good.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use redb::{
    ConcurrencyMode, Database, Durability, ReadableDatabase, ReadableTable, ReadableTableMetadata,
    StorageBackend, TableDefinition,
};
use tokio::sync::oneshot;

use super::Mark;
use super::journal::{self, Journal, OpenError, Pending};
use super::quota::{self, Changes, Delta, RecordQuota, Rejected, Tally, Volume};
use crate::metrics::histogram::Histogram;
use crate::token::Token;

/// scope → (epoch, counter). Tokens as two integers, never as text.
const MARKS: TableDefinition<&str, (u64, u64)> = TableDefinition::new("marks");
/// Store-wide facts: format version, epoch floor, and the journal's bookkeeping
/// ([`JOURNAL_APPLIED`], [`JOURNAL_CLEAN`]).
/// scope → (epoch, counter, sequence): the highest `Fencing-Sequence` accepted for that
/// token (SPEC §11). It counts only while that token is the scope's mark: a higher token
/// starts the sequence over without a write here. A table of its own, so that a store
/// file from before sequences opens as it is (the table is made at the first open).
const SEQUENCES: TableDefinition<&str, (u64, u64, u64)> = TableDefinition::new("sequences");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
/// Idempotency records: "scope\0key" → 8 bytes expiry (unix seconds, big-endian) + record.
const RECORDS: TableDefinition<&str, &[u8]> = TableDefinition::new("idempotency");
/// (expiry, record key), so expired records are found without a scan.
const RECORD_EXPIRY: TableDefinition<(u64, &str), ()> = TableDefinition::new("idempotency_expiry");
/// Record key → (client, bytes counted for it): who a record counts against in the
/// quotas, and how much (a record in flight counts as its largest completion). A record
/// without a row (made before quotas, or an S3 upload's) counts against the client ""
/// with its own size.
const RECORD_OWNER: TableDefinition<&str, (&str, u64)> = TableDefinition::new("idempotency_owner");
/// Expired records a refused claim deletes first, in its own transaction.
const RECLAIM_BATCH: usize = 256;
/// A failed store tries to reopen its file this long after the failure, then twice as
/// long after each attempt that fails, up to [`REOPEN_MAX`].
const REOPEN_FIRST: Duration = Duration::from_secs(1);
const REOPEN_MAX: Duration = Duration::from_secs(30);
/// Free bytes the volume needs before a reopen is tried: the reopen writes (redb's
/// repair, the journal's advances).
const REOPEN_FREE: u64 = 4 << 20;
/// Expired records deleted right after a reopen, before anything else is committed.
const REOPEN_COLLECT: usize = 100_000;
const FORMAT_VERSION: u64 = 1;
/// The journal generation whose records a checkpoint last committed to redb. The journal's
/// header is then that generation (a crash before its reset) or the next: anything else
/// means one of the two files is not the other's (an older copy restored, a journal
/// swapped), and acknowledged marks may be missing.
const JOURNAL_APPLIED: &str = "journal_applied";
/// 1 once a clean close emptied the journal, 0 while a server runs: a journal missing or
/// blank is only harmless after a clean close.
const JOURNAL_CLEAN: &str = "journal_clean";
/// Upper bound on advances in one commit, so one batch cannot starve replies for long.
const MAX_BATCH: usize = 4096;
/// redb's page cache; its default (1 GiB) would let RSS follow the file size.
const CACHE_BYTES: usize = 32 << 20;

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("cannot open the mark store {path}: {reason}")]
    Open { path: String, reason: String },
    #[error("the mark store has failed and refuses writes until restarted: {0}")]
    Failed(String),
    #[error("the mark store {0} is held by a running server")]
    InUse(String),
    #[error("mark store read failed: {0}")]
    Read(String),
    /// The journal (or the store file beside it) was changed by something other than a
    /// crash: acknowledged marks may be missing, so the store is not opened.
    #[error(
        "the mark journal {path} is corrupt at byte {offset}: {what}; acknowledged marks may be missing, so the store is not opened (run `fencegate store recover --config FILE`: it applies every record that checks out and raises the epoch floor above every token issued before)"
    )]
    Corrupt {
        path: String,
        offset: u64,
        what: String,
    },
}

fn read_err(e: impl std::fmt::Display) -> StoreError {
    StoreError::Read(e.to_string())
}

/// What a dropped reply channel means: the writer is gone.
pub fn writer_stopped() -> StoreError {
    StoreError::Failed("writer stopped".into())
}

enum Op {
    Advance {
        scope: Arc<str>,
        mark: Mark,
        reply: oneshot::Sender<Result<Mark, StoreError>>,
    },
    Floor {
        epoch: u64,
        reply: oneshot::Sender<Result<u64, StoreError>>,
    },
    /// Finish what is queued, then stop the writer (it drops its database handle).
    Close { reply: oneshot::Sender<()> },
    /// Apply the journal's advances to redb (so that redb alone shows every mark).
    Checkpoint {
        reply: oneshot::Sender<Result<Snapshot, StoreError>>,
    },
    /// Idempotency: insert `value` under `key` unless a live record is there (or the one
    /// there equals `replace_if`); answers the live record that stopped it, if any.
    Claim {
        key: String,
        value: Vec<u8>,
        replace_if: Option<Vec<u8>>,
        now: u64,
        /// The client it counts against and the bounds it must stay within; none: it
        /// is counted (against the client "") but never refused.
        quota: Option<(String, RecordQuota)>,
        reply: oneshot::Sender<Result<Claimed, StoreError>>,
    },
    /// Idempotency: overwrite a claimed record (completion), keeping its expiry.
    Put {
        key: String,
        value: Vec<u8>,
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    /// Idempotency: delete up to `limit` records that expired by `now`.
    Collect {
        now: u64,
        limit: usize,
        reply: oneshot::Sender<Result<usize, StoreError>>,
    },
}

/// What one op of a committed batch answers.
enum Answer {
    None,
    Claim(Claimed),
    Collected(usize),
}

/// What a claim of an idempotency record answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claimed {
    /// The key is this attempt's.
    Claimed,
    /// A live record holds the key.
    Held(Vec<u8>),
    /// A bound of the quota refused a new record.
    Rejected(Rejected),
}

struct Inner {
    /// The database; none while the writer reopens it after a failure.
    db: Slot,
    stats: Arc<StoreStats>,
    commits: Commits,
    failed: Arc<AtomicBool>,
    floor: Arc<AtomicU64>,
    /// Advances in the journal and not yet in redb: the highest token per scope.
    pending: Arc<Mutex<Pending>>,
    /// What the idempotency records take (changed by the writer once committed).
    tally: Arc<Mutex<Tally>>,
    /// The store file, once known: the writer reopens it after a failure.
    reopen: Arc<Mutex<Option<PathBuf>>>,
}

/// The open database, shared by the handles and the writer: the writer takes it out to
/// reopen the file after a failure ([`Writer::reopen`]).
type Slot = Arc<std::sync::RwLock<Option<Arc<Database>>>>;

/// Where commits happen.
enum Commits {
    /// The writer thread (production): group commit, never on an async worker.
    Thread(mpsc::Sender<Op>),
    /// On the calling task, one op per commit: deterministic under a paused test clock,
    /// where waiting on another thread would let the clock jump.
    Inline(Mutex<Writer>),
}

/// What the writer measures; rendered by the admin listener's /metrics.
#[derive(Debug)]
pub struct StoreStats {
    pub commit_seconds: Histogram,
    pub commit_batch_size: Histogram,
    pub commit_failures: AtomicU64,
    /// Checkpoints of the journal into redb.
    pub checkpoints: AtomicU64,
}

impl StoreStats {
    /// Commits made so far (each served one batch of advances).
    pub fn commit_batch_size_count(&self) -> u64 {
        self.commit_batch_size.count()
    }
}

impl Default for StoreStats {
    fn default() -> StoreStats {
        StoreStats {
            commit_seconds: Histogram::new(crate::metrics::histogram::SECONDS),
            commit_batch_size: Histogram::new(crate::metrics::histogram::BATCH),
            commit_failures: AtomicU64::new(0),
            checkpoints: AtomicU64::new(0),
        }
    }
}

/// A handle to the store; cheap to clone. The writer thread stops when the last handle drops.
#[derive(Clone)]
pub struct MarkStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MarkStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MarkStore")
            .field("failed", &self.is_failed())
            .finish()
    }
}

fn builder() -> redb::Builder {
    let mut b = Database::builder();
    // ExclusiveWriter: one fsync per commit. (SingleWriter would let other processes read
    // the file while the server runs, but commits in two phases, with twice the fsyncs;
    // the CLI reads through the admin API instead while the server holds the file.)
    b.set_concurrency_mode(ConcurrencyMode::ExclusiveWriter);
    // Memory must not grow with the number of marks on disk; hot scopes live in the gates.
    b.set_cache_size(CACHE_BYTES);
    // A plain open trusts the file's pages: a flipped bit in a leaf reads as a mark that
    // is not there (measured: the scope's mark vanished, no error). The check verifies
    // every page's checksum, so a file changed behind redb's back fails to open.
    b.set_check_integrity_on_open(true);
    b
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

    fn with_backend(backend: impl StorageBackend, inline: bool) -> Result<MarkStore, StoreError> {
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
    fn start(
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
    fn reopenable(self, path: &Path) -> MarkStore {
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
    fn db(&self) -> Result<Arc<Database>, StoreError> {
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

    fn send(&self, op: Op) -> Result<(), StoreError> {
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

/// Creates the tables and checks the format; returns the epoch floor.
fn initialize(db: &Database) -> Result<u64, redb::Error> {
    let mut txn = db.begin_write()?;
    txn.set_durability(Durability::Immediate)
        .map_err(|e| redb::Error::Io(std::io::Error::other(e.to_string())))?;
    let floor;
    {
        let mut meta = txn.open_table(META)?;
        let version = meta.get("format_version")?.map(|g| g.value());
        match version {
            None => {
                meta.insert("format_version", FORMAT_VERSION)?;
            }
            Some(FORMAT_VERSION) => {}
            Some(other) => {
                return Err(redb::Error::Io(std::io::Error::other(format!(
                    "store format version {other} is not supported (this build reads {FORMAT_VERSION})"
                ))));
            }
        }
        floor = meta.get("epoch_floor")?.map(|g| g.value()).unwrap_or(0);
        txn.open_table(MARKS)?;
        txn.open_table(SEQUENCES)?;
        txn.open_table(RECORDS)?;
        txn.open_table(RECORD_EXPIRY)?;
        txn.open_table(RECORD_OWNER)?;
    }
    txn.commit()?;
    Ok(floor)
}

/// An empty in-memory database: what the writer holds while its file is closed.
fn placeholder() -> Result<Database, redb::DatabaseError> {
    Database::builder().create_with_backend(redb::backends::InMemoryBackend::new())
}

/// The store file at `path` opened again as [`MarkStore::open`] opens it: the database,
/// its journal (applied), the epoch floor and the records' usage.
fn reopen_parts(path: &Path) -> Result<(Database, Journal, u64, Tally), String> {
    let db = builder().create(path).map_err(|e| e.to_string())?;
    let journal = JournalFile::open(&journal_path(path)).map_err(|e| e.to_string())?;
    let floor = initialize(&db).map_err(|e| e.to_string())?;
    let journal = recover(&db, journal, &journal_path(path).display().to_string())
        .map_err(|e| e.to_string())?;
    let tally = tally_records(&db).map_err(|e| e.to_string())?;
    Ok((db, journal, floor, tally))
}

/// The records' usage as the file holds it (once, at open; bounded by the records).
fn tally_records(db: &Database) -> Result<Tally, redb::Error> {
    let txn = db.begin_read()?;
    let records = txn.open_table(RECORDS)?;
    let owners = txn.open_table(RECORD_OWNER)?;
    let mut changes = Changes::default();
    for item in records.iter()? {
        let (k, v) = item?;
        let key = k.value();
        let (client, bytes) = owner_of(&owners, key, v.value().len())?;
        changes.add(quota::scope_of(key), &client, Delta::of(1, bytes));
    }
    let mut tally = Tally::default();
    tally.apply(&changes);
    Ok(tally)
}

/// Who a record counts against and its bytes (see [`RECORD_OWNER`]).
fn owner_of(
    owners: &impl ReadableTable<&'static str, (&'static str, u64)>,
    key: &str,
    value_len: usize,
) -> Result<(String, u64), redb::StorageError> {
    Ok(match owners.get(key)? {
        Some(g) => {
            let (client, bytes) = g.value();
            (client.to_string(), bytes)
        }
        None => (String::new(), quota::size_of(key, value_len)),
    })
}

/// Makes a new store file whole under another name and renames it into place, so that a
/// crash while it is made leaves no half-made file at `path` (which redb would refuse).
fn create_file(path: &Path) -> Result<(), redb::Error> {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".new");
    let new = path.with_file_name(name);
    match std::fs::remove_file(&new) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
    }
    let db = builder().create(&new)?;
    initialize(&db)?;
    drop(db);
    std::fs::File::open(&new)?.sync_all()?;
    std::fs::rename(&new, path)?;
    sync_dir(path)?;
    Ok(())
}

/// Makes a name created or renamed in `path`'s directory survive a crash.
fn sync_dir(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)?.sync_all()
}

/// Durably raises the epoch floor to at least `floor` (never lowers it).
fn raise_floor_to(db: &Database, floor: u64) -> Result<(), redb::Error> {
    let mut txn = db.begin_write()?;
    txn.set_durability(Durability::Immediate)
        .map_err(|e| redb::Error::Io(std::io::Error::other(e.to_string())))?;
    {
        let mut meta = txn.open_table(META)?;
        let now = meta.get("epoch_floor")?.map(|g| g.value()).unwrap_or(0);
        meta.insert("epoch_floor", now.max(floor))?;
    }
    txn.commit()?;
    Ok(())
}

/// What `fencegate store recover` did.
#[derive(Debug)]
pub struct Recovered {
    /// Records of the journal that checked out, and the scopes they held.
    pub records: usize,
    pub scopes: usize,
    /// The epoch floor now in force: above every epoch seen in the store and its journal.
    pub floor: u64,
    /// redb's integrity check had to repair the store file.
    pub repaired: bool,
    /// Where the damaged journal was kept (None: there was none).
    pub journal_kept: Option<PathBuf>,
}

/// The way out of a damaged journal (or a journal that does not belong with its store),
/// safe by construction: every journal record that checks out is applied (max per scope),
/// and the epoch floor is raised above every epoch seen in the store file and the journal
/// and to at least `at_least`, so every token issued before the damage is stale and
/// owners re-acquire. The damaged journal is kept beside the store, a new empty one takes
/// its place. The server must be stopped.
pub fn recover_store(path: &Path, at_least: u64) -> Result<Recovered, StoreError> {
    let open_err = |reason: String| StoreError::Open {
        path: path.display().to_string(),
        reason,
    };
    if !path.exists() {
        return Err(open_err("no such file".into()));
    }
    let mut db = match builder().open(path) {
        Ok(db) => db,
        Err(redb::DatabaseError::DatabaseAlreadyOpen) => {
            return Err(StoreError::InUse(path.display().to_string()));
        }
        Err(e) => {
            return Err(open_err(format!(
                "{e}: the store file itself is damaged; restore a backup into a new store file (`fencegate restore`) and bump the epoch"
            )));
        }
    };
    let repaired = !db.check_integrity().map_err(|e| {
        open_err(format!(
            "{e}: the store file itself is damaged; restore a backup into a new store file (`fencegate restore`) and bump the epoch"
        ))
    })?;
    let floor = initialize(&db).map_err(|e| open_err(e.to_string()))?;
    let journal = journal_path(path);
    let saved = match std::fs::File::open(&journal) {
        Ok(f) => Some(
            journal::salvage(&JournalFile(f))
                .map_err(|e| open_err(format!("its journal {}: {e}", journal.display())))?,
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(open_err(format!("its journal {}: {e}", journal.display()))),
    };
    let mut seen = floor.max(saved.as_ref().map_or(0, |s| s.max_epoch));
    Snapshot::of(&db)?.for_each(|_, t| {
        seen = seen.max(t.epoch);
        true
    })?;
    let new_floor = seen
        .checked_add(1)
        .ok_or_else(|| open_err("an epoch of 2^64-1 was seen: no floor can be above it".into()))?
        .max(at_least);
    let (records, mut marks) = match saved {
        Some(s) => (s.records, s.pending.into_iter().collect::<Vec<_>>()),
        None => (0, Vec::new()),
    };
    marks.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    let scopes = marks.len();
    let failed = |e: redb::Error| open_err(e.to_string());
    // The floor first: a crash before the marks' commit leaves the store as damaged as it
    // was (and recover runs again), never marked clean without its floor.
    raise_floor_to(&db, new_floor).map_err(failed)?;
    // Then the salvaged marks, and a journal that starts over (empty, as after a clean
    // close).
    raise_marks(&db, &mut marks, Some((0, true))).map_err(failed)?;
    drop(db);
    let journal_kept = if journal.exists() {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut name = journal.file_name().unwrap_or_default().to_os_string();
        name.push(format!(".damaged-{secs}"));
        let kept = journal.with_file_name(name);
        std::fs::rename(&journal, &kept)
            .and_then(|()| sync_dir(&journal))
            .map_err(|e| open_err(format!("cannot move its journal aside: {e}")))?;
        Some(kept)
    } else {
        None
    };
    Ok(Recovered {
        records,
        scopes,
        floor: new_floor,
        repaired,
        journal_kept,
    })
}

/// Where the journal of the store at `path` lives: next to it, `<file name>.journal`.
pub fn journal_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".journal");
    path.with_file_name(name)
}

/// The journal's file (redb's backend trait, so that tests can inject a failing disk).
#[derive(Debug)]
struct JournalFile(std::fs::File);

impl JournalFile {
    fn open(path: &Path) -> std::io::Result<JournalFile> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        // The file's name must survive a crash as surely as what is written in it (on every
        // open: a run that created it may have crashed before this).
        file.sync_all()?;
        sync_dir(path)?;
        Ok(JournalFile(file))
    }
}

impl StorageBackend for JournalFile {
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&self.0, out, offset)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.0.set_len(len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        self.0.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(&self.0, data, offset)
    }
}

/// Applies what the journal holds to redb in one transaction; returns the journal emptied.
/// Refuses a journal that is damaged, or that does not belong with this store file.
fn recover(db: &Database, file: impl StorageBackend, name: &str) -> Result<Journal, StoreError> {
    let corrupt = |offset: u64, what: String| StoreError::Corrupt {
        path: name.to_string(),
        offset,
        what,
    };
    let failed = |e: redb::Error| StoreError::Open {
        path: name.to_string(),
        reason: e.to_string(),
    };
    let (applied, clean) = journal_meta(db).map_err(failed)?;
    let (mut journal, pending) = Journal::open(file, applied).map_err(|e| match e {
        OpenError::Corrupt(c) => corrupt(c.offset, c.what),
        OpenError::Io(e) => failed(redb::Error::Io(e)),
    })?;
    let generation = journal.generation();
    // No bookkeeping yet: a store from before it was kept, or a new one.
    if let Some(applied) = applied {
        // Generation 0 applied: the first reset (which writes the first header) may have
        // been cut short, so a blank journal lost nothing. From 1 on a header existed.
        if generation == 0 && !clean && applied >= 1 {
            return Err(corrupt(
                0,
                format!(
                    "the journal is missing or blank, but the store file has used one (up to generation {applied}) and was not closed cleanly"
                ),
            ));
        }
        if generation != 0 && generation != applied && generation != applied + 1 {
            let which = if generation > applied {
                "the store file is older than its journal (an older copy of it restored?)"
            } else {
                "the journal is older than the store file (an older copy of it restored?)"
            };
            return Err(corrupt(
                0,
                format!(
                    "the journal's generation is {generation}, the store file's last applied {applied}: {which}"
                ),
            ));
        }
    }
    let mut marks: Vec<(Arc<str>, Mark)> = pending.into_iter().collect();
    if !marks.is_empty() {
        marks.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        tracing::info!(
            scopes = marks.len(),
            "applying the mark journal left by the last run"
        );
    }
    // With the bookkeeping of a running server: not closed cleanly until `close` says so.
    raise_marks(db, &mut marks, Some((generation, false))).map_err(failed)?;
    journal.reset().map_err(|e| failed(redb::Error::Io(e)))?;
    Ok(journal)
}

/// The journal's bookkeeping in redb: the generation last applied (None: never kept) and
/// whether the last close was clean.
fn journal_meta(db: &Database) -> Result<(Option<u64>, bool), redb::Error> {
    let txn = db.begin_read()?;
    let meta = txn.open_table(META)?;
    let applied = meta.get(JOURNAL_APPLIED)?.map(|g| g.value());
    let clean = meta.get(JOURNAL_CLEAN)?.map(|g| g.value()) == Some(1);
    Ok((applied, clean))
}

/// Raises each mark to at least its token in one durable transaction (never lowers one);
/// each token becomes the mark stored.
/// With `journal` = (generation, clean), the journal's bookkeeping is committed with them
/// (see [`JOURNAL_APPLIED`]).
fn raise_marks(
    db: &Database,
    marks: &mut [(Arc<str>, Mark)],
    journal: Option<(u64, bool)>,
) -> Result<(), redb::Error> {
    let mut txn = db.begin_write()?;
    txn.set_durability(Durability::Immediate)
        .map_err(|e| redb::Error::Io(std::io::Error::other(e.to_string())))?;
    let mut changed = false;
    {
        let mut table = txn.open_table(MARKS)?;
        let mut sequences = txn.open_table(SEQUENCES)?;
        for (scope, mark) in marks.iter_mut() {
            changed |= raise(&mut table, &mut sequences, scope, mark)?;
        }
    }
    if let Some((generation, clean)) = journal {
        let mut meta = txn.open_table(META)?;
        let was = (
            meta.get(JOURNAL_APPLIED)?.map(|g| g.value()),
            meta.get(JOURNAL_CLEAN)?.map(|g| g.value()),
        );
        let now = (Some(generation), Some(u64::from(clean)));
        if was != now {
            meta.insert(JOURNAL_APPLIED, generation)?;
            meta.insert(JOURNAL_CLEAN, u64::from(clean))?;
            changed = true;
        }
    }
    if changed {
        txn.commit()?;
    } else {
        txn.abort()?;
    }
    Ok(())
}

/// Raises one mark (and its sequence) to at least `mark`; `mark` becomes what is stored.
/// Answers whether anything changed.
fn raise(
    marks: &mut redb::Table<&str, (u64, u64)>,
    sequences: &mut redb::Table<&str, (u64, u64, u64)>,
    scope: &str,
    mark: &mut Mark,
) -> Result<bool, redb::Error> {
    let mut token = mark.token;
    let mut changed = raise_token(marks, scope, &mut token)?;
    let held = sequence_of(sequences.get(scope)?.map(|g| g.value()), token);
    // A sequence counts for its own token only: under a higher stored one it is void.
    let wanted = mark.sequence.filter(|_| mark.token == token);
    if let Some(n) = wanted.filter(|n| held.is_none_or(|h| *n > h)) {
        sequences.insert(scope, (token.epoch, token.counter, n))?;
        changed = true;
    }
    *mark = Mark {
        token,
        sequence: wanted.max(held),
    };
    Ok(changed)
}

/// The sequence a `SEQUENCES` row holds for `token` (none if it is another token's).
fn sequence_of(row: Option<(u64, u64, u64)>, token: Token) -> Option<u64> {
    row.filter(|(e, c, _)| Token::new(*e, *c) == token)
        .map(|(_, _, n)| n)
}

/// Raises one token to at least `token` in one walk down the tree; `token` becomes the
/// mark stored. Answers whether anything changed.
fn raise_token(
    marks: &mut redb::Table<&str, (u64, u64)>,
    scope: &str,
    token: &mut Token,
) -> Result<bool, redb::Error> {
    // Write, and look at what was there. A higher one found is put back (rare: the gates
    // queue only advances above what they hold, and they hold what is on disk).
    let before = marks.insert(scope, (token.epoch, token.counter))?.map(|g| {
        let (e, c) = g.value();
        Token::new(e, c)
    });
    Ok(match before {
        Some(b) if b > *token => {
            marks.insert(scope, (b.epoch, b.counter))?;
            *token = b;
            false
        }
        Some(b) => b != *token,
        None => true,
    })
}

fn get_mark(db: &impl ReadableDatabase, scope: &str) -> Result<Option<Mark>, StoreError> {
    let txn = db.begin_read().map_err(read_err)?;
    let table = txn.open_table(MARKS).map_err(read_err)?;
    let Some(token) = table.get(scope).map_err(read_err)?.map(|g| {
        let (e, c) = g.value();
        Token::new(e, c)
    }) else {
        return Ok(None);
    };
    let sequence = match txn.open_table(SEQUENCES) {
        Ok(t) => sequence_of(t.get(scope).map_err(read_err)?.map(|g| g.value()), token),
        // A store file from before sequences, read without a writer's open: none yet.
        Err(redb::TableError::TableDoesNotExist(_)) => None,
        Err(e) => return Err(read_err(e)),
    };
    Ok(Some(Mark { token, sequence }))
}

fn list_marks(
    db: &impl ReadableDatabase,
    prefix: &str,
    after: Option<&str>,
    limit: usize,
) -> Result<Vec<(String, Token)>, StoreError> {
    let txn = db.begin_read().map_err(read_err)?;
    let table = txn.open_table(MARKS).map_err(read_err)?;
    let start = match after {
        Some(a) if a >= prefix => a,
        _ => prefix,
    };
    let mut out = Vec::new();
    let mut bytes = 0;
    for item in table.range(start..).map_err(read_err)? {
        let (k, v) = item.map_err(read_err)?;
        let key = k.value();
        if Some(key) == after {
            continue;
        }
        // `listed_all` tells a page cut short by the byte budget by this same rule.
        if !key.starts_with(prefix) || out.len() >= limit || bytes >= LIST_BYTES {
            break;
        }
        let (e, c) = v.value();
        bytes += key.len();
        out.push((key.to_string(), Token::new(e, c)));
    }
    Ok(out)
}

/// Scope bytes after which a listing stops short of its `limit` (see [`listed_all`]): a
/// scope is as long as a request head allows, and 10,000 long ones would take gigabytes.
pub const LIST_BYTES: usize = 4 << 20;

/// Whether a listing asked for `limit` marks holds every mark that was left: it is short
/// of its limit, and not because it reached [`LIST_BYTES`].
pub fn listed_all(marks: &[(String, Token)], limit: usize) -> bool {
    marks.len() < limit && marks.iter().map(|(s, _)| s.len()).sum::<usize>() < LIST_BYTES
}

/// One read transaction: the floor and the marks it shows belong together, whatever is
/// committed meanwhile (a floor read apart from the marks could be older or newer than
/// they are, and a backup of both would never have existed).
pub struct Snapshot {
    txn: redb::ReadTransaction,
}

impl Snapshot {
    fn of(db: &impl ReadableDatabase) -> Result<Snapshot, StoreError> {
        Ok(Snapshot {
            txn: db.begin_read().map_err(read_err)?,
        })
    }

    pub fn floor(&self) -> Result<u64, StoreError> {
        let meta = self.txn.open_table(META).map_err(read_err)?;
        Ok(meta
            .get("epoch_floor")
            .map_err(read_err)?
            .map(|g| g.value())
            .unwrap_or(0))
    }

    /// Every mark in scope order, until `f` answers false.
    pub fn for_each(&self, mut f: impl FnMut(&str, Token) -> bool) -> Result<(), StoreError> {
        let table = self.txn.open_table(MARKS).map_err(read_err)?;
        for item in table.iter().map_err(read_err)? {
            let (k, v) = item.map_err(read_err)?;
            let (e, c) = v.value();
            if !f(k.value(), Token::new(e, c)) {
                break;
            }
        }
        Ok(())
    }
}

/// A read-only view of a store file, for the CLI (works while a server has it open).
pub struct MarkReader {
    db: redb::ReadOnlyDatabase,
}

impl MarkReader {
    pub fn open(path: &Path) -> Result<MarkReader, StoreError> {
        if !path.exists() {
            return Err(StoreError::Open {
                path: path.display().to_string(),
                reason: "no such file".into(),
            });
        }
        let open_err = |e: redb::DatabaseError| StoreError::Open {
            path: path.display().to_string(),
            reason: e.to_string(),
        };
        let journal = journal_path(path);
        let journal_err = |e: std::io::Error| StoreError::Open {
            path: journal.display().to_string(),
            reason: e.to_string(),
        };
        // Whether a run left advances in the journal that redb does not have yet. Read
        // without the store's lock: while a server runs this view may be torn, but then
        // the opens below find the store in use.
        let left = || match std::fs::File::open(&journal) {
            Ok(f) => match Journal::open(JournalFile(f), None) {
                Ok((_, pending)) => Ok(!pending.is_empty()),
                // A running server's journal may look damaged while it is being written
                // (a reset in progress): judged again below, with the store's lock held.
                Err(OpenError::Corrupt(_)) => Ok(true),
                Err(OpenError::Io(e)) => Err(journal_err(e)),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(journal_err(e)),
        };
        // A server may start (and stop) between the look at the journal and the read-only
        // open; the journal is looked at again once the handle is held.
        for _ in 0..3 {
            if left()? {
                // Applying them needs the store for writing, which a running server holds.
                let db = match builder().open(path) {
                    Ok(db) => db,
                    Err(redb::DatabaseError::DatabaseAlreadyOpen) => {
                        return Err(StoreError::InUse(path.display().to_string()));
                    }
                    Err(e) => return Err(open_err(e)),
                };
                let file = JournalFile::open(&journal).map_err(journal_err)?;
                recover(&db, file, &journal.display().to_string())?;
            }
            let db = match builder().open_read_only(path) {
                Ok(db) => db,
                Err(redb::DatabaseError::DatabaseAlreadyOpen) => {
                    return Err(StoreError::InUse(path.display().to_string()));
                }
                // Not closed cleanly (a crash) and nobody has it open: a read-only handle
                // cannot repair, so open it once for writing, which repairs, then read.
                Err(redb::DatabaseError::RepairAborted) => {
                    drop(builder().open(path).map_err(open_err)?);
                    builder().open_read_only(path).map_err(open_err)?
                }
                Err(e) => return Err(open_err(e)),
            };
            if !left()? {
                return Ok(MarkReader { db });
            }
        }
        Err(StoreError::InUse(path.display().to_string()))
    }

    pub fn get(&self, scope: &str) -> Result<Option<Token>, StoreError> {
        Ok(get_mark(&self.db, scope)?.map(|m| m.token))
    }

    /// The mark of one scope with its sequence.
    pub fn get_mark(&self, scope: &str) -> Result<Option<Mark>, StoreError> {
        get_mark(&self.db, scope)
    }

    pub fn list(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Token)>, StoreError> {
        list_marks(&self.db, prefix, after, limit)
    }

    pub fn snapshot(&self) -> Result<Snapshot, StoreError> {
        Snapshot::of(&self.db)
    }
}

struct Writer {
    db: Arc<Database>,
    failed: Arc<AtomicBool>,
    floor: Arc<AtomicU64>,
    stats: Arc<StoreStats>,
    /// None: every batch is a redb commit (stores on test backends without a journal).
    journal: Option<Journal>,
    /// The journal's advances not yet in redb; shared with readers.
    pending: Arc<Mutex<Pending>>,
    /// What the idempotency records take; changed here only, once committed.
    tally: Arc<Mutex<Tally>>,
    /// Where the store file is, for its free space (none on a test backend).
    volume: Option<Volume>,
    /// Shared with the handles: emptied while the file is reopened.
    slot: Slot,
    /// The store file to reopen after a failure (none on a test backend).
    reopen: Arc<Mutex<Option<PathBuf>>>,
}

impl Writer {
    fn run(mut self, rx: mpsc::Receiver<Op>) {
        let mut wait = REOPEN_FIRST;
        let mut next_reopen = Instant::now() + wait;
        loop {
            // A failed store waits for its next reopen as well as for ops (which it fails
            // meanwhile).
            let reopening = self.failed.load(Ordering::Acquire) && self.reopens();
            let first = if reopening {
                match rx.recv_timeout(next_reopen.saturating_duration_since(Instant::now())) {
                    Ok(op) => Some(op),
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
            } else {
                match rx.recv() {
                    Ok(op) => Some(op),
                    Err(_) => return,
                }
            };
            if reopening && Instant::now() >= next_reopen {
                self = self.reopen();
                if self.failed.load(Ordering::Acquire) {
                    wait = (wait * 2).min(REOPEN_MAX);
                } else {
                    wait = REOPEN_FIRST;
                }
                next_reopen = Instant::now() + wait;
            }
            let Some(first) = first else { continue };
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(op) => batch.push(op),
                    Err(_) => break,
                }
            }
            let close = batch
                .iter()
                .position(|op| matches!(op, Op::Close { .. }))
                .map(|i| batch.remove(i));
            if !batch.is_empty() {
                self.commit(batch);
            }
            if let Some(Op::Close { reply }) = close {
                // Dropped before `reply` and the ops still queued: see `commit`.
                let failed = self.failed.clone();
                let fail_closed = FailOnPanic(&failed);
                // A clean stop leaves the journal empty and redb whole.
                if !self.failed.load(Ordering::Acquire) {
                    match self.checkpoint() {
                        Err(e) => {
                            tracing::warn!(error = %e, "checkpoint at close failed; the journal is applied at the next open")
                        }
                        Ok(()) => self.mark_clean(),
                    }
                }
                drop(fail_closed);
                drop(self);
                let _ = reply.send(());
                return;
            }
        }
    }

    /// Records in redb that the journal is empty (after a checkpoint at close): a journal
    /// found missing at the next open lost nothing.
    fn mark_clean(&self) {
        let Some(journal) = &self.journal else { return };
        if let Err(e) = raise_marks(&self.db, &mut [], Some((journal.generation(), true))) {
            tracing::warn!(error = %e, "cannot record the clean close in the store file");
        }
    }

    fn lock_pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether this store reopens its file after a failure (it was opened from a path).
    fn reopens(&self) -> bool {
        self.reopen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// After a failure (a full disk, a write error), reopens the store file as a start-up
    /// would, once the volume has room: redb refuses every operation after an I/O error
    /// until the file is closed. The handles see no database meanwhile (reads fail, as
    /// writes do while failed). Nothing in memory is trusted over the file: the journal's
    /// advances are applied from the journal, the floor and the records' usage are read
    /// again, and the expired records are deleted first. A mark a failed commit may have
    /// written stays (a mark is never lowered); its request was answered 503, never
    /// forwarded. If another handle holds the database (the `local` authority does), or
    /// the reopen fails, the store stays failed and tries again later.
    fn reopen(mut self) -> Writer {
        let Some(path) = self
            .reopen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        else {
            return self;
        };
        if self
            .volume
            .as_ref()
            .and_then(Volume::free)
            .is_some_and(|free| free < REOPEN_FREE)
        {
            return self;
        }
        // Everyone lets go of the database: the handles' reads end within moments.
        let taken = self.slot.write().unwrap_or_else(|p| p.into_inner()).take();
        drop(taken);
        let old = Arc::downgrade(&self.db);
        let placeholder = match placeholder() {
            Ok(db) => Arc::new(db),
            Err(e) => {
                tracing::warn!(error = %e, "cannot reopen the mark store");
                *self.slot.write().unwrap_or_else(|p| p.into_inner()) = Some(self.db.clone());
                return self;
            }
        };
        self.db = placeholder;
        for _ in 0..100 {
            if old.strong_count() == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if let Some(db) = old.upgrade() {
            tracing::warn!(
                "the mark store failed and another part of the process holds its file (the local authority); it reopens at a restart"
            );
            *self.slot.write().unwrap_or_else(|p| p.into_inner()) = Some(db.clone());
            self.db = db;
            *self.reopen.lock().unwrap_or_else(|p| p.into_inner()) = None;
            return self;
        }
        self.journal = None;
        match reopen_parts(&path) {
            Ok((db, journal, floor, tally)) => {
                let db = Arc::new(db);
                self.db = db.clone();
                self.journal = Some(journal);
                self.lock_pending().clear();
                self.floor.store(floor, Ordering::Release);
                *self.tally.lock().unwrap_or_else(|p| p.into_inner()) = tally;
                *self.slot.write().unwrap_or_else(|p| p.into_inner()) = Some(db);
                self.failed.store(false, Ordering::Release);
                // Room first: the expired records go before anything else is committed.
                let (reply, _) = oneshot::channel();
                self.commit_redb(vec![Op::Collect {
                    now: std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs()),
                    limit: REOPEN_COLLECT,
                    reply,
                }]);
                if !self.failed.load(Ordering::Acquire) {
                    tracing::info!(path = %path.display(), "the mark store was reopened after its failure; writes are taken again");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "the mark store could not be reopened yet; trying again later");
            }
        }
        self
    }

    /// Applies the journal's advances to redb, then empties the journal. A failure fails
    /// the store closed (what the journal holds is durable and applied at the next open).
    fn checkpoint(&mut self) -> Result<(), StoreError> {
        let mut marks: Vec<(Arc<str>, Mark)> = self
            .lock_pending()
            .iter()
            .map(|(s, t)| (s.clone(), *t))
            .collect();
        let Some(journal) = self.journal.as_mut().filter(|_| !marks.is_empty()) else {
            return Ok(());
        };
        marks.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let generation = journal.generation();
        let done = raise_marks(&self.db, &mut marks, Some((generation, false)))
            .map_err(|e| e.to_string())
            .and_then(|()| journal.reset().map_err(|e| e.to_string()));
        match done {
            Ok(()) => {
                // Forgotten only now that redb has them (readers look here first).
                self.lock_pending().clear();
                self.stats.checkpoints.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                self.failed.store(true, Ordering::Release);
                self.stats.commit_failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, "mark journal checkpoint failed; the store refuses writes until restarted");
                Err(StoreError::Failed(e))
            }
        }
    }

    fn commit(&mut self, mut batch: Vec<Op>) {
        // Close is handled by `run`; inline stores have nothing to stop.
        batch.retain(|op| !matches!(op, Op::Close { .. }));
        if self.failed.load(Ordering::Acquire) {
            return fail_all(batch, "an earlier commit failed");
        }
        let checkpoints: Vec<_> = {
            let (asked, rest): (Vec<Op>, Vec<Op>) = batch
                .into_iter()
                .partition(|op| matches!(op, Op::Checkpoint { .. }));
            batch = rest;
            asked
        };
        // Declared after every op's owner here (and the functions the batch is handed to
        // have guards of their own), so dropped before them: a panic marks the store failed
        // before any caller hears that its reply is gone.
        let failed = self.failed.clone();
        let _fail_closed = FailOnPanic(&failed);
        if !batch.is_empty() {
            if self.journal.is_some() && batch.iter().all(|op| matches!(op, Op::Advance { .. })) {
                self.journal_advances(batch);
            } else {
                self.commit_redb(batch);
            }
        }
        let due = self.journal.as_ref().is_some_and(Journal::is_long)
            || self.lock_pending().len() >= journal::PENDING_SCOPES;
        if (due || !checkpoints.is_empty()) && !self.failed.load(Ordering::Acquire) {
            let done = self.checkpoint();
            for op in checkpoints {
                if let Op::Checkpoint { reply } = op {
                    // Taken here, before the next batch: nothing is journaled in between.
                    let _ = reply.send(done.clone().and_then(|()| Snapshot::of(&*self.db)));
                }
            }
        } else {
            fail_all(checkpoints, "an earlier commit failed");
        }
    }

    /// A batch of advances only: one journal record, one `fdatasync`.
    fn journal_advances(&mut self, batch: Vec<Op>) {
        // Dropped before `batch` (a parameter): see `commit`.
        let failed = self.failed.clone();
        let _fail_closed = FailOnPanic(&failed);
        let started = Instant::now();
        let mut wanted = wanted(&batch);
        // A batch that raises nothing is durable already: no record, no sync.
        let written = self
            .stored(&mut wanted)
            .and_then(|raised| match self.journal.as_mut() {
                Some(j) if raised => j.append(&wanted).map(|()| true).map_err(|e| e.to_string()),
                Some(_) => Ok(false),
                None => Err("no journal".into()),
            });
        let written = match written {
            Ok(w) => w,
            Err(e) => {
                // A failed write may still have reached the disk: fail closed.
                self.failed.store(true, Ordering::Release);
                self.stats.commit_failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, "mark journal write failed; the store refuses writes until restarted");
                return fail_all(batch, &e);
            }
        };
        if written {
            let mut pending = self.lock_pending();
            for (scope, token) in &wanted {
                pending.insert(scope.clone(), *token);
            }
            drop(pending);
            self.stats
                .commit_seconds
                .observe_duration(started.elapsed());
            self.stats.commit_batch_size.observe(batch.len() as f64);
        }
        for op in batch {
            if let Op::Advance { scope, reply, .. } = op {
                let _ = reply.send(answer_for(&wanted, &scope));
            }
        }
    }

    /// Raises each wanted token to the mark already held for its scope (the journal's
    /// pending one, else redb's), so that what is journaled and answered is the mark.
    /// Answers whether any wanted token is above what is held (else nothing needs writing).
    fn stored(&self, wanted: &mut [(Arc<str>, Mark)]) -> Result<bool, String> {
        let mut raised = false;
        let mut hold = |mark: &mut Mark, held: Option<Mark>| match held {
            Some(h) if h >= *mark => *mark = h,
            _ => raised = true,
        };
        let mut missing = Vec::new();
        {
            // Only this thread changes `pending`: what it shows stays true after the lock.
            let pending = self.lock_pending();
            for (i, (scope, token)) in wanted.iter_mut().enumerate() {
                match pending.get(scope) {
                    Some(p) => hold(token, Some(*p)),
                    None => missing.push(i),
                }
            }
        }
        if !missing.is_empty() {
            let txn = self.db.begin_read().map_err(|e| e.to_string())?;
            let table = txn.open_table(MARKS).map_err(|e| e.to_string())?;
            let sequences = txn.open_table(SEQUENCES).map_err(|e| e.to_string())?;
            for i in missing {
                let (scope, mark) = &mut wanted[i];
                let held = table.get(&**scope).map_err(|e| e.to_string())?.map(|g| {
                    let (e, c) = g.value();
                    Token::new(e, c)
                });
                let held = match held {
                    Some(token) => {
                        let row = sequences.get(&**scope).map_err(|e| e.to_string())?;
                        Some(Mark {
                            token,
                            sequence: sequence_of(row.map(|g| g.value()), token),
                        })
                    }
                    None => None,
                };
                hold(mark, held);
            }
        }
        Ok(raised)
    }

    /// Any batch as one redb transaction.
    fn commit_redb(&self, batch: Vec<Op>) {
        // Dropped before `batch` (a parameter): see `commit`.
        let _fail_closed = FailOnPanic(&self.failed);
        let started = Instant::now();
        match self.apply(&batch) {
            Ok((marks, floor, answers, committed)) => {
                if committed {
                    self.stats
                        .commit_seconds
                        .observe_duration(started.elapsed());
                    self.stats.commit_batch_size.observe(batch.len() as f64);
                }
                self.floor.store(floor, Ordering::Release);
                {
                    // A scope the journal holds keeps there the mark now in redb, so that
                    // a later batch of advances (which trusts the journal's) never answers
                    // less than what is stored.
                    let mut pending = self.lock_pending();
                    for (scope, token) in &marks {
                        if let Some(p) = pending.get_mut(scope) {
                            *p = (*p).max(*token);
                        }
                    }
                }
                for (op, answer) in batch.into_iter().zip(answers) {
                    match op {
                        Op::Claim { reply, .. } => {
                            let _ = reply.send(Ok(match answer {
                                Answer::Claim(claimed) => claimed,
                                _ => Claimed::Claimed,
                            }));
                        }
                        Op::Put { reply, .. } => {
                            let _ = reply.send(Ok(()));
                        }
                        Op::Collect { reply, .. } => {
                            let _ = reply.send(Ok(match answer {
                                Answer::Collected(n) => n,
                                _ => 0,
                            }));
                        }
                        Op::Advance { scope, reply, .. } => {
                            let _ = reply.send(answer_for(&marks, &scope));
                        }
                        Op::Floor { reply, .. } => {
                            let _ = reply.send(Ok(floor));
                        }
                        Op::Close { .. } | Op::Checkpoint { .. } => {}
                    }
                }
            }
            Err(e) => {
                // A failed commit may still have become durable: fail closed.
                self.failed.store(true, Ordering::Release);
                self.stats.commit_failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, "mark commit failed; the store refuses writes until restarted");
                fail_all(batch, &e.to_string());
            }
        }
    }

    /// One transaction for the whole batch; answers the stored mark per scope (sorted by
    /// scope, one entry each) and the floor.
    #[allow(clippy::type_complexity)]
    fn apply(
        &self,
        batch: &[Op],
    ) -> Result<(Vec<(Arc<str>, Mark)>, u64, Vec<Answer>, bool), redb::Error> {
        let mut wanted = wanted(batch);
        let floor_wanted = batch
            .iter()
            .filter_map(|op| match op {
                Op::Floor { epoch, .. } => Some(*epoch),
                _ => None,
            })
            .max();
        {
            // A journaled advance may be ahead of redb: answer the mark, not less.
            let pending = self.lock_pending();
            for (scope, token) in wanted.iter_mut() {
                if let Some(p) = pending.get(scope).filter(|p| **p > *token) {
                    *token = *p;
                }
            }
        }
        let mut txn = self.db.begin_write()?;
        txn.set_durability(Durability::Immediate)
            .map_err(|e| redb::Error::Io(std::io::Error::other(e.to_string())))?;
        let mut changed = false;
        let mut floor = self.floor.load(Ordering::Acquire);
        {
            let mut marks = txn.open_table(MARKS)?;
            let mut sequences = txn.open_table(SEQUENCES)?;
            for (scope, mark) in wanted.iter_mut() {
                changed |= raise(&mut marks, &mut sequences, scope, mark)?;
            }
            if let Some(epoch) = floor_wanted.filter(|e| *e > floor) {
                let mut meta = txn.open_table(META)?;
                meta.insert("epoch_floor", epoch)?;
                floor = epoch;
                changed = true;
            }
        }
        let mut answers = Vec::with_capacity(batch.len());
        let mut usage = Changes::default();
        if batch
            .iter()
            .any(|op| matches!(op, Op::Claim { .. } | Op::Put { .. } | Op::Collect { .. }))
        {
            let tally = self.tally.lock().unwrap_or_else(|p| p.into_inner());
            let mut records = txn.open_table(RECORDS)?;
            let mut expiry = txn.open_table(RECORD_EXPIRY)?;
            let mut owners = txn.open_table(RECORD_OWNER)?;
            let mut t = RecordTables {
                records: &mut records,
                expiry: &mut expiry,
                owners: &mut owners,
                usage: &mut usage,
            };
            for op in batch {
                answers.push(match op {
                    Op::Claim {
                        key,
                        value,
                        replace_if,
                        now,
                        quota,
                        ..
                    } => {
                        let existing = t.records.get(key.as_str())?.map(|g| g.value().to_vec());
                        let live = existing
                            .as_ref()
                            .filter(|v| record_expiry(v) > *now && Some(*v) != replace_if.as_ref());
                        match live {
                            Some(v) => Answer::Claim(Claimed::Held(v.clone())),
                            None => {
                                let (client, bytes) = match quota {
                                    Some((client, q)) => (
                                        client.as_str(),
                                        q.reserve.max(quota::size_of(key, value.len())),
                                    ),
                                    None => ("", quota::size_of(key, value.len())),
                                };
                                if existing.is_some() {
                                    t.remove(key)?;
                                }
                                let refused = match quota {
                                    Some((_, q)) => {
                                        let refused =
                                            t.refuses(&tally, key, client, bytes, q, &self.volume);
                                        if refused.is_some() {
                                            // Expired records first: what they free may be enough.
                                            changed |= t.collect(*now, RECLAIM_BATCH)? > 0;
                                            t.refuses(&tally, key, client, bytes, q, &self.volume)
                                        } else {
                                            None
                                        }
                                    }
                                    None => None,
                                };
                                match refused {
                                    Some(r) => {
                                        // An expired record taken out above stays out.
                                        changed |= existing.is_some();
                                        Answer::Claim(Claimed::Rejected(r))
                                    }
                                    None => {
                                        t.insert(key, value, client, bytes)?;
                                        changed = true;
                                        Answer::Claim(Claimed::Claimed)
                                    }
                                }
                            }
                        }
                    }
                    Op::Put { key, value, .. } => {
                        let present = t
                            .records
                            .get(key.as_str())?
                            .map(|g| record_expiry(g.value()));
                        if let Some(old) = present {
                            let mut v = value.clone();
                            if let Some(head) = v.get_mut(..8) {
                                head.copy_from_slice(&old.to_be_bytes());
                            }
                            t.replace(key, &v)?;
                            changed = true;
                        }
                        Answer::None
                    }
                    Op::Collect { now, limit, .. } => {
                        let n = t.collect(*now, *limit)?;
                        changed |= n > 0;
                        Answer::Collected(n)
                    }
                    _ => Answer::None,
                });
            }
        } else {
            answers.resize_with(batch.len(), || Answer::None);
        }
        if changed {
            txn.commit()?;
            self.tally
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .apply(&usage);
        } else {
            // Everything asked for is already durable; no fsync needed.
            txn.abort()?;
        }
        Ok((wanted, floor, answers, changed))
    }
}

/// The idempotency tables of one write transaction, and the usage it changes.
struct RecordTables<'a, 't> {
    records: &'a mut redb::Table<'t, &'static str, &'static [u8]>,
    expiry: &'a mut redb::Table<'t, (u64, &'static str), ()>,
    owners: &'a mut redb::Table<'t, &'static str, (&'static str, u64)>,
    usage: &'a mut Changes,
}

impl RecordTables<'_, '_> {
    /// Deletes the record under `key` (if any), with its expiry entry and owner row.
    fn remove(&mut self, key: &str) -> Result<(), redb::Error> {
        let Some(old) = self.records.remove(key)?.map(|g| g.value().to_vec()) else {
            return Ok(());
        };
        let (client, bytes) = owner_of(&*self.owners, key, old.len())?;
        self.expiry.remove((record_expiry(&old), key))?;
        self.owners.remove(key)?;
        self.usage
            .add(quota::scope_of(key), &client, Delta::of(1, bytes).neg());
        Ok(())
    }

    /// Inserts a new record counted as `bytes` against `client`.
    fn insert(
        &mut self,
        key: &str,
        value: &[u8],
        client: &str,
        bytes: u64,
    ) -> Result<(), redb::Error> {
        self.records.insert(key, value)?;
        self.expiry.insert((record_expiry(value), key), ())?;
        self.owners.insert(key, (client, bytes))?;
        self.usage
            .add(quota::scope_of(key), client, Delta::of(1, bytes));
        Ok(())
    }

    /// Overwrites a record (its expiry unchanged); it now counts as its own size.
    fn replace(&mut self, key: &str, value: &[u8]) -> Result<(), redb::Error> {
        let old_len = self.records.get(key)?.map_or(0, |g| g.value().len());
        let (client, old) = owner_of(&*self.owners, key, old_len)?;
        let new = quota::size_of(key, value.len());
        self.records.insert(key, value)?;
        self.owners.insert(key, (client.as_str(), new))?;
        let scope = quota::scope_of(key);
        self.usage.add(scope, &client, Delta::of(1, new));
        self.usage.add(scope, &client, Delta::of(1, old).neg());
        Ok(())
    }

    /// Deletes up to `limit` records expired by `now`; answers how many.
    fn collect(&mut self, now: u64, limit: usize) -> Result<usize, redb::Error> {
        let due: Vec<String> = self
            .expiry
            .range(..(now + 1, ""))?
            .take(limit)
            .map(|item| item.map(|(k, _)| k.value().1.to_string()))
            .collect::<Result<_, _>>()?;
        for key in &due {
            self.remove(key)?;
        }
        Ok(due.len())
    }

    /// Which bound one more record would pass, if any: the quota's, then the volume's
    /// free space (asked only when the counts allow the record).
    fn refuses(
        &self,
        tally: &Tally,
        key: &str,
        client: &str,
        bytes: u64,
        q: &RecordQuota,
        volume: &Option<Volume>,
    ) -> Option<Rejected> {
        self.usage
            .refuses(tally, quota::scope_of(key), client, bytes, q)
            .or_else(|| {
                let free = volume.as_ref().and_then(Volume::free)?;
                (free < q.min_free.saturating_add(bytes)).then_some(Rejected::Disk)
            })
    }
}

/// The advances of a batch in scope order (the tree's order), one per scope: its highest.
fn wanted(batch: &[Op]) -> Vec<(Arc<str>, Mark)> {
    let mut wanted: Vec<(Arc<str>, Mark)> = batch
        .iter()
        .filter_map(|op| match op {
            Op::Advance { scope, mark, .. } => Some((scope.clone(), *mark)),
            _ => None,
        })
        .collect();
    wanted.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
    wanted.dedup_by(|later, kept| later.0 == kept.0);
    wanted
}

/// The mark stored for `scope` by a batch whose (sorted) marks are `marks`.
fn answer_for(marks: &[(Arc<str>, Mark)], scope: &str) -> Result<Mark, StoreError> {
    marks
        .binary_search_by(|(s, _)| (**s).cmp(scope))
        .map(|i| marks[i].1)
        .map_err(|_| StoreError::Failed("scope missing from batch".into()))
}

/// Fails the store closed if dropped while the writer panics: the panicking commit's
/// outcome on disk is unknown, and the writer thread is about to end.
struct FailOnPanic<'a>(&'a AtomicBool);

impl Drop for FailOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Release);
            tracing::error!(
                "the mark store's writer panicked; the store refuses writes until restarted"
            );
        }
    }
}

fn fail_all(batch: Vec<Op>, why: &str) {
    for op in batch {
        match op {
            Op::Advance { reply, .. } => {
                let _ = reply.send(Err(StoreError::Failed(why.to_string())));
            }
            Op::Floor { reply, .. } => {
                let _ = reply.send(Err(StoreError::Failed(why.to_string())));
            }
            Op::Claim { reply, .. } => {
                let _ = reply.send(Err(StoreError::Failed(why.to_string())));
            }
            Op::Put { reply, .. } => {
                let _ = reply.send(Err(StoreError::Failed(why.to_string())));
            }
            Op::Collect { reply, .. } => {
                let _ = reply.send(Err(StoreError::Failed(why.to_string())));
            }
            Op::Checkpoint { reply } => {
                let _ = reply.send(Err(StoreError::Failed(why.to_string())));
            }
            Op::Close { .. } => {}
        }
    }
}

/// The expiry stamped at the front of an idempotency record.
fn record_expiry(value: &[u8]) -> u64 {
    value
        .get(..8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map_or(0, u64::from_be_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn advance(scope: &str, token: u64) -> (Op, oneshot::Receiver<Result<Mark, StoreError>>) {
        sequenced(scope, token, None)
    }

    fn sequenced(
        scope: &str,
        token: u64,
        sequence: Option<u64>,
    ) -> (Op, oneshot::Receiver<Result<Mark, StoreError>>) {
        let (reply, rx) = oneshot::channel();
        let op = Op::Advance {
            scope: Arc::from(scope),
            mark: Mark {
                token: Token::new(1, token),
                sequence,
            },
            reply,
        };
        (op, rx)
    }

    /// Once a send to the writer fails (its thread has gone), the store is failed: readiness
    /// and metrics must not go on saying it works.
    #[test]
    fn a_writer_gone_fails_the_store() {
        let store = MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new())
            .expect("open");
        let (tx, rx) = mpsc::channel();
        drop(rx);
        let gone = MarkStore {
            inner: Arc::new(Inner {
                db: Arc::new(std::sync::RwLock::new(store.database())),
                reopen: Arc::default(),
                stats: Arc::default(),
                commits: Commits::Thread(tx),
                failed: Arc::default(),
                floor: Arc::default(),
                pending: Arc::default(),
                tally: Arc::default(),
            }),
        };
        assert!(!gone.is_failed());
        assert!(
            gone.begin_advance(Arc::from("s"), Mark::of(Token::new(0, 1)))
                .is_err()
        );
        assert!(gone.is_failed());
    }

    /// A listing of long scope names stops at `LIST_BYTES`, says it did, and the rest
    /// follows from where it stopped.
    #[test]
    fn a_listing_of_long_scopes_stops_at_its_byte_budget() {
        let store = MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new())
            .expect("open");
        let Commits::Inline(writer) = &store.inner.commits else {
            panic!("inline store expected");
        };
        let mut writer = writer.lock().unwrap();
        let long = |i: usize| format!("{i:03}{}", "s".repeat(60_000));
        let n = LIST_BYTES / 60_000 + 10;
        writer.commit((0..n).map(|i| advance(&long(i), 1).0).collect());
        let first = store.list("", None, 10_000).expect("list");
        assert!(first.len() < n, "{}", first.len());
        assert!(!listed_all(&first, 10_000));
        let after = first.last().map(|m| m.0.as_str());
        let rest = store.list("", after, 10_000).expect("list");
        assert!(listed_all(&rest, 10_000));
        assert_eq!(first.len() + rest.len(), n);
        assert_eq!(rest.last().map(|m| m.0.clone()), Some(long(n - 1)));
        // Short names: the count decides.
        let few = store.list("0", None, 3).expect("list");
        assert_eq!(few.len(), 3);
        assert!(!listed_all(&few, 3));
    }

    /// A scope the journal holds, then raised further by a batch that had to go to redb
    /// (an advance sharing it with a floor raise): a later batch of lower advances answers
    /// the mark stored, not the journal's older one.
    #[test]
    fn a_journaled_scope_never_answers_less_than_is_stored() {
        let db = Database::builder()
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .expect("db");
        let store = MarkStore::start(
            db,
            Some(redb::backends::InMemoryBackend::new()),
            true,
            "<test>",
            None,
        )
        .expect("open");
        let Commits::Inline(writer) = &store.inner.commits else {
            panic!("inline store expected");
        };
        let mut writer = writer.lock().unwrap();
        let (a3, r3) = advance("s", 3);
        writer.commit(vec![a3]);
        assert_eq!(answer(r3), Some(3));
        assert!(
            store.list("", None, 10).expect("list").is_empty(),
            "journaled"
        );
        let (a7, r7) = advance("s", 7);
        let (floor, _floor_rx) = oneshot::channel();
        writer.commit(vec![
            a7,
            Op::Floor {
                epoch: 0,
                reply: floor,
            },
        ]);
        assert_eq!(answer(r7), Some(7));
        let records = store.stats().commit_batch_size_count();
        let (a5, r5) = advance("s", 5);
        writer.commit(vec![a5]);
        assert_eq!(answer(r5), Some(7));
        assert_eq!(
            store.stats().commit_batch_size_count(),
            records,
            "a batch that raises nothing writes nothing"
        );
        assert_eq!(store.get("s").expect("read"), Some(Token::new(1, 7)));
    }

    fn answer(mut rx: oneshot::Receiver<Result<Mark, StoreError>>) -> Option<u64> {
        rx.try_recv().ok()?.ok().map(|t| t.token.counter)
    }

    fn answer_mark(
        mut rx: oneshot::Receiver<Result<Mark, StoreError>>,
    ) -> Option<(u64, Option<u64>)> {
        rx.try_recv()
            .ok()?
            .ok()
            .map(|m| (m.token.counter, m.sequence))
    }

    /// A sequence is stored with its token, in redb (no journal) and through the journal
    /// (then the checkpoint): the highest per token wins, a lower one is answered the
    /// stored one, a new token starts over, and an advance without a sequence keeps the
    /// token's.
    #[test]
    fn sequences_are_stored_with_their_token_and_never_go_back() {
        let journaled = || {
            let db = Database::builder()
                .create_with_backend(redb::backends::InMemoryBackend::new())
                .expect("db");
            MarkStore::start(
                db,
                Some(redb::backends::InMemoryBackend::new()),
                true,
                "<test>",
                None,
            )
            .expect("open")
        };
        let plain = || {
            MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new())
                .expect("open")
        };
        for store in [journaled(), plain()] {
            let Commits::Inline(writer) = &store.inner.commits else {
                panic!("inline store expected");
            };
            let mut writer = writer.lock().unwrap();
            let (a, ra) = sequenced("s", 3, Some(2));
            let (b, rb) = sequenced("s", 3, Some(5));
            writer.commit(vec![a, b]);
            assert_eq!(
                answer_mark(ra),
                Some((3, Some(5))),
                "one batch: the highest"
            );
            assert_eq!(answer_mark(rb), Some((3, Some(5))));
            let (c, rc) = sequenced("s", 3, Some(4));
            writer.commit(vec![c]);
            assert_eq!(answer_mark(rc), Some((3, Some(5))), "never back");
            let (d, rd) = advance("s", 3);
            writer.commit(vec![d]);
            assert_eq!(answer_mark(rd), Some((3, Some(5))), "kept without one");
            writer.checkpoint().expect("checkpoint");
            let seq = |n| Mark {
                token: Token::new(1, 3),
                sequence: Some(n),
            };
            assert_eq!(store.get_mark("s").expect("read"), Some(seq(5)));
            let (e, re) = advance("s", 4);
            writer.commit(vec![e]);
            assert_eq!(answer_mark(re), Some((4, None)), "a new token starts over");
            let (f, rf) = sequenced("s", 4, Some(1));
            writer.commit(vec![f]);
            assert_eq!(answer_mark(rf), Some((4, Some(1))));
            let (g, rg) = sequenced("s", 3, Some(9));
            writer.commit(vec![g]);
            assert_eq!(
                answer_mark(rg),
                Some((4, Some(1))),
                "an old token's is void"
            );
            writer.checkpoint().expect("checkpoint");
            assert_eq!(
                store.get_mark("s").expect("read"),
                Some(Mark {
                    token: Token::new(1, 4),
                    sequence: Some(1)
                })
            );
        }
    }

    /// One batch: the highest token per scope wins whatever the order, every member reads
    /// what was stored, a lower advance never lowers a mark, and a batch that changes
    /// nothing commits nothing.
    #[test]
    fn a_batch_stores_the_highest_token_per_scope_and_never_lowers_one() {
        let store = MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new())
            .expect("open");
        let Commits::Inline(writer) = &store.inner.commits else {
            panic!("inline store expected");
        };
        let mut writer = writer.lock().unwrap();
        let (a5, ra5) = advance("a", 5);
        let (b2, rb2) = advance("b", 2);
        let (a7, ra7) = advance("a", 7);
        let (a6, ra6) = advance("a", 6);
        writer.commit(vec![a5, b2, a7, a6]);
        assert_eq!(
            [answer(ra5), answer(rb2), answer(ra7), answer(ra6)],
            [Some(7), Some(2), Some(7), Some(7)]
        );
        assert_eq!(store.get("a").expect("read"), Some(Token::new(1, 7)));
        assert_eq!(store.get("b").expect("read"), Some(Token::new(1, 2)));
        assert_eq!(store.stats().commit_batch_size_count(), 1);

        // Lower and equal advances answer the stored marks, leave them, and need no commit.
        let (a3, ra3) = advance("a", 3);
        let (b2, rb2) = advance("b", 2);
        writer.commit(vec![a3, b2]);
        assert_eq!([answer(ra3), answer(rb2)], [Some(7), Some(2)]);
        assert_eq!(store.get("a").expect("read"), Some(Token::new(1, 7)));
        assert_eq!(store.stats().commit_batch_size_count(), 1);

        // A lower advance in a batch that changes something else is put back, not lowered.
        let (a4, ra4) = advance("a", 4);
        let (c9, rc9) = advance("c", 9);
        writer.commit(vec![a4, c9]);
        assert_eq!([answer(ra4), answer(rc9)], [Some(7), Some(9)]);
        assert_eq!(store.get("a").expect("read"), Some(Token::new(1, 7)));
        assert_eq!(store.get("c").expect("read"), Some(Token::new(1, 9)));
        assert_eq!(store.stats().commit_batch_size_count(), 2);
    }

    fn quota(records: u64, bytes: u64) -> RecordQuota {
        let u = quota::Usage { records, bytes };
        RecordQuota {
            total: quota::Usage {
                records: 100,
                bytes: 1 << 20,
            },
            per_scope: u,
            per_client: u,
            reserve: 100,
            min_free: 0,
        }
    }

    fn record(expires: u64, len: usize) -> Vec<u8> {
        let mut v = expires.to_be_bytes().to_vec();
        v.resize(8 + len, b'x');
        v
    }

    /// A claim counts as the reserve until its completion is written, then as its size;
    /// past a bound it is refused and nothing is written; an expired record is deleted by
    /// the refused claim first, and what it took is free again; the usage is rebuilt
    /// from the file when the store is opened again.
    #[tokio::test]
    async fn records_are_claimed_within_their_quota() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("m.redb");
        let store = MarkStore::open(&path).expect("open");
        let q = Some(("c1".to_string(), quota(2, 1000)));
        let claim = |key: &str, expires: u64, q: Option<(String, RecordQuota)>| {
            let store = store.clone();
            let key = key.to_string();
            async move {
                store
                    .claim_within(key, record(expires, 10), None, 50, q)
                    .await
                    .expect("claim")
            }
        };
        assert_eq!(claim("s\0a", 100, q.clone()).await, Claimed::Claimed);
        let (total, scope, client) = store.record_usage("s", "c1");
        assert_eq!((total.records, total.bytes), (1, 100), "the reserve");
        assert_eq!((scope, client), (total, total));
        // Completed: its own size (key 3 bytes + value 18).
        store
            .put_record("s\0a".into(), record(0, 10))
            .await
            .expect("put");
        assert_eq!(store.record_usage("s", "c1").0.bytes, 21);
        // An expired one, then one past the client's count.
        assert_eq!(claim("s\0b", 10, q.clone()).await, Claimed::Claimed);
        let past = claim("s\0c", 100, q.clone()).await;
        assert_eq!(past, Claimed::Claimed, "the expired record made room");
        assert!(store.record("s\0b").expect("read").is_none());
        assert_eq!(
            claim("s\0d", 100, q.clone()).await,
            Claimed::Rejected(Rejected::Scope)
        );
        assert_eq!(
            claim("t\0d", 100, q.clone()).await,
            Claimed::Rejected(Rejected::Client)
        );
        assert_eq!(
            claim("t\0d", 100, Some(("c2".into(), quota(2, 1000)))).await,
            Claimed::Claimed
        );
        assert_eq!(store.record_count().expect("count"), 3);
        let big = Some(("c3".to_string(), quota(10, 150)));
        assert_eq!(
            claim("u\0e", 100, big.clone()).await,
            Claimed::Claimed,
            "bytes: 100 of 150"
        );
        assert_eq!(
            claim("u\0f", 100, big).await,
            Claimed::Rejected(Rejected::Scope),
            "bytes: 200 of 150"
        );
        let usage = store.record_usage("s", "c1");
        assert_eq!(store.record_owners(), (3, 3));
        store.close().await;
        drop(store);
        let again = MarkStore::open(&path).expect("reopen");
        assert_eq!(again.record_usage("s", "c1"), usage);
        assert_eq!(again.record_owners(), (3, 3));
        // Everything expires: the tally empties with the records.
        assert_eq!(again.collect_records(1000, 100).await.expect("collect"), 4);
        assert_eq!(again.record_owners(), (0, 0));
        assert_eq!(again.record_usage("s", "c1").0, quota::Usage::default());
    }
}
