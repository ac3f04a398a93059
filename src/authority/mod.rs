//! The lease authority (SPEC §8): grants leases with fencing tokens that the proxy
//! enforces. `local` keeps counters in the `[store]` redb file; `etcd` uses a cluster.
//! Both sit behind [`Engine`], so the HTTP API ([`api`]) is one piece of code.

mod api;
#[cfg(feature = "etcd")]
pub mod etcd;
pub mod local;

use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::{Config, ConfigError};
use crate::fence::MarkStore;
use crate::server::StartError;
use crate::token::Token;

#[derive(Debug, Clone)]
pub struct AuthorityConfig {
    pub listen: SocketAddr,
    pub backend: Backend,
    /// Longest lease granted; also how long a restarted authority waits before granting
    /// a scope whose lease may still be live.
    pub max_ttl: Duration,
    /// After an expiry without release, wait this long before granting the scope again.
    pub lock_delay: Duration,
    /// `tls = { cert, key, client_ca }`: serve the API over HTTPS, as `server.tls` (read
    /// by `Config::parse`, which knows the config file's directory).
    pub tls: Option<crate::tls::ListenerFiles>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    Local,
    Etcd { endpoints: Vec<String> },
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAuthority {
    listen: Option<String>,
    backend: Option<String>,
    etcd_endpoints: Option<Vec<String>>,
    max_ttl: Option<String>,
    lock_delay: Option<String>,
}

impl AuthorityConfig {
    /// Validates the `[authority]` table, pushing every error with its key path.
    pub fn parse(value: toml::Value, errors: &mut Vec<ConfigError>) -> Option<AuthorityConfig> {
        let mut err = |path: &str, message: String| {
            errors.push(ConfigError {
                path: path.to_string(),
                message,
            })
        };
        let raw: RawAuthority = match value.try_into() {
            Ok(r) => r,
            Err(e) => {
                err("authority", e.message().trim().to_string());
                return None;
            }
        };
        let listen_raw = raw.listen.as_deref().unwrap_or("127.0.0.1:7070");
        let listen = listen_raw
            .parse()
            .map_err(|_| {
                err(
                    "authority.listen",
                    format!("`{listen_raw}` is not an IP:port address"),
                )
            })
            .ok();
        let mut duration = |key: &str, raw: Option<&str>, default: Duration| match raw {
            None => Some(default),
            Some(s) => match humantime::parse_duration(s) {
                Ok(d) if d > crate::config::MAX_DURATION => {
                    err(key, format!("`{s}` is longer than the maximum, 366d"));
                    None
                }
                Ok(d) => Some(d),
                Err(e) => {
                    err(key, format!("`{s}` is not a duration: {e}"));
                    None
                }
            },
        };
        let max_ttl = duration(
            "authority.max_ttl",
            raw.max_ttl.as_deref(),
            Duration::from_secs(60),
        );
        let lock_delay = duration(
            "authority.lock_delay",
            raw.lock_delay.as_deref(),
            Duration::ZERO,
        );
        if max_ttl.is_some_and(|t| t.is_zero()) {
            err("authority.max_ttl", "must be greater than zero".into());
        }
        let backend = match (
            raw.backend.as_deref().unwrap_or("local"),
            raw.etcd_endpoints,
        ) {
            ("local", None) => Some(Backend::Local),
            ("local", Some(_)) => {
                err(
                    "authority.etcd_endpoints",
                    "only for backend = \"etcd\"".into(),
                );
                None
            }
            ("etcd", Some(endpoints)) if !endpoints.is_empty() => Some(Backend::Etcd { endpoints }),
            ("etcd", _) => {
                err(
                    "authority.etcd_endpoints",
                    "backend = \"etcd\" needs at least one endpoint".into(),
                );
                None
            }
            (other, _) => {
                err(
                    "authority.backend",
                    format!("`{other}`: expected \"local\" or \"etcd\""),
                );
                None
            }
        };
        Some(AuthorityConfig {
            listen: listen?,
            backend: backend?,
            max_ttl: max_ttl?,
            lock_delay: lock_delay?,
            tls: None,
        })
    }
}

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

    pub async fn renew(&self, scope: &str, lease_id: &str, token: Token, ttl: Duration) -> Outcome {
        match self {
            Engine::Local(l) => l.renew(scope, lease_id, token, ttl),
            #[cfg(feature = "etcd")]
            Engine::Etcd(e) => e.renew(scope, lease_id, token, ttl).await,
        }
    }

    pub async fn release(&self, scope: &str, lease_id: &str, token: Token) -> Outcome {
        match self {
            Engine::Local(l) => l.release(scope, lease_id, token),
            #[cfg(feature = "etcd")]
            Engine::Etcd(e) => e.release(scope, lease_id, token).await,
        }
    }

    pub async fn status(&self, scope: &str) -> Result<LockStatus, String> {
        match self {
            Engine::Local(l) => l.status(scope),
            #[cfg(feature = "etcd")]
            Engine::Etcd(e) => e.status(scope).await,
        }
    }

    /// Periodic housekeeping (dropping expired leases from memory).
    fn sweep(&self) {
        match self {
            Engine::Local(l) => l.sweep(),
            #[cfg(feature = "etcd")]
            Engine::Etcd(_) => {}
        }
    }
}

/// Opens the configured backend.
pub async fn engine(config: &AuthorityConfig, store: &MarkStore) -> Result<Engine, StartError> {
    match &config.backend {
        Backend::Local => local::Local::open(store.database(), config)
            .await
            .map(Engine::Local)
            .map_err(|e| StartError::Authority(e.to_string())),
        #[cfg(feature = "etcd")]
        Backend::Etcd { endpoints } => etcd::Etcd::connect(endpoints, config)
            .await
            .map(|e| Engine::Etcd(Box::new(e)))
            .map_err(|e| StartError::Authority(e.to_string())),
        #[cfg(not(feature = "etcd"))]
        Backend::Etcd { .. } => Err(StartError::Authority(
            "backend = \"etcd\" needs a build with `--features etcd`".into(),
        )),
    }
}

/// Binds the authority listener and serves it until `stop` turns true.
pub async fn serve(
    config: &AuthorityConfig,
    server: &crate::config::ServerConfig,
    store: &MarkStore,
    tls: Option<std::sync::Arc<crate::tls::Listener>>,
    stop: watch::Receiver<bool>,
) -> Result<(SocketAddr, JoinHandle<()>), StartError> {
    let engine = std::sync::Arc::new(engine(config, store).await?);
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| StartError::Bind {
            addr: config.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| StartError::Bind {
        addr: config.listen,
        source,
    })?;
    let sweeper = engine.clone();
    let mut sweep_stop = stop.clone();
    let sweeping = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        loop {
            tokio::select! {
                _ = tick.tick() => sweeper.sweep(),
                _ = sweep_stop.changed() => return,
            }
        }
    });
    tracing::info!(%addr, backend = ?config.backend, "lease authority listening");
    let max_ttl = config.max_ttl;
    // A request body must arrive within the head's bound once its head has.
    let body_timeout = server.header_read_timeout;
    // Served by the proxy's listener code, with `[server]`'s bounds (connection limits
    // of its own). A waiting acquire watches `stop` and answers at once on it.
    let handler_stop = stop.clone();
    let listening =
        crate::server::spawn_listener(listener, server, tls, stop, move |req, _peer| {
            let engine = engine.clone();
            let stop = handler_stop.clone();
            crate::server::closing_if_unread(req, move |req| async move {
                api::handle(&engine, max_ttl, body_timeout, req, stop).await
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

/// `fencegate authority bump-epoch`: every later token compares above every earlier one.
/// Answers the new epoch. With `local`, run it with the server stopped (it opens the
/// store file); with `etcd`, it writes the cluster's epoch key and authorities may run.
pub fn bump_epoch(config: &Config) -> Result<u64, String> {
    match config.authority.as_ref().map(|a| &a.backend) {
        None => Err("the configuration has no [authority] section".into()),
        #[cfg(feature = "etcd")]
        Some(Backend::Etcd { endpoints }) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the runtime: {e}"))?
            .block_on(etcd::bump_epoch(endpoints))
            .map_err(|e| e.to_string()),
        #[cfg(not(feature = "etcd"))]
        Some(Backend::Etcd { .. }) => {
            Err("backend = \"etcd\" needs a build with `--features etcd`".into())
        }
        Some(Backend::Local) => local::bump_epoch(&config.store.path).map_err(|e| e.to_string()),
    }
}
