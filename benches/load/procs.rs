//! Child processes of the bench: fencegate (the release binary) and PostgreSQL, each
//! owned by a guard that stops it on drop (also while unwinding from a panic), plus the
//! machine description.
//!
//! nginx instances come from `tests/it/support/nginx.rs`, which has its own guard.

use std::fs;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::client;

const STOP_TIMEOUT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(2);

/// Sends `SIG<signal>` with kill(1): std can only send SIGKILL.
fn signal(signal: &str, pid: u32) {
    let _ = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Waits up to `timeout` for the child to exit.
fn wait_bounded(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(s)) => return Some(s),
            Ok(None) if Instant::now() < deadline => thread::sleep(POLL),
            _ => return None,
        }
    }
}

/// A child process that is stopped when the guard drops: `stop_signal` first (so it
/// shuts down cleanly), SIGKILL if it does not exit within [`STOP_TIMEOUT`].
pub struct Guard {
    child: Child,
    stop_signal: &'static str,
}

impl Guard {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The polite stop; answers how long the process took to exit.
    pub fn stop(&mut self) -> Duration {
        let started = Instant::now();
        if self.running() {
            signal(self.stop_signal, self.child.id());
            if wait_bounded(&mut self.child, STOP_TIMEOUT).is_none() {
                self.kill();
            }
        }
        started.elapsed()
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = wait_bounded(&mut self.child, STOP_TIMEOUT);
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One of the bench's floors (`bare.rs`) in a process of its own (this bench binary with
/// `--serve-floor`), so that its CPU is counted apart from the load generator's and it
/// does not share a scheduler with it; answers the guard and the floor's address.
pub fn floor_process(
    upstream: Option<std::net::SocketAddr>,
    workers: usize,
) -> io::Result<(Guard, std::net::SocketAddr)> {
    use std::io::BufRead;
    let mut child = Command::new(std::env::current_exe()?)
        .arg("--serve-floor")
        .arg(upstream.map_or_else(|| "none".to_string(), |u| u.to_string()))
        .arg("--workers")
        .arg(workers.to_string())
        // Held open by the guard's `Child`: closed when this process goes, however it goes.
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdout = child.stdout.take();
    let guard = Guard {
        child,
        stop_signal: "TERM",
    };
    // The first line is the address; a floor that dies first closes stdout (EOF).
    let mut line = String::new();
    if let Some(out) = stdout {
        io::BufReader::new(out).read_line(&mut line)?;
    }
    let addr = line
        .trim()
        .strip_prefix("listening ")
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| io::Error::other(format!("floor process did not start: {line:?}")))?;
    Ok((guard, addr))
}

fn free_port() -> io::Result<(TcpListener, u16)> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let port = l.local_addr()?.port();
    Ok((l, port))
}

/// CPU time (user + system, all threads) of `pid` in seconds, from /proc/<pid>/stat.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces): state is field 3,
    // utime field 14, stime field 15.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / clock_ticks())
}

/// Context switches (voluntary + involuntary) of every thread of `pid`.
pub fn context_switches(pid: u32) -> Option<u64> {
    let mut total = 0;
    for task in fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten() {
        let status = fs::read_to_string(task.path().join("status")).unwrap_or_default();
        total += status
            .lines()
            .filter(|l| l.contains("ctxt_switches:"))
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum::<u64>();
    }
    Some(total)
}

/// `getconf CLK_TCK`, 100 on Linux unless told otherwise.
fn clock_ticks() -> f64 {
    static TCK: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TCK.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// A process and its direct children (nginx's master and workers).
pub fn with_children(pid: u32) -> Vec<u32> {
    let mut pids = vec![pid];
    if let Ok(s) = fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")) {
        pids.extend(s.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
    }
    pids
}

/// Loopback TCP ports on which `pid` itself holds a listening socket (from /proc/net/tcp
/// and the process's file descriptors).
pub fn listening_ports(pid: u32) -> std::collections::HashSet<u16> {
    let mut inodes = std::collections::HashSet::new();
    if let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) {
        for fd in fds.flatten() {
            if let Ok(target) = fs::read_link(fd.path())
                && let Some(inode) = target
                    .to_str()
                    .and_then(|t| t.strip_prefix("socket:["))
                    .and_then(|t| t.strip_suffix(']'))
            {
                inodes.insert(inode.to_string());
            }
        }
    }
    let table = fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            let f: Vec<&str> = line.split_whitespace().collect();
            let (local, state, inode) = (f.get(1)?, f.get(3)?, f.get(9)?);
            if *state != "0A" || !inodes.contains(*inode) {
                return None;
            }
            u16::from_str_radix(local.split(':').nth(1)?, 16).ok()
        })
        .collect()
}

/// Memory of a process from /proc/<pid>/status, in KiB: (VmRSS, VmHWM).
pub fn memory_kib(pid: u32) -> Option<(u64, u64)> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// fencegate as a separate process (the release binary cargo built next to this bench),
/// so the load generator and the proxy do not share a runtime.
pub struct Fencegate {
    bin: PathBuf,
    config: PathBuf,
    log: PathBuf,
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    pub store: PathBuf,
    /// Ports of the null and WebDAV backends.
    upstreams: (u16, u16),
    /// `server.workers`: the proxy listener's threads.
    workers: usize,
    /// The verification key (`.pub`) of the `proof = "required"` route.
    proof_key: PathBuf,
    /// `[server] tls` as written into the config, if the listener speaks TLS.
    tls: Option<String>,
    proc: Option<Guard>,
}

impl Fencegate {
    /// Writes a config for `dir` (store on disk, `settle = "0s"`) with a route to each
    /// backend and a second route to the null backend that requires proofs made with
    /// the key whose `.pub` is `proof_key`, and starts the server.
    pub async fn start(
        dir: &Path,
        null_port: u16,
        dav_port: u16,
        workers: usize,
        proof_key: &Path,
    ) -> io::Result<Fencegate> {
        Fencegate::start_with(dir, null_port, dav_port, workers, proof_key, None).await
    }

    /// [`Fencegate::start`] with `tls` (a `tls = { … }` line) in `[server]`: the proxy
    /// listener speaks TLS, the admin listener stays plain HTTP.
    pub async fn start_with(
        dir: &Path,
        null_port: u16,
        dav_port: u16,
        workers: usize,
        proof_key: &Path,
        tls: Option<String>,
    ) -> io::Result<Fencegate> {
        let mut fg = Fencegate {
            bin: PathBuf::from(env!("CARGO_BIN_EXE_fencegate")),
            config: dir.join("fencegate.toml"),
            log: dir.join("fencegate.log"),
            proxy: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            admin: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            store: dir.join("marks.redb"),
            upstreams: (null_port, dav_port),
            workers,
            proof_key: proof_key.to_path_buf(),
            tls,
            proc: None,
        };
        fg.spawn_on_fresh_ports().await?;
        Ok(fg)
    }

    /// Picks two free loopback ports and writes the config with them.
    fn write_config(&mut self) -> io::Result<()> {
        // Hold both listeners while picking, so the two ports differ.
        let (l1, proxy_port) = free_port()?;
        let (l2, admin_port) = free_port()?;
        drop((l1, l2));
        let (null_port, dav_port) = self.upstreams;
        fs::write(
            &self.config,
            format!(
                r#"# Written by benches/load.rs.
[server]
listen = "127.0.0.1:{proxy_port}"
workers = {workers}
shutdown_timeout = "5s"
{tls}
[admin]
listen = "127.0.0.1:{admin_port}"

[store]
path = "{store}"

[fencing]
header = "Fencing-Token"
drain_timeout = "5s"
settle = "0s"
proof_keys = ["{proof_key}"]

[[upstream]]
name = "null"
url = "http://127.0.0.1:{null_port}"
timeout = "10s"

[[upstream]]
name = "webdav"
url = "http://127.0.0.1:{dav_port}"
timeout = "10s"

[[route]]
name = "reports"
path = "/reports/{{report}}/{{*rest}}"
scope = "report/{{report}}"
upstream = "null"

[[route]]
name = "dav-reports"
path = "/dav/reports/{{report}}/{{*rest}}"
scope = "dav/{{report}}"
upstream = "webdav"

[[route]]
name = "proofed"
path = "/proofed/{{report}}/{{*rest}}"
scope = "proofed/{{report}}"
upstream = "null"
proof = "required"
"#,
                store = self.store.display(),
                proof_key = self.proof_key.display(),
                workers = self.workers,
                tls = self
                    .tls
                    .as_deref()
                    .map_or(String::new(), |t| format!("{t}\n")),
            ),
        )?;
        self.proxy = SocketAddr::from((Ipv4Addr::LOCALHOST, proxy_port));
        self.admin = SocketAddr::from((Ipv4Addr::LOCALHOST, admin_port));
        Ok(())
    }

    async fn spawn_on_fresh_ports(&mut self) -> io::Result<Duration> {
        let mut last = None;
        for _ in 0..5 {
            self.write_config()?;
            match self.spawn().await {
                Ok(d) => return Ok(d),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("fencegate did not start")))
    }

    /// Starts it again on the same ports (a restart); if another process took one of
    /// them meanwhile, on fresh ones. Answers the time from the first spawn to ready.
    pub async fn respawn(&mut self) -> io::Result<Duration> {
        let started = Instant::now();
        match self.spawn().await {
            Ok(d) => Ok(d),
            Err(e) if self.log_tail().contains("cannot listen") => {
                eprintln!("    (a port was taken while fencegate was down: {e}; new ports)");
                self.spawn_on_fresh_ports().await?;
                Ok(started.elapsed())
            }
            Err(e) => Err(e),
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.proc.as_ref().map(Guard::pid)
    }

    /// (VmRSS, VmHWM) in KiB.
    pub fn memory_kib(&self) -> Option<(u64, u64)> {
        memory_kib(self.pid()?)
    }

    /// Starts the process and waits for `/readyz` to answer 200; answers the time from
    /// spawn to ready.
    async fn spawn(&mut self) -> io::Result<Duration> {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let started = Instant::now();
        let child = Command::new(&self.bin)
            .arg("serve")
            .arg("--config")
            .arg(&self.config)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()?;
        let mut guard = Guard {
            child,
            stop_signal: "TERM",
        };
        let deadline = started + Duration::from_secs(120);
        loop {
            if !guard.running() {
                return Err(io::Error::other(format!(
                    "fencegate exited during start-up; log:\n{}",
                    self.log_tail()
                )));
            }
            // Ready means: our child listens on both ports (not some other process that
            // grabbed a port between our probe and fencegate's bind) and says ready.
            let ports = listening_ports(guard.pid());
            if ports.contains(&self.proxy.port())
                && ports.contains(&self.admin.port())
                && let Ok((200, _)) = client::http_once(self.admin, "GET", "/readyz", "").await
            {
                let ready = started.elapsed();
                self.proc = Some(guard);
                return Ok(ready);
            }
            if Instant::now() > deadline {
                return Err(io::Error::other(format!(
                    "fencegate not ready after 120 s; log:\n{}",
                    self.log_tail()
                )));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// SIGTERM and wait; answers how long the shutdown took.
    pub fn stop(&mut self) -> Duration {
        self.proc.take().map(|mut g| g.stop()).unwrap_or_default()
    }

    /// SIGKILL: a crash.
    pub fn crash(&mut self) {
        if let Some(mut g) = self.proc.take() {
            g.kill();
        }
    }

    /// Size of the redb file in bytes.
    pub fn store_bytes(&self) -> u64 {
        fs::metadata(&self.store).map_or(0, |m| m.len())
    }

    pub fn log_tail(&self) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

/// A throwaway PostgreSQL cluster on loopback: the baseline of a conditional
/// `UPDATE ... WHERE accepted_fence <= :fence` per request.
pub struct Postgres {
    bin: PathBuf,
    uid: u32,
    gid: u32,
    port: u16,
    // Field order: the server stops before its directory is removed.
    _server: Guard,
    dir: TempDir,
}

/// pgbench's answer.
#[derive(Debug, Default)]
pub struct PgResult {
    pub tps: f64,
    pub transactions: u64,
    pub failed: u64,
    /// Sorted per-transaction latencies in nanoseconds (from `--log`).
    pub latencies: Vec<u64>,
    pub version: String,
}

/// The newest installed server's bin directory.
pub fn postgres_bin() -> Option<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            (bin.join("postgres").is_file() && bin.join("pgbench").is_file()).then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, b)| b)
}

/// uid and gid of `user` from /etc/passwd.
fn user_ids(user: &str) -> Option<(u32, u32)> {
    let passwd = fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.first() == Some(&user) && f.len() > 3)
            .then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))
            .flatten()
    })
}

fn run_checked(cmd: &mut Command, what: &str) -> io::Result<String> {
    let out = cmd.stdin(Stdio::null()).output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "{what} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Postgres {
    /// Why PostgreSQL cannot run here, if it cannot.
    pub fn unavailable() -> Option<String> {
        if postgres_bin().is_none() {
            return Some("PostgreSQL is not installed (benches/run.sh installs it)".into());
        }
        if user_ids("postgres").is_none() {
            return Some("there is no `postgres` user".into());
        }
        None
    }

    /// initdb in a temp dir (on disk) as `postgres`, start the server on a loopback port
    /// with `synchronous_commit = on`, create `fences` with `rows` rows.
    pub fn start(rows: u32) -> io::Result<Postgres> {
        let bin = postgres_bin().ok_or_else(|| io::Error::other("no PostgreSQL"))?;
        let (uid, gid) = user_ids("postgres").ok_or_else(|| io::Error::other("no postgres"))?;
        let dir = tempfile::Builder::new()
            .prefix("fencegate-bench-pg-")
            .tempdir()?;
        std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))?;
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o700))?;
        let data = dir.path().join("data");
        let as_pg = |cmd: &str| {
            let mut c = Command::new(bin.join(cmd));
            c.uid(uid)
                .gid(gid)
                .current_dir(dir.path())
                .env("LC_ALL", "C")
                .env("HOME", dir.path());
            c
        };
        run_checked(
            as_pg("initdb").arg("-D").arg(&data).args([
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ]),
            "initdb",
        )?;
        let (l, port) = free_port()?;
        drop(l);
        let log = fs::File::create(dir.path().join("postgres.log"))?;
        std::os::unix::fs::chown(dir.path().join("postgres.log"), Some(uid), Some(gid))?;
        let child = as_pg("postgres")
            .arg("-D")
            .arg(&data)
            .arg("-p")
            .arg(port.to_string())
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!("unix_socket_directories={}", dir.path().display()))
            .args([
                "-c",
                "synchronous_commit=on",
                "-c",
                "fsync=on",
                "-c",
                "max_connections=200",
                "-c",
                "shared_buffers=128MB",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()?;
        let server = Guard {
            child,
            // SIGINT is PostgreSQL's fast shutdown.
            stop_signal: "INT",
        };
        let mut pg = Postgres {
            bin,
            uid,
            gid,
            port,
            _server: server,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while pg.psql("SELECT 1").is_err() || !listening_ports(pg._server.pid()).contains(&port) {
            if !pg._server.running() || Instant::now() > deadline {
                let log =
                    fs::read_to_string(pg.dir.path().join("postgres.log")).unwrap_or_default();
                return Err(io::Error::other(format!(
                    "PostgreSQL did not start:\n{log}"
                )));
            }
            thread::sleep(Duration::from_millis(50));
        }
        pg.psql("CREATE TABLE fences (scope text PRIMARY KEY, accepted_fence bigint NOT NULL)")?;
        pg.psql(&format!(
            "INSERT INTO fences SELECT 's' || g, 0 FROM generate_series(0, {}) g",
            rows - 1
        ))?;
        // Not in a transaction block: one statement per psql call.
        pg.psql("VACUUM ANALYZE fences")?;
        Ok(pg)
    }

    fn command(&self, cmd: &str) -> Command {
        let mut c = Command::new(self.bin.join(cmd));
        c.uid(self.uid)
            .gid(self.gid)
            .current_dir(self.dir.path())
            .env("LC_ALL", "C")
            .env("HOME", self.dir.path());
        c
    }

    pub fn psql(&self, sql: &str) -> io::Result<String> {
        let mut c = self.command("psql");
        c.args([
            "-X",
            "-q",
            "-t",
            "-A",
            "-v",
            "ON_ERROR_STOP=1",
            "-h",
            "127.0.0.1",
        ])
        .arg("-p")
        .arg(self.port.to_string())
        .args(["-U", "postgres", "-d", "postgres", "-c", sql]);
        run_checked(&mut c, "psql")
    }

    /// pgbench: `clients` connections, `threads` threads, for `secs` seconds, each
    /// transaction one conditional UPDATE. Like W2, client `c` owns the scopes
    /// `s{k*clients + c}` and sends each a strictly increasing fence, so every update
    /// advances (none is stale).
    pub fn bench(&self, clients: u32, threads: u32, secs: u32, log: bool) -> io::Result<PgResult> {
        let per_client = (1000 / clients).max(1) - 1;
        let script = self.dir.path().join("fence.sql");
        fs::write(
            &script,
            format!(
                "\\set k random(0, {per_client})\n\
                 \\set fence :fence + 1\n\
                 UPDATE fences SET accepted_fence = :fence \
                 WHERE scope = 's' || (:k * {clients} + :client_id) AND accepted_fence <= :fence;\n"
            ),
        )?;
        let prefix = self.dir.path().join(format!("pgbench-{secs}"));
        let mut c = self.command("pgbench");
        c.args(["-n", "-M", "prepared", "-h", "127.0.0.1"])
            .arg("-p")
            .arg(self.port.to_string())
            .args(["-U", "postgres"])
            .arg(format!("-c{clients}"))
            .arg(format!("-j{threads}"))
            .arg(format!("-T{secs}"))
            // Variables persist across a client's transactions: `fence` counts up.
            .args(["-D", "fence=0"])
            .arg("-f")
            .arg(&script);
        if log {
            c.arg("--log")
                .arg(format!("--log-prefix={}", prefix.display()));
        }
        c.arg("postgres");
        let child = c
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        // Bounded: pgbench ends by itself after -T; the guard kills it otherwise.
        let mut guard = Guard {
            child,
            stop_signal: "INT",
        };
        let bound = Duration::from_secs(u64::from(secs) + 60);
        let status = wait_bounded(&mut guard.child, bound);
        let mut stdout = String::new();
        let mut stderr = String::new();
        if let Some(mut o) = guard.child.stdout.take() {
            let _ = io::Read::read_to_string(&mut o, &mut stdout);
        }
        if let Some(mut e) = guard.child.stderr.take() {
            let _ = io::Read::read_to_string(&mut e, &mut stderr);
        }
        if !status.is_some_and(|s| s.success()) {
            return Err(io::Error::other(format!(
                "pgbench failed ({status:?}):\n{stdout}\n{stderr}"
            )));
        }
        let number = |label: &str| {
            stdout
                .lines()
                .find_map(|l| l.trim().strip_prefix(label))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse::<f64>().ok())
        };
        let mut result = PgResult {
            tps: number("tps =").unwrap_or(0.0),
            transactions: number("number of transactions actually processed:").unwrap_or(0.0)
                as u64,
            failed: number("number of failed transactions:").unwrap_or(0.0) as u64,
            latencies: Vec::new(),
            version: run_checked(self.command("postgres").arg("--version"), "postgres")
                .unwrap_or_default()
                .trim()
                .to_string(),
        };
        if log {
            let name = prefix
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default()
                .to_string();
            for entry in fs::read_dir(self.dir.path())?.flatten() {
                if !entry.file_name().to_string_lossy().starts_with(&name) {
                    continue;
                }
                // client_id transaction_no time_us script_no epoch epoch_us
                for line in fs::read_to_string(entry.path())?.lines() {
                    if let Some(us) = line
                        .split_whitespace()
                        .nth(2)
                        .and_then(|t| t.parse::<u64>().ok())
                    {
                        result.latencies.push(us * 1000);
                    }
                }
                let _ = fs::remove_file(entry.path());
            }
            result.latencies.sort_unstable();
        }
        Ok(result)
    }

    /// How many scopes were advanced at least once and the highest fence: a cheap check
    /// that the updates really happened.
    pub fn advanced(&self) -> io::Result<(u64, u64)> {
        let out = self.psql(
            "SELECT count(*) FILTER (WHERE accepted_fence > 0), coalesce(max(accepted_fence), 0) FROM fences",
        )?;
        let mut f = out.trim().split('|').map(|v| v.parse().unwrap_or(0));
        Ok((f.next().unwrap_or(0), f.next().unwrap_or(0)))
    }
}

/// The machine and the code under test, for the results file.
pub fn machine() -> Vec<(String, String)> {
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let nproc = thread::available_parallelism().map_or(0, |n| n.get());
    let mem = fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map_or("unknown".into(), |kib| {
            format!("{:.1} GiB", kib as f64 / 1024.0 / 1024.0)
        });
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string();
    let root = env!("CARGO_MANIFEST_DIR");
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(root)
            .stderr(Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    // Files that differ from the commit: the numbers describe those too.
    let dirty: Vec<String> = git(&["status", "--porcelain", "--untracked-files=no"])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .map(str::to_string)
        .collect();
    let nginx = Command::new("nginx")
        .arg("-v")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stderr).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let fs_type = Command::new("df")
        .arg("--output=fstype,source")
        .arg(std::env::temp_dir())
        .output()
        .ok()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .nth(1)
                .unwrap_or_default()
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" on ")
        })
        .unwrap_or_default();
    vec![
        ("CPU".into(), model),
        ("CPUs (nproc)".into(), nproc.to_string()),
        ("memory".into(), mem),
        ("kernel".into(), kernel),
        (
            "fencegate commit".into(),
            if dirty.is_empty() {
                commit
            } else {
                format!("{commit} + uncommitted changes to {}", dirty.join(", "))
            },
        ),
        ("nginx".into(), nginx),
        (
            "temp dir (stores)".into(),
            format!("{} ({fs_type})", std::env::temp_dir().display()),
        ),
    ]
}
