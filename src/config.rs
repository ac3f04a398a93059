//! Configuration (SPEC §5): raw TOML with unknown keys refused, validated into a
//! [`Config`]. Validation collects every error with its key path, so `check-config` can
//! show an operator all of them at once instead of one per run.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::{HeaderName, Method, Uri};
use serde::Deserialize;

use crate::route::{PathTemplate, RouteMatch, ScopeTemplate};

/// One configuration error and where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub path: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// All the errors of one configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

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
    pub authority: Option<crate::authority::AuthorityConfig>,
    /// The access log (`[log]`).
    pub log: LogConfig,
}

#[derive(Debug, Clone, Default)]
pub struct LogConfig {
    /// `access = "off" | "stdout" | "<file>"`: one JSON line per proxy request. A relative
    /// file is resolved against the config file's directory.
    pub access: crate::access_log::Sink,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawLog {
    access: Option<String>,
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// Threads serving the proxy listener, each running its connections start to end.
    pub workers: usize,
    /// Bound on how long SIGTERM waits for in-flight requests before exiting anyway.
    pub shutdown_timeout: Duration,
    /// Open client connections, in total and per client IP; more are closed at accept.
    pub max_connections: usize,
    pub max_connections_per_ip: usize,
    /// Time allowed to send a request head (slowloris); also bounds idle keep-alive.
    pub header_read_timeout: Duration,
    /// Time a client may take none of its answer (no write to it makes progress, or an
    /// HTTP/2 stream gets no window) before its connection is closed.
    pub send_timeout: Duration,
    /// Largest request head in bytes, and most header lines; beyond: 431.
    pub max_header_bytes: usize,
    pub max_headers: usize,
    /// Peers whose X-Forwarded-* headers are kept (and appended to); from anyone else
    /// they are stripped, since a client could claim any address or scheme.
    pub trusted_proxies: Vec<IpNet>,
    /// `tls = { cert, key, client_ca }`: serve HTTPS (h2 by ALPN) instead of plain HTTP;
    /// with `client_ca`, only clients holding a certificate from it get through.
    pub tls: Option<crate::tls::ListenerFiles>,
}

/// An IP network (`10.0.0.0/8`, `::1/128`; a bare address is a single host).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpNet {
    pub addr: std::net::IpAddr,
    pub prefix: u8,
}

impl IpNet {
    pub fn parse(s: &str) -> Option<IpNet> {
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a.parse().ok()?, Some(p.parse::<u8>().ok()?)),
            None => (s.parse().ok()?, None),
        };
        let max = if matches!(addr, std::net::IpAddr::V4(_)) {
            32
        } else {
            128
        };
        let prefix = prefix.unwrap_or(max);
        (prefix <= max).then_some(IpNet { addr, prefix })
    }

    pub fn contains(&self, ip: std::net::IpAddr) -> bool {
        use std::net::IpAddr::{V4, V6};
        let ip = match ip {
            V6(v6) => v6.to_ipv4_mapped().map(V4).unwrap_or(V6(v6)),
            v4 => v4,
        };
        match (self.addr, ip) {
            (V4(net), V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (V6(net), V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

#[derive(Debug, Clone)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    /// Bearer token for the admin API (all but /healthz and /readyz), read at start-up.
    pub token: Option<String>,
    /// `tls = { cert, key, client_ca }`: serve the admin API over HTTPS, as `server.tls`.
    pub tls: Option<crate::tls::ListenerFiles>,
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Relative paths are resolved against the config file's directory.
    pub path: PathBuf,
}

#[derive(Debug, Clone)]
pub struct FencingConfig {
    pub header: HeaderName,
    pub drain_timeout: Duration,
    pub settle: Duration,
    /// Per scope: requests of one generation at the backend at once, and requests
    /// waiting at its gate. Beyond either: 503 draining, so memory stays bounded.
    pub max_inflight_per_scope: usize,
    pub max_waiters_per_scope: usize,
    /// Longest scope a fenced request may derive: each one admitted is kept in memory
    /// while hot and on disk for good. Beyond: 400 invalid_path.
    pub max_scope_bytes: usize,
    /// Keys whose proofs `proof = "required"` routes accept (SPEC §9), read at start-up.
    pub proof_keys: crate::proof::ProofKeys,
}

/// Whether a fenced route asks for a `Fencing-Proof` beside the token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProofMode {
    /// Today's behaviour, for lock services that cannot sign.
    Off,
    /// A proof from one of `[fencing] proof_keys` for this scope and token, or 403.
    Required,
}

#[derive(Debug, Clone)]
pub struct IdempotencyConfig {
    /// How long a record is kept; a retry after this is a new request.
    pub ttl: Duration,
    /// Largest request body that is fingerprinted (it is read before forwarding); 413 beyond.
    pub max_request_body: u64,
    /// Largest response body stored for replay; a larger one is replayed without a body.
    pub max_response_body: u64,
    /// Bytes of request and response bodies held in memory at once by requests with a
    /// key, over all connections; a request body that finds no room gets 503.
    pub max_buffered: u64,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawIdempotency {
    ttl: Option<String>,
    max_request_body: Option<String>,
    max_response_body: Option<String>,
    max_buffered: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Upstream {
    pub name: String,
    /// Scheme and authority only; the request's path is appended byte for byte.
    pub url: Uri,
    pub timeout: Duration,
    /// Client TLS settings; `Some` exactly for https upstreams.
    pub tls: Option<crate::tls::UpstreamTls>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EqualPolicy {
    Accept,
    Reject,
}

#[derive(Debug, Clone)]
pub struct Route {
    pub name: String,
    pub path: PathTemplate,
    pub scope: ScopeTemplate,
    pub upstream: usize,
    /// Lowercase host without port.
    pub host: Option<String>,
    pub fenced: bool,
    /// Methods that need a token; `None` means every method but the safe ones.
    pub methods: Option<Vec<Method>>,
    pub equal: EqualPolicy,
    /// Largest request body in bytes (413 beyond); `None`: no limit.
    pub max_body: Option<u64>,
    /// Idempotency-Key handling on fenced requests.
    pub idempotency: crate::idempotency::Mode,
    /// A retry whose first attempt's outcome is unknown: refuse it, or forward it again.
    pub idempotency_unknown: crate::idempotency::OnUnknown,
    pub proof: ProofMode,
}

impl Route {
    /// Does this method need a token on this route (SPEC §2)? A listed method is matched
    /// without regard to case: methods are case-sensitive, but many backends upper-case
    /// them, and to those `post` is a POST. The default set of safe methods is matched
    /// exactly, so `get` needs a token.
    pub fn fences_method(&self, method: &Method) -> bool {
        match &self.methods {
            Some(list) => list
                .iter()
                .any(|m| m.as_str().eq_ignore_ascii_case(method.as_str())),
            None => !matches!(
                *method,
                Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
            ),
        }
    }
}

impl RouteMatch for Route {
    fn path(&self) -> &PathTemplate {
        &self.path
    }
    fn host(&self) -> Option<&str> {
        self.host.as_deref()
    }
}

/// More proxy threads than this is a typo, not a machine.
const MAX_WORKERS: usize = 1024;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: Option<String>,
    workers: Option<usize>,
    shutdown_timeout: Option<String>,
    max_connections: Option<usize>,
    max_connections_per_ip: Option<usize>,
    header_read_timeout: Option<String>,
    send_timeout: Option<String>,
    max_header_bytes: Option<String>,
    max_headers: Option<usize>,
    trusted_proxies: Option<Vec<String>>,
    tls: Option<crate::tls::RawListenerTls>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    listen: Option<String>,
    token_file: Option<String>,
    tls: Option<crate::tls::RawListenerTls>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStore {
    path: String,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawFencing {
    header: Option<String>,
    drain_timeout: Option<String>,
    settle: Option<String>,
    max_inflight_per_scope: Option<usize>,
    max_waiters_per_scope: Option<usize>,
    max_scope_bytes: Option<usize>,
    proof_keys: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawUpstream {
    name: String,
    url: String,
    timeout: Option<String>,
    tls: Option<crate::tls::RawUpstreamTls>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    name: String,
    path: String,
    scope: Option<String>,
    upstream: String,
    host: Option<String>,
    fenced: Option<bool>,
    methods: Option<Vec<String>>,
    equal: Option<String>,
    idempotency: Option<String>,
    idempotency_unknown: Option<String>,
    max_body: Option<String>,
    proof: Option<String>,
}

/// Collects errors as validation walks the file.
#[derive(Default)]
struct Errors(Vec<ConfigError>);

impl Errors {
    fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(ConfigError {
            path: path.into(),
            message: message.into(),
        });
    }
}

fn section<T: for<'de> Deserialize<'de>>(
    value: Option<toml::Value>,
    path: &str,
    errors: &mut Errors,
) -> Option<T> {
    let value = value?;
    match T::deserialize(value) {
        Ok(v) => Some(v),
        Err(e) => {
            errors.push(path, e.message().trim().to_string());
            None
        }
    }
}

/// The longest duration a setting takes: deadlines are instants plus a setting, and an
/// instant a few hundred billion years out does not exist.
pub(crate) const MAX_DURATION: Duration = Duration::from_secs(366 * 24 * 3600);

/// The largest count a setting takes (connections, in-flight requests, waiters, ...).
const MAX_COUNT: usize = 1 << 32;

fn duration(raw: Option<&str>, default: Duration, path: &str, errors: &mut Errors) -> Duration {
    match raw {
        None => default,
        Some(s) => match humantime::parse_duration(s) {
            Ok(d) if d > MAX_DURATION => {
                errors.push(path, format!("`{s}` is longer than the maximum, 366d"));
                default
            }
            Ok(d) => d,
            Err(e) => {
                errors.push(
                    path,
                    format!("`{s}` is not a duration (e.g. 500ms, 30s): {e}"),
                );
                default
            }
        },
    }
}

/// A size: bytes (`1048576`) or with a unit (`64KiB`, `10MiB`, `1GiB`, `1MB`).
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(mult)
}

fn size(raw: Option<&str>, default: u64, path: &str, errors: &mut Errors) -> u64 {
    match raw {
        None => default,
        Some(s) => parse_size(s).unwrap_or_else(|| {
            errors.push(
                path,
                format!("`{s}` is not a size (e.g. 65536, 64KiB, 10MiB)"),
            );
            default
        }),
    }
}

fn socket_addr(raw: Option<&str>, default: &str, path: &str, errors: &mut Errors) -> SocketAddr {
    let s = raw.unwrap_or(default);
    s.parse().unwrap_or_else(|_| {
        errors.push(path, format!("`{s}` is not an IP:port address"));
        SocketAddr::from(([127, 0, 0, 1], 0))
    })
}

impl Config {
    /// Reads and validates a file. Relative paths in it are resolved against its directory.
    pub fn load(file: &Path) -> Result<Config, ConfigErrors> {
        let text = std::fs::read_to_string(file).map_err(|e| {
            ConfigErrors(vec![ConfigError {
                path: String::new(),
                message: format!("cannot read {}: {e}", file.display()),
            }])
        })?;
        let base = file.parent().unwrap_or(Path::new("."));
        Config::parse(&text, base)
    }

    pub fn parse(text: &str, base: &Path) -> Result<Config, ConfigErrors> {
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
            ) {
                errors.push(key.clone(), "unknown section");
            }
        }

        let server: RawServer =
            section(table.remove("server"), "server", &mut errors).unwrap_or_default();
        let admin: RawAdmin =
            section(table.remove("admin"), "admin", &mut errors).unwrap_or_default();
        let store: Option<RawStore> = section(table.remove("store"), "store", &mut errors);
        let fencing: RawFencing =
            section(table.remove("fencing"), "fencing", &mut errors).unwrap_or_default();
        let raw_log: RawLog = section(table.remove("log"), "log", &mut errors).unwrap_or_default();
        let log = LogConfig {
            access: match raw_log.access.as_deref() {
                None | Some("off") => crate::access_log::Sink::Off,
                Some("stdout") => crate::access_log::Sink::Stdout,
                Some("") => {
                    errors.push(
                        "log.access",
                        "must be \"off\", \"stdout\" or a file path, not empty",
                    );
                    crate::access_log::Sink::Off
                }
                Some(path) => crate::access_log::Sink::File(base.join(path)),
            },
        };

        let trusted_proxies = server
            .trusted_proxies
            .unwrap_or_default()
            .iter()
            .enumerate()
            .filter_map(|(i, n)| {
                IpNet::parse(n).or_else(|| {
                    errors.push(
                        format!("server.trusted_proxies[{i}]"),
                        format!("`{n}` is not an IP address or network (10.0.0.0/8)"),
                    );
                    None
                })
            })
            .collect();
        let positive = |v: Option<usize>, default: usize, path: &str, errors: &mut Errors| match v {
            Some(0) => {
                errors.push(path, "must be at least 1");
                default
            }
            Some(n) if n > MAX_COUNT => {
                errors.push(path, format!("must be at most {MAX_COUNT}"));
                default
            }
            Some(n) => n,
            None => default,
        };
        let max_connections = positive(
            server.max_connections,
            10_000,
            "server.max_connections",
            &mut errors,
        );
        let server = ServerConfig {
            listen: socket_addr(
                server.listen.as_deref(),
                "127.0.0.1:8080",
                "server.listen",
                &mut errors,
            ),
            workers: match server.workers {
                Some(n) if n > MAX_WORKERS => {
                    errors.push("server.workers", format!("must be at most {MAX_WORKERS}"));
                    1
                }
                w => positive(
                    w,
                    std::thread::available_parallelism().map_or(1, |n| n.get()),
                    "server.workers",
                    &mut errors,
                ),
            },
            shutdown_timeout: duration(
                server.shutdown_timeout.as_deref(),
                Duration::from_secs(30),
                "server.shutdown_timeout",
                &mut errors,
            ),
            max_connections,
            max_connections_per_ip: positive(
                server.max_connections_per_ip,
                // A tenth of the total (1000 of the default 10000): one address alone
                // cannot take every slot.
                (max_connections / 10).clamp(1, 1_000),
                "server.max_connections_per_ip",
                &mut errors,
            ),
            header_read_timeout: duration(
                server.header_read_timeout.as_deref(),
                Duration::from_secs(10),
                "server.header_read_timeout",
                &mut errors,
            ),
            send_timeout: duration(
                server.send_timeout.as_deref(),
                Duration::from_secs(60),
                "server.send_timeout",
                &mut errors,
            ),
            max_header_bytes: size(
                server.max_header_bytes.as_deref(),
                64 << 10,
                "server.max_header_bytes",
                &mut errors,
            )
            .max(8192) as usize,
            max_headers: positive(server.max_headers, 100, "server.max_headers", &mut errors),
            trusted_proxies,
            tls: server
                .tls
                .and_then(|raw| crate::tls::listener_files(raw, base, "server.tls", &mut errors.0)),
        };
        let admin_listen = socket_addr(
            admin.listen.as_deref(),
            "127.0.0.1:9090",
            "admin.listen",
            &mut errors,
        );
        let token = admin.token_file.as_ref().and_then(|f| {
            let p = base.join(f);
            match std::fs::read_to_string(&p) {
                Ok(t) if !t.trim().is_empty() => Some(t.trim().to_string()),
                Ok(_) => {
                    errors.push("admin.token_file", format!("{} is empty", p.display()));
                    None
                }
                Err(e) => {
                    errors.push(
                        "admin.token_file",
                        format!("cannot read {}: {e}", p.display()),
                    );
                    None
                }
            }
        });
        if !admin_listen.ip().is_loopback() && admin.token_file.is_none() {
            errors.push(
                "admin.listen",
                format!("{admin_listen} is not loopback: set admin.token_file so the admin API needs a bearer token"),
            );
        }
        let admin = AdminConfig {
            listen: admin_listen,
            token,
            tls: admin
                .tls
                .and_then(|raw| crate::tls::listener_files(raw, base, "admin.tls", &mut errors.0)),
        };
        let store = match store {
            Some(s) if !s.path.is_empty() => StoreConfig {
                path: base.join(s.path),
            },
            Some(_) => {
                errors.push("store.path", "must not be empty");
                StoreConfig {
                    path: PathBuf::new(),
                }
            }
            None => {
                errors.push("store", "missing: [store] path = \"...\" is required");
                StoreConfig {
                    path: PathBuf::new(),
                }
            }
        };
        let header_raw = fencing.header.as_deref().unwrap_or("Fencing-Token");
        let header = HeaderName::from_bytes(header_raw.as_bytes()).unwrap_or_else(|_| {
            errors.push(
                "fencing.header",
                format!("`{header_raw}` is not a header name"),
            );
            HeaderName::from_static("fencing-token")
        });
        let fencing = FencingConfig {
            header,
            drain_timeout: duration(
                fencing.drain_timeout.as_deref(),
                Duration::from_secs(30),
                "fencing.drain_timeout",
                &mut errors,
            ),
            settle: duration(
                fencing.settle.as_deref(),
                Duration::from_secs(5),
                "fencing.settle",
                &mut errors,
            ),
            max_inflight_per_scope: positive(
                fencing.max_inflight_per_scope,
                4096,
                "fencing.max_inflight_per_scope",
                &mut errors,
            ),
            max_waiters_per_scope: positive(
                fencing.max_waiters_per_scope,
                1024,
                "fencing.max_waiters_per_scope",
                &mut errors,
            ),
            max_scope_bytes: positive(
                fencing.max_scope_bytes,
                1024,
                "fencing.max_scope_bytes",
                &mut errors,
            ),
            proof_keys: {
                let mut keys = crate::proof::ProofKeys::default();
                for (i, f) in fencing.proof_keys.iter().flatten().enumerate() {
                    if let Err(e) = keys.add_file(&base.join(f)) {
                        errors.push(format!("fencing.proof_keys[{i}]"), e.to_string());
                    }
                }
                keys
            },
        };

        let upstreams = array(table.remove("upstream"), "upstream", &mut errors)
            .into_iter()
            .enumerate()
            .filter_map(|(i, v)| {
                let path = format!("upstream[{i}]");
                let raw: RawUpstream = section(Some(v), &path, &mut errors)?;
                Some(validate_upstream(raw, &path, base, &mut errors))
            })
            .collect::<Vec<_>>();
        let mut seen = std::collections::HashSet::new();
        for (i, u) in upstreams.iter().enumerate() {
            if !seen.insert(u.name.clone()) {
                errors.push(
                    format!("upstream[{i}].name"),
                    format!("`{}` is defined twice", u.name),
                );
            }
        }

        let raw_idem: RawIdempotency =
            section(table.remove("idempotency"), "idempotency", &mut errors).unwrap_or_default();
        let idempotency = IdempotencyConfig {
            ttl: duration(
                raw_idem.ttl.as_deref(),
                Duration::from_secs(24 * 3600),
                "idempotency.ttl",
                &mut errors,
            ),
            max_request_body: size(
                raw_idem.max_request_body.as_deref(),
                8 << 20,
                "idempotency.max_request_body",
                &mut errors,
            ),
            max_response_body: size(
                raw_idem.max_response_body.as_deref(),
                1 << 20,
                "idempotency.max_response_body",
                &mut errors,
            ),
            max_buffered: size(
                raw_idem.max_buffered.as_deref(),
                128 << 20,
                "idempotency.max_buffered",
                &mut errors,
            ),
        };
        if idempotency.max_buffered < idempotency.max_request_body {
            errors.push(
                "idempotency.max_buffered",
                format!(
                    "{} bytes is less than idempotency.max_request_body ({} bytes): a body that size could never be read",
                    idempotency.max_buffered, idempotency.max_request_body
                ),
            );
        }
        if overlaps(admin.listen, server.listen) {
            errors.push(
                "admin.listen",
                format!(
                    "{} is also server.listen ({}): the admin API needs a listener of its own",
                    admin.listen, server.listen
                ),
            );
        }
        let mut raw_authority = table.remove("authority");
        let has_authority = raw_authority.is_some();
        // `authority.tls` is read here, where relative paths have their base.
        let authority_tls = raw_authority
            .as_mut()
            .and_then(|v| v.as_table_mut())
            .and_then(|t| t.remove("tls"))
            .and_then(|v| match v.try_into::<crate::tls::RawListenerTls>() {
                Ok(raw) => crate::tls::listener_files(raw, base, "authority.tls", &mut errors.0),
                Err(e) => {
                    errors.push("authority.tls", e.message().trim().to_string());
                    None
                }
            });
        let authority = raw_authority
            .and_then(|v| crate::authority::AuthorityConfig::parse(v, base, &mut errors.0))
            .map(|mut a| {
                a.tls = authority_tls;
                a
            });
        if let Some(a) = &authority {
            for (other, key) in [
                (server.listen, "server.listen"),
                (admin.listen, "admin.listen"),
            ] {
                if overlaps(a.listen, other) {
                    errors.push(
                        "authority.listen",
                        format!(
                            "{} is also {key} ({other}): the authority needs a listener of its own",
                            a.listen
                        ),
                    );
                }
            }
        }
        let raw_routes = array(table.remove("route"), "route", &mut errors);
        // An authority-only process needs no routes; a proxy without routes is a mistake.
        // (An [authority] table with errors has its own; it is no reason to ask for routes.)
        if raw_routes.is_empty() && !has_authority {
            errors.push("route", "no routes: every request would get 404 no_route");
        }
        let mut routes: Vec<Route> = Vec::new();
        // Position in the file of each validated route, for error paths.
        let mut positions: Vec<usize> = Vec::new();
        let mut names = std::collections::HashSet::new();
        for (i, v) in raw_routes.into_iter().enumerate() {
            let path = format!("route[{i}]");
            let Some(raw) = section::<RawRoute>(Some(v), &path, &mut errors) else {
                continue;
            };
            if !names.insert(raw.name.clone()) {
                errors.push(
                    format!("{path}.name"),
                    format!("`{}` is defined twice", raw.name),
                );
            }
            if raw.proof.as_deref() == Some("required")
                && fencing.proof_keys.is_empty()
                && !errors
                    .0
                    .iter()
                    .any(|e| e.path.starts_with("fencing.proof_keys"))
            {
                errors.push(
                    format!("{path}.proof"),
                    "\"required\" needs [fencing] proof_keys: no proof could pass",
                );
            }
            if let Some(route) = validate_route(raw, &path, &upstreams, &mut errors) {
                routes.push(route);
                positions.push(i);
            }
        }
        for (i, r) in routes.iter().enumerate() {
            if let Some(e) = routes[..i]
                .iter()
                .find(|e| (e.host.is_none() || e.host == r.host) && r.path.is_covered_by(&e.path))
            {
                errors.push(
                    format!("route[{}]", positions[i]),
                    format!(
                        "route `{}` can never match: route `{}` ({}) comes first and matches every path it does",
                        r.name, e.name, e.path
                    ),
                );
            }
        }

        if errors.0.is_empty() {
            Ok(Config {
                server,
                admin,
                store,
                fencing,
                upstreams,
                routes,
                idempotency,
                authority,
                log,
            })
        } else {
            Err(ConfigErrors(errors.0))
        }
    }

    /// A short human description of what was understood, for `check-config`.
    /// What the file allows but is likely a mistake: printed by `check-config`, logged at
    /// start-up.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (i, r) in self.routes.iter().enumerate() {
            if !r.fenced {
                continue;
            }
            if r.equal == EqualPolicy::Reject && r.idempotency != crate::idempotency::Mode::Off {
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
        if let Some(a) = &self.authority {
            let backend = match &a.backend {
                crate::authority::Backend::Local => "local".to_string(),
                crate::authority::Backend::Etcd { endpoints } => {
                    format!("etcd ({})", endpoints.join(", "))
                }
            };
            out.push_str(&format!(
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
            ));
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
                "upstream {:<12} {} (timeout {:?}){}\n",
                u.name,
                u.url,
                u.timeout,
                u.tls.as_ref().map(|t| format!(" {t}")).unwrap_or_default()
            ));
        }
        for r in &self.routes {
            let fenced = if !r.fenced {
                "pass-through (unfenced)".to_string()
            } else {
                let methods = match &r.methods {
                    Some(m) => m.iter().map(Method::as_str).collect::<Vec<_>>().join(","),
                    None => "all but GET,HEAD,OPTIONS,TRACE".into(),
                };
                format!(
                    "scope {:?}{} · fenced methods: {methods} · equal={}{}",
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
                    }
                )
            };
            out.push_str(&format!(
                "route {:<12} {}{} -> {} · {fenced}\n",
                r.name,
                r.host
                    .as_ref()
                    .map(|h| format!("host {h} "))
                    .unwrap_or_default(),
                r.path,
                self.upstreams[r.upstream].name,
            ));
        }
        out
    }
}

/// Would two listeners on these addresses collide at bind (the same port on the same
/// address, or on a wildcard address)? Port 0 (any free port) never collides.
fn overlaps(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() != 0
        && a.port() == b.port()
        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

fn array(value: Option<toml::Value>, path: &str, errors: &mut Errors) -> Vec<toml::Value> {
    match value {
        None => Vec::new(),
        Some(toml::Value::Array(a)) => a,
        Some(_) => {
            errors.push(path, format!("must be an array of tables: [[{path}]]"));
            Vec::new()
        }
    }
}

fn validate_upstream(raw: RawUpstream, path: &str, base: &Path, errors: &mut Errors) -> Upstream {
    let timeout = duration(
        raw.timeout.as_deref(),
        Duration::from_secs(30),
        &format!("{path}.timeout"),
        errors,
    );
    let url = match raw.url.parse::<Uri>() {
        Ok(u) if matches!(u.scheme_str(), Some("http" | "https")) && u.authority().is_some() => {
            if u.path() != "/" && !u.path().is_empty() || u.query().is_some() {
                errors.push(
                    format!("{path}.url"),
                    "give scheme and authority only; the request path is forwarded as received",
                );
            }
            u
        }
        _ => {
            errors.push(
                format!("{path}.url"),
                format!("`{}` is not an http:// or https://host:port URL", raw.url),
            );
            Uri::from_static("http://invalid")
        }
    };
    let https = url.scheme_str() == Some("https");
    let tls = crate::tls::upstream_tls(raw.tls, https, base, path, &mut errors.0);
    Upstream {
        name: raw.name,
        url,
        timeout,
        tls,
    }
}

fn validate_route(
    raw: RawRoute,
    path: &str,
    upstreams: &[Upstream],
    errors: &mut Errors,
) -> Option<Route> {
    let before = errors.0.len();
    if raw.name == crate::metrics::UNROUTED {
        errors.push(
            format!("{path}.name"),
            format!(
                "`{}` is reserved: it labels the metrics of requests that matched no route",
                raw.name
            ),
        );
    }
    let template = PathTemplate::parse(&raw.path)
        .map_err(|e| errors.push(format!("{path}.path"), format!("`{}` {e}", raw.path)))
        .ok();
    let fenced = raw.fenced.unwrap_or(true);
    let scope = match (&template, &raw.scope) {
        (Some(t), Some(s)) => ScopeTemplate::parse(s, t)
            .map_err(|e| errors.push(format!("{path}.scope"), e))
            .ok(),
        (Some(t), None) if !fenced => ScopeTemplate::parse("-", t).ok(),
        (_, None) => {
            errors.push(
                format!("{path}.scope"),
                "missing: a fenced route needs a scope template",
            );
            None
        }
        (None, Some(_)) => None,
    };
    let upstream = upstreams.iter().position(|u| u.name == raw.upstream);
    if upstream.is_none() {
        errors.push(
            format!("{path}.upstream"),
            format!("no upstream named `{}`", raw.upstream),
        );
    }
    // Kept as the router compares it: lowercase, without a trailing dot.
    let host = raw.host.map(|h| {
        let h = h.to_ascii_lowercase();
        let bare = h.strip_suffix('.').unwrap_or(&h);
        if crate::route::host_of(&h) != Ok(bare) {
            errors.push(
                format!("{path}.host"),
                "must be a host name without scheme, port or path",
            );
        }
        bare.to_string()
    });
    // An empty list would fence no method: an implicit pass-through (SPEC §2).
    if fenced && raw.methods.as_ref().is_some_and(Vec::is_empty) {
        errors.push(
            format!("{path}.methods"),
            format!(
                "empty on fenced route `{}`: no method would need a token; \
                 write `fenced = false` for a pass-through route",
                raw.name
            ),
        );
    }
    let methods = raw.methods.map(|list| {
        list.iter()
            .filter_map(|m| match Method::from_bytes(m.as_bytes()) {
                Ok(method) if m.chars().all(|c| c.is_ascii_uppercase()) => Some(method),
                _ => {
                    errors.push(
                        format!("{path}.methods"),
                        format!("`{m}` is not an upper-case HTTP method"),
                    );
                    None
                }
            })
            .collect::<Vec<_>>()
    });
    let equal = match raw.equal.as_deref() {
        None | Some("accept") => EqualPolicy::Accept,
        Some("reject") => EqualPolicy::Reject,
        Some(other) => {
            errors.push(
                format!("{path}.equal"),
                format!("`{other}`: expected \"accept\" or \"reject\""),
            );
            EqualPolicy::Accept
        }
    };
    use crate::idempotency::{Mode, OnUnknown};
    let idempotency = match raw.idempotency.as_deref() {
        None | Some("off") => Mode::Off,
        Some("optional") => Mode::Optional,
        Some("required") => Mode::Required,
        Some(other) => {
            errors.push(
                format!("{path}.idempotency"),
                format!("`{other}`: expected \"off\", \"optional\" or \"required\""),
            );
            Mode::Off
        }
    };
    let idempotency_unknown = match raw.idempotency_unknown.as_deref() {
        None | Some("refuse") => OnUnknown::Refuse,
        Some("forward") => OnUnknown::Forward,
        Some(other) => {
            errors.push(
                format!("{path}.idempotency_unknown"),
                format!("`{other}`: expected \"refuse\" or \"forward\""),
            );
            OnUnknown::Refuse
        }
    };
    let proof = match raw.proof.as_deref() {
        None | Some("off") => ProofMode::Off,
        Some("required") if !fenced => {
            errors.push(
                format!("{path}.proof"),
                "only for fenced routes: a pass-through route reads no token",
            );
            ProofMode::Off
        }
        Some("required") => ProofMode::Required,
        Some(other) => {
            errors.push(
                format!("{path}.proof"),
                format!("`{other}`: expected \"off\" or \"required\""),
            );
            ProofMode::Off
        }
    };
    let max_body = raw.max_body.as_deref().and_then(|s| {
        parse_size(s).or_else(|| {
            errors.push(
                format!("{path}.max_body"),
                format!("`{s}` is not a size (e.g. 10MiB)"),
            );
            None
        })
    });
    if errors.0.len() > before {
        return None;
    }
    Some(Route {
        proof,
        max_body,
        idempotency,
        idempotency_unknown,
        name: raw.name,
        path: template?,
        scope: scope?,
        upstream: upstream?,
        host,
        fenced,
        methods,
        equal,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[server]
listen = "127.0.0.1:8080"
[store]
path = "data/x.redb"
[fencing]
drain_timeout = "2s"
[[upstream]]
name = "objects"
url = "http://127.0.0.1:9000"
[[route]]
name = "reports"
path = "/reports/{report}/{*rest}"
scope = "report/{report}"
upstream = "objects"
"#;

    #[test]
    fn good_config() {
        let c = Config::parse(GOOD, Path::new("/etc/fg")).unwrap();
        assert_eq!(c.store.path, Path::new("/etc/fg/data/x.redb"));
        assert_eq!(c.fencing.drain_timeout, Duration::from_secs(2));
        assert_eq!(c.fencing.settle, Duration::from_secs(5));
        assert_eq!(c.routes[0].equal, EqualPolicy::Accept);
        assert!(c.routes[0].fences_method(&Method::PUT));
        assert!(!c.routes[0].fences_method(&Method::GET));
    }

    /// Loading `text` fails with an error at each of `paths` (among others, perhaps).
    fn errors_at(text: &str, paths: &[&str]) -> Vec<ConfigError> {
        let errs = Config::parse(text, Path::new(".")).unwrap_err().0;
        for want in paths {
            assert!(
                errs.iter().any(|e| e.path == *want),
                "missing {want} in {errs:?}"
            );
        }
        errs
    }

    /// Allowed, but likely mistakes: warned about, not refused.
    #[test]
    fn warns_of_shared_scopes_and_pass_through_routes_over_fenced_paths() {
        let routes = r#"
[[route]]
name = "public"
path = "/{x}/{y}/{z}"
upstream = "objects"
fenced = false
[[route]]
name = "kv"
path = "/kv/{bucket}/{*key}"
scope = "kv/{bucket}:{key}"
upstream = "objects"
[[route]]
name = "reports"
path = "/reports/{report}/{*rest}"
scope = "report/{report}"
upstream = "objects"
[[route]]
name = "files"
path = "/files/{a}/{*rest}"
scope = "f/{a}/{rest}"
upstream = "objects"
host = "files.example"
[[route]]
name = "other-host"
path = "/{p}"
upstream = "objects"
fenced = false
host = "other.example"
[[route]]
name = "top"
path = "/{q}"
scope = "top/{q}"
upstream = "objects"
equal = "reject"
idempotency = "optional"
"#;
        let text = GOOD
            .split("[[route]]")
            .next()
            .unwrap_or_default()
            .to_string()
            + routes;
        let c = Config::parse(&text, Path::new(".")).expect("a config with warnings loads");
        let w = c.warnings();
        let has = |needle: &str| w.iter().any(|x| x.contains(needle));
        assert!(
            has("route `kv`: scope `kv/{bucket}:{key}` joins captures `bucket` and `key`"),
            "{w:#?}"
        );
        assert!(
            has("route `kv` is fenced, but pass-through route `public`"),
            "{w:#?}"
        );
        assert!(has("(such as /kv/a/a)"), "{w:#?}");
        assert!(
            has(
                "route `reports` is fenced, but pass-through route `public` (/{x}/{y}/{z}) comes first and takes some of its paths (such as /reports/a/a)"
            ),
            "{w:#?}"
        );
        assert!(
            has("route `files` is fenced, but pass-through route `public`"),
            "{w:#?}"
        );
        // A pass-through route for one host takes that host's paths of a route for all.
        assert!(
            has(
                "route `top` is fenced, but pass-through route `other-host` (/{p}) comes first and takes some of its paths (such as /a)"
            ),
            "{w:#?}"
        );
        // Another host (`files` after `other-host`), or no common path (`top` after
        // `public`): nothing to say.
        assert!(
            has("route `top`: idempotency with equal = \"reject\""),
            "{w:#?}"
        );
        assert_eq!(w.len(), 6, "{w:#?}");
        assert!(
            Config::parse(GOOD, Path::new("."))
                .unwrap()
                .warnings()
                .is_empty()
        );
    }

    #[test]
    fn the_buffered_budget_holds_at_least_one_request_body() {
        let text = format!(
            "{GOOD}\n[idempotency]\nmax_request_body = \"1MiB\"\nmax_buffered = \"512KiB\"\n"
        );
        errors_at(&text, &["idempotency.max_buffered"]);
        let text = text.replace("512KiB", "1MiB");
        let c = Config::parse(&text, Path::new(".")).expect("equal is enough");
        assert_eq!(c.idempotency.max_buffered, 1 << 20);
        let c = Config::parse(GOOD, Path::new(".")).unwrap();
        assert_eq!(c.idempotency.max_buffered, 128 << 20);
    }

    #[test]
    fn collects_every_error_with_its_path() {
        let bad = r#"
bogus = 1
[fencing]
settle = "soon"
[[upstream]]
name = "u"
url = "ftp://x"
[[route]]
name = "a"
path = "/a/{x}"
scope = "a/{y}"
upstream = "nope"
equal = "maybe"
[[route]]
name = "b"
path = "/b"
scope = "b"
upstream = "u"
colour = "red"
"#;
        let errs = errors_at(
            bad,
            &[
                "bogus",
                "store",
                "fencing.settle",
                "upstream[0].url",
                "route[0].scope",
                "route[0].upstream",
                "route[0].equal",
                "route[1]",
            ],
        );
        assert!(errs.iter().any(|e| e.message.contains("colour")));
    }

    /// A route's host is kept as the router compares it; one it could never match (a
    /// port, a path, userinfo) is refused.
    #[test]
    fn route_hosts_are_bare_host_names() {
        let with = |h: &str| {
            GOOD.replace(
                "name = \"reports\"",
                &format!("name = \"reports\"\nhost = \"{h}\""),
            )
        };
        let c = Config::parse(&with("Files.Internal."), Path::new(".")).unwrap();
        assert_eq!(c.routes[0].host.as_deref(), Some("files.internal"));
        let c = Config::parse(&with("[::1]"), Path::new(".")).unwrap();
        assert_eq!(c.routes[0].host.as_deref(), Some("[::1]"));
        for bad in [
            "",
            "files.internal:8080",
            "files.internal/x",
            "u@files.internal",
            "a b",
        ] {
            errors_at(&with(bad), &["route[0].host"]);
        }
    }

    /// Values so large that a deadline or a semaphore built from them would panic at run
    /// time are refused when the file is loaded (and so by `check-config`).
    #[test]
    fn durations_and_counts_are_bounded() {
        let huge = GOOD
            .replace(
                "drain_timeout = \"2s\"",
                "drain_timeout = \"2s\"\nsettle = \"18446744073709551615s\"\nmax_waiters_per_scope = 4294967297",
            )
            .replace(
                "listen = \"127.0.0.1:8080\"",
                "listen = \"127.0.0.1:8080\"\nmax_connections = 4611686018427387904\nshutdown_timeout = \"367d\"",
            );
        errors_at(
            &huge,
            &[
                "fencing.settle",
                "fencing.max_waiters_per_scope",
                "server.max_connections",
                "server.shutdown_timeout",
            ],
        );
        let authority = format!("{GOOD}\n[authority]\nmax_ttl = \"400000000000y\"\n");
        errors_at(&authority, &["authority.max_ttl"]);
        let edge = GOOD.replace(
            "drain_timeout = \"2s\"",
            "drain_timeout = \"366d\"\nmax_waiters_per_scope = 4294967296",
        );
        let c = Config::parse(&edge, Path::new(".")).expect("the largest values load");
        assert_eq!(
            c.fencing.drain_timeout,
            Duration::from_secs(366 * 24 * 3600)
        );
        assert_eq!(c.fencing.max_waiters_per_scope, 1 << 32);
    }

    /// `none` labels the metrics of requests that matched no route: a route of that name
    /// would share their row.
    #[test]
    fn a_route_named_none_is_refused() {
        let errs = errors_at(
            &GOOD.replace("name = \"reports\"", "name = \"none\""),
            &["route[0].name"],
        );
        assert!(
            errs.iter().any(|e| e.message.contains("reserved")),
            "{errs:?}"
        );
        // Other names, quotes and backslashes included, are fine (metrics escape them).
        let odd = GOOD.replace("name = \"reports\"", r#"name = "none \"2\" \\ x""#);
        Config::parse(&odd, Path::new(".")).expect("an odd name loads");
    }

    #[test]
    fn admin_off_loopback_needs_a_token() {
        let text = format!("{GOOD}\n[admin]\nlisten = \"0.0.0.0:9090\"\n");
        let errs = Config::parse(&text, Path::new(".")).unwrap_err().0;
        assert!(errs.iter().any(|e| e.path == "admin.listen"), "{errs:?}");
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("t"), "secret").unwrap();
        let text = format!("{GOOD}\n[admin]\nlisten = \"0.0.0.0:9090\"\ntoken_file = \"t\"\n");
        let c = Config::parse(&text, dir.path()).unwrap();
        assert_eq!(c.admin.token.as_deref(), Some("secret"));
    }

    #[test]
    fn the_admin_api_listens_apart_from_the_proxy() {
        for listen in ["127.0.0.1:8080", "0.0.0.0:8080"] {
            let text = format!("{GOOD}\n[admin]\nlisten = \"{listen}\"\ntoken_file = \"t\"\n");
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join("t"), "secret").unwrap();
            let errs = Config::parse(&text, dir.path()).unwrap_err().0;
            assert_eq!(errs.len(), 1, "{errs:?}");
            assert_eq!(errs[0].path, "admin.listen");
            assert!(errs[0].message.contains("server.listen"), "{errs:?}");
        }
        let other = format!("{GOOD}\n[admin]\nlisten = \"127.0.0.1:8081\"\n");
        Config::parse(&other, Path::new(".")).expect("another port");
    }

    /// A fenced route must fence something: an empty `methods` list would let every
    /// tokenless request through unchecked, an implicit pass-through (SPEC §2).
    #[test]
    fn a_fenced_route_needs_a_fenced_method() {
        let empty = format!("{GOOD}methods = []\n");
        let errs = errors_at(&empty, &["route[0].methods"]);
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert!(errs[0].message.contains("`reports`"), "{errs:?}");
        assert!(errs[0].message.contains("fenced = false"), "{errs:?}");
        // Said explicitly, a pass-through is fine; so is a list naming any method.
        let open = format!("{GOOD}fenced = false\nmethods = []\n");
        Config::parse(&open, Path::new(".")).expect("an explicit pass-through");
        let one = format!("{GOOD}methods = [\"PUT\"]\n");
        let c = Config::parse(&one, Path::new(".")).expect("one fenced method");
        assert!(c.routes[0].fences_method(&Method::PUT));
        assert!(!c.routes[0].fences_method(&Method::POST));
    }

    #[test]
    fn the_authority_listens_apart() {
        for listen in ["127.0.0.1:8080", "127.0.0.1:9090", "0.0.0.0:8080"] {
            let text = format!("{GOOD}\n[authority]\nlisten = \"{listen}\"\n");
            let errs = errors_at(&text, &["authority.listen"]);
            assert!(
                errs.iter().any(|e| e.message.contains("of its own")),
                "{errs:?}"
            );
        }
        // Any free port (0) is no collision; another port is none either.
        let ports = GOOD.replace("127.0.0.1:8080", "127.0.0.1:0")
            + "\n[admin]\nlisten = \"127.0.0.1:0\"\n[authority]\nlisten = \"127.0.0.1:0\"\n";
        Config::parse(&ports, Path::new(".")).expect("port 0 everywhere");
        let other = format!("{GOOD}\n[authority]\nlisten = \"127.0.0.1:7070\"\n");
        Config::parse(&other, Path::new(".")).expect("another port");
    }

    #[test]
    fn an_open_authority_needs_clients_and_their_files() {
        let dir = tempfile::tempdir().expect("dir");
        std::fs::write(dir.path().join("a.token"), "s").expect("token");
        std::fs::write(dir.path().join("empty.token"), " \n").expect("token");
        let parse = |extra: &str| {
            let text = format!("{GOOD}\n[authority]\nlisten = \"0.0.0.0:7070\"\n{extra}");
            Config::parse(&text, dir.path())
        };
        let errs = parse("").unwrap_err().0;
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].path, "authority.listen");
        assert!(errs[0].message.contains("[[authority.client]]"), "{errs:?}");
        let client =
            "[[authority.client]]\nname = \"a\"\ntoken_file = \"a.token\"\nscopes = [\"r/*\"]\n";
        let c = parse(client).expect("with a client");
        let clients = &c.authority.as_ref().expect("authority").clients;
        assert_eq!(clients[0].name, "a");
        assert!(clients[0].allows("r/x") && !clients[0].allows("q"));
        assert!(!format!("{:?}", c.authority).contains("secret_digest"));
        let bad = "[[authority.client]]\nname = \"a\"\ntoken_file = \"empty.token\"\nscopes = []\n\
                   [[authority.client]]\nname = \"a\"\ntoken_file = \"gone\"\nscopes = [\"x**\", \"a*b\"]\ncolour = 1\n";
        let errs = parse(bad).unwrap_err().0;
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert!(paths.contains(&"authority"), "{paths:?}");
        let bad = "signing_key = \"nokey\"\n\
                   [[authority.client]]\nname = \"a\"\ntoken_file = \"empty.token\"\nscopes = []\n\
                   [[authority.client]]\nname = \"a\"\ntoken_file = \"gone\"\nscopes = [\"x**\", \"a*b\"]\n";
        let errs = parse(bad).unwrap_err().0;
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        for p in [
            "authority.signing_key",
            "authority.client[0].token_file",
            "authority.client[0].scopes",
            "authority.client[1].name",
            "authority.client[1].token_file",
            "authority.client[1].scopes[0]",
            "authority.client[1].scopes[1]",
        ] {
            assert!(paths.contains(&p), "{p} in {paths:?}");
        }
    }

    #[test]
    fn required_proofs_need_keys() {
        let dir = tempfile::tempdir().expect("dir");
        let required = format!("{GOOD}proof = \"required\"\n");
        let errs = Config::parse(&required, dir.path()).unwrap_err().0;
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].path, "route[0].proof");
        assert!(errs[0].message.contains("proof_keys"), "{errs:?}");
        let maybe = format!("{GOOD}proof = \"maybe\"\n");
        assert_eq!(
            Config::parse(&maybe, dir.path()).unwrap_err().0[0].path,
            "route[0].proof"
        );
        crate::proof::keygen(&dir.path().join("k")).expect("keygen");
        let with_keys = required.replace("[fencing]\n", "[fencing]\nproof_keys = [\"k.pub\"]\n");
        let c = Config::parse(&with_keys, dir.path()).expect("keys and a required route");
        assert_eq!(c.routes[0].proof, ProofMode::Required);
        assert!(c.describe().contains("equal=accept · proof required"));
        assert!(!c.fencing.proof_keys.is_empty());
        // A key that cannot be read is its own error, not also the route's.
        let missing = with_keys.replace("k.pub", "gone.pub");
        let errs = Config::parse(&missing, dir.path()).unwrap_err().0;
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].path, "fencing.proof_keys[0]");
        let secret = with_keys.replace("k.pub", "k.key");
        assert_eq!(
            Config::parse(&secret, dir.path()).unwrap_err().0[0].path,
            "fencing.proof_keys[0]"
        );
    }

    /// An authority-only file whose [authority] table has an error reports that error,
    /// not also a missing route.
    #[test]
    fn a_bad_authority_table_is_not_also_a_missing_route() {
        let text = "[store]\npath = \"x.redb\"\n[authority]\nbackend = \"zookeeper\"\n";
        let errs = errors_at(text, &["authority.backend"]);
        assert_eq!(errs.len(), 1, "{errs:?}");
        let text = "[store]\npath = \"x.redb\"\n[authority]\ncolour = \"red\"\n";
        let errs = errors_at(text, &["authority"]);
        assert_eq!(errs.len(), 1, "{errs:?}");
        // Without [authority], no routes is an error.
        errors_at("[store]\npath = \"x.redb\"\n", &["route"]);
    }

    #[test]
    fn describe_shows_the_authority() {
        let c = Config::parse(GOOD, Path::new(".")).unwrap();
        assert!(!c.describe().contains("authority"));
        let text = format!(
            "{GOOD}\n[authority]\nlisten = \"127.0.0.1:7070\"\nbackend = \"etcd\"\n\
             etcd_endpoints = [\"http://10.0.0.1:2379\", \"http://10.0.0.2:2379\"]\nlock_delay = \"2s\"\n"
        );
        let c = Config::parse(&text, Path::new(".")).unwrap();
        assert!(
            c.describe().contains(
                "authority 127.0.0.1:7070 · backend etcd (http://10.0.0.1:2379, http://10.0.0.2:2379) · max_ttl 1m · lock_delay 2s\n"
            ),
            "{}",
            c.describe()
        );
        let text = format!("{GOOD}\n[authority]\n");
        let c = Config::parse(&text, Path::new(".")).unwrap();
        assert!(
            c.describe()
                .contains("authority 127.0.0.1:7070 · backend local"),
            "{}",
            c.describe()
        );
    }

    #[test]
    fn shadowed_routes_are_errors() {
        let text = format!(
            "{GOOD}\n[[route]]\nname = \"late\"\npath = \"/reports/july/{{*rest}}\"\nscope = \"x\"\nupstream = \"objects\"\n"
        );
        let errs = Config::parse(&text, Path::new(".")).unwrap_err().0;
        assert!(errs[0].message.contains("can never match"), "{errs:?}");
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]

            /// Arbitrary text never panics the loader.
            #[test]
            fn arbitrary_text_never_panics(text in "\\PC{0,300}") {
                let _ = Config::parse(&text, Path::new("."));
            }

            /// A good file with a random splice (the shape fuzzers find bugs with) either
            /// loads or reports errors with paths; it never panics.
            #[test]
            fn spliced_config_never_panics(at in 0usize..GOOD.len(), insert in "[\\[\\]{}=\"a-z0-9_./*:, \n]{0,24}") {
                let mut text = GOOD.to_string();
                let at = (0..=at).rev().find(|i| text.is_char_boundary(*i)).unwrap_or(0);
                text.insert_str(at, &insert);
                if let Err(errors) = Config::parse(&text, Path::new(".")) {
                    prop_assert!(!errors.0.is_empty());
                }
            }

            /// Random path and scope templates never panic, and an accepted scope template
            /// only names captures of its path.
            #[test]
            fn random_templates(path in "/[a-z{}*/]{0,20}", scope in "[a-z{}/]{0,12}") {
                if let Ok(p) = PathTemplate::parse(&path)
                    && let Ok(st) = ScopeTemplate::parse(&scope, &p)
                {
                    let _ = st.is_constant();
                }
            }
        }
    }
}
