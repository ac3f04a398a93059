//! Unit tests of the mark store: the writer's batches, sequences, journal answers, records.

use std::sync::mpsc;

use redb::Database;

use super::handle::{Commits, Inner};
use super::*;
use crate::store::quota::{self, Rejected};
use crate::token::Token;

fn advance(scope: &str, token: u64) -> (Op, oneshot::Receiver<Result<Mark, StoreError>>) {
    sequenced(scope, token, None)
}

fn sequenced(
    scope: &str,
    token: u64,
    sequence: Option<u64>,
) -> (Op, oneshot::Receiver<Result<Mark, StoreError>>) {
    let (reply, rx) = oneshot::channel();
    let op = Op::Advance {
        scope: Arc::from(scope),
        mark: Mark {
            token: Token::new(1, token),
            sequence,
        },
        reply,
    };
    (op, rx)
}

/// Once a send to the writer fails (its thread has gone), the store is failed: readiness
/// and metrics must not go on saying it works.
#[test]
fn a_writer_gone_fails_the_store() {
    let store =
        MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new()).expect("open");
    let (tx, rx) = mpsc::channel();
    drop(rx);
    let gone = MarkStore {
        inner: Arc::new(Inner {
            db: Arc::new(std::sync::RwLock::new(store.database())),
            reopen: Arc::default(),
            stats: Arc::default(),
            commits: Commits::Thread(tx),
            failed: Arc::default(),
            floor: Arc::default(),
            pending: Arc::default(),
            tally: Arc::default(),
        }),
    };
    assert!(!gone.is_failed());
    assert!(
        gone.begin_advance(Arc::from("s"), Mark::of(Token::new(0, 1)))
            .is_err()
    );
    assert!(gone.is_failed());
}

/// A listing of long scope names stops at `LIST_BYTES`, says it did, and the rest
/// follows from where it stopped.
#[test]
fn a_listing_of_long_scopes_stops_at_its_byte_budget() {
    let store =
        MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new()).expect("open");
    let Commits::Inline(writer) = &store.inner.commits else {
        panic!("inline store expected");
    };
    let mut writer = writer.lock().unwrap();
    let long = |i: usize| format!("{i:03}{}", "s".repeat(60_000));
    let n = LIST_BYTES / 60_000 + 10;
    writer.commit((0..n).map(|i| advance(&long(i), 1).0).collect());
    let first = store.list("", None, 10_000).expect("list");
    assert!(first.len() < n, "{}", first.len());
    assert!(!listed_all(&first, 10_000));
    let after = first.last().map(|m| m.0.as_str());
    let rest = store.list("", after, 10_000).expect("list");
    assert!(listed_all(&rest, 10_000));
    assert_eq!(first.len() + rest.len(), n);
    assert_eq!(rest.last().map(|m| m.0.clone()), Some(long(n - 1)));
    // Short names: the count decides.
    let few = store.list("0", None, 3).expect("list");
    assert_eq!(few.len(), 3);
    assert!(!listed_all(&few, 3));
}

/// A scope the journal holds, then raised further by a batch that had to go to redb
/// (an advance sharing it with a floor raise): a later batch of lower advances answers
/// the mark stored, not the journal's older one.
#[test]
fn a_journaled_scope_never_answers_less_than_is_stored() {
    let db = Database::builder()
        .create_with_backend(redb::backends::InMemoryBackend::new())
        .expect("db");
    let store = MarkStore::start(
        db,
        Some(redb::backends::InMemoryBackend::new()),
        true,
        "<test>",
        None,
    )
    .expect("open");
    let Commits::Inline(writer) = &store.inner.commits else {
        panic!("inline store expected");
    };
    let mut writer = writer.lock().unwrap();
    let (a3, r3) = advance("s", 3);
    writer.commit(vec![a3]);
    assert_eq!(answer(r3), Some(3));
    assert!(
        store.list("", None, 10).expect("list").is_empty(),
        "journaled"
    );
    let (a7, r7) = advance("s", 7);
    let (floor, _floor_rx) = oneshot::channel();
    writer.commit(vec![
        a7,
        Op::Floor {
            epoch: 0,
            reply: floor,
        },
    ]);
    assert_eq!(answer(r7), Some(7));
    let records = store.stats().commit_batch_size_count();
    let (a5, r5) = advance("s", 5);
    writer.commit(vec![a5]);
    assert_eq!(answer(r5), Some(7));
    assert_eq!(
        store.stats().commit_batch_size_count(),
        records,
        "a batch that raises nothing writes nothing"
    );
    assert_eq!(store.get("s").expect("read"), Some(Token::new(1, 7)));
}

fn answer(mut rx: oneshot::Receiver<Result<Mark, StoreError>>) -> Option<u64> {
    rx.try_recv().ok()?.ok().map(|t| t.token.counter)
}

fn answer_mark(mut rx: oneshot::Receiver<Result<Mark, StoreError>>) -> Option<(u64, Option<u64>)> {
    rx.try_recv()
        .ok()?
        .ok()
        .map(|m| (m.token.counter, m.sequence))
}

/// A sequence is stored with its token, in redb (no journal) and through the journal
/// (then the checkpoint): the highest per token wins, a lower one is answered the
/// stored one, a new token starts over, and an advance without a sequence keeps the
/// token's.
#[test]
fn sequences_are_stored_with_their_token_and_never_go_back() {
    let journaled = || {
        let db = Database::builder()
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .expect("db");
        MarkStore::start(
            db,
            Some(redb::backends::InMemoryBackend::new()),
            true,
            "<test>",
            None,
        )
        .expect("open")
    };
    let plain = || {
        MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new()).expect("open")
    };
    for store in [journaled(), plain()] {
        let Commits::Inline(writer) = &store.inner.commits else {
            panic!("inline store expected");
        };
        let mut writer = writer.lock().unwrap();
        let (a, ra) = sequenced("s", 3, Some(2));
        let (b, rb) = sequenced("s", 3, Some(5));
        writer.commit(vec![a, b]);
        assert_eq!(
            answer_mark(ra),
            Some((3, Some(5))),
            "one batch: the highest"
        );
        assert_eq!(answer_mark(rb), Some((3, Some(5))));
        let (c, rc) = sequenced("s", 3, Some(4));
        writer.commit(vec![c]);
        assert_eq!(answer_mark(rc), Some((3, Some(5))), "never back");
        let (d, rd) = advance("s", 3);
        writer.commit(vec![d]);
        assert_eq!(answer_mark(rd), Some((3, Some(5))), "kept without one");
        writer.checkpoint().expect("checkpoint");
        let seq = |n| Mark {
            token: Token::new(1, 3),
            sequence: Some(n),
        };
        assert_eq!(store.get_mark("s").expect("read"), Some(seq(5)));
        let (e, re) = advance("s", 4);
        writer.commit(vec![e]);
        assert_eq!(answer_mark(re), Some((4, None)), "a new token starts over");
        let (f, rf) = sequenced("s", 4, Some(1));
        writer.commit(vec![f]);
        assert_eq!(answer_mark(rf), Some((4, Some(1))));
        let (g, rg) = sequenced("s", 3, Some(9));
        writer.commit(vec![g]);
        assert_eq!(
            answer_mark(rg),
            Some((4, Some(1))),
            "an old token's is void"
        );
        writer.checkpoint().expect("checkpoint");
        assert_eq!(
            store.get_mark("s").expect("read"),
            Some(Mark {
                token: Token::new(1, 4),
                sequence: Some(1)
            })
        );
    }
}

/// One batch: the highest token per scope wins whatever the order, every member reads
/// what was stored, a lower advance never lowers a mark, and a batch that changes
/// nothing commits nothing.
#[test]
fn a_batch_stores_the_highest_token_per_scope_and_never_lowers_one() {
    let store =
        MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new()).expect("open");
    let Commits::Inline(writer) = &store.inner.commits else {
        panic!("inline store expected");
    };
    let mut writer = writer.lock().unwrap();
    let (a5, ra5) = advance("a", 5);
    let (b2, rb2) = advance("b", 2);
    let (a7, ra7) = advance("a", 7);
    let (a6, ra6) = advance("a", 6);
    writer.commit(vec![a5, b2, a7, a6]);
    assert_eq!(
        [answer(ra5), answer(rb2), answer(ra7), answer(ra6)],
        [Some(7), Some(2), Some(7), Some(7)]
    );
    assert_eq!(store.get("a").expect("read"), Some(Token::new(1, 7)));
    assert_eq!(store.get("b").expect("read"), Some(Token::new(1, 2)));
    assert_eq!(store.stats().commit_batch_size_count(), 1);

    // Lower and equal advances answer the stored marks, leave them, and need no commit.
    let (a3, ra3) = advance("a", 3);
    let (b2, rb2) = advance("b", 2);
    writer.commit(vec![a3, b2]);
    assert_eq!([answer(ra3), answer(rb2)], [Some(7), Some(2)]);
    assert_eq!(store.get("a").expect("read"), Some(Token::new(1, 7)));
    assert_eq!(store.stats().commit_batch_size_count(), 1);

    // A lower advance in a batch that changes something else is put back, not lowered.
    let (a4, ra4) = advance("a", 4);
    let (c9, rc9) = advance("c", 9);
    writer.commit(vec![a4, c9]);
    assert_eq!([answer(ra4), answer(rc9)], [Some(7), Some(9)]);
    assert_eq!(store.get("a").expect("read"), Some(Token::new(1, 7)));
    assert_eq!(store.get("c").expect("read"), Some(Token::new(1, 9)));
    assert_eq!(store.stats().commit_batch_size_count(), 2);
}

fn quota(records: u64, bytes: u64) -> RecordQuota {
    let u = quota::Usage { records, bytes };
    RecordQuota {
        total: quota::Usage {
            records: 100,
            bytes: 1 << 20,
        },
        per_scope: u,
        per_client: u,
        reserve: 100,
        min_free: 0,
    }
}

fn record(expires: u64, len: usize) -> Vec<u8> {
    let mut v = expires.to_be_bytes().to_vec();
    v.resize(8 + len, b'x');
    v
}

/// A claim counts as the reserve until its completion is written, then as its size;
/// past a bound it is refused and nothing is written; an expired record is deleted by
/// the refused claim first, and what it took is free again; the usage is rebuilt
/// from the file when the store is opened again.
#[tokio::test]
async fn records_are_claimed_within_their_quota() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("m.redb");
    let store = MarkStore::open(&path).expect("open");
    let q = Some(("c1".to_string(), quota(2, 1000)));
    let claim = |key: &str, expires: u64, q: Option<(String, RecordQuota)>| {
        let store = store.clone();
        let key = key.to_string();
        async move {
            store
                .claim_within(key, record(expires, 10), None, 50, q)
                .await
                .expect("claim")
        }
    };
    assert_eq!(claim("s\0a", 100, q.clone()).await, Claimed::Claimed);
    let (total, scope, client) = store.record_usage("s", "c1");
    assert_eq!((total.records, total.bytes), (1, 100), "the reserve");
    assert_eq!((scope, client), (total, total));
    // Completed: its own size (key 3 bytes + value 18).
    store
        .put_record("s\0a".into(), record(0, 10))
        .await
        .expect("put");
    assert_eq!(store.record_usage("s", "c1").0.bytes, 21);
    // An expired one, then one past the client's count.
    assert_eq!(claim("s\0b", 10, q.clone()).await, Claimed::Claimed);
    let past = claim("s\0c", 100, q.clone()).await;
    assert_eq!(past, Claimed::Claimed, "the expired record made room");
    assert!(store.record("s\0b").expect("read").is_none());
    assert_eq!(
        claim("s\0d", 100, q.clone()).await,
        Claimed::Rejected(Rejected::Scope)
    );
    assert_eq!(
        claim("t\0d", 100, q.clone()).await,
        Claimed::Rejected(Rejected::Client)
    );
    assert_eq!(
        claim("t\0d", 100, Some(("c2".into(), quota(2, 1000)))).await,
        Claimed::Claimed
    );
    assert_eq!(store.record_count().expect("count"), 3);
    let big = Some(("c3".to_string(), quota(10, 150)));
    assert_eq!(
        claim("u\0e", 100, big.clone()).await,
        Claimed::Claimed,
        "bytes: 100 of 150"
    );
    assert_eq!(
        claim("u\0f", 100, big).await,
        Claimed::Rejected(Rejected::Scope),
        "bytes: 200 of 150"
    );
    let usage = store.record_usage("s", "c1");
    assert_eq!(store.record_owners(), (3, 3));
    store.close().await;
    drop(store);
    let again = MarkStore::open(&path).expect("reopen");
    assert_eq!(again.record_usage("s", "c1"), usage);
    assert_eq!(again.record_owners(), (3, 3));
    // Everything expires: the tally empties with the records.
    assert_eq!(again.collect_records(1000, 100).await.expect("collect"), 4);
    assert_eq!(again.record_owners(), (0, 0));
    assert_eq!(again.record_usage("s", "c1").0, quota::Usage::default());
}
