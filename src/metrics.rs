//! Prometheus text metrics with bounded labels: route name and result, never the scope
//! (scopes are unbounded; a label per scope would be a memory leak in every scraper).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::fence::marks::StoreStats;

/// A fixed-bucket histogram; buckets are upper bounds in the unit of the caller.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, value: f64) {
        if let Some(i) = self.bounds.iter().position(|b| value <= *b) {
            self.counts[i].fetch_add(1, Relaxed);
        }
        self.count.fetch_add(1, Relaxed);
        self.sum_micros.fetch_add((value * 1e6) as u64, Relaxed);
    }

    pub fn observe_duration(&self, d: Duration) {
        self.observe(d.as_secs_f64());
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cumulative += c.load(Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        let count = self.count.load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.sum_micros.load(Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count {count}");
    }
}

pub const SECONDS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0,
];
pub const BATCH: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0, 4096.0,
];

/// Every result a request can end in; the label values of `fencegate_requests_total`.
pub const RESULTS: &[&str] = &[
    "accepted",
    "stale_fence",
    "missing_token",
    "invalid_token",
    "scope_mismatch",
    "invalid_path",
    "invalid_request",
    "no_route",
    "draining",
    "unavailable",
    "upstream_unavailable",
    "upstream_timeout",
    "unfenced",
];

pub fn result_index(result: &str) -> usize {
    RESULTS.iter().position(|r| *r == result).unwrap_or(0)
}

#[derive(Debug)]
pub struct Metrics {
    /// Route names in config order, plus "none" for requests that matched no route.
    routes: Vec<String>,
    /// `requests[route][result]`.
    requests: Vec<Vec<AtomicU64>>,
    pub gate_wait_seconds: Histogram,
    pub upstream_seconds: Histogram,
}

impl Metrics {
    pub fn new(route_names: impl IntoIterator<Item = String>) -> Metrics {
        let mut routes: Vec<String> = route_names.into_iter().collect();
        routes.push("none".into());
        let requests = routes
            .iter()
            .map(|_| RESULTS.iter().map(|_| AtomicU64::new(0)).collect())
            .collect();
        Metrics {
            routes,
            requests,
            gate_wait_seconds: Histogram::new(SECONDS),
            upstream_seconds: Histogram::new(SECONDS),
        }
    }

    /// `route` is the route index, or `None` for requests that matched no route.
    pub fn count(&self, route: Option<usize>, result: &str) {
        let r = route
            .unwrap_or(self.routes.len() - 1)
            .min(self.routes.len() - 1);
        self.requests[r][result_index(result)].fetch_add(1, Relaxed);
    }

    pub fn requests(&self, route: Option<usize>, result: &str) -> u64 {
        let r = route
            .unwrap_or(self.routes.len() - 1)
            .min(self.routes.len() - 1);
        self.requests[r][result_index(result)].load(Relaxed)
    }

    pub fn render(&self, store: &StoreStats, extra: &[(&str, &str, f64)]) -> String {
        let mut out = String::new();
        out.push_str("# HELP fencegate_requests_total Requests by route and fencing result.\n");
        out.push_str("# TYPE fencegate_requests_total counter\n");
        for (route, row) in self.routes.iter().zip(&self.requests) {
            for (result, c) in RESULTS.iter().zip(row) {
                let v = c.load(Relaxed);
                if v > 0 {
                    let _ = writeln!(
                        out,
                        "fencegate_requests_total{{route=\"{route}\",result=\"{result}\"}} {v}"
                    );
                }
            }
        }
        let stale: u64 = self
            .requests
            .iter()
            .map(|row| row[result_index("stale_fence")].load(Relaxed))
            .sum();
        out.push_str(
            "# HELP fencegate_stale_rejections_total Requests refused with stale_fence.\n",
        );
        out.push_str("# TYPE fencegate_stale_rejections_total counter\n");
        let _ = writeln!(out, "fencegate_stale_rejections_total {stale}");
        store.commit_seconds.render(
            &mut out,
            "fencegate_mark_commit_seconds",
            "Time of one durable mark commit (one batch).",
        );
        store.commit_batch_size.render(
            &mut out,
            "fencegate_mark_commit_batch_size",
            "Mark advances served by one commit (group commit).",
        );
        out.push_str("# HELP fencegate_mark_commit_failures_total Failed mark commits.\n");
        out.push_str("# TYPE fencegate_mark_commit_failures_total counter\n");
        let _ = writeln!(
            out,
            "fencegate_mark_commit_failures_total {}",
            store.commit_failures.load(Relaxed)
        );
        self.gate_wait_seconds.render(
            &mut out,
            "fencegate_gate_wait_seconds",
            "Time a request waited at its scope's gate for an older generation to drain.",
        );
        self.upstream_seconds.render(
            &mut out,
            "fencegate_upstream_seconds",
            "Time to the upstream's response head.",
        );
        for (name, help, value) in extra {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        }
        out
    }
}
