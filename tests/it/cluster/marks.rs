//! Marks in etcd against a real 3-member etcd on loopback: guarded by ownership (a deposed
//! owner writes nothing), group-committed past etcd's per-transaction limit, loaded whole
//! by a new owner, and refused by name when a stored value is not a mark.
#![cfg(feature = "etcd")]

use std::sync::Arc;
use std::time::Duration;

use fencegate::cluster::marks::{
    Advance, CommitError, EtcdMarks, MAX_TXN_OPS, MarkWriter, ReadError,
};
use fencegate::cluster::ownership::{Claim, Ownership, OwnershipConfig};
use fencegate::store::Mark;
use fencegate::token::Token;

use crate::support::etcd::EtcdCluster;

const TTL: Duration = Duration::from_secs(2);

async fn instance(etcd: &EtcdCluster, name: &str) -> Ownership {
    Ownership::start(
        &etcd.endpoints(),
        OwnershipConfig {
            cluster: "marks".into(),
            instance: name.into(),
            ownership_ttl: TTL,
            drift_margin: Duration::from_millis(250),
        },
    )
    .await
    .expect("ownership starts")
}

async fn own(o: &Ownership, shard: u32) -> u64 {
    match o.claim(shard).await.expect("claim") {
        Claim::Owned { epoch, .. } => epoch,
        c => panic!("shard {shard} is free: {c:?}"),
    }
}

fn advance(shard: u32, epoch: u64, scope: &str, token: u64, sequence: Option<u64>) -> Advance {
    Advance {
        shard,
        epoch,
        scope: Arc::from(scope),
        mark: Mark {
            token: Token::new(0, token),
            sequence,
        },
    }
}

/// 3 shards × 100 scopes queued at once: more than one transaction may hold, all committed
/// and answered, every mark loaded back as written. Two advances of one scope in a batch
/// commit the higher, and both are answered with it. (One thread: everything is queued
/// before the writer's task first runs, so it is one batch.)
#[tokio::test(flavor = "current_thread")]
async fn a_batch_past_the_transaction_limit_commits_whole_and_loads_back() {
    let etcd = EtcdCluster::start(3).await;
    let a = instance(&etcd, "a").await;
    let epochs = [own(&a, 0).await, own(&a, 1).await, own(&a, 2).await];
    let marks = EtcdMarks::new(&a);
    let writer = MarkWriter::spawn(marks.clone());
    let mut pending = Vec::new();
    for shard in 0..3u32 {
        for i in 0..100u64 {
            let scope = format!("s{shard}/{i}");
            let e = epochs[shard as usize];
            pending.push(writer.begin_advance(advance(shard, e, &scope, i + 1, Some(i))));
        }
    }
    let low = writer.begin_advance(advance(0, epochs[0], "s0/5", 3, None));
    for (n, rx) in pending.into_iter().enumerate() {
        let got = rx.await.expect("answered").expect("committed");
        if n == 5 {
            assert_eq!(got.token, Token::new(0, 6), "the higher of the two");
        }
    }
    assert_eq!(
        low.await.expect("answered").expect("committed").token,
        Token::new(0, 6),
        "a lower advance in the same batch is answered with the mark committed"
    );
    let batches = writer.stats().commit_batch_size.count();
    assert!(
        batches >= 300u64.div_ceil(MAX_TXN_OPS as u64),
        "{batches} transactions for 300 scopes"
    );

    for shard in 0..3u32 {
        let mut loaded = marks.load(shard).await.expect("load");
        loaded.sort_by_key(|(_, m)| *m);
        assert_eq!(loaded.len(), 100, "shard {shard}");
        for (i, (scope, mark)) in loaded.iter().enumerate() {
            assert_eq!(scope, &format!("s{shard}/{i}"));
            assert_eq!(mark.token, Token::new(0, i as u64 + 1));
            assert_eq!(mark.sequence, Some(i as u64));
        }
    }
    assert_eq!(
        marks.get(1, "s1/9").await.expect("get").map(|m| m.token),
        Some(Token::new(0, 10))
    );
    assert_eq!(marks.get(1, "none").await.expect("get"), None);
}

/// The owner of shard 1 releases it and another instance claims it; the old owner's
/// advances under its epoch write nothing — in the same batch as advances of a shard it
/// still owns, which commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_owner_writes_no_mark_and_its_other_shards_commit() {
    let etcd = EtcdCluster::start(3).await;
    let a = instance(&etcd, "a").await;
    let b = instance(&etcd, "b").await;
    let (e1, e2) = (own(&a, 1).await, own(&a, 2).await);
    let old = EtcdMarks::new(&a);
    old.commit_one(&[advance(1, e1, "x", 5, None)])
        .await
        .expect("the owner commits");

    assert!(a.release(1, e1).await.expect("release"), "released");
    let e1b = own(&b, 1).await;
    assert!(e1b > e1);

    // Deposed, and nothing written.
    let deposed = old
        .commit_one(&[advance(1, e1, "x", 4, None), advance(2, e2, "y", 1, None)])
        .await
        .expect("answered");
    assert_eq!(deposed, vec![(1, e1)]);
    let new = EtcdMarks::new(&b);
    assert_eq!(
        new.get(1, "x").await.expect("get").map(|m| m.token),
        Some(Token::new(0, 5))
    );
    assert_eq!(
        new.get(2, "y").await.expect("get"),
        None,
        "the failed transaction wrote nothing"
    );

    // Through the writer: the deposed shard's advance fails, the other commits.
    let writer = MarkWriter::spawn(old.clone());
    let lost = writer.begin_advance(advance(1, e1, "x", 9, None));
    let kept = writer.begin_advance(advance(2, e2, "y", 2, None));
    assert_eq!(
        lost.await.expect("answered"),
        Err(CommitError::Deposed {
            shard: 1,
            epoch: e1
        })
    );
    assert_eq!(
        kept.await.expect("answered").map(|m| m.token),
        Ok(Token::new(0, 2))
    );
    assert_eq!(
        new.get(1, "x").await.expect("get").map(|m| m.token),
        Some(Token::new(0, 5))
    );
    assert_eq!(
        new.get(2, "y").await.expect("get").map(|m| m.token),
        Some(Token::new(0, 2))
    );

    // The new owner writes under its own epoch.
    new.commit_one(&[advance(1, e1b, "x", 7, None)])
        .await
        .expect("commit");
    assert_eq!(
        new.load(1).await.expect("load"),
        vec![("x".to_string(), Mark::of(Token::new(0, 7)))]
    );
}

/// A value under the marks' prefix that is not a mark fails the load and the read by its
/// key: never taken for no mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_that_is_not_a_mark_is_refused_by_name() {
    let etcd = EtcdCluster::start(3).await;
    let a = instance(&etcd, "a").await;
    let e = own(&a, 4).await;
    let marks = EtcdMarks::new(&a);
    marks
        .commit_one(&[advance(4, e, "good", 3, None)])
        .await
        .expect("commit");
    let mut raw = etcd_client::Client::connect(etcd.endpoints(), None)
        .await
        .expect("etcd client");
    raw.put(marks.key(4, "bad"), "07", None).await.expect("put");
    match marks.load(4).await {
        Err(ReadError::Corrupt { key, value, .. }) => {
            assert_eq!(key, marks.key(4, "bad"));
            assert_eq!(value, "07");
        }
        other => panic!("a bad value must fail the load: {other:?}"),
    }
    assert!(matches!(
        marks.get(4, "bad").await,
        Err(ReadError::Corrupt { .. })
    ));
    assert_eq!(
        marks.get(4, "good").await.expect("get").map(|m| m.token),
        Some(Token::new(0, 3))
    );
}

/// A new owner's load pages through more marks than one request returns, at one
/// revision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_pages_through_a_large_shard() {
    let etcd = EtcdCluster::start(3).await;
    let a = instance(&etcd, "a").await;
    let e = own(&a, 9).await;
    let marks = EtcdMarks::new(&a);
    let writer = MarkWriter::spawn(marks.clone());
    let pending: Vec<_> = (0..2500u64)
        .map(|i| writer.begin_advance(advance(9, e, &format!("p{i:05}"), i + 1, None)))
        .collect();
    for rx in pending {
        rx.await.expect("answered").expect("committed");
    }
    let loaded = marks.load(9).await.expect("load");
    assert_eq!(loaded.len(), 2500);
    for (i, (scope, mark)) in loaded.iter().enumerate() {
        assert_eq!(scope, &format!("p{i:05}"));
        assert_eq!(mark.token, Token::new(0, i as u64 + 1));
    }
    // Another shard's marks are not in it (shard 9's prefix is not shard 90's).
    let e90 = own(&a, 90).await;
    marks
        .commit_one(&[advance(90, e90, "q", 1, None)])
        .await
        .expect("commit");
    assert_eq!(marks.load(9).await.expect("load").len(), 2500);
}
