//! The lock-set history check (`tests/it/lockset.rs`) through a cluster: three fencegate
//! processes on a real 3-member etcd, in front of nginx WebDAV, the lease authority on
//! the same etcd, and the workers spread over all three instances (each hop to the
//! scope's owner is part of the run). Mid-run, once the set holds a few acknowledged
//! elements, the instance that owns the scope is killed (SIGKILL) and so is the etcd
//! leader. No acknowledged update may be lost, every write a paused worker makes after
//! its lease was superseded must be refused 409, and the scope must be served again by
//! the survivors. (The takeover's time is measured in `serve.rs` and by
//! `benches/cluster.rs`.)
#![cfg(feature = "etcd")]

use std::time::{Duration, Instant};

use super::procs::{Instance, SECRET, SHARDS, settled};
use crate::support::etcd::{EtcdCluster, authority_table};
use crate::support::nginx::Nginx;
use crate::support::{self, Client};

use crate::lockset::workload::{self, Mode, Settings};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockset_through_a_cluster_loses_nothing_when_the_owner_and_the_etcd_leader_die() {
    let mut etcd = EtcdCluster::start(3).await;
    let nginx = Nginx::webdav().expect("nginx (run scripts/test.sh)");
    let dir = tempfile::tempdir().expect("dir");
    crate::support::write_secret(dir.path().join("peer.secret"), format!("{SECRET}\n"));
    let authority = support::start_text(
        &support::authority_text(&authority_table(&etcd.endpoints(), None)),
        dir.path(),
    )
    .await;
    let authority_addr = authority.authority_addr.expect("authority");
    let instances: Vec<Instance> = ["a", "b", "c"]
        .iter()
        .map(|n| Instance::new(dir.path(), n, nginx.addr(), &etcd))
        .collect();
    let mut procs: Vec<_> = instances.iter().map(Instance::spawn).collect();
    settled(&instances.iter().collect::<Vec<_>>()).await;

    // The owner of the workload's one scope.
    let shard = fencegate::cluster::shard::shard_of(workload::SCOPE, SHARDS as u32);
    let mut owner = None;
    for (i, inst) in instances.iter().enumerate() {
        let s = inst.status().await;
        let mine = s["owned"].as_array().cloned().unwrap_or_default();
        if mine.iter().any(|o| o["shard"] == shard) {
            owner = Some(i);
        }
    }
    let owner = owner.expect("an owner of the lockset scope");

    let settings = Settings {
        workers: 6,
        rounds: 8,
        // Leases of the etcd authority are whole seconds.
        ttl: Duration::from_secs(1),
        pausers: 2,
    };
    let proxies: Vec<_> = instances
        .iter()
        .map(|i| std::net::SocketAddr::from(([127, 0, 0, 1], i.proxy)))
        .collect();
    let backend = nginx.addr();
    let run = tokio::spawn(async move {
        workload::run_spread(Mode::Fenced, settings, authority_addr, &proxies, backend).await
    });

    // Mid-run: once three updates are acknowledged in the set, kill the owner and the
    // etcd leader.
    let direct = Client::new(backend);
    let until = Instant::now() + support::BOUND;
    loop {
        let body = direct.get(workload::OBJECT).await.body;
        if body.lines().filter(|l| !l.is_empty()).count() >= 3 {
            break;
        }
        assert!(Instant::now() < until, "the run made no progress");
        assert!(!run.is_finished(), "the run ended early");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let killed = Instant::now();
    procs[owner].child.kill().expect("SIGKILL the owner");
    let _ = procs[owner].child.wait();
    let leader = etcd.leader().await.expect("an etcd leader");
    etcd.kill(leader);

    let fenced = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the run ends")
        .expect("the run's task")
        .expect("the run");
    println!("fenced through a cluster, owner and etcd leader killed: {fenced}");
    assert!(
        fenced.lost.is_empty(),
        "lost through the cluster: {:?}",
        fenced.lost
    );
    assert!(fenced.acknowledged > 3, "{fenced}");
    assert_eq!(
        fenced.stale_rejected, fenced.stale_writes,
        "every superseded write refused: {fenced}"
    );

    // The scope is served again through each survivor: its shard was taken over (a
    // higher token than any lease's is admitted, and hopped where the owner is the other).
    let survivors: Vec<&Instance> = instances
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != owner)
        .map(|(_, inst)| inst)
        .collect();
    settled(&survivors).await;
    println!(
        "settled on the survivors {:?} after the kill",
        killed.elapsed()
    );
    for (n, inst) in survivors.iter().enumerate() {
        let token = format!("999999:{n}");
        let resp = inst
            .client()
            .send("GET", workload::OBJECT, &[("fencing-token", &token)], "")
            .await;
        assert_eq!(resp.status, 200, "{}: {}", inst.name, resp.body);
        assert_eq!(resp.result(), "accepted");
    }
    drop(authority);
}
