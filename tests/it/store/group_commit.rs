//! Group commit: one redb commit serves every advance queued behind it. A failed batch
//! answers every member 503 and forwards nothing; a crash in the middle of batches loses
//! no acknowledged advance.

use crate::support;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use fencegate::store::MarkStore;
use support::disk::Disk;
use support::{Client, Double, spawn, write_config};

/// Gates over a store on `disk` committed by the writer thread (as in production), with
/// `drain` as the drain timeout and no settle.
fn gates_on(disk: &Disk, drain: std::time::Duration) -> (MarkStore, Arc<fencegate::fence::Gates>) {
    let store = MarkStore::open_with_backend(disk.clone()).unwrap();
    let gates = Arc::new(fencegate::fence::Gates::new(
        store.clone(),
        Arc::new(fencegate::metrics::Metrics::new(Vec::new())),
        drain,
        std::time::Duration::ZERO,
    ));
    (store, gates)
}

/// Bounded wait until the writer is inside a commit held at `disk`.
async fn until_syncing(disk: &Disk) {
    tokio::time::timeout(support::BOUND, async {
        while !disk.syncing() {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the commit reaches the disk");
}

/// An advance of `token` on `s` whose commit hangs at `disk`: answered `unavailable` by its
/// deadline while the commit is still held, with memory not ahead of disk; then the disk
/// lets go, and this returns once the gate has taken the commit that landed.
async fn refused_while_hung_then_landed(
    disk: &Disk,
    store: &MarkStore,
    gates: &Arc<fencegate::fence::Gates>,
    token: fencegate::token::Token,
    equal: fencegate::settings::EqualPolicy,
) {
    disk.hold();
    let g = gates.clone();
    let first = tokio::spawn(async move { g.admit("s", token, equal).await });
    until_syncing(disk).await;
    let refused = tokio::time::timeout(support::BOUND, first)
        .await
        .expect("answered while the commit still hangs")
        .unwrap();
    assert_eq!(refused.unwrap_err(), fencegate::fence::Refusal::Unavailable);
    assert!(disk.syncing(), "the commit is still held");
    assert_eq!(
        gates.mark("s").unwrap(),
        None,
        "memory never runs ahead of disk"
    );
    assert!(!store.is_failed(), "a slow disk is not a failed one");
    disk.release();
    tokio::time::timeout(support::BOUND, async {
        while gates.mark("s").unwrap() != Some(token) {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the commit lands and the gate learns it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_commit_serves_many_advances_and_a_failed_batch_fails_them_all() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let disk = Disk::new();
    let store = MarkStore::open_with_backend(disk.clone()).unwrap();
    let proxy = fencegate::app::start(support::config(double.addr, dir.path()), Some(store))
        .await
        .unwrap();
    let client = Client::new(proxy.proxy_addr);

    // Many concurrent advances: fewer commits than advances (group commit).
    let puts = |token: &'static str, n: usize| {
        (0..n)
            .map(|i| {
                let c = client.clone();
                tokio::spawn(async move { c.put(&format!("/reports/g{i}/x"), token, "").await })
            })
            .collect::<Vec<_>>()
    };
    for t in puts("1", 64) {
        assert_eq!(t.await.unwrap().status, 200);
    }
    let stats = proxy.app.store.stats();
    let commits = stats.commit_batch_size_count();
    assert!(
        (1..64).contains(&commits),
        "{commits} commits for 64 advances"
    );

    // Every member of a failed batch gets 503 unavailable; nothing is forwarded.
    disk.set_broken(true);
    let before = double.seen().len();
    for t in puts("2", 32) {
        let r = t.await.unwrap();
        assert_eq!((r.status, r.result()), (503, "unavailable"));
    }
    assert_eq!(double.seen().len(), before, "nothing forwarded");
    assert!(proxy.app.store.is_failed());
    proxy.shutdown().await;
}

/// A request that goes away while its advance is being committed: the commit lands, and
/// the gate learns it (no advance left "under way" forever, no second commit needed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_gone_mid_commit_leaves_the_gate_consistent() {
    use fencegate::settings::EqualPolicy::Accept;
    use fencegate::token::Token;
    use std::time::Duration;

    let disk = Disk::new();
    let (store, gates) = gates_on(&disk, Duration::from_secs(5));
    let token = Token {
        epoch: 0,
        counter: 7,
    };
    disk.hold();
    let g = gates.clone();
    let first = tokio::spawn(async move { g.admit("s", token, Accept).await });
    until_syncing(&disk).await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    disk.release();
    let again = tokio::time::timeout(support::BOUND, gates.admit("s", token, Accept))
        .await
        .expect("admitted within the bound")
        .expect("admitted");
    assert!(
        !again.advanced,
        "the abandoned commit was not taken into account"
    );
    assert_eq!(gates.mark("s").unwrap(), Some(token));
    assert_eq!(store.get("s").unwrap(), Some(token));
}

/// A commit that hangs (an fsync that never returns) does not hang the request that
/// advances: it is answered `unavailable` once its drain deadline passes, and nothing is
/// admitted. The commit is left to finish on its own; when it lands, the gate learns it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_commit_answers_unavailable_by_the_deadline() {
    use fencegate::settings::EqualPolicy::Accept;
    use fencegate::token::Token;
    use std::time::Duration;

    let disk = Disk::new();
    let (store, gates) = gates_on(&disk, Duration::from_millis(300));
    let token = Token::new(0, 7);
    refused_while_hung_then_landed(&disk, &store, &gates, token, Accept).await;
    let again = tokio::time::timeout(support::BOUND, gates.admit("s", token, Accept))
        .await
        .expect("admitted within the bound")
        .expect("admitted");
    assert!(!again.advanced, "the retry needs no second commit");
    assert_eq!(store.get("s").unwrap(), Some(token));
}

/// A request whose token another request is committing waits for that commit, however
/// short the drain timeout: with `drain_timeout = 0` (never wait for older generations) it
/// was refused `draining` at once, though nothing older was in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_behind_anothers_commit_waits_for_it_not_for_the_drain() {
    use fencegate::settings::EqualPolicy::Accept;
    use fencegate::token::Token;
    use std::time::Duration;

    let disk = Disk::new();
    let (store, gates) = gates_on(&disk, Duration::ZERO);
    let token = Token::new(0, 7);
    disk.hold();
    let g = gates.clone();
    let first = tokio::spawn(async move { g.admit("s", token, Accept).await });
    until_syncing(&disk).await;
    let g = gates.clone();
    let second = tokio::spawn(async move { g.admit("s", token, Accept).await });
    // Bounded wait until the second request either waits at the gate or is answered.
    tokio::time::timeout(support::BOUND, async {
        while gates.waiting() == 0 && !second.is_finished() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the second request waits or is answered");
    assert!(
        !second.is_finished(),
        "answered while the commit was under way"
    );
    disk.release();
    let first = first
        .await
        .unwrap()
        .expect("the committing request is admitted");
    let second = tokio::time::timeout(support::BOUND, second)
        .await
        .expect("answered once the commit landed")
        .unwrap()
        .expect("admitted");
    assert!(first.advanced && !second.advanced);
    assert_eq!(store.get("s").unwrap(), Some(token), "one durable advance");
}

/// A request mid-commit when its worker's runtime stops (shutdown) leaves no advance
/// behind: the gate was left believing the commit still under way, and every later
/// request of that token on that scope waited for it in vain.
#[test]
fn a_commit_cut_off_by_its_runtimes_end_leaves_no_advance_behind() {
    use fencegate::settings::EqualPolicy::Accept;
    use fencegate::token::Token;
    use std::time::Duration;

    let disk = Disk::new();
    let (store, gates) = gates_on(&disk, Duration::from_secs(1));
    let token = Token::new(0, 7);
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    disk.hold();
    let worker = runtime();
    let g = gates.clone();
    worker.spawn(async move { g.admit("s", token, Accept).await.map(|_| ()) });
    worker.block_on(until_syncing(&disk));
    drop(worker);
    disk.release();
    let admitted = runtime().block_on(async {
        tokio::time::timeout(support::BOUND, gates.admit("s", token, Accept))
            .await
            .expect("answered within the bound")
    });
    assert!(admitted.is_ok(), "{:?}", admitted.err());
    assert_eq!(store.get("s").unwrap(), Some(token));
}

/// A writer thread that dies (here it panics inside a commit) fails the store closed, as a
/// failed commit does: /readyz and `fencegate_store_failed` say so, and every later
/// advance is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_writer_fails_the_store_closed() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let disk = Disk::new();
    let store = MarkStore::open_with_backend(disk.clone()).unwrap();
    let proxy = fencegate::app::start(support::config(double.addr, dir.path()), Some(store))
        .await
        .unwrap();
    let client = Client::new(proxy.proxy_addr);
    let admin = Client::new(proxy.admin_addr);
    assert_eq!(client.put("/reports/w/x", "1", "").await.status, 200);
    assert_eq!(admin.get("/readyz").await.status, 200);

    disk.set_panicking(true);
    let r = client.put("/reports/w/x", "2", "").await;
    assert_eq!((r.status, r.result()), (503, "unavailable"));
    disk.set_panicking(false);
    assert!(proxy.app.store.is_failed(), "a dead writer fails the store");
    assert_eq!(admin.get("/readyz").await.status, 503);
    let metrics = admin.get("/metrics").await.body;
    assert!(metrics.contains("fencegate_store_failed 1"), "{metrics}");
    let r = client.put("/reports/other/x", "1", "").await;
    assert_eq!((r.status, r.result()), (503, "unavailable"));
    assert_eq!(double.count_token("2"), 0, "nothing forwarded");
    proxy.shutdown().await;
}

/// Concurrent writers advance their scopes while the process is killed at an arbitrary
/// moment. Every advance that was acknowledged (forwarded, 200) must be on disk after the
/// restart: its token or a higher one is the scope's mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_mid_batch_loses_no_acknowledged_advance() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = write_config(dir.path(), double.addr);
    let mut proc = spawn(&config, p, a);
    let client = Client::new(proc.proxy);
    let acked: Arc<std::sync::Mutex<HashMap<String, u64>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..8 {
        let (c, acked, stop) = (client.clone(), acked.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            for token in 1..=2_000u64 {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let scope = format!("crash-{w}-{}", token % 4);
                let path = format!("/reports/{scope}/x");
                match c.try_put(&path, &token.to_string()).await {
                    Some(200) => {
                        let mut m = acked.lock().unwrap();
                        let e = m.entry(format!("report/{scope}")).or_insert(0);
                        *e = (*e).max(token);
                    }
                    Some(_) => {}
                    None => break, // the process is gone
                }
            }
        }));
    }
    // Kill once a good number of advances were acknowledged (bounded wait).
    tokio::time::timeout(support::BOUND, async {
        while acked.lock().unwrap().values().sum::<u64>() <= 2_000 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("advances acknowledged before the kill");
    proc.child.kill().unwrap();
    proc.child.wait().unwrap();
    stop.store(true, Ordering::SeqCst);
    for w in workers {
        w.await.unwrap();
    }

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["marks", "list", "--prefix", "report/crash-", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let marks: HashMap<String, u64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let (t, s) = l.split_once('\t')?;
            Some((s.to_string(), t.parse().ok()?))
        })
        .collect();
    let acked = acked.lock().unwrap();
    assert!(acked.len() >= 8, "{acked:?}");
    for (scope, token) in acked.iter() {
        let mark = marks.get(scope).copied().unwrap_or(0);
        assert!(
            mark >= *token,
            "{scope}: acknowledged {token}, mark after crash {mark}"
        );
    }
}

/// An Idempotency-Key's claim waits for the disk no longer than an advance does: with the
/// disk hung, the request is answered 503 `unavailable` and nothing is forwarded (it used
/// to wait for as long as the disk hung, then be forwarded with its client long gone).
/// When the claim lands after all, it is released, so the retry the 503 asks for is
/// forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_idempotency_claim_answers_unavailable_and_is_released() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let disk = Disk::new();
    let store = MarkStore::open_with_backend(disk.clone()).unwrap();
    let proxy = fencegate::app::start(support::config(double.addr, dir.path()), Some(store))
        .await
        .unwrap();
    let client = Client::new(proxy.proxy_addr);
    let key = ("idempotency-key", "\"hung-1\"");
    // The mark is set first: the keyed request below needs no advance, only its claim.
    assert_eq!(client.put("/idem/h", "3", "").await.status, 200);

    disk.hold();
    let c = client.clone();
    let keyed = tokio::spawn(async move {
        c.send("PUT", "/idem/h", &[("fencing-token", "3"), key], "once")
            .await
    });
    until_syncing(&disk).await;
    let r = tokio::time::timeout(support::BOUND, keyed)
        .await
        .expect("answered while the claim still hangs")
        .unwrap();
    assert_eq!((r.status, r.result()), (503, "unavailable"), "{r:?}");
    assert!(disk.syncing(), "the claim is still held");
    let forwarded = |d: &Double| d.seen().iter().filter(|s| s.target == "/idem/h").count();
    assert_eq!(
        forwarded(&double),
        1,
        "only the unkeyed request was forwarded"
    );

    disk.release();
    // The claim lands, then is released: the retry is forwarded, once.
    let retry = tokio::time::timeout(support::BOUND, async {
        loop {
            let r = client
                .send("PUT", "/idem/h", &[("fencing-token", "3"), key], "once")
                .await;
            if r.result() != "in_progress" {
                return r;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the key is not stuck");
    assert_eq!(
        (retry.status, retry.result()),
        (200, "accepted"),
        "{retry:?}"
    );
    assert_eq!(forwarded(&double), 2);
    let again = client
        .send("PUT", "/idem/h", &[("fencing-token", "3"), key], "once")
        .await;
    assert_eq!((again.status, again.result()), (200, "duplicate"));
    assert_eq!(forwarded(&double), 2);
    proxy.shutdown().await;
}

/// On an `equal = "reject"` route: an advance whose commit did not land in time (503
/// `unavailable`, "retry with the same token") and landed later was never forwarded, so
/// its token still admits the retry, once (it was `stale_fence` for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_commit_leaves_its_token_to_the_retry_on_a_reject_route() {
    use fencegate::fence::Refusal;
    use fencegate::settings::EqualPolicy::Reject;
    use fencegate::token::Token;
    use std::time::Duration;

    let disk = Disk::new();
    let (store, gates) = gates_on(&disk, Duration::from_millis(300));
    let token = Token::new(0, 7);
    refused_while_hung_then_landed(&disk, &store, &gates, token, Reject).await;
    let retry = tokio::time::timeout(support::BOUND, gates.admit("s", token, Reject))
        .await
        .expect("answered within the bound")
        .expect("the retry is admitted");
    assert!(retry.advanced, "it takes the advance nobody used");
    let again = gates.admit("s", token, Reject).await.unwrap_err();
    assert_eq!(
        again,
        Refusal::Stale {
            highest: Some(token)
        },
        "once"
    );
}

/// A store with its journal on `journal` and redb on `db`, committed by the writer thread.
fn journaled(db: &Disk, journal: &Disk) -> MarkStore {
    MarkStore::open_with_backends(db.clone(), journal.clone()).unwrap()
}

/// `n` concurrent advances of `token` on scopes `{prefix}{i}`; all answered.
async fn advance_all(store: &MarkStore, prefix: &str, n: usize, token: u64) -> Vec<bool> {
    let waits: Vec<_> = (0..n)
        .map(|i| {
            let (store, scope) = (store.clone(), Arc::from(format!("{prefix}{i}")));
            tokio::spawn(async move {
                store
                    .advance(scope, fencegate::token::Token::new(0, token))
                    .await
            })
        })
        .collect();
    let mut ok = Vec::new();
    for w in waits {
        ok.push(w.await.unwrap().is_ok());
    }
    ok
}

/// Batches of advances go to the journal (one record and one sync each, redb untouched):
/// they are read back through the journal before any checkpoint, applied to redb when the
/// store is opened again, and a journal that cannot be written fails its batch and the
/// store closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advances_are_journaled_then_applied_and_a_failed_journal_fails_them_all() {
    let (db, journal) = (Disk::new(), Disk::new());
    let store = journaled(&db, &journal);
    // The first advance's record is held at the disk; the other 63 queue behind it and
    // share the next record.
    journal.hold();
    let token = fencegate::token::Token::new(0, 5);
    let mark = fencegate::store::Mark::of(token);
    let mut waits = vec![store.begin_advance(Arc::from("j0"), mark).unwrap()];
    until_syncing(&journal).await;
    for i in 1..64 {
        waits.push(
            store
                .begin_advance(Arc::from(format!("j{i}")), mark)
                .unwrap(),
        );
    }
    journal.release();
    for w in waits {
        assert_eq!(w.await.unwrap().unwrap().token, token);
    }
    assert_eq!(
        store.stats().commit_batch_size_count(),
        2,
        "two records for 64"
    );
    assert_eq!(store.stats().checkpoints.load(Ordering::SeqCst), 0);
    // redb does not have them yet; the store's reads do.
    assert!(store.list("j", None, 100).unwrap().is_empty());
    let five = Some(fencegate::token::Token::new(0, 5));
    assert_eq!(store.get("j7").unwrap(), five);
    // A lower advance answers the journaled mark and does not lower it.
    let lower = store
        .advance(Arc::from("j7"), fencegate::token::Token::new(0, 3))
        .await
        .unwrap();
    assert_eq!(Some(lower), five);

    // Without a close (as after a crash) the next open applies the journal to redb (a
    // fresh one here: the journal alone holds these marks).
    drop(store);
    let store = journaled(&Disk::new(), &journal);
    assert_eq!(store.list("j", None, 100).unwrap().len(), 64);
    assert_eq!(store.get("j63").unwrap(), five);

    journal.set_broken(true);
    let answered = advance_all(&store, "j", 16, 6).await;
    assert!(answered.iter().all(|ok| !ok), "{answered:?}");
    assert!(store.is_failed());
    assert!(store.get("j3").is_err());
}

/// A checkpoint that cannot commit to redb fails the store closed, and what the journal
/// holds is applied when the store is opened again; one that can leaves redb with every
/// mark. Checkpoints also happen by themselves once enough scopes wait in the journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_checkpoint_fails_closed_and_loses_nothing() {
    let (db, journal) = (Disk::new(), Disk::new());
    let store = journaled(&db, &journal);
    assert!(advance_all(&store, "c", 32, 9).await.iter().all(|ok| *ok));
    db.set_broken(true);
    assert!(store.checkpoint().await.is_err());
    assert!(store.is_failed());
    assert!(!advance_all(&store, "c", 1, 10).await[0]);
    drop(store);

    // The journal alone holds them (a fresh redb: the old one's handle may still close).
    let store = journaled(&Disk::new(), &journal);
    let marks = store.list("c", None, 100).unwrap();
    assert_eq!(marks.len(), 32);
    assert!(marks.iter().all(|(_, t)| t.counter == 9), "{marks:?}");

    // Past PENDING_SCOPES scopes waiting, a checkpoint follows without being asked.
    let n = fencegate::store::journal::PENDING_SCOPES + 100;
    for chunk in 0..n.div_ceil(4096) {
        let ok = advance_all(&store, &format!("p{chunk}-"), 4096, 1).await;
        assert!(ok.iter().all(|ok| *ok));
    }
    assert!(store.stats().checkpoints.load(Ordering::SeqCst) >= 1);
    assert!(store.list("p", None, 10_000).unwrap().len() >= 4096);
    store.checkpoint().await.unwrap();
    let mut listed = 0;
    let mut after: Option<String> = None;
    loop {
        let page = store.list("p", after.as_deref(), 10_000).unwrap();
        listed += page.len();
        match page.last() {
            Some((s, _)) if page.len() == 10_000 => after = Some(s.clone()),
            _ => break,
        }
    }
    assert_eq!(listed, n.div_ceil(4096) * 4096);

    // A clean close applies what the journal holds.
    assert!(advance_all(&store, "z", 8, 1).await.iter().all(|ok| *ok));
    assert!(store.list("z", None, 100).unwrap().is_empty());
    store.close().await;
    assert_eq!(store.list("z", None, 100).unwrap().len(), 8);
}
