//! The load generator: exactly N HTTP/1.1 connections (one `http1::handshake` each), a
//! closed loop per connection for a fixed time, every request timed.
//!
//! Every loop is bounded three ways: by the deadline, by a request count per connection,
//! and by a per-request timeout; a broken connection is re-opened a bounded number of
//! times and every failure is counted, never retried silently.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fencegate::proof::SigningKey;
use fencegate::token::Token;
use http::{HeaderValue, Method, Request, header};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The request body of every PUT: small, as in the issue.
pub const BODY: &[u8] = b"fencegate load bench: a small object body of 64 bytes..........\n";
/// A response slower than this is an error (and the connection is re-opened).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Failed connects or requests after which one connection gives up.
const MAX_FAILURES: u32 = 20;
/// Hard cap on requests per connection, whatever the duration.
const MAX_REQUESTS_PER_CONN: u64 = 50_000_000;

/// Which scope and token each request of a connection carries.
#[derive(Clone, Debug)]
pub enum Plan {
    /// A uniformly random scope out of `scopes` (indices), always with `token`.
    Random { scopes: Arc<Vec<u32>>, token: u64 },
    /// Connection `c` of `n` owns scopes `i ≡ c (mod n)` in `0..scopes`, visits them in
    /// turn and sends each a fresh, higher token every time (`start + 1`, `start + 2`…):
    /// a durable advance per request, never a stale one.
    Churn { scopes: u32, start: u64 },
    /// Every scope in `0..scopes` exactly once (partitioned like `Churn`), with `token`.
    /// The connection stops when its share is done.
    Sweep { scopes: u32, token: u64 },
    /// Every scope of the list exactly once (partitioned like `Sweep`), with `token`.
    Each { scopes: Arc<Vec<u32>>, token: u64 },
    /// Owned and visited like `Churn`, but always with `token`, each request with the
    /// scope's next `Fencing-Sequence` (1, 2, …): a durable record of the sequence per
    /// request, the token's mark left as it is (W2S).
    Sequenced { scopes: u32, token: u64 },
}

/// What a correct answer looks like.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// Any 2xx (a backend reached directly or through nginx).
    Success,
    /// 2xx with `Fencing-Result: accepted` (through fencegate).
    Accepted,
    /// 409 with `Fencing-Result: stale_fence`.
    Stale,
}

impl Expect {
    fn check(self, status: u16, result: Option<&[u8]>) -> bool {
        match self {
            Expect::Success => (200..300).contains(&status),
            Expect::Accepted => (200..300).contains(&status) && result == Some(b"accepted"),
            Expect::Stale => status == 409 && result == Some(b"stale_fence"),
        }
    }
}

/// The `Fencing-Proof` of each request, for a route with `proof = "required"`.
#[derive(Debug)]
pub struct Prover {
    key: Arc<SigningKey>,
    /// The scope of scope index `i` is `{scope}{i}` (what the route derives from the path).
    scope: String,
    /// Proofs made before the run, by (scope index, token): looked up, not signed.
    table: HashMap<(u32, u64), HeaderValue>,
    /// Proofs signed during runs (not in the table).
    signed: AtomicU64,
}

impl Prover {
    pub fn new(key: Arc<SigningKey>, scope: impl Into<String>) -> Prover {
        Prover {
            key,
            scope: scope.into(),
            table: HashMap::new(),
            signed: AtomicU64::new(0),
        }
    }

    /// Signs the proofs of `token` on each of `scopes` now, so that a run only looks
    /// them up (and the load generator's cost stays that of a header copy).
    pub fn precompute(mut self, scopes: &[u32], token: u64) -> Prover {
        for &i in scopes {
            let v = self.sign(i, token);
            self.table.insert((i, token), v);
        }
        self
    }

    fn sign(&self, scope: u32, token: u64) -> HeaderValue {
        let proof = self
            .key
            .prove(&format!("{}{scope}", self.scope), Token::new(0, token));
        HeaderValue::try_from(proof).expect("a proof is ASCII hex and dots")
    }

    /// The proof for (scope index, token): from the table, or signed now.
    pub fn proof(&self, scope: u32, token: u64) -> HeaderValue {
        if let Some(v) = self.table.get(&(scope, token)) {
            return v.clone();
        }
        self.signed.fetch_add(1, Ordering::Relaxed);
        self.sign(scope, token)
    }

    /// How many proofs were signed during runs (not found in the table).
    pub fn signed(&self) -> u64 {
        self.signed.load(Ordering::Relaxed)
    }
}

#[derive(Clone, Debug)]
pub struct Spec {
    pub addr: SocketAddr,
    /// Path up to the scope number: the request path is `{prefix}{i}/obj`.
    pub prefix: String,
    pub conns: usize,
    /// Requests before this much time has passed are sent and checked, not measured.
    pub warmup: Duration,
    /// Measured time after the warm-up (for `Sweep`: the upper bound on the whole run).
    pub duration: Duration,
    pub plan: Plan,
    pub expect: Expect,
    /// Sends a `Fencing-Proof` with every request (a route with `proof = "required"`).
    pub proof: Option<Arc<Prover>>,
}

/// What one measurement produced.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Responses in the measured window.
    pub requests: u64,
    /// The measured window: from the end of the warm-up to the last response.
    pub window: Duration,
    /// Latencies (nanoseconds) of the measured responses, sorted.
    pub latencies: Vec<u64>,
    /// Responses that were not what `expect` says, warm-up included.
    pub unexpected: u64,
    /// Requests that got no response (timeout, reset, connect failure), warm-up included.
    pub io_errors: u64,
    /// Every status seen, warm-up included.
    pub statuses: BTreeMap<u16, u64>,
    /// For `Sweep`: did every connection finish its share within the bound?
    pub complete: bool,
    /// Responses in total, warm-up included.
    pub total: u64,
    /// Connections opened (more than `conns` when the server closed some).
    pub connects: u64,
}

impl Outcome {
    pub fn rps(&self) -> f64 {
        let s = self.window.as_secs_f64();
        if s > 0.0 {
            self.requests as f64 / s
        } else {
            0.0
        }
    }

    /// The q-quantile in milliseconds (nearest rank), if anything was measured.
    pub fn quantile_ms(&self, q: f64) -> Option<f64> {
        if self.latencies.is_empty() {
            return None;
        }
        let rank =
            ((q * self.latencies.len() as f64).ceil() as usize).clamp(1, self.latencies.len());
        Some(self.latencies[rank - 1] as f64 / 1e6)
    }

    pub fn errors(&self) -> u64 {
        self.unexpected + self.io_errors
    }

    pub fn statuses_text(&self) -> String {
        let mut parts: Vec<String> = self
            .statuses
            .iter()
            .map(|(s, n)| format!("{s}×{n}"))
            .collect();
        if self.io_errors > 0 {
            parts.push(format!("no-response×{}", self.io_errors));
        }
        parts.join(" ")
    }
}

/// SplitMix64's output function: a bijective 64-bit mix.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One connection's view of a plan.
struct ConnPlan {
    plan: Plan,
    rng: u64,
    owned: Vec<u32>,
    tokens: Vec<u64>,
    pos: usize,
}

impl ConnPlan {
    fn new(plan: &Plan, conn: usize, conns: usize) -> ConnPlan {
        let owned: Vec<u32> = match plan {
            Plan::Churn { scopes, .. }
            | Plan::Sweep { scopes, .. }
            | Plan::Sequenced { scopes, .. } => (conn as u32..*scopes).step_by(conns).collect(),
            Plan::Each { scopes, .. } => scopes.iter().skip(conn).step_by(conns).copied().collect(),
            Plan::Random { .. } => Vec::new(),
        };
        let tokens = match plan {
            Plan::Churn { start, .. } => vec![*start; owned.len()],
            // The last sequence sent per owned scope.
            Plan::Sequenced { .. } => vec![0; owned.len()],
            _ => Vec::new(),
        };
        ConnPlan {
            plan: plan.clone(),
            // Each connection's SplitMix64 state starts at a mixed (not merely offset)
            // value: states that differ by a multiple of the increment would give every
            // connection the same scope sequence, one step apart. Fixed, so reproducible.
            rng: mix64(conn as u64 + 1),
            owned,
            tokens,
            pos: 0,
        }
    }

    /// SplitMix64.
    fn random(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.rng)
    }

    /// The next (scope index, token, sequence), or `None` when this connection's share is
    /// done.
    fn next(&mut self) -> Option<(u32, u64, Option<u64>)> {
        if let Plan::Sequenced { token, .. } = self.plan {
            if self.owned.is_empty() {
                return None;
            }
            let i = self.pos;
            self.pos = (self.pos + 1) % self.owned.len();
            self.tokens[i] += 1;
            return Some((self.owned[i], token, Some(self.tokens[i])));
        }
        self.next_unsequenced().map(|(s, t)| (s, t, None))
    }

    fn next_unsequenced(&mut self) -> Option<(u32, u64)> {
        let dice = self.random();
        match &self.plan {
            Plan::Random { scopes, token } => {
                let n = scopes.len() as u64;
                (n > 0).then(|| (scopes[(dice % n) as usize], *token))
            }
            Plan::Sequenced { .. } => None,
            Plan::Churn { .. } => {
                if self.owned.is_empty() {
                    return None;
                }
                let i = self.pos;
                self.pos = (self.pos + 1) % self.owned.len();
                self.tokens[i] += 1;
                Some((self.owned[i], self.tokens[i]))
            }
            Plan::Sweep { token, .. } | Plan::Each { token, .. } => {
                let token = *token;
                let i = self.pos;
                self.pos += 1;
                self.owned.get(i).map(|s| (*s, token))
            }
        }
    }
}

#[derive(Default)]
struct ConnResult {
    measured: u64,
    latencies: Vec<u64>,
    unexpected: u64,
    io_errors: u64,
    statuses: BTreeMap<u16, u64>,
    last: Option<Instant>,
    finished_share: bool,
    total: u64,
    connects: u64,
}

type Sender = http1::SendRequest<Full<Bytes>>;

async fn connect(addr: SocketAddr) -> std::io::Result<Sender> {
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| std::io::Error::other("connect timed out"))??;
    stream.set_nodelay(true)?;
    let (sender, conn) = http1::handshake(TokioIo::new(stream))
        .await
        .map_err(std::io::Error::other)?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

/// One response: status, `Fencing-Result`, and whether the server closes the connection.
struct Answer {
    status: u16,
    result: Option<Vec<u8>>,
    closing: bool,
}

/// Sends one request on a ready connection and reads the whole response.
async fn exchange(sender: &mut Sender, req: Request<Full<Bytes>>) -> Result<Answer, String> {
    let work = async {
        let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let result = resp
            .headers()
            .get("fencing-result")
            .map(|v| v.as_bytes().to_vec());
        // nginx closes a keep-alive connection after `keepalive_requests` (1000) responses
        // and says so: that is no error, the next request goes on a new connection.
        let closing = resp
            .headers()
            .get(header::CONNECTION)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
        resp.into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?;
        Ok(Answer {
            status,
            result,
            closing,
        })
    };
    tokio::time::timeout(REQUEST_TIMEOUT, work)
        .await
        .map_err(|_| "timed out".to_string())?
}

/// Waits until the connection can take a request; `false` if the server closed it
/// (nothing was sent, so nothing failed).
async fn ready(sender: &mut Sender) -> bool {
    matches!(
        tokio::time::timeout(REQUEST_TIMEOUT, sender.ready()).await,
        Ok(Ok(()))
    )
}

fn put(
    prefix: &str,
    scope: u32,
    token: u64,
    sequence: Option<u64>,
    proof: Option<&Prover>,
) -> Request<Full<Bytes>> {
    let mut req = Request::builder()
        .method(Method::PUT)
        .uri(format!("{prefix}{scope}/obj"))
        .header(header::HOST, "127.0.0.1")
        .header(header::CONTENT_LENGTH, BODY.len())
        .header("fencing-token", token);
    if let Some(p) = proof {
        req = req.header("fencing-proof", p.proof(scope, token));
    }
    if let Some(n) = sequence {
        req = req.header("fencing-sequence", n);
    }
    req.body(Full::new(Bytes::from_static(BODY)))
        .expect("a valid request")
}

async fn run_conn(
    spec: Arc<Spec>,
    mut plan: ConnPlan,
    measure_from: Instant,
    end: Instant,
) -> ConnResult {
    let mut r = ConnResult {
        latencies: Vec::with_capacity(16 * 1024),
        ..ConnResult::default()
    };
    let mut sender = None;
    let mut used = 0u64;
    let mut failures = 0;
    let mut sent = 0u64;
    while Instant::now() < end && sent < MAX_REQUESTS_PER_CONN && failures <= MAX_FAILURES {
        let s = match sender.as_mut() {
            Some(s) => s,
            None => match connect(spec.addr).await {
                Ok(s) => {
                    r.connects += 1;
                    used = 0;
                    sender.insert(s)
                }
                Err(_) => {
                    r.io_errors += 1;
                    failures += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        if !ready(s).await {
            // Closed by the server between requests (idle or request limit): reconnect.
            // Closed before its first request: the server is refusing us, a failure.
            if used == 0 {
                r.io_errors += 1;
                failures += 1;
            }
            sender = None;
            continue;
        }
        used += 1;
        let Some((scope, token, sequence)) = plan.next() else {
            r.finished_share = true;
            break;
        };
        sent += 1;
        // Built (and a proof signed, if it must be) before the clock starts.
        let req = put(&spec.prefix, scope, token, sequence, spec.proof.as_deref());
        let started = Instant::now();
        match exchange(s, req).await {
            Ok(answer) => {
                let done = Instant::now();
                r.total += 1;
                *r.statuses.entry(answer.status).or_default() += 1;
                if !spec.expect.check(answer.status, answer.result.as_deref()) {
                    r.unexpected += 1;
                }
                if started >= measure_from {
                    r.measured += 1;
                    r.latencies.push((done - started).as_nanos() as u64);
                    r.last = Some(done);
                }
                if answer.closing {
                    sender = None;
                }
            }
            Err(_) => {
                r.io_errors += 1;
                sender = None;
                failures += 1;
            }
        }
    }
    r
}

/// Runs one measurement: `conns` connections, warm-up, then the measured window.
pub async fn run(spec: Spec) -> Outcome {
    let spec = Arc::new(spec);
    let start = Instant::now();
    let measure_from = start + spec.warmup;
    let end = measure_from + spec.duration;
    let tasks: Vec<_> = (0..spec.conns)
        .map(|c| {
            let plan = ConnPlan::new(&spec.plan, c, spec.conns);
            tokio::spawn(run_conn(spec.clone(), plan, measure_from, end))
        })
        .collect();
    let mut out = Outcome {
        complete: true,
        ..Outcome::default()
    };
    let mut last = measure_from;
    for t in tasks {
        let r = t.await.unwrap_or_default();
        out.requests += r.measured;
        out.latencies.extend_from_slice(&r.latencies);
        out.unexpected += r.unexpected;
        out.io_errors += r.io_errors;
        out.total += r.total;
        out.connects += r.connects;
        for (s, n) in r.statuses {
            *out.statuses.entry(s).or_default() += n;
        }
        if let Some(l) = r.last {
            last = last.max(l);
        }
        out.complete &= r.finished_share;
    }
    out.window = last.saturating_duration_since(measure_from);
    out.latencies.sort_unstable();
    out
}

/// One request on a fresh connection with `Connection: close`, for admin calls and
/// readiness polls: (status, body).
pub async fn http_once(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> std::io::Result<(u16, String)> {
    let work = async {
        let mut stream = TcpStream::connect(addr).await?;
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(req.as_bytes()).await?;
        let mut buf = Vec::new();
        stream.take(1 << 20).read_to_end(&mut buf).await?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let status = text
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("no status line in {text:?}")))?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        Ok((status, body))
    };
    tokio::time::timeout(REQUEST_TIMEOUT, work)
        .await
        .map_err(|_| std::io::Error::other("timed out"))?
}

/// Raises `count` scopes (`report/{name}{i}`) to `token` through the admin API, with
/// `conns` requests in flight. Answers how many raises failed.
pub async fn raise_all(admin: SocketAddr, name: &str, count: u32, token: u64, conns: u32) -> u64 {
    let body = Arc::new(format!("{{\"token\":\"{token}\"}}"));
    let tasks: Vec<_> = (0..conns)
        .map(|c| {
            let (body, name) = (body.clone(), name.to_string());
            tokio::spawn(async move {
                let mut failed = 0;
                for i in (c..count).step_by(conns as usize) {
                    // The scope is one path segment: its `/` is percent-encoded.
                    let path = format!("/v1/scopes/report%2F{name}{i}/raise");
                    match http_once(admin, "POST", &path, &body).await {
                        Ok((200, _)) => {}
                        _ => failed += 1,
                    }
                }
                failed
            })
        })
        .collect();
    let mut failed = 0;
    for t in tasks {
        failed += t.await.unwrap_or(1);
    }
    failed
}
