//! One look at a gate under its lock: from the gate's state and what the request brings,
//! what it does next (refuse, admit, commit, wait), for tokens and for sequences.

use std::sync::Arc;

use tokio::time::Instant;

use crate::fence::policy::EqualPolicy;
use crate::fence::policy::{Decision, decide};
use crate::token::Token;

use super::commit::{commit_deadline, observe};
use super::guard::{Admission, InflightGuard};
use super::state::{Gate, GateState};
use super::{Gates, Refusal};

/// What one request brings to a look at its gate ([`Gates::step`]), and what it has
/// done so far.
pub(super) struct At<'a> {
    pub(super) scope: &'a str,
    pub(super) token: Token,
    pub(super) sequence: Option<u64>,
    pub(super) equal: EqualPolicy,
    /// This request advanced the mark (or took an unclaimed advance).
    pub(super) advanced: &'a mut bool,
    /// This request's sequence is recorded (or it took an unclaimed record).
    pub(super) recorded: &'a mut bool,
    pub(super) arrived: Instant,
    pub(super) now: Instant,
}

pub(super) enum Step {
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

impl Gates {
    /// One look at the gate under its lock, at `at.now`: what this request does next.
    pub(super) fn step(&self, st: &mut GateState, gate: &Arc<Gate>, at: &mut At<'_>) -> Step {
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
    pub(super) fn sequence_step(
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
}
