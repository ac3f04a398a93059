//! Admission: a request's loop of looks at its gate, commits and waits, until it is
//! admitted or refused. The hot path: one look under the lock decides most requests.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::time::Instant;

use crate::fence::policy::EqualPolicy;
use crate::store::Mark;
use crate::token::Token;

use super::commit::{Claim, commit_deadline};
use super::decide::{At, Step};
use super::guard::Admission;
use super::state::{Gate, GateState};
use super::{Gates, Proof, Refusal};

/// Checks `proof` for (`scope`, `token`) unless the gate verified these very bytes for this
/// token already. The signature is checked outside the gate's lock.
pub(super) fn verify_at(
    gate: &Gate,
    scope: &str,
    token: Token,
    proof: Proof<'_>,
) -> Result<(), Refusal> {
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

/// Counts one waiting request, in the gate and in total, while it lives.
pub(super) struct Waiting<'a> {
    pub(super) total: &'a AtomicUsize,
    pub(super) gate: Arc<Gate>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.total.fetch_sub(1, Ordering::Relaxed);
        let mut st = self.gate.lock();
        st.waiters = st.waiters.saturating_sub(1);
    }
}

impl Gates {
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
                Step::Admit(a) => {
                    if let Some(claim) = claim.take() {
                        claim.used();
                    }
                    return self.admitted(scope, token, a, waiting.is_some());
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
            self.keep_waiting(&gate, &mut waiting, arrived, give_up, for_commit)?;
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

    /// A request the gate admitted: refused after all if a collection operation holds its
    /// scope's tree; `waited` (it registered as a waiter) makes its wait count.
    #[inline]
    fn admitted(
        &self,
        scope: &str,
        token: Token,
        mut a: Admission,
        waited: bool,
    ) -> Result<Admission, Refusal> {
        // A collection operation in flight may change this scope's object whole (SPEC
        // §16): it was checked against the marks there were, and this request's mark may
        // have landed since. Looked at only now that the mark is durable: one of the two
        // always sees the other.
        if self.trees.covers(scope) {
            a.guard.not_forwarded();
            return Err(Refusal::Draining {
                highest: Some(token),
            });
        }
        // Only requests that really waited for an older generation count.
        if waited {
            self.metrics.gate_wait_seconds.observe_duration(a.waited);
        }
        Ok(a)
    }

    /// Before a wait: counts the request as a waiter the first time (refused `Draining`
    /// when the gate has its fill of them), and refuses it once `give_up` has passed.
    fn keep_waiting<'a>(
        &'a self,
        gate: &Arc<Gate>,
        waiting: &mut Option<Waiting<'a>>,
        arrived: Instant,
        give_up: Instant,
        for_commit: bool,
    ) -> Result<(), Refusal> {
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
            *waiting = Some(Waiting {
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
        Ok(())
    }
}
