//! What an admitted request holds: its [`InflightGuard`] (counted in flight for its
//! generation until it completes, or settles the scope when abandoned), and a collection
//! operation's [`TreeHold`] on the scopes beneath it (SPEC §16).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use crate::token::Token;

use super::commit::{unclaim, unclaim_sequence};
use super::state::Gate;

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
    pub(super) gate: Arc<Gate>,
    pub(super) token: Token,
    /// The request's recorded `Fencing-Sequence`, if it had one.
    pub(super) sequence: Option<u64>,
    pub(super) settle: Duration,
    pub(super) completed: bool,
    /// This admission's request advanced the mark (or took an unclaimed advance).
    pub(super) advanced: bool,
    /// Nothing of this admission reached the upstream (see [`InflightGuard::not_forwarded`]).
    pub(super) unused: bool,
    /// A collection operation's hold on the tree beneath its scope (SPEC §16), released
    /// with this guard: at once if the upstream answered, else once the scope has settled.
    pub(super) tree: Option<Box<TreeHold>>,
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
    /// [`GateState::unclaimed`](super::state::GateState::unclaimed)).
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
pub(super) struct Trees {
    /// Holds in the list, expired or not: 0 spares admissions the lock.
    pub(super) count: AtomicUsize,
    pub(super) holds: Mutex<Vec<Held>>,
    pub(super) next: std::sync::atomic::AtomicU64,
}

#[derive(Debug)]
pub(super) struct Held {
    pub(super) id: u64,
    /// The scope with a `/` appended: what every scope beneath it starts with.
    pub(super) beneath: Box<str>,
    /// `Some`: released by a request that did not complete; held until then.
    pub(super) until: Option<Instant>,
}

impl Trees {
    pub(super) fn lock(&self) -> MutexGuard<'_, Vec<Held>> {
        self.holds.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn hold(self: &Arc<Self>, scope: &str) -> TreeHold {
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
    pub(super) fn covers(&self, scope: &str) -> bool {
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

    pub(super) fn release(&self, id: u64, until: Option<Instant>) {
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

/// A collection operation's hold on the scopes beneath its own ([`Gates::hold_tree`](super::Gates::hold_tree)).
/// Dropped on its own (the request was refused before it was forwarded), it is released
/// at once; handed to the request's guard ([`InflightGuard::hold_tree`]), with it.
#[derive(Debug)]
pub struct TreeHold {
    pub(super) trees: Arc<Trees>,
    pub(super) id: u64,
    /// Kept until then once dropped (`None`: released at once).
    pub(super) until: Option<Instant>,
}

impl TreeHold {
    /// Released by the request's guard: at once if the upstream answered, else held
    /// until the scope has settled.
    pub(super) fn release(&mut self, completed: bool, settle: Duration) {
        self.until = (!completed).then(|| Instant::now() + settle);
    }
}

impl Drop for TreeHold {
    fn drop(&mut self) {
        self.trees.release(self.id, self.until);
    }
}
