//! The lease authority (SPEC §8): grants leases with fencing tokens that the proxy
//! enforces. `local` keeps counters in the `[store]` redb file; `etcd` uses a cluster.
//! Both sit behind [`Engine`], so the HTTP API ([`api`]) is one piece of code.

mod api;
#[cfg(feature = "etcd")]
pub mod etcd;
pub mod local;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::{Config, ConfigError};
use crate::metrics::AuthorityMetrics;
use crate::store::MarkStore;
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
    /// `[[authority.client]]`: with any, every call needs one's bearer secret, and a
    /// lease's holder is the client that took it (SPEC §9).
    pub clients: Vec<Client>,
    /// Signs a proof of every grant (`[authority] signing_key`), read at start-up.
    pub signing_key: Option<std::sync::Arc<crate::proof::SigningKey>>,
    /// `tls = { cert, key, client_ca }`: serve the API over HTTPS, as `server.tls` (read
    /// by `Config::parse`, which knows the config file's directory).
    pub tls: Option<crate::tls::ListenerFiles>,
}

/// One `[[authority.client]]`.
#[derive(Clone)]
pub struct Client {
    pub name: String,
    /// SHA-256 of the secret: the presented secret's digest is compared with it in
    /// constant time, so neither its bytes nor its length leak through timing.
    pub secret_digest: [u8; 32],
    /// Exact scopes, or prefixes ending in `*`.
    pub scopes: Vec<String>,
}

impl std::fmt::Debug for Client {
    // Never the secret's digest: configs are logged and compared through Debug.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("name", &self.name)
            .field("scopes", &self.scopes)
            .finish()
    }
}

impl Client {
    /// May this client take, see, renew or release `scope`?
    pub fn allows(&self, scope: &str) -> bool {
        self.scopes.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => scope.starts_with(prefix),
            None => p == scope,
        })
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClient {
    name: String,
    token_file: String,
    scopes: Vec<String>,
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
    client: Option<Vec<RawClient>>,
    signing_key: Option<String>,
}

impl AuthorityConfig {
    /// Validates the `[authority]` table, pushing every error with its key path.
    /// Files (`token_file`, `signing_key`) are read relative to `base`, the config file's
    /// directory.
    pub fn parse(
        value: toml::Value,
        base: &std::path::Path,
        errors: &mut Vec<ConfigError>,
    ) -> Option<AuthorityConfig> {
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
        let listen: Option<SocketAddr> = listen_raw
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
        let mut clients: Vec<Client> = Vec::new();
        let mut names = std::collections::HashSet::new();
        for (i, c) in raw.client.unwrap_or_default().into_iter().enumerate() {
            let at = |key: &str| format!("authority.client[{i}].{key}");
            if c.name.is_empty() || c.name.len() > 1024 || c.name.chars().any(char::is_control) {
                err(
                    &at("name"),
                    "must be 1 to 1024 characters, none a control".into(),
                );
            } else if !names.insert(c.name.clone()) {
                err(&at("name"), format!("`{}` is defined twice", c.name));
            }
            if c.scopes.is_empty() {
                err(
                    &at("scopes"),
                    "empty: the client could take no scope".into(),
                );
            }
            for (j, p) in c.scopes.iter().enumerate() {
                if p.is_empty() || p.trim_end_matches('*').len() + 1 < p.len() {
                    err(
                        &format!("authority.client[{i}].scopes[{j}]"),
                        format!("`{p}`: an exact scope, or a prefix ending in one `*`"),
                    );
                } else if p[..p.len() - usize::from(p.ends_with('*'))].contains('*') {
                    err(
                        &format!("authority.client[{i}].scopes[{j}]"),
                        format!("`{p}`: `*` only at the end"),
                    );
                }
            }
            let path = base.join(&c.token_file);
            let secret = match std::fs::read_to_string(&path) {
                Ok(t) if !t.trim().is_empty() => Some(t.trim().to_string()),
                Ok(_) => {
                    err(&at("token_file"), format!("{} is empty", path.display()));
                    None
                }
                Err(e) => {
                    err(
                        &at("token_file"),
                        format!("cannot read {}: {e}", path.display()),
                    );
                    None
                }
            };
            if let Some(secret) = secret {
                clients.push(Client {
                    name: c.name,
                    secret_digest: digest(secret.as_bytes()),
                    scopes: c.scopes,
                });
            }
        }
        if let Some(addr) = listen
            && !addr.ip().is_loopback()
            && clients.is_empty()
        {
            err(
                "authority.listen",
                format!(
                    "{addr} is not loopback: add [[authority.client]] entries so that every call needs a bearer secret"
                ),
            );
        }
        let signing_key =
            raw.signing_key
                .and_then(|f| match crate::proof::SigningKey::load(&base.join(f)) {
                    Ok(k) => Some(std::sync::Arc::new(k)),
                    Err(e) => {
                        err("authority.signing_key", e.to_string());
                        None
                    }
                });
        Some(AuthorityConfig {
            clients,
            signing_key,
            listen: listen?,
            backend: backend?,
            max_ttl: max_ttl?,
            lock_delay: lock_delay?,
            tls: None,
        })
    }
}

/// SHA-256 of a bearer secret.
pub fn digest(secret: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(secret).into()
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

    pub async fn status(&self, scope: &str) -> Result<LockStatus, String> {
        match self {
            Engine::Local(l) => l.status(scope),
            #[cfg(feature = "etcd")]
            Engine::Etcd(e) => e.status(scope).await,
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

/// Why the authority could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Its backend could not be opened or reached.
    #[error("{0}")]
    Engine(String),
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
        Backend::Local => local::Local::open(store.database(), config)
            .await
            .map(|l| Engine::Local(l.with_metrics(metrics)))
            .map_err(|e| ServeError::Engine(e.to_string())),
        #[cfg(feature = "etcd")]
        Backend::Etcd { endpoints } => etcd::Etcd::connect(endpoints, config)
            .await
            .map(|e| Engine::Etcd(Box::new(e.with_metrics(metrics))))
            .map_err(|e| ServeError::Engine(e.to_string())),
        #[cfg(not(feature = "etcd"))]
        Backend::Etcd { .. } => Err(ServeError::Engine(
            "backend = \"etcd\" needs a build with `--features etcd`".into(),
        )),
    }
}

/// Binds the authority listener and serves it until `stop` turns true; counts into
/// `metrics` (rendered on the admin listener's `/metrics` from then on).
pub(crate) async fn serve(
    config: &AuthorityConfig,
    server: &crate::config::ServerConfig,
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
