//! `[authority]` and its `[[authority.client]]` entries.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::config::error::{Errors, Place};
use crate::config::value::{MAX_DURATION, read_secret};
use crate::proof::SigningKey;
use crate::tls::{ListenerFiles, RawListenerTls};

#[derive(Debug, Clone, PartialEq, Eq)]
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
    pub signing_key: Option<Arc<SigningKey>>,
    /// `tls = { cert, key, client_ca }`: serve the API over HTTPS, as `server.tls`.
    pub tls: Option<ListenerFiles>,
}

/// One `[[authority.client]]`. Compared by value, secret included (a changed secret is a
/// changed client); never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Client {
    pub name: String,
    /// SHA-256 of the secret: the presented secret's digest is compared with it in
    /// constant time, so neither its bytes nor its length leak through timing.
    pub secret_digest: [u8; 32],
    /// Exact scopes, or prefixes ending in `*`.
    pub scopes: Vec<String>,
}

impl std::fmt::Debug for Client {
    // Never the secret's digest: configs are logged through Debug.
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

/// SHA-256 of a bearer secret.
pub fn digest(secret: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(secret).into()
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    Local,
    Etcd { endpoints: Vec<String> },
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClient {
    name: String,
    token_file: String,
    scopes: Vec<String>,
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

/// One `[[authority.client]]` as parsed: its secret file is named, not read yet.
#[derive(Debug)]
struct ClientDraft {
    name: String,
    scopes: Vec<String>,
    token_file: PathBuf,
    key_path: String,
    token_at: Place,
}

/// `[authority]` as parsed: the clients' secrets, the signing key and the TLS files are
/// named, not read yet. A setting that did not validate is `None`.
#[derive(Debug)]
pub(crate) struct AuthorityDraft {
    listen: Option<SocketAddr>,
    backend: Option<Backend>,
    max_ttl: Option<Duration>,
    lock_delay: Option<Duration>,
    clients: Vec<ClientDraft>,
    /// After the clients: `listen` off loopback needs one that loads.
    open_at: Place,
    signing_key: Option<PathBuf>,
    signing_key_at: Place,
    tls: Option<(ListenerFiles, Place)>,
}

impl AuthorityDraft {
    /// The listener's address, when the section validated far enough to run.
    /// Whether the backend is the local one (the epochs in this instance's store).
    pub(crate) fn is_local(&self) -> bool {
        matches!(self.backend, Some(Backend::Local))
    }

    pub(crate) fn listen(&self) -> Option<SocketAddr> {
        self.listen.filter(|_| {
            self.backend.is_some() && self.max_ttl.is_some() && self.lock_delay.is_some()
        })
    }

    /// Reads the clients' secrets, the signing key and the TLS files.
    pub(crate) fn load(self, errors: &mut Errors) -> Option<AuthorityConfig> {
        let tls = self
            .tls
            .and_then(|(files, at)| crate::tls::check_listener_files(files, at, errors));
        let clients: Vec<Client> = self
            .clients
            .into_iter()
            .filter_map(|c| {
                let secret = read_secret(&c.token_file, &c.key_path, c.token_at, errors)?;
                Some(Client {
                    name: c.name,
                    secret_digest: digest(secret.as_bytes()),
                    scopes: c.scopes,
                })
            })
            .collect();
        if let Some(addr) = self.listen
            && !addr.ip().is_loopback()
            && clients.is_empty()
        {
            errors.push_at(
                self.open_at,
                "authority.listen",
                format!(
                    "{addr} is not loopback: add [[authority.client]] entries so that every call needs a bearer secret"
                ),
            );
        }
        let signing_key = self.signing_key.and_then(|f| match SigningKey::load(&f) {
            Ok(k) => Some(Arc::new(k)),
            Err(e) => {
                errors.push_at(self.signing_key_at, "authority.signing_key", e.to_string());
                None
            }
        });
        Some(AuthorityConfig {
            clients,
            signing_key,
            listen: self.listen?,
            backend: self.backend?,
            max_ttl: self.max_ttl?,
            lock_delay: self.lock_delay?,
            tls,
        })
    }
}

/// Validates the `[authority]` table, pushing every error with its key path. Files
/// (`tls`, `token_file`, `signing_key`) are named relative to `base`, the config file's
/// directory, and read by [`AuthorityDraft::load`]. `None`: not a table of settings.
pub(crate) fn parse(
    mut value: toml::Value,
    base: &Path,
    errors: &mut Errors,
) -> Option<AuthorityDraft> {
    let tls = value
        .as_table_mut()
        .and_then(|t| t.remove("tls"))
        .and_then(|v| match v.try_into::<RawListenerTls>() {
            Ok(raw) => Some((
                crate::tls::listener_files(raw, base, "authority.tls"),
                errors.place(),
            )),
            Err(e) => {
                errors.push("authority.tls", e.message().trim().to_string());
                None
            }
        });
    let raw: RawAuthority = match value.try_into() {
        Ok(r) => r,
        Err(e) => {
            errors.push("authority", e.message().trim().to_string());
            return None;
        }
    };
    let listen_raw = raw.listen.as_deref().unwrap_or("127.0.0.1:7070");
    let listen: Option<SocketAddr> = listen_raw
        .parse()
        .map_err(|_| {
            errors.push(
                "authority.listen",
                format!("`{listen_raw}` is not an IP:port address"),
            )
        })
        .ok();
    let mut duration = |key: &str, raw: Option<&str>, default: Duration| match raw {
        None => Some(default),
        Some(s) => match humantime::parse_duration(s) {
            Ok(d) if d > MAX_DURATION => {
                errors.push(key, format!("`{s}` is longer than the maximum, 366d"));
                None
            }
            Ok(d) => Some(d),
            Err(e) => {
                errors.push(key, format!("`{s}` is not a duration: {e}"));
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
        errors.push("authority.max_ttl", "must be greater than zero");
    }
    let backend = match (
        raw.backend.as_deref().unwrap_or("local"),
        raw.etcd_endpoints,
    ) {
        ("local", None) => Some(Backend::Local),
        ("local", Some(_)) => {
            errors.push("authority.etcd_endpoints", "only for backend = \"etcd\"");
            None
        }
        ("etcd", Some(endpoints)) if !endpoints.is_empty() => Some(Backend::Etcd { endpoints }),
        ("etcd", _) => {
            errors.push(
                "authority.etcd_endpoints",
                "backend = \"etcd\" needs at least one endpoint",
            );
            None
        }
        (other, _) => {
            errors.push(
                "authority.backend",
                format!("`{other}`: expected \"local\" or \"etcd\""),
            );
            None
        }
    };
    let clients = clients(raw.client.unwrap_or_default(), base, errors);
    Some(AuthorityDraft {
        listen,
        backend,
        max_ttl,
        lock_delay,
        clients,
        open_at: errors.place(),
        signing_key: raw.signing_key.map(|f| base.join(f)),
        signing_key_at: errors.place(),
        tls,
    })
}

/// Validates the `[[authority.client]]` entries.
fn clients(raw: Vec<RawClient>, base: &Path, errors: &mut Errors) -> Vec<ClientDraft> {
    let mut clients = Vec::new();
    let mut names = std::collections::HashSet::new();
    for (i, c) in raw.into_iter().enumerate() {
        let at = |key: &str| format!("authority.client[{i}].{key}");
        if c.name.is_empty() || c.name.len() > 1024 || c.name.chars().any(char::is_control) {
            errors.push(at("name"), "must be 1 to 1024 characters, none a control");
        } else if !names.insert(c.name.clone()) {
            errors.push(at("name"), format!("`{}` is defined twice", c.name));
        }
        if c.scopes.is_empty() {
            errors.push(at("scopes"), "empty: the client could take no scope");
        }
        for (j, p) in c.scopes.iter().enumerate() {
            if p.is_empty() || p.trim_end_matches('*').len() + 1 < p.len() {
                errors.push(
                    format!("authority.client[{i}].scopes[{j}]"),
                    format!("`{p}`: an exact scope, or a prefix ending in one `*`"),
                );
            } else if p[..p.len() - usize::from(p.ends_with('*'))].contains('*') {
                errors.push(
                    format!("authority.client[{i}].scopes[{j}]"),
                    format!("`{p}`: `*` only at the end"),
                );
            }
        }
        clients.push(ClientDraft {
            name: c.name,
            scopes: c.scopes,
            token_file: base.join(&c.token_file),
            key_path: at("token_file"),
            token_at: errors.place(),
        });
    }
    clients
}
