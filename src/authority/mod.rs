//! The lease authority (SPEC §8): grants leases with fencing tokens that the proxy
//! enforces. `local` keeps counters in the `[store]` redb file; `etcd` uses a cluster.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::{Config, ConfigError};
use crate::fence::MarkStore;
use crate::server::StartError;

/// `[authority]`, validated.
#[derive(Debug, Clone)]
pub struct AuthorityConfig {
    pub listen: SocketAddr,
    pub backend: Backend,
    /// Longest lease granted; also how long a restarted authority waits before granting
    /// a scope whose lease may still be live.
    pub max_ttl: Duration,
    /// After an expiry without release, wait this long before granting the scope again.
    pub lock_delay: Duration,
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
            Some(s) => humantime::parse_duration(s)
                .map_err(|e| err(key, format!("`{s}` is not a duration: {e}")))
                .ok(),
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
        })
    }
}

/// Binds the authority listener and serves it until `stop` turns true.
pub async fn serve(
    config: &AuthorityConfig,
    store: &MarkStore,
    stop: watch::Receiver<bool>,
) -> Result<(SocketAddr, JoinHandle<()>), StartError> {
    let _ = (config, store, stop);
    Err(StartError::Authority("not implemented yet".into()))
}

/// `fencegate authority bump-epoch`: every later token compares above every earlier one.
/// Answers the new epoch.
pub fn bump_epoch(config: &Config) -> Result<u64, String> {
    let _ = config;
    Err("not implemented yet".into())
}
