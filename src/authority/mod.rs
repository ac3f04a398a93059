//! The lease authority (SPEC §8): grants leases with fencing tokens that the proxy
//! enforces. `local` keeps counters in the `[store]` redb file; `etcd` uses a cluster.
//! Both sit behind [`Engine`], so the HTTP API ([`api`]) is one piece of code.

mod api;
pub mod config;
#[cfg(feature = "etcd")]
pub mod etcd;
pub mod local;
pub mod metrics;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use config::{AuthorityConfig, Backend, Client, digest};

use crate::settings::Config;
use crate::store::MarkStore;
use crate::token::Token;
pub use metrics::AuthorityMetrics;

/// Longest `wait_ms` an acquire may ask for: a waiting request holds a connection.
pub const MAX_WAIT: Duration = Duration::from_secs(300);

/// One acquisition request, validated.
#[derive(Debug, Clone)]
pub struct AcquireRequest {
    pub scope: String,
    pub holder: String,
    pub ttl: Duration,
    /// How long to wait for a busy scope before answering `busy`.
    pub wait: Duration,
}

/// A granted lease, as the API reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub scope: String,
    pub lease_id: String,
    pub token: Token,
    /// How long the lease lasts from the grant, as the authority judges it.
    pub ttl: Duration,
}

/// Every answer of the lease calls (SPEC §8).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Acquired(Grant),
    /// Someone holds the scope (`holder`), or it may still be held (`holder` unknown:
    /// after a restart, or within `lock_delay` of an expiry).
    Busy {
        holder: Option<String>,
        retry_after: Duration,
    },
    Renewed {
        ttl: Duration,
    },
    Released,
    /// Expired, superseded or unknown: not the current lease. Nothing changed.
    Lost,
    /// The authority could not decide (store or cluster failure). Nothing was granted
    /// that the caller could learn of; retry later.
    Unavailable {
        retry_after: Duration,
        detail: String,
    },
}

/// `GET /v1/locks?scope=S`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockStatus {
    pub scope: String,
    pub holder: Option<String>,
    pub lease_id: Option<String>,
    pub token: Option<Token>,
    pub remaining: Option<Duration>,
    pub last_issued: Option<Token>,
}

/// The backends behind the one HTTP API.
pub enum Engine {
    Local(local::Local),
    #[cfg(feature = "etcd")]
    Etcd(Box<etcd::Etcd>),
}

impl Engine {
    /// Acquires, waiting up to `req.wait` for a busy scope (but not past `stop`).
    pub async fn acquire(&self, req: &AcquireRequest, stop: watch::Receiver<bool>) -> Outcome {
        match self {
            Engine::Local(l) => l.acquire(req, stop).await,
            #[cfg(feature = "etcd")]
            Engine::Etcd(e) => e.acquire(req, stop).await,
        }
    }

    /// Renews the exact (lease_id, token); with `holder`, only if the lease is that
    /// holder's (else `lost`, nothing changed).
    pub async fn renew(
        &self,
        scope: &str,
        lease_id: &str,
        token: Token,
        ttl: Duration,
        holder: Option<&str>,
    ) -> Outcome {
        match self {
            Engine::Local(l) => l.renew(scope, lease_id, token, ttl, holder),
            #[cfg(feature = "etcd")]
            Engine::Etcd(e) => e.renew(scope, lease_id, token, ttl, holder).await,
        }
    }

    /// Releases the exact (lease_id, token); with `holder`, as for [`Engine::renew`].
    pub async fn release(
        &self,
        scope: &str,
        lease_id: &str,
        token: Token,
        holder: Option<&str>,
    ) -> Outcome {
        match self {
            Engine::Local(l) => l.release(scope, lease_id, token, holder),
            #[cfg(feature = "etcd")]
            Engine::Etcd(e) => e.release(scope, lease_id, token, holder).await,
        }
    }

    pub async fn status(&self, scope: &str) -> Result<LockStatus, StatusError> {
        match self {
            Engine::Local(l) => Ok(l.status(scope)?),
            #[cfg(feature = "etcd")]
            Engine::Etcd(e) => Ok(e.status(scope).await?),
        }
    }

    /// Periodic housekeeping (dropping expired leases from memory), and the expiries
    /// that no call has seen yet counted.
    async fn sweep(&self) {
        match self {
            Engine::Local(l) => l.sweep(),
            #[cfg(feature = "etcd")]
            Engine::Etcd(e) => e.sweep().await,
        }
    }
}

/// Why a scope's status could not be read (its text is the 503's detail).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StatusError {
    #[error(transparent)]
    Local(#[from] local::LocalError),
    #[cfg(feature = "etcd")]
    #[error(transparent)]
    Etcd(#[from] etcd_client::Error),
}

/// Why the configured backend could not be opened or reached.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    #[error("the mark store is being reopened")]
    StoreReopening,
    #[error(transparent)]
    Local(#[from] local::LocalError),
    #[cfg(feature = "etcd")]
    #[error(transparent)]
    Etcd(#[from] etcd::EtcdError),
    #[cfg(not(feature = "etcd"))]
    #[error("backend = \"etcd\" needs a build with `--features etcd`")]
    EtcdNotBuilt,
}

/// Why the authority could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Its backend could not be opened or reached.
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Opens the configured backend, counting into `metrics`.
pub async fn engine(
    config: &AuthorityConfig,
    store: &MarkStore,
    metrics: Arc<AuthorityMetrics>,
) -> Result<Engine, ServeError> {
    match &config.backend {
        Backend::Local => {
            local::Local::open(store.database().ok_or(EngineError::StoreReopening)?, config)
                .await
                .map(|l| Engine::Local(l.with_metrics(metrics)))
                .map_err(|e| EngineError::from(e).into())
        }
        #[cfg(feature = "etcd")]
        Backend::Etcd { endpoints } => etcd::Etcd::connect(endpoints, config)
            .await
            .map(|e| Engine::Etcd(Box::new(e.with_metrics(metrics))))
            .map_err(|e| EngineError::from(e).into()),
        #[cfg(not(feature = "etcd"))]
        Backend::Etcd { .. } => Err(EngineError::EtcdNotBuilt.into()),
    }
}

/// Binds the authority listener and serves it until `stop` turns true; counts into
/// `metrics` (rendered on the admin listener's `/metrics` from then on).
pub(crate) async fn serve(
    config: &AuthorityConfig,
    server: &crate::settings::ServerConfig,
    store: &MarkStore,
    tls: Option<std::sync::Arc<crate::tls::Listener>>,
    stop: watch::Receiver<bool>,
    metrics: Arc<AuthorityMetrics>,
    hooks: crate::listen::Hooks,
) -> Result<(SocketAddr, JoinHandle<()>), ServeError> {
    let engine = std::sync::Arc::new(engine(config, store, metrics.clone()).await?);
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| ServeError::Bind {
            addr: config.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| ServeError::Bind {
        addr: config.listen,
        source,
    })?;
    let sweeper = engine.clone();
    let mut sweep_stop = stop.clone();
    let sweeping = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = sweep_stop.changed() => return,
            }
            // A sweep may ask etcd: shutdown does not wait for it.
            tokio::select! {
                _ = sweeper.sweep() => {}
                _ = sweep_stop.changed() => return,
            }
        }
    });
    tracing::info!(%addr, backend = ?config.backend, "lease authority listening");
    metrics.enable();
    let policy = std::sync::Arc::new(api::Policy::of(config, metrics));
    // A request body must arrive within the head's bound once its head has.
    let body_timeout = server.header_read_timeout;
    // Served by the proxy's listener code, with `[server]`'s bounds (connection limits
    // of its own). A waiting acquire watches `stop` and answers at once on it.
    let handler_stop = stop.clone();
    let listening =
        crate::listen::spawn_listener(listener, server, tls, stop, hooks, move |req, _peer| {
            let engine = engine.clone();
            let policy = policy.clone();
            let stop = handler_stop.clone();
            crate::listen::closing_if_unread(req, move |req| async move {
                api::handle(&engine, &policy, body_timeout, req, stop).await
            })
        });
    // One handle for both tasks: when it resolves, nothing of the authority holds the
    // store any more.
    let task = tokio::spawn(async move {
        let _ = listening.await;
        let _ = sweeping.await;
    });
    Ok((addr, task))
}

/// 128 random bits, hex: the part of a lease id that proves holdership (SPEC §8). From
/// the system's randomness; should that fail, from std's randomly keyed hashers of the
/// time and a counter, which are still not guessable from another lease's id.
pub fn lease_secret() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut b = [0u8; 16];
    if ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b).is_err() {
        static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        for (i, half) in b.chunks_mut(8).enumerate() {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(now);
            h.write_u64(n);
            h.write_usize(i);
            half.copy_from_slice(&h.finish().to_le_bytes());
        }
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// `fencegate authority bump-epoch`: every later token compares above every earlier one.
/// Answers the new epoch. With `local`, run it with the server stopped (it opens the
/// store file); with `etcd`, it writes the cluster's epoch key and authorities may run.
pub fn bump_epoch(config: &Config) -> Result<u64, BumpError> {
    match config.authority.as_ref().map(|a| &a.backend) {
        None => Err(BumpError::NoAuthority),
        #[cfg(feature = "etcd")]
        Some(Backend::Etcd { endpoints }) => Ok(tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(BumpError::Runtime)?
            .block_on(etcd::bump_epoch(endpoints))?),
        #[cfg(not(feature = "etcd"))]
        Some(Backend::Etcd { .. }) => Err(BumpError::EtcdNotBuilt),
        Some(Backend::Local) => Ok(local::bump_epoch(&config.store.path)?),
    }
}

/// Why `fencegate authority bump-epoch` could not raise the epoch.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BumpError {
    #[error("the configuration has no [authority] section")]
    NoAuthority,
    #[error("cannot start the runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error(transparent)]
    Local(#[from] local::LocalError),
    #[cfg(feature = "etcd")]
    #[error(transparent)]
    Etcd(#[from] etcd::EtcdError),
    #[cfg(not(feature = "etcd"))]
    #[error("backend = \"etcd\" needs a build with `--features etcd`")]
    EtcdNotBuilt,
}
