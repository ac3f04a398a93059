//! The access log (`[log] access`): one JSON line per proxy request, request ids kept,
//! made and passed upstream, the file reopened on SIGHUP; and the rate-limited warnings
//! for stale refusals, logged with the access log off.

use crate::support;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fencegate::settings::Config;
use support::{BOUND, Client, Double, config_text, write_config};

/// Waits (bounded) until `path` holds at least `n` lines, and returns them as JSON.
async fn lines(path: &Path, n: usize) -> Vec<serde_json::Value> {
    let read = || {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
            .collect::<Vec<serde_json::Value>>()
    };
    tokio::time::timeout(BOUND, async {
        loop {
            let got = read();
            if got.len() >= n {
                return got;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{} never held {n} lines: {:?}", path.display(), read()))
}

async fn start_logged(upstream: std::net::SocketAddr, dir: &Path) -> fencegate::app::Running {
    let text = format!(
        "{}\n[log]\naccess = \"access.log\"\n",
        config_text(upstream, "10s", "0s", "10s")
    );
    support::start(Config::parse(&text, dir).expect("config")).await
}

#[tokio::test]
async fn a_line_per_request_with_its_fields() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = start_logged(double.addr, dir.path()).await;
    let client = Client::new(proxy.proxy_addr);
    let ok = client.put("/reports/r/x", "5", "hello").await;
    assert_eq!(ok.status, 200);
    assert_eq!(client.put("/reports/r/x", "4", "late").await.status, 409);
    assert_eq!(client.put("/nowhere", "1", "").await.status, 404);

    let log = lines(&dir.path().join("access.log"), 3).await;
    assert_eq!(log.len(), 3, "{log:#?}");
    let (accepted, stale, unrouted) = (&log[0], &log[1], &log[2]);
    let time = accepted["time"].as_str().unwrap();
    assert!(
        time.len() == 24 && time.ends_with('Z') && time.as_bytes()[19] == b'.',
        "RFC 3339, UTC, ms: {time}"
    );
    assert_eq!(accepted["method"], "PUT");
    assert_eq!(accepted["route"], "reports");
    assert_eq!(accepted["scope"], "report/r");
    assert_eq!(accepted["token"], "5");
    assert_eq!(accepted["result"], "accepted");
    assert_eq!(accepted["status"], 200);
    assert!(
        accepted["peer"].as_str().unwrap().starts_with("127.0.0.1:"),
        "{accepted}"
    );
    assert!(accepted["duration_ms"].as_f64().unwrap() >= 0.0);
    assert!(accepted["upstream_ms"].as_f64().unwrap() >= 0.0);
    assert_eq!(
        accepted["bytes"].as_u64(),
        ok.headers
            .get("content-length")
            .map(|v| v.to_str().unwrap().parse::<u64>().unwrap())
            .or(Some(ok.body.len() as u64))
    );
    assert_eq!(
        accepted["request_id"].as_str(),
        ok.headers.get("x-request-id").map(|v| v.to_str().unwrap())
    );

    assert_eq!(stale["result"], "stale_fence");
    assert_eq!(stale["status"], 409);
    assert_eq!(stale["token"], "4");
    assert_eq!(stale["highest"], "5");
    assert!(stale["sequence"].is_null() && stale["highest_sequence"].is_null());
    assert_eq!(stale["scope"], "report/r");
    assert_eq!(stale["route"], "reports");
    assert!(stale["upstream_ms"].is_null(), "never forwarded: {stale}");
    assert!(stale["bytes"].as_u64().unwrap() > 0, "the problem document");

    assert_eq!(unrouted["result"], "no_route");
    assert_eq!(unrouted["status"], 404);
    assert!(unrouted["route"].is_null() && unrouted["scope"].is_null());
    let ids: std::collections::HashSet<_> =
        log.iter().map(|l| l["request_id"].to_string()).collect();
    assert_eq!(ids.len(), 3, "a request id each: {ids:?}");
    proxy.shutdown().await;
}

#[tokio::test]
async fn request_ids_kept_made_and_replaced() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = start_logged(double.addr, dir.path()).await;
    let client = Client::new(proxy.proxy_addr);
    let seen_id = |target: &str| {
        double
            .seen()
            .iter()
            .find(|s| s.target == target)
            .and_then(|s| s.header("x-request-id").map(str::to_string))
    };
    let id_of = |r: &support::Resp| {
        r.headers
            .get("x-request-id")
            .map(|v| v.to_str().unwrap().to_string())
    };

    let kept = client
        .send(
            "PUT",
            "/reports/r/kept",
            &[("fencing-token", "1"), ("x-request-id", "trace-0123456789")],
            "",
        )
        .await;
    assert_eq!(kept.status, 200);
    assert_eq!(id_of(&kept).as_deref(), Some("trace-0123456789"));
    assert_eq!(
        seen_id("/reports/r/kept").as_deref(),
        Some("trace-0123456789")
    );

    let made = client.put("/reports/r/made", "2", "").await;
    let made_id = id_of(&made).expect("a request id made");
    assert_eq!(
        seen_id("/reports/r/made"),
        Some(made_id.clone()),
        "passed upstream"
    );

    let long = "a".repeat(200);
    for (target, hostile) in [
        ("/reports/r/long", long.as_str()),
        ("/reports/r/control", "evil\tid"),
    ] {
        let r = client
            .send(
                "PUT",
                target,
                &[("fencing-token", "3"), ("x-request-id", hostile)],
                "",
            )
            .await;
        let id = id_of(&r).expect("an id");
        assert_ne!(id, hostile, "{target}");
        assert_ne!(id, made_id, "{target}: ids are unique");
        assert_eq!(
            seen_id(target),
            Some(id.clone()),
            "{target}: replaced upstream too"
        );
    }

    let log = lines(&dir.path().join("access.log"), 4).await;
    assert_eq!(log[0]["request_id"], "trace-0123456789");
    assert_eq!(log[1]["request_id"].as_str(), Some(made_id.as_str()));
    proxy.shutdown().await;
}

/// Lines of a rotated file: the one before the rotation, then any that were written
/// between the rename and the reopen.
fn lines_before(text: &str) -> usize {
    let mut lines = text.lines();
    assert!(
        lines
            .next()
            .is_some_and(|l| l.contains("\"request_id\":\"before\"")),
        "{text}"
    );
    1 + lines
        .filter(|l| l.contains("\"request_id\":\"after-"))
        .count()
}

/// The binary on `config`, its stderr collected line by line (ANSI colours removed).
struct Served {
    child: std::process::Child,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(config: &Path) -> Served {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["serve", "--config"])
        .arg(config)
        .env("NO_COLOR", "1")
        .env_remove("RUST_LOG")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn fencegate");
    let pipe = child.stderr.take().unwrap();
    let stderr = Arc::new(Mutex::new(Vec::new()));
    let lines = stderr.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            lines.lock().unwrap().push(strip_ansi(&line));
        }
    });
    let served = Served { child, stderr };
    served.until(|l| l.iter().any(|l| l.contains("fencegate listening")));
    served
}

impl Served {
    /// Waits (bounded) until the stderr lines satisfy `done`.
    fn until(&self, done: impl Fn(&[String]) -> bool) -> Vec<String> {
        let end = Instant::now() + BOUND;
        loop {
            let lines = self.stderr.lock().unwrap().clone();
            if done(&lines) {
                return lines;
            }
            assert!(Instant::now() < end, "stderr never got there: {lines:#?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[tokio::test]
async fn sighup_reopens_the_access_log() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, _) = write_config(dir.path(), double.addr);
    let path = dir.path().join("access.log");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        format!("{text}\n[log]\naccess = \"{}\"\n", path.display()),
    )
    .unwrap();
    let served = serve(&config);
    let client = Client::new(([127, 0, 0, 1], p).into());
    let before = client
        .send(
            "PUT",
            "/reports/r/before",
            &[("fencing-token", "1"), ("x-request-id", "before")],
            "",
        )
        .await;
    assert_eq!(before.status, 200);
    lines(&path, 1).await;
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o640, "created 0640");
    }
    let rotated = dir.path().join("access.log.1");
    std::fs::rename(&path, &rotated).unwrap();
    support::signal(served.child.id(), "HUP");
    // The reopen follows the signal: requests until one lands in the new file (bounded).
    let mut n = 0;
    let landed = tokio::time::timeout(BOUND, async {
        loop {
            n += 1;
            let id = format!("after-{n}");
            let r = client
                .send(
                    "PUT",
                    "/reports/r/after",
                    &[("fencing-token", "1"), ("x-request-id", &id)],
                    "",
                )
                .await;
            assert_eq!(r.status, 200);
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            if text.contains(&format!("\"{id}\"")) {
                return text;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("a line in the new file after SIGHUP");
    // The rotated file kept the line before; the new one has only lines after it.
    let old = std::fs::read_to_string(&rotated).unwrap();
    assert_eq!(old.lines().count(), lines_before(&old), "{old}");
    assert!(
        landed
            .lines()
            .all(|l| l.contains("\"request_id\":\"after-")),
        "{landed}"
    );
    drop(served);
}

#[tokio::test]
async fn stale_refusals_warned_with_the_log_off_at_a_bounded_rate() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, _) = write_config(dir.path(), double.addr);
    let served = serve(&config);
    let client = Arc::new(Client::new(([127, 0, 0, 1], p).into()));
    assert_eq!(client.put("/reports/r/x", "50", "").await.status, 200);

    let burst = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for i in 0..100 {
        let client = client.clone();
        set.spawn(async move {
            client
                .send(
                    "PUT",
                    "/reports/r/x",
                    &[
                        ("fencing-token", "4"),
                        ("x-request-id", &format!("burst-{i}")),
                    ],
                    "",
                )
                .await
                .status
        });
    }
    while let Some(status) = set.join_next().await {
        assert_eq!(status.unwrap(), 409);
    }
    let seconds = burst.elapsed().as_secs();

    let warned = |l: &String| l.contains("WARN") && l.contains("result=\"stale_fence\"");
    let suppressed = |lines: &[String]| -> u64 {
        lines
            .iter()
            .filter_map(|l| l.split("suppressed=").nth(1))
            .filter_map(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
            .sum()
    };
    // Every refusal is either warned about or counted in a "suppressed" line.
    let lines =
        served.until(|l| l.iter().filter(|l| warned(l)).count() as u64 + suppressed(l) >= 100);
    let logged: Vec<_> = lines.iter().filter(|l| warned(l)).collect();
    assert_eq!(logged.len() as u64 + suppressed(&lines), 100, "{lines:#?}");
    assert!(
        logged.len() as u64 <= 10 * (seconds + 2),
        "{} warnings in a {seconds} s burst: {lines:#?}",
        logged.len()
    );
    assert!(suppressed(&lines) > 0, "the rest counted");
    let first = logged[0];
    for field in [
        "scope=\"report/r\"",
        "token=4",
        "highest=\"50\"",
        "route=\"reports\"",
        "request_id=\"burst-",
        "peer=127.0.0.1:",
    ] {
        assert!(first.contains(field), "{field} in {first}");
    }
    drop(served);
}

#[test]
fn log_section_is_validated_with_its_key_path() {
    let upstream: std::net::SocketAddr = ([127, 0, 0, 1], 9).into();
    let dir = Path::new("/etc/fencegate");
    let parse = |log: &str| {
        Config::parse(
            &format!("{}\n{log}", config_text(upstream, "10s", "0s", "10s")),
            dir,
        )
    };
    let errors = |log: &str| match parse(log) {
        Ok(_) => panic!("{log:?} accepted"),
        Err(e) => e.to_string(),
    };
    assert!(errors("[log]\naccess = \"\"").starts_with("log.access: "));
    assert!(errors("[log]\nformat = \"json\"").starts_with("log: unknown field `format`"));
    assert!(errors("[log]\naccess = 1").starts_with("log: "));
    use fencegate::access_log::Sink;
    assert_eq!(parse("").unwrap().log.access, Sink::Off);
    assert_eq!(
        parse("[log]\naccess = \"off\"").unwrap().log.access,
        Sink::Off
    );
    assert_eq!(
        parse("[log]\naccess = \"stdout\"").unwrap().log.access,
        Sink::Stdout
    );
    assert_eq!(
        parse("[log]\naccess = \"logs/access.log\"")
            .unwrap()
            .log
            .access,
        Sink::File(dir.join("logs/access.log"))
    );
}

#[tokio::test]
async fn invalid_proofs_warned_with_the_log_off() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    fencegate::proof::keygen(&dir.path().join("fence")).unwrap();
    let (config, p, _) = write_config(dir.path(), double.addr);
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("[fencing]\n", "[fencing]\nproof_keys = [\"fence.pub\"]\n");
    std::fs::write(
        &config,
        format!(
            "{text}\n[[route]]\nname = \"proved\"\npath = \"/proved/{{k}}\"\nscope = \"proved/{{k}}\"\nupstream = \"u\"\nproof = \"required\"\n"
        ),
    )
    .unwrap();
    let served = serve(&config);
    let client = Client::new(([127, 0, 0, 1], p).into());
    let r = client
        .send(
            "PUT",
            "/proved/x",
            &[("fencing-token", "3"), ("fencing-proof", "v1.nokey.bad")],
            "",
        )
        .await;
    assert_eq!((r.status, r.result()), (403, "invalid_proof"));
    let made = r
        .headers
        .get("x-request-id")
        .map(|v| v.to_str().unwrap().to_string())
        .expect("a request id made for the refusal");
    let lines = served.until(|l| l.iter().any(|l| l.contains("result=\"invalid_proof\"")));
    let line = lines
        .iter()
        .find(|l| l.contains("result=\"invalid_proof\""))
        .unwrap();
    for field in [
        "WARN",
        "scope=\"proved/x\"",
        "token=3",
        "highest=\"none\"",
        "route=\"proved\"",
        &format!("request_id=\"{made}\""),
    ] {
        assert!(line.contains(field), "{field} in {line}");
    }
    drop(served);
}

/// The log on a FIFO that the test reads only when it chooses: a disk that holds the
/// writer back. 400 lines are more than the pipe holds (64 KiB), so the last ones are still
/// queued in fencegate when it is told to stop.
#[tokio::test]
async fn lines_of_the_last_requests_are_written_before_exit() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, _) = write_config(dir.path(), double.addr);
    let path = dir.path().join("access.fifo");
    assert!(
        Command::new("mkfifo")
            .arg(&path)
            .status()
            .unwrap()
            .success()
    );
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        format!("{text}\n[log]\naccess = \"{}\"\n", path.display()),
    )
    .unwrap();
    let (go, read) = std::sync::mpsc::channel::<()>();
    let fifo = path.clone();
    let reader = std::thread::spawn(move || {
        use std::io::Read;
        // Opening waits for fencegate's open for writing, and lets it go on.
        let mut f = std::fs::File::open(&fifo).unwrap();
        let _ = read.recv();
        let mut all = String::new();
        f.read_to_string(&mut all).unwrap();
        all
    });
    let mut served = serve(&config);
    let client = Arc::new(Client::new(([127, 0, 0, 1], p).into()));
    let mut set = tokio::task::JoinSet::new();
    for i in 0..400 {
        let client = client.clone();
        set.spawn(async move {
            client
                .put(&format!("/reports/r{i}/x"), "1", "")
                .await
                .status
        });
    }
    while let Some(status) = set.join_next().await {
        assert_eq!(status.unwrap(), 200);
    }
    support::signal(served.child.id(), "TERM");
    // A process that does not wait for its log exits now, its last lines unwritten; one
    // that waits is still there after a second (its wait is bounded at 5 s).
    let exited_early = tokio::time::timeout(Duration::from_secs(1), async {
        while served.child.try_wait().unwrap().is_none() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .is_ok();
    go.send(()).unwrap();
    let written = reader.join().unwrap();
    let end = Instant::now() + BOUND;
    let status = loop {
        if let Some(status) = served.child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < end, "fencegate did not exit");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.success(), "{status}");
    assert_eq!(
        written.lines().count(),
        400,
        "exited before its log was written: {exited_early}"
    );
}
