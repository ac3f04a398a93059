//! The claim of a keyed request's record (its claim phase): made durably before the
//! request is forwarded; a record already there answers the retry instead (replayed,
//! refused, or taken over when its outcome is provably not applied).

use http::Response;

use super::Attempt;
use super::record::{Meta, State, decode, fingerprint_version_is_current};
use super::replay::replay;
use crate::proxy::context::Plan;
use crate::proxy::{Body, Outcome};
use crate::store::marks::Claimed;

impl Attempt {
    /// Claims the record; `None` when claimed (the request goes on), else the answer.
    pub(super) async fn claim(&self, plan: &mut Plan) -> Option<Response<Body>> {
        let (scope, token) = (self.scope.clone(), self.token);
        let mine = self.record(State::InFlight, &[]);
        let mut replace_if = None;
        loop {
            let mut claim = {
                let (store, key, mine) =
                    (self.store.clone(), self.record_key.clone(), mine.clone());
                let replace_if = replace_if.take();
                let quota = Some(self.quota.clone());
                let now = self.now;
                Box::pin(async move { store.claim_within(key, mine, replace_if, now, quota).await })
            };
            let claimed = match crate::rt::timer::timeout_at(self.claim_by, &mut claim).await {
                Ok(claimed) => claimed,
                // The disk is not answering: 503 `unavailable`, and nothing is forwarded,
                // as for a mark. The claim may still land; then it is released, so that
                // the retry this answer asks for is forwarded.
                Err(_) => {
                    let (store, key) = (self.store.clone(), self.record_key.clone());
                    let released = self.record(State::Released, &[]);
                    // Counted by the worker's drain: shutdown waits for it (within its
                    // grace), so a landed claim is not left in flight.
                    crate::rt::drain::spawn_detached(async move {
                        if let Ok(Claimed::Claimed) = claim.await {
                            let _ = store.put_record(key, released).await;
                        }
                    });
                    return Some(self.refuse(plan, Outcome::Unavailable { scope, token }));
                }
            };
            let existing = match claimed {
                Ok(Claimed::Claimed) => return None,
                Ok(Claimed::Held(existing)) => existing,
                Ok(Claimed::Rejected(why)) => {
                    tracing::debug!(%scope, reason = why.describe(), "a new Idempotency-Key past a bound on the records: key_rejected");
                    let detail = why.describe();
                    let outcome = Outcome::KeyRejected {
                        scope,
                        token,
                        detail,
                    };
                    return Some(self.refuse(plan, outcome));
                }
                Err(_) => {
                    return Some(self.refuse(plan, Outcome::Unavailable { scope, token }));
                }
            };
            let Some((meta, stored_body)) = decode(&existing) else {
                return Some(self.refuse(plan, Outcome::Unavailable { scope, token }));
            };
            match self.retry(plan, meta, stored_body) {
                Retry::Answer(resp) => return Some(resp),
                // Take the key over only if nobody else did in between (compare and swap);
                // if someone did, the next look sees their record.
                Retry::TakeOver => replace_if = Some(existing),
            }
        }
    }

    /// What a retry of the record `meta` (with `stored_body`) is answered.
    fn retry(&self, plan: &mut Plan, meta: Meta, stored_body: &[u8]) -> Retry {
        let (scope, token) = (self.scope.clone(), self.token);
        if !meta.made_for(&self.fingerprint) {
            if !fingerprint_version_is_current(&meta) {
                tracing::debug!(
                    version = meta.fingerprint_version,
                    "an Idempotency-Key record of another fingerprint version: key_reused"
                );
            }
            return Retry::Answer(self.refuse(plan, Outcome::KeyReused { scope, token }));
        }
        let retry_unknown = match meta.state {
            State::InFlight if meta.boot == self.boot => {
                return Retry::Answer(self.refuse(plan, Outcome::InProgress { scope, token }));
            }
            State::Completed {
                status,
                headers,
                body_stored,
            } => {
                if let Some(g) = plan.guard.as_mut() {
                    g.complete();
                }
                self.table.count(self.route, self.op, "duplicate");
                return Retry::Answer(replay(status, headers, body_stored, stored_body));
            }
            State::Released => true,
            State::InFlight | State::Unknown => self.forward_unknown,
        };
        if !retry_unknown {
            return Retry::Answer(self.refuse(plan, Outcome::OutcomeUnknown { scope, token }));
        }
        Retry::TakeOver
    }
}

/// What a retry finds in a record made for it.
enum Retry {
    Answer(Response<Body>),
    /// The record's outcome lets the retry go again: take it over.
    TakeOver,
}
