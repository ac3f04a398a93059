//! `fencegate demo` (the README's first command) tells the real story: its tokens come
//! from the built-in lease authority, A's lease really expires, A's late publish is
//! refused `stale_fence` at the proxy, the store keeps B's report, and the metric that
//! counted the refusal is shown; it ends with the access-log line of that refusal.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fencegate::token::Token;
use http::StatusCode;

/// Far above the demo's run time (about a second), so only a hung demo reaches it.
const BOUND: Duration = Duration::from_secs(60);

/// The token printed after `marker` on the line that contains it.
fn token_after(text: &str, marker: &str) -> Token {
    let line = text
        .lines()
        .find(|l| l.contains(marker))
        .unwrap_or_else(|| panic!("no line with {marker:?} in:\n{text}"));
    let rest = &line[line.find(marker).unwrap() + marker.len()..];
    let raw = rest.split([' ', ',']).next().unwrap_or_default();
    raw.parse()
        .unwrap_or_else(|e| panic!("{raw:?} in {line:?} is not a token: {e:?}"))
}

fn line_with<'a>(text: &'a str, needle: &str) -> &'a str {
    text.lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no line with {needle:?} in:\n{text}"))
}

/// What the printed story must show; answers the tokens it names.
fn check_story(text: &str) -> (Token, Token) {
    let a = token_after(text, "A acquires report/july from the authority: token ");
    let b = token_after(text, "the authority grants B report/july: token ");
    assert!(a < b, "B's token {b} must follow A's {a}:\n{text}");
    let through = text.split("\n2) ").next().unwrap();
    assert!(
        line_with(through, "B PUT /reports/july/final")
            .ends_with("204 No Content Fencing-Result: accepted"),
        "{text}"
    );
    assert!(
        line_with(
            through,
            &format!("A PUT /reports/july/final with token {a}")
        )
        .ends_with("409 Conflict Fencing-Result: stale_fence"),
        "{text}"
    );
    assert!(
        line_with(through, "GET /reports/july/final")
            .ends_with(&format!("200 OK \"report by B (token {b})\"")),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "Through fencegate the published report is \"report by B (token {b})\""
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "Straight to the store it is \"report by A (token {a})\""
        )),
        "{text}"
    );
    // The counter may come to carry labels; its value is A's one refusal.
    let metric = line_with(text, "fencegate_stale_rejections_total");
    assert!(
        metric
            .trim()
            .starts_with("fencegate_stale_rejections_total")
            && metric.ends_with(" 1"),
        "{text}"
    );
    (a, b)
}

/// The story in-process: what the demo saw, and what it printed about it.
#[tokio::test]
async fn the_demo_plays_on_the_authority_and_fences_out_the_paused_writer() {
    let mut out = Vec::new();
    let outcome = tokio::time::timeout(BOUND, fencegate::cli::demo::play(&mut out))
        .await
        .expect("the demo finishes")
        .expect("the demo runs");
    let text = String::from_utf8(out).unwrap();
    let (a, b) = check_story(&text);
    assert_eq!((outcome.a_token, outcome.b_token), (a, b), "{text}");
    // The route requires proofs, so the proxy accepted B's token (and weighed A's against
    // it, rather than refusing it invalid_proof) only because the authority signed them:
    // with the key whose id the demo printed.
    let key_id = text
        .split("signing tokens with key ")
        .nth(1)
        .and_then(|r| r.split('.').next())
        .unwrap_or_else(|| panic!("no key id in:\n{text}"));
    for proof in [&outcome.a_proof, &outcome.b_proof] {
        let proof = proof.as_deref().expect("the authority signed the token");
        assert!(proof.starts_with(&format!("v1.{key_id}.")), "{proof}");
    }
    assert_eq!(
        outcome.stale,
        (StatusCode::CONFLICT, "stale_fence".to_string())
    );
    assert_eq!(outcome.through, format!("report by B (token {b})"));
    assert_eq!(outcome.straight, format!("report by A (token {a})"));
    assert!(!outcome.metric_lines.is_empty());
    for line in &outcome.metric_lines {
        assert!(line.ends_with(" 1"), "{line}");
    }
    assert!(outcome.as_expected());
}

/// The command itself, as the README's quick start runs it: exit 0, the same story.
#[test]
fn fencegate_demo_prints_the_real_story() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .arg("demo")
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("fencegate starts");
    let deadline = Instant::now() + BOUND;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("fencegate demo did not exit within {BOUND:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let output = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        status.success(),
        "{status}\n{text}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    check_story(&text);
}

/// `fencegate demo` ends with the access-log line of A's refused publish: its scope, A's
/// token and the highest accepted (B's), as an operator would find it.
#[tokio::test]
async fn the_demo_shows_the_access_log_line_of_the_refusal() {
    let mut out = Vec::new();
    let outcome = tokio::time::timeout(
        Duration::from_secs(60),
        fencegate::cli::demo::play(&mut out),
    )
    .await
    .expect("the demo finishes")
    .expect("the demo runs");
    let text = String::from_utf8(out).unwrap();
    let records = text
        .split("What recorded A's refusal:")
        .nth(1)
        .unwrap_or_else(|| panic!("no records section in:\n{text}"));
    let line = records
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no access-log line in:\n{text}"));
    let entry: serde_json::Value =
        serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
    assert_eq!(entry["result"], "stale_fence", "{line}");
    assert_eq!(entry["status"], 409, "{line}");
    assert_eq!(entry["method"], "PUT", "{line}");
    assert_eq!(entry["route"], "reports", "{line}");
    assert_eq!(entry["scope"], "report/july", "{line}");
    assert_eq!(entry["token"], outcome.a_token.to_string(), "{line}");
    assert_eq!(entry["highest"], outcome.b_token.to_string(), "{line}");
    assert!(entry["request_id"].as_str().is_some_and(|s| !s.is_empty()));
}
