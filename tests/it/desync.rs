//! Request streams against a running proxy, from a seeded generator: several requests
//! pipelined on a connection, in mixed framings (a length, chunks with extensions and
//! trailers, none), with odd but valid spellings (whitespace around values, header names
//! in any case, repeated headers), and now and then one that two parsers could read two
//! ways (a length beside chunked, a folded line, a duplicated or malformed length, a
//! disguised coding, bare line feeds), each carrying a second request in its body. The
//! bytes go out cut at random places. The recording upstream must see only requests the
//! stream really holds, each once, with the method, target and token it was sent with;
//! a request hidden in a body reaching it is a desync, and fails with the stream's bytes.

use std::collections::HashMap;
use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::{self, Double, Rng};

/// A request the stream holds, as the upstream should see it if it is forwarded.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Sent {
    method: String,
    target: String,
    token: String,
}

/// One generated connection: its bytes, the requests it really holds (in order), and the
/// targets of those hidden in bodies (which must never arrive).
struct Stream {
    bytes: Vec<u8>,
    real: Vec<Sent>,
    hidden: Vec<String>,
}

/// `name` in a random case.
fn spell(rng: &mut Rng, name: &str) -> String {
    match rng.below(3) {
        0 => name.to_ascii_lowercase(),
        1 => name.to_ascii_uppercase(),
        _ => name.to_string(),
    }
}

/// Optional whitespace around a value (RFC 9112 §5: spaces and tabs, trimmed).
fn ows(rng: &mut Rng) -> &'static str {
    rng.pick(&["", " ", "  ", "\t", " \t"])
}

fn chunked(rng: &mut Rng, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = body;
    // Bounded: each turn takes at least one byte.
    while !rest.is_empty() {
        let n = (1 + rng.below(rest.len() as u64)) as usize;
        let ext = rng.pick(&["", ";a=1", ";x", ";q=\"v\""]);
        out.extend_from_slice(format!("{n:x}{ext}\r\n").as_bytes());
        out.extend_from_slice(&rest[..n]);
        out.extend_from_slice(b"\r\n");
        rest = &rest[n..];
    }
    out.extend_from_slice(b"0\r\n");
    if rng.chance(3) {
        out.extend_from_slice(b"X-Trailer: 1\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

fn generate(rng: &mut Rng, conn: usize) -> Stream {
    let mut s = Stream {
        bytes: Vec::new(),
        real: Vec::new(),
        hidden: Vec::new(),
    };
    let n = 1 + rng.below(5) as usize;
    for i in 0..n {
        let method = rng
            .pick(&["PUT", "POST", "DELETE", "PATCH", "GET"])
            .to_string();
        let token = (1 + rng.below(1000)).to_string();
        let target = format!("/reports/c{conn}r{i}/x?q={}", rng.below(100));
        let mut head = format!("{method} {target} HTTP/1.1\r\n");
        head.push_str(&format!(
            "{}:{}a{}\r\n",
            spell(rng, "Host"),
            ows(rng),
            ows(rng)
        ));
        head.push_str(&format!(
            "{}:{}{token}{}\r\n",
            spell(rng, "Fencing-Token"),
            ows(rng),
            ows(rng)
        ));
        if rng.chance(3) {
            head.push_str("X-Dup: 1\r\nx-dup: 2\r\n");
        }
        let body: Vec<u8> = (0..rng.below(40)).map(|k| b'a' + (k % 26) as u8).collect();
        // A request hidden in the body of an ambiguous one.
        let smuggled_target = format!("/reports/hidden{conn}x{i}/x");
        let smuggled = format!(
            "DELETE {smuggled_target} HTTP/1.1\r\nHost: a\r\nFencing-Token: 999999\r\n\r\n"
        );
        let ambiguous = i > 0 && rng.chance(4) || rng.chance(6);
        if ambiguous {
            s.hidden.push(smuggled_target);
            let chunk_end = "0\r\n\r\n";
            let (headers, payload): (String, String) = match rng.below(9) {
                // A name that only looks like Transfer-Encoding (no framing to hyper),
                // and a next request with a fragment, which must be refused: the head
                // scan once read the name as the coding, took the next head for a
                // chunk, and let the fragment through unseen.
                8 => (
                    format!(
                        "{}: chunked\r\n",
                        rng.pick(&["Transfer%Encoding", "TransferXEncoding"])
                    ),
                    smuggled.replacen("/x HTTP/1.1", "/x#f HTTP/1.1", 1),
                ),
                // CL.TE: a length covering the chunked body's end and the hidden request.
                0 => (
                    format!(
                        "Content-Length: {}\r\nTransfer-Encoding: chunked\r\n",
                        chunk_end.len() + smuggled.len()
                    ),
                    format!("{chunk_end}{smuggled}"),
                ),
                // TE.CL: chunked first, a short length after it.
                1 => {
                    let inner = format!("{:x}\r\n{smuggled}\r\n0\r\n\r\n", smuggled.len());
                    (
                        "Transfer-Encoding: chunked\r\nContent-Length: 3\r\n".into(),
                        inner,
                    )
                }
                // A folded coding line: obsolete line folding.
                2 => (
                    "X-F: 1\r\n Transfer-Encoding: chunked\r\n".into(),
                    format!("{chunk_end}{smuggled}"),
                ),
                // Two different lengths.
                3 => (
                    format!(
                        "Content-Length: 0\r\nContent-Length: {}\r\n",
                        smuggled.len()
                    ),
                    smuggled.clone(),
                ),
                // A disguised coding.
                4 => (
                    rng.pick(&[
                        "Transfer-Encoding: xchunked\r\n",
                        "Transfer-Encoding : chunked\r\n",
                        "Transfer-Encoding: chunked, identity\r\n",
                        "Transfer-Encoding:\x0bchunked\r\n",
                    ])
                    .to_string(),
                    format!("{chunk_end}{smuggled}"),
                ),
                // A length that is not one number.
                5 => (
                    rng.pick(&[
                        "Content-Length: +5\r\n",
                        "Content-Length: 5, 6\r\n",
                        "Content-Length: 0x5\r\n",
                        "Content-Length: 5 5\r\n",
                    ])
                    .to_string(),
                    smuggled.clone(),
                ),
                // Bare line feeds in a chunk-size line.
                6 => (
                    "Transfer-Encoding: chunked\r\n".into(),
                    format!("1;a\nx\r\n{chunk_end}{smuggled}"),
                ),
                // A hidden request in a chunk's data, framed right: must stay data.
                _ => (
                    "Transfer-Encoding: chunked\r\n".into(),
                    format!("{:x}\r\n{smuggled}\r\n{chunk_end}", smuggled.len()),
                ),
            };
            head.push_str(&headers);
            head.push_str("\r\n");
            s.bytes.extend_from_slice(head.as_bytes());
            s.bytes.extend_from_slice(payload.as_bytes());
            // The outer request may be forwarded (read one way) or refused; what follows
            // it on the connection is not counted on.
            s.real.push(Sent {
                method,
                target,
                token,
            });
            return s;
        }
        match rng.below(3) {
            0 if !body.is_empty() || method != "GET" => {
                head.push_str(&format!(
                    "{}:{}{}{}\r\n\r\n",
                    spell(rng, "Content-Length"),
                    ows(rng),
                    body.len(),
                    ows(rng)
                ));
                s.bytes.extend_from_slice(head.as_bytes());
                s.bytes.extend_from_slice(&body);
            }
            1 => {
                head.push_str(&format!(
                    "{}:{}chunked\r\n\r\n",
                    spell(rng, "Transfer-Encoding"),
                    ows(rng)
                ));
                s.bytes.extend_from_slice(head.as_bytes());
                s.bytes.extend_from_slice(&chunked(rng, &body));
            }
            _ => {
                head.push_str("\r\n");
                s.bytes.extend_from_slice(head.as_bytes());
            }
        }
        s.real.push(Sent {
            method,
            target,
            token,
        });
    }
    s
}

/// The last request of every stream: an unfenced one that closes the connection, so
/// that the proxy reads (and serves or refuses) everything before it, then closes. (A
/// client that shuts its side instead may have its pipelined requests dropped unread.)
const LAST: &[u8] = b"GET /public/end HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n";

/// Writes the stream and [`LAST`] cut at random places, then reads until the proxy
/// closes: after `LAST`, or after a refusal, or (a stream whose body it still waits for)
/// at the bound, when the connection is dropped.
async fn send(rng: &mut Rng, addr: SocketAddr, bytes: &[u8]) {
    let mut conn = TcpStream::connect(addr).await.expect("connect");
    let whole = [bytes, LAST].concat();
    let mut rest = &whole[..];
    while !rest.is_empty() {
        let n = (1 + rng.below(rest.len().min(64) as u64)) as usize;
        if conn.write_all(&rest[..n]).await.is_err() {
            break;
        }
        rest = &rest[n..];
    }
    let mut sink = Vec::new();
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        conn.read_to_end(&mut sink),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_request_streams_reach_the_upstream_only_as_decided() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start_text(
        &support::config_text_with_server(double.addr, "header_read_timeout = \"2s\""),
        dir.path(),
    )
    .await;
    let seed = std::env::var("DESYNC_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_f00d_u64);
    let streams: usize = std::env::var("DESYNC_STREAMS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(150);
    let mut rng = Rng(seed);
    let mut all: HashMap<String, (Sent, usize)> = HashMap::new();
    let mut hidden: HashMap<String, usize> = HashMap::new();
    let mut sent_streams = Vec::new();
    for conn in 0..streams {
        let s = generate(&mut rng, conn);
        send(&mut rng, proxy.proxy_addr, &s.bytes).await;
        for r in &s.real {
            all.insert(r.target.clone(), (r.clone(), conn));
        }
        for h in &s.hidden {
            hidden.insert(h.clone(), conn);
        }
        sent_streams.push(s.bytes);
    }
    let show = |conn: usize| String::from_utf8_lossy(&sent_streams[conn]).into_owned();
    let seen = double.seen();
    let mut arrived: HashMap<String, usize> = HashMap::new();
    for got in seen.iter().filter(|s| s.target != "/public/end") {
        if let Some(&conn) = hidden.get(got.target.as_str()) {
            panic!(
                "a request hidden in a body reached the upstream: {} {} (seed {seed}, stream {conn}):\n{:?}",
                got.method,
                got.target,
                show(conn)
            );
        }
        let Some((want, conn)) = all.get(&got.target) else {
            panic!("the upstream saw a request nobody sent: {got:?}");
        };
        let token = got.header("fencing-token").unwrap_or("").to_string();
        assert_eq!(
            (got.method.as_str(), token.as_str()),
            (want.method.as_str(), want.token.as_str()),
            "{} reached the upstream otherwise than sent (seed {seed}, stream {conn}):\n{:?}",
            got.target,
            show(*conn)
        );
        *arrived.entry(got.target.clone()).or_default() += 1;
    }
    if let Some((target, n)) = arrived.iter().find(|(_, n)| **n > 1) {
        panic!("{target} reached the upstream {n} times (seed {seed})");
    }
    // Not vacuous: most plain requests go through.
    assert!(
        arrived.len() * 2 > all.len(),
        "only {} of {} requests arrived (seed {seed})",
        arrived.len(),
        all.len()
    );
    assert!(
        !hidden.is_empty(),
        "the streams hid no request (seed {seed})"
    );
}
