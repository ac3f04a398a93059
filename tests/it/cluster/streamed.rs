//! A response body that streams across the end of an ownership (SPEC §3's second
//! invariant, SPEC §10), with real processes on loopback: fencegate instances, a
//! one-member etcd, and a recording backend that answers the head at once and streams
//! its body slowly, its write taking effect only once the whole body is sent (a write
//! that fails midway is recorded as aborted). The client of the older generation never
//! reads its response, so the proxy reads nothing more from the backend either: what
//! the backend sends piles up in the sockets' buffers, and only a cut of the upstream
//! connection stops it. In each case the older generation's write must end (aborted, as
//! the backend sees it) before the newer generation's request arrives:
//!
//! 1. **A join moves the shard** (`c` joins `a`): `a` hands the shard off, its drain
//!    bound passes with the body still streaming, `a` cuts it, and releases without the
//!    release marker, so `c` waits the full takeover wait before it admits.
//! 2. **A leave** (SIGTERM to `a`, `b` stays): the same hand-off, on the way out.
//! 3. **A lost owner** (`a` cut off from etcd, not paused): `a`'s self-fencing deadline
//!    cuts the body; `b` takes over after the lease expires and the takeover wait.
//!
//! Each older client sees its response cut: the head (200), then the connection closes
//! before the chunked body's end (HTTP/1.1), or its stream reset (HTTP/2, a client that
//! reads along, in case 3).
//!
//! 4. **A body that ends in time** is the client's whole, and lets its shard go: a join
//!    right after it hands the shard off drained, with no cut and no wait.
#![cfg(feature = "etcd")]

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Frame;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

use super::faults::{cluster_dir, exit_within, owned_by, relay, report_in, shard_of_report};
use super::procs::{Instance, SHARDS, settled};
use crate::support::etcd::EtcdCluster;
use crate::support::{self, Proc};

/// How long the older generation's response body streams: past the drain bound (4 s
/// here: drain 2 s + upstream timeout 1 s + settle 0 + 1 s) plus the takeover wait
/// (ttl 2 s + upstream timeout 1 s), so that a body not cut would still be at the
/// backend when the next owner admits.
const STREAM: Duration = Duration::from_secs(12);
/// One chunk of the streamed body every this long.
const CHUNK_EVERY: Duration = Duration::from_millis(100);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum What {
    Arrived,
    /// The whole body was handed over: the write took effect.
    Completed,
    /// Sending the body failed midway (the connection closed): no effect.
    Aborted,
}

#[derive(Debug, Clone)]
struct Event {
    at: Instant,
    token: String,
    what: What,
}

/// The recording backend (see the module doc). `x-test-stream-ms: N` streams the body
/// for N ms; without it the body is one chunk.
#[derive(Clone)]
struct Recorder {
    addr: SocketAddr,
    events: Arc<Mutex<Vec<Event>>>,
}

/// A response body fed by a channel, one chunk at a time.
struct Chunks(mpsc::Receiver<Bytes>);

impl http_body::Body for Chunks {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.get_mut()
            .0
            .poll_recv(cx)
            .map(|c| c.map(|b| Ok(Frame::data(b))))
    }
}

impl Recorder {
    async fn start() -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let recorder = Recorder {
            addr: listener.local_addr().expect("addr"),
            events: Arc::default(),
        };
        let r = recorder.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let r = r.clone();
                let svc = service_fn(move |req| {
                    let r = r.clone();
                    async move { r.serve(req).await }
                });
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        recorder
    }

    fn record(&self, token: &str, what: What) {
        self.events.lock().unwrap().push(Event {
            at: Instant::now(),
            token: token.to_string(),
            what,
        });
    }

    async fn serve(
        &self,
        req: Request<Incoming>,
    ) -> Result<Response<Chunks>, std::convert::Infallible> {
        let (parts, body) = req.into_parts();
        let _ = body.collect().await;
        let token = parts
            .headers
            .get("fencing-token")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_string();
        let stream = parts
            .headers
            .get("x-test-stream-ms")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .map(Duration::from_millis);
        self.record(&token, What::Arrived);
        let (tx, rx) = mpsc::channel(1);
        let r = self.clone();
        tokio::spawn(async move {
            let chunks = stream.map_or(1, |d| (d.as_millis() / CHUNK_EVERY.as_millis()).max(1));
            for i in 0..chunks {
                if i > 0 {
                    tokio::time::sleep(CHUNK_EVERY).await;
                }
                if tx.send(Bytes::from(vec![b'x'; 100])).await.is_err() {
                    r.record(&token, What::Aborted);
                    return;
                }
            }
            r.record(&token, What::Completed);
        });
        Ok(Response::new(Chunks(rx)))
    }

    fn events(&self) -> Vec<Event> {
        self.events.lock().unwrap().clone()
    }

    fn first(&self, token: &str, what: What) -> Option<Instant> {
        self.events()
            .iter()
            .find(|e| e.token == token && e.what == what)
            .map(|e| e.at)
    }

    /// Waits (bounded) until `token` arrived.
    async fn arrived(&self, token: &str) -> Instant {
        let until = Instant::now() + support::BOUND;
        loop {
            if let Some(at) = self.first(token, What::Arrived) {
                return at;
            }
            assert!(Instant::now() < until, "token {token} never arrived");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits (bounded) until `token`'s write ended, completed or aborted.
    async fn ended(&self, token: &str) -> Event {
        let until = Instant::now() + STREAM + support::BOUND;
        loop {
            if let Some(e) = self
                .events()
                .into_iter()
                .find(|e| e.token == token && e.what != What::Arrived)
            {
                return e;
            }
            assert!(Instant::now() < until, "token {token}'s write never ended");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Sends a PUT with `token` whose response streams for [`STREAM`], and reads nothing.
async fn streamed_put(port: u16, path: &str, token: &str) -> TcpStream {
    put_streaming(port, path, token, STREAM).await
}

/// Sends a PUT with `token` whose response streams for `stream` (the connection closes
/// after the response).
async fn put_streaming(port: u16, path: &str, token: &str, stream: Duration) -> TcpStream {
    let mut raw = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    raw.write_all(
        format!(
            "PUT {path} HTTP/1.1\r\nhost: fencegate\r\nfencing-token: {token}\r\nx-test-stream-ms: {}\r\nconnection: close\r\ncontent-length: 1\r\n\r\nx",
            stream.as_millis()
        )
        .as_bytes(),
    )
    .await
    .expect("request");
    raw
}

/// Reads what the older client got, to the connection's end (bounded).
async fn answer_of(mut raw: TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let until = Instant::now() + support::BOUND;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, raw.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => panic!("the older client's connection stayed open"),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// PUTs `token` through `via` until it is accepted (bounded); only 503 (no one may admit
/// yet) and 502-504 (a hop to an owner that is leaving or cut off) are allowed before.
async fn accepted(via: &Instance, path: &str, token: &str) {
    let until = Instant::now() + support::BOUND;
    loop {
        let resp = via.client().put(path, token, "newer").await;
        if resp.status < 300 {
            return;
        }
        assert!(
            resp.status == 503 || (502..=504).contains(&resp.status),
            "{}: {}",
            resp.status,
            resp.body
        );
        assert!(Instant::now() < until, "{token} never accepted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The older generation's write ended, aborted, before the newer one arrived; its client
/// saw the head and a body cut short. Answers how long before the newer arrival it ended.
async fn check(recorder: &Recorder, older: &str, newer: &str, answer: Option<&str>) -> Duration {
    let newer_at = recorder.arrived(newer).await;
    let older_end = recorder.ended(older).await;
    let events = recorder.events();
    assert_eq!(
        older_end.what,
        What::Aborted,
        "token {older}'s write was not cut: {events:?}"
    );
    assert!(
        older_end.at < newer_at,
        "token {older}'s write ended {:?} after {newer} arrived: {events:?}",
        older_end.at - newer_at
    );
    // Nothing of the older generation after the newer one's arrival.
    assert!(
        events
            .iter()
            .filter(|e| e.token == older)
            .all(|e| e.at < newer_at),
        "{events:?}"
    );
    if let Some(answer) = answer {
        assert_eq!(
            support::status_of(answer),
            200,
            "the head went out: {answer}"
        );
        assert!(
            answer
                .to_ascii_lowercase()
                .contains("transfer-encoding: chunked")
                && !answer.ends_with("0\r\n\r\n"),
            "the older client's body is cut short, never complete: {answer:?}"
        );
    }
    newer_at - older_end.at
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_cuts_a_streamed_response_before_the_new_owner_admits() {
    let started = Instant::now();
    let etcd = EtcdCluster::start(1).await;
    let recorder = Recorder::start().await;
    let dir = cluster_dir();
    let a = Instance::new(dir.path(), "a", recorder.addr, &etcd);
    let c = Instance::new(dir.path(), "c", recorder.addr, &etcd);
    let _pa = a.spawn();
    settled(&[&a]).await;
    // A scope whose shard the balance gives to c once it joins.
    let given = fencegate::cluster::balance::assignment(&["a", "c"], SHARDS as u32);
    let to_c: Vec<u32> = (0..SHARDS as u32)
        .filter(|s| given[*s as usize] == 1)
        .collect();
    let report = report_in(&to_c);
    let path = format!("/reports/{report}/obj");

    let raw = streamed_put(a.proxy, &path, "5").await;
    let five = recorder.arrived("5").await;
    let _pc = c.spawn();
    accepted(&c, &path, "7").await;
    let answer = answer_of(raw).await;
    let margin = check(&recorder, "5", "7", Some(&answer)).await;

    let metrics = a.metrics().await;
    let cut = support::metric(
        &metrics,
        "fencegate_cluster_exchanges_cut_total{reason=\"handoff\"}",
    );
    assert!(cut.is_some_and(|v| v >= 1.0), "{metrics}");
    assert!(
        support::metric(&metrics, "fencegate_cluster_handoff_drain_timeouts_total")
            .is_some_and(|v| v >= 1.0),
        "{metrics}"
    );
    // c claimed the shard released undrained: a takeover, with its wait.
    let takeovers = c.status().await["stats"]["takeovers"].as_u64();
    assert!(takeovers.is_some_and(|t| t >= 1), "{takeovers:?}");
    println!(
        "join: token 5 cut {:?} after it arrived, {margin:?} before 7 arrived; test took {:?}",
        recorder.ended("5").await.at - five,
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leave_cuts_a_streamed_response_before_the_next_owner_admits() {
    let started = Instant::now();
    let etcd = EtcdCluster::start(1).await;
    let recorder = Recorder::start().await;
    let dir = cluster_dir();
    let a = Instance::new(dir.path(), "a", recorder.addr, &etcd);
    let b = Instance::new(dir.path(), "b", recorder.addr, &etcd);
    let mut pa = a.spawn();
    let _pb = b.spawn();
    settled(&[&a, &b]).await;
    let report = report_in(&owned_by(&a).await);
    let path = format!("/reports/{report}/obj");

    let raw = streamed_put(a.proxy, &path, "5").await;
    let five = recorder.arrived("5").await;
    support::signal(pa.child.id(), "TERM");
    accepted(&b, &path, "7").await;
    let answer = answer_of(raw).await;
    let margin = check(&recorder, "5", "7", Some(&answer)).await;
    let exit = exit_within(&mut pa.child, support::BOUND).await;
    assert_eq!(exit, Some(0), "a left and exited");
    let takeovers = b.status().await["stats"]["takeovers"].as_u64();
    assert!(takeovers.is_some_and(|t| t >= 1), "{takeovers:?}");
    println!(
        "leave: token 5 cut {:?} after it arrived, {margin:?} before 7 arrived; test took {:?}",
        recorder.ended("5").await.at - five,
        started.elapsed()
    );
}

/// How the older client of the lost-owner case speaks and reads.
enum Older {
    /// HTTP/1.1, reading nothing until the end.
    Silent(TcpStream),
    /// HTTP/2, reading along: how many body bytes came, and whether the body failed.
    ReadingH2(tokio::task::JoinHandle<(usize, bool)>),
}

async fn h2_streamed_put(port: u16, path: &str, token: &str) -> Older {
    let stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(stream),
    )
    .await
    .expect("h2 handshake");
    tokio::spawn(conn);
    let req = Request::put(format!("http://127.0.0.1:{port}{path}"))
        .header("fencing-token", token)
        .header("x-test-stream-ms", STREAM.as_millis().to_string())
        .body(http_body_util::Full::new(Bytes::from_static(b"x")))
        .expect("request");
    Older::ReadingH2(tokio::spawn(async move {
        let resp = send.send_request(req).await.expect("head");
        assert_eq!(resp.status(), 200);
        let mut body = resp.into_body();
        let mut read = 0;
        let until = Instant::now() + STREAM + support::BOUND;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, body.frame()).await {
                Ok(Some(Ok(f))) => read += f.data_ref().map_or(0, |d| d.len()),
                Ok(Some(Err(_))) => return (read, true),
                Ok(None) => return (read, false),
                Err(_) => panic!("the older body neither ended nor failed"),
            }
        }
    }))
}

async fn lost_owner(h2: bool) {
    let started = Instant::now();
    let etcd = EtcdCluster::start(1).await;
    let recorder = Recorder::start().await;
    let dir = cluster_dir();
    let (cut_tx, cut_rx) = watch::channel(false);
    let mut relays = Vec::new();
    for member in etcd.endpoints() {
        relays.push(relay(member, cut_rx.clone()).await);
    }
    // a reaches etcd only through the relays; b directly.
    let a = Instance::with_endpoints(dir.path(), "a", recorder.addr, &relays);
    let b = Instance::new(dir.path(), "b", recorder.addr, &etcd);
    let _pa: Proc = a.spawn();
    let _pb = b.spawn();
    settled(&[&a, &b]).await;
    let report = report_in(&owned_by(&a).await);
    let shard = shard_of_report(&report);
    let path = format!("/reports/{report}/obj");

    let older = if h2 {
        h2_streamed_put(a.proxy, &path, "5").await
    } else {
        Older::Silent(streamed_put(a.proxy, &path, "5").await)
    };
    let five = recorder.arrived("5").await;
    cut_tx.send_replace(true);
    let cut = Instant::now();
    // b takes the shard over once a's lease expired and the takeover wait is over.
    let until = Instant::now() + support::BOUND;
    while !owned_by(&b).await.contains(&shard) {
        assert!(Instant::now() < until, "b never took shard {shard} over");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    accepted(&b, &path, "6").await;
    let margin = match older {
        Older::Silent(raw) => {
            let answer = answer_of(raw).await;
            check(&recorder, "5", "6", Some(&answer)).await
        }
        Older::ReadingH2(reader) => {
            let (read, failed) = reader.await.expect("reader");
            assert!(
                read > 0 && failed,
                "the stream is reset mid-body: {read} bytes, failed {failed}"
            );
            check(&recorder, "5", "6", None).await
        }
    };
    let ended = recorder.ended("5").await.at;
    // By a's self-fencing deadline: at most one ttl after its last keep-alive before the
    // cut (with room for scheduling).
    assert!(
        ended.saturating_duration_since(cut) <= super::procs::TTL + Duration::from_millis(700),
        "cut {:?} after a lost etcd",
        ended.saturating_duration_since(cut)
    );
    let metrics = a.metrics().await;
    assert!(
        support::metric(
            &metrics,
            "fencegate_cluster_exchanges_cut_total{reason=\"ownership\"}"
        )
        .is_some_and(|v| v >= 1.0),
        "{metrics}"
    );
    println!(
        "lost owner (h2 {h2}): token 5 cut {:?} after it arrived ({:?} after etcd was cut off), {margin:?} before 6 arrived; test took {:?}",
        ended - five,
        ended.saturating_duration_since(cut),
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_owner_cuts_its_streamed_response_at_its_deadline() {
    lost_owner(false).await;
}

/// The same over HTTP/2, with a client that reads along: its stream is reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_owner_resets_an_http2_stream_mid_body_at_its_deadline() {
    lost_owner(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_response_that_ends_in_time_is_whole_and_its_shard_moves_without_a_wait() {
    let started = Instant::now();
    let etcd = EtcdCluster::start(1).await;
    let recorder = Recorder::start().await;
    let dir = cluster_dir();
    let a = Instance::new(dir.path(), "a", recorder.addr, &etcd);
    let c = Instance::new(dir.path(), "c", recorder.addr, &etcd);
    let _pa = a.spawn();
    settled(&[&a]).await;
    let given = fencegate::cluster::balance::assignment(&["a", "c"], SHARDS as u32);
    let to_c: Vec<u32> = (0..SHARDS as u32)
        .filter(|s| given[*s as usize] == 1)
        .collect();
    let report = report_in(&to_c);
    let path = format!("/reports/{report}/obj");

    // Read as it comes: the whole body, to its chunked end.
    let raw = put_streaming(a.proxy, &path, "5", Duration::from_secs(1)).await;
    let answer = answer_of(raw).await;
    assert_eq!(support::status_of(&answer), 200, "{answer}");
    assert!(answer.ends_with("0\r\n\r\n"), "whole: {answer:?}");
    assert_eq!(recorder.ended("5").await.what, What::Completed);

    // The exchange is over: the join's hand-off drains at once, without a cut.
    let _pc = c.spawn();
    accepted(&c, &path, "7").await;
    let metrics = a.metrics().await;
    for series in [
        "fencegate_cluster_exchanges_cut_total{reason=\"handoff\"}",
        "fencegate_cluster_exchanges_cut_total{reason=\"ownership\"}",
        "fencegate_cluster_handoff_drain_timeouts_total",
    ] {
        assert_eq!(support::metric(&metrics, series), Some(0.0), "{series}");
    }
    let takeovers = c.status().await["stats"]["takeovers"].as_u64();
    assert_eq!(
        takeovers,
        Some(0),
        "no takeover wait after a drained hand-off"
    );
    println!("a body in time: whole; test took {:?}", started.elapsed());
}
