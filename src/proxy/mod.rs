//! The proxy service: one request's way through, as named phases over one context
//! ([`context`]: the connection, the table and plan, the typed [`context::Verdict`]).
//!
//! The phases, in order: decide ([`fence`]: canonicalize → route → token and scope →
//! [`check`]: placement, uploads, gate: durable advance, drain, settle) → idempotency
//! ([`idempotency`], for routes with it on: the record's claim, or a retry's replay) →
//! choose the peer → the upstream request → the response ([`forward`]) → log
//! ([`Proxy::handle`], with the access log on). The fence ([`fence::Fence::serve`]) hands
//! an admitted request to the inner [`stage::Stage`]s, called directly by the binary (one
//! unboxed future per request; [`stage::Staged`] makes a stage a `Service`). Every
//! refusal goes through [`problem::Outcome`], the one place that makes fencegate's own
//! responses, and is counted in one place, `fence::Refusals::refuse`.

pub mod classify;
pub mod config;
pub(crate) mod context;
pub mod fence;
pub mod forward;
pub mod hop;
pub mod idempotency;
pub mod problem;
pub mod s3;
pub mod settings;
pub(crate) mod stage;
pub mod upstream;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use http::{Method, Request, Response};
use hyper::body::Incoming;

use crate::fence::{Gates, Proof, Refusal};
use crate::metrics::{Metrics, Op, RouteRow};
use crate::token::Token;
pub(crate) use classify::classify;
use classify::{Classified, Fenced};
use context::{Conn, Note, Plan, Verdict};
use fence::{Fence, FenceLayer, Refusals, Typed};
pub(crate) use forward::Forwarder;
use idempotency::{Idempotency, IdempotencyLayer, Idempotent};
pub use problem::{FENCING_RESULT, Outcome};
pub use settings::Settings;

pub use crate::body::{Body, BoxError};

/// The routing table in force: the proxy's settings and the metric rows of its routes. Swapped as a
/// whole on reload, so a request sees one table from start to end.
pub struct Table {
    pub config: Arc<Settings>,
    rows: Vec<Arc<RouteRow>>,
    /// By upstream index: the own client of each https upstream (`None` for http ones,
    /// which share the forwarder's). Rebuilt with the table, so new TLS files apply.
    clients: Vec<Option<forward::Client>>,
    /// Where the refusals of requests under this table are counted.
    refusals: Arc<Refusals>,
}

impl Table {
    pub(crate) fn new(config: Arc<Settings>, refusals: &Arc<Refusals>) -> Table {
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
        let verdict = Verdict::Refused(outcome.result());
        let mut resp = self
            .refusals
            .refuse(self, Some(route), op, outcome, None, resource);
        // Rare (a failed exchange, an idempotency refusal): the phases after read it.
        resp.extensions_mut().insert(verdict);
        resp
    }

    /// [`Table::refuse`] for a refusal made before anything reached the upstream (the
    /// body could not be read, the head cannot be forwarded, the connection failed): a
    /// retry may go again.
    pub(crate) fn refuse_unsent(
        &self,
        route: usize,
        op: Op,
        outcome: Outcome,
        resource: Option<&str>,
    ) -> Response<Body> {
        let verdict = Verdict::NotForwarded(outcome.result());
        let mut resp = self.refuse(route, op, outcome, resource);
        resp.extensions_mut().insert(verdict);
        resp
    }
}

/// The binary's pipeline: the fence over idempotency over the forwarder.
type Stack = Fence<Idempotent<Forwarder>, Typed>;

pub struct Proxy {
    pub gates: Arc<Gates>,
    pub metrics: Arc<Metrics>,
    /// In a cluster: which instance decides for a scope.
    placement: Option<Arc<dyn hop::Placement>>,
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

impl Proxy {
    pub fn new(config: Arc<Settings>, gates: Arc<Gates>, metrics: Arc<Metrics>) -> Proxy {
        Proxy::build(
            config,
            gates,
            metrics,
            crate::access_log::AccessLog::off(),
            None,
        )
    }

    fn build(
        config: Arc<Settings>,
        gates: Arc<Gates>,
        metrics: Arc<Metrics>,
        access: crate::access_log::AccessLog,
        placement: Option<Arc<dyn hop::Placement>>,
    ) -> Proxy {
        let max_buffered = config.idempotency.max_buffered;
        let idempotency = Arc::new(Idempotency::new(gates.store().clone(), max_buffered));
        let refusals = Arc::new(Refusals::new(metrics.clone(), access));
        let stack = tower::ServiceBuilder::new()
            // First, the fence: nothing below sees a request that is unrouted, unsafe to
            // pass, or not admitted at its scope's gate.
            .layer(FenceLayer::<Typed>::with(
                config,
                gates.clone(),
                refusals,
                placement.clone(),
            ))
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
            placement,
            stack,
            idempotency,
        }
    }

    /// The access log to write to (opened by the caller, which reports a bad file).
    pub fn with_access_log(self, log: crate::access_log::AccessLog) -> Proxy {
        Proxy::build(self.config(), self.gates, self.metrics, log, self.placement)
    }

    /// In a cluster: hops the fenced requests of shards owned elsewhere (SPEC §10).
    /// Before [`Proxy::with_access_log`], which keeps it (this one starts the access log
    /// off again).
    pub fn with_placement(self, placement: Arc<dyn hop::Placement>) -> Proxy {
        Proxy::build(
            self.config(),
            self.gates,
            self.metrics,
            crate::access_log::AccessLog::off(),
            Some(placement),
        )
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
    pub fn reload(&self, config: Arc<Settings>) {
        self.stack.layer().reload(config);
    }

    /// The settings in force (routes, upstreams and the values the proxy reads).
    pub fn config(&self) -> Arc<Settings> {
        self.stack.layer().config()
    }

    pub fn idempotency(&self) -> &Idempotency {
        &self.idempotency
    }

    /// A request's answer, from the stack (a plain function returning its future).
    pub fn handle(
        &self,
        req: Request<Incoming>,
        peer: crate::listen::Peer,
        tls: bool,
    ) -> impl Future<Output = Response<Body>> + Send + '_ {
        self.handle_conn(
            req,
            Conn {
                peer: peer.addr,
                tls,
                hop: false,
                client: peer.held,
            },
        )
    }

    /// A request handed over by another instance of the cluster on `peer_listen`, its
    /// credential checked (SPEC §10): decided here, never hopped again.
    pub fn handle_peer(
        &self,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> impl Future<Output = Response<Body>> + Send + '_ {
        self.handle_conn(
            req,
            Conn {
                peer,
                tls: false,
                hop: true,
                client: None,
            },
        )
    }

    fn handle_conn(
        &self,
        req: Request<Incoming>,
        conn: Conn,
    ) -> impl Future<Output = Response<Body>> + Send + '_ {
        // Through the stages' unboxed futures (see `stage::Stage`), not `Service::call`.
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
        let note = resp.extensions_mut().remove::<Note>().unwrap_or_default();
        resp.headers_mut()
            .insert(crate::access_log::X_REQUEST_ID, id.clone());
        // What the request came to, as the phase that decided it said; a refusal made
        // after the note was taken (an upload's record) carries its own.
        let verdict = note
            .verdict
            .or_else(|| resp.extensions().get::<Verdict>().copied());
        let result = match verdict {
            Some(v) => v.result().unwrap_or_else(|| {
                // A hop: the owner's word, in its header.
                resp.headers()
                    .get(FENCING_RESULT)
                    .map_or("unfenced", |v| v.to_str().unwrap_or("-"))
            }),
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

/// Everything before forwarding: refuse what is unsafe ([`classify()`], without waiting),
/// admit what is fenced. Holds no reference to the request while the gate is awaited
/// (a body need not be `Sync`), and only what admission needs.
pub(crate) async fn check(
    gates: &Gates,
    config: &Settings,
    classified: Result<Classified, (Option<usize>, Outcome)>,
    op: Op,
    placement: Option<&dyn hop::Placement>,
    hopped: bool,
) -> Result<Plan, (Option<usize>, Outcome)> {
    let Fenced {
        route: idx,
        equal,
        scope,
        token,
        sequence,
        proof,
        upload,
        tree,
    } = match classified? {
        Classified::Unfenced(plan) => return Ok(plan),
        Classified::PassUpload { plan, id } => {
            let route = plan.route;
            return passing_upload(gates, config, &id)
                .map(|()| plan)
                .map_err(|o| (Some(route), o));
        }
        Classified::Fenced(fenced) => fenced,
        // The binary's fence reads such a body before it checks (`Fence::serve`); a fence
        // that hands requests to a service of its own does not.
        Classified::Named(named) => {
            return Err((
                Some(named.route),
                Outcome::UnfencedOperation {
                    detail: "the objects are named in the body, which this fence does not read"
                        .into(),
                },
            ));
        }
    };
    if let Some(placement) = placement
        && let Some(hop) = place(placement, idx, &scope, token, hopped)?
    {
        return Ok(Plan {
            route: idx,
            op,
            guard: None,
            scope: Some(scope),
            token: Some(token),
            hop: Some(hop),
            stop: None,
            record_upload: false,
        });
    }
    // A part, a completion or an abort names an upload id: it must have been created in
    // this scope (SPEC §15). Checked where the scope is decided, before admission.
    if let Some(upload) = &upload {
        check_upload(
            gates,
            config,
            idx,
            &scope,
            token,
            upload,
            placement.is_some(),
        )?;
    }
    // A DELETE, MOVE or COPY that may change a collection's members (SPEC §16): refused
    // while a scope beneath its own holds a mark, and holding that tree (against new
    // marks there) until its upstream exchange is over.
    let tree = if tree {
        Some(check_tree(gates, idx, &scope, token, placement.is_some())?)
    } else {
        None
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
    let stop = placement.and_then(|p| p.stop(&scope));
    let mut guard = admission.guard;
    if let Some(hold) = tree {
        guard.hold_tree(hold);
    }
    Ok(Plan {
        route: idx,
        op,
        guard: Some(guard),
        scope: Some(scope),
        token: Some(token),
        hop: None,
        stop,
        record_upload: upload == Some(s3::upload::Upload::Creates),
    })
}

/// In a cluster, where the scope is decided: `None` here, or the owner to hop to. At
/// most one hop: a request handed here for a shard owned elsewhere now is told to retry.
fn place(
    placement: &dyn hop::Placement,
    idx: usize,
    scope: &str,
    token: Token,
    hopped: bool,
) -> Result<Option<Arc<hop::Hop>>, (Option<usize>, Outcome)> {
    let unavailable = || {
        (
            Some(idx),
            Outcome::Unavailable {
                scope: scope.to_string(),
                token,
            },
        )
    };
    match placement.place(scope) {
        hop::Place::Here => Ok(None),
        hop::Place::Owner(_) | hop::Place::Unknown if hopped => Err(unavailable()),
        hop::Place::Owner(owner) => Ok(Some(owner)),
        hop::Place::Unknown => Err(unavailable()),
    }
}

/// A part, a completion or an abort names an upload id: it must have been created in
/// this scope (SPEC §15). A DeleteBucket may delete the bucket's objects with it: none
/// may be fenced under another scope. Checked where the scope is decided, before
/// admission.
fn check_upload(
    gates: &Gates,
    config: &Settings,
    idx: usize,
    scope: &str,
    token: Token,
    upload: &s3::upload::Upload,
    clustered: bool,
) -> Result<(), (Option<usize>, Outcome)> {
    match upload {
        s3::upload::Upload::Uses(id) => check_upload_id(gates, config, idx, scope, token, id),
        s3::upload::Upload::DeletesBucket { scopes, exact } => {
            // In a cluster another instance may hold the bucket's marks.
            let beneath = if clustered {
                Some("(marks held by other instances)".to_string())
            } else {
                gates
                    .store()
                    .marked_beneath(scopes, *exact, scope)
                    .map_err(|_| {
                        (
                            Some(idx),
                            Outcome::Unavailable {
                                scope: scope.to_string(),
                                token,
                            },
                        )
                    })?
            };
            match beneath {
                None => Ok(()),
                Some(other) => Err((
                    Some(idx),
                    Outcome::MultiScope {
                        detail: format!(
                            "a DeleteBucket may delete the bucket's objects with it, and one is fenced under another scope ({other})"
                        ),
                    },
                )),
            }
        }
        _ => Ok(()),
    }
}

/// Holds the tree beneath `scope` for a request that may change a collection's members,
/// then refuses it `multi_scope` if any scope beneath holds a mark: those objects are
/// fenced by tokens of their own, which this request does not carry. In a cluster the
/// marks are spread over the instances (and `check-config` refuses such a route there).
fn check_tree(
    gates: &Gates,
    idx: usize,
    scope: &str,
    token: Token,
    clustered: bool,
) -> Result<crate::fence::TreeHold, (Option<usize>, Outcome)> {
    let hold = gates.hold_tree(scope);
    let beneath = if clustered {
        Some("(marks held by other instances)".to_string())
    } else {
        gates
            .store()
            .marked_beneath(&format!("{scope}/"), false, "")
            .map_err(|_| {
                (
                    Some(idx),
                    Outcome::Unavailable {
                        scope: scope.to_string(),
                        token,
                    },
                )
            })?
    };
    match beneath {
        None => Ok(hold),
        Some(other) => Err((
            Some(idx),
            Outcome::FencedBeneath {
                scope: scope.to_string(),
                token,
                detail: format!(
                    "this request may change the members of the collection {scope}, and one is fenced under a scope of its own ({other})"
                ),
            },
        )),
    }
}

/// Refuses a request that names an upload id not recorded for its scope: one created for
/// another key (`multi_scope`: it would change that key's object), or one unknown here
/// (created before fencegate recorded uploads, expired, or recorded by the instance that
/// owned the scope before).
fn check_upload_id(
    gates: &Gates,
    config: &Settings,
    idx: usize,
    scope: &str,
    token: Token,
    id: &str,
) -> Result<(), (Option<usize>, Outcome)> {
    let upstream = &config.upstreams[config.routes[idx].upstream].name;
    let recorded = recorded_scope(gates, upstream, id).map_err(|()| {
        (
            Some(idx),
            Outcome::Unavailable {
                scope: scope.to_string(),
                token,
            },
        )
    })?;
    match recorded {
        Some(s) if s == scope => Ok(()),
        Some(other) => Err((
            Some(idx),
            Outcome::MultiScope {
                detail: format!(
                    "the upload {id} was created in scope {other}, not in this request's ({scope})"
                ),
            },
        )),
        None => Err((
            Some(idx),
            Outcome::UnknownUpload {
                scope: scope.to_string(),
                detail: format!(
                    "the upload {id} was not created through this fence (or has expired): start a new upload"
                ),
            },
        )),
    }
}

/// An unfenced request naming an upload id, on an upstream an S3 route fences: refused if
/// a fenced scope recorded that id (the request would change its object's upload outside
/// the fence), or if the store cannot say.
fn passing_upload(gates: &Gates, config: &Settings, id: &str) -> Result<(), Outcome> {
    // Records are kept per upstream name; every S3 route's upstream is looked at.
    for upstream in config
        .routes
        .iter()
        .filter(|r| r.fenced && r.s3().is_some())
        .map(|r| &config.upstreams[r.upstream].name)
    {
        let recorded =
            recorded_scope(gates, upstream, id).map_err(|()| Outcome::UnfencedOperation {
                detail: format!(
                    "whether the upload {id} belongs to a fenced scope cannot be read now; retry"
                ),
            })?;
        if let Some(scope) = recorded {
            return Err(Outcome::MultiScope {
                detail: format!(
                    "the upload {id} was created in the fenced scope {scope}: its parts, completion and abort go through its fenced route, with its token"
                ),
            });
        }
    }
    Ok(())
}

/// The scope an upload id of `upstream` was recorded in, if its record has not expired;
/// `Err` when the store cannot be read.
fn recorded_scope(gates: &Gates, upstream: &str, id: &str) -> Result<Option<String>, ()> {
    let record = gates
        .store()
        .record(&s3::upload::record_key(upstream, id))
        .map_err(|_| ())?;
    Ok(record
        .as_deref()
        .and_then(|v| s3::upload::record_scope(v, now_secs()))
        .map(str::to_owned))
}

/// Seconds since the Unix epoch, for records' expiry.
pub(crate) fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
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
