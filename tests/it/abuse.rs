//! One client must not fill the disk, hold the memory or take the sockets: idempotency
//! records within their quotas and the volume's reserve, reads with a token not recorded,
//! and the open-file limit.

use crate::support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use support::{BOUND, Client};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// The size of every answer of [`big_upstream`].
const BIG: usize = 1_000_000;

/// An upstream that answers every request 200 with [`BIG`] bytes.
async fn big_upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let body = Bytes::from(vec![b'x'; BIG]);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let body = body.clone();
            let svc = service_fn(move |_req| {
                let body = body.clone();
                async move { Ok::<_, std::io::Error>(hyper::Response::new(Full::new(body))) }
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

/// A tmpfs mounted for one test, unmounted when dropped.
struct Tmpfs {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl Tmpfs {
    /// A tmpfs of `size` (as mount(8) takes it), or `None` (and why, on stderr) where this
    /// process may not mount one.
    fn mount(size: &str) -> Option<Tmpfs> {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("vol");
        std::fs::create_dir(&path).expect("mount point");
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&path)
            .output();
        match out {
            Ok(o) if o.status.success() => Some(Tmpfs { _dir: dir, path }),
            Ok(o) => {
                eprintln!(
                    "SKIPPED: cannot mount a tmpfs here (needs root): {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                );
                None
            }
            Err(e) => {
                eprintln!("SKIPPED: cannot run mount(8): {e}");
                None
            }
        }
    }

    fn free(&self) -> u64 {
        let st = rustix::fs::statvfs(&self.path).expect("statvfs");
        st.f_bavail * st.f_frsize
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .args(["-l"])
            .arg(&self.path)
            .status();
    }
}

/// A proxy in front of `upstream` with its store at `store`, two keyed routes and
/// `extra` lines in `[idempotency]`.
fn config(upstream: SocketAddr, store: &Path, store_extra: &str, idempotency: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
shutdown_timeout = "10s"
[admin]
listen = "127.0.0.1:0"
[store]
path = "{store}"
{store_extra}
[fencing]
drain_timeout = "10s"
settle = "0s"
[idempotency]
{idempotency}
[[upstream]]
name = "u"
url = "http://{upstream}"
timeout = "10s"

[[route]]
name = "big"
path = "/big/{{o}}"
scope = "big/{{o}}"
upstream = "u"
idempotency = "optional"

[[route]]
name = "other"
path = "/other/{{o}}"
scope = "other/{{o}}"
upstream = "u"
idempotency = "optional"
"#,
        store = store.join("marks.redb").display(),
    )
}

fn key(i: usize) -> String {
    format!("\"k-{i}\"")
}

/// The issue's reproduction, on a 48 MB volume: reads with a token and a new key each
/// time (1 MB answers) record nothing; writes with new keys stop being recorded (429
/// `key_rejected`) while the volume still has its reserve; the store never fails,
/// /readyz stays 200, and every other scope is still served.
#[tokio::test]
async fn new_keys_never_fill_the_store_volume() {
    let Some(vol) = Tmpfs::mount("48m") else {
        return;
    };
    let upstream = big_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start_text(
        &config(upstream, &vol.path, "min_free = \"16MiB\"", ""),
        dir.path(),
    )
    .await;
    let client = Client::new(proxy.proxy_addr);
    let admin = Client::new(proxy.admin_addr);

    // More reads than would have filled the volume: answered, none recorded.
    for i in 0..60 {
        let k = key(i);
        let r = client
            .send(
                "GET",
                "/big/o",
                &[("fencing-token", "1"), ("idempotency-key", &k)],
                "",
            )
            .await;
        assert_eq!((r.status, r.result()), (200, "accepted"), "read {i}");
        assert_eq!(r.body.len(), BIG);
    }
    assert_eq!(
        proxy.app.store.record_count().unwrap(),
        0,
        "reads are not recorded"
    );

    // Writes with a new key each: recorded until the reserve, then refused.
    let mut recorded = Vec::new();
    let mut rejected = None;
    for i in 100..160 {
        let k = key(i);
        let r = client
            .send(
                "PUT",
                "/big/o",
                &[("fencing-token", "1"), ("idempotency-key", &k)],
                "w",
            )
            .await;
        match (r.status, r.result()) {
            (200, "accepted") => recorded.push(k),
            (429, "key_rejected") => {
                assert_eq!(
                    r.headers.get("retry-after").and_then(|v| v.to_str().ok()),
                    Some("60")
                );
                rejected = Some(r);
                break;
            }
            other => panic!("write {i}: {other:?} {}", r.body),
        }
    }
    let rejected = rejected.expect("a new key is refused before the volume fills");
    assert!(
        rejected.json()["title"]
            .as_str()
            .unwrap_or("")
            .contains("free space"),
        "{}",
        rejected.body
    );
    assert!(
        !recorded.is_empty(),
        "keys are recorded while there is room"
    );
    assert!(
        vol.free() >= 8 << 20,
        "the volume keeps its reserve: {} bytes free",
        vol.free()
    );
    assert!(!proxy.app.store.is_failed(), "the store never failed");
    assert_eq!(admin.get("/readyz").await.status, 200);

    // Every other scope is served: unkeyed writes advance and forward; a recorded key
    // still replays.
    for i in 0..20 {
        let r = client
            .send(
                "PUT",
                &format!("/other/s{i}"),
                &[("fencing-token", "5")],
                "w",
            )
            .await;
        assert_eq!(
            (r.status, r.result()),
            (200, "accepted"),
            "scope other/s{i}"
        );
    }
    let replay = client
        .send(
            "PUT",
            "/big/o",
            &[("fencing-token", "1"), ("idempotency-key", &recorded[0])],
            "w",
        )
        .await;
    assert_eq!((replay.status, replay.result()), (200, "duplicate"));
    assert_eq!(replay.body.len(), BIG);
    proxy.shutdown().await;
}

/// A client past its count of records gets 429 `key_rejected` (nothing forwarded), while
/// another client's new keys are recorded; once its records expire, the next claim
/// reclaims them and its new keys are recorded again.
#[tokio::test]
async fn a_client_past_its_records_is_refused_until_they_expire() {
    let upstream = big_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start_text(
        &config(
            upstream,
            dir.path(),
            "",
            "ttl = \"2s\"\nmax_records_per_client = 3\nmax_records_per_scope = 5",
        ),
        dir.path(),
    )
    .await;
    let client = Client::new(proxy.proxy_addr);
    for i in 0..3 {
        let k = key(i);
        let r = client
            .send(
                "PUT",
                &format!("/big/a{i}"),
                &[("fencing-token", "1"), ("idempotency-key", &k)],
                "w",
            )
            .await;
        assert_eq!((r.status, r.result()), (200, "accepted"));
    }
    let k = key(3);
    let past = client
        .send(
            "PUT",
            "/big/a3",
            &[("fencing-token", "1"), ("idempotency-key", &k)],
            "w",
        )
        .await;
    assert_eq!((past.status, past.result()), (429, "key_rejected"));
    assert!(
        past.json()["title"]
            .as_str()
            .unwrap_or("")
            .contains("client")
    );
    assert_eq!(proxy.app.store.record_count().unwrap(), 3);

    // Another address is another client.
    let other = raw_put(proxy.proxy_addr, "127.0.0.2", "/big/b0", "\"b-0\"").await;
    assert!(other.starts_with("HTTP/1.1 200"), "{other}");
    assert_eq!(proxy.app.store.record_count().unwrap(), 4);
    let metrics = Client::new(proxy.admin_addr).get("/metrics").await.body;
    assert!(
        metrics
            .lines()
            .any(|l| l == "fencegate_idempotency_records 4"),
        "{metrics}"
    );

    // The first client's records expire (ttl 2 s); its next new key reclaims them.
    let deadline = tokio::time::Instant::now() + BOUND;
    let mut n = 10;
    loop {
        let k = key(n);
        let r = client
            .send(
                "PUT",
                "/big/a9",
                &[("fencing-token", "1"), ("idempotency-key", &k)],
                "w",
            )
            .await;
        if r.result() == "accepted" {
            break;
        }
        assert_eq!(r.result(), "key_rejected");
        assert!(
            tokio::time::Instant::now() < deadline,
            "records never expired"
        );
        n += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Records are made in different seconds, so they expire one by one: the claim that
    // went through had reclaimed at least one, and the client is still within its bound.
    let (total, _, mine) = proxy.app.store.record_usage("big/a9", "127.0.0.1");
    assert!(
        total.records <= 4,
        "an expired record was reclaimed: {total:?}"
    );
    assert!(mine.records <= 3, "{mine:?}");
    proxy.shutdown().await;
}

/// A keyed PUT from the local address `from`; answers the response head and body as text.
async fn raw_put(to: SocketAddr, from: &str, path: &str, key: &str) -> String {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind(format!("{from}:0").parse().unwrap()).unwrap();
    let mut s = tokio::time::timeout(BOUND, sock.connect(to))
        .await
        .unwrap()
        .unwrap();
    let req = format!(
        "PUT {path} HTTP/1.1\r\nhost: x\r\nfencing-token: 1\r\nidempotency-key: {key}\r\ncontent-length: 1\r\nconnection: close\r\n\r\nw"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(BOUND, s.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    String::from_utf8_lossy(&out[..out.len().min(200)]).into_owned()
}

/// Starts the binary under `ulimits` (sh's `ulimit` arguments, run first) and keeps all
/// it says on stderr; waits (bounded) for its "listening" line.
fn spawn_limited(config: &Path, proxy: u16, admin: u16, ulimits: &str) -> (support::Proc, Said) {
    use std::io::BufRead;
    let mut child = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{ulimits} && exec \"$0\" serve --config \"$1\""))
        .arg(env!("CARGO_BIN_EXE_fencegate"))
        .arg(config)
        .env("RUST_LOG", "info")
        // As the image sets it (see OPERATIONS, Limits): freed memory goes back to the
        // system even on a worker thread that has gone quiet.
        .env("MIMALLOC_PURGE_DELAY", "0")
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("spawn fencegate");
    let stderr = child.stderr.take().unwrap();
    let said = Said::default();
    let log = said.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if line.contains("fencegate listening") {
                let _ = tx.send(());
            }
            log.0.lock().unwrap().push(line);
        }
    });
    let proc = support::Proc {
        child,
        proxy: ([127, 0, 0, 1], proxy).into(),
        admin: ([127, 0, 0, 1], admin).into(),
    };
    if rx.recv_timeout(BOUND).is_err() {
        panic!("fencegate did not start: {:#?}", said.lines());
    }
    (proc, said)
}

/// What a child said on stderr.
#[derive(Clone, Default)]
struct Said(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Said {
    fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

/// The soft and hard "Max open files" of a process.
fn open_file_limits(pid: u32) -> (u64, u64) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files");
    let nums: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    (nums[0], nums[1])
}

/// At start the soft open-file limit is raised to the hard one.
#[test]
fn the_soft_open_file_limit_is_raised_to_the_hard_one() {
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = support::write_config(dir.path(), "127.0.0.1:9".parse().unwrap());
    let (proc, said) = spawn_limited(&config, p, a, "ulimit -Sn 128 && ulimit -Hn 1024");
    assert_eq!(open_file_limits(proc.child.id()), (1024, 1024));
    assert!(
        said.lines()
            .iter()
            .any(|l| l.contains("open-file limit raised")),
        "{:#?}",
        said.lines()
    );
}

/// The issue's reproduction with `ulimit -n 256`: one address holds requests open (each
/// takes a client and an upstream descriptor) far past the limit. The connections past
/// the budget are closed at accept or refused before any upstream connection is made;
/// `accept` never fails for want of descriptors, the admin API still answers, another
/// address is served while the first holds all it may (its share is half the budget: two
/// per connection), and once the client lets go new clients are served.
#[tokio::test]
async fn one_client_cannot_take_every_file_descriptor() {
    let double = support::Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = support::write_config(dir.path(), double.addr);
    // The held requests must not time out at the upstream while the test looks at them.
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace("\ntimeout = \"10s\"", "\ntimeout = \"300s\""),
    )
    .unwrap();
    assert!(
        std::fs::read_to_string(&config)
            .unwrap()
            .contains("\ntimeout = \"300s\"")
    );
    let (proc, said) = spawn_limited(&config, p, a, "ulimit -n 256");
    let admin = Client::new(proc.admin);

    // 400 connections, each with a request the upstream holds.
    let mut held = Vec::new();
    let mut refused_at_accept = 0;
    let mut answered = Vec::new();
    for i in 0..400 {
        let Ok(Ok(mut s)) =
            tokio::time::timeout(BOUND, tokio::net::TcpStream::connect(proc.proxy)).await
        else {
            refused_at_accept += 1;
            continue;
        };
        let req = format!("GET /public/h{i} HTTP/1.1\r\nhost: x\r\nx-test-hold: fds\r\n\r\n");
        if s.write_all(req.as_bytes()).await.is_err() {
            refused_at_accept += 1;
            continue;
        }
        held.push(s);
    }
    // Those the proxy could not take are closed (at accept) or answered 502 at once; all
    // are looked at together, for a second.
    let mut looks = tokio::task::JoinSet::new();
    for mut s in held {
        looks.spawn(async move {
            let mut buf = [0u8; 256];
            let seen = tokio::time::timeout(Duration::from_secs(1), s.read(&mut buf)).await;
            (
                s,
                seen.map(|r| r.map(|n| String::from_utf8_lossy(&buf[..n]).into_owned())),
            )
        });
    }
    let mut still_open = Vec::new();
    // Answered connections are kept open too: the client holds every descriptor it got.
    let mut kept = Vec::new();
    while let Some(look) = looks.join_next().await {
        let (s, seen) = look.expect("look");
        match seen {
            Err(_) => still_open.push(s),
            Ok(Ok(text)) if !text.is_empty() => {
                answered.push(text);
                kept.push(s);
            }
            Ok(_) => refused_at_accept += 1,
        }
    }
    assert!(
        !still_open.is_empty() && still_open.len() < 256,
        "held: {}",
        still_open.len()
    );
    assert!(
        refused_at_accept + answered.len() > 0,
        "the budget refused some of the 400"
    );
    for a in &answered {
        assert!(a.starts_with("HTTP/1.1 502"), "{a}");
    }
    // The reserve: the admin API is served while the budget is spent.
    assert_eq!(admin.get("/readyz").await.status, 200);
    // The share: another client is served while the first holds all it may.
    assert_eq!(
        get_from("127.0.0.2", proc.proxy, "/public/other").await,
        "HTTP/1.1 200",
        "another address is served while one holds its share"
    );

    // The client lets go; a new client is served.
    double.release("fds");
    drop(still_open);
    drop(kept);
    // (Until the proxy has seen the first client's connections close, a new one may still
    // be closed at accept: looked at again, not taken for an answer.)
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        if get_from("127.0.0.1", proc.proxy, "/public/after").await == "HTTP/1.1 200" {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never served again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let lines = said.lines();
    assert!(
        !lines
            .iter()
            .any(|l| l.contains("accept failed") || l.contains("Too many open files")),
        "{lines:#?}"
    );
}

/// The status line's first 12 bytes of a GET of `path` sent from the loopback address
/// `from`, on a connection of its own.
async fn get_from(from: &str, to: SocketAddr, path: &str) -> String {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(SocketAddr::new(from.parse().expect("address"), 0))
        .expect("bind a loopback address");
    let mut s = tokio::time::timeout(BOUND, socket.connect(to))
        .await
        .expect("connect in time")
        .expect("connect");
    let req = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("send");
    let mut out = Vec::new();
    let _ = tokio::time::timeout(BOUND, s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out[..out.len().min(12)]).into_owned()
}

/// One client's HTTP/2 streams count on its share of descriptors (two per connection, one
/// per open stream): past `server.max_descriptors_per_ip`, a new stream is answered 502
/// `upstream_unavailable` saying why, nothing forwarded, while another client is served;
/// once the held answers end, the client may open streams again.
#[tokio::test]
async fn a_clients_streams_count_on_its_share_of_descriptors() {
    const SHARE: usize = 20;
    let double = support::Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = support::write_config(dir.path(), double.addr);
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(text.contains("[server]\n"), "{text}");
    std::fs::write(
        &config,
        text.replacen(
            "[server]\n",
            &format!("[server]\nmax_descriptors_per_ip = {SHARE}\n"),
            1,
        ),
    )
    .unwrap();
    let (proc, _said) = spawn_limited(&config, p, a, "true");

    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(SocketAddr::new([127, 0, 0, 3].into(), 0))
        .expect("bind");
    let io = socket.connect(proc.proxy).await.expect("connect");
    let (mut send, conn) = h2::client::handshake(io).await.expect("h2 handshake");
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    // 30 streams the upstream holds: the connection counts two, so 18 may be open.
    let mut responses = Vec::new();
    for i in 0..30 {
        let req = http::Request::get(format!("http://x/public/s{i}"))
            .header("x-test-hold", "share")
            .body(())
            .unwrap();
        let (resp, _) = send.send_request(req, true).expect("send");
        responses.push(resp);
    }
    // The 12 past the share are answered at once; the 18 others reach the upstream.
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let inside = double
            .seen()
            .iter()
            .filter(|s| s.target.starts_with("/public/s"))
            .count();
        if inside == SHARE - 2 {
            break;
        }
        assert!(inside < SHARE - 2, "{inside} streams forwarded");
        assert!(tokio::time::Instant::now() < deadline, "{inside} forwarded");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut refused = 0;
    for resp in responses {
        match tokio::time::timeout(Duration::from_millis(500), resp).await {
            Ok(Ok(r)) => {
                assert_eq!(r.status(), 502);
                assert_eq!(r.headers()["fencing-result"], "upstream_unavailable");
                let mut body = r.into_body();
                let mut text = Vec::new();
                while let Some(chunk) = body.data().await {
                    text.extend_from_slice(&chunk.expect("body"));
                }
                let text = String::from_utf8_lossy(&text).into_owned();
                assert!(
                    text.contains("holds 20 file descriptors, as many as it may"),
                    "{text}"
                );
                refused += 1;
            }
            Ok(Err(e)) => panic!("stream failed: {e}"),
            Err(_) => {}
        }
    }
    assert_eq!(refused, 30 - (SHARE - 2));
    // Another client is served meanwhile.
    assert_eq!(
        get_from("127.0.0.4", proc.proxy, "/public/other").await,
        "HTTP/1.1 200"
    );
    // The held answers end: the client may open streams again.
    double.release("share");
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let req = http::Request::get("http://x/public/again")
            .body(())
            .unwrap();
        let (resp, _) = send.send_request(req, true).expect("send");
        let r = tokio::time::timeout(BOUND, resp)
            .await
            .expect("answered in time")
            .expect("answer");
        if r.status() == 200 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never served again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    driver.abort();
}

/// An upstream that answers every GET 200 with `size` bytes, counting the requests for
/// `…/big`; no answer to those starts before `barrier` of them have come (or [`BOUND`]
/// has passed), so that every stream a client opens is in before any answer fills its
/// connection.
async fn sized_upstream(
    size: usize,
    barrier: usize,
) -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let all_in = std::sync::Arc::new(tokio::sync::Notify::new());
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let body = Bytes::from(vec![b'x'; size]);
    let seen = std::sync::Arc::new(AtomicUsize::new(0));
    let count = seen.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (body, count, all_in) = (body.clone(), count.clone(), all_in.clone());
            let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                // Only the big GETs are counted and held.
                let held = req.uri().path().ends_with("/big");
                if held && count.fetch_add(1, Ordering::AcqRel) + 1 == barrier {
                    all_in.notify_waiters();
                }
                let (body, count, all_in) = (body.clone(), count.clone(), all_in.clone());
                async move {
                    let _ = tokio::time::timeout(BOUND, async {
                        if !held {
                            return;
                        }
                        loop {
                            let notified = all_in.notified();
                            if count.load(Ordering::Acquire) >= barrier {
                                return;
                            }
                            notified.await;
                        }
                    })
                    .await;
                    Ok::<_, std::io::Error>(hyper::Response::new(Full::new(body)))
                }
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, seen)
}

/// A socket that stops reading once told: the peer's writes back up as a client's that
/// never reads would.
struct Stall {
    io: tokio::net::TcpStream,
    reading: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl tokio::io::AsyncRead for Stall {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if !self.reading.load(std::sync::atomic::Ordering::Acquire) {
            return std::task::Poll::Pending;
        }
        std::pin::Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Stall {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Resident memory of a process now (VmRSS), in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmRSS")
        * 1024
}

/// Waits (bounded) until the RSS of `pid` holds still for a second; answers it.
async fn settled_rss(pid: u32) -> u64 {
    let mut last = rss(pid);
    let mut still = 0;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = rss(pid);
        if now.abs_diff(last) < 256 << 10 {
            still += 1;
            if still >= 5 {
                return now;
            }
        } else {
            still = 0;
        }
        last = now;
    }
    last
}

/// Opens a prior-knowledge HTTP/2 connection with a huge window that asks for `streams`
/// GETs of `path` and then never reads; answers what keeps it open.
async fn slow_reader(
    to: SocketAddr,
    path: &str,
    streams: usize,
) -> (
    h2::client::SendRequest<Bytes>,
    Vec<h2::client::ResponseFuture>,
    tokio::task::JoinHandle<()>,
) {
    let io = tokio::net::TcpStream::connect(to).await.expect("connect");
    let reading = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stall = Stall { io, reading };
    let (mut send, conn) = h2::client::Builder::new()
        .initial_window_size((1 << 31) - 1)
        .initial_connection_window_size((1 << 31) - 1)
        .initial_max_send_streams(streams)
        .handshake::<_, Bytes>(stall)
        .await
        .expect("h2 handshake");
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut responses = Vec::new();
    for _ in 0..streams {
        let req = http::Request::get(format!("http://x{path}"))
            .body(())
            .unwrap();
        match send.send_request(req, true) {
            Ok((resp, _)) => responses.push(resp),
            Err(_) => break,
        }
    }
    (send, responses, driver)
}

/// Prior-knowledge HTTP/2 clients that open as many streams of a 4 MB GET as they may,
/// with a huge window, and never read: the proxy's memory per connection stays within the
/// documented bound, each connection serves at most the streams cap (and so holds at
/// most that many upstream connections), and the memory goes back once they leave.
#[tokio::test]
async fn http2_readers_that_never_read_are_bounded() {
    use std::sync::atomic::Ordering;
    const CONNS: usize = 6;
    const CAP: usize = fencegate::listen::config::DEFAULT_STREAMS as usize;
    let (upstream, seen) = sized_upstream(4 << 20, CONNS * CAP).await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = support::write_config(dir.path(), upstream);
    let (proc, _said) = spawn_limited(&config, p, a, "true");
    let pid = proc.child.id();
    // Warm: one exchange, so the runtime and pools are made.
    let client = Client::new(proc.proxy);
    assert_eq!(
        client.send("GET", "/public/warm", &[], "").await.status,
        200
    );
    let before = settled_rss(pid).await;

    let mut held = Vec::new();
    for _ in 0..CONNS {
        held.push(slow_reader(proc.proxy, "/public/big", 256).await);
    }
    // Every stream the proxy took reached the upstream (bounded wait).
    let deadline = tokio::time::Instant::now() + BOUND;
    while seen.load(Ordering::Acquire) < CONNS * CAP {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {} streams reached the upstream",
            seen.load(Ordering::Acquire)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let loaded = settled_rss(pid).await;
    let upstream_requests = seen.load(Ordering::Acquire);
    let per_conn = loaded.saturating_sub(before) / CONNS as u64;
    eprintln!(
        "h2 slow readers: {CONNS} connections, {upstream_requests} upstream requests, RSS {} MiB -> {} MiB, {} KiB per connection",
        before >> 20,
        loaded >> 20,
        per_conn >> 10
    );
    // The clients leave: the memory goes back.
    for (_, _, driver) in &held {
        driver.abort();
    }
    drop(held);
    let after = settled_rss(pid).await;
    eprintln!(
        "h2 slow readers gone: RSS {} MiB, {} fds",
        after >> 20,
        std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
    );
    assert_eq!(
        upstream_requests,
        CONNS * CAP,
        "at most {CAP} streams per connection are served"
    );
    assert!(
        per_conn <= (CAP as u64) * (128 << 10),
        "memory per connection: {} KiB",
        per_conn >> 10
    );
    assert!(
        after <= before + (loaded - before) / 4,
        "RSS {} MiB before, {} MiB loaded, {} MiB after",
        before >> 20,
        loaded >> 20,
        after >> 20
    );
    // Still serving.
    assert_eq!(
        client.send("GET", "/public/after", &[], "").await.status,
        200
    );
}

/// Fills the volume at `dir` with a file of its own until the disk refuses more.
fn fill(dir: &Path) -> PathBuf {
    use std::io::Write;
    let path = dir.join("filler");
    let mut f = std::fs::File::create(&path).expect("filler");
    let chunk = vec![0u8; 1 << 20];
    // Bounded: a tmpfs of a few MB takes a few writes.
    for _ in 0..1024 {
        if f.write_all(&chunk).is_err() {
            break;
        }
    }
    let _ = f.sync_all();
    path
}

/// A store whose disk filled (something else took the volume; a commit failed with
/// ENOSPC) fails closed, then reopens by itself once space returns: writes are taken
/// again without a restart, and no mark acknowledged before is lost or lowered.
#[tokio::test]
async fn a_store_that_hit_a_full_disk_recovers_once_space_returns() {
    use fencegate::store::MarkStore;
    use fencegate::token::Token;
    let Some(vol) = Tmpfs::mount("24m") else {
        return;
    };
    let store = MarkStore::open(&vol.path.join("marks.redb")).expect("open");
    store
        .advance("kept".into(), Token::new(1, 7))
        .await
        .expect("advance");
    let filler = fill(&vol.path);
    // A record too large for what is left: its commit fails, and the store with it.
    let mut value = u64::MAX.to_be_bytes().to_vec();
    value.resize(4 << 20, b'x');
    let claimed = store.claim("s\0k".into(), value, None, 0).await;
    assert!(
        claimed.is_err(),
        "a commit on a full disk fails: {claimed:?}"
    );
    assert!(store.is_failed());
    assert!(
        store
            .advance("other".into(), Token::new(1, 1))
            .await
            .is_err(),
        "failed closed"
    );

    // Space returns: the store reopens by itself (bounded wait).
    std::fs::remove_file(&filler).expect("remove filler");
    let deadline = tokio::time::Instant::now() + BOUND;
    while store.is_failed() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the store never reopened"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        store
            .advance("other".into(), Token::new(1, 1))
            .await
            .expect("advance"),
        Token::new(1, 1)
    );
    assert_eq!(
        store
            .advance("kept".into(), Token::new(1, 3))
            .await
            .expect("advance"),
        Token::new(1, 7),
        "the mark acknowledged before is kept, never lowered"
    );
    store.close().await;
}

/// The new bounds are validated with their key paths; the defaults are the documented
/// ones.
#[test]
fn the_bounds_are_checked_and_default_as_documented() {
    let dir = tempfile::tempdir().unwrap();
    let text = |extra_store: &str, server: &str, idempotency: &str| {
        format!(
            "[server]\n{server}\n[store]\npath = \"x.redb\"\n{extra_store}\n[idempotency]\n{idempotency}\n[[upstream]]\nname = \"u\"\nurl = \"http://127.0.0.1:9\"\n[[route]]\nname = \"r\"\npath = \"/r/{{k}}\"\nscope = \"r/{{k}}\"\nupstream = \"u\"\n"
        )
    };
    let errors = fencegate::settings::Config::parse(
        &text(
            "min_free = \"lots\"",
            "max_concurrent_streams = 5000\nmax_descriptors_per_ip = 1",
            "max_records_per_client = 0\nmax_record_bytes_per_scope = \"100KiB\"",
        ),
        dir.path(),
    )
    .expect_err("bad bounds");
    let paths: Vec<&str> = errors.0.iter().map(|e| e.path.as_str()).collect();
    for path in [
        "server.max_concurrent_streams",
        "server.max_descriptors_per_ip",
        "store.min_free",
        "idempotency.max_records_per_client",
        "idempotency.max_record_bytes_per_scope",
    ] {
        assert!(paths.contains(&path), "{path} in {paths:?}");
    }
    let config =
        fencegate::settings::Config::parse(&text("", "", ""), dir.path()).expect("defaults");
    assert_eq!(config.server.max_concurrent_streams, 128);
    // Half the descriptor budget, found at start.
    assert_eq!(config.server.max_descriptors_per_ip, None);
    assert_eq!(config.store.min_free, 64 << 20);
    let i = &config.idempotency;
    assert_eq!(
        (i.max_records.records, i.max_records.bytes),
        (1_000_000, 4 << 30)
    );
    for per in [i.max_records_per_scope, i.max_records_per_client] {
        assert_eq!((per.records, per.bytes), (10_000, 256 << 20));
    }
}

/// [`support::write_config`] with `server` lines added to `[server]` and the upstream's
/// timeout raised (held requests must not time out while a test looks at them).
fn share_config(dir: &Path, upstream: SocketAddr, server: &str) -> (PathBuf, u16, u16) {
    let (config, p, a) = support::write_config(dir, upstream);
    let text = std::fs::read_to_string(&config).unwrap();
    let text = text
        .replacen("[server]\n", &format!("[server]\n{server}\n"), 1)
        .replace("\ntimeout = \"10s\"", "\ntimeout = \"300s\"");
    assert!(text.contains("\ntimeout = \"300s\""), "{text}");
    std::fs::write(&config, text).unwrap();
    (config, p, a)
}

/// An HTTP/2 connection from the loopback address `from` to `to`, driven by a task.
async fn h2_from(
    from: &str,
    to: SocketAddr,
) -> (h2::client::SendRequest<Bytes>, tokio::task::JoinHandle<()>) {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(SocketAddr::new(from.parse().expect("address"), 0))
        .expect("bind a loopback address");
    let io = socket.connect(to).await.expect("connect");
    let (send, conn) = h2::client::handshake(io).await.expect("h2 handshake");
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    (send, driver)
}

/// [`h2_from`], once the proxy has admitted the connection: one request answered on it.
/// (A client that reconnects as soon as it read the end of its last connection may find
/// that connection's slot not given back yet, and this one closed at accept: it tries
/// again, within [`BOUND`].)
async fn admitted_h2_from(
    from: &str,
    to: SocketAddr,
) -> (h2::client::SendRequest<Bytes>, tokio::task::JoinHandle<()>) {
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let (send, driver) = h2_from(from, to).await;
        let answered = async {
            let mut ready = send.clone().ready().await.ok()?;
            let req = http::Request::get("http://x/public/admitted")
                .body(())
                .unwrap();
            let (resp, _) = ready.send_request(req, true).ok()?;
            tokio::time::timeout(BOUND, resp).await.ok()?.ok()
        };
        if answered.await.is_some_and(|r| r.status() == 200) {
            return (send, driver);
        }
        driver.abort();
        assert!(
            tokio::time::Instant::now() < deadline,
            "an HTTP/2 connection was never admitted"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Sends a keyed PUT to its own scope on `send`, waits (bounded) until the upstream holds
/// it, then resets the stream (both handles dropped: RST_STREAM CANCEL). Answers whether
/// it reached the upstream (else how fencegate answered).
async fn keyed_then_reset(
    send: &mut h2::client::SendRequest<Bytes>,
    double: &support::Double,
    i: usize,
) -> Result<(), String> {
    let before = double.seen().len();
    let req = http::Request::put(format!("http://x/idem/d{i}"))
        .header("fencing-token", "1")
        .header("idempotency-key", format!("\"d{i}\""))
        .header("x-test-hold", "detached")
        .header("content-length", "2")
        .body(())
        .unwrap();
    let mut send = tokio::time::timeout(BOUND, send.clone().ready())
        .await
        .expect("ready in time")
        .expect("ready");
    let (resp, mut body) = send.send_request(req, false).expect("send");
    body.send_data(Bytes::from_static(b"hi"), true)
        .expect("body");
    let mut resp = std::pin::pin!(resp);
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        if double.seen().len() > before {
            return Ok(());
        }
        if let Ok(r) = tokio::time::timeout(Duration::from_millis(5), resp.as_mut()).await {
            return Err(match r {
                Ok(r) => format!("{} {:?}", r.status(), r.headers().get("fencing-result")),
                Err(e) => e.to_string(),
            });
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "request {i} never arrived"
        );
    }
    // (Dropping `resp` and `body` here resets the stream.)
}

/// The same, with the process's budget small (`ulimit -n 256`): one client, one HTTP/2
/// connection, takes every upstream descriptor of the budget with reset keyed streams,
/// and another client's request is refused for want of one.
#[tokio::test]
async fn reset_keyed_streams_cannot_starve_another_client() {
    let double = support::Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = share_config(dir.path(), double.addr, "");
    let (proc, _said) = spawn_limited(&config, p, a, "ulimit -n 256");
    let (mut send, driver) = h2_from("127.0.0.8", proc.proxy).await;
    let mut reached = 0;
    let mut refused = None;
    for i in 0..300 {
        match keyed_then_reset(&mut send, &double, i).await {
            Ok(()) => reached += 1,
            Err(e) => {
                refused = Some(e);
                break;
            }
        }
    }
    let other = get_from("127.0.0.9", proc.proxy, "/public/other").await;
    double.release("detached");
    driver.abort();
    assert_eq!(
        other, "HTTP/1.1 200",
        "another client refused after one held {reached} upstream connections (then: {refused:?})"
    );
}

/// The admin listener's connections are not counted in the budget (they live on the
/// reserve), yet one client may open a share of them (half the budget, two each): with the
/// budget spent by proxy traffic, one client's idle admin connections take the reserve, and
/// the admin API itself (and the store, the log) find no descriptor.
#[tokio::test]
async fn one_clients_admin_connections_cannot_take_the_reserve() {
    let double = support::Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = share_config(dir.path(), double.addr, "");
    let (proc, said) = spawn_limited(&config, p, a, "ulimit -n 256");
    // Two clients spend the budget with held requests (each within its share).
    let mut held = Vec::new();
    for (c, from) in ["127.0.0.12", "127.0.0.13"].iter().enumerate() {
        for i in 0..70 {
            let socket = tokio::net::TcpSocket::new_v4().expect("socket");
            socket
                .bind(SocketAddr::new(from.parse().unwrap(), 0))
                .expect("bind");
            let Ok(mut s) = socket.connect(proc.proxy).await else {
                continue;
            };
            let req =
                format!("GET /public/r{c}-{i} HTTP/1.1\r\nhost: x\r\nx-test-hold: res\r\n\r\n");
            if s.write_all(req.as_bytes()).await.is_ok() {
                held.push(s);
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let admin = Client::new(proc.admin);
    let metrics = admin.get("/metrics").await.body;
    let fds = support::metric_value(&metrics, "fencegate_connection_fds");
    let budget = support::metric_value(&metrics, "fencegate_connection_fds_budget");
    // A third client opens idle connections to the admin listener.
    let mut idle = Vec::new();
    for _ in 0..80 {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind(SocketAddr::new([127, 0, 0, 14].into(), 0))
            .expect("bind");
        if let Ok(Ok(s)) =
            tokio::time::timeout(Duration::from_secs(1), socket.connect(proc.admin)).await
        {
            idle.push(s);
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Which of them the admin listener kept: those it closed read EOF at once.
    let mut kept = 0;
    for s in &mut idle {
        let mut b = [0u8; 1];
        if tokio::time::timeout(Duration::from_millis(20), s.read(&mut b))
            .await
            .is_err()
        {
            kept += 1;
        }
    }
    let open = std::fs::read_dir(format!("/proc/{}/fd", proc.child.id()))
        .map(|d| d.count())
        .unwrap_or(0);
    // On a connection of its own (the client's pooled one is already accepted).
    let ready = get_from("127.0.0.1", proc.admin, "/readyz").await;
    double.release("res");
    let lines = said.lines();
    let emfile = lines.iter().filter(|l| l.contains("accept failed")).count();
    assert!(
        ready == "HTTP/1.1 200" && emfile == 0,
        "budget {budget}, {fds} taken; one client opened {kept} idle admin connections; \
         {open} descriptors open; /readyz: {ready:?}; {emfile} 'accept failed' lines, e.g. {:?}",
        lines.iter().find(|l| l.contains("accept failed"))
    );
}

/// A client that drops its HTTP/2 connection while streams are held upstream, then opens
/// another at once: the old streams end with the connection (their upstream connections
/// let go), so the fresh share the new connection finds is not on top of them.
#[tokio::test]
async fn a_dropped_connections_streams_end_with_it() {
    const SHARE: usize = 6;
    let double = support::Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = share_config(
        dir.path(),
        double.addr,
        &format!("max_descriptors_per_ip = {SHARE}"),
    );
    let (proc, _said) = spawn_limited(&config, p, a, "true");
    let admin = Client::new(proc.admin);
    let fds = || async {
        support::metric_value(
            &admin.get("/metrics").await.body,
            "fencegate_connection_fds",
        )
    };
    let mut most = 0.0f64;
    for round in 0..5 {
        let (send, driver) = h2_from("127.0.0.15", proc.proxy).await;
        let mut responses = Vec::new();
        for i in 0..SHARE - 2 {
            let req = http::Request::get(format!("http://x/public/r{round}-{i}"))
                .header("x-test-hold", "drop")
                .body(())
                .unwrap();
            let mut send = send.clone().ready().await.expect("ready");
            responses.push(send.send_request(req, true).expect("send"));
        }
        let deadline = tokio::time::Instant::now() + BOUND;
        while double
            .seen()
            .iter()
            .filter(|s| s.target.starts_with(&format!("/public/r{round}-")))
            .count()
            < SHARE - 2
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "round {round}: never forwarded"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        most = most.max(fds().await);
        driver.abort();
        drop((send, responses));
        // The proxy sees the close (a connection it has not is closed at accept).
        let deadline = tokio::time::Instant::now() + BOUND;
        while fds().await > 0.0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "round {round}: never let go"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = fds().await;
    double.release("drop");
    // One client connection and SHARE - 2 upstream ones at most, and nothing left after.
    assert!(
        most <= (SHARE - 1) as f64,
        "{most} descriptors counted at once"
    );
    assert_eq!(after, 0.0, "left counted after the client went");
}

/// Connections that end every odd way give their count back: closed at once, silent past
/// the first-bytes bound, a malformed head, an HTTP/2 preface then nothing, reset streams,
/// a held request abandoned. With a share of one connection, the client is served after.
#[tokio::test]
async fn abandoned_connections_give_their_share_back() {
    let double = support::Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = share_config(
        dir.path(),
        double.addr,
        "max_descriptors_per_ip = 3\nheader_read_timeout = \"200ms\"",
    );
    let (proc, _said) = spawn_limited(&config, p, a, "true");
    let proc = &proc;
    let from = "127.0.0.16";
    let connect = || async {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind(SocketAddr::new(from.parse().unwrap(), 0))
            .expect("bind");
        socket.connect(proc.proxy).await.expect("connect")
    };
    // Served again (within the bound): nothing of the client's share is left held. (Idle
    // upstream connections stay counted in the process's total, not in the share.)
    let settle = |step: &'static str| async move {
        let deadline = tokio::time::Instant::now() + BOUND;
        loop {
            if get_from(from, proc.proxy, "/public/settle").await == "HTTP/1.1 200" {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "never let go: {step}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    settle("start").await;
    for round in 0..3 {
        drop(connect().await);
        settle("step1").await;
        let mut s = connect().await;
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(BOUND, s.read_to_end(&mut sink)).await;
        settle("step2").await;
        let mut s = connect().await;
        let _ = s.write_all(b"GARBAGE\r\n\r\n").await;
        let _ = tokio::time::timeout(BOUND, s.read_to_end(&mut sink)).await;
        settle("step3").await;
        let mut s = connect().await;
        let _ = s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
        let _ = tokio::time::timeout(BOUND, s.read_to_end(&mut sink)).await;
        settle("step4").await;
        let (send, driver) = admitted_h2_from(from, proc.proxy).await;
        for i in 0..3 {
            let req = http::Request::get(format!("http://x/public/a{round}-{i}"))
                .header("x-test-hold", "abandon")
                .body(())
                .unwrap();
            let mut send = send.clone().ready().await.expect("ready");
            let (resp, _) = send.send_request(req, true).expect("send");
            tokio::time::sleep(Duration::from_millis(20)).await;
            drop(resp);
        }
        driver.abort();
        drop(send);
        settle("step5").await;
        let mut s = connect().await;
        let _ = s
            .write_all(b"GET /public/held HTTP/1.1\r\nhost: x\r\nx-test-hold: abandon\r\n\r\n")
            .await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(s);
        settle("step6").await;
    }
    double.release("abandon");
}

/// A keyed request whose client resets its stream goes on upstream (its answer is recorded
/// for the retry), holding its upstream connection; the stream's count on the client's
/// share was given back with the stream. One HTTP/2 connection thus holds any number of
/// upstream connections: past `max_descriptors_per_ip`, and past `max_concurrent_streams`.
#[tokio::test]
async fn reset_keyed_streams_hold_upstream_descriptors_within_the_share() {
    const SHARE: usize = 6;
    let double = support::Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = share_config(
        dir.path(),
        double.addr,
        &format!("max_descriptors_per_ip = {SHARE}\nmax_concurrent_streams = 2"),
    );
    let (proc, _said) = spawn_limited(&config, p, a, "true");
    let (mut send, driver) = h2_from("127.0.0.7", proc.proxy).await;
    let mut reached = 0;
    for i in 0..12 {
        if keyed_then_reset(&mut send, &double, i).await.is_ok() {
            reached += 1;
        }
    }
    double.release("detached");
    driver.abort();
    // The connection counts two: at most SHARE - 2 upstream connections for its streams.
    assert!(
        reached <= SHARE - 2,
        "one client held {reached} upstream connections at once (share {SHARE})"
    );
}

/// The HTTP/1 form: a keyed request, its connection closed once the upstream holds it.
/// The connection's two are given back at close; the exchange goes on, detached.
#[tokio::test]
async fn closed_keyed_http1_requests_hold_upstream_descriptors_within_the_share() {
    const SHARE: usize = 4;
    let double = support::Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = share_config(
        dir.path(),
        double.addr,
        &format!("max_descriptors_per_ip = {SHARE}"),
    );
    let (proc, _said) = spawn_limited(&config, p, a, "true");
    let mut reached = 0;
    for i in 0..10 {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind(SocketAddr::new([127, 0, 0, 10].into(), 0))
            .expect("bind");
        let Ok(mut s) = socket.connect(proc.proxy).await else {
            continue;
        };
        let before = double.seen().len();
        let req = format!(
            "PUT /idem/h{i} HTTP/1.1\r\nhost: x\r\nfencing-token: 1\r\nidempotency-key: \"h{i}\"\r\n\
             x-test-hold: detached1\r\ncontent-length: 2\r\n\r\nhi"
        );
        if s.write_all(req.as_bytes()).await.is_err() {
            continue;
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        while double.seen().len() == before && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if double.seen().len() > before {
            reached += 1;
        }
        drop(s);
        // The proxy sees the close before the next connection comes.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    double.release("detached1");
    // A connection counts two, its request's upstream connection among them.
    assert!(
        reached <= SHARE / 2,
        "one client held {reached} upstream connections at once (share {SHARE})"
    );
}
