//! `[cluster]` (SPEC §10): this instance's place in a cluster of instances that share one
//! fence through etcd. Parsed and checked in full; the peer secret is read at load
//! ([`ClusterDraft::load`]). A build without the `etcd` feature refuses the table.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::config::error::{Errors, Place};
use crate::config::value::{duration, read_secret, socket_addr};

/// The most shards a cluster may have: each is an owner key, a lease attachment and a
/// watch event at every change of owner.
pub const MAX_SHARDS: u32 = 4096;
/// The longest name (instance or cluster): a component of etcd keys and of logs.
const MAX_NAME: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    /// This instance's name, unique in the cluster: its owner keys' value.
    pub name: String,
    /// The cluster's name: its keys are under `/fencegate/cluster/<cluster_name>/`, so
    /// several clusters may share one etcd.
    pub cluster_name: String,
    pub etcd_endpoints: Vec<String>,
    /// Where the other instances hand this one the requests of the shards it owns.
    pub peer_listen: SocketAddr,
    /// Fixed for the cluster's life: a scope's shard is a function of it.
    pub shards: u32,
    /// The ttl of the instance's etcd lease, to which its ownerships are attached.
    pub ownership_ttl: Duration,
    /// How much before its lease could expire an owner stops admitting (see
    /// `cluster::ownership`).
    pub drift_margin: Duration,
    /// The file of the secret the instances prove to each other on `peer_listen`.
    pub peer_secret_file: PathBuf,
    /// SHA-256 of that secret (read at load): what a hop carries and a peer listener
    /// compares, in constant time. Never the secret itself on the wire.
    pub peer_key: PeerKey,
    /// Run, and must succeed, before a takeover of a lost owner's shards (argv; the lost
    /// instance's name is passed in `FENCEGATE_FENCED_INSTANCE`).
    pub fence_command: Option<Vec<String>>,
    pub fence_timeout: Duration,
}

/// The hop's credential: SHA-256 of the peer secret, hex. Its `Debug` does not show it
/// (configs are logged).
#[derive(Clone, PartialEq, Eq, Default)]
pub struct PeerKey(pub String);

impl std::fmt::Debug for PeerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerKey(..)")
    }
}

impl PeerKey {
    /// The key of a secret's text (trimmed, as read from its file).
    pub fn of(secret: &str) -> PeerKey {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(secret.as_bytes());
        PeerKey(digest.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// Whether `presented` is this key, compared in constant time.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let ours = self.0.as_bytes();
        if presented.len() != ours.len() {
            return false;
        }
        ours.iter()
            .zip(presented)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

/// `[cluster]` as parsed: the peer secret's file is named, not read yet.
#[derive(Debug)]
pub(crate) struct ClusterDraft {
    config: ClusterConfig,
    secret_at: Place,
}

/// The shortest peer secret: it is all that keeps a client from posing as an instance.
const MIN_SECRET: usize = 16;

impl ClusterDraft {
    /// The table as parsed (the peer key not read yet).
    pub(crate) fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// Reads the peer secret.
    pub(crate) fn load(self, errors: &mut Errors) -> ClusterConfig {
        let mut config = self.config;
        if let Some(secret) = read_secret(
            &config.peer_secret_file,
            "cluster.peer_secret_file",
            self.secret_at,
            errors,
        ) {
            if secret.len() < MIN_SECRET {
                errors.push_at(
                    self.secret_at,
                    "cluster.peer_secret_file",
                    format!(
                        "{}: the secret is {} bytes; at least {MIN_SECRET} (e.g. `openssl rand -hex 32`)",
                        config.peer_secret_file.display(),
                        secret.len()
                    ),
                );
            }
            config.peer_key = PeerKey::of(&secret);
        }
        config
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawCluster {
    name: Option<String>,
    cluster_name: Option<String>,
    etcd_endpoints: Option<Vec<String>>,
    peer_listen: Option<String>,
    shards: Option<u32>,
    ownership_ttl: Option<String>,
    drift_margin: Option<String>,
    peer_secret_file: Option<String>,
    fence_command: Option<Vec<String>>,
    fence_timeout: Option<String>,
}

/// A name that is safe as one component of an etcd key and as a log field.
fn name(raw: Option<String>, default: Option<&str>, path: &str, errors: &mut Errors) -> String {
    let Some(n) = raw.or(default.map(str::to_owned)) else {
        errors.push(
            path,
            "missing: every instance needs a name unique in its cluster",
        );
        return String::new();
    };
    let ok = !n.is_empty()
        && n.len() <= MAX_NAME
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if !ok {
        errors.push(path, format!("{n:?}: 1 to {MAX_NAME} of A-Z a-z 0-9 - _ ."));
    }
    n
}

/// Validates `[cluster]`, when present.
pub(crate) fn parse(
    raw: Option<RawCluster>,
    base: &Path,
    errors: &mut Errors,
) -> Option<ClusterDraft> {
    let raw = raw?;
    let e = errors;
    #[cfg(not(feature = "etcd"))]
    e.push(
        "cluster",
        "cluster mode needs a build with `--features etcd` (its marks and ownership are in etcd)",
    );
    let name = name(raw.name, None, "cluster.name", e);
    let cluster_name = name_or_default(raw.cluster_name, e);
    let etcd_endpoints = etcd_endpoints(raw.etcd_endpoints, e);
    let peer_listen = peer_listen(raw.peer_listen.as_deref(), e);
    let shards = raw.shards.unwrap_or(64);
    if !(1..=MAX_SHARDS).contains(&shards) {
        e.push(
            "cluster.shards",
            format!(
                "{shards}: must be 1 to {MAX_SHARDS} (and stay the same for the cluster's life)"
            ),
        );
    }
    let (ownership_ttl, drift_margin) =
        ownership_timings(raw.ownership_ttl.as_deref(), raw.drift_margin.as_deref(), e);
    let secret_at = e.place();
    let peer_secret_file = match raw.peer_secret_file {
        Some(p) if !p.is_empty() => base.join(p),
        _ => {
            e.push(
                "cluster.peer_secret_file",
                "missing: a file with the secret every instance of the cluster shares, so a \
                 client cannot pose as a peer",
            );
            PathBuf::new()
        }
    };
    let fence_command = raw.fence_command;
    if fence_command
        .as_ref()
        .is_some_and(|c| c.first().is_none_or(|p| p.is_empty()))
    {
        e.push(
            "cluster.fence_command",
            "must name a program: [\"/path/to/program\", \"arg\", ...]",
        );
    }
    let fence_timeout = duration(
        raw.fence_timeout.as_deref(),
        Duration::from_secs(10),
        "cluster.fence_timeout",
        e,
    );
    let config = ClusterConfig {
        name,
        cluster_name,
        etcd_endpoints,
        peer_listen,
        shards,
        ownership_ttl,
        drift_margin,
        peer_secret_file,
        peer_key: PeerKey::default(),
        fence_command,
        fence_timeout,
    };
    Some(ClusterDraft { config, secret_at })
}

/// `cluster.etcd_endpoints`: at least one, each `http(s)://host:port`.
fn etcd_endpoints(raw: Option<Vec<String>>, e: &mut Errors) -> Vec<String> {
    let etcd_endpoints = raw.unwrap_or_default();
    if etcd_endpoints.is_empty() {
        e.push(
            "cluster.etcd_endpoints",
            "missing: at least one etcd member, e.g. [\"http://127.0.0.1:2379\"]",
        );
    }
    for (i, url) in etcd_endpoints.iter().enumerate() {
        let rest = url
            .strip_prefix("http://")
            .or_else(|| url.strip_prefix("https://"));
        if rest.is_none_or(|r| r.is_empty() || r.contains('/')) {
            e.push(
                format!("cluster.etcd_endpoints[{i}]"),
                format!("{url:?} is not http(s)://host:port"),
            );
        }
    }
    etcd_endpoints
}

/// `cluster.peer_listen`: given, and one of this host's addresses.
fn peer_listen(raw: Option<&str>, e: &mut Errors) -> SocketAddr {
    if raw.is_none() {
        e.push(
            "cluster.peer_listen",
            "missing: where the other instances reach this one, e.g. \"127.0.0.1:7401\"",
        );
    }
    let peer_listen = socket_addr(raw, "127.0.0.1:0", "cluster.peer_listen", e);
    // Registered as the address the other instances connect to: it must name this host.
    if raw.is_some() && peer_listen.ip().is_unspecified() {
        e.push(
            "cluster.peer_listen",
            format!(
                "{peer_listen}: the other instances connect to this address, so it must be one \
                 of this host's (not 0.0.0.0 or ::)"
            ),
        );
    }
    peer_listen
}

/// `cluster.ownership_ttl` (1 s to 1 h) and `cluster.drift_margin` (at most half of it).
fn ownership_timings(
    ownership_ttl: Option<&str>,
    drift_margin: Option<&str>,
    e: &mut Errors,
) -> (Duration, Duration) {
    let ownership_ttl = duration(
        ownership_ttl,
        Duration::from_secs(5),
        "cluster.ownership_ttl",
        e,
    );
    if !(Duration::from_secs(1)..=Duration::from_secs(3600)).contains(&ownership_ttl) {
        e.push(
            "cluster.ownership_ttl",
            "must be 1s to 1h (etcd leases count whole seconds)",
        );
    }
    let drift_margin = duration(
        drift_margin,
        Duration::from_millis(250),
        "cluster.drift_margin",
        e,
    );
    if drift_margin * 2 > ownership_ttl {
        e.push(
            "cluster.drift_margin",
            format!("{drift_margin:?} must be at most half of ownership_ttl ({ownership_ttl:?})"),
        );
    }
    (ownership_ttl, drift_margin)
}

fn name_or_default(raw: Option<String>, errors: &mut Errors) -> String {
    name(raw, Some("default"), "cluster.cluster_name", errors)
}
