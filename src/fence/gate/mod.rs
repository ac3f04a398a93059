//! Per-scope generation gates (SPEC §3, invariants 2 and 3).
//!
//! A gate knows the scope's current generation (mirroring the durable mark), how many
//! requests of each generation are in flight at the backend, and until when the scope
//! must settle after an abandoned upstream request. A higher token is made durable first,
//! then waits until every older in-flight request has finished and the scope has settled.
//! Gates of idle scopes are dropped; the mark store stays the truth.
//!
//! Requests of one token that carry a `Fencing-Sequence` (SPEC §11) are ordered the same
//! way within their generation: a sequence is recorded durably with the mark before its
//! request is forwarded, one not above the recorded one is refused, and a higher one
//! waits until every lower one of its token in flight has finished (or settled).
//!
//! One concern per file: [`state`] (what a gate knows), [`decide`] (one look at a gate:
//! what a request does next), [`admit`] (the admission loop), [`commit`] (advances and
//! sequence records in flight to the writer), [`guard`] (what an admitted request holds),
//! [`map`] (the sharded map of hot gates, eviction and the sweep).

mod admit;
mod commit;
mod decide;
mod guard;
mod map;
mod state;
#[cfg(test)]
mod tests;

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::fence::source::{MarkSource, Pending};
use crate::metrics::Metrics;
use crate::store::Mark;
use crate::store::marks::{MarkStore, StoreError};
use crate::token::Token;

use self::guard::Trees;
use self::map::{DEFAULT_HOT_BYTES, DEFAULT_HOT_CAPACITY, SHARDS, Shard};

pub(crate) use self::commit::MIN_COMMIT_WAIT;
pub use self::guard::{Admission, InflightGuard, TreeHold};

/// Why a fenced request was not admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    Stale {
        highest: Option<Token>,
    },
    Draining {
        highest: Option<Token>,
    },
    Unavailable,
    /// The `Fencing-Proof` did not verify (SPEC §9); nothing was advanced.
    InvalidProof(String),
    /// The request's `Fencing-Sequence` is not above `sequence`, the highest recorded for
    /// its token (SPEC §11).
    StaleSequence {
        highest: Option<Token>,
        sequence: u64,
    },
}

/// A proof to check before admission: the request's `Fencing-Proof` bytes and the keys
/// that may have signed it.
#[derive(Clone, Copy)]
pub struct Proof<'a> {
    pub keys: &'a crate::proof::ProofKeys,
    pub bytes: &'a [u8],
}

/// All gates of one process.
pub struct Gates {
    shards: Vec<Mutex<Shard>>,
    /// Seeds the shard choice (see [`Gates::shard`]).
    shard_seed: u64,
    store: MarkStore,
    /// Where the marks come from instead of `store`, if set (a cluster's owned shards).
    source: Option<Arc<dyn MarkSource>>,
    metrics: Arc<Metrics>,
    drain_timeout: Duration,
    settle: Duration,
    /// Start-up instant: after a restart every scope settles until `started + settle`.
    started: Instant,
    /// Requests waiting at a gate right now (for metrics and tests).
    waiting: AtomicUsize,
    /// Per-scope bounds: one generation's requests at the backend, and waiters.
    max_inflight: usize,
    max_waiters: usize,
    /// Hot gates per shard before idle ones are evicted regardless of age.
    shard_capacity: usize,
    /// Bytes of scope names per shard before idle gates are evicted regardless of age.
    shard_bytes: usize,
    /// Collection operations in flight (SPEC §16).
    trees: Arc<Trees>,
}

impl Gates {
    pub fn new(
        store: MarkStore,
        metrics: Arc<Metrics>,
        drain_timeout: Duration,
        settle: Duration,
    ) -> Gates {
        Gates {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            shard_seed: std::collections::hash_map::RandomState::new().hash_one(0u64),
            store,
            source: None,
            metrics,
            drain_timeout,
            settle,
            started: Instant::now(),
            waiting: AtomicUsize::new(0),
            max_inflight: usize::MAX,
            max_waiters: usize::MAX,
            shard_capacity: DEFAULT_HOT_CAPACITY / SHARDS,
            shard_bytes: DEFAULT_HOT_BYTES / SHARDS,
            trees: Arc::default(),
        }
    }

    /// How many scopes may stay hot (in memory) at once, at most; beyond, idle gates are
    /// evicted as new scopes arrive.
    pub fn with_hot_capacity(mut self, scopes: usize) -> Gates {
        self.shard_capacity = (scopes / SHARDS).max(1);
        self
    }

    /// How many bytes of scope names the hot gates may hold at once, at most (spread over
    /// the shards); beyond, idle gates are evicted as new scopes arrive.
    pub fn with_hot_bytes(mut self, bytes: usize) -> Gates {
        self.shard_bytes = (bytes / SHARDS).max(1);
        self
    }

    /// Bounds per scope; beyond either, requests are refused with `Draining`.
    pub fn with_limits(mut self, max_inflight: usize, max_waiters: usize) -> Gates {
        self.max_inflight = max_inflight.max(1);
        self.max_waiters = max_waiters;
        self
    }

    /// Takes the marks from `source` instead of the store, and decides only when it
    /// admits (SPEC §10: a cluster's owned shards).
    pub fn with_source(mut self, source: Arc<dyn MarkSource>) -> Gates {
        self.source = Some(source);
        self
    }

    pub fn store(&self) -> &MarkStore {
        &self.store
    }

    /// Holds the tree of scopes beneath `scope` (those that extend it with `/`) for a
    /// collection operation (SPEC §16): from now until the hold is released, a request
    /// admitted to a scope beneath it is refused `Draining`. The caller then reads the
    /// marks beneath `scope` ([`MarkStore::marked_beneath`]) and refuses if there is
    /// one. Either that read sees a mark that lands concurrently, or that mark's request
    /// sees this hold: a request is checked against the holds only once its mark is
    /// durable.
    pub fn hold_tree(&self, scope: &str) -> TreeHold {
        self.trees.hold(scope)
    }

    /// The scope's mark, from the source if there is one, else from the store.
    fn read_mark(&self, scope: &str) -> Result<Option<Mark>, StoreError> {
        match &self.source {
            Some(source) => source.get_mark(scope),
            None => self.store.get_mark(scope),
        }
    }

    fn begin_advance(&self, scope: Arc<str>, mark: Mark) -> Result<Pending, StoreError> {
        match &self.source {
            Some(source) => source.begin_advance(scope, mark),
            None => self.store.begin_advance(scope, mark),
        }
    }

    /// The mark as the gates see it (memory if hot, else disk).
    pub fn mark(&self, scope: &str) -> Result<Option<Token>, StoreError> {
        if let Some(g) = self.shard(scope).gates.get(scope) {
            return Ok(g.lock().current);
        }
        Ok(self.read_mark(scope)?.map(|m| m.token))
    }

    /// The mark with its `Fencing-Sequence`, as the gates see it (memory if hot, else disk).
    pub fn mark_with_sequence(&self, scope: &str) -> Result<Option<Mark>, StoreError> {
        if let Some(g) = self.shard(scope).gates.get(scope) {
            let st = g.lock();
            return Ok(st.current.map(|token| Mark {
                token,
                sequence: st.sequence,
            }));
        }
        self.read_mark(scope)
    }

    /// Requests waiting at a gate for an older generation to drain or settle.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }
}
