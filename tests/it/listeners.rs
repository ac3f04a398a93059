//! The three listeners (proxy, admin, authority) are served by one piece of code with one
//! set of bounds: idle and mute HTTP/2 clients are let go on time on every port, idle
//! connections make room for new clients, and a refusal that leaves a body unread says
//! that the connection closes.
//!
//! The timings are the server's, but on real sockets and hyper's and the server's own
//! deadlines (std's clock), which a paused tokio clock does not move: each test sets short
//! limits (300 ms) and waits for an outcome within a bound well above them and well below
//! the behaviour it rules out (hyper's 40 s keep-alive, or never).

use crate::support;

use std::net::SocketAddr;
use std::time::Duration;

use support::{BOUND, Double};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Well above the 300 ms limits the tests set (and their closing bound), well below
/// hyper's 20 s keep-alive interval plus 20 s timeout.
const SOON: Duration = Duration::from_secs(5);

/// A proxy (and, with `authority`, a lease authority) whose `[server]` has `server` in
/// place of the test config's `trusted_proxies` line.
async fn start(
    double: &Double,
    dir: &std::path::Path,
    server: &str,
    authority: bool,
) -> fencegate::app::Running {
    let mut text = support::config_text_with_server(double.addr, server);
    if authority {
        text.push_str(support::AUTHORITY_TABLE);
    }
    support::start_text(&text, dir).await
}

/// An HTTP/2 connection, its handshake done; the connection's task is the answer's second.
async fn h2_connect(
    addr: SocketAddr,
) -> (
    h2::client::SendRequest<bytes::Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (h2, conn) = h2::client::handshake(tcp).await.unwrap();
    (h2.ready().await.unwrap(), tokio::spawn(conn))
}

/// On every port, an HTTP/2 connection with no open stream is closed at the idle limit
/// (`header_read_timeout`), though its client answers every PING (the h2 crate does).
#[tokio::test]
async fn an_idle_http2_connection_that_answers_pings_is_closed_on_every_port() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let running = start(&double, dir.path(), "header_read_timeout = \"300ms\"", true).await;
    let ports = [
        ("proxy", running.proxy_addr),
        ("admin", running.admin_addr),
        ("authority", running.authority_addr.expect("authority")),
    ];
    for (port, addr) in ports {
        let (h2, conn) = h2_connect(addr).await;
        let ended = tokio::time::timeout(SOON, conn).await;
        assert!(
            ended.is_ok(),
            "{port}: an idle HTTP/2 connection must be closed"
        );
        drop(h2);
    }
    running.shutdown().await;
}

/// A client that sends the preface and its SETTINGS, then answers nothing (not the
/// GOAWAY's PING, not even the server's SETTINGS), is dropped soon after the server's
/// GOAWAY, not held until hyper's keep-alive gives up (40 s).
#[tokio::test]
async fn a_mute_http2_client_is_dropped_soon_after_the_goaway() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let running = start(&double, dir.path(), "header_read_timeout = \"300ms\"", true).await;
    let ports = [
        ("proxy", running.proxy_addr),
        ("admin", running.admin_addr),
        ("authority", running.authority_addr.expect("authority")),
    ];
    for (port, addr) in ports {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        // The preface, then an empty SETTINGS frame (length 0, type 4, no flags, stream 0).
        tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
            .await
            .unwrap();
        // Read (so nothing blocks on the socket's buffers) but never answer.
        let mut seen = Vec::new();
        let closed = tokio::time::timeout(SOON, tcp.read_to_end(&mut seen)).await;
        assert!(
            closed.is_ok(),
            "{port}: a mute HTTP/2 client still holds its connection after {SOON:?}"
        );
        // The GOAWAY (type 7) was sent first.
        assert!(
            seen.windows(4).any(|w| w[3] == 7 && w[0] == 0),
            "{port}: no GOAWAY seen: {seen:?}"
        );
    }
    running.shutdown().await;
}

/// `max_connections` taken by idle connections (here HTTP/2 ones, from the one address,
/// with a per-client bound that lets it) does not lock anyone out: a new client is
/// served, in place of one of them; and an idle HTTP/1 keep-alive connection makes room
/// too. With no idle connection to close, a client past the bound is still refused.
#[tokio::test]
async fn idle_connections_make_room_for_a_new_client() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let server =
        "max_connections = 24\nmax_connections_per_ip = 100\nheader_read_timeout = \"30s\"";
    // Just opened (some perhaps not yet handed to a worker when the newcomer comes), or
    // each after one answer.
    for warm in [false, true] {
        let running = start(&double, dir.path(), server, false).await;
        let addr = running.proxy_addr;
        let mut idle = Vec::new();
        for _ in 0..24 {
            let (mut h2, conn) = h2_connect(addr).await;
            if warm {
                let req = http::Request::get(format!("http://{addr}/public/warm"))
                    .body(())
                    .unwrap();
                let (resp, _) = h2.send_request(req, true).unwrap();
                let mut body = resp.await.unwrap().into_body();
                while let Some(chunk) = body.data().await {
                    chunk.unwrap();
                }
                h2 = h2.ready().await.unwrap();
            }
            idle.push((h2, conn));
        }
        let (status, text) = tokio::time::timeout(
            BOUND,
            support::raw(
                addr,
                b"GET /public/new HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
            ),
        )
        .await
        .expect("the new client is answered");
        assert_eq!(status, 200, "warm {warm}: {text}");
        // One of the idle ones made room.
        let mut closed = 0;
        for (_, conn) in &mut idle {
            if tokio::time::timeout(Duration::from_millis(100), conn)
                .await
                .is_ok()
            {
                closed += 1;
            }
        }
        assert!(closed >= 1, "no idle connection was closed");
        drop(idle);
        running.shutdown().await;
    }

    // The same with HTTP/1 keep-alive connections, each after one answer.
    let running = start(&double, dir.path(), server, false).await;
    let addr = running.proxy_addr;
    let mut idle = Vec::new();
    for _ in 0..24 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /public/k HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 12];
        s.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"HTTP/1.1 200");
        idle.push(s);
    }
    let (status, _) = tokio::time::timeout(
        BOUND,
        support::raw(
            addr,
            b"GET /public/new HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        ),
    )
    .await
    .expect("the new client is answered");
    assert_eq!(status, 200);
    drop(idle);
    running.shutdown().await;

    // Busy connections (heads in progress count as busy only for HTTP/2 streams: here an
    // open stream each) are not closed for a newcomer.
    let running = start(&double, dir.path(), server, false).await;
    let addr = running.proxy_addr;
    let mut busy = Vec::new();
    for i in 0..24 {
        let (mut h2, conn) = h2_connect(addr).await;
        let req = http::Request::get(format!("http://{addr}/public/slow"))
            .header("x-test-hold", format!("busy-{i}"))
            .body(())
            .unwrap();
        // Held at the upstream: its stream stays open.
        let (resp, body) = h2.send_request(req, true).unwrap();
        double.arrived(&format!("busy-{i}")).await;
        busy.push((h2, conn, resp, body));
    }
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s
        .write_all(b"GET /public/new HTTP/1.1\r\nHost: a\r\n\r\n")
        .await;
    let mut buf = Vec::new();
    let out = tokio::time::timeout(BOUND, s.read_to_end(&mut buf)).await;
    assert!(
        matches!(out, Ok(Ok(0)) | Ok(Err(_))),
        "refused unanswered: {:?}",
        String::from_utf8_lossy(&buf)
    );
    for i in 0..24 {
        double.release(&format!("busy-{i}"));
    }
    drop(busy);
    running.shutdown().await;
}

/// Without `max_connections_per_ip`, one address may hold a tenth of `max_connections`
/// (the default 1000 is a tenth of the default 10000), not every slot.
#[test]
fn the_per_client_default_is_a_tenth_of_the_total() {
    let dir = tempfile::tempdir().unwrap();
    let parse = |server: &str| {
        let text = support::config_text_with_server("127.0.0.1:1".parse().unwrap(), server);
        fencegate::settings::Config::parse(&text, dir.path())
            .expect("config")
            .server
    };
    assert_eq!(parse("").max_connections_per_ip, 1000);
    assert_eq!(parse("max_connections = 24").max_connections_per_ip, 2);
    assert_eq!(parse("max_connections = 5").max_connections_per_ip, 1);
    assert_eq!(
        parse("max_connections = 24\nmax_connections_per_ip = 24").max_connections_per_ip,
        24
    );
}

/// Reads one HTTP/1 answer (head and Content-Length body) off `s`, bounded.
async fn read_answer(s: &mut TcpStream) -> String {
    let mut got = Vec::new();
    tokio::time::timeout(BOUND, async {
        let mut buf = [0u8; 4096];
        loop {
            if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
                let len = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .unwrap_or(0);
                if got.len() >= end + 4 + len {
                    return;
                }
            }
            let n = s.read(&mut buf).await.unwrap();
            assert!(
                n > 0,
                "closed mid-answer: {:?}",
                String::from_utf8_lossy(&got)
            );
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .expect("an answer within bound");
    String::from_utf8_lossy(&got).into_owned()
}

/// A refusal answered before the request's body came (409 stale_fence to a PUT whose
/// client is still sending) is followed by a close: the answer says `Connection: close`,
/// so a keep-alive client does not send its next request into it. The same on the
/// authority's port (404 to a POST whose body is not sent yet).
#[tokio::test]
async fn a_refusal_before_the_body_says_the_connection_closes() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let running = start(&double, dir.path(), "", true).await;
    let client = support::Client::new(running.proxy_addr);
    assert_eq!(client.put("/reports/r/x", "5", "").await.status, 200);

    let mut s = TcpStream::connect(running.proxy_addr).await.unwrap();
    s.write_all(
        b"PUT /reports/r/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\nContent-Length: 100000\r\n\r\n",
    )
    .await
    .unwrap();
    let answer = read_answer(&mut s).await;
    assert!(answer.starts_with("HTTP/1.1 409"), "{answer}");
    assert!(
        answer.to_lowercase().contains("\r\nconnection: close\r\n"),
        "{answer}"
    );
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(BOUND, s.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "the connection is closed after the refusal");

    // A refusal after the whole body keeps the connection.
    let mut s = TcpStream::connect(running.proxy_addr).await.unwrap();
    s.write_all(
        b"PUT /reports/r/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\nContent-Length: 0\r\n\r\n",
    )
    .await
    .unwrap();
    let answer = read_answer(&mut s).await;
    assert!(answer.starts_with("HTTP/1.1 409"), "{answer}");
    assert!(
        !answer.to_lowercase().contains("connection: close"),
        "{answer}"
    );

    let mut s = TcpStream::connect(running.authority_addr.expect("authority"))
        .await
        .unwrap();
    s.write_all(b"POST /v1/nothing HTTP/1.1\r\nHost: a\r\nContent-Length: 5000\r\n\r\n")
        .await
        .unwrap();
    let answer = read_answer(&mut s).await;
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
    assert!(
        answer.to_lowercase().contains("\r\nconnection: close\r\n"),
        "{answer}"
    );
    running.shutdown().await;
}

/// A small body of known length that came with its refused head is read and dropped, as
/// nginx discards it: the 409 keeps the connection, and the next request on it is
/// answered. One held back by its client, or awaiting `100 Continue`, is not waited for
/// past a bound (nor asked for): the answer closes the connection.
#[tokio::test]
async fn a_refusal_discards_a_small_body_and_keeps_the_connection() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let running = start(&double, dir.path(), "", true).await;
    let client = support::Client::new(running.proxy_addr);
    assert_eq!(client.put("/reports/d/x", "5", "").await.status, 200);

    let mut s = TcpStream::connect(running.proxy_addr).await.unwrap();
    let stale = format!(
        "PUT /reports/d/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\nContent-Length: 64\r\n\r\n{}",
        "b".repeat(64)
    );
    for i in 0..3 {
        s.write_all(stale.as_bytes()).await.unwrap();
        let answer = read_answer(&mut s).await;
        assert!(answer.starts_with("HTTP/1.1 409"), "request {i}: {answer}");
        assert!(
            !answer.to_lowercase().contains("connection: close"),
            "request {i}: {answer}"
        );
    }
    s.write_all(
        b"PUT /reports/d/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 6\r\nContent-Length: 2\r\n\r\nok",
    )
    .await
    .unwrap();
    let answer = read_answer(&mut s).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(
        running
            .app
            .gates
            .mark("report/d")
            .expect("mark")
            .map(|t| t.to_string())
            .as_deref(),
        Some("6")
    );

    // The head alone: the body is not waited for past the bound, and the answer closes.
    let mut s = TcpStream::connect(running.proxy_addr).await.unwrap();
    s.write_all(
        b"PUT /reports/d/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\nContent-Length: 64\r\n\r\n",
    )
    .await
    .unwrap();
    let answer = read_answer(&mut s).await;
    assert!(answer.starts_with("HTTP/1.1 409"), "{answer}");
    assert!(
        answer.to_lowercase().contains("\r\nconnection: close\r\n"),
        "{answer}"
    );
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(BOUND, s.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "the connection is closed after the refusal");

    // Expect: 100-continue: refused at once, without a 100 asking for the body.
    let mut s = TcpStream::connect(running.proxy_addr).await.unwrap();
    s.write_all(b"PUT /reports/d/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\nExpect: 100-continue\r\nContent-Length: 64\r\n\r\n")
        .await
        .unwrap();
    let answer = read_answer(&mut s).await;
    assert!(answer.starts_with("HTTP/1.1 409"), "{answer}");
    assert!(
        answer.to_lowercase().contains("\r\nconnection: close\r\n"),
        "{answer}"
    );
    running.shutdown().await;
}

/// A request with both `Content-Length` and `Transfer-Encoding` (hyper would read it as
/// chunked and drop the length) is answered 400 invalid_request and the connection
/// closed; nothing of it, nor of what follows it, is forwarded. On every port.
#[tokio::test]
async fn a_length_with_a_transfer_encoding_is_refused_and_nothing_forwarded() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let running = start(&double, dir.path(), "", true).await;
    for te in ["chunked", "gzip, chunked"] {
        let request = format!(
            "PUT /public/clte HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: {te}\r\n\r\n\
             0\r\n\r\nDELETE /public/clte HTTP/1.1\r\nHost: a\r\n\r\n"
        );
        let (status, text) = support::raw(running.proxy_addr, request.as_bytes()).await;
        assert_eq!(status, 400, "{text}");
        let lower = text.to_lowercase();
        assert!(lower.contains("\r\nconnection: close\r\n"), "{text}");
        assert!(lower.contains("fencing-result: invalid_request"), "{text}");
        assert!(lower.contains("application/problem+json"), "{text}");
        assert_eq!(text.matches("HTTP/1.1 ").count(), 1, "one answer: {text}");
    }
    // The same with the length after the encoding.
    let (status, _) = support::raw(
        running.proxy_addr,
        b"PUT /public/clte HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!(status, 400);
    for addr in [
        running.admin_addr,
        running.authority_addr.expect("authority"),
    ] {
        let (status, text) = support::raw(
            addr,
            b"POST /v1/locks/acquire HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        )
        .await;
        assert_eq!(status, 400, "{addr}: {text}");
    }
    assert!(
        !double.seen().iter().any(|s| s.target.contains("clte")),
        "forwarded: {:?}",
        double.seen()
    );
    // Counted as the proxy's other refusals before routing are (the three on its port).
    let metrics = support::Client::new(running.admin_addr)
        .get("/metrics")
        .await
        .body;
    assert!(
        metrics.contains("fencegate_requests_total{route=\"none\",result=\"invalid_request\"} 3"),
        "{metrics}"
    );
    running.shutdown().await;
}

/// A `#fragment` in the request target (which `http::Uri` cuts off: `DELETE
/// /public/frag/#ment` would be forwarded as `DELETE /public/frag/`) is answered 400
/// invalid_path, and nothing is forwarded; also as the second request of a keep-alive
/// connection, after a body, and with the target split over many writes.
#[tokio::test]
async fn a_fragment_in_the_target_is_refused_and_nothing_forwarded() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let running = start(&double, dir.path(), "", false).await;
    let addr = running.proxy_addr;
    let (status, text) = support::raw(
        addr,
        b"DELETE /public/frag/#ment HTTP/1.1\r\nHost: a\r\n\r\n",
    )
    .await;
    assert_eq!(status, 400, "{text}");
    assert!(
        text.to_lowercase().contains("fencing-result: invalid_path"),
        "{text}"
    );
    assert!(
        text.to_lowercase().contains("\r\nconnection: close\r\n"),
        "{text}"
    );

    // Second on its connection, after a request whose body holds a `#` line of its own.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let body = "GET /public/x#y HTTP/1.1\r\n";
    let first = format!(
        "PUT /public/ok HTTP/1.1\r\nHost: a\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(first.as_bytes()).await.unwrap();
    let answer = read_answer(&mut s).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // The second head, a few bytes per write.
    for part in b"DELETE /public/frag/#ment HTTP/1.1\r\nHost: a\r\n\r\n".chunks(3) {
        s.write_all(part).await.unwrap();
        s.flush().await.unwrap();
    }
    let answer = read_answer(&mut s).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    let seen = double.seen();
    assert_eq!(
        seen.len(),
        1,
        "only the first request is forwarded: {seen:?}"
    );
    assert_eq!(seen[0].target, "/public/ok");
    assert_eq!(seen[0].body, body.as_bytes());
    running.shutdown().await;
}
