//! The durable state: the marks in redb ([`marks`]: the handle, the writer thread and
//! group commit, the tables, the idempotency records, recovery, the read-only reader) and
//! the write-ahead journal of advances ([`journal`]) that makes a batch durable with one
//! append and one sync.

pub mod config;
pub mod journal;
pub mod marks;
mod metrics;
pub mod quota;

pub use marks::{MarkStore, Snapshot, StoreError};

use crate::token::Token;

/// A scope's durable state: its high-water mark and, for that very token, the highest
/// `Fencing-Sequence` accepted (SPEC §11). Ordered as (token, sequence), no sequence
/// below any: a higher token outranks every sequence of a lower one, so taking the max
/// (a batch, a replay of the journal) starts the sequence over with a new token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Mark {
    pub token: Token,
    pub sequence: Option<u64>,
}

impl Mark {
    /// A mark without a sequence.
    pub const fn of(token: Token) -> Mark {
        Mark {
            token,
            sequence: None,
        }
    }
}
