//! Bodies are streamed both ways, never buffered: 1 GiB goes up and 1 GiB comes back
//! through the real binary while its peak RSS stays small.

use crate::support;

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Frame;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use support::{BOUND, peak_rss, spawn, write_config};
use tokio::net::TcpListener;

const CHUNK: usize = 1 << 20;
const CHUNKS: usize = 1024; // 1 GiB

/// A body of `left` chunks of zeros, generated as it is read.
struct Zeros {
    left: usize,
    chunk: Bytes,
}

impl Zeros {
    fn new(chunks: usize) -> Zeros {
        Zeros {
            left: chunks,
            chunk: Bytes::from(vec![0u8; CHUNK]),
        }
    }
}

impl http_body::Body for Zeros {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        self.left -= 1;
        Poll::Ready(Some(Ok(Frame::data(self.chunk.clone()))))
    }
}

/// Counts and discards the request body; answers with 1 GiB of zeros on GET.
async fn sink(
    req: Request<Incoming>,
) -> Result<Response<http_body_util::combinators::BoxBody<Bytes, Infallible>>, Infallible> {
    if req.method() == http::Method::GET {
        return Ok(Response::new(Zeros::new(CHUNKS).boxed()));
    }
    let mut body = req.into_body();
    let mut n = 0usize;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => n += f.data_ref().map_or(0, |d| d.len()),
            Err(_) => break,
        }
    }
    let reply = http_body_util::Full::new(Bytes::from(n.to_string()));
    Ok(Response::new(reply.boxed()))
}

/// An upstream serving [`sink`] on loopback.
async fn start_sink() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), service_fn(sink))
                    .await;
            });
        }
    });
    upstream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_gib_each_way_is_streamed() {
    let upstream = start_sink().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = write_config(dir.path(), upstream);
    let mut proc = spawn(&config, p, a);
    let before = peak_rss(proc.child.id());

    let stream = tokio::net::TcpStream::connect(proc.proxy).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = Request::put("/reports/big/blob")
        .header("host", "localhost")
        .header("fencing-token", "1")
        .body(Zeros::new(CHUNKS))
        .unwrap();
    let resp = tokio::time::timeout(BOUND * 6, send.send_request(req))
        .await
        .expect("upload within bound")
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        body,
        (CHUNK * CHUNKS).to_string(),
        "every byte reached the upstream"
    );

    let req = Request::get("/reports/big/blob")
        .header("host", "localhost")
        .header("fencing-token", "1")
        .body(Zeros::new(0))
        .unwrap();
    // The connection takes the next request only once it has finished the last one:
    // a request sent before that is refused with "connection was not ready".
    send.ready()
        .await
        .expect("connection kept alive for the next request");
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut n = 0usize;
    while let Some(frame) = tokio::time::timeout(BOUND, body.frame()).await.unwrap() {
        n += frame.unwrap().data_ref().map_or(0, |d| d.len());
    }
    assert_eq!(n, CHUNK * CHUNKS);

    let peak = peak_rss(proc.child.id());
    eprintln!(
        "fencegate peak RSS: {} MiB at start, {} MiB after 2 GiB streamed",
        before >> 20,
        peak >> 20
    );
    assert!(
        peak < 64 << 20,
        "peak RSS {} MiB: bodies were buffered",
        peak >> 20
    );
    proc.child.kill().unwrap();
    proc.child.wait().unwrap();
}

/// The old owner that fencing exists for: it reads the head of a large fenced response,
/// then pauses with its connection open. The upstream has answered; only delivery is
/// left. Its generation lets go once the body has made no progress for the upstream's
/// timeout, and the new owner's write goes through instead of draining until the old
/// owner wakes up or hangs up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_reader_does_not_hold_up_the_next_generation() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let upstream = start_sink().await;
    let dir = tempfile::tempdir().unwrap();
    let text = support::config_text(upstream, "5s", "0s", "300ms");
    let config = fencegate::settings::Config::parse(&text, dir.path()).unwrap();
    let proxy = support::start(config).await;

    let mut paused = tokio::net::TcpStream::connect(proxy.proxy_addr)
        .await
        .unwrap();
    paused
        .write_all(b"GET /reports/p/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\n\r\n")
        .await
        .unwrap();
    let mut head = [0u8; 12];
    tokio::time::timeout(BOUND, paused.read_exact(&mut head))
        .await
        .expect("head within bound")
        .unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    // From here on it reads nothing (1 GiB is on its way; the buffers fill).

    let client = support::Client::new(proxy.proxy_addr);
    let resp = client.put("/reports/p/x", "2", "newer").await;
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.result(), "accepted");
    drop(paused);
}
