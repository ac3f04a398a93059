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

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use crate::fence::policy::EqualPolicy;
use crate::fence::policy::{Decision, decide};
use crate::fence::source::{MarkSource, Pending};
use crate::metrics::Metrics;
use crate::store::Mark;
use crate::store::marks::{MarkStore, StoreError, writer_stopped};
use crate::token::Token;

const SHARDS: usize = 64;
/// Gates idle this long are dropped by the sweeper.
const IDLE_TTL: Duration = Duration::from_secs(30);
/// Hot gates (in total, over all shards) before idle ones are evicted at once, whatever
/// their age: memory must not grow with a burst of new scopes.
const DEFAULT_HOT_CAPACITY: usize = 131_072;
/// Bytes of scope names the hot gates hold (in total) before idle ones are evicted at
/// once: a scope is as long as a request head allows (64 KiB by default), and the count
/// alone would let long ones take gigabytes.
const DEFAULT_HOT_BYTES: usize = 64 << 20;

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

#[derive(Debug, Default)]
struct GateState {
    /// The durable mark as far as this process has seen it; never ahead of disk.
    current: Option<Token>,
    /// The highest sequence recorded for `current`, as far as this process has seen it;
    /// never ahead of disk.
    sequence: Option<u64>,
    /// The highest advance being committed right now, if any.
    advancing: Option<Token>,
    /// The highest sequence being recorded right now, with its token.
    seq_advancing: Option<(Token, u64)>,
    /// Sequenced requests forwarded and not yet finished: (token, sequence), a handful.
    seq_inflight: Vec<(Token, u64)>,
    /// (token, sequence, until): a sequenced request was abandoned; no higher sequence of
    /// its token is forwarded before `until`.
    seq_settle: Option<(Token, u64, Instant)>,
    /// The recorded sequence of the current token whose request was never forwarded
    /// (refused after its record, or gone): its retry may take it, once, as an
    /// `equal = "reject"` retry takes an unclaimed advance.
    seq_unclaimed: Option<(Token, u64)>,
    /// Requests forwarded and not yet finished, per generation, oldest first. Rarely more
    /// than one generation: a vector keeps its buffer when it empties, where a map would
    /// allocate and free a node for every request.
    inflight: Inflight,
    /// (generation, until): a request of this generation was abandoned; nothing higher
    /// is forwarded before `until`.
    settle: Option<(Token, Instant)>,
    last_used: Option<Instant>,
    /// Requests waiting at this gate.
    waiters: usize,
    /// The current mark, when the request that advanced to it was never forwarded (it was
    /// refused after its commit, 503 `draining` or `unavailable`, or went away). Those
    /// answers say "retry with the same token", so on an `equal = "reject"` route the
    /// token still admits one request: the retry. Kept while the gate is in memory.
    unclaimed: Option<Token>,
    /// (token, n): `n` requests of `token` were admitted and not known to have been left
    /// unsent ([`InflightGuard::not_forwarded`] takes its own back). An advance is left
    /// unclaimed only when none of its token's requests may have reached the upstream: a
    /// scope can be shared by a `reject` route and an `accept` route that admits the
    /// same token meanwhile.
    admitted: Option<(Token, u32)>,
    /// The last proof verified for this scope, with its token: the steady path (the same
    /// token and proof, request after request) compares bytes instead of verifying an
    /// Ed25519 signature again. Another proof for the same token is verified.
    verified: Option<(Token, Box<[u8]>)>,
    /// The [`MarkSource`] view this gate last decided under (0: none yet, or no source);
    /// see [`crate::fence::source`].
    view: u64,
}

/// In-flight counts per generation, sorted by token, no zero counts.
#[derive(Debug, Default)]
struct Inflight(Vec<(Token, usize)>);

impl Inflight {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn older_than(&self, token: Token) -> bool {
        self.0.first().is_some_and(|(t, _)| *t < token)
    }

    fn count(&self, token: Token) -> usize {
        self.0
            .binary_search_by(|(t, _)| t.cmp(&token))
            .map_or(0, |i| self.0[i].1)
    }

    fn add(&mut self, token: Token) {
        match self.0.binary_search_by(|(t, _)| t.cmp(&token)) {
            Ok(i) => self.0[i].1 += 1,
            Err(i) => self.0.insert(i, (token, 1)),
        }
    }

    fn remove(&mut self, token: Token) {
        if let Ok(i) = self.0.binary_search_by(|(t, _)| t.cmp(&token)) {
            self.0[i].1 -= 1;
            if self.0[i].1 == 0 {
                self.0.remove(i);
            }
        }
    }
}

#[derive(Debug)]
struct Gate {
    state: Mutex<GateState>,
    notify: Notify,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        // A panic while holding the lock leaves the state consistent enough (every update
        // is a single assignment); keep serving rather than poisoning the scope forever.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What an admitted request holds while it is at the backend.
#[derive(Debug)]
pub struct Admission {
    pub guard: InflightGuard,
    /// This request advanced the mark (first of its generation here).
    pub advanced: bool,
    pub waited: Duration,
}

/// Counts a request in flight for its generation. Dropping it without [`complete`]
/// means the upstream may still apply the request later: the scope settles.
///
/// [`complete`]: InflightGuard::complete
#[derive(Debug)]
pub struct InflightGuard {
    gate: Arc<Gate>,
    token: Token,
    /// The request's recorded `Fencing-Sequence`, if it had one.
    sequence: Option<u64>,
    settle: Duration,
    completed: bool,
    /// This admission's request advanced the mark (or took an unclaimed advance).
    advanced: bool,
    /// Nothing of this admission reached the upstream (see [`InflightGuard::not_forwarded`]).
    unused: bool,
    /// A collection operation's hold on the tree beneath its scope (SPEC §16), released
    /// with this guard: at once if the upstream answered, else once the scope has settled.
    tree: Option<Box<TreeHold>>,
}

impl InflightGuard {
    /// Keeps `hold` (the tree this request may change whole) until this guard drops.
    pub fn hold_tree(&mut self, hold: TreeHold) {
        self.tree = Some(Box::new(hold));
    }

    /// The upstream answered (or provably never received the request).
    pub fn complete(&mut self) {
        self.completed = true;
    }

    /// The request was refused after admission and nothing of it reached the upstream
    /// (a 502 before sending, a refused or unreadable body, an idempotency refusal).
    /// If it advanced the mark, its token still admits one request on an
    /// `equal = "reject"` route: the retry those answers ask for (see
    /// [`GateState::unclaimed`]).
    pub fn not_forwarded(&mut self) {
        self.completed = true;
        self.unused = true;
    }

    pub fn token(&self) -> Token {
        self.token
    }

    /// The `Fencing-Sequence` this request was admitted with.
    pub fn sequence(&self) -> Option<u64> {
        self.sequence
    }

    /// One more count for this request's generation, with the same rules: for a stage
    /// that goes on after this guard has been handed over (the idempotency stage reads the
    /// response body the guard travels with). It keeps the generation in flight until it
    /// drops, and makes the scope settle if dropped without [`complete`].
    ///
    /// [`complete`]: InflightGuard::complete
    pub fn hold(&self) -> InflightGuard {
        let mut st = self.gate.lock();
        st.inflight.add(self.token);
        if let Some(n) = self.sequence {
            st.seq_inflight.push((self.token, n));
        }
        drop(st);
        InflightGuard {
            gate: self.gate.clone(),
            token: self.token,
            sequence: self.sequence,
            settle: self.settle,
            completed: false,
            advanced: false,
            unused: false,
            tree: None,
        }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        if let Some(mut tree) = self.tree.take() {
            tree.release(self.completed, self.settle);
        }
        let mut st = self.gate.lock();
        st.inflight.remove(self.token);
        if let Some(n) = self.sequence
            && let Some(i) = st.seq_inflight.iter().position(|e| *e == (self.token, n))
        {
            st.seq_inflight.swap_remove(i);
        }
        // A completed request leaves `last_used` at its admission (no clock read on the
        // common path): a gate idle for `IDLE_TTL` since then, with nothing in flight, may
        // be swept; its mark is on disk.
        if !self.completed {
            let now = Instant::now();
            let until = now + self.settle;
            st.settle = Some(match st.settle {
                Some((g, u)) => (g.max(self.token), u.max(until)),
                None => (self.token, until),
            });
            if let Some(n) = self.sequence {
                st.seq_settle = Some(match st.seq_settle {
                    Some((t, s, u)) if t == self.token => (t, s.max(n), u.max(until)),
                    _ => (self.token, n, until),
                });
            }
            st.last_used = Some(now);
        }
        if self.unused {
            if let Some(n) = self.sequence {
                unclaim_sequence(&mut st, self.token, n);
            }
            if let Some((t, n)) = &mut st.admitted
                && *t == self.token
            {
                *n = n.saturating_sub(1);
            }
            if self.advanced {
                unclaim(&mut st, self.token);
            }
        }
        drop(st);
        self.gate.notify.notify_waiters();
    }
}

/// Collection operations in flight: the scopes beneath which each may change objects
/// whole, and until when a hold stays after its request was abandoned (the backend may
/// still apply it). A handful at most; looked at by every admission, so the common case
/// (none) is one atomic load.
#[derive(Debug, Default)]
struct Trees {
    /// Holds in the list, expired or not: 0 spares admissions the lock.
    count: AtomicUsize,
    holds: Mutex<Vec<Held>>,
    next: std::sync::atomic::AtomicU64,
}

#[derive(Debug)]
struct Held {
    id: u64,
    /// The scope with a `/` appended: what every scope beneath it starts with.
    beneath: Box<str>,
    /// `Some`: released by a request that did not complete; held until then.
    until: Option<Instant>,
}

impl Trees {
    fn lock(&self) -> MutexGuard<'_, Vec<Held>> {
        self.holds.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn hold(self: &Arc<Self>, scope: &str) -> TreeHold {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut holds = self.lock();
        let now = Instant::now();
        holds.retain(|h| h.until.is_none_or(|u| now < u));
        holds.push(Held {
            id,
            beneath: format!("{scope}/").into_boxed_str(),
            until: None,
        });
        self.count.store(holds.len(), Ordering::SeqCst);
        drop(holds);
        // Pairs with the fence in `covers`: the caller's read of the marks comes after
        // this hold is visible to every admission that follows (store-load order).
        std::sync::atomic::fence(Ordering::SeqCst);
        TreeHold {
            trees: self.clone(),
            id,
            until: None,
        }
    }

    /// Is `scope` beneath a hold in force?
    fn covers(&self, scope: &str) -> bool {
        // Pairs with the fence in `hold`: this request's mark (durable, written before)
        // is visible to a hold's read of the marks, or the hold is visible here.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.count.load(Ordering::SeqCst) == 0 {
            return false;
        }
        let now = Instant::now();
        let mut holds = self.lock();
        holds.retain(|h| h.until.is_none_or(|u| now < u));
        self.count.store(holds.len(), Ordering::SeqCst);
        holds.iter().any(|h| scope.starts_with(&*h.beneath))
    }

    fn release(&self, id: u64, until: Option<Instant>) {
        let mut holds = self.lock();
        match until {
            None => holds.retain(|h| h.id != id),
            Some(u) => {
                if let Some(h) = holds.iter_mut().find(|h| h.id == id) {
                    h.until = Some(u);
                }
            }
        }
        self.count.store(holds.len(), Ordering::SeqCst);
    }
}

/// A collection operation's hold on the scopes beneath its own ([`Gates::hold_tree`]).
/// Dropped on its own (the request was refused before it was forwarded), it is released
/// at once; handed to the request's guard ([`InflightGuard::hold_tree`]), with it.
#[derive(Debug)]
pub struct TreeHold {
    trees: Arc<Trees>,
    id: u64,
    /// Kept until then once dropped (`None`: released at once).
    until: Option<Instant>,
}

impl TreeHold {
    /// Released by the request's guard: at once if the upstream answered, else held
    /// until the scope has settled.
    fn release(&mut self, completed: bool, settle: Duration) {
        self.until = (!completed).then(|| Instant::now() + settle);
    }
}

impl Drop for TreeHold {
    fn drop(&mut self) {
        self.trees.release(self.id, self.until);
    }
}

/// An advance queued at the writer; dropping it before the commit landed leaves a task
/// to finish the gate's bookkeeping when it does.
struct PendingCommit {
    rx: Option<oneshot::Receiver<Result<Mark, StoreError>>>,
    gate: Arc<Gate>,
    mark: Mark,
    /// The commit raises the token (else it records a sequence of the current one).
    advance: bool,
    /// A request's commit (not an admin raise): if it lands with nobody waiting, the
    /// request was never forwarded and its token (or sequence) is left unclaimed.
    for_request: bool,
}

impl PendingCommit {
    async fn wait(mut self) -> Result<Mark, StoreError> {
        let result = match self.rx.as_mut() {
            Some(rx) => rx.await.unwrap_or_else(|_| Err(writer_stopped())),
            None => Err(writer_stopped()),
        };
        self.rx = None;
        finish_commit(&self.gate, self.mark, self.advance, &result, false);
        result
    }
}

impl Drop for PendingCommit {
    fn drop(&mut self) {
        let Some(rx) = self.rx.take() else {
            return;
        };
        let finish = Finish {
            rx: Some(rx),
            gate: self.gate.clone(),
            mark: self.mark,
            advance: self.advance,
            for_request: self.for_request,
        };
        // With no runtime, or one shutting down (which drops the task unrun), `finish` is
        // dropped unfinished and clears the advance there and then.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(finish.run());
        }
    }
}

/// The rest of a dropped request's commit: the gate takes the stored mark once it lands.
/// Dropped before that (its runtime stopped), it clears the advance without trusting it:
/// memory stays at or behind disk, and the next request of the token advances again.
struct Finish {
    rx: Option<oneshot::Receiver<Result<Mark, StoreError>>>,
    gate: Arc<Gate>,
    mark: Mark,
    advance: bool,
    for_request: bool,
}

impl Finish {
    async fn run(mut self) {
        let result = match self.rx.as_mut() {
            Some(rx) => rx.await.unwrap_or_else(|_| Err(writer_stopped())),
            None => return,
        };
        self.rx = None;
        // Its request is gone (or was answered `unavailable`): nobody used the token.
        finish_commit(
            &self.gate,
            self.mark,
            self.advance,
            &result,
            self.for_request,
        );
    }
}

impl Drop for Finish {
    fn drop(&mut self) {
        if self.rx.take().is_some() {
            finish_commit(
                &self.gate,
                self.mark,
                self.advance,
                &Err(writer_stopped()),
                false,
            );
        }
    }
}

/// Under the gate's lock: `token`'s advance landed and no request of it was forwarded. If
/// it is still the mark, its retry may use it (see [`GateState::unclaimed`]); the gate is
/// kept from the sweep for `IDLE_TTL` from now, so that the retry finds it.
fn unclaim(st: &mut GateState, token: Token) {
    let admitted = match st.admitted {
        Some((t, n)) if t == token => n,
        _ => 0,
    };
    if st.current == Some(token) && admitted == 0 {
        st.unclaimed = Some(token);
        st.last_used = Some(Instant::now());
    }
}

/// Under the gate's lock: sequence `n` of `token` was recorded and its request never
/// forwarded. If it is still the highest, its retry may take it.
fn unclaim_sequence(st: &mut GateState, token: Token, n: u64) {
    if st.current == Some(token) && st.sequence == Some(n) {
        st.seq_unclaimed = Some((token, n));
        st.last_used = Some(Instant::now());
    }
}

/// The gate's view takes a stored mark: a higher token starts its sequence over.
fn observe(st: &mut GateState, stored: Mark) {
    match st.current {
        Some(c) if c > stored.token => {}
        Some(c) if c == stored.token => st.sequence = st.sequence.max(stored.sequence),
        _ => {
            st.current = Some(stored.token);
            st.sequence = stored.sequence;
        }
    }
}

/// A request that advanced the mark (or took an unclaimed advance), or recorded its
/// sequence, and has not been admitted yet: if it never is, what it committed is left
/// unclaimed for its retry.
struct Claim<'a> {
    gate: &'a Gate,
    token: Token,
    advanced: bool,
    sequence: Option<u64>,
}

impl<'a> Claim<'a> {
    /// Keeps `claim` up to date with what the request has committed so far.
    fn note(
        claim: &mut Option<Claim<'a>>,
        gate: &'a Gate,
        token: Token,
        advanced: bool,
        sequence: Option<u64>,
    ) {
        if !advanced && sequence.is_none() {
            return;
        }
        match claim {
            Some(c) => {
                c.advanced = advanced;
                c.sequence = sequence;
            }
            None => {
                *claim = Some(Claim {
                    gate,
                    token,
                    advanced,
                    sequence,
                })
            }
        }
    }
}

impl Claim<'_> {
    /// The request was admitted: the advance is used.
    fn used(self) {
        std::mem::forget(self);
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let mut st = self.gate.lock();
        if self.advanced {
            unclaim(&mut st, self.token);
        }
        if let Some(n) = self.sequence {
            unclaim_sequence(&mut st, self.token, n);
        }
    }
}

/// A commit of `mark` landed (or failed): the gate takes the stored mark and wakes its
/// waiters. `advance`: it raised the token (else it recorded a sequence). `unclaimed`:
/// nobody waits for it any more, and nothing of it was forwarded.
fn finish_commit(
    gate: &Gate,
    mark: Mark,
    advance: bool,
    result: &Result<Mark, StoreError>,
    unclaimed: bool,
) {
    let token = mark.token;
    let mut st = gate.lock();
    if advance && st.advancing == Some(token) {
        st.advancing = None;
    }
    if let Some(n) = mark.sequence
        && st.seq_advancing == Some((token, n))
    {
        st.seq_advancing = None;
    }
    if let Ok(stored) = result {
        observe(&mut st, *stored);
        if unclaimed {
            if advance {
                unclaim(&mut st, token);
            }
            if let Some(n) = mark.sequence {
                unclaim_sequence(&mut st, token, n);
            }
        }
    }
    drop(st);
    gate.notify.notify_waiters();
}

/// Checks `proof` for (`scope`, `token`) unless the gate verified these very bytes for this
/// token already. The signature is checked outside the gate's lock.
fn verify_at(gate: &Gate, scope: &str, token: Token, proof: Proof<'_>) -> Result<(), Refusal> {
    let known = gate
        .lock()
        .verified
        .as_ref()
        .is_some_and(|(t, p)| *t == token && **p == *proof.bytes);
    if known {
        return Ok(());
    }
    proof
        .keys
        .verify(scope, token, proof.bytes)
        .map_err(|e| Refusal::InvalidProof(e.to_string()))?;
    let mut st = gate.lock();
    // An older token's proof (a stale request's) does not push the current one out.
    if st.verified.as_ref().is_none_or(|(t, _)| token >= *t) {
        st.verified = Some((token, proof.bytes.into()));
    }
    Ok(())
}

/// Called with the shard locked. Only the map holds an evictable gate, so nobody can be
/// waiting on it or about to use it; its state is all on disk. So is the start-up settle
/// (`restart`) of a scope with a mark: a gate made again gets the same, so a flood of
/// existing scopes after a restart does not pin its gates in memory.
fn evictable(
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

/// What one request brings to a look at its gate ([`Gates::step`]), and what it has
/// done so far.
struct At<'a> {
    scope: &'a str,
    token: Token,
    sequence: Option<u64>,
    equal: EqualPolicy,
    /// This request advanced the mark (or took an unclaimed advance).
    advanced: &'a mut bool,
    /// This request's sequence is recorded (or it took an unclaimed record).
    recorded: &'a mut bool,
    arrived: Instant,
    now: Instant,
}

enum Step {
    Refuse(Refusal),
    Admit(Admission),
    /// Commit the advance to `token` (the gate now records it as advancing).
    Commit,
    /// Record the request's sequence for the current token (the gate now records it as
    /// being recorded).
    CommitSequence,
    /// Wait for a wake-up, or until this instant (for an older generation to drain or
    /// settle; refused `Draining` at the drain deadline).
    Wait(Instant),
    /// Wait for another request's commit of an advance that covers ours, as long as the
    /// committing request itself waits for it (refused `Unavailable` then).
    AwaitCommit(Instant),
}

/// The hot gates of the scopes that hash to one shard.
#[derive(Default)]
struct Shard {
    gates: HashMap<Arc<str>, Arc<Gate>>,
    /// Bytes of the scope names in `gates`.
    bytes: usize,
    /// Gates evicted from this shard so far (see [`Gates::gate`]).
    evicted: u64,
}

impl Shard {
    /// Drops the gates `keep` refuses, counting them as evicted.
    fn evict(&mut self, mut keep: impl FnMut(&Arc<Gate>) -> bool) {
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

/// Counts one waiting request, in the gate and in total, while it lives.
struct Waiting<'a> {
    total: &'a AtomicUsize,
    gate: Arc<Gate>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.total.fetch_sub(1, Ordering::Relaxed);
        let mut st = self.gate.lock();
        st.waiters = st.waiters.saturating_sub(1);
    }
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

    fn shard(&self, scope: &str) -> MutexGuard<'_, Shard> {
        self.shards[shard_index(self.shard_seed, scope)]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    fn gate(&self, scope: &str) -> Result<(Arc<str>, Arc<Gate>), StoreError> {
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
    fn insert(
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

    /// Admits a request carrying `token` for `scope`, or says why not. Cancel-safe: a
    /// dropped future leaves nothing counted; an advance it started still completes.
    pub async fn admit(
        &self,
        scope: &str,
        token: Token,
        equal: EqualPolicy,
    ) -> Result<Admission, Refusal> {
        self.admit_proved(scope, token, equal, None).await
    }

    /// [`Gates::admit`], after checking `proof` (when given) for `scope` and `token`: a
    /// proof that does not verify is refused before anything is advanced or counted.
    pub async fn admit_proved(
        &self,
        scope: &str,
        token: Token,
        equal: EqualPolicy,
        proof: Option<Proof<'_>>,
    ) -> Result<Admission, Refusal> {
        self.admit_sequenced(scope, token, None, equal, proof).await
    }

    /// [`Gates::admit_proved`] for a request that may carry a `Fencing-Sequence`
    /// (SPEC §11): the sequence is recorded durably with the mark before admission (one
    /// commit with the advance, if the token is new), one not above the recorded sequence
    /// of the token is refused [`Refusal::StaleSequence`], and a higher one waits for the
    /// lower ones of its token in flight, as a generation waits for older ones.
    pub async fn admit_sequenced(
        &self,
        scope: &str,
        token: Token,
        sequence: Option<u64>,
        equal: EqualPolicy,
        proof: Option<Proof<'_>>,
    ) -> Result<Admission, Refusal> {
        let arrived = Instant::now();
        let deadline = arrived + self.drain_timeout;
        let (key, gate) = self.gate(scope).map_err(|_| Refusal::Unavailable)?;
        if let Some(proof) = proof {
            verify_at(&gate, scope, token, proof)?;
        }
        let mut advanced = false;
        // Our sequence is recorded (by our commit, or our taking an unclaimed one).
        let mut recorded = false;
        // Held from our advance or record (or our taking an unclaimed one) until admission.
        let mut claim: Option<Claim<'_>> = None;
        let mut waiting = None;
        let mut looked = false;
        loop {
            // The first look is a moment after arrival; later ones follow a wait or a commit.
            let now = if looked { Instant::now() } else { arrived };
            looked = true;
            // Fast path: most requests are decided by one look under the lock, without
            // registering as a waiter.
            // One look under the gate's lock (the same for both looks below).
            let mut look = |st: &mut GateState| {
                let mut at = At {
                    scope,
                    token,
                    sequence,
                    equal,
                    advanced: &mut advanced,
                    recorded: &mut recorded,
                    arrived,
                    now,
                };
                self.step(st, &gate, &mut at)
            };
            let step = look(&mut gate.lock());
            // Made only to wait (boxed: the admitted request's future stays small).
            let mut notified = None;
            let step = match step {
                Step::Wait(_) | Step::AwaitCommit(_) => {
                    // Register, then look again: a wake-up between the first look and the
                    // registration would otherwise be lost.
                    let registered = notified.insert(Box::pin(gate.notify.notified()));
                    registered.as_mut().enable();
                    look(&mut gate.lock())
                }
                decided => decided,
            };
            Claim::note(
                &mut claim,
                &gate,
                token,
                advanced,
                sequence.filter(|_| recorded),
            );
            let (wake_at, give_up, for_commit) = match step {
                Step::Refuse(r) => return Err(r),
                Step::Admit(mut a) => {
                    if let Some(claim) = claim.take() {
                        claim.used();
                    }
                    // A collection operation in flight may change this scope's object
                    // whole (SPEC §16): it was checked against the marks there were, and
                    // this request's mark may have landed since. Looked at only now that
                    // the mark is durable: one of the two always sees the other.
                    if self.trees.covers(scope) {
                        a.guard.not_forwarded();
                        return Err(Refusal::Draining {
                            highest: Some(token),
                        });
                    }
                    // Only requests that really waited for an older generation count.
                    if waiting.is_some() {
                        self.metrics.gate_wait_seconds.observe_duration(a.waited);
                    }
                    return Ok(a);
                }
                Step::Commit | Step::CommitSequence => {
                    let advance = matches!(step, Step::Commit);
                    self.commit(
                        &key,
                        &gate,
                        Mark { token, sequence },
                        advance,
                        commit_deadline(arrived, self.drain_timeout),
                        true,
                    )
                    .await?;
                    advanced |= advance;
                    recorded = sequence.is_some();
                    Claim::note(
                        &mut claim,
                        &gate,
                        token,
                        advanced,
                        sequence.filter(|_| recorded),
                    );
                    continue;
                }
                Step::Wait(until) => (until, deadline, false),
                Step::AwaitCommit(until) => (until, until, true),
            };
            if waiting.is_none() {
                let mut st = gate.lock();
                if st.waiters >= self.max_waiters {
                    return Err(Refusal::Draining {
                        highest: st.current,
                    });
                }
                st.waiters += 1;
                drop(st);
                self.waiting.fetch_add(1, Ordering::Relaxed);
                waiting = Some(Waiting {
                    total: &self.waiting,
                    gate: gate.clone(),
                });
            }
            if Instant::now() >= give_up {
                let highest = gate.lock().current;
                self.metrics
                    .gate_wait_seconds
                    .observe_duration(give_up - arrived);
                // Another request's commit that has not landed in time: a hung disk, as for
                // the committing request itself.
                if for_commit {
                    return Err(Refusal::Unavailable);
                }
                return Err(Refusal::Draining { highest });
            }
            // A step that waits was looked at once registered, so `notified` is there.
            match notified.as_mut() {
                Some(notified) => tokio::select! {
                    _ = notified.as_mut() => {}
                    _ = tokio::time::sleep_until(wake_at) => {}
                },
                None => tokio::time::sleep_until(wake_at).await,
            }
        }
    }

    /// One look at the gate under its lock, at `at.now`: what this request does next.
    fn step(&self, st: &mut GateState, gate: &Arc<Gate>, at: &mut At<'_>) -> Step {
        let (token, equal, arrived, now) = (at.token, at.equal, at.arrived, at.now);
        let advanced = &mut *at.advanced;
        let deadline = arrived + self.drain_timeout;
        let floor = self.store.floor();
        if let Some(source) = &self.source {
            match source.admits(at.scope) {
                None => return Step::Refuse(Refusal::Unavailable),
                Some(view) if view != st.view => {
                    // The source's marks were loaded anew since this gate last decided
                    // (the shard was owned elsewhere meanwhile, or reloaded): take its
                    // mark, which may be higher than ours.
                    match source.get_mark(at.scope) {
                        Ok(Some(stored)) => observe(st, stored),
                        Ok(None) => {}
                        Err(_) => return Step::Refuse(Refusal::Unavailable),
                    }
                    st.view = view;
                }
                Some(_) => {}
            }
        }
        let decision = match decide(st.current, token, equal, floor) {
            // Our own advance made `token` current: we are its first request.
            Decision::Stale if *advanced && st.current == Some(token) && token.epoch >= floor => {
                Decision::Accept
            }
            // The retry of a request that advanced to `token` and was never forwarded
            // (`equal = "reject"`: an equal token is otherwise stale): it takes the advance.
            Decision::Stale
                if st.unclaimed == Some(token)
                    && st.current == Some(token)
                    && token.epoch >= floor =>
            {
                st.unclaimed = None;
                *advanced = true;
                Decision::Accept
            }
            d => d,
        };
        match decision {
            Decision::Stale => Step::Refuse(Refusal::Stale {
                highest: st.current,
            }),
            // An advance that covers ours is being committed; wait for it.
            Decision::Advance if st.advancing.is_some_and(|a| a >= token) => {
                Step::AwaitCommit(commit_deadline(arrived, self.drain_timeout))
            }
            Decision::Advance => {
                st.advancing = Some(token);
                Step::Commit
            }
            Decision::Accept => {
                if let Some(n) = at.sequence
                    && let Some(step) = self.sequence_step(st, token, n, at.recorded, arrived)
                {
                    return step;
                }
                let older_in_flight = st.inflight.older_than(token);
                let settling = st
                    .settle
                    .filter(|(g, until)| token > *g && now < *until)
                    .map(|(_, until)| until);
                // Within the generation: lower sequences of this token first.
                let lower_in_flight = at
                    .sequence
                    .is_some_and(|n| st.seq_inflight.iter().any(|(t, s)| *t == token && *s < n));
                let seq_settling = st
                    .seq_settle
                    .filter(|(t, s, until)| {
                        *t == token && at.sequence.is_some_and(|n| n > *s) && now < *until
                    })
                    .map(|(_, _, until)| until);
                if older_in_flight
                    || settling.is_some()
                    || lower_in_flight
                    || seq_settling.is_some()
                {
                    let until = match (settling, seq_settling) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                    return Step::Wait(until.map_or(deadline, |s| s.min(deadline)));
                }
                if st.inflight.count(token) >= self.max_inflight {
                    return Step::Refuse(Refusal::Draining {
                        highest: st.current,
                    });
                }
                st.inflight.add(token);
                if let Some(n) = at.sequence {
                    st.seq_inflight.push((token, n));
                }
                st.last_used = Some(now);
                st.admitted = Some(match st.admitted {
                    Some((t, n)) if t == token => (t, n.saturating_add(1)),
                    _ => (token, 1),
                });
                if st.unclaimed == Some(token) {
                    // Used, by a route that accepts equal tokens.
                    st.unclaimed = None;
                }
                let waited = now - arrived;
                Step::Admit(Admission {
                    guard: InflightGuard {
                        gate: gate.clone(),
                        token,
                        sequence: at.sequence,
                        settle: self.settle,
                        completed: false,
                        advanced: *advanced,
                        unused: false,
                        tree: None,
                    },
                    advanced: *advanced,
                    waited,
                })
            }
        }
    }

    /// Under the lock, for a request of the current token with sequence `n`: refused if
    /// `n` is not above the recorded sequence (unless it is this request's own record, or
    /// the retry of an unclaimed one), or it records `n`, or waits for another request's
    /// record that covers it. `None`: `n` is recorded, for this request.
    fn sequence_step(
        &self,
        st: &mut GateState,
        token: Token,
        n: u64,
        recorded: &mut bool,
        arrived: Instant,
    ) -> Option<Step> {
        if *recorded && st.sequence == Some(n) {
            return None;
        }
        if st.seq_unclaimed == Some((token, n)) && st.sequence == Some(n) {
            st.seq_unclaimed = None;
            *recorded = true;
            return None;
        }
        if let Some(h) = st.sequence.filter(|h| *h >= n) {
            return Some(Step::Refuse(Refusal::StaleSequence {
                highest: st.current,
                sequence: h,
            }));
        }
        if st.seq_advancing.is_some_and(|(t, a)| t == token && a >= n) {
            return Some(Step::AwaitCommit(commit_deadline(
                arrived,
                self.drain_timeout,
            )));
        }
        st.seq_advancing = Some((token, n));
        Some(Step::CommitSequence)
    }

    /// Commits an advance and brings the gate up to date. Cancel-safe: if the request
    /// goes away mid-commit, a task finishes the bookkeeping when the commit lands, so
    /// the gate never believes an advance is still under way. A commit that has not
    /// landed by `deadline` (a hung fsync) is answered `Unavailable`; the commit is then
    /// left to that task as if the request had gone away.
    /// `for_request`: the advance of a request (not an admin raise).
    async fn commit(
        &self,
        key: &Arc<str>,
        gate: &Arc<Gate>,
        mark: Mark,
        advance: bool,
        deadline: Instant,
        for_request: bool,
    ) -> Result<Mark, Refusal> {
        let pending = match self.begin_advance(key.clone(), mark) {
            Ok(rx) => PendingCommit {
                rx: Some(rx),
                gate: gate.clone(),
                mark,
                advance,
                for_request,
            },
            Err(e) => {
                finish_commit(gate, mark, advance, &Err(e), false);
                return Err(Refusal::Unavailable);
            }
        };
        // On a worker, a slot in its deadline wheel rather than a tokio timer entry: the
        // deadline is seconds away and almost never reached.
        match crate::rt::timer::timeout_at(deadline.into_std(), pending.wait()).await {
            Ok(result) => result.map_err(|_| Refusal::Unavailable),
            Err(_) => Err(Refusal::Unavailable),
        }
    }

    /// Raises a scope's mark without forwarding anything (admin API). Never lowers.
    pub async fn raise(&self, scope: &str, token: Token) -> Result<Token, Refusal> {
        let (key, gate) = self.gate(scope).map_err(|_| Refusal::Unavailable)?;
        let current = gate.lock().current;
        if let Some(c) = current.filter(|c| *c >= token) {
            return Ok(c);
        }
        self.commit(
            &key,
            &gate,
            Mark::of(token),
            true,
            commit_deadline(Instant::now(), self.drain_timeout),
            false,
        )
        .await
        .map(|m| m.token)
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

/// The shard of `scope`: FNV-1a from a per-process seed, then murmur3's 64-bit finalizer
/// (FNV alone leaves the last bytes, where scopes like `report/7` and `report/8` differ,
/// out of most bits; a shard that fills evicts its idle gates early). A few instructions
/// per byte where SipHash takes a hundred or so. Each shard's map keeps std's keyed
/// SipHash, so a client that crowds scopes into one shard only makes that shard's lock
/// busier and its gates go idle sooner, never its lookups slower.
fn shard_index(seed: u64, scope: &str) -> usize {
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

/// The shortest time a commit is waited for, whatever `drain_timeout` says: a zero
/// `drain_timeout` (never wait for older generations) must not fail every advance.
pub(crate) const MIN_COMMIT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// When a request that arrived at `arrived` stops waiting for its mark's commit (a hung
/// fsync): its drain deadline, but not before [`MIN_COMMIT_WAIT`].
fn commit_deadline(arrived: Instant, drain_timeout: Duration) -> Instant {
    arrived + drain_timeout.max(MIN_COMMIT_WAIT)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A collection operation holds the tree beneath its scope (SPEC §16): while it is in
    /// flight, a request to a scope beneath is refused (its new mark stays, so the
    /// collection's check would see it), others pass; an operation whose upstream
    /// exchange was abandoned holds the tree until the scope has settled.
    #[tokio::test(start_paused = true)]
    async fn a_collection_in_flight_holds_the_scopes_beneath_it() {
        let store = MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new())
            .expect("store");
        let metrics = Arc::new(Metrics::new(Vec::new()));
        let settle = Duration::from_secs(10);
        let g = Gates::new(store, metrics, Duration::from_secs(30), settle);
        // Past the start-up settle.
        tokio::time::advance(settle).await;
        let t5 = Token::new(0, 5);
        let mut collection = g
            .admit("file/q4", t5, EqualPolicy::Accept)
            .await
            .expect("the collection's own scope");
        collection.guard.hold_tree(g.hold_tree("file/q4"));
        assert_eq!(
            g.admit("file/q4/final", t5, EqualPolicy::Accept)
                .await
                .map(|_| ()),
            Err(Refusal::Draining { highest: Some(t5) })
        );
        // The refused request's mark is durable: the collection's check would see it.
        assert!(
            g.store()
                .marked_beneath("file/q4/", false, "")
                .expect("read")
                .is_some()
        );
        for other in ["file/q4x", "file/q", "file/q5/final"] {
            let mut a = g
                .admit(other, t5, EqualPolicy::Accept)
                .await
                .unwrap_or_else(|r| panic!("{other}: {r:?}"));
            a.guard.complete();
        }
        // Answered: released at once.
        collection.guard.complete();
        drop(collection);
        let mut a = g
            .admit("file/q4/final", t5, EqualPolicy::Accept)
            .await
            .expect("after the collection's answer");
        a.guard.complete();
        drop(a);
        // Abandoned: held until the scope has settled.
        let mut abandoned = g
            .admit("file/q6", t5, EqualPolicy::Accept)
            .await
            .expect("q6");
        abandoned.guard.hold_tree(g.hold_tree("file/q6"));
        drop(abandoned);
        tokio::time::advance(settle / 2).await;
        assert!(g.admit("file/q6/a", t5, EqualPolicy::Accept).await.is_err());
        tokio::time::advance(settle).await;
        let mut a = g
            .admit("file/q6/a", t5, EqualPolicy::Accept)
            .await
            .expect("settled");
        a.guard.complete();
        // A hold refused before it was forwarded (dropped on its own) holds nothing.
        drop(g.hold_tree("file/q7"));
        assert!(g.admit("file/q7/a", t5, EqualPolicy::Accept).await.is_ok());
    }

    /// Scopes that differ only in their last characters spread over every shard (a shard
    /// at its capacity evicts early, so crowding shows up as lost hot gates).
    #[test]
    fn similar_scopes_spread_evenly_over_the_shards() {
        for seed in [0, 1, 0x9e37_79b9_7f4a_7c15, u64::MAX] {
            let mut counts = [0usize; SHARDS];
            for i in 0..64_000 {
                counts[shard_index(seed, &format!("report/w4s{i}"))] += 1;
            }
            let (min, max) = (counts.iter().min(), counts.iter().max());
            // 1,000 each on average.
            assert!(
                min >= Some(&850) && max <= Some(&1150),
                "seed {seed:#x}: {min:?}..{max:?}"
            );
        }
    }

    /// A request that found no gate reads the mark from disk, then inserts a gate. If,
    /// in between, another request made the scope's gate, advanced the mark and the gate
    /// was evicted, the mark read is stale: the inserted gate must hold the newer one.
    #[tokio::test(start_paused = true)]
    async fn a_mark_read_before_an_eviction_is_read_again() {
        let store = MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new())
            .expect("store");
        let metrics = Arc::new(Metrics::new(Vec::new()));
        let g = Gates::new(store, metrics, Duration::from_secs(30), Duration::ZERO);
        let (t5, t6) = (Token::new(0, 5), Token::new(0, 6));
        let idle_out = |g: &Gates| {
            g.sweep();
            assert_eq!(g.len(), 0, "every gate evicted");
        };
        let mut a = g.admit("s", t5, EqualPolicy::Accept).await.expect("5");
        a.guard.complete();
        drop(a);
        tokio::time::advance(IDLE_TTL).await;
        idle_out(&g);
        // Request A: no gate for "s"; it reads mark 5 and is held up before inserting.
        let evicted = g.shard("s").evicted;
        let read = g.store.get_mark("s").expect("read");
        assert_eq!(read, Some(Mark::of(t5)));
        // Meanwhile B makes the gate, advances to 6, finishes, and the gate is evicted.
        let mut b = g.admit("s", t6, EqualPolicy::Accept).await.expect("6");
        b.guard.complete();
        drop(b);
        tokio::time::advance(IDLE_TTL).await;
        idle_out(&g);
        // A goes on with what it read.
        let (_, gate) = g.insert("s", read, evicted).expect("insert");
        assert_eq!(
            gate.lock().current,
            Some(t6),
            "the gate holds the disk's mark"
        );
        drop(gate);
        assert_eq!(
            g.admit("s", t5, EqualPolicy::Accept).await.unwrap_err(),
            Refusal::Stale { highest: Some(t6) }
        );
        // Without an eviction in between, the read is used as it is (no second read).
        let evicted = g.shard("t").evicted;
        let (_, gate) = g.insert("t", Some(Mark::of(t5)), evicted).expect("insert");
        assert_eq!(gate.lock().current, Some(t5));
    }

    /// A proof is verified once per (token, bytes) while the gate lives; a stale token's
    /// valid proof neither passes nor pushes the current one out of the cache; a bad
    /// proof is refused before anything is advanced.
    #[tokio::test]
    async fn verified_proofs_are_remembered_per_gate() {
        let dir = tempfile::tempdir().expect("dir");
        crate::proof::keygen(&dir.path().join("k")).expect("keygen");
        let key = crate::proof::SigningKey::load(&dir.path().join("k.key")).expect("key");
        let mut keys = crate::proof::ProofKeys::default();
        keys.add_file(&dir.path().join("k.pub")).expect("pub");
        let store = MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new())
            .expect("store");
        let metrics = Arc::new(Metrics::new(Vec::new()));
        let g = Gates::new(
            store.clone(),
            metrics,
            Duration::from_secs(1),
            Duration::ZERO,
        );
        let accept = EqualPolicy::Accept;
        let (t5, t6) = (Token::new(0, 5), Token::new(0, 6));
        let (p5, p6) = (key.prove("s", t5), key.prove("s", t6));
        fn with<'a>(keys: &'a crate::proof::ProofKeys, p: &'a str) -> Option<Proof<'a>> {
            Some(Proof {
                keys,
                bytes: p.as_bytes(),
            })
        }
        let proof = |p| with(&keys, p);
        let refused = g
            .admit_proved("s", t5, accept, proof(&p6))
            .await
            .unwrap_err();
        assert!(matches!(refused, Refusal::InvalidProof(_)), "{refused:?}");
        assert_eq!(store.get("s").expect("get"), None, "nothing advanced");
        let n = keys.verifications();
        for _ in 0..3 {
            let mut a = g
                .admit_proved("s", t6, accept, proof(&p6))
                .await
                .expect("6");
            a.guard.complete();
        }
        assert_eq!(keys.verifications() - n, 1);
        // 5's own proof is valid, but 5 is stale; 6's cached proof stays.
        assert!(matches!(
            g.admit_proved("s", t5, accept, proof(&p5)).await,
            Err(Refusal::Stale { .. })
        ));
        let n = keys.verifications();
        let mut a = g
            .admit_proved("s", t6, accept, proof(&p6))
            .await
            .expect("6");
        a.guard.complete();
        assert_eq!(keys.verifications(), n, "still cached");
    }

    /// On an `equal = "reject"` route an equal token is stale, but a request that advanced
    /// the mark and was then refused (503 `draining`, which says "retry with the same
    /// token") or went away was never forwarded: its retry must get through, once.
    #[tokio::test(start_paused = true)]
    async fn a_refused_advance_admits_its_retry_once_on_a_reject_route() {
        let store = MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new())
            .expect("store");
        let metrics = Arc::new(Metrics::new(Vec::new()));
        let g = Gates::new(store, metrics, Duration::from_secs(1), Duration::ZERO);
        let reject = EqualPolicy::Reject;
        let (t5, t7, t9) = (Token::new(0, 5), Token::new(0, 7), Token::new(0, 9));
        let mut old = g.admit("s", t5, reject).await.expect("5");
        // 7 advances, then waits for 5 to finish; the paused clock runs out its drain.
        assert_eq!(
            g.admit("s", t7, reject).await.unwrap_err(),
            Refusal::Draining { highest: Some(t7) }
        );
        old.guard.complete();
        drop(old);
        // The gate (and what it remembers) outlives an idle sweep until its retry comes.
        tokio::time::advance(IDLE_TTL - Duration::from_millis(500)).await;
        g.sweep();
        assert_eq!(g.len(), 1, "kept for the retry");
        let mut retry = g.admit("s", t7, reject).await.expect("the retry of 7");
        assert!(retry.advanced, "it is the token's first request");
        assert_eq!(
            g.admit("s", t7, reject).await.unwrap_err(),
            Refusal::Stale { highest: Some(t7) },
            "once"
        );
        retry.guard.complete();
        drop(retry);

        // An advance whose request went away before admission (here: while it waited
        // for an older generation) is left for its retry too.
        let mut old = g.admit("s", Token::new(0, 8), reject).await.expect("8");
        let gone = tokio::time::timeout(Duration::from_millis(10), g.admit("s", t9, reject)).await;
        assert!(gone.is_err(), "9 waits for 8");
        old.guard.complete();
        drop(old);
        let mut retry = g.admit("s", t9, reject).await.expect("the retry of 9");
        retry.guard.complete();
        drop(retry);
        assert!(g.admit("s", t9, reject).await.is_err());

        // Admitted, then refused before anything reached the upstream (a 502 before
        // sending, an idempotency refusal): the retry gets through, once.
        let t95 = Token::new(0, 95);
        let mut first = g.admit("s", t95, reject).await.expect("95");
        first.guard.not_forwarded();
        drop(first);
        let mut retry = g.admit("s", t95, reject).await.expect("the retry of 95");
        retry.guard.complete();
        drop(retry);
        assert!(g.admit("s", t95, reject).await.is_err(), "once");

        // One scope, a reject route and an accept route: a request of the token that
        // the accept route admitted (and so may have forwarded) uses it, even if the
        // request that advanced is then refused unsent.
        let t96 = Token::new(0, 96);
        let mut x = g.admit("s", t96, reject).await.expect("96 advances");
        let mut y = g
            .admit("s", t96, EqualPolicy::Accept)
            .await
            .expect("96 by accept");
        x.guard.not_forwarded();
        drop(x);
        assert_eq!(
            g.admit("s", t96, reject).await.unwrap_err(),
            Refusal::Stale { highest: Some(t96) },
            "96 reached the backend through the accept route"
        );
        y.guard.complete();
        drop(y);

        // A token that a request was forwarded with is used, whatever route took it.
        let t10 = Token::new(0, 100);
        let mut old = g.admit("s", t10, reject).await.expect("100");
        let t11 = Token::new(0, 101);
        assert!(g.admit("s", t11, reject).await.is_err(), "101 drains out");
        old.guard.complete();
        drop(old);
        let mut by_accept = g.admit("s", t11, EqualPolicy::Accept).await.expect("101");
        by_accept.guard.complete();
        drop(by_accept);
        assert_eq!(
            g.admit("s", t11, reject).await.unwrap_err(),
            Refusal::Stale { highest: Some(t11) }
        );
    }

    #[test]
    fn inflight_counts_per_generation_and_knows_the_oldest() {
        let (t1, t2, t3) = (Token::new(0, 1), Token::new(0, 2), Token::new(1, 0));
        let mut f = Inflight::default();
        assert!(f.is_empty() && !f.older_than(t1));
        f.add(t3);
        f.add(t1);
        f.add(t3);
        assert_eq!((f.count(t1), f.count(t2), f.count(t3)), (1, 0, 2));
        assert!(f.older_than(t2) && !f.older_than(t1));
        f.remove(t1);
        assert!(!f.older_than(t2) && f.older_than(Token::new(1, 1)));
        // Removing a generation with nothing in flight changes nothing.
        f.remove(t2);
        f.remove(t3);
        assert_eq!(f.count(t3), 1);
        f.remove(t3);
        assert!(f.is_empty());
    }
}
