//! Idempotency-Key at the proxy (IETF httpapi-idempotency-key-header), per scope.
//!
//! Fencing orders ownership generations; idempotency tells attempts within one generation
//! apart. A fenced request with a key is fenced first; then (scope, key) is claimed durably
//! with a fingerprint of the request before it is forwarded; the upstream's response is
//! stored when it completes and replayed to retries without reaching the upstream.
//!
//! A keyed request's phases ([`Idempotency::handle`]): the key ([`key`]) → the body, read
//! whole within the memory budget ([`budget`]) → the claim of its record ([`claim`]),
//! or a retry's answer from it ([`replay`]) → the forward → the answer recorded
//! ([`mod@answer`], in the record's layout of [`record`]). [`layer`] puts the stage in the
//! stack.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::{Request, Response, Version};

mod answer;
mod budget;
mod claim;
pub mod config;
pub mod fingerprint;
mod key;
mod layer;
mod record;
mod replay;

pub use config::{IdempotencyConfig, Mode, OnUnknown};
pub use key::{KeyError, parse_key};
pub use layer::{IdempotencyLayer, Idempotent};
pub use record::COLLECT_EVERY;

use crate::metrics::Op;
use crate::proxy::context::{Admitted, Conn, Plan, Verdict};
use crate::proxy::problem::Dialect;
use crate::proxy::stage::{Stage, Staged};
use crate::proxy::{Body, Outcome, Table};
use crate::store::MarkStore;
use crate::store::quota::RecordQuota;
use crate::token::Token;
use budget::{Budget, Room, read_up_to};
use record::{Meta, State, collect_expired, encode};

/// The keyed exchange's future, boxed: it is larger than the rest of the request's,
/// which hyper moves whole as it sets it up.
type Keyed = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

pub struct Idempotency {
    store: MarkStore,
    boot: u64,
    budget: Budget,
}

/// One keyed attempt's context, as its phases read it: where it is counted and answered,
/// its record's key, fingerprint and expiry, and the bounds it runs under.
struct Attempt {
    table: Arc<Table>,
    route: usize,
    op: Op,
    /// Named in an S3 error document, on routes that answer in that dialect.
    path: Arc<str>,
    dialect: Dialect,
    scope: String,
    token: Token,
    store: MarkStore,
    /// Which process run claims the record.
    boot: u64,
    budget: Budget,
    record_key: String,
    fingerprint: String,
    now: u64,
    expires: u64,
    /// As long as a request waits for its mark's commit (a hung disk).
    claim_wait: Duration,
    /// When the claim is given up on: `claim_wait` from the attempt's start.
    claim_by: Instant,
    /// The client a new record counts against, and the bounds on records.
    quota: (String, RecordQuota),
    /// `idempotency_unknown = "forward"`: a retry of an unknown outcome goes again.
    forward_unknown: bool,
    /// The upstream's timeout, which bounds the bodies' reads too.
    timeout: Duration,
    /// `max_response_body`: the largest answer body stored for replay.
    cap: u64,
    client_version: Version,
}

impl Attempt {
    /// Refuses the request: nothing was forwarded under this admission.
    fn refuse(&self, plan: &mut Plan, outcome: Outcome) -> Response<Body> {
        refuse(&self.table, plan, outcome, &self.path)
    }

    /// The record's value in `state`, with `body`.
    fn record(&self, state: State, body: &[u8]) -> Vec<u8> {
        encode(
            self.expires,
            &Meta::new(self.fingerprint.clone(), state, self.boot),
            body,
        )
    }

    /// An answer of this stage's own after the forward (counted as the forward was).
    fn answer(&self, outcome: Outcome) -> Response<Body> {
        answer(outcome, self.dialect, &self.path)
    }
}

/// Refuses a keyed request before anything was forwarded under its admission.
fn refuse(table: &Table, plan: &mut Plan, outcome: Outcome, path: &str) -> Response<Body> {
    if let Some(g) = plan.guard.as_mut() {
        g.not_forwarded();
    }
    table.refuse(plan.route, plan.op, outcome, Some(path))
}

/// An answer of this stage's own, not counted again, with its [`Verdict`] for the access
/// log.
fn answer(outcome: Outcome, dialect: Dialect, path: &str) -> Response<Body> {
    let verdict = Verdict::Refused(outcome.result());
    let mut resp = outcome.into_response_in(dialect, Some(path), None);
    resp.extensions_mut().insert(verdict);
    resp
}

impl Idempotency {
    /// `max_buffered`: bytes of bodies held in memory at once for requests with a key.
    pub fn new(store: MarkStore, max_buffered: u64) -> Idempotency {
        use std::hash::BuildHasher;
        let boot = std::collections::hash_map::RandomState::new().hash_one(SystemTime::now());
        let permits = usize::try_from(max_buffered)
            .unwrap_or(usize::MAX)
            .min(tokio::sync::Semaphore::MAX_PERMITS);
        Idempotency {
            store,
            boot,
            budget: Budget {
                room: Arc::new(tokio::sync::Semaphore::new(permits)),
                size: permits,
            },
        }
    }

    /// Bytes of bodies held in memory for requests with a key right now.
    pub fn buffered(&self) -> usize {
        self.budget.size - self.budget.room.available_permits()
    }

    /// Deletes every expired record, in bounded batches; answers how many went.
    pub async fn collect(&self) -> usize {
        collect_expired(&self.store, record::COLLECT_BATCH).await
    }

    /// A fenced, admitted request on a route with idempotency on, phase by phase; `fwd`
    /// forwards it.
    async fn handle<S>(&self, fwd: S, admitted: Admitted<Body>) -> Response<Body>
    where
        S: Stage<Body> + Clone + 'static,
    {
        let Admitted {
            req,
            table,
            mut plan,
            conn,
            report,
        } = admitted;
        let path: Arc<str> = req.uri().path().into();
        let route = &table.config.routes[plan.route];
        let key = match key::of(route, &req) {
            Ok(Some(key)) => key,
            Ok(None) => {
                let mut fwd = Staged(fwd);
                return unwrap(forward(&mut fwd, req, table.clone(), plan, conn, report).await);
            }
            Err(outcome) => return refuse(&table, &mut plan, outcome, &path),
        };
        // An exchange that may go on after its client has gone counts on the client's
        // share of descriptors until it ends (see `listen::share`); past the share it does
        // not start.
        let unit = match conn.client.as_ref().map(|c| c.one_more()).transpose() {
            Ok(unit) => unit,
            Err(held) => {
                let outcome = Outcome::UpstreamUnavailable {
                    scope: plan.scope.clone(),
                    detail: crate::listen::share::over_share(held),
                };
                return refuse(&table, &mut plan, outcome, &path);
            }
        };
        let client_version = req.version();
        let (parts, body) = req.into_parts();
        let read = self.read_body(&table, plan.route, (&plan.scope, plan.token), &parts, body);
        let (body, room) = match read.await {
            Ok(read) => read,
            Err(outcome) => return refuse(&table, &mut plan, outcome, &path),
        };
        let attempt = self.attempt(
            &table,
            &plan,
            &parts,
            &body,
            &key,
            path,
            conn.clone(),
            client_version,
        );
        let dialect = attempt.dialect;
        let task_path = attempt.path.clone();
        // The claim, the forward and the record run in a task of their own. A claim is
        // committed whether or not anyone awaits it: made for a client that went away
        // meanwhile and never finished, it would answer every retry 409 `in_progress`
        // until it expired. And once forwarded, the upstream's answer is recorded even if
        // the client is gone, so the client's retry is answered from the record. The
        // worker's shutdown waits for the task (within its grace), since no connection does.
        let task = crate::rt::drain::spawn_detached(async move {
            if let Some(answered) = attempt.claim(&mut plan).await {
                return answered;
            }
            // The response body is read after the guard has gone with the response: this
            // count keeps the generation in flight until the exchange is over, and is
            // completed unless the exchange ended without a whole response.
            let held = plan.guard.as_ref().map(crate::fence::InflightGuard::hold);
            // The body's deadline counts from here, as the head's does in `forward`.
            let started = Instant::now();
            let req = Request::from_parts(parts, body_of(body));
            let mut fwd = Staged(fwd);
            let resp =
                unwrap(forward(&mut fwd, req, attempt.table.clone(), plan, conn, true).await);
            // The body's room is given back once the exchange has its answer: a body in
            // memory is kept (or queued to be written) until then, whichever way it went.
            drop(room);
            let resp = attempt.settle(resp, held, started).await;
            drop(unit);
            resp
        });
        match task.await {
            Ok(resp) => resp,
            Err(_) => answer(
                Outcome::UpstreamTimeout {
                    scope: None,
                    detail: "the forwarding task failed".into(),
                },
                dialect,
                &task_path,
            ),
        }
    }

    /// Reads the request body whole: the fingerprint covers it, so it is read before
    /// anything is recorded. The read is bounded by the upstream's timeout, as a body read
    /// or streamed on the way upstream is: the admission counts this generation in flight
    /// meanwhile, and a paused sender must not keep a newer owner out for as long as it
    /// stays connected. It is bounded in size by the route's `max_body` too, when that is
    /// smaller: only a Content-Length was checked against it so far, and a body without
    /// one (chunked, HTTP/2) must not be held in memory past the route's limit.
    async fn read_body(
        &self,
        table: &Table,
        route: usize,
        (scope, token): (&Option<String>, Option<Token>),
        parts: &http::request::Parts,
        body: Body,
    ) -> Result<(Bytes, Room), Outcome> {
        // (Not the plan: it is not `Sync`, and this future is sent.)
        let route = &table.config.routes[route];
        let settings = &table.config.idempotency;
        let limit = route.max_body.map_or(settings.max_request_body, |m| {
            m.min(settings.max_request_body)
        });
        let timeout = table.config.upstreams[route.upstream].timeout;
        // Room for the whole body is taken before it is read when its length is known, as
        // it is read otherwise; with none left, 503 (load is shed, memory stays bounded).
        let mut room = Room::default();
        let declared = parts
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|len| *len <= limit)
            .and_then(|len| usize::try_from(len).ok());
        let no_room = || Outcome::Unavailable {
            scope: scope.clone().unwrap_or_default(),
            token: token.unwrap_or(Token::new(0, 0)),
        };
        if declared.is_some_and(|len| !room.cover(&self.budget, len)) {
            return Err(no_room());
        }
        let read = crate::rt::timer::timeout_from(
            Instant::now(),
            timeout,
            read_up_to(body, limit, &self.budget, &mut room),
        )
        .await;
        if room.short {
            return Err(no_room());
        }
        match read {
            Ok(Ok((bytes, None))) => Ok((bytes, room)),
            Ok(Ok((_, Some(_)))) => Err(Outcome::PayloadTooLarge { limit }),
            Ok(Err(_)) | Err(_) => Err(Outcome::InvalidRequest {
                detail: "the request body could not be read (in time)".into(),
            }),
        }
    }

    /// The attempt's context: its fingerprint and record key, and the bounds it runs under.
    #[allow(clippy::too_many_arguments)]
    fn attempt(
        &self,
        table: &Arc<Table>,
        plan: &Plan,
        parts: &http::request::Parts,
        body: &Bytes,
        key: &str,
        path: Arc<str>,
        conn: Conn,
        client_version: Version,
    ) -> Attempt {
        let config = &table.config;
        let route = &config.routes[plan.route];
        let settings = &config.idempotency;
        let scope = plan.scope.clone().unwrap_or_default();
        let token = plan.token.unwrap_or(Token::new(0, 0));
        let fingerprint = fingerprint::fingerprint(
            parts,
            token,
            &config.fencing.header,
            body,
            &settings.fingerprint_ignore,
        );
        let now = record::now_secs();
        // As long as a request waits for its mark's commit (a hung disk).
        let claim_wait = config
            .fencing
            .drain_timeout
            .max(crate::fence::gate::MIN_COMMIT_WAIT);
        Attempt {
            table: table.clone(),
            route: plan.route,
            op: plan.op,
            path,
            dialect: route.errors,
            record_key: format!("{scope}\0{key}"),
            scope,
            token,
            store: self.store.clone(),
            boot: self.boot,
            budget: self.budget.clone(),
            fingerprint,
            now,
            expires: now.saturating_add(settings.ttl.as_secs()),
            claim_wait,
            claim_by: Instant::now() + claim_wait,
            // The client a new record counts against: its address, an IPv6 one by its
            // /64 (as `max_connections_per_ip` counts it: a host may use every address of
            // it).
            quota: (
                crate::store::quota::client_key(conn.peer.ip()),
                RecordQuota {
                    total: settings.max_records,
                    per_scope: settings.max_records_per_scope,
                    per_client: settings.max_records_per_client,
                    reserve: settings.reserve(),
                    min_free: config.store.min_free,
                },
            ),
            forward_unknown: route.idempotency_unknown == OnUnknown::Forward,
            timeout: config.upstreams[route.upstream].timeout,
            cap: settings.max_response_body,
            client_version,
        }
    }
}

/// A request body in memory, as a body again.
fn body_of(bytes: Bytes) -> Body {
    use http_body_util::BodyExt;
    http_body_util::Full::new(bytes)
        .map_err(|e| match e {})
        .boxed()
}

fn unwrap(r: Result<Response<Body>, Infallible>) -> Response<Body> {
    match r {
        Ok(resp) => resp,
        Err(never) => match never {},
    }
}

/// Hands a request to the inner stage (`report`: asking for its [`Verdict`]). Through
/// [`Staged`] (boxed): a future of a generic stage awaited in the spawned task would have
/// to be proven `Send` for every lifetime, which the compiler cannot do.
fn forward<S>(
    fwd: &mut Staged<S>,
    req: Request<Body>,
    table: Arc<Table>,
    plan: Plan,
    conn: Conn,
    report: bool,
) -> Keyed
where
    S: Stage<Body> + Clone + 'static,
{
    use tower::Service as _;
    fwd.call(Admitted {
        req,
        table,
        plan,
        conn,
        report,
    })
}

#[cfg(test)]
mod tests;
