//! The sharded map of hot gates: which shard a scope hashes to, how gates are made (from
//! the durable mark), evicted when a shard is full and swept when idle.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::store::Mark;
use crate::store::marks::StoreError;
use crate::token::Token;

use super::Gates;
use super::state::{Gate, GateState};

pub(super) const SHARDS: usize = 64;

/// Gates idle this long are dropped by the sweeper.
pub(super) const IDLE_TTL: Duration = Duration::from_secs(30);

/// Hot gates (in total, over all shards) before idle ones are evicted at once, whatever
/// their age: memory must not grow with a burst of new scopes.
pub(super) const DEFAULT_HOT_CAPACITY: usize = 131_072;

/// Bytes of scope names the hot gates hold (in total) before idle ones are evicted at
/// once: a scope is as long as a request head allows (64 KiB by default), and the count
/// alone would let long ones take gigabytes.
pub(super) const DEFAULT_HOT_BYTES: usize = 64 << 20;

/// Called with the shard locked. Only the map holds an evictable gate, so nobody can be
/// waiting on it or about to use it; its state is all on disk. So is the start-up settle
/// (`restart`) of a scope with a mark: a gate made again gets the same, so a flood of
/// existing scopes after a restart does not pin its gates in memory.
pub(super) fn evictable(
    gate: &Arc<Gate>,
    now: Instant,
    idle_for: Duration,
    restart: (Token, Instant),
) -> bool {
    if Arc::strong_count(gate) > 1 {
        return false;
    }
    let st = gate.lock();
    st.inflight.is_empty()
        && st.advancing.is_none()
        && st
            .settle
            .is_none_or(|settle| now >= settle.1 || settle == restart)
        && st.seq_settle.is_none_or(|(_, _, until)| now >= until)
        && st
            .last_used
            .is_none_or(|t| now.duration_since(t) >= idle_for)
}

/// The hot gates of the scopes that hash to one shard.
#[derive(Default)]
pub(super) struct Shard {
    pub(super) gates: HashMap<Arc<str>, Arc<Gate>>,
    /// Bytes of the scope names in `gates`.
    pub(super) bytes: usize,
    /// Gates evicted from this shard so far (see [`Gates::gate`]).
    pub(super) evicted: u64,
}

impl Shard {
    /// Drops the gates `keep` refuses, counting them as evicted.
    pub(super) fn evict(&mut self, mut keep: impl FnMut(&Arc<Gate>) -> bool) {
        let before = self.gates.len();
        let mut freed = 0;
        self.gates.retain(|scope, g| {
            let kept = keep(g);
            if !kept {
                freed += scope.len();
            }
            kept
        });
        self.bytes -= freed;
        self.evicted += (before - self.gates.len()) as u64;
    }
}

/// The shard of `scope`: FNV-1a from a per-process seed, then murmur3's 64-bit finalizer
/// (FNV alone leaves the last bytes, where scopes like `report/7` and `report/8` differ,
/// out of most bits; a shard that fills evicts its idle gates early). A few instructions
/// per byte where SipHash takes a hundred or so. Each shard's map keeps std's keyed
/// SipHash, so a client that crowds scopes into one shard only makes that shard's lock
/// busier and its gates go idle sooner, never its lookups slower.
pub(super) fn shard_index(seed: u64, scope: &str) -> usize {
    let mut h = seed;
    for &b in scope.as_bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    (h % SHARDS as u64) as usize
}

impl Gates {
    pub(super) fn shard(&self, scope: &str) -> MutexGuard<'_, Shard> {
        self.shards[shard_index(self.shard_seed, scope)]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn gate(&self, scope: &str) -> Result<(Arc<str>, Arc<Gate>), StoreError> {
        let evicted = {
            let shard = self.shard(scope);
            if let Some((k, g)) = shard.gates.get_key_value(scope) {
                return Ok((k.clone(), g.clone()));
            }
            shard.evicted
        };
        // Read outside the shard lock: a read may wait for the disk.
        let mark = self.read_mark(scope)?;
        self.insert(scope, mark, evicted)
    }

    /// Makes the gate of `scope` from `mark`, read from disk when the shard had evicted
    /// `evicted` gates; or answers the gate another request made meanwhile.
    pub(super) fn insert(
        &self,
        scope: &str,
        mut mark: Option<Mark>,
        evicted: u64,
    ) -> Result<(Arc<str>, Arc<Gate>), StoreError> {
        let settle_until = self.started + self.settle;
        let mut shard = self.shard(scope);
        if let Some((k, g)) = shard.gates.get_key_value(scope) {
            return Ok((k.clone(), g.clone()));
        }
        // Every advance goes through a gate, so the mark read cannot have moved since,
        // unless a gate of this scope was made, advanced and evicted in the meantime (a
        // gate made stale would accept the old mark's token, now stale): read it again,
        // with the lock keeping new gates out. Rare: it takes an eviction in this shard.
        if shard.evicted != evicted {
            mark = self.read_mark(scope)?;
        }
        if shard.gates.len() >= self.shard_capacity || shard.bytes + scope.len() > self.shard_bytes
        {
            let now = Instant::now();
            let restart = (Token::new(0, 0), settle_until);
            shard.evict(|g| !evictable(g, now, Duration::ZERO, restart));
        }
        // Which generation was at the backend when the process stopped is unknown: an
        // advance is made durable before older requests drain, so requests older than
        // the mark may still be in flight. Every generation therefore waits out the
        // start-up settle, the mark's own included (a lower token is stale anyway);
        // 0:0, the lowest token, as the settling generation says so.
        let settle = mark
            .filter(|_| Instant::now() < settle_until)
            .map(|_| (Token::new(0, 0), settle_until));
        let key: Arc<str> = Arc::from(scope);
        let gate = Arc::new(Gate {
            state: Mutex::new(GateState {
                current: mark.map(|m| m.token),
                sequence: mark.and_then(|m| m.sequence),
                settle,
                ..GateState::default()
            }),
            notify: Notify::new(),
        });
        shard.gates.insert(key.clone(), gate.clone());
        shard.bytes += key.len();
        Ok((key, gate))
    }

    /// Number of gates in memory (hot scopes).
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).gates.len())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a hot gate of a scope that `of` selects has a request at the backend, an
    /// advance being committed or an abandoned request settling: what a shard handed off
    /// in a cluster waits out before it is released.
    pub fn busy(&self, of: impl Fn(&str) -> bool) -> bool {
        let now = Instant::now();
        self.shards.iter().any(|shard| {
            let shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            shard.gates.iter().any(|(scope, gate)| {
                if !of(scope) {
                    return false;
                }
                let st = gate.lock();
                !st.inflight.is_empty()
                    || st.advancing.is_some()
                    || st.seq_advancing.is_some()
                    || st.settle.is_some_and(|(_, until)| now < until)
                    || st.seq_settle.is_some_and(|(_, _, until)| now < until)
            })
        })
    }

    /// Drops gates that nobody holds, with nothing in flight, nothing to settle and no
    /// use for `IDLE_TTL`. Their marks stay on disk.
    pub fn sweep(&self) {
        let now = Instant::now();
        for shard in &self.shards {
            let mut shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            shard.evict(|gate| {
                // Only the map holds it: nobody can be waiting or about to use it.
                if Arc::strong_count(gate) > 1 {
                    return true;
                }
                let st = gate.lock();
                let busy = !st.inflight.is_empty()
                    || st.advancing.is_some()
                    || st.settle.is_some_and(|(_, until)| now < until)
                    || st.seq_settle.is_some_and(|(_, _, until)| now < until);
                busy || st
                    .last_used
                    .is_some_and(|t| now.duration_since(t) < IDLE_TTL)
            });
        }
    }
}
