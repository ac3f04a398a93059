//! Shard ownership against a real 3-member etcd cluster on loopback (started and removed by
//! each test): one owner per shard, self-fencing before etcd expires a lost owner, planned
//! hand-offs, and a leader failover under an owner that keeps renewing. Real time: etcd's
//! lease ttls are whole seconds; every wait is a bounded poll.
//!
//! Needs `--features etcd` (protoc at build time) and `etcd` on the machine.
#![cfg(feature = "etcd")]

use std::time::Duration;

use fencegate::cluster::ownership::{Claim, Ownership, OwnershipConfig, Previous, takeover_wait};
use tokio::time::Instant;

use crate::support::etcd::EtcdCluster;

const TTL: Duration = Duration::from_secs(2);
const MARGIN: Duration = Duration::from_millis(250);
/// How often a claimant polls a shard it waits for.
const POLL: Duration = Duration::from_millis(20);

async fn instance(cluster: &EtcdCluster, name: &str) -> Ownership {
    Ownership::start(
        &cluster.endpoints(),
        OwnershipConfig {
            cluster: "test".into(),
            instance: name.into(),
            ownership_ttl: TTL,
            drift_margin: MARGIN,
        },
    )
    .await
    .expect("ownership starts")
}

fn owned(claim: &Claim) -> Option<u64> {
    match claim {
        Claim::Owned { epoch, .. } => Some(*epoch),
        Claim::Taken { .. } => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_claimants_of_one_shard_one_owns_it_the_other_is_told_who() {
    let etcd = EtcdCluster::start(3).await;
    let (a, b) = tokio::join!(instance(&etcd, "a"), instance(&etcd, "b"));
    let (ca, cb) = tokio::join!(a.claim(7), b.claim(7));
    let (ca, cb) = (ca.expect("claim a"), cb.expect("claim b"));
    let (winner, epoch, loser) = match (owned(&ca), owned(&cb)) {
        (Some(e), None) => ("a", e, cb),
        (None, Some(e)) => ("b", e, ca),
        _ => panic!("exactly one owner: {ca:?} {cb:?}"),
    };
    assert_eq!(
        loser,
        Claim::Taken {
            owner: winner.into(),
            epoch
        }
    );
    // A fresh shard had no owner before; claiming it again is idempotent.
    let w = if winner == "a" { &a } else { &b };
    assert_eq!(
        w.claim(7).await.expect("claim again"),
        Claim::Owned {
            shard: 7,
            epoch,
            previous: Previous::Ours
        }
    );
    // Another shard is independent of the first.
    let other = if winner == "a" { &b } else { &a };
    match other.claim(8).await.expect("claim 8") {
        Claim::Owned {
            shard: 8,
            epoch: e8,
            previous: Previous::None,
        } => assert!(e8 > epoch),
        c => panic!("shard 8 is free: {c:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_stops_renewing_is_invalid_before_another_can_claim() {
    let etcd = EtcdCluster::start(3).await;
    let a = instance(&etcd, "a").await;
    let b = instance(&etcd, "b").await;
    let Claim::Owned { epoch: old, .. } = a.claim(3).await.expect("claim a") else {
        panic!("a owns the free shard");
    };
    let validity = a.validity();
    assert!(validity.is_valid());
    a.stop_renewing();
    let stopped = Instant::now();

    // b polls the claim; at the send of its first successful one, a's validity must
    // already have passed.
    let bound = stopped + TTL * 4;
    let (sent, claim) = loop {
        assert!(
            Instant::now() < bound,
            "the shard stays taken past {:?}",
            TTL * 4
        );
        let sent = Instant::now();
        let claim = b.claim(3).await.expect("claim b");
        match &claim {
            Claim::Taken { owner, epoch } => {
                assert_eq!((owner.as_str(), *epoch), ("a", old));
                tokio::time::sleep(POLL).await;
            }
            Claim::Owned { .. } => break (sent, claim),
        }
    };
    let deadline = validity.deadline().expect("a's lease was not seen gone");
    assert!(
        deadline <= sent,
        "a was valid until {:?} after b's winning claim was sent",
        deadline - sent
    );
    eprintln!(
        "a invalid {:?} after it stopped renewing; b owned it {:?} after a's deadline",
        deadline - stopped,
        sent - deadline
    );
    match claim {
        Claim::Owned {
            epoch,
            previous: Previous::Lost { owner, epoch: prev },
            ..
        } => {
            assert!(epoch > old, "the new epoch {epoch} outranks {old}");
            assert_eq!((owner.as_str(), prev), ("a", old));
            assert_eq!(
                claim_wait(epoch, owner, prev),
                TTL + Duration::from_secs(30) + Duration::from_secs(1)
            );
        }
        c => panic!("a lost shard is taken over: {c:?}"),
    }
}

/// A lease revoked in etcd (an operator's `etcdctl lease revoke`): another instance can
/// claim at once, while the old owner still holds the deadline of its last keep-alive. The
/// takeover wait's ttl term covers that deadline, and the old owner learns of the loss at
/// its next keep-alive (ttl 0), then refuses to claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_owner_is_lost_at_its_next_keep_alive_and_the_wait_covers_its_deadline() {
    let etcd = EtcdCluster::start(3).await;
    let a = instance(&etcd, "a").await;
    let b = instance(&etcd, "b").await;
    let Claim::Owned { epoch: old, .. } = a.claim(2).await.expect("claim a") else {
        panic!("a owns the free shard");
    };
    let mut admin = etcd_client::Client::connect(etcd.endpoints(), None)
        .await
        .expect("etcd client");
    admin.lease_revoke(a.lease_id()).await.expect("revoke");
    let revoked = Instant::now();

    let sent = Instant::now();
    let claim = b.claim(2).await.expect("claim b");
    let Claim::Owned {
        epoch,
        previous: Previous::Lost { ref owner, .. },
        ..
    } = claim
    else {
        panic!("a revoked owner's shard is free at once: {claim:?}");
    };
    assert!(epoch > old);
    assert_eq!(owner, "a");
    let wait = claim.wait(TTL, Duration::ZERO, Duration::ZERO);
    if let Some(deadline) = a.validity().deadline() {
        assert!(
            deadline <= sent + wait,
            "a is valid {:?} past the takeover wait",
            deadline - (sent + wait)
        );
    }

    // One keep-alive round (a third of the ttl) and its answer.
    let bound = revoked + TTL * 2;
    while !a.validity().is_lost() {
        assert!(
            Instant::now() < bound,
            "a never learnt its lease was revoked"
        );
        tokio::time::sleep(POLL).await;
    }
    assert!(!a.validity().is_valid());
    eprintln!(
        "a saw its lease gone {:?} after the revoke",
        revoked.elapsed()
    );
    assert!(matches!(
        a.claim(9).await,
        Err(fencegate::cluster::ownership::Error::Lost)
    ));
}

fn claim_wait(epoch: u64, owner: String, prev: u64) -> Duration {
    Claim::Owned {
        shard: 3,
        epoch,
        previous: Previous::Lost { owner, epoch: prev },
    }
    .wait(TTL, Duration::from_secs(30), Duration::from_secs(1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_shard_is_claimed_at_once_and_a_deposed_release_deletes_nothing() {
    let etcd = EtcdCluster::start(3).await;
    let (a, b, c) = tokio::join!(
        instance(&etcd, "a"),
        instance(&etcd, "b"),
        instance(&etcd, "c")
    );
    let Claim::Owned { epoch: first, .. } = a.claim(1).await.expect("claim a") else {
        panic!("a owns the free shard");
    };
    assert!(a.release(1, first).await.expect("release"));
    // No poll: the very next claim owns it, and knows no wait applies.
    let claim = b.claim(1).await.expect("claim b");
    let Claim::Owned {
        epoch: second,
        previous: Previous::Released { epoch: released },
        ..
    } = claim
    else {
        panic!("a released shard is free: {claim:?}");
    };
    assert!(second > first);
    assert_eq!(released, first);
    assert_eq!(
        claim.wait(TTL, Duration::from_secs(30), Duration::from_secs(1)),
        Duration::ZERO
    );

    // a, deposed, releases its old epoch: b keeps the shard.
    assert!(!a.release(1, first).await.expect("deposed release"));
    assert_eq!(
        c.claim(1).await.expect("claim c"),
        Claim::Taken {
            owner: "b".into(),
            epoch: second
        }
    );
    // And the marker was consumed by b's claim: were b now lost, the next claim would wait.
    assert!(b.release(1, second).await.expect("release b"));
    assert!(matches!(
        c.claim(1).await.expect("claim c"),
        Claim::Owned { previous: Previous::Released { epoch }, .. } if epoch == second
    ));
}

/// A release that could not drain leaves no release marker: the next claim waits the
/// full takeover wait, and is told the owner was alive (no `fence_command`); the marker is
/// consumed, so a drained release after it is again without a wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undrained_release_makes_the_next_claim_wait_in_full() {
    let etcd = EtcdCluster::start(1).await;
    let (a, b) = tokio::join!(instance(&etcd, "a"), instance(&etcd, "b"));
    let Claim::Owned { epoch: first, .. } = a.claim(2).await.expect("claim a") else {
        panic!("a owns the free shard");
    };
    assert!(a.release_undrained(2, first).await.expect("release"));
    let claim = b.claim(2).await.expect("claim b");
    let Claim::Owned {
        epoch: second,
        previous: Previous::Undrained { epoch },
        ..
    } = claim
    else {
        panic!("undrained: {claim:?}");
    };
    assert_eq!(epoch, first);
    let (upstream, settle) = (Duration::from_secs(30), Duration::from_secs(1));
    assert_eq!(
        claim.wait(TTL, upstream, settle),
        takeover_wait(TTL, upstream, settle)
    );
    // Consumed by b's claim: b's drained release lets a claim without a wait.
    assert!(b.release(2, second).await.expect("release b"));
    let claim = a.claim(2).await.expect("claim a again");
    assert!(
        matches!(claim, Claim::Owned { previous: Previous::Released { epoch }, .. } if epoch == second),
        "{claim:?}"
    );
    assert_eq!(claim.wait(TTL, upstream, settle), Duration::ZERO);
}

/// Moves the etcd cluster's leadership to member `target` (bounded tries).
async fn lead_from(etcd: &EtcdCluster, target: usize) {
    let bound = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(
            Instant::now() < bound,
            "member {target} never became the leader"
        );
        match etcd.leader().await {
            Some(i) if i == target => return,
            Some(i) => {
                let options = etcd_client::ConnectOptions::new()
                    .with_connect_timeout(Duration::from_millis(500))
                    .with_timeout(Duration::from_millis(1000));
                if let Ok(mut c) = etcd_client::Client::connect(
                    [etcd.members[i].client_url.as_str()],
                    Some(options),
                )
                .await
                    && let Ok(list) = c.member_list().await
                    && let Some(id) = list
                        .members()
                        .iter()
                        .find(|m| m.name() == etcd.members[target].name)
                        .map(|m| m.id())
                {
                    let _ = c.move_leader(id).await;
                }
            }
            None => {}
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How soon after the leader is killed a renewing owner holds a deadline from a keep-alive
/// sent after the kill: an election (500 ms in the harness) plus a keep-alive round or two.
const FAILOVER_BOUND: Duration = Duration::from_secs(6);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_renewing_through_a_leader_failover_stays_the_only_owner() {
    let mut etcd = EtcdCluster::start(3).await;
    let a = instance(&etcd, "a").await;
    let b = instance(&etcd, "b").await;
    let Claim::Owned { epoch, .. } = a.claim(5).await.expect("claim a") else {
        panic!("a owns the free shard");
    };
    let validity = a.validity();
    // The owners talk to the first member until it fails: make it the leader, so the kill
    // takes both the leader and the member the keep-alives go to.
    lead_from(&etcd, 0).await;
    let leader = etcd.leader().await.expect("a leader");
    assert_eq!(leader, 0);
    etcd.kill(leader);
    let killed = Instant::now();

    // Until a holds a deadline that only a keep-alive sent after the kill can give, b keeps
    // trying to claim: never does it own the shard (errors during the election are fine).
    let renewed_after_kill = killed + TTL - MARGIN;
    let mut longest_gap = Duration::ZERO;
    let mut invalid_since: Option<Instant> = None;
    let regained = loop {
        let now = Instant::now();
        assert!(
            now < killed + FAILOVER_BOUND,
            "a renewed nothing within {FAILOVER_BOUND:?} of the leader's kill"
        );
        match (validity.is_valid(), invalid_since) {
            (false, None) => invalid_since = Some(now),
            (true, Some(since)) => {
                longest_gap = longest_gap.max(now - since);
                invalid_since = None;
            }
            _ => {}
        }
        assert!(!validity.is_lost(), "a's lease survives the failover");
        if let Ok(claim) = b.claim(5).await {
            assert_eq!(
                claim,
                Claim::Taken {
                    owner: "a".into(),
                    epoch
                },
                "two owners at once"
            );
        }
        if validity.deadline().is_some_and(|d| d > renewed_after_kill) {
            break now - killed;
        }
        tokio::time::sleep(POLL).await;
    };
    assert!(validity.is_valid());
    eprintln!(
        "renewed {regained:?} after the leader's kill; longest invalid stretch {longest_gap:?}"
    );
    // The survivors agree afterwards too.
    assert_eq!(
        b.claim(5).await.expect("claim b after the failover"),
        Claim::Taken {
            owner: "a".into(),
            epoch
        }
    );
}
