//! deploy/ against what fencegate exports: every metric name that the alert rules
//! (deploy/prometheus) and the dashboard (deploy/grafana) use is one that `/metrics` of a
//! running server with a lease authority prints, so a renamed metric fails here instead
//! of silencing an alert. (`promtool check rules` and `promtool test rules` check the
//! rules themselves; scripts/test.sh runs them.)

use crate::support;

use std::collections::BTreeSet;
use std::path::Path;

use support::{Client, Double};

/// Every `fencegate_…` name in `text`.
fn names_in(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("fencegate_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        // A name, not the inside of a longer word.
        let before = rest[..at].chars().next_back();
        if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            names.insert(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    names
}

/// The series names a scrape holds: each sample's name, and a histogram's `_bucket`,
/// `_sum` and `_count` from its `# TYPE` line.
fn exported(scrape: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in scrape.lines() {
        if let Some(t) = line.strip_prefix("# TYPE ") {
            let mut parts = t.split(' ');
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            names.insert(name.to_string());
            if kind == "histogram" {
                for s in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{s}"));
                }
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_string());
        }
    }
    names
}

/// The `expr` of every panel target, walked out of the dashboard JSON.
fn exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(e)) => out.push(e.clone()),
                    _ => exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| exprs(v, out)),
        _ => {}
    }
}

#[tokio::test]
async fn rules_and_dashboard_use_only_exported_metric_names() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    let rules = std::fs::read_to_string(root.join("prometheus/fencegate.rules.yml"))
        .expect("deploy/prometheus/fencegate.rules.yml");
    let dashboard_text =
        std::fs::read_to_string(root.join("grafana/fencegate.json")).expect("dashboard");
    let dashboard: serde_json::Value =
        serde_json::from_str(&dashboard_text).expect("deploy/grafana/fencegate.json parses");
    let mut panel_exprs = Vec::new();
    exprs(&dashboard, &mut panel_exprs);
    assert!(panel_exprs.len() >= 10, "{panel_exprs:?}");

    // A server with routes and an authority, after one request of each kind, so that
    // every series family is there.
    let dir = tempfile::tempdir().unwrap();
    let upstream = Double::start().await;
    let text = support::config_text(upstream.addr, "10s", "0s", "10s")
        + "\n[authority]\nlisten = \"127.0.0.1:0\"\nmax_ttl = \"60s\"\n";
    let config =
        fencegate::settings::Config::parse(&text, dir.path()).unwrap_or_else(|e| panic!("{e}"));
    let running = support::start(config).await;
    let proxy = Client::new(running.proxy_addr);
    assert_eq!(proxy.put("/reports/r/a", "5", "x").await.status, 200);
    assert_eq!(proxy.put("/reports/r/a", "4", "x").await.status, 409);
    let scrape = Client::new(running.admin_addr).get("/metrics").await.body;
    let exported = exported(&scrape);

    let used_by_rules = names_in(&rules);
    let used_by_dashboard: BTreeSet<String> =
        panel_exprs.iter().flat_map(|e| names_in(e)).collect();
    for (what, used) in [("rules", &used_by_rules), ("dashboard", &used_by_dashboard)] {
        let unknown: Vec<_> = used.difference(&exported).collect();
        assert!(
            unknown.is_empty(),
            "the {what} use metrics that fencegate does not export: {unknown:?}\nexported: {exported:?}"
        );
    }
    // What each must watch (what deploy/ is for): a rename on either side shows here.
    for name in [
        "fencegate_stale_rejections_total",
        "fencegate_store_failed",
        "fencegate_requests_total",
        "fencegate_authority_expiries_total",
        "fencegate_mark_commit_seconds_bucket",
    ] {
        assert!(used_by_rules.contains(name), "rules do not use {name}");
    }
    for name in [
        "fencegate_requests_total",
        "fencegate_stale_rejections_total",
        "fencegate_mark_commit_seconds_bucket",
        "fencegate_gate_wait_seconds_bucket",
        "fencegate_authority_acquisitions_total",
        "fencegate_authority_expiries_total",
        "fencegate_authority_renewals_total",
        "fencegate_store_failed",
    ] {
        assert!(
            used_by_dashboard.contains(name),
            "dashboard does not use {name}"
        );
    }
    running.shutdown().await;
}

/// The name scan itself: names inside expressions and text, not inside longer words.
#[test]
fn names_are_scanned_out_of_expressions() {
    let got = names_in(
        "sum(rate(fencegate_requests_total{a=\"b\"}[5m])) / x_fencegate_no + fencegate_store_failed",
    );
    assert_eq!(
        got.into_iter().collect::<Vec<_>>(),
        ["fencegate_requests_total", "fencegate_store_failed"]
    );
}
