//! A 3-member etcd on loopback for the cluster benches, and etcd's own rate for the marks'
//! transaction next to the `MarkWriter`'s. Shared by `benches/cluster_marks.rs` and
//! `benches/cluster.rs` (each includes it by path).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("a free port: {e}"))
}

/// A 3-member etcd on loopback, killed on drop.
pub struct Etcd {
    children: Vec<Child>,
    pub endpoints: Vec<String>,
    _dir: tempfile::TempDir,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Etcd {
    // `benches/cluster.rs` accounts etcd's CPU; `cluster_marks` does not.
    #[allow(dead_code)]
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(Child::id).collect()
    }

    /// `/usr/bin/etcd` (or `ETCD_BIN`), 3 members, ports picked here.
    pub fn start() -> Etcd {
        let bin = std::env::var("ETCD_BIN").unwrap_or_else(|_| "/usr/bin/etcd".into());
        let dir = tempfile::Builder::new()
            .prefix("fencegate-cbench-etcd-")
            .tempdir()
            .expect("temp dir");
        let ports: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
        let initial = ports
            .iter()
            .enumerate()
            .map(|(i, (_, p))| format!("m{i}=http://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut children = Vec::new();
        let mut endpoints = Vec::new();
        for (i, (client, peer)) in ports.iter().enumerate() {
            let name = format!("m{i}");
            let data: PathBuf = dir.path().join(&name);
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
                .args(["--initial-cluster-token", "fencegate-cbench"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("start {bin} (apt-get install etcd-server): {e}"));
            children.push(child);
            endpoints.push(client_url);
        }
        Etcd {
            children,
            endpoints,
            _dir: dir,
        }
    }
}

/// Runs `clients` loops of `one` for `duration`; answers the writes done per second.
pub async fn rate<F, Fut>(duration: Duration, clients: usize, one: F) -> f64
where
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (stop, done, one) = (stop.clone(), done.clone(), one.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    one(c, n).await;
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

/// etcd's own rate for the marks' transaction (a compare on an owner key's create
/// revision, one put: one per write) and the `MarkWriter`'s, each for `duration` with
/// `clients` writers, under the cluster name `cluster`: (transactions/s, advances/s,
/// advances per transaction). Waits (bounded) for the members to elect a leader.
pub async fn etcd_alone(
    endpoints: &[String],
    duration: Duration,
    clients: usize,
    cluster: &str,
) -> Result<(f64, f64, f64), String> {
    use etcd_client::{Compare, CompareOp, Txn, TxnOp};
    use fencegate::cluster::marks::{Advance, EtcdMarks, MarkWriter};
    use fencegate::cluster::ownership::{Claim, Ownership, OwnershipConfig};
    use fencegate::store::Mark;
    use fencegate::token::Token;
    let give_up = Instant::now() + Duration::from_secs(30);
    let ownership = loop {
        let tried = Ownership::start(
            endpoints,
            OwnershipConfig {
                cluster: cluster.into(),
                instance: "raw".into(),
                ownership_ttl: Duration::from_secs(5),
                drift_margin: Duration::from_millis(250),
            },
        )
        .await;
        match tried {
            Ok(o) => break o,
            Err(e) if Instant::now() < give_up => {
                eprintln!("waiting for etcd: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(format!("etcd did not come up: {e}")),
        }
    };
    let Claim::Owned { epoch, .. } = ownership
        .claim(0)
        .await
        .map_err(|e| format!("claim: {e}"))?
    else {
        return Err("shard 0 of a new cluster is not free".into());
    };
    let marks = EtcdMarks::new(&ownership);
    let owner_key: Arc<str> = Arc::from(format!("/fencegate/cluster/{cluster}/shards/0/owner"));
    let client = etcd_client::Client::connect(endpoints.to_vec(), None)
        .await
        .map_err(|e| format!("etcd client: {e}"))?;
    let raw = {
        let (client, marks) = (client.clone(), marks.clone());
        rate(duration, clients, move |c, n| {
            let (mut client, key) = (client.clone(), marks.key(0, &format!("raw/{c}")));
            let owner_key = owner_key.clone();
            async move {
                let txn = Txn::new()
                    .when([Compare::create_revision(
                        owner_key.as_bytes(),
                        CompareOp::Equal,
                        epoch as i64,
                    )])
                    .and_then([TxnOp::put(key, n.to_string(), None)]);
                client.txn(txn).await.expect("txn");
            }
        })
        .await
    };
    let writer = MarkWriter::spawn(marks.clone());
    let grouped = {
        let writer = writer.clone();
        rate(duration, clients, move |c, n| {
            let writer = writer.clone();
            async move {
                writer
                    .advance(Advance {
                        shard: 0,
                        epoch,
                        scope: Arc::from(format!("marks/{c}")),
                        mark: Mark::of(Token::new(0, n)),
                    })
                    .await
                    .expect("advance");
            }
        })
        .await
    };
    let txns = writer.stats().commit_batch_size.count();
    let per_txn = grouped * duration.as_secs_f64() / txns.max(1) as f64;
    Ok((raw, grouped, per_txn))
}
