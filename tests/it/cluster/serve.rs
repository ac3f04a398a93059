//! Real fencegate processes in a cluster (SPEC §10), in front of a real nginx (WebDAV),
//! on a real 3-member etcd, all on loopback: two instances share the shards and one
//! fence; a request that lands on a non-owner is handed to the owner; the peer listener
//! refuses what does not carry the cluster's credential; a planned leave (SIGTERM) hands
//! every shard off with its marks and no takeover wait; a killed owner (SIGKILL) is taken
//! over after its lease expires and the takeover wait, answering 503 with Retry-After
//! meanwhile. Every wait is a bounded poll.
#![cfg(feature = "etcd")]

use std::time::{Duration, Instant};

use super::procs::{Instance, SECRET, SHARDS, TTL, UPSTREAM_TIMEOUT, requests, settled};
use crate::support::etcd::EtcdCluster;
use crate::support::nginx::Nginx;
use crate::support::{self, Client};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_one_fence_hand_off_on_leave_and_take_over_from_the_killed() {
    let etcd = EtcdCluster::start(3).await;
    let nginx = Nginx::webdav().expect("nginx (run scripts/test.sh)");
    let dir = tempfile::tempdir().expect("dir");
    crate::support::write_secret(dir.path().join("peer.secret"), format!("{SECRET}\n"));
    let a = Instance::new(dir.path(), "a", nginx.addr(), &etcd);
    let b = Instance::new(dir.path(), "b", nginx.addr(), &etcd);
    let mut pa = a.spawn();
    let mut pb = b.spawn();
    settled(&[&a, &b]).await;

    // 16 scopes over 8 shards, so both instances own some: every write goes in through
    // a, every stale one and every read through b. Either way one of them hops.
    let scopes: Vec<String> = (0..16).map(|i| format!("/reports/r{i}/obj")).collect();
    for (i, path) in scopes.iter().enumerate() {
        let put = a.client().put(path, "5", &format!("a5-{i}")).await;
        assert!(put.status < 300, "{path}: {} {}", put.status, put.body);
        assert_eq!(put.result(), "accepted", "{path}");
        let stale = b.client().put(path, "4", "late").await;
        assert_eq!(stale.status, 409, "{path}: {}", stale.body);
        assert_eq!(stale.result(), "stale_fence", "{path}");
        assert_eq!(b.client().get(path).await.body, format!("a5-{i}"), "{path}");
    }
    let (ma, mb) = (a.metrics().await, b.metrics().await);
    assert!(
        requests(&ma, "forwarded_to_owner") > 0.0,
        "a hopped some: {ma}"
    );
    assert!(
        requests(&mb, "forwarded_to_owner") > 0.0,
        "b hopped some: {mb}"
    );
    // Each decision was made once, at the owner: 16 accepted, 16 stale, over both.
    assert_eq!(requests(&ma, "accepted") + requests(&mb, "accepted"), 16.0);
    assert_eq!(
        requests(&ma, "stale_fence") + requests(&mb, "stale_fence"),
        16.0
    );
    assert!(mb.contains("fencegate_cluster_shards_owned"), "{mb}");

    // The peer listener takes only what carries the cluster's credential.
    let peer = Client::new(([127, 0, 0, 1], b.peer).into());
    assert_eq!(peer.put(&scopes[0], "9", "x").await.status, 403);
    let forged = peer
        .send(
            "PUT",
            &scopes[0],
            &[("fencing-token", "9"), ("fencegate-peer", "not-the-key")],
            "x",
        )
        .await;
    assert_eq!(forged.status, 403);

    // b leaves (SIGTERM): its shards are handed off, and a owns them all at once, with
    // their marks, without a takeover wait.
    support::signal(pb.child.id(), "TERM");
    let exit = pb.child.wait().expect("b exits");
    assert!(exit.success(), "{exit:?}");
    settled(&[&a]).await;
    let s = a.status().await;
    assert_eq!(s["stats"]["takeovers"], 0, "{s}");
    for path in &scopes {
        let stale = a.client().put(path, "4", "late").await;
        assert_eq!(stale.status, 409, "{path}: the mark came with the shard");
        let put = a.client().put(path, "6", "a6").await;
        assert_eq!(put.result(), "accepted", "{path}");
    }

    // b joins again; then a is killed. b takes a's shards over once a's lease has expired
    // and the takeover wait has passed; meanwhile those scopes are 503 with Retry-After.
    let _pb = b.spawn();
    let owners = settled(&[&a, &b]).await;
    let status = a.status().await;
    let a_owned: Vec<u64> = status["owned"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|o| o["shard"].as_u64())
        .collect();
    let a_shard_scope = scopes
        .iter()
        .find(|path| {
            let report = path.split('/').nth(2).unwrap_or("");
            let shard =
                fencegate::cluster::shard::shard_of(&format!("report/{report}"), SHARDS as u32);
            a_owned.contains(&u64::from(shard))
        })
        .cloned()
        .unwrap_or_else(|| panic!("a owns a shard of some scope: {owners:?}"));
    let killed = Instant::now();
    pa.child.kill().expect("SIGKILL a");
    let _ = pa.child.wait();
    let mut unavailable = 0;
    let until = killed + support::BOUND;
    let taken_over = loop {
        let resp = b.client().put(&a_shard_scope, "7", "b7").await;
        match resp.status {
            s if s < 300 => break killed.elapsed(),
            503 => {
                unavailable += 1;
                assert!(
                    resp.headers.contains_key("retry-after"),
                    "{:?}",
                    resp.headers
                );
            }
            // The hop to the killed owner: refused before etcd lets its shards go.
            other => assert!((502..=504).contains(&other), "{other}: {}", resp.body),
        }
        assert!(Instant::now() < until, "never taken over");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    settled(&[&b]).await;
    let s = b.status().await;
    assert!(s["stats"]["takeovers"].as_u64() > Some(0), "{s}");
    // Not before the lease could have expired and the wait passed; within a bound.
    assert!(
        taken_over >= TTL + UPSTREAM_TIMEOUT,
        "taken over after {taken_over:?}"
    );
    assert!(
        taken_over <= 2 * TTL + UPSTREAM_TIMEOUT + Duration::from_secs(3),
        "taken over after {taken_over:?}"
    );
    assert!(unavailable > 0, "503 during the takeover");
    println!("takeover after SIGKILL: {taken_over:?}, {unavailable} answers 503 meanwhile");
    // a's marks were loaded: its token 6 is stale now behind 7, and 5 everywhere.
    assert_eq!(b.client().put(&a_shard_scope, "6", "x").await.status, 409);
    assert_eq!(b.client().put(&scopes[0], "5", "x").await.status, 409);
}
