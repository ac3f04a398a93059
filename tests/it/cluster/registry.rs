//! The instance registry and the watched view against a real 3-member etcd on loopback: a
//! name is held by one live instance at a time, and the view follows instances joining and
//! leaving and shards being claimed, released and claimed again, never showing `claimed`,
//! `released` or the marks, and falls back to a full read when its watch is compacted away.
//! Every wait is bounded.
#![cfg(feature = "etcd")]

use std::collections::BTreeMap;
use std::time::Duration;

use etcd_client::CompactionOptions;
use fencegate::cluster::ownership::{Claim, Error, Ownership, OwnershipConfig};
use fencegate::cluster::registry::{Owner, View, ViewWatch, agree_on_shards, deregister, register};
use tokio::time::Instant;

use crate::support::BOUND;
use crate::support::etcd::EtcdCluster;

const TTL: Duration = Duration::from_secs(2);
const CLUSTER: &str = "registry";

async fn instance(etcd: &EtcdCluster, name: &str) -> Ownership {
    Ownership::start(
        &etcd.endpoints(),
        OwnershipConfig {
            cluster: CLUSTER.into(),
            instance: name.into(),
            ownership_ttl: TTL,
            drift_margin: Duration::from_millis(250),
        },
    )
    .await
    .expect("ownership starts")
}

async fn admin(etcd: &EtcdCluster) -> etcd_client::Client {
    etcd_client::Client::connect(etcd.endpoints(), None)
        .await
        .expect("etcd client")
}

fn key(rest: &str) -> String {
    format!("/fencegate/cluster/{CLUSTER}/{rest}")
}

async fn own(o: &Ownership, shard: u32) -> u64 {
    match o.claim(shard).await.expect("claim") {
        Claim::Owned { epoch, .. } => epoch,
        c => panic!("shard {shard} is free: {c:?}"),
    }
}

fn instances(list: &[(&str, &str)]) -> BTreeMap<String, String> {
    list.iter()
        .map(|(n, a)| (n.to_string(), a.to_string()))
        .collect()
}

fn owners(list: &[(u32, &str, u64)]) -> BTreeMap<u32, Owner> {
    list.iter()
        .map(|&(shard, name, epoch)| {
            (
                shard,
                Owner {
                    instance: name.into(),
                    epoch,
                },
            )
        })
        .collect()
}

/// Waits (bounded) until the view holds exactly these instances and owners.
async fn until(
    view: &ViewWatch,
    instances: &BTreeMap<String, String>,
    owners: &BTreeMap<u32, Owner>,
) -> std::sync::Arc<View> {
    match view
        .wait_for(BOUND, |v| &v.instances == instances && &v.owners == owners)
        .await
    {
        Some(v) => v,
        None => panic!(
            "the view never showed {instances:?} {owners:?}; it is {:?}",
            view.current()
        ),
    }
}

/// The watched view and a full read of a fresh one agree once the watch has caught up.
async fn agrees_with_a_fresh_read(view: &ViewWatch, o: &Ownership, shards: u32) {
    let fresh = ViewWatch::start(o, shards)
        .await
        .expect("fresh view")
        .current();
    let caught_up = view
        .wait_for(BOUND, |v| v.revision >= fresh.revision)
        .await
        .expect("the watch catches up with a fresh read");
    assert_eq!(
        (&caught_up.instances, &caught_up.owners),
        (&fresh.instances, &fresh.owners)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_is_held_by_one_live_instance_and_free_once_its_lease_ends() {
    let etcd = EtcdCluster::start(3).await;
    let a = instance(&etcd, "a").await;
    let again = instance(&etcd, "a").await;
    let mut admin = admin(&etcd).await;
    let held = |admin: &mut etcd_client::Client| {
        let mut admin = admin.clone();
        async move {
            let resp = admin.get(key("instances/a"), None).await.expect("get");
            resp.kvs()
                .first()
                .map(|kv| (kv.value_str().expect("utf-8").to_owned(), kv.lease()))
        }
    };

    register(&a, "127.0.0.1:7401").await.expect("register a");
    match register(&again, "127.0.0.1:7402").await {
        Err(Error::Config(m)) => assert_eq!(
            m,
            format!(
                "instance name \"a\" is already registered by a running instance (lease {:x})",
                a.lease_id()
            )
        ),
        other => panic!("a second live \"a\" is refused: {other:?}"),
    }
    assert_eq!(
        held(&mut admin).await,
        Some(("127.0.0.1:7401".into(), a.lease_id()))
    );

    // A retry by the same ownership (a lost answer, a new address) is fine.
    register(&a, "127.0.0.1:7401").await.expect("retry");
    register(&a, "127.0.0.1:7403")
        .await
        .expect("retry, new address");
    assert_eq!(
        held(&mut admin).await,
        Some(("127.0.0.1:7403".into(), a.lease_id()))
    );

    // The first one's lease ends: the name is free at once, and the old ownership's
    // deregister does not touch the new registration.
    admin.lease_revoke(a.lease_id()).await.expect("revoke");
    register(&again, "127.0.0.1:7402")
        .await
        .expect("the name is free");
    deregister(&a).await.expect("deregister a (not ours now)");
    assert_eq!(
        held(&mut admin).await,
        Some(("127.0.0.1:7402".into(), again.lease_id()))
    );
    deregister(&again).await.expect("deregister");
    assert_eq!(held(&mut admin).await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_view_sees_instances_join_and_leave_with_their_addresses() {
    let etcd = EtcdCluster::start(3).await;
    let (a, b, c) = tokio::join!(
        instance(&etcd, "a"),
        instance(&etcd, "b"),
        instance(&etcd, "c")
    );
    let view = ViewWatch::start(&a, 8).await.expect("view");
    let first = view.current();
    assert!(first.instances.is_empty() && first.owners.is_empty());
    assert!(first.revision > 0);

    register(&a, "10.0.0.1:7401").await.expect("register a");
    register(&b, "10.0.0.2:7401").await.expect("register b");
    let none = owners(&[]);
    let joined = until(
        &view,
        &instances(&[("a", "10.0.0.1:7401"), ("b", "10.0.0.2:7401")]),
        &none,
    )
    .await;
    assert!(joined.revision > first.revision);
    register(&c, "10.0.0.3:7401").await.expect("register c");
    until(
        &view,
        &instances(&[
            ("a", "10.0.0.1:7401"),
            ("b", "10.0.0.2:7401"),
            ("c", "10.0.0.3:7401"),
        ]),
        &none,
    )
    .await;

    // Leaving: a clean shutdown, and a lease that ends under the instance.
    deregister(&b).await.expect("deregister b");
    until(
        &view,
        &instances(&[("a", "10.0.0.1:7401"), ("c", "10.0.0.3:7401")]),
        &none,
    )
    .await;
    admin(&etcd)
        .await
        .lease_revoke(c.lease_id())
        .await
        .expect("revoke c");
    until(&view, &instances(&[("a", "10.0.0.1:7401")]), &none).await;

    // A subscriber is told of the next change.
    let mut rx = view.subscribe();
    rx.borrow_and_update();
    register(&b, "10.0.0.2:7402").await.expect("b again");
    tokio::time::timeout(BOUND, rx.changed())
        .await
        .expect("told within the bound")
        .expect("the view's task runs");
    until(
        &view,
        &instances(&[("a", "10.0.0.1:7401"), ("b", "10.0.0.2:7402")]),
        &none,
    )
    .await;
    agrees_with_a_fresh_read(&view, &a, 8).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_view_sees_claims_releases_and_reclaims_and_nothing_else() {
    let etcd = EtcdCluster::start(3).await;
    let (a, b) = tokio::join!(instance(&etcd, "a"), instance(&etcd, "b"));
    let view = ViewWatch::start(&a, 4).await.expect("view");
    let none = instances(&[]);

    let first = own(&a, 1).await;
    until(&view, &none, &owners(&[(1, "a", first)])).await;

    // Keys that are not the view's: marks (never read or watched), an owner key past the
    // shard count, and an owner whose value is not UTF-8 (logged and skipped).
    let mut admin = admin(&etcd).await;
    for (k, v) in [
        (key("marks/1/scope"), b"7".to_vec()),
        (key("marks/2/scope"), b"3:12 4".to_vec()),
        (key("shards/9/owner"), b"x".to_vec()),
        (key("shards/2/owner"), b"\xff\xfe".to_vec()),
        (key("shards/2/nonsense"), b"x".to_vec()),
    ] {
        admin.put(k, v, None).await.expect("raw put");
    }

    assert!(a.release(1, first).await.expect("release"));
    until(&view, &none, &owners(&[])).await;
    let second = own(&b, 1).await;
    assert!(
        second > first,
        "a re-claim's epoch {second} outranks {first}"
    );
    let reclaimed = until(&view, &none, &owners(&[(1, "b", second)])).await;
    assert!(reclaimed.revision >= i64::try_from(second).expect("epoch"));

    // `claimed` and `released` are in etcd all along; the view shows none of them.
    let under_shards = admin
        .get(
            key("shards/"),
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_keys_only(),
            ),
        )
        .await
        .expect("list");
    let stored: Vec<String> = under_shards
        .kvs()
        .iter()
        .map(|kv| kv.key_str().expect("utf-8").to_owned())
        .collect();
    assert!(stored.contains(&key("shards/1/claimed")), "{stored:?}");
    let current = view.current();
    assert_eq!(current.owners, owners(&[(1, "b", second)]));
    assert!(current.instances.is_empty());
    agrees_with_a_fresh_read(&view, &b, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_from_a_compacted_revision_falls_back_to_a_full_read() {
    let etcd = EtcdCluster::start(3).await;
    let (a, b) = tokio::join!(instance(&etcd, "a"), instance(&etcd, "b"));
    let view = ViewWatch::start(&a, 8).await.expect("view");
    let started_at = view.current().revision;
    assert_eq!(view.full_reads(), 1);

    // A burst of changes, followed by the watch.
    register(&a, "10.0.0.1:7401").await.expect("register a");
    register(&b, "10.0.0.2:7401").await.expect("register b");
    let mut epochs = BTreeMap::new();
    for shard in 0..8 {
        let o = if shard % 2 == 0 { &a } else { &b };
        epochs.insert(shard, own(o, shard).await);
    }
    for shard in [1, 3] {
        assert!(b.release(shard, epochs[&shard]).await.expect("release"));
    }
    deregister(&b).await.expect("deregister b");
    let expected = owners(&[
        (0, "a", epochs[&0]),
        (2, "a", epochs[&2]),
        (4, "a", epochs[&4]),
        (5, "b", epochs[&5]),
        (6, "a", epochs[&6]),
        (7, "b", epochs[&7]),
    ]);
    let seen = until(&view, &instances(&[("a", "10.0.0.1:7401")]), &expected).await;

    // History up to now is gone; a watch resumed from before it must read whole.
    let mut admin = admin(&etcd).await;
    let now = admin
        .get(key("instances/"), None)
        .await
        .expect("revision")
        .header()
        .expect("header")
        .revision();
    assert!(now >= seen.revision);
    admin
        .compact(now, Some(CompactionOptions::new().with_physical()))
        .await
        .expect("compact");
    view.rewatch_from(started_at + 1);
    let bound = Instant::now() + BOUND;
    while view.full_reads() < 2 {
        assert!(
            Instant::now() < bound,
            "the compacted watch never fell back to a read"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let reread = view.current();
    assert!(reread.revision >= now);
    assert_eq!(reread.instances, instances(&[("a", "10.0.0.1:7401")]));
    assert_eq!(reread.owners, expected);

    // And the watch goes on from the read.
    let taken = own(&a, 1).await;
    register(&b, "10.0.0.2:7402").await.expect("b again");
    let mut after = expected.clone();
    after.insert(
        1,
        Owner {
            instance: "a".into(),
            epoch: taken,
        },
    );
    until(
        &view,
        &instances(&[("a", "10.0.0.1:7401"), ("b", "10.0.0.2:7402")]),
        &after,
    )
    .await;
    assert_eq!(view.full_reads(), 2, "no read beyond the one fallback");
    agrees_with_a_fresh_read(&view, &a, 8).await;
}

/// One shard count per cluster: the first instance sets it, one configured with another
/// is refused by name (two counts would map one scope to two shards, two marks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_keeps_one_shard_count() {
    let etcd = EtcdCluster::start(1).await;
    let a = instance(&etcd, "a").await;
    let b = instance(&etcd, "b").await;
    agree_on_shards(&a, 8).await.expect("the first sets it");
    agree_on_shards(&b, 8).await.expect("the same count joins");
    match agree_on_shards(&b, 4).await {
        Err(Error::Config(message)) => {
            assert!(message.contains("has 8 shards"), "{message}");
            assert!(message.contains("configured with 4"), "{message}");
        }
        other => panic!("another count must be refused: {other:?}"),
    }
    let mut c = admin(&etcd).await;
    let held = c.get(key("config/shards"), None).await.expect("get");
    assert_eq!(
        held.kvs().first().map(|kv| kv.value().to_vec()),
        Some(b"8".to_vec())
    );
}
