//! The S3 compatibility suite: the subset of ceph/s3-tests in tests/s3-compat (pytest and
//! boto3, installed by `scripts/test.sh` into `target/s3-venv`) against `s3s-fs` directly,
//! then through an `api = "s3"` route in front of it. Every test that passes directly must
//! pass through fencegate with a token on every mutation, or be listed in
//! tests/s3-compat/expected.txt with the refusal that fails it (docs/S3-COMPAT.md says
//! why each is right); without tokens, a test that fails through fencegate fails on
//! `missing_token`. Once path-style, once virtual-hosted.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::s3::{ACCESS_KEY, ENDPOINT_HOST, S3sFs, SECRET_KEY, config, tool};
use crate::support;

/// How long one run of the suite may take (about 25 s each on two cores; the suite
/// bounds each of its tests to 30 s too).
const RUN_BOUND: Duration = Duration::from_secs(240);
const POLL: Duration = Duration::from_millis(50);
/// A direct run that passes fewer of the suite's tests than this share (it passes them
/// all when nothing is wrong with the setup) is not a baseline worth comparing against.
const DIRECT_FLOOR: f64 = 0.9;

fn compat_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/s3-compat")
}

/// One test's result: `passed`, `failed` or `skipped`; the refusals fencegate answered it
/// with (its `Fencing-Result` values other than `accepted`); why it failed.
#[derive(Debug)]
struct Outcome {
    outcome: String,
    refusals: Vec<String>,
    reason: String,
}

impl Outcome {
    fn passed(&self) -> bool {
        self.outcome == "passed"
    }
}

/// One run of the suite against `http://s3.test:{port}`.
struct Run<'a> {
    what: &'a str,
    port: u16,
    /// s3s-fs itself, where the suite's fixtures delete the run's buckets.
    backend: u16,
    addressing: &'a str,
    tokens: bool,
}

/// Runs the suite (bounded by [`RUN_BOUND`]); each test's outcome by name.
async fn suite(run: &Run<'_>, dir: &Path) -> BTreeMap<String, Outcome> {
    let python = tool("s3-venv/bin/python", "the s3-tests virtualenv");
    let results = dir.join(format!("{}.results", run.what));
    let log = dir.join(format!("{}.log", run.what));
    let out = std::fs::File::create(&log).expect("log file");
    let err = out.try_clone().expect("log file");
    let mut command = Command::new(python);
    command
        .args(["-m", "pytest", "-p", "no:cacheprovider", "-q", "--tb=no"])
        .arg("s3tests/functional/test_s3.py")
        .current_dir(compat_dir())
        .env("S3COMPAT_PORT", run.port.to_string())
        .env("S3COMPAT_BACKEND_PORT", run.backend.to_string())
        .env("S3COMPAT_ACCESS_KEY", ACCESS_KEY)
        .env("S3COMPAT_SECRET_KEY", SECRET_KEY)
        .env("S3COMPAT_ADDRESSING", run.addressing)
        .env("S3COMPAT_TOKENS", if run.tokens { "1" } else { "0" })
        .env("S3COMPAT_RESULTS", &results)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        // Loopback only: no proxy from the environment, no AWS profile or its settings.
        .env("NO_PROXY", "*")
        .env("AWS_CONFIG_FILE", "/dev/null")
        .env("AWS_SHARED_CREDENTIALS_FILE", "/dev/null");
    for name in [
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "AWS_PROFILE",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
    ] {
        command.env_remove(name);
    }
    let mut child = command
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("spawn pytest");
    let deadline = Instant::now() + RUN_BOUND;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait pytest") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{}: the suite took over {RUN_BOUND:?}:\n{}",
                run.what,
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        // The proxy runs on this runtime's other thread meanwhile.
        tokio::time::sleep(POLL).await;
    };
    // pytest exits 0 when every test passed, 1 when some failed; anything else is an
    // error of the run itself.
    let text = std::fs::read_to_string(&results).unwrap_or_default();
    assert!(
        matches!(status.code(), Some(0 | 1)) && !text.is_empty(),
        "{}: pytest failed ({status}):\n{}",
        run.what,
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    text.lines()
        .map(|line| {
            let mut fields = line.splitn(4, '\t');
            let mut next = || fields.next().unwrap_or_default().to_string();
            let (name, outcome, refusals, reason) = (next(), next(), next(), next());
            let refusals = refusals
                .split(',')
                .filter(|r| *r != "-" && !r.is_empty())
                .map(str::to_string)
                .collect();
            (
                name,
                Outcome {
                    outcome,
                    refusals,
                    reason,
                },
            )
        })
        .collect()
}

/// tests/s3-compat/expected.txt: each listed test and the refusal that fails it.
fn expected() -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(compat_dir().join("expected.txt")).expect("expected.txt");
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let mut fields = l.split('\t');
            let name = fields.next().unwrap_or_default().to_string();
            let refusal = fields.next().unwrap_or_default().to_string();
            assert!(!refusal.is_empty(), "expected.txt: no refusal in `{l}`");
            (name, refusal)
        })
        .collect()
}

fn count(results: &BTreeMap<String, Outcome>) -> String {
    let passed = results.values().filter(|o| o.passed()).count();
    format!("{passed} passed, {} not", results.len() - passed)
}

/// The suite directly against s3s-fs, then through fencegate with a token on every
/// mutation and without any, with `addressing` ("path" or "virtual"); fails on every way a
/// result through fencegate departs from the rules above, naming each.
async fn compare(addressing: &str) {
    let (backend, listen) = (support::free_port(), support::free_port());
    let s3 = S3sFs::start(
        backend,
        &[
            &format!("{ENDPOINT_HOST}:{backend}"),
            &format!("{ENDPOINT_HOST}:{listen}"),
        ],
    );
    let dir = tempfile::tempdir().expect("dir");
    let run = |what, port, tokens| Run {
        what,
        port,
        backend,
        addressing,
        tokens,
    };
    let direct = suite(&run("direct", backend, false), dir.path()).await;
    let proxy = support::start_text(&config(s3.addr, listen), dir.path()).await;
    let tokens = suite(&run("tokens", listen, true), dir.path()).await;
    let tokenless = suite(&run("tokenless", listen, false), dir.path()).await;
    proxy.shutdown().await;

    let expected = expected();
    let mut problems = String::new();
    let baseline: Vec<&String> = direct
        .iter()
        .filter(|(_, o)| o.passed())
        .map(|(n, _)| n)
        .collect();
    println!(
        "{addressing}: direct {}; through fencegate with tokens {}; tokenless {}",
        count(&direct),
        count(&tokens),
        count(&tokenless)
    );
    for (name, o) in direct.iter().filter(|(_, o)| !o.passed()) {
        println!(
            "{addressing}: not passed directly (not compared): {name}: {}",
            o.reason
        );
    }
    if (baseline.len() as f64) < DIRECT_FLOOR * direct.len() as f64 {
        let _ = writeln!(
            problems,
            "only {} of {} tests pass directly",
            baseline.len(),
            direct.len()
        );
    }
    for name in &baseline {
        let missing = Outcome {
            outcome: "missing".into(),
            refusals: Vec::new(),
            reason: "no result".into(),
        };
        let through = tokens.get(*name).unwrap_or(&missing);
        match expected.get(*name) {
            None if !through.passed() => {
                let _ = writeln!(
                    problems,
                    "{name}: passes directly, {} through fencegate (refusals {:?}): {}",
                    through.outcome, through.refusals, through.reason
                );
            }
            Some(refusal) if through.passed() => {
                let _ = writeln!(
                    problems,
                    "{name}: listed in expected.txt ({refusal}) but passes through fencegate"
                );
            }
            Some(refusal) if !through.refusals.contains(refusal) => {
                let _ = writeln!(
                    problems,
                    "{name}: expected to fail on {refusal}, failed with refusals {:?}: {}",
                    through.refusals, through.reason
                );
            }
            _ => {}
        }
        let without = tokenless.get(*name).unwrap_or(&missing);
        if !without.passed() && !without.refusals.iter().any(|r| r == "missing_token") {
            let _ = writeln!(
                problems,
                "{name}: passes directly, {} through fencegate without tokens, not on missing_token (refusals {:?}): {}",
                without.outcome, without.refusals, without.reason
            );
        }
    }
    for name in expected.keys() {
        if !direct.contains_key(name) {
            let _ = writeln!(problems, "{name}: listed in expected.txt, not in the suite");
        }
    }
    assert!(
        problems.is_empty(),
        "{addressing}: through fencegate:\n{problems}"
    );
    drop(s3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_tests_through_fencegate_path_style() {
    compare("path").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_tests_through_fencegate_virtual_hosted() {
    compare("virtual").await;
}
