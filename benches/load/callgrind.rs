//! The client of `benches/callgrind.sh`: W1 PUTs one at a time, in turn over a few
//! keep-alive connections, to a fencegate running under callgrind, so that its
//! instruction count per request can be read as the difference of two runs.
//!
//! ```text
//! load --callgrind-client PROXY ADMIN COUNT [--proof-key PATH.key [--unchecked]]
//! ```
//!
//! Waits for `ADMIN/readyz`, touches scopes 0..1000 once each with token 1 (the priming:
//! an advance each), then sends COUNT requests with token 1 to scopes picked by a fixed
//! generator (the same ones every run). Without `--proof-key` to `/reports/cg-s{i}/obj`;
//! with it to `/proofed/cg-s{i}/obj` (a route with `proof = "required"`) with a
//! `Fencing-Proof` for (`proofed/cg-s{i}`, token 1), all 1,000 signed before the first
//! request; with `--unchecked` too, the same header (for `report/cg-s{i}`) goes to
//! `/reports/cg-s{i}/obj`, whose route checks no proof: what carrying the header costs
//! without its check. Every answer must be 2xx with `Fencing-Result: accepted`; anything
//! else stops the client with an error.
//! Synchronous (std only, one request in flight), so that the proxy does the same work
//! in the same order every run.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use fencegate::proof::SigningKey;
use fencegate::token::Token;

const SCOPES: u32 = 1000;
const CONNS: usize = 4;
/// Under valgrind a request takes milliseconds; this bounds one that never comes.
const TIMEOUT: Duration = Duration::from_secs(60);
/// How long to wait for `/readyz` (valgrind starts slowly).
const READY_TIMEOUT: Duration = Duration::from_secs(300);
const MAX_COUNT: u64 = 10_000_000;
const MAX_HEADER_LINES: usize = 100;

struct Args {
    proxy: SocketAddr,
    admin: SocketAddr,
    count: u64,
    proof_key: Option<PathBuf>,
    /// Send the proofs to the route that checks none.
    unchecked: bool,
}

fn parse(args: &[String]) -> Result<Args, String> {
    let usage = "usage: --callgrind-client PROXY ADMIN COUNT [--proof-key PATH.key [--unchecked]]";
    let (Some(proxy), Some(admin), Some(count)) = (args.first(), args.get(1), args.get(2)) else {
        return Err(usage.into());
    };
    let addr = |a: &String| {
        a.parse::<SocketAddr>()
            .map_err(|e| format!("bad address {a}: {e}"))
    };
    let count = count
        .parse()
        .ok()
        .filter(|c| (1..=MAX_COUNT).contains(c))
        .ok_or_else(|| format!("bad COUNT {count} (1..={MAX_COUNT})"))?;
    let rest: Vec<&str> = args.iter().skip(3).map(String::as_str).collect();
    let (proof_key, unchecked) = match rest.as_slice() {
        [] => (None, false),
        ["--proof-key", p] => (Some(PathBuf::from(p)), false),
        ["--proof-key", p, "--unchecked"] => (Some(PathBuf::from(p)), true),
        _ => return Err(usage.into()),
    };
    Ok(Args {
        proxy: addr(proxy)?,
        admin: addr(admin)?,
        count,
        proof_key,
        unchecked,
    })
}

/// One keep-alive connection.
struct Conn {
    reader: BufReader<TcpStream>,
}

/// What came back: the status and `Fencing-Result`.
struct Answer {
    status: u16,
    result: Option<String>,
}

impl Conn {
    fn open(addr: SocketAddr) -> io::Result<Conn> {
        let s = TcpStream::connect_timeout(&addr, TIMEOUT)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(TIMEOUT))?;
        s.set_write_timeout(Some(TIMEOUT))?;
        Ok(Conn {
            reader: BufReader::new(s),
        })
    }

    fn line(&mut self) -> io::Result<String> {
        let mut line = String::new();
        (&mut self.reader).take(16 * 1024).read_line(&mut line)?;
        if !line.ends_with('\n') {
            return Err(io::Error::other(
                "connection closed or header line too long",
            ));
        }
        Ok(line.trim_end().to_string())
    }

    /// Sends `req` and reads the whole response (bodies by `Content-Length` only).
    fn exchange(&mut self, req: &[u8]) -> io::Result<Answer> {
        self.reader.get_mut().write_all(req)?;
        let status_line = self.line()?;
        let status = status_line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| io::Error::other(format!("bad status line {status_line:?}")))?;
        let (mut length, mut result) = (0u64, None);
        for _ in 0..MAX_HEADER_LINES {
            let line = self.line()?;
            if line.is_empty() {
                let mut body = Vec::new();
                (&mut self.reader).take(length).read_to_end(&mut body)?;
                if body.len() as u64 != length {
                    return Err(io::Error::other("body shorter than its Content-Length"));
                }
                return Ok(Answer { status, result });
            }
            let Some((name, value)) = line.split_once(':') else {
                return Err(io::Error::other(format!("bad header line {line:?}")));
            };
            let value = value.trim();
            match name.to_ascii_lowercase().as_str() {
                "content-length" => {
                    length = value
                        .parse()
                        .map_err(|_| io::Error::other("bad Content-Length"))?;
                }
                "fencing-result" => result = Some(value.to_string()),
                "transfer-encoding" => {
                    return Err(io::Error::other(format!(
                        "status {status}: a chunked body is not expected here"
                    )));
                }
                "connection" if value.eq_ignore_ascii_case("close") => {
                    return Err(io::Error::other(format!(
                        "status {status}: the proxy closes the connection"
                    )));
                }
                _ => {}
            }
        }
        Err(io::Error::other("too many header lines"))
    }
}

fn wait_ready(admin: SocketAddr) -> Result<(), String> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let ok = Conn::open(admin)
            .and_then(|mut c| {
                c.exchange(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                    .map(|a| a.status == 200)
            })
            .unwrap_or(false);
        if ok {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("{admin}/readyz not 200 within {READY_TIMEOUT:?}"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The requests, ready to send: one per scope index.
fn requests(key: Option<&SigningKey>, unchecked: bool) -> Vec<Vec<u8>> {
    const BODY: &[u8] = super::client::BODY;
    let (route, scope) = if key.is_some() && !unchecked {
        ("proofed", "proofed")
    } else {
        ("reports", "report")
    };
    (0..SCOPES)
        .map(|i| {
            let path = format!("/{route}/cg-s{i}/obj");
            let proof = key.map_or(String::new(), |k| {
                format!(
                    "Fencing-Proof: {}\r\n",
                    k.prove(&format!("{scope}/cg-s{i}"), Token::new(0, 1))
                )
            });
            let mut req = format!(
                "PUT {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\n\
                 Fencing-Token: 1\r\n{proof}\r\n",
                BODY.len()
            )
            .into_bytes();
            req.extend_from_slice(BODY);
            req
        })
        .collect()
}

fn run(args: &Args) -> Result<(), String> {
    let key = match &args.proof_key {
        Some(p) => Some(SigningKey::load(p).map_err(|e| e.to_string())?),
        None => None,
    };
    let reqs = requests(key.as_ref(), args.unchecked);
    wait_ready(args.admin)?;
    let mut conns = (0..CONNS)
        .map(|_| Conn::open(args.proxy))
        .collect::<io::Result<Vec<_>>>()
        .map_err(|e| format!("connect {}: {e}", args.proxy))?;
    let mut send = |n: u64, scope: u32| -> Result<(), String> {
        let conn = &mut conns[(n % CONNS as u64) as usize];
        let a = conn
            .exchange(&reqs[scope as usize])
            .map_err(|e| format!("request {n} (scope {scope}): {e}"))?;
        if !(200..300).contains(&a.status) || a.result.as_deref() != Some("accepted") {
            return Err(format!(
                "request {n} (scope {scope}): status {}, Fencing-Result {:?}",
                a.status, a.result
            ));
        }
        Ok(())
    };
    for i in 0..SCOPES {
        send(u64::from(i), i)?;
    }
    // xorshift64 with a fixed seed: the same scopes in the same order every run.
    let mut x: u64 = 0x5EED_F00D;
    for n in 0..args.count {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        send(u64::from(SCOPES) + n, (x % u64::from(SCOPES)) as u32)?;
    }
    println!(
        "{} priming requests and {} W1 requests{}, all accepted",
        SCOPES,
        args.count,
        match (&key, args.unchecked) {
            (None, _) => "",
            (Some(_), false) => " with proofs",
            (Some(_), true) => " with an unchecked Fencing-Proof header",
        }
    );
    Ok(())
}

/// `--callgrind-client …` (the arguments after it).
pub fn main(args: &[String]) -> std::process::ExitCode {
    match parse(args).and_then(|a| run(&a)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("callgrind client: {e}");
            std::process::ExitCode::from(1)
        }
    }
}
