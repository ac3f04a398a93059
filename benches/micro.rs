//! Micro-benchmarks of the request pipeline's pieces (criterion).
//!
//! Run with `cargo bench --bench micro`; pass a filter to run some, e.g.
//! `cargo bench --bench micro -- gate`. Settings keep the whole run under ~2 minutes:
//! short warm-ups, short measurements, small samples for the fsync-bound group.
//!
//! What each group answers:
//! - `token`: cost of parsing the `Fencing-Token` header (bare counter, epoch form, junk).
//! - `route`: canonicalizing a path and finding its route in a realistic table, plus
//!   rendering the scope: everything before the gate, per request.
//! - `policy`: the pure decision table.
//! - `gate`: `Gates::admit` on the equal-token path (a hot scope, no disk, no wait),
//!   including dropping the in-flight guard, on a current-thread runtime.
//! - `marks`: one group commit of N concurrent advances (N = 1, 64, 512) through the
//!   writer thread to a redb file on disk, opened as fencegate opens it: the
//!   fsync-bound cost of W2, and how it grows with the batch.
//! - `beneath`: `MarkStore::marked_beneath`, the check of a WebDAV collection's DELETE,
//!   MOVE or COPY (SPEC §16), over 100,000 marks in redb, with the journal's pending
//!   advances empty and full (16,384 scopes, as W2's churn leaves it just before a
//!   checkpoint), for a collection with a marked member and one without.

use std::hint::black_box;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use fencegate::fence::{Gates, decide};
use fencegate::metrics::Metrics;
use fencegate::route;
use fencegate::settings::{Config, EqualPolicy};
use fencegate::store::MarkStore;
use fencegate::token::Token;

/// A route table shaped like a real edge deployment: unfenced health and static routes,
/// host-specific routes, several fenced families. The request the benches route matches
/// the eighth route, so the router walks most of the table first.
const ROUTES: &str = r#"
[server]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[store]
path = "marks.redb"
[fencing]
settle = "0s"

# Each tenant's host name is a site of its own (name-based virtual hosts), so the
# tenants' routes and `reports` may fence /reports/... apart.
[[upstream]]
name = "objects"
url = "http://127.0.0.1:9000"
distinct_hosts = true
[[upstream]]
name = "ledger"
url = "http://127.0.0.1:9001"

[[route]]
name = "health"
path = "/healthz"
upstream = "objects"
fenced = false

[[route]]
name = "static"
path = "/static/{*file}"
upstream = "objects"
fenced = false

[[route]]
name = "tenant-a"
host = "reports.tenant-a.example.com"
path = "/reports/{report}/{*object}"
scope = "tenant-a/report/{report}"
upstream = "objects"

[[route]]
name = "tenant-b"
host = "reports.tenant-b.example.com"
path = "/reports/{report}/{*object}"
scope = "tenant-b/report/{report}"
upstream = "objects"

[[route]]
name = "ledger"
path = "/ledger/{account}/entries"
scope = "ledger/{account}"
upstream = "ledger"
equal = "reject"

[[route]]
name = "jobs"
path = "/jobs/{job}/state"
scope = "job/{job}"
upstream = "objects"
methods = ["GET", "PUT", "POST", "PATCH", "DELETE"]

[[route]]
name = "buckets"
path = "/buckets/{bucket}/objects/{*key}"
scope = "bucket/{bucket}"
upstream = "objects"

[[route]]
name = "reports"
path = "/reports/{report}/{*object}"
scope = "report/{report}"
upstream = "objects"

[[route]]
name = "config"
path = "/config/{*key}"
scope = "config"
upstream = "objects"
"#;

fn config() -> Config {
    Config::parse(ROUTES, Path::new("/tmp"))
        .unwrap_or_else(|e| panic!("bench route table must parse: {e}"))
}

fn token(c: &mut Criterion) {
    let mut g = c.benchmark_group("token");
    g.warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    for (name, raw) in [
        ("counter", &b"1234567"[..]),
        ("epoch_counter", b"3:18446744073709551615"),
        ("malformed", b"01:2"),
    ] {
        g.bench_with_input(BenchmarkId::new("parse", name), raw, |b, raw| {
            b.iter(|| Token::parse(black_box(raw)))
        });
    }
    g.finish();
}

fn routing(c: &mut Criterion) {
    let config = config();
    let mut g = c.benchmark_group("route");
    g.warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    let plain = "/reports/2024-07/part-00017.csv";
    let encoded = "/r%65ports/2024%2D07/part%2D00017.csv";
    let deep = "/buckets/b-17/objects/a/b/c/d/e/f/g/h.bin";
    for (name, path) in [("plain", plain), ("encoded", encoded), ("deep", deep)] {
        g.bench_with_input(BenchmarkId::new("canonicalize", name), path, |b, p| {
            b.iter(|| route::canonicalize(black_box(p)))
        });
    }
    let segments = route::canonicalize(plain).expect("canonical path");
    g.bench_function("find/8th_route", |b| {
        b.iter(|| route::find(&config.routes, black_box(Some("127.0.0.1")), &segments).map(|m| m.0))
    });
    // Everything the proxy does before the gate: canonicalize, find, render the scope.
    for (name, path) in [("plain", plain), ("encoded", encoded)] {
        g.bench_with_input(BenchmarkId::new("pipeline", name), path, |b, p| {
            b.iter(|| {
                let segs = route::canonicalize(black_box(p)).expect("canonical");
                let (_, r, caps) =
                    route::find(&config.routes, Some("127.0.0.1"), &segs).expect("a route");
                r.scope.render(&caps)
            })
        });
    }
    g.finish();
}

fn policy(c: &mut Criterion) {
    let mut g = c.benchmark_group("policy");
    g.warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    let mark = Some(Token::new(2, 41));
    for (name, t) in [
        ("equal", Token::new(2, 41)),
        ("advance", Token::new(2, 42)),
        ("stale", Token::new(1, 99)),
    ] {
        g.bench_with_input(BenchmarkId::new("decide", name), &t, |b, t| {
            b.iter(|| decide(black_box(mark), black_box(*t), EqualPolicy::Accept, 0))
        });
    }
    g.finish();
}

fn gate(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let store = MarkStore::open(&dir.path().join("marks.redb")).expect("store");
    let gates = Arc::new(Gates::new(
        store,
        Arc::new(Metrics::new(vec!["reports".to_string()])),
        Duration::from_secs(5),
        Duration::ZERO,
    ));
    let t = Token::new(0, 7);
    let scopes: Vec<String> = (0..1000).map(|i| format!("report/s{i}")).collect();
    // Make every scope's mark `t` (one advance each, committed in groups), so the bench
    // is the equal path.
    rt.block_on(async {
        let tasks: Vec<_> = scopes
            .iter()
            .map(|s| {
                let (gates, s) = (gates.clone(), s.clone());
                tokio::spawn(async move { gates.admit(&s, t, EqualPolicy::Accept).await.is_ok() })
            })
            .collect();
        for task in tasks {
            assert!(task.await.expect("task"), "first advance");
        }
    });
    let mut g = c.benchmark_group("gate");
    g.warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    g.bench_function("admit_equal/one_scope", |b| {
        b.iter(|| {
            rt.block_on(async {
                let a = gates
                    .admit(black_box(&scopes[17]), t, EqualPolicy::Accept)
                    .await
                    .expect("admitted");
                let mut guard = a.guard;
                guard.complete();
            })
        })
    });
    let mut i = 0usize;
    g.bench_function("admit_equal/1000_scopes", |b| {
        b.iter(|| {
            i = (i + 389) % scopes.len();
            rt.block_on(async {
                let a = gates
                    .admit(black_box(&scopes[i]), t, EqualPolicy::Accept)
                    .await
                    .expect("admitted");
                let mut guard = a.guard;
                guard.complete();
            })
        })
    });
    g.bench_function("admit_stale/1000_scopes", |b| {
        b.iter(|| {
            i = (i + 389) % scopes.len();
            rt.block_on(async {
                gates
                    .admit(black_box(&scopes[i]), Token::new(0, 1), EqualPolicy::Accept)
                    .await
                    .expect_err("stale")
            })
        })
    });
    g.finish();
    rt.block_on(gates.store().close());
}

/// One group commit of N concurrent advances, on a store opened as fencegate opens it
/// (`MarkStore::open`: redb `ConcurrencyMode::ExclusiveWriter`, one fsync per commit).
fn marks(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let store = MarkStore::open(&dir.path().join("marks.redb")).expect("store");
    let scopes: Vec<Arc<str>> = (0..512)
        .map(|i| Arc::from(format!("report/s{i}")))
        .collect();
    let counter = AtomicU64::new(1);
    let mut g = c.benchmark_group("marks");
    // Each iteration is at least one fsync (~130 µs on the bench machine, often more):
    // few, short samples.
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    for n in [1usize, 64, 512] {
        g.throughput(Throughput::Elements(n as u64));
        let id = BenchmarkId::new("commit_batch", n);
        g.bench_with_input(id, &n, |b, &n| {
            b.iter(|| {
                // A fresh, higher token per iteration: every advance really writes.
                let t = Token::new(0, counter.fetch_add(1, Ordering::Relaxed));
                rt.block_on(async {
                    let tasks: Vec<_> = scopes[..n]
                        .iter()
                        .map(|s| {
                            let store = store.clone();
                            let s = s.clone();
                            tokio::spawn(async move { store.advance(s, t).await })
                        })
                        .collect();
                    for task in tasks {
                        task.await.expect("task").expect("advance");
                    }
                })
            })
        });
    }
    g.finish();
    rt.block_on(store.close());
}

/// `marked_beneath` over 100,000 marks in redb (`file/d{i % 1000}/f{i}`), the journal's
/// pending advances empty, then full.
fn beneath(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let store = MarkStore::open(&dir.path().join("marks.redb")).expect("store");
    let advance_all = |names: Vec<Arc<str>>| {
        rt.block_on(async {
            for chunk in names.chunks(512) {
                let tasks: Vec<_> = chunk
                    .iter()
                    .map(|s| {
                        let (store, s) = (store.clone(), s.clone());
                        tokio::spawn(async move { store.advance(s, Token::new(0, 1)).await })
                    })
                    .collect();
                for task in tasks {
                    task.await.expect("task").expect("advance");
                }
            }
        })
    };
    advance_all(
        (0..100_000)
            .map(|i| Arc::from(format!("file/d{}/f{i}", i % 1000)))
            .collect(),
    );
    rt.block_on(store.checkpoint()).expect("checkpoint");
    let mut g = c.benchmark_group("beneath");
    g.warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    let run = |g: &mut criterion::BenchmarkGroup<'_, _>, pending: &str| {
        g.bench_function(format!("marked_member/pending_{pending}"), |b| {
            b.iter(|| {
                store
                    .marked_beneath(black_box("file/d42/"), false, "")
                    .expect("read")
                    .expect("a member")
            })
        });
        g.bench_function(format!("no_member/pending_{pending}"), |b| {
            b.iter(|| {
                assert!(
                    store
                        .marked_beneath(black_box("file/e42/"), false, "")
                        .expect("read")
                        .is_none()
                )
            })
        });
    };
    run(&mut g, "empty");
    // Just under the checkpoint's threshold: every one stays pending.
    advance_all(
        (0..16_000)
            .map(|i| Arc::from(format!("other/p{i}")))
            .collect(),
    );
    run(&mut g, "full");
    g.finish();
    rt.block_on(store.close());
}

criterion_group!(benches, token, routing, policy, gate, marks, beneath);
criterion_main!(benches);
