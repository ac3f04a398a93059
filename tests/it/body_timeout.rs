//! The upstream's `timeout` bounds every wait for more of a response body, not only the
//! wait for its head: a body that stalls mid-way is cut off (the client's connection
//! closes short of the length, the upstream's is closed, not pooled), while a body that
//! keeps coming, however slowly, or a client that reads slowly, is not.
//! Both upstream exchanges are covered: the lean one (a body in memory) and hyper's
//! client connection (a streamed, chunked request body).

use crate::support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use fencegate::settings::Config;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use support::BOUND;

/// The upstream `timeout` in these tests.
const TIMEOUT: Duration = Duration::from_millis(300);
/// The body the scripted answers announce.
const LENGTH: usize = 10;
/// The `big` answer's body: more than the sockets and the proxy buffer between them.
const BIG: usize = 8 << 20;

/// An upstream that answers by the path's second segment (`/reports/KIND/...`):
/// `stall`: a head with `Content-Length: 10` and 3 bytes of body, then nothing (it holds
/// the connection until the proxy closes it, and reports that on `closed`);
/// `trickle`: the same head, then one byte every 100 ms until the 10 are sent;
/// `big`: 8 MiB at once; `broken`: a chunked head, then the connection closed (its body
/// fails before its first byte); `short`: a head with `Content-Length: 10`, then closed;
/// `cut`: that head and 3 bytes of body, then closed; `garbled`: a chunked head and a
/// chunk size that is no number, in one write (its body fails at its first read, with
/// nothing left to wait for), then closed.
struct Upstream {
    addr: SocketAddr,
    closed: mpsc::UnboundedReceiver<()>,
}

impl Upstream {
    async fn start() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, closed) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, tx.clone()));
            }
        });
        Upstream { addr, closed }
    }
}

/// Reads one request, its body included (by `Content-Length`, or chunked to its last
/// chunk); answers its path, or `None` if the connection ended first.
async fn read_request(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<String> {
    async fn more(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<()> {
        let mut chunk = [0u8; 4096];
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => None,
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                Some(())
            }
        }
    }
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        more(s, buf).await?;
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    let chunked = head.contains("transfer-encoding: chunked");
    let length: usize = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim() == "content-length")
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0);
    let used = loop {
        if chunked {
            // The test's chunked bodies carry no trailers: the last chunk ends them.
            if let Some(i) = buf[end..].windows(5).position(|w| w == b"0\r\n\r\n") {
                break end + i + 5;
            }
        } else if buf.len() >= end + length {
            break end + length;
        }
        more(s, buf).await?;
    };
    buf.drain(..used);
    Some(head.split_whitespace().nth(1).unwrap_or("").to_string())
}

async fn serve(mut s: TcpStream, closed: mpsc::UnboundedSender<()>) {
    let mut buf = Vec::new();
    while let Some(path) = read_request(&mut s, &mut buf).await {
        let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {LENGTH}\r\n\r\n");
        match path.split('/').nth(2).unwrap_or("") {
            "stall" => {
                if s.write_all(format!("{head}abc").as_bytes()).await.is_err() {
                    return;
                }
                // Nothing more: hold the connection until the proxy lets go of it (or
                // the test's bound passes).
                let mut rest = [0u8; 64];
                let ended = tokio::time::timeout(BOUND, async {
                    loop {
                        match s.read(&mut rest).await {
                            Ok(0) | Err(_) => return,
                            Ok(_) => {}
                        }
                    }
                })
                .await;
                if ended.is_ok() {
                    let _ = closed.send(());
                }
                return;
            }
            "trickle" => {
                if s.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                for byte in b"0123456789" {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    if s.write_all(&[*byte]).await.is_err() {
                        return;
                    }
                }
            }
            "broken" => {
                let head = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";
                let _ = s.write_all(head.as_bytes()).await;
                return;
            }
            "short" => {
                let _ = s.write_all(head.as_bytes()).await;
                return;
            }
            "garbled" => {
                let head = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n";
                let _ = s.write_all(head.as_bytes()).await;
                return;
            }
            "cut" => {
                let _ = s.write_all(format!("{head}abc").as_bytes()).await;
                return;
            }
            "big" => {
                let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {BIG}\r\n\r\n");
                if s.write_all(head.as_bytes()).await.is_err()
                    || s.write_all(&vec![b'b'; BIG]).await.is_err()
                {
                    return;
                }
            }
            _ => return,
        }
    }
}

async fn setup() -> (Upstream, fencegate::app::Running, tempfile::TempDir) {
    setup_with(|text| text).await
}

/// [`setup`], its config text changed by `edit` first.
async fn setup_with(
    edit: impl FnOnce(String) -> String,
) -> (Upstream, fencegate::app::Running, tempfile::TempDir) {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let text = edit(support::config_text(upstream.addr, "5s", "0s", "300ms"));
    let config = Config::parse(&text, dir.path()).expect("config");
    let running = support::start(config).await;
    (upstream, running, dir)
}

/// A fenced request for `kind`; `streamed` sends its body chunked, which takes hyper's
/// client connection instead of the lean exchange.
fn request(kind: &str, streamed: bool) -> String {
    let body = if streamed {
        "Transfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n"
    } else {
        "Content-Length: 1\r\n\r\nx"
    };
    format!("PUT /reports/{kind}/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\n{body}")
}

/// Everything the proxy sends until it closes the connection (bounded).
async fn read_until_closed(s: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    tokio::time::timeout(BOUND, async {
        let mut chunk = [0u8; 4096];
        loop {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "the connection was still open after {BOUND:?}, holding {:?}",
            String::from_utf8_lossy(&got)
        )
    });
    got
}

/// Reads a response whose body is `length` bytes, appending to `got` (which may hold its
/// start); answers whether it arrived whole before the connection ended (bounded).
async fn read_response(s: &mut TcpStream, got: &mut Vec<u8>, length: usize) -> bool {
    tokio::time::timeout(BOUND, async {
        let mut chunk = vec![0u8; 64 << 10];
        let mut end = None;
        loop {
            if end.is_none() {
                end = got.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
            }
            if end.is_some_and(|end| got.len() >= end + length) {
                return true;
            }
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => got.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await
    .expect("the response within bound")
}

/// Sends `request` on a new connection; answers everything the proxy sends until it
/// closes the connection.
async fn answer(running: &fencegate::app::Running, request: &str) -> Vec<u8> {
    let mut s = TcpStream::connect(running.proxy_addr)
        .await
        .expect("connect");
    s.write_all(request.as_bytes()).await.expect("write");
    read_until_closed(&mut s).await
}

/// Splits a response into its head (text) and the body bytes after it.
fn split(response: &[u8]) -> (String, &[u8]) {
    let end = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| i + 4)
        .unwrap_or_else(|| panic!("no head in {:?}", String::from_utf8_lossy(response)));
    (
        String::from_utf8_lossy(&response[..end]).to_ascii_lowercase(),
        &response[end..],
    )
}

async fn a_stalled_body_is_cut_off(streamed: bool) {
    let (mut upstream, running, _dir) = setup().await;
    let mut s = TcpStream::connect(running.proxy_addr)
        .await
        .expect("connect");
    let sent = Instant::now();
    s.write_all(request("stall", streamed).as_bytes())
        .await
        .expect("write");
    let got = read_until_closed(&mut s).await;
    let (head, body) = split(&got);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("content-length: 10\r\n"), "{head}");
    assert_eq!(body, b"abc", "closed short of the announced length");
    assert!(
        sent.elapsed() >= TIMEOUT,
        "cut off after {:?}, before the timeout",
        sent.elapsed()
    );
    // The upstream's connection is closed too, not kept for another request.
    tokio::time::timeout(BOUND, upstream.closed.recv())
        .await
        .expect("the proxy closed the stalled upstream connection")
        .expect("upstream running");
    running.shutdown().await;
}

#[tokio::test]
async fn a_body_that_stalls_is_cut_off_in_the_lean_exchange() {
    a_stalled_body_is_cut_off(false).await;
}

#[tokio::test]
async fn a_body_that_stalls_is_cut_off_in_the_streamed_exchange() {
    a_stalled_body_is_cut_off(true).await;
}

/// 10 bytes over about a second, one per 100 ms, with a 300 ms timeout: each byte starts
/// the wait afresh.
async fn a_trickling_body_arrives_whole(streamed: bool) {
    let (_upstream, running, _dir) = setup().await;
    let mut s = TcpStream::connect(running.proxy_addr)
        .await
        .expect("connect");
    let started = Instant::now();
    s.write_all(request("trickle", streamed).as_bytes())
        .await
        .expect("write");
    let mut got = Vec::new();
    let whole = read_response(&mut s, &mut got, LENGTH).await;
    assert!(whole, "cut off: {:?}", String::from_utf8_lossy(&got));
    let (head, body) = split(&got);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert_eq!(body, b"0123456789");
    // It took longer than one timeout: the waits, not the whole body, are bounded.
    assert!(started.elapsed() > TIMEOUT, "{:?}", started.elapsed());
    running.shutdown().await;
}

#[tokio::test]
async fn a_body_that_keeps_coming_is_not_cut_off_in_the_lean_exchange() {
    a_trickling_body_arrives_whole(false).await;
}

#[tokio::test]
async fn a_body_that_keeps_coming_is_not_cut_off_in_the_streamed_exchange() {
    a_trickling_body_arrives_whole(true).await;
}

/// An upstream body that fails at once, right after the head (or after its first bytes):
/// the client gets the head (the upstream's status: it may have acted) and what came of
/// the body, then the connection closes short of the message's end: never a complete
/// message, and never silence.
async fn a_body_that_breaks_at_once_still_shows_its_head(kind: &str, streamed: bool) {
    let (_upstream, running, _dir) = setup().await;
    let got = answer(&running, &request(kind, streamed)).await;
    let (head, body) = split(&got);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("fencing-result: accepted\r\n"), "{head}");
    match kind {
        // Chunked to the client too: no last chunk, so not a complete (empty) body.
        "broken" => assert!(
            head.contains("transfer-encoding: chunked\r\n") && !complete(&head, body),
            "{head}{:?}",
            String::from_utf8_lossy(body)
        ),
        "short" => {
            assert!(head.contains("content-length: 10\r\n"), "{head}");
            assert!(body.is_empty(), "{:?}", String::from_utf8_lossy(body));
        }
        _ => {
            assert!(head.contains("content-length: 10\r\n"), "{head}");
            assert_eq!(body, b"abc", "what came before the upstream closed");
        }
    }
    running.shutdown().await;
}

#[tokio::test]
async fn a_chunked_body_that_breaks_at_once_still_shows_its_head_in_the_lean_exchange() {
    a_body_that_breaks_at_once_still_shows_its_head("broken", false).await;
}

#[tokio::test]
async fn a_chunked_body_that_breaks_at_once_still_shows_its_head_in_the_streamed_exchange() {
    a_body_that_breaks_at_once_still_shows_its_head("broken", true).await;
}

#[tokio::test]
async fn a_sized_body_that_breaks_at_once_still_shows_its_head() {
    a_body_that_breaks_at_once_still_shows_its_head("short", false).await;
}

#[tokio::test]
async fn a_body_that_breaks_after_its_first_bytes_shows_them_in_the_lean_exchange() {
    a_body_that_breaks_at_once_still_shows_its_head("cut", false).await;
}

#[tokio::test]
async fn a_body_that_breaks_after_its_first_bytes_shows_them_in_the_streamed_exchange() {
    a_body_that_breaks_at_once_still_shows_its_head("cut", true).await;
}

/// Whether a response (its lowercased head and the body bytes after it) is a complete
/// HTTP/1.1 message: all of its `Content-Length`, or chunked up to the last chunk.
fn complete(head: &str, body: &[u8]) -> bool {
    let length = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim() == "content-length")
        .and_then(|(_, v)| v.trim().parse::<usize>().ok());
    match length {
        Some(n) => body.len() >= n,
        None => !head.contains("transfer-encoding: chunked") || body.ends_with(b"0\r\n\r\n"),
    }
}

/// What an HTTP/1.0 client gets for `/reports/{kind}/x` (until the proxy closes).
async fn http10_answer(kind: &str) -> Vec<u8> {
    let (_upstream, running, _dir) = setup().await;
    let got = answer(
        &running,
        &format!("PUT /reports/{kind}/x HTTP/1.0\r\nHost: a\r\nFencing-Token: 1\r\nContent-Length: 1\r\n\r\nx"),
    )
    .await;
    running.shutdown().await;
    got
}

/// An HTTP/1.0 client reads a response without a length up to the connection's close, so
/// a cut there would look like the end: when the body fails at once, such a client gets
/// no answer at all instead.
#[tokio::test]
async fn an_http10_client_gets_no_answer_when_a_body_without_length_fails_at_once() {
    let got = http10_answer("garbled").await;
    assert!(
        got.is_empty(),
        "an HTTP/1.0 answer that ends at the close: {:?}",
        String::from_utf8_lossy(&got)
    );
}

/// With a length, an HTTP/1.0 client can tell a cut: it gets the head, then a short body.
#[tokio::test]
async fn an_http10_client_gets_the_head_of_a_sized_body_that_breaks_at_once() {
    let got = http10_answer("short").await;
    let (head, body) = split(&got);
    assert!(head.starts_with("http/1.0 200"), "{head}");
    assert!(head.contains("content-length: 10\r\n"), "{head}");
    assert!(body.is_empty(), "{:?}", String::from_utf8_lossy(body));
}

/// With an `Idempotency-Key` the response is read whole before it is answered; a body that
/// breaks then still reaches the client as broken (its head, then a cut), not as a
/// complete empty body.
async fn with_a_key_a_broken_body_is_answered_as_broken(kind: &str) {
    let (_upstream, running, _dir) = setup_with(|text| {
        let route = "scope = \"report/{report}\"\nupstream = \"u\"\n";
        let text = text.replacen(route, &format!("{route}idempotency = \"optional\"\n"), 1);
        assert!(text.contains("idempotency = \"optional\""), "{text}");
        text
    })
    .await;
    let got = answer(
        &running,
        &format!(
            "PUT /reports/{kind}/x HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\nIdempotency-Key: \"k-{kind}\"\r\nContent-Length: 1\r\n\r\nx"
        ),
    )
    .await;
    let (head, body) = split(&got);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(
        !complete(&head, body),
        "a broken body answered as complete: {head}{:?}",
        String::from_utf8_lossy(body)
    );
    running.shutdown().await;
}

#[tokio::test]
async fn with_a_key_a_sized_body_that_breaks_is_answered_as_broken() {
    with_a_key_a_broken_body_is_answered_as_broken("short").await;
}

#[tokio::test]
async fn with_a_key_a_chunked_body_that_breaks_is_answered_as_broken() {
    with_a_key_a_broken_body_is_answered_as_broken("broken").await;
}

/// A client that stops reading for longer than the timeout: the proxy does not ask the
/// upstream for more meanwhile, so that time is not a wait for the upstream.
#[tokio::test]
async fn a_client_that_reads_slowly_is_not_cut_off() {
    let (_upstream, running, _dir) = setup().await;
    let mut s = TcpStream::connect(running.proxy_addr)
        .await
        .expect("connect");
    s.write_all(request("big", false).as_bytes())
        .await
        .expect("write");
    let mut first = vec![0u8; 64 << 10];
    let n = tokio::time::timeout(BOUND, s.read(&mut first))
        .await
        .expect("head within bound")
        .expect("read");
    let mut got = first[..n].to_vec();
    // The pause is the scenario (a slow reader), not a wait for something to happen: the
    // buffers between the upstream and here fill up meanwhile.
    tokio::time::sleep(TIMEOUT * 3).await;
    let whole = read_response(&mut s, &mut got, BIG).await;
    assert!(whole, "cut off after {} bytes", got.len());
    let (head, body) = split(&got);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert_eq!(body.len(), BIG, "the whole body arrived");
    running.shutdown().await;
}

/// Over HTTP/2 the cut-off resets the stream: the client's body ends in an error after the
/// 3 bytes that came.
#[tokio::test]
async fn over_http2_a_stalled_body_ends_in_an_error() {
    use http_body_util::BodyExt;
    let (_upstream, running, _dir) = setup().await;
    let stream = TcpStream::connect(running.proxy_addr)
        .await
        .expect("connect");
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .expect("h2 handshake");
    tokio::spawn(conn);
    let req = http::Request::get(format!("http://{}/reports/stall/x", running.proxy_addr))
        .header("fencing-token", "1")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .expect("request");
    let sent = Instant::now();
    let resp = tokio::time::timeout(BOUND, send.send_request(req))
        .await
        .expect("head within bound")
        .expect("head");
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut data = Vec::new();
    let error = tokio::time::timeout(BOUND, async {
        loop {
            match body.frame().await {
                Some(Ok(frame)) => data.extend_from_slice(frame.data_ref().map_or(&[][..], |d| d)),
                Some(Err(e)) => return Some(e),
                None => return None,
            }
        }
    })
    .await
    .expect("the body ended within bound");
    assert!(error.is_some(), "the body ended cleanly after {data:?}");
    assert_eq!(data, b"abc");
    assert!(sent.elapsed() >= TIMEOUT, "{:?}", sent.elapsed());
    running.shutdown().await;
}
