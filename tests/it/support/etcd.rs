//! A real etcd cluster on loopback for the etcd backend's tests: three members with
//! private data directories and ports picked by the test, stopped and removed on drop.
#![cfg(feature = "etcd")]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{BOUND, free_port};

/// Where Debian's `etcd-server` package installs the binary.
const ETCD_BIN: &str = "/usr/bin/etcd";

pub struct Member {
    pub name: String,
    pub client_url: String,
    child: Option<Child>,
}

pub struct EtcdCluster {
    pub members: Vec<Member>,
    _dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// Starts `n` members and waits (bounded) until the cluster has a leader. Short
    /// heartbeat and election timeouts keep failover (and the minimum lease ttl, 1 s) short.
    pub async fn start(n: usize) -> EtcdCluster {
        let bin = std::env::var("ETCD_BIN").unwrap_or_else(|_| ETCD_BIN.to_string());
        let dir = tempfile::Builder::new()
            .prefix("fencegate-etcd-")
            .tempdir()
            .expect("temp dir");
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let initial = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let members = ports
            .iter()
            .enumerate()
            .map(|(i, (client, peer))| {
                let name = format!("m{i}");
                let data: PathBuf = dir.path().join(&name);
                let log = std::fs::File::create(dir.path().join(format!("{name}.log"))).unwrap();
                let client_url = format!("http://127.0.0.1:{client}");
                let peer_url = format!("http://127.0.0.1:{peer}");
                let child = Command::new(&bin)
                    .args(["--name", &name])
                    .arg("--data-dir")
                    .arg(&data)
                    .args(["--listen-client-urls", &client_url])
                    .args(["--advertise-client-urls", &client_url])
                    .args(["--listen-peer-urls", &peer_url])
                    .args(["--initial-advertise-peer-urls", &peer_url])
                    .args(["--initial-cluster", &initial])
                    .args(["--initial-cluster-state", "new"])
                    .args(["--initial-cluster-token", "fencegate-test"])
                    .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
                    .stdin(Stdio::null())
                    .stdout(log.try_clone().unwrap())
                    .stderr(log)
                    .spawn()
                    .unwrap_or_else(|e| panic!("start {bin} (apt-get install etcd-server): {e}"));
                Member {
                    name,
                    client_url,
                    child: Some(child),
                }
            })
            .collect();
        let cluster = EtcdCluster { members, _dir: dir };
        tokio::time::timeout(BOUND, async {
            while cluster.leader().await.is_none() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .expect("the etcd cluster elects a leader");
        cluster
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.client_url.clone()).collect()
    }

    /// The index of the current leader, asked of a live member; None while there is none.
    pub async fn leader(&self) -> Option<usize> {
        for m in self.members.iter().filter(|m| m.child.is_some()) {
            let options = etcd_client::ConnectOptions::new()
                .with_connect_timeout(Duration::from_millis(500))
                .with_timeout(Duration::from_millis(500));
            let Ok(mut c) =
                etcd_client::Client::connect([m.client_url.as_str()], Some(options)).await
            else {
                continue;
            };
            let Ok(status) = c.status().await else {
                continue;
            };
            if status.leader() == 0 {
                continue;
            }
            let Ok(list) = c.member_list().await else {
                continue;
            };
            let name = list
                .members()
                .iter()
                .find(|x| x.id() == status.leader())
                .map(|x| x.name().to_string())?;
            let i = self.members.iter().position(|m| m.name == name)?;
            if self.members[i].child.is_some() {
                return Some(i);
            }
        }
        None
    }

    /// The sum over the live members of every sample of `metric` whose labels contain
    /// `labels` (`""`: all), from their `/metrics`: what the cluster was asked to do.
    pub async fn metric(&self, metric: &str, labels: &str) -> f64 {
        let mut sum = 0.0;
        for m in self.members.iter().filter(|m| m.child.is_some()) {
            let addr = m
                .client_url
                .trim_start_matches("http://")
                .parse()
                .expect("member address");
            let text = super::Client::new(addr).get("/metrics").await.body;
            sum += text
                .lines()
                .filter(|l| {
                    l.strip_prefix(metric)
                        .is_some_and(|rest| rest.starts_with(['{', ' ']) && rest.contains(labels))
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>();
        }
        sum
    }

    /// SIGSTOP one member: its process is frozen, its connections stay up. `kill` (and the
    /// drop) still ends it.
    pub fn stop(&mut self, i: usize) {
        if let Some(child) = &self.members[i].child {
            super::signal(child.id(), "STOP");
        }
    }

    /// SIGKILL one member and reap it.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

/// The lines of an `[authority]` table (after `listen`) for the etcd backend on
/// `endpoints`, max_ttl 30 s, and `lock_delay` when given (else the default).
pub fn authority_table(endpoints: &[String], lock_delay: Option<&str>) -> String {
    let list = endpoints
        .iter()
        .map(|e| format!("\"{e}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let mut table = format!("backend = \"etcd\"\netcd_endpoints = [{list}]\nmax_ttl = \"30s\"\n");
    if let Some(delay) = lock_delay {
        table.push_str(&format!("lock_delay = \"{delay}\"\n"));
    }
    table
}
