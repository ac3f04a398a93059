//! `fencegate demo`: the paused-writer story with real HTTP on loopback, on the real
//! lease authority.
//!
//! A legacy store with no conditional writes runs in-process; fencegate runs in front of
//! it with its built-in lease authority (the `local` backend, signing its tokens). A and
//! B take real leases; A's lease expires while A pauses, B gets the next token and
//! publishes, and A's late publish is refused at the proxy. The same writes are then sent
//! straight to the store, where A's silently replaces B's.

use std::collections::HashMap;
use std::convert::Infallible;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

use crate::client::{AuthorityClient, ClientOptions, FenceResult, FencedHttp, Lease};
use crate::settings::Config;
use crate::token::Token;

type Objects = Arc<Mutex<HashMap<String, Bytes>>>;
type Error = Box<dyn std::error::Error>;

/// The scope both writers lock, and the object they publish.
const SCOPE: &str = "report/july";
const FINAL: &str = "/reports/july/final";
/// A's lease: short, so that its expiry is part of the story and the demo stays quick.
const A_TTL: Duration = Duration::from_secs(2);
/// B's lease: long enough to outlast the wait for A's expiry and B's publish.
const B_TTL: Duration = Duration::from_secs(5);
/// How long B waits at the authority for A's lease to run out (A's ttl, with room).
const B_WAIT: Duration = Duration::from_secs(5);
/// Bound on every single exchange of the demo (a loopback round trip takes milliseconds).
const EXCHANGE: Duration = Duration::from_secs(5);
/// Bound on the whole story.
const WHOLE: Duration = Duration::from_secs(30);

/// A legacy object store: PUT overwrites, GET reads, nothing is conditional.
pub async fn legacy_store() -> std::io::Result<(SocketAddr, Objects)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let objects: Objects = Arc::default();
    let shared = objects.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let objects = shared.clone();
            let svc = service_fn(move |req: Request<Incoming>| {
                let objects = objects.clone();
                async move { Ok::<_, Infallible>(store_request(req, objects).await) }
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok((addr, objects))
}

async fn store_request(req: Request<Incoming>, objects: Objects) -> Response<Full<Bytes>> {
    let key = req.uri().path().to_string();
    let reply = |status: StatusCode, body: Bytes| {
        let mut r = Response::new(Full::new(body));
        *r.status_mut() = status;
        r
    };
    match *req.method() {
        Method::PUT => match req.into_body().collect().await {
            Ok(body) => {
                let mut map = objects.lock().unwrap_or_else(|p| p.into_inner());
                map.insert(key, body.to_bytes());
                reply(StatusCode::NO_CONTENT, Bytes::new())
            }
            Err(_) => reply(StatusCode::BAD_REQUEST, Bytes::new()),
        },
        Method::GET => {
            let map = objects.lock().unwrap_or_else(|p| p.into_inner());
            match map.get(&key) {
                Some(v) => reply(StatusCode::OK, v.clone()),
                None => reply(StatusCode::NOT_FOUND, Bytes::new()),
            }
        }
        _ => reply(StatusCode::METHOD_NOT_ALLOWED, Bytes::new()),
    }
}

fn stored(objects: &Objects, key: &str) -> String {
    let map = objects.lock().unwrap_or_else(|p| p.into_inner());
    map.get(key)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .unwrap_or_default()
}

/// A plain HTTP client, for what the fenced client does not do: requests straight to the
/// store, A's late publish as it goes on the wire, and the metrics scrape.
struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
}

/// What came back: status, `Fencing-Result` (`-` if none), body.
type Answer = (StatusCode, String, String);

impl Http {
    async fn send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Result<Answer, Error> {
        let mut req = Request::builder().method(method).uri(url);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let req = req.body(Full::new(Bytes::from(body.to_string())))?;
        let exchange = async {
            let resp = self.client.request(req).await?;
            let status = resp.status();
            let result = resp
                .headers()
                .get("fencing-result")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-")
                .to_string();
            let body = resp.into_body().collect().await?.to_bytes();
            Ok::<_, Error>((status, result, String::from_utf8_lossy(&body).into_owned()))
        };
        tokio::time::timeout(EXCHANGE, exchange)
            .await
            .map_err(|_| format!("{url}: no answer within {EXCHANGE:?}"))?
    }
}

/// What the demo saw, for its exit code and its test.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The tokens the authority granted A, then B.
    pub a_token: Token,
    pub b_token: Token,
    /// The authority's proofs of them (it signs with the demo's key).
    pub a_proof: Option<String>,
    pub b_proof: Option<String>,
    /// The proxy's answer to A's late publish: status and `Fencing-Result`.
    pub stale: (StatusCode, String),
    /// The published object in the store after the fenced story, and after the same
    /// writes went straight to the store.
    pub through: String,
    pub straight: String,
    /// The `fencegate_stale_rejections_total` lines of the admin listener's `/metrics`.
    pub metric_lines: Vec<String>,
}

impl Outcome {
    /// The story went as it must: tokens from the authority in order, A refused
    /// `stale_fence`, B's report kept behind fencegate, A's without it, the refusal counted.
    pub fn as_expected(&self) -> bool {
        self.a_token < self.b_token
            && self.stale == (StatusCode::CONFLICT, "stale_fence".to_string())
            && self.through == report_by("B", self.b_token)
            && self.straight == report_by("A", self.a_token)
            && self
                .metric_lines
                .iter()
                .any(|l| l.split_whitespace().last() == Some("1"))
    }
}

fn report_by(who: &str, token: Token) -> String {
    format!("report by {who} (token {token})")
}

/// The demo's files (the store, the key pair), removed when the demo ends however it ends.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> std::io::Result<TempDir> {
        // Unique per process and per run: a leftover directory (a killed run) is never
        // reused, so the store is always fresh and nothing waits out a previous run.
        static RUNS: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let name = format!(
            "fencegate-demo-{}-{}-{nanos}",
            std::process::id(),
            RUNS.fetch_add(1, Ordering::Relaxed)
        );
        let dir = std::env::temp_dir().join(name);
        std::fs::create_dir(&dir)?;
        Ok(TempDir(dir))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn config_text(store: SocketAddr) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[store]
path = "demo.redb"
[fencing]
drain_timeout = "5s"
settle = "1s"
proof_keys = ["fence.pub"]
[authority]
listen = "127.0.0.1:0"
max_ttl = "10s"
signing_key = "fence.key"
[[upstream]]
name = "legacy"
url = "http://{store}"
timeout = "5s"
[[route]]
name = "reports"
path = "/reports/{{report}}/{{*rest}}"
scope = "report/{{report}}"
upstream = "legacy"
proof = "required"
[log]
access = "access.log"
"#
    )
}

/// Runs the story on stdout; returns an error only if the machinery itself fails.
pub async fn run() -> Result<std::process::ExitCode, Error> {
    let mut out = std::io::stdout();
    let outcome = tokio::time::timeout(WHOLE, play(&mut out))
        .await
        .map_err(|_| format!("the demo did not finish within {WHOLE:?}"))??;
    Ok(if outcome.as_expected() {
        std::process::ExitCode::SUCCESS
    } else {
        writeln!(out, "unexpected outcome: {outcome:?}")?;
        std::process::ExitCode::from(1)
    })
}

/// Plays the story, telling it on `out`: starts the store, fencegate and its authority,
/// and stops them again.
pub async fn play(out: &mut dyn Write) -> Result<Outcome, Error> {
    let (store_addr, objects) = legacy_store().await?;
    let dir = TempDir::new()?;
    let key_id = crate::proof::keygen(&dir.path().join("fence"))?;
    let config = Config::parse(&config_text(store_addr), dir.path()).map_err(|e| e.to_string())?;
    let running = crate::app::start(config, None).await?;
    let played = async {
        let authority_addr = running
            .authority_addr
            .ok_or("the authority did not start")?;
        let stage = Stage {
            authority: AuthorityClient::with_options(
                &format!("http://{authority_addr}"),
                ClientOptions {
                    request_timeout: EXCHANGE,
                    ..ClientOptions::default()
                },
            )?,
            fenced: FencedHttp::with_options(
                &format!("http://{}", running.proxy_addr),
                ClientOptions {
                    request_timeout: EXCHANGE,
                    ..ClientOptions::default()
                },
            )?,
            http: Http {
                client: Client::builder(TokioExecutor::new()).build_http(),
            },
            proxy: format!("http://{}", running.proxy_addr),
            direct: format!("http://{store_addr}"),
            admin: format!("http://{}", running.admin_addr),
            access_log: dir.path().join("access.log"),
        };
        writeln!(
            out,
            "fencegate demo: a legacy store at {} (no conditional writes),",
            stage.direct
        )?;
        writeln!(
            out,
            "fencegate in front of it at {}, fencing scope report/{{report}},",
            stage.proxy
        )?;
        writeln!(
            out,
            "its lease authority at http://{authority_addr}, signing tokens with key {key_id}.\n"
        )?;
        writeln!(out, "1) Through fencegate, with leases from the authority")?;
        let (a, b, stale) = stage.fenced_story(out).await?;
        let through = stored(&objects, FINAL);
        writeln!(
            out,
            "\n2) The same writes straight to the store, without fencing"
        )?;
        stage.straight_story(out, &a, &b).await?;
        let straight = stored(&objects, FINAL);
        writeln!(out)?;
        writeln!(
            out,
            "Through fencegate the published report is {through:?}: B's work survived."
        )?;
        writeln!(
            out,
            "Straight to the store it is {straight:?}: A's stale write silently replaced B's."
        )?;
        let metric_lines = stage.records(out).await?;
        Ok::<_, Error>(Outcome {
            a_token: a.token(),
            b_token: b.token(),
            a_proof: a.proof().map(str::to_string),
            b_proof: b.proof().map(str::to_string),
            stale,
            through,
            straight,
            metric_lines,
        })
    }
    .await;
    running.shutdown().await;
    played
}

/// The clients of one run and where they go.
struct Stage {
    authority: AuthorityClient,
    fenced: FencedHttp,
    http: Http,
    proxy: String,
    direct: String,
    admin: String,
    /// The proxy's access log (`[log] access`), for the line of A's refusal.
    access_log: std::path::PathBuf,
}

impl Stage {
    /// A and B on real leases through fencegate. Answers both leases and the proxy's
    /// answer to A's late publish.
    async fn fenced_story(
        &self,
        out: &mut dyn Write,
    ) -> Result<(Lease, Lease, (StatusCode, String)), Error> {
        let a = self
            .authority
            .acquire(SCOPE, "A", A_TTL, Duration::ZERO)
            .await?;
        say(
            out,
            &format!(
                "A acquires {SCOPE} from the authority: token {}, lease {A_TTL:?}, renewed while A works",
                a.token()
            ),
        )?;
        let renewing = self.authority.keep_alive(&a, A_TTL);
        let fence = a.fence()?;
        let r = self
            .fenced
            .put(&fence, "/reports/july/tmp-A", "draft by A")
            .await?;
        say(
            out,
            &format!(
                "A PUT /reports/july/tmp-A (its temporary object) -> {}",
                applied(&r)
            ),
        )?;

        say(out, "A pauses (a long GC pause): it stops renewing")?;
        drop(renewing);
        say(
            out,
            &format!("B asks for {SCOPE}: busy, B waits at the authority (at most {B_WAIT:?})"),
        )?;
        // The authority answers B once A's lease has run out there (bounded by B_WAIT).
        let asked = tokio::time::Instant::now();
        let b = self.authority.acquire(SCOPE, "B", B_TTL, B_WAIT).await?;
        say(
            out,
            &format!(
                "{:.1}s later A's lease has expired there; the authority grants B {SCOPE}: token {}",
                asked.elapsed().as_secs_f64(),
                b.token()
            ),
        )?;
        let r = self
            .fenced
            .put(&b.fence()?, FINAL, report_by("B", b.token()))
            .await?;
        say(
            out,
            &format!("B PUT {FINAL} (publishes) -> {}", applied(&r)),
        )?;

        say(
            out,
            "A wakes up, still believing it holds the lock, and publishes",
        )?;
        // The client would refuse A's fence now that its lease is lost, but a pause can
        // strike just after that check: A's request goes out with its token and proof as
        // they were, and it is the proxy that must refuse it.
        let token = a.token().to_string();
        let mut headers = vec![("fencing-token", token.as_str()), ("fencing-scope", SCOPE)];
        if let Some(proof) = a.proof() {
            headers.push(("fencing-proof", proof));
        }
        let r = self
            .http
            .send(
                Method::PUT,
                &format!("{}{FINAL}", self.proxy),
                &headers,
                &report_by("A", a.token()),
            )
            .await?;
        say(
            out,
            &format!(
                "A PUT {FINAL} with token {} and its proof -> {} Fencing-Result: {}",
                a.token(),
                r.0,
                r.1
            ),
        )?;
        if r.0 == StatusCode::CONFLICT && r.1 == "stale_fence" {
            say(
                out,
                "A's write was refused at the destination: stale_fence. A discards its work.",
            )?;
        }
        let g = self
            .http
            .send(Method::GET, &format!("{}{FINAL}", self.proxy), &[], "")
            .await?;
        say(out, &format!("GET {FINAL} -> {} {:?}", g.0, g.2))?;
        // B is done: it gives its lease back (an answer of `lost` would be a demo bug).
        self.authority.release(&b).await?;
        Ok((a, b, (r.0, r.1)))
    }

    /// The same writes, in the same order, straight to the store: it ignores the tokens.
    async fn straight_story(&self, out: &mut dyn Write, a: &Lease, b: &Lease) -> Result<(), Error> {
        let put = |path: &'static str, body: String| {
            let url = format!("{}{path}", self.direct);
            async move { self.http.send(Method::PUT, &url, &[], &body).await }
        };
        let r = put("/reports/july/tmp-A", "draft by A".into()).await?;
        say(out, &format!("A PUT /reports/july/tmp-A -> {}", r.0))?;
        say(out, "A pauses; B publishes")?;
        let r = put(FINAL, report_by("B", b.token())).await?;
        say(out, &format!("B PUT {FINAL} -> {}", r.0))?;
        say(out, "A wakes up and publishes")?;
        let r = put(FINAL, report_by("A", a.token())).await?;
        say(
            out,
            &format!("A PUT {FINAL} with token {} -> {}", a.token(), r.0),
        )?;
        let g = self
            .http
            .send(Method::GET, &format!("{}{FINAL}", self.direct), &[], "")
            .await?;
        say(out, &format!("GET {FINAL} -> {} {:?}", g.0, g.2))?;
        Ok(())
    }

    /// What recorded the refusal. Answers the metric's lines.
    async fn records(&self, out: &mut dyn Write) -> Result<Vec<String>, Error> {
        writeln!(out, "\nWhat recorded A's refusal:")?;
        // The log's writer thread writes the line soon after the response: a bounded wait.
        let mut refused = None;
        for _ in 0..200 {
            let text = std::fs::read_to_string(&self.access_log).unwrap_or_default();
            refused = text
                .lines()
                .find(|l| l.contains("\"result\":\"stale_fence\""))
                .map(str::to_string);
            if refused.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        say(out, &format!("access log ({}):", self.access_log.display()))?;
        say(
            out,
            &format!(
                "  {}",
                refused.as_deref().unwrap_or("(no stale_fence line)")
            ),
        )?;
        let url = format!("{}/metrics", self.admin);
        let (status, _, text) = self.http.send(Method::GET, &url, &[], "").await?;
        if status != StatusCode::OK {
            return Err(format!("{url}: {status}").into());
        }
        let lines: Vec<String> = text
            .lines()
            .filter(|l| {
                l.strip_prefix("fencegate_stale_rejections_total")
                    .is_some_and(|rest| rest.starts_with([' ', '{']))
            })
            .map(str::to_string)
            .collect();
        say(out, &format!("metrics (GET {url}):"))?;
        for l in &lines {
            say(out, &format!("  {l}"))?;
        }
        if lines.is_empty() {
            say(out, "  (no fencegate_stale_rejections_total line)")?;
        }
        Ok(lines)
    }
}

/// How a fenced write that passed the fence was answered.
fn applied(r: &FenceResult) -> String {
    match r {
        FenceResult::Applied {
            status, headers, ..
        } => {
            let result = headers
                .get("fencing-result")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-");
            format!("{status} Fencing-Result: {result}")
        }
        other => format!("{other:?}"),
    }
}

fn say(out: &mut dyn Write, step: &str) -> std::io::Result<()> {
    writeln!(out, "  {step}")
}
