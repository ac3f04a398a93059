//! Crash and damage of the mark store. Power loss at every write and sync: the mark store (redb file and journal) on a disk
//! double where only what was synced is sure to survive. Whatever the cut, and whichever
//! unsynced writes the restart finds, the store opens (a crash is never taken for
//! corruption) and shows every acknowledged mark, sequence and floor.

use crate::support;

use std::collections::HashMap;
use std::sync::Arc;

use fencegate::store::{Mark, MarkStore};
use fencegate::token::Token;
use support::power::{Power, PowerDisk, SURVIVORS, Survivors};

/// What the store acknowledged before the cut.
#[derive(Debug, Default)]
struct Acked {
    marks: HashMap<String, Token>,
    /// Scope `q`'s mark with its `Fencing-Sequence` (SPEC §11).
    sequenced: Option<Mark>,
    floor: u64,
}

/// Advances in batches, checkpoints, a floor raise (a redb commit of its own) and a clean
/// close; records what was acknowledged. Every op after the cut fails, and so does the
/// store from then on.
async fn workload(redb: &PowerDisk, journal: &PowerDisk) -> Acked {
    let mut acked = Acked::default();
    let Ok(store) = MarkStore::open_with_backends(redb.clone(), journal.clone()) else {
        return acked;
    };
    for round in 1..=6u64 {
        let epoch = u64::from(round > 3);
        if round == 4
            && let Ok(f) = store.raise_floor(1).await
        {
            acked.floor = f;
        }
        // Four at once (a batch of them, as a rule), over six scopes.
        let tasks: Vec<_> = (0..4u64)
            .map(|i| {
                let store = store.clone();
                let scope = format!("s{}", (round + i) % 6);
                let token = Token::new(epoch, round);
                tokio::spawn(async move {
                    let got = store.advance(Arc::from(scope.as_str()), token).await;
                    (scope, token, got)
                })
            })
            .collect();
        // Two sequences of one token on scope `q`, at once with the advances (the same
        // batches); a new epoch starts the sequence over.
        let sequenced: Vec<_> = [2 * round - 1, 2 * round]
            .into_iter()
            .map(|n| {
                let mark = Mark {
                    token: Token::new(epoch, 1),
                    sequence: Some(n),
                };
                (mark, store.begin_advance(Arc::from("q"), mark))
            })
            .collect();
        for t in tasks {
            let (scope, token, got) = t.await.unwrap();
            if let Ok(stored) = got {
                assert!(stored >= token);
                let e = acked.marks.entry(scope).or_insert(token);
                *e = (*e).max(token);
            }
        }
        for (mark, rx) in sequenced {
            let Ok(rx) = rx else { continue };
            if let Ok(Ok(stored)) = rx.await {
                assert!(stored >= mark);
                acked.sequenced = acked.sequenced.max(Some(mark));
            }
        }
        if round % 2 == 0 {
            let _ = store.checkpoint().await;
        }
    }
    store.close().await;
    drop(store);
    acked
}

/// The store reopened on `redb` and `journal` shows every acknowledged mark and floor, and
/// no mark above what was ever asked for.
fn check(store: &MarkStore, acked: &Acked, what: &str) {
    assert!(
        store.floor() >= acked.floor,
        "{what}: floor {}",
        store.floor()
    );
    for (scope, token) in &acked.marks {
        let mark = store.get(scope).unwrap();
        assert!(
            mark >= Some(*token),
            "{what}: {scope} is {mark:?}, acknowledged {token}"
        );
    }
    for i in 0..6 {
        let mark = store.get(&format!("s{i}")).unwrap();
        assert!(mark <= Some(Token::new(1, 6)), "{what}: s{i} is {mark:?}");
    }
    let q = store.get_mark("q").unwrap();
    assert!(
        q >= acked.sequenced,
        "{what}: q is {q:?}, acknowledged {:?}",
        acked.sequenced
    );
    let asked = Mark {
        token: Token::new(1, 1),
        sequence: Some(12),
    };
    assert!(q <= Some(asked), "{what}: q is {q:?}");
}

#[tokio::test]
async fn no_acknowledged_mark_is_lost_to_a_power_cut_at_any_write_or_sync() {
    // A store made and closed (its first creation is the file's rename into place, see
    // `MarkStore::open`, which this double has no rename for).
    let setup = Power::new();
    let (redb, journal) = (PowerDisk::new(&setup), PowerDisk::new(&setup));
    drop(MarkStore::open_with_backends(redb.clone(), journal.clone()).unwrap());
    let (redb0, journal0) = (
        redb.image_after_crash(Survivors::None),
        journal.image_after_crash(Survivors::None),
    );
    let disks = |power: &Arc<Power>| {
        (
            PowerDisk::from_image(power, redb0.clone()),
            PowerDisk::from_image(power, journal0.clone()),
        )
    };

    // Once without a cut, to count the ops.
    let power = Power::new();
    let (redb, journal) = disks(&power);
    let all = workload(&redb, &journal).await;
    let total = power.ops();
    assert_eq!(all.marks.len(), 6, "{all:?}");
    assert!(total > 40, "{total} ops");

    // Batches vary from run to run (four advances at once), and with them the ops: cut
    // before op 0, 1, 2, ... until a run ends before its cut.
    let (mut cuts, mut cut_with_unsynced) = (0, 0);
    for cut in 0..total * 2 {
        let power = Power::new();
        power.cut_before(cut);
        let (redb, journal) = disks(&power);
        let acked = workload(&redb, &journal).await;
        if !power.is_cut() {
            break;
        }
        cuts += 1;
        if redb.unsynced() + journal.unsynced() > 0 {
            cut_with_unsynced += 1;
        }
        for survivors in SURVIVORS {
            let what =
                format!("cut before op {cut} of {total}, unsynced writes surviving: {survivors:?}");
            let after = Power::new();
            let redb = PowerDisk::from_image(&after, redb.image_after_crash(survivors));
            let journal = PowerDisk::from_image(&after, journal.image_after_crash(survivors));
            let store = MarkStore::open_with_backends(redb.clone(), journal.clone())
                .unwrap_or_else(|e| panic!("{what}: the store does not open: {e}"));
            check(&store, &acked, &what);
            store.close().await;
            drop(store);
            // What the restart wrote is whole too.
            let store = MarkStore::open_with_backends(redb, journal)
                .unwrap_or_else(|e| panic!("{what}, reopened: {e}"));
            check(&store, &acked, &format!("{what}, reopened"));
        }
    }
    assert!(
        cuts + 10 > total,
        "{cuts} cuts, {total} ops in the first run"
    );
    assert!(
        cut_with_unsynced > cuts / 4,
        "{cut_with_unsynced} of {cuts} cuts left unsynced writes"
    );
}

/// `fencegate serve` on `config` exits with a failure by itself; answers what it said.
fn refused_start(config: &std::path::Path) -> String {
    let mut serve = std::process::Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["serve", "--config"])
        .arg(config)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let status = ends_within(&mut serve, std::time::Duration::from_secs(30));
    let mut said = String::new();
    std::io::Read::read_to_string(&mut serve.stderr.take().unwrap(), &mut said).unwrap();
    assert!(!status.success(), "{said}");
    said
}

/// A bounded wait for a process that should end by itself.
fn ends_within(
    child: &mut std::process::Child,
    bound: std::time::Duration,
) -> std::process::ExitStatus {
    let start = std::time::Instant::now();
    while start.elapsed() < bound {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    panic!("still running after {bound:?}");
}

/// The reproduction: after a SIGKILL, one bit flipped in a journal record that has records
/// after it. The server used to start on it with those advances gone, and stale writes
/// were then accepted; now it refuses to start, naming the file and the offset, until
/// `fencegate store recover` applies what checks out and raises the epoch floor above
/// every token issued before.
#[tokio::test]
async fn a_damaged_journal_refuses_to_start_until_recovered() {
    use std::process::Command;
    use support::{Client, Double, spawn, write_config};

    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = write_config(dir.path(), double.addr);
    let mut proc = spawn(&config, p, a);
    let client = Client::new(proc.proxy);
    // One at a time: each advance is a batch of its own.
    for (report, token) in [("a", "5"), ("b", "6"), ("c", "7")] {
        let r = client
            .put(&format!("/reports/{report}/x"), token, "v")
            .await;
        assert_eq!((r.status, r.result()), (200, "accepted"), "{report}");
    }
    proc.child.kill().unwrap();
    proc.child.wait().unwrap();

    let journal = dir.path().join("marks.redb.journal");
    let mut bytes = std::fs::read(&journal).unwrap();
    // Header (24 bytes: magic, generation, check), then records: a header (body length,
    // padding, generation, check) and a body each. (An advance that shares its batch
    // with other work goes to redb instead: count them.)
    let generation = bytes[8..16].to_vec();
    let (mut at, mut records) = (24, 0);
    while bytes[at + 8..at + 16] == generation[..] {
        at += 24 + u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        records += 1;
    }
    assert!(records >= 2, "records follow the first");
    // One bit of the first record's body.
    bytes[48 + 2] ^= 0x10;
    std::fs::write(&journal, &bytes).unwrap();

    let said = refused_start(&config);
    assert!(
        said.contains("marks.redb.journal")
            && said.contains("corrupt at byte 24")
            && said.contains("store recover"),
        "{said}"
    );

    let out = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["store", "recover", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    let applied = format!("applied {} journal records", records - 1);
    assert!(said.contains(&applied), "{said}");
    let floor: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert!(floor >= 1);
    let kept = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("marks.redb.journal.damaged-")
        })
        .count();
    assert_eq!(kept, 1, "the damaged journal is kept");

    let mut proc = spawn(&config, p, a);
    let client = Client::new(proc.proxy);
    // The advance the damage hid (a's) and every token before the recovery are stale now.
    for (report, token) in [("a", "5"), ("a", "6"), ("c", "8")] {
        let r = client
            .put(&format!("/reports/{report}/x"), token, "stale")
            .await;
        assert_eq!(
            (r.status, r.result()),
            (409, "stale_fence"),
            "{report} {token}"
        );
    }
    assert_eq!(double.count_token("6"), 1, "only b's own write");
    let r = client
        .put("/reports/a/x", &format!("{floor}:1"), "new owner")
        .await;
    assert_eq!((r.status, r.result()), (200, "accepted"));
    proc.child.kill().unwrap();
    proc.child.wait().unwrap();
}

/// A flipped bit in a page of the redb file (a mark's key): a plain open trusted it, and
/// the scope's mark read as absent. Every page's checksum is verified at open: the server
/// refuses to start, and `store recover` refuses to build on the file (a backup is the way).
#[tokio::test]
async fn a_damaged_store_file_refuses_to_start() {
    use std::process::Command;
    use support::{Client, Double, spawn, write_config};

    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = write_config(dir.path(), double.addr);
    let mut proc = spawn(&config, p, a);
    let client = Client::new(proc.proxy);
    for (report, token) in [("a", "5"), ("b", "6")] {
        let r = client
            .put(&format!("/reports/{report}/x"), token, "v")
            .await;
        assert_eq!((r.status, r.result()), (200, "accepted"), "{report}");
    }
    // A clean stop: the journal is applied to redb.
    support::signal(proc.child.id(), "TERM");
    assert!(ends_within(&mut proc.child, std::time::Duration::from_secs(30)).success());

    let path = dir.path().join("marks.redb");
    let mut bytes = std::fs::read(&path).unwrap();
    let key = bytes
        .windows(8)
        .position(|w| w == b"report/b")
        .expect("the mark's key is in the file");
    bytes[key + 3] ^= 1;
    std::fs::write(&path, &bytes).unwrap();

    let said = refused_start(&config);
    assert!(
        said.contains("marks.redb") && said.contains("corrupted"),
        "{said}"
    );

    let out = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["store", "recover", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("restore a backup"), "{said}");
    assert_eq!(double.count_token("6"), 1);
}

/// A store file put back from an older copy, beside the journal of a later run: marks went
/// back in time, which only a new epoch makes safe. Refused at open, until `store recover`
/// raises the floor above every epoch seen (a copy of both files together opens as it was).
#[tokio::test]
async fn a_store_file_older_than_its_journal_is_refused() {
    use fencegate::store::marks::{journal_path, recover_store};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("marks.redb");
    let old = dir.path().join("old.redb");
    let advance = |store: &MarkStore, scope: &str, counter: u64| {
        let (store, scope) = (store.clone(), Arc::<str>::from(scope));
        async move { store.advance(scope, Token::new(3, counter)).await.unwrap() }
    };
    let store = MarkStore::open(&path).unwrap();
    advance(&store, "s", 1).await;
    store.close().await;
    drop(store);
    std::fs::copy(&path, &old).unwrap();
    std::fs::copy(journal_path(&path), journal_path(&old)).unwrap();
    let store = MarkStore::open(&path).unwrap();
    advance(&store, "s", 2).await;
    store.close().await;
    drop(store);

    std::fs::copy(&old, &path).unwrap();
    let err = MarkStore::open(&path).unwrap_err().to_string();
    assert!(err.contains("older copy"), "{err}");
    // Both files of the copy together: what they held.
    std::fs::copy(journal_path(&old), journal_path(&path)).unwrap();
    let store = MarkStore::open(&path).unwrap();
    assert_eq!(store.get("s").unwrap(), Some(Token::new(3, 1)));
    store.close().await;
    drop(store);

    // A later run, then the old store file alone once more.
    let store = MarkStore::open(&path).unwrap();
    advance(&store, "s", 5).await;
    store.close().await;
    drop(store);
    std::fs::copy(&old, &path).unwrap();
    assert!(MarkStore::open(&path).is_err());
    let done = recover_store(&path, 0).unwrap();
    assert_eq!(done.floor, 4, "above epoch 3, every token before is stale");
    let store = MarkStore::open(&path).unwrap();
    assert_eq!(store.floor(), 4);
    store.close().await;
}

/// A crash during the very first start, after the store file recorded its bookkeeping and
/// before the journal's first header reached the disk: a blank journal then lost nothing,
/// and the next start must not take it for damage.
#[tokio::test]
async fn a_crash_before_the_first_journal_header_is_not_damage() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("marks.redb");
    // Dropped without a clean close: the store file says "not closed cleanly".
    drop(MarkStore::open(&path).unwrap());
    let journal = fencegate::store::marks::journal_path(&path);
    std::fs::File::create(&journal).unwrap();
    // The dropped store's writer thread lets go of the file as it ends (bounded wait).
    let mut opened = MarkStore::open(&path);
    for _ in 0..250 {
        match &opened {
            Err(e) if e.to_string().contains("already open") => {
                std::thread::sleep(std::time::Duration::from_millis(20));
                opened = MarkStore::open(&path);
            }
            _ => break,
        }
    }
    let store = opened.unwrap_or_else(|e| panic!("{e}"));
    store.close().await;
}
