//! Documented limits with clear errors: body size per route (413), connections per
//! client IP, requests in flight and waiters per scope (503 draining).

use crate::support;

use std::time::Duration;

use support::{BOUND, Client, Double};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn proxy_with(
    double: &Double,
    dir: &std::path::Path,
    server: &str,
    route: &str,
) -> fencegate::app::Running {
    let text = support::config_text(double.addr, "10s", "0s", "10s")
        .replace("trusted_proxies = [\"127.0.0.1\"]", server)
        .replace(
            "[[route]]\nname = \"reports\"\npath = \"/reports/{report}/{*rest}\"\nscope = \"report/{report}\"\nupstream = \"u\"\n",
            &format!("[[route]]\nname = \"reports\"\npath = \"/reports/{{report}}/{{*rest}}\"\nscope = \"report/{{report}}\"\nupstream = \"u\"\n{route}\n"),
        );
    let config = fencegate::settings::Config::parse(&text, dir).expect("config");
    support::start(config).await
}

#[tokio::test]
async fn bodies_over_max_body_get_413_and_are_not_applied() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = proxy_with(&double, dir.path(), "", "max_body = \"1KiB\"").await;
    let client = Client::new(proxy.proxy_addr);
    let r = client.put("/reports/a/x", "1", &"x".repeat(1024)).await;
    assert_eq!(r.status, 200, "exactly the limit passes");
    let r = client.put("/reports/a/x", "1", &"x".repeat(1025)).await;
    assert_eq!((r.status, r.result()), (413, "payload_too_large"));
    assert_eq!(double.seen().len(), 1, "refused before forwarding");

    // Without a Content-Length (chunked), the limit is enforced while streaming.
    let mut s = TcpStream::connect(proxy.proxy_addr).await.unwrap();
    let chunk = "x".repeat(600);
    let req = format!(
        "PUT /reports/a/y HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\nTransfer-Encoding: chunked\r\n\
         Connection: close\r\n\r\n258\r\n{chunk}\r\n258\r\n{chunk}\r\n0\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    tokio::time::timeout(BOUND, s.read_to_string(&mut out))
        .await
        .unwrap()
        .unwrap();
    assert!(out.starts_with("HTTP/1.1 413"), "{out}");
    assert!(
        !double
            .seen()
            .iter()
            .any(|s| s.target == "/reports/a/y" && s.body.len() > 1024),
        "no oversized body was applied"
    );
    proxy.shutdown().await;
}

/// A body with an `Idempotency-Key` is read whole before it is forwarded (to be
/// fingerprinted). That read stops at the route's `max_body` when it is below
/// `idempotency.max_request_body`: a body without a Content-Length is refused as soon as it
/// passes the route's limit, not buffered on towards the larger one, and nothing of it
/// reaches the upstream.
#[tokio::test]
async fn an_idempotent_body_without_a_length_stops_at_max_body() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let route = "max_body = \"1KiB\"\nidempotency = \"optional\"";
    let proxy = proxy_with(&double, dir.path(), "", route).await;
    let head = |path: &str| {
        format!(
            "PUT {path} HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\n\
             Idempotency-Key: \"{path}\"\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
    };

    // Exactly the limit, chunked, passes.
    let mut s = TcpStream::connect(proxy.proxy_addr).await.unwrap();
    let body = "x".repeat(1024);
    let req = format!("{}400\r\n{body}\r\n0\r\n\r\n", head("/reports/a/fits"));
    s.write_all(req.as_bytes()).await.unwrap();
    let (status, text) = read_answer(&mut s).await;
    assert_eq!(status, 200, "{text}");

    // Past it: answered while the rest of the body is still to come (no last chunk).
    let mut s = TcpStream::connect(proxy.proxy_addr).await.unwrap();
    let part = "x".repeat(1100);
    let req = format!("{}44c\r\n{part}\r\n", head("/reports/a/big"));
    s.write_all(req.as_bytes()).await.unwrap();
    let (status, text) = read_answer(&mut s).await;
    assert_eq!(status, 413, "{text}");
    assert!(text.contains("\"result\":\"payload_too_large\""), "{text}");
    assert!(text.contains("(1024 bytes)"), "the route's limit: {text}");
    let seen = double.seen();
    assert!(seen.iter().any(|s| s.target == "/reports/a/fits"));
    assert!(
        !seen.iter().any(|s| s.target == "/reports/a/big"),
        "nothing of it was forwarded"
    );
    proxy.shutdown().await;
}

/// Bodies of requests with an `Idempotency-Key` are held in memory whole (to be
/// fingerprinted) and are bounded over all connections by `idempotency.max_buffered`: a
/// body that finds no room gets 503 `unavailable` and nothing is forwarded (one client
/// sending many large keyed bodies on HTTP/2 streams held gigabytes before). The room
/// comes back once a body has been sent on.
#[tokio::test]
async fn keyed_bodies_held_in_memory_are_bounded_over_all_connections() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let text = support::config_text(double.addr, "10s", "0s", "10s").replacen(
        "scope = \"report/{report}\"\nupstream = \"u\"\n",
        "scope = \"report/{report}\"\nupstream = \"u\"\nidempotency = \"optional\"\n",
        1,
    ) + "\n[idempotency]\nmax_request_body = \"4KiB\"\nmax_buffered = \"6KiB\"\n";
    let config = fencegate::settings::Config::parse(&text, dir.path()).expect("config");
    let proxy = support::start(config).await;
    let client = Client::new(proxy.proxy_addr);
    let body = "x".repeat(4096);
    let keyed = |n: usize| (format!("/reports/b{n}/x"), format!("\"key-{n}\""));
    let send_keyed = |n: usize| {
        let (client, body) = (client.clone(), body.clone());
        async move {
            let (path, key) = keyed(n);
            client
                .send(
                    "PUT",
                    &path,
                    &[("fencing-token", "1"), ("idempotency-key", &key)],
                    &body,
                )
                .await
        }
    };

    // A holds room for its whole declared body while the body is still on its way.
    let mut a = TcpStream::connect(proxy.proxy_addr).await.unwrap();
    let head = "PUT /reports/a/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\n\
                Idempotency-Key: \"key-a\"\r\nContent-Length: 4096\r\n\r\n";
    a.write_all(head.as_bytes()).await.unwrap();
    a.write_all(&body.as_bytes()[..100]).await.unwrap();

    // Once A holds its room, another 4 KiB body does not fit.
    tokio::time::timeout(BOUND, async {
        while proxy.app.proxy.idempotency().buffered() < 4096 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .expect("A's body takes its room");
    let n = 0;
    let r = send_keyed(n).await;
    assert_eq!((r.status, r.result()), (503, "unavailable"), "{r:?}");
    let (path, _) = keyed(n);
    assert!(
        !double.seen().iter().any(|s| s.target == path),
        "a body without room is not forwarded"
    );
    // A body without a key is not held, so it is not bounded by this.
    assert_eq!(client.put("/reports/c/x", "1", &body).await.status, 200);

    // A's body arrives: it is forwarded, and its room comes back.
    a.write_all(&body.as_bytes()[100..]).await.unwrap();
    let (status, text) = read_answer(&mut a).await;
    assert_eq!(status, 200, "{text}");
    let r = send_keyed(n + 1).await;
    assert_eq!((r.status, r.result()), (200, "accepted"), "{r:?}");
    proxy.shutdown().await;
}

/// A fenced request's scope is kept in memory while hot and as a mark for good, so its
/// length is bounded (`fencing.max_scope_bytes`, 1024 by default): a path may be as long
/// as the head allows. Unfenced requests derive no state and are not bounded by it.
#[tokio::test]
async fn a_scope_past_max_scope_bytes_is_invalid_path() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = proxy_with(&double, dir.path(), "", "").await;
    let client = Client::new(proxy.proxy_addr);
    // `report/` and 1017 bytes: exactly the limit.
    let fits = format!("/reports/{}/x", "r".repeat(1017));
    assert_eq!(client.put(&fits, "1", "").await.status, 200);
    let long = format!("/reports/{}/x", "r".repeat(1018));
    let r = client.put(&long, "1", "").await;
    assert_eq!((r.status, r.result()), (400, "invalid_path"), "{r:?}");
    assert!(r.body.contains("max_scope_bytes"), "{}", r.body);
    assert!(
        !double.seen().iter().any(|s| s.target == long),
        "not forwarded"
    );
    let scope = format!("report/{}", "r".repeat(1018));
    assert_eq!(proxy.app.gates.mark(&scope).unwrap(), None, "no mark");
    // A read without a token is not fenced: no scope is kept.
    let r = client.send("GET", &long, &[], "").await;
    assert_eq!(r.status, 200, "{r:?}");
    proxy.shutdown().await;
}

/// Reads one answer (head, then a body of `Content-Length` bytes) within [`BOUND`].
async fn read_answer(s: &mut TcpStream) -> (u16, String) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    tokio::time::timeout(BOUND, async {
        loop {
            let text = String::from_utf8_lossy(&buf).into_owned();
            if let Some(end) = text.find("\r\n\r\n") {
                let length: usize = text[..end]
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().to_string())
                    })
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                if buf.len() >= end + 4 + length {
                    return;
                }
            }
            let n = s.read(&mut chunk).await.expect("read");
            assert!(n > 0, "closed before a whole answer: {text}");
            buf.extend_from_slice(&chunk[..n]);
        }
    })
    .await
    .expect("an answer within the bound");
    let text = String::from_utf8_lossy(&buf).into_owned();
    (support::status_of(&text), text)
}

/// Opens `n` connections to `addr` that are each answered 200 to `request`, and keeps
/// them open; then checks that one more is closed at once, without an answer.
async fn admits_exactly(addr: std::net::SocketAddr, n: usize, request: &[u8]) {
    for _ in 0..n {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(request).await.unwrap();
        let mut buf = [0u8; 12];
        tokio::time::timeout(BOUND, s.read_exact(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&buf, b"HTTP/1.1 200", "{addr}");
        std::mem::forget(s); // keep it open for the rest of the test
    }
    let mut c = TcpStream::connect(addr).await.unwrap();
    let _ = c.write_all(request).await;
    let mut buf = Vec::new();
    let read = tokio::time::timeout(BOUND, c.read_to_end(&mut buf))
        .await
        .unwrap();
    assert!(
        read.map(|n| n == 0).unwrap_or(true),
        "{addr}: got {:?}",
        String::from_utf8_lossy(&buf)
    );
}

#[tokio::test]
async fn connections_per_client_ip_are_bounded() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = proxy_with(&double, dir.path(), "max_connections_per_ip = 2", "").await;
    // Two connections from this IP work; a third is closed at once.
    admits_exactly(
        proxy.proxy_addr,
        2,
        b"GET /public/x HTTP/1.1\r\nHost: a\r\n\r\n",
    )
    .await;
    // The admin listener has a bound of its own, the same size.
    admits_exactly(
        proxy.admin_addr,
        2,
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    )
    .await;
    proxy.shutdown().await;
}

#[tokio::test]
async fn per_scope_inflight_and_waiters_are_bounded() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let text = support::config_text(double.addr, "10s", "0s", "10s").replace(
        "settle = \"0s\"",
        "settle = \"0s\"\nmax_inflight_per_scope = 2\nmax_waiters_per_scope = 1",
    );
    let config = fencegate::settings::Config::parse(&text, dir.path()).unwrap();
    let proxy = support::start(config).await;
    let client = Client::new(proxy.proxy_addr);
    let held = |name: &'static str, token: &'static str| {
        let c = client.clone();
        tokio::spawn(async move {
            c.send(
                "PUT",
                "/reports/b/x",
                &[("fencing-token", token), ("x-test-hold", name)],
                "",
            )
            .await
        })
    };
    let h1 = held("one", "1");
    double.arrived("one").await;
    let h2 = held("two", "1");
    double.arrived("two").await;
    // A third request of the same generation would exceed max_inflight_per_scope.
    let r = client.put("/reports/b/x", "1", "").await;
    assert_eq!((r.status, r.result()), (503, "draining"));
    // One newer request may wait; a second waiter is refused at once.
    let c = client.clone();
    let waiter = tokio::spawn(async move { c.put("/reports/b/x", "2", "").await });
    tokio::time::timeout(BOUND, async {
        while proxy.app.gates.waiting() != 1 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .unwrap();
    let r = client.put("/reports/b/x", "2", "").await;
    assert_eq!((r.status, r.result()), (503, "draining"));
    double.release("one");
    double.release("two");
    assert_eq!(h1.await.unwrap().status, 200);
    assert_eq!(h2.await.unwrap().status, 200);
    assert_eq!(waiter.await.unwrap().status, 200);
    proxy.shutdown().await;
}
