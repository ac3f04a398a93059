//! The cluster's marks in etcd against etcd's own transaction rate, on one 3-member etcd
//! on loopback started here (the `etcd` feature and `/usr/bin/etcd`, or `ETCD_BIN`).
//!
//! `cargo bench --features etcd --bench cluster_marks [-- --seconds N --clients C]`
//!
//! Two measurements, each for `--seconds` (default 5) with `--clients` (default 64)
//! concurrent writers, each writing its own scopes:
//! - **etcd alone**: each client sends one transaction per write, guarded as the marks'
//!   are (a compare on an owner key's create revision, one put): what etcd itself does.
//! - **marks**: each client queues an advance on the owner's `MarkWriter` and waits for it;
//!   the writer group-commits what is queued, so advances per second can exceed
//!   transactions per second.
//!
//! Reports both rates and their ratio; no speed is asserted. Under `cargo test` (no
//! `--bench` argument) it does nothing.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use fencegate::cluster::marks::{Advance, EtcdMarks, MarkWriter};
use fencegate::cluster::ownership::{Claim, Ownership, OwnershipConfig};
use fencegate::store::Mark;
use fencegate::token::Token;

struct Etcd {
    children: Vec<Child>,
    endpoints: Vec<String>,
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

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("a free port: {e}"))
}

fn start_etcd() -> Etcd {
    let bin = std::env::var("ETCD_BIN").unwrap_or_else(|_| "/usr/bin/etcd".into());
    let dir = tempfile::Builder::new()
        .prefix("fencegate-bench-etcd-")
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
            .args(["--initial-cluster-token", "fencegate-bench"])
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

fn args() -> (Duration, usize) {
    let mut seconds = 5.0;
    let mut clients = 64;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seconds" => {
                seconds = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|s: &f64| (0.1..=600.0).contains(s))
                    .unwrap_or_else(|| panic!("--seconds needs 0.1..=600"));
            }
            "--clients" => {
                clients = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|c| (1..=4096).contains(c))
                    .unwrap_or_else(|| panic!("--clients needs 1..=4096"));
            }
            "--bench" => {}
            other => panic!("unknown argument {other:?}: --seconds N --clients C"),
        }
    }
    (Duration::from_secs_f64(seconds), clients)
}

/// Runs `clients` loops of `one` for `duration`; answers the writes done per second.
async fn rate<F, Fut>(duration: Duration, clients: usize, one: F) -> f64
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

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo test --all-targets` runs bench targets without `--bench`: nothing to do then.
    if !std::env::args().skip(1).any(|a| a == "--bench") {
        return;
    }
    let (duration, clients) = args();
    let etcd = start_etcd();
    // Bounded: the members elect a leader within a few seconds or the bench gives up.
    let ownership = {
        let give_up = Instant::now() + Duration::from_secs(30);
        loop {
            let tried = Ownership::start(
                &etcd.endpoints,
                OwnershipConfig {
                    cluster: "bench".into(),
                    instance: "a".into(),
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
                Err(e) => panic!("etcd did not come up: {e}"),
            }
        }
    };
    let Claim::Owned { epoch, .. } = ownership.claim(0).await.expect("claim") else {
        panic!("shard 0 is free in a new cluster");
    };
    let marks = EtcdMarks::new(&ownership);
    let owner_key = "/fencegate/cluster/bench/shards/0/owner";
    let client = etcd_client::Client::connect(etcd.endpoints.clone(), None)
        .await
        .expect("etcd client");

    let raw = {
        let (client, marks) = (client.clone(), marks.clone());
        rate(duration, clients, move |c, n| {
            let (mut client, key) = (client.clone(), marks.key(0, &format!("raw/{c}")));
            async move {
                let txn = Txn::new()
                    .when([Compare::create_revision(
                        owner_key,
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
    println!(
        "etcd alone (one guarded transaction per write, {clients} clients): {raw:.0} writes/s"
    );
    println!(
        "marks through the MarkWriter ({clients} clients): {grouped:.0} advances/s, {:.1} advances per transaction",
        grouped * duration.as_secs_f64() / txns.max(1) as f64
    );
    println!("ratio: {:.2}× etcd's own transaction rate", grouped / raw);
}
