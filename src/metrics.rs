//! Prometheus text metrics with bounded labels: route name and result, never the scope
//! (scopes are unbounded; a label per scope would be a memory leak in every scraper).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
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

    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
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
    "payload_too_large",
    "duplicate",
    "in_progress",
    "key_reused",
    "outcome_unknown",
    "unfenced",
];

pub fn result_index(result: &str) -> usize {
    RESULTS.iter().position(|r| *r == result).unwrap_or(0)
}

/// Request counts of one route, by result. Routes hold their row, so counting is one
/// atomic add; rows are kept by name, so counts survive a config reload.
#[derive(Debug)]
pub struct RouteRow {
    counts: Vec<AtomicU64>,
}

impl RouteRow {
    fn new() -> RouteRow {
        RouteRow {
            counts: RESULTS.iter().map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub fn count(&self, result: &str) {
        self.counts[result_index(result)].fetch_add(1, Relaxed);
    }

    pub fn get(&self, result: &str) -> u64 {
        self.counts[result_index(result)].load(Relaxed)
    }
}

#[derive(Debug)]
pub struct Metrics {
    /// Route name → its row; "none" counts requests that matched no route.
    rows: Mutex<Vec<(String, Arc<RouteRow>)>>,
    none: Arc<RouteRow>,
    pub gate_wait_seconds: Histogram,
    pub upstream_seconds: Histogram,
    /// Config reloads applied and refused (SIGHUP).
    pub reloads: AtomicU64,
    pub reload_failures: AtomicU64,
}

impl Metrics {
    pub fn new(route_names: impl IntoIterator<Item = String>) -> Metrics {
        let none = Arc::new(RouteRow::new());
        let m = Metrics {
            rows: Mutex::new(vec![("none".into(), none.clone())]),
            none,
            gate_wait_seconds: Histogram::new(SECONDS),
            upstream_seconds: Histogram::new(SECONDS),
            reloads: AtomicU64::new(0),
            reload_failures: AtomicU64::new(0),
        };
        for name in route_names {
            m.row(&name);
        }
        m
    }

    /// The row of a route name, created on first use.
    pub fn row(&self, name: &str) -> Arc<RouteRow> {
        let mut rows = self.rows.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, r)) = rows.iter().find(|(n, _)| n == name) {
            return r.clone();
        }
        let r = Arc::new(RouteRow::new());
        rows.push((name.to_string(), r.clone()));
        r
    }

    /// Counts a request that matched no route.
    pub fn count_unrouted(&self, result: &str) {
        self.none.count(result);
    }

    pub fn render(&self, store: &StoreStats, extra: &[(&str, &str, f64)]) -> String {
        let mut out = String::new();
        out.push_str("# HELP fencegate_requests_total Requests by route and fencing result.\n");
        out.push_str("# TYPE fencegate_requests_total counter\n");
        let rows = self.rows.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for (route, row) in &rows {
            for (result, c) in RESULTS.iter().zip(&row.counts) {
                let v = c.load(Relaxed);
                if v > 0 {
                    let _ = writeln!(
                        out,
                        "fencegate_requests_total{{route=\"{route}\",result=\"{result}\"}} {v}"
                    );
                }
            }
        }
        let stale: u64 = rows.iter().map(|(_, row)| row.get("stale_fence")).sum();
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
        for (name, help, v) in [
            (
                "fencegate_config_reloads_total",
                "Config reloads applied.",
                &self.reloads,
            ),
            (
                "fencegate_config_reload_failures_total",
                "Config reloads refused (invalid file).",
                &self.reload_failures,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Relaxed)
            );
        }
        for (name, help, value) in extra {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        }
        out
    }
}
