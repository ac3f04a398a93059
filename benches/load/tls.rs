//! The TLS rows: fencegate's TLS listener against nginx (`listen … ssl http2`, TLS 1.2 and
//! 1.3) with the same certificate, in the same run, both proxying to the null backend,
//! measured by external clients built on OpenSSL and nghttp2:
//!
//! - keep-alive W1 over TLS: `wrk -t2 -c64` (PUTs with an equal token over 1,000 scopes);
//! - a new connection per request (`wrk -t2 -c16 -H 'Connection: close'`), with
//!   resumption off on both servers (every handshake a full one: the rows for a P-256 and
//!   an RSA-2048 certificate), and on (wrk's OpenSSL client offers its last session's
//!   ticket on reconnect: resumed handshakes);
//! - HTTP/2 over TLS: `h2load -t2 -c16 -m16`.
//!
//! The proxy CPU per request comes from /proc (the nginx master and its workers; the
//! fencegate process). In smoke mode only the full handshakes with the P-256 certificate
//! run (a second each), and only if wrk is installed; rows whose tool is missing are left
//! out with a note.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use super::nginx::{Nginx, Tls};
use super::procs::{self, Fencegate};
use super::report::{CpuUse, Kind, Row, Verdict};
use super::{Bench, Error, Series, cpu_of, median, step};

const GROUP: &str = "TLS, null backend (nginx `listen … ssl http2` with the same certificate)";

/// The request script of every wrk run: W1's PUT (equal token 1) over 1,000 scopes.
const W1_LUA: &str = r#"wrk.method = "PUT"
wrk.body = "5"
wrk.headers["Fencing-Token"] = "1"
request = function()
  return wrk.format(nil, "/reports/tls-s" .. math.random(0, 999) .. "/x")
end
"#;

/// Is `tool` on the PATH?
fn installed(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A self-signed certificate for `localhost` and 127.0.0.1 (`openssl req`), `NAME.pem`
/// and `NAME.key` in `dir`.
fn certificate(dir: &Path, name: &str, key: &[&str]) -> Result<(PathBuf, PathBuf), Error> {
    let (cert, keyfile) = (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.key")),
    );
    let out = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
        ])
        .args(["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"])
        .args(key)
        .arg("-keyout")
        .arg(&keyfile)
        .arg("-out")
        .arg(&cert)
        .stdin(Stdio::null())
        .output()?;
    if !out.status.success() {
        return Err(format!(
            "openssl req ({name}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    // fencegate refuses a private key other users may read.
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&keyfile, std::fs::Permissions::from_mode(0o600))?;
    }
    Ok((cert, keyfile))
}

/// What one run of an external client measured.
#[derive(Debug, Default)]
struct Run {
    requests: u64,
    rps: f64,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
    /// Non-2xx answers, socket errors, failed requests.
    errors: u64,
    summary: String,
}

/// `1.23ms`, `456.78us`, `1.02s` in ms.
fn wrk_ms(v: &str) -> Option<f64> {
    let (num, scale) = if let Some(n) = v.strip_suffix("us") {
        (n, 1e-3)
    } else if let Some(n) = v.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1e3)
    } else {
        (v, 1.0)
    };
    num.parse::<f64>().ok().map(|n| n * scale)
}

/// Reads `wrk --latency`'s report.
fn parse_wrk(out: &str) -> Run {
    let mut run = Run::default();
    let mut errors_seen = Vec::new();
    for line in out.lines().map(str::trim) {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["50%", v] => run.p50_ms = wrk_ms(v),
            ["99%", v] => run.p99_ms = wrk_ms(v),
            [n, "requests", "in", ..] => run.requests = n.parse().unwrap_or(0),
            ["Requests/sec:", v] => run.rps = v.parse().unwrap_or(0.0),
            ["Non-2xx", "or", "3xx", "responses:", n] => {
                run.errors += n.parse::<u64>().unwrap_or(1);
                errors_seen.push(line.to_string());
            }
            ["Socket", "errors:", rest @ ..] => {
                // `connect 0, read 0, write 0, timeout 0`
                let n: u64 = rest
                    .iter()
                    .filter_map(|w| w.trim_end_matches(',').parse::<u64>().ok())
                    .sum();
                run.errors += n;
                errors_seen.push(line.to_string());
            }
            _ => {}
        }
    }
    if run.requests == 0 {
        run.errors += 1;
        errors_seen.push("no requests".into());
    }
    run.summary = if errors_seen.is_empty() {
        format!("{} requests, all 2xx", run.requests)
    } else {
        format!("{} requests; {}", run.requests, errors_seen.join("; "))
    };
    run
}

/// Reads h2load's report.
fn parse_h2load(out: &str) -> Run {
    let mut run = Run::default();
    let mut status = String::new();
    let mut protocol = String::new();
    for line in out.lines().map(str::trim) {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["finished", "in", _, rps, "req/s,", ..] => {
                run.rps = rps.trim_end_matches(',').parse().unwrap_or(0.0)
            }
            [
                "requests:",
                total,
                "total,",
                _,
                "started,",
                _,
                "done,",
                ok,
                "succeeded,",
                ..,
            ] => {
                let total: u64 = total.parse().unwrap_or(0);
                let ok: u64 = ok.parse().unwrap_or(0);
                run.requests = total;
                run.errors += total - ok.min(total);
            }
            ["status", "codes:", ok, "2xx,", ..] => {
                let ok: u64 = ok.parse().unwrap_or(0);
                run.errors += run.requests - ok.min(run.requests);
                status = line.to_string();
            }
            ["Application", "protocol:", p] => protocol = (*p).to_string(),
            _ => {}
        }
    }
    if protocol != "h2" {
        run.errors += 1;
    }
    if run.requests == 0 {
        run.errors += 1;
    }
    run.summary = format!(
        "{} requests; {status}; ALPN {}",
        run.requests,
        if protocol.is_empty() {
            "none"
        } else {
            &protocol
        }
    );
    run
}

/// The client command of one kind of row.
#[derive(Clone, Copy)]
enum Client {
    /// wrk, one connection per client kept alive.
    KeepAlive,
    /// wrk with `Connection: close`: a handshake per request.
    NewConnection,
    /// h2load, 16 streams per connection.
    H2,
}

/// Runs `client` against `port` for `secs` seconds and accounts the CPU of `proxy` (and
/// of the backend) per request.
fn measure(
    client: Client,
    port: u16,
    secs: u32,
    lua: &Path,
    proxy: &[u32],
    backend: &[u32],
) -> (Run, CpuUse) {
    let url = format!("https://127.0.0.1:{port}/");
    let mut cmd = match client {
        Client::KeepAlive | Client::NewConnection => {
            let mut c = Command::new("wrk");
            c.args(["-t2", "--latency", "-d", &format!("{secs}s"), "-s"])
                .arg(lua);
            match client {
                Client::KeepAlive => c.args(["-c", &super::CONNS.to_string()]),
                _ => c.args(["-c16", "-H", "Connection: close"]),
            };
            c.arg(&url);
            c
        }
        Client::H2 => {
            let mut c = Command::new("h2load");
            c.args(["-t2", "-c16", "-m16", "-D", &secs.to_string()])
                .args(["-H", ":method: PUT", "-H", "fencing-token: 1"]);
            // Sixteen scopes; each client takes the next URI in turn.
            c.args((0..16).map(|i| format!("{url}reports/tls-h2-s{i}/x")));
            c
        }
    };
    let before = (cpu_of(proxy), cpu_of(backend));
    let t0 = Instant::now();
    let out = cmd.stdin(Stdio::null()).stderr(Stdio::piped()).output();
    let wall = t0.elapsed().as_secs_f64();
    let after = (cpu_of(proxy), cpu_of(backend));
    let run = match out {
        Ok(o) => {
            let text = String::from_utf8_lossy(&o.stdout);
            match client {
                Client::H2 => parse_h2load(&text),
                _ => parse_wrk(&text),
            }
        }
        Err(e) => Run {
            errors: 1,
            summary: format!("client did not run: {e}"),
            ..Run::default()
        },
    };
    let n = run.requests.max(1) as f64;
    let part = |used: f64| Some((used * 1e6 / n, used / wall));
    let cpu = CpuUse {
        proxy: part(after.0 - before.0),
        backend: part(after.1 - before.1),
        generator: None,
        proxy_switches: None,
    };
    (run, cpu)
}

fn row(name: &str, kind: Kind, run: &Run, cpu: CpuUse) -> Row {
    let mut r = Row::new(GROUP, name, kind);
    r.rps = Some(run.rps);
    r.p50_ms = run.p50_ms;
    r.p99_ms = run.p99_ms;
    r.errors = Some(run.errors);
    r.statuses = run.summary.clone();
    let us = cpu.proxy.map_or(0.0, |(us, _)| us);
    eprintln!(
        "    {name}: {:.0} req/s, proxy CPU {us:.0} µs per request, errors {} [{}]",
        run.rps, run.errors, run.summary
    );
    r.cpu = Some(cpu);
    r
}

/// nginx and fencegate (its files in `dir`) with the certificate `cert`, resumption on or
/// off in both.
async fn start_pair(
    dir: &Path,
    null: &Nginx,
    workers: usize,
    proof_key: &Path,
    cert: &(PathBuf, PathBuf),
    resumption: bool,
) -> Result<(Nginx, Fencegate), Error> {
    let tls = Tls {
        cert: cert.0.clone(),
        key: cert.1.clone(),
        resumption,
    };
    let nginx = Nginx::tls_proxy_pass(null.port(), workers, tls)?;
    std::fs::create_dir_all(dir)?;
    let line = format!(
        "tls = {{ cert = \"{}\", key = \"{}\", resumption = {resumption} }}",
        cert.0.display(),
        cert.1.display()
    );
    let fg = Fencegate::start_with(
        dir,
        null.port(),
        null.port(),
        workers,
        proof_key,
        Some(line),
    )
    .await?;
    Ok((nginx, fg))
}

/// One comparison: nginx and fencegate with the same certificate and client.
struct Pair {
    what: &'static str,
    client: Client,
    nginx: Nginx,
    fencegate: Fencegate,
    /// Judged against ≥ 1.0× nginx req/s.
    target: bool,
    rounds: (Series, Series),
}

/// `--tls-only`: the null backend and the TLS rows; the table and notes printed.
pub(super) async fn only(
    args: &super::Args,
    scratch: &Path,
    proof_key: &Path,
) -> Result<bool, Error> {
    let null = Nginx::null()?;
    let mut b = Bench {
        args,
        rows: Vec::new(),
        notes: Vec::new(),
        ok: true,
    };
    run(&mut b, scratch, &null, proof_key).await?;
    println!("{}", super::report::table(&b.rows));
    println!("{}", super::report::cpu_table(&b.rows));
    for note in &b.notes {
        println!("- {note}");
    }
    Ok(b.ok)
}

/// Runs the TLS rows and adds them to `b`. `null_port` is the null backend's.
pub(super) async fn run(
    b: &mut Bench<'_>,
    scratch: &Path,
    null: &Nginx,
    proof_key: &Path,
) -> Result<(), Error> {
    let smoke = b.args.smoke;
    let (wrk, h2load, openssl) = (installed("wrk"), installed("h2load"), installed("openssl"));
    if !wrk || !openssl {
        b.notes.push(format!(
            "TLS rows not run: {} missing (benches/run.sh installs them)",
            [(!wrk).then_some("wrk"), (!openssl).then_some("openssl")]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join(" and ")
        ));
        return Ok(());
    }
    step("TLS: certificates, nginx and fencegate with each");
    let dir = scratch.join("tls");
    std::fs::create_dir_all(&dir)?;
    let lua = dir.join("w1.lua");
    std::fs::write(&lua, W1_LUA)?;
    let p256 = certificate(
        &dir,
        "p256",
        &["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"],
    )?;
    let rsa = certificate(&dir, "rsa2048", &["-newkey", "rsa:2048"])?;
    let workers = b.args.workers;
    let start = async |n: usize, cert: &(PathBuf, PathBuf), resumption: bool| {
        start_pair(
            &dir.join(format!("fencegate-{n}")),
            null,
            workers,
            proof_key,
            cert,
            resumption,
        )
        .await
    };
    const FULL: &str = "new connection per request, full handshakes (wrk -c16, `Connection: close`, resumption off)";
    let mut pairs = Vec::new();
    let (nginx, fencegate) = start(1, &p256, false).await?;
    pairs.push(Pair {
        what: "P-256, full handshakes",
        client: Client::NewConnection,
        nginx,
        fencegate,
        target: true,
        rounds: Default::default(),
    });
    if !smoke {
        let (nginx, fencegate) = start(2, &rsa, false).await?;
        pairs.push(Pair {
            what: "RSA-2048, full handshakes",
            client: Client::NewConnection,
            nginx,
            fencegate,
            target: true,
            rounds: Default::default(),
        });
        // The resumed-handshake rows and the keep-alive and HTTP/2 rows share one pair of
        // servers: resumption on, as both ship.
        let (nginx, fencegate) = start(3, &p256, true).await?;
        pairs.push(Pair {
            what: "P-256, resumed handshakes",
            client: Client::NewConnection,
            nginx,
            fencegate,
            target: true,
            rounds: Default::default(),
        });
    }
    let rounds = if smoke { 1 } else { b.args.rounds.min(3) };
    let secs = b.args.duration.as_secs().max(1) as u32;
    let backend = procs::with_children(null.pid());
    // Keep-alive and HTTP/2 go to the resumption-on pair (the last one), measured as
    // extra pairs of rows over the same servers.
    let mut extra: Vec<(&'static str, Client, (Series, Series))> = Vec::new();
    if !smoke {
        extra.push((
            "keep-alive W1 over TLS (wrk -c64)",
            Client::KeepAlive,
            Default::default(),
        ));
        if h2load {
            extra.push((
                "HTTP/2 over TLS (h2load -c16 -m16)",
                Client::H2,
                Default::default(),
            ));
        } else {
            b.notes.push(
                "TLS: HTTP/2 row not run: h2load missing (benches/run.sh installs nghttp2-client)"
                    .into(),
            );
        }
    }
    for round in 1..=rounds {
        step(&format!(
            "TLS, round {round} of {rounds}: nginx, then fencegate, for each row"
        ));
        for pair in &mut pairs {
            let ng = procs::with_children(pair.nginx.pid());
            let fg: Vec<u32> = pair.fencegate.pid().into_iter().collect();
            if round == 1 && !smoke {
                // Warm-up, not measured: every scope's first advance, caches filled.
                let _ = measure(pair.client, pair.nginx.port(), 1, &lua, &ng, &backend);
                let _ = measure(
                    pair.client,
                    pair.fencegate.proxy.port(),
                    1,
                    &lua,
                    &fg,
                    &backend,
                );
            }
            let (r, cpu) = measure(pair.client, pair.nginx.port(), secs, &lua, &ng, &backend);
            pair.rounds.0.push(row(
                &format!("nginx, {}", pair.what),
                Kind::Baseline,
                &r,
                cpu,
            ));
            let (r, cpu) = measure(
                pair.client,
                pair.fencegate.proxy.port(),
                secs,
                &lua,
                &fg,
                &backend,
            );
            pair.rounds.1.push(row(
                &format!("fencegate, {}", pair.what),
                Kind::Fencegate,
                &r,
                cpu,
            ));
        }
        if let Some(last) = pairs.last() {
            let ng = procs::with_children(last.nginx.pid());
            let fg: Vec<u32> = last.fencegate.pid().into_iter().collect();
            for (what, client, series) in &mut extra {
                if round == 1 {
                    let _ = measure(*client, last.nginx.port(), 1, &lua, &ng, &backend);
                    let _ = measure(*client, last.fencegate.proxy.port(), 1, &lua, &fg, &backend);
                }
                let (r, cpu) = measure(*client, last.nginx.port(), secs, &lua, &ng, &backend);
                series
                    .0
                    .push(row(&format!("nginx, {what}"), Kind::Baseline, &r, cpu));
                let (r, cpu) = measure(
                    *client,
                    last.fencegate.proxy.port(),
                    secs,
                    &lua,
                    &fg,
                    &backend,
                );
                series
                    .1
                    .push(row(&format!("fencegate, {what}"), Kind::Fencegate, &r, cpu));
            }
        }
    }
    let mut judged: Vec<(bool, (Series, Series))> =
        pairs.into_iter().map(|p| (p.target, p.rounds)).collect();
    judged.extend(extra.into_iter().map(|(_, _, s)| (false, s)));
    for (target, (nginx, fencegate)) in judged {
        let rps = median(&fencegate.over(&nginx, |a, b| a.rps / b.rps));
        let cpu = median(&fencegate.over(&nginx, |a, b| a.proxy_us / b.proxy_us));
        b.push(nginx.median_row());
        let mut r = fencegate.median_row();
        r.ratio = format!("{rps:.2}× nginx req/s; {cpu:.2}× nginx's proxy CPU per request");
        if target {
            r.target = "≥ 1.0× nginx req/s".into();
            r.verdict = Verdict::from(rps >= 1.0);
        }
        b.push(r);
    }
    b.notes.push(format!(
        "TLS: both servers proxy to the null backend with `workers = {workers}` / `worker_processes {workers}`, \
         one certificate each (made with `openssl req` for the run: P-256 or RSA-2048), TLS 1.3 \
         negotiated with the OpenSSL clients (X25519, TLS_AES_256_GCM_SHA384). The full-handshake \
         rows: {FULL}; nginx with `ssl_session_tickets off; ssl_session_cache off;`, fencegate with \
         `resumption = false`. The resumed rows: both with resumption on (their defaults); wrk's \
         OpenSSL client keeps its session across reconnects and resumes it. {rounds} round(s), each \
         ratio the median of the per-round ratios; the first round starts with a 1 s warm-up of each \
         server, not measured. fencegate's TLS provider: {}.",
        if cfg!(feature = "aws-lc-rs") { "aws-lc-rs" } else { "ring" }
    ));
    Ok(())
}
