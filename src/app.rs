//! The wiring: `start` opens the store, builds the fence and the proxy over it, binds the
//! proxy, admin and authority listeners and starts serving; `reload` is SIGHUP's; `Running`
//! shuts it all down in order. Only `main` and `cli` import this module. `start` binds
//! port 0 in tests and hands back the addresses, so tests talk to a real socket.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin::State;
use crate::fence::Gates;
use crate::listen::{ConnLimits, Flaw, Hooks, closing_if_unread, spawn_listener, spawn_workers};
use crate::metrics::Metrics;
use crate::proxy::{Outcome, Proxy};
use crate::settings::Config;
use crate::store::MarkStore;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error("lease authority: {0}")]
    Authority(#[source] crate::authority::EngineError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("TLS: {0}")]
    Tls(#[from] crate::tls::TlsError),
    #[error("cluster: {0}")]
    Cluster(String),
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
    /// Where the other instances of the cluster hand this one requests, with `[cluster]`.
    pub peer_addr: Option<SocketAddr>,
    /// This instance's part in its cluster, with `[cluster]`.
    #[cfg(feature = "etcd")]
    pub cluster: Option<crate::cluster::node::Node>,
    pub app: Arc<State>,
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
        #[cfg(feature = "etcd")]
        let mut cluster = self.cluster;
        let Running {
            app, stop, tasks, ..
        } = self;
        let deadline =
            tokio::time::Instant::now() + app.config.server.shutdown_timeout + CLOSE_AFTER_GRACE;
        // A planned leave first, while every listener still serves: the shards are handed
        // off (drained, released) so their next owners admit at once, without a takeover
        // wait; the hops to them work meanwhile.
        #[cfg(feature = "etcd")]
        if let Some(node) = cluster.as_mut() {
            match tokio::time::timeout(app.config.server.shutdown_timeout, node.leave()).await {
                Ok(Ok(())) => tracing::info!("left the cluster: every shard handed off"),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "leaving the cluster failed; its shards are taken over when the lease expires")
                }
                Err(_) => tracing::warn!(
                    "leaving the cluster took past server.shutdown_timeout; the rest is taken over when the lease expires"
                ),
            }
        }
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

/// Opens the store (unless one is given), binds both listeners and starts serving. The
/// steps, in order: the files read (TLS) before anything is opened or bound, so bad files
/// fail the start cleanly; the store; the cluster joined; the gates; the listeners bound;
/// the state they share; then each listener and the housekeeping spawned.
pub async fn start(config: Config, store: Option<MarkStore>) -> Result<Running, StartError> {
    raise_fd_limit();
    let tls = ListenerTls::load(&config)?;
    let metrics = Arc::new(Metrics::new(config.routes.iter().map(|r| r.name.clone())));
    let store = match store {
        Some(s) => s,
        None => MarkStore::open(&config.store.path)?,
    };
    let config = Arc::new(config);
    #[cfg(feature = "etcd")]
    let joining = connect_cluster(&config).await?;
    #[cfg(not(feature = "etcd"))]
    if config.cluster.is_some() {
        return Err(StartError::Cluster(
            "cluster mode needs a build with `--features etcd`".into(),
        ));
    }
    let gates = Gates::new(
        store.clone(),
        metrics.clone(),
        config.fencing.drain_timeout,
        config.fencing.settle,
    )
    .with_limits(
        config.fencing.max_inflight_per_scope,
        config.fencing.max_waiters_per_scope,
    );
    // In a cluster, the gates decide on the marks of the shards this instance owns, in
    // etcd (SPEC §10).
    #[cfg(feature = "etcd")]
    let gates = match &joining {
        Some(j) => gates.with_source(Arc::new(j.owned().clone())),
        None => gates,
    };
    let gates = Arc::new(gates);
    let peer = bind_peer(&config).await?;
    let peer_addr = peer.as_ref().map(|(_, addr)| *addr);
    #[cfg(feature = "etcd")]
    let cluster = join_cluster(joining, peer_addr, &gates, &config).await?;
    let proxy_listener = bind(config.server.listen).await?;
    let admin_listener = bind(config.admin.listen).await?;
    let proxy_addr = local_addr(&proxy_listener, config.server.listen)?;
    let admin_addr = local_addr(&admin_listener, config.admin.listen)?;
    let access_log = open_access_log(&config)?;
    let proxy = Proxy::new(
        Arc::new(config.proxy_settings()),
        gates.clone(),
        metrics.clone(),
    );
    #[cfg(feature = "etcd")]
    let proxy = match &cluster {
        Some(node) => proxy.with_placement(node.placement()),
        None => proxy,
    };
    let app = Arc::new(State {
        proxy: proxy.with_access_log(access_log),
        config: config.clone(),
        store,
        gates: gates.clone(),
        metrics,
        authority: Arc::default(),
        backups: Arc::new(tokio::sync::Semaphore::new(crate::admin::MAX_BACKUPS)),
        #[cfg(feature = "etcd")]
        cluster: cluster.as_ref().map(|n| n.view()),
        #[cfg(not(feature = "etcd"))]
        cluster: None,
    });
    let (stop, stop_rx) = watch::channel(false);
    spawn_warning_flush(&app);
    let mut tasks = spawn_proxy(
        &app,
        proxy_listener,
        proxy_addr,
        tls.proxy.clone(),
        &stop_rx,
    )?;
    let admin_task = spawn_admin(&app, admin_listener, tls.admin.clone(), &stop_rx);
    if let (Some((listener, _)), Some(c)) = (peer, &config.cluster) {
        tasks.push((
            "peer listener",
            spawn_peer(&app, listener, c.peer_key.clone(), &stop_rx),
        ));
    }
    let mut authority_addr = None;
    if let Some(auth) = &config.authority {
        let (addr, task) = serve_authority(&app, auth, tls.authority.clone(), &stop_rx).await?;
        authority_addr = Some(addr);
        tasks.push(("lease authority", task));
    }
    let sweeper = spawn_housekeeping(app.clone(), gates, stop_rx);
    tracing::info!(%proxy_addr, %admin_addr, "fencegate listening");
    tasks.extend([("admin listener", admin_task), ("housekeeping", sweeper)]);
    Ok(Running {
        proxy_addr,
        admin_addr,
        authority_addr,
        peer_addr,
        #[cfg(feature = "etcd")]
        cluster,
        app,
        tls: tls.all(),
        stop,
        tasks,
    })
}

/// Once per process: the soft open-file limit raised to the hard one, and the budget of
/// connections under it.
fn raise_fd_limit() {
    let fds = crate::rt::fds::raise();
    if fds.was != fds.limit {
        tracing::info!(from = fds.was, to = fds.limit, "open-file limit raised");
    }
    tracing::debug!(
        limit = fds.limit,
        budget = fds.budget,
        "connections' file descriptors"
    );
}

/// The listeners' TLS (`server.tls`, `admin.tls`, `authority.tls`), each when set.
struct ListenerTls {
    proxy: Option<Arc<crate::tls::Listener>>,
    admin: Option<Arc<crate::tls::Listener>>,
    authority: Option<Arc<crate::tls::Listener>>,
}

impl ListenerTls {
    fn load(config: &Config) -> Result<ListenerTls, StartError> {
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
        Ok(ListenerTls {
            proxy: load(config.server.tls.as_ref())?,
            admin: load(config.admin.tls.as_ref())?,
            authority: load(config.authority.as_ref().and_then(|a| a.tls.as_ref()))?,
        })
    }

    /// Those set, for their files to be re-read on reload.
    fn all(&self) -> Vec<Arc<crate::tls::Listener>> {
        [&self.proxy, &self.admin, &self.authority]
            .into_iter()
            .flatten()
            .cloned()
            .collect()
    }
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind { addr, source })
}

/// The address a listener bound to `addr` (port 0 in tests) took.
fn local_addr(listener: &TcpListener, addr: SocketAddr) -> Result<SocketAddr, StartError> {
    listener
        .local_addr()
        .map_err(|source| StartError::Bind { addr, source })
}

/// With `[cluster]`: the listener on which the other instances hand this one requests,
/// and its address.
async fn bind_peer(config: &Config) -> Result<Option<(TcpListener, SocketAddr)>, StartError> {
    let Some(c) = &config.cluster else {
        return Ok(None);
    };
    let listener = bind(c.peer_listen).await?;
    let addr = listener.local_addr().map_err(|source| StartError::Bind {
        addr: listener.local_addr().unwrap_or(config.server.listen),
        source,
    })?;
    Ok(Some((listener, addr)))
}

/// With `[cluster]`: connected to etcd, before the gates that decide on its shards.
#[cfg(feature = "etcd")]
async fn connect_cluster(
    config: &Config,
) -> Result<Option<crate::cluster::node::Joining>, StartError> {
    match &config.cluster {
        Some(c) => Ok(Some(
            crate::cluster::node::Joining::connect(c)
                .await
                .map_err(|e| StartError::Cluster(e.to_string()))?,
        )),
        None => Ok(None),
    }
}

/// With `[cluster]`: this instance joined, its peer listener bound; a shard is busy while
/// a gate of one of its scopes is.
#[cfg(feature = "etcd")]
async fn join_cluster(
    joining: Option<crate::cluster::node::Joining>,
    peer_addr: Option<SocketAddr>,
    gates: &Arc<Gates>,
    config: &Config,
) -> Result<Option<crate::cluster::node::Node>, StartError> {
    let (Some(joining), Some(peer_addr)) = (joining, peer_addr) else {
        return Ok(None);
    };
    let busy: crate::cluster::member::Busy = {
        let (gates, owned) = (gates.clone(), joining.owned().clone());
        Arc::new(move |shard| gates.busy(|scope| owned.shard_of(scope) == shard))
    };
    let longest = config
        .upstreams
        .iter()
        .map(|u| u.timeout)
        .max()
        .unwrap_or_default();
    let node = joining
        .join(
            peer_addr,
            busy,
            longest,
            config.fencing.settle,
            config.fencing.drain_timeout,
        )
        .await
        .map_err(|e| StartError::Cluster(e.to_string()))?;
    Ok(Some(node))
}

fn open_access_log(config: &Config) -> Result<crate::access_log::AccessLog, StartError> {
    crate::access_log::AccessLog::open(&config.log.access).map_err(|source| StartError::AccessLog {
        path: match &config.log.access {
            crate::access_log::Sink::File(p) => p.display().to_string(),
            _ => "stdout".into(),
        },
        source,
    })
}

/// Each second, the count of refusal warnings the last second left out (if any).
fn spawn_warning_flush(app: &Arc<State>) {
    let warnings = Arc::downgrade(app);
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
}

/// The proxy's listener, served by `server.workers` workers.
fn spawn_proxy(
    app: &Arc<State>,
    listener: TcpListener,
    addr: SocketAddr,
    tls: Option<Arc<crate::tls::Listener>>,
    stop: &watch::Receiver<bool>,
) -> Result<Vec<(&'static str, JoinHandle<()>)>, StartError> {
    let config = &app.config;
    let https = tls.is_some();
    let proxy_app = app.clone();
    let limits = ConnLimits::for_server(&config.server, crate::rt::fds::Pool::Proxy);
    let tasks = spawn_workers(
        listener,
        config.server.workers,
        stop,
        config.server.shutdown_timeout,
        &config.server,
        limits,
        tls,
        proxy_hooks(app),
        move |req, peer| {
            let app = proxy_app.clone();
            async move { app.proxy.handle(req, peer, https).await }
        },
    )
    .map_err(|source| StartError::Bind { addr, source })?;
    Ok(tasks.into_iter().map(|t| ("proxy listener", t)).collect())
}

fn spawn_admin(
    app: &Arc<State>,
    listener: TcpListener,
    tls: Option<Arc<crate::tls::Listener>>,
    stop: &watch::Receiver<bool>,
) -> JoinHandle<()> {
    let admin_app = app.clone();
    spawn_listener(
        listener,
        &app.config.server,
        tls,
        stop.clone(),
        service_hooks(),
        move |req, _peer| {
            let app = admin_app.clone();
            closing_if_unread(req, move |req| async move {
                crate::admin::handle(&app, req).await
            })
        },
    )
}

/// The peer listener: requests the other instances hand this one, each proven by the
/// cluster's credential (`Fencegate-Peer`).
fn spawn_peer(
    app: &Arc<State>,
    listener: TcpListener,
    key: crate::cluster::config::PeerKey,
    stop: &watch::Receiver<bool>,
) -> JoinHandle<()> {
    let peer_app = app.clone();
    spawn_listener(
        listener,
        &app.config.server,
        None,
        stop.clone(),
        service_hooks(),
        move |req, peer| {
            let app = peer_app.clone();
            let key = key.clone();
            async move {
                let proven = req
                    .headers()
                    .get(crate::proxy::hop::FENCEGATE_PEER)
                    .is_some_and(|v| key.matches(v.as_bytes()));
                if !proven {
                    return closing_if_unread(req, |_| async { not_a_peer() }).await;
                }
                app.proxy.handle_peer(req, peer).await
            }
        },
    )
}

/// The lease authority's listener, with `[authority]`.
async fn serve_authority(
    app: &Arc<State>,
    auth: &crate::authority::AuthorityConfig,
    tls: Option<Arc<crate::tls::Listener>>,
    stop: &watch::Receiver<bool>,
) -> Result<(SocketAddr, JoinHandle<()>), StartError> {
    crate::authority::serve(
        auth,
        &app.config.server,
        &app.store,
        tls,
        stop.clone(),
        app.authority.clone(),
        service_hooks(),
    )
    .await
    .map_err(|e| match e {
        crate::authority::ServeError::Engine(e) => StartError::Authority(e),
        crate::authority::ServeError::Bind { addr, source } => StartError::Bind { addr, source },
    })
}

/// Housekeeping: the gates swept every 10 s, expired idempotency records collected.
fn spawn_housekeeping(
    app: Arc<State>,
    gates: Arc<Gates>,
    mut stop: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        let mut collect = tokio::time::interval(crate::proxy::idempotency::COLLECT_EVERY);
        loop {
            tokio::select! {
                _ = tick.tick() => gates.sweep(),
                _ = collect.tick() => {
                    // A collection waits for its commits: one stuck at a hung disk must
                    // not hold shutdown up. (A batch already queued commits, or not, by
                    // itself; the next start collects what is left.)
                    let n = tokio::select! {
                        n = app.proxy.idempotency().collect() => n,
                        _ = stop.changed() => return,
                    };
                    if n > 0 {
                        tracing::debug!(records = n, "expired idempotency records collected");
                    }
                }
                _ = stop.changed() => return,
            }
        }
    })
}

/// The peer listener's answer to a request without the cluster's credential.
fn not_a_peer() -> http::Response<crate::proxy::Body> {
    use http_body_util::BodyExt;
    let body = r#"{"type":"about:blank","title":"not a peer","status":403,"detail":"this listener takes requests only from the instances of its cluster (Fencegate-Peer)"}"#;
    let mut resp = http::Response::new(
        http_body_util::Full::new(bytes::Bytes::from_static(body.as_bytes()))
            .map_err(|never| match never {})
            .boxed(),
    );
    *resp.status_mut() = http::StatusCode::FORBIDDEN;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/problem+json"),
    );
    resp
}

/// What the proxy's workers ask of it beyond the handler: its own answer to a head with a
/// flaw hyper hides (through the proxy's one refusal path, counted as unrouted), and
/// per-thread sweeps of idle upstream connections (they close on time even when no
/// request comes).
fn proxy_hooks(app: &Arc<State>) -> Hooks {
    let app = Arc::downgrade(app);
    Hooks {
        refuse: Arc::new(move |flaw, method| match app.upgrade() {
            Some(app) => app.proxy.refuse_unrouted(method, flawed(flaw)),
            None => flawed(flaw).into_response(),
        }),
        per_worker: Some(|| {
            Box::pin(async {
                let mut tick = tokio::time::interval(crate::proxy::upstream::SWEEP_EVERY);
                loop {
                    tick.tick().await;
                    crate::proxy::forward::sweep_idle();
                }
            })
        }),
    }
}

/// The admin and authority listeners': the same answer to a flawed head, counted nowhere.
pub(crate) fn service_hooks() -> Hooks {
    Hooks {
        refuse: Arc::new(|flaw, _method| flawed(flaw).into_response()),
        per_worker: None,
    }
}

/// The refusal of an HTTP/1 request whose head has a flaw hyper hides (see
/// [`crate::listen::h1_scan`]): 400; the listener closes the connection after it (what
/// follows the head is not read as this request's body, nor as another request).
/// Nothing is forwarded.
fn flawed(flaw: Flaw) -> Outcome {
    match flaw {
        Flaw::Fragment => Outcome::InvalidPath {
            detail: "the request target has a #fragment (a client sends none; it would be cut off before routing)".into(),
        },
        Flaw::LengthAndEncoding => Outcome::InvalidRequest {
            detail: "both Content-Length and Transfer-Encoding".into(),
        },
        Flaw::OverShare { held } => Outcome::UpstreamUnavailable {
            scope: None,
            detail: crate::listen::share::over_share(held),
        },
        Flaw::Unfollowed => Outcome::InvalidRequest {
            detail: "the framing of an earlier request on this connection could not be followed (a length, a chunk or a head beyond what is checked); open a new connection".into(),
        },
    }
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
    // The sections bound at start never change on reload: the start config holds them.
    let old = &running.app.config;
    let in_force = running.app.proxy.config();
    let fixed = [
        ("server", old.server != new.server),
        ("admin", old.admin != new.admin),
        ("store", old.store != new.store),
        (
            "idempotency.max_buffered",
            in_force.idempotency.max_buffered != new.idempotency.max_buffered,
        ),
        ("fencing", old.fencing != new.fencing),
        ("authority", old.authority != new.authority),
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
    let remapped = remapped_routes(&in_force.routes, &merged.routes);
    if !remapped.is_empty() {
        tracing::warn!(
            routes = ?remapped,
            "this reload changes how requests map to scopes: marks stay with their scopes, so a request now mapped to another scope is fenced by that scope's mark (none, for a new scope), not by the old one's; tokens issued for the old scopes do not fence the new ones"
        );
    }
    let routes = merged.routes.len();
    running.app.proxy.reload(Arc::new(merged.proxy_settings()));
    metrics.reloads.fetch_add(1, Ordering::Relaxed);
    tracing::info!(file = %path.display(), routes, "config reloaded");
}

/// The routes (by name) whose share in mapping requests to scopes differs between two
/// tables: their path, host, scope template, fencing or methods, or their place among the
/// others (the first match wins); routes added or removed count too.
fn remapped_routes(old: &[crate::settings::Route], new: &[crate::settings::Route]) -> Vec<String> {
    let sign = |r: &crate::settings::Route| {
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
            crate::settings::Config::parse(&text, std::path::Path::new("."))
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
}
