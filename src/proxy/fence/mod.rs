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
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{Request, Response};
use tower::{Layer, Service};

use super::Settings;
pub use super::context::Conn;
use super::context::{Admitted, Note, Plan, Verdict};
use super::stage::Boxed;
pub(crate) use super::stage::Stage;
use crate::access_log::AccessLog;
use crate::fence::Gates;
use crate::metrics::{Metrics, Op};
use crate::proxy::hop::Placement;
use crate::proxy::{Body, BoxError, Outcome, Table};
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

mod extensions;
mod refusals;
mod upload;

pub use extensions::Guarded;
use refusals::unread;
pub(crate) use refusals::{Asked, Refusals};
use upload::record_upload;

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
        hop: bool,
    ) -> impl Future<Output = Result<Plan, (Option<usize>, Outcome)>> + Send + 'a {
        super::check(
            &self.gates,
            &table.config,
            classified,
            op,
            self.placement.as_deref(),
            hop,
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
            conn: self.conn.clone(),
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
            let plan = match shared.check(&table, classified, op, conn.hop).await {
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
        let classified = keys.map_err(|e| malformed(e.to_string())).and_then(|keys| {
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
        let plan = match shared.check(&table, classified, op, conn.hop).await {
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
    /// with what the request came to, in the answer's extensions. (A future of its own,
    /// not an `async fn`: that one kept the request, plan and connection it was given
    /// beside the inner stage's future, which made every request's future ~660 bytes
    /// larger, the unlogged one's too: it is one of [`Fence::serve`]'s states.)
    fn noted<B>(
        &self,
        req: Request<B>,
        table: Arc<Table>,
        plan: Plan,
        conn: Conn,
    ) -> Noted<impl Future<Output = Response<Body>> + Send + '_>
    where
        S: Stage<B>,
    {
        let note = Note::of(&table, &plan);
        Noted {
            sent: Instant::now(),
            inner: self.inner.serve(Admitted {
                req,
                table,
                plan,
                conn,
                report: true,
            }),
            note: Some(note),
        }
    }
}

pin_project_lite::pin_project! {
    /// The inner stage's answer with the access log's note in its extensions: when it
    /// was handed in, how long its answer took, and what it came to (the [`Verdict`] the
    /// inner stage left, taken out).
    pub(crate) struct Noted<F> {
        #[pin]
        inner: F,
        note: Option<Note>,
        sent: Instant,
    }
}

impl<F: Future<Output = Response<Body>>> Future for Noted<F> {
    type Output = Response<Body>;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Response<Body>> {
        let this = self.project();
        let mut resp = std::task::ready!(this.inner.poll(cx));
        let mut note = this.note.take().unwrap_or_default();
        note.upstream = Some(this.sent.elapsed());
        note.verdict = resp.extensions_mut().remove::<Verdict>();
        resp.extensions_mut().insert(note);
        Poll::Ready(resp)
    }
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
        let conn = self.conn.clone();
        Box::pin(async move {
            let conn =
                conn.unwrap_or_else(|| req.extensions().get::<Conn>().cloned().unwrap_or_default());
            Ok(this.serve(req, conn).await)
        })
    }
}

#[cfg(test)]
mod tests;
