//! Instances owning the cluster's shards between them (SPEC §10), against a real 3-member
//! etcd on loopback: three instances in one process, each with its ownership, owned shards,
//! gates and membership loop. The shards are spread evenly; a planned leave hands its
//! shards off with their marks and no takeover wait; a join takes its share by hand-off; a
//! lost instance's shards are taken over, each admitting nothing until its wait is over.
//! Every wait is bounded.
#![cfg(feature = "etcd")]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use fencegate::cluster::balance;
use fencegate::cluster::member::{Member, MemberConfig};
use fencegate::cluster::owned::{OwnedShards, State};
use fencegate::cluster::ownership::{Ownership, OwnershipConfig};
use fencegate::cluster::registry::View;
use fencegate::fence::{Gates, Refusal};
use fencegate::metrics::Metrics;
use fencegate::settings::EqualPolicy::Accept;
use fencegate::store::MarkStore;
use fencegate::token::Token;
use tokio::time::Instant;

use crate::support::etcd::EtcdCluster;

const TTL: Duration = Duration::from_secs(2);
const SHARDS: u32 = 8;
const UPSTREAM_TIMEOUT: Duration = Duration::from_millis(300);
/// Bound on any one change settling.
const BOUND: Duration = Duration::from_secs(20);

fn t(c: u64) -> Token {
    Token::new(1, c)
}

struct Instance {
    gates: Arc<Gates>,
    member: Member,
}

async fn instance(etcd: &EtcdCluster, name: &str) -> Instance {
    instance_fencing(etcd, name, None).await
}

/// An instance whose takeovers run `fence_command` first.
async fn instance_fencing(
    etcd: &EtcdCluster,
    name: &str,
    fence_command: Option<Vec<String>>,
) -> Instance {
    let ownership = Arc::new(
        Ownership::start(
            &etcd.endpoints(),
            OwnershipConfig {
                cluster: "member".into(),
                instance: name.into(),
                ownership_ttl: TTL,
                drift_margin: Duration::from_millis(250),
            },
        )
        .await
        .expect("ownership starts"),
    );
    let owned = OwnedShards::new(&ownership, SHARDS);
    let store =
        MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new()).expect("store");
    let gates = Arc::new(
        Gates::new(
            store,
            Arc::new(Metrics::new(Vec::new())),
            Duration::from_secs(5),
            Duration::ZERO,
        )
        .with_source(Arc::new(owned.clone())),
    );
    let busy = {
        let (gates, owned) = (gates.clone(), owned.clone());
        Arc::new(move |shard: u32| gates.busy(|scope| owned.shard_of(scope) == shard))
    };
    let member = Member::start(
        ownership,
        owned,
        busy,
        MemberConfig {
            shards: SHARDS,
            peer_addr: format!("127.0.0.1:1/{name}"),
            upstream_timeout: UPSTREAM_TIMEOUT,
            settle: Duration::ZERO,
            drain_bound: Duration::from_secs(2),
            tick: Duration::from_millis(200),
            fence_command,
            fence_timeout: Duration::from_secs(2),
        },
    )
    .await
    .expect("member starts");
    Instance { gates, member }
}

/// Shards per owner in `view`.
fn shares(view: &View) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for o in view.owners.values() {
        *out.entry(o.instance.clone()).or_insert(0) += 1;
    }
    out
}

/// Waits until every shard is owned, admitting, by exactly these instances, as the
/// balance assigns them (and each share is the floor or the ceiling of an even split);
/// answers the view.
async fn settled(instances: &[&Instance]) -> Arc<View> {
    let names: Vec<&str> = instances
        .iter()
        .map(|i| i.member.ownership().instance())
        .collect();
    let mut want = BTreeMap::new();
    for i in balance::assignment(&names, SHARDS) {
        *want.entry(names[i].to_string()).or_insert(0) += 1;
    }
    let even = SHARDS as usize / names.len();
    assert!(
        want.values().all(|&n| n == even || n == even + 1),
        "{want:?}"
    );
    let until = Instant::now() + BOUND;
    loop {
        let view = instances[0].member.view();
        let admitting = instances.iter().all(|i| {
            i.member
                .owned()
                .owned()
                .iter()
                .all(|o| o.state == State::Admitting && o.admit_after <= Instant::now())
        });
        let held: usize = instances
            .iter()
            .map(|i| i.member.owned().owned().len())
            .sum();
        if shares(&view) == want && admitting && held == SHARDS as usize {
            return view;
        }
        assert!(
            Instant::now() < until,
            "not settled on {want:?}: {:?}",
            shares(&view)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The instance of `instances` that owns `scope`'s shard.
fn owner_of<'a>(instances: &[&'a Instance], view: &View, scope: &str) -> &'a Instance {
    let shard = instances[0].member.owned().shard_of(scope);
    let name = &view.owners[&shard].instance;
    instances
        .iter()
        .find(|i| i.member.ownership().instance() == name)
        .copied()
        .expect("owner among the instances")
}

async fn write(i: &Instance, scope: &str, token: Token) -> Result<bool, Refusal> {
    let mut a = i.gates.admit(scope, token, Accept).await?;
    a.guard.complete();
    Ok(a.advanced)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_spread_hand_off_on_leave_and_join_and_are_taken_over_from_the_lost() {
    let etcd = EtcdCluster::start(3).await;
    let (a, b, c) = tokio::join!(
        instance(&etcd, "a"),
        instance(&etcd, "b"),
        instance(&etcd, "c")
    );
    let view = settled(&[&a, &b, &c]).await;
    assert_eq!(view.instances.len(), 3);
    let scopes: Vec<String> = (0..16).map(|i| format!("report/{i}")).collect();
    for s in &scopes {
        let owner = owner_of(&[&a, &b, &c], &view, s);
        assert_eq!(write(owner, s, t(5)).await, Ok(true), "{s}");
        // A non-owner decides nothing for it.
        for other in [&a, &b, &c] {
            if !std::ptr::eq(other, owner) {
                assert_eq!(write(other, s, t(9)).await, Err(Refusal::Unavailable));
            }
        }
    }

    // c leaves: its shards are handed off (drained, released) and a and b own them at
    // once, with c's marks.
    let c_handoffs = c.member.stats().handoffs.load(Ordering::Relaxed);
    let c_owned = c.member.owned().owned().len() as u64;
    c.member.leave().await.expect("leave");
    assert_eq!(
        c.member.stats().handoffs.load(Ordering::Relaxed),
        c_handoffs + c_owned,
        "every shard c held was handed off"
    );
    let view = settled(&[&a, &b]).await;
    assert!(!view.instances.contains_key("c"));
    for i in [&a, &b] {
        assert_eq!(
            i.member.stats().takeovers.load(Ordering::Relaxed),
            0,
            "a planned hand-off needs no wait"
        );
    }
    for s in &scopes {
        let owner = owner_of(&[&a, &b], &view, s);
        assert_eq!(
            write(owner, s, t(4)).await,
            Err(Refusal::Stale {
                highest: Some(t(5))
            }),
            "{s}: the mark came with the shard"
        );
        assert_eq!(write(owner, s, t(5)).await, Ok(false));
    }

    // d joins: it takes its share by hand-off from a and b.
    let d = instance(&etcd, "d").await;
    let view = settled(&[&a, &b, &d]).await;
    let handed: u64 = [&a, &b]
        .iter()
        .map(|i| i.member.stats().handoffs.load(Ordering::Relaxed))
        .sum();
    assert!(handed >= 2, "{handed} hand-offs to d");
    for s in &scopes {
        let owner = owner_of(&[&a, &b, &d], &view, s);
        assert_eq!(write(owner, s, t(6)).await, Ok(true), "{s}");
    }

    // d is lost (it stops renewing, as if killed): after its lease expires, a and b take
    // its shards over, each admitting nothing until its takeover wait is over.
    let d_shards: Vec<u32> = d.member.owned().owned().iter().map(|o| o.shard).collect();
    d.member.ownership().stop_renewing();
    let lost_at = Instant::now();
    drop(d);
    let view = settled(&[&a, &b]).await;
    let taken = lost_at.elapsed();
    let takeovers: u64 = [&a, &b]
        .iter()
        .map(|i| i.member.stats().takeovers.load(Ordering::Relaxed))
        .sum();
    assert_eq!(takeovers, d_shards.len() as u64);
    // At least the lease's expiry, then the wait: ttl + upstream timeout.
    assert!(taken >= TTL + TTL - Duration::from_millis(250), "{taken:?}");
    for s in &scopes {
        let owner = owner_of(&[&a, &b], &view, s);
        assert_eq!(
            write(owner, s, t(5)).await,
            Err(Refusal::Stale {
                highest: Some(t(6))
            }),
            "{s}"
        );
    }
}

/// A takeover runs `fence_command` (once per lost owner, its name in
/// `FENCEGATE_FENCED_INSTANCE`) and takes nothing of the lost owner's until it exits 0:
/// a failing command leaves those shards claimed and admitting nothing, tried again each
/// pass; once it succeeds they are taken (after the takeover wait) with their marks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_waits_for_the_fence_command_to_succeed() {
    let etcd = EtcdCluster::start(3).await;
    let dir = tempfile::tempdir().expect("dir");
    let (log, rc) = (dir.path().join("fenced.log"), dir.path().join("rc"));
    std::fs::write(&rc, "1").expect("rc");
    let command = vec![
        "sh".to_string(),
        "-c".to_string(),
        format!(
            "echo \"$FENCEGATE_FENCED_INSTANCE\" >> {}; exit $(cat {})",
            log.display(),
            rc.display()
        ),
    ];
    let a = instance(&etcd, "a").await;
    let b = instance_fencing(&etcd, "b", Some(command)).await;
    settled(&[&a, &b]).await;
    let a_shards: Vec<u32> = a.member.owned().owned().iter().map(|o| o.shard).collect();
    let scope = (0..64)
        .map(|i| format!("report/{i}"))
        .find(|s| a_shards.contains(&a.member.owned().shard_of(s)))
        .expect("a scope of a's");
    assert_eq!(write(&a, &scope, t(5)).await, Ok(true));

    a.member.ownership().stop_renewing();
    drop(a);
    // b claims a's shards once a's lease is gone, but its fence fails: they stay unfenced.
    let until = Instant::now() + BOUND;
    while b.member.unfenced().len() < a_shards.len() {
        assert!(
            Instant::now() < until,
            "never claimed: {:?}",
            b.member.unfenced()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(b.member.unfenced().values().all(|o| o == "a"));
    assert_eq!(write(&b, &scope, t(6)).await, Err(Refusal::Unavailable));
    let runs = b.member.stats().fence_runs.load(Ordering::Relaxed);
    assert!(runs >= 1);
    assert_eq!(
        b.member.stats().fence_failures.load(Ordering::Relaxed),
        runs
    );
    // Still failing on the next passes, once per pass (not once per shard).
    let until = Instant::now() + BOUND;
    while b.member.stats().fence_runs.load(Ordering::Relaxed) < runs + 2 {
        assert!(Instant::now() < until);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(write(&b, &scope, t(6)).await, Err(Refusal::Unavailable));

    // The fence succeeds: b takes the shards (after the wait) with a's marks.
    std::fs::write(&rc, "0").expect("rc");
    let view = settled(&[&b]).await;
    assert!(b.member.unfenced().is_empty());
    assert!(view.owners.values().all(|o| o.instance == "b"));
    assert_eq!(
        write(&b, &scope, t(5)).await,
        Ok(false),
        "a's mark came with the shard"
    );
    assert_eq!(write(&b, &scope, t(6)).await, Ok(true));
    let fenced = std::fs::read_to_string(&log).expect("log");
    let lines: Vec<&str> = fenced.lines().collect();
    assert!(lines.iter().all(|l| *l == "a"), "{fenced}");
    // Every run was for a, and counted.
    assert_eq!(
        lines.len() as u64,
        b.member.stats().fence_runs.load(Ordering::Relaxed)
    );
}
