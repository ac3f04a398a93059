//! Planned hand-offs under load (SPEC §10): writers keep writing, each scope with rising
//! tokens, through one instance that stays (so every request for another owner's shard
//! takes a hop), while a third instance joins and then one of the first two leaves
//! (SIGTERM). The only refusals are 503 `unavailable` (retried with the same token) inside
//! the windows of the join and of the leave; nothing else fails; and the backend, the
//! in-process double that logs arrivals, sees every scope's tokens in order.
#![cfg(feature = "etcd")]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::procs::{Instance, SECRET, settled};
use crate::support::etcd::EtcdCluster;
use crate::support::{self, Double};

const WRITERS: usize = 4;
const SCOPES_PER_WRITER: usize = 4;
/// Each writer's most requests, so the loop ends by itself.
const MAX_REQUESTS: usize = 20_000;

#[derive(Debug, Clone, Copy)]
struct Answer {
    at: Instant,
    status: u16,
}

async fn put(
    client: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Full<bytes::Bytes>,
    >,
    port: u16,
    path: &str,
    token: &str,
) -> u16 {
    let req = http::Request::builder()
        .method("PUT")
        .uri(format!("http://127.0.0.1:{port}{path}"))
        .header("fencing-token", token)
        .body(http_body_util::Full::new(bytes::Bytes::from_static(b"x")))
        .expect("request");
    match tokio::time::timeout(support::BOUND, client.request(req)).await {
        Ok(Ok(resp)) => resp.status().as_u16(),
        // No answer at all: counted apart (it must not happen).
        _ => 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_and_a_leave_under_load_refuse_only_in_their_windows_and_reorder_nothing() {
    let etcd = EtcdCluster::start(3).await;
    let double = Double::start().await;
    let dir = tempfile::tempdir().expect("dir");
    crate::support::write_secret(dir.path().join("peer.secret"), format!("{SECRET}\n"));
    let a = Instance::new(dir.path(), "a", double.addr, &etcd);
    let b = Instance::new(dir.path(), "b", double.addr, &etcd);
    let c = Instance::new(dir.path(), "c", double.addr, &etcd);
    let mut pa = a.spawn();
    let _pb = b.spawn();
    settled(&[&a, &b]).await;

    let stop = Arc::new(AtomicBool::new(false));
    let port = b.proxy;
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let stop = stop.clone();
        writers.push(tokio::spawn(async move {
            let client =
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                    .build_http();
            let mut answers = Vec::new();
            let mut next = [1u64; SCOPES_PER_WRITER];
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) && answers.len() < MAX_REQUESTS {
                let s = i % SCOPES_PER_WRITER;
                let path = format!("/reports/w{w}s{s}/obj");
                let status = put(&client, port, &path, &next[s].to_string()).await;
                answers.push(Answer {
                    at: Instant::now(),
                    status,
                });
                // A 503 is retried with the same token; anything else moves on.
                if status != 503 {
                    next[s] += 1;
                    i += 1;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            answers
        }));
    }
    // Some traffic first, then the join, then the leave.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let join_start = Instant::now();
    let _pc = c.spawn();
    settled(&[&a, &b, &c]).await;
    let join_end = Instant::now();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let leave_start = Instant::now();
    support::signal(pa.child.id(), "TERM");
    let exit = pa.child.wait().expect("a exits");
    assert!(exit.success(), "{exit:?}");
    settled(&[&b, &c]).await;
    let leave_end = Instant::now();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);

    let mut answers = Vec::new();
    for w in writers {
        answers.extend(w.await.expect("writer"));
    }
    let mut by_status: BTreeMap<u16, usize> = BTreeMap::new();
    for a in &answers {
        *by_status.entry(a.status).or_default() += 1;
    }
    // A window ends when the test saw it settled; an answer is timed when its writer
    // read it, a moment after it was made: that moment is allowed for.
    let slack = Duration::from_millis(200);
    let in_join = |t: Instant| t >= join_start && t <= join_end + slack;
    let in_leave = |t: Instant| t >= leave_start && t <= leave_end + slack;
    let refused: Vec<&Answer> = answers.iter().filter(|a| a.status == 503).collect();
    let span = |f: &dyn Fn(Instant) -> bool| {
        let ts: Vec<Instant> = refused.iter().map(|a| a.at).filter(|t| f(*t)).collect();
        match (ts.iter().min(), ts.iter().max()) {
            (Some(a), Some(b)) => b.duration_since(*a),
            _ => Duration::ZERO,
        }
    };
    println!(
        "hand-offs under load: {by_status:?}; join {:?} (503s over {:?}), leave {:?} (503s over {:?})",
        join_end - join_start,
        span(&in_join),
        leave_end - leave_start,
        span(&in_leave)
    );
    assert!(
        by_status
            .keys()
            .all(|s| (200..300).contains(s) || *s == 503),
        "only successes and 503 unavailable: {by_status:?}"
    );
    for r in &refused {
        assert!(
            in_join(r.at) || in_leave(r.at),
            "a 503 outside the hand-off windows"
        );
    }
    assert!(
        by_status.get(&200).copied().unwrap_or(0) > 100,
        "{by_status:?}"
    );

    // The backend saw each scope's tokens in order.
    let mut last: BTreeMap<String, u64> = BTreeMap::new();
    for seen in double.seen() {
        let token: u64 = seen
            .header("fencing-token")
            .and_then(|t| t.parse().ok())
            .expect("a token");
        let prev = last.entry(seen.target.clone()).or_insert(0);
        assert!(token >= *prev, "{}: {token} after {prev}", seen.target);
        *prev = token;
    }
    assert_eq!(last.len(), WRITERS * SCOPES_PER_WRITER);
}
