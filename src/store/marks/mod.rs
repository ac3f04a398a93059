//! The durable mark store: per-scope high-water marks in redb.
//!
//! One writer thread owns every write transaction. Callers queue advances; the writer takes
//! everything queued, applies the max per scope in one transaction, commits with immediate
//! durability (one fsync for the whole batch: group commit), and only then answers. A
//! failed commit fails the store closed: redb says a failed commit may still be durable,
//! so nothing in memory may be trusted to match the disk until the file is opened again:
//! by the writer itself once the volume has room ([`Writer::reopen`](writer::Writer::reopen)), or by a restart. A
//! writer that panics or stops fails the store closed for good.
//!
//! One concern per file: [`handle`] (the [`MarkStore`] callers hold), [`writer`] (the
//! writer thread and group commit), [`tables`] (the schema, reads and raises of marks, snapshots),
//! [`records`] (the idempotency records' tables), [`recover`] (journal replay, reopening
//! and `store recover`), [`reader`] (the read-only [`MarkReader`]). Shared by
//! the handle and the writer, here: the queue's operations and answers, and the errors.

mod handle;
mod reader;
mod records;
mod recover;
mod tables;
#[cfg(test)]
mod tests;
mod writer;

use std::sync::Arc;

use tokio::sync::oneshot;

use super::Mark;
use super::quota::{RecordQuota, Rejected};

pub use self::handle::MarkStore;
pub use self::reader::MarkReader;
pub use self::recover::{Recovered, journal_path, recover_store};
pub use self::tables::{LIST_BYTES, Snapshot, listed_all};
pub use self::writer::StoreStats;

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
