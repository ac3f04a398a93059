//! The proxy service: one request's way through, as tower layers over the forwarder.
//!
//! [`fence::FenceLayer`]: canonicalize → route → token and scope → gate (durable
//! advance, drain, settle); then [`idempotency::IdempotencyLayer`] (the record, for
//! routes with it on); then the `Forwarder`, the innermost service → response with
//! `Fencing-Result`. Every refusal goes through [`problem::Outcome`], the one place that
//! makes fencegate's own responses, and is counted in one place,
//! `fence::Refusals::refuse`.

pub mod config;
pub mod fence;
pub mod forward;
pub mod idempotency;
pub mod problem;
pub mod upstream;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::config::{Config, ProofMode, SequenceMode};
use crate::fence::{Gates, InflightGuard, Proof, Refusal};
use crate::metrics::{Metrics, Op, RouteRow};
use crate::route;
use crate::token::Token;
use fence::{Conn, Fence, FenceLayer, Refusals, Typed};
use idempotency::{Idempotency, IdempotencyLayer, Idempotent};
pub use problem::{FENCING_RESULT, Outcome};

pub use crate::body::{Body, BoxError};

/// Request bodies of known length up to this size are read whole before forwarding.
const WHOLE_BODY: u64 = 64 * 1024;

/// Reads a body of known length whole (hyper holds a body to its Content-Length). Stops
/// as soon as the body says it has ended, without a poll for its end; one data frame,
/// the usual case for a small body, is kept as it is.
async fn read_whole(mut body: Body) -> Result<Bytes, BoxError> {
    let mut first: Option<Bytes> = None;
    let mut joined = bytes::BytesMut::new();
    while !http_body::Body::is_end_stream(&body) {
        let Some(frame) = body.frame().await else {
            break;
        };
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        match first.take() {
            None if joined.is_empty() => first = Some(data),
            earlier => {
                if let Some(earlier) = earlier {
                    joined.extend_from_slice(&earlier);
                }
                joined.extend_from_slice(&data);
            }
        }
    }
    Ok(first.unwrap_or_else(|| joined.freeze()))
}

/// Headers that ask a backend to treat a request as another method: each would let a
/// fenced write travel as an unfenced GET.
static METHOD_OVERRIDES: [http::HeaderName; 3] = [
    http::HeaderName::from_static("x-http-method-override"),
    http::HeaderName::from_static("x-http-method"),
    http::HeaderName::from_static("x-method-override"),
];

/// Headers with which some backends act on another path than the request's (IIS URL
/// Rewrite, older Symfony and Zend): that path was never routed nor fenced.
static RETARGETS: [http::HeaderName; 2] = [
    http::HeaderName::from_static("x-original-url"),
    http::HeaderName::from_static("x-rewrite-url"),
];

/// Where a request's WebDAV `Destination` (COPY, MOVE) points, routed like a request.
#[derive(Debug, PartialEq)]
enum Destination {
    /// No `Destination` header.
    None,
    /// A pass-through route's path.
    Unfenced,
    /// A fenced route's path, in this scope.
    Scope(String),
}

/// The target named by a request's `Destination` header, routed with the request's host
/// (a backend such as nginx's WebDAV module writes the destination's path on the server
/// the request reached, whatever host the header names, so another host is refused).
/// `X-Original-URL` and `X-Rewrite-URL` are refused outright on every route. Called only
/// when [`HeadScan`] saw one of these names.
fn destination<B>(
    config: &Config,
    req: &Request<B>,
    host: Option<&str>,
    seen: Seen<'_>,
) -> Result<Destination, String> {
    if let Some(h) = RETARGETS.iter().find(|h| req.headers().contains_key(*h)) {
        return Err(format!(
            "{h} would make the backend act on a target that was not routed"
        ));
    }
    let value = match seen {
        Seen::None => return Ok(Destination::None),
        Seen::Many => return Err("more than one Destination header".into()),
        Seen::One(v) => v
            .to_str()
            .map_err(|_| "Destination is not ASCII".to_string())?,
    };
    let uri: http::Uri = value
        .parse()
        .map_err(|e| format!("Destination is not a URI: {e}"))?;
    if let Some(scheme) = uri.scheme_str()
        && !scheme.eq_ignore_ascii_case("http")
        && !scheme.eq_ignore_ascii_case("https")
    {
        return Err(format!("Destination has the scheme {scheme}"));
    }
    if let Some(authority) = uri.authority() {
        let named = route::host_of(authority.as_str())
            .map_err(|e| format!("Destination's host is not valid: {e}"))?;
        if host.is_some_and(|h| !h.eq_ignore_ascii_case(named)) {
            return Err("Destination names another host than the request".into());
        }
    }
    // `path()` of a bare `?x` would read as `/`: the path must be spelled out.
    if !uri
        .path_and_query()
        .is_some_and(|p| p.as_str().starts_with('/'))
    {
        return Err("Destination has no absolute path".into());
    }
    let segments = route::canonicalize(uri.path()).map_err(|e| format!("Destination: {e}"))?;
    match route::find(&config.routes, host, &segments) {
        None => Err("Destination matches no route".into()),
        Some((_, r, _)) if !r.fenced => Ok(Destination::Unfenced),
        Some((_, r, caps)) => Ok(Destination::Scope(r.scope.render(&caps))),
    }
}

/// The routing table in force: a config and the metric rows of its routes. Swapped as a
/// whole on reload, so a request sees one table from start to end.
pub struct Table {
    pub config: Arc<Config>,
    rows: Vec<Arc<RouteRow>>,
    /// By upstream index: the own client of each https upstream (`None` for http ones,
    /// which share the forwarder's). Rebuilt with the table, so new TLS files apply.
    clients: Vec<Option<forward::Client>>,
    /// Where the refusals of requests under this table are counted.
    refusals: Arc<Refusals>,
}

impl Table {
    pub(crate) fn new(config: Arc<Config>, refusals: &Arc<Refusals>) -> Table {
        let rows = config
            .routes
            .iter()
            .map(|r| refusals.metrics.row(&r.name))
            .collect();
        let clients = config
            .upstreams
            .iter()
            .map(|u| u.tls.as_ref().map(forward::client))
            .collect();
        Table {
            config,
            rows,
            clients,
            refusals: refusals.clone(),
        }
    }

    /// Counts one request of route `route` and method `op` under `result`.
    pub fn count(&self, route: usize, op: Op, result: &str) {
        self.rows[route].count(op, result);
    }

    /// Refuses a routed request after admission (see [`Refusals::refuse`]); `resource`
    /// is the request's path, named in an S3 error document.
    pub(crate) fn refuse(
        &self,
        route: usize,
        op: Op,
        outcome: Outcome,
        resource: Option<&str>,
    ) -> Response<Body> {
        self.refusals
            .refuse(self, Some(route), op, outcome, None, resource)
    }
}

/// The binary's pipeline: the fence over idempotency over the forwarder.
type Stack = Fence<Idempotent<Forwarder>, Typed>;

pub struct Proxy {
    pub gates: Arc<Gates>,
    pub metrics: Arc<Metrics>,
    stack: Stack,
    /// The idempotency stage's records and memory budget (also the stack's).
    idempotency: Arc<Idempotency>,
}

pin_project_lite::pin_project! {
    /// [`Proxy::handle`]'s future: the request served, with or without its access-log line.
    #[project = HandledProj]
    enum Handled<P, L> {
        Plain { #[pin] fut: P },
        Logged { #[pin] fut: L },
    }
}

impl<P, L> Future for Handled<P, L>
where
    P: Future<Output = Response<Body>>,
    L: Future<Output = Response<Body>>,
{
    type Output = Response<Body>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Response<Body>> {
        match self.project() {
            HandledProj::Plain { fut } => fut.poll(cx),
            HandledProj::Logged { fut } => fut.poll(cx),
        }
    }
}

/// Where a request stands after the checks: forward it, fenced or not.
pub(crate) struct Plan {
    pub(crate) route: usize,
    /// The request's method, as counted.
    pub(crate) op: Op,
    /// `Some` for fenced requests: the generation they hold at the gate.
    pub(crate) guard: Option<InflightGuard>,
    pub(crate) scope: Option<String>,
    pub(crate) token: Option<Token>,
}

impl Proxy {
    pub fn new(config: Arc<Config>, gates: Arc<Gates>, metrics: Arc<Metrics>) -> Proxy {
        Proxy::build(config, gates, metrics, crate::access_log::AccessLog::off())
    }

    fn build(
        config: Arc<Config>,
        gates: Arc<Gates>,
        metrics: Arc<Metrics>,
        access: crate::access_log::AccessLog,
    ) -> Proxy {
        let max_buffered = config.idempotency.max_buffered;
        let idempotency = Arc::new(Idempotency::new(gates.store().clone(), max_buffered));
        let refusals = Arc::new(Refusals::new(metrics.clone(), access));
        let stack = tower::ServiceBuilder::new()
            // First, the fence: nothing below sees a request that is unrouted, unsafe to
            // pass, or not admitted at its scope's gate.
            .layer(FenceLayer::<Typed>::with(config, gates.clone(), refusals))
            // Under it, idempotency: a key is looked at only for an admitted generation
            // (a stale retry is refused, never replayed).
            .layer(IdempotencyLayer::new(idempotency.clone()))
            // Innermost, the upstream exchange, which settles the gate's guard.
            .service(Forwarder {
                metrics: metrics.clone(),
            });
        Proxy {
            gates,
            metrics,
            stack,
            idempotency,
        }
    }

    /// The access log to write to (opened by the caller, which reports a bad file).
    pub fn with_access_log(self, log: crate::access_log::AccessLog) -> Proxy {
        Proxy::build(self.config(), self.gates, self.metrics, log)
    }

    fn refusals(&self) -> &Refusals {
        self.stack.refusals()
    }

    /// Refuses a request the listener does not hand on (see [`Fence::refuse_unrouted`]).
    pub(crate) fn refuse_unrouted(&self, method: &Method, outcome: Outcome) -> Response<Body> {
        self.stack.refuse_unrouted(method, outcome)
    }

    pub fn access_log(&self) -> &crate::access_log::AccessLog {
        &self.refusals().access
    }

    pub fn refusal_warnings(&self) -> &crate::access_log::RefusalWarnings {
        &self.refusals().warnings
    }

    /// New routes and upstreams for every request that starts from now on; requests
    /// under way finish with the table they started with.
    pub fn reload(&self, config: Arc<Config>) {
        self.stack.layer().reload(config);
    }

    pub fn config(&self) -> Arc<Config> {
        self.stack.layer().config()
    }

    pub fn idempotency(&self) -> &Idempotency {
        &self.idempotency
    }

    /// A request's answer, from the stack (a plain function returning its future).
    pub fn handle(
        &self,
        req: Request<Incoming>,
        peer: SocketAddr,
        tls: bool,
    ) -> impl Future<Output = Response<Body>> + Send + '_ {
        // Through the stages' unboxed futures (see `fence::Stage`), not `Service::call`.
        let conn = Conn { peer, tls };
        if self.refusals().access.is_on() {
            // Boxed: the logged path's state stays out of the unlogged request's future.
            Handled::Logged {
                fut: Box::pin(self.handle_logged(req, conn)),
            }
        } else {
            Handled::Plain {
                fut: self.stack.serve(req, conn),
            }
        }
    }

    /// [`Proxy::handle`] with the access log on: the request id is kept or made, passed
    /// upstream and returned, and the request's line is queued when its response head is
    /// ready (so `duration_ms` is time to the response head, and `bytes` the body's length
    /// when known then).
    async fn handle_logged(&self, mut req: Request<Incoming>, conn: Conn) -> Response<Body> {
        let peer = conn.peer;
        let access = &self.refusals().access;
        let started = Instant::now();
        let time = std::time::SystemTime::now();
        let id = access.request_id(req.headers());
        req.headers_mut()
            .insert(crate::access_log::X_REQUEST_ID, id.clone());
        let method = req.method().clone();
        let mut resp = self.stack.serve(req, conn).await;
        let note = resp
            .extensions_mut()
            .remove::<fence::Note>()
            .unwrap_or_default();
        resp.headers_mut()
            .insert(crate::access_log::X_REQUEST_ID, id.clone());
        let result = match resp.headers().get(FENCING_RESULT) {
            Some(v) => v.to_str().unwrap_or("-"),
            None => "unfenced",
        };
        let entry = crate::access_log::Entry {
            time,
            request_id: id.as_bytes(),
            peer,
            method: method.as_str(),
            route: note.route.as_deref(),
            scope: note.scope.as_deref(),
            token: note.token,
            highest: note.highest,
            sequence: note.sequence,
            highest_sequence: note.highest_sequence,
            result,
            status: resp.status().as_u16(),
            bytes: http_body::Body::size_hint(resp.body()).exact(),
            duration: started.elapsed(),
            upstream: note.upstream,
        };
        access.write(entry.line());
        resp
    }
}

/// Everything before forwarding: refuse what is unsafe ([`classify`], without waiting),
/// admit what is fenced. Holds no reference to the request while the gate is awaited
/// (a body need not be `Sync`), and only what admission needs.
pub(crate) async fn check(
    gates: &Gates,
    config: &Config,
    classified: Result<Classified, (Option<usize>, Outcome)>,
    op: Op,
) -> Result<Plan, (Option<usize>, Outcome)> {
    let Fenced {
        route: idx,
        equal,
        scope,
        token,
        sequence,
        proof,
    } = match classified? {
        Classified::Unfenced(plan) => return Ok(plan),
        Classified::Fenced(fenced) => fenced,
    };
    let proof = proof.as_ref().map(|v| Proof {
        keys: &config.fencing.proof_keys,
        bytes: v.as_bytes(),
    });
    let admission = match gates
        .admit_sequenced(&scope, token, sequence, equal, proof)
        .await
    {
        Ok(a) => a,
        Err(refusal) => return Err((Some(idx), refused(refusal, scope, token, sequence))),
    };
    Ok(Plan {
        route: idx,
        op,
        guard: Some(admission.guard),
        scope: Some(scope),
        token: Some(token),
    })
}

/// [`check`] up to the gate: routes the request, refuses what is unsafe, and
/// says what a fenced request asks the gate for.
pub(crate) fn classify<B>(
    config: &Config,
    req: &Request<B>,
) -> Result<Classified, (Option<usize>, Outcome)> {
    if req.method() == Method::CONNECT {
        return Err((None, Outcome::MethodNotAllowed));
    }
    // h2 always carries scheme and authority; in HTTP/1.x they mean absolute form. An
    // h2 `:path` must begin with `/` too: `?x` would be routed as `/` and forwarded as
    // `?x`, another target than the one classified.
    if (req.version() < http::Version::HTTP_2 && req.uri().scheme().is_some())
        || !req
            .uri()
            .path_and_query()
            .is_some_and(|p| p.as_str().starts_with('/'))
    {
        return Err((
            None,
            Outcome::InvalidPath {
                detail: "the request target is not in origin form".into(),
            },
        ));
    }
    let segments = route::canonicalize(req.uri().path()).map_err(|e| {
        (
            None,
            Outcome::InvalidPath {
                detail: e.to_string(),
            },
        )
    })?;
    let head = HeadScan::of(req.headers(), &config.fencing.header);
    if let Some(name) = head.alias {
        return Err((
            None,
            Outcome::InvalidRequest {
                detail: format!(
                    "header {name}: a name with `_` that backends may read as one with `-`"
                ),
            },
        ));
    }
    let host = request_host(req, head.host)
        .map_err(|detail| (None, Outcome::InvalidRequest { detail }))?;
    let (idx, route, caps) =
        route::find(&config.routes, host, &segments).ok_or((None, Outcome::NoRoute))?;
    let at = |o: Outcome| (Some(idx), o);
    if let Some(limit) = route.max_body
        && content_length(req).is_some_and(|len| len > limit)
    {
        return Err(at(Outcome::PayloadTooLarge { limit }));
    }
    let unfenced = || {
        Classified::Unfenced(Plan {
            route: idx,
            op: Op::of(req.method()),
            guard: None,
            scope: None,
            token: None,
        })
    };
    // A COPY or MOVE writes its Destination too: that target must be fenced by this
    // request's own scope, or be a pass-through route's.
    let destination = if head.retarget {
        destination(config, req, host, head.destination)
            .map_err(|detail| at(Outcome::InvalidRequest { detail }))?
    } else {
        Destination::None
    };
    let into_other = |theirs: &str, ours: Option<&str>| {
        at(Outcome::InvalidRequest {
            detail: match ours {
                Some(ours) => {
                    format!("Destination is in scope {theirs}, another than the request's ({ours})")
                }
                None => format!(
                    "Destination is in the fenced scope {theirs}; an unfenced request cannot write it"
                ),
            },
        })
    };
    if !route.fenced {
        if let Destination::Scope(theirs) = &destination {
            return Err(into_other(theirs, None));
        }
        return Ok(unfenced());
    }
    if head.suspect {
        refuse_unfenceable(req).map_err(|detail| at(Outcome::InvalidRequest { detail }))?;
    }
    let scope = route.scope.render(&caps);
    let token = match read_token(head.token, &config.fencing.header) {
        Ok(Some(t)) => t,
        Ok(None) if route.fences_method(req.method()) => {
            return Err(at(Outcome::MissingToken { scope }));
        }
        // A safe method without a token is not fenced, nor may it write a fenced
        // Destination.
        Ok(None) => {
            return match &destination {
                Destination::Scope(theirs) if *theirs == scope => {
                    Err(at(Outcome::MissingToken { scope }))
                }
                Destination::Scope(theirs) => Err(into_other(theirs, None)),
                _ => Ok(unfenced()),
            };
        }
        Err(detail) => return Err(at(Outcome::InvalidToken { scope, detail })),
    };
    let sequence = match (read_sequence(head.sequence), route.sequence) {
        (Ok(None), SequenceMode::Required) => {
            return Err(at(Outcome::InvalidToken {
                scope,
                detail: "this route requires a Fencing-Sequence header".into(),
            }));
        }
        (Ok(sequence), _) => sequence,
        (Err(detail), _) => return Err(at(Outcome::InvalidToken { scope, detail })),
    };
    // An admitted scope is kept in memory while hot and as a mark for good: its length
    // is bounded (a path may be up to the head's size).
    if scope.len() > config.fencing.max_scope_bytes {
        return Err(at(Outcome::InvalidPath {
            detail: format!(
                "the path's scope would be {} bytes, more than fencing.max_scope_bytes ({})",
                scope.len(),
                config.fencing.max_scope_bytes
            ),
        }));
    }
    check_scope_header(head.scope, &scope).map_err(|_| {
        at(Outcome::ScopeMismatch {
            scope: scope.clone(),
            token,
        })
    })?;
    if let Destination::Scope(theirs) = &destination
        && *theirs != scope
    {
        return Err(into_other(theirs, Some(&scope)));
    }
    // The proof is verified at the gate (which remembers what it verified); here only
    // whether there is exactly one.
    let proof = match (route.proof, head.proof) {
        (ProofMode::Off, _) => None,
        (ProofMode::Required, Seen::One(v)) => Some(v.clone()),
        (ProofMode::Required, seen) => {
            return Err(at(Outcome::InvalidProof {
                scope,
                token,
                detail: match seen {
                    Seen::Many => "more than one Fencing-Proof header".into(),
                    _ => "no Fencing-Proof header".into(),
                },
            }));
        }
    };
    Ok(Classified::Fenced(Fenced {
        route: idx,
        equal: route.equal,
        scope,
        token,
        sequence,
        proof,
    }))
}

/// What [`classify`] found: a request to forward as it is, or one for the gate.
pub(crate) enum Classified {
    Unfenced(Plan),
    Fenced(Fenced),
}

/// A fenced request on its way to the gate.
pub(crate) struct Fenced {
    route: usize,
    equal: crate::config::EqualPolicy,
    scope: String,
    token: Token,
    /// The request's `Fencing-Sequence` (SPEC §11).
    sequence: Option<u64>,
    /// The `Fencing-Proof` to verify, on a `proof = "required"` route.
    proof: Option<HeaderValue>,
}

/// The answer to a request the gate did not admit.
fn refused(refusal: Refusal, scope: String, token: Token, presented: Option<u64>) -> Outcome {
    match refusal {
        Refusal::Stale { highest } => Outcome::Stale {
            scope,
            token,
            highest,
        },
        Refusal::Draining { highest } => Outcome::Draining {
            scope,
            token,
            highest,
        },
        Refusal::Unavailable => Outcome::Unavailable { scope, token },
        Refusal::InvalidProof(detail) => Outcome::InvalidProof {
            scope,
            token,
            detail,
        },
        Refusal::StaleSequence { sequence, .. } => Outcome::StaleSequence {
            scope,
            token,
            sequence: presented.unwrap_or_default(),
            highest_sequence: sequence,
        },
    }
}

/// The forwarding stage and what it reports to (the upstream connections are the
/// worker's pool, or the https upstream's client in the routing table).
#[derive(Clone)]
pub(crate) struct Forwarder {
    metrics: Arc<Metrics>,
}

impl Forwarder {
    /// Forwards an admitted request. (A plain function returning its future, as
    /// [`Proxy::handle`].)
    #[allow(clippy::manual_async_fn)]
    #[inline(always)]
    pub(crate) fn forward<'a>(
        &'a self,
        table: Arc<Table>,
        req: Request<Body>,
        plan: Plan,
        peer: SocketAddr,
        tls: bool,
    ) -> impl Future<Output = Response<Body>> + Send + 'a {
        async move {
            let Plan {
                route,
                op,
                mut guard,
                scope,
                ..
            } = plan;
            let fenced = guard.is_some();
            let table = &*table;
            let config = &table.config;
            let row = &table.rows[route];
            let max_body = config.routes[route].max_body;
            let upstream_index = config.routes[route].upstream;
            let upstream = &config.upstreams[upstream_index];
            let tls_client = table.clients[upstream_index].as_ref();
            // The path is named only in an S3 error document: copied only on such routes.
            let resource = (config.routes[route].errors != problem::Dialect::Problem)
                .then(|| req.uri().path().to_owned());
            let fail = |outcome: Outcome| table.refuse(route, op, outcome, resource.as_deref());
            let trusted = config
                .server
                .trusted_proxies
                .iter()
                .any(|net| net.contains(peer.ip()));
            // A small HTTP/1 body of known length is read whole before the request goes
            // upstream. An upstream may answer without reading a body (nginx's `return`, an
            // early error): part of it would then stay unread on the client's connection,
            // which hyper closes after the response, and a client that already sent its next
            // request on it sees a broken pipe. Larger or unsized bodies are streamed, and so
            // is every HTTP/2 body (an unread one ends its own stream only). Request trailers
            // are not passed on either way (`Trailer` is stripped, and hyper's client sends
            // only declared ones): the fence reads the head alone, and a trailer field could
            // carry what it refuses there.
            let whole = req.version() <= http::Version::HTTP_11;
            // The upstream timeout counts from here: reading the body is part of the exchange
            // (as it was when the body streamed upstream), and the clock is read once.
            let started = Instant::now();
            // A connection not made by the exchange's end is given up on its own, so that
            // the request is known not to have reached the upstream: 502 and no settle,
            // rather than the exchange's 504 (outcome unknown).
            let connect_by = started
                .checked_add(upstream.timeout)
                .unwrap_or(started + Duration::from_secs(86_400 * 365));
            let (mut parts, body) = req.into_parts();
            let client_version = parts.version;
            // The body in memory (none, or a small one read whole), or still to stream.
            let body: Result<Bytes, Body> = if http_body::Body::is_end_stream(&body) {
                Ok(Bytes::new())
            } else {
                match http_body::Body::size_hint(&body).exact() {
                    Some(len)
                        if whole && len <= WHOLE_BODY && max_body.is_none_or(|m| len <= m) =>
                    {
                        let read = crate::rt::timer::timeout_from(
                            started,
                            upstream.timeout,
                            read_whole(body),
                        )
                        .await;
                        match read {
                            Ok(Ok(bytes)) => Ok(bytes),
                            Ok(Err(_)) | Err(_) => {
                                if let Some(g) = guard.as_mut() {
                                    g.not_forwarded();
                                }
                                return fail(Outcome::InvalidRequest {
                                    detail: "the request body could not be read (in time)".into(),
                                });
                            }
                        }
                    }
                    _ => Err(body),
                }
            };
            let added = match forward::upstream_parts(
                &mut parts,
                upstream,
                peer.ip(),
                tls,
                trusted,
                tls_client.is_some(),
            ) {
                Ok(added) => added,
                Err(e) => {
                    if let Some(g) = guard.as_mut() {
                        g.not_forwarded();
                    }
                    return fail(Outcome::InvalidRequest {
                        detail: format!("cannot forward: {e}"),
                    });
                }
            };
            let mut too_large = None;
            let result = match (body, tls_client) {
                // A plain-HTTP upstream and a body in hand: the lean exchange.
                (Ok(bytes), None) => {
                    crate::rt::timer::timeout_from(
                        started,
                        upstream.timeout,
                        forward::send_whole(upstream, &parts, &added, &bytes, connect_by),
                    )
                    .await
                }
                (body, tls_client) => {
                    let body = match body {
                        Ok(bytes) => http_body_util::Full::new(bytes)
                            .map_err(|never| match never {})
                            .boxed(),
                        Err(streamed) => streamed,
                    };
                    added.put_into(&mut parts.headers);
                    let (out, tripped) = forward::upstream_request(parts, body, max_body);
                    too_large = Some(tripped);
                    // Boxed: hyper's client exchange makes a large future, which would make
                    // every request's future (moved whole on its way to hyper) that large.
                    crate::rt::timer::timeout_from(
                        started,
                        upstream.timeout,
                        Box::pin(forward::send(upstream, tls_client, out, connect_by)),
                    )
                    .await
                }
            };
            self.metrics
                .upstream_seconds
                .observe_duration(started.elapsed());
            match result {
                Ok(Ok(resp)) => {
                    if let Some(g) = guard.as_mut() {
                        g.complete();
                    }
                    row.count(op, if fenced { "accepted" } else { "unfenced" });
                    // A body that stops moving for the upstream's timeout lets go of its generation.
                    let mut resp =
                        forward::client_response(resp, guard, upstream.timeout, client_version);
                    if fenced {
                        resp.headers_mut()
                            .insert(FENCING_RESULT, HeaderValue::from_static("accepted"));
                    } else {
                        // The header is fencegate's word: an upstream's own must not make an
                        // unfenced answer look fenced.
                        resp.headers_mut().remove(FENCING_RESULT);
                    }
                    resp
                }
                // The body outgrew the route's limit mid-stream: the upstream saw an incomplete
                // message, which it cannot apply, so there is nothing to settle.
                Ok(Err(_)) if too_large.is_some_and(|t| t.load(Ordering::Acquire)) => {
                    if let Some(g) = guard.as_mut() {
                        g.complete();
                    }
                    fail(Outcome::PayloadTooLarge {
                        limit: max_body.unwrap_or(0),
                    })
                }
                Ok(Err(e)) if e.not_sent => {
                    // Never reached the upstream: nothing to settle, and the token was not
                    // used (the answer says retry).
                    if let Some(g) = guard.as_mut() {
                        g.not_forwarded();
                    }
                    fail(Outcome::UpstreamUnavailable {
                        scope,
                        detail: e.detail,
                    })
                }
                // Sent, then reset or timed out: the upstream may still apply it. The guard
                // drops uncompleted, so the scope settles before a newer generation goes.
                Ok(Err(e)) => fail(Outcome::UpstreamTimeout {
                    scope,
                    detail: e.detail,
                }),
                Err(_) => fail(Outcome::UpstreamTimeout {
                    scope,
                    detail: format!("no response within {:?}", upstream.timeout),
                }),
            }
        }
    }
}

fn content_length<B>(req: &Request<B>) -> Option<u64> {
    req.headers()
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// Where a request head's policy headers are: `None`, one value, or more than one.
#[derive(Clone, Copy)]
enum Seen<'a> {
    None,
    One(&'a HeaderValue),
    Many,
}

impl<'a> Seen<'a> {
    fn add(&mut self, v: &'a HeaderValue) {
        *self = match self {
            Seen::None => Seen::One(v),
            _ => Seen::Many,
        };
    }
}

/// The headers the fence looks at, found in one pass over the head (a name compared by
/// its text) instead of a hash lookup each.
struct HeadScan<'a> {
    host: Seen<'a>,
    token: Seen<'a>,
    scope: Seen<'a>,
    proof: Seen<'a>,
    sequence: Seen<'a>,
    /// A method override, `Upgrade` or `Connection` is present (see
    /// [`refuse_unfenceable`]).
    suspect: bool,
    destination: Seen<'a>,
    /// A header naming a second target is present (see [`destination`]).
    retarget: bool,
    /// A name with `_` that reads as one of the names above once `_` is `-` (see
    /// [`underscore_alias`]).
    alias: Option<&'a str>,
}

impl<'a> HeadScan<'a> {
    fn of(headers: &'a http::HeaderMap, token_name: &http::HeaderName) -> HeadScan<'a> {
        let token_name = token_name.as_str();
        let mut scan = HeadScan {
            host: Seen::None,
            token: Seen::None,
            scope: Seen::None,
            proof: Seen::None,
            sequence: Seen::None,
            suspect: false,
            destination: Seen::None,
            retarget: false,
            alias: None,
        };
        for (name, value) in headers {
            let name = name.as_str();
            // Not `else`: a configured token header named like one below counts for both,
            // as separate lookups would.
            if name == token_name {
                scan.token.add(value);
            }
            match name {
                "host" => scan.host.add(value),
                "fencing-scope" => scan.scope.add(value),
                "fencing-proof" => scan.proof.add(value),
                "fencing-sequence" => scan.sequence.add(value),
                "connection" | "upgrade" => scan.suspect = true,
                "destination" => {
                    scan.destination.add(value);
                    scan.retarget = true;
                }
                n if RETARGETS.iter().any(|m| m.as_str() == n) => scan.retarget = true,
                n if METHOD_OVERRIDES.iter().any(|m| m.as_str() == n) => scan.suspect = true,
                n if maybe_alias(n, token_name) && underscore_alias(n, token_name) => {
                    scan.alias = Some(n)
                }
                _ => {}
            }
        }
        scan
    }
}

/// A cheap first look for [`underscore_alias`] (run on every header name the scan does
/// not know): the names it knows begin with `x` or `f` and are 13 to 22 bytes long, or
/// are as long as the token header's and begin as it does.
#[inline]
fn maybe_alias(name: &str, token_name: &str) -> bool {
    let (n, t) = (name.as_bytes(), token_name.as_bytes());
    let known = match n.first() {
        Some(b'x' | b'f') => matches!(n.len(), 13..=22),
        _ => false,
    };
    (known || (n.len() == t.len() && n.first() == t.first()))
        && name != token_name
        && n.contains(&b'_')
}

/// True when `name` (which has a `_`) reads, with `_` as `-`, as a header the fence
/// looks at. CGI, WSGI, Rack and PHP hand headers to applications as
/// `HTTP_X_HTTP_METHOD_OVERRIDE`-style variables, where `_` and `-` are one character: a
/// backend of that kind would read `X_HTTP_Method_Override` or `X_Original_URL` as the
/// header fencegate refuses, so such a request is refused too.
fn underscore_alias(name: &str, token_name: &str) -> bool {
    let same = |known: &str| {
        known.len() == name.len()
            && known
                .bytes()
                .zip(name.bytes())
                .all(|(k, n)| k == n || (k == b'-' && n == b'_'))
    };
    ["fencing-scope", token_name]
        .into_iter()
        .chain(METHOD_OVERRIDES.iter().map(|h| h.as_str()))
        .chain(RETARGETS.iter().map(|h| h.as_str()))
        // A configured token header may itself have `_`: that name is the header.
        .any(|known| known != name && same(known))
}

/// The request's host without port (see [`route::host_of`]), for `host =` routes. The
/// router and the backend must read one host from a request, so a request that names it
/// in a form that is not an authority, twice, or differently in `Host` and the HTTP/2
/// authority is refused, and so is an HTTP/1.1 or HTTP/2 request that names none (RFC 9112
/// §3.2: an upstream would fill in its own). Only HTTP/1.0 may leave it out (`None`: no
/// `host =` route matches).
fn request_host<'a, B>(req: &'a Request<B>, host: Seen<'a>) -> Result<Option<&'a str>, String> {
    let bad = |what: &str, e: &str| format!("{what} is not a valid host: {e}");
    let header = match host {
        Seen::Many => return Err("more than one Host header".into()),
        Seen::One(v) => {
            let v = v.to_str().map_err(|_| "Host is not ASCII".to_string())?;
            Some(route::host_of(v).map_err(|e| bad("Host", e))?)
        }
        Seen::None => None,
    };
    let authority = match req.uri().authority() {
        Some(a) => Some(route::host_of(a.as_str()).map_err(|e| bad("the authority", e))?),
        None => None,
    };
    match (header, authority) {
        (Some(h), Some(a)) if !h.eq_ignore_ascii_case(a) => {
            Err("Host differs from the request's authority".into())
        }
        (Some(h), _) | (None, Some(h)) => Ok(Some(h)),
        (None, None) if req.version() >= http::Version::HTTP_11 => {
            Err("the request names no host (Host header)".into())
        }
        (None, None) => Ok(None),
    }
}

/// Method overrides and upgrades would carry a request past the fence; refuse them.
/// Called only when [`HeadScan`] saw one of the names it looks for.
fn refuse_unfenceable<B>(req: &Request<B>) -> Result<(), String> {
    if let Some(h) = METHOD_OVERRIDES
        .iter()
        .find(|h| req.headers().contains_key(*h))
    {
        return Err(format!("method-override header {h} on a fenced route"));
    }
    let connection_upgrade = req.headers().get_all(header::CONNECTION).iter().any(|v| {
        v.to_str()
            .map(|s| {
                s.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
            })
            .unwrap_or(true)
    });
    if req.headers().contains_key(header::UPGRADE) || connection_upgrade {
        return Err("protocol upgrade on a fenced route".into());
    }
    Ok(())
}

/// `Ok(None)`: no `Fencing-Sequence`. More than one header, or a malformed value, is an
/// error (answered as a malformed token is).
fn read_sequence(seen: Seen<'_>) -> Result<Option<u64>, String> {
    match seen {
        Seen::None => Ok(None),
        Seen::Many => Err("more than one Fencing-Sequence header".into()),
        Seen::One(v) => crate::token::parse_sequence(v.as_bytes())
            .map(Some)
            .map_err(|_| {
                "Fencing-Sequence must be 1 to 20 ASCII digits, no leading zero, at most 2^64-1"
                    .into()
            }),
    }
}

/// `Ok(None)`: no token. More than one header, or any malformed value, is an error.
fn read_token(seen: Seen<'_>, name: &http::HeaderName) -> Result<Option<Token>, String> {
    match seen {
        Seen::None => Ok(None),
        Seen::Many => Err(format!("more than one {name} header")),
        Seen::One(v) => Token::parse(v.as_bytes())
            .map(Some)
            .map_err(|e| e.to_string()),
    }
}

fn check_scope_header(seen: Seen<'_>, scope: &str) -> Result<(), ()> {
    match seen {
        Seen::None => Ok(()),
        Seen::One(v) if v.as_bytes() == scope.as_bytes() => Ok(()),
        _ => Err(()),
    }
}

#[cfg(test)]
mod tests {
    use super::{maybe_alias, underscore_alias};

    #[test]
    fn underscore_aliases_of_the_headers_the_fence_reads() {
        let token = "fencing-token";
        for alias in [
            "x_http_method_override",
            "x-http_method",
            "x_original_url",
            "fencing_scope",
            "fencing_token",
        ] {
            assert!(maybe_alias(alias, token), "{alias}");
            assert!(underscore_alias(alias, token), "{alias}");
        }
        for other in ["x_trace_id", "x_http_method_overrides", "fencing__token"] {
            assert!(!underscore_alias(other, token), "{other}");
        }
        // A configured token header with `_` is that header, not an alias of it; its dashed
        // spelling is not an alias either (only `_` stands for `-`).
        assert!(!maybe_alias("x_fence", "x_fence"));
        assert!(!underscore_alias("x_fence", "x_fence"));
        assert!(maybe_alias("x_fencing_token", "x-fencing-token"));
        assert!(underscore_alias("x_fencing_token", "x-fencing-token"));
        assert!(
            maybe_alias("y_fence", "y-fence"),
            "as long as the token header"
        );
        assert!(!maybe_alias("content-length", token));
    }
}
