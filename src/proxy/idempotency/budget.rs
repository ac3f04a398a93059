//! The memory that keyed requests' bodies may hold (`idempotency.max_buffered`), and the
//! bounded reads that take from it.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;

use crate::proxy::{Body, BoxError};

/// Bytes of request and response bodies that requests with an `Idempotency-Key` hold in
/// memory, over all connections (`idempotency.max_buffered`): a request body is read
/// whole before it is forwarded, and a response body is read to be stored.
#[derive(Clone)]
pub(super) struct Budget {
    pub(super) room: Arc<tokio::sync::Semaphore>,
    pub(super) size: usize,
}

/// Room taken from a [`Budget`], given back when dropped.
#[derive(Default)]
pub(super) struct Room {
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
    taken: usize,
    /// A take failed: the budget is spent.
    pub(super) short: bool,
}

impl Room {
    /// Makes sure `total` bytes are covered; false (and `short`) if the budget has no room.
    pub(super) fn cover(&mut self, budget: &Budget, total: usize) -> bool {
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
pub(super) struct Held<B> {
    pub(super) body: B,
    pub(super) _room: Room,
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

/// Reads a body up to `cap` bytes. Answers the bytes and, if the body was longer, the
/// rest still to stream (the read part is in the bytes); `Err` if the body broke.
/// Reads `body` until it ends or more than `cap` bytes came, each byte covered by `room`
/// out of `budget`. Answers what was read and, if it stopped early, the rest of the body:
/// past `cap`, or when the budget had no more room (then `room.short`).
pub(super) async fn read_up_to(
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
pub(super) struct Chain {
    pub(super) first: Option<Bytes>,
    pub(super) rest: Body,
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
