//! Unit tests of the gates: admission, eviction, proofs, unclaimed advances, shards.

use super::map::{IDLE_TTL, shard_index};
use super::state::Inflight;
use super::*;
use crate::fence::policy::EqualPolicy;

/// A collection operation holds the tree beneath its scope (SPEC §16): while it is in
/// flight, a request to a scope beneath is refused (its new mark stays, so the
/// collection's check would see it), others pass; an operation whose upstream
/// exchange was abandoned holds the tree until the scope has settled.
#[tokio::test(start_paused = true)]
async fn a_collection_in_flight_holds_the_scopes_beneath_it() {
    let store =
        MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new()).expect("store");
    let metrics = Arc::new(Metrics::new(Vec::new()));
    let settle = Duration::from_secs(10);
    let g = Gates::new(store, metrics, Duration::from_secs(30), settle);
    // Past the start-up settle.
    tokio::time::advance(settle).await;
    let t5 = Token::new(0, 5);
    let mut collection = g
        .admit("file/q4", t5, EqualPolicy::Accept)
        .await
        .expect("the collection's own scope");
    collection.guard.hold_tree(g.hold_tree("file/q4"));
    assert_eq!(
        g.admit("file/q4/final", t5, EqualPolicy::Accept)
            .await
            .map(|_| ()),
        Err(Refusal::Draining { highest: Some(t5) })
    );
    // The refused request's mark is durable: the collection's check would see it.
    assert!(
        g.store()
            .marked_beneath("file/q4/", false, "")
            .expect("read")
            .is_some()
    );
    for other in ["file/q4x", "file/q", "file/q5/final"] {
        let mut a = g
            .admit(other, t5, EqualPolicy::Accept)
            .await
            .unwrap_or_else(|r| panic!("{other}: {r:?}"));
        a.guard.complete();
    }
    // Answered: released at once.
    collection.guard.complete();
    drop(collection);
    let mut a = g
        .admit("file/q4/final", t5, EqualPolicy::Accept)
        .await
        .expect("after the collection's answer");
    a.guard.complete();
    drop(a);
    // Abandoned: held until the scope has settled.
    let mut abandoned = g
        .admit("file/q6", t5, EqualPolicy::Accept)
        .await
        .expect("q6");
    abandoned.guard.hold_tree(g.hold_tree("file/q6"));
    drop(abandoned);
    tokio::time::advance(settle / 2).await;
    assert!(g.admit("file/q6/a", t5, EqualPolicy::Accept).await.is_err());
    tokio::time::advance(settle).await;
    let mut a = g
        .admit("file/q6/a", t5, EqualPolicy::Accept)
        .await
        .expect("settled");
    a.guard.complete();
    // A hold refused before it was forwarded (dropped on its own) holds nothing.
    drop(g.hold_tree("file/q7"));
    assert!(g.admit("file/q7/a", t5, EqualPolicy::Accept).await.is_ok());
}

/// Scopes that differ only in their last characters spread over every shard (a shard
/// at its capacity evicts early, so crowding shows up as lost hot gates).
#[test]
fn similar_scopes_spread_evenly_over_the_shards() {
    for seed in [0, 1, 0x9e37_79b9_7f4a_7c15, u64::MAX] {
        let mut counts = [0usize; SHARDS];
        for i in 0..64_000 {
            counts[shard_index(seed, &format!("report/w4s{i}"))] += 1;
        }
        let (min, max) = (counts.iter().min(), counts.iter().max());
        // 1,000 each on average.
        assert!(
            min >= Some(&850) && max <= Some(&1150),
            "seed {seed:#x}: {min:?}..{max:?}"
        );
    }
}

/// A request that found no gate reads the mark from disk, then inserts a gate. If,
/// in between, another request made the scope's gate, advanced the mark and the gate
/// was evicted, the mark read is stale: the inserted gate must hold the newer one.
#[tokio::test(start_paused = true)]
async fn a_mark_read_before_an_eviction_is_read_again() {
    let store =
        MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new()).expect("store");
    let metrics = Arc::new(Metrics::new(Vec::new()));
    let g = Gates::new(store, metrics, Duration::from_secs(30), Duration::ZERO);
    let (t5, t6) = (Token::new(0, 5), Token::new(0, 6));
    let idle_out = |g: &Gates| {
        g.sweep();
        assert_eq!(g.len(), 0, "every gate evicted");
    };
    let mut a = g.admit("s", t5, EqualPolicy::Accept).await.expect("5");
    a.guard.complete();
    drop(a);
    tokio::time::advance(IDLE_TTL).await;
    idle_out(&g);
    // Request A: no gate for "s"; it reads mark 5 and is held up before inserting.
    let evicted = g.shard("s").evicted;
    let read = g.store.get_mark("s").expect("read");
    assert_eq!(read, Some(Mark::of(t5)));
    // Meanwhile B makes the gate, advances to 6, finishes, and the gate is evicted.
    let mut b = g.admit("s", t6, EqualPolicy::Accept).await.expect("6");
    b.guard.complete();
    drop(b);
    tokio::time::advance(IDLE_TTL).await;
    idle_out(&g);
    // A goes on with what it read.
    let (_, gate) = g.insert("s", read, evicted).expect("insert");
    assert_eq!(
        gate.lock().current,
        Some(t6),
        "the gate holds the disk's mark"
    );
    drop(gate);
    assert_eq!(
        g.admit("s", t5, EqualPolicy::Accept).await.unwrap_err(),
        Refusal::Stale { highest: Some(t6) }
    );
    // Without an eviction in between, the read is used as it is (no second read).
    let evicted = g.shard("t").evicted;
    let (_, gate) = g.insert("t", Some(Mark::of(t5)), evicted).expect("insert");
    assert_eq!(gate.lock().current, Some(t5));
}

/// A proof is verified once per (token, bytes) while the gate lives; a stale token's
/// valid proof neither passes nor pushes the current one out of the cache; a bad
/// proof is refused before anything is advanced.
#[tokio::test]
async fn verified_proofs_are_remembered_per_gate() {
    let dir = tempfile::tempdir().expect("dir");
    crate::proof::keygen(&dir.path().join("k")).expect("keygen");
    let key = crate::proof::SigningKey::load(&dir.path().join("k.key")).expect("key");
    let mut keys = crate::proof::ProofKeys::default();
    keys.add_file(&dir.path().join("k.pub")).expect("pub");
    let store =
        MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new()).expect("store");
    let metrics = Arc::new(Metrics::new(Vec::new()));
    let g = Gates::new(
        store.clone(),
        metrics,
        Duration::from_secs(1),
        Duration::ZERO,
    );
    let accept = EqualPolicy::Accept;
    let (t5, t6) = (Token::new(0, 5), Token::new(0, 6));
    let (p5, p6) = (key.prove("s", t5), key.prove("s", t6));
    fn with<'a>(keys: &'a crate::proof::ProofKeys, p: &'a str) -> Option<Proof<'a>> {
        Some(Proof {
            keys,
            bytes: p.as_bytes(),
        })
    }
    let proof = |p| with(&keys, p);
    let refused = g
        .admit_proved("s", t5, accept, proof(&p6))
        .await
        .unwrap_err();
    assert!(matches!(refused, Refusal::InvalidProof(_)), "{refused:?}");
    assert_eq!(store.get("s").expect("get"), None, "nothing advanced");
    let n = keys.verifications();
    for _ in 0..3 {
        let mut a = g
            .admit_proved("s", t6, accept, proof(&p6))
            .await
            .expect("6");
        a.guard.complete();
    }
    assert_eq!(keys.verifications() - n, 1);
    // 5's own proof is valid, but 5 is stale; 6's cached proof stays.
    assert!(matches!(
        g.admit_proved("s", t5, accept, proof(&p5)).await,
        Err(Refusal::Stale { .. })
    ));
    let n = keys.verifications();
    let mut a = g
        .admit_proved("s", t6, accept, proof(&p6))
        .await
        .expect("6");
    a.guard.complete();
    assert_eq!(keys.verifications(), n, "still cached");
}

/// On an `equal = "reject"` route an equal token is stale, but a request that advanced
/// the mark and was then refused (503 `draining`, which says "retry with the same
/// token") or went away was never forwarded: its retry must get through, once.
#[tokio::test(start_paused = true)]
async fn a_refused_advance_admits_its_retry_once_on_a_reject_route() {
    let store =
        MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new()).expect("store");
    let metrics = Arc::new(Metrics::new(Vec::new()));
    let g = Gates::new(store, metrics, Duration::from_secs(1), Duration::ZERO);
    let reject = EqualPolicy::Reject;
    let (t5, t7, t9) = (Token::new(0, 5), Token::new(0, 7), Token::new(0, 9));
    let mut old = g.admit("s", t5, reject).await.expect("5");
    // 7 advances, then waits for 5 to finish; the paused clock runs out its drain.
    assert_eq!(
        g.admit("s", t7, reject).await.unwrap_err(),
        Refusal::Draining { highest: Some(t7) }
    );
    old.guard.complete();
    drop(old);
    // The gate (and what it remembers) outlives an idle sweep until its retry comes.
    tokio::time::advance(IDLE_TTL - Duration::from_millis(500)).await;
    g.sweep();
    assert_eq!(g.len(), 1, "kept for the retry");
    let mut retry = g.admit("s", t7, reject).await.expect("the retry of 7");
    assert!(retry.advanced, "it is the token's first request");
    assert_eq!(
        g.admit("s", t7, reject).await.unwrap_err(),
        Refusal::Stale { highest: Some(t7) },
        "once"
    );
    retry.guard.complete();
    drop(retry);

    // An advance whose request went away before admission (here: while it waited
    // for an older generation) is left for its retry too.
    let mut old = g.admit("s", Token::new(0, 8), reject).await.expect("8");
    let gone = tokio::time::timeout(Duration::from_millis(10), g.admit("s", t9, reject)).await;
    assert!(gone.is_err(), "9 waits for 8");
    old.guard.complete();
    drop(old);
    let mut retry = g.admit("s", t9, reject).await.expect("the retry of 9");
    retry.guard.complete();
    drop(retry);
    assert!(g.admit("s", t9, reject).await.is_err());

    // Admitted, then refused before anything reached the upstream (a 502 before
    // sending, an idempotency refusal): the retry gets through, once.
    let t95 = Token::new(0, 95);
    let mut first = g.admit("s", t95, reject).await.expect("95");
    first.guard.not_forwarded();
    drop(first);
    let mut retry = g.admit("s", t95, reject).await.expect("the retry of 95");
    retry.guard.complete();
    drop(retry);
    assert!(g.admit("s", t95, reject).await.is_err(), "once");

    // One scope, a reject route and an accept route: a request of the token that
    // the accept route admitted (and so may have forwarded) uses it, even if the
    // request that advanced is then refused unsent.
    let t96 = Token::new(0, 96);
    let mut x = g.admit("s", t96, reject).await.expect("96 advances");
    let mut y = g
        .admit("s", t96, EqualPolicy::Accept)
        .await
        .expect("96 by accept");
    x.guard.not_forwarded();
    drop(x);
    assert_eq!(
        g.admit("s", t96, reject).await.unwrap_err(),
        Refusal::Stale { highest: Some(t96) },
        "96 reached the backend through the accept route"
    );
    y.guard.complete();
    drop(y);

    // A token that a request was forwarded with is used, whatever route took it.
    let t10 = Token::new(0, 100);
    let mut old = g.admit("s", t10, reject).await.expect("100");
    let t11 = Token::new(0, 101);
    assert!(g.admit("s", t11, reject).await.is_err(), "101 drains out");
    old.guard.complete();
    drop(old);
    let mut by_accept = g.admit("s", t11, EqualPolicy::Accept).await.expect("101");
    by_accept.guard.complete();
    drop(by_accept);
    assert_eq!(
        g.admit("s", t11, reject).await.unwrap_err(),
        Refusal::Stale { highest: Some(t11) }
    );
}

#[test]
fn inflight_counts_per_generation_and_knows_the_oldest() {
    let (t1, t2, t3) = (Token::new(0, 1), Token::new(0, 2), Token::new(1, 0));
    let mut f = Inflight::default();
    assert!(f.is_empty() && !f.older_than(t1));
    f.add(t3);
    f.add(t1);
    f.add(t3);
    assert_eq!((f.count(t1), f.count(t2), f.count(t3)), (1, 0, 2));
    assert!(f.older_than(t2) && !f.older_than(t1));
    f.remove(t1);
    assert!(!f.older_than(t2) && f.older_than(Token::new(1, 1)));
    // Removing a generation with nothing in flight changes nothing.
    f.remove(t2);
    f.remove(t3);
    assert_eq!(f.count(t3), 1);
    f.remove(t3);
    assert!(f.is_empty());
}
