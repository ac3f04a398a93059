//! The load bench: fencegate against nginx and PostgreSQL baselines, on loopback.
//!
//! ```text
//! bash benches/run.sh                  # installs what is missing, then the full run
//! cargo bench --bench load -- --smoke  # seconds-long run (CI: benches/smoke.sh)
//! cargo bench --bench load -- --duration 20 --out /tmp/results
//! ```
//!
//! Options: `--smoke` (≈1 s per measurement, W4 with 20,000 scopes, PostgreSQL only if
//! installed), `--duration SECS` (measured seconds per workload, default 10),
//! `--out DIR` (default `benches/results`), `--no-postgres`, `--tls-only` (only the TLS
//! rows of `load/tls.rs`, the table printed, no file written), `--workers N` (fencegate's
//! `server.workers` and nginx proxy_pass's worker processes, default 2), `--rounds N`
//! (rounds of the null-backend workloads and their baselines, default 5, smoke 1: each
//! round measures direct, bare hyper, nginx proxy_pass, W1, W1 with proofs, W3, the bare
//! 409 server, W2, W2 with proofs, W2S (one token, a new `Fencing-Sequence` per request)
//! and PostgreSQL in a row, and every ratio is the median of its per-round ratios).
//!
//! It starts everything itself on 127.0.0.1: nginx null (`return 204`), nginx WebDAV,
//! nginx proxy_pass (keepalive upstream, 2 workers) in front of each, fencegate (the
//! release binary, `workers = 2`, store in a temp dir on disk, `settle = "0s"`, a route
//! with `proof = "required"` and a key made for the run) and PostgreSQL. Every child is
//! stopped by a guard on exit, on panic and on Ctrl-C.
//!
//! `--callgrind-client …` turns this binary into the client of `benches/callgrind.sh`
//! (`load/callgrind.rs`).
//!
//! Writes `RESULTS.md` (machine, table, details) and `load.svg` to the output directory
//! and prints the table. Exits non-zero if any workload got an answer it should not
//! have (W1/W2/W2S, with or without proofs, anything but 2xx `accepted`, W3 anything but 409 `stale_fence`, a
//! baseline anything but 2xx, a request without response): correctness, never speed.

#[path = "load/bare.rs"]
mod bare;
#[path = "load/callgrind.rs"]
mod callgrind;
#[path = "load/client.rs"]
mod client;
// The test suite's nginx harness, of which this uses a part.
#[allow(dead_code)]
#[path = "../tests/it/support/nginx.rs"]
mod nginx;
#[path = "load/procs.rs"]
mod procs;
#[path = "load/report.rs"]
mod report;
#[path = "load/tls.rs"]
mod tls;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use client::{Expect, Outcome, Plan, Prover, Spec};
use nginx::Nginx;
use procs::{Fencegate, Postgres};
use report::{CpuUse, Kind, Row, Verdict};

type Error = Box<dyn std::error::Error + Send + Sync>;

// The allocator fencegate's binary uses (`src/main.rs`), so the floors this binary serves
// (`--serve-floor`) run on the same stack as fencegate.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

const CONNS: usize = 64;
const SCOPES: u32 = 1000;
const W4_SCOPES_FULL: u32 = 1_000_000;
const W4_SCOPES_SMOKE: u32 = 20_000;
const W4_SAMPLE: u32 = 10_000;
/// W3 raises every scope to this token, then sends token 1.
const W3_HIGH: u64 = 1_000_000;

#[derive(Debug)]
struct Args {
    smoke: bool,
    duration: Duration,
    warmup: Duration,
    out: PathBuf,
    postgres: bool,
    /// fencegate's `server.workers` and nginx proxy_pass's worker processes.
    workers: usize,
    /// Rounds of the null-backend workloads and their baselines.
    rounds: usize,
    /// Only the TLS rows (`load/tls.rs`), printed, no files written.
    tls_only: bool,
}

fn usage() -> &'static str {
    "usage: cargo bench --bench load -- [--smoke] [--duration SECS] [--out DIR] [--no-postgres] [--workers N] [--rounds N] [--tls-only]"
}

/// `cargo bench` passes `--bench`; `cargo test --all-targets` runs bench targets without
/// it, as a test. In that case this bench does nothing: a load run is minutes long, needs
/// nginx, and would measure a debug build.
fn invoked_by_cargo_test() -> bool {
    !std::env::args().skip(1).any(|a| a == "--bench")
}

fn parse_args() -> Result<Args, String> {
    let mut smoke = false;
    let mut duration = None;
    let mut out = None;
    let mut postgres = true;
    let mut workers = 2;
    let mut rounds = None;
    let mut tls_only = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--smoke" => smoke = true,
            "--duration" => {
                let v = args.next().ok_or("--duration needs a value")?;
                let secs: f64 = v.parse().map_err(|_| format!("bad --duration {v}"))?;
                if !(0.1..=3600.0).contains(&secs) {
                    return Err("--duration must be 0.1..=3600 seconds".into());
                }
                duration = Some(Duration::from_secs_f64(secs));
            }
            "--out" => out = Some(PathBuf::from(args.next().ok_or("--out needs a value")?)),
            "--no-postgres" => postgres = false,
            "--tls-only" => tls_only = true,
            "--workers" => {
                let v = args.next().ok_or("--workers needs a value")?;
                workers = v
                    .parse()
                    .ok()
                    .filter(|w| (1..=64).contains(w))
                    .ok_or_else(|| format!("bad --workers {v} (1..=64)"))?;
            }
            "--rounds" => {
                let v = args.next().ok_or("--rounds needs a value")?;
                rounds = Some(
                    v.parse()
                        .ok()
                        .filter(|r| (1..=20).contains(r))
                        .ok_or_else(|| format!("bad --rounds {v} (1..=20)"))?,
                );
            }
            // cargo bench passes --bench to harness = false targets.
            "--bench" => {}
            "-h" | "--help" => return Err(usage().into()),
            other => return Err(format!("unknown argument {other}\n{}", usage())),
        }
    }
    let duration = duration.unwrap_or(if smoke {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(10)
    });
    Ok(Args {
        smoke,
        duration,
        warmup: if smoke {
            Duration::from_millis(300)
        } else {
            Duration::from_secs(2)
        },
        out: out
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/results")),
        postgres,
        workers,
        rounds: rounds.unwrap_or(if smoke { 1 } else { 5 }),
        tls_only,
    })
}

/// `--serve-floor UPSTREAM|none --workers N`: runs one floor (`bare.rs`) until stopped or
/// until its stdin ends, after printing `listening ADDR` (see `procs::floor_process`).
fn serve_floor() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let upstream = match args.get(2).map(String::as_str) {
        Some("none") => None,
        Some(a) => match a.parse() {
            Ok(a) => Some(a),
            Err(e) => {
                eprintln!("--serve-floor {a}: {e}");
                return ExitCode::from(2);
            }
        },
        None => {
            eprintln!("--serve-floor needs an upstream address or none");
            return ExitCode::from(2);
        }
    };
    let workers = match (args.get(3).map(String::as_str), args.get(4)) {
        (Some("--workers"), Some(n)) => n.parse().ok().filter(|w| (1..=64).contains(w)),
        _ => None,
    };
    let Some(workers) = workers else {
        eprintln!("--serve-floor needs --workers N (1..=64)");
        return ExitCode::from(2);
    };
    match bare::start(upstream, workers) {
        Ok(floor) => {
            println!("listening {}", floor.addr);
            // The parent stops this process with a signal, and holds its stdin open: if
            // the parent dies without stopping it (SIGKILL), stdin ends and so does this.
            let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("floor: {e}");
            ExitCode::from(1)
        }
    }
}

fn main() -> ExitCode {
    if std::env::args().nth(1).as_deref() == Some("--serve-floor") {
        return serve_floor();
    }
    if std::env::args().nth(1).as_deref() == Some("--callgrind-client") {
        let args: Vec<String> = std::env::args().skip(2).collect();
        return callgrind::main(&args);
    }
    if invoked_by_cargo_test() {
        println!(
            "load bench: skipped under `cargo test` (run `cargo bench --bench load`, \
             benches/run.sh or benches/smoke.sh)"
        );
        return ExitCode::SUCCESS;
    }
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let started = Instant::now();
    // On SIGINT or SIGTERM the run future is dropped, and with it every guard it owns:
    // every child process is stopped before this process exits.
    let result = rt.block_on(async {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        let terminated = async {
            match term.as_mut() {
                Some(t) => {
                    t.recv().await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = run(&args) => r,
            _ = tokio::signal::ctrl_c() => Err("interrupted".into()),
            _ = terminated => Err("terminated".into()),
        }
    });
    rt.shutdown_timeout(Duration::from_secs(5));
    eprintln!(
        "==> load bench took {:.0} s",
        started.elapsed().as_secs_f64()
    );
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("FAILED: some workload got answers it should not have (see `errors`)");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("load bench failed: {e}");
            ExitCode::from(1)
        }
    }
}

fn step(msg: &str) {
    eprintln!("==> {msg}");
}

/// The fields every measured row shares.
fn measured(group: &'static str, name: &str, kind: Kind, o: &Outcome, cpu: CpuUse) -> Row {
    let mut r = Row::new(group, name, kind);
    r.cpu = Some(cpu);
    r.rps = Some(o.rps());
    r.p50_ms = o.quantile_ms(0.50);
    r.p99_ms = o.quantile_ms(0.99);
    r.errors = Some(o.errors());
    r.statuses = o.statuses_text();
    eprintln!(
        "    {name}: {:.0} req/s, p50 {:.2} ms, p99 {:.2} ms, errors {} [{}]",
        o.rps(),
        r.p50_ms.unwrap_or(0.0),
        r.p99_ms.unwrap_or(0.0),
        o.errors(),
        r.statuses
    );
    r
}

/// One workload's measurements, one per round.
#[derive(Default)]
struct Series(Vec<Row>);

/// What a per-round ratio is computed from.
struct Point {
    rps: f64,
    p99: f64,
    /// The proxy's CPU per request, µs.
    proxy_us: f64,
}

impl Series {
    fn push(&mut self, row: Row) {
        self.0.push(row);
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn point(row: &Row) -> Point {
        Point {
            rps: row.rps.unwrap_or(0.0),
            p99: row.p99_ms.unwrap_or(0.0),
            proxy_us: row
                .cpu
                .as_ref()
                .and_then(|c| c.proxy)
                .map_or(0.0, |(us, _)| us),
        }
    }

    /// `f(self, other)` for each round both measured.
    fn over(&self, other: &Series, f: impl Fn(Point, Point) -> f64) -> Vec<f64> {
        self.0
            .iter()
            .zip(&other.0)
            .map(|(a, b)| f(Series::point(a), Series::point(b)))
            .collect()
    }

    /// The round with the median rate; its errors are those of every round.
    fn median_row(&self) -> Row {
        let mut order: Vec<&Row> = self.0.iter().collect();
        order.sort_by(|a, b| Series::point(a).rps.total_cmp(&Series::point(b).rps));
        let Some(mid) = order.get(order.len() / 2) else {
            return Row::new("", "", Kind::Baseline);
        };
        let mut row = (*mid).clone();
        row.errors = Some(self.0.iter().map(|r| r.errors.unwrap_or(0)).sum());
        if self.0.len() > 1 {
            let rates: Vec<String> = self
                .0
                .iter()
                .map(|r| format!("{:.0}", Series::point(r).rps))
                .collect();
            row.statuses = format!(
                "{} (median of {} rounds: {} req/s)",
                row.statuses,
                self.0.len(),
                rates.join(", ")
            );
        }
        row
    }
}

/// The median (the mean of the middle two for an even count); 0 for none.
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The first three fields of /proc/loadavg.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn mb(kib: u64) -> f64 {
    kib as f64 * 1024.0 / 1e6
}

/// Distinct random indices out of `0..n` (a partial Fisher–Yates with a fixed seed).
fn sample(n: u32, k: u32) -> Vec<u32> {
    let mut all: Vec<u32> = (0..n).collect();
    let mut x: u64 = 0x5EED_F00D;
    let k = k.min(n) as usize;
    for i in 0..k {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let j = i + (x % (all.len() - i) as u64) as usize;
        all.swap(i, j);
    }
    all.truncate(k);
    all
}

/// The `_sum` and `_count` series of fencegate's /metrics (histograms without labels).
#[derive(Default)]
struct Scrape(std::collections::HashMap<String, f64>);

impl Scrape {
    async fn take(admin: SocketAddr) -> Scrape {
        let Ok((200, text)) = client::http_once(admin, "GET", "/metrics", "").await else {
            return Scrape::default();
        };
        Scrape(
            text.lines()
                .filter(|l| !l.starts_with('#') && !l.contains('{'))
                .filter_map(|l| {
                    let (k, v) = l.split_once(' ')?;
                    Some((k.to_string(), v.trim().parse().ok()?))
                })
                .collect(),
        )
    }

    fn get(&self, k: &str) -> f64 {
        self.0.get(k).copied().unwrap_or(0.0)
    }

    /// Adds what changed from `before` to `after` (sums a workload over its rounds).
    fn add(&mut self, after: &Scrape, before: &Scrape) {
        for (k, v) in &after.0 {
            *self.0.entry(k.clone()).or_insert(0.0) += v - before.get(k);
        }
    }

    /// What the store and the gates did between two scrapes, as one line.
    fn since(&self, before: &Scrape, what: &str) -> String {
        let d = |k: &str| self.get(k) - before.get(k);
        let mean = |name: &str| {
            let n = d(&format!("{name}_count"));
            (n > 0.0).then(|| d(&format!("{name}_sum")) / n)
        };
        let commits = d("fencegate_mark_commit_seconds_count");
        let mut out = format!("{what} (from fencegate's /metrics): {commits:.0} mark commits");
        if let Some(t) = mean("fencegate_mark_commit_seconds") {
            out.push_str(&format!(", {:.2} ms per commit", t * 1e3));
        }
        if let Some(b) = mean("fencegate_mark_commit_batch_size") {
            out.push_str(&format!(", {b:.1} advances per commit"));
        }
        if let Some(u) = mean("fencegate_upstream_seconds") {
            out.push_str(&format!(
                "; upstream {:.2} ms mean over {:.0} requests",
                u * 1e3,
                d("fencegate_upstream_seconds_count")
            ));
        }
        if let Some(w) = mean("fencegate_gate_wait_seconds") {
            out.push_str(&format!(
                "; gate wait {:.2} ms mean over {:.0} observations",
                w * 1e3,
                d("fencegate_gate_wait_seconds_count")
            ));
        }
        out
    }
}

struct Bench<'a> {
    args: &'a Args,
    rows: Vec<Row>,
    notes: Vec<String>,
    ok: bool,
}

/// The processes whose CPU time a measurement accounts for.
#[derive(Clone, Default)]
struct Watch {
    proxy: Vec<u32>,
    backend: Vec<u32>,
}

impl Watch {
    fn of(proxy: Option<u32>, backend: u32) -> Watch {
        Watch {
            proxy: proxy.map(procs::with_children).unwrap_or_default(),
            backend: procs::with_children(backend),
        }
    }
}

fn cpu_of(pids: &[u32]) -> f64 {
    pids.iter().filter_map(|p| procs::cpu_seconds(*p)).sum()
}

/// Runs `spec` and accounts the CPU the proxy, the backend and this process used.
async fn watched(spec: Spec, watch: &Watch) -> (Outcome, CpuUse) {
    let me = [std::process::id()];
    let switches = |pids: &[u32]| -> u64 {
        pids.iter()
            .filter_map(|p| procs::context_switches(*p))
            .sum()
    };
    let switches_before = switches(&watch.proxy);
    let before = [cpu_of(&watch.proxy), cpu_of(&watch.backend), cpu_of(&me)];
    let t0 = Instant::now();
    let o = client::run(spec).await;
    let wall = t0.elapsed().as_secs_f64();
    let after = [cpu_of(&watch.proxy), cpu_of(&watch.backend), cpu_of(&me)];
    let n = o.total.max(1) as f64;
    let part = |i: usize, pids: &[u32]| {
        (!pids.is_empty()).then(|| {
            let used = after[i] - before[i];
            (used * 1e6 / n, used / wall)
        })
    };
    let cpu = CpuUse {
        proxy: part(0, &watch.proxy),
        backend: part(1, &watch.backend),
        generator: part(2, &me),
        proxy_switches: (!watch.proxy.is_empty())
            .then(|| (switches(&watch.proxy) - switches_before) as f64 / n),
    };
    (o, cpu)
}

impl Bench<'_> {
    async fn load(
        &self,
        addr: SocketAddr,
        prefix: &str,
        plan: Plan,
        expect: Expect,
        watch: &Watch,
    ) -> (Outcome, CpuUse) {
        self.load_proved(addr, prefix, plan, expect, None, watch)
            .await
    }

    /// [`Bench::load`] with a `Fencing-Proof` on every request when `proof` is given.
    async fn load_proved(
        &self,
        addr: SocketAddr,
        prefix: &str,
        plan: Plan,
        expect: Expect,
        proof: Option<&Arc<Prover>>,
        watch: &Watch,
    ) -> (Outcome, CpuUse) {
        let spec = Spec {
            addr,
            prefix: prefix.into(),
            conns: CONNS,
            warmup: self.args.warmup,
            duration: self.args.duration,
            plan,
            expect,
            proof: proof.cloned(),
        };
        watched(spec, watch).await
    }

    /// Touches every scope once (the first advance), outside any measurement.
    async fn prime(&mut self, addr: SocketAddr, prefix: &str, scopes: u32, token: u64) {
        self.prime_with(addr, prefix, Plan::Sweep { scopes, token }, None)
            .await;
    }

    /// Touches every scope of `plan` (a sweep) once, outside any measurement; with a
    /// `Fencing-Proof` on every request when `proof` is given.
    async fn prime_with(
        &mut self,
        addr: SocketAddr,
        prefix: &str,
        plan: Plan,
        proof: Option<&Arc<Prover>>,
    ) {
        let o = client::run(Spec {
            addr,
            prefix: prefix.into(),
            conns: CONNS,
            warmup: Duration::ZERO,
            duration: Duration::from_secs(120),
            plan,
            expect: Expect::Accepted,
            proof: proof.cloned(),
        })
        .await;
        if o.errors() > 0 || !o.complete {
            self.ok = false;
            self.notes.push(format!(
                "priming {prefix}* failed: {} errors [{}], complete: {}",
                o.errors(),
                o.statuses_text(),
                o.complete
            ));
        }
    }

    fn push(&mut self, row: Row) {
        if row.errors.unwrap_or(0) > 0 {
            self.ok = false;
        }
        self.rows.push(row);
    }
}

const W2S_NAME: &str = "W2S sequenced (one token, a durable Fencing-Sequence per request)";

/// One round of W2S: fresh scopes, each taken with token 1 first (not measured), then
/// every request under that token with the scope's next `Fencing-Sequence`, so that each
/// is a durable record of its sequence (in the journal, like W2's advances), never an
/// advance of the token.
async fn measure_w2s(b: &mut Bench<'_>, proxy: SocketAddr, round: usize, watch: &Watch) -> Row {
    let prefix = format!("/reports/w2sr{round}-s");
    b.prime(proxy, &prefix, SCOPES, 1).await;
    let (o, cpu) = b
        .load(
            proxy,
            &prefix,
            Plan::Sequenced {
                scopes: SCOPES,
                token: 1,
            },
            Expect::Accepted,
            watch,
        )
        .await;
    measured(
        "null backend (nginx `return 204`)",
        W2S_NAME,
        Kind::Fencegate,
        &o,
        cpu,
    )
}

/// W2S's median row, judged against W2 of the same rounds, and its note.
fn w2s_row(w2s: &Series, w2: &Series) -> (Row, String) {
    let rps = w2s.over(w2, |a, b| a.rps / b.rps);
    let cpu = w2s.over(w2, |a, b| a.proxy_us / b.proxy_us);
    let each = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut row = w2s.median_row();
    row.target = "— (its cost against W2 is reported)".into();
    row.ratio = format!(
        "{:.2}× W2 req/s; {:.2}× W2's proxy CPU per request",
        median(&rps),
        median(&cpu)
    );
    let note = format!(
        "W2S: like W2, connection `c` owns the scopes `i ≡ c (mod 64)` of 1,000 fresh ones per \
         round and visits them in turn, but every scope was taken once with token 1 before the \
         run (not measured) and each request carries token 1 and the scope's next \
         `Fencing-Sequence` (1, 2, …): a durable record per request, of the sequence rather \
         than of a new mark. Per-round ratios W2S / W2: req/s {}, proxy CPU per request {}",
        each(&rps),
        each(&cpu)
    );
    (row, note)
}

async fn run(args: &Args) -> Result<bool, Error> {
    let mode = if args.smoke {
        format!(
            "smoke ({:.1} s per measurement after {:.1} s warm-up; W4 with {} scopes)",
            args.duration.as_secs_f64(),
            args.warmup.as_secs_f64(),
            W4_SCOPES_SMOKE
        )
    } else {
        format!(
            "full ({:.0} s per measurement after {:.0} s warm-up; {} rounds on the null backend)",
            args.duration.as_secs_f64(),
            args.warmup.as_secs_f64(),
            args.rounds
        )
    };
    step(&format!("load bench, {mode}"));
    let machine = procs::machine();
    for (k, v) in &machine {
        eprintln!("    {k}: {v}");
    }
    let load_before = loadavg();
    std::fs::create_dir_all(&args.out)?;
    // Stores go to the temp dir (on disk, not tmpfs: durability cost must be real).
    let scratch = tempfile::Builder::new()
        .prefix("fencegate-bench-")
        .tempdir()?;
    // The key of the `proof = "required"` route (`/proofed/…`, scope `proofed/…`).
    fencegate::proof::keygen(&scratch.path().join("proof-key"))?;
    let proof_pub = scratch.path().join("proof-key.pub");
    let key = Arc::new(fencegate::proof::SigningKey::load(
        &scratch.path().join("proof-key.key"),
    )?);
    // What a signature costs the load generator (W2 with proofs signs one per request).
    const SIGN_SAMPLE: u32 = 2000;
    let t0 = Instant::now();
    for i in 0..SIGN_SAMPLE {
        std::hint::black_box(key.prove(
            &format!("proofed/sample-s{i}"),
            fencegate::token::Token::new(0, u64::from(i) + 1),
        ));
    }
    let sign_us = t0.elapsed().as_secs_f64() * 1e6 / f64::from(SIGN_SAMPLE);

    if args.tls_only {
        return tls::only(args, scratch.path(), &proof_pub).await;
    }
    step("starting nginx (null, WebDAV, proxy_pass in front of each) and fencegate");
    let null = Nginx::null()?;
    let dav = Nginx::webdav()?;
    let pp_null = Nginx::proxy_pass(null.port(), args.workers)?;
    let pp_dav = Nginx::proxy_pass(dav.port(), args.workers)?;
    let mut fg = Fencegate::start(
        scratch.path(),
        null.port(),
        dav.port(),
        args.workers,
        &proof_pub,
    )
    .await?;
    let mut b = Bench {
        args,
        rows: Vec::new(),
        notes: Vec::new(),
        ok: true,
    };
    let all: Arc<Vec<u32>> = Arc::new((0..SCOPES).collect());
    let random = |token| Plan::Random {
        scopes: all.clone(),
        token,
    };
    let mut memory = Vec::new();
    let mut remember = |what: &str, fg: &Fencegate| {
        if let Some((rss, hwm)) = fg.memory_kib() {
            memory.push(format!(
                "{what}: RSS {:.1} MB (peak so far {:.1} MB)",
                mb(rss),
                mb(hwm)
            ));
        }
    };
    remember("fencegate after start-up", &fg);

    // ---- null backend: proxy overhead ------------------------------------------------
    // The machine's speed and the disk's fsync latency drift from minute to minute, so
    // every ratio pairs measurements taken next to each other: each round measures the
    // baselines, W1, W3, W2 and PostgreSQL in a row. A ratio is the median of its
    // per-round ratios; the table shows each workload's median round.
    const NULL: &str = "null backend (nginx `return 204`)";
    const PG: &str = "PostgreSQL (pgbench, synchronous_commit = on)";
    b.prime(fg.proxy, "/reports/w1-s", SCOPES, 1).await;
    // W1 with proofs: every scope's proof for token 1 signed before any run, so that the
    // load generator only copies a header (as for W1, its cost is not in the comparison).
    let t0 = Instant::now();
    let w1_proofs = Arc::new(Prover::new(key.clone(), "proofed/w1-s").precompute(&all, 1));
    let w1_table_ms = t0.elapsed().as_secs_f64() * 1e3;
    let sweep = Plan::Sweep {
        scopes: SCOPES,
        token: 1,
    };
    b.prime_with(fg.proxy, "/proofed/w1-s", sweep.clone(), Some(&w1_proofs))
        .await;
    let failed = client::raise_all(fg.admin, "w3-s", SCOPES, W3_HIGH, CONNS as u32).await;
    if failed > 0 {
        b.ok = false;
        b.notes.push(format!("W3: {failed} admin raises failed"));
    }
    let pg_unavailable = if !args.postgres {
        Some("skipped (--no-postgres)".to_string())
    } else {
        Postgres::unavailable()
    };
    let pg = match pg_unavailable {
        Some(why) => {
            if !args.smoke && args.postgres {
                eprintln!("WARNING: PostgreSQL baseline not run: {why}");
            }
            b.notes.push(format!("PostgreSQL baseline not run: {why}"));
            None
        }
        None => {
            step("PostgreSQL: initdb, pgbench warm-up");
            let pg = Postgres::start(SCOPES)?;
            if !args.smoke {
                pg.bench(CONNS as u32, 2, args.warmup.as_secs().max(1) as u32, false)?;
            }
            Some(pg)
        }
    };
    // The floor of fencegate's own HTTP stack, without fencegate, in a process of its own.
    let (floor, floor_addr) = procs::floor_process(Some(null.addr()), args.workers)?;
    // W3's floor: the same stack answering every request with W3's refusal.
    let (refuser, refuser_addr) = procs::floor_process(None, args.workers)?;
    let refuser_name = format!(
        "bare hyper server answering 409 ({} workers; W3's floor, no fencing)",
        args.workers
    );
    let floor_name = format!(
        "bare hyper proxy ({} workers; fencegate's HTTP stack, no fencing)",
        args.workers
    );
    let pp_name = format!("nginx proxy_pass ({} workers, keepalive)", args.workers);
    const W1_NAME: &str = "W1 steady owners (equal token)";
    const W1P_NAME: &str = "W1 with proofs required (equal token, the same proof)";
    const W2_NAME: &str = "W2 churn (durable advance per request)";
    const W2P_NAME: &str = "W2 with proofs required (a new token and proof per request)";
    const W3_NAME: &str = "W3 stale storm (all 409)";
    const PG_NAME: &str = "UPDATE … WHERE accepted_fence <= :fence";
    let [
        mut direct,
        mut floor_s,
        mut pp,
        mut w1,
        mut w1p,
        mut w3,
        mut refuser_s,
        mut w2,
        mut w2p,
        mut pg_s,
    ] = std::array::from_fn(|_| Series::default());
    let mut w2s = Series::default();
    let mut w2p_signed = 0;
    let (mut w1_metrics, mut w2_metrics) = (Scrape::default(), Scrape::default());
    let secs = args.duration.as_secs().max(1) as u32;
    for round in 1..=args.rounds {
        step(&format!(
            "null backend, round {round} of {}: direct, bare hyper, nginx proxy_pass, \
             fencegate W1, W1 with proofs, W3, bare 409 server, fencegate W2, W2 with proofs, \
             W2S, PostgreSQL",
            args.rounds
        ));
        let null_only = Watch::of(None, null.pid());
        let (o, cpu) = b
            .load(
                null.addr(),
                "/reports/base-s",
                random(1),
                Expect::Success,
                &null_only,
            )
            .await;
        direct.push(measured(NULL, "direct to backend", Kind::Baseline, &o, cpu));
        let (o, cpu) = b
            .load(
                floor_addr,
                "/reports/base-s",
                random(1),
                Expect::Success,
                &Watch::of(Some(floor.pid()), null.pid()),
            )
            .await;
        floor_s.push(measured(NULL, &floor_name, Kind::Baseline, &o, cpu));
        let (o, cpu) = b
            .load(
                pp_null.addr(),
                "/reports/base-s",
                random(1),
                Expect::Success,
                &Watch::of(Some(pp_null.pid()), null.pid()),
            )
            .await;
        pp.push(measured(NULL, &pp_name, Kind::Baseline, &o, cpu));

        let fenced = Watch::of(fg.pid(), null.pid());
        // Gates idle for 30 s are swept, and a round takes longer: every W1 scope is
        // touched once more (not measured) so that W1 and W1 with proofs both measure
        // the steady path, with the gate hot and (with proofs) its proof verified.
        b.prime_with(fg.proxy, "/reports/w1-s", sweep.clone(), None)
            .await;
        let before = Scrape::take(fg.admin).await;
        let (o, cpu) = b
            .load(
                fg.proxy,
                "/reports/w1-s",
                random(1),
                Expect::Accepted,
                &fenced,
            )
            .await;
        w1_metrics.add(&Scrape::take(fg.admin).await, &before);
        w1.push(measured(NULL, W1_NAME, Kind::Fencegate, &o, cpu));
        b.prime_with(fg.proxy, "/proofed/w1-s", sweep.clone(), Some(&w1_proofs))
            .await;
        let (o, cpu) = b
            .load_proved(
                fg.proxy,
                "/proofed/w1-s",
                random(1),
                Expect::Accepted,
                Some(&w1_proofs),
                &fenced,
            )
            .await;
        w1p.push(measured(NULL, W1P_NAME, Kind::Fencegate, &o, cpu));
        let (o, cpu) = b
            .load(fg.proxy, "/reports/w3-s", random(1), Expect::Stale, &fenced)
            .await;
        w3.push(measured(NULL, W3_NAME, Kind::Fencegate, &o, cpu));
        let (o, cpu) = b
            .load(
                refuser_addr,
                "/reports/w3-s",
                random(1),
                Expect::Stale,
                &Watch::of(Some(refuser.pid()), null.pid()),
            )
            .await;
        refuser_s.push(measured(NULL, &refuser_name, Kind::Baseline, &o, cpu));

        // Fresh scopes each round, so every request of every round is an advance.
        let before = Scrape::take(fg.admin).await;
        let (o, cpu) = b
            .load(
                fg.proxy,
                &format!("/reports/w2r{round}-s"),
                Plan::Churn {
                    scopes: SCOPES,
                    start: 0,
                },
                Expect::Accepted,
                &fenced,
            )
            .await;
        w2_metrics.add(&Scrape::take(fg.admin).await, &before);
        w2.push(measured(NULL, W2_NAME, Kind::Fencegate, &o, cpu));
        // The same on the proofed route, on fresh scopes too: every request carries a
        // new token, so the proxy verifies a signature per request, and the load
        // generator signs each proof as it sends it.
        let w2_proofs = Arc::new(Prover::new(key.clone(), format!("proofed/w2r{round}-s")));
        let (o, cpu) = b
            .load_proved(
                fg.proxy,
                &format!("/proofed/w2r{round}-s"),
                Plan::Churn {
                    scopes: SCOPES,
                    start: 0,
                },
                Expect::Accepted,
                Some(&w2_proofs),
                &fenced,
            )
            .await;
        w2p_signed += w2_proofs.signed();
        w2p.push(measured(NULL, W2P_NAME, Kind::Fencegate, &o, cpu));
        w2s.push(measure_w2s(&mut b, fg.proxy, round, &fenced).await);
        if let Some(pg) = &pg {
            let res = pg.bench(CONNS as u32, 2, secs, true)?;
            let mut r = Row::new(PG, PG_NAME, Kind::Postgres);
            r.rps = Some(res.tps);
            let q = |q: f64| {
                (!res.latencies.is_empty()).then(|| {
                    let n = res.latencies.len();
                    let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
                    res.latencies[rank - 1] as f64 / 1e6
                })
            };
            r.p50_ms = q(0.5);
            r.p99_ms = q(0.99);
            r.errors = Some(res.failed);
            r.statuses = format!(
                "{} transactions, {} failed; {}",
                res.transactions, res.failed, res.version
            );
            eprintln!(
                "    PostgreSQL: {:.0} tps, p50 {:.2} ms, p99 {:.2} ms [{}]",
                res.tps,
                r.p50_ms.unwrap_or(0.0),
                r.p99_ms.unwrap_or(0.0),
                r.statuses
            );
            pg_s.push(r);
        }
    }
    drop(floor);
    b.notes
        .push(w1_metrics.since(&Scrape::default(), "W1 (null)"));
    b.notes
        .push(w2_metrics.since(&Scrape::default(), "W2 (null)"));
    let mut pg_row = None;
    if let Some(pg) = &pg {
        // Every round's UPDATEs must have moved marks: a fence that never advanced would
        // measure a different statement.
        let (advanced, highest) = pg.advanced()?;
        let mut r = pg_s.median_row();
        r.errors = Some(r.errors.unwrap_or(0) + u64::from(advanced == 0));
        r.statuses = format!(
            "{}; {advanced} scopes advanced, highest fence {highest}",
            r.statuses
        );
        pg_row = Some(r);
    }

    let rounds = |v: Vec<f64>, unit: &str| -> (f64, String) {
        let m = median(&v);
        let each: Vec<String> = v.iter().map(|x| format!("{x:.2}{unit}")).collect();
        (m, each.join(" "))
    };
    let (floor_ratio, floor_each) = rounds(floor_s.over(&pp, |a, b| a.rps / b.rps), "");
    let (w1_ratio, w1_each) = rounds(w1.over(&pp, |a, b| a.rps / b.rps), "");
    let (w1_p99, w1_p99_each) = rounds(w1.over(&pp, |a, b| a.p99 - b.p99), " ms");
    let (w1_floor, _) = rounds(w1.over(&floor_s, |a, b| a.rps / b.rps), "");
    let (w3_ratio, w3_each) = rounds(w3.over(&pp, |a, b| a.rps / b.rps), "");
    let (refuser_ratio, refuser_each) = rounds(refuser_s.over(&pp, |a, b| a.rps / b.rps), "");
    let (w3_refuser, _) = rounds(w3.over(&refuser_s, |a, b| a.rps / b.rps), "");
    let (w2_own, w2_own_each) = rounds(w2.over(&w1, |a, b| a.rps / b.rps), "");
    let (w2_pg, w2_pg_each) = rounds(w2.over(&pg_s, |a, b| a.rps / b.rps), "");
    let (w1p_cpu, _) = rounds(w1p.over(&w1, |a, b| a.proxy_us / b.proxy_us), "");
    let (w1p_rps, w1p_rps_each) = rounds(w1p.over(&w1, |a, b| a.rps / b.rps), "");
    let (w2p_cpu, _) = rounds(w2p.over(&w2, |a, b| a.proxy_us / b.proxy_us), "");
    let (w2p_rps, w2p_rps_each) = rounds(w2p.over(&w2, |a, b| a.rps / b.rps), "");
    let ratio3 = |v: f64| format!("{v:.3}");
    let each3 = |a: &Series, b: &Series| -> String {
        a.over(b, |a, b| a.proxy_us / b.proxy_us)
            .into_iter()
            .map(ratio3)
            .collect::<Vec<_>>()
            .join(" ")
    };
    if args.rounds > 1 {
        b.notes.push(format!(
            "Per-round ratios, rounds 1 to {} (the table shows their medians): \
             bare hyper / nginx {floor_each}; W1 / nginx {w1_each}; \
             W1 p99 − nginx p99 {w1_p99_each}; W3 / nginx {w3_each}; bare 409 server / nginx {refuser_each}; \
             W2 / own W1 {w2_own_each}; W2 / PostgreSQL {}; \
             W1 with proofs / W1: proxy CPU per request {}, req/s {w1p_rps_each}; \
             W2 with proofs / W2: proxy CPU per request {}, req/s {w2p_rps_each}",
            args.rounds,
            if pg_s.is_empty() {
                "not run".into()
            } else {
                w2_pg_each.clone()
            },
            each3(&w1p, &w1),
            each3(&w2p, &w2),
        ));
    }

    b.push(direct.median_row());
    b.push(pp.median_row());
    let mut floor_row = floor_s.median_row();
    floor_row.ratio = format!("{floor_ratio:.2}× nginx");
    b.push(floor_row);
    let mut w1_row = w1.median_row();
    let w1_rps = w1_row.rps.unwrap_or(0.0);
    w1_row.target = "≥ 1.0× nginx proxy_pass req/s; p99 ≤ nginx + 1 ms".into();
    w1_row.ratio = format!("{w1_ratio:.2}× nginx; p99 {w1_p99:+.2} ms; {w1_floor:.2}× bare hyper");
    w1_row.verdict = Verdict::from(w1_ratio >= 1.0 && w1_p99 <= 1.0);
    b.push(w1_row);
    let mut w1p_row = w1p.median_row();
    w1p_row.target = "≤ 1.03× W1's proxy CPU per request".into();
    w1p_row.ratio = format!(
        "{}× W1's proxy CPU per request; {w1p_rps:.2}× W1 req/s",
        ratio3(w1p_cpu)
    );
    w1p_row.verdict = Verdict::from(w1p_cpu <= 1.03);
    b.push(w1p_row);
    let mut w2_row = w2.median_row();
    w2_row.target = "≥ 0.7× own W1; ≥ 1.5× PostgreSQL".into();
    if pg_s.is_empty() {
        w2_row.ratio = format!("{w2_own:.2}× own W1; PostgreSQL not run");
        w2_row.verdict = if w2_own >= 0.7 {
            Verdict::NotJudged
        } else {
            Verdict::Fail
        };
    } else {
        w2_row.ratio = format!("{w2_own:.2}× own W1; {w2_pg:.2}× PostgreSQL");
        w2_row.verdict = Verdict::from(w2_own >= 0.7 && w2_pg >= 1.5);
    }
    b.push(w2_row);
    let mut w2p_row = w2p.median_row();
    w2p_row.target = "— (its cost is reported)".into();
    w2p_row.ratio = format!(
        "{}× W2's proxy CPU per request; {w2p_rps:.2}× W2 req/s",
        ratio3(w2p_cpu)
    );
    b.push(w2p_row);
    let (row, note) = w2s_row(&w2s, &w2);
    b.push(row);
    b.notes.push(note);
    b.notes.push(format!(
        "Token proofs: the route `/proofed/{{report}}/{{*rest}}` (scope `proofed/{{report}}`, the null \
         backend) has `proof = \"required\"` and `[fencing] proof_keys` holds a key made with \
         `fencegate::proof::keygen` for this run. W1 with proofs sends proofs signed before any run \
         (1,000 scopes, token 1: {w1_table_ms:.0} ms), so the load generator only copies a 147-byte \
         header. W2 with proofs signs every request's proof on the fly in the load generator (ring \
         Ed25519, {sign_us:.1} µs per signature, timed over {SIGN_SAMPLE} in this process; {w2p_signed} \
         signed over all rounds): its load generator CPU per request is higher than W2's by about that, \
         on the cores the proxy uses, so its req/s ratio understates; the comparison is of proxy CPU per \
         request. Before W1 and before W1 with proofs every W1 scope is touched once, not measured, so \
         both measure hot gates (gates idle 30 s are swept between rounds). Ratios: median of the \
         per-round ratios; W1 with proofs / W1 proxy CPU per request {}, W2 with proofs / W2 {}",
        ratio3(w1p_cpu),
        ratio3(w2p_cpu)
    ));
    let mut w3_row = w3.median_row();
    w3_row.target = "≥ 1.5× nginx proxy_pass req/s".into();
    w3_row.ratio = format!("{w3_ratio:.2}× nginx; {w3_refuser:.2}× bare 409 server");
    w3_row.verdict = Verdict::from(w3_ratio >= 1.5);
    b.push(w3_row);
    let mut refuser_row = refuser_s.median_row();
    refuser_row.ratio = format!("{refuser_ratio:.2}× nginx");
    b.push(refuser_row);
    remember("fencegate after W1, W2, W3", &fg);

    // ---- TLS: handshakes, keep-alive, HTTP/2 (load/tls.rs) ------------------------------
    tls::run(&mut b, scratch.path(), &null, &proof_pub).await?;

    // ---- WebDAV backend: a real store ------------------------------------------------
    const DAV: &str = "WebDAV backend (nginx dav_methods PUT)";
    step("WebDAV backend: direct, nginx proxy_pass, fencegate W1 W2");
    let (o, cpu) = b
        .load(
            dav.addr(),
            "/dav/reports/base-s",
            random(1),
            Expect::Success,
            &Watch::of(None, dav.pid()),
        )
        .await;
    b.push(measured(DAV, "direct to backend", Kind::Baseline, &o, cpu));
    let (o, cpu) = b
        .load(
            pp_dav.addr(),
            "/dav/reports/base-s",
            random(1),
            Expect::Success,
            &Watch::of(Some(pp_dav.pid()), dav.pid()),
        )
        .await;
    let pp_dav_rps = o.rps();
    let pp_dav_row = measured(
        DAV,
        &format!("nginx proxy_pass ({} workers, keepalive)", args.workers),
        Kind::Baseline,
        &o,
        cpu,
    );
    let pp_dav_p99 = pp_dav_row.p99_ms.unwrap_or(0.0);
    b.push(pp_dav_row);
    b.prime(fg.proxy, "/dav/reports/w1-s", SCOPES, 1).await;
    let (o, cpu) = b
        .load(
            fg.proxy,
            "/dav/reports/w1-s",
            random(1),
            Expect::Accepted,
            &Watch::of(fg.pid(), dav.pid()),
        )
        .await;
    let mut r = measured(
        DAV,
        "W1 steady owners (equal token)",
        Kind::Fencegate,
        &o,
        cpu,
    );
    let dav_w1_rps = o.rps();
    r.ratio = format!(
        "{:.2}× nginx; p99 {:+.2} ms",
        o.rps() / pp_dav_rps,
        r.p99_ms.unwrap_or(0.0) - pp_dav_p99
    );
    b.push(r);
    let before = Scrape::take(fg.admin).await;
    let (o, cpu) = b
        .load(
            fg.proxy,
            "/dav/reports/w2-s",
            Plan::Churn {
                scopes: SCOPES,
                start: 0,
            },
            Expect::Accepted,
            &Watch::of(fg.pid(), dav.pid()),
        )
        .await;
    let mut r = measured(
        DAV,
        "W2 churn (durable advance per request)",
        Kind::Fencegate,
        &o,
        cpu,
    );
    r.ratio = format!("{:.2}× own W1", o.rps() / dav_w1_rps);
    let note = Scrape::take(fg.admin).await.since(&before, "W2 (WebDAV)");
    b.notes.push(note);
    b.push(r);

    if let Some(row) = pg_row {
        b.push(row);
    }

    // ---- W4: many scopes ---------------------------------------------------------------
    const W4: &str = "W4 many scopes (null backend)";
    let n = if args.smoke {
        W4_SCOPES_SMOKE
    } else {
        W4_SCOPES_FULL
    };
    // W1 as it was before the fill (for its rate; the p99 comparison is made below, on the
    // same 10,000 scopes with and without the fill's marks on disk).
    step("W4: W1 over the 1,000 W1 scopes before the fill (the reference)");
    let (o, cpu) = b
        .load(
            fg.proxy,
            "/reports/w1-s",
            random(1),
            Expect::Accepted,
            &Watch::of(fg.pid(), null.pid()),
        )
        .await;
    let mut r = measured(
        W4,
        "W1 over the 1,000 W1 scopes before the fill",
        Kind::Fencegate,
        &o,
        cpu,
    );
    let (ref_rps, ref_p99) = (o.rps(), r.p99_ms.unwrap_or(0.0));
    r.ratio = format!("{:.2}× W1 req/s", ref_rps / w1_rps);
    b.push(r);
    step(&format!("W4: touching {n} scopes once each"));
    let before = Scrape::take(fg.admin).await;
    let fill_bound = if args.smoke {
        Duration::from_secs(120)
    } else {
        Duration::from_secs(1800)
    };
    let (o, cpu) = watched(
        Spec {
            addr: fg.proxy,
            prefix: "/reports/w4-s".into(),
            conns: CONNS,
            warmup: Duration::ZERO,
            duration: fill_bound,
            plan: Plan::Sweep {
                scopes: n,
                token: 1,
            },
            expect: Expect::Accepted,
            proof: None,
        },
        &Watch::of(fg.pid(), null.pid()),
    )
    .await;
    let note = Scrape::take(fg.admin).await.since(&before, "W4 fill");
    b.notes.push(note);
    let mut r = measured(
        W4,
        &format!("fill: {n} first touches (an advance each)"),
        Kind::Fencegate,
        &o,
        cpu,
    );
    r.ratio = format!(
        "{} scopes in {:.1} s{}",
        o.total,
        o.window.as_secs_f64(),
        if o.complete {
            ""
        } else {
            " (INCOMPLETE: bound hit)"
        }
    );
    if !o.complete {
        b.notes.push(format!(
            "W4 fill stopped at its time bound after {} scopes",
            o.total
        ));
    }
    b.push(r);

    let marks_label = if n >= 1_000_000 {
        format!("{}M marks", n / 1_000_000)
    } else {
        format!("{}k marks", n / 1000)
    };
    let rss_target = "≤ 200 MB";
    if let Some((rss, hwm)) = fg.memory_kib() {
        let mut r = Row::new(
            W4,
            format!("RSS right after the fill ({marks_label}, all gates hot)"),
            Kind::Fencegate,
        );
        r.target = rss_target.into();
        r.ratio = format!(
            "RSS {:.1} MB (peak {:.1} MB); {:.0} hot gates",
            mb(rss),
            mb(hwm),
            Scrape::take(fg.admin).await.get("fencegate_hot_scopes")
        );
        r.verdict = Verdict::from(mb(hwm.max(rss)) <= 200.0);
        b.push(r);
    }
    remember("fencegate after the W4 fill", &fg);
    b.notes.push(format!(
        "W4: the mark store file holds {marks_label} (and the other workloads' marks) in {:.1} MB",
        fg.store_bytes() as f64 / 1e6
    ));
    if !args.smoke {
        // Idle gates are swept after 30 s (checked every 10 s): what is left then?
        step("W4: waiting 45 s for idle gates to be swept");
        tokio::time::sleep(Duration::from_secs(45)).await;
        if let Some((rss, _)) = fg.memory_kib() {
            let mut r = Row::new(
                W4,
                format!("RSS 45 s later ({marks_label}, idle gates swept)"),
                Kind::Fencegate,
            );
            r.target = rss_target.into();
            r.ratio = format!(
                "RSS {:.1} MB; {:.0} hot gates",
                mb(rss),
                Scrape::take(fg.admin).await.get("fencegate_hot_scopes")
            );
            r.verdict = Verdict::from(mb(rss) <= 200.0);
            b.push(r);
        }
        remember("fencegate 45 s after the fill", &fg);
    }

    step("W4: clean restart (SIGTERM, start, poll /readyz)");
    let t0 = Instant::now();
    let stop = fg.stop();
    let start = fg.respawn().await?;
    let total = t0.elapsed();
    let mut r = Row::new(
        W4,
        format!("restart to ready, clean ({marks_label})"),
        Kind::Fencegate,
    );
    r.target = "≤ 2 s".into();
    r.ratio = format!(
        "{:.3} s (stop {:.3} s + start {:.3} s)",
        total.as_secs_f64(),
        stop.as_secs_f64(),
        start.as_secs_f64()
    );
    r.verdict = Verdict::from(total <= Duration::from_secs(2));
    b.push(r);
    remember("fencegate after a clean restart", &fg);

    // "W1 p99 independent of how many marks are on disk": the same W1 (a random 10,000 of
    // the filled scopes, token 1) through this fencegate and through a second one whose
    // store holds only those 10,000 marks, both just restarted, in alternating rounds (one
    // W1 a minute before or after another can differ by more than the fill does here).
    let subset = Arc::new(sample(n, W4_SAMPLE));
    step(&format!(
        "W4: a second fencegate whose store holds only {W4_SAMPLE} of the {n} scopes"
    ));
    let few_dir = scratch.path().join("w4-few-marks");
    std::fs::create_dir_all(&few_dir)?;
    let mut few =
        Fencegate::start(&few_dir, null.port(), dav.port(), args.workers, &proof_pub).await?;
    b.prime_with(
        few.proxy,
        "/reports/w4-s",
        Plan::Each {
            scopes: subset.clone(),
            token: 1,
        },
        None,
    )
    .await;
    few.stop();
    few.respawn().await?;
    let few_label = format!("{}k marks", W4_SAMPLE / 1000);
    let w4_rounds = args.rounds.min(3);
    let (mut few_s, mut many_s) = (Series::default(), Series::default());
    for round in 1..=w4_rounds {
        let mut sides = [
            (&few, few.proxy, &few_label, &mut few_s),
            (&fg, fg.proxy, &marks_label, &mut many_s),
        ];
        // Each side goes first in turn, so neither always gets the same place in a round.
        if round % 2 == 0 {
            sides.reverse();
        }
        for (who, proxy, label, series) in sides {
            step(&format!(
                "W4 round {round}/{w4_rounds}: W1 over {W4_SAMPLE} random scopes, {label} on disk"
            ));
            let (o, cpu) = b
                .load(
                    proxy,
                    "/reports/w4-s",
                    Plan::Random {
                        scopes: subset.clone(),
                        token: 1,
                    },
                    Expect::Accepted,
                    &Watch::of(who.pid(), null.pid()),
                )
                .await;
            series.push(measured(
                W4,
                &format!("W1 over {W4_SAMPLE} random scopes after restart ({label} on disk)"),
                Kind::Fencegate,
                &o,
                cpu,
            ));
        }
    }
    few.stop();
    let (p99_diff, p99_each) = rounds(many_s.over(&few_s, |a, b| a.p99 - b.p99), " ms");
    let (rps_ratio, _) = rounds(many_s.over(&few_s, |a, b| a.rps / b.rps), "");
    b.push(few_s.median_row());
    let mut r = many_s.median_row();
    r.target = format!("p99 ≤ the same W1 with {few_label} on disk + 1 ms");
    r.ratio = format!(
        "p99 {p99_diff:+.2} ms vs {few_label} on disk{}; {rps_ratio:.2}× its req/s",
        if w4_rounds > 1 {
            format!(
                " (median of the per-round differences {p99_each}; each row shows its median-rate round)"
            )
        } else {
            String::new()
        }
    );
    b.notes.push(format!(
        "W4: p99 of W1 over the {W4_SAMPLE} scopes with {marks_label} on disk (its median-rate round) against W1 over the 1,000 W1 scopes before the fill: {:+.2} ms",
        r.p99_ms.unwrap_or(0.0) - ref_p99
    ));
    r.verdict = Verdict::from(p99_diff <= 1.0);
    b.push(r);
    if let Some((rss, hwm)) = fg.memory_kib() {
        let mut r = Row::new(
            W4,
            format!("RSS after restart + W1 on {W4_SAMPLE} ({marks_label} on disk)"),
            Kind::Fencegate,
        );
        r.target = rss_target.into();
        r.ratio = format!(
            "RSS {:.1} MB (peak {:.1} MB); {:.0} hot gates",
            mb(rss),
            mb(hwm),
            Scrape::take(fg.admin).await.get("fencegate_hot_scopes")
        );
        r.verdict = Verdict::from(mb(hwm.max(rss)) <= 200.0);
        b.push(r);
    }

    step("W4: crash restart (SIGKILL, start, poll /readyz), then check the marks held");
    fg.crash();
    let t0 = Instant::now();
    let start = fg.respawn().await?;
    let mut r = Row::new(
        W4,
        format!("restart to ready after SIGKILL ({marks_label})"),
        Kind::Fencegate,
    );
    r.target = "≤ 2 s".into();
    r.ratio = format!("{:.3} s", t0.elapsed().as_secs_f64());
    r.verdict = Verdict::from(start <= Duration::from_secs(2));
    b.push(r);
    // Every sampled scope holds mark 1, so token 0 must be stale everywhere.
    let o = client::run(Spec {
        addr: fg.proxy,
        prefix: "/reports/w4-s".into(),
        conns: CONNS,
        warmup: Duration::ZERO,
        duration: Duration::from_millis(500),
        plan: Plan::Random {
            scopes: subset,
            token: 0,
        },
        expect: Expect::Stale,
        proof: None,
    })
    .await;
    if o.errors() > 0 || o.total == 0 {
        b.ok = false;
        b.notes.push(format!(
            "after the crash restart, token 0 was not refused everywhere: [{}]",
            o.statuses_text()
        ));
    } else {
        b.notes.push(format!(
            "after the crash restart, all {} requests with token 0 on marked scopes got 409 stale_fence (marks held)",
            o.total
        ));
    }
    remember("fencegate after a crash restart", &fg);
    fg.stop();
    if !b.ok {
        eprintln!("fencegate's log (last lines):\n{}", fg.log_tail());
    }

    // ---- report ------------------------------------------------------------------------
    let table = report::table(&b.rows);
    let commit = machine
        .iter()
        .find(|(k, _)| k == "fencegate commit")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    let cpus = machine
        .iter()
        .find(|(k, _)| k == "CPUs (nproc)")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    let svg = report::svg(
        &b.rows,
        "fencegate load bench",
        &format!(
            "{CONNS} connections, {SCOPES} scopes, loopback; {cpus} CPUs shared by load generator, proxy and backend\n\
             fencegate {}; {mode}",
            commit.replace(" + uncommitted changes to", " + local changes to")
        ),
    );
    std::fs::write(args.out.join("load.svg"), svg)?;
    let date = std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let mut md = String::new();
    md.push_str("# fencegate load bench results\n\n");
    md.push_str(&format!(
        "Generated {date} by `bash benches/run.sh` (`cargo bench --bench load`), mode: {mode}.\n\n"
    ));
    md.push_str("## Machine\n\n| | |\n| --- | --- |\n");
    for (k, v) in &machine {
        md.push_str(&format!("| {k} | {v} |\n"));
    }
    md.push_str(&format!(
        "| fencegate | `workers = {}` (proxy threads), separate process |\n| load generator | in the bench process, tokio, 2 worker threads |\n\n",
        args.workers
    ));
    md.push_str(&format!(
        "Load average (1, 5, 15 min) at the start: {load_before}; at the end: {}. Anything above \
         what this bench runs itself (about 1.5 on 2 CPUs) is other work on the machine.\n\n",
        loadavg()
    ));
    md.push_str("## Results\n\n");
    md.push_str(&table);
    md.push_str("\n![throughput and p99 per workload and baseline](load.svg)\n\n");
    md.push_str(
        "### Where the CPU went\n\nCPU time (user + system, all threads, warm-up included) of each process \
         during each measurement, per request, and in cores busy on average. The proxy and the backend include \
         nginx's workers; the load generator is this bench process.\n\n",
    );
    md.push_str(&report::cpu_table(&b.rows));
    md.push('\n');
    md.push_str("## How it was measured\n\n");
    md.push_str(&format!(
        "- Load: {CONNS} HTTP/1.1 keep-alive connections (one `hyper::client::conn::http1::handshake` each), \
         a closed loop per connection: `PUT /reports/s{{i}}/obj` with `Fencing-Token` and a {}-byte body; \
         latency per request from send to the last body byte, percentiles by nearest rank over every measured request. \
         Requests in the warm-up are checked but not measured.\n\
         - Rounds: the null-backend workloads and their baselines run in {} round(s), each measuring direct, bare hyper, \
         nginx proxy_pass, W1, W1 with proofs, W3, the bare 409 server, W2, W2 with proofs and PostgreSQL in a row; a ratio is the median of its per-round ratios and a \
         row shows its workload's median round (errors: every round's). WebDAV and W4 run once, but for W4's W1 after the fill (up to 3 alternating rounds, see W4 below).\n",
        client::BODY.len(),
        args.rounds
    ));
    md.push_str(
        "- fencegate: the release binary, `settle = \"0s\"`, its store in a temp dir on disk (ext4; \
         every advance is on disk before it is forwarded: a batch of advances is one record appended to the \
         store's journal and one `fdatasync`, applied to redb in checkpoints). \
         Routes `/reports/{report}/{*rest}` → null backend (scope `report/{report}`) and \
         `/dav/reports/{report}/{*rest}` → WebDAV (scope `dav/{report}`), and \
         `/proofed/{report}/{*rest}` → null backend (scope `proofed/{report}`) with `proof = \"required\"` and \
         `[fencing] proof_keys` holding the `.pub` of a key made with `fencegate::proof::keygen` in the run's temp dir.\n\
         - W1: every scope's mark is set once before the run (not measured), then each request picks a random scope of \
         1,000 and sends the same token (the equal-token path). W2: connection `c` owns the scopes `i ≡ c (mod 64)` and \
         sends each a strictly higher token every time (a durable advance per request, never stale). \
         W1 with proofs and W2 with proofs: the same on the proofed route, each request with the `Fencing-Proof` of its \
         scope and token (W1's 1,000 signed before any run; W2's signed by the load generator as it sends them, on fresh \
         scopes each round), measured right after W1 and W2; their target compares proxy CPU per request (the load \
         generator's cost differs), as the median of the per-round ratios. Before W1 and W1 with proofs every W1 scope is \
         touched once (not measured), so both measure hot gates. W3: every scope \
         is raised to 1000000 through the admin API, then every request sends token 1 (409, no disk, no upstream). \
         W4: W1 over the 1,000 W1 scopes (its rate before the fill), then a fresh scope per request until \
         every one was touched once (token 1), then a clean restart; then W1 over 10,000 of them chosen at random, \
         in up to 3 rounds alternating with the same W1 through a second fencegate (same config, just restarted) \
         whose store holds only those 10,000 marks (which of the two goes first alternates from round to round; \
         the rounds run on the same two processes, so from the first round's warm-up on both hold the 10,000 \
         scopes' gates in memory and differ only in the marks on disk): the p99 verdict is the median of the \
         per-round differences; \
         then a SIGKILL restart and a check that token 0 is refused on them.\n\
         - Baselines: the same requests straight to the backend and through nginx `proxy_pass` \
         (keepalive 64 upstream, `worker_processes` = fencegate's `workers`); and the floor of fencegate's own \
         HTTP stack: a bare reverse proxy on hyper's HTTP/1.1 server and fencegate's upstream pool, with the same \
         worker model and no routing, fencing, header policy, timeouts or metrics (`benches/load/bare.rs`, in a \
         process of its own); and W3's floor, the same server answering \
         every request with W3's 409 (fencegate's own rendering of it, made once at start) without deciding anything. PostgreSQL: pgbench, 64 clients, \
         2 threads, prepared statements, `synchronous_commit = on`; each transaction is \
         `UPDATE fences SET accepted_fence = :fence WHERE scope = :scope AND accepted_fence <= :fence` with client `c` \
         owning its scopes and raising their fence every time, like W2 (1,000 rows).\n\
         - Everything runs on one machine over loopback: the load generator, fencegate, nginx and PostgreSQL share \
         the same CPUs, so absolute numbers are lower than on dedicated hosts; the ratios are the point.\n",
    );
    md.push_str("\n## Details\n\n");
    for r in &b.rows {
        if !r.statuses.is_empty() {
            md.push_str(&format!("- {} / {}: {}\n", r.group, r.name, r.statuses));
        }
    }
    for m in &memory {
        md.push_str(&format!("- {m}\n"));
    }
    for n in &b.notes {
        md.push_str(&format!("- {n}\n"));
    }
    std::fs::write(args.out.join("RESULTS.md"), &md)?;

    println!("\n{table}");
    println!("CPU per request:\n\n{}", report::cpu_table(&b.rows));
    for n in &b.notes {
        println!("note: {n}");
    }
    println!(
        "\nwrote {} and {}",
        args.out.join("RESULTS.md").display(),
        args.out.join("load.svg").display()
    );
    drop((null, dav, pp_null, pp_dav));
    Ok(b.ok)
}
