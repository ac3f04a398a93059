//! Commit bookkeeping: an advance or a sequence record queued at the mark writer, what
//! the gate takes when it lands, and what is left unclaimed for a retry when its request
//! never reaches the upstream.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::store::Mark;
use crate::store::marks::{StoreError, writer_stopped};
use crate::token::Token;

use super::state::{Gate, GateState};
use super::{Gates, Refusal};

/// An advance queued at the writer; dropping it before the commit landed leaves a task
/// to finish the gate's bookkeeping when it does.
pub(super) struct PendingCommit {
    pub(super) rx: Option<oneshot::Receiver<Result<Mark, StoreError>>>,
    pub(super) gate: Arc<Gate>,
    pub(super) mark: Mark,
    /// The commit raises the token (else it records a sequence of the current one).
    pub(super) advance: bool,
    /// A request's commit (not an admin raise): if it lands with nobody waiting, the
    /// request was never forwarded and its token (or sequence) is left unclaimed.
    pub(super) for_request: bool,
}

impl PendingCommit {
    pub(super) async fn wait(mut self) -> Result<Mark, StoreError> {
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
pub(super) struct Finish {
    pub(super) rx: Option<oneshot::Receiver<Result<Mark, StoreError>>>,
    pub(super) gate: Arc<Gate>,
    pub(super) mark: Mark,
    pub(super) advance: bool,
    pub(super) for_request: bool,
}

impl Finish {
    pub(super) async fn run(mut self) {
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
pub(super) fn unclaim(st: &mut GateState, token: Token) {
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
pub(super) fn unclaim_sequence(st: &mut GateState, token: Token, n: u64) {
    if st.current == Some(token) && st.sequence == Some(n) {
        st.seq_unclaimed = Some((token, n));
        st.last_used = Some(Instant::now());
    }
}

/// The gate's view takes a stored mark: a higher token starts its sequence over.
pub(super) fn observe(st: &mut GateState, stored: Mark) {
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
pub(super) struct Claim<'a> {
    pub(super) gate: &'a Gate,
    pub(super) token: Token,
    pub(super) advanced: bool,
    pub(super) sequence: Option<u64>,
}

impl<'a> Claim<'a> {
    /// Keeps `claim` up to date with what the request has committed so far.
    pub(super) fn note(
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
    pub(super) fn used(self) {
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
pub(super) fn finish_commit(
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

/// The shortest time a commit is waited for, whatever `drain_timeout` says: a zero
/// `drain_timeout` (never wait for older generations) must not fail every advance.
pub(crate) const MIN_COMMIT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// When a request that arrived at `arrived` stops waiting for its mark's commit (a hung
/// fsync): its drain deadline, but not before [`MIN_COMMIT_WAIT`].
pub(super) fn commit_deadline(arrived: Instant, drain_timeout: Duration) -> Instant {
    arrived + drain_timeout.max(MIN_COMMIT_WAIT)
}

impl Gates {
    /// Commits an advance and brings the gate up to date. Cancel-safe: if the request
    /// goes away mid-commit, a task finishes the bookkeeping when the commit lands, so
    /// the gate never believes an advance is still under way. A commit that has not
    /// landed by `deadline` (a hung fsync) is answered `Unavailable`; the commit is then
    /// left to that task as if the request had gone away.
    /// `for_request`: the advance of a request (not an admin raise).
    pub(super) async fn commit(
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
}
