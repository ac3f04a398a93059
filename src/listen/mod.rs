//! Listeners: bind, accept (HTTP/1.1 and h2 on one port, TLS or not), connection limits
//! that make room by closing idle connections, the first-bytes, head and send timeouts,
//! HTTP/2 idle and closing bounds, and graceful drain. Plumbing: it serves any handler and
//! knows nothing of fencing; what it needs of the service comes in [`Hooks`].
//!
//! - [`first_bytes`]: the connection's first bytes (protocol, TLS, their timeout)
//! - [`h1_scan`]: what hyper hides of an HTTP/1 head (fragments, length and encoding)
//! - [`h2_idle`]: HTTP/2 idle and closing bounds, stalled streams
//! - [`conn`]: one connection's state, shared by the three
//! - [`limits`]: connection admission, per client and in total
//! - [`share`]: a client's share of descriptors

pub mod config;
pub(crate) mod conn;
pub(crate) mod first_bytes;
pub(crate) mod h1_scan;
pub(crate) mod h2_idle;
pub(crate) mod limits;
pub(crate) mod share;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::future::Either;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::body::Body;
use config::ServerConfig;
pub(crate) use conn::Flaw;
use conn::Streams;
use first_bytes::FirstBytes;
use h1_scan::Scan;
use h2_idle::{IdleConn, OpenBody};
pub use limits::ConnLimits;
use limits::ConnSlot;
pub(crate) use limits::client_of;

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
    hooks: Hooks,
    handler: F,
) -> JoinHandle<()>
where
    F: Fn(hyper::Request<Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = hyper::Response<Body>> + Send + 'static,
{
    tokio::spawn(serve(
        Source::Listener(listener),
        Some(ConnLimits::for_server(
            server,
            crate::rt::fds::Pool::Services,
        )),
        stop,
        server.shutdown_timeout,
        ConnTimeouts {
            first_bytes: server.header_read_timeout,
            send: server.send_timeout,
            max_head: server.max_header_bytes,
            hooks,
        },
        http_builder(server),
        tls,
        move |req, peer: Peer| handler(req, peer.addr),
    ))
}

/// Who sent a request: its connection's peer and, on a listener with connection limits,
/// its client's count of descriptors (on which work that goes on after the client has
/// gone must count: see [`share::Held::one_more`]).
#[derive(Clone, Debug)]
pub struct Peer {
    pub addr: SocketAddr,
    pub held: Option<Arc<share::Held>>,
}

/// The service's answer to a request head with a flaw (see [`Hooks::refuse`]).
pub(crate) type Refuse = dyn Fn(Flaw, &http::Method) -> hyper::Response<Body> + Send + Sync;
/// A worker thread's housekeeping task (see [`Hooks::per_worker`]).
pub(crate) type Housekeeping = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// What a listener asks of the service behind it, beyond the handler.
#[derive(Clone)]
pub(crate) struct Hooks {
    /// The answer to an HTTP/1 request whose head has a flaw hyper hides (see
    /// [`h1_scan`]): given the flaw and the method, a 400 of the service's own making
    /// (and counted where the service counts); the listener marks it `Connection: close`
    /// and forwards nothing.
    pub refuse: Arc<Refuse>,
    /// Started on each worker's runtime as it starts: per-thread housekeeping of what the
    /// handlers keep per thread (idle upstream connections).
    pub per_worker: Option<fn() -> Housekeeping>,
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
    /// The refusals made here (not by the handler), and per-worker housekeeping.
    hooks: Hooks,
}

/// HTTP/1.1 and h2 on one port, with the request-head limits of `[server]`.
fn http_builder(server: &ServerConfig) -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    let mut h1 = b.http1();
    h1
        // Per-worker coarse deadlines instead of a tokio timer entry per request.
        .timer(crate::rt::timer::CoarseTimer)
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
        // Each stream may hold an upstream connection and its buffers: the bound on both
        // per client connection.
        .max_concurrent_streams(server.max_concurrent_streams)
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

/// Counts a connection as open on its worker while it lives (its descriptor is counted
/// by its [`ConnSlot`]).
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
pub(crate) fn spawn_workers<F, Fut>(
    listener: TcpListener,
    workers: usize,
    stop: &watch::Receiver<bool>,
    grace: Duration,
    server: &ServerConfig,
    limits: Arc<ConnLimits>,
    tls: Option<Arc<crate::tls::Listener>>,
    hooks: Hooks,
    handler: F,
) -> std::io::Result<Vec<JoinHandle<()>>>
where
    F: Fn(hyper::Request<Incoming>, Peer) -> Fut + Clone + Send + Sync + 'static,
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
        let per_worker = hooks.per_worker;
        let timeouts = ConnTimeouts {
            first_bytes: server.header_read_timeout,
            send: server.send_timeout,
            max_head: server.max_header_bytes,
            hooks: hooks.clone(),
        };
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(format!("fencegate-worker-{i}"))
            .spawn(move || {
                // This worker's request deadlines (the head, upstream and upstream body
                // read timeouts).
                runtime.spawn(crate::rt::timer::drive());
                if let Some(housekeeping) = per_worker {
                    runtime.spawn(housekeeping());
                }
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

/// One request of a connection: counted open (an HTTP/2 stream until its answer is
/// dropped, on its client's share too; an HTTP/1 request while in its handler), refused
/// here when its head has a flaw or its client holds its share, else handed to `handler`.
/// The counting is done when hyper calls the service, before the answer is polled; the
/// handler is called then too (for HTTP/2 on the connection's task, and whether or not
/// its future is ever polled), so a handler does nothing but make its future: its work
/// belongs in the future.
fn answer<F, Fut>(
    req: hyper::Request<Incoming>,
    handler: &F,
    peer: SocketAddr,
    counted: &Arc<Streams>,
    held: Option<&Arc<share::Held>>,
    refuse: &Refuse,
) -> impl Future<Output = Result<hyper::Response<Body>, Infallible>> + Send + use<F, Fut>
where
    F: Fn(hyper::Request<Incoming>, Peer) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = hyper::Response<Body>> + Send + 'static,
{
    let (open, in_handler, refused) = if req.version() == http::Version::HTTP_2 {
        // A stream counts on its client's share until its answer is dropped.
        match held.map(|h| h.one_more()).transpose() {
            Err(held) => (
                None,
                None,
                Some(refuse(Flaw::OverShare { held }, req.method())),
            ),
            Ok(unit) => (Some(counted.open(unit)), None, None),
        }
    } else {
        let in_handler = counted.in_handler();
        let refused = counted.next_request_flaw().map(|flaw| {
            let mut resp = refuse(flaw, req.method());
            resp.headers_mut().insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
            resp
        });
        (None, Some(in_handler), refused)
    };
    // The handler's future is made here and polled where it lies (see [`Answered`]).
    let handled = match refused {
        None => {
            let peer = Peer {
                addr: peer,
                held: held.cloned(),
            };
            Either::Left(handler(req, peer))
        }
        Some(refused) => Either::Right(std::future::ready(refused)),
    };
    Answered {
        handled,
        in_handler,
        open,
    }
}

pin_project_lite::pin_project! {
    /// [`answer`]'s future: the handler's answer, counted done as it comes. A future of
    /// its own, not an `async` block: that kept the request it took in beside the
    /// handler's future (and a block that awaits a future it took in holds two of it),
    /// every request's future larger, moved whole by hyper (`benches/callgrind.sh`).
    struct Answered<F> {
        #[pin]
        handled: F,
        in_handler: Option<conn::InHandler>,
        open: Option<conn::StreamOpen>,
    }
}

impl<F: Future<Output = hyper::Response<Body>>> Future for Answered<F> {
    type Output = Result<hyper::Response<Body>, Infallible>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = self.project();
        let resp = std::task::ready!(this.handled.poll(cx));
        drop(this.in_handler.take());
        std::task::Poll::Ready(Ok(match this.open.take() {
            None => resp,
            Some(open) => resp.map(|inner| OpenBody::new(inner, open).boxed()),
        }))
    }
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
    F: Fn(hyper::Request<Incoming>, Peer) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = hyper::Response<Body>> + Send + 'static,
{
    let graceful = crate::rt::drain::Drain::new();
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
        let refuse = timeouts.hooks.refuse.clone();
        let counted = streams.clone();
        let held = slot.0.as_ref().map(|s| s.held().clone());
        let svc = service_fn(move |req: hyper::Request<Incoming>| {
            answer(req, &handler, peer, &counted, held.as_ref(), &*refuse)
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
