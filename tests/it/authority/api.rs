//! The lease authority over real sockets (SPEC §8): the API's answers and refusals,
//! durable counters across a crash, the restart wait, and `bump-epoch` after a restore.

use crate::support;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use fencegate::client::{AcquireError, AuthorityClient, Lease};
use fencegate::settings::Config;
use support::{BOUND, Client, Double, free_port};

/// An authority-only process on port 0 (no routes), store in `dir`.
fn authority_text(max_ttl: &str, lock_delay: &str, listen: u16, proxy: u16, admin: u16) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:{proxy}"
[admin]
listen = "127.0.0.1:{admin}"
[store]
path = "authority.redb"
[authority]
listen = "127.0.0.1:{listen}"
backend = "local"
max_ttl = "{max_ttl}"
lock_delay = "{lock_delay}"
"#
    )
}

async fn start_authority(dir: &Path, max_ttl: &str) -> (fencegate::app::Running, SocketAddr) {
    let config = Config::parse(&authority_text(max_ttl, "0s", 0, 0, 0), dir).expect("config");
    let running = support::start(config).await;
    let addr = running.authority_addr.expect("authority address");
    (running, addr)
}

#[tokio::test]
async fn acquire_renew_release_and_status() {
    let dir = tempfile::tempdir().unwrap();
    let (running, addr) = start_authority(dir.path(), "60s").await;
    let c = Client::new(addr);

    let r = c
        .post_json(
            "/v1/locks/acquire",
            r#"{"scope":"report/july","holder":"a","ttl_ms":30000}"#,
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let j = r.json();
    assert_eq!(j["result"], "acquired");
    assert_eq!(j["scope"], "report/july");
    assert_eq!(j["token"], "1");
    assert_eq!(j["ttl_ms"], 30000);
    let lease_id = j["lease_id"].as_str().unwrap().to_string();

    let r = c
        .post_json(
            "/v1/locks/acquire",
            r#"{"scope":"report/july","holder":"b","ttl_ms":1000}"#,
        )
        .await;
    assert_eq!(r.status, 409);
    assert_eq!(r.headers["content-type"], "application/problem+json");
    let j = r.json();
    assert_eq!(
        (j["result"].as_str(), j["holder"].as_str()),
        (Some("busy"), Some("a"))
    );
    assert!(j["retry_after_ms"].as_u64().unwrap() > 29_000);
    assert_eq!(r.headers["retry-after"], "30");

    let r = c.get("/v1/locks?scope=report%2Fjuly").await;
    assert_eq!(r.status, 200);
    let j = r.json();
    assert_eq!(j["holder"], "a");
    // Without clients nobody can prove to be the holder: nobody sees the lease id.
    assert_eq!(j["lease_id"], serde_json::Value::Null);
    assert_eq!(j["token"], "1");
    assert_eq!(j["last_issued"], "1");
    assert!(j["ttl_ms"].as_u64().unwrap() <= 30_000);

    let renew = |id: &str, token: &str| {
        format!(r#"{{"scope":"report/july","lease_id":"{id}","token":"{token}","ttl_ms":20000}}"#)
    };
    let r = c.post_json("/v1/locks/renew", &renew("nope", "1")).await;
    assert_eq!((r.status, r.json()["result"].as_str()), (409, Some("lost")));
    let r = c.post_json("/v1/locks/renew", &renew(&lease_id, "2")).await;
    assert_eq!((r.status, r.json()["result"].as_str()), (409, Some("lost")));
    let r = c.post_json("/v1/locks/renew", &renew(&lease_id, "1")).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json(),
        serde_json::json!({"result": "renewed", "ttl_ms": 20000})
    );

    let release = |id: &str| format!(r#"{{"scope":"report/july","lease_id":"{id}","token":"1"}}"#);
    let r = c.post_json("/v1/locks/release", &release("nope")).await;
    assert_eq!((r.status, r.json()["result"].as_str()), (409, Some("lost")));
    assert_eq!(
        c.get("/v1/locks?scope=report%2Fjuly").await.json()["holder"],
        "a"
    );
    let r = c.post_json("/v1/locks/release", &release(&lease_id)).await;
    assert_eq!(
        (r.status, r.json()["result"].as_str()),
        (200, Some("released"))
    );
    let r = c.post_json("/v1/locks/release", &release(&lease_id)).await;
    assert_eq!(r.status, 409);

    // Released: the next acquisition is immediate and gets a greater token.
    let r = c
        .post_json(
            "/v1/locks/acquire",
            r#"{"scope":"report/july","holder":"b","ttl_ms":1000}"#,
        )
        .await;
    assert_eq!((r.status, r.json()["token"].as_str()), (200, Some("2")));
    let j = c.get("/v1/locks?scope=nothing-here").await.json();
    assert_eq!(j["holder"], serde_json::Value::Null);
    assert_eq!(j["last_issued"], serde_json::Value::Null);
    running.shutdown().await;
}

#[tokio::test]
async fn bad_requests_are_400_problems() {
    let dir = tempfile::tempdir().unwrap();
    let (running, addr) = start_authority(dir.path(), "10s").await;
    let c = Client::new(addr);
    for (path, body) in [
        ("/v1/locks/acquire", r#"{"holder":"a","ttl_ms":1000}"#),
        (
            "/v1/locks/acquire",
            r#"{"scope":"","holder":"a","ttl_ms":1000}"#,
        ),
        ("/v1/locks/acquire", r#"{"scope":"s","ttl_ms":1000}"#),
        (
            "/v1/locks/acquire",
            r#"{"scope":"s","holder":"a","ttl_ms":0}"#,
        ),
        (
            "/v1/locks/acquire",
            r#"{"scope":"s","holder":"a","ttl_ms":-5}"#,
        ),
        (
            "/v1/locks/acquire",
            r#"{"scope":"s","holder":"a","ttl_ms":10001}"#,
        ),
        (
            "/v1/locks/acquire",
            r#"{"scope":"s","holder":"a","ttl_ms":1.5}"#,
        ),
        (
            "/v1/locks/acquire",
            r#"{"scope":"s","holder":"a","ttl_ms":"1000"}"#,
        ),
        (
            "/v1/locks/acquire",
            r#"{"scope":"s","holder":"a","ttl_ms":1000,"wait_ms":-1}"#,
        ),
        (
            "/v1/locks/acquire",
            r#"{"scope":"s","holder":"a","ttl_ms":1000,"colour":1}"#,
        ),
        ("/v1/locks/acquire", r#"{"scope":"s","holder":"a","#),
        ("/v1/locks/acquire", "not json"),
        (
            "/v1/locks/renew",
            r#"{"scope":"s","lease_id":"x","token":"01","ttl_ms":1000}"#,
        ),
        (
            "/v1/locks/renew",
            r#"{"scope":"s","lease_id":"x","token":"1"}"#,
        ),
        (
            "/v1/locks/renew",
            r#"{"scope":"s","lease_id":"","token":"1","ttl_ms":1000}"#,
        ),
        ("/v1/locks/release", r#"{"scope":"s","lease_id":"x"}"#),
        (
            "/v1/locks/release",
            r#"{"scope":"s","lease_id":"x","token":"1,2"}"#,
        ),
    ] {
        let r = c.post_json(path, body).await;
        assert_eq!(r.status, 400, "{path} {body}: {}", r.body);
        assert_eq!(r.headers["content-type"], "application/problem+json");
        assert_eq!(r.json()["result"], "invalid_request", "{body}");
        assert_eq!(r.json()["status"], 400);
    }
    assert_eq!(c.get("/v1/locks").await.status, 400);
    assert_eq!(c.get("/v1/locks?scope=").await.status, 400);
    assert_eq!(c.get("/v1/elsewhere").await.status, 404);
    let r = c.get("/v1/locks/acquire").await;
    assert_eq!(
        (r.status, &r.headers["allow"]),
        (405, &"POST".parse::<http::HeaderValue>().unwrap())
    );
    // Nothing was granted by any of them.
    let r = c
        .post_json(
            "/v1/locks/acquire",
            r#"{"scope":"s","holder":"a","ttl_ms":1000}"#,
        )
        .await;
    assert_eq!(r.json()["token"], "1");
    running.shutdown().await;
}

/// The authority's listener has the proxy listener's bounds: a connection that sends
/// nothing, or a head that never completes, is cut off after `header_read_timeout`, and
/// connections per client IP are capped.
#[tokio::test]
async fn slow_and_silent_clients_are_cut_off_and_connections_capped() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    let dir = tempfile::tempdir().unwrap();
    let text = authority_text("10s", "0s", 0, 0, 0).replace(
        "[server]\n",
        "[server]\nheader_read_timeout = \"1s\"\nmax_connections_per_ip = 4\n",
    );
    let config = Config::parse(&text, dir.path()).expect("config");
    let running = support::start(config).await;
    let addr = running.authority_addr.expect("authority address");
    for first in [
        &b""[..],
        b"PRI * HT",
        b"POST /v1/locks/acquire HTTP/1.1\r\nHost: a\r\n",
    ] {
        let mut slow = TcpStream::connect(addr).await.unwrap();
        slow.write_all(first).await.unwrap();
        let mut buf = Vec::new();
        let closed = tokio::time::timeout(BOUND, slow.read_to_end(&mut buf)).await;
        assert!(closed.is_ok(), "{first:?} then silence must be cut off");
    }
    // Four open connections from 127.0.0.1: a fifth is closed at once, unanswered.
    let mut open = Vec::new();
    for _ in 0..4 {
        let mut conn = TcpStream::connect(addr).await.unwrap();
        conn.write_all(b"GET /v1/locks?scope=s HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 12];
        conn.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"HTTP/1.1 200");
        open.push(conn);
    }
    let mut fifth = TcpStream::connect(addr).await.unwrap();
    let _ = fifth
        .write_all(b"GET /v1/locks?scope=s HTTP/1.1\r\nHost: a\r\n\r\n")
        .await;
    let mut buf = Vec::new();
    let read = tokio::time::timeout(BOUND, fifth.read_to_end(&mut buf)).await;
    assert!(
        matches!(read, Ok(Ok(0)) | Ok(Err(_))),
        "closed without an answer: {read:?} {buf:?}"
    );
    drop(open);
    running.shutdown().await;
}

/// A request body must arrive within `header_read_timeout` of its head: a client that
/// announces a body and sends less (or nothing) gets 408 and its connection is closed.
#[tokio::test]
async fn a_body_that_never_arrives_is_cut_off() {
    let dir = tempfile::tempdir().unwrap();
    let text = authority_text("10s", "0s", 0, 0, 0)
        .replace("[server]\n", "[server]\nheader_read_timeout = \"1s\"\n");
    let running = support::start(Config::parse(&text, dir.path()).expect("config")).await;
    let addr = running.authority_addr.expect("authority address");
    let head = "POST /v1/locks/acquire HTTP/1.1\r\nHost: a\r\n\
                Content-Type: application/json\r\nContent-Length: 100\r\n\r\n";
    for sent in [head.to_string(), format!("{head}{{\"scope\":")] {
        let (status, text) = support::raw(addr, sent.as_bytes()).await;
        assert_eq!(status, 408, "{text}");
        assert!(text.contains("request_timeout"), "{text}");
    }
    // A whole body is answered as before.
    let c = Client::new(addr);
    let r = c
        .post_json(
            "/v1/locks/acquire",
            r#"{"scope":"s","holder":"a","ttl_ms":1000}"#,
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    running.shutdown().await;
}

/// Shutdown waits for in-flight calls for `server.shutdown_timeout`, then closes their
/// connections: a call stuck reading its body does not hold the process.
#[tokio::test]
async fn shutdown_ends_calls_still_running_after_shutdown_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let dir = tempfile::tempdir().unwrap();
    // The body may take a minute; shutdown grants in-flight calls one second.
    let text = authority_text("10s", "0s", 0, 0, 0).replace(
        "[server]\n",
        "[server]\nheader_read_timeout = \"60s\"\nshutdown_timeout = \"1s\"\n",
    );
    let running = support::start(Config::parse(&text, dir.path()).expect("config")).await;
    let addr = running.authority_addr.expect("authority address");
    let mut stuck = tokio::net::TcpStream::connect(addr).await.unwrap();
    stuck
        .write_all(
            b"POST /v1/locks/renew HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\
              Expect: 100-continue\r\n\r\n",
        )
        .await
        .unwrap();
    // hyper sends 100 Continue once the handler reads the body: the call is in flight.
    let mut continued = [0u8; 25];
    tokio::time::timeout(BOUND, stuck.read_exact(&mut continued))
        .await
        .expect("100 Continue")
        .unwrap();
    assert_eq!(&continued, b"HTTP/1.1 100 Continue\r\n\r\n");
    stuck.write_all(b"{").await.unwrap();
    // Well under the 10 s the listener used to wait whatever the configuration said.
    tokio::time::timeout(Duration::from_secs(8), running.shutdown())
        .await
        .expect("shutdown within shutdown_timeout (and some slack)");
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(BOUND, stuck.read_to_end(&mut buf)).await;
    assert!(
        matches!(closed, Ok(Ok(_)) | Ok(Err(_))),
        "the stuck connection is closed: {closed:?}"
    );
}

#[tokio::test]
async fn a_waiting_acquire_is_granted_when_the_holder_releases() {
    let dir = tempfile::tempdir().unwrap();
    let (running, addr) = start_authority(dir.path(), "60s").await;
    let authority = AuthorityClient::new(&format!("http://{addr}")).unwrap();
    let a = authority
        .acquire("s", "a", Duration::from_secs(60), Duration::ZERO)
        .await
        .unwrap();
    let waiting = {
        let authority = authority.clone();
        tokio::spawn(async move {
            authority
                .acquire("s", "b", Duration::from_secs(10), Duration::from_secs(60))
                .await
        })
    };
    // The waiter is parked inside the authority: a busy scope, not yet granted.
    let c = Client::new(addr);
    assert_eq!(c.get("/v1/locks?scope=s").await.json()["holder"], "a");
    authority.release(&a).await.unwrap();
    let b = tokio::time::timeout(BOUND, waiting)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(b.token() > a.token());
    assert!(!a.is_held() && b.is_held());
    running.shutdown().await;
}

/// The real binary as an authority-only process, with ports chosen by the test.
struct AuthorityProc {
    proc: support::Proc,
    addr: SocketAddr,
}

fn spawn_authority(config: &Path) -> AuthorityProc {
    let text = std::fs::read_to_string(config).unwrap();
    let port = |key: &str| -> u16 {
        let at = text.find(key).unwrap() + key.len();
        let rest = &text[at..];
        let line = rest.lines().next().unwrap();
        line.trim()
            .trim_start_matches("listen = \"127.0.0.1:")
            .trim_end_matches('"')
            .parse()
            .unwrap()
    };
    let (proxy, admin, authority) = (port("[server]\n"), port("[admin]\n"), port("[authority]\n"));
    AuthorityProc {
        proc: support::spawn(config, proxy, admin),
        addr: ([127, 0, 0, 1], authority).into(),
    }
}

fn write_authority_config(dir: &Path, max_ttl: &str) -> std::path::PathBuf {
    let path = dir.join("authority.toml");
    std::fs::write(
        &path,
        authority_text(max_ttl, "0s", free_port(), free_port(), free_port()),
    )
    .unwrap();
    path
}

async fn acquire(authority: &AuthorityClient, scope: &str, wait: Duration) -> Lease {
    authority
        .acquire(scope, "test", Duration::from_millis(400), wait)
        .await
        .unwrap_or_else(|e| panic!("acquire {scope}: {e}"))
}

/// kill -9 while a lease is live: the counter survived (it was committed before the
/// grant was answered), and the restarted authority waits out max_ttl for that scope.
#[tokio::test]
async fn counters_survive_a_crash_and_the_restart_waits_out_max_ttl() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_authority_config(dir.path(), "1s");
    let mut first = spawn_authority(&config);
    let authority = AuthorityClient::new(&format!("http://{}", first.addr)).unwrap();
    let before = acquire(&authority, "held", Duration::ZERO).await;
    assert_eq!(before.token().to_string(), "1");
    first.proc.child.kill().unwrap();
    first.proc.child.wait().unwrap();

    let mut second = spawn_authority(&config);
    let authority = AuthorityClient::new(&format!("http://{}", second.addr)).unwrap();
    match authority
        .acquire("held", "other", Duration::from_millis(400), Duration::ZERO)
        .await
    {
        Err(AcquireError::Busy {
            holder,
            retry_after,
        }) => {
            assert_eq!(holder, None, "the old holder is not known after a restart");
            assert!(retry_after <= Duration::from_secs(1) && !retry_after.is_zero());
        }
        other => panic!("expected busy during the restart wait, got {other:?}"),
    }
    // A scope never granted cannot have a live lease: granted at once.
    assert_eq!(
        acquire(&authority, "fresh", Duration::ZERO)
            .await
            .token()
            .to_string(),
        "1"
    );
    // Waiting out the restart window yields the next token, never a repeated one.
    let after = acquire(&authority, "held", BOUND).await;
    assert_eq!(after.token().to_string(), "2");
    second.proc.child.kill().unwrap();
    second.proc.child.wait().unwrap();
}

fn bump_epoch(config: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["authority", "bump-epoch", "--config"])
        .arg(config)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// The restore story: the authority's store is restored from an old copy, so its counters
/// go back. Without an epoch bump its next token is refused by a proxy that saw newer
/// ones; after `bump-epoch` every new token is accepted.
#[tokio::test]
async fn bump_epoch_after_a_restore_outranks_every_earlier_token() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy_dir = dir.path().join("proxy");
    std::fs::create_dir(&proxy_dir).unwrap();
    let proxy = support::start(support::config(double.addr, &proxy_dir)).await;
    let via = Client::new(proxy.proxy_addr);
    let config = write_authority_config(dir.path(), "500ms");
    let store = dir.path().join("authority.redb");
    let backup = dir.path().join("authority.backup.redb");
    let put = |lease: &Lease| {
        let via = via.clone();
        let token = lease.token().to_string();
        async move { via.put("/reports/july/final", &token, &token).await }
    };

    let mut run = spawn_authority(&config);
    let authority = AuthorityClient::new(&format!("http://{}", run.addr)).unwrap();
    for want in ["1", "2"] {
        let lease = acquire(&authority, "report/july", Duration::ZERO).await;
        assert_eq!(lease.token().to_string(), want);
        assert_eq!(put(&lease).await.result(), "accepted");
        authority.release(&lease).await.unwrap();
    }
    run.proc.child.kill().unwrap();
    run.proc.child.wait().unwrap();
    // The old copy: the store file and its journal, as the stopped server left them (a
    // store file alone, older than the journal beside it, is refused at start-up).
    let journal = |p: &std::path::Path| fencegate::store::marks::journal_path(p);
    std::fs::copy(&store, &backup).unwrap();
    std::fs::copy(journal(&store), journal(&backup)).unwrap();

    let mut run = spawn_authority(&config);
    let authority = AuthorityClient::new(&format!("http://{}", run.addr)).unwrap();
    for want in ["3", "4", "5"] {
        let lease = acquire(&authority, "report/july", BOUND).await;
        assert_eq!(lease.token().to_string(), want);
        assert_eq!(put(&lease).await.result(), "accepted");
        authority.release(&lease).await.unwrap();
    }
    run.proc.child.kill().unwrap();
    run.proc.child.wait().unwrap();

    // Restore the old copy. Without a bump, the authority repeats token 3: stale.
    std::fs::copy(&backup, &store).unwrap();
    std::fs::copy(journal(&backup), journal(&store)).unwrap();
    let mut run = spawn_authority(&config);
    let authority = AuthorityClient::new(&format!("http://{}", run.addr)).unwrap();
    let repeated = acquire(&authority, "report/july", BOUND).await;
    assert_eq!(repeated.token().to_string(), "3");
    let r = put(&repeated).await;
    assert_eq!((r.status, r.result()), (409, "stale_fence"));
    run.proc.child.kill().unwrap();
    run.proc.child.wait().unwrap();

    // The remedy: bump the epoch (server stopped), then every new token outranks them all.
    let e1: u64 = bump_epoch(&config).parse().expect("an epoch");
    assert!(e1 >= 1);
    let mut run = spawn_authority(&config);
    let authority = AuthorityClient::new(&format!("http://{}", run.addr)).unwrap();
    // After a restore any scope may have a live lease: even a scope missing from the old
    // copy waits out max_ttl.
    assert!(matches!(
        authority
            .acquire(
                "report/august",
                "x",
                Duration::from_millis(400),
                Duration::ZERO
            )
            .await,
        Err(AcquireError::Busy { holder: None, .. })
    ));
    let mut last = None;
    for _ in 0..3 {
        let lease = acquire(&authority, "report/july", BOUND).await;
        assert_eq!(lease.token().epoch, e1, "{:?}", lease.token());
        assert!(Some(lease.token()) > last);
        last = Some(lease.token());
        let r = put(&lease).await;
        assert_eq!((r.status, r.result()), (200, "accepted"), "{}", r.body);
        authority.release(&lease).await.unwrap();
    }
    assert_eq!(last.unwrap().to_string(), format!("{e1}:6"));
    run.proc.child.kill().unwrap();
    run.proc.child.wait().unwrap();

    // The same backup restored once more: the copy does not remember the first bump, yet
    // the second one still starts an epoch above it (a plain increment would give e1
    // again, and the next token, e1:3, would be stale behind e1:6).
    std::fs::copy(&backup, &store).unwrap();
    std::fs::copy(journal(&backup), journal(&store)).unwrap();
    let e2: u64 = bump_epoch(&config).parse().expect("an epoch");
    assert!(e2 > e1, "{e2} > {e1}");
    let run = spawn_authority(&config);
    let authority = AuthorityClient::new(&format!("http://{}", run.addr)).unwrap();
    let lease = acquire(&authority, "report/july", BOUND).await;
    assert_eq!(lease.token().to_string(), format!("{e2}:3"));
    let r = put(&lease).await;
    assert_eq!((r.status, r.result()), (200, "accepted"), "{}", r.body);
    drop(run);
    // Epoch bumps are cumulative and survive restarts.
    let e3: u64 = bump_epoch(&config).parse().expect("an epoch");
    assert!(e3 > e2, "{e3} > {e2}");
    proxy.shutdown().await;
}

#[test]
fn bump_epoch_refuses_a_config_without_authority_or_a_missing_store() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.toml");
    std::fs::write(&path, authority_text("1s", "0s", 0, 0, 0)).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["authority", "bump-epoch", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success(), "no store file yet");
    let config = Config::parse(&authority_text("1s", "0s", 0, 0, 0), dir.path()).unwrap();
    assert!(fencegate::authority::bump_epoch(&config).is_err());
}
