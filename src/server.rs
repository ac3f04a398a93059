//! Listeners and lifecycle: bind, accept (HTTP/1.1 and h2 on one port), graceful shutdown.
//! `start` binds port 0 in tests and hands back the addresses, so tests talk to a real socket.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinHandle;

use crate::config::{Config, ServerConfig};
use crate::fence::{Gates, MarkStore};
use crate::first_bytes::FirstBytes;
use crate::h1_scan::{Flaw, Scan};
use crate::h2_idle::{IdleConn, OpenBody, Streams};
use crate::metrics::Metrics;
use crate::proxy::{Body, Proxy};

/// Everything the listeners share.
pub struct App {
    pub config: Arc<Config>,
    pub store: MarkStore,
    pub gates: Arc<Gates>,
    pub metrics: Arc<Metrics>,
    pub proxy: Proxy,
    /// Online backups running now, at most [`crate::admin::MAX_BACKUPS`]: each holds a
    /// read transaction and a blocking thread for as long as its client reads.
    pub backups: Arc<tokio::sync::Semaphore>,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Store(#[from] crate::fence::StoreError),
    #[error("lease authority: {0}")]
    Authority(String),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("TLS: {0}")]
    Tls(#[from] crate::tls::TlsError),
    #[error("log.access: cannot open {path}: {source}")]
    AccessLog {
        path: String,
        source: std::io::Error,
    },
}

/// A started server. Dropping it does not stop it; call [`Running::shutdown`].
pub struct Running {
    pub proxy_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// Where the lease authority listens, when `[authority]` is configured.
    pub authority_addr: Option<SocketAddr>,
    pub app: Arc<App>,
    /// The listeners' TLS (`server.tls`, `admin.tls`, `authority.tls`, those set); their
    /// files are re-read on reload.
    tls: Vec<Arc<crate::tls::Listener>>,
    stop: watch::Sender<bool>,
    /// What shutdown waits for, each with what it is, for the log if it is left behind.
    tasks: Vec<(&'static str, JoinHandle<()>)>,
}

/// How long shutdown goes on after `server.shutdown_timeout`, for the listeners to let go
/// of what they ended and for the store to commit what is queued and close. A healthy store
/// closes in milliseconds; one whose disk hangs (an fsync that never returns) never does,
/// and waiting for it would keep the process from exiting.
pub const CLOSE_AFTER_GRACE: Duration = Duration::from_secs(2);

impl Running {
    /// Stops accepting, lets in-flight requests finish (bounded by
    /// `server.shutdown_timeout`), then closes the store. Returns within
    /// `shutdown_timeout` plus [`CLOSE_AFTER_GRACE`] whatever the disk does: what is
    /// still running by then is left behind, with a warning.
    pub async fn shutdown(self) {
        let Running {
            app, stop, tasks, ..
        } = self;
        let deadline =
            tokio::time::Instant::now() + app.config.server.shutdown_timeout + CLOSE_AFTER_GRACE;
        let _ = stop.send(true);
        // The listeners end what is left of their requests once the grace is over, and
        // housekeeping stops at once; the deadline is for what does not.
        let mut left = Vec::new();
        for (what, task) in tasks {
            if tokio::time::timeout_at(deadline, task).await.is_err() {
                left.push(what);
            }
        }
        if !left.is_empty() {
            tracing::warn!(tasks = ?left, "shutdown: still running at the time limit; left behind");
        }
        // The requests have ended: their access-log lines are written before the process is.
        app.proxy.access_log().flush(Duration::from_secs(5)).await;
        // A close waits for every commit queued before it, and so for the disk. Left
        // behind, the commit under way may or may not land; each one committed before is
        // on disk, and the next start opens the file as after a crash.
        if tokio::time::timeout_at(deadline, app.store.close())
            .await
            .is_err()
        {
            tracing::warn!(
                "shutdown: the mark store did not close in time (a commit is waiting for the disk); left behind"
            );
            return;
        }
        // The store's last handle writes the file's clean-shutdown header, and syncs, as it
        // drops: on a thread of its own, so that a hung disk cannot hold shutdown there.
        let (dropped, done) = tokio::sync::oneshot::channel();
        let closing = std::thread::Builder::new()
            .name("fencegate-close".into())
            .spawn(move || {
                drop(app);
                let _ = dropped.send(());
            });
        match closing {
            Ok(_) => {
                if tokio::time::timeout_at(deadline, done).await.is_err() {
                    tracing::warn!(
                        "shutdown: the store file's last sync did not finish in time (the disk is not answering); left behind"
                    );
                }
            }
            // The closure, and the handles in it, were dropped here.
            Err(e) => {
                tracing::warn!(error = %e, "cannot start a thread to close the store; closed it here")
            }
        }
    }
}

/// Opens the store (unless one is given), binds both listeners and starts serving.
pub async fn start(config: Config, store: Option<MarkStore>) -> Result<Running, StartError> {
    // Read before anything is opened or bound, so bad files fail the start cleanly.
    let load = |files: Option<&crate::tls::ListenerFiles>| -> Result<_, StartError> {
        Ok(match files {
            Some(files) => Some(Arc::new(crate::tls::Listener::load(
                files.clone(),
                // A handshake is part of getting a request in: the same slowloris bound.
                config.server.header_read_timeout,
            )?)),
            None => None,
        })
    };
    let tls = load(config.server.tls.as_ref())?;
    let admin_tls = load(config.admin.tls.as_ref())?;
    let authority_tls = load(config.authority.as_ref().and_then(|a| a.tls.as_ref()))?;
    let all_tls: Vec<_> = [&tls, &admin_tls, &authority_tls]
        .into_iter()
        .flatten()
        .cloned()
        .collect();
    let metrics = Arc::new(Metrics::new(config.routes.iter().map(|r| r.name.clone())));
    let store = match store {
        Some(s) => s,
        None => MarkStore::open(&config.store.path)?,
    };
    let config = Arc::new(config);
    let gates = Arc::new(
        Gates::new(
            store.clone(),
            metrics.clone(),
            config.fencing.drain_timeout,
            config.fencing.settle,
        )
        .with_limits(
            config.fencing.max_inflight_per_scope,
            config.fencing.max_waiters_per_scope,
        ),
    );
    let bind = |addr: SocketAddr| async move {
        TcpListener::bind(addr)
            .await
            .map_err(|source| StartError::Bind { addr, source })
    };
    let proxy_listener = bind(config.server.listen).await?;
    let admin_listener = bind(config.admin.listen).await?;
    let proxy_addr = proxy_listener
        .local_addr()
        .map_err(|source| StartError::Bind {
            addr: config.server.listen,
            source,
        })?;
    let admin_addr = admin_listener
        .local_addr()
        .map_err(|source| StartError::Bind {
            addr: config.admin.listen,
            source,
        })?;
    let access_log = crate::access_log::AccessLog::open(&config.log.access).map_err(|source| {
        StartError::AccessLog {
            path: match &config.log.access {
                crate::access_log::Sink::File(p) => p.display().to_string(),
                _ => "stdout".into(),
            },
            source,
        }
    })?;
    let app = Arc::new(App {
        proxy: Proxy::new(config.clone(), gates.clone(), metrics.clone())
            .with_access_log(access_log),
        config: config.clone(),
        store,
        gates: gates.clone(),
        metrics,
        backups: Arc::new(tokio::sync::Semaphore::new(crate::admin::MAX_BACKUPS)),
    });
    let (stop, stop_rx) = watch::channel(false);
    let grace = config.server.shutdown_timeout;
    // Each second, the count of refusal warnings the last second left out (if any).
    let warnings = Arc::downgrade(&app);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match warnings.upgrade() {
                Some(app) => app.proxy.refusal_warnings().flush(),
                None => return,
            }
        }
    });

    let https = tls.is_some();
    let proxy_app = app.clone();
    let limits = ConnLimits::new(
        config.server.max_connections,
        config.server.max_connections_per_ip,
        Some(config.server.send_timeout),
    );
    let proxy_tasks = spawn_workers(
        proxy_listener,
        config.server.workers,
        &stop_rx,
        grace,
        &config.server,
        limits,
        tls.clone(),
        app.metrics.clone(),
        move |req, peer| {
            let app = proxy_app.clone();
            async move { app.proxy.handle(req, peer, https).await }
        },
    )
    .map_err(|source| StartError::Bind {
        addr: proxy_addr,
        source,
    })?;
    let admin_app = app.clone();
    let admin_task = spawn_listener(
        admin_listener,
        &config.server,
        admin_tls,
        stop_rx.clone(),
        move |req, _peer| {
            let app = admin_app.clone();
            closing_if_unread(req, move |req| async move {
                crate::admin::handle(&app, req).await
            })
        },
    );
    let mut tasks: Vec<_> = proxy_tasks
        .into_iter()
        .map(|t| ("proxy listener", t))
        .collect();
    let mut authority_addr = None;
    if let Some(auth) = &config.authority {
        let (addr, task) = crate::authority::serve(
            auth,
            &config.server,
            &app.store,
            authority_tls,
            stop_rx.clone(),
            app.metrics.authority.clone(),
        )
        .await?;
        authority_addr = Some(addr);
        tasks.push(("lease authority", task));
    }
    let mut sweep_stop = stop_rx;
    let housekeeping = app.clone();
    let sweeper = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        let mut collect = tokio::time::interval(crate::idempotency::COLLECT_EVERY);
        loop {
            tokio::select! {
                _ = tick.tick() => gates.sweep(),
                _ = collect.tick() => {
                    // A collection waits for its commits: one stuck at a hung disk must
                    // not hold shutdown up. (A batch already queued commits, or not, by
                    // itself; the next start collects what is left.)
                    let n = tokio::select! {
                        n = housekeeping.proxy.idempotency().collect() => n,
                        _ = sweep_stop.changed() => return,
                    };
                    if n > 0 {
                        tracing::debug!(records = n, "expired idempotency records collected");
                    }
                }
                _ = sweep_stop.changed() => return,
            }
        }
    });
    tracing::info!(%proxy_addr, %admin_addr, "fencegate listening");
    tasks.extend([("admin listener", admin_task), ("housekeeping", sweeper)]);
    Ok(Running {
        proxy_addr,
        admin_addr,
        authority_addr,
        app,
        tls: all_tls,
        stop,
        tasks,
    })
}

/// Serves one listener other than the proxy's (admin, authority) with the same code and
/// bounds as the proxy's workers: `[server]`'s connection limits (a set of its own, so
/// one port's clients cannot take another's slots), first-bytes, head and send timeouts,
/// HTTP/2 idle and closing bounds, and graceful drain within `server.shutdown_timeout`.
/// Its connections run on the calling runtime; those left at the end of the grace are
/// ended before the answer's task completes, so nothing of theirs outlives it.
pub(crate) fn spawn_listener<F, Fut>(
    listener: TcpListener,
    server: &ServerConfig,
    tls: Option<Arc<crate::tls::Listener>>,
    stop: watch::Receiver<bool>,
    handler: F,
) -> JoinHandle<()>
where
    F: Fn(hyper::Request<Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = hyper::Response<Body>> + Send + 'static,
{
    tokio::spawn(serve(
        Source::Listener(listener),
        Some(ConnLimits::new(
            server.max_connections,
            server.max_connections_per_ip,
            Some(server.send_timeout),
        )),
        stop,
        server.shutdown_timeout,
        ConnTimeouts {
            first_bytes: server.header_read_timeout,
            send: server.send_timeout,
            max_head: server.max_header_bytes,
            counts: None,
        },
        http_builder(server),
        tls,
        handler,
    ))
}

/// The answer to an HTTP/1 request whose head has a flaw hyper hides (see
/// [`crate::h1_scan`]): 400, and the connection closes after it (what follows the head
/// is not read as this request's body, nor as another request). Nothing is forwarded.
fn refuse_flaw(
    flaw: Flaw,
    method: &http::Method,
    counts: Option<&Metrics>,
) -> hyper::Response<Body> {
    let outcome = match flaw {
        Flaw::Fragment => crate::proxy::Outcome::InvalidPath {
            detail: "the request target has a #fragment (a client sends none; it would be cut off before routing)".into(),
        },
        Flaw::LengthAndEncoding => crate::proxy::Outcome::InvalidRequest {
            detail: "both Content-Length and Transfer-Encoding".into(),
        },
        Flaw::Unfollowed => crate::proxy::Outcome::InvalidRequest {
            detail: "the framing of an earlier request on this connection could not be followed (a length, a chunk or a head beyond what is checked); open a new connection".into(),
        },
    };
    if let Some(metrics) = counts {
        metrics.count_unrouted(crate::metrics::Op::of(method), outcome.result());
    }
    let mut resp = outcome.into_response();
    resp.headers_mut().insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
    resp
}

/// Runs `handler`, and marks its answer `Connection: close` when it is a refusal (4xx or
/// 5xx) of an HTTP/1 request whose body had not ended when it came: the handler may have
/// answered without reading it, and hyper then closes the connection after the answer; a
/// keep-alive client told so does not send its next request into that close.
pub(crate) fn closing_if_unread<H, Fut>(
    req: hyper::Request<Incoming>,
    handler: H,
) -> impl Future<Output = hyper::Response<Body>> + Send
where
    H: FnOnce(hyper::Request<Incoming>) -> Fut + Send,
    Fut: Future<Output = hyper::Response<Body>> + Send,
{
    use hyper::body::Body as _;
    let unread = req.version() < http::Version::HTTP_2 && !req.body().is_end_stream();
    async move {
        let mut resp = handler(req).await;
        if unread && (resp.status().is_client_error() || resp.status().is_server_error()) {
            resp.headers_mut().insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
        }
        resp
    }
}

/// Connection admission: a total bound and a per-client-IP bound, so one client cannot
/// take every socket.
///
/// Out of slots, a listener makes room as nginx does with its "reusable" connections: it
/// closes a connection that has nothing in hand (an HTTP/2 one with no open stream, else
/// an HTTP/1 one with no request in its handler) and gives its slot to the new one. Idle
/// connections are cheap to reopen and are what a client can hold the most of for the
/// least; busy ones are bounded by the request timeouts. The per-client bound is not
/// made room for: a client past it is refused, which costs only that client.
pub struct ConnLimits {
    total: Arc<Semaphore>,
    per_ip: Mutex<HashMap<IpAddr, usize>>,
    max_per_ip: usize,
    /// The admitted connections' states (by slot; free slots listed), made at admission
    /// so that one on its way to a worker can already make room.
    conns: Mutex<Listed>,
    /// For the connections' [`Streams`].
    send_timeout: Option<Duration>,
}

/// The admitted connections' states, by slot, and the free slots.
#[derive(Default)]
struct Listed {
    list: Vec<Option<Arc<Streams>>>,
    free: Vec<usize>,
}

/// How long a new connection waits, at accept, for the slot of one asked to make room
/// (which closes at its next poll).
const RECLAIM_WAIT: Duration = Duration::from_millis(500);

/// Why [`ConnLimits::admit`] refused.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Full {
    Total,
    PerClient,
}

/// Held by a connection's task; gives its slots back when the connection ends.
pub(crate) struct ConnSlot {
    _permit: OwnedSemaphorePermit,
    limits: Arc<ConnLimits>,
    ip: IpAddr,
    /// The connection's state, and where it is listed in `limits.conns`.
    streams: Arc<Streams>,
    listed: usize,
}

impl ConnSlot {
    /// The connection's state, which it keeps up to date.
    pub(crate) fn streams(&self) -> &Arc<Streams> {
        &self.streams
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        {
            let mut conns = self.limits.conns.lock().unwrap_or_else(|p| p.into_inner());
            conns.list[self.listed] = None;
            conns.free.push(self.listed);
        }
        let mut map = self.limits.per_ip.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
    }
}

impl ConnLimits {
    /// `send_timeout`: the bound of the connections' HTTP/2 streams (see [`Streams`]).
    pub fn new(total: usize, per_ip: usize, send_timeout: Option<Duration>) -> Arc<ConnLimits> {
        Arc::new(ConnLimits {
            total: Arc::new(Semaphore::new(total)),
            per_ip: Mutex::new(HashMap::new()),
            max_per_ip: per_ip,
            conns: Mutex::default(),
            send_timeout,
        })
    }

    pub(crate) fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<ConnSlot, Full> {
        let permit = self
            .total
            .clone()
            .try_acquire_owned()
            .map_err(|_| Full::Total)?;
        self.admit_with(permit, ip)
    }

    fn admit_with(
        self: &Arc<Self>,
        permit: OwnedSemaphorePermit,
        ip: IpAddr,
    ) -> Result<ConnSlot, Full> {
        let ip = client_of(ip);
        let mut map = self.per_ip.lock().unwrap_or_else(|p| p.into_inner());
        let n = map.entry(ip).or_insert(0);
        if *n >= self.max_per_ip {
            return Err(Full::PerClient);
        }
        *n += 1;
        drop(map);
        let streams = Streams::new(self.send_timeout);
        let listed = {
            let mut conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
            let Listed { list, free } = &mut *conns;
            match free.pop() {
                Some(i) => {
                    list[i] = Some(streams.clone());
                    i
                }
                None => {
                    list.push(Some(streams.clone()));
                    list.len() - 1
                }
            }
        };
        Ok(ConnSlot {
            _permit: permit,
            limits: self.clone(),
            ip,
            streams,
            listed,
        })
    }

    /// [`ConnLimits::admit`], and when every slot is taken, the slot of a connection with
    /// nothing in hand, asked to close for it (waiting at most [`RECLAIM_WAIT`]).
    pub(crate) async fn admit_or_reclaim(self: &Arc<Self>, ip: IpAddr) -> Result<ConnSlot, Full> {
        match self.admit(ip) {
            Err(Full::Total) => {}
            other => return other,
        }
        if !self.reclaim_one() {
            return Err(Full::Total);
        }
        match tokio::time::timeout(RECLAIM_WAIT, self.total.clone().acquire_owned()).await {
            Ok(Ok(permit)) => self.admit_with(permit, ip),
            _ => Err(Full::Total),
        }
    }

    /// Asks one connection with nothing in hand to close: an idle HTTP/2 one first (it
    /// closes at once), else an HTTP/1 one between requests. Answers whether there was one.
    fn reclaim_one(&self) -> bool {
        let conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        let pick = [true, false].into_iter().find_map(|h2| {
            conns
                .list
                .iter()
                .flatten()
                .find(|s| s.evictable(h2))
                .cloned()
        });
        drop(conns);
        match pick {
            Some(streams) => {
                streams.evict();
                true
            }
            None => false,
        }
    }
}

/// The client an address counts for in `max_connections_per_ip`: one IPv4 address, or one
/// IPv6 /64 (a host is handed a whole /64 and may use any address in it); an IPv4-mapped
/// IPv6 address is its IPv4 one.
fn client_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6(std::net::Ipv6Addr::from(
            u128::from(v6) & !((1u128 << 64) - 1),
        )),
        v4 => v4,
    }
}

/// hyper's HTTP/1 header-count limit when none is set.
const HYPER_MAX_HEADERS: usize = 100;

/// Bytes an HTTP/2 stream may queue for sending: 256 streams of it is 16 MiB at most.
const H2_SEND_BUFFER: usize = 64 << 10;

/// The time limits of a connection in [`serve`]: for its first bytes (which tell its
/// protocol) and for any write to the client to make progress.
#[derive(Clone)]
struct ConnTimeouts {
    first_bytes: Duration,
    send: Duration,
    /// `server.max_header_bytes`, for [`Scan`].
    max_head: usize,
    /// Where the refusals made here (not by the handler) are counted: the proxy's metrics.
    counts: Option<Arc<Metrics>>,
}

/// HTTP/1.1 and h2 on one port, with the request-head limits of `[server]`.
fn http_builder(server: &ServerConfig) -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    let mut h1 = b.http1();
    h1
        // Per-worker coarse deadlines instead of a tokio timer entry per request.
        .timer(crate::timer::CoarseTimer)
        // Slowloris: a request head must arrive within this time (also bounds idle
        // keep-alive connections waiting for their next request).
        .header_read_timeout(server.header_read_timeout)
        .max_buf_size(server.max_header_bytes)
        // One buffer, one write(2) per response head and its first body bytes, instead of
        // a writev(2) over hyper's queue of buffers (measured: less CPU per request on
        // small answers; a body chunk is copied, and the buffer stays bounded by
        // max_buf_size plus one chunk).
        .writev(false);
    // hyper's own limit is 100 and keeps its header slots inline; an explicit limit makes
    // it allocate and fill them for every request head.
    if server.max_headers != HYPER_MAX_HEADERS {
        h1.max_headers(server.max_headers);
    }
    b.http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(server.max_header_bytes).unwrap_or(u32::MAX))
        .max_concurrent_streams(256)
        // Rapid reset (CVE-2023-44487): bound streams reset before they are served.
        .max_pending_accept_reset_streams(Some(64))
        .max_local_error_reset_streams(Some(256))
        .keep_alive_interval(Some(Duration::from_secs(20)))
        .keep_alive_timeout(Duration::from_secs(20))
        // What a stream may queue beyond the client's flow-control window (hyper's
        // default, 400 KiB, times 256 streams would let one connection pin ~100 MiB).
        .max_send_buf_size(H2_SEND_BUFFER);
    b
}

/// A connection on its way to be served, with its admission slot and, when handed to a
/// worker, that worker's count of open connections.
struct Accepted {
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    /// Held by the connection's task while it lives.
    slot: (Option<ConnSlot>, Option<OpenCount>),
}

/// A connection accepted by the acceptor, on its way to a worker.
struct Handed {
    stream: std::net::TcpStream,
    peer: SocketAddr,
    slot: Option<ConnSlot>,
    open: OpenCount,
}

/// Counts a connection as open on its worker while it lives.
struct OpenCount(Arc<AtomicUsize>);

impl Drop for OpenCount {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Where a serve loop gets its connections.
enum Source {
    /// Accepts them itself (admin listener).
    Listener(TcpListener),
    /// Gets them from the acceptor (proxy workers); the count is held by the connection.
    Handed(tokio::sync::mpsc::UnboundedReceiver<Handed>),
}

impl Source {
    /// The next connection, `None` once the source is closed.
    async fn next(&mut self, limits: Option<&Arc<ConnLimits>>) -> Option<Accepted> {
        match self {
            Source::Listener(listener) => loop {
                let (stream, peer) = accept(listener).await;
                let slot = match limits {
                    Some(l) => match l.admit_or_reclaim(peer.ip()).await {
                        Ok(slot) => Some(slot),
                        Err(full) => {
                            tracing::debug!(%peer, ?full, "connection limit reached; closing");
                            continue;
                        }
                    },
                    None => None,
                };
                let _ = stream.set_nodelay(true);
                return Some(Accepted {
                    stream,
                    peer,
                    slot: (slot, None),
                });
            },
            Source::Handed(rx) => loop {
                let handed = rx.recv().await?;
                // Registered with this worker's runtime from here on.
                match tokio::net::TcpStream::from_std(handed.stream) {
                    Ok(stream) => {
                        return Some(Accepted {
                            stream,
                            peer: handed.peer,
                            slot: (handed.slot, Some(handed.open)),
                        });
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot take over a connection"),
                }
            },
        }
    }
}

async fn accept(listener: &TcpListener) -> (tokio::net::TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(a) => return a,
            Err(e) => {
                // EMFILE and friends: back off briefly instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The proxy listener: one acceptor task, and workers — each an OS thread with a
/// single-threaded runtime that runs its connections start to end (parsing, fencing, the
/// upstream exchange, the response) without handing a request between threads. The
/// acceptor admits each connection and gives it to the worker with the fewest open, so
/// connections spread evenly. Answers the acceptor's handle and one per worker, which
/// completes when the worker has drained and stopped.
#[allow(clippy::too_many_arguments)]
fn spawn_workers<F, Fut>(
    listener: TcpListener,
    workers: usize,
    stop: &watch::Receiver<bool>,
    grace: Duration,
    server: &ServerConfig,
    limits: Arc<ConnLimits>,
    tls: Option<Arc<crate::tls::Listener>>,
    counts: Arc<Metrics>,
    handler: F,
) -> std::io::Result<Vec<JoinHandle<()>>>
where
    F: Fn(hyper::Request<Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = hyper::Response<Body>> + Send + 'static,
{
    let mut handles = Vec::with_capacity(workers + 1);
    let mut lanes = Vec::with_capacity(workers);
    for i in 0..workers {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let open = Arc::new(AtomicUsize::new(0));
        lanes.push((tx, open));
        let (stop, builder, tls, handler) = (
            stop.clone(),
            http_builder(server),
            tls.clone(),
            handler.clone(),
        );
        let timeouts = ConnTimeouts {
            first_bytes: server.header_read_timeout,
            send: server.send_timeout,
            max_head: server.max_header_bytes,
            counts: Some(counts.clone()),
        };
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(format!("fencegate-worker-{i}"))
            .spawn(move || {
                // This worker's request deadlines (the head, upstream and upstream body
                // read timeouts).
                runtime.spawn(crate::timer::drive());
                // Idle upstream connections close on time even when no request comes.
                runtime.spawn(async {
                    let mut tick = tokio::time::interval(crate::proxy::upstream::SWEEP_EVERY);
                    loop {
                        tick.tick().await;
                        crate::proxy::forward::sweep_idle();
                    }
                });
                runtime.block_on(serve(
                    Source::Handed(rx),
                    // Admitted by the acceptor, which holds the slots.
                    None,
                    stop,
                    grace,
                    timeouts,
                    builder,
                    tls,
                    handler,
                ));
                let _ = done_tx.send(());
            })?;
        handles.push(tokio::spawn(async move {
            let _ = done_rx.await;
        }));
    }
    let mut stop = stop.clone();
    handles.push(tokio::spawn(async move {
        let mut source = Source::Listener(listener);
        let mut next_lane = 0;
        loop {
            let accepted = tokio::select! {
                a = source.next(Some(&limits)) => a,
                _ = stop.changed() => break,
            };
            let Some(Accepted {
                stream,
                peer,
                slot: (slot, _),
            }) = accepted
            else {
                break;
            };
            let Ok(stream) = stream.into_std() else {
                continue;
            };
            // Fewest open connections wins; ties go round in turn.
            let n = lanes.len();
            let Some(lane) = (0..n)
                .map(|k| (next_lane + k) % n)
                .filter(|&k| !lanes[k].0.is_closed())
                .min_by_key(|&k| lanes[k].1.load(Ordering::Relaxed))
            else {
                break;
            };
            next_lane = (lane + 1) % n;
            let (tx, open) = &lanes[lane];
            open.fetch_add(1, Ordering::Relaxed);
            let handed = Handed {
                stream,
                peer,
                slot,
                open: OpenCount(open.clone()),
            };
            if tx.send(handed).is_err() {
                tracing::warn!(worker = lane, "worker gone; connection dropped");
            }
        }
        // Dropping the lanes closes the workers' sources: they drain and stop.
    }));
    Ok(handles)
}

/// The accept loop of one listener. On stop: close the listener, ask every connection to
/// finish its in-flight requests, and wait at most `grace` for them (on a proxy worker,
/// for its detached tasks too). A connection whose
/// first bytes do not tell its protocol within `first_bytes` (after the TLS handshake, if
/// any) is closed.
#[allow(clippy::too_many_arguments)]
async fn serve<F, Fut>(
    mut source: Source,
    limits: Option<Arc<ConnLimits>>,
    mut stop: watch::Receiver<bool>,
    grace: Duration,
    timeouts: ConnTimeouts,
    builder: auto::Builder<TokioExecutor>,
    tls: Option<Arc<crate::tls::Listener>>,
    handler: F,
) where
    F: Fn(hyper::Request<Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = hyper::Response<Body>> + Send + 'static,
{
    let graceful = crate::drain::Drain::new();
    if matches!(source, Source::Handed(_)) {
        // A proxy worker: its requests may hand work off to tasks of their own (an
        // idempotent exchange goes on after its client has gone, to record the answer for
        // the retry). The worker's runtime is dropped, and those tasks with it, once this
        // returns, so the drain waits for them as for connections.
        graceful.count_detached_tasks_of_this_thread();
    }
    // Shared with TLS connections' tasks, which build their connection after the handshake.
    let builder = Arc::new(builder);
    // The connections' tasks, so that those left when the grace is over end before this
    // returns (a proxy worker's would end with its runtime; the admin's and authority's
    // run on the main one, and hold the store).
    let mut connections = tokio::task::JoinSet::new();
    loop {
        // Reaps what has ended, so the set holds only live connections.
        while connections.try_join_next().is_some() {}
        let next = tokio::select! {
            next = source.next(limits.as_ref()) => next,
            _ = stop.changed() => break,
        };
        let Some(Accepted { stream, peer, slot }) = next else {
            break;
        };
        let handler = handler.clone();
        // HTTP/2 requests are counted open until their response body is done, for the
        // connection's idle deadline (`h2_idle`); HTTP/1 is bounded by hyper's head timeout,
        // and its requests are counted while in their handler (a connection between them
        // may be asked to make room for a new one).
        let streams = match &slot.0 {
            Some(slot) => slot.streams().clone(),
            None => Streams::new(Some(timeouts.send)),
        };
        let (first_bytes, send, max_head) =
            (timeouts.first_bytes, timeouts.send, timeouts.max_head);
        let counts = timeouts.counts.clone();
        let counted = streams.clone();
        let svc = service_fn(move |req: hyper::Request<Incoming>| {
            let handler = handler.clone();
            let (open, in_handler, flaw) = if req.version() == http::Version::HTTP_2 {
                (Some(counted.open()), None, None)
            } else {
                (
                    None,
                    Some(counted.in_handler()),
                    counted.next_request_flaw(),
                )
            };
            let refused = flaw.map(|flaw| refuse_flaw(flaw, req.method(), counts.as_deref()));
            async move {
                let resp = match refused {
                    None => handler(req, peer).await,
                    Some(refused) => refused,
                };
                drop(in_handler);
                Ok::<_, Infallible>(match open {
                    None => resp,
                    Some(open) => resp.map(|inner| OpenBody::new(inner, open).boxed()),
                })
            }
        });
        if let Some(tls) = &tls {
            // The handshake runs in the connection's own task, so a slow client delays only
            // itself, and it is bounded, so it cannot keep its slot either.
            let handshake = tls.accept(stream);
            let watcher = graceful.watcher();
            let builder = Arc::clone(&builder);
            connections.spawn(async move {
                let _slot = slot;
                let stream = match handshake.await {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::debug!(error = %e, %peer, "TLS handshake failed");
                        return;
                    }
                };
                let stream = FirstBytes::new(stream, first_bytes)
                    .send_timeout(send)
                    .telling(streams.clone())
                    .scanning(Scan::new(streams.clone(), max_head));
                let conn = builder
                    .serve_connection(TokioIo::new(stream), svc)
                    .into_owned();
                let conn = IdleConn::new(conn, streams, first_bytes);
                if let Err(e) = watcher.watch(conn).await {
                    tracing::debug!(error = %e, %peer, "connection ended with an error");
                }
            });
            continue;
        }
        let stream = FirstBytes::new(stream, first_bytes)
            .send_timeout(send)
            .telling(streams.clone())
            .scanning(Scan::new(streams.clone(), max_head));
        let conn = builder
            .serve_connection(TokioIo::new(stream), svc)
            .into_owned();
        let conn = graceful.watch(IdleConn::new(conn, streams, first_bytes));
        connections.spawn(async move {
            let _slot = slot;
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, %peer, "connection ended with an error");
            }
        });
    }
    drop(source);
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        let (connections, exchanges) = graceful.remaining();
        tracing::warn!(
            ?grace,
            connections,
            exchanges,
            "shutdown grace period over; closing remaining connections and ending exchanges whose clients have gone"
        );
    }
    connections.shutdown().await;
}

/// SIGHUP: re-read the config file. Routes and upstreams take effect atomically for new
/// requests; an invalid file is refused and the old config kept. Settings bound at start
/// (listeners, store, fencing timings and limits) need a restart; a change to them is
/// logged and ignored. The listener's certificate, key and client CA files are re-read
/// (from the paths in force); a bad file is refused and the running certificate kept.
pub fn reload(running: &Running, path: &std::path::Path) {
    // logrotate renamed the access log: the next line goes to a new file at its path,
    // whether or not the config file reloads.
    running.app.proxy.access_log().reopen();
    let metrics = &running.app.metrics;
    let new = match Config::load(path) {
        Ok(c) => c,
        Err(errors) => {
            metrics.reload_failures.fetch_add(1, Ordering::Relaxed);
            tracing::error!(file = %path.display(), %errors, "config reload refused; keeping the running config");
            return;
        }
    };
    for w in new.warnings() {
        tracing::warn!("{w}");
    }
    let old = running.app.proxy.config();
    let fixed = [
        (
            "server",
            format!("{:?}", old.server) != format!("{:?}", new.server),
        ),
        (
            "admin",
            format!("{:?}", old.admin) != format!("{:?}", new.admin),
        ),
        ("store", old.store.path != new.store.path),
        (
            "idempotency.max_buffered",
            old.idempotency.max_buffered != new.idempotency.max_buffered,
        ),
        (
            "fencing",
            format!("{:?}", old.fencing) != format!("{:?}", new.fencing),
        ),
        (
            "authority",
            format!("{:?}", old.authority) != format!("{:?}", new.authority),
        ),
        ("log", old.log.access != new.log.access),
    ];
    for (section, changed) in fixed {
        if changed {
            tracing::warn!(
                section,
                "changes to this section take effect only after a restart"
            );
        }
    }
    let mut merged = new;
    merged.server = old.server.clone();
    merged.admin = old.admin.clone();
    merged.store = old.store.clone();
    merged.fencing = old.fencing.clone();
    merged.authority = old.authority.clone();
    merged.log = old.log.clone();
    // The listeners' TLS files are re-read from the paths they started with: new
    // handshakes use them, open connections keep what they negotiated.
    for tls in &running.tls {
        match tls.reload() {
            Ok(()) => {
                tracing::info!(listener = tls.files().key_path, cert = %tls.files().cert.display(), "listener certificate reloaded")
            }
            Err(e) => {
                metrics.reload_failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, "certificate reload refused; keeping the running certificate");
            }
        }
    }
    let remapped = remapped_routes(&old.routes, &merged.routes);
    if !remapped.is_empty() {
        tracing::warn!(
            routes = ?remapped,
            "this reload changes how requests map to scopes: marks stay with their scopes, so a request now mapped to another scope is fenced by that scope's mark (none, for a new scope), not by the old one's; tokens issued for the old scopes do not fence the new ones"
        );
    }
    let routes = merged.routes.len();
    running.app.proxy.reload(Arc::new(merged));
    metrics.reloads.fetch_add(1, Ordering::Relaxed);
    tracing::info!(file = %path.display(), routes, "config reloaded");
}

/// The routes (by name) whose share in mapping requests to scopes differs between two
/// tables: their path, host, scope template, fencing or methods, or their place among the
/// others (the first match wins); routes added or removed count too.
fn remapped_routes(old: &[crate::config::Route], new: &[crate::config::Route]) -> Vec<String> {
    let sign = |r: &crate::config::Route| {
        (
            r.name.clone(),
            r.path.to_string(),
            r.host.clone(),
            r.scope.to_string(),
            r.fenced,
            r.methods.clone(),
        )
    };
    let (old, new): (Vec<_>, Vec<_>) = (
        old.iter().map(sign).collect(),
        new.iter().map(sign).collect(),
    );
    let mut names: Vec<String> = old
        .iter()
        .zip(&new)
        .filter(|(a, b)| a != b)
        .flat_map(|(a, b)| [a.0.clone(), b.0.clone()])
        .chain(old.iter().skip(new.len()).map(|a| a.0.clone()))
        .chain(new.iter().skip(old.len()).map(|b| b.0.clone()))
        .collect();
    names.sort();
    names.dedup();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reload_that_maps_requests_to_other_scopes_is_told() {
        let parse = |routes: &str| {
            let text = format!(
                "[store]\npath = \"m.redb\"\n[[upstream]]\nname = \"u\"\nurl = \"http://127.0.0.1:1\"\n{routes}"
            );
            crate::config::Config::parse(&text, std::path::Path::new("."))
                .expect("config")
                .routes
        };
        let a = r#"
[[route]]
name = "a"
path = "/a/{k}"
scope = "a/{k}"
upstream = "u"
[[route]]
name = "b"
path = "/b/{k}"
scope = "b/{k}"
upstream = "u"
"#;
        let base = parse(a);
        assert!(remapped_routes(&base, &parse(a)).is_empty());
        // Another upstream or body limit maps nothing elsewhere.
        let limits = a.replacen(
            "upstream = \"u\"",
            "upstream = \"u\"\nmax_body = \"1KiB\"",
            1,
        );
        assert!(remapped_routes(&base, &parse(&limits)).is_empty());
        let scope = a.replace("scope = \"b/{k}\"", "scope = \"bee/{k}\"");
        assert_eq!(remapped_routes(&base, &parse(&scope)), ["b"]);
        let unfenced = a.replace("scope = \"b/{k}\"", "fenced = false");
        assert_eq!(remapped_routes(&base, &parse(&unfenced)), ["b"]);
        let swapped = format!(
            "{}{}",
            &a[a.find("[[route]]\nname = \"b\"").unwrap()..],
            &a[..a.find("[[route]]\nname = \"b\"").unwrap()]
        );
        assert_eq!(remapped_routes(&base, &parse(&swapped)), ["a", "b"]);
        let fewer = &a[..a.find("[[route]]\nname = \"b\"").unwrap()];
        assert_eq!(remapped_routes(&base, &parse(fewer)), ["b"]);
    }

    #[test]
    fn one_client_is_an_ipv4_address_or_an_ipv6_slash_64() {
        let limits = ConnLimits::new(100, 2, None);
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let a = limits.admit(ip("2001:db8:1:2::1")).expect("first");
        let b = limits.admit(ip("2001:db8:1:2:ffff::9")).expect("second");
        assert!(
            limits.admit(ip("2001:db8:1:2:1:2:3:4")).is_err(),
            "same /64"
        );
        assert!(limits.admit(ip("2001:db8:1:3::1")).is_ok(), "another /64");
        drop(a);
        assert!(limits.admit(ip("2001:db8:1:2::7")).is_ok(), "a slot freed");
        drop(b);
        let v4 = limits.admit(ip("192.0.2.7")).expect("v4");
        let _mapped = limits.admit(ip("::ffff:192.0.2.7")).expect("mapped");
        assert!(
            limits.admit(ip("192.0.2.7")).is_err(),
            "mapped counts as v4"
        );
        assert!(limits.admit(ip("192.0.2.8")).is_ok());
        drop(v4);
    }
}
