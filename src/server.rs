//! Listeners and lifecycle: bind, accept (HTTP/1.1 and h2 on one port), graceful shutdown.
//! `start` binds port 0 in tests and hands back the addresses, so tests talk to a real socket.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::fence::{Gates, MarkStore};
use crate::metrics::Metrics;
use crate::proxy::{Body, Proxy};

/// Everything the listeners share.
pub struct App {
    pub config: Arc<Config>,
    pub store: MarkStore,
    pub gates: Arc<Gates>,
    pub metrics: Arc<Metrics>,
    pub proxy: Proxy,
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
}

/// A started server. Dropping it does not stop it; call [`Running::shutdown`].
pub struct Running {
    pub proxy_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// Where the lease authority listens, when `[authority]` is configured.
    pub authority_addr: Option<SocketAddr>,
    pub app: Arc<App>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Running {
    /// Stops accepting, lets in-flight requests finish (bounded by
    /// `server.shutdown_timeout`), and returns when every connection has closed.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
        self.app.store.close().await;
    }
}

/// Opens the store (unless one is given), binds both listeners and starts serving.
pub async fn start(config: Config, store: Option<MarkStore>) -> Result<Running, StartError> {
    let metrics = Arc::new(Metrics::new(config.routes.iter().map(|r| r.name.clone())));
    let store = match store {
        Some(s) => s,
        None => MarkStore::open(&config.store.path)?,
    };
    let config = Arc::new(config);
    let gates = Arc::new(Gates::new(
        store.clone(),
        metrics.clone(),
        config.fencing.drain_timeout,
        config.fencing.settle,
    ));
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
    let app = Arc::new(App {
        proxy: Proxy::new(config.clone(), gates.clone(), metrics.clone()),
        config: config.clone(),
        store,
        gates: gates.clone(),
        metrics,
    });
    let (stop, stop_rx) = watch::channel(false);
    let grace = config.server.shutdown_timeout;

    let proxy_app = app.clone();
    let proxy_task = tokio::spawn(serve(
        proxy_listener,
        stop_rx.clone(),
        grace,
        move |req, peer| {
            let app = proxy_app.clone();
            async move { app.proxy.handle(req, peer, false).await }
        },
    ));
    let admin_app = app.clone();
    let admin_task = tokio::spawn(serve(
        admin_listener,
        stop_rx.clone(),
        grace,
        move |req, _peer| {
            let app = admin_app.clone();
            async move { crate::admin::handle(&app, req).await }
        },
    ));
    let mut tasks = Vec::new();
    let mut authority_addr = None;
    if let Some(auth) = &config.authority {
        let (addr, task) = crate::authority::serve(auth, &app.store, stop_rx.clone()).await?;
        authority_addr = Some(addr);
        tasks.push(task);
    }
    let mut sweep_stop = stop_rx;
    let sweeper = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        loop {
            tokio::select! {
                _ = tick.tick() => gates.sweep(),
                _ = sweep_stop.changed() => return,
            }
        }
    });
    tracing::info!(%proxy_addr, %admin_addr, "fencegate listening");
    tasks.extend([proxy_task, admin_task, sweeper]);
    Ok(Running {
        proxy_addr,
        admin_addr,
        authority_addr,
        app,
        stop,
        tasks,
    })
}

/// The accept loop of one listener. On stop: close the listener, ask every connection to
/// finish its in-flight requests, and wait at most `grace` for them.
async fn serve<F, Fut>(
    listener: TcpListener,
    mut stop: watch::Receiver<bool>,
    grace: Duration,
    handler: F,
) where
    F: Fn(hyper::Request<Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = hyper::Response<Body>> + Send + 'static,
{
    let graceful = GracefulShutdown::new();
    let builder = auto::Builder::new(TokioExecutor::new());
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and friends: back off briefly instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stop.changed() => break,
        };
        let _ = stream.set_nodelay(true);
        let handler = handler.clone();
        let svc = service_fn(move |req| {
            let handler = handler.clone();
            async move { Ok::<_, Infallible>(handler(req, peer).await) }
        });
        let conn = builder
            .serve_connection(TokioIo::new(stream), svc)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, %peer, "connection ended with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            ?grace,
            "shutdown grace period over; closing remaining connections"
        );
    }
}
