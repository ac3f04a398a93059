//! The shards this instance owns, as the gates see them: the [`MarkSource`] of a cluster
//! (SPEC §10).
//!
//! For each shard it owns, the instance holds the epoch it claimed it at, every mark of
//! the shard (loaded from etcd at the claim, then kept up to date with each commit), and
//! until when a takeover keeps it from admitting. The gates decide in memory, as on one
//! instance: equal and stale tokens cost no etcd round trip. An advance goes to etcd
//! through the [`MarkWriter`], guarded by the shard's epoch; only a committed mark is
//! answered, and only then taken into memory.
//!
//! **When the instance may decide for a scope** ([`MarkSource::admits`]): it owns the
//! scope's shard, the shard is neither draining (a planned hand-off) nor being reloaded,
//! its takeover wait is over, and the ownership is valid now (its self-fencing deadline,
//! [`Validity`], has not passed). Anything else is refused `unavailable`, which asks the
//! client to retry.
//!
//! **Outcomes.** An advance answered [`CommitError::Deposed`] means the shard is someone
//! else's: it is dropped here at once. One answered [`CommitError::Unknown`] may have
//! committed: the shard admits nothing until its marks are read again from etcd (merged
//! with memory, taking the higher of each, as both hold only committed marks), under a new
//! view, so every gate takes the reloaded mark before it decides again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::marks::{Advance, CommitError, EtcdMarks, MarkWriter, ReadError, WriterStats};
use super::ownership::{Ownership, Validity};
use super::shard::shard_of;
use crate::fence::source::{MarkSource, Pending};
use crate::store::Mark;
use crate::store::marks::StoreError;

/// What an owned shard is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Deciding for its scopes (once the takeover wait, if any, is over).
    Admitting,
    /// A planned hand-off: admitting nothing while what it admitted drains.
    Draining,
    /// A commit's outcome was lost: admitting nothing until its marks are read again.
    Reloading,
}

/// An owned shard, as [`OwnedShards::owned`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedShard {
    pub shard: u32,
    pub epoch: u64,
    pub state: State,
    /// Admits nothing before this (the takeover wait).
    pub admit_after: Instant,
    /// Marks held in memory.
    pub marks: usize,
}

struct Owned {
    epoch: u64,
    view: u64,
    admit_after: Instant,
    state: State,
    marks: HashMap<Arc<str>, Mark>,
    /// The stop of the exchanges admitted under this ownership: each holds a receiver
    /// until it is over (its response body read from the upstream to its end), so the
    /// count of receivers is the count of exchanges in flight. Set (or dropped, with the
    /// ownership) to make them give up ([`OwnedShards::cut`]).
    stop: watch::Sender<bool>,
}

/// The owned shards of one instance (cheap to clone).
#[derive(Clone)]
pub struct OwnedShards {
    inner: Arc<Inner>,
}

struct Inner {
    shards: u32,
    etcd: EtcdMarks,
    writer: MarkWriter,
    validity: Validity,
    table: Box<[RwLock<Option<Owned>>]>,
    /// The last view handed out (views start at 1: 0 is a gate that never decided).
    views: AtomicU64,
    /// Shards to read again (a commit's outcome was lost).
    reloads: mpsc::UnboundedSender<(u32, u64)>,
    reloader: std::sync::Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(task) = self
            .reloader
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            task.abort();
        }
    }
}

fn not_owned(shard: u32) -> StoreError {
    StoreError::Failed(format!("shard {shard} is not owned by this instance"))
}

impl OwnedShards {
    /// No shard owned yet; marks go to `ownership`'s etcd, guarded by its claims. Starts
    /// the mark writer and the reloader on the current runtime.
    pub fn new(ownership: &Ownership, shards: u32) -> OwnedShards {
        let etcd = EtcdMarks::new(ownership);
        let (reloads, rx) = mpsc::unbounded_channel();
        let inner = Arc::new(Inner {
            shards: shards.max(1),
            writer: MarkWriter::spawn(etcd.clone()),
            etcd,
            validity: ownership.validity(),
            table: (0..shards.max(1)).map(|_| RwLock::new(None)).collect(),
            views: AtomicU64::new(0),
            reloads,
            reloader: std::sync::Mutex::new(None),
        });
        let task = tokio::spawn(reload(Arc::downgrade(&inner), rx));
        *inner.reloader.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
        OwnedShards { inner }
    }

    pub fn shards(&self) -> u32 {
        self.inner.shards
    }

    /// The shard of `scope` in this cluster.
    pub fn shard_of(&self, scope: &str) -> u32 {
        shard_of(scope, self.inner.shards)
    }

    pub fn writer_stats(&self) -> &WriterStats {
        self.inner.writer.stats()
    }

    /// Starts owning `shard`, claimed at `epoch`: loads its marks from etcd, then admits
    /// from `admit_after` on (the takeover wait's end; now for a planned hand-off).
    /// Answers how many marks it loaded. A load that fails leaves the shard not owned here
    /// (the caller may try again, or release it).
    pub async fn take(
        &self,
        shard: u32,
        epoch: u64,
        admit_after: Instant,
    ) -> Result<usize, ReadError> {
        let Some(slot) = self.inner.table.get(shard as usize) else {
            return Err(ReadError::Etcd(format!(
                "shard {shard} is outside the cluster's {} shards",
                self.inner.shards
            )));
        };
        let loaded = self.inner.etcd.load(shard).await?;
        let count = loaded.len();
        let marks = loaded
            .into_iter()
            .map(|(scope, mark)| (Arc::<str>::from(scope), mark))
            .collect();
        *write(slot) = Some(Owned {
            epoch,
            view: self.inner.next_view(),
            admit_after,
            state: State::Admitting,
            marks,
            stop: watch::Sender::new(false),
        });
        Ok(count)
    }

    /// A planned hand-off begins: the shard admits nothing from now on (what it admitted
    /// drains). Answers false if it is not owned here at `epoch`.
    pub fn drain(&self, shard: u32, epoch: u64) -> bool {
        self.inner.set_state(shard, epoch, State::Draining)
    }

    /// A hand-off that did not happen (its release failed, and the balance gives the shard
    /// back to this instance): the shard admits again. False if it is not owned here at
    /// `epoch` and draining.
    pub fn resume(&self, shard: u32, epoch: u64) -> bool {
        let Some(slot) = self.inner.table.get(shard as usize) else {
            return false;
        };
        match write(slot).as_mut() {
            Some(o) if o.epoch == epoch && o.state == State::Draining => {
                o.state = State::Admitting;
                // A hand-off that cut its exchanges: the next ones have a stop not set.
                if *o.stop.borrow() {
                    o.stop = watch::Sender::new(false);
                }
                true
            }
            _ => false,
        }
    }

    /// The stop of an exchange admitted now for a scope of `shard` (see `Owned::stop`):
    /// it resolves once the ownership's exchanges are cut or the ownership is forgotten
    /// here. None if the shard is not owned here (the exchange must give up at once).
    pub fn exchange_stop(&self, shard: u32) -> Option<watch::Receiver<bool>> {
        let slot = self.inner.table.get(shard as usize)?;
        read(slot).as_ref().map(|o| o.stop.subscribe())
    }

    /// How many exchanges admitted under the ownership of `shard` at `epoch` are still in
    /// flight: sent, or their response body still being read from the upstream (whatever
    /// their in-flight count at the gate says: a body whose client stopped reading lets
    /// go of that, not of the upstream).
    pub fn exchanges(&self, shard: u32, epoch: u64) -> usize {
        let Some(slot) = self.inner.table.get(shard as usize) else {
            return 0;
        };
        read(slot)
            .as_ref()
            .filter(|o| o.epoch == epoch)
            .map_or(0, |o| o.stop.receiver_count())
    }

    /// Makes every exchange admitted under the ownership of `shard` at `epoch` give up
    /// (a hand-off that could not drain): one still waiting for its answer ends with 504,
    /// one streaming its response body has it cut. False if not owned here at `epoch`.
    pub fn cut(&self, shard: u32, epoch: u64) -> bool {
        let Some(slot) = self.inner.table.get(shard as usize) else {
            return false;
        };
        match read(slot).as_ref() {
            Some(o) if o.epoch == epoch => {
                o.stop.send_replace(true);
                true
            }
            _ => false,
        }
    }

    /// Whether the exchanges of the ownership of `shard` at `epoch` were cut (and the
    /// shard has not admitted again since): a hand-off tried again after a release that
    /// failed is then undrained, whatever is in flight now.
    pub fn was_cut(&self, shard: u32, epoch: u64) -> bool {
        let Some(slot) = self.inner.table.get(shard as usize) else {
            return false;
        };
        read(slot)
            .as_ref()
            .is_some_and(|o| o.epoch == epoch && *o.stop.borrow())
    }

    /// Stops owning `shard` (released, or found lost): its marks are forgotten here, and
    /// its exchanges still in flight are cut (their stop resolves).
    pub fn forget(&self, shard: u32) {
        if let Some(slot) = self.inner.table.get(shard as usize) {
            *write(slot) = None;
        }
    }

    /// Until when the shard, owned here at `epoch`, admits nothing (its takeover wait).
    pub fn admit_after(&self, shard: u32, epoch: u64) -> Option<Instant> {
        let slot = self.inner.table.get(shard as usize)?;
        read(slot)
            .as_ref()
            .filter(|o| o.epoch == epoch)
            .map(|o| o.admit_after)
    }

    /// The shard's epoch, if owned here.
    pub fn epoch(&self, shard: u32) -> Option<u64> {
        let slot = self.inner.table.get(shard as usize)?;
        read(slot).as_ref().map(|o| o.epoch)
    }

    /// Every shard owned here, in order.
    pub fn owned(&self) -> Vec<OwnedShard> {
        self.inner
            .table
            .iter()
            .enumerate()
            .filter_map(|(i, slot)| {
                read(slot).as_ref().map(|o| OwnedShard {
                    shard: i as u32,
                    epoch: o.epoch,
                    state: o.state,
                    admit_after: o.admit_after,
                    marks: o.marks.len(),
                })
            })
            .collect()
    }
}

fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|p| p.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|p| p.into_inner())
}

impl Inner {
    fn next_view(&self) -> u64 {
        self.views.fetch_add(1, Ordering::Relaxed) + 1
    }

    fn set_state(&self, shard: u32, epoch: u64, state: State) -> bool {
        let Some(slot) = self.table.get(shard as usize) else {
            return false;
        };
        match write(slot).as_mut() {
            Some(o) if o.epoch == epoch => {
                o.state = state;
                true
            }
            _ => false,
        }
    }

    /// An advance of `shard` at `epoch` committed (`Ok`) or not: memory follows.
    fn committed(
        &self,
        shard: u32,
        epoch: u64,
        scope: Arc<str>,
        result: &Result<Mark, CommitError>,
    ) {
        let Some(slot) = self.table.get(shard as usize) else {
            return;
        };
        let mut slot = write(slot);
        let Some(owned) = slot.as_mut().filter(|o| o.epoch == epoch) else {
            return;
        };
        match result {
            Ok(mark) => {
                let held = owned.marks.entry(scope).or_insert(*mark);
                *held = (*held).max(*mark);
            }
            Err(CommitError::Deposed { .. }) => {
                tracing::warn!(shard, epoch, "shard deposed: another instance owns it now");
                *slot = None;
            }
            Err(CommitError::Unknown(e)) => {
                if owned.state != State::Reloading {
                    tracing::warn!(shard, epoch, error = %e, "a commit's outcome is unknown: reloading the shard's marks");
                    owned.state = State::Reloading;
                    let _ = self.reloads.send((shard, epoch));
                }
            }
            Err(CommitError::Stopped) => {}
        }
    }
}

/// Reads shards again whose commit outcome was lost, until each succeeds or the shard is
/// no longer owned at that epoch. A mark that cannot be read leaves the shard refusing,
/// loudly.
async fn reload(inner: std::sync::Weak<Inner>, mut rx: mpsc::UnboundedReceiver<(u32, u64)>) {
    while let Some((shard, epoch)) = rx.recv().await {
        let mut pause = std::time::Duration::from_millis(50);
        loop {
            let Some(inner) = inner.upgrade() else {
                return;
            };
            let Some(slot) = inner.table.get(shard as usize) else {
                break;
            };
            let still = read(slot)
                .as_ref()
                .is_some_and(|o| o.epoch == epoch && o.state == State::Reloading);
            if !still || inner.validity.is_lost() {
                break;
            }
            match inner.etcd.load(shard).await {
                Ok(loaded) => {
                    let view = inner.next_view();
                    if let Some(o) = write(slot)
                        .as_mut()
                        .filter(|o| o.epoch == epoch && o.state == State::Reloading)
                    {
                        for (scope, mark) in loaded {
                            let held = o.marks.entry(Arc::from(scope)).or_insert(mark);
                            *held = (*held).max(mark);
                        }
                        o.view = view;
                        o.state = State::Admitting;
                        tracing::info!(shard, epoch, "shard's marks reloaded");
                    }
                    break;
                }
                Err(e @ ReadError::Corrupt { .. }) => {
                    tracing::error!(shard, epoch, error = %e, "shard's marks unreadable: refusing its scopes");
                    break;
                }
                Err(e) => {
                    tracing::debug!(shard, epoch, error = %e, "reload failed; trying again");
                }
            }
            drop(inner);
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(std::time::Duration::from_secs(1));
        }
    }
}

impl MarkSource for OwnedShards {
    fn admits(&self, scope: &str) -> Option<u64> {
        let shard = self.shard_of(scope);
        let slot = read(&self.inner.table[shard as usize]);
        let owned = slot.as_ref()?;
        let now = Instant::now();
        let admitting = owned.state == State::Admitting
            && now >= owned.admit_after
            && self.inner.validity.valid_at(now);
        admitting.then_some(owned.view)
    }

    fn get_mark(&self, scope: &str) -> Result<Option<Mark>, StoreError> {
        let shard = self.shard_of(scope);
        let slot = read(&self.inner.table[shard as usize]);
        match slot.as_ref() {
            Some(owned) => Ok(owned.marks.get(scope).copied()),
            None => Err(not_owned(shard)),
        }
    }

    fn begin_advance(&self, scope: Arc<str>, mark: Mark) -> Result<Pending, StoreError> {
        let shard = self.shard_of(&scope);
        let epoch = {
            let slot = read(&self.inner.table[shard as usize]);
            match slot.as_ref() {
                Some(o) if o.state == State::Admitting => o.epoch,
                _ => return Err(not_owned(shard)),
            }
        };
        let committing = self.inner.writer.begin_advance(Advance {
            shard,
            epoch,
            scope: scope.clone(),
            mark,
        });
        let (tx, rx) = oneshot::channel();
        let inner = self.inner.clone();
        // Memory takes the mark before the gate hears of it: a gate made again from
        // memory (after an eviction) never sees less than a gate that decided on it.
        tokio::spawn(async move {
            let result = committing.await.unwrap_or(Err(CommitError::Stopped));
            inner.committed(shard, epoch, scope, &result);
            let _ = tx.send(result.map_err(|e| StoreError::Failed(e.to_string())));
        });
        Ok(rx)
    }
}
