//! Adversarial input against the real binary: smuggling, malformed and oversized heads,
//! slowloris, h2 rapid reset, invalid paths, a flood of new scopes. Each gets a clear
//! error; nothing unfenced reaches the upstream; memory stays bounded.

use crate::support;

use std::net::SocketAddr;
use std::time::Duration;

use support::{BOUND, Client, Double, peak_rss, spawn, status_of as status, write_config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Sends raw bytes and reads what comes back until the server closes (bounded).
async fn raw(addr: SocketAddr, bytes: &[u8]) -> String {
    let (_, text) = support::raw(addr, bytes).await;
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_clients_get_clear_errors_and_nothing_unfenced_passes() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = write_config(dir.path(), double.addr);
    let text = std::fs::read_to_string(&config).unwrap().replace(
        "trusted_proxies = [\"127.0.0.1\"]",
        "header_read_timeout = \"300ms\"\nmax_header_bytes = \"16KiB\"\nmax_headers = 50",
    );
    std::fs::write(&config, text).unwrap();
    let mut proc = spawn(&config, p, a);
    let addr = proc.proxy;
    let pid = proc.child.id();

    // Request smuggling: the proxy re-frames every request it forwards, so a second
    // request hidden in a body can only ever be parsed by the proxy itself.
    let cl_te = raw(
        addr,
        b"PUT /reports/s/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\nContent-Length: 4\r\n\
          Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nDELETE /reports/s/x HTTP/1.1\r\nHost: a\r\n\
          Connection: close\r\n\r\n",
    )
    .await;
    // Both framings: refused (as nginx does), the connection closed after the answer, so
    // the hidden DELETE is never read at all.
    assert_eq!(status(&cl_te), 400, "CL+TE: {cl_te}");
    assert_eq!(
        cl_te.matches("HTTP/1.1 ").count(),
        1,
        "one answer only: {cl_te}"
    );
    let dup_cl = raw(
        addr,
        b"PUT /reports/s/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\nContent-Length: 1\r\n\
          Content-Length: 2\r\nConnection: close\r\n\r\nab",
    )
    .await;
    assert_eq!(status(&dup_cl), 400, "duplicate Content-Length: {dup_cl}");
    let fold = raw(
        addr,
        b"PUT /reports/s/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\n 2\r\nContent-Length: 0\r\n\
          Connection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status(&fold), 400, "obs-fold: {fold}");
    let absolute = raw(
        addr,
        b"PUT http://127.0.0.1/reports/s/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\n\
          Content-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status(&absolute), 400, "absolute form: {absolute}");
    assert!(absolute.contains("invalid_path"));

    // Oversized and overlong heads: 431.
    let big = format!(
        "PUT /reports/s/x HTTP/1.1\r\nHost: a\r\nX-Big: {}\r\nConnection: close\r\n\r\n",
        "a".repeat(20 << 10)
    );
    assert_eq!(status(&raw(addr, big.as_bytes()).await), 431);
    let many: String = (0..60).map(|i| format!("X-H{i}: v\r\n")).collect();
    let many = format!("GET /public/x HTTP/1.1\r\nHost: a\r\n{many}Connection: close\r\n\r\n");
    assert_eq!(status(&raw(addr, many.as_bytes()).await), 431);

    // Invalid UTF-8 and unsafe paths never map to a scope.
    for path in [
        "/reports/%ff/x",
        "/reports/%c0%ae%c0%ae/x",
        "/reports/a%00/x",
    ] {
        let req = format!(
            "PUT {path} HTTP/1.1\r\nHost: a\r\nFencing-Token: 9\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        let resp = raw(addr, req.as_bytes()).await;
        assert_eq!(status(&resp), 400, "{path}: {resp}");
    }
    let raw_bytes = raw(
        addr,
        b"PUT /reports/\xff/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 9\r\nContent-Length: 0\r\n\
          Connection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status(&raw_bytes), 400);

    // Slowloris: a head that never completes is cut off by header_read_timeout.
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"PUT /reports/s/x HTTP/1.1\r\nHost: a\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), slow.read_to_end(&mut buf)).await;
    assert!(closed.is_ok(), "a slow head must be cut off");
    // Before a head even begins: a connection that sends nothing, or part of the HTTP/2
    // preface and then nothing, leaves the protocol undecided. It is cut off too (it
    // would hold its connection slot for good).
    for first in [&b""[..], b"PRI * HTTP/2.0\r\n"] {
        let mut silent = TcpStream::connect(addr).await.unwrap();
        silent.write_all(first).await.unwrap();
        let mut buf = Vec::new();
        let closed =
            tokio::time::timeout(Duration::from_secs(5), silent.read_to_end(&mut buf)).await;
        assert!(closed.is_ok(), "{first:?} and silence must be cut off");
    }
    // An HTTP/2 connection with no open stream is closed once it has been idle for
    // header_read_timeout, as an idle HTTP/1 connection is: right after the preface, and
    // after its last response (which it gets whole first).
    for requests in [0, 1] {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (h2, conn) = h2::client::handshake(tcp).await.unwrap();
        let conn = tokio::spawn(conn);
        let mut h2 = h2.ready().await.unwrap();
        for _ in 0..requests {
            let req = http::Request::get("http://a/public/x").body(()).unwrap();
            let (resp, _) = h2.send_request(req, true).unwrap();
            let resp = resp.await.unwrap();
            assert_eq!(resp.status(), 200);
            let mut body = resp.into_body();
            while let Some(chunk) = body.data().await {
                chunk.unwrap();
            }
            h2 = h2.ready().await.unwrap();
        }
        let ended = tokio::time::timeout(Duration::from_secs(5), conn).await;
        assert!(
            ended.is_ok(),
            "an idle HTTP/2 connection ({requests} requests) must be closed"
        );
        drop(h2);
    }

    // HTTP/2 rapid reset: streams opened and cancelled at once, many times.
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (h2, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut h2 = h2.ready().await.unwrap();
    let mut opened = 0;
    for _ in 0..2_000 {
        let req = http::Request::put(format!("http://{addr}/reports/rr/x"))
            .header("fencing-token", "1")
            .body(())
            .unwrap();
        match h2.send_request(req, false) {
            Ok((_resp, mut stream)) => {
                stream.send_reset(h2::Reason::CANCEL);
                opened += 1;
            }
            Err(_) => break,
        }
        h2 = match h2.ready().await {
            Ok(h) => h,
            Err(_) => break,
        };
    }
    eprintln!("h2 rapid reset: {opened} streams opened and reset before the server stopped us");
    assert!(opened > 0);

    // A flood of new scopes: every one fenced and durable, memory bounded.
    let client = Client::new(addr);
    let mut tasks = Vec::new();
    for w in 0..16 {
        let c = client.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..625 {
                let r = c.put(&format!("/reports/flood-{w}-{i}/x"), "1", "").await;
                assert_eq!(r.status, 200);
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(BOUND * 6, t).await.unwrap().unwrap();
    }

    // Still healthy, and nothing without a valid token reached the upstream.
    assert_eq!(client.put("/reports/after/x", "1", "").await.status, 200);
    for seen in double.seen() {
        if seen.target.starts_with("/reports/") {
            let token = seen.header("fencing-token").unwrap_or("");
            assert!(
                fencegate::token::Token::parse(token.as_bytes()).is_ok(),
                "unfenced request reached the upstream: {seen:?}"
            );
        }
        assert_ne!(
            seen.method, "DELETE",
            "smuggled request reached the upstream"
        );
    }
    let rss = peak_rss(pid);
    eprintln!(
        "fencegate peak RSS after the adversarial run: {} MiB",
        rss >> 20
    );
    assert!(rss < 96 << 20, "peak RSS {} MiB", rss >> 20);
    proc.child.kill().unwrap();
    proc.child.wait().unwrap();
}

/// A `host =` route is not fallen past on a spelling of its host that the backend reads
/// as the same host, nor on a request that names no host (the upstream would fill in its
/// own): with an unfenced catch-all behind it on the same upstream, either would be an
/// unfenced path to the fenced virtual host. (The upstream serves each host name its own
/// objects, `distinct_hosts`: else the two routes would be refused, SPEC §2.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_a_route_was_chosen_on_is_the_host_the_backend_sees() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[store]
path = "marks.redb"
[[upstream]]
name = "u"
url = "http://{}"
distinct_hosts = true
[[route]]
name = "files"
host = "files.internal"
api = "plain"
path = "/{{*k}}"
scope = "f/{{k}}"
upstream = "u"
[[route]]
name = "rest"
path = "/{{*k}}"
upstream = "u"
fenced = false
"#,
        double.addr
    );
    let config = fencegate::settings::Config::parse(&text, dir.path()).unwrap();
    let proxy = support::start(config).await;
    let addr = proxy.proxy_addr;
    let put = |host: &str| {
        format!("PUT /k HTTP/1.1\r\n{host}Content-Length: 0\r\nConnection: close\r\n\r\n")
    };
    // The same host, spelt with a trailing dot or another case: the fenced route.
    for host in ["Host: files.internal.\r\n", "Host: FILES.internal:80\r\n"] {
        let (code, text) = support::raw(addr, put(host).as_bytes()).await;
        assert_eq!(code, 428, "{host:?}: {text}");
    }
    // No host, an empty one, or one that is no host at all: refused.
    for host in [
        "",
        "Host: \r\n",
        "Host: files.internal:x\r\n",
        "Host: u@files.internal\r\n",
        "Host: files.internal\r\nHost: other\r\n",
    ] {
        let (code, text) = support::raw(addr, put(host).as_bytes()).await;
        assert_eq!(code, 400, "{host:?}: {text}");
        assert!(text.contains("invalid_request"), "{host:?}: {text}");
    }
    assert!(double.seen().is_empty(), "nothing reached the upstream");
    // Another host takes the catch-all, as does HTTP/1.0 without a Host.
    let (code, _) = support::raw(addr, put("Host: other.internal\r\n").as_bytes()).await;
    assert_eq!(code, 200);
    let (code, _) = support::raw(addr, b"GET /k HTTP/1.0\r\n\r\n").await;
    assert_eq!(code, 200);
    assert_eq!(double.seen().len(), 2);
}
