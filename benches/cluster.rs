//! The cluster bench: fencegate's cluster mode (SPEC §10) against the same fencegate with
//! local marks, on loopback, in one run; then W2 against etcd's own transaction rate, and
//! the distribution of takeovers after SIGKILL.
//!
//! ```text
//! cargo bench --features etcd --bench cluster [-- --seconds N --rounds R --kills K]
//! ```
//!
//! It starts a 3-member etcd (the starter of `benches/cluster_marks.rs`), nginx answering
//! `return 204` (`tests/it/support/nginx.rs`) and four fencegate processes (the release
//! binary, `workers = 2`, `settle = "0s"`, upstream timeout 1 s): (a) one without
//! `[cluster]` (local marks: the reference), (b) a 1-instance cluster, (c) a 2-instance
//! cluster (8 shards, ttl 2 s). Then, per round (`--rounds`, default 1), W1, W3 and W2 on
//! each of (a), (b), (c), each measured for `--seconds` (default 5) after a 1 s warm-up,
//! with the load bench's generator (`load/client.rs`: 64 HTTP/1.1 keep-alive connections,
//! closed loop, 1,000 scopes; for (c) 32 on each instance, so about half the requests take
//! a hop to the other), plus (c)'s W1 on the scopes the other instance owns only (every
//! request hops). CPU per request is the fencegate processes' (and etcd's) user + system
//! time from `/proc/<pid>/stat` over the run divided by its responses.
//!
//! Then etcd alone: 64 clients each sending one guarded transaction per write (as
//! `cluster_marks` does) and the same through the `MarkWriter`, `--seconds` each.
//!
//! Then `--kills` (default 20) takeovers on (c): find the owner of a probe scope, SIGKILL
//! it, PUT a higher token to the other every 20 ms until accepted, record the time since
//! the kill, restart the killed instance and wait until both own shards again.
//!
//! Every child process is stopped at the end, on panic and on SIGINT/SIGTERM (guards).
//! Exits non-zero if a workload got an answer it should not have. Under `cargo test`
//! (no `--bench` argument) it does nothing.

#[allow(dead_code)]
#[path = "load/client.rs"]
mod client;
#[path = "cluster/etcd.rs"]
mod etcd;
#[allow(dead_code)]
#[path = "load/procs.rs"]
mod lprocs;
#[allow(dead_code)]
#[path = "../tests/it/support/nginx.rs"]
mod nginx;
#[path = "cluster/procs.rs"]
mod procs;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use client::{Expect, Outcome, Plan, Spec};
use etcd::Etcd;
use fencegate::cluster::shard::shard_of;
use procs::{Instance, Mode, SHARDS, TTL, UPSTREAM_TIMEOUT, settled};

type Error = Box<dyn std::error::Error + Send + Sync>;

const CONNS: usize = 64;
const SCOPES: u32 = 1000;
const WARMUP: Duration = Duration::from_secs(1);
/// W3 raises every scope to this token first, then sends token 1.
const W3_HIGH: u64 = 1_000_000;
const SETTLE_BOUND: Duration = Duration::from_secs(60);
const SECRET: &str = "cluster-bench-secret-0123456789abcdef";
const POLL: Duration = Duration::from_millis(20);

struct Args {
    seconds: Duration,
    rounds: usize,
    kills: usize,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        seconds: Duration::from_secs(5),
        rounds: 1,
        kills: 20,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        match x.as_str() {
            "--seconds" => {
                let s: f64 = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|s: &f64| (0.1..=600.0).contains(s))
                    .ok_or("--seconds needs 0.1..=600")?;
                a.seconds = Duration::from_secs_f64(s);
            }
            "--rounds" => {
                a.rounds = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|r| (1..=20).contains(r))
                    .ok_or("--rounds needs 1..=20")?;
            }
            "--kills" => {
                a.kills = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|k| (0..=200).contains(k))
                    .ok_or("--kills needs 0..=200")?;
            }
            "--bench" => {}
            other => {
                return Err(format!(
                    "unknown argument {other:?}: --seconds N --rounds R --kills K"
                ));
            }
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    // `cargo test --all-targets` runs bench targets without `--bench`: nothing to do then.
    if !std::env::args().skip(1).any(|a| a == "--bench") {
        return ExitCode::SUCCESS;
    }
    let args = match args() {
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
    // On SIGINT or SIGTERM the run future is dropped, and with it every guard it owns.
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
        "==> cluster bench took {:.0} s",
        started.elapsed().as_secs_f64()
    );
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("FAILED: some workload got answers it should not have (see `errors`)");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("cluster bench failed: {e}");
            ExitCode::from(1)
        }
    }
}

fn step(msg: &str) {
    eprintln!("==> {msg}");
}

/// One measurement over one or more instances.
#[derive(Clone, Default)]
struct Measured {
    rps: f64,
    p50: f64,
    p99: f64,
    errors: u64,
    statuses: String,
    /// fencegate's CPU (all its processes in the configuration) per response, µs.
    fg_us: f64,
    /// etcd's CPU (its 3 members) per response, µs.
    etcd_us: f64,
    /// Share of the responses that took a hop (`forwarded_to_owner` at the entry).
    hops: f64,
}

fn cpu_of(pids: &[u32]) -> f64 {
    pids.iter().filter_map(|p| lprocs::cpu_seconds(*p)).sum()
}

fn quantile_ms(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1e6
}

/// Runs `work[k]` (a path prefix and a plan) against `insts[k]`, all at once, with
/// `CONNS / insts.len()` connections each; accounts CPU and hops.
async fn measure(
    insts: &[&Instance],
    work: Vec<(String, Plan)>,
    expect: Expect,
    duration: Duration,
    etcd: &[u32],
) -> Measured {
    let fg: Vec<u32> = insts.iter().filter_map(|i| i.pid()).collect();
    let mut forwarded = 0.0;
    for i in insts {
        forwarded -= i.requests("forwarded_to_owner").await;
    }
    let before = (cpu_of(&fg), cpu_of(etcd));
    let conns = CONNS / insts.len();
    let tasks: Vec<_> = insts
        .iter()
        .zip(work)
        .map(|(i, (prefix, plan))| {
            tokio::spawn(client::run(Spec {
                addr: i.proxy,
                prefix,
                conns,
                warmup: WARMUP,
                duration,
                plan,
                expect,
                proof: None,
            }))
        })
        .collect();
    let mut outs: Vec<Outcome> = Vec::new();
    for t in tasks {
        outs.push(t.await.unwrap_or_default());
    }
    let after = (cpu_of(&fg), cpu_of(etcd));
    for i in insts {
        forwarded += i.requests("forwarded_to_owner").await;
    }
    let total: u64 = outs.iter().map(|o| o.total).sum::<u64>().max(1);
    let mut lat: Vec<u64> = outs
        .iter()
        .flat_map(|o| o.latencies.iter().copied())
        .collect();
    lat.sort_unstable();
    let mut statuses = std::collections::BTreeMap::<u16, u64>::new();
    let mut io_errors = 0;
    for o in &outs {
        for (s, n) in &o.statuses {
            *statuses.entry(*s).or_default() += n;
        }
        io_errors += o.io_errors;
    }
    let mut text: Vec<String> = statuses.iter().map(|(s, n)| format!("{s}×{n}")).collect();
    if io_errors > 0 {
        text.push(format!("no-response×{io_errors}"));
    }
    Measured {
        rps: outs.iter().map(Outcome::rps).sum(),
        p50: quantile_ms(&lat, 0.50),
        p99: quantile_ms(&lat, 0.99),
        errors: outs.iter().map(Outcome::errors).sum(),
        statuses: text.join(" "),
        fg_us: (after.0 - before.0) * 1e6 / total as f64,
        etcd_us: (after.1 - before.1) * 1e6 / total as f64,
        hops: forwarded / total as f64,
    }
}

/// Every scope of `0..SCOPES` under `prefix` once with `token`, through `inst`.
async fn prime(inst: &Instance, prefix: &str, token: u64) -> Result<(), String> {
    let o = client::run(Spec {
        addr: inst.proxy,
        prefix: prefix.into(),
        conns: CONNS,
        warmup: Duration::ZERO,
        duration: Duration::from_secs(120),
        plan: Plan::Sweep {
            scopes: SCOPES,
            token,
        },
        expect: Expect::Accepted,
        proof: None,
    })
    .await;
    if o.errors() > 0 || !o.complete {
        return Err(format!(
            "priming {prefix}* through {} failed: {} errors [{}], complete {}",
            inst.name,
            o.errors(),
            o.statuses_text(),
            o.complete
        ));
    }
    Ok(())
}

/// The configurations measured.
const CONFIGS: [&str; 3] = [
    "(a) local marks, 1 instance",
    "(b) cluster, 1 instance",
    "(c) cluster, 2 instances",
];
const WORKLOADS: [&str; 4] = [
    "W1 steady (equal token)",
    "W1, every request hops",
    "W2 churn (an advance per request)",
    "W3 stale (all 409)",
];

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The round with the median rate.
fn median_round(v: &[Measured]) -> Measured {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.rps.total_cmp(&b.rps));
    v.get(v.len() / 2).cloned().unwrap_or_default()
}

/// Shards owned by each of `insts`, as each says.
async fn owned_by(insts: &[&Instance]) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    for i in insts {
        out.push(i.owned().await);
    }
    out
}

async fn run(args: &Args) -> Result<bool, Error> {
    let mut ok = true;
    step(&format!(
        "cluster bench: {:.1} s per measurement after {:.0} s warm-up, {} round(s), {} kills",
        args.seconds.as_secs_f64(),
        WARMUP.as_secs_f64(),
        args.rounds,
        args.kills
    ));
    let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    // Field order of the locals: etcd is dropped last (instances leave through it).
    let etcd = Etcd::start();
    let etcd_pids = etcd.pids();
    let null = nginx::Nginx::null()?;
    let dir = tempfile::Builder::new()
        .prefix("fencegate-cbench-")
        .tempdir()?;
    let secret = dir.path().join("peer.secret");
    std::fs::write(&secret, format!("{SECRET}\n"))?;
    // fencegate refuses a secret other users may read.
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600))?;
    }
    let cluster = |name: &str| Mode::Cluster {
        cluster: name.into(),
        endpoints: etcd.endpoints.clone(),
        secret: secret.clone(),
    };
    step("starting etcd (3 members), nginx null, fencegate (a), (b), (c)");
    let mut a = Instance::new(dir.path(), "local", null.port(), Mode::Local);
    a.start().await?;
    // etcd elects a leader within a few seconds: wait (bounded) until it answers a read.
    let give_up = Instant::now() + Duration::from_secs(30);
    loop {
        let tried = async {
            let mut c = etcd_client::Client::connect(etcd.endpoints.clone(), None).await?;
            c.get("/fencegate-cbench/ping", None).await
        };
        match tokio::time::timeout(Duration::from_secs(2), tried).await {
            Ok(Ok(_)) => break,
            Ok(Err(e)) if Instant::now() < give_up => eprintln!("    waiting for etcd: {e}"),
            Err(_) if Instant::now() < give_up => eprintln!("    waiting for etcd"),
            Ok(Err(e)) => return Err(format!("etcd did not come up: {e}").into()),
            Err(_) => return Err("etcd did not come up".into()),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut b = Instance::new(dir.path(), "one", null.port(), cluster("one"));
    b.start().await?;
    let mut c1 = Instance::new(dir.path(), "c1", null.port(), cluster("two"));
    let mut c2 = Instance::new(dir.path(), "c2", null.port(), cluster("two"));
    c1.start().await?;
    c2.start().await?;
    settled(&[&b], SETTLE_BOUND).await?;
    settled(&[&c1, &c2], SETTLE_BOUND).await?;

    // W3's scopes: raised once, through the proxy, on every configuration.
    for (i, inst) in [&a, &b, &c1].into_iter().enumerate() {
        prime(inst, "/reports/w3-s", W3_HIGH)
            .await
            .map_err(|e| format!("{}: {e}", CONFIGS[i]))?;
    }

    let all: Arc<Vec<u32>> = Arc::new((0..SCOPES).collect());
    let w1 = |scopes: &Arc<Vec<u32>>| Plan::Random {
        scopes: scopes.clone(),
        token: 1,
    };
    // [config][workload] → rounds.
    let mut results: Vec<Vec<Vec<Measured>>> = vec![vec![Vec::new(); WORKLOADS.len()]; 3];
    let note = |m: &Measured, cfg: usize, wl: usize| {
        eprintln!(
            "    {} / {}: {:.0} req/s, p50 {:.3} ms, p99 {:.3} ms, fencegate {:.1} µs/req, \
             etcd {:.1} µs/req, hops {:.0}%, errors {} [{}]",
            CONFIGS[cfg],
            WORKLOADS[wl],
            m.rps,
            m.p50,
            m.p99,
            m.fg_us,
            m.etcd_us,
            m.hops * 100.0,
            m.errors,
            m.statuses
        );
    };
    let mut hop_scopes = (Vec::new(), Vec::new());
    for round in 1..=args.rounds {
        step(&format!(
            "round {round} of {}: W1 (a) (b) (c), (c) every request hopping, W3 (a) (b) (c), W2 (a) (b) (c)",
            args.rounds
        ));
        let configs: [Vec<&Instance>; 3] = [vec![&a], vec![&b], vec![&c1, &c2]];
        // Which of W1's scopes the other instance of (c) owns (its view may have moved).
        let owned = owned_by(&configs[2]).await;
        let other = |k: usize| -> Arc<Vec<u32>> {
            Arc::new(
                (0..SCOPES)
                    .filter(|i| {
                        let shard = shard_of(&format!("report/w1-s{i}"), SHARDS);
                        !owned[k].contains(&shard)
                    })
                    .collect(),
            )
        };
        hop_scopes = (other(0).to_vec(), other(1).to_vec());
        for (cfg, insts) in configs.iter().enumerate() {
            // Gates idle for 30 s are swept: every W1 scope touched once, not measured.
            prime(insts[0], "/reports/w1-s", 1).await?;
            let work = insts
                .iter()
                .map(|_| ("/reports/w1-s".to_string(), w1(&all)))
                .collect();
            let m = measure(insts, work, Expect::Accepted, args.seconds, &etcd_pids).await;
            note(&m, cfg, 0);
            ok &= m.errors == 0;
            results[cfg][0].push(m);
        }
        let hop_work = vec![
            ("/reports/w1-s".to_string(), w1(&other(0))),
            ("/reports/w1-s".to_string(), w1(&other(1))),
        ];
        let m = measure(
            &configs[2],
            hop_work,
            Expect::Accepted,
            args.seconds,
            &etcd_pids,
        )
        .await;
        note(&m, 2, 1);
        ok &= m.errors == 0;
        results[2][1].push(m);
        for (cfg, insts) in configs.iter().enumerate() {
            let work = insts
                .iter()
                .map(|_| ("/reports/w3-s".to_string(), w1(&all)))
                .collect();
            let m = measure(insts, work, Expect::Stale, args.seconds, &etcd_pids).await;
            note(&m, cfg, 3);
            ok &= m.errors == 0;
            results[cfg][3].push(m);
        }
        for (cfg, insts) in configs.iter().enumerate() {
            // Fresh scopes per round and per entry instance: every request an advance.
            let work = insts
                .iter()
                .enumerate()
                .map(|(k, _)| {
                    (
                        format!("/reports/w2r{round}i{k}-s"),
                        Plan::Churn {
                            scopes: SCOPES,
                            start: 0,
                        },
                    )
                })
                .collect();
            let m = measure(insts, work, Expect::Accepted, args.seconds, &etcd_pids).await;
            note(&m, cfg, 2);
            ok &= m.errors == 0;
            results[cfg][2].push(m);
        }
    }
    // (a) and (b) are done; (c) stays for the takeovers.
    a.stop();
    b.stop();

    step(&format!(
        "etcd alone: {CONNS} clients, one guarded transaction per write, then through the MarkWriter, {:.1} s each",
        args.seconds.as_secs_f64()
    ));
    let (raw, grouped, per_txn) =
        etcd::etcd_alone(&etcd.endpoints, args.seconds, CONNS, "cbench-raw").await?;
    eprintln!(
        "    etcd alone {raw:.0} txns/s; MarkWriter {grouped:.0} advances/s, {per_txn:.1} per txn"
    );

    // ---- takeovers -------------------------------------------------------------------
    step(&format!(
        "{} takeovers on (c): SIGKILL the probe scope's owner, poll the other every 20 ms",
        args.kills
    ));
    let probe_scope = "report/probe";
    let probe_path = "/reports/probe/obj";
    let probe_shard = shard_of(probe_scope, SHARDS);
    let mut token = 1u64;
    let mut takeovers: Vec<f64> = Vec::new();
    let mut rejoins: Vec<f64> = Vec::new();
    let mut claims: Vec<f64> = Vec::new();
    let mut polls_503 = 0u64;
    let mut polls_other = std::collections::BTreeMap::<String, u64>::new();
    let mut pair = [c1, c2];
    for round in 1..=args.kills {
        let owners = settled(&[&pair[0], &pair[1]], SETTLE_BOUND).await?;
        let owner = &owners[probe_shard as usize];
        let (dead, alive) = if *owner == pair[0].name {
            (0, 1)
        } else {
            (1, 0)
        };
        // The probe's mark is there before the kill (through the survivor: maybe a hop).
        token += 1;
        let (s, r) = procs::put_once(pair[alive].proxy, probe_path, token).await?;
        if s >= 300 || r != "accepted" {
            return Err(format!("probe before kill {round}: {s} {r}").into());
        }
        let killed = Instant::now();
        pair[dead].kill();
        let mut tick = tokio::time::interval(POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // When the survivor first shows the shard as its own (in its takeover wait).
        let mut claimed = None;
        let took = loop {
            tick.tick().await;
            if claimed.is_none() && pair[alive].owned().await.contains(&probe_shard) {
                claimed = Some(killed.elapsed());
            }
            token += 1;
            match procs::put_once(pair[alive].proxy, probe_path, token).await {
                Ok((s, r)) if s < 300 && r == "accepted" => break killed.elapsed(),
                Ok((503, _)) => polls_503 += 1,
                Ok((s, r)) => *polls_other.entry(format!("{s} {r}")).or_default() += 1,
                Err(e) => *polls_other.entry(format!("error {e}")).or_default() += 1,
            }
            if killed.elapsed() > Duration::from_secs(60) {
                return Err(format!("kill {round}: not taken over within 60 s").into());
            }
        };
        // The mark before the kill came along: the token before it is stale now.
        let (s, _) = procs::put_once(pair[alive].proxy, probe_path, token - 1).await?;
        if s != 409 {
            ok = false;
            eprintln!("    kill {round}: the token before the takeover's answered {s}, not 409");
        }
        takeovers.push(took.as_secs_f64());
        // Not seen before the accept (it fell between two polls): the accept's time.
        let claimed = claimed.unwrap_or(took).as_secs_f64();
        claims.push(claimed);
        let back = Instant::now();
        pair[dead].restart().await?;
        settled(&[&pair[0], &pair[1]], SETTLE_BOUND).await?;
        rejoins.push(back.elapsed().as_secs_f64());
        eprintln!(
            "    kill {round}: {} killed, {} owned the shard after {claimed:.3} s, accepted after {:.3} s; rejoined in {:.2} s",
            pair[dead].name,
            pair[alive].name,
            took.as_secs_f64(),
            back.elapsed().as_secs_f64()
        );
    }
    let load_after = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();

    // ---- report ----------------------------------------------------------------------
    let m = |cfg: usize, wl: usize| median_round(&results[cfg][wl]);
    let ratio = |x: usize, y: usize, wl: usize| {
        median(
            &results[x][wl]
                .iter()
                .zip(&results[y][wl])
                .map(|(p, q)| p.rps / q.rps)
                .collect::<Vec<_>>(),
        )
    };
    println!();
    println!(
        "cargo bench --features etcd --bench cluster -- --seconds {} --rounds {} --kills {}",
        args.seconds.as_secs_f64(),
        args.rounds,
        args.kills
    );
    println!(
        "load average at start {}, at end {}",
        load_before
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" "),
        load_after
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!();
    println!(
        "| configuration | workload | req/s | p50 ms | p99 ms | fencegate CPU µs/req | etcd CPU µs/req | hops | errors |"
    );
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for wl in [0, 1, 2, 3] {
        for cfg in 0..3 {
            if results[cfg][wl].is_empty() {
                continue;
            }
            let r = m(cfg, wl);
            let errors: u64 = results[cfg][wl].iter().map(|r| r.errors).sum();
            println!(
                "| {} | {} | {:.0} | {:.3} | {:.3} | {:.1} | {:.1} | {:.0}% | {} |",
                CONFIGS[cfg],
                WORKLOADS[wl],
                r.rps,
                r.p50,
                r.p99,
                r.fg_us,
                r.etcd_us,
                r.hops * 100.0,
                errors
            );
        }
    }
    println!();
    println!("| workload | (b)/(a) req/s | (c)/(b) req/s |");
    println!("| --- | ---: | ---: |");
    for wl in [0, 2, 3] {
        println!(
            "| {} | {:.2}× | {:.2}× |",
            WORKLOADS[wl],
            ratio(1, 0, wl),
            ratio(2, 1, wl)
        );
    }
    println!();
    // Each difference is taken within a round (measured minutes apart at most), then the
    // median over the rounds, as the ratios are.
    let diff = |x: usize, wl: usize, f: fn(&Measured) -> f64| {
        let per_round: Vec<f64> = results[x][wl]
            .iter()
            .zip(&results[1][0])
            .map(|(p, q)| f(p) - f(q))
            .collect();
        let each = per_round
            .iter()
            .map(|d| format!("{d:+.3}"))
            .collect::<Vec<_>>()
            .join(" ");
        (median(&per_round), each)
    };
    let (hop_p50, hop_each) = diff(2, 0, |r| r.p50);
    let (all_hop_p50, all_hop_each) = diff(2, 1, |r| r.p50);
    println!(
        "hop: (c) W1 p50 − (b) W1 p50 = {hop_p50:+.3} ms (rounds: {hop_each}; {:.0}% of (c)'s \
         requests hopped); with every request hopping, (c) p50 − (b) p50 = {all_hop_p50:+.3} ms \
         (rounds: {all_hop_each})",
        m(2, 0).hops * 100.0,
    );
    let (hop_cpu, hop_cpu_each) = diff(2, 0, |r| r.fg_us);
    let (all_hop_cpu, all_hop_cpu_each) = diff(2, 1, |r| r.fg_us);
    println!(
        "hop CPU: fencegate µs per W1 request (c) − (b) = {hop_cpu:+.1} µs (rounds: \
         {hop_cpu_each}); every request hopping: {all_hop_cpu:+.1} µs (rounds: {all_hop_cpu_each})"
    );
    println!(
        "(c)'s hop-only W1 used {} of (c1)'s entry scopes and {} of (c2)'s (those the other owns)",
        hop_scopes.0.len(),
        hop_scopes.1.len()
    );
    println!();
    println!(
        "W2 against etcd: (b) {:.0} advances/s, (c) {:.0} advances/s; etcd alone {raw:.0} \
         guarded transactions/s ({CONNS} clients, one per write); MarkWriter alone {grouped:.0} \
         advances/s ({per_txn:.1} per transaction). (b)/etcd {:.2}×, (c)/etcd {:.2}×, \
         (b)/MarkWriter {:.2}×",
        m(1, 2).rps,
        m(2, 2).rps,
        m(1, 2).rps / raw,
        m(2, 2).rps / raw,
        m(1, 2).rps / grouped
    );
    if !takeovers.is_empty() {
        let mut t = takeovers.clone();
        t.sort_by(f64::total_cmp);
        let q = |q: f64| t[((q * t.len() as f64).ceil() as usize).clamp(1, t.len()) - 1];
        let wait = TTL + UPSTREAM_TIMEOUT;
        println!();
        println!(
            "takeover after SIGKILL ({} kills, ttl {} s, upstream timeout {} s, settle 0, polled every {} ms): \
             min {:.3} s, median {:.3} s, p90 {:.3} s, max {:.3} s",
            t.len(),
            TTL.as_secs(),
            UPSTREAM_TIMEOUT.as_secs(),
            POLL.as_millis(),
            t[0],
            median(&t),
            q(0.9),
            t[t.len() - 1]
        );
        println!(
            "bound: lease expiry ≤ ttl ({} s), then the wait ttl + upstream timeout + settle ({} s): \
             between {} s and {} s after the kill, plus detection and the poll's period; \
             {} of {} within {} s",
            TTL.as_secs(),
            wait.as_secs(),
            wait.as_secs(),
            (TTL + wait).as_secs(),
            t.iter()
                .filter(|x| **x <= (TTL + wait).as_secs_f64())
                .count(),
            t.len(),
            (TTL + wait).as_secs()
        );
        let stats = |v: &[f64]| {
            let mut v = v.to_vec();
            v.sort_by(f64::total_cmp);
            let q = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
            format!(
                "min {:.3} s, median {:.3} s, p90 {:.3} s, max {:.3} s",
                v[0],
                median(&v),
                q(0.9),
                v[v.len() - 1]
            )
        };
        let waits: Vec<f64> = takeovers.iter().zip(&claims).map(|(t, c)| t - c).collect();
        println!(
            "of which: kill to the survivor owning the shard (lease expiry, detection, claim; \
             seen by polling its /v1/cluster): {}; owning to accepting (the takeover wait, \
             {} s): {}",
            stats(&claims),
            wait.as_secs(),
            stats(&waits)
        );
        println!(
            "every takeover in order (s): {}",
            takeovers
                .iter()
                .map(|x| format!("{x:.3}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
        println!(
            "polls meanwhile: {polls_503} answered 503; others: {polls_other:?}; \
             rejoin (restart to both owning shards again): median {:.2} s, max {:.2} s",
            median(&rejoins),
            rejoins.iter().copied().fold(0.0, f64::max)
        );
    }
    drop(pair);
    Ok(ok)
}
