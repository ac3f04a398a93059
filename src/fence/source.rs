//! Where the gates' marks live when they are not the local store's: in a cluster
//! (SPEC §10), the marks of the shards this instance owns, in etcd, with a copy in memory.
//!
//! The gates ([`super::gate`]) decide as they always do, under each scope's lock; a
//! [`MarkSource`] answers the three questions whose answer changes in a cluster:
//! may this instance decide for the scope at all right now ([`MarkSource::admits`]: it
//! owns the scope's shard, its ownership is valid, any takeover wait is over), what the
//! scope's mark is ([`MarkSource::get_mark`]), and how an advance is made durable
//! ([`MarkSource::begin_advance`]).
//!
//! **Views.** A source's marks for a scope may be replaced from outside the gates: a
//! shard claimed again after another instance owned it (and advanced its marks), or
//! reloaded after a commit whose outcome was lost. `admits` answers the *view* in force
//! for the scope, a number that changes whenever that happens; a gate that last decided
//! under another view takes the source's mark first (raising, never lowering, its own).

use std::sync::Arc;

use tokio::sync::oneshot;

use crate::store::Mark;
use crate::store::marks::StoreError;

/// The receiver of one advance's outcome: the mark stored, once durable.
pub type Pending = oneshot::Receiver<Result<Mark, StoreError>>;

/// The marks the gates decide against, and whether they may decide (see the module doc).
/// Called under a gate's lock: implementations must not call back into the gates, and
/// must not block.
pub trait MarkSource: Send + Sync + 'static {
    /// Whether this instance may decide for `scope` now: the view in force (never 0), or
    /// `None` (the request is refused `unavailable`: retry).
    fn admits(&self, scope: &str) -> Option<u64>;

    /// The scope's mark in the view in force; an error if this instance cannot say (it
    /// does not own the scope's shard).
    fn get_mark(&self, scope: &str) -> Result<Option<Mark>, StoreError>;

    /// Queues the advance of `scope` to at least `mark`; the receiver answers the mark
    /// stored once it is durable. It must never answer a mark that is not durable.
    fn begin_advance(&self, scope: Arc<str>, mark: Mark) -> Result<Pending, StoreError>;
}
