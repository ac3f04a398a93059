//! The upstream connection pool against a scripted upstream: connections are reused,
//! and never reused when that would be wrong — closed by the upstream while idle, closed
//! by `Connection: close`, or left with an unread body by a client that went away.

use crate::support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use fencegate::settings::Config;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

use support::BOUND;

/// What the upstream did, in order: (connection number, request path).
#[derive(Default)]
struct Log {
    accepted: usize,
    requests: Vec<(usize, String)>,
}

/// An upstream whose answer depends on the path's first segment:
/// `keep` (200 "ok", keep-alive), `close-after` (200 "ok", then closes the idle
/// connection and says so), `conn-close` (200 "ok" with `Connection: close`),
/// `big` (200 with an 8 MiB body), `chunked` (a chunked body with a trailer), `continue`
/// (100 Continue, then 201), `eof` (no length: the body ends with the connection),
/// `extra` (bytes after the body), and heads a proxy must not pass on as they are:
/// `te-and-length`, `gzip`, `lengths`, `conflict`, `switch`, `listed`.
struct Upstream {
    addr: SocketAddr,
    log: Arc<Mutex<Log>>,
    closed: Arc<Notify>,
}

impl Upstream {
    async fn start() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let log = Arc::new(Mutex::new(Log::default()));
        let closed = Arc::new(Notify::new());
        let (l, c) = (log.clone(), closed.clone());
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let n = {
                    let mut log = l.lock().expect("log");
                    log.accepted += 1;
                    log.accepted
                };
                tokio::spawn(serve(stream, n, l.clone(), c.clone()));
            }
        });
        Upstream { addr, log, closed }
    }

    fn accepted(&self) -> usize {
        self.log.lock().expect("log").accepted
    }

    fn requests(&self) -> Vec<(usize, String)> {
        self.log.lock().expect("log").requests.clone()
    }
}

async fn serve(mut s: TcpStream, conn: usize, log: Arc<Mutex<Log>>, closed: Arc<Notify>) {
    let mut buf = Vec::new();
    // `drop-next` answers, then closes the connection on its next request without a word
    // (a keep-alive timeout that races the proxy's reuse of the connection).
    let mut drop_next = false;
    loop {
        // One request head (and a Content-Length body, if any).
        let end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        let length: usize = head
            .lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.trim().parse().ok())
            .unwrap_or(0);
        while buf.len() < end + length {
            let mut chunk = [0u8; 4096];
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        buf.drain(..end + length);
        let path = head.split_whitespace().nth(1).unwrap_or("").to_string();
        log.lock().expect("log").requests.push((conn, path.clone()));
        if drop_next {
            return;
        }
        let kind = path.trim_start_matches('/').split('/').next().unwrap_or("");
        drop_next = kind == "drop-next";
        match kind {
            "big" => {
                let body = vec![b'b'; 8 << 20];
                let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
                if s.write_all(head.as_bytes()).await.is_err() || s.write_all(&body).await.is_err()
                {
                    return;
                }
            }
            // Chunked, in pieces, with extensions and a trailer.
            "chunked" => {
                for piece in [&b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc"[..], b"\r\n2\r\nde\r", b"\n0\r\nX-Trailer: 1\r\n\r\n"] {
                    if s.write_all(piece).await.is_err() {
                        return;
                    }
                }
            }
            // An upstream that claims a fencing result of its own.
            "claims" => {
                if s
                    .write_all(b"HTTP/1.1 200 OK\r\nFencing-Result: accepted\r\nContent-Length: 2\r\n\r\nok")
                    .await
                    .is_err()
                {
                    return;
                }
            }
            // An interim answer, then the final one.
            "continue" => {
                if s
                    .write_all(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 7\r\n\r\ncreated")
                    .await
                    .is_err()
                {
                    return;
                }
            }
            // No length: the body ends with the connection.
            "eof" => {
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\nuntil the end").await;
                return;
            }
            // A length and then more than that: the rest is not the next answer.
            "extra" => {
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n\r\n")
                    .await;
            }
            // A length beside chunked, and wrong: the body is the chunked one.
            "te-and-length" => {
                if s
                    .write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\nb\r\nhello world\r\n0\r\n\r\n")
                    .await
                    .is_err()
                {
                    return;
                }
            }
            // A transfer coding other than chunked: the body up to the end of the stream.
            "gzip" => {
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n\x1f\x8bcompressed")
                    .await;
                return;
            }
            // One length, said three times.
            "lengths" => {
                if s
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\nContent-Length: 2\r\n\r\nok")
                    .await
                    .is_err()
                {
                    return;
                }
            }
            "conflict" => {
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok!")
                    .await;
                return;
            }
            // An upgrade nobody asked for.
            "switch" => {
                let _ = s
                    .write_all(b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n")
                    .await;
                return;
            }
            // `Connection` lists a header beside an element that is not ASCII.
            "listed" => {
                if s
                    .write_all(b"HTTP/1.1 200 OK\r\nConnection: x-secret, \xff\r\nX-Secret: s3cr3t\r\nContent-Length: 2\r\n\r\nok")
                    .await
                    .is_err()
                {
                    return;
                }
            }
            "conn-close" => {
                let _ = s
                    .write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
                    )
                    .await;
                return;
            }
            // Bodiless answers with lengths: repeated, conflicting, and on a 204.
            "head-lengths" => {
                if s
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\nContent-Length: 5\r\n\r\n")
                    .await
                    .is_err()
                {
                    return;
                }
            }
            "head-conflict" => {
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n")
                    .await;
                return;
            }
            "no-content" => {
                if s
                    .write_all(b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n")
                    .await
                    .is_err()
                {
                    return;
                }
            }
            // A HEAD's answer: the length the body would have, and no body.
            _ if head.starts_with("HEAD ") => {
                if s
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")
                    .await
                    .is_err()
                {
                    return;
                }
            }
            _ => {
                if s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    .await
                    .is_err()
                {
                    return;
                }
                if kind == "close-after" {
                    let _ = s.shutdown().await;
                    drop(s);
                    closed.notify_one();
                    return;
                }
            }
        }
    }
}

/// The `Content-Length` values of an answer, in order.
fn lengths(r: &support::Resp) -> Vec<String> {
    r.headers
        .get_all("content-length")
        .iter()
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .collect()
}

fn config(upstream: SocketAddr, dir: &std::path::Path) -> Config {
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
workers = 1
[admin]
listen = "127.0.0.1:0"
[store]
path = "marks.redb"
[fencing]
settle = "0s"
[[upstream]]
name = "u"
url = "http://{upstream}"
timeout = "10s"
[[route]]
name = "all"
path = "/{{kind}}/{{name}}"
scope = "obj/{{name}}"
upstream = "u"
"#
    );
    Config::parse(&text, dir).expect("config")
}

async fn setup() -> (
    Upstream,
    fencegate::app::Running,
    support::Client,
    tempfile::TempDir,
) {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let running = support::start(config(upstream.addr, dir.path())).await;
    let client = support::Client::new(running.proxy_addr);
    (upstream, running, client, dir)
}

#[tokio::test]
async fn an_idle_connection_is_reused() {
    let (upstream, running, client, _dir) = setup().await;
    for (i, token) in ["1", "1", "2"].iter().enumerate() {
        let r = client.put(&format!("/keep/a{i}"), token, "x").await;
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.body, "ok");
    }
    assert_eq!(upstream.accepted(), 1, "{:?}", upstream.requests());
    running.shutdown().await;
}

#[tokio::test]
async fn a_connection_the_upstream_closed_while_idle_is_not_an_error() {
    let (upstream, running, client, _dir) = setup().await;
    let closed = upstream.closed.notified();
    let r = client.put("/close-after/a", "1", "x").await;
    assert_eq!(r.status, 200, "{r:?}");
    tokio::time::timeout(BOUND, closed)
        .await
        .expect("the upstream closed its end");
    // The pooled connection is dead; the request goes out once, on a new connection.
    let r = client.put("/keep/a", "1", "y").await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.result(), "accepted");
    assert_eq!(
        upstream.requests(),
        vec![
            (1, "/close-after/a".to_string()),
            (2, "/keep/a".to_string())
        ]
    );
    running.shutdown().await;
}

#[tokio::test]
async fn connection_close_is_honoured() {
    let (upstream, running, client, _dir) = setup().await;
    let r = client.put("/conn-close/a", "1", "x").await;
    assert_eq!((r.status, r.body.as_str()), (200, "ok"));
    let r = client.put("/keep/a", "1", "y").await;
    assert_eq!((r.status, r.body.as_str()), (200, "ok"));
    assert_eq!(
        upstream.requests(),
        vec![(1, "/conn-close/a".to_string()), (2, "/keep/a".to_string())]
    );
    running.shutdown().await;
}

#[tokio::test]
async fn a_connection_with_an_unread_body_is_not_reused() {
    let (upstream, running, client, _dir) = setup().await;
    // A client asks for a big body, reads the head and part of the body, and goes away.
    let mut s = TcpStream::connect(running.proxy_addr)
        .await
        .expect("connect");
    s.write_all(b"GET /big/a HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let mut got = vec![0u8; 64 << 10];
    let n = tokio::time::timeout(BOUND, s.read(&mut got))
        .await
        .expect("head within bound")
        .expect("read");
    assert!(String::from_utf8_lossy(&got[..n]).starts_with("HTTP/1.1 200"));
    drop(s);
    // The next request gets its own answer, whole, from a connection in a clean state.
    for i in 0..3 {
        let r = client.put(&format!("/keep/b{i}"), "1", "y").await;
        assert_eq!((r.status, r.body.as_str()), (200, "ok"), "{r:?}");
    }
    let requests = upstream.requests();
    assert_eq!(requests[0], (1, "/big/a".to_string()));
    assert!(
        requests[1..].iter().all(|(conn, _)| *conn != 1),
        "the connection with 8 MiB unread was reused: {requests:?}"
    );
    running.shutdown().await;
}

/// The pool on its own: a connection back from a finished exchange waits idle, is reused,
/// and once past the idle timeout a sweep closes it.
#[tokio::test]
async fn idle_connections_past_the_timeout_are_closed() {
    use fencegate::proxy::upstream::StreamedPool as Pool;
    use http_body_util::BodyExt;
    use std::time::Duration;

    let upstream = Upstream::start().await;
    let timeout = Duration::from_millis(50);
    let pool = Pool::new(8, timeout, Duration::from_secs(5));
    let authority: http::uri::Authority = upstream.addr.to_string().parse().unwrap();
    for i in 0..2 {
        let req = http::Request::builder()
            .uri(format!("/keep/p{i}"))
            .body(
                http_body_util::Empty::<bytes::Bytes>::new()
                    .map_err(|e| match e {})
                    .boxed(),
            )
            .unwrap();
        let resp = tokio::time::timeout(
            BOUND,
            pool.send(
                Some(&authority),
                req,
                Duration::from_secs(10),
                std::time::Instant::now() + BOUND,
            ),
        )
        .await
        .expect("answer within bound")
        .expect("answer");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"ok");
        assert_eq!(pool.idle(), 1);
    }
    assert_eq!(upstream.accepted(), 1);
    pool.sweep();
    assert_eq!(pool.idle(), 1, "not idle for long enough yet");
    // The pool's clock is its sweeps: 50 ms is one sweep period's worth (rounded up), so
    // the next sweep closes it, with no waiting.
    pool.sweep();
    assert_eq!(pool.idle(), 0);
}

/// Response framing (RFC 9112 §6.3) as the upstream chooses it: each body arrives whole
/// and alone, and a connection is reused only after a body that ended at a known
/// boundary with nothing after it.
#[tokio::test]
async fn every_framing_arrives_whole_and_reuse_follows_it() {
    let (upstream, running, client, _dir) = setup().await;
    for (path, status, body) in [
        ("/chunked/a", 200, "abcde"),
        ("/chunked/b", 200, "abcde"),
        ("/continue/c", 201, "created"),
        ("/eof/d", 200, "until the end"),
        ("/keep/e", 200, "ok"),
        ("/extra/f", 200, "ok"),
        ("/keep/g", 200, "ok"),
    ] {
        let r = tokio::time::timeout(BOUND, client.put(path, "1", "x"))
            .await
            .unwrap_or_else(|_| panic!("{path}: no answer within bound"));
        assert_eq!((r.status, r.body.as_str()), (status, body), "{path}: {r:?}");
        assert_eq!(r.result(), "accepted");
    }
    let head = tokio::time::timeout(
        BOUND,
        client.send("HEAD", "/keep/h", &[("fencing-token", "1")], ""),
    )
    .await
    .expect("HEAD answered within bound");
    assert_eq!((head.status, head.body.as_str()), (200, ""));
    let r = tokio::time::timeout(BOUND, client.put("/keep/i", "1", "x"))
        .await
        .expect("answered within bound");
    assert_eq!((r.status, r.body.as_str()), (200, "ok"));
    assert_eq!(
        upstream.requests(),
        vec![
            // The chunked body ended at its boundary: reused for the next two answers.
            (1, "/chunked/a".to_string()),
            (1, "/chunked/b".to_string()),
            (1, "/continue/c".to_string()),
            // Read to the end of the stream: that connection is gone.
            (1, "/eof/d".to_string()),
            (2, "/keep/e".to_string()),
            // Bytes after the body: never reused.
            (2, "/extra/f".to_string()),
            (3, "/keep/g".to_string()),
            // A HEAD's answer has no body, whatever its length says: reused.
            (3, "/keep/h".to_string()),
            (3, "/keep/i".to_string()),
        ]
    );
    running.shutdown().await;
}

/// Framing headers the client must not see as the upstream sent them (RFC 9112 §6.3),
/// answered to a request that took the lean exchange (a small body) and to one whose
/// body streamed through hyper's client (over 64 KiB): both get the same answer. A length
/// beside chunked goes and the whole body arrives (not the length's worth of it); one
/// length said three times is said once; a coding other than chunked, conflicting
/// lengths and an upgrade nobody asked for are refused as a failed exchange; every name
/// `Connection` lists is stripped, whatever else it lists.
#[tokio::test]
async fn framing_headers_are_checked_whichever_way_the_request_went() {
    let (upstream, running, client, _dir) = setup().await;
    let big = "s".repeat(70 * 1024);
    for (how, body) in [("lean", "x"), ("streamed", big.as_str())] {
        let put = |kind: &str| {
            let path = format!("/{kind}/{how}");
            let client = client.clone();
            async move {
                tokio::time::timeout(BOUND, client.put(&path, "1", body))
                    .await
                    .unwrap_or_else(|_| panic!("{path}: no answer within bound"))
            }
        };

        let r = put("te-and-length").await;
        assert_eq!(
            (r.status, r.result(), r.body.as_str()),
            (200, "accepted", "hello world"),
            "{how}: {r:?}"
        );
        assert!(
            lengths(&r).iter().all(|l| l == "11"),
            "{how}: {:?}",
            lengths(&r)
        );
        // A message to be wary of: its connection carries nothing more.
        let r = put("keep").await;
        assert_eq!((r.status, r.body.as_str()), (200, "ok"), "{how}: {r:?}");
        let conn_of = |path: String| {
            upstream
                .requests()
                .into_iter()
                .find(|(_, p)| *p == path)
                .map(|(conn, _)| conn)
        };
        assert_ne!(
            conn_of(format!("/te-and-length/{how}")),
            conn_of(format!("/keep/{how}")),
            "{how}: reused after a length beside chunked"
        );

        let r = put("lengths").await;
        assert_eq!(
            (r.status, r.result(), r.body.as_str()),
            (200, "accepted", "ok"),
            "{how}: {r:?}"
        );
        assert_eq!(lengths(&r), ["2"], "{how}");

        for kind in ["gzip", "conflict", "switch"] {
            let r = put(kind).await;
            assert_eq!(
                (r.status, r.result()),
                (504, "upstream_timeout"),
                "{how} {kind}: {r:?}"
            );
            assert_eq!(
                r.headers.get("content-type").map(|v| v.as_bytes()),
                Some(&b"application/problem+json"[..]),
                "{how} {kind}"
            );
        }

        let r = put("listed").await;
        assert_eq!(
            (r.status, r.result(), r.body.as_str()),
            (200, "accepted", "ok"),
            "{how}: {r:?}"
        );
        assert!(r.headers.get("x-secret").is_none(), "{how}: {r:?}");
        assert!(r.headers.get("connection").is_none(), "{how}: {r:?}");
    }
    running.shutdown().await;
}

/// A bodiless answer's length is checked as any length is: a repeated one is passed on
/// once, conflicting ones are refused (the client got a closed connection and no answer
/// at all before: its side of the proxy could not send such a head), and a 204 loses its
/// length (RFC 9110 §8.6).
#[tokio::test]
async fn lengths_on_bodiless_answers_are_checked() {
    let (_upstream, running, client, _dir) = setup().await;
    let head = |path: &str| {
        let (client, path) = (client.clone(), path.to_string());
        async move {
            tokio::time::timeout(
                BOUND,
                client.send("HEAD", &path, &[("fencing-token", "1")], ""),
            )
            .await
            .unwrap_or_else(|_| panic!("{path}: no answer within bound"))
        }
    };
    let r = head("/head-lengths/a").await;
    assert_eq!((r.status, r.result()), (200, "accepted"), "{r:?}");
    assert_eq!(lengths(&r), ["5"]);
    let r = head("/head-conflict/a").await;
    assert_eq!((r.status, r.result()), (504, "upstream_timeout"), "{r:?}");
    let r = tokio::time::timeout(BOUND, client.put("/no-content/a", "1", "x"))
        .await
        .expect("answered");
    assert_eq!((r.status, r.result()), (204, "accepted"), "{r:?}");
    assert!(lengths(&r).is_empty(), "{r:?}");
    running.shutdown().await;
}

/// A pooled connection the upstream closes without answering just as a request goes out
/// on it (its keep-alive timeout racing the reuse): a safe method is sent again on a new
/// connection, as nginx does, instead of answering 504; any other method may have been
/// acted on, so it is answered as sent (504, outcome unknown).
#[tokio::test]
async fn a_safe_request_on_a_connection_closed_unanswered_is_sent_again() {
    let (upstream, running, client, _dir) = setup().await;
    let get = |path: &str| {
        let (client, path) = (client.clone(), path.to_string());
        async move {
            tokio::time::timeout(BOUND, client.send("GET", &path, &[], ""))
                .await
                .unwrap_or_else(|_| panic!("{path}: no answer within bound"))
        }
    };
    assert_eq!(get("/drop-next/a").await.status, 200);
    let r = get("/keep/b").await;
    assert_eq!((r.status, r.body.as_str()), (200, "ok"), "{r:?}");
    let sent: Vec<usize> = upstream
        .requests()
        .iter()
        .filter(|(_, p)| p == "/keep/b")
        .map(|(c, _)| *c)
        .collect();
    assert_eq!(sent.len(), 2, "sent twice: {sent:?}");
    assert_ne!(sent[0], sent[1], "the second time on a new connection");

    assert_eq!(get("/drop-next/c").await.status, 200);
    let r = tokio::time::timeout(BOUND, client.put("/keep/d", "1", "x"))
        .await
        .expect("answered");
    assert_eq!((r.status, r.result()), (504, "upstream_timeout"), "{r:?}");
    let puts = upstream
        .requests()
        .iter()
        .filter(|(_, p)| p == "/keep/d")
        .count();
    assert_eq!(puts, 1, "a PUT is not sent again");
    running.shutdown().await;
}

/// The lean exchange's pool on its own: a connection back from a finished exchange waits
/// idle and is reused; sweeps close it once it has idled through the idle timeout's worth
/// of them (60 s at one sweep per 10 s: the seventh sweep after its last use).
#[tokio::test]
async fn lean_exchange_connections_are_closed_by_the_sweeps() {
    use fencegate::proxy::upstream::H1Pool;
    use std::time::Duration;

    let upstream = Upstream::start().await;
    let pool = H1Pool::new(8, Duration::from_secs(60), Duration::from_secs(5));
    let authority: http::uri::Authority = upstream.addr.to_string().parse().unwrap();
    let empty = bytes::Bytes::new();
    for i in 0..2 {
        let (parts, ()) = http::Request::builder()
            .uri(format!("/keep/p{i}"))
            .body(())
            .unwrap()
            .into_parts();
        let resp = tokio::time::timeout(
            BOUND,
            pool.send(
                Some(&authority),
                &parts,
                [],
                &empty,
                Duration::from_secs(10),
                std::time::Instant::now() + BOUND,
            ),
        )
        .await
        .expect("answer within bound")
        .expect("answer");
        assert_eq!(resp.status(), 200);
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .unwrap()
            .to_bytes();
        assert_eq!(&body[..], b"ok");
        assert_eq!(pool.idle(), 1);
    }
    assert_eq!(
        upstream.accepted(),
        1,
        "the second exchange reused the first's connection"
    );
    for _ in 0..6 {
        pool.sweep();
    }
    assert_eq!(pool.idle(), 1, "not idle for long enough yet");
    pool.sweep();
    assert_eq!(pool.idle(), 0);
}

/// `Fencing-Result` is fencegate's word: an upstream's own is dropped from an unfenced
/// answer (it would make it look fenced) and replaced on a fenced one.
#[tokio::test]
async fn an_upstreams_fencing_result_is_not_passed_on() {
    let (_upstream, running, client, _dir) = setup().await;
    let unfenced = tokio::time::timeout(BOUND, client.get("/claims/a"))
        .await
        .expect("answered within bound");
    assert_eq!((unfenced.status, unfenced.body.as_str()), (200, "ok"));
    assert!(
        unfenced.headers.get("fencing-result").is_none(),
        "{unfenced:?}"
    );
    let fenced = tokio::time::timeout(BOUND, client.put("/claims/b", "1", "x"))
        .await
        .expect("answered within bound");
    assert_eq!(
        fenced
            .headers
            .get_all("fencing-result")
            .iter()
            .collect::<Vec<_>>(),
        ["accepted"]
    );
    running.shutdown().await;
}

/// An upstream whose connections never complete (its listen queue is full, so handshakes
/// go unanswered) never received the request: once the upstream's timeout runs out the
/// answer is 502 `upstream_unavailable`, not 504 (outcome unknown), and the scope does not
/// settle, so the next generation is tried at once instead of waiting out `settle`.
#[tokio::test]
async fn a_connect_that_never_completes_is_unavailable_and_settles_nothing() {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(1).unwrap();
    let upstream = listener.local_addr().unwrap();
    // Fill the queue nobody accepts from (bounded): the first connect that does not
    // complete promptly shows it full.
    let mut queued = Vec::new();
    let mut full = false;
    for _ in 0..16 {
        match tokio::time::timeout(
            std::time::Duration::from_millis(200),
            TcpStream::connect(upstream),
        )
        .await
        {
            Ok(Ok(s)) => queued.push(s),
            _ => {
                full = true;
                break;
            }
        }
    }
    assert!(full, "the listen queue filled");

    let dir = tempfile::tempdir().unwrap();
    // A settle that outlasts the test: a scope that settled would answer 503 draining.
    let text = support::config_text(upstream, "1s", "1h", "300ms");
    let proxy = support::start(Config::parse(&text, dir.path()).unwrap()).await;
    let client = support::Client::new(proxy.proxy_addr);
    for token in ["1", "2"] {
        let r = client.put("/reports/q/x", token, "never sent").await;
        assert_eq!(
            (r.status, r.result()),
            (502, "upstream_unavailable"),
            "token {token}"
        );
    }
    drop(queued);
    drop(listener);
}
