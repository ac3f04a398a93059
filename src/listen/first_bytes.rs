//! A deadline for a connection's first bytes.
//!
//! On a port that serves HTTP/1.1 and HTTP/2, hyper-util reads up to 24 bytes (the
//! HTTP/2 preface) to tell them apart, with no deadline of its own; hyper's HTTP/1 head
//! timeout starts only once that is done. A client that connects and sends nothing, or
//! part of the preface and then nothing, would hold its connection slot for good — enough
//! of them and nobody else gets in. [`FirstBytes`] fails the read once the deadline
//! passes while the protocol is still undecided, and costs one branch per read after.
//!
//! It also bounds the other direction (`send_timeout`): a client that stops reading its
//! answer, so that no write to it makes progress for that long, gets its connection
//! closed, which frees the upstream connection its response was coming from.
//!
//! And it hands what an HTTP/1 connection reads to a [`Scan`] (`scanning`), which notes
//! the request heads with a flaw that hyper hides from the service.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::conn::Streams;
use super::h1_scan::Scan;
use crate::rt::timer::Deadline;

/// What a client sends first on an HTTP/2 connection with prior knowledge.
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A connection's IO whose protocol must be told within a deadline.
pub struct FirstBytes<S> {
    io: S,
    /// While undecided: the deadline, and how many bytes so far matched the preface.
    deciding: Option<(Deadline, usize)>,
    /// Told when the connection turns out to speak HTTP/2.
    h2: Option<Arc<Streams>>,
    /// How long a write (or flush) may make no progress.
    send_timeout: Option<Duration>,
    /// Since the first write that found the client not reading: when it fails.
    stalled: Option<Deadline>,
    /// Follows an HTTP/1 connection's request heads (dropped once it speaks HTTP/2).
    scan: Option<Box<Scan>>,
}

impl<S> FirstBytes<S> {
    /// `io`, whose protocol must be known within `within` from now.
    pub fn new(io: S, within: Duration) -> FirstBytes<S> {
        FirstBytes {
            io,
            deciding: Some((Deadline::after(within), 0)),
            h2: None,
            send_timeout: None,
            stalled: None,
            scan: None,
        }
    }

    /// Hands what an HTTP/1 connection reads to `scan`.
    pub(crate) fn scanning(mut self, scan: Scan) -> FirstBytes<S> {
        self.scan = Some(Box::new(scan));
        self
    }

    /// Fails a write, or a flush, that made no progress for `limit` (the client is not
    /// reading what it is sent).
    pub fn send_timeout(mut self, limit: Duration) -> FirstBytes<S> {
        self.send_timeout = Some(limit);
        self
    }

    /// A write's result, through the send deadline: progress clears it; the first write
    /// that cannot go on sets it, and one still waiting at it fails.
    fn sent<T>(
        &mut self,
        cx: &mut Context<'_>,
        result: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match result {
            Poll::Pending => {
                let Some(limit) = self.send_timeout else {
                    return Poll::Pending;
                };
                let deadline = self.stalled.get_or_insert_with(|| Deadline::after(limit));
                match Pin::new(deadline).poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client took none of its answer within send_timeout",
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
            ready => {
                self.stalled = None;
                ready
            }
        }
    }

    /// Tells `streams` if the connection begins with the HTTP/2 preface.
    pub fn telling(mut self, streams: Arc<Streams>) -> FirstBytes<S> {
        self.h2 = Some(streams);
        self
    }

    /// Whether the protocol is told yet.
    #[cfg(test)]
    fn decided(&self) -> bool {
        self.deciding.is_none()
    }
}

/// After `matched` bytes of the preface, `new` arrived: `true` once it is known whether
/// the connection speaks HTTP/2 by prior knowledge (the whole preface) or not (a byte off
/// it, or the end of the stream) — exactly when hyper-util's detection ends too.
fn tells(matched: &mut usize, new: &[u8]) -> bool {
    if new.is_empty() {
        return true;
    }
    let rest = &H2_PREFACE[*matched..];
    let n = new.len().min(rest.len());
    if new[..n] != rest[..n] {
        return true;
    }
    *matched += n;
    *matched == H2_PREFACE.len()
}

impl<S: AsyncRead + Unpin> AsyncRead for FirstBytes<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let Some((deadline, matched)) = this.deciding.as_mut() else {
            let Some(scan) = &mut this.scan else {
                return Pin::new(&mut this.io).poll_read(cx, buf);
            };
            let read = Pin::new(&mut this.io).poll_read(cx, buf);
            if let Poll::Ready(Ok(())) = read {
                scan.feed(&buf.filled()[before..]);
            }
            return read;
        };
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let new = &buf.filled()[before..];
                if tells(matched, new) {
                    if *matched == H2_PREFACE.len() {
                        if let Some(streams) = &this.h2 {
                            streams.set_h2();
                        }
                        this.scan = None;
                    }
                    this.deciding = None;
                }
                if let Some(scan) = &mut this.scan {
                    scan.feed(new);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match Pin::new(deadline).poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no request began within header_read_timeout",
                ))),
                Poll::Pending => Poll::Pending,
            },
            other => other,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FirstBytes<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_write(cx, buf);
        this.sent(cx, result)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.sent(cx, result)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // A TLS stream writes to the socket here.
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_flush(cx);
        this.sent(cx, result)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn the_protocol_is_told_where_hyper_util_tells_it() {
        for (parts, told_after) in [
            // HTTP/1: the first byte is off the preface.
            (&[&b"GET / HTTP/1.1\r\n"[..]][..], Some(0)),
            // POST: its P matches the preface's, its O does not.
            (&[&b"P"[..], b"OST /"][..], Some(1)),
            // The preface in pieces: told once all 24 bytes matched.
            (
                &[&b"PRI * HTTP/2.0\r\n"[..], b"\r\nSM\r\n\r\n"][..],
                Some(1),
            ),
            // Part of the preface and no more: undecided.
            (&[&b"PRI * HT"[..]][..], None),
            // The end of the stream tells (HTTP/1, which then sees the end).
            (&[&b"PRI"[..], b""][..], Some(1)),
        ] {
            let mut matched = 0;
            let told = parts.iter().position(|p| tells(&mut matched, p));
            assert_eq!(told, told_after, "{parts:?}");
        }
    }

    // Real time: `Deadline` keeps std's clock, which a paused tokio clock does not move.
    #[tokio::test]
    async fn a_client_that_stops_reading_fails_the_write_at_the_send_deadline() {
        let limit = Duration::from_secs(1);
        let (mut client, server) = tokio::io::duplex(1024);
        let mut io = FirstBytes::new(server, limit).send_timeout(limit);
        let chunk = [7u8; 512];
        // The pipe takes 1 KiB, then the client is not reading.
        io.write_all(&chunk).await.unwrap();
        io.write_all(&chunk).await.unwrap();
        // A read that comes within the limit lets the waiting write go on...
        let mut buf = [0u8; 512];
        let (w, r) = tokio::join!(io.write_all(&chunk), async {
            tokio::time::sleep(limit * 3 / 10).await;
            client.read_exact(&mut buf).await
        });
        w.unwrap();
        r.unwrap();
        // ...and the next stall gets the whole limit again: the write fails at it.
        let start = std::time::Instant::now();
        let err = io.write_all(&chunk).await.expect_err("nobody reads");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(start.elapsed() >= limit, "{:?}", start.elapsed());
        drop(client);
    }

    #[tokio::test(start_paused = true)]
    async fn silence_fails_the_read_at_the_deadline_and_bytes_in_time_do_not() {
        let (client, server) = tokio::io::duplex(64);
        let mut io = FirstBytes::new(server, Duration::from_millis(300));
        let mut buf = [0u8; 24];
        // Before the deadline the read just waits...
        let early = tokio::time::timeout(Duration::from_millis(200), io.read(&mut buf)).await;
        assert!(early.is_err(), "still waiting at 200 ms: {early:?}");
        // ...and at it, fails.
        let err = io.read(&mut buf).await.expect_err("nothing sent");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        drop(client);

        let (mut client, server) = tokio::io::duplex(64);
        let mut io = FirstBytes::new(server, Duration::from_millis(300));
        client.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        let n = io.read(&mut buf).await.expect("read");
        assert_eq!(&buf[..n], b"GET / HTTP/1.1\r\n");
        assert!(io.decided());
        // Decided: later reads wait as long as they must (hyper's own timeouts apply).
        tokio::time::advance(Duration::from_secs(3600)).await;
        client.write_all(b"Host: a\r\n").await.unwrap();
        let n = io.read(&mut buf).await.expect("read after an hour");
        assert_eq!(&buf[..n], b"Host: a\r\n");
    }
}
