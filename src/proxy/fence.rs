//! The fence as a tower [`Layer`]: routing → token → (proof) → gate, and every refusal
//! made a problem+json response, in front of any `Service<http::Request<_>>`.
//!
//! It lives under `proxy/`, not `fence/`, because it is the HTTP face of the fence: it
//! reads request heads, routes them and answers with [`Outcome`]s, while `fence/` (the
//! policy table, the gate, the marks) knows nothing of HTTP and imports nothing from here.
//!
//! Two ways to hand an admitted request on, chosen by the layer's type parameter:
//! - [`InExtensions`] (the default, for a service that owns its storage, e.g. axum
//!   handlers): the inner service gets the `http::Request` with a [`FencedRequest`] in
//!   its extensions; the layer holds the gate's in-flight guard until the inner service's
//!   response body is done, completing it when a response came back.
//! - `Typed` (the binary's stack): the inner service gets an `Admitted` request that
//!   carries the plan, guard included, so that the forwarder can apply the guard's rules
//!   (not forwarded, settle on a lost exchange) as the upstream exchange goes. No
//!   extension map is allocated on the hot path.

use std::convert::Infallible;
use std::future::Future;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, header};
use http_body::{Frame, SizeHint};
use tower::{Layer, Service};

use super::Settings;
pub use super::context::Conn;
use super::context::{Admitted, Note, Plan, Verdict};
use super::stage::Boxed;
pub(crate) use super::stage::Stage;
use crate::access_log::{AccessLog, RefusalWarnings};
use crate::fence::{Gates, InflightGuard};
use crate::metrics::{Metrics, Op};
use crate::proxy::hop::Placement;
use crate::proxy::problem::Dialect;
use crate::proxy::{Body, BoxError, FENCING_RESULT, Outcome, Table};
use crate::token::Token;

/// The handoff of [`FenceLayer`]'s default: the request, with a [`FencedRequest`] in
/// its extensions when it was fenced.
#[derive(Debug, Clone, Copy)]
pub enum InExtensions {}

/// The binary's handoff: an [`Admitted`] request.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Typed {}

/// What an [`InExtensions`] fence tells its inner service of an admitted, fenced request.
#[derive(Debug, Clone)]
pub struct FencedRequest {
    /// The route's name.
    pub route: String,
    pub scope: String,
    pub token: Token,
}

/// Where every refusal is counted, once: the route's metric row (or the unrouted one),
/// the access log's note, and the rate-limited warning for `stale_fence` and
/// `invalid_proof`. Every stage refuses through [`Refusals::refuse`] (the inner layers by
/// [`Table::refuse`]).
pub(crate) struct Refusals {
    pub(crate) metrics: Arc<Metrics>,
    /// `[log] access`; off unless set.
    pub(crate) access: AccessLog,
    /// Warnings for stale and unproven tokens, logged whether the access log is on or not.
    pub(crate) warnings: RefusalWarnings,
}

/// A refused request's head, for what only the fence knows of a refusal made before
/// anything was forwarded.
pub(crate) struct Asked<'a> {
    pub(crate) headers: &'a HeaderMap,
    /// The request's path, named in an S3 error document.
    pub(crate) path: &'a str,
    pub(crate) peer: SocketAddr,
    /// An HTTP/1 request whose body was not read: the answer closes the connection.
    pub(crate) unread_body: bool,
}

impl Refusals {
    pub(crate) fn new(metrics: Arc<Metrics>, access: AccessLog) -> Refusals {
        Refusals {
            metrics,
            access,
            warnings: RefusalWarnings::default(),
        }
    }

    /// The one place a refusal is counted and answered. `asked` is the request's head
    /// when the refusal was made before anything was forwarded (the fence's): then it is
    /// noted for the access log, warned about if stale or unproven, and answered with a
    /// request id and (body unread) `Connection: close`. The answer is in the route's
    /// dialect (`errors`); `resource`, the request's path, is named in an S3 document
    /// (`asked`'s path when there is one).
    pub(crate) fn refuse(
        &self,
        table: &Table,
        route: Option<usize>,
        op: Op,
        outcome: Outcome,
        asked: Option<Asked<'_>>,
        resource: Option<&str>,
    ) -> Response<Body> {
        match route {
            Some(i) => table.count(i, op, outcome.result()),
            None => self.metrics.count_unrouted(op, outcome.result()),
        }
        let dialect = match route {
            Some(i) => table.config.routes[i].errors,
            None => {
                super::s3::unrouted_dialect(&table.config.routes, asked.as_ref().map(|a| a.headers))
            }
        };
        let Some(asked) = asked else {
            return outcome.into_response_in(dialect, resource, None);
        };
        let warned = matches!(
            outcome,
            Outcome::Stale { .. } | Outcome::InvalidProof { .. }
        );
        let logged = self.access.is_on();
        let mut note = None;
        let mut id = None;
        if warned || logged {
            let (scope, token, highest) = outcome.fields();
            // With the access log on, the request already carries the id the log keeps.
            let request_id = self.access.request_id(asked.headers);
            if let (Some(scope), Some(token), true) = (scope, token, warned) {
                self.warnings.warn(&crate::access_log::Refused {
                    result: outcome.result(),
                    scope,
                    token: *token,
                    highest,
                    peer: asked.peer,
                    route: route.map_or("-", |i| table.config.routes[i].name.as_str()),
                    request_id: request_id.to_str().unwrap_or("-"),
                });
            }
            if logged {
                note = Some(Note {
                    route: route.map(|i| table.config.routes[i].name.clone()),
                    scope: scope.cloned(),
                    token: token.copied(),
                    highest,
                    sequence: outcome.sequences().map(|s| s.0),
                    highest_sequence: outcome.sequences().map(|s| s.1),
                    upstream: None,
                    verdict: Some(Verdict::Refused(outcome.result())),
                });
            } else {
                id = Some(request_id);
            }
        }
        let shown_id = match (&id, dialect) {
            (_, Dialect::Problem) => None,
            (Some(id), _) => Some(id.clone()),
            // With the access log on, the request carries the id the log keeps.
            (None, _) => asked.headers.get(crate::access_log::X_REQUEST_ID).cloned(),
        };
        let mut resp = outcome.into_response_in(dialect, Some(asked.path), shown_id.as_ref());
        if let Some(id) = id {
            resp.headers_mut()
                .insert(crate::access_log::X_REQUEST_ID, id);
        }
        if let Some(note) = note {
            resp.extensions_mut().insert(note);
        }
        // Refused before its body was read: hyper closes the connection after the answer,
        // which says so, or a keep-alive client would send its next request into the close.
        if asked.unread_body {
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

/// What every [`Fence`] of one layer shares.
pub(crate) struct Shared {
    /// The routing table in force, swapped whole on reload.
    pub(crate) table: ArcSwap<Table>,
    pub(crate) gates: Arc<Gates>,
    pub(crate) refusals: Arc<Refusals>,
    /// In a cluster: which instance decides for a scope (SPEC §10).
    pub(crate) placement: Option<Arc<dyn Placement>>,
}

impl Shared {
    /// [`super::check`] with what this layer knows: its gates and, in a cluster, where
    /// each scope is decided.
    /// (A plain function returning the check's own future: no future around it.)
    fn check<'a>(
        &'a self,
        table: &'a Table,
        classified: Result<super::Classified, (Option<usize>, Outcome)>,
        op: Op,
        conn: Conn,
    ) -> impl Future<Output = Result<Plan, (Option<usize>, Outcome)>> + Send + 'a {
        super::check(
            &self.gates,
            &table.config,
            classified,
            op,
            self.placement.as_deref(),
            conn.hop,
        )
    }
}

/// The fence in front of a service: see the module's documentation. Cloning it shares
/// the routing table, gates and metrics.
pub struct FenceLayer<H = InExtensions> {
    shared: Arc<Shared>,
    _handoff: PhantomData<fn() -> H>,
}

impl<H> Clone for FenceLayer<H> {
    fn clone(&self) -> Self {
        FenceLayer {
            shared: self.shared.clone(),
            _handoff: PhantomData,
        }
    }
}

impl FenceLayer {
    /// A fence for `config`'s routes, admitting at `gates` (over the service's mark
    /// store) and counting into `metrics`.
    pub fn new(config: Arc<Settings>, gates: Arc<Gates>, metrics: Arc<Metrics>) -> FenceLayer {
        FenceLayer::with(
            config,
            gates,
            Arc::new(Refusals::new(metrics, AccessLog::off())),
            None,
        )
    }
}

impl<H> FenceLayer<H> {
    pub(crate) fn with(
        config: Arc<Settings>,
        gates: Arc<Gates>,
        refusals: Arc<Refusals>,
        placement: Option<Arc<dyn Placement>>,
    ) -> FenceLayer<H> {
        let table = Table::new(config, &refusals);
        FenceLayer {
            shared: Arc::new(Shared {
                table: ArcSwap::from_pointee(table),
                gates,
                refusals,
                placement,
            }),
            _handoff: PhantomData,
        }
    }

    /// New routes for every request that starts from now on; requests under way finish
    /// with the table they started with.
    pub fn reload(&self, config: Arc<Settings>) {
        let table = Table::new(config, &self.shared.refusals);
        self.shared.table.store(Arc::new(table));
    }

    /// The settings in force.
    pub fn config(&self) -> Arc<Settings> {
        self.shared.table.load().config.clone()
    }

    pub fn gates(&self) -> &Arc<Gates> {
        &self.shared.gates
    }
}

impl<S, H> Layer<S> for FenceLayer<H> {
    type Service = Fence<S, H>;

    fn layer(&self, inner: S) -> Fence<S, H> {
        Fence {
            shared: self.shared.clone(),
            inner,
            conn: None,
            _handoff: PhantomData,
        }
    }
}

/// [`FenceLayer`]'s service. Always ready: it refuses by answering, never by waiting.
pub struct Fence<S, H = InExtensions> {
    shared: Arc<Shared>,
    inner: S,
    conn: Option<Conn>,
    _handoff: PhantomData<fn() -> H>,
}

impl<S: Clone, H> Clone for Fence<S, H> {
    fn clone(&self) -> Self {
        Fence {
            shared: self.shared.clone(),
            inner: self.inner.clone(),
            conn: self.conn,
            _handoff: PhantomData,
        }
    }
}

impl<S, H> Fence<S, H> {
    /// This service for the requests of one connection.
    pub fn on_connection(mut self, conn: Conn) -> Self {
        self.conn = Some(conn);
        self
    }

    pub(crate) fn refusals(&self) -> &Refusals {
        &self.shared.refusals
    }

    /// Refuses a request that was never routed (the listener's own refusals, e.g. a head
    /// with a flaw hyper hides), through the one refusal path: counted as unrouted.
    pub(crate) fn refuse_unrouted(
        &self,
        method: &http::Method,
        outcome: Outcome,
    ) -> Response<Body> {
        let table = self.shared.table.load();
        self.shared
            .refusals
            .refuse(&table, None, Op::of(method), outcome, None, None)
    }

    pub(crate) fn layer(&self) -> FenceLayer<H> {
        FenceLayer {
            shared: self.shared.clone(),
            _handoff: PhantomData,
        }
    }
}

/// The largest body of a refused HTTP/1 request that is read and dropped rather than left
/// unread (which closes the connection): W3's stale writes keep their connections.
const DISCARD_MAX: u64 = 64 * 1024;
/// How long a refusal waits for such a body. A body sent with its head is in hyper's
/// buffer already and takes one turn of the connection's loop; one the client holds back
/// is given up on after this, and the answer closes the connection.
const DISCARD_WAIT: Duration = Duration::from_millis(500);

/// Whether a refused request's answer must close the connection (see [`Refusals::refuse`]):
/// an HTTP/1 request whose body has not ended, unless it is small, of known length, not
/// waiting for `100 Continue` (reading would ask the client to send it) and arrives
/// within [`DISCARD_WAIT`]; that one is read and dropped, as nginx discards the body of a
/// request it refused, and the connection stays open.
async fn unread<B: http_body::Body>(version: http::Version, headers: &HeaderMap, body: B) -> bool {
    use http_body_util::BodyExt;
    if version >= http::Version::HTTP_2 || body.is_end_stream() {
        return false;
    }
    if headers.contains_key(header::EXPECT)
        || body.size_hint().exact().is_none_or(|n| n > DISCARD_MAX)
    {
        return true;
    }
    let mut body = std::pin::pin!(body);
    let discarded = crate::rt::timer::timeout_from(Instant::now(), DISCARD_WAIT, async {
        while !body.is_end_stream() {
            let mut b = body.as_mut();
            match b.frame().await {
                Some(Ok(_)) => {}
                Some(Err(_)) => return false,
                None => break,
            }
        }
        true
    })
    .await;
    !matches!(discarded, Ok(true))
}

impl<S> Fence<S, Typed> {
    /// The binary's way in (see [`Stage`]): without a clone or a box. (A plain function
    /// returning its future, as the stages' own.)
    #[allow(clippy::manual_async_fn)]
    pub(crate) fn serve<B>(
        &self,
        req: Request<B>,
        conn: Conn,
    ) -> impl Future<Output = Response<Body>> + Send + '_
    where
        S: Stage<B> + Stage<Body>,
        B: http_body::Body<Data = Bytes> + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        async move {
            let shared = &self.shared;
            let table = shared.table.load_full();
            let op = Op::of(req.method());
            let classified = super::classify(&table.config, &req);
            let classified = match classified {
                Ok(super::Classified::Named(named)) => {
                    // Boxed: rare, and its state stays out of every other request's future.
                    return Box::pin(self.serve_named(req, conn, table, op, named)).await;
                }
                other => other,
            };
            let plan = match shared.check(&table, classified, op, conn).await {
                Ok(plan) => plan,
                Err((route, outcome)) => {
                    let (parts, body) = req.into_parts();
                    let asked = Asked {
                        unread_body: unread(parts.version, &parts.headers, body).await,
                        headers: &parts.headers,
                        path: parts.uri.path(),
                        peer: conn.peer,
                    };
                    return shared
                        .refusals
                        .refuse(&table, route, op, outcome, Some(asked), None);
                }
            };
            if plan.record_upload {
                return Box::pin(self.pass(req, table, plan, conn)).await;
            }
            // The common way in, inline rather than through `pass` (an async fn more per
            // request: see docs/PERFORMANCE.md, W1 instructions).
            if shared.refusals.access.is_on() {
                return self.noted(req, table, plan, conn).await;
            }
            self.inner
                .serve(Admitted {
                    req,
                    table,
                    plan,
                    conn,
                    report: false,
                })
                .await
        }
    }

    /// An S3 request that names its objects in its body (SPEC §15): the body is read up
    /// to what names them, their one scope checked as any fenced request's, and the body
    /// forwarded as it was read.
    async fn serve_named<B>(
        &self,
        req: Request<B>,
        conn: Conn,
        table: Arc<Table>,
        op: Op,
        named: super::classify::Named,
    ) -> Response<Body>
    where
        S: Stage<Body>,
        B: http_body::Body<Data = Bytes> + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        use super::s3;
        use http_body_util::BodyExt;
        let shared = &self.shared;
        let (parts, body) = req.into_parts();
        let idx = named.route;
        let route = &table.config.routes[idx];
        let (keys, body) = s3::read_named(named.op, &parts.headers, body, route.max_body).await;
        let body: Body = body.map_err(Into::into).boxed();
        let malformed = |detail| {
            (
                Some(idx),
                Outcome::MalformedBody {
                    code: s3::malformed_code(named.op),
                    detail,
                },
            )
        };
        let classified = keys.map_err(malformed).and_then(|keys| {
            let mode = route.s3().map(|s| s.keys).unwrap_or_default();
            // A form posted to an object's path names that key too.
            let names = keys.iter().chain(named.path_key.as_ref());
            match s3::one_scope(&route.scope, &named.bucket, names.map(String::as_str), mode) {
                Ok(scope) => super::classify::named(&table.config, &parts, idx, scope),
                Err(s3::Refused::Malformed(detail)) => Err(malformed(detail)),
                Err(s3::Refused::MultiScope(detail)) => {
                    Err((Some(idx), Outcome::MultiScope { detail }))
                }
            }
        });
        let plan = match shared.check(&table, classified, op, conn).await {
            Ok(plan) => plan,
            Err((route, outcome)) => {
                let asked = Asked {
                    unread_body: unread(parts.version, &parts.headers, body).await,
                    headers: &parts.headers,
                    path: parts.uri.path(),
                    peer: conn.peer,
                };
                return shared
                    .refusals
                    .refuse(&table, route, op, outcome, Some(asked), None);
            }
        };
        self.pass(Request::from_parts(parts, body), table, plan, conn)
            .await
    }

    /// Hands an admitted request to the inner stage ([`Fence::hand_in`]); an S3
    /// CreateMultipartUpload's answer is held until its upload id is recorded.
    async fn pass<B>(
        &self,
        req: Request<B>,
        table: Arc<Table>,
        plan: Plan,
        conn: Conn,
    ) -> Response<Body>
    where
        S: Stage<B>,
    {
        let record = match (&plan.scope, plan.record_upload, plan.token) {
            (Some(scope), true, Some(token)) => {
                Some((table.clone(), scope.clone(), plan.route, token))
            }
            _ => None,
        };
        let client = conn.peer.ip();
        let resp = self.hand_in(req, table, plan, conn).await;
        match record {
            None => resp,
            Some((table, scope, route, token)) => {
                Box::pin(record_upload(
                    self.shared.gates.store(),
                    resp,
                    &table,
                    scope,
                    route,
                    token,
                    client,
                ))
                .await
            }
        }
    }

    /// Hands an admitted request to the inner stage, with the access log's note when
    /// the log is on.
    async fn hand_in<B>(
        &self,
        req: Request<B>,
        table: Arc<Table>,
        plan: Plan,
        conn: Conn,
    ) -> Response<Body>
    where
        S: Stage<B>,
    {
        if self.shared.refusals.access.is_on() {
            return self.noted(req, table, plan, conn).await;
        }
        self.inner
            .serve(Admitted {
                req,
                table,
                plan,
                conn,
                report: false,
            })
            .await
    }

    /// Hands an admitted request to the inner stage and leaves the access log's note,
    /// with what the request came to, in the answer's extensions.
    async fn noted<B>(
        &self,
        req: Request<B>,
        table: Arc<Table>,
        plan: Plan,
        conn: Conn,
    ) -> Response<Body>
    where
        S: Stage<B>,
    {
        let mut note = Note::of(&table, &plan);
        let sent = Instant::now();
        let mut resp = self
            .inner
            .serve(Admitted {
                req,
                table,
                plan,
                conn,
                report: true,
            })
            .await;
        note.upstream = Some(sent.elapsed());
        note.verdict = resp.extensions_mut().remove::<Verdict>();
        resp.extensions_mut().insert(note);
        resp
    }
}

/// Why an upstream answer's body could not be read whole.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum AnswerError {
    #[error("{0}")]
    Body(#[source] BoxError),
    #[error("longer than {limit} bytes")]
    TooLong { limit: usize },
}

/// An upstream answer's body, whole, up to `limit` bytes.
async fn read_answer(mut body: Body, limit: usize) -> Result<Bytes, AnswerError> {
    use http_body_util::BodyExt;
    let mut out = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(AnswerError::Body)?;
        if let Ok(data) = frame.into_data() {
            if out.len() + data.len() > limit {
                return Err(AnswerError::TooLong { limit });
            }
            out.extend_from_slice(&data);
        }
    }
    Ok(out.freeze())
}

/// Records the upload id of a CreateMultipartUpload's successful answer with its
/// scope (SPEC §15), durably, before the answer goes on. An answer whose id cannot be
/// read goes on unrecorded (its parts will be refused as unknown, loudly); a record
/// that cannot be made durable, or past the bounds on records (the store's and its
/// client's, as for idempotency records: see `idempotency.max_records*`), is 503
/// `unavailable`.
#[allow(clippy::too_many_arguments)]
async fn record_upload(
    store: &crate::store::MarkStore,
    resp: Response<Body>,
    table: &Table,
    scope: String,
    route: usize,
    token: crate::token::Token,
    client: std::net::IpAddr,
) -> Response<Body> {
    use super::s3::upload;
    use http_body_util::BodyExt;
    if resp.status() != http::StatusCode::OK {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let op = Op::of(&http::Method::POST);
    let bytes = match read_answer(body, upload::MAX_ANSWER).await {
        Ok(b) => b,
        Err(detail) => {
            let outcome = Outcome::UpstreamTimeout {
                scope: Some(scope),
                detail: format!(
                    "the CreateMultipartUpload answer could not be read whole ({detail}); the upload may have been created"
                ),
            };
            return table.refuse(route, op, outcome, None);
        }
    };
    match upload::answered_id(&bytes) {
        Err(detail) => {
            tracing::warn!(%scope, %detail, "a CreateMultipartUpload answer without an upload id to record");
        }
        Ok(id) => {
            let upstream = &table.config.upstreams[table.config.routes[route].upstream].name;
            let now = super::now_secs();
            let value = upload::record_value(now + upload::UPLOAD_TTL.as_secs(), &scope);
            let key = upload::record_key(upstream, &id);
            let settings = &table.config.idempotency;
            // Every upload record shares one scope of its own: the store's bound stands
            // for it.
            let quota = crate::store::quota::RecordQuota {
                total: settings.max_records,
                per_scope: settings.max_records,
                per_client: settings.max_records_per_client,
                reserve: 0,
                min_free: table.config.store.min_free,
            };
            let stored = store
                .claim_within(
                    key,
                    value,
                    None,
                    now,
                    Some((crate::store::quota::client_key(client), quota)),
                )
                .await;
            use crate::store::marks::Claimed;
            let ours = match &stored {
                Ok(Claimed::Claimed) => true,
                Ok(Claimed::Held(v)) => upload::record_scope(v, now) == Some(scope.as_str()),
                Ok(Claimed::Rejected(why)) => {
                    tracing::warn!(%scope, reason = why.describe(), "a multipart upload not recorded: past a bound on records");
                    false
                }
                Err(_) => false,
            };
            if !ours {
                return table.refuse(route, op, Outcome::Unavailable { scope, token }, None);
            }
        }
    }
    let body = http_body_util::Full::new(bytes)
        .map_err(|never| match never {})
        .boxed();
    Response::from_parts(parts, body)
}

impl<S, B> Service<Request<B>> for Fence<S, Typed>
where
    S: Stage<B> + Stage<Body> + Clone + 'static,
    B: http_body::Body<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Boxed<Response<Body>, Infallible>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    /// [`Fence::serve`] on a clone of this service, for a caller that needs a `Service`.
    fn call(&mut self, req: Request<B>) -> Self::Future {
        let this = self.clone();
        let conn = self.conn;
        Box::pin(async move {
            let conn =
                conn.unwrap_or_else(|| req.extensions().get::<Conn>().copied().unwrap_or_default());
            Ok(this.serve(req, conn).await)
        })
    }
}

impl<S, B, RB> Service<Request<B>> for Fence<S, InExtensions>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    B: http_body::Body + Send + 'static,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = Response<http_body_util::Either<Body, Guarded<RB>>>;
    type Error = S::Error;
    type Future = Boxed<Self::Response, S::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        use http_body_util::Either;
        let shared = self.shared.clone();
        let mut inner = self.inner.clone();
        let conn = self.conn;
        Box::pin(async move {
            let conn =
                conn.unwrap_or_else(|| req.extensions().get::<Conn>().copied().unwrap_or_default());
            let table = shared.table.load_full();
            let op = Op::of(req.method());
            let classified = super::classify(&table.config, &req);
            let plan = match shared.check(&table, classified, op, conn).await {
                Ok(plan) => plan,
                Err((route, outcome)) => {
                    let (parts, body) = req.into_parts();
                    let asked = Asked {
                        unread_body: unread(parts.version, &parts.headers, body).await,
                        headers: &parts.headers,
                        path: parts.uri.path(),
                        peer: conn.peer,
                    };
                    let resp =
                        shared
                            .refusals
                            .refuse(&table, route, op, outcome, Some(asked), None);
                    return Ok(resp.map(Either::Left));
                }
            };
            let Plan {
                route,
                op,
                mut guard,
                scope,
                token,
                ..
            } = plan;
            let fenced = guard.is_some();
            if let (Some(scope), Some(token)) = (scope, token) {
                req.extensions_mut().insert(FencedRequest {
                    route: table.config.routes[route].name.clone(),
                    scope,
                    token,
                });
            }
            // On an error the guard drops uncompleted: the scope settles, as after an
            // exchange whose outcome is unknown.
            let resp = inner.call(req).await?;
            // A 202 says the write was queued, not applied (SPEC §3, invariant 3): the
            // guard drops uncompleted and the scope settles, as after a lost answer.
            if let Some(g) = guard.as_mut()
                && resp.status() != http::StatusCode::ACCEPTED
            {
                g.complete();
            }
            table.count(route, op, if fenced { "accepted" } else { "unfenced" });
            let (mut parts, body) = resp.into_parts();
            if fenced {
                parts
                    .headers
                    .insert(FENCING_RESULT, HeaderValue::from_static("accepted"));
            } else {
                parts.headers.remove(FENCING_RESULT);
            }
            // The generation stays in flight while the response body is sent.
            // A body with nothing to read (a 204, an empty body) lets go at once.
            let guard = guard.filter(|_| !body.is_end_stream());
            let body = Guarded { body, guard };
            Ok(Response::from_parts(parts, Either::Right(body)))
        })
    }
}

pin_project_lite::pin_project! {
    /// An inner service's response body, holding the request's in-flight guard (completed)
    /// until the body ends or is dropped.
    pub struct Guarded<B> {
        #[pin]
        body: B,
        guard: Option<InflightGuard>,
    }
}

impl<B> http_body::Body for Guarded<B>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        let polled = this.body.poll_frame(cx);
        if let Poll::Ready(None) = polled {
            this.guard.take();
        }
        polled.map(|f| f.map(|r| r.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests;
