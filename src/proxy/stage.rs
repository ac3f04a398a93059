//! A stage of the binary's stack ([`Stage`]), and [`Staged`], the one `tower::Service`
//! over any stage, for a caller that needs a `Service` (a spawned task, another tower
//! stack) rather than the stage's borrowed future.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;

use super::Body;
use super::context::Admitted;

/// A future that owns what it needs, boxed: what a `Service` must name.
pub(crate) type Boxed<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

/// A layer of the binary's stack as the binary calls it: like `Service::call`, but its
/// future is an `impl Future` that borrows the stage, so the whole request is one
/// unboxed future as before the stack was made of layers. (`Service` needs a nameable
/// future, which without `impl Trait` in associated types is a box per layer: measured
/// with `benches/callgrind.sh`, 29,962 instructions per W1 request against 28,820.)
/// [`Staged`] makes any stage a `Service` where one is needed.
pub(crate) trait Stage<B>: Send + Sync {
    fn serve(&self, a: Admitted<B>) -> impl Future<Output = Response<Body>> + Send + '_;
}

/// Any [`Stage`] as a `tower::Service` of admitted requests: always ready, infallible,
/// its future boxed and owning a clone of the stage.
#[derive(Clone)]
pub(crate) struct Staged<S>(pub(crate) S);

impl<S, B> tower::Service<Admitted<B>> for Staged<S>
where
    S: Stage<B> + Clone + 'static,
    B: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Boxed<Response<Body>, Infallible>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, a: Admitted<B>) -> Self::Future {
        let stage = self.0.clone();
        Box::pin(async move { Ok(stage.serve(a).await) })
    }
}
