//! `fencegate demo` ends with the access-log line of A's refused publish: its scope, A's
//! token and the highest accepted (B's), as an operator would find it.

use std::time::Duration;

#[tokio::test]
async fn the_demo_shows_the_access_log_line_of_the_refusal() {
    let mut out = Vec::new();
    let outcome = tokio::time::timeout(Duration::from_secs(60), fencegate::demo::play(&mut out))
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
