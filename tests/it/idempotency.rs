//! Idempotency-Key at the proxy: a retry after a lost response applies once, concurrent
//! duplicates are told apart, unknown outcomes are never silently applied twice, records
//! survive a crash and expire.

use crate::support;

use std::time::Duration;

use fencegate::store::MarkStore;
use support::{BOUND, Client, Double, spawn, write_config};

const KEY: (&str, &str) = ("idempotency-key", "\"order-1\"");

/// Sends until the answer is no longer `in_progress` (the first attempt's record is
/// completed asynchronously once its upstream answered), bounded.
async fn settled(
    client: &Client,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> support::Resp {
    settled_as(client, "PUT", path, headers, body).await
}

/// [`settled`] for a request of any method.
async fn settled_as(
    client: &Client,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> support::Resp {
    tokio::time::timeout(BOUND, async {
        loop {
            let r = client.send(method, path, headers, body).await;
            if r.result() != "in_progress" {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("first attempt completes")
}

#[tokio::test]
async fn a_retry_after_a_lost_response_applies_once() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start(support::config(double.addr, dir.path())).await;
    let client = Client::new(proxy.proxy_addr);

    // The first attempt reaches the upstream; its client gives up before the answer.
    let c = client.clone();
    let first = tokio::spawn(async move {
        c.send(
            "PUT",
            "/idem/a",
            &[("fencing-token", "1"), KEY, ("x-test-hold", "lost")],
            "pay 10",
        )
        .await
    });
    double.arrived("lost").await;
    first.abort();
    let _ = first.await;
    double.release("lost");

    let retry = settled(
        &client,
        "/idem/a",
        &[("fencing-token", "1"), KEY, ("x-test-hold", "lost")],
        "pay 10",
    )
    .await;
    assert_eq!((retry.status, retry.result()), (200, "duplicate"));
    assert_eq!(
        retry.body, "PUT /idem/a token=1",
        "the stored response is replayed"
    );
    assert_eq!(retry.headers["x-upstream"], "double");
    let applied = double
        .seen()
        .iter()
        .filter(|s| s.target == "/idem/a")
        .count();
    assert_eq!(applied, 1, "the upstream applied the operation once");

    // A different request under the same key is refused, and a stale token is stale.
    let other = client
        .send("PUT", "/idem/a", &[("fencing-token", "1"), KEY], "pay 99")
        .await;
    assert_eq!((other.status, other.result()), (422, "key_reused"));
    assert_eq!(client.put("/idem/a", "2", "owner 2").await.status, 200);
    let stale = client
        .send("PUT", "/idem/a", &[("fencing-token", "1"), KEY], "pay 10")
        .await;
    assert_eq!((stale.status, stale.result()), (409, "stale_fence"));
    proxy.shutdown().await;
}

/// A client that goes away while its key's claim is being committed: the claim lands
/// anyway (the writer commits it whether or not anyone waits), so the request must still
/// be forwarded and recorded. Otherwise the key would stay `in_progress` to every retry
/// until the record expired.
/// Two paths that share a scope can still name two objects (`x` and `x/` on an object
/// store; `x` and `%78` on a backend that does not decode): a key reused on the other one
/// is refused, never answered with the first one's stored response.
#[tokio::test]
async fn a_key_reused_on_another_spelling_is_not_a_duplicate() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start(support::config(double.addr, dir.path())).await;
    let client = Client::new(proxy.proxy_addr);

    let first = settled(&client, "/idem/x", &[("fencing-token", "1"), KEY], "v1").await;
    assert_eq!((first.status, first.result()), (200, "accepted"));
    for other in ["/idem/x/", "/idem/%78"] {
        let r = client
            .send("PUT", other, &[("fencing-token", "1"), KEY], "v1")
            .await;
        assert_eq!((r.status, r.result()), (422, "key_reused"), "{other}");
    }
    let again = client
        .send("PUT", "/idem/x", &[("fencing-token", "1"), KEY], "v1")
        .await;
    assert_eq!((again.status, again.result()), (200, "duplicate"));
    let targets: Vec<String> = double.seen().iter().map(|s| s.target.clone()).collect();
    assert_eq!(
        targets,
        ["/idem/x"],
        "only the first request reached the upstream"
    );
    proxy.shutdown().await;
}

/// The test config with a route over a tree whose scope is its top segment, as the
/// issue's WebDAV reproduction had it (a MOVE within one scope).
fn tree_config(upstream: std::net::SocketAddr) -> String {
    support::config_text(upstream, "10s", "0s", "10s")
        + r#"
[[route]]
name = "tree"
path = "/tree/{t}/{*rest}"
scope = "tree/{t}"
upstream = "u"
idempotency = "optional"
"#
}

/// The fingerprint covers the request's headers (SPEC §4): the same MOVE and key with
/// another `Destination` is another request, answered 422 `key_reused`, not the first
/// one's 200 `duplicate` (which told the client asking for /c that it had moved there,
/// when the backend had moved to /b); so are a `Content-Type`, an `If-*` and an
/// `x-amz-*` that differ. A retry that differs only in what a client changes between
/// attempts of one request (its signature and date, an SDK's attempt counter, trace ids,
/// the order of its headers) is still that request: `duplicate`.
#[tokio::test]
async fn a_retry_with_other_request_headers_is_key_reused() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start_text(&tree_config(double.addr), dir.path()).await;
    let client = Client::new(proxy.proxy_addr);
    let key = ("idempotency-key", "\"mv1\"");

    let first = settled_as(
        &client,
        "MOVE",
        "/tree/t/a",
        &[
            ("fencing-token", "1"),
            key,
            ("destination", "/tree/t/b"),
            ("authorization", "AWS4-HMAC-SHA256 Signature=aa"),
            ("x-amz-date", "20260101T000000Z"),
            ("amz-sdk-request", "attempt=1; max=3"),
            ("traceparent", "00-aa-01"),
        ],
        "",
    )
    .await;
    assert_eq!((first.status, first.result()), (200, "accepted"));

    let other = client
        .send(
            "MOVE",
            "/tree/t/a",
            &[("fencing-token", "1"), key, ("destination", "/tree/t/c")],
            "",
        )
        .await;
    assert_eq!((other.status, other.result()), (422, "key_reused"));

    let retry = client
        .send(
            "MOVE",
            "/tree/t/a",
            &[
                ("traceparent", "00-bb-01"),
                ("amz-sdk-request", "attempt=2; max=3"),
                ("x-amz-date", "20260101T000003Z"),
                ("authorization", "AWS4-HMAC-SHA256 Signature=bb"),
                ("Destination", "/tree/t/b"),
                key,
                ("fencing-token", "1"),
                ("user-agent", "retrying/2"),
                ("x-request-id", "attempt-2"),
            ],
            "",
        )
        .await;
    assert_eq!((retry.status, retry.result()), (200, "duplicate"));
    assert_eq!(retry.body, "MOVE /tree/t/a token=1");

    // A PUT's own headers, each changed on its own.
    let put_key = ("idempotency-key", "\"put1\"");
    let base = [
        ("fencing-token", "1"),
        put_key,
        ("content-type", "text/csv"),
        ("if-match", "\"e1\""),
        ("x-amz-meta-owner", "a"),
    ];
    let first = settled(&client, "/tree/t/p", &base, "rows").await;
    assert_eq!((first.status, first.result()), (200, "accepted"));
    for (i, changed) in [
        ("content-type", "text/plain"),
        ("if-match", "\"e2\""),
        ("x-amz-meta-owner", "b"),
    ]
    .into_iter()
    .enumerate()
    {
        let mut headers = base.to_vec();
        headers[i + 2] = changed;
        let r = client.send("PUT", "/tree/t/p", &headers, "rows").await;
        assert_eq!((r.status, r.result()), (422, "key_reused"), "{changed:?}");
    }
    // One left out, or one added, is another request too.
    let r = client.send("PUT", "/tree/t/p", &base[..4], "rows").await;
    assert_eq!((r.status, r.result()), (422, "key_reused"), "no x-amz-meta");
    let mut added = base.to_vec();
    added.push(("x-amz-tagging", "k=v"));
    let r = client.send("PUT", "/tree/t/p", &added, "rows").await;
    assert_eq!((r.status, r.result()), (422, "key_reused"), "x-amz-tagging");
    let r = client.send("PUT", "/tree/t/p", &base, "rows").await;
    assert_eq!((r.status, r.result()), (200, "duplicate"));

    let applied: Vec<(String, Option<String>)> = double
        .seen()
        .iter()
        .map(|s| {
            (
                s.method.clone(),
                s.header("destination").map(str::to_string),
            )
        })
        .collect();
    assert_eq!(
        applied,
        [
            ("MOVE".to_string(), Some("/tree/t/b".to_string())),
            ("PUT".to_string(), None)
        ],
        "each operation reached the upstream once"
    );
    proxy.shutdown().await;
}

/// `fingerprint_ignore` adds a deployment's own per-attempt headers to the list: a
/// retry that differs only in one is a duplicate; without the setting it is another
/// request.
#[tokio::test]
async fn configured_headers_are_left_out_of_the_fingerprint() {
    let double = Double::start().await;
    for (ignore, second) in [("[\"x-my-trace\"]", "duplicate"), ("[]", "key_reused")] {
        let dir = tempfile::tempdir().unwrap();
        let text =
            tree_config(double.addr) + &format!("[idempotency]\nfingerprint_ignore = {ignore}\n");
        let proxy = support::start_text(&text, dir.path()).await;
        let client = Client::new(proxy.proxy_addr);
        let headers = |trace| {
            [
                ("fencing-token", "1"),
                ("idempotency-key", "\"k\""),
                ("x-my-trace", trace),
            ]
        };
        let first = settled(&client, "/tree/c/x", &headers("1"), "v").await;
        assert_eq!(first.result(), "accepted", "{ignore}");
        let r = client.send("PUT", "/tree/c/x", &headers("2"), "v").await;
        assert_eq!(r.result(), second, "{ignore}");
        proxy.shutdown().await;
    }
}

/// A record that the version before header fingerprints stored (its fingerprint over the
/// method, target, token and body only, no `fingerprint_version`) is answered 422
/// `key_reused` after the upgrade, never `duplicate`: that fingerprint says nothing of the
/// headers, so the retry may be another request (the issue's MOVE to another
/// `Destination` matched it). The client is told, nothing is forwarded, and the key is
/// free again once the record expires (`idempotency.ttl`). That version answered this
/// very request `duplicate` from this record.
#[tokio::test]
async fn a_record_from_before_header_fingerprints_is_key_reused() {
    use sha2::{Digest, Sha256};

    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let store = MarkStore::open(&dir.path().join("marks.redb")).expect("store");
    // The earlier version's fingerprint of `PUT /idem/old` with token 1 and body "v1".
    let mut h = Sha256::new();
    for part in ["PUT", "/idem/old", "", "1"] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    h.update(b"v1");
    let fingerprint: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    let meta = format!(
        r#"{{"fingerprint":"{fingerprint}","state":{{"Completed":{{"status":201,"headers":[["x-upstream",[111,108,100]]],"body_stored":true}}}},"boot":1}}"#
    );
    let mut record = u64::MAX.to_be_bytes().to_vec();
    record.extend_from_slice(&u32::try_from(meta.len()).unwrap().to_be_bytes());
    record.extend_from_slice(meta.as_bytes());
    record.extend_from_slice(b"stored by the old version");
    let claimed = store
        .claim("idem/old\0old-1".into(), record, None, 0)
        .await
        .expect("record");
    assert!(claimed.is_none());
    let proxy = fencegate::app::start(support::config(double.addr, dir.path()), Some(store))
        .await
        .expect("start");
    let client = Client::new(proxy.proxy_addr);

    let r = client
        .send(
            "PUT",
            "/idem/old",
            &[("fencing-token", "1"), ("idempotency-key", "\"old-1\"")],
            "v1",
        )
        .await;
    assert_eq!((r.status, r.result()), (422, "key_reused"), "{}", r.body);
    assert!(double.seen().is_empty(), "nothing forwarded");
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_client_gone_during_its_claim_leaves_no_stuck_key() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (proxy, disk) = support::start_on_disk(double.addr, dir.path()).await;
    let client = Client::new(proxy.proxy_addr);
    // The mark first, so that the claim is the one commit the disk holds below.
    let r = client.put("/idem/c", "4", "no key").await;
    assert_eq!((r.status, r.result()), (200, "accepted"));

    disk.hold();
    let mut conn = tokio::net::TcpStream::connect(proxy.proxy_addr)
        .await
        .expect("connect");
    conn.write_all(
        b"PUT /idem/c HTTP/1.1\r\nHost: x\r\nFencing-Token: 4\r\n\
          Idempotency-Key: \"order-1\"\r\nContent-Length: 5\r\n\r\npay 5",
    )
    .await
    .expect("write");
    tokio::time::timeout(BOUND, async {
        while !disk.syncing() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the claim reaches the disk");
    // The client goes away; the proxy closing the connection shows it dropped the request.
    conn.shutdown().await.expect("shutdown");
    let mut rest = Vec::new();
    tokio::time::timeout(BOUND, conn.read_to_end(&mut rest))
        .await
        .expect("the proxy closes the connection")
        .expect("read");
    assert!(rest.is_empty(), "no answer was sent: {rest:?}");
    disk.release();

    let retry = settled(&client, "/idem/c", &[("fencing-token", "4"), KEY], "pay 5").await;
    assert_eq!((retry.status, retry.result()), (200, "duplicate"));
    assert_eq!(
        double
            .seen()
            .iter()
            .filter(|s| s.target == "/idem/c" && s.body == "pay 5")
            .count(),
        1,
        "forwarded once"
    );
    proxy.shutdown().await;
}

/// Shutdown while an exchange whose client has gone is still at the upstream: the worker
/// waits for it (within `shutdown_timeout`), as it does for connections, so its answer is
/// recorded and the client's retry after the restart is answered from the record. (Once
/// the last connection had ended, the worker used to stop and drop the exchange: the retry
/// found no response recorded, 409 `outcome_unknown`.)
#[tokio::test]
async fn shutdown_waits_for_an_exchange_whose_client_has_gone() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (proxy, disk) = support::start_on_disk(double.addr, dir.path()).await;
    let addr = proxy.proxy_addr;
    let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
    conn.write_all(
        b"PUT /idem/gone HTTP/1.1\r\nHost: x\r\nFencing-Token: 1\r\n\
          Idempotency-Key: \"order-1\"\r\nX-Test-Hold: gone\r\nContent-Length: 5\r\n\r\npay 5",
    )
    .await
    .expect("write");
    double.arrived("gone").await;
    // The client goes away; the proxy closing the connection shows that the request's
    // own task has ended, and that the exchange goes on without it.
    conn.shutdown().await.expect("shutdown");
    let mut rest = Vec::new();
    tokio::time::timeout(BOUND, conn.read_to_end(&mut rest))
        .await
        .expect("the proxy closes the connection")
        .expect("read");
    assert!(rest.is_empty(), "no answer was sent: {rest:?}");

    // Shutdown begins (the listener closes) while the exchange is still at the upstream;
    // only then does the upstream answer.
    let shutdown = tokio::spawn(proxy.shutdown());
    tokio::time::timeout(BOUND, async {
        while tokio::net::TcpStream::connect(addr).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the listener closes on shutdown");
    double.release("gone");
    tokio::time::timeout(BOUND, shutdown)
        .await
        .expect("shutdown returns once the exchange is over")
        .expect("shutdown task");

    // After a restart on the same store, the retry is answered from the record.
    let store = MarkStore::open_with_backend(disk.clone()).expect("reopen the store");
    let proxy = fencegate::app::start(support::config(double.addr, dir.path()), Some(store))
        .await
        .expect("restart");
    let client = Client::new(proxy.proxy_addr);
    let retry = client
        .send(
            "PUT",
            "/idem/gone",
            &[("fencing-token", "1"), KEY, ("x-test-hold", "gone")],
            "pay 5",
        )
        .await;
    assert_eq!((retry.status, retry.result()), (200, "duplicate"));
    assert_eq!(retry.body, "PUT /idem/gone token=1");
    assert_eq!(
        double
            .seen()
            .iter()
            .filter(|s| s.target == "/idem/gone")
            .count(),
        1,
        "applied once"
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn concurrent_duplicates_are_in_progress_then_replayed() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start(support::config(double.addr, dir.path())).await;
    let client = Client::new(proxy.proxy_addr);
    let c = client.clone();
    let first = tokio::spawn(async move {
        c.send(
            "POST",
            "/idem/b",
            &[("fencing-token", "3"), KEY, ("x-test-hold", "b")],
            "x",
        )
        .await
    });
    double.arrived("b").await;
    // A retry repeats the request, its headers included (the double's hold too).
    let hold = ("x-test-hold", "b");
    let dup = client
        .send("POST", "/idem/b", &[("fencing-token", "3"), KEY, hold], "x")
        .await;
    assert_eq!((dup.status, dup.result()), (409, "in_progress"));
    assert!(dup.headers.contains_key("retry-after"));
    let reused = client
        .send("POST", "/idem/b", &[("fencing-token", "3"), KEY, hold], "y")
        .await;
    assert_eq!((reused.status, reused.result()), (422, "key_reused"));
    double.release("b");
    let first = first.await.unwrap();
    assert_eq!((first.status, first.result()), (200, "accepted"));
    let again = settled(
        &client,
        "/idem/b",
        &[("fencing-token", "3"), KEY, hold],
        "x",
    )
    .await;
    assert_eq!(
        again.result(),
        "key_reused",
        "PUT is another request than POST"
    );
    let again = client
        .send("POST", "/idem/b", &[("fencing-token", "3"), KEY, hold], "x")
        .await;
    assert_eq!((again.status, again.result()), (200, "duplicate"));
    assert_eq!(
        double
            .seen()
            .iter()
            .filter(|s| s.target == "/idem/b")
            .count(),
        1
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn unknown_outcomes_are_refused_or_forwarded_by_route() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let text = support::config_text(double.addr, "10s", "0s", "200ms");
    let config = fencegate::settings::Config::parse(&text, dir.path()).unwrap();
    let proxy = support::start(config).await;
    let client = Client::new(proxy.proxy_addr);

    // The upstream never answers in time: the outcome is unknown.
    let r = client
        .send(
            "PUT",
            "/idem/c",
            &[("fencing-token", "1"), KEY, ("x-test-hold", "c")],
            "z",
        )
        .await;
    assert_eq!((r.status, r.result()), (504, "upstream_timeout"));
    // A retry repeats the request, its headers included.
    let retry = client
        .send(
            "PUT",
            "/idem/c",
            &[("fencing-token", "1"), KEY, ("x-test-hold", "c")],
            "z",
        )
        .await;
    assert_eq!((retry.status, retry.result()), (409, "outcome_unknown"));
    assert_eq!(
        double
            .seen()
            .iter()
            .filter(|s| s.target == "/idem/c")
            .count(),
        1
    );

    // On a route that says `idempotency_unknown = "forward"`, the retry goes again.
    let r = client
        .send(
            "PUT",
            "/idemreq/c",
            &[("fencing-token", "1"), KEY, ("x-test-hold", "c2")],
            "z",
        )
        .await;
    assert_eq!(r.result(), "upstream_timeout");
    double.release("c2");
    let retry = client
        .send(
            "PUT",
            "/idemreq/c",
            &[("fencing-token", "1"), KEY, ("x-test-hold", "c2")],
            "z",
        )
        .await;
    assert_eq!((retry.status, retry.result()), (200, "accepted"));
    assert_eq!(
        double
            .seen()
            .iter()
            .filter(|s| s.target == "/idemreq/c")
            .count(),
        2
    );

    // `required`: a fenced method without a key is refused; a malformed key too.
    let r = client.put("/idemreq/d", "1", "").await;
    assert_eq!((r.status, r.result()), (400, "invalid_request"));
    let r = client
        .send(
            "PUT",
            "/idemreq/d",
            &[("fencing-token", "1"), ("idempotency-key", "bare")],
            "",
        )
        .await;
    assert_eq!((r.status, r.result()), (400, "invalid_request"));
    let r = client
        .send("PUT", "/idemreq/d", &[("fencing-token", "1"), KEY, KEY], "")
        .await;
    assert_eq!((r.status, r.result()), (400, "invalid_request"));
    double.release("c");
    proxy.shutdown().await;
}

/// An upstream that answers `x-stall` requests with a head and the start of a chunked body,
/// then sends nothing more (the connection stays open); other requests get a whole answer.
async fn stalling_upstream() -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    // One request: its head, then its body (Content-Length).
                    let end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    while buf.len() < end + length {
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    buf.drain(..end + length);
                    if head.contains("x-stall:") {
                        let _ = stream
                            .write_all(
                                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n",
                            )
                            .await;
                        // Never finishes; the connection is held open until the test ends.
                        std::future::pending::<()>().await;
                    }
                    if stream
                        .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// An upstream that sends its head, then stalls the body, must not hold the scope: the
/// body read is bounded by the upstream timeout (counted from the start of the exchange),
/// the attempt is answered 504 and recorded as unknown, and its generation leaves the gate
/// as a timed-out request does: in flight no more, with the scope settling.
#[tokio::test]
async fn a_stalled_response_body_ends_at_the_upstream_timeout() {
    let upstream = stalling_upstream().await;
    // (drain, settle): first with nothing to settle, then with a settle that outlasts the test.
    for (drain, settle) in [("10s", "0s"), ("1s", "1h")] {
        let dir = tempfile::tempdir().unwrap();
        let text = support::config_text(upstream, drain, settle, "300ms");
        let config = fencegate::settings::Config::parse(&text, dir.path()).unwrap();
        let proxy = support::start(config).await;
        let client = Client::new(proxy.proxy_addr);
        let first = client
            .send(
                "PUT",
                "/idem/stall",
                &[("fencing-token", "1"), KEY, ("x-stall", "1")],
                "pay 1",
            )
            .await;
        assert_eq!((first.status, first.result()), (504, "upstream_timeout"));
        // Its retry is not applied again: the outcome is unknown, not in progress.
        let retry = client
            .send(
                "PUT",
                "/idem/stall",
                &[("fencing-token", "1"), KEY, ("x-stall", "1")],
                "pay 1",
            )
            .await;
        assert_eq!((retry.status, retry.result()), (409, "outcome_unknown"));
        let newer = client.put("/idem/stall", "2", "owner 2").await;
        if settle == "0s" {
            // Nothing in flight any more: the newer generation goes at once.
            assert_eq!((newer.status, newer.result()), (200, "accepted"));
        } else {
            // The upstream may still apply the stalled request: the scope settles.
            assert_eq!((newer.status, newer.result()), (503, "draining"));
        }
        proxy.shutdown().await;
    }
}

/// An old owner that sends its head and part of its body on an idempotency route, then
/// pauses with its connection open, holds its generation only for the upstream's timeout:
/// the body is read under that timeout (as on routes without idempotency), the old request
/// is answered 400 with nothing of it forwarded, and the new owner's write goes through
/// instead of draining until the old owner hangs up.
#[tokio::test]
async fn a_stalled_request_body_does_not_hold_up_the_next_generation() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let text = support::config_text(double.addr, "10s", "0s", "300ms");
    let config = fencegate::settings::Config::parse(&text, dir.path()).unwrap();
    let proxy = support::start(config).await;
    let admin = Client::new(proxy.admin_addr);

    let mut old = tokio::net::TcpStream::connect(proxy.proxy_addr)
        .await
        .unwrap();
    old.write_all(
        b"PUT /idem/p HTTP/1.1\r\nHost: a\r\nFencing-Token: 41\r\nIdempotency-Key: \"k\"\r\n\
          Content-Length: 100\r\n\r\nonly part of it",
    )
    .await
    .unwrap();
    // Its advance becomes the scope's mark in the same step that admits it; from then on
    // it waits for the rest of its body.
    tokio::time::timeout(BOUND, async {
        while admin.get("/v1/scopes/idem%2Fp").await.json()["highest_accepted"] != "41" {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the old owner is admitted");

    let newer = Client::new(proxy.proxy_addr)
        .put("/idem/p", "42", "newer")
        .await;
    assert_eq!((newer.status, newer.result()), (200, "accepted"));
    let mut answer = Vec::new();
    tokio::time::timeout(BOUND, old.read_to_end(&mut answer))
        .await
        .expect("the old owner is answered")
        .unwrap();
    assert!(
        answer.starts_with(b"HTTP/1.1 400"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    assert_eq!(double.count_token("41"), 0, "nothing of it was forwarded");
    proxy.shutdown().await;
}

/// kill -9 while the first attempt is at the upstream: the durable record survives; after
/// the restart the retry is not silently applied again.
#[tokio::test]
async fn crash_between_record_and_answer_leaves_an_unknown_outcome() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = write_config(dir.path(), double.addr);
    let mut proc = spawn(&config, p, a);
    let client = Client::new(proc.proxy);
    let c = client.clone();
    let first = tokio::spawn(async move {
        c.send(
            "PUT",
            "/idem/crash",
            &[("fencing-token", "1"), KEY, ("x-test-hold", "crash")],
            "q",
        )
        .await
    });
    double.arrived("crash").await;
    proc.child.kill().unwrap();
    proc.child.wait().unwrap();
    let _ = first.await;
    double.release("crash");

    let mut proc = spawn(&config, p, a);
    let client = Client::new(proc.proxy);
    let r = client
        .send(
            "PUT",
            "/idem/crash",
            &[("fencing-token", "1"), KEY, ("x-test-hold", "crash")],
            "q",
        )
        .await;
    assert_eq!((r.status, r.result()), (409, "outcome_unknown"));
    assert_eq!(
        double
            .seen()
            .iter()
            .filter(|s| s.target == "/idem/crash")
            .count(),
        1
    );
    proc.child.kill().unwrap();
    proc.child.wait().unwrap();
}

/// Records expire after their TTL and are collected in bounded batches.
#[tokio::test]
async fn records_expire_and_are_collected() {
    let dir = tempfile::tempdir().unwrap();
    let store = MarkStore::open(&dir.path().join("m.redb")).unwrap();
    let record = |expires: u64| {
        let mut v = expires.to_be_bytes().to_vec();
        v.extend_from_slice(&[0, 0, 0, 2, b'{', b'}']);
        v
    };
    for i in 0..25u64 {
        let claimed = store
            .claim(format!("s\0k{i}"), record(100 + i), None, 50)
            .await
            .unwrap();
        assert!(claimed.is_none());
    }
    // A live record blocks a second claim; an expired one does not.
    assert!(
        store
            .claim("s\0k0".into(), record(500), None, 60)
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(store.record_count().unwrap(), 25);
    assert_eq!(
        store.collect_records(109, 4).await.unwrap(),
        4,
        "bounded batch"
    );
    assert_eq!(store.collect_records(109, 100).await.unwrap(), 6);
    assert_eq!(store.record_count().unwrap(), 15);
    assert!(
        store
            .claim("s\0k20".into(), record(900), None, 200)
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(store.collect_records(10_000, 100).await.unwrap(), 15);
    assert_eq!(store.record_count().unwrap(), 0);
}

/// The Rust client sees a replay as `Duplicate`, and an unknown first attempt as `Unknown`.
#[tokio::test]
async fn the_client_library_reports_duplicates() {
    use fencegate::client::{Fence, FenceResult, FencedHttp};
    use http::{HeaderMap, HeaderValue, Method};

    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start(support::config(double.addr, dir.path())).await;
    let http = FencedHttp::new(&format!("http://{}", proxy.proxy_addr)).unwrap();
    let fence = Fence::new("idem/lib", fencegate::token::Token::new(0, 4));
    let mut headers = HeaderMap::new();
    headers.insert("idempotency-key", HeaderValue::from_static("\"lib-1\""));
    let send = || {
        http.send(
            &fence,
            Method::POST,
            "/idem/lib",
            headers.clone(),
            bytes::Bytes::from_static(b"charge"),
        )
    };
    assert!(matches!(send().await.unwrap(), FenceResult::Applied { .. }));
    match settled_lib(send).await {
        FenceResult::Duplicate { status, body, .. } => {
            assert_eq!(status, 200);
            assert_eq!(body, "POST /idem/lib token=4");
        }
        other => panic!("expected Duplicate, got {other:?}"),
    }
    assert_eq!(
        double
            .seen()
            .iter()
            .filter(|s| s.target == "/idem/lib")
            .count(),
        1
    );
    proxy.shutdown().await;
}

/// Retries while the first attempt's record is still being completed.
async fn settled_lib<F, Fut>(send: F) -> fencegate::client::FenceResult
where
    F: Fn() -> Fut,
    Fut: std::future::Future<
            Output = Result<fencegate::client::FenceResult, fencegate::client::FencedError>,
        >,
{
    use fencegate::client::FenceResult;
    tokio::time::timeout(BOUND, async {
        loop {
            match send().await.unwrap() {
                FenceResult::Transient { result, .. } if result == "in_progress" => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                other => return other,
            }
        }
    })
    .await
    .expect("settles")
}
