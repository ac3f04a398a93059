//! The fence's default handoff ([`InExtensions`]), for a service that owns its storage:
//! the admitted request goes on with a [`FencedRequest`] in its extensions, and the fence
//! holds the gate's guard until the inner service's response body is done ([`Guarded`]).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body::{Frame, SizeHint};
use tower::Service;

use super::{Asked, Conn, Fence, FencedRequest, InExtensions, unread};
use crate::fence::InflightGuard;
use crate::metrics::Op;
use crate::proxy::context::Plan;
use crate::proxy::stage::Boxed;
use crate::proxy::{Body, BoxError, FENCING_RESULT};

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
        let conn = self.conn.clone();
        Box::pin(async move {
            let conn =
                conn.unwrap_or_else(|| req.extensions().get::<Conn>().cloned().unwrap_or_default());
            let table = shared.table.load_full();
            let op = Op::of(req.method());
            let classified = crate::proxy::classify(&table.config, &req);
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
