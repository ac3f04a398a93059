//! End to end through real sockets: the paused-writer story (against nginx WebDAV and an
//! in-process double), delayed delivery, store failure, crash recovery and graceful
//! shutdown of the real binary.

use crate::support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use support::{BOUND, Client, Double, spawn, write_config};

/// The mission's story against a real legacy store: nginx with WebDAV, no conditional
/// writes. Through fencegate the stale writer is refused; straight to nginx it wins.
#[tokio::test]
async fn paused_writer_story_against_nginx_webdav() {
    let nginx = support::nginx::Nginx::webdav().expect("nginx (run scripts/test.sh)");
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start(support::config(nginx.addr(), dir.path())).await;
    let via = Client::new(proxy.proxy_addr);

    // A holds token 41 and writes its temporary object, then pauses.
    let r = via.put("/reports/july/tmp-a", "41", "draft by A").await;
    assert_eq!((r.status, r.result()), (201, "accepted"));
    // A's lease expires; B acquires 42 and publishes.
    let r = via.put("/reports/july/final", "42", "report by B").await;
    assert_eq!((r.status, r.result()), (201, "accepted"));
    // A resumes and publishes with its old token: refused at the destination.
    let r = via.put("/reports/july/final", "41", "report by A").await;
    assert_eq!((r.status, r.result()), (409, "stale_fence"));
    assert_eq!(r.json()["highest_accepted"], "42");
    let r = via.get("/reports/july/final").await;
    assert_eq!((r.status, r.body.as_str()), (200, "report by B"));
    let on_disk = std::fs::read_to_string(nginx.root().join("reports/july/final")).unwrap();
    assert_eq!(on_disk, "report by B");

    // Without the fence the same sequence loses B's work silently.
    let direct = Client::new(nginx.addr());
    assert_eq!(
        direct
            .put("/reports/june/final", "42", "report by B")
            .await
            .status,
        201
    );
    assert_eq!(
        direct
            .put("/reports/june/final", "41", "report by A")
            .await
            .status,
        204
    );
    assert_eq!(direct.get("/reports/june/final").await.body, "report by A");
    proxy.shutdown().await;
}

/// nginx's WebDAV module writes a COPY's or MOVE's `Destination` too (on its own server,
/// whatever host the header names). Through fencegate, a stale owner of one scope cannot
/// copy over another scope's object, nor can a pass-through request move into it; a copy
/// within the owner's own scope goes through. Straight to nginx the stale copy wins.
#[tokio::test]
async fn a_webdav_copy_cannot_write_another_scope() {
    let nginx = support::nginx::Nginx::webdav().expect("nginx (run scripts/test.sh)");
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start(support::config(nginx.addr(), dir.path())).await;
    let via = Client::new(proxy.proxy_addr);
    let here = proxy.proxy_addr;

    let r = via.put("/reports/june/draft", "1", "stale draft").await;
    assert_eq!((r.status, r.result()), (201, "accepted"));
    let r = via.put("/reports/july/final", "42", "report by B").await;
    assert_eq!((r.status, r.result()), (201, "accepted"));
    let public = via.send("PUT", "/public/loose", &[], "loose file").await;
    assert_eq!(public.status, 201);

    let copy = [
        ("fencing-token", "1"),
        ("destination", &*format!("http://{here}/reports/july/final")),
        ("overwrite", "T"),
    ];
    let r = via.send("COPY", "/reports/june/draft", &copy, "").await;
    assert_eq!((r.status, r.result()), (400, "multi_scope"), "{r:?}");
    let moved = [("destination", "/reports/jul%79/final"), ("overwrite", "T")];
    let r = via.send("MOVE", "/public/loose", &moved, "").await;
    assert_eq!((r.status, r.result()), (400, "invalid_request"), "{r:?}");
    let final_path = nginx.root().join("reports/july/final");
    assert_eq!(std::fs::read_to_string(&final_path).unwrap(), "report by B");
    assert!(nginx.root().join("public/loose").exists());

    // Within its own scope the copy is fenced and done.
    let own = [
        ("fencing-token", "1"),
        ("destination", &*format!("http://{here}/reports/june/final")),
    ];
    let r = via.send("COPY", "/reports/june/draft", &own, "").await;
    assert!(matches!(r.status, 201 | 204), "{r:?}");
    assert_eq!(r.result(), "accepted");
    let copied = std::fs::read_to_string(nginx.root().join("reports/june/final")).unwrap();
    assert_eq!(copied, "stale draft");

    // Straight to nginx, the same stale copy overwrites B's report.
    let direct = Client::new(nginx.addr());
    let dest = format!("http://{}/reports/july/final", nginx.addr());
    let r = direct
        .send(
            "COPY",
            "/reports/june/draft",
            &[("destination", &*dest)],
            "",
        )
        .await;
    assert_eq!(r.status, 204, "{r:?}");
    assert_eq!(std::fs::read_to_string(&final_path).unwrap(), "stale draft");
    proxy.shutdown().await;
}

/// nginx's `return 204` answers without reading a request's body. Were the request
/// forwarded before its body had arrived, the answer could come back while the body is
/// still on its way; the client's connection then cannot carry another request (it is
/// closed after the answer, and a client that sent its next request on it sees a broken
/// pipe). A small body is read whole before the request goes upstream: sent apart from
/// its head, it holds the answer back, and the connection stays usable.
#[tokio::test]
async fn keep_alive_survives_an_upstream_that_ignores_the_body() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let nginx = support::nginx::Nginx::null().expect("nginx (run scripts/test.sh)");
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start(support::config(nginx.addr(), dir.path())).await;
    let mut conn = tokio::net::TcpStream::connect(proxy.proxy_addr)
        .await
        .expect("connect");
    conn.set_nodelay(true).expect("nodelay");
    let head = b"PUT /reports/ka/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\n\
                 Content-Length: 1\r\n\r\n";
    let mut buf = Vec::new();
    for i in 0..3 {
        conn.write_all(head).await.expect("head");
        // Nothing is forwarded, so nothing answered, while the body is missing (with the
        // head forwarded at once, nginx's answer would be back within a millisecond).
        let mut chunk = [0u8; 512];
        let early = tokio::time::timeout(Duration::from_millis(300), conn.read(&mut chunk)).await;
        assert!(
            early.is_err(),
            "request {i}: answered before its body: {early:?}"
        );
        conn.write_all(b"x").await.expect("body");
        // A 204 has no body: its head is the whole answer.
        buf.clear();
        while !buf.ends_with(b"\r\n\r\n") {
            let n = tokio::time::timeout(BOUND, conn.read(&mut chunk))
                .await
                .expect("an answer within the bound")
                .unwrap_or(0);
            assert!(
                n > 0,
                "request {i}: the connection was closed after {buf:?}"
            );
            buf.extend_from_slice(&chunk[..n]);
        }
        assert!(buf.starts_with(b"HTTP/1.1 204"), "request {i}: {buf:?}");
    }
    proxy.shutdown().await;
}

/// Waits (bounded) until `n` requests wait at gates: the proof that a request is being
/// held back by the fence rather than merely slow.
async fn until_waiting(proxy: &fencegate::app::Running, n: usize) {
    tokio::time::timeout(BOUND, async {
        while proxy.app.gates.waiting() != n {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .expect("requests waiting at the gate");
}

/// A's token-41 write is delayed inside the upstream; B's 42 arrives. 42 must reach the
/// backend only after 41 finished; a fresh 41 after 42 was admitted never reaches it.
#[tokio::test]
async fn delayed_delivery_is_ordered_at_the_backend() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start(support::config(double.addr, dir.path())).await;
    let client = Client::new(proxy.proxy_addr);

    let c = client.clone();
    let a = tokio::spawn(async move {
        c.send(
            "PUT",
            "/reports/july/final",
            &[("fencing-token", "41"), ("x-test-hold", "a")],
            "A",
        )
        .await
    });
    double.arrived("a").await;

    let c = client.clone();
    let b = tokio::spawn(async move { c.put("/reports/july/final", "42", "B").await });
    until_waiting(&proxy, 1).await;
    assert_eq!(
        proxy.app.store.get("report/july").unwrap(),
        Some(fencegate::token::Token::new(0, 42)),
        "42 is durable before it waits"
    );
    assert_eq!(double.count_token("42"), 0, "42 must wait for 41 to finish");

    // 42 is admitted: a new request with 41 is stale and never forwarded.
    let late = client.put("/reports/july/other", "41", "A again").await;
    assert_eq!((late.status, late.result()), (409, "stale_fence"));
    assert_eq!(double.count_token("41"), 1);

    double.release("a");
    let a = a.await.unwrap();
    assert_eq!((a.status, a.result()), (200, "accepted"));
    let b = b.await.unwrap();
    assert_eq!((b.status, b.result()), (200, "accepted"));
    let order: Vec<String> = double
        .seen()
        .iter()
        .filter_map(|s| s.header("fencing-token").map(str::to_string))
        .collect();
    assert_eq!(order, ["41", "42"]);
    proxy.shutdown().await;
}

/// A drain that outlasts `drain_timeout` answers 503 draining with Retry-After, and an
/// upstream timeout makes the scope settle before a newer generation is forwarded.
#[tokio::test]
async fn draining_and_settle_over_http() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let text = support::config_text(double.addr, "300ms", "1h", "200ms");
    let config = fencegate::settings::Config::parse(&text, dir.path()).unwrap();
    let proxy = support::start(config).await;
    let client = Client::new(proxy.proxy_addr);

    // 41 is sent and never answered within the upstream timeout: outcome unknown.
    let r = client
        .send(
            "PUT",
            "/reports/july/x",
            &[("fencing-token", "41"), ("x-test-hold", "slow")],
            "A",
        )
        .await;
    assert_eq!((r.status, r.result()), (504, "upstream_timeout"));
    // The backend may still apply 41, so 42 must not be forwarded until settle passes.
    let r = client.put("/reports/july/x", "42", "B").await;
    assert_eq!((r.status, r.result()), (503, "draining"));
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(double.count_token("42"), 0);
    double.release("slow");
    proxy.shutdown().await;
}

/// An upstream that answers every request `200` with an empty body as soon as its head
/// has come, before reading any of its body (which it then reads and drops); how many
/// requests it answered so.
async fn answers_on_the_head() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let answered = Arc::new(AtomicUsize::new(0));
    let count = answered.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                if conn
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    .await
                    .is_ok()
                {
                    count.fetch_add(1, Ordering::SeqCst);
                }
                while matches!(conn.read(&mut buf).await, Ok(n) if n > 0) {}
            });
        }
    });
    (addr, answered)
}

/// An answer that does not confirm the write was applied leaves the generation
/// indeterminate (SPEC §3, invariant 3), as a lost answer does: the scope settles, and the
/// next token is 503 `draining` (here `settle` outlasts the test) and never forwarded.
/// Such answers: a 202 Accepted (with or without an `Idempotency-Key`), and a 200 that an
/// upstream sent on the request's head, complete before fencegate had written the body
/// (the client is still sending it). A 200 given after the whole body is the control: the
/// next token goes at once.
#[tokio::test]
async fn an_answer_that_does_not_confirm_the_write_settles() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let double = Double::start().await;
    let (early, answered) = answers_on_the_head().await;
    let dir = tempfile::tempdir().unwrap();
    let text = support::config_text(double.addr, "300ms", "1h", "10s")
        + &format!(
            r#"
[[upstream]]
name = "early"
url = "http://{early}"
[[route]]
name = "early"
path = "/early/{{k}}"
scope = "early/{{k}}"
upstream = "early"
"#
        );
    let proxy = support::start_text(&text, dir.path()).await;
    let client = Client::new(proxy.proxy_addr);

    // Control: an answer after the whole request leaves nothing to settle, whichever
    // way the body went (in memory, streamed with a length, chunked).
    let r = client.put("/reports/done/x", "1", "A").await;
    assert_eq!((r.status, r.result()), (200, "accepted"));
    let big = "b".repeat(100 * 1024);
    let r = client.put("/reports/big/x", "1", &big).await;
    assert_eq!((r.status, r.result()), (200, "accepted"));
    let (status, text) = support::raw(
        proxy.proxy_addr,
        b"PUT /reports/chunked/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\n\
          Connection: close\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!(status, 200, "{text}");
    for path in ["/reports/done/x", "/reports/big/x", "/reports/chunked/x"] {
        let r = client.put(path, "2", "B").await;
        assert_eq!((r.status, r.result()), (200, "accepted"), "{path}");
    }
    let bodies: Vec<usize> = double.seen().iter().map(|s| s.body.len()).collect();
    assert_eq!(
        bodies,
        [1, 100 * 1024, 5, 1, 1, 1],
        "each body reached the upstream whole"
    );

    // 202: queued, maybe applied later; so with a key, whose record replays the 202.
    for (path, key) in [
        ("/reports/queued/x", None),
        ("/idem/queued", Some("\"q-1\"")),
    ] {
        let mut headers = vec![("fencing-token", "1"), ("x-test-status", "202")];
        if let Some(key) = key {
            headers.push(("idempotency-key", key));
        }
        let r = client.send("PUT", path, &headers, "A").await;
        assert_eq!((r.status, r.result()), (202, "accepted"), "{path}");
        let r = client.put(path, "2", "B").await;
        assert_eq!((r.status, r.result()), (503, "draining"), "{path}");
        assert!(r.headers.contains_key("retry-after"));
    }
    assert_eq!(
        double.count_token("2"),
        3,
        "only the controls' token 2 was forwarded"
    );

    // A 200 on the head while the body is still coming: chunked, its end never sent.
    let mut conn = tokio::net::TcpStream::connect(proxy.proxy_addr)
        .await
        .expect("connect");
    conn.write_all(
        b"PUT /early/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\n\
          Transfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n",
    )
    .await
    .expect("write");
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    tokio::time::timeout(BOUND, async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = conn.read(&mut buf).await.expect("read");
            assert!(n > 0, "closed before an answer");
            head.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .expect("an answer within the bound");
    let head = String::from_utf8_lossy(&head).to_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("fencing-result: accepted"), "{head}");
    let r = client.put("/early/x", "2", "B").await;
    assert_eq!((r.status, r.result()), (503, "draining"));
    assert_eq!(
        answered.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "token 2 never forwarded"
    );
    drop(conn);
    proxy.shutdown().await;
}

/// A commit that fails answers 503 unavailable, forwards nothing, and flips /readyz.
#[tokio::test]
async fn store_failure_answers_unavailable_and_forwards_nothing() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (proxy, disk) = support::start_on_disk(double.addr, dir.path()).await;
    let client = Client::new(proxy.proxy_addr);
    let admin = Client::new(proxy.admin_addr);

    assert_eq!(client.put("/reports/july/x", "1", "ok").await.status, 200);
    assert_eq!(admin.get("/readyz").await.status, 200);
    disk.set_broken(true);
    let r = client.put("/reports/july/x", "2", "lost").await;
    assert_eq!((r.status, r.result()), (503, "unavailable"));
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(r.json()["token"], "2");
    assert_eq!(double.count_token("2"), 0, "nothing forwarded");
    let r = client.put("/reports/august/x", "1", "new scope").await;
    assert_eq!((r.status, r.result()), (503, "unavailable"));
    assert_eq!(admin.get("/readyz").await.status, 503);
    let metrics = admin.get("/metrics").await.body;
    assert!(metrics.contains("fencegate_store_failed 1"), "{metrics}");
    assert!(metrics.contains("fencegate_mark_commit_failures_total 1"));
    proxy.shutdown().await;
}

/// kill -9 right after an accepted advance: the mark was durable before the request was
/// forwarded, so after a restart the lower token is still refused.
#[tokio::test]
async fn crash_after_accepted_advance_keeps_the_mark() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = write_config(dir.path(), double.addr);
    let mut proc = spawn(&config, p, a);
    let client = Client::new(proc.proxy);
    let r = client.put("/reports/july/x", "7", "B").await;
    assert_eq!((r.status, r.result()), (200, "accepted"));
    proc.child.kill().unwrap(); // SIGKILL: no shutdown path runs
    proc.child.wait().unwrap();

    let mut proc = spawn(&config, p, a);
    let client = Client::new(proc.proxy);
    let r = client.put("/reports/july/x", "6", "stale").await;
    assert_eq!((r.status, r.result()), (409, "stale_fence"));
    assert_eq!(r.json()["highest_accepted"], "7");
    assert_eq!(double.count_token("6"), 0);
    let r = client.put("/reports/july/x", "7", "same owner").await;
    assert_eq!(r.status, 200);

    // The CLI reads marks while the server runs.
    let out = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["marks", "get", "report/july", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "7");
    let admin = Client::new(proc.admin);
    assert_eq!(admin.get("/healthz").await.status, 200);
    proc.child.kill().unwrap();
    proc.child.wait().unwrap();
}

/// SIGTERM stops accepting and lets an in-flight request finish, then exits 0.
#[tokio::test]
async fn sigterm_finishes_in_flight_requests() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = write_config(dir.path(), double.addr);
    let mut proc = spawn(&config, p, a);
    let client = Client::new(proc.proxy);
    let c = client.clone();
    let inflight = tokio::spawn(async move {
        c.send(
            "PUT",
            "/reports/july/x",
            &[("fencing-token", "3"), ("x-test-hold", "term")],
            "body",
        )
        .await
    });
    double.arrived("term").await;
    support::signal(proc.child.id(), "TERM");
    // New connections are refused once the listener is closed.
    tokio::time::timeout(BOUND, async {
        while tokio::net::TcpStream::connect(proc.proxy).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("listener closed after SIGTERM");
    double.release("term");
    let r = inflight.await.unwrap();
    assert_eq!((r.status, r.result()), (200, "accepted"));
    let status = tokio::task::spawn_blocking(move || proc.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "exit status {status:?}");
}

/// A proxy on `store`, with a short `shutdown_timeout` (100 ms): shutdown then takes at
/// most that plus `CLOSE_AFTER_GRACE`, whatever the disk does.
async fn start_on_store(
    upstream: std::net::SocketAddr,
    dir: &Path,
    store: fencegate::store::MarkStore,
) -> fencegate::app::Running {
    let text = support::config_text(upstream, "10s", "0s", "10s")
        .replace("shutdown_timeout = \"10s\"", "shutdown_timeout = \"100ms\"");
    let config = fencegate::settings::Config::parse(&text, dir).expect("config");
    fencegate::app::start(config, Some(store))
        .await
        .expect("start proxy")
}

/// Runs `proxy.shutdown()` on a thread of its own and waits for it within [`BOUND`], so
/// that a shutdown blocked in the disk fails the test instead of hanging it.
async fn shut_down_within_bound(proxy: fencegate::app::Running) {
    let (done, returned) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(proxy.shutdown());
        let _ = done.send(());
    });
    tokio::time::timeout(BOUND, returned)
        .await
        .expect("shutdown returns while the disk hangs")
        .expect("shutdown thread");
}

async fn wait_for_a_held_sync(disk: &support::disk::Disk) {
    tokio::time::timeout(BOUND, async {
        while !disk.syncing() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("a commit reaches the held disk");
}

/// SIGTERM while a commit hangs at the disk (an fsync that never returns): shutdown ends
/// the request waiting for it after `shutdown_timeout`, gives the store until
/// `CLOSE_AFTER_GRACE` later to close, and returns without it.
#[tokio::test]
async fn shutdown_returns_while_a_commit_hangs() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let disk = support::disk::Disk::new();
    let store = fencegate::store::MarkStore::open_with_backend(disk.clone()).expect("store");
    let proxy = start_on_store(double.addr, dir.path(), store).await;
    disk.hold();
    let client = Client::new(proxy.proxy_addr);
    let waiting = tokio::spawn(async move { client.try_put("/reports/july/x", "1").await });
    wait_for_a_held_sync(&disk).await;
    shut_down_within_bound(proxy).await;
    assert!(disk.syncing(), "the commit is still held");
    assert_ne!(waiting.await.unwrap(), Some(200));
    assert_eq!(double.count_token("1"), 0, "nothing forwarded");
    disk.release();
}

/// The collection of expired idempotency records (at start-up, then every 60 s) waits for
/// its commit; stuck at a hung disk, it does not hold shutdown up either.
#[tokio::test]
async fn shutdown_returns_while_a_collection_hangs() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let disk = support::disk::Disk::new();
    let store = fencegate::store::MarkStore::open_with_backend(disk.clone()).expect("store");
    // An expired record (expiry, an empty JSON record), for the first collection to delete.
    let mut expired = 1u64.to_be_bytes().to_vec();
    expired.extend_from_slice(&[0, 0, 0, 2, b'{', b'}']);
    let claimed = store.claim("s\0k".into(), expired, None, 0).await;
    assert!(claimed.expect("claim").is_none());
    disk.hold();
    let proxy = start_on_store(double.addr, dir.path(), store).await;
    wait_for_a_held_sync(&disk).await;
    shut_down_within_bound(proxy).await;
    assert!(disk.syncing(), "the collection's commit is still held");
    disk.release();
}

/// With nothing to commit when the disk hangs, the store closes, but the last handle's
/// drop writes and syncs the file's clean-shutdown header: that waits for the disk too,
/// and does not hold shutdown up.
#[tokio::test]
async fn shutdown_returns_while_the_disk_hangs_with_nothing_to_commit() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let disk = support::disk::Disk::new();
    let store = fencegate::store::MarkStore::open_with_backend(disk.clone()).expect("store");
    let proxy = start_on_store(double.addr, dir.path(), store).await;
    let client = Client::new(proxy.proxy_addr);
    assert_eq!(client.put("/reports/july/x", "1", "a").await.status, 200);
    disk.hold();
    shut_down_within_bound(proxy).await;
    wait_for_a_held_sync(&disk).await;
    disk.release();
}

/// backup (while serving) → restore into another store merges by max, never lowering.
#[tokio::test]
async fn backup_and_restore_merge_by_max() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = write_config(dir.path(), double.addr);
    let mut proc = spawn(&config, p, a);
    let client = Client::new(proc.proxy);
    for (report, token) in [("a", "5"), ("b", "1:3"), ("c", "9")] {
        let r = client.put(&format!("/reports/{report}/x"), token, "").await;
        assert_eq!(r.status, 200);
    }
    let backup = dir.path().join("marks.jsonl");
    let run = |args: &[&str], cfg: &Path| {
        Command::new(env!("CARGO_BIN_EXE_fencegate"))
            .args(args)
            .arg("--config")
            .arg(cfg)
            .output()
            .unwrap()
    };
    let out = run(&["backup", "--out", backup.to_str().unwrap()], &config);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&backup).unwrap();
    assert_eq!(text.lines().count(), 5, "{text}");
    assert_eq!(
        text.lines().last(),
        Some(r#"{"fencegate_backup_end":3}"#),
        "{text}"
    );
    // Restore refuses while the server holds the store.
    assert!(
        !run(&["restore", "--in", backup.to_str().unwrap()], &config)
            .status
            .success()
    );
    proc.child.kill().unwrap();
    proc.child.wait().unwrap();
    // With the server stopped the file is read directly: the same backup, end line too.
    let offline = dir.path().join("marks-offline.jsonl");
    let out = run(&["backup", "--out", offline.to_str().unwrap()], &config);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(std::fs::read_to_string(&offline).unwrap(), text);

    // A second store already has a higher mark for c: restore must not lower it.
    let other = tempfile::tempdir().unwrap();
    let (config2, p2, a2) = write_config(other.path(), double.addr);
    let mut proc2 = spawn(&config2, p2, a2);
    assert_eq!(
        Client::new(proc2.proxy)
            .put("/reports/c/x", "20", "")
            .await
            .status,
        200
    );
    proc2.child.kill().unwrap();
    proc2.child.wait().unwrap();
    let out = run(&["restore", "--in", backup.to_str().unwrap()], &config2);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&["marks", "list"], &config2);
    let listed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(listed, "5\treport/a\n1:3\treport/b\n20\treport/c\n");
}

/// `marks list` answers the same from a running server and from the file: `--limit 0` is
/// refused (exit 1) in both, and a limit lists as many marks either way.
#[tokio::test]
async fn marks_list_limits_are_the_same_online_and_offline() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = write_config(dir.path(), double.addr);
    let mut proc = spawn(&config, p, a);
    let client = Client::new(proc.proxy);
    for report in ["a", "b", "c"] {
        let r = client.put(&format!("/reports/{report}/x"), "7", "").await;
        assert_eq!(r.status, 200);
    }
    let list = |limit: &str| {
        Command::new(env!("CARGO_BIN_EXE_fencegate"))
            .args(["marks", "list", "--limit", limit, "--config"])
            .arg(&config)
            .output()
            .unwrap()
    };
    let check = |mode: &str| {
        let out = list("0");
        assert_eq!(out.status.code(), Some(1), "{mode}: --limit 0");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("--limit must be at least 1"),
            "{mode}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = list("2");
        assert!(out.status.success(), "{mode}");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "7\treport/a\n7\treport/b\n",
            "{mode}"
        );
    };
    check("online");
    proc.child.kill().unwrap();
    proc.child.wait().unwrap();
    check("offline");
}

/// `restore` checks a format-2 backup before it touches the store: one header, first; the
/// end line last, counting the marks. A file failing that restores nothing. Format 1 has
/// no end line and is still accepted.
#[test]
fn restore_refuses_a_backup_that_is_not_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (config, _, _) = write_config(dir.path(), ([127, 0, 0, 1], 9).into());
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_fencegate"))
            .args(args)
            .arg("--config")
            .arg(&config)
            .output()
            .unwrap()
    };
    let restore = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        let out = run(&["restore", "--in", path.to_str().unwrap()]);
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let header = "{\"fencegate_backup\":2,\"epoch_floor\":0}\n";
    let (ok, err) = restore(
        "whole.jsonl",
        &format!("{header}{{\"scope\":\"a\",\"token\":\"1\"}}\n{{\"fencegate_backup_end\":1}}\n"),
    );
    assert!(ok, "{err}");

    // Each would raise a and the floor, were it restored.
    let higher = "{\"fencegate_backup\":2,\"epoch_floor\":3}\n";
    let marks = "{\"scope\":\"a\",\"token\":\"3:9\"}\n{\"scope\":\"b\",\"token\":\"3:1\"}\n";
    for (name, text, want) in [
        (
            "no-end.jsonl",
            format!("{higher}{marks}"),
            "the backup is incomplete: ",
        ),
        (
            "wrong-count.jsonl",
            format!("{higher}{marks}{{\"fencegate_backup_end\":3}}\n"),
            "the backup is incomplete: its end line counts 3 marks",
        ),
        (
            "after-end.jsonl",
            format!(
                "{higher}{marks}{{\"fencegate_backup_end\":2}}\n{{\"scope\":\"c\",\"token\":\"3:1\"}}\n"
            ),
            "a line follows the end line",
        ),
        (
            "two-headers.jsonl",
            format!("{higher}{marks}{higher}{{\"fencegate_backup_end\":2}}\n"),
            "a second header line",
        ),
        (
            "two-headers-v1.jsonl",
            format!(
                "{{\"fencegate_backup\":1,\"epoch_floor\":0}}\n{marks}{{\"fencegate_backup\":1,\"epoch_floor\":3}}\n"
            ),
            "a second header line",
        ),
        (
            "header-late.jsonl",
            format!("{marks}{higher}{{\"fencegate_backup_end\":2}}\n"),
            "does not begin with its header line",
        ),
        (
            "header-late-v1.jsonl",
            format!("{marks}{{\"fencegate_backup\":1,\"epoch_floor\":3}}\n"),
            "does not begin with its header line",
        ),
        (
            "empty.jsonl",
            String::new(),
            "is empty: not a fencegate backup",
        ),
        (
            "blank.jsonl",
            "\n\n".into(),
            "is empty: not a fencegate backup",
        ),
        (
            "long-line.jsonl",
            format!(
                "{higher}{{\"scope\":\"{}\",\"token\":\"3:1\"}}\n{{\"fencegate_backup_end\":1}}\n",
                "x".repeat(2 << 20)
            ),
            "a line longer than",
        ),
    ] {
        let (ok, err) = restore(name, &text);
        assert!(!ok, "{name} was restored");
        assert!(err.contains(want), "{name}: {err}");
        assert!(err.contains("nothing was restored"), "{name}: {err}");
    }
    let list = |args: &[&str]| String::from_utf8_lossy(&run(args).stdout).into_owned();
    assert_eq!(list(&["marks", "list"]), "1\ta\n");

    // Format 1: no end line to check, restored as before.
    let (ok, err) = restore(
        "v1.jsonl",
        "{\"epoch_floor\":0,\"fencegate_backup\":1}\n{\"scope\":\"b\",\"token\":\"4\"}\n",
    );
    assert!(ok, "{err}");
    assert_eq!(list(&["marks", "list"]), "1\ta\n4\tb\n");
}

/// The online backup renames its file into place only if the stream ended with its end
/// line: a server that ends the body cleanly but short (as one that gave up on a stalled
/// client once did) leaves no backup behind, and the command fails.
#[tokio::test]
async fn an_online_backup_without_its_end_line_is_refused() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let dir = tempfile::tempdir().unwrap();
    let (config, _, admin) = write_config(dir.path(), ([127, 0, 0, 1], 9).into());
    let store_path = dir.path().join("marks.redb");
    // Held here, so the command asks the admin API, which this test answers.
    let store = fencegate::store::MarkStore::open(&store_path).expect("store");
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", admin))
        .await
        .expect("bind the admin port");
    let server = tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.expect("accept");
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = conn.read(&mut buf).await.expect("read");
            assert!(n > 0, "request cut short");
            head.extend_from_slice(&buf[..n]);
        }
        let body =
            "{\"fencegate_backup\":2,\"epoch_floor\":0}\n{\"scope\":\"a\",\"token\":\"1\"}\n";
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n\
             transfer-encoding: chunked\r\nconnection: close\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
            body.len()
        );
        conn.write_all(answer.as_bytes()).await.expect("write");
        conn.shutdown().await.expect("shutdown");
    });
    let out_path = dir.path().join("marks.jsonl");
    let out = tokio::task::spawn_blocking({
        let (config, out_path) = (config.clone(), out_path.clone());
        move || {
            Command::new(env!("CARGO_BIN_EXE_fencegate"))
                .args(["backup", "--out", out_path.to_str().unwrap(), "--config"])
                .arg(&config)
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    server.await.expect("the admin double answered");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the backup from the running server is incomplete"),
        "{err}"
    );
    assert!(!out_path.exists(), "a short backup was put in place");
    assert!(!out_path.with_extension("partial").exists());
    store.close().await;
}
