//! `fencegate_route_operations_total{route,method,result}` over real requests: each
//! request counted once under its route, its method (a bounded set, else `other`) and its
//! result, next to `fencegate_requests_total{route,result}` (which keeps its labels).

use crate::support;

use support::{Client, Double, metric};

#[tokio::test]
async fn requests_are_counted_by_route_method_and_result() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Double::start().await;
    let running = support::start(support::config(upstream.addr, dir.path())).await;
    let proxy = Client::new(running.proxy_addr);
    let mut expected: Vec<(String, String, String)> = Vec::new();
    let mut send = async |method: &str, path: &str, token: Option<&str>| {
        let headers: Vec<(&str, &str)> = token.map(|t| ("fencing-token", t)).into_iter().collect();
        let r = proxy.send(method, path, &headers, "").await;
        // A request forwarded unfenced carries no Fencing-Result.
        let result = match r.result() {
            "" if r.status < 300 => "unfenced".to_string(),
            "" => panic!("{method} {path}: {r:?}"),
            result => result.to_string(),
        };
        expected.push((path.to_string(), method.to_string(), result));
    };
    send("PUT", "/reports/r/a", Some("5")).await;
    send("PUT", "/reports/r/a", Some("6")).await;
    send("PUT", "/reports/r/a", Some("4")).await;
    send("DELETE", "/reports/r/a", Some("4")).await;
    send("GET", "/reports/r/a", None).await;
    send("PROPFIND", "/reports/r/a", None).await;
    send("PUT", "/nowhere", Some("1")).await;
    let m = Client::new(running.admin_addr).get("/metrics").await.body;

    let label = |method: &str| {
        if ["GET", "HEAD", "PUT", "POST", "DELETE", "PATCH", "OPTIONS"].contains(&method) {
            method.to_string()
        } else {
            "other".to_string()
        }
    };
    let route_of = |path: &str| {
        if path == "/nowhere" {
            "none"
        } else {
            "reports"
        }
    };
    let mut counts = std::collections::BTreeMap::new();
    for (path, method, result) in &expected {
        *counts
            .entry((route_of(path), label(method), result.clone()))
            .or_insert(0.0) += 1.0;
    }
    assert_eq!(
        counts[&("reports", "PUT".to_string(), "accepted".to_string())],
        2.0
    );
    assert_eq!(
        counts[&("reports", "PUT".to_string(), "stale_fence".to_string())],
        1.0
    );
    assert!(counts.keys().any(|(_, m, _)| m == "other"), "{counts:?}");
    for ((route, method, result), n) in &counts {
        let series = format!(
            "fencegate_route_operations_total{{route=\"{route}\",method=\"{method}\",result=\"{result}\"}}"
        );
        assert_eq!(metric(&m, &series), Some(*n), "{series}\n{m}");
    }
    let series_count = m
        .lines()
        .filter(|l| l.starts_with("fencegate_route_operations_total{"))
        .count();
    assert_eq!(series_count, counts.len(), "{m}");
    // requests_total keeps its labels: the same requests, summed over methods.
    assert_eq!(
        metric(
            &m,
            "fencegate_requests_total{route=\"reports\",result=\"accepted\"}"
        ),
        Some(2.0)
    );
    assert_eq!(
        metric(
            &m,
            "fencegate_requests_total{route=\"reports\",result=\"stale_fence\"}"
        ),
        Some(counts[&("reports", "DELETE".to_string(), "stale_fence".to_string())] + 1.0)
    );
    running.shutdown().await;
}
