//! The gates on a cluster's marks (SPEC §10), against a real 3-member etcd on loopback:
//! two instances in one process, each with its ownership, its owned shards and its gates.
//! An instance decides only for the shards it owns, from the marks etcd holds for them;
//! a planned hand-off carries every mark over; a gate kept hot from an earlier ownership
//! takes the marks another owner advanced meanwhile; a deposed owner's advance is refused
//! and writes nothing; a takeover admits nothing until its wait is over.
#![cfg(feature = "etcd")]

use std::sync::Arc;
use std::time::Duration;

use fencegate::cluster::marks::EtcdMarks;
use fencegate::cluster::owned::{OwnedShards, State};
use fencegate::cluster::ownership::{Claim, Ownership, OwnershipConfig, Previous};
use fencegate::fence::{Gates, Refusal};
use fencegate::metrics::Metrics;
use fencegate::settings::EqualPolicy::Accept;
use fencegate::store::{Mark, MarkStore};
use fencegate::token::Token;
use tokio::time::Instant;

use crate::support::etcd::EtcdCluster;

const TTL: Duration = Duration::from_secs(2);
const SHARDS: u32 = 4;
const SCOPE: &str = "report/1";

fn t(c: u64) -> Token {
    Token::new(1, c)
}

struct Instance {
    ownership: Ownership,
    shards: OwnedShards,
    gates: Gates,
}

async fn instance(etcd: &EtcdCluster, name: &str) -> Instance {
    let ownership = Ownership::start(
        &etcd.endpoints(),
        OwnershipConfig {
            cluster: "owned".into(),
            instance: name.into(),
            ownership_ttl: TTL,
            drift_margin: Duration::from_millis(250),
        },
    )
    .await
    .expect("ownership starts");
    let shards = OwnedShards::new(&ownership, SHARDS);
    let store =
        MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new()).expect("store");
    let gates = Gates::new(
        store,
        Arc::new(Metrics::new(Vec::new())),
        Duration::from_secs(5),
        Duration::ZERO,
    )
    .with_source(Arc::new(shards.clone()));
    Instance {
        ownership,
        shards,
        gates,
    }
}

impl Instance {
    async fn claim(&self, shard: u32) -> (u64, Previous) {
        match self.ownership.claim(shard).await.expect("claim") {
            Claim::Owned {
                epoch, previous, ..
            } => (epoch, previous),
            c => panic!("shard {shard} is free: {c:?}"),
        }
    }

    /// Admits one request and finishes it as answered; answers whether it advanced.
    async fn write(&self, token: Token) -> Result<bool, Refusal> {
        let mut a = self.gates.admit(SCOPE, token, Accept).await?;
        a.guard.complete();
        Ok(a.advanced)
    }

    fn busy(&self, shard: u32) -> bool {
        let shards = self.shards.clone();
        self.gates
            .busy(move |scope| shards.shard_of(scope) == shard)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_decides_only_for_its_shards_on_the_marks_in_etcd() {
    let etcd = EtcdCluster::start(3).await;
    let (a, b) = tokio::join!(instance(&etcd, "a"), instance(&etcd, "b"));
    let shard = a.shards.shard_of(SCOPE);
    let raw = EtcdMarks::new(&a.ownership);

    // Not owned: nothing is decided, not even a stale refusal.
    assert_eq!(a.write(t(5)).await, Err(Refusal::Unavailable));
    let (epoch_a, previous) = a.claim(shard).await;
    assert_eq!(previous, Previous::None);
    assert_eq!(a.shards.take(shard, epoch_a, Instant::now()).await, Ok(0));

    // An advance is in etcd before it is admitted; equal and stale tokens are decided in
    // memory, with no transaction.
    assert_eq!(a.write(t(5)).await, Ok(true));
    assert_eq!(raw.get(shard, SCOPE).await, Ok(Some(Mark::of(t(5)))));
    let txns = a.shards.writer_stats().commit_batch_size.count();
    assert_eq!(a.write(t(5)).await, Ok(false));
    assert_eq!(
        a.write(t(4)).await,
        Err(Refusal::Stale {
            highest: Some(t(5))
        })
    );
    assert_eq!(a.shards.writer_stats().commit_batch_size.count(), txns);
    // b does not own the shard: it refuses, and an advance it never made is not in etcd.
    assert_eq!(b.write(t(9)).await, Err(Refusal::Unavailable));
    assert_eq!(raw.get(shard, SCOPE).await, Ok(Some(Mark::of(t(5)))));

    // A planned hand-off: a drains (admitting nothing), releases; b loads the marks.
    assert!(a.shards.drain(shard, epoch_a));
    assert_eq!(a.write(t(5)).await, Err(Refusal::Unavailable));
    assert!(!a.busy(shard), "nothing in flight to drain");
    assert!(a.ownership.release(shard, epoch_a).await.expect("release"));
    a.shards.forget(shard);
    let (epoch_b, previous) = b.claim(shard).await;
    assert_eq!(previous, Previous::Released { epoch: epoch_a });
    assert!(epoch_b > epoch_a);
    assert_eq!(b.shards.take(shard, epoch_b, Instant::now()).await, Ok(1));
    assert_eq!(
        b.write(t(4)).await,
        Err(Refusal::Stale {
            highest: Some(t(5))
        })
    );
    assert_eq!(b.write(t(6)).await, Ok(true));

    // Back to a, whose gate for the scope is still hot with 5: the gate takes the mark b
    // advanced (6) before deciding, so 5 is stale now, not equal.
    assert!(b.shards.drain(shard, epoch_b));
    assert!(b.ownership.release(shard, epoch_b).await.expect("release"));
    b.shards.forget(shard);
    let (epoch_a2, _) = a.claim(shard).await;
    assert_eq!(a.shards.take(shard, epoch_a2, Instant::now()).await, Ok(1));
    assert_eq!(
        a.gates.mark(SCOPE).expect("mark"),
        Some(t(5)),
        "hot and behind"
    );
    assert_eq!(
        a.write(t(5)).await,
        Err(Refusal::Stale {
            highest: Some(t(6))
        })
    );
    assert_eq!(a.write(t(6)).await, Ok(false));
    assert_eq!(
        a.shards
            .owned()
            .iter()
            .map(|o| (o.shard, o.epoch, o.state))
            .collect::<Vec<_>>(),
        vec![(shard, epoch_a2, State::Admitting)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_owner_writes_nothing_and_the_new_one_waits_out_its_takeover() {
    let etcd = EtcdCluster::start(3).await;
    let (a, b) = tokio::join!(instance(&etcd, "a"), instance(&etcd, "b"));
    let shard = a.shards.shard_of(SCOPE);
    let raw = EtcdMarks::new(&a.ownership);
    let (epoch_a, _) = a.claim(shard).await;
    a.shards
        .take(shard, epoch_a, Instant::now())
        .await
        .expect("take");
    assert_eq!(a.write(t(5)).await, Ok(true));

    // a's lease is revoked (an operator, or etcd expiring it): b takes the shard over. a
    // has not noticed yet (its validity still runs), so only etcd's guard stops it.
    let mut admin = etcd_client::Client::connect(etcd.endpoints(), None)
        .await
        .expect("admin client");
    admin
        .lease_revoke(a.ownership.lease_id())
        .await
        .expect("revoke");
    let (epoch_b, previous) = b.claim(shard).await;
    assert!(matches!(previous, Previous::Lost { .. }), "{previous:?}");
    let wait = Duration::from_millis(400);
    let taken = Instant::now();
    b.shards
        .take(shard, epoch_b, taken + wait)
        .await
        .expect("take");

    assert_eq!(a.write(t(7)).await, Err(Refusal::Unavailable));
    assert_eq!(a.shards.epoch(shard), None, "the deposed shard is dropped");
    assert_eq!(raw.get(shard, SCOPE).await, Ok(Some(Mark::of(t(5)))));

    // b admits nothing during its takeover wait, then decides on the marks a committed.
    if Instant::now() < taken + wait {
        assert_eq!(b.write(t(8)).await, Err(Refusal::Unavailable));
    }
    tokio::time::sleep_until(taken + wait).await;
    assert_eq!(
        b.write(t(5)).await,
        Ok(false),
        "an equal token: a's mark was loaded"
    );
    assert_eq!(b.write(t(8)).await, Ok(true));
    assert_eq!(raw.get(shard, SCOPE).await, Ok(Some(Mark::of(t(8)))));
}
