//! Idempotency-Key at the proxy (IETF httpapi-idempotency-key-header), per scope.
//!
//! Fencing orders ownership generations; idempotency tells attempts within one generation
//! apart. A fenced request with a key is fenced first; then (scope, key) is claimed durably
//! with a fingerprint of the request before it is forwarded; the upstream's response is
//! stored when it completes and replayed to retries without reaching the upstream.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body::{Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use serde::{Deserialize, Serialize};

pub mod config;
pub mod fingerprint;
pub use config::{IdempotencyConfig, Mode, OnUnknown};

use crate::fence::InflightGuard;
use crate::proxy::context::{Admitted, Conn, Plan, Verdict};
use crate::proxy::stage::{Stage, Staged};
use crate::proxy::{Body, BoxError, FENCING_RESULT, Outcome};
use crate::rt::timer::ReadTimedOut;
use crate::store::MarkStore;
use crate::store::marks::Claimed;
use crate::store::quota::RecordQuota;

/// The idempotency stage as a layer, under the fence: a fenced, admitted request on a
/// route with `idempotency` on is claimed, forwarded by the inner service and recorded;
/// every other request goes to the inner service as it is.
#[derive(Clone)]
pub struct IdempotencyLayer {
    state: Arc<Idempotency>,
}

impl IdempotencyLayer {
    pub fn new(state: Arc<Idempotency>) -> IdempotencyLayer {
        IdempotencyLayer { state }
    }
}

impl<S> tower::Layer<S> for IdempotencyLayer {
    type Service = Idempotent<S>;

    fn layer(&self, inner: S) -> Idempotent<S> {
        Idempotent {
            state: self.state.clone(),
            inner,
        }
    }
}

/// [`IdempotencyLayer`]'s service. Always ready, as the inner one must be.
#[derive(Clone)]
pub struct Idempotent<S> {
    state: Arc<Idempotency>,
    inner: S,
}

type Keyed = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

pin_project_lite::pin_project! {
    /// [`Idempotent`]'s future as a [`Stage`]: the inner stage's, or the keyed exchange.
    #[project = ServedProj]
    pub(crate) enum Served<F> {
        Passed { #[pin] fut: F },
        Keyed { #[pin] fut: Keyed },
    }
}

impl<F: Future<Output = Response<Body>>> Future for Served<F> {
    type Output = Response<Body>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Response<Body>> {
        match self.project() {
            ServedProj::Passed { fut } => fut.poll(cx),
            ServedProj::Keyed { fut } => fut.poll(cx).map(|r| match r {
                Ok(resp) => resp,
                Err(never) => match never {},
            }),
        }
    }
}

impl<S, B> Stage<B> for Idempotent<S>
where
    S: Stage<Body> + Clone + 'static,
    B: http_body::Body<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<BoxError>,
{
    // Forced inline with the forwarder's (see there): the unkeyed request's path is a
    // pass-through.
    #[inline(always)]
    fn serve(&self, a: Admitted<B>) -> impl Future<Output = Response<Body>> + Send + '_ {
        let (a, keyed) = boxed_and_keyed(a);
        if !keyed {
            return Served::Passed {
                fut: self.inner.serve(a),
            };
        }
        let state = self.state.clone();
        let inner = self.inner.clone();
        Served::Keyed {
            fut: Box::pin(async move { Ok(state.handle(inner, a).await) }),
        }
    }
}

/// Whether `method` is safe (RFC 9110 §9.2.1): a read changes nothing, so a retry of one
/// needs no record, only to be sent again.
fn is_safe(method: &http::Method) -> bool {
    matches!(
        *method,
        http::Method::GET | http::Method::HEAD | http::Method::OPTIONS | http::Method::TRACE
    )
}

/// The admitted request with its body boxed, and whether this stage keys it (a fenced
/// generation on a route with `idempotency` on, of a method that may change something:
/// one the route fences, or any but the safe ones; a safe read with a token is fenced
/// but not recorded, so a client cannot fill the store with copies of what it reads);
/// both ways in ([`Stage`] and `Service`) decide with it.
fn boxed_and_keyed<B>(a: Admitted<B>) -> (Admitted<Body>, bool)
where
    B: http_body::Body<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<BoxError>,
{
    let Admitted {
        req,
        table,
        plan,
        conn,
        report,
    } = a;
    let req = req.map(|b| b.map_err(Into::into).boxed());
    let route = &table.config.routes[plan.route];
    let keyed = plan.guard.is_some()
        && route.idempotency != Mode::Off
        && (route.fences_method(req.method()) || !is_safe(req.method()));
    (
        Admitted {
            req,
            table,
            plan,
            conn,
            report,
        },
        keyed,
    )
}

#[derive(Debug, Serialize, Deserialize)]
enum State {
    InFlight,
    /// Sent; no response came back. The upstream may or may not have applied it.
    Unknown,
    /// Provably not applied (never reached the upstream): a retry may claim the key.
    Released,
    Completed {
        status: u16,
        headers: Vec<(String, Vec<u8>)>,
        /// False when the body was larger than `max_response_body`.
        body_stored: bool,
    },
}

#[derive(Debug, Serialize, Deserialize)]
struct Meta {
    fingerprint: String,
    /// What `fingerprint` covers ([`fingerprint::VERSION`]); absent from the records of
    /// versions before it, whose fingerprints covered no header (1).
    #[serde(default = "first_fingerprint_version")]
    fingerprint_version: u32,
    state: State,
    /// Which process run claimed it: an in-flight record of an earlier run is unknown.
    boot: u64,
}

impl Meta {
    /// A record of this version's fingerprint.
    fn new(fingerprint: String, state: State, boot: u64) -> Meta {
        Meta {
            fingerprint,
            fingerprint_version: fingerprint::VERSION,
            state,
            boot,
        }
    }

    /// Whether this record was made for the request fingerprinted `fingerprint` (by
    /// this version). A record of another fingerprint version is not: its fingerprint
    /// covered other parts of its request (a version 1 record, no header at all), so a
    /// retry that matched it could still be another request. It is answered
    /// `key_reused`, never `duplicate`.
    fn made_for(&self, fingerprint: &str) -> bool {
        self.fingerprint_version == fingerprint::VERSION && self.fingerprint == fingerprint
    }
}

fn first_fingerprint_version() -> u32 {
    1
}

/// Record layout: expiry (8 bytes, big-endian unix seconds) · JSON length (4) · JSON · body.
fn encode(expires: u64, meta: &Meta, body: &[u8]) -> Vec<u8> {
    let json = serde_json::to_vec(meta).unwrap_or_default();
    let mut v = Vec::with_capacity(12 + json.len() + body.len());
    v.extend_from_slice(&expires.to_be_bytes());
    v.extend_from_slice(&(json.len() as u32).to_be_bytes());
    v.extend_from_slice(&json);
    v.extend_from_slice(body);
    v
}

fn decode(v: &[u8]) -> Option<(Meta, &[u8])> {
    let len = u32::from_be_bytes(v.get(8..12)?.try_into().ok()?) as usize;
    let json = v.get(12..12 + len)?;
    let body = v.get(12 + len..)?;
    Some((serde_json::from_slice(json).ok()?, body))
}

/// Parses an `Idempotency-Key` value: a structured-field string (`"..."`), 1–255
/// printable ASCII characters.
pub fn parse_key(raw: &HeaderValue) -> Result<String, String> {
    let bad = || {
        "Idempotency-Key must be a quoted string of printable ASCII, e.g. \"8e03978e-40d5\""
            .to_string()
    };
    let s = raw.to_str().map_err(|_| bad())?;
    let inner = s
        .strip_prefix('"')
        .and_then(|s| s.strip_suffix('"'))
        .ok_or_else(bad)?;
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(e @ ('"' | '\\')) => out.push(e),
                _ => return Err(bad()),
            },
            '"' => return Err(bad()),
            ' '..='~' => out.push(c),
            _ => return Err(bad()),
        }
    }
    if out.is_empty() || out.len() > 255 {
        return Err("Idempotency-Key must have 1 to 255 characters".into());
    }
    Ok(out)
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub struct Idempotency {
    store: MarkStore,
    boot: u64,
    budget: Budget,
}

/// Bytes of request and response bodies that requests with an `Idempotency-Key` hold in
/// memory, over all connections (`idempotency.max_buffered`): a request body is read
/// whole before it is forwarded, and a response body is read to be stored.
#[derive(Clone)]
struct Budget {
    room: Arc<tokio::sync::Semaphore>,
    size: usize,
}

/// Room taken from a [`Budget`], given back when dropped.
#[derive(Default)]
struct Room {
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
    taken: usize,
    /// A take failed: the budget is spent.
    short: bool,
}

impl Room {
    /// Makes sure `total` bytes are covered; false (and `short`) if the budget has no room.
    fn cover(&mut self, budget: &Budget, total: usize) -> bool {
        let Some(more) = total.checked_sub(self.taken).filter(|m| *m > 0) else {
            return true;
        };
        let got = u32::try_from(more)
            .ok()
            .and_then(|n| budget.room.clone().try_acquire_many_owned(n).ok());
        match (got, self.permit.as_mut()) {
            (Some(p), Some(have)) => have.merge(p),
            (Some(p), None) => self.permit = Some(p),
            (None, _) => {
                self.short = true;
                return false;
            }
        }
        self.taken = total;
        true
    }
}

/// A body that holds its [`Room`] until it is dropped (sent, or abandoned).
struct Held<B> {
    body: B,
    _room: Room,
}

impl<B: http_body::Body + Unpin> http_body::Body for Held<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
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
        collect_expired(&self.store, COLLECT_BATCH).await
    }

    /// A fenced, admitted request on a route with idempotency on; `fwd` forwards it.
    async fn handle<S>(&self, fwd: S, admitted: Admitted<Body>) -> Response<Body>
    where
        S: Stage<Body> + Clone + 'static,
    {
        let Admitted {
            req,
            table,
            mut plan,
            conn,
            ..
        } = admitted;
        let mut fwd = Staged(fwd);
        let route_idx = plan.route;
        let op = plan.op;
        let client_version = req.version();
        // Named in an S3 error document, on routes that answer in that dialect.
        let req_path: Arc<str> = req.uri().path().into();
        let route = &table.config.routes[route_idx];
        let dialect = route.errors;
        let settings = &table.config.idempotency;
        let scope = plan.scope.clone().unwrap_or_default();
        let token = plan.token.unwrap_or(crate::token::Token::new(0, 0));
        let refuse = |plan: &mut Plan, outcome: Outcome| {
            // Nothing was forwarded under this admission.
            if let Some(g) = plan.guard.as_mut() {
                g.not_forwarded();
            }
            table.refuse(route_idx, op, outcome, Some(&req_path))
        };
        let mut keys = req.headers().get_all("idempotency-key").iter();
        let key = match (keys.next(), keys.next()) {
            (None, _) => {
                if route.idempotency == Mode::Required && route.fences_method(req.method()) {
                    return refuse(
                        &mut plan,
                        Outcome::InvalidRequest {
                            detail: "this route requires an Idempotency-Key header".into(),
                        },
                    );
                }
                return match forward(&mut fwd, req, table.clone(), plan, conn).await {
                    Ok(resp) => resp,
                    Err(never) => match never {},
                };
            }
            (Some(_), Some(_)) => {
                return refuse(
                    &mut plan,
                    Outcome::InvalidRequest {
                        detail: "more than one Idempotency-Key header".into(),
                    },
                );
            }
            (Some(v), None) => match parse_key(v) {
                Ok(k) => k,
                Err(detail) => return refuse(&mut plan, Outcome::InvalidRequest { detail }),
            },
        };

        // The fingerprint covers the body, so the body is read before anything is recorded.
        // The read is bounded by the upstream's timeout, as a body read or streamed on the
        // way upstream is: the admission counts this generation in flight meanwhile, and a
        // paused sender must not keep a newer owner out for as long as it stays connected.
        // It is bounded in size by the route's `max_body` too, when that is smaller: only a
        // Content-Length was checked against it so far, and a body without one (chunked,
        // HTTP/2) must not be held in memory past the route's limit.
        let (parts, body) = req.into_parts();
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
        let no_room = |plan: &mut Plan| {
            refuse(
                plan,
                Outcome::Unavailable {
                    scope: scope.clone(),
                    token,
                },
            )
        };
        if declared.is_some_and(|len| !room.cover(&self.budget, len)) {
            return no_room(&mut plan);
        }
        let read = crate::rt::timer::timeout_from(
            std::time::Instant::now(),
            timeout,
            read_up_to(body, limit, &self.budget, &mut room),
        )
        .await;
        if room.short {
            return no_room(&mut plan);
        }
        let body = match read {
            Ok(Ok((bytes, None))) => bytes,
            Ok(Ok((_, Some(_)))) => {
                return refuse(&mut plan, Outcome::PayloadTooLarge { limit });
            }
            Ok(Err(_)) | Err(_) => {
                return refuse(
                    &mut plan,
                    Outcome::InvalidRequest {
                        detail: "the request body could not be read (in time)".into(),
                    },
                );
            }
        };
        let fingerprint = fingerprint::fingerprint(
            &parts,
            token,
            &table.config.fencing.header,
            &body,
            &settings.fingerprint_ignore,
        );

        let record_key = format!("{scope}\0{key}");
        let now = now_secs();
        let expires = now.saturating_add(settings.ttl.as_secs());
        let mine = encode(
            expires,
            &Meta::new(fingerprint.clone(), State::InFlight, self.boot),
            &[],
        );
        // The claim, the forward and the record run in a task of their own. A claim is
        // committed whether or not anyone awaits it: made for a client that went away
        // meanwhile and never finished, it would answer every retry 409 `in_progress`
        // until it expired. And once forwarded, the upstream's answer is recorded even if
        // the client is gone, so the client's retry is answered from the record. The
        // worker's shutdown waits for the task (within its grace), since no connection does.
        let forward_unknown = route.idempotency_unknown == OnUnknown::Forward;
        // As long as a request waits for its mark's commit (a hung disk).
        let claim_wait = table
            .config
            .fencing
            .drain_timeout
            .max(crate::fence::gate::MIN_COMMIT_WAIT);
        let claim_by = std::time::Instant::now() + claim_wait;
        let store = self.store.clone();
        let boot = self.boot;
        let cap = settings.max_response_body;
        // The client a new record counts against: its address, an IPv6 one by its /64
        // (as `max_connections_per_ip` counts it: a host may use every address of it).
        let quota = (
            crate::store::quota::client_key(conn.peer.ip()),
            RecordQuota {
                total: settings.max_records,
                per_scope: settings.max_records_per_scope,
                per_client: settings.max_records_per_client,
                reserve: settings.reserve(),
                min_free: table.config.store.min_free,
            },
        );
        let budget = self.budget.clone();
        let task_path = req_path.clone();
        let task = crate::rt::drain::spawn_detached(async move {
            let refuse = |plan: &mut Plan, outcome: Outcome| {
                // Nothing was forwarded under this admission.
                if let Some(g) = plan.guard.as_mut() {
                    g.not_forwarded();
                }
                table.refuse(route_idx, op, outcome, Some(&task_path))
            };
            let mut replace_if = None;
            loop {
                let mut claim = {
                    let (store, key, mine) = (store.clone(), record_key.clone(), mine.clone());
                    let replace_if = replace_if.take();
                    let quota = Some(quota.clone());
                    Box::pin(
                        async move { store.claim_within(key, mine, replace_if, now, quota).await },
                    )
                };
                let claimed = match crate::rt::timer::timeout_at(claim_by, &mut claim).await {
                    Ok(claimed) => claimed,
                    // The disk is not answering: 503 `unavailable`, and nothing is forwarded,
                    // as for a mark. The claim may still land; then it is released, so
                    // that the retry this answer asks for is forwarded.
                    Err(_) => {
                        let (store, key) = (store.clone(), record_key.clone());
                        let released = encode(
                            expires,
                            &Meta::new(fingerprint.clone(), State::Released, boot),
                            &[],
                        );
                        // Counted by the worker's drain: shutdown waits for it (within
                        // its grace), so a landed claim is not left in flight.
                        crate::rt::drain::spawn_detached(async move {
                            if let Ok(Claimed::Claimed) = claim.await {
                                let _ = store.put_record(key, released).await;
                            }
                        });
                        return refuse(&mut plan, Outcome::Unavailable { scope, token });
                    }
                };
                let existing = match claimed {
                    Ok(Claimed::Claimed) => break,
                    Ok(Claimed::Held(existing)) => existing,
                    Ok(Claimed::Rejected(why)) => {
                        tracing::debug!(%scope, reason = why.describe(), "a new Idempotency-Key past a bound on the records: key_rejected");
                        return refuse(
                            &mut plan,
                            Outcome::KeyRejected {
                                scope,
                                token,
                                detail: why.describe(),
                            },
                        );
                    }
                    Err(_) => {
                        return refuse(&mut plan, Outcome::Unavailable { scope, token });
                    }
                };
                let Some((meta, stored_body)) = decode(&existing) else {
                    return refuse(&mut plan, Outcome::Unavailable { scope, token });
                };
                if !meta.made_for(&fingerprint) {
                    if meta.fingerprint_version != fingerprint::VERSION {
                        tracing::debug!(
                            version = meta.fingerprint_version,
                            "an Idempotency-Key record of another fingerprint version: key_reused"
                        );
                    }
                    return refuse(&mut plan, Outcome::KeyReused { scope, token });
                }
                let retry_unknown = match meta.state {
                    State::InFlight if meta.boot == boot => {
                        return refuse(&mut plan, Outcome::InProgress { scope, token });
                    }
                    State::Completed {
                        status,
                        headers,
                        body_stored,
                    } => {
                        if let Some(g) = plan.guard.as_mut() {
                            g.complete();
                        }
                        table.count(route_idx, op, "duplicate");
                        return replay(status, headers, body_stored, stored_body);
                    }
                    State::Released => true,
                    State::InFlight | State::Unknown => forward_unknown,
                };
                if !retry_unknown {
                    return refuse(&mut plan, Outcome::OutcomeUnknown { scope, token });
                }
                // Take the key over only if nobody else did in between (compare and swap);
                // if someone did, the next look sees their record.
                replace_if = Some(existing);
            }

            // The response body is read here, after the guard has gone with the response:
            // this count keeps the generation in flight until the exchange is over, and
            // is completed unless the exchange ended without a whole response.
            let held = plan.guard.as_ref().map(InflightGuard::hold);
            // The body's deadline counts from here, as the head's does in `forward`.
            let started = std::time::Instant::now();
            let req = Request::from_parts(parts, Full::new(body).map_err(|e| match e {}).boxed());
            let resp = match forward(&mut fwd, req, table.clone(), plan, conn).await {
                Ok(resp) => resp,
                Err(never) => match never {},
            };
            // The body's room is given back once the exchange has its answer: a body in
            // memory is kept (or queued to be written) until then, whichever way it went.
            drop(room);
            // What the forward came to, as the forwarder said (asked for with `report`).
            let verdict = resp.extensions().get::<Verdict>().copied();
            let record = |state: State, body: &[u8]| {
                encode(expires, &Meta::new(fingerprint.clone(), state, boot), body)
            };
            match verdict {
                Some(Verdict::Accepted) => {
                    let (parts, body) = resp.into_parts();
                    // A body that breaks midway was still applied (the head came back):
                    // record it as completed without a replayable body.
                    // Stored only while the budget has room; beyond it the rest is streamed
                    // and the record keeps no body, as past `cap`.
                    let mut room = Room::default();
                    let read = crate::rt::timer::timeout_from(
                        started,
                        timeout,
                        read_up_to(body, cap, &budget, &mut room),
                    )
                    .await;
                    let (prefix, rest, broken) = match read {
                        Ok(Ok((prefix, rest))) => (prefix, rest, None),
                        Ok(Err(e)) if !e.is::<ReadTimedOut>() => (Bytes::new(), None, Some(e)),
                        // The body did not end within the upstream timeout (or a wait for
                        // more of it outlasted that timeout, whichever came first): the
                        // exchange is treated as one that timed out (504, outcome unknown),
                        // and `held` drops uncompleted, so the scope settles before a newer
                        // generation goes. (Counted once already, as accepted, when the
                        // head came.)
                        Ok(Err(_)) | Err(_) => {
                            drop(held);
                            let _ = put_within(
                                &store,
                                record_key,
                                record(State::Unknown, &[]),
                                claim_wait,
                            )
                            .await;
                            return answer(
                                Outcome::UpstreamTimeout {
                                    scope: Some(scope),
                                    detail: format!(
                                        "the response body did not arrive within {timeout:?}"
                                    ),
                                },
                                dialect,
                                &task_path,
                            );
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
                    if let Err(e) =
                        put_within(&store, record_key, record(state, stored), claim_wait).await
                    {
                        tracing::warn!(error = %e, "idempotency record not completed; a retry will see an unknown outcome");
                    }
                    let body = match (rest, broken) {
                        // The client sees it break as it broke: the head, then a body cut
                        // short (not a complete empty one).
                        (_, Some(e)) => Held {
                            body: crate::proxy::forward::CutShort::new(
                                e,
                                crate::proxy::forward::holds_back(client_version, &parts.headers),
                            ),
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
                // Never reached the upstream, or refused before forwarding: not applied.
                Some(Verdict::NotForwarded(_)) => {
                    complete(held);
                    let _ =
                        put_within(&store, record_key, record(State::Released, &[]), claim_wait)
                            .await;
                    resp
                }
                // Sent, no answer: the scope settles (as `forward`'s guard made it).
                _ => {
                    drop(held);
                    let _ = put_within(&store, record_key, record(State::Unknown, &[]), claim_wait)
                        .await;
                    resp
                }
            }
        });
        match task.await {
            Ok(resp) => resp,
            Err(_) => answer(
                Outcome::UpstreamTimeout {
                    scope: None,
                    detail: "the forwarding task failed".into(),
                },
                dialect,
                &req_path,
            ),
        }
    }
}

/// Hands a request to the inner stage, asking for its [`Verdict`]. Through [`Staged`]
/// (boxed): a future of a generic stage awaited in the spawned task would have to be
/// proven `Send` for every lifetime, which the compiler cannot do.
fn forward<S>(
    fwd: &mut Staged<S>,
    req: Request<Body>,
    table: Arc<crate::proxy::Table>,
    plan: Plan,
    conn: Conn,
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
        report: true,
    })
}

/// Writes a record, waiting at most `wait` for the disk (a hung disk must not hold an
/// answer the upstream already gave); the write itself is committed whether or not it is
/// waited for.
async fn put_within(
    store: &MarkStore,
    key: String,
    value: Vec<u8>,
    wait: Duration,
) -> Result<(), String> {
    match crate::rt::timer::timeout_from(
        std::time::Instant::now(),
        wait,
        store.put_record(key, value),
    )
    .await
    {
        Ok(done) => done.map_err(|e| e.to_string()),
        Err(_) => Err(format!("not committed within {wait:?}")),
    }
}

/// An answer of this stage's own after the forward (counted as the forward was), with
/// its [`Verdict`] for the access log.
fn answer(outcome: Outcome, dialect: crate::proxy::problem::Dialect, path: &str) -> Response<Body> {
    let verdict = Verdict::Refused(outcome.result());
    let mut resp = outcome.into_response_in(dialect, Some(path), None);
    resp.extensions_mut().insert(verdict);
    resp
}

/// The exchange ended with a whole answer (or provably never reached the upstream).
fn complete(held: Option<InflightGuard>) {
    if let Some(mut held) = held {
        held.complete();
    }
}

/// The stored response, marked as a duplicate.
fn replay(
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body_stored: bool,
    body: &[u8],
) -> Response<Body> {
    let body = if body_stored {
        Bytes::copy_from_slice(body)
    } else {
        Bytes::new()
    };
    let mut resp = Response::new(Full::new(body).map_err(|e| match e {}).boxed());
    *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    for (n, v) in headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(n.as_bytes()),
            HeaderValue::from_bytes(&v),
        ) {
            if !body_stored && n == http::header::CONTENT_LENGTH {
                continue;
            }
            resp.headers_mut().append(n, v);
        }
    }
    resp.headers_mut()
        .insert(FENCING_RESULT, HeaderValue::from_static("duplicate"));
    resp.extensions_mut().insert(Verdict::Duplicate);
    if !body_stored {
        resp.headers_mut().insert(
            "idempotency-replay",
            HeaderValue::from_static("body-not-stored"),
        );
    }
    resp
}

/// Reads a body up to `cap` bytes. Answers the bytes and, if the body was longer, the
/// rest still to stream (the read part is in the bytes); `Err` if the body broke.
/// Reads `body` until it ends or more than `cap` bytes came, each byte covered by `room`
/// out of `budget`. Answers what was read and, if it stopped early, the rest of the body:
/// past `cap`, or when the budget had no more room (then `room.short`).
async fn read_up_to(
    mut body: Body,
    cap: u64,
    budget: &Budget,
    room: &mut Room,
) -> Result<(Bytes, Option<Body>), BoxError> {
    let mut buf = BytesMut::new();
    loop {
        match body.frame().await {
            None => return Ok((buf.freeze(), None)),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    buf.extend_from_slice(&data);
                    if buf.len() as u64 > cap || !room.cover(budget, buf.len()) {
                        return Ok((buf.freeze(), Some(body)));
                    }
                }
            }
            Some(Err(e)) => return Err(e),
        }
    }
}

/// Bytes already read, then the rest of a body.
struct Chain {
    first: Option<Bytes>,
    rest: Body,
}

impl http_body::Body for Chain {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Some(first) = this.first.take() {
            return Poll::Ready(Some(Ok(Frame::data(first))));
        }
        Pin::new(&mut this.rest).poll_frame(cx)
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// How often expired records are collected.
pub const COLLECT_EVERY: Duration = Duration::from_secs(60);
/// Expired records deleted per write transaction.
const COLLECT_BATCH: usize = 1000;

/// Deletes expired records `batch` at a time until a batch comes back short. No cap on
/// the batches: records that expire faster than a capped run deletes would grow the table
/// without bound. Each batch is one short write transaction queued with the proxy's own
/// commits, and the task yields between batches.
async fn collect_expired(store: &MarkStore, batch: usize) -> usize {
    let mut total = 0;
    loop {
        match store.collect_records(now_secs(), batch).await {
            Ok(n) => {
                total += n;
                if n < batch {
                    return total;
                }
            }
            Err(_) => return total,
        }
        tokio::task::yield_now().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_structured_field_strings() {
        let k = |s: &str| parse_key(&HeaderValue::from_str(s).unwrap());
        assert_eq!(k("\"abc-123\"").unwrap(), "abc-123");
        assert_eq!(k("\"a\\\"b\"").unwrap(), "a\"b");
        for bad in ["abc", "\"\"", "\"a", "\"a\"b\"", "\"a\\x\""] {
            assert!(k(bad).is_err(), "{bad}");
        }
        assert!(k(&format!("\"{}\"", "x".repeat(256))).is_err());
    }

    /// Collection goes on while batches come back full, however many there are.
    #[tokio::test]
    async fn every_expired_record_is_collected_in_one_run() {
        let store = MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new())
            .expect("store");
        let record =
            |expires: u64| encode(expires, &Meta::new(String::new(), State::Released, 0), &[]);
        // 150 full batches of 2 expired records (a run used to stop after 100), and live
        // records that must stay.
        for i in 0..300 {
            let claimed = store.claim(format!("s\0old{i}"), record(1), None, 0).await;
            assert!(claimed.expect("claim").is_none());
        }
        for i in 0..3 {
            let claimed = store
                .claim(format!("s\0live{i}"), record(u64::MAX), None, 0)
                .await;
            assert!(claimed.expect("claim").is_none());
        }
        assert_eq!(collect_expired(&store, 2).await, 300);
        assert_eq!(store.record_count().expect("count"), 3);
    }

    #[test]
    fn records_round_trip() {
        let meta = Meta::new(
            "f".into(),
            State::Completed {
                status: 201,
                headers: vec![("etag".into(), b"\"1\"".to_vec())],
                body_stored: true,
            },
            7,
        );
        let v = encode(99, &meta, b"hello");
        assert_eq!(u64::from_be_bytes(v[..8].try_into().unwrap()), 99);
        let (m, body) = decode(&v).unwrap();
        assert_eq!(body, b"hello");
        assert!(matches!(m.state, State::Completed { status: 201, .. }));
        assert!(decode(&v[..10]).is_none());
        assert!(m.made_for("f"));
        assert!(!m.made_for("g"));
    }

    /// A record as the version before header fingerprints wrote it (no
    /// `fingerprint_version`) still decodes, as version 1, and is made for no request of
    /// this version, even one whose fingerprint were equal to its own: its fingerprint
    /// covered no header, so a match could be another request (`key_reused`, never
    /// `duplicate`).
    #[test]
    fn a_record_of_the_header_blind_version_matches_nothing() {
        let fingerprint = "ab".repeat(32);
        let json = format!(
            r#"{{"fingerprint":"{fingerprint}","state":{{"Completed":{{"status":201,"headers":[],"body_stored":true}}}},"boot":7}}"#
        );
        let mut v = 99u64.to_be_bytes().to_vec();
        v.extend_from_slice(&(json.len() as u32).to_be_bytes());
        v.extend_from_slice(json.as_bytes());
        v.extend_from_slice(b"moved");
        let (m, body) = decode(&v).expect("an old record decodes");
        assert_eq!(body, b"moved");
        assert_eq!(m.fingerprint_version, 1);
        assert!(matches!(m.state, State::Completed { status: 201, .. }));
        assert!(!m.made_for(&fingerprint));
    }
}
