//! fencegate processes in a cluster for the multi-process tests: each instance's config
//! (two routes, `/reports/{report}/{*rest}` with scope `report/{report}` and the lock-set
//! workload's `/lockset/{*rest}` with scope `lockset`, in front of one upstream), its
//! ports, its admin view, and a wait until the shards are settled.
#![cfg(feature = "etcd")]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::support::etcd::EtcdCluster;
use crate::support::{self, Client, Proc, free_port};

pub const SHARDS: usize = 8;
pub const SECRET: &str = "cluster-test-secret-0123456789abcdef";
/// The lease's ttl and the upstream timeout: a takeover waits ttl + timeout (settle 0).
pub const TTL: Duration = Duration::from_secs(2);
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(1);

pub struct Instance {
    pub name: String,
    pub config: PathBuf,
    pub proxy: u16,
    pub admin: u16,
    pub peer: u16,
}

impl Instance {
    pub fn new(dir: &Path, name: &str, nginx: SocketAddr, etcd: &EtcdCluster) -> Instance {
        Instance::with_endpoints(dir, name, nginx, &etcd.endpoints())
    }

    /// An instance named `name` in front of `nginx`, on the etcd `endpoints` given (the
    /// cluster's members, or stand-ins in front of them).
    pub fn with_endpoints(
        dir: &Path,
        name: &str,
        nginx: SocketAddr,
        endpoints: &[String],
    ) -> Instance {
        let (proxy, admin, peer) = (free_port(), free_port(), free_port());
        let endpoints = endpoints
            .iter()
            .map(|e| format!("\"{e}\""))
            .collect::<Vec<_>>()
            .join(", ");
        let text = format!(
            r#"
[server]
listen = "127.0.0.1:{proxy}"
shutdown_timeout = "5s"
[admin]
listen = "127.0.0.1:{admin}"
[store]
path = "marks-{name}.redb"
[fencing]
drain_timeout = "2s"
settle = "0s"
[[upstream]]
name = "u"
url = "http://{nginx}"
timeout = "{timeout}ms"
[[route]]
name = "reports"
path = "/reports/{{report}}/{{*rest}}"
scope = "report/{{report}}"
upstream = "u"
[[route]]
name = "lockset"
path = "/lockset/{{*rest}}"
scope = "lockset"
upstream = "u"
[cluster]
name = "{name}"
etcd_endpoints = [{endpoints}]
peer_listen = "127.0.0.1:{peer}"
shards = {SHARDS}
ownership_ttl = "{ttl}s"
peer_secret_file = "peer.secret"
"#,
            timeout = UPSTREAM_TIMEOUT.as_millis(),
            ttl = TTL.as_secs(),
        );
        let config = dir.join(format!("{name}.toml"));
        std::fs::write(&config, text).expect("config");
        Instance {
            name: name.into(),
            config,
            proxy,
            admin,
            peer,
        }
    }

    pub fn spawn(&self) -> Proc {
        support::spawn(&self.config, self.proxy, self.admin)
    }

    pub fn client(&self) -> Client {
        Client::new(([127, 0, 0, 1], self.proxy).into())
    }

    pub async fn status(&self) -> serde_json::Value {
        Client::new(([127, 0, 0, 1], self.admin).into())
            .get("/v1/cluster")
            .await
            .json()
    }

    pub async fn metrics(&self) -> String {
        Client::new(([127, 0, 0, 1], self.admin).into())
            .get("/metrics")
            .await
            .body
    }
}

/// Waits until the instances named own every shard between them, each admitting (no
/// takeover wait, no hand-off under way), as each of them sees it; answers the owner
/// of each shard.
pub async fn settled(instances: &[&Instance]) -> Vec<String> {
    let until = Instant::now() + support::BOUND;
    loop {
        let mut owned = 0;
        let mut even = true;
        let mut admitting = true;
        let mut owners = Vec::new();
        for i in instances {
            let s = i.status().await;
            let mine = s["owned"].as_array().cloned().unwrap_or_default();
            owned += mine.len();
            // The balance gives each the floor or the ceiling of an even share.
            even &= mine.len() == SHARDS / instances.len()
                || mine.len() == SHARDS.div_ceil(instances.len());
            admitting &= mine.iter().all(|o| o["state"] == "admitting");
            let seen: Vec<String> = s["owners"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .map(|o| o["instance"].as_str().unwrap_or("").to_string())
                .collect();
            owners.push(seen);
        }
        let names: Vec<&str> = instances.iter().map(|i| i.name.as_str()).collect();
        let agreed = owners.windows(2).all(|w| w[0] == w[1])
            && owners[0].len() == SHARDS
            && owners[0].iter().all(|o| names.contains(&o.as_str()));
        if owned == SHARDS && even && admitting && agreed {
            return owners.remove(0);
        }
        assert!(
            Instant::now() < until,
            "not settled over {names:?}: {owned} owned, even {even}, admitting {admitting}, owners {owners:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub fn requests(text: &str, result: &str) -> f64 {
    support::metric(
        text,
        &format!("fencegate_requests_total{{route=\"reports\",result=\"{result}\"}}"),
    )
    .unwrap_or(0.0)
}
