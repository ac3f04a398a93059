//! The etcd backend against a real 3-member etcd cluster on loopback (started and removed
//! by the test): the same API as `local`, tokens from create revisions, and a leader
//! failover in the middle of a run of acquisitions through two authority instances.
//!
//! Needs `--features etcd` (protoc at build time) and `etcd` on the machine.
#![cfg(feature = "etcd")]

use crate::support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencegate::client::{AcquireError, AuthorityClient};
use fencegate::settings::Config;
use fencegate::token::Token;
use support::etcd::{self, EtcdCluster};
use support::{BOUND, Client};
use tokio::time::Instant;

async fn authority(
    endpoints: &[String],
    dir: &std::path::Path,
    lock_delay: &str,
) -> fencegate::app::Running {
    support::start(authority_config(endpoints, dir, lock_delay)).await
}

fn authority_config(endpoints: &[String], dir: &std::path::Path, lock_delay: &str) -> Config {
    let table = etcd::authority_table(endpoints, Some(lock_delay));
    Config::parse(&support::authority_text(&table), dir).expect("config")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_etcd_backend_speaks_the_same_api() {
    let cluster = EtcdCluster::start(3).await;
    let dir = tempfile::tempdir().unwrap();
    let running = authority(&cluster.endpoints(), dir.path(), "0s").await;
    let c = Client::new(running.authority_addr.unwrap());

    let r = c
        .post_json(
            "/v1/locks/acquire",
            r#"{"scope":"report/july","holder":"a","ttl_ms":5000}"#,
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let j = r.json();
    assert_eq!(j["result"], "acquired");
    let token: Token = j["token"].as_str().unwrap().parse().unwrap();
    assert_eq!(token.epoch, 0, "etcd tokens are bare revisions");
    let lease_id = j["lease_id"].as_str().unwrap().to_string();

    let r = c
        .post_json(
            "/v1/locks/acquire",
            r#"{"scope":"report/july","holder":"b","ttl_ms":5000}"#,
        )
        .await;
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(
        (r.json()["result"].as_str(), r.json()["holder"].as_str()),
        (Some("busy"), Some("a"))
    );

    let s = c.get("/v1/locks?scope=report%2Fjuly").await.json();
    assert_eq!(
        (s["holder"].as_str(), s["token"].as_str()),
        (Some("a"), Some(token.to_string().as_str()))
    );

    let body = |id: &str, t: &str, ttl: bool| {
        if ttl {
            format!(r#"{{"scope":"report/july","lease_id":"{id}","token":"{t}","ttl_ms":5000}}"#)
        } else {
            format!(r#"{{"scope":"report/july","lease_id":"{id}","token":"{t}"}}"#)
        }
    };
    let tok = token.to_string();
    assert_eq!(
        c.post_json("/v1/locks/renew", &body(&lease_id, "1", true))
            .await
            .status,
        409
    );
    let r = c
        .post_json("/v1/locks/renew", &body(&lease_id, &tok, true))
        .await;
    assert_eq!(
        (r.status, r.json()["result"].as_str()),
        (200, Some("renewed")),
        "{}",
        r.body
    );
    assert_eq!(
        c.post_json("/v1/locks/release", &body("abc", &tok, false))
            .await
            .status,
        409
    );
    let r = c
        .post_json("/v1/locks/release", &body(&lease_id, &tok, false))
        .await;
    assert_eq!(
        (r.status, r.json()["result"].as_str()),
        (200, Some("released")),
        "{}",
        r.body
    );
    assert_eq!(
        c.post_json("/v1/locks/renew", &body(&lease_id, &tok, true))
            .await
            .status,
        409
    );

    let r = c
        .post_json(
            "/v1/locks/acquire",
            r#"{"scope":"report/july","holder":"b","ttl_ms":1000}"#,
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let next: Token = r.json()["token"].as_str().unwrap().parse().unwrap();
    assert!(next > token);
    assert_eq!(
        c.post_json(
            "/v1/locks/acquire",
            r#"{"scope":"","holder":"b","ttl_ms":1000}"#
        )
        .await
        .status,
        400
    );
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_delay_holds_a_scope_after_an_expiry() {
    let cluster = EtcdCluster::start(3).await;
    let dir = tempfile::tempdir().unwrap();
    let running = authority(&cluster.endpoints(), dir.path(), "2s").await;
    let authority =
        AuthorityClient::new(&format!("http://{}", running.authority_addr.unwrap())).unwrap();
    let a = acquire_when_up(&authority, "a").await;
    a.lost().await; // not renewed, not released: it expires (at etcd, within ~2 s)
    // Until the lease and its delay have run out, the scope is busy.
    let started = Instant::now();
    let mut busy_after_expiry = false;
    let b = loop {
        match authority
            .acquire("s", "b", Duration::from_secs(1), Duration::ZERO)
            .await
        {
            Ok(b) => break b,
            Err(AcquireError::Busy { .. }) => busy_after_expiry = true,
            // etcd briefly without a leader (a re-election on a loaded machine).
            Err(AcquireError::Unavailable { .. }) => {}
            Err(e) => panic!("{e}"),
        }
        assert!(started.elapsed() < BOUND, "never granted after the delay");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(busy_after_expiry);
    // Released scopes skip the delay.
    assert!(b.token() > a.token());
    authority.release(&b).await.unwrap();
    acquire_when_up(&authority, "c").await;
    running.shutdown().await;
}

/// A waiting acquire takes no lease while the scope is busy: it reads the lock key and
/// watches it, and is granted as soon as the holder releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_acquire_watches_instead_of_taking_leases() {
    let cluster = EtcdCluster::start(1).await;
    let dir = tempfile::tempdir().unwrap();
    let running = authority(&cluster.endpoints(), dir.path(), "0s").await;
    let authority =
        AuthorityClient::new(&format!("http://{}", running.authority_addr.unwrap())).unwrap();
    let a = acquire_for(&authority, "a", Duration::from_secs(25)).await;
    let grants = || cluster.metric("grpc_server_started_total", "grpc_method=\"LeaseGrant\"");

    // Busy for the whole wait (a holds it far longer): no lease is granted meanwhile.
    let before = grants().await;
    let waited = authority
        .acquire(
            "s",
            "b",
            Duration::from_secs(5),
            Duration::from_millis(1500),
        )
        .await;
    assert!(
        matches!(waited, Err(AcquireError::Busy { ref holder, .. }) if holder.as_deref() == Some("a")),
        "{waited:?}"
    );
    assert_eq!(grants().await - before, 0.0, "leases granted while busy");

    // A waiter parked on the lock key's watch is granted at the release, long before a's
    // lease would have run out.
    let waiting = {
        let authority = authority.clone();
        tokio::spawn(async move {
            authority
                .acquire("s", "c", Duration::from_secs(5), BOUND)
                .await
        })
    };
    tokio::time::timeout(BOUND, async {
        while cluster
            .metric("etcd_debugging_mvcc_watcher_total", "")
            .await
            < 1.0
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the waiter watches the lock key");
    authority.release(&a).await.unwrap();
    let c = tokio::time::timeout(BOUND, waiting)
        .await
        .unwrap()
        .unwrap()
        .expect("granted at the release");
    assert!(c.token() > a.token());
    running.shutdown().await;
}

/// `bump-epoch` on the etcd backend: every later token carries the new epoch and so
/// outranks every earlier one, whatever its revision (after a restore from a snapshot,
/// revisions count again from the snapshot's); leases of either epoch renew and release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bump_epoch_makes_later_tokens_outrank_earlier_ones() {
    let cluster = EtcdCluster::start(1).await;
    let dir = tempfile::tempdir().unwrap();
    let config = authority_config(&cluster.endpoints(), dir.path(), "0s");
    let running = support::start(config.clone()).await;
    let authority =
        AuthorityClient::new(&format!("http://{}", running.authority_addr.unwrap())).unwrap();
    let bump = |config: Config| async move {
        tokio::task::spawn_blocking(move || fencegate::authority::bump_epoch(&config))
            .await
            .unwrap()
            .expect("bump-epoch")
    };
    let ttl = Duration::from_secs(10);
    let before = acquire_for(&authority, "a", ttl).await;
    assert_eq!(before.token().epoch, 0, "no epoch key yet: epoch 0");

    let epoch = bump(config.clone()).await;
    assert!(epoch > 0);
    let after = authority
        .acquire("t", "b", ttl, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(after.token().epoch, epoch);
    assert!(after.token() > before.token());
    let info = authority.status("t").await.unwrap();
    assert_eq!(info.token, Some(after.token()));
    authority.renew(&after, ttl).await.expect("renews");
    authority.renew(&before, ttl).await.expect("renews");
    authority.release(&after).await.expect("releases");
    authority.release(&before).await.expect("releases");

    let again = bump(config).await;
    assert!(again > epoch);
    let later = authority
        .acquire("s", "c", ttl, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(later.token().epoch, again);
    assert!(later.token() > after.token());
    running.shutdown().await;
}

/// Acquires scope `s`, retrying (within the test bound) while the authority answers 503:
/// a fresh cluster on a loaded machine may re-elect its leader right after start-up.
async fn acquire_when_up(authority: &AuthorityClient, holder: &str) -> fencegate::client::Lease {
    acquire_for(authority, holder, Duration::from_secs(1)).await
}

async fn acquire_for(
    authority: &AuthorityClient,
    holder: &str,
    ttl: Duration,
) -> fencegate::client::Lease {
    let started = Instant::now();
    loop {
        match authority.acquire("s", holder, ttl, Duration::ZERO).await {
            Ok(lease) => return lease,
            Err(AcquireError::Unavailable { .. }) if started.elapsed() < BOUND => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("acquire for {holder}: {e}"),
        }
    }
}

#[derive(Debug, Clone)]
struct Granted {
    scope: String,
    token: Token,
    sent: Instant,
    /// From the grant's answer until the client gave the lease up (its conservative local
    /// deadline, or the release it sent).
    held_from: Instant,
    held_until: Instant,
}

/// Puts `fault` on member 0 (the one an authority asks first; one acquisition before the
/// fault connects to it), waits until the other two have a leader, then makes `rounds`
/// acquisitions through one authority: answers the refused ones.
async fn refused_after(fault: fn(&mut EtcdCluster), rounds: usize) -> Vec<String> {
    let mut cluster = EtcdCluster::start(3).await;
    let dir = tempfile::tempdir().unwrap();
    let running = authority(&cluster.endpoints(), dir.path(), "0s").await;
    let c = Client::new(running.authority_addr.unwrap());
    let acquire = |i: usize| {
        let c = &c;
        async move {
            c.post_json(
                "/v1/locks/acquire",
                &format!(r#"{{"scope":"member/{i}","holder":"a","ttl_ms":5000}}"#),
            )
            .await
        }
    };
    let r = acquire(0).await;
    assert_eq!(r.status, 200, "before the fault: {}", r.body);

    fault(&mut cluster);
    tokio::time::timeout(BOUND, async {
        while cluster.leader().await.is_none_or(|i| i == 0) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the two members left have a leader");

    let mut refused = Vec::new();
    for i in 1..=rounds {
        let r = acquire(i).await;
        if r.status != 200 {
            refused.push(format!("{i}: {} {}", r.status, r.body));
        }
    }
    running.shutdown().await;
    refused
}

/// A member that is gone is not asked again: at most one acquisition may find out about
/// it the hard way (a request already on its way there). A client balanced over all
/// members kept picking the dead one, and most requests failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_member_is_not_asked_again() {
    const ROUNDS: usize = 30;
    let refused = refused_after(|cluster| cluster.kill(0), ROUNDS).await;
    assert!(
        refused.len() <= 1,
        "{} of {ROUNDS} acquisitions refused after a member died: {refused:#?}",
        refused.len()
    );
}

/// A member that stops answering (its process frozen, its connection up) is left after one
/// request of it timed out, instead of every request waiting out its timeout there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_stops_answering_is_left() {
    const ROUNDS: usize = 10;
    let refused = refused_after(|cluster| cluster.stop(0), ROUNDS).await;
    assert!(
        refused.len() <= 1,
        "{} of {ROUNDS} acquisitions refused after a member stopped answering: {refused:#?}",
        refused.len()
    );
}

/// Stop the leader during a run of acquisitions through two authority instances: every
/// token granted after the failover is greater than every token granted before it, and
/// no two grants of one scope are ever held at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_failover_keeps_tokens_increasing_and_leases_exclusive() {
    const WORKERS: usize = 5;
    const BEFORE: usize = 15;
    const AFTER: usize = 15;
    let mut cluster = EtcdCluster::start(3).await;
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let one = authority(&cluster.endpoints(), d1.path(), "0s").await;
    let two = authority(&cluster.endpoints(), d2.path(), "0s").await;
    let clients = [one.authority_addr.unwrap(), two.authority_addr.unwrap()]
        .map(|a| AuthorityClient::new(&format!("http://{a}")).unwrap());
    let grants: Arc<Mutex<Vec<Granted>>> = Arc::default();
    let killed_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let (progress, mut progress_rx) = tokio::sync::watch::channel(0usize);
    let progress = Arc::new(progress);
    let ttl = Duration::from_secs(1);
    // What the workers were told after the kill, per answer (for the failure message).
    let refusals: Arc<Mutex<BTreeMap<String, usize>>> = Arc::default();

    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let authority = clients[w % 2].clone();
        let (grants, killed_at, progress) = (grants.clone(), killed_at.clone(), progress.clone());
        let refusals = refusals.clone();
        tasks.push(tokio::spawn(async move {
            let scope = format!("scope-{}", w % 2);
            let give_up = Instant::now() + Duration::from_secs(90);
            let mut round = 0usize;
            loop {
                let after = {
                    let k = *killed_at.lock().unwrap();
                    let list = grants.lock().unwrap();
                    k.map(|k| list.iter().filter(|g| g.sent > k).count())
                };
                if after.is_some_and(|n| n >= AFTER) || Instant::now() > give_up {
                    return;
                }
                let sent = Instant::now();
                match authority
                    .acquire(&scope, &format!("w{w}"), ttl, Duration::ZERO)
                    .await
                {
                    Ok(lease) => {
                        let held_from = Instant::now();
                        round += 1;
                        // Hold for a while; every third lease is left to expire.
                        tokio::time::sleep(Duration::from_millis(20 * (round % 5) as u64)).await;
                        let release = !round.is_multiple_of(3);
                        let held_until = match lease.deadline() {
                            Some(deadline) if release => Instant::now().min(deadline),
                            Some(deadline) => deadline,
                            None => held_from, // arrived already expired: never held
                        };
                        if release {
                            let _ = authority.release(&lease).await;
                        }
                        grants.lock().unwrap().push(Granted {
                            scope: scope.clone(),
                            token: lease.token(),
                            sent,
                            held_from,
                            held_until,
                        });
                        progress.send_modify(|n| *n += 1);
                    }
                    Err(e) => {
                        if killed_at.lock().unwrap().is_some() {
                            let seen = match &e {
                                AcquireError::Busy { holder, .. } => format!("busy ({holder:?})"),
                                other => other.to_string(),
                            };
                            *refusals.lock().unwrap().entry(seen).or_default() += 1;
                        }
                        let pause = match e {
                            AcquireError::Busy { retry_after, .. } => retry_after,
                            _ => Duration::from_millis(50),
                        };
                        tokio::time::sleep(pause.min(Duration::from_millis(50))).await;
                    }
                }
            }
        }));
    }

    tokio::time::timeout(BOUND * 3, progress_rx.wait_for(|n| *n >= BEFORE))
        .await
        .expect("grants before the failover")
        .unwrap();
    let leader = cluster.leader().await.expect("a leader");
    let before_kill = Instant::now();
    cluster.kill(leader);
    *killed_at.lock().unwrap() = Some(Instant::now());
    for t in tasks {
        t.await.unwrap();
    }
    let grants = grants.lock().unwrap().clone();

    let before: Vec<&Granted> = grants
        .iter()
        .filter(|g| g.held_from < before_kill)
        .collect();
    let kill = killed_at.lock().unwrap().unwrap();
    let after: Vec<&Granted> = grants.iter().filter(|g| g.sent > kill).collect();
    println!(
        "etcd failover: {} grants before stopping leader m{leader}, {} after, {} in all",
        before.len(),
        after.len(),
        grants.len()
    );
    assert!(before.len() >= BEFORE);
    if after.len() < AFTER {
        // What each authority answers now, in full.
        let mut now = Vec::new();
        for a in [&one, &two] {
            let c = Client::new(a.authority_addr.unwrap());
            let r = c
                .post_json(
                    "/v1/locks/acquire",
                    r#"{"scope":"probe","holder":"probe","ttl_ms":1000}"#,
                )
                .await;
            now.push(format!("{} {}", r.status, r.body));
        }
        let leader_now = cluster.leader().await.map(|i| format!("m{i}"));
        let refused = refusals.lock().unwrap().clone();
        panic!(
            "too few grants after the failover: {}; answers after the kill: {refused:?}; leader now: {leader_now:?}; a fresh scope now: {now:?}",
            after.len(),
        );
    }
    let max_before = before.iter().map(|g| g.token).max().unwrap();
    let min_after = after.iter().map(|g| g.token).min().unwrap();
    assert!(
        min_after > max_before,
        "{min_after} after the failover is not above {max_before}"
    );

    // Per scope, in grant order: tokens strictly increase and holds never overlap.
    let mut by_scope: BTreeMap<&str, Vec<&Granted>> = BTreeMap::new();
    for g in &grants {
        by_scope.entry(&g.scope).or_default().push(g);
    }
    for (scope, mut list) in by_scope {
        list.sort_by_key(|g| g.token);
        for pair in list.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            assert!(a.token < b.token, "{scope}: repeated token {}", a.token);
            assert!(
                a.held_until <= b.held_from,
                "{scope}: lease {} was still held when {} was granted",
                a.token,
                b.token
            );
        }
    }
    one.shutdown().await;
    two.shutdown().await;
}

/// SPEC §9 on the etcd backend: the holder is the authenticated client, and another
/// client's renew or release with the holder's (lease_id, token) is `lost`, the lease
/// untouched; the status shows the lease id to its holder only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_holder_renews_or_releases_an_etcd_lease() {
    let cluster = EtcdCluster::start(1).await;
    let dir = tempfile::tempdir().unwrap();
    crate::support::write_secret(dir.path().join("a.token"), "secret-a");
    crate::support::write_secret(dir.path().join("b.token"), "secret-b");
    let clients = r#"
[[authority.client]]
name = "a"
token_file = "a.token"
scopes = ["s/*"]
[[authority.client]]
name = "b"
token_file = "b.token"
scopes = ["s/*"]
"#;
    let table = etcd::authority_table(&cluster.endpoints(), None) + clients;
    let support::Authority {
        running, api: c, ..
    } = support::start_authority(&table, dir.path()).await;
    let call = |who: &'static str, path: &'static str, body: String| {
        let c = c.clone();
        async move {
            c.send(
                "POST",
                path,
                &[("content-type", "application/json"), ("authorization", who)],
                &body,
            )
            .await
        }
    };
    let r = call(
        "Bearer secret-a",
        "/v1/locks/acquire",
        r#"{"scope":"s/1","ttl_ms":5000}"#.into(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let (id, tok) = (
        r.json()["lease_id"].as_str().unwrap().to_string(),
        r.json()["token"].as_str().unwrap().to_string(),
    );
    let lease = |ttl: bool| {
        let ttl = if ttl { r#","ttl_ms":5000"# } else { "" };
        format!(r#"{{"scope":"s/1","lease_id":"{id}","token":"{tok}"{ttl}}}"#)
    };
    let status = |who: &'static str| {
        let c = c.clone();
        async move {
            c.send(
                "GET",
                "/v1/locks?scope=s%2F1",
                &[("authorization", who)],
                "",
            )
            .await
            .json()
        }
    };
    assert_eq!(
        status("Bearer secret-b").await["lease_id"],
        serde_json::Value::Null
    );
    assert_eq!(status("Bearer secret-a").await["lease_id"], id.as_str());
    for (path, ttl) in [("/v1/locks/release", false), ("/v1/locks/renew", true)] {
        let r = call("Bearer secret-b", path, lease(ttl)).await;
        assert_eq!((r.status, r.json()["result"].as_str()), (409, Some("lost")));
    }
    assert_eq!(status("Bearer secret-a").await["holder"], "a");
    // The id is etcd's lease (handed out in sequence) and 128 random bits: the holder's
    // own client with etcd's part alone, or with another secret, is `lost` too (SPEC §8).
    let (etcd_part, secret) = id.split_once('.').expect("lease id with a secret part");
    assert_eq!(secret.len(), 32, "{id}");
    let mut other = secret.as_bytes().to_vec();
    other[0] = if other[0] == b'0' { b'1' } else { b'0' };
    let other = String::from_utf8(other).expect("hex");
    for guess in [
        etcd_part.to_string(),
        format!("{etcd_part}.{other}"),
        format!("{etcd_part}."),
    ] {
        for (path, ttl) in [("/v1/locks/release", false), ("/v1/locks/renew", true)] {
            let body = lease(ttl).replace(&id, &guess);
            let r = call("Bearer secret-a", path, body).await;
            assert_eq!(
                (r.status, r.json()["result"].as_str()),
                (409, Some("lost")),
                "{path} with {guess}"
            );
        }
    }
    let r = call("Bearer secret-a", "/v1/locks/renew", lease(true)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = call("Bearer secret-a", "/v1/locks/release", lease(false)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    running.shutdown().await;
}
