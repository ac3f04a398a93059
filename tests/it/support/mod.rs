//! Shared test support: an in-process upstream double with barriers, a proxy started on
//! port 0, and HTTP helpers (a pooled client and a raw-bytes client for malformed input).

pub mod disk;
pub mod etcd;
pub mod nginx;
pub mod oracle;
pub mod power;
pub mod sigv4;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use fencegate::app::Running;
use fencegate::settings::Config;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// Upper bound for any wait in a test, so a bug fails the test instead of hanging it.
pub const BOUND: Duration = Duration::from_secs(20);

/// One request as the upstream saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    /// Path and query exactly as received.
    pub target: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Seen {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

#[derive(Default)]
struct Holds {
    /// name → (arrived, released)
    state: Mutex<HashMap<String, (bool, bool)>>,
    changed: Notify,
}

/// An upstream test double. Requests with `x-test-hold: NAME` wait inside the upstream
/// until [`Double::release`]; [`Double::arrived`] waits until such a request is inside.
/// `x-test-reset: 1` makes the upstream drop the connection without answering;
/// `x-test-status: NNN` makes it answer status NNN with an empty body (an S3 PutObject's
/// 200, an asynchronous backend's 202).
#[derive(Clone)]
pub struct Double {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    holds: Arc<Holds>,
}

impl Double {
    pub async fn start() -> Double {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind double");
        let addr = listener.local_addr().expect("addr");
        let double = Double {
            addr,
            seen: Arc::default(),
            holds: Arc::default(),
        };
        let d = double.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let d = d.clone();
                let svc = service_fn(move |req| {
                    let d = d.clone();
                    async move { d.serve(req).await }
                });
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        double
    }

    async fn serve(&self, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, std::io::Error> {
        let (parts, body) = req.into_parts();
        let body = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let seen = Seen {
            method: parts.method.to_string(),
            target: parts
                .uri
                .path_and_query()
                .map(|p| p.as_str().to_string())
                .unwrap_or_default(),
            headers: parts.headers.clone(),
            body,
        };
        let hold = seen.header("x-test-hold").map(str::to_string);
        let reset = seen.header("x-test-reset").is_some();
        let status = seen
            .header("x-test-status")
            .and_then(|s| s.parse::<u16>().ok())
            .and_then(|s| StatusCode::from_u16(s).ok());
        self.seen.lock().unwrap().push(seen.clone());
        if let Some(name) = hold {
            self.mark(&name, true, false);
            loop {
                let notified = self.holds.changed.notified();
                if self
                    .holds
                    .state
                    .lock()
                    .unwrap()
                    .get(&name)
                    .is_some_and(|s| s.1)
                {
                    break;
                }
                notified.await;
            }
        }
        if reset {
            return Err(std::io::Error::other("reset by test"));
        }
        let body = match status {
            Some(_) => Bytes::new(),
            None => Bytes::from(format!(
                "{} {} token={}",
                seen.method,
                seen.target,
                seen.header("fencing-token").unwrap_or("-")
            )),
        };
        let mut resp = Response::new(Full::new(body));
        *resp.status_mut() = status.unwrap_or(StatusCode::OK);
        resp.headers_mut()
            .insert("x-upstream", http::HeaderValue::from_static("double"));
        Ok(resp)
    }

    fn mark(&self, name: &str, arrived: bool, released: bool) {
        let mut st = self.holds.state.lock().unwrap();
        let e = st.entry(name.to_string()).or_insert((false, false));
        e.0 |= arrived;
        e.1 |= released;
        drop(st);
        self.holds.changed.notify_waiters();
    }

    /// Waits (bounded) until a request held under `name` is inside the upstream.
    pub async fn arrived(&self, name: &str) {
        tokio::time::timeout(BOUND, async {
            loop {
                let notified = self.holds.changed.notified();
                if self
                    .holds
                    .state
                    .lock()
                    .unwrap()
                    .get(name)
                    .is_some_and(|s| s.0)
                {
                    return;
                }
                notified.await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("request {name} never reached the upstream"));
    }

    pub fn release(&self, name: &str) {
        self.mark(name, false, true);
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Requests seen whose `Fencing-Token` equals `token`.
    pub fn count_token(&self, token: &str) -> usize {
        self.seen()
            .iter()
            .filter(|s| s.header("fencing-token") == Some(token))
            .count()
    }
}

pub const ROUTES: &str = r#"
[[route]]
name = "reports"
path = "/reports/{report}/{*rest}"
scope = "report/{report}"
upstream = "u"

[[route]]
name = "strict"
path = "/strict/{k}"
scope = "strict/{k}"
upstream = "u"
equal = "reject"

[[route]]
name = "public"
path = "/public/{*rest}"
upstream = "u"
fenced = false

[[route]]
name = "tenant"
host = "tenant.example"
path = "/t/{*rest}"
scope = "tenant"
upstream = "u"

[[route]]
name = "posts"
path = "/posts/{id}"
scope = "post/{id}"
upstream = "u"
methods = ["POST"]

[[route]]
name = "idem"
path = "/idem/{k}"
scope = "idem/{k}"
upstream = "u"
idempotency = "optional"

[[route]]
name = "idemreq"
path = "/idemreq/{k}"
scope = "idemreq/{k}"
upstream = "u"
idempotency = "required"
idempotency_unknown = "forward"
"#;

/// A config for a proxy on port 0 in front of `upstream`, with the store in `dir`.
pub fn config_text(upstream: SocketAddr, drain: &str, settle: &str, timeout: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
shutdown_timeout = "10s"
trusted_proxies = ["127.0.0.1"]
[admin]
listen = "127.0.0.1:0"
[store]
path = "marks.redb"
[fencing]
drain_timeout = "{drain}"
settle = "{settle}"
[[upstream]]
name = "u"
url = "http://{upstream}"
timeout = "{timeout}"
{ROUTES}"#
    )
}

pub fn config(upstream: SocketAddr, dir: &Path) -> Config {
    Config::parse(&config_text(upstream, "10s", "0s", "10s"), dir).expect("test config")
}

/// [`config_text`] with the test defaults (drain 10 s, settle 0 s, upstream timeout 10 s)
/// and `server` (lines of `[server]`, or nothing) in place of its `trusted_proxies` line.
pub fn config_text_with_server(upstream: SocketAddr, server: &str) -> String {
    config_text(upstream, "10s", "0s", "10s").replace("trusted_proxies = [\"127.0.0.1\"]", server)
}

/// An `[authority]` table on port 0 with nothing else set, to append to a proxy's config.
pub const AUTHORITY_TABLE: &str = "\n[authority]\nlisten = \"127.0.0.1:0\"\n";

/// A process that is only a lease authority (no routes): every listener on port 0, the
/// store in `authority.redb`, and `authority` (the lines of its `[authority]` table after
/// `listen`: backend, ttl bounds, clients).
pub fn authority_text(authority: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[store]
path = "authority.redb"
[authority]
listen = "127.0.0.1:0"
{authority}
"#
    )
}

/// Parses `text` (its relative paths under `dir`) and starts it; a config the test got
/// wrong fails the test with the parser's message.
pub async fn start_text(text: &str, dir: &Path) -> Running {
    start(Config::parse(text, dir).unwrap_or_else(|e| panic!("test config: {e}"))).await
}

/// A running lease authority with a client for its API and one for its admin listener.
pub struct Authority {
    pub running: Running,
    pub api: Client,
    pub admin: Client,
}

/// Starts [`authority_text`]`(authority)`, state in `dir`.
pub async fn start_authority(authority: &str, dir: &Path) -> Authority {
    let running = start_text(&authority_text(authority), dir).await;
    let api = Client::new(running.authority_addr.expect("authority address"));
    let admin = Client::new(running.admin_addr);
    Authority {
        running,
        api,
        admin,
    }
}

/// The value of the series `series` (name and labels, exactly as exposed) in a
/// Prometheus text exposition, if it is there; a series exposed twice fails the test.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    let mut found = text.lines().filter_map(|l| {
        let (name, v) = l.rsplit_once(' ')?;
        (name == series).then(|| v.parse::<f64>().expect("a number"))
    });
    let v = found.next()?;
    assert!(found.next().is_none(), "{series} twice");
    Some(v)
}

/// [`metric`], for a series that must be there.
pub fn metric_value(text: &str, series: &str) -> f64 {
    metric(text, series).unwrap_or_else(|| panic!("no series {series} in:\n{text}"))
}

/// A proxy in front of `upstream`, state in `dir`, whose mark store lives on a
/// [`disk::Disk`] the test controls (it can fail or hold the store's writes).
pub async fn start_on_disk(upstream: SocketAddr, dir: &Path) -> (Running, disk::Disk) {
    let disk = disk::Disk::new();
    let store = fencegate::store::MarkStore::open_with_backend(disk.clone()).expect("store");
    let proxy = fencegate::app::start(config(upstream, dir), Some(store))
        .await
        .expect("start proxy");
    (proxy, disk)
}

pub async fn start(config: Config) -> Running {
    fencegate::app::start(config, None)
        .await
        .expect("start proxy")
}

/// A response, fully read.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: String,
}

impl Resp {
    pub fn result(&self) -> &str {
        self.headers
            .get("fencing-result")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

#[derive(Clone)]
pub struct Client {
    inner: HyperClient<HttpConnector, Full<Bytes>>,
    base: String,
}

impl Client {
    pub fn new(addr: SocketAddr) -> Client {
        Client {
            inner: HyperClient::builder(TokioExecutor::new()).build_http(),
            base: format!("http://{addr}"),
        }
    }

    /// Sends `method path` with `headers` (name, value pairs; repeated names repeat).
    pub async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Resp {
        let mut b = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let req = b
            .body(Full::new(Bytes::from(body.to_string())))
            .expect("request");
        let resp = tokio::time::timeout(BOUND, self.inner.request(req))
            .await
            .expect("response within bound")
            .expect("response");
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        Resp {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
    }

    /// A POST of a JSON `body` (the lease authority's API).
    pub async fn post_json(&self, path: &str, body: &str) -> Resp {
        self.post_json_as(path, body, None).await
    }

    /// [`Client::post_json`] with an `Authorization` header when `authorization` is given.
    pub async fn post_json_as(&self, path: &str, body: &str, authorization: Option<&str>) -> Resp {
        let mut headers = vec![("content-type", "application/json")];
        if let Some(a) = authorization {
            headers.push(("authorization", a));
        }
        self.send("POST", path, &headers, body).await
    }

    pub async fn put(&self, path: &str, token: &str, body: &str) -> Resp {
        self.send("PUT", path, &[("fencing-token", token)], body)
            .await
    }

    /// A PUT that tolerates the server going away: `None` if no answer came.
    pub async fn try_put(&self, path: &str, token: &str) -> Option<u16> {
        let req = Request::builder()
            .method("PUT")
            .uri(format!("{}{path}", self.base))
            .header("fencing-token", token)
            .body(Full::new(Bytes::new()))
            .ok()?;
        let resp = tokio::time::timeout(BOUND, self.inner.request(req))
            .await
            .ok()?
            .ok()?;
        Some(resp.status().as_u16())
    }

    pub async fn get(&self, path: &str) -> Resp {
        self.send("GET", path, &[], "").await
    }
}

/// Sends raw bytes (for requests no well-behaved client would build) and reads the
/// status line and body until the server closes.
pub async fn raw(addr: SocketAddr, request: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(request).await.expect("write");
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(BOUND, s.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf).into_owned();
    (status_of(&text), text)
}

/// The status code of a raw HTTP/1.1 answer (0 if it has none).
pub fn status_of(text: &str) -> u16 {
    text.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// The real binary, started on a config file with ports picked by the test.
pub struct Proc {
    pub child: Child,
    pub proxy: std::net::SocketAddr,
    pub admin: std::net::SocketAddr,
}

/// A test that fails midway must not leave the server running.
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port for a process the test starts to listen on. Taken below the kernel's ephemeral
/// range (32768 and up here), so that no outgoing connection of a concurrent test can take
/// it between this check and the process's bind (a port the kernel handed out as free could
/// be); each pick of this process moves on, so two of its picks never collide either.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let seed = || {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        (std::process::id().wrapping_mul(7919) ^ nanos) % SPAN
    };
    let _ = NEXT.compare_exchange(u32::MAX, seed(), Ordering::AcqRel, Ordering::Acquire);
    for _ in 0..SPAN {
        let port = LOW + NEXT.fetch_add(1, Ordering::AcqRel) % SPAN;
        let port = u16::try_from(port).expect("below 32768");
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {LOW}..{}", LOW + SPAN);
}

pub fn write_config(dir: &Path, upstream: std::net::SocketAddr) -> (std::path::PathBuf, u16, u16) {
    let (p, a) = (free_port(), free_port());
    let text = config_text(upstream, "10s", "0s", "10s")
        .replace(
            "listen = \"127.0.0.1:0\"\nshutdown",
            &format!("listen = \"127.0.0.1:{p}\"\nshutdown"),
        )
        .replace(
            "[admin]\nlisten = \"127.0.0.1:0\"",
            &format!("[admin]\nlisten = \"127.0.0.1:{a}\""),
        );
    let path = dir.join("fencegate.toml");
    std::fs::write(&path, text).unwrap();
    (path, p, a)
}

/// Starts the binary and waits (bounded) for its "listening" log line.
pub fn spawn(config: &Path, proxy: u16, admin: u16) -> Proc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["serve", "--config"])
        .arg(config)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn fencegate");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    // Until it listens, what it says is kept: a process that ends first says why.
    let said = Arc::new(Mutex::new(Vec::new()));
    let log = said.clone();
    std::thread::spawn(move || {
        let mut listening = false;
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("fencegate listening") {
                listening = true;
                let _ = tx.send(());
            } else if !listening {
                log.lock().unwrap().push(line);
            }
        }
    });
    if let Err(e) = rx.recv_timeout(BOUND) {
        panic!(
            "fencegate did not start listening ({e}): {:#?}",
            said.lock().unwrap()
        );
    }
    Proc {
        child,
        proxy: ([127, 0, 0, 1], proxy).into(),
        admin: ([127, 0, 0, 1], admin).into(),
    }
}

/// Sends the signal `name` (`HUP`, `TERM`, `STOP`) to the child process `pid` with
/// kill(1) (std sends only SIGKILL); the test fails unless it was delivered. Never the
/// test's own process: every test of this binary shares it.
pub fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{name} {pid}");
}

/// The peak resident memory of a process, from /proc (VmHWM), in bytes.
pub fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmHWM")
        * 1024
}

/// Writes a secret or private key as its owner alone may read it (mode 0600): fencegate
/// refuses one that other users could read, as ssh does.
pub fn write_secret(path: impl AsRef<Path>, text: impl AsRef<[u8]>) {
    use std::os::unix::fs::PermissionsExt;
    let path = path.as_ref();
    std::fs::write(path, text).expect("write a secret");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod 600");
}

/// A small deterministic generator (SplitMix64): the same seed gives
/// the same requests (the desync streams, the object-identity oracle).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    pub fn chance(&mut self, in_n: u64) -> bool {
        self.below(in_n) == 0
    }

    pub fn pick<T: Copy>(&mut self, of: &[T]) -> T {
        of[self.below(of.len() as u64) as usize]
    }
}
