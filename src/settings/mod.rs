//! The configuration file (SPEC §5), assembled: raw TOML with unknown keys refused,
//! validated into a [`Config`]. Validation collects every error with its key path, so
//! `check-config` can show an operator all of them at once instead of one per run.
//!
//! Each section owns its raw and validated types and its checks, beside the code that uses
//! it: `[server]` ([`crate::listen::config`]), `[admin]` ([`crate::admin::config`]), `[store]`
//! ([`crate::store::config`]), `[fencing]` ([`crate::fence::config`]), `[[upstream]]` and `[[route]]`
//! ([`crate::proxy::config`]), `[idempotency]` ([`crate::proxy::idempotency::config`]),
//! `[authority]` ([`crate::authority::config`]), `[cluster]` ([`crate::cluster::config`]),
//! `[log]` ([`crate::access_log`]), the `tls` tables ([`crate::tls`]). This module sits
//! above them all and assembles them in two steps: [`Draft::parse`] reads the text and
//! nothing else; [`Draft::load`] reads the files it names (certificates, keys, secrets) and
//! reports their errors in the place of the file's own. The accumulator and the value
//! checks are the leaf [`crate::config`], which every section imports.

use std::net::SocketAddr;
use std::path::Path;

use http::Method;

pub use crate::access_log::LogConfig;
pub use crate::admin::config::AdminConfig;
use crate::admin::config::{AdminDraft, RawAdmin};
use crate::authority::config::AuthorityDraft;
use crate::config::error::Errors;
pub use crate::config::error::{ConfigError, ConfigErrors};
pub use crate::config::value::parse_size;
use crate::config::value::section;
pub use crate::fence::config::FencingConfig;
use crate::fence::config::{FencingDraft, RawFencing};
pub use crate::fence::policy::EqualPolicy;
pub use crate::listen::config::{IpNet, ServerConfig};
use crate::listen::config::{RawServer, ServerDraft};
pub use crate::proxy::config::{ProofMode, Route, SequenceMode, Upstream};
use crate::proxy::config::{RouteContext, UpstreamDraft};
pub use crate::proxy::idempotency::config::IdempotencyConfig;
use crate::proxy::idempotency::config::RawIdempotency;
pub use crate::store::config::StoreConfig;

#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub admin: AdminConfig,
    pub store: StoreConfig,
    pub fencing: FencingConfig,
    pub upstreams: Vec<Upstream>,
    pub routes: Vec<Route>,
    /// Idempotency records: lifetime and size bounds.
    pub idempotency: IdempotencyConfig,
    /// The optional lease authority (SPEC §8).
    pub authority: Option<crate::authority::config::AuthorityConfig>,
    /// The access log (`[log]`).
    pub log: LogConfig,
    /// `[cluster]`: this instance shares the fence with others through etcd (SPEC §10).
    pub cluster: Option<crate::cluster::config::ClusterConfig>,
}

/// A file as parsed: every setting checked, every file it names (certificates, keys, proof
/// keys, secrets) named but not read. [`Draft::load`] reads them.
#[derive(Debug)]
pub struct Draft {
    server: ServerDraft,
    admin: AdminDraft,
    store: StoreConfig,
    fencing: FencingDraft,
    upstreams: Vec<UpstreamDraft>,
    routes: Vec<Route>,
    idempotency: IdempotencyConfig,
    authority: Option<AuthorityDraft>,
    log: LogConfig,
    cluster: Option<crate::cluster::config::ClusterDraft>,
    errors: Errors,
}

impl Draft {
    /// Parses and validates `text`, reading no file. Relative paths in it are resolved
    /// against `base`. `Err` only for text that is not TOML at all; the errors of the
    /// settings are kept for [`Draft::load`] to report with those of the files.
    pub fn parse(text: &str, base: &Path) -> Result<Draft, ConfigErrors> {
        let mut errors = Errors::default();
        let mut table: toml::Table = toml::from_str(text).map_err(|e| {
            ConfigErrors(vec![ConfigError {
                path: String::new(),
                message: format!("not valid TOML: {}", e.to_string().trim()),
            }])
        })?;
        for key in table.keys() {
            if !matches!(
                key.as_str(),
                "server"
                    | "admin"
                    | "store"
                    | "fencing"
                    | "idempotency"
                    | "upstream"
                    | "route"
                    | "authority"
                    | "log"
                    | "cluster"
            ) {
                // A key may be empty (`"" = 1`): its path is still a path.
                let path = if key.is_empty() { "\"\"" } else { key.as_str() };
                errors.push(path, "unknown section");
            }
        }
        let e = &mut errors;
        let raw_cluster = section(table.remove("cluster"), "cluster", e);
        let cluster = crate::cluster::config::parse(raw_cluster, base, e);
        let raw_server: RawServer =
            section(table.remove("server"), "server", e).unwrap_or_default();
        let raw_admin: RawAdmin = section(table.remove("admin"), "admin", e).unwrap_or_default();
        let raw_store = section(table.remove("store"), "store", e);
        let raw_fencing: RawFencing =
            section(table.remove("fencing"), "fencing", e).unwrap_or_default();
        let raw_log = section(table.remove("log"), "log", e).unwrap_or_default();

        let log = LogConfig::parse(raw_log, base, e);
        let server = crate::listen::config::parse(raw_server, base, e);
        let admin = crate::admin::config::parse(raw_admin, base, e);
        let store = crate::store::config::parse(raw_store, base, e);
        let fencing = crate::fence::config::parse(raw_fencing, base, e);
        let upstreams = crate::proxy::config::parse_upstreams(table.remove("upstream"), base, e);
        let raw_idempotency: RawIdempotency =
            section(table.remove("idempotency"), "idempotency", e).unwrap_or_default();
        let idempotency = IdempotencyConfig::parse(raw_idempotency, e);
        if overlaps(admin.listen(), server.listen()) {
            e.push(
                "admin.listen",
                format!(
                    "{} is also server.listen ({}): the admin API needs a listener of its own",
                    admin.listen(),
                    server.listen()
                ),
            );
        }
        let raw_authority = table.remove("authority");
        let has_authority = raw_authority.is_some();
        let authority = raw_authority.and_then(|v| crate::authority::config::parse(v, base, e));
        if let Some(listen) = authority.as_ref().and_then(AuthorityDraft::listen) {
            for (other, key) in [
                (server.listen(), "server.listen"),
                (admin.listen(), "admin.listen"),
            ] {
                if overlaps(listen, other) {
                    e.push(
                        "authority.listen",
                        format!(
                            "{listen} is also {key} ({other}): the authority needs a listener of its own"
                        ),
                    );
                }
            }
        }
        let routes = crate::proxy::config::parse_routes(
            table.remove("route"),
            RouteContext {
                upstreams: &upstreams,
                has_authority,
                proof_keys: fencing.names_proof_keys(),
            },
            e,
        );
        if let Some(c) = &cluster {
            cluster_limits(c.config(), &routes, authority.as_ref(), &server, &admin, e);
        }
        Ok(Draft {
            server,
            admin,
            store,
            fencing,
            upstreams,
            routes,
            idempotency,
            authority,
            log,
            cluster,
            errors,
        })
    }

    /// Did the text itself have errors (before any file is read)?
    pub fn has_errors(&self) -> bool {
        !self.errors.is_empty()
    }

    /// Reads the files the text names and completes the config, or answers every error of
    /// the text and of its files, in the order of the text.
    pub fn load(self) -> Result<Config, ConfigErrors> {
        let mut errors = self.errors;
        let e = &mut errors;
        let server = self.server.load(e);
        let admin = self.admin.load(e);
        let fencing = self.fencing.load(e);
        let upstreams: Vec<Upstream> = self.upstreams.into_iter().map(|u| u.load(e)).collect();
        let authority = self.authority.map(|a| a.load(e));
        let cluster = self.cluster.map(|c| c.load(e));
        let (store, routes, idempotency, log) =
            (self.store, self.routes, self.idempotency, self.log);
        errors.finish(|| {
            Some(Config {
                server,
                admin,
                store,
                fencing,
                upstreams,
                routes,
                idempotency,
                // An [authority] table that did not validate has errors of its own.
                authority: match authority {
                    Some(a) => Some(a?),
                    None => None,
                },
                log,
                cluster,
            })
        })
    }
}

/// What a cluster cannot do (SPEC §10), and the listener it must not share.
fn cluster_limits(
    cluster: &crate::cluster::config::ClusterConfig,
    routes: &[Route],
    authority: Option<&AuthorityDraft>,
    server: &ServerDraft,
    admin: &AdminDraft,
    e: &mut Errors,
) {
    for (i, r) in routes.iter().enumerate() {
        if r.fences_trees() {
            e.push(
                format!("route[{i}].api"),
                "api = \"webdav\" with one scope per object is not available in cluster \
                 mode: a DELETE, MOVE or COPY of a collection is checked against every mark \
                 beneath its scope, and in a cluster those marks are spread over the instances \
                 (run one instance, or make the scope one per tree)",
            );
        }
        if r.idempotency != crate::proxy::idempotency::config::Mode::Off {
            e.push(
                format!("route[{i}].idempotency"),
                "not available in cluster mode: idempotency records are kept by one \
                 instance, and a retry may reach another (remove it, or run one instance)",
            );
        }
    }
    if authority.is_some_and(AuthorityDraft::is_local) {
        e.push(
            "authority.backend",
            "backend = \"local\" keeps the authority's epochs in one instance's file: a \
             cluster's authority needs backend = \"etcd\"",
        );
    }
    for (other, key) in [
        (server.listen(), "server.listen"),
        (admin.listen(), "admin.listen"),
    ] {
        if overlaps(cluster.peer_listen, other) {
            e.push(
                "cluster.peer_listen",
                format!(
                    "{} is also {key} ({other}): the instances' hops need a listener of their own",
                    cluster.peer_listen
                ),
            );
        }
    }
}

impl Config {
    /// What the proxy reads of the file: its sections, not the whole (also what an
    /// embedding service hands `FenceLayer::new`).
    pub fn proxy_settings(&self) -> crate::proxy::Settings {
        crate::proxy::Settings::from_sections(
            self.routes.clone(),
            self.upstreams.clone(),
            self.fencing.clone(),
            self.idempotency.clone(),
            self.store.clone(),
            self.server.trusted_proxies.clone(),
            self.cluster.is_some(),
        )
    }

    /// Reads and validates a file. Relative paths in it are resolved against its directory.
    pub fn load(file: &Path) -> Result<Config, ConfigErrors> {
        let text = crate::config::value::read_bounded_text(file, crate::config::value::MAX_FILE)
            .map_err(|e| {
                ConfigErrors(vec![ConfigError {
                    path: String::new(),
                    message: format!("cannot read {}: {e}", file.display()),
                }])
            })?;
        let base = file.parent().unwrap_or(Path::new("."));
        Config::parse(&text, base)
    }

    /// Validates `text` and reads the files it names ([`Draft::parse`], then
    /// [`Draft::load`]). Relative paths in it are resolved against `base`.
    pub fn parse(text: &str, base: &Path) -> Result<Config, ConfigErrors> {
        Draft::parse(text, base)?.load()
    }

    /// What the file allows but is likely a mistake: printed by `check-config`, logged at
    /// start-up.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        // A connection alone takes a share of two (itself and its upstream connection);
        // an HTTP/2 stream takes one more.
        if self.server.max_descriptors_per_ip == Some(2) {
            out.push(
                "[server] max_descriptors_per_ip = 2: a client's connection takes both (itself and its upstream connection) and each HTTP/2 stream one more, so every HTTP/2 request is refused (502); 3 or more lets a connection's streams through"
                    .to_string(),
            );
        }
        // Bearer secrets and the marks' API in the clear, where others can listen.
        if !self.admin.listen.ip().is_loopback() && self.admin.tls.is_none() {
            out.push(format!(
                "[admin] listens on {} without tls: its bearer token and the marks' API cross the network in the clear",
                self.admin.listen
            ));
        }
        if let Some(a) = &self.authority
            && !a.listen.ip().is_loopback()
            && a.tls.is_none()
        {
            out.push(format!(
                "[authority] listens on {} without tls: clients' bearer secrets and lease ids cross the network in the clear",
                a.listen
            ));
        }
        for (i, r) in self.routes.iter().enumerate() {
            if !r.fenced {
                continue;
            }
            if r.equal == EqualPolicy::Reject
                && r.idempotency != crate::proxy::idempotency::config::Mode::Off
            {
                out.push(format!(
                    "route `{}`: idempotency with equal = \"reject\": a retry with the same token is stale_fence before its Idempotency-Key is looked at, so keys replay nothing here",
                    r.name
                ));
            }
            if let Some((a, b)) = r.scope.ambiguous_captures(&r.path) {
                out.push(format!(
                    "route `{}`: scope `{}` joins captures `{a}` and `{b}` without a `/` between them, and a capture may hold any other character: two different paths can share one scope (and one mark)",
                    r.name, r.scope
                ));
            }
            for e in &self.routes[..i] {
                let hosts_meet = e.host.is_none() || r.host.is_none() || e.host == r.host;
                if e.fenced || !hosts_meet {
                    continue;
                }
                if let Some(example) = e.path.overlap(&r.path) {
                    out.push(format!(
                        "route `{}` is fenced, but pass-through route `{}` ({}) comes first and takes some of its paths (such as {example}): those are forwarded unfenced",
                        r.name, e.name, e.path
                    ));
                }
            }
        }
        out
    }

    /// A short human description of what was understood, for `check-config`.
    pub fn describe(&self) -> String {
        let mut out = format!(
            "listen {}{}  admin {}  store {}\n",
            self.server.listen,
            self.server
                .tls
                .as_ref()
                .map(|t| format!(" ({t})"))
                .unwrap_or_default(),
            self.admin.listen,
            self.store.path.display()
        );
        let f = &self.fencing;
        out.push_str(&format!(
            "fencing header {} · drain_timeout {} · settle {} · max_inflight_per_scope {} · max_waiters_per_scope {} · max_scope_bytes {} · proof keys {}\n",
            f.header,
            humantime::format_duration(f.drain_timeout),
            humantime::format_duration(f.settle),
            f.max_inflight_per_scope,
            f.max_waiters_per_scope,
            f.max_scope_bytes,
            if f.proof_keys.is_empty() { "none" } else { "set" },
        ));
        if let Some(a) = &self.authority {
            out.push_str(&describe_authority(a));
        }
        match &self.log.access {
            crate::access_log::Sink::Off => {}
            crate::access_log::Sink::Stdout => out.push_str("access log stdout\n"),
            crate::access_log::Sink::File(p) => {
                out.push_str(&format!("access log {}\n", p.display()))
            }
        }
        for u in &self.upstreams {
            out.push_str(&format!(
                "upstream {:<12} {} (timeout {:?}){}{}\n",
                u.name,
                u.url,
                u.timeout,
                u.tls.as_ref().map(|t| format!(" {t}")).unwrap_or_default(),
                if u.distinct_hosts {
                    " · distinct hosts"
                } else {
                    ""
                }
            ));
        }
        for r in &self.routes {
            out.push_str(&describe_route(r, &self.upstreams[r.upstream].name));
        }
        out
    }
}

/// `check-config`'s line for the `[authority]` table.
fn describe_authority(a: &crate::authority::config::AuthorityConfig) -> String {
    let backend = match &a.backend {
        crate::authority::config::Backend::Local => "local".to_string(),
        crate::authority::config::Backend::Etcd { endpoints } => {
            format!("etcd ({})", endpoints.join(", "))
        }
    };
    format!(
        "authority {} · backend {backend} · max_ttl {} · lock_delay {}{}{}\n",
        a.listen,
        humantime::format_duration(a.max_ttl),
        humantime::format_duration(a.lock_delay),
        if a.clients.is_empty() {
            String::new()
        } else {
            let names: Vec<&str> = a.clients.iter().map(|c| c.name.as_str()).collect();
            format!(" · clients {}", names.join(", "))
        },
        a.signing_key
            .as_ref()
            .map(|k| format!(" · signs proofs with key {}", k.id()))
            .unwrap_or_default(),
    )
}

/// `check-config`'s line for a route (on `upstream`), and its API's line when it has one.
fn describe_route(r: &Route, upstream: &str) -> String {
    let fenced = if !r.fenced {
        "pass-through (unfenced)".to_string()
    } else {
        let methods = match &r.methods {
            Some(m) => m.iter().map(Method::as_str).collect::<Vec<_>>().join(","),
            None => "all but GET,HEAD,OPTIONS,TRACE".into(),
        };
        format!(
            "scope {:?}{} · fenced methods: {methods} · equal={}{}{}",
            r.scope.to_string(),
            if r.scope.is_constant() {
                " (whole route)"
            } else {
                ""
            },
            if r.equal == EqualPolicy::Accept {
                "accept"
            } else {
                "reject"
            },
            if r.proof == ProofMode::Required {
                " · proof required"
            } else {
                ""
            },
            if r.sequence == SequenceMode::Required {
                " · sequence required"
            } else {
                ""
            }
        )
    };
    let mut out = format!(
        "route {:<12} {}{} -> {} · {fenced}{}\n",
        r.name,
        r.host
            .as_ref()
            .map(|h| format!("host {h} "))
            .unwrap_or_default(),
        r.path,
        upstream,
        match r.errors {
            crate::proxy::problem::Dialect::Problem => "",
            crate::proxy::problem::Dialect::S3 => " · errors s3",
        },
    );
    if let Some(s3) = r.s3() {
        out.push_str(&format!(
            "  api s3: {} · {} · keys {}\n",
            s3.virtual_host_domain
                .as_ref()
                .map_or("path-style only".to_string(), |d| format!(
                    "path-style and virtual-hosted *.{d}"
                )),
            s3.bucket_scope.as_ref().map_or(
                "bucket requests refused (no bucket_scope)".to_string(),
                |b| { format!("bucket scope \"{b}\"") }
            ),
            match s3.keys {
                crate::proxy::config::Keys::Strict => "strict",
                crate::proxy::config::Keys::Opaque => "opaque",
            },
        ));
    } else if r.api == crate::proxy::config::Api::Plain {
        out.push_str("  api plain: the path names all a request changes\n");
    } else if r.fences_trees() {
        out.push_str(
            "  api webdav: a collection's DELETE, MOVE or COPY is refused while a scope beneath it holds a mark\n",
        );
    } else if r.api == crate::proxy::config::Api::Webdav {
        out.push_str("  api webdav: one scope for a whole tree\n");
    }
    out
}

/// Would two listeners on these addresses collide at bind (the same port on the same
/// address, or on a wildcard address)? Port 0 (any free port) never collides.
fn overlaps(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() != 0
        && a.port() == b.port()
        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

#[cfg(test)]
mod tests;
