//! Faults of a cluster (SPEC §10) with real processes on loopback: fencegate instances,
//! a real 3-member etcd, and a backend (the in-process [`Double`], where the backend's
//! order of arrival must be seen; nginx WebDAV, where what was stored must be read back).
//! What is proved:
//!
//! 1. **An owner frozen (SIGSTOP) past its ownership** with a request it admitted still
//!    reading its body: another instance takes the shard over and accepts a higher token;
//!    once the frozen owner runs again, the request it admitted never reaches the backend
//!    (the backend never sees its token, let alone after the newer one), the frozen
//!    owner's client gets no 2xx, and the owner exits with status 3 (its lease is gone).
//!    (A body this small, 10 bytes, is read whole before anything goes upstream, within
//!    the upstream timeout counted from the admission. Once the owner runs again, either
//!    that read has timed out (400), or the rest of the body is read first and the
//!    exchange's self-fencing stop gives the request up before it is sent (504): both
//!    are seen, and either way the backend never sees token 5.)
//! 2. **An owner cut off from etcd but not from its clients or its backend.** This is the
//!    closest faithful substitute for a network partition that loopback allows: the owner
//!    reaches etcd only through TCP relays in the test, one per member, and cutting them
//!    stops forwarding bytes both ways while keeping every socket open, so the owner sees
//!    timeouts, not refusals, as in a partition; nothing else of the owner's reaches etcd.
//!    The cut owner stops admitting by itself no later than its self-fencing deadline (at
//!    most one ttl after the cut, plus a small bound for the probe), and before the other
//!    instance first accepts a write for the shard.
//! 3. **The etcd leader killed (SIGKILL) mid-run** under 8 writers on 16 scopes spread
//!    over both instances: every scope accepts a new, higher-token write within a stated
//!    bound after the kill, and no acknowledged write is lost (each scope reads back,
//!    through either instance, the body of its last acknowledged write, or of the one
//!    write after it whose answer left its outcome unknown). The unavailability window
//!    is measured and printed.
//!
//! Every wait is a bounded poll; no result depends on a sleep.
#![cfg(feature = "etcd")]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::procs::{Instance, SECRET, SHARDS, TTL, UPSTREAM_TIMEOUT, settled};
use crate::support::etcd::EtcdCluster;
use crate::support::nginx::Nginx;
use crate::support::{self, Double};

/// The shard a scope of the test's route (`report/<r>`) falls in.
pub(super) fn shard_of_report(report: &str) -> u32 {
    fencegate::cluster::shard::shard_of(&format!("report/{report}"), SHARDS as u32)
}

/// The shards `instance` owns, as its `/v1/cluster` says.
pub(super) async fn owned_by(instance: &Instance) -> Vec<u32> {
    instance.status().await["owned"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|o| o["shard"].as_u64())
        .filter_map(|s| u32::try_from(s).ok())
        .collect()
}

/// A report name whose scope falls in one of `shards`.
pub(super) fn report_in(shards: &[u32]) -> String {
    (0..1000)
        .map(|i| format!("r{i}"))
        .find(|r| shards.contains(&shard_of_report(r)))
        .unwrap_or_else(|| panic!("no report in shards {shards:?}"))
}

/// The directory the instances run in, with the cluster's peer secret.
pub(super) fn cluster_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("dir");
    crate::support::write_secret(dir.path().join("peer.secret"), format!("{SECRET}\n"));
    dir
}

/// Waits (bounded) for the child to exit; None if it is still running at `bound`.
pub(super) async fn exit_within(child: &mut std::process::Child, bound: Duration) -> Option<i32> {
    let until = Instant::now() + bound;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return Some(status.code().unwrap_or(-1));
        }
        if Instant::now() >= until {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_frozen_past_its_ownership_never_lets_its_admitted_request_reach_the_backend() {
    let started = Instant::now();
    let etcd = EtcdCluster::start(3).await;
    let double = Double::start().await;
    let dir = cluster_dir();
    let a = Instance::new(dir.path(), "a", double.addr, &etcd);
    let b = Instance::new(dir.path(), "b", double.addr, &etcd);
    let mut pa = a.spawn();
    let _pb = b.spawn();
    settled(&[&a, &b]).await;

    let report = report_in(&owned_by(&a).await);
    let shard = shard_of_report(&report);
    let path = format!("/reports/{report}/obj");

    // The head and half the body: a decides (the mark goes to etcd) and waits for the rest.
    let mut raw = TcpStream::connect(("127.0.0.1", a.proxy))
        .await
        .expect("connect a");
    raw.write_all(
        format!(
            "PUT {path} HTTP/1.1\r\nhost: fencegate\r\nfencing-token: 5\r\ncontent-length: 10\r\n\r\n12345"
        )
        .as_bytes(),
    )
    .await
    .expect("head and half the body");
    let mut kv = etcd_client::Client::connect(etcd.endpoints(), None)
        .await
        .expect("etcd client");
    let key = format!("/fencegate/cluster/default/marks/{shard}/report/{report}");
    let until = Instant::now() + support::BOUND;
    loop {
        let got = kv.get(key.as_str(), None).await.expect("get the mark");
        if got.kvs().first().is_some_and(|k| k.value() == b"5") {
            break;
        }
        assert!(Instant::now() < until, "a never admitted token 5 ({key})");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Frozen with the request admitted; the rest of its body waits in a's socket.
    support::signal(pa.child.id(), "STOP");
    let stopped = Instant::now();
    raw.write_all(b"67890").await.expect("the rest of the body");

    // b takes the shard over (a's lease expires, then the takeover wait) and accepts 6.
    let until = stopped + support::BOUND;
    let mut refused = BTreeMap::<u16, usize>::new();
    let taken_over = loop {
        let resp = b.client().put(&path, "6", "b6").await;
        if resp.status < 300 {
            break stopped.elapsed();
        }
        // 503 while no one may admit; 502-504 for the hop to the frozen owner.
        assert!(
            resp.status == 503 || (502..=504).contains(&resp.status),
            "{}: {}",
            resp.status,
            resp.body
        );
        *refused.entry(resp.status).or_default() += 1;
        assert!(Instant::now() < until, "b never took the shard over");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        taken_over >= TTL + UPSTREAM_TIMEOUT,
        "taken over after {taken_over:?}"
    );

    // a runs again: its validity is long past, and etcd says its lease is gone.
    support::signal(pa.child.id(), "CONT");
    let exit = exit_within(&mut pa.child, support::BOUND).await;
    assert_eq!(
        exit,
        Some(3),
        "a exits with status 3 once its lease is known gone"
    );

    let mut answer = Vec::new();
    let _ = tokio::time::timeout(support::BOUND, raw.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = support::status_of(&answer);
    assert!(
        !(200..300).contains(&status),
        "the frozen owner's client got {status}: {answer}"
    );

    let seen = double.seen();
    let tokens: Vec<&str> = seen
        .iter()
        .filter(|s| s.target == path)
        .filter_map(|s| s.header("fencing-token"))
        .collect();
    let six = tokens.iter().position(|t| *t == "6");
    assert!(six.is_some(), "b's token 6 reached the backend: {tokens:?}");
    assert!(
        !tokens.contains(&"5"),
        "the backend saw token 5 (after 6: {}): {tokens:?}",
        tokens.iter().rposition(|t| *t == "5") > six
    );
    println!(
        "frozen owner: b took over {taken_over:?} after SIGSTOP (refused meanwhile: {refused:?}); \
         a's client got {status:?}; a exited 3; backend saw {tokens:?}; test took {:?}",
        started.elapsed()
    );
}

/// A TCP relay to one etcd member: forwards bytes both ways until cut; once cut it
/// forwards nothing more, in either direction, on any connection old or new, and keeps
/// every socket open (what a partition looks like to the endpoints: silence).
pub(super) async fn relay(target: String, cut: watch::Receiver<bool>) -> String {
    let target: SocketAddr = target
        .trim_start_matches("http://")
        .parse()
        .expect("member address");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
    let addr = listener.local_addr().expect("relay address");
    tokio::spawn(async move {
        while let Ok((inbound, _)) = listener.accept().await {
            let cut = cut.clone();
            tokio::spawn(async move {
                if *cut.borrow() {
                    return hold(vec![inbound]).await;
                }
                let Ok(outbound) = TcpStream::connect(target).await else {
                    return;
                };
                let (ir, iw) = inbound.into_split();
                let (or, ow) = outbound.into_split();
                tokio::spawn(pump(ir, ow, cut.clone()));
                pump(or, iw, cut).await;
            });
        }
    });
    format!("http://{addr}")
}

/// Keeps sockets open, silent, until the test's runtime ends.
async fn hold<T>(_open: Vec<T>) {
    std::future::pending::<()>().await;
}

/// Copies one direction until either end closes; once cut, holds both ends open and
/// silent (bytes read as the cut came are dropped, as a partition would).
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut cut: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if *cut.borrow() {
            return hold(vec![(from, to)]).await;
        }
        let read = tokio::select! {
            read = from.read(&mut buf) => Some(read),
            _ = cut.wait_for(|c| *c) => None,
        };
        let n = match read {
            None => continue,
            Some(Ok(0) | Err(_)) => return,
            Some(Ok(n)) => n,
        };
        if *cut.borrow() {
            return hold(vec![(from, to)]).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_cut_off_from_etcd_stops_admitting_by_its_deadline_before_another_takes_over() {
    let started = Instant::now();
    let etcd = EtcdCluster::start(3).await;
    let double = Double::start().await;
    let dir = cluster_dir();
    let (cut_tx, cut_rx) = watch::channel(false);
    let mut relays = Vec::new();
    for member in etcd.endpoints() {
        relays.push(relay(member, cut_rx.clone()).await);
    }
    // a reaches etcd only through the relays; b directly.
    let a = Instance::with_endpoints(dir.path(), "a", double.addr, &relays);
    let b = Instance::new(dir.path(), "b", double.addr, &etcd);
    let _pa = a.spawn();
    let _pb = b.spawn();
    settled(&[&a, &b]).await;

    let report = report_in(&owned_by(&a).await);
    let shard = shard_of_report(&report);
    let path = format!("/reports/{report}/obj");
    // The scope's mark is 10, decided by a: from now on a probe with 10 is an equal
    // token, which a decides in memory, with no round trip to etcd.
    let put = a.client().put(&path, "10", "a10").await;
    assert_eq!(put.result(), "accepted", "{}: {}", put.status, put.body);

    cut_tx.send_replace(true);
    let cut = Instant::now();

    // Through a, every 20 ms: when it first refuses (503), having answered 2xx until then.
    let a_probe = {
        let client = a.client();
        let path = path.clone();
        tokio::spawn(async move {
            let until = Instant::now() + support::BOUND;
            let mut accepted = 0;
            loop {
                let resp = client.put(&path, "10", "a10").await;
                let at = cut.elapsed();
                match resp.status {
                    503 => return (at, accepted),
                    // Its deadline passed while this request was at the upstream: a
                    // gave the exchange up, which is the same stop (SPEC §10).
                    504 if resp.body.contains("ownership of the scope's shard ended") => {
                        return (at, accepted);
                    }
                    s if s < 300 => accepted += 1,
                    s => panic!("a answered {s} before it stopped: {}", resp.body),
                }
                assert!(Instant::now() < until, "a never stopped admitting");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    // Through b, every 20 ms: when it first accepts a write for the scope. Only once b
    // holds the shard: before that b hands a write to a (its owner in b's view), and a,
    // still valid, would try to commit it to the etcd it cannot reach, which is another
    // fault than the one measured here.
    let b_probe = {
        let client = b.client();
        let path = path.clone();
        let admin = b.admin;
        tokio::spawn(async move {
            let until = Instant::now() + support::BOUND;
            let status = support::Client::new(([127, 0, 0, 1], admin).into());
            loop {
                let owned = status.get("/v1/cluster").await.json()["owned"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                    .iter()
                    .any(|o| o["shard"].as_u64() == Some(u64::from(shard)));
                if owned {
                    let resp = client.put(&path, "11", "b11").await;
                    if resp.status < 300 {
                        return cut.elapsed();
                    }
                    assert_eq!(resp.status, 503, "b: {}", resp.body);
                }
                assert!(Instant::now() < until, "b never took the shard over");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let (a_stopped, a_accepted) = a_probe.await.expect("a's probe");
    let b_started = b_probe.await.expect("b's probe");

    // a's deadline is its last keep-alive's send (before the cut) + ttl − drift margin.
    let slack = Duration::from_millis(300);
    assert!(
        a_stopped <= TTL + slack,
        "a stopped {a_stopped:?} after the cut (ttl {TTL:?})"
    );
    assert!(
        a_stopped < b_started,
        "a stopped at {a_stopped:?}, b started at {b_started:?}"
    );
    // And a never took b's write: the backend saw 11 only from b, after a's last 10.
    let tokens: Vec<String> = double
        .seen()
        .iter()
        .filter(|s| s.target == path)
        .filter_map(|s| s.header("fencing-token").map(str::to_string))
        .collect();
    let first_11 = tokens.iter().position(|t| t == "11");
    assert!(first_11.is_some(), "{tokens:?}");
    assert!(
        tokens[first_11.unwrap_or(0)..].iter().all(|t| t == "11"),
        "a's 10 reached the backend after b's 11: {tokens:?}"
    );
    println!(
        "cut from etcd: a stopped admitting {a_stopped:?} after the cut ({a_accepted} probes \
         accepted before), b first accepted {b_started:?} after (gap {:?}); test took {:?}",
        b_started.saturating_sub(a_stopped),
        started.elapsed()
    );
}

/// One write as a writer sent it and what came back.
#[derive(Debug, Clone)]
struct Write {
    scope: usize,
    token: u64,
    status: u16,
    sent: Duration,
    answered: Duration,
}

fn body_of(scope: usize, token: u64) -> String {
    format!("r{scope}-t{token}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_etcd_leader_killed_mid_run_loses_no_acknowledged_write() {
    let started = Instant::now();
    let mut etcd = EtcdCluster::start(3).await;
    let nginx = Nginx::webdav().expect("nginx (run scripts/test.sh)");
    let dir = cluster_dir();
    let a = Instance::new(dir.path(), "a", nginx.addr(), &etcd);
    let b = Instance::new(dir.path(), "b", nginx.addr(), &etcd);
    let mut pa = a.spawn();
    let mut pb = b.spawn();
    settled(&[&a, &b]).await;

    const SCOPES: usize = 16;
    const WRITERS: usize = 8;
    let (owned_a, owned_b) = (owned_by(&a).await, owned_by(&b).await);
    let shards: Vec<u32> = (0..SCOPES)
        .map(|i| shard_of_report(&format!("r{i}")))
        .collect();
    assert!(
        shards.iter().any(|s| owned_a.contains(s)) && shards.iter().any(|s| owned_b.contains(s)),
        "the scopes' shards {shards:?} are spread over a {owned_a:?} and b {owned_b:?}"
    );

    // Writers run from t0 until `stop`; the leader is killed at `kill_at` (1.5 s in).
    let t0 = Instant::now();
    let kill_at = Duration::from_millis(1500);
    // Every scope must accept a write sent after the kill within this.
    let recovery_bound = Duration::from_secs(8);
    let stop = kill_at + recovery_bound + Duration::from_secs(2);
    let log = Arc::new(Mutex::new(Vec::<Write>::new()));
    let clients = [a.client(), b.client()];
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (log, clients) = (log.clone(), clients.clone());
        writers.push(tokio::spawn(async move {
            let mine = [2 * w, 2 * w + 1];
            // Each scope's next token: kept until acknowledged, so every attempt of a
            // token carries the same body, and an unacknowledged one is retried as is.
            let mut next = [1u64, 1];
            while t0.elapsed() < stop {
                for (k, &scope) in mine.iter().enumerate() {
                    let token = next[k];
                    // Through either instance, by the token's parity.
                    let client = &clients[(token % 2) as usize];
                    let sent = t0.elapsed();
                    let resp = client
                        .put(
                            &format!("/reports/r{scope}/obj"),
                            &token.to_string(),
                            &body_of(scope, token),
                        )
                        .await;
                    let answered = t0.elapsed();
                    if resp.status < 300 {
                        next[k] += 1;
                    } else {
                        assert!(
                            resp.status >= 500,
                            "r{scope} t{token}: {} {}",
                            resp.status,
                            resp.body
                        );
                    }
                    log.lock().unwrap().push(Write {
                        scope,
                        token,
                        status: resp.status,
                        sent,
                        answered,
                    });
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }

    let until = t0 + support::BOUND;
    while t0.elapsed() < kill_at {
        assert!(Instant::now() < until);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let leader = etcd.leader().await.expect("an etcd leader");
    etcd.kill(leader);
    let killed = t0.elapsed();
    for w in writers {
        w.await.expect("writer");
    }
    let log = log.lock().unwrap().clone();

    assert!(
        pa.child.try_wait().expect("a").is_none(),
        "a kept its lease"
    );
    assert!(
        pb.child.try_wait().expect("b").is_none(),
        "b kept its lease"
    );

    let mut refused = BTreeMap::<u16, usize>::new();
    for w in log.iter().filter(|w| w.status >= 300) {
        *refused.entry(w.status).or_default() += 1;
    }
    let acked = log.iter().filter(|w| w.status < 300).count();
    // The unavailability window: from the kill to the last refusal answered after it.
    let window = log
        .iter()
        .filter(|w| w.status >= 300 && w.answered >= killed)
        .map(|w| w.answered - killed)
        .max()
        .unwrap_or_default();
    let mut worst_gap = Duration::ZERO;
    let mut worst_recovery = Duration::ZERO;
    for scope in 0..SCOPES {
        let mine: Vec<&Write> = log.iter().filter(|w| w.scope == scope).collect();
        let acks: Vec<&Write> = mine.iter().copied().filter(|w| w.status < 300).collect();
        // Recovery: the first write sent after the kill that was acknowledged.
        let first = acks
            .iter()
            .find(|w| w.sent >= killed)
            .unwrap_or_else(|| panic!("r{scope}: no write acknowledged after the kill"));
        let recovery = first.answered - killed;
        assert!(
            recovery <= recovery_bound,
            "r{scope}: first write after the kill acknowledged {recovery:?} after it"
        );
        let before = acks
            .iter()
            .filter(|w| w.sent < killed)
            .map(|w| w.token)
            .max()
            .unwrap_or(0);
        assert!(
            first.token > before,
            "r{scope}: a higher token after the kill"
        );
        worst_recovery = worst_recovery.max(recovery);
        // The unavailability: the longest time between two acknowledgments of the scope.
        for pair in acks.windows(2) {
            worst_gap = worst_gap.max(pair[1].answered - pair[0].answered);
        }

        // Nothing acknowledged is lost: the last acknowledged body, or the next token's
        // if an attempt of it had an unknown outcome (an answer other than 503).
        let last = acks.last().expect("acknowledged writes");
        let unknown_next = mine
            .iter()
            .any(|w| w.token == last.token + 1 && w.status != 503);
        let path = format!("/reports/r{scope}/obj");
        for client in &clients {
            let got = client.get(&path).await;
            assert_eq!(got.status, 200, "r{scope}: {}", got.body);
            let ok = got.body == body_of(scope, last.token)
                || (unknown_next && got.body == body_of(scope, last.token + 1));
            assert!(
                ok,
                "r{scope}: read {:?}, last acknowledged {:?}",
                got.body,
                body_of(scope, last.token)
            );
        }
    }
    println!(
        "etcd leader (m{leader}) killed at {killed:?}: {} writes, {acked} acknowledged, \
         refused {refused:?}; refusals until {window:?} after the kill; every scope acknowledged a new write within {worst_recovery:?} \
         of the kill; longest gap between a scope's acknowledgments {worst_gap:?}; test took {:?}",
        log.len(),
        started.elapsed()
    );
}
