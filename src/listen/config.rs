//! `[server]`: the proxy listener and its limits. Its raw and validated types live here
//! until the listener code has a folder of its own to take them.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::config::error::{Errors, Place};
use crate::config::value::{duration, positive, size, socket_addr};
use crate::tls::{ListenerFiles, RawListenerTls};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// Threads serving the proxy listener, each running its connections start to end.
    pub workers: usize,
    /// Bound on how long SIGTERM waits for in-flight requests before exiting anyway.
    pub shutdown_timeout: Duration,
    /// Open client connections, in total and per client IP; more are closed at accept.
    pub max_connections: usize,
    pub max_connections_per_ip: usize,
    /// Descriptors one client may hold: its connections count two each (the connection
    /// and the upstream connection its request may hold), its open HTTP/2 streams one
    /// each. `None`: half the process's budget of descriptors (see `rt::fds`).
    pub max_descriptors_per_ip: Option<usize>,
    /// Time allowed to send a request head (slowloris); also bounds idle keep-alive.
    pub header_read_timeout: Duration,
    /// Time a client may take none of its answer (no write to it makes progress, or an
    /// HTTP/2 stream gets no window) before its connection is closed.
    pub send_timeout: Duration,
    /// Largest request head in bytes, and most header lines; beyond: 431.
    pub max_header_bytes: usize,
    pub max_headers: usize,
    /// Concurrent streams of one HTTP/2 connection; each may hold one upstream
    /// connection, so this bounds those per client connection too.
    pub max_concurrent_streams: u32,
    /// Peers whose X-Forwarded-* headers are kept (and appended to); from anyone else
    /// they are stripped, since a client could claim any address or scheme.
    pub trusted_proxies: Vec<IpNet>,
    /// `tls = { cert, key, client_ca }`: serve HTTPS (h2 by ALPN) instead of plain HTTP;
    /// with `client_ca`, only clients holding a certificate from it get through.
    pub tls: Option<ListenerFiles>,
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

/// More proxy threads than this is a typo, not a machine.
const MAX_WORKERS: usize = 1024;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawServer {
    listen: Option<String>,
    workers: Option<usize>,
    shutdown_timeout: Option<String>,
    max_connections: Option<usize>,
    max_connections_per_ip: Option<usize>,
    max_descriptors_per_ip: Option<usize>,
    header_read_timeout: Option<String>,
    send_timeout: Option<String>,
    max_header_bytes: Option<String>,
    max_headers: Option<usize>,
    max_concurrent_streams: Option<usize>,
    trusted_proxies: Option<Vec<String>>,
    tls: Option<RawListenerTls>,
}

/// `[server]` as parsed: its listener's TLS files are named, not read yet.
#[derive(Debug)]
pub(crate) struct ServerDraft {
    config: ServerConfig,
    tls_at: Place,
}

impl ServerDraft {
    pub(crate) fn listen(&self) -> SocketAddr {
        self.config.listen
    }

    /// Reads the listener's TLS files.
    pub(crate) fn load(self, errors: &mut Errors) -> ServerConfig {
        let mut config = self.config;
        config.tls = config
            .tls
            .and_then(|files| crate::tls::check_listener_files(files, self.tls_at, errors));
        config
    }
}

/// `server.max_concurrent_streams` by default (nginx's `http2_max_concurrent_streams`).
pub const DEFAULT_STREAMS: u32 = 128;
/// The most `server.max_concurrent_streams` may be: what one connection may then hold in
/// memory and upstream connections is already more than a client needs.
pub const MAX_STREAMS: u32 = 1024;

/// Validates `[server]`; relative paths are resolved against `base`.
pub(crate) fn parse(server: RawServer, base: &Path, errors: &mut Errors) -> ServerDraft {
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
    let max_connections = positive(
        server.max_connections,
        10_000,
        "server.max_connections",
        errors,
    );
    let config = ServerConfig {
        listen: socket_addr(
            server.listen.as_deref(),
            "127.0.0.1:8080",
            "server.listen",
            errors,
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
                errors,
            ),
        },
        shutdown_timeout: duration(
            server.shutdown_timeout.as_deref(),
            Duration::from_secs(30),
            "server.shutdown_timeout",
            errors,
        ),
        max_connections,
        max_connections_per_ip: positive(
            server.max_connections_per_ip,
            // A tenth of the total (1000 of the default 10000): one address alone
            // cannot take every slot.
            (max_connections / 10).clamp(1, 1_000),
            "server.max_connections_per_ip",
            errors,
        ),
        max_descriptors_per_ip: match server.max_descriptors_per_ip {
            // At least a connection's worth.
            Some(n) if n < 2 => {
                errors.push("server.max_descriptors_per_ip", "must be at least 2");
                None
            }
            n => n.map(|n| positive(Some(n), n, "server.max_descriptors_per_ip", errors)),
        },
        header_read_timeout: duration(
            server.header_read_timeout.as_deref(),
            Duration::from_secs(10),
            "server.header_read_timeout",
            errors,
        ),
        send_timeout: duration(
            server.send_timeout.as_deref(),
            Duration::from_secs(60),
            "server.send_timeout",
            errors,
        ),
        max_header_bytes: size(
            server.max_header_bytes.as_deref(),
            64 << 10,
            "server.max_header_bytes",
            errors,
        )
        .max(8192) as usize,
        max_headers: positive(server.max_headers, 100, "server.max_headers", errors),
        max_concurrent_streams: match server.max_concurrent_streams {
            Some(n) if n > MAX_STREAMS as usize => {
                errors.push(
                    "server.max_concurrent_streams",
                    format!("must be at most {MAX_STREAMS}"),
                );
                DEFAULT_STREAMS
            }
            n => u32::try_from(positive(
                n,
                DEFAULT_STREAMS as usize,
                "server.max_concurrent_streams",
                errors,
            ))
            .unwrap_or(DEFAULT_STREAMS),
        },
        trusted_proxies,
        tls: server
            .tls
            .map(|raw| crate::tls::listener_files(raw, base, "server.tls")),
    };
    ServerDraft {
        config,
        tls_at: errors.place(),
    }
}
