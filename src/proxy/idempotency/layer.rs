//! The idempotency stage in the stack: a tower layer under the fence, and the [`Stage`]
//! the binary calls, which passes every request through but a fenced generation's write
//! on a route with `idempotency` on (see [`Idempotency::handle`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::Response;
use http_body_util::BodyExt;

use super::{Idempotency, Keyed, Mode};
use crate::proxy::context::Admitted;
use crate::proxy::stage::Stage;
use crate::proxy::{Body, BoxError};

/// The idempotency stage as a layer, under the fence: a fenced, admitted request on a
/// route with `idempotency` on is claimed, forwarded by the inner stage and recorded;
/// every other request goes to the inner stage as it is.
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

/// [`IdempotencyLayer`]'s stage (a `Service` through
/// [`Staged`](crate::proxy::stage::Staged)).
#[derive(Clone)]
pub struct Idempotent<S> {
    state: Arc<Idempotency>,
    inner: S,
}

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
/// but not recorded, so a client cannot fill the store with copies of what it reads).
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
