//! A real nginx on loopback for end-to-end tests and benchmark baselines.
//!
//! Each [`Nginx`] owns a private prefix directory (a [`tempfile::TempDir`]) that
//! holds *everything* nginx writes: the config, pid file, lock file, error log,
//! every `*_temp_path`, and (for [`Nginx::webdav`]) the document root. Nothing
//! touches `/etc/nginx`, `/var/log/nginx`, `/var/lib/nginx` or `/run`, so any
//! number of instances can run in parallel next to a system nginx.
//!
//! The integration tests reach it as `support::nginx` (`tests/it/support/mod.rs` includes
//! it by path); the load bench and the lockset example include it by path too:
//!
//! ```ignore
//! #[path = "../tests/it/support/nginx.rs"]
//! mod nginx;
//! ```
//!
//! Only `std` and `tempfile` are used, so the module can be included by any
//! integration test or bench without extra dependencies. Signals are sent with
//! the `kill(1)` utility because `std` cannot send SIGTERM.

use std::fmt::Write as _;
use std::fs;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// Where Debian's `nginx` package installs the binary.
const NGINX_BIN: &str = "/usr/sbin/nginx";
/// How many fresh ports to try when nginx loses the bind race for a port.
const MAX_START_ATTEMPTS: usize = 5;
/// Upper bound on waiting for nginx to start listening.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// Poll interval for readiness and shutdown loops.
const POLL_STEP: Duration = Duration::from_millis(20);
/// Upper bound on a graceful (SIGTERM) shutdown before escalating to SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// Upper bound on reaping after SIGKILL.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);
/// `worker_processes` used by [`Nginx::webdav`] and [`Nginx::null`].
const DEFAULT_WORKERS: usize = 1;

/// A running nginx master process listening on `127.0.0.1:<port>`.
///
/// Dropping it stops nginx (SIGTERM, then SIGKILL as a last resort), reaps the
/// master (which only exits after its workers are gone) and removes the prefix
/// directory, so no process, socket or file outlives the value.
pub struct Nginx {
    child: Child,
    port: u16,
    root: PathBuf,
    // Fields are dropped after `Drop::drop` has stopped nginx, so the prefix
    // is only removed once nothing writes to it any more.
    prefix: TempDir,
}

/// Which server block to generate.
enum Kind {
    WebDav,
    Null,
    ProxyPass {
        upstream_port: u16,
    },
    /// A client's stand-in for clients that cannot add a header (litmus): every request
    /// passed on to `upstream_port` with `Fencing-Token: {token}` and its own Host.
    TokenFront {
        upstream_port: u16,
        token: u64,
    },
    /// [`Kind::ProxyPass`] behind TLS (and HTTP/2 by ALPN) with this certificate.
    TlsProxyPass {
        upstream_port: u16,
        tls: Tls,
    },
}

/// The certificate of [`Nginx::tls_proxy_pass`], and whether sessions resume.
pub struct Tls {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// Its PEM private key.
    pub key: PathBuf,
    /// Session tickets on (nginx's default); off: every handshake is a full one
    /// (`ssl_session_tickets off; ssl_session_cache off;`).
    pub resumption: bool,
}

impl Nginx {
    /// nginx as a legacy WebDAV object store: GET/HEAD serve files from a root dir,
    /// `dav_methods PUT DELETE MKCOL COPY MOVE; create_full_put_path on;` No conditional writes.
    ///
    /// This is the "destination" a fencing proxy protects: nginx accepts every
    /// PUT/DELETE unconditionally (it ignores `If-Match`/`If-None-Match` on
    /// writes), so stale writers are only stopped if something in front of it
    /// rejects them. Files PUT through it land under [`Nginx::root`].
    pub fn webdav() -> io::Result<Nginx> {
        Self::start(&Kind::WebDav, DEFAULT_WORKERS)
    }

    /// nginx in front of `upstream_port` adding `Fencing-Token: {token}` to every request
    /// and passing the client's Host on (so that a WebDAV `Destination` names the host
    /// the backend sees): for clients that cannot send a header of their own.
    pub fn token_front(upstream_port: u16, token: u64) -> io::Result<Nginx> {
        Self::start(
            &Kind::TokenFront {
                upstream_port,
                token,
            },
            1,
        )
    }

    /// nginx answering `return 204;` to every request (a null backend to expose proxy overhead).
    ///
    /// The backend does no work at all, so a benchmark through a proxy in front
    /// of it measures the proxy, not the backend.
    pub fn null() -> io::Result<Nginx> {
        Self::start(&Kind::Null, DEFAULT_WORKERS)
    }

    /// nginx as a reverse proxy: `proxy_pass http://127.0.0.1:{upstream_port}` with a keepalive
    /// upstream block (keepalive 64; proxy_http_version 1.1; proxy_set_header Connection "";),
    /// `worker_processes {workers}`. Baseline for benchmarks.
    ///
    /// This is what a well-tuned "plain" reverse proxy costs, so fencegate's
    /// overhead can be compared against it. `workers` must be at least 1.
    pub fn proxy_pass(upstream_port: u16, workers: usize) -> io::Result<Nginx> {
        if workers == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "Nginx::proxy_pass: workers must be at least 1",
            ));
        }
        if upstream_port == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "Nginx::proxy_pass: upstream_port must not be 0",
            ));
        }
        Self::start(&Kind::ProxyPass { upstream_port }, workers)
    }

    /// [`Nginx::proxy_pass`] over TLS 1.2 and 1.3 (`listen … ssl http2`: HTTP/1.1 or h2
    /// by ALPN) with `tls`'s certificate. Baseline for TLS benchmarks.
    pub fn tls_proxy_pass(upstream_port: u16, workers: usize, tls: Tls) -> io::Result<Nginx> {
        if workers == 0 || upstream_port == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "Nginx::tls_proxy_pass: workers and upstream_port must not be 0",
            ));
        }
        Self::start(&Kind::TlsProxyPass { upstream_port, tls }, workers)
    }

    /// The loopback port nginx listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:port`; nginx listens on loopback only.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, self.port))
    }

    /// The WebDAV document root (files PUT through nginx land here). Only meaningful for webdav().
    ///
    /// The directory exists for every kind (inside the prefix), it is simply
    /// never served by [`Nginx::null`] or [`Nginx::proxy_pass`].
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// PID of the nginx master process, so tests can verify that dropping the
    /// value really stopped it (e.g. by checking `/proc/<pid>`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Starts nginx, retrying with a fresh port when the port was taken
    /// between probing it and nginx binding it.
    fn start(kind: &Kind, workers: usize) -> io::Result<Nginx> {
        let bin = find_nginx()?;
        let mut last_error = None;
        for _ in 0..MAX_START_ATTEMPTS {
            match Self::try_start(&bin, kind, workers)? {
                Attempt::Ready(nginx) => return Ok(nginx),
                Attempt::PortTaken(message) => last_error = Some(message),
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!(
                "nginx could not bind a free loopback port after {MAX_START_ATTEMPTS} attempts; \
                 last failure:\n{}",
                last_error.unwrap_or_default()
            ),
        ))
    }

    /// One start attempt in a brand-new prefix. Returns `Ok(PortTaken)` only
    /// for the retryable bind race; any other failure is an `Err`.
    fn try_start(bin: &Path, kind: &Kind, workers: usize) -> io::Result<Attempt> {
        let prefix = tempfile::Builder::new()
            .prefix("fencegate-nginx-")
            .tempdir()
            .map_err(|e| ctx(e, "creating nginx prefix temp dir"))?;
        // TempDir is created 0700. With `user root` (see `render_config`) the
        // workers could traverse it anyway, but keep it traversable so that a
        // config change to an unprivileged worker user cannot silently break.
        set_mode(prefix.path(), 0o755)?;

        let root = prefix.path().join("dav");
        let temp = prefix.path().join("temp");
        for dir in [&root, &temp] {
            fs::create_dir(dir).map_err(|e| ctx(e, format!("creating {}", dir.display())))?;
            set_mode(dir, 0o755)?;
        }

        let conf_path = prefix.path().join("nginx.conf");
        let error_log = prefix.path().join("error.log");
        let stderr_log = prefix.path().join("stderr.log");
        let pid_path = prefix.path().join("nginx.pid");

        // Whether we are root decides the `user` directive. The owner of a
        // file we just created is our effective uid; this avoids libc.
        fs::write(&conf_path, "")
            .map_err(|e| ctx(e, format!("creating {}", conf_path.display())))?;
        let is_root = fs::metadata(&conf_path)
            .map_err(|e| ctx(e, format!("stat {}", conf_path.display())))?
            .uid()
            == 0;

        let port = free_port()?;
        let paths = ConfPaths {
            prefix: prefix.path(),
            root: &root,
            temp: &temp,
            error_log: &error_log,
            pid: &pid_path,
        };
        let config = render_config(kind, workers, port, is_root, &paths)?;
        fs::write(&conf_path, config)
            .map_err(|e| ctx(e, format!("writing {}", conf_path.display())))?;

        let stderr_file = fs::File::create(&stderr_log)
            .map_err(|e| ctx(e, format!("creating {}", stderr_log.display())))?;
        // nginx wants the prefix to end in '/'; it appends one if missing, but
        // be explicit. `-e` redirects the *startup* error log (before the
        // config's `error_log` is applied) away from the compiled-in default.
        let mut prefix_arg = prefix.path().as_os_str().to_owned();
        prefix_arg.push("/");
        let child = Command::new(bin)
            .arg("-p")
            .arg(&prefix_arg)
            .arg("-c")
            .arg(&conf_path)
            .arg("-e")
            .arg(&error_log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr_file))
            .spawn()
            .map_err(|e| ctx(e, format!("spawning {}", bin.display())))?;

        let mut nginx = Nginx {
            child,
            port,
            root,
            prefix,
        };
        match nginx.wait_ready(&pid_path) {
            Ok(()) => Ok(Attempt::Ready(nginx)),
            Err(failure) => {
                let logs = nginx.logs();
                // Dropping `nginx` stops whatever is left and removes the prefix.
                drop(nginx);
                let message = format!("{failure}\n{logs}");
                if failure.exited && logs.contains("Address already in use") {
                    Ok(Attempt::PortTaken(message))
                } else {
                    Err(io::Error::other(message))
                }
            }
        }
    }

    /// Polls until nginx is really serving on our port, bounded by
    /// [`READY_TIMEOUT`].
    ///
    /// A successful TCP connect alone is not proof: if another process stole
    /// the port, the connect reaches *it* while nginx is still retrying
    /// `bind()` (nginx retries for ~2.5 s before giving up). nginx writes its
    /// pid file only after all listening sockets are open, so "pid file holds
    /// our child's pid" + "connect succeeds" + "child still running" together
    /// mean this nginx owns the port.
    fn wait_ready(&mut self, pid_path: &Path) -> Result<(), StartFailure> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let expected_pid = self.child.id().to_string();
        let addr = self.addr();
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => {
                    return Err(StartFailure {
                        exited: true,
                        reason: format!("nginx exited during startup with {status}"),
                    });
                }
                Ok(None) => {}
                Err(e) => {
                    return Err(StartFailure {
                        exited: false,
                        reason: format!("waiting on nginx child failed: {e}"),
                    });
                }
            }
            let pid_ok = fs::read_to_string(pid_path)
                .map(|s| s.trim() == expected_pid)
                .unwrap_or(false);
            if pid_ok && TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(StartFailure {
                    exited: false,
                    reason: format!(
                        "nginx did not become ready on {addr} within {READY_TIMEOUT:?} \
                         (pid file written: {pid_ok})"
                    ),
                });
            }
            thread::sleep(POLL_STEP);
        }
    }

    /// error.log and captured stderr, for error messages.
    fn logs(&self) -> String {
        let mut out = String::new();
        for name in ["error.log", "stderr.log", "nginx.conf"] {
            let path = self.prefix.path().join(name);
            let text = fs::read_to_string(&path)
                .unwrap_or_else(|e| format!("<could not read {}: {e}>", path.display()));
            let _ = write!(out, "--- {name} ---\n{}\n", text.trim_end());
        }
        out
    }

    /// Stops nginx: SIGTERM (fast shutdown: the master signals its workers and
    /// exits only once they are gone), bounded wait, then SIGKILL of the
    /// workers and the master as a last resort. Never panics.
    fn stop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        let pid = self.child.id();
        // `Child::kill` would send SIGKILL to the master only, orphaning the
        // workers, which keep the listening socket open. SIGTERM lets nginx
        // tear itself down properly.
        send_signal("TERM", &[pid]);
        if wait_bounded(&mut self.child, STOP_TIMEOUT) {
            return;
        }
        // Last resort: kill the workers explicitly (they would survive a
        // SIGKILL of the master), then the master.
        let workers = child_pids(pid);
        send_signal("KILL", &workers);
        let _ = self.child.kill();
        if !wait_bounded(&mut self.child, KILL_TIMEOUT) {
            eprintln!("nginx harness: nginx master {pid} did not exit after SIGKILL");
        }
    }
}

impl Drop for Nginx {
    /// Stops nginx and reaps the master; afterwards the `TempDir` field is
    /// dropped, removing the prefix (config, logs, WebDAV root).
    fn drop(&mut self) {
        self.stop();
    }
}

/// Outcome of one start attempt that did not hit a hard error.
enum Attempt {
    Ready(Nginx),
    /// nginx exited because the port was taken; the message has the logs.
    PortTaken(String),
}

/// Why readiness failed.
struct StartFailure {
    /// The child exited by itself (as opposed to a timeout).
    exited: bool,
    reason: String,
}

impl std::fmt::Display for StartFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

/// Paths that go into the generated config.
struct ConfPaths<'a> {
    prefix: &'a Path,
    root: &'a Path,
    temp: &'a Path,
    error_log: &'a Path,
    pid: &'a Path,
}

/// Builds nginx.conf for one instance.
fn render_config(
    kind: &Kind,
    workers: usize,
    port: u16,
    is_root: bool,
    paths: &ConfPaths<'_>,
) -> io::Result<String> {
    let pid = quote(paths.pid)?;
    let lock = quote(&paths.prefix.join("nginx.lock"))?;
    let error_log = quote(paths.error_log)?;
    let temp = |name: &str| quote(&paths.temp.join(name));
    let (body_tmp, proxy_tmp, fastcgi_tmp, uwsgi_tmp, scgi_tmp) = (
        temp("client_body")?,
        temp("proxy")?,
        temp("fastcgi")?,
        temp("uwsgi")?,
        temp("scgi")?,
    );
    let root = quote(paths.root)?;

    // When the master runs as root, workers switch to the `user` directive's
    // account, by default the compiled-in `nobody`. Those workers then cannot
    // traverse the 0700 TempDir or write the root-owned WebDAV root and PUT
    // answers 500 ("Permission denied" on the client body temp file).
    // `user root root;` is the robust fix: it needs no /etc/passwd lookups
    // (minimal containers may lack `nobody`/`nogroup`, Fedora names the group
    // `nobody`), no chown of every directory, and works in user namespaces
    // where 65534 may be unmapped. Running workers as root is acceptable for a
    // loopback-only test server. When not root, `user` must be omitted
    // (nginx would warn and ignore it) and workers run as the caller.
    let user = if is_root { "user root root;\n" } else { "" };

    // Benchmarks through the proxy open many connections; give it headroom.
    let (worker_connections, rlimit) = match kind {
        Kind::ProxyPass { .. } | Kind::TlsProxyPass { .. } => {
            (4096, "worker_rlimit_nofile 16384;\n")
        }
        _ => (1024, ""),
    };

    // nginx 1.22's default `ssl_protocols` lacks TLSv1.3: named, so that clients get
    // the version fencegate negotiates.
    let listen = match kind {
        Kind::TlsProxyPass { tls, .. } => format!(
            "listen 127.0.0.1:{port} ssl http2;
        ssl_protocols TLSv1.2 TLSv1.3;
        ssl_certificate {};
        ssl_certificate_key {};
        # nginx closes a connection after 1,000 requests by default (HTTP/2 with a
        # GOAWAY, which h2load does not follow); fencegate sets no such limit.
        keepalive_requests 1000000;{}",
            quote(&tls.cert)?,
            quote(&tls.key)?,
            if tls.resumption {
                ""
            } else {
                "\n        ssl_session_tickets off;\n        ssl_session_cache off;"
            }
        ),
        _ => format!("listen 127.0.0.1:{port};"),
    };
    let (upstream, location) = match kind {
        Kind::WebDav => (
            String::new(),
            format!(
                "        location / {{
            root {root};
            dav_methods PUT DELETE MKCOL COPY MOVE;
            create_full_put_path on;
            dav_access user:rw group:r all:r;
            client_max_body_size 0;
        }}
"
            ),
        ),
        Kind::Null => (
            String::new(),
            "        location / {
            return 204;
        }
"
            .to_owned(),
        ),
        Kind::TokenFront {
            upstream_port,
            token,
        } => (
            String::new(),
            format!(
                "        location / {{
            proxy_pass http://127.0.0.1:{upstream_port};
            proxy_http_version 1.1;
            proxy_set_header Host $http_host;
            proxy_set_header Fencing-Token {token};
            proxy_request_buffering off;
            client_max_body_size 0;
        }}
"
            ),
        ),
        Kind::ProxyPass { upstream_port } | Kind::TlsProxyPass { upstream_port, .. } => (
            format!(
                "    upstream backend {{
        server 127.0.0.1:{upstream_port};
        keepalive 64;
    }}
"
            ),
            "        location / {
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
            client_max_body_size 0;
        }
"
            .to_owned(),
        ),
    };

    Ok(format!(
        "# Generated by tests/it/support/nginx.rs; everything lives under the prefix.
daemon off;
master_process on;
{user}worker_processes {workers};
{rlimit}pid {pid};
lock_file {lock};
error_log {error_log} warn;

events {{
    worker_connections {worker_connections};
}}

http {{
    access_log off;
    default_type application/octet-stream;
    client_body_temp_path {body_tmp};
    proxy_temp_path {proxy_tmp};
    fastcgi_temp_path {fastcgi_tmp};
    uwsgi_temp_path {uwsgi_tmp};
    scgi_temp_path {scgi_tmp};

{upstream}
    server {{
        {listen}
        server_name _;

{location}    }}
}}
"
    ))
}

/// A path as a double-quoted nginx config string.
///
/// Inside quotes nginx unescapes only `\"`, `\'`, `\\` (and `\t\r\n`), so
/// `"` and `\` are escaped. `$` cannot be escaped at all (`\$` stays literal
/// and `root` would expand `$x` as a variable), so such paths are rejected.
fn quote(path: &Path) -> io::Result<String> {
    let invalid = |why: &str| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "nginx prefix path {} {why}; set TMPDIR to a plain directory",
                path.display()
            ),
        )
    };
    let s = path.to_str().ok_or_else(|| invalid("is not UTF-8"))?;
    if s.contains('$') || s.chars().any(char::is_control) {
        return Err(invalid("contains '$' or control characters"));
    }
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if matches!(c, '"' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    Ok(out)
}

/// Finds the nginx binary: Debian's location first, then `$PATH`.
fn find_nginx() -> io::Result<PathBuf> {
    let default = Path::new(NGINX_BIN);
    if default.is_file() {
        return Ok(default.to_path_buf());
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join("nginx");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!(
            "nginx not found at {NGINX_BIN} or on PATH; run scripts/test.sh (which installs nginx)"
        ),
    ))
}

/// Asks the kernel for a free loopback port. The listener is dropped before
/// nginx binds, so another process may grab it; `start` retries in that case.
fn free_port() -> io::Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| ctx(e, "binding 127.0.0.1:0 to pick a port"))?;
    let port = listener
        .local_addr()
        .map_err(|e| ctx(e, "reading the picked port"))?
        .port();
    drop(listener);
    Ok(port)
}

fn set_mode(path: &Path, mode: u32) -> io::Result<()> {
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .map_err(|e| ctx(e, format!("chmod {mode:o} {}", path.display())))
}

/// Sends `SIG<signal>` to `pids` via kill(1). Best effort: used from Drop.
fn send_signal(signal: &str, pids: &[u32]) {
    if pids.is_empty() {
        return;
    }
    let kill = ["/bin/kill", "/usr/bin/kill"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.is_file())
        .unwrap_or(Path::new("kill"));
    let result = Command::new(kill)
        .arg(format!("-{signal}"))
        .args(pids.iter().map(u32::to_string))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if let Err(e) = result {
        eprintln!("nginx harness: running {} failed: {e}", kill.display());
    }
}

/// Direct children of `pid` (the nginx workers), from Linux procfs.
fn child_pids(pid: u32) -> Vec<u32> {
    fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .map(|s| {
            s.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Waits up to `timeout` for the child to exit; true if it has been reaped.
fn wait_bounded(child: &mut Child, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return true,
            Ok(None) => {}
            // ECHILD etc.: nothing left for us to wait on.
            Err(_) => return true,
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(POLL_STEP);
    }
}

/// Adds context to an io::Error while keeping its kind.
fn ctx(e: io::Error, what: impl std::fmt::Display) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}
