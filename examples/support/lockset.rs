//! The lock-set workload, after Jepsen's etcd lock-set test: workers take turns holding a
//! short lease, read a shared set, pause, and write it back with their element added. An
//! update whose write was acknowledged but whose element is missing from the final set
//! was lost.
//!
//! Some pauses are deterministically longer than the lease: the pausing worker waits
//! (without renewing) until another worker has acquired the lock after it and had a
//! write acknowledged. Straight to the backend, the paused worker's write then
//! overwrites that acknowledged update; through fencegate it is refused with 409.
//!
//! Shared by `tests/it/lockset.rs` and `examples/lockset.rs`.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fencegate::client::{AuthorityClient, ClientOptions, FenceResult, FencedHttp, Lease};
use fencegate::token::Token;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::sync::watch;

/// The object every worker updates.
pub const OBJECT: &str = "/lockset/set.txt";
/// The lock scope of that object.
pub const SCOPE: &str = "lockset";
/// Upper bound on any wait, so a bug ends the run instead of hanging it.
const BOUND: Duration = Duration::from_secs(30);
/// Bounded retries of one transient failure.
const RETRIES: usize = 50;

/// How the workload runs.
#[derive(Debug, Clone)]
pub struct Settings {
    pub workers: usize,
    pub rounds: usize,
    pub ttl: Duration,
    /// Workers `0..pausers` pause past their lease on every other round.
    pub pausers: usize,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            workers: 5,
            rounds: 8,
            ttl: Duration::from_millis(300),
            pausers: 2,
        }
    }
}

/// Where reads and writes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Straight to the backend: tokens are obtained but nothing checks them.
    Direct,
    /// Through fencegate: fenced reads and writes.
    Fenced,
}

/// What one run observed.
#[derive(Debug, Default, Clone)]
pub struct Counts {
    pub workers: usize,
    pub attempts: usize,
    /// Writes the backend acknowledged (2xx, through the fence where fenced).
    pub acknowledged: usize,
    /// Acknowledged elements missing from the final set.
    pub lost: Vec<String>,
    /// Writes made after a pause past the lease, once a newer holder had written.
    pub stale_writes: usize,
    /// Of those, refused with 409 stale_fence.
    pub stale_rejected: usize,
    /// Other 409 stale_fence answers (reads, or writes slowed down by the machine).
    pub other_stale: usize,
    /// Writes whose outcome is unknown (upstream_timeout): neither counted nor lost.
    pub unknown: usize,
    pub final_size: usize,
}

impl std::fmt::Display for Counts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "workers={} attempts={} acknowledged={} lost_acknowledged={} stale_writes={} \
             stale_rejected_409={} other_stale={} unknown={} final_set={}",
            self.workers,
            self.attempts,
            self.acknowledged,
            self.lost.len(),
            self.stale_writes,
            self.stale_rejected,
            self.other_stale,
            self.unknown,
            self.final_size
        )
    }
}

/// A fencegate config: an authority with short leases, and the object behind one scope.
pub fn fencegate_config(backend: SocketAddr) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[store]
path = "lockset.redb"
[fencing]
settle = "0s"
[authority]
listen = "127.0.0.1:0"
max_ttl = "10s"
[[upstream]]
name = "dav"
url = "http://{backend}"
timeout = "10s"
[[route]]
name = "lockset"
path = "/lockset/{{*rest}}"
scope = "{SCOPE}"
upstream = "dav"
"#
    )
}

/// Starts fencegate (proxy and authority) in front of `backend`, its store in `dir`.
pub async fn start_fencegate(
    backend: SocketAddr,
    dir: &Path,
) -> Result<fencegate::app::Running, String> {
    let config = fencegate::settings::Config::parse(&fencegate_config(backend), dir)
        .map_err(|e| e.to_string())?;
    fencegate::app::start(config, None)
        .await
        .map_err(|e| e.to_string())
}

/// Shared progress: the highest token whose write was acknowledged, and finished workers.
#[derive(Clone, Copy, Default)]
struct Progress {
    highest_acked: Option<Token>,
    finished: usize,
    pausing: usize,
}

struct Shared {
    settings: Settings,
    mode: Mode,
    authority: AuthorityClient,
    /// The proxies, one per fencegate instance (a cluster's, or one): worker `i` starts at
    /// `i % n` and moves to the next when one cannot serve it for now.
    fenced: Vec<FencedHttp>,
    direct: Client<HttpConnector, Full<Bytes>>,
    backend: SocketAddr,
    progress: watch::Sender<Progress>,
}

#[derive(Default)]
struct WorkerCounts {
    attempts: usize,
    acked: Vec<String>,
    stale_writes: usize,
    stale_rejected: usize,
    other_stale: usize,
    unknown: usize,
}

fn parse_set(body: &[u8]) -> BTreeSet<String> {
    String::from_utf8_lossy(body)
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

fn render_set(set: &BTreeSet<String>) -> Bytes {
    let mut out = String::new();
    for e in set {
        out.push_str(e);
        out.push('\n');
    }
    Bytes::from(out)
}

enum Read {
    Set(BTreeSet<String>),
    Stale,
}

enum Write {
    Acked,
    Stale,
    Unknown,
}

impl Shared {
    async fn direct(&self, method: http::Method, body: Bytes) -> Result<(u16, Bytes), String> {
        let req = http::Request::builder()
            .method(method)
            .uri(format!("http://{}{OBJECT}", self.backend))
            .body(Full::new(body))
            .map_err(|e| e.to_string())?;
        let resp = tokio::time::timeout(BOUND, self.direct.request(req))
            .await
            .map_err(|_| "backend did not answer".to_string())?
            .map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, body))
    }

    /// After a transient answer: the next proxy, after a pause that grows with `attempt`
    /// (a cluster's takeover takes seconds; one instance's drain, milliseconds).
    async fn next_proxy(&self, via: &mut usize, attempt: usize) {
        *via = (*via + 1) % self.fenced.len();
        let pause =
            Duration::from_millis(10 * (attempt as u64 + 1)).min(Duration::from_millis(250));
        tokio::time::sleep(pause).await;
    }

    async fn read(&self, lease: &Lease, via: &mut usize) -> Result<Read, String> {
        let fence = lease.fence().map_err(|e| e.to_string())?;
        for attempt in 0..RETRIES {
            let (status, body) = match self.mode {
                Mode::Direct => self.direct(http::Method::GET, Bytes::new()).await?,
                Mode::Fenced => match self.fenced[*via].get(&fence, OBJECT).await {
                    Ok(FenceResult::Applied { status, body, .. }) => (status.as_u16(), body),
                    Ok(FenceResult::StaleFence { .. }) => return Ok(Read::Stale),
                    // The lease ran out before the read went out (retries take time).
                    Err(fencegate::client::FencedError::LeaseLost) => return Ok(Read::Stale),
                    Ok(FenceResult::Transient { .. } | FenceResult::Unknown { .. }) => {
                        self.next_proxy(via, attempt).await;
                        continue;
                    }
                    Ok(FenceResult::Duplicate { .. } | FenceResult::StaleSequence { .. }) => {
                        return Err("unexpected answer for an unnumbered fence".into());
                    }
                    Err(e) => return Err(e.to_string()),
                },
            };
            return match status {
                200 => Ok(Read::Set(parse_set(&body))),
                404 => Ok(Read::Set(BTreeSet::new())),
                other => Err(format!("read answered {other}")),
            };
        }
        Err("read kept failing".into())
    }

    async fn write(
        &self,
        lease: &Lease,
        set: &BTreeSet<String>,
        via: &mut usize,
    ) -> Result<Write, String> {
        // The fence was taken before the pause: a paused process acts on what it had, and
        // a fence apart from the lease is not refused by the client once the lease is lost
        // (the point here is what the proxy does with it).
        let fence = fencegate::client::Fence::new(lease.scope(), lease.token());
        for attempt in 0..RETRIES {
            let status = match self.mode {
                Mode::Direct => self.direct(http::Method::PUT, render_set(set)).await?.0,
                Mode::Fenced => match self.fenced[*via]
                    .put(&fence, OBJECT, render_set(set))
                    .await
                    .map_err(|e| e.to_string())?
                {
                    FenceResult::Applied { status, .. } => status.as_u16(),
                    FenceResult::StaleFence { .. } => return Ok(Write::Stale),
                    // Same token, later: the contract's advice for these.
                    FenceResult::Transient { .. } => {
                        self.next_proxy(via, attempt).await;
                        continue;
                    }
                    FenceResult::Unknown { .. } => return Ok(Write::Unknown),
                    FenceResult::Duplicate { .. } | FenceResult::StaleSequence { .. } => {
                        return Err("unexpected answer for an unnumbered fence".into());
                    }
                },
            };
            return match status {
                200..=299 => Ok(Write::Acked),
                other => Err(format!("write answered {other}")),
            };
        }
        Err("write kept failing".into())
    }

    /// Acquires without waiting at the authority: a waiting acquisition's local deadline
    /// counts from when it was sent, which would eat a short lease. Busy: look again soon.
    async fn acquire(&self, worker: usize) -> Result<Lease, String> {
        let give_up = tokio::time::Instant::now() + BOUND;
        while tokio::time::Instant::now() < give_up {
            match self
                .authority
                .acquire(
                    SCOPE,
                    &format!("w{worker}"),
                    self.settings.ttl,
                    Duration::ZERO,
                )
                .await
            {
                Ok(lease) if lease.is_held() => return Ok(lease),
                Ok(_) => continue,
                Err(fencegate::client::AcquireError::Busy { retry_after, .. })
                | Err(fencegate::client::AcquireError::Unavailable { retry_after }) => {
                    tokio::time::sleep(retry_after.min(Duration::from_millis(20))).await;
                }
                Err(e) => return Err(e.to_string()),
            }
        }
        Err("could not acquire".into())
    }

    /// Waits until a later holder has had a write acknowledged (so this worker's lease is
    /// long gone), or until nobody is left to supersede it (every other worker is done
    /// or pausing too).
    async fn pause_past_the_lease(&self, mine: Token) -> Result<(), String> {
        self.progress.send_modify(|p| p.pausing += 1);
        let mut rx = self.progress.subscribe();
        let workers = self.settings.workers;
        let waited = tokio::time::timeout(
            BOUND,
            rx.wait_for(|p| p.highest_acked > Some(mine) || p.finished + p.pausing >= workers),
        )
        .await
        .map(|r| r.map(|_| ()));
        self.progress.send_modify(|p| p.pausing -= 1);
        waited
            .map_err(|_| "pause never ended".to_string())?
            .map_err(|e| e.to_string())
    }

    async fn worker(&self, i: usize) -> Result<WorkerCounts, String> {
        let mut counts = WorkerCounts::default();
        let mut via = i % self.fenced.len().max(1);
        for round in 0..self.settings.rounds {
            counts.attempts += 1;
            let lease = self.acquire(i).await?;
            let set = match self.read(&lease, &mut via).await? {
                Read::Set(set) => set,
                Read::Stale => {
                    counts.other_stale += 1;
                    continue;
                }
            };
            let long = i < self.settings.pausers && round.is_multiple_of(2);
            if long {
                self.pause_past_the_lease(lease.token()).await?;
            }
            let superseded = self.progress.borrow().highest_acked > Some(lease.token());
            let element = format!("w{i}-r{round}");
            let mut next = set;
            next.insert(element.clone());
            let written = self.write(&lease, &next, &mut via).await?;
            if long && superseded {
                counts.stale_writes += 1;
            }
            match written {
                Write::Acked => {
                    counts.acked.push(element);
                    let token = lease.token();
                    self.progress.send_modify(|p| {
                        p.highest_acked = p.highest_acked.max(Some(token));
                    });
                }
                Write::Stale if long && superseded => counts.stale_rejected += 1,
                Write::Stale => counts.other_stale += 1,
                Write::Unknown => counts.unknown += 1,
            }
            if lease.is_held() {
                let _ = self.authority.release(&lease).await;
            }
        }
        Ok(counts)
    }
}

/// Runs the workload once against `backend` (Direct) or through `proxy` (Fenced).
pub async fn run(
    mode: Mode,
    settings: Settings,
    authority: SocketAddr,
    proxy: SocketAddr,
    backend: SocketAddr,
) -> Result<Counts, String> {
    run_spread(mode, settings, authority, &[proxy], backend).await
}

/// [`run`] with the workers spread over several proxies (the instances of a cluster):
/// worker `i` goes through `proxies[i % n]`, and to the next one when it cannot be served
/// for now (the instance is gone, or its shard is being taken over).
pub async fn run_spread(
    mode: Mode,
    settings: Settings,
    authority: SocketAddr,
    proxies: &[SocketAddr],
    backend: SocketAddr,
) -> Result<Counts, String> {
    if proxies.is_empty() {
        return Err("no proxy to run through".into());
    }
    let options = ClientOptions::default();
    let fenced = proxies
        .iter()
        .map(|p| FencedHttp::with_options(&format!("http://{p}"), options.clone()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let shared = Arc::new(Shared {
        mode,
        authority: AuthorityClient::with_options(&format!("http://{authority}"), options.clone())
            .map_err(|e| e.to_string())?,
        fenced,
        direct: Client::builder(TokioExecutor::new()).build_http(),
        backend,
        progress: watch::channel(Progress::default()).0,
        settings: settings.clone(),
    });
    // Start from an empty object.
    shared.direct(http::Method::DELETE, Bytes::new()).await?;
    let mut tasks = Vec::new();
    for i in 0..settings.workers {
        let shared = shared.clone();
        tasks.push(tokio::spawn(async move {
            let r = shared.worker(i).await;
            shared.progress.send_modify(|p| p.finished += 1);
            r
        }));
    }
    let mut counts = Counts {
        workers: settings.workers,
        ..Counts::default()
    };
    let mut acked = Vec::new();
    for t in tasks {
        let w = t.await.map_err(|e| e.to_string())??;
        counts.attempts += w.attempts;
        counts.stale_writes += w.stale_writes;
        counts.stale_rejected += w.stale_rejected;
        counts.other_stale += w.other_stale;
        counts.unknown += w.unknown;
        acked.extend(w.acked);
    }
    counts.acknowledged = acked.len();
    let (status, body) = shared.direct(http::Method::GET, Bytes::new()).await?;
    let final_set = if status == 200 {
        parse_set(&body)
    } else {
        BTreeSet::new()
    };
    counts.final_size = final_set.len();
    counts.lost = acked
        .into_iter()
        .filter(|e| !final_set.contains(e))
        .collect();
    Ok(counts)
}
