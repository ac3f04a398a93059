//! The forward's answer recorded (the record phase): a whole answer as completed, with
//! its body while it fits; one provably not applied as released, so a retry goes again;
//! any other as unknown. What the forward came to is its typed [`Verdict`].

use std::time::Instant;

use bytes::Bytes;
use http::Response;
use http_body_util::{BodyExt, Full};

use super::Attempt;
use super::budget::{Chain, Held, Room, read_up_to};
use super::record::{State, put_within};
use crate::fence::InflightGuard;
use crate::proxy::context::Verdict;
use crate::proxy::forward::{CutShort, holds_back};
use crate::proxy::{Body, FENCING_RESULT, Outcome};
use crate::rt::timer::ReadTimedOut;

impl Attempt {
    /// Records what the forward came to and answers the client. `held` keeps the
    /// generation in flight until the answer is over; `started`: when the exchange began.
    pub(super) async fn settle(
        self,
        resp: Response<Body>,
        held: Option<InflightGuard>,
        started: Instant,
    ) -> Response<Body> {
        // As the forwarder said (asked for with `report`).
        match resp.extensions().get::<Verdict>().copied() {
            Some(Verdict::Accepted) => self.keep(resp, held, started).await,
            // Never reached the upstream, or refused before forwarding: not applied.
            Some(Verdict::NotForwarded(_)) => {
                complete(held);
                let record = self.record(State::Released, &[]);
                let _ = put_within(&self.store, self.record_key, record, self.claim_wait).await;
                resp
            }
            // Sent, no answer: the scope settles (as `forward`'s guard made it).
            _ => {
                drop(held);
                let record = self.record(State::Unknown, &[]);
                let _ = put_within(&self.store, self.record_key, record, self.claim_wait).await;
                resp
            }
        }
    }

    /// An accepted answer: its body read (up to `cap`, within the budget) and recorded as
    /// completed, then passed on as it came.
    async fn keep(
        self,
        resp: Response<Body>,
        held: Option<InflightGuard>,
        started: Instant,
    ) -> Response<Body> {
        let (parts, body) = resp.into_parts();
        // A body that breaks midway was still applied (the head came back): record it as
        // completed without a replayable body. Stored only while the budget has room;
        // beyond it the rest is streamed and the record keeps no body, as past `cap`.
        let mut room = Room::default();
        let read = crate::rt::timer::timeout_from(
            started,
            self.timeout,
            read_up_to(body, self.cap, &self.budget, &mut room),
        )
        .await;
        let (prefix, rest, broken) = match read {
            Ok(Ok((prefix, rest))) => (prefix, rest, None),
            Ok(Err(e)) if !e.is::<ReadTimedOut>() => (Bytes::new(), None, Some(e)),
            // The body did not end within the upstream timeout (or a wait for more of it
            // outlasted that timeout, whichever came first): the exchange is treated as
            // one that timed out (504, outcome unknown), and `held` drops uncompleted, so
            // the scope settles before a newer generation goes. (Counted once already, as
            // accepted, when the head came.)
            Ok(Err(_)) | Err(_) => {
                drop(held);
                let record = self.record(State::Unknown, &[]);
                let _ = put_within(
                    &self.store,
                    self.record_key.clone(),
                    record,
                    self.claim_wait,
                )
                .await;
                return self.answer(Outcome::UpstreamTimeout {
                    scope: Some(self.scope.clone()),
                    detail: format!("the response body did not arrive within {:?}", self.timeout),
                });
            }
        };
        complete(held);
        let headers = parts
            .headers
            .iter()
            .filter(|(n, _)| *n != http::header::DATE && *n != FENCING_RESULT)
            .map(|(n, v)| (n.as_str().to_string(), v.as_bytes().to_vec()))
            .collect();
        let body_stored = rest.is_none() && broken.is_none();
        let state = State::Completed {
            status: parts.status.as_u16(),
            headers,
            body_stored,
        };
        let stored: &[u8] = if body_stored { &prefix } else { &[] };
        let record = self.record(state, stored);
        if let Err(e) = put_within(
            &self.store,
            self.record_key.clone(),
            record,
            self.claim_wait,
        )
        .await
        {
            tracing::warn!(error = %e, "idempotency record not completed; a retry will see an unknown outcome");
        }
        let body = match (rest, broken) {
            // The client sees it break as it broke: the head, then a body cut short (not
            // a complete empty one).
            (_, Some(e)) => Held {
                body: CutShort::new(e, holds_back(self.client_version, &parts.headers)),
                _room: room,
            }
            .boxed(),
            (None, None) => Held {
                body: Full::new(prefix).map_err(|e| match e {}),
                _room: room,
            }
            .boxed(),
            (Some(rest), None) => Held {
                body: Chain {
                    first: Some(prefix),
                    rest,
                },
                _room: room,
            }
            .boxed(),
        };
        Response::from_parts(parts, body)
    }
}

/// The exchange ended with a whole answer (or provably never reached the upstream).
fn complete(held: Option<InflightGuard>) {
    if let Some(mut held) = held {
        held.complete();
    }
}
