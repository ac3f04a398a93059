//! The writer thread: the only owner of write transactions. It takes everything queued,
//! applies it in one batch (journal append or redb commit, one sync: group commit), answers
//! only then, and fails the store closed on a failed commit until it can reopen the file.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use redb::{Database, Durability, ReadableDatabase, ReadableTable};
use tokio::sync::oneshot;

use crate::metrics::histogram::Histogram;
use crate::store::Mark;
use crate::store::journal::{self, Journal, Pending};
use crate::store::quota::{Changes, Tally, Volume};
use crate::token::Token;

use super::records::{Claim, RECORD_EXPIRY, RECORD_OWNER, RECORDS, RecordTables, record_expiry};
use super::recover::reopen_parts;
use super::tables::{
    MARKS, META, SEQUENCES, Snapshot, placeholder, raise, raise_marks, sequence_of,
};
use super::{Answer, Claimed, Op, StoreError};

/// A failed store tries to reopen its file this long after the failure, then twice as
/// long after each attempt that fails, up to [`REOPEN_MAX`].
pub(super) const REOPEN_FIRST: Duration = Duration::from_secs(1);

pub(super) const REOPEN_MAX: Duration = Duration::from_secs(30);

/// Free bytes the volume needs before a reopen is tried: the reopen writes (redb's
/// repair, the journal's advances).
pub(super) const REOPEN_FREE: u64 = 4 << 20;

/// Expired records deleted right after a reopen, before anything else is committed.
pub(super) const REOPEN_COLLECT: usize = 100_000;

/// Upper bound on advances in one commit, so one batch cannot starve replies for long.
pub(super) const MAX_BATCH: usize = 4096;

pub(super) struct Writer {
    pub(super) db: Arc<Database>,
    pub(super) failed: Arc<AtomicBool>,
    pub(super) floor: Arc<AtomicU64>,
    pub(super) stats: Arc<StoreStats>,
    /// None: every batch is a redb commit (stores on test backends without a journal).
    pub(super) journal: Option<Journal>,
    /// The journal's advances not yet in redb; shared with readers.
    pub(super) pending: Arc<Mutex<Pending>>,
    /// What the idempotency records take; changed here only, once committed.
    pub(super) tally: Arc<Mutex<Tally>>,
    /// Where the store file is, for its free space (none on a test backend).
    pub(super) volume: Option<Volume>,
    /// Shared with the handles: emptied while the file is reopened.
    pub(super) slot: Slot,
    /// The store file to reopen after a failure (none on a test backend).
    pub(super) reopen: Arc<Mutex<Option<PathBuf>>>,
}

impl Writer {
    pub(super) fn run(mut self, rx: mpsc::Receiver<Op>) {
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
    pub(super) fn mark_clean(&self) {
        let Some(journal) = &self.journal else { return };
        if let Err(e) = raise_marks(&self.db, &mut [], Some((journal.generation(), true))) {
            tracing::warn!(error = %e, "cannot record the clean close in the store file");
        }
    }

    pub(super) fn lock_pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether this store reopens its file after a failure (it was opened from a path).
    pub(super) fn reopens(&self) -> bool {
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
    pub(super) fn reopen(mut self) -> Writer {
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
    pub(super) fn checkpoint(&mut self) -> Result<(), StoreError> {
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

    pub(super) fn commit(&mut self, mut batch: Vec<Op>) {
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
    pub(super) fn journal_advances(&mut self, batch: Vec<Op>) {
        // Dropped before `batch` (a parameter): see `commit`.
        let failed = self.failed.clone();
        let _fail_closed = FailOnPanic(&failed);
        let started = Instant::now();
        let mut wanted = wanted(&batch);
        // A batch that raises nothing is durable already: no record, no sync.
        let written = self
            .stored(&mut wanted)
            .and_then(|raised| match self.journal.as_mut() {
                Some(j) if raised => j.append(&wanted).map(|()| true).map_err(JournalWrite::from),
                Some(_) => Ok(false),
                None => Err(JournalWrite::NoJournal),
            });
        let written = match written {
            Ok(w) => w,
            Err(e) => {
                // A failed write may still have reached the disk: fail closed.
                self.failed.store(true, Ordering::Release);
                self.stats.commit_failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, "mark journal write failed; the store refuses writes until restarted");
                return fail_all(batch, &e.to_string());
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
    pub(super) fn stored(&self, wanted: &mut [(Arc<str>, Mark)]) -> Result<bool, JournalWrite> {
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
            let txn = self.db.begin_read()?;
            let table = txn.open_table(MARKS)?;
            let sequences = txn.open_table(SEQUENCES)?;
            for i in missing {
                let (scope, mark) = &mut wanted[i];
                let held = table.get(&**scope)?.map(|g| {
                    let (e, c) = g.value();
                    Token::new(e, c)
                });
                let held = match held {
                    Some(token) => {
                        let row = sequences.get(&**scope)?;
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
    pub(super) fn commit_redb(&self, batch: Vec<Op>) {
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
    pub(super) fn apply(
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
                    } => Answer::Claim(t.claim(
                        &tally,
                        &self.volume,
                        Claim {
                            key,
                            value,
                            replace_if: replace_if.as_ref(),
                            now: *now,
                            quota: quota.as_ref(),
                        },
                        &mut changed,
                    )?),
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

/// The advances of a batch in scope order (the tree's order), one per scope: its highest.
pub(super) fn wanted(batch: &[Op]) -> Vec<(Arc<str>, Mark)> {
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
pub(super) fn answer_for(marks: &[(Arc<str>, Mark)], scope: &str) -> Result<Mark, StoreError> {
    marks
        .binary_search_by(|(s, _)| (**s).cmp(scope))
        .map(|i| marks[i].1)
        .map_err(|_| StoreError::Failed("scope missing from batch".into()))
}

/// Fails the store closed if dropped while the writer panics: the panicking commit's
/// outcome on disk is unknown, and the writer thread is about to end.
pub(super) struct FailOnPanic<'a>(&'a AtomicBool);

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

/// Why a batch of advances could not be journaled: reading the marks held, or writing
/// the record (the store then fails closed).
#[derive(Debug, thiserror::Error)]
pub(super) enum JournalWrite {
    #[error(transparent)]
    Transaction(#[from] redb::TransactionError),
    #[error(transparent)]
    Table(#[from] redb::TableError),
    #[error(transparent)]
    Storage(#[from] redb::StorageError),
    #[error(transparent)]
    Journal(#[from] std::io::Error),
    #[error("no journal")]
    NoJournal,
}

pub(super) fn fail_all(batch: Vec<Op>, why: &str) {
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

/// The open database, shared by the handles and the writer: the writer takes it out to
/// reopen the file after a failure ([`Writer::reopen`]).
pub(super) type Slot = Arc<std::sync::RwLock<Option<Arc<Database>>>>;

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
