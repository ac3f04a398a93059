//! A gate's state: what one scope's gate knows under its lock (the mark as seen, the
//! generations and sequences in flight, settles, waiters), and the gate itself.

use std::sync::{Mutex, MutexGuard};

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::token::Token;

#[derive(Debug, Default)]
pub(super) struct GateState {
    /// The durable mark as far as this process has seen it; never ahead of disk.
    pub(super) current: Option<Token>,
    /// The highest sequence recorded for `current`, as far as this process has seen it;
    /// never ahead of disk.
    pub(super) sequence: Option<u64>,
    /// The highest advance being committed right now, if any.
    pub(super) advancing: Option<Token>,
    /// The highest sequence being recorded right now, with its token.
    pub(super) seq_advancing: Option<(Token, u64)>,
    /// Sequenced requests forwarded and not yet finished: (token, sequence), a handful.
    pub(super) seq_inflight: Vec<(Token, u64)>,
    /// (token, sequence, until): a sequenced request was abandoned; no higher sequence of
    /// its token is forwarded before `until`.
    pub(super) seq_settle: Option<(Token, u64, Instant)>,
    /// The recorded sequence of the current token whose request was never forwarded
    /// (refused after its record, or gone): its retry may take it, once, as an
    /// `equal = "reject"` retry takes an unclaimed advance.
    pub(super) seq_unclaimed: Option<(Token, u64)>,
    /// Requests forwarded and not yet finished, per generation, oldest first. Rarely more
    /// than one generation: a vector keeps its buffer when it empties, where a map would
    /// allocate and free a node for every request.
    pub(super) inflight: Inflight,
    /// (generation, until): a request of this generation was abandoned; nothing higher
    /// is forwarded before `until`.
    pub(super) settle: Option<(Token, Instant)>,
    pub(super) last_used: Option<Instant>,
    /// Requests waiting at this gate.
    pub(super) waiters: usize,
    /// The current mark, when the request that advanced to it was never forwarded (it was
    /// refused after its commit, 503 `draining` or `unavailable`, or went away). Those
    /// answers say "retry with the same token", so on an `equal = "reject"` route the
    /// token still admits one request: the retry. Kept while the gate is in memory.
    pub(super) unclaimed: Option<Token>,
    /// (token, n): `n` requests of `token` were admitted and not known to have been left
    /// unsent ([`InflightGuard::not_forwarded`](super::InflightGuard::not_forwarded) takes its own back). An advance is left
    /// unclaimed only when none of its token's requests may have reached the upstream: a
    /// scope can be shared by a `reject` route and an `accept` route that admits the
    /// same token meanwhile.
    pub(super) admitted: Option<(Token, u32)>,
    /// The last proof verified for this scope, with its token: the steady path (the same
    /// token and proof, request after request) compares bytes instead of verifying an
    /// Ed25519 signature again. Another proof for the same token is verified.
    pub(super) verified: Option<(Token, Box<[u8]>)>,
    /// The [`MarkSource`](crate::fence::source::MarkSource) view this gate last decided under (0: none yet, or no source);
    /// see [`crate::fence::source`].
    pub(super) view: u64,
}

/// In-flight counts per generation, sorted by token, no zero counts.
#[derive(Debug, Default)]
pub(super) struct Inflight(Vec<(Token, usize)>);

impl Inflight {
    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(super) fn older_than(&self, token: Token) -> bool {
        self.0.first().is_some_and(|(t, _)| *t < token)
    }

    pub(super) fn count(&self, token: Token) -> usize {
        self.0
            .binary_search_by(|(t, _)| t.cmp(&token))
            .map_or(0, |i| self.0[i].1)
    }

    pub(super) fn add(&mut self, token: Token) {
        match self.0.binary_search_by(|(t, _)| t.cmp(&token)) {
            Ok(i) => self.0[i].1 += 1,
            Err(i) => self.0.insert(i, (token, 1)),
        }
    }

    pub(super) fn remove(&mut self, token: Token) {
        if let Ok(i) = self.0.binary_search_by(|(t, _)| t.cmp(&token)) {
            self.0[i].1 -= 1;
            if self.0[i].1 == 0 {
                self.0.remove(i);
            }
        }
    }
}

#[derive(Debug)]
pub(super) struct Gate {
    pub(super) state: Mutex<GateState>,
    pub(super) notify: Notify,
}

impl Gate {
    pub(super) fn lock(&self) -> MutexGuard<'_, GateState> {
        // A panic while holding the lock leaves the state consistent enough (every update
        // is a single assignment); keep serving rather than poisoning the scope forever.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}
