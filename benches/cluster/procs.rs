//! The cluster bench's processes: fencegate instances (the release binary), local or in a cluster, each owned by a
//! guard that stops it on drop (also while unwinding from a panic).

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::client;
use crate::etcd::free_port;
use crate::lprocs::listening_ports;

/// Shards of every cluster here (as the multi-process tests have).
pub const SHARDS: u32 = 8;
/// The ownership's ttl and the upstream timeout: a takeover waits ttl + timeout (settle 0).
pub const TTL: Duration = Duration::from_secs(2);
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(1);
/// `server.workers` of every instance (the load bench's default).
pub const WORKERS: usize = 2;
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
const READY_BOUND: Duration = Duration::from_secs(60);

/// Sends `SIG<sig>` with kill(1): std can only send SIGKILL.
fn signal(sig: &str, pid: u32) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// A child stopped on drop: SIGTERM, SIGKILL after [`STOP_TIMEOUT`].
pub struct Proc {
    child: Child,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGKILL, as a crash would, and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn stop(&mut self) {
        if !self.running() {
            return;
        }
        signal("TERM", self.child.id());
        let until = Instant::now() + STOP_TIMEOUT;
        while self.running() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        if self.running() {
            self.kill();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Without `[cluster]` (local marks), or a member of the cluster named.
#[derive(Clone)]
pub enum Mode {
    Local,
    Cluster {
        cluster: String,
        endpoints: Vec<String>,
        secret: PathBuf,
    },
}

/// One fencegate process: its config, its ports, its guard.
pub struct Instance {
    pub name: String,
    dir: PathBuf,
    null_port: u16,
    mode: Mode,
    config: PathBuf,
    log: PathBuf,
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    proc: Option<Proc>,
}

impl Instance {
    pub fn new(dir: &Path, name: &str, null_port: u16, mode: Mode) -> Instance {
        let mut i = Instance {
            name: name.into(),
            dir: dir.to_path_buf(),
            null_port,
            mode,
            config: dir.join(format!("{name}.toml")),
            log: dir.join(format!("{name}.log")),
            proxy: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            admin: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            proc: None,
        };
        i.write_config();
        i
    }

    /// Fresh ports, and the config with them: the route `/reports/{report}/{*rest}` (scope
    /// `report/{report}`) to the null backend, `settle = "0s"`, the upstream timeout 1 s,
    /// `workers = 2`; in a cluster, 8 shards, ttl 2 s.
    fn write_config(&mut self) {
        let (proxy, admin, peer) = (free_port(), free_port(), free_port());
        let cluster = match &self.mode {
            Mode::Local => String::new(),
            Mode::Cluster {
                cluster,
                endpoints,
                secret,
            } => format!(
                r#"[cluster]
name = "{name}"
cluster_name = "{cluster}"
etcd_endpoints = [{endpoints}]
peer_listen = "127.0.0.1:{peer}"
shards = {SHARDS}
ownership_ttl = "{ttl}s"
peer_secret_file = "{secret}"
"#,
                name = self.name,
                endpoints = endpoints
                    .iter()
                    .map(|e| format!("\"{e}\""))
                    .collect::<Vec<_>>()
                    .join(", "),
                ttl = TTL.as_secs(),
                secret = secret.display(),
            ),
        };
        let text = format!(
            r#"# Written by benches/cluster.rs.
[server]
listen = "127.0.0.1:{proxy}"
workers = {WORKERS}
shutdown_timeout = "5s"
[admin]
listen = "127.0.0.1:{admin}"
[store]
path = "{store}"
[fencing]
drain_timeout = "2s"
settle = "0s"
[[upstream]]
name = "null"
url = "http://127.0.0.1:{null}"
timeout = "{timeout}ms"
[[route]]
name = "reports"
path = "/reports/{{report}}/{{*rest}}"
scope = "report/{{report}}"
upstream = "null"
{cluster}"#,
            store = self.dir.join(format!("marks-{}.redb", self.name)).display(),
            null = self.null_port,
            timeout = UPSTREAM_TIMEOUT.as_millis(),
        );
        std::fs::write(&self.config, text).expect("config");
        self.proxy = SocketAddr::from((Ipv4Addr::LOCALHOST, proxy));
        self.admin = SocketAddr::from((Ipv4Addr::LOCALHOST, admin));
    }

    /// Starts it (fresh ports if one was taken meanwhile) and waits until it listens on
    /// both ports and `/readyz` says 200.
    pub async fn start(&mut self) -> io::Result<()> {
        let mut last = None;
        for _ in 0..4 {
            match self.spawn().await {
                Ok(()) => return Ok(()),
                Err(e) if self.log_tail().contains("listen") => {
                    last = Some(e);
                    self.write_config();
                }
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("fencegate did not start")))
    }

    /// Starts it again on its ports (after a kill).
    pub async fn restart(&mut self) -> io::Result<()> {
        match self.spawn().await {
            Ok(()) => Ok(()),
            Err(_) => self.start().await,
        }
    }

    async fn spawn(&mut self) -> io::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new(env!("CARGO_BIN_EXE_fencegate"))
            .arg("serve")
            .arg("--config")
            .arg(&self.config)
            .current_dir(&self.dir)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()?;
        let mut guard = Proc { child };
        let until = Instant::now() + READY_BOUND;
        loop {
            if !guard.running() {
                return Err(io::Error::other(format!(
                    "{} exited during start-up; log:\n{}",
                    self.name,
                    self.log_tail()
                )));
            }
            let ports = listening_ports(guard.pid());
            if ports.contains(&self.proxy.port())
                && ports.contains(&self.admin.port())
                && let Ok((200, _)) = client::http_once(self.admin, "GET", "/readyz", "").await
            {
                self.proc = Some(guard);
                return Ok(());
            }
            if Instant::now() > until {
                return Err(io::Error::other(format!(
                    "{} not ready after {READY_BOUND:?}; log:\n{}",
                    self.name,
                    self.log_tail()
                )));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.proc.as_ref().map(Proc::pid)
    }

    /// SIGKILL: a crash.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// SIGTERM and wait (a cluster member leaves, handing its shards off).
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.stop();
        }
    }

    /// `GET /v1/cluster` (Null if it does not answer).
    pub async fn status(&self) -> serde_json::Value {
        match client::http_once(self.admin, "GET", "/v1/cluster", "").await {
            Ok((200, body)) => serde_json::from_str(&body).unwrap_or_default(),
            _ => serde_json::Value::Null,
        }
    }

    /// `fencegate_requests_total{route="reports",result=…}`, 0 if absent.
    pub async fn requests(&self, result: &str) -> f64 {
        let Ok((200, text)) = client::http_once(self.admin, "GET", "/metrics", "").await else {
            return 0.0;
        };
        let series = format!("fencegate_requests_total{{route=\"reports\",result=\"{result}\"}}");
        text.lines()
            .filter_map(|l| l.rsplit_once(' '))
            .filter(|(k, _)| *k == series)
            .filter_map(|(_, v)| v.trim().parse::<f64>().ok())
            .sum()
    }

    /// The shards this instance owns (as it says).
    pub async fn owned(&self) -> Vec<u32> {
        self.status().await["owned"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .filter_map(|o| o["shard"].as_u64().map(|s| s as u32))
            .collect()
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

/// Waits (bounded) until the instances own every shard between them, an even share each,
/// all admitting, and agree on the owners; answers the owner of each shard.
pub async fn settled(instances: &[&Instance], bound: Duration) -> Result<Vec<String>, String> {
    let until = Instant::now() + bound;
    let n = instances.len() as u32;
    loop {
        let mut owned = 0;
        let mut even = true;
        let mut admitting = true;
        let mut views = Vec::new();
        for i in instances {
            let s = i.status().await;
            let mine = s["owned"].as_array().cloned().unwrap_or_default();
            owned += mine.len() as u32;
            even &= mine.len() as u32 == SHARDS / n || mine.len() as u32 == SHARDS.div_ceil(n);
            admitting &= mine.iter().all(|o| o["state"] == "admitting");
            let mut by_shard = vec![String::new(); SHARDS as usize];
            for o in s["owners"].as_array().cloned().unwrap_or_default() {
                if let (Some(sh), Some(who)) = (o["shard"].as_u64(), o["instance"].as_str())
                    && let Some(slot) = by_shard.get_mut(sh as usize)
                {
                    *slot = who.to_string();
                }
            }
            views.push(by_shard);
        }
        let names: Vec<&str> = instances.iter().map(|i| i.name.as_str()).collect();
        let agreed = views.windows(2).all(|w| w[0] == w[1])
            && views[0].iter().all(|o| names.contains(&o.as_str()));
        if owned == SHARDS && even && admitting && agreed {
            return Ok(views.remove(0));
        }
        if Instant::now() > until {
            return Err(format!(
                "not settled over {names:?} within {bound:?}: {owned} owned, even {even}, \
                 admitting {admitting}, owners {views:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One PUT with `Fencing-Token: token` on a fresh connection: (status, Fencing-Result).
pub async fn put_once(addr: SocketAddr, path: &str, token: u64) -> io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let work = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        let req = format!(
            "PUT {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
             Fencing-Token: {token}\r\nContent-Length: 1\r\n\r\nx"
        );
        stream.write_all(req.as_bytes()).await?;
        let mut buf = Vec::new();
        stream.take(1 << 16).read_to_end(&mut buf).await?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let status = text
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| io::Error::other(format!("no status line in {text:?}")))?;
        let result = text
            .split("\r\n\r\n")
            .next()
            .unwrap_or_default()
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("fencing-result")
                    .then(|| v.trim().to_string())
            })
            .unwrap_or_default();
        Ok((status, result))
    };
    tokio::time::timeout(Duration::from_secs(5), work)
        .await
        .map_err(|_| io::Error::other("timed out"))?
}
