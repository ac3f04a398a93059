//! The durable state: the marks in redb ([`marks`]: the writer task, group commit, the
//! tables, backup and recovery) and the write-ahead journal of advances ([`journal`]) that
//! makes a batch durable with one append and one sync.

pub mod config;
pub mod journal;
pub mod marks;

pub use marks::{MarkStore, Snapshot, StoreError};
