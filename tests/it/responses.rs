//! End-to-end proof of the SPEC §4 response table: every result the proxy produces today,
//! over real loopback sockets against the in-process proxy and the upstream double.
//!
//! Each refusal is checked for status, `Fencing-Result`, `application/problem+json`, the
//! problem members, and that nothing reached the upstream.

use crate::support;

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use fencegate::app::Running;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Version};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use support::{BOUND, Client, Double, Resp, Seen};
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// A proxy in front of a fresh upstream double, with its store in a temporary directory.
struct Env {
    double: Double,
    proxy: Running,
    client: Client,
    _dir: TempDir,
}

impl Env {
    /// The standard test config (`support::config`).
    async fn start() -> Env {
        let double = Double::start().await;
        let dir = tempfile::tempdir().expect("tempdir");
        let proxy = support::start(support::config(double.addr, dir.path())).await;
        Env::assemble(double, proxy, dir)
    }

    /// A config built from `support::config_text(addr, drain, settle, timeout)`.
    async fn with_timings(drain: &str, settle: &str, timeout: &str) -> Env {
        let double = Double::start().await;
        let dir = tempfile::tempdir().expect("tempdir");
        let text = support::config_text(double.addr, drain, settle, timeout);
        let config = fencegate::settings::Config::parse(&text, dir.path()).expect("test config");
        let proxy = support::start(config).await;
        Env::assemble(double, proxy, dir)
    }

    fn assemble(double: Double, proxy: Running, dir: TempDir) -> Env {
        let client = Client::new(proxy.proxy_addr);
        Env {
            double,
            proxy,
            client,
            _dir: dir,
        }
    }

    fn addr(&self) -> SocketAddr {
        self.proxy.proxy_addr
    }

    fn seen(&self) -> Vec<Seen> {
        self.double.seen()
    }

    async fn send(&self, method: &str, path: &str, headers: &[(&str, &str)]) -> Resp {
        self.client.send(method, path, headers, "").await
    }

    /// Sends a request that fencegate must refuse by itself; checks the problem response
    /// and that the upstream saw nothing. Returns the problem body.
    async fn refused(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        status: u16,
        result: &str,
    ) -> Value {
        let before = self.seen().len();
        let resp = self.send(method, path, headers).await;
        let problem = assert_problem(&resp, status, result);
        assert_eq!(
            self.seen().len(),
            before,
            "{method} {path} {headers:?} was refused ({result}) but reached the upstream"
        );
        problem
    }

    /// Like [`Env::refused`], with raw request bytes (for targets no client would build).
    async fn refused_raw(&self, request: &str, status: u16, result: &str) -> Value {
        let before = self.seen().len();
        let resp = raw(self.addr(), request).await;
        let problem = assert_problem(&resp, status, result);
        assert_eq!(
            self.seen().len(),
            before,
            "{request:?} was refused ({result}) but reached the upstream"
        );
        problem
    }

    /// Sends a fenced request that must pass: 200 from the double, `accepted`, and exactly
    /// one new upstream request with the target as sent. Returns what the upstream saw.
    async fn accepted(&self, method: &str, path: &str, headers: &[(&str, &str)]) -> Seen {
        let before = self.seen().len();
        let resp = self.send(method, path, headers).await;
        assert_eq!(resp.status, 200, "{method} {path} {headers:?}: {resp:?}");
        assert_eq!(resp.result(), "accepted", "{resp:?}");
        assert_eq!(header(&resp.headers, "x-upstream"), Some("double"));
        self.only_new_upstream_request(before, method, path)
    }

    /// Sends a request that must pass unfenced: upstream's answer, no `Fencing-Result`.
    async fn unfenced(&self, method: &str, path: &str, headers: &[(&str, &str)]) -> Seen {
        let before = self.seen().len();
        let resp = self.send(method, path, headers).await;
        assert_eq!(resp.status, 200, "{method} {path} {headers:?}: {resp:?}");
        assert_eq!(
            header(&resp.headers, "fencing-result"),
            None,
            "an unfenced request carries no Fencing-Result: {resp:?}"
        );
        assert_eq!(header(&resp.headers, "x-upstream"), Some("double"));
        self.only_new_upstream_request(before, method, path)
    }

    fn only_new_upstream_request(&self, before: usize, method: &str, path: &str) -> Seen {
        let seen = self.seen();
        assert_eq!(seen.len(), before + 1, "{method} {path} not forwarded once");
        let last = seen.last().expect("a request").clone();
        assert_eq!(last.method, method);
        assert_eq!(
            last.target, path,
            "the target must reach the upstream verbatim"
        );
        last
    }

    async fn stop(self) {
        tokio::time::timeout(BOUND, self.proxy.shutdown())
            .await
            .expect("proxy shuts down within bound");
    }
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Checks one of fencegate's own answers (RFC 9457) and returns its JSON body.
fn assert_problem(resp: &Resp, status: u16, result: &str) -> Value {
    assert_eq!(resp.status, status, "expected {status} {result}: {resp:?}");
    assert_eq!(resp.result(), result, "Fencing-Result: {resp:?}");
    assert_eq!(
        header(&resp.headers, "content-type"),
        Some("application/problem+json"),
        "{resp:?}"
    );
    let body = resp.json();
    let ty = body["type"].as_str().expect("`type` is a string");
    assert!(ty.contains(result), "type {ty:?} names {result}");
    let title = body["title"].as_str().expect("`title` is a string");
    assert!(!title.is_empty());
    assert_eq!(body["status"].as_u64(), Some(u64::from(status)), "{body}");
    assert_eq!(body["result"].as_str(), Some(result), "{body}");
    for member in ["scope", "token", "highest_accepted"] {
        if let Some(v) = body.get(member) {
            assert!(v.is_string(), "{member} must be a string: {body}");
        }
    }
    let retry_after = resp.headers.get("retry-after");
    if matches!(result, "draining" | "unavailable") {
        let secs = retry_after.expect("Retry-After").to_str().expect("ascii");
        assert!(secs.parse::<u64>().is_ok(), "Retry-After {secs:?}");
    } else {
        assert!(retry_after.is_none(), "{result} must not carry Retry-After");
    }
    body
}

/// Asserts the `scope`, `token` and `highest_accepted` members (`None`: absent).
fn assert_members(body: &Value, scope: Option<&str>, token: Option<&str>, highest: Option<&str>) {
    assert_eq!(body.get("scope").and_then(Value::as_str), scope, "{body}");
    assert_eq!(body.get("token").and_then(Value::as_str), token, "{body}");
    assert_eq!(
        body.get("highest_accepted").and_then(Value::as_str),
        highest,
        "{body}"
    );
}

/// A raw HTTP/1.1 exchange via `support::raw`, parsed into a [`Resp`]. The request
/// must ask for `Connection: close` (raw reads until the server closes).
async fn raw(addr: SocketAddr, request: &str) -> Resp {
    let (status, text) = support::raw(addr, request.as_bytes()).await;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no complete response to {request:?}: {text:?}"));
    let mut headers = HeaderMap::new();
    for line in head.lines().skip(1) {
        let (name, value) = line.split_once(':').expect("header line");
        headers.append(
            HeaderName::from_bytes(name.trim().as_bytes()).expect("header name"),
            HeaderValue::from_str(value.trim()).expect("header value"),
        );
    }
    Resp {
        status,
        headers,
        body: body.to_string(),
    }
}

/// `PUT target` with a valid token, as raw bytes.
fn raw_put(target: &str) -> String {
    format!(
        "PUT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nFencing-Token: 1\r\n\
         Content-Length: 0\r\nConnection: close\r\n\r\n"
    )
}

/// A scripted upstream for what the double cannot do: answer with the status asked for in
/// `x-want-status`, send hop-by-hop and forged `Fencing-Result` response headers, and,
/// for `x-stream: 1`, send the body in two parts with a barrier ([`Scripted::release`])
/// between them.
struct Scripted {
    addr: SocketAddr,
    release: Arc<Notify>,
}

impl Scripted {
    async fn start() -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let release = Arc::new(Notify::new());
        let r = release.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(Scripted::answer(stream, r.clone()));
            }
        });
        Scripted { addr, release }
    }

    async fn answer(mut stream: TcpStream, release: Arc<Notify>) {
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
        let status = head
            .lines()
            .find_map(|l| l.strip_prefix("x-want-status:"))
            .map_or("200", str::trim)
            .to_string();
        let first = format!(
            "HTTP/1.1 {status} Scripted\r\nConnection: close, x-up-secret\r\n\
             X-Up-Secret: 1\r\nKeep-Alive: timeout=5\r\nFencing-Result: forged\r\n\
             X-Scripted: yes\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n"
        );
        if stream.write_all(first.as_bytes()).await.is_err() || stream.flush().await.is_err() {
            return;
        }
        if head.contains("x-stream: 1") {
            release.notified().await;
        }
        let _ = stream.write_all(b"4\r\nlast\r\n0\r\n\r\n").await;
        let _ = stream.shutdown().await;
    }
}

#[tokio::test]
async fn accepted_requests_return_the_upstream_answer() {
    let env = Env::start().await;
    let resp = env
        .client
        .put("/reports/acc/x?v=1", "1", "hello upstream")
        .await;
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.result(), "accepted");
    assert_eq!(header(&resp.headers, "x-upstream"), Some("double"));
    assert_eq!(resp.body, "PUT /reports/acc/x?v=1 token=1");
    let seen = env.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].body, Bytes::from("hello upstream"));
    assert_eq!(seen[0].header("fencing-token"), Some("1"));

    // Same token again, default `equal = "accept"`: one generation may send many requests.
    env.accepted("PUT", "/reports/acc/x", &[("fencing-token", "1")])
        .await;
    env.accepted("POST", "/reports/acc/y", &[("fencing-token", "1")])
        .await;
    env.accepted("DELETE", "/reports/acc/z", &[("fencing-token", "1")])
        .await;
    env.stop().await;
}

#[tokio::test]
async fn equal_reject_route_refuses_a_repeated_token() {
    let env = Env::start().await;
    env.accepted("PUT", "/strict/k", &[("fencing-token", "3")])
        .await;
    let body = env
        .refused(
            "PUT",
            "/strict/k",
            &[("fencing-token", "3")],
            409,
            "stale_fence",
        )
        .await;
    assert_members(&body, Some("strict/k"), Some("3"), Some("3"));
    env.accepted("PUT", "/strict/k", &[("fencing-token", "4")])
        .await;
    assert_eq!(env.double.count_token("3"), 1);
    env.stop().await;
}

#[tokio::test]
async fn lower_token_is_stale_forever_without_retry_after() {
    let env = Env::start().await;
    env.accepted("PUT", "/reports/s/a", &[("fencing-token", "10")])
        .await;
    for (method, path) in [
        ("PUT", "/reports/s/a"),
        ("PUT", "/reports/s/a"),
        ("POST", "/reports/s/other/object"),
        ("DELETE", "/reports/s/a"),
    ] {
        let body = env
            .refused(method, path, &[("fencing-token", "9")], 409, "stale_fence")
            .await;
        assert_members(&body, Some("report/s"), Some("9"), Some("10"));
    }
    // Another scope is not affected by report/s's mark.
    env.accepted("PUT", "/reports/t/a", &[("fencing-token", "9")])
        .await;
    assert_eq!(env.double.count_token("9"), 1);
    env.stop().await;
}

#[tokio::test]
async fn epochs_order_before_counters() {
    let env = Env::start().await;
    let put = |token| [("fencing-token", token)];
    env.accepted("PUT", "/reports/e/x", &put("999999")).await;
    env.accepted("PUT", "/reports/e/x", &put("1:0")).await;
    let body = env
        .refused("PUT", "/reports/e/x", &put("999999"), 409, "stale_fence")
        .await;
    assert_members(&body, Some("report/e"), Some("999999"), Some("1:0"));
    // An explicit epoch 0 is the same generation as the bare counter.
    let body = env
        .refused("PUT", "/reports/e/x", &put("0:999999"), 409, "stale_fence")
        .await;
    assert_members(&body, Some("report/e"), Some("999999"), Some("1:0"));
    env.accepted("PUT", "/reports/e/x", &put("1:5")).await;
    let body = env
        .refused("PUT", "/reports/e/x", &put("1:0"), 409, "stale_fence")
        .await;
    assert_members(&body, Some("report/e"), Some("1:0"), Some("1:5"));
    env.stop().await;
}

#[tokio::test]
async fn fenced_methods_without_a_token_are_missing_token() {
    let env = Env::start().await;
    for method in ["PUT", "POST", "DELETE", "PATCH"] {
        let body = env
            .refused(method, "/reports/m/x", &[], 428, "missing_token")
            .await;
        assert_members(&body, Some("report/m"), None, None);
    }
    // Safe methods without a token pass through unfenced.
    for method in ["GET", "HEAD", "OPTIONS"] {
        env.unfenced(method, "/reports/m/x", &[]).await;
    }
    env.stop().await;
}

#[tokio::test]
async fn a_read_with_a_token_is_fenced_and_advances_the_mark() {
    let env = Env::start().await;
    env.accepted("PUT", "/reports/r/x", &[("fencing-token", "6")])
        .await;
    env.accepted("GET", "/reports/r/x", &[("fencing-token", "7")])
        .await;
    let body = env
        .refused(
            "PUT",
            "/reports/r/x",
            &[("fencing-token", "6")],
            409,
            "stale_fence",
        )
        .await;
    assert_members(&body, Some("report/r"), Some("6"), Some("7"));
    // A stale read is refused too: the old owner cannot read past the new one.
    let body = env
        .refused(
            "GET",
            "/reports/r/x",
            &[("fencing-token", "6")],
            409,
            "stale_fence",
        )
        .await;
    assert_members(&body, Some("report/r"), Some("6"), Some("7"));
    env.stop().await;
}

#[tokio::test]
async fn route_methods_list_decides_which_methods_need_a_token() {
    let env = Env::start().await;
    let body = env
        .refused("POST", "/posts/1", &[], 428, "missing_token")
        .await;
    assert_members(&body, Some("post/1"), None, None);
    env.unfenced("PUT", "/posts/1", &[]).await;
    env.unfenced("DELETE", "/posts/1", &[]).await;
    env.accepted("POST", "/posts/1", &[("fencing-token", "2")])
        .await;
    // A token is checked whatever the method.
    let body = env
        .refused(
            "PUT",
            "/posts/1",
            &[("fencing-token", "1")],
            409,
            "stale_fence",
        )
        .await;
    assert_members(&body, Some("post/1"), Some("1"), Some("2"));
    env.stop().await;
}

#[tokio::test]
async fn malformed_tokens_are_invalid_token() {
    let env = Env::start().await;
    let malformed = [
        "18446744073709551616",
        "99999999999999999999",
        "1:18446744073709551616",
        "-1",
        "+1",
        "01",
        "00",
        "1:01",
        "1 2",
        "1: 5",
        "1 :5",
        "1:2:3",
        "",
        "1:",
        ":1",
        "1, 2",
        "1,2",
        "0x1",
        "1.0",
    ];
    for token in malformed {
        for method in ["PUT", "GET"] {
            let body = env
                .refused(
                    method,
                    "/reports/bad/x",
                    &[("fencing-token", token)],
                    400,
                    "invalid_token",
                )
                .await;
            assert_members(&body, Some("report/bad"), None, None);
        }
    }
    // Two headers, each valid on its own.
    let body = env
        .refused(
            "PUT",
            "/reports/bad/x",
            &[("fencing-token", "1"), ("fencing-token", "2")],
            400,
            "invalid_token",
        )
        .await;
    assert_members(&body, Some("report/bad"), None, None);
    let body = env
        .refused(
            "PUT",
            "/reports/bad/x",
            &[("fencing-token", "5"), ("fencing-token", "5")],
            400,
            "invalid_token",
        )
        .await;
    assert_members(&body, Some("report/bad"), None, None);
    // None of them created a mark: the lowest valid token is still accepted.
    env.accepted("PUT", "/reports/bad/x", &[("fencing-token", "0")])
        .await;
    // The largest valid token is accepted, and is the mark from now on.
    env.accepted(
        "PUT",
        "/reports/bad/x",
        &[("fencing-token", "18446744073709551615")],
    )
    .await;
    let body = env
        .refused(
            "PUT",
            "/reports/bad/x",
            &[("fencing-token", "18446744073709551614")],
            409,
            "stale_fence",
        )
        .await;
    assert_members(
        &body,
        Some("report/bad"),
        Some("18446744073709551614"),
        Some("18446744073709551615"),
    );
    env.stop().await;
}

#[tokio::test]
async fn fencing_scope_header_must_match_the_derived_scope() {
    let env = Env::start().await;
    let body = env
        .refused(
            "PUT",
            "/reports/july/x",
            &[("fencing-token", "3"), ("fencing-scope", "report/august")],
            409,
            "scope_mismatch",
        )
        .await;
    assert_members(&body, Some("report/july"), Some("3"), None);
    for wrong in ["report/July", "report/july/x", "report/jul%79", ""] {
        env.refused(
            "PUT",
            "/reports/july/x",
            &[("fencing-token", "3"), ("fencing-scope", wrong)],
            409,
            "scope_mismatch",
        )
        .await;
    }
    // Two Fencing-Scope headers, even if one matches, are no agreement.
    env.refused(
        "PUT",
        "/reports/july/x",
        &[
            ("fencing-token", "3"),
            ("fencing-scope", "report/july"),
            ("fencing-scope", "report/july"),
        ],
        409,
        "scope_mismatch",
    )
    .await;
    // The mismatches did not advance the mark.
    env.accepted(
        "PUT",
        "/reports/july/x",
        &[("fencing-token", "2"), ("fencing-scope", "report/july")],
    )
    .await;
    // The scope is compared decoded: an encoded path still derives `report/july`.
    env.accepted(
        "PUT",
        "/reports/jul%79/x",
        &[("fencing-token", "2"), ("fencing-scope", "report/july")],
    )
    .await;
    env.stop().await;
}

#[tokio::test]
async fn non_canonical_paths_are_invalid_path() {
    let env = Env::start().await;
    let targets = [
        "//x",
        "/reports//x",
        "/reports/july//x",
        "/reports/july/../x",
        "/reports/july/./x",
        "/reports/%2e%2e/x",
        "/reports/%2E/x",
        "/reports/.%2e/x",
        "/reports/%2e./x",
        "/reports/a\\b/x",
        "/reports/a%2fb/x",
        "/reports/a%2Fb/x",
        "/reports/a%5Cb/x",
        "/reports/a%5cb/x",
        "/reports/a%00b/x",
        "/reports/a%0ab/x",
        "/reports/a%0d%0ab/x",
        "/reports/a%7f/x",
        "/reports/a%c2%85/x",
        "/reports/%ff/x",
        "/reports/a%c3/x",
        "/reports/%zz/x",
        "/reports/a%4/x",
        "/reports/a%/x",
        // A raw `;`: path parameters to servlet containers (`..;` is `..` there), part of
        // the name to others; refused either way.
        "/reports/july/..;/august/x",
        "/reports/july;v=1/x",
        "/reports;a/july/x",
        "/reports/;v=1/x",
        // Refused before routing: an unmatched unsafe path is still invalid_path.
        "/nowhere/%2e%2e",
        "*",
        "http://127.0.0.1/reports/july/x",
        "http://127.0.0.1:1/reports/july/x",
    ];
    for target in targets {
        let body = env.refused_raw(&raw_put(target), 400, "invalid_path").await;
        assert_members(&body, None, None, None);
    }
    // Also for reads without a token, and on the unfenced route.
    for target in [
        "/reports/july/../x",
        "/public/a/../b",
        "/public/%2e%2e",
        "/public/..;/reports/august/x",
    ] {
        let request =
            format!("GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
        env.refused_raw(&request, 400, "invalid_path").await;
    }
    env.stop().await;
}

#[tokio::test]
async fn aliases_share_one_scope_and_reach_the_upstream_verbatim() {
    let env = Env::start().await;
    let spellings = [
        "/reports/july/x",
        "/reports/jul%79/x",
        "/r%65ports/july/x",
        "/reports/%6A%75%6C%79/x",
        "/reports/july/x/",
    ];
    for (round, advancer) in spellings.iter().enumerate() {
        let high = (round as u64 + 1) * 10;
        let (high, low) = (high.to_string(), (high - 1).to_string());
        let seen = env
            .accepted("PUT", advancer, &[("fencing-token", high.as_str())])
            .await;
        assert_eq!(seen.target, *advancer);
        for other in spellings.iter().filter(|s| *s != advancer) {
            let body = env
                .refused(
                    "PUT",
                    other,
                    &[("fencing-token", low.as_str())],
                    409,
                    "stale_fence",
                )
                .await;
            assert_members(&body, Some("report/july"), Some(&low), Some(&high));
        }
    }
    // Byte for byte, query included, over a raw connection too.
    let before = env.seen().len();
    let target = "/r%65ports/jul%79/x%2Dy?sig=a%2Fb&x=%zz";
    let request = format!(
        "PUT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nFencing-Token: 100\r\n\
         Content-Length: 0\r\nConnection: close\r\n\r\n"
    );
    let resp = raw(env.addr(), &request).await;
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.result(), "accepted");
    let seen = env.seen();
    assert_eq!(seen.len(), before + 1);
    assert_eq!(seen[before].target, target);
    env.stop().await;
}

/// Two `Host` headers leave the host ambiguous (`host =` routes and the upstream's `Host`
/// depend on it): refused before routing, even when both say the same.
#[tokio::test]
async fn two_host_headers_are_invalid_request() {
    let env = Env::start().await;
    for second in ["files.example", "other.example"] {
        let request = format!(
            "PUT /reports/h2/x HTTP/1.1\r\nHost: files.example\r\nHost: {second}\r\n\
             Fencing-Token: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        let problem = env.refused_raw(&request, 400, "invalid_request").await;
        assert!(
            problem.to_string().contains("more than one Host header"),
            "{problem}"
        );
    }
    // One Host header is fine.
    env.accepted("PUT", "/reports/h2/x", &[("fencing-token", "1")])
        .await;
    env.stop().await;
}

#[tokio::test]
async fn method_overrides_and_upgrades_are_invalid_request_on_fenced_routes() {
    let env = Env::start().await;
    for name in [
        "X-HTTP-Method-Override",
        "X-HTTP-Method",
        "X-Method-Override",
    ] {
        for value in ["PUT", "DELETE", "GET"] {
            let body = env
                .refused(
                    "PUT",
                    "/reports/o/x",
                    &[("fencing-token", "1"), (name, value)],
                    400,
                    "invalid_request",
                )
                .await;
            assert_members(&body, None, None, None);
            env.refused(
                "GET",
                "/reports/o/x",
                &[(name, value)],
                400,
                "invalid_request",
            )
            .await;
            env.refused("POST", "/posts/1", &[(name, value)], 400, "invalid_request")
                .await;
        }
    }
    // CGI-style backends read `_` as `-` (HTTP_X_HTTP_METHOD_OVERRIDE): the same header.
    for name in [
        "X_HTTP_Method_Override",
        "X-HTTP_Method",
        "X_Method_Override",
        "X_Original_URL",
        "X_Rewrite-URL",
        "Fencing_Scope",
        "Fencing_Token",
    ] {
        let body = env
            .refused(
                "GET",
                "/reports/o/x",
                &[(name, "PUT")],
                400,
                "invalid_request",
            )
            .await;
        assert!(body.to_string().contains("`_`"), "{name}: {body}");
    }
    // Other names with `_` pass.
    env.accepted(
        "PUT",
        "/reports/u/x",
        &[("fencing-token", "1"), ("x_trace_id", "1")],
    )
    .await;
    let upgrade = [("upgrade", "websocket"), ("connection", "Upgrade")];
    env.refused("GET", "/reports/o/x", &upgrade, 400, "invalid_request")
        .await;
    let with_token = [
        ("upgrade", "websocket"),
        ("connection", "keep-alive, Upgrade"),
        ("fencing-token", "1"),
    ];
    env.refused("PUT", "/reports/o/x", &with_token, 400, "invalid_request")
        .await;
    env.refused(
        "GET",
        "/reports/o/x",
        &[("upgrade", "h2c")],
        400,
        "invalid_request",
    )
    .await;
    // Nothing advanced: the lowest token is still accepted.
    env.accepted("PUT", "/reports/o/x", &[("fencing-token", "0")])
        .await;
    env.stop().await;
}

#[tokio::test]
async fn ambiguous_host_is_invalid_request() {
    let env = Env::start().await;
    let request = "PUT /t/x HTTP/1.1\r\nHost: tenant.example\r\nHost: other.example\r\n\
                   Fencing-Token: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    let body = env.refused_raw(request, 400, "invalid_request").await;
    assert_members(&body, None, None, None);
    assert!(env.seen().is_empty());
    env.stop().await;
}

#[tokio::test]
async fn connect_is_method_not_allowed() {
    let env = Env::start().await;
    for target in ["127.0.0.1:80", "127.0.0.1:443"] {
        let request = format!(
            "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nFencing-Token: 1\r\n\
             Connection: close\r\n\r\n"
        );
        let body = env.refused_raw(&request, 405, "invalid_request").await;
        assert_members(&body, None, None, None);
    }
    env.stop().await;
}

#[tokio::test]
async fn unmatched_requests_are_no_route() {
    let env = Env::start().await;
    for (method, path, headers) in [
        ("GET", "/nowhere", &[][..]),
        ("PUT", "/nowhere/x", &[("fencing-token", "1")][..]),
        ("GET", "/", &[][..]),
        ("PUT", "/reports", &[("fencing-token", "1")][..]),
        ("PUT", "/reports/july", &[("fencing-token", "1")][..]),
        ("PUT", "/strict/a/b", &[("fencing-token", "1")][..]),
        ("POST", "/posts", &[][..]),
    ] {
        let body = env.refused(method, path, headers, 404, "no_route").await;
        assert_members(&body, None, None, None);
    }
    env.stop().await;
}

#[tokio::test]
async fn host_route_matches_only_its_host() {
    let env = Env::start().await;
    let put = |host, token| [("host", host), ("fencing-token", token)];
    env.accepted("PUT", "/t/a", &put("tenant.example", "1"))
        .await;
    env.accepted("PUT", "/t/b", &put("TENANT.Example:8443", "2"))
        .await;
    let body = env
        .refused(
            "PUT",
            "/t/c",
            &put("Tenant.EXAMPLE", "1"),
            409,
            "stale_fence",
        )
        .await;
    assert_members(&body, Some("tenant"), Some("1"), Some("2"));
    // The fully qualified spelling names the same host (backends match it so): the same
    // route and scope, never a fall-through.
    env.accepted("PUT", "/t/d", &put("tenant.example.", "3"))
        .await;
    for host in [
        "other.example",
        "tenant.example.evil",
        "eviltenant.example",
        "tenant.example..",
        "127.0.0.1",
    ] {
        env.refused("PUT", "/t/a", &put(host, "3"), 404, "no_route")
            .await;
        env.refused("GET", "/t/a", &[("host", host)], 404, "no_route")
            .await;
    }
    // The client's default Host (127.0.0.1:port) is no match either.
    env.refused("GET", "/t/a", &[], 404, "no_route").await;
    env.stop().await;
}

#[tokio::test]
async fn pass_through_route_is_not_fenced() {
    let env = Env::start().await;
    for method in ["PUT", "POST", "DELETE", "GET"] {
        env.unfenced(method, "/public/a/b", &[]).await;
    }
    // A token on a pass-through route is forwarded but neither checked nor recorded.
    env.unfenced("PUT", "/public/a", &[("fencing-token", "5")])
        .await;
    env.unfenced("PUT", "/public/a", &[("fencing-token", "4")])
        .await;
    env.unfenced("PUT", "/public/a", &[("fencing-token", "junk")])
        .await;
    env.stop().await;
}

#[tokio::test]
async fn closed_upstream_port_is_upstream_unavailable() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = closed.local_addr().expect("addr");
    drop(closed);
    let dir = tempfile::tempdir().expect("tempdir");
    let proxy = support::start(support::config(addr, dir.path())).await;
    let client = Client::new(proxy.proxy_addr);

    let resp = client.put("/reports/down/x", "1", "").await;
    let body = assert_problem(&resp, 502, "upstream_unavailable");
    assert_members(&body, Some("report/down"), None, None);
    // The client is told what happened, not where: no address, port or socket error.
    let title = body["title"].as_str().unwrap_or_default();
    assert!(
        !title.contains(&addr.port().to_string()) && !title.contains("127.0.0.1"),
        "{title}"
    );
    assert!(!title.to_ascii_lowercase().contains("refused"), "{title}");
    // Never received, so nothing to settle: the same token may retry.
    let resp = client.put("/reports/down/x", "1", "").await;
    assert_problem(&resp, 502, "upstream_unavailable");
    // Unfenced requests fail the same way, without a scope.
    let resp = client.get("/public/x").await;
    let body = assert_problem(&resp, 502, "upstream_unavailable");
    assert_members(&body, None, None, None);
    tokio::time::timeout(BOUND, proxy.shutdown())
        .await
        .expect("shutdown within bound");
}

#[tokio::test]
async fn unanswered_upstream_is_upstream_timeout() {
    let env = Env::with_timings("10s", "0s", "200ms").await;

    // Held inside the upstream past the 200ms timeout: the outcome is unknown.
    let resp = env
        .send(
            "PUT",
            "/reports/slow/x",
            &[("fencing-token", "1"), ("x-test-hold", "slow")],
        )
        .await;
    let body = assert_problem(&resp, 504, "upstream_timeout");
    assert_members(&body, Some("report/slow"), None, None);
    env.double.arrived("slow").await;
    assert_eq!(env.double.count_token("1"), 1, "it did reach the upstream");

    // The upstream drops the connection without answering: also unknown.
    let resp = env
        .send(
            "PUT",
            "/reports/reset/x",
            &[("fencing-token", "1"), ("x-test-reset", "1")],
        )
        .await;
    let body = assert_problem(&resp, 504, "upstream_timeout");
    assert_members(&body, Some("report/reset"), None, None);
    assert_eq!(env.double.count_token("1"), 2, "it did reach the upstream");

    env.double.release("slow");
    env.stop().await;
}

#[tokio::test]
async fn higher_generation_behind_an_older_in_flight_request_is_draining() {
    let env = Env::with_timings("100ms", "0s", "10s").await;
    let old = {
        let client = env.client.clone();
        tokio::spawn(async move {
            client
                .send(
                    "PUT",
                    "/reports/d/x",
                    &[("fencing-token", "1"), ("x-test-hold", "old")],
                    "",
                )
                .await
        })
    };
    env.double.arrived("old").await;

    let body = env
        .refused(
            "PUT",
            "/reports/d/x",
            &[("fencing-token", "2")],
            503,
            "draining",
        )
        .await;
    assert_members(&body, Some("report/d"), Some("2"), Some("2"));
    // The advance to 2 is durable: the old generation is stale from now on.
    env.refused(
        "PUT",
        "/reports/d/x",
        &[("fencing-token", "1")],
        409,
        "stale_fence",
    )
    .await;

    env.double.release("old");
    let old = tokio::time::timeout(BOUND, old)
        .await
        .expect("held request answers")
        .expect("task");
    assert_eq!(old.status, 200);
    assert_eq!(old.result(), "accepted");
    // Retry later with the same token: admitted once the old generation has drained.
    env.accepted("PUT", "/reports/d/x", &[("fencing-token", "2")])
        .await;
    env.stop().await;
}

#[tokio::test]
async fn hop_by_hop_headers_stay_at_the_proxy() {
    let env = Env::start().await;
    let request = "PUT /reports/h/x HTTP/1.1\r\n\
                   Host: files.example:8080\r\n\
                   Fencing-Token: 1\r\n\
                   Connection: close, x-secret\r\n\
                   Connection: X-Other\r\n\
                   X-Secret: 1\r\n\
                   X-Other: 2\r\n\
                   Keep-Alive: timeout=5\r\n\
                   TE: trailers\r\n\
                   Proxy-Authorization: Basic Zm9vOmJhcg==\r\n\
                   Proxy-Connection: keep-alive\r\n\
                   X-Forwarded-For: 10.0.0.1\r\n\
                   X-Kept: yes\r\n\
                   Content-Length: 0\r\n\r\n";
    let resp = raw(env.addr(), request).await;
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.result(), "accepted");
    let seen = env.seen();
    assert_eq!(seen.len(), 1);
    let up = &seen[0];
    for name in [
        "connection",
        "x-secret",
        "x-other",
        "keep-alive",
        "te",
        "proxy-authorization",
        "proxy-connection",
    ] {
        assert!(
            !up.headers.contains_key(name),
            "{name} reached the upstream: {:?}",
            up.headers
        );
    }
    assert_eq!(up.header("x-kept"), Some("yes"));
    assert_eq!(up.header("fencing-token"), Some("1"));
    assert_eq!(up.header("x-forwarded-for"), Some("10.0.0.1, 127.0.0.1"));
    assert_eq!(up.header("x-forwarded-proto"), Some("http"));
    assert_eq!(up.header("host"), Some("files.example:8080"));
    assert_eq!(up.headers.get_all("host").iter().count(), 1);

    // Without a previous hop, X-Forwarded-For is the peer alone.
    let up = env
        .accepted("PUT", "/reports/h/y", &[("fencing-token", "1")])
        .await;
    assert_eq!(up.header("x-forwarded-for"), Some("127.0.0.1"));
    assert_eq!(up.header("x-forwarded-proto"), Some("http"));
    let host = env.addr().to_string();
    assert_eq!(up.header("host"), Some(host.as_str()));

    // `Connection` may name end-to-end headers too. Host chose the route (and so the
    // scope): it reaches the upstream as received. A forwarding header listed there is
    // gone, and the proxy's own `X-Forwarded-Proto` takes its place.
    let request = "PUT /reports/h/z HTTP/1.1\r\n\
                   Host: files.example:8080\r\n\
                   Fencing-Token: 1\r\n\
                   Connection: close, host, x-forwarded-proto, x-forwarded-for\r\n\
                   X-Forwarded-Proto: https\r\n\
                   X-Forwarded-For: 10.0.0.1\r\n\
                   Content-Length: 0\r\n\r\n";
    let resp = raw(env.addr(), request).await;
    assert_eq!(resp.status, 200, "{resp:?}");
    let seen = env.seen();
    let up = seen.last().expect("forwarded");
    assert_eq!(up.target, "/reports/h/z");
    assert_eq!(up.header("host"), Some("files.example:8080"));
    assert_eq!(up.header("x-forwarded-proto"), Some("http"));
    assert_eq!(up.header("x-forwarded-for"), Some("127.0.0.1"));
    assert!(!up.headers.contains_key("connection"));
    env.stop().await;
}

/// Every name `Connection` lists stays at the proxy, even beside an element that is not
/// ASCII. (On a fenced route such a `Connection` is refused, as it might ask for an
/// upgrade; a pass-through route forwards the request without what it lists.)
#[tokio::test]
async fn names_listed_beside_a_non_ascii_connection_element_stay_at_the_proxy() {
    let env = Env::start().await;
    let request = b"GET /public/listed HTTP/1.1\r\n\
                    Host: 127.0.0.1\r\n\
                    Connection: close\r\n\
                    Connection: X-Secret, \xff\r\n\
                    X-Secret: s3cr3t\r\n\
                    X-Kept: yes\r\n\r\n";
    let (status, text) = support::raw(env.addr(), request).await;
    assert_eq!(status, 200, "{text}");
    let seen = env.seen();
    assert_eq!(seen.len(), 1);
    assert!(
        !seen[0].headers.contains_key("x-secret"),
        "x-secret reached the upstream: {:?}",
        seen[0].headers
    );
    assert!(!seen[0].headers.contains_key("connection"));
    assert_eq!(seen[0].header("x-kept"), Some("yes"));
    env.stop().await;
}

/// From a peer that is not a trusted proxy, forwarding headers are stripped: a client must
/// not claim another address or HTTPS to the backend (nginx and Envoy set them too).
#[tokio::test]
async fn untrusted_clients_cannot_spoof_forwarding_headers() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let text = support::config_text(double.addr, "10s", "0s", "10s")
        .replace("trusted_proxies = [\"127.0.0.1\"]\n", "");
    let config = fencegate::settings::Config::parse(&text, dir.path()).expect("test config");
    let env = Env::assemble(double, support::start(config).await, dir);
    let up = env
        .accepted(
            "PUT",
            "/reports/xfp/x",
            &[
                ("fencing-token", "1"),
                ("x-forwarded-proto", "https"),
                ("x-forwarded-for", "10.9.9.9"),
                ("x-forwarded-host", "evil.example"),
                ("forwarded", "for=10.9.9.9;proto=https"),
                ("x-real-ip", "10.9.9.9"),
            ],
        )
        .await;
    assert_eq!(up.header("x-forwarded-proto"), Some("http"));
    assert_eq!(up.header("x-forwarded-for"), Some("127.0.0.1"));
    assert_eq!(up.header("x-forwarded-host"), None);
    assert_eq!(up.header("forwarded"), None);
    assert_eq!(up.header("x-real-ip"), None);
    env.stop().await;
}

#[tokio::test]
async fn h2c_client_reaches_an_h1_upstream() {
    let env = Env::start().await;
    let h2: HyperClient<_, Full<Bytes>> = HyperClient::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let send = |method: &str, path: &str, token: Option<&str>| {
        let mut b = Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", env.addr()));
        if let Some(t) = token {
            b = b.header("fencing-token", t);
        }
        let req = b
            .body(Full::new(Bytes::from_static(b"over h2")))
            .expect("request");
        let h2 = h2.clone();
        async move {
            let resp = tokio::time::timeout(BOUND, h2.request(req))
                .await
                .expect("response within bound")
                .expect("h2 response");
            assert_eq!(resp.version(), Version::HTTP_2);
            let status = resp.status().as_u16();
            let headers = resp.headers().clone();
            let body = resp.into_body().collect().await.expect("body").to_bytes();
            Resp {
                status,
                headers,
                body: String::from_utf8_lossy(&body).into_owned(),
            }
        }
    };

    let resp = send("PUT", "/reports/h2/x%2Dy?q=1", Some("2")).await;
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.result(), "accepted");
    assert_eq!(header(&resp.headers, "x-upstream"), Some("double"));
    assert_eq!(resp.body, "PUT /reports/h2/x%2Dy?q=1 token=2");
    let seen = env.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].method, "PUT");
    assert_eq!(seen[0].target, "/reports/h2/x%2Dy?q=1");
    assert_eq!(seen[0].body, Bytes::from_static(b"over h2"));
    let authority = env.addr().to_string();
    assert_eq!(seen[0].header("host"), Some(authority.as_str()));

    let resp = send("PUT", "/reports/h2/x", Some("1")).await;
    let body = assert_problem(&resp, 409, "stale_fence");
    assert_members(&body, Some("report/h2"), Some("1"), Some("2"));
    let resp = send("PUT", "/reports/h2/x", None).await;
    assert_problem(&resp, 428, "missing_token");
    let resp = send("PUT", "/reports/h2/x", Some("01")).await;
    assert_problem(&resp, 400, "invalid_token");
    let resp = send("GET", "/nowhere", None).await;
    assert_problem(&resp, 404, "no_route");
    assert_eq!(env.seen().len(), 1, "refusals over h2 reach nothing");
    drop(h2);
    env.stop().await;
}

#[tokio::test]
async fn accepted_carries_the_upstream_status_and_end_to_end_headers() {
    let upstream = Scripted::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let proxy = support::start(support::config(upstream.addr, dir.path())).await;
    let client = Client::new(proxy.proxy_addr);
    for status in ["201", "404", "418", "500", "503"] {
        let resp = client
            .send(
                "PUT",
                "/reports/st/x",
                &[("fencing-token", "1"), ("x-want-status", status)],
                "",
            )
            .await;
        assert_eq!(resp.status.to_string(), status, "{resp:?}");
        // fencegate's own header wins over anything the upstream said.
        let results: Vec<_> = resp.headers.get_all("fencing-result").iter().collect();
        assert_eq!(results, ["accepted"], "{resp:?}");
        assert_eq!(header(&resp.headers, "x-scripted"), Some("yes"));
        for name in ["x-up-secret", "keep-alive"] {
            assert!(!resp.headers.contains_key(name), "{name} leaked: {resp:?}");
        }
        assert_eq!(resp.body, "firstlast");
    }
    tokio::time::timeout(BOUND, proxy.shutdown())
        .await
        .expect("shutdown within bound");
}

#[tokio::test]
async fn accepted_body_is_streamed_not_buffered() {
    let upstream = Scripted::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let proxy = support::start(support::config(upstream.addr, dir.path())).await;
    let client: HyperClient<_, Full<Bytes>> =
        HyperClient::builder(TokioExecutor::new()).build_http();
    let req = Request::builder()
        .method("PUT")
        .uri(format!("http://{}/reports/stream/x", proxy.proxy_addr))
        .header("fencing-token", "1")
        .header("x-stream", "1")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let resp = tokio::time::timeout(BOUND, client.request(req))
        .await
        .expect("headers before the upstream body has ended")
        .expect("response");
    assert_eq!(resp.status(), 200);
    assert_eq!(header(resp.headers(), "fencing-result"), Some("accepted"));
    let mut body = resp.into_body();
    // The upstream is holding back the rest: this part can only arrive streamed.
    let first = tokio::time::timeout(BOUND, body.frame())
        .await
        .expect("first part arrives while the upstream still holds the rest")
        .expect("a frame")
        .expect("no error")
        .into_data()
        .expect("data");
    assert_eq!(first, Bytes::from_static(b"first"));
    upstream.release.notify_one();
    let rest = tokio::time::timeout(BOUND, body.collect())
        .await
        .expect("rest within bound")
        .expect("rest")
        .to_bytes();
    assert_eq!(rest, Bytes::from_static(b"last"));
    drop(client);
    tokio::time::timeout(BOUND, proxy.shutdown())
        .await
        .expect("shutdown within bound");
}

/// A GET with a body of unknown length (chunked here; an HTTP/2 one with data and no
/// `content-length` alike) reaches the upstream with its body, not stripped of it.
#[tokio::test]
async fn a_chunked_get_keeps_its_body() {
    let env = Env::start().await;
    let (code, text) = support::raw(
        env.proxy.proxy_addr,
        b"GET /reports/g/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\n\
          Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!(code, 200, "{text}");
    let seen = env.seen();
    let last = seen.last().expect("forwarded");
    assert_eq!(last.method, "GET");
    assert_eq!(&last.body[..], b"hello");
    env.stop().await;
}

/// Methods are case-sensitive, but backends that upper-case them take `post` for a POST:
/// a route's `methods` list is matched without regard to case. The default safe set is
/// matched exactly, so a lower-case `get` needs a token.
#[tokio::test]
async fn a_listed_method_is_fenced_whatever_its_case() {
    let env = Env::start().await;
    for method in ["post", "Post"] {
        env.refused(method, "/posts/1", &[], 428, "missing_token")
            .await;
    }
    env.accepted("Post", "/posts/1", &[("fencing-token", "5")])
        .await;
    let body = env
        .refused(
            "post",
            "/posts/1",
            &[("fencing-token", "4")],
            409,
            "stale_fence",
        )
        .await;
    assert_members(&body, Some("post/1"), Some("4"), Some("5"));
    env.refused("get", "/reports/c/x", &[], 428, "missing_token")
        .await;
    env.unfenced("GET", "/reports/c/x", &[]).await;
    env.stop().await;
}

/// An HTTP/2 `:path` must begin with `/`: `?x` would be classified as `/` and forwarded
/// as `?x`.
#[tokio::test]
async fn an_h2_path_without_its_slash_is_invalid_path() {
    let env = Env::start().await;
    let tcp = tokio::net::TcpStream::connect(env.addr()).await.unwrap();
    let (h2, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let mut h2 = h2.ready().await.unwrap();
    let authority = env.addr().to_string();
    for target in ["?x", "?/reports/q/x"] {
        let req = http::Request::put(format!("http://{authority}{target}"))
            .header("fencing-token", "7")
            .body(())
            .unwrap();
        let (resp, _) = h2.send_request(req, true).unwrap();
        let resp = tokio::time::timeout(BOUND, resp).await.unwrap().unwrap();
        assert_eq!(resp.status(), 400, "{target}");
        assert_eq!(
            header(resp.headers(), "fencing-result"),
            Some("invalid_path"),
            "{target}"
        );
        h2 = h2.ready().await.unwrap();
    }
    assert!(env.seen().is_empty(), "{:?}", env.seen());
    env.stop().await;
}

/// WebDAV's COPY and MOVE write their `Destination` too. It is canonicalized and routed
/// like a request: it must lie in the request's own scope or on a pass-through route.
/// Headers that make a backend act on another path altogether are refused.
#[tokio::test]
async fn a_destination_stays_in_the_requests_scope() {
    let env = Env::start().await;
    env.accepted("PUT", "/reports/b/x", &[("fencing-token", "10")])
        .await;
    let here = env.addr();
    let into_b = [
        format!("http://{here}/reports/b/x"),
        "/reports/b/x".to_string(),
        "/r%65ports/b/x".to_string(),
        "/reports/%62/y".to_string(),
    ];
    for dest in &into_b {
        let body = env
            .refused(
                "COPY",
                "/reports/a/x",
                &[("fencing-token", "1"), ("destination", dest)],
                400,
                "multi_scope",
            )
            .await;
        let title = body["title"].as_str().unwrap_or_default();
        assert!(title.contains("report/b"), "{dest}: {body}");
        // A pass-through request cannot write it either.
        env.refused(
            "MOVE",
            "/public/y",
            &[("destination", dest)],
            400,
            "invalid_request",
        )
        .await;
    }
    let refused = [
        "http://other.example/reports/a/y",
        "/nowhere/y",
        "/reports/a/../b/x",
        "/reports//x",
        "ftp://127.0.0.1/reports/a/y",
        "reports/a/y",
        "?x",
        // Read as every backend might read it (SPEC §16): a `#` that http::Uri would
        // drop, a query, and escapes a decoding server would split at.
        "/reports/a/y#/../../b/x",
        "/reports/a/y#frag",
        "/reports/a/y?x=1",
        "/reports/a/y%3F",
        "/reports/a/y%3fz",
        "/reports/a/y%23",
        "/reports/a/y%3Bv=1",
    ];
    for dest in refused {
        env.refused(
            "COPY",
            "/reports/a/x",
            &[("fencing-token", "1"), ("destination", dest)],
            400,
            "invalid_request",
        )
        .await;
    }
    let two = [
        ("fencing-token", "1"),
        ("destination", "/reports/a/y"),
        ("destination", "/reports/a/z"),
    ];
    env.refused("MOVE", "/reports/a/x", &two, 400, "invalid_request")
        .await;
    for name in ["x-original-url", "x-rewrite-url"] {
        env.refused(
            "PUT",
            "/public/y",
            &[(name, "/reports/b/x")],
            400,
            "invalid_request",
        )
        .await;
        env.refused(
            "PUT",
            "/reports/a/x",
            &[("fencing-token", "1"), (name, "/reports/a/y")],
            400,
            "invalid_request",
        )
        .await;
    }
    // The posts route fences only POST: a COPY there without a token may not write a
    // fenced destination, and needs a token when that is its own scope.
    env.refused(
        "COPY",
        "/posts/1",
        &[("destination", "/posts/1")],
        428,
        "missing_token",
    )
    .await;
    env.refused(
        "COPY",
        "/posts/1",
        &[("destination", "/posts/2")],
        400,
        "invalid_request",
    )
    .await;
    // Inside its own scope, or onto a pass-through route, it goes through as sent.
    let dest = format!("http://{here}/reports/a/y");
    let seen = env
        .accepted(
            "COPY",
            "/reports/a/x",
            &[("fencing-token", "1"), ("destination", &dest)],
        )
        .await;
    assert_eq!(seen.header("destination"), Some(dest.as_str()));
    env.accepted(
        "MOVE",
        "/reports/a/y",
        &[("fencing-token", "1"), ("destination", "/public/a-y")],
    )
    .await;
    env.unfenced("MOVE", "/public/y", &[("destination", "/public/z")])
        .await;
    // None of the refusals moved report/b's mark.
    env.refused(
        "PUT",
        "/reports/b/x",
        &[("fencing-token", "9")],
        409,
        "stale_fence",
    )
    .await;
    env.accepted("PUT", "/reports/b/x", &[("fencing-token", "10")])
        .await;
    env.stop().await;
}

/// A `Destination` on a route of another upstream is refused, pass-through or fenced: the
/// backend that gets the request writes the destination on itself, under the path the
/// other upstream's route would have fenced (SPEC §16).
#[tokio::test]
async fn a_destination_stays_on_the_requests_upstream() {
    let (one, two) = (Double::start().await, Double::start().await);
    let dir = tempfile::tempdir().expect("tempdir");
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[store]
path = "marks.redb"
[fencing]
settle = "0s"
[[upstream]]
name = "one"
url = "http://{}"
[[upstream]]
name = "two"
url = "http://{}"
[[route]]
name = "open"
path = "/open/{{*rest}}"
upstream = "one"
fenced = false
[[route]]
name = "files"
path = "/files/{{*rest}}"
scope = "files"
upstream = "two"
[[route]]
name = "open-two"
path = "/open-two/{{*rest}}"
upstream = "two"
fenced = false
"#,
        one.addr, two.addr
    );
    let proxy = support::start_text(&text, dir.path()).await;
    let client = Client::new(proxy.proxy_addr);
    for (path, token, dest) in [
        ("/open/x", None, "/open-two/x"),
        ("/open/x", None, "/files/x"),
        ("/files/x", Some("1"), "/open/x"),
    ] {
        let mut headers = vec![("destination", dest)];
        if let Some(t) = token {
            headers.push(("fencing-token", t));
        }
        let resp = client.send("COPY", path, &headers, "").await;
        assert_problem(&resp, 400, "invalid_request");
    }
    assert!(one.seen().is_empty() && two.seen().is_empty());
    let ok = client
        .send("COPY", "/open-two/x", &[("destination", "/open-two/y")], "")
        .await;
    assert_eq!(ok.status, 200, "{ok:?}");
    assert_eq!(two.seen().len(), 1);
}
