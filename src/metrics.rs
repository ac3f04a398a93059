//! Prometheus text metrics with bounded labels: route name and result, never the scope
//! (scopes are unbounded; a label per scope would be a memory leak in every scraper).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::fence::marks::StoreStats;

/// Counter shards: each thread adds to its own (on its own cache line), so the proxy
/// workers do not pass counter cache lines back and forth on every request; a scrape
/// sums them.
const SHARDS: usize = 8;
/// Most buckets a histogram may have.
const MAX_BUCKETS: usize = 20;

static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static SHARD: usize = NEXT_SHARD.fetch_add(1, Relaxed) % SHARDS;
}

fn shard() -> usize {
    SHARD.try_with(|s| *s).unwrap_or(0)
}

/// One cache line (two, against adjacent-line prefetch) per shard.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Padded<T>(T);

#[derive(Debug, Default)]
struct HistogramShard {
    counts: [AtomicU64; MAX_BUCKETS],
    sum_micros: AtomicU64,
    count: AtomicU64,
}

/// A fixed-bucket histogram; buckets are upper bounds in the unit of the caller.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    shards: Box<[Padded<HistogramShard>]>,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        assert!(bounds.len() <= MAX_BUCKETS, "too many histogram buckets");
        Histogram {
            bounds,
            shards: (0..SHARDS).map(|_| Padded::default()).collect(),
        }
    }

    pub fn observe(&self, value: f64) {
        let shard = &self.shards[shard()].0;
        if let Some(i) = self.bounds.iter().position(|b| value <= *b) {
            shard.counts[i].fetch_add(1, Relaxed);
        }
        shard.count.fetch_add(1, Relaxed);
        shard.sum_micros.fetch_add((value * 1e6) as u64, Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.shards.iter().map(|s| s.0.count.load(Relaxed)).sum()
    }

    pub fn observe_duration(&self, d: Duration) {
        self.observe(d.as_secs_f64());
    }

    fn bucket(&self, i: usize) -> u64 {
        self.shards
            .iter()
            .map(|s| s.0.counts[i].load(Relaxed))
            .sum()
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, b) in self.bounds.iter().enumerate() {
            cumulative += self.bucket(i);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        let count = self.count();
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum_micros: u64 = self
            .shards
            .iter()
            .map(|s| s.0.sum_micros.load(Relaxed))
            .sum();
        let _ = writeln!(out, "{name}_sum {}", sum_micros as f64 / 1e6);
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
    "invalid_proof",
    "unfenced",
];

pub fn result_index(result: &str) -> usize {
    RESULTS.iter().position(|r| *r == result).unwrap_or(0)
}

/// Request counts of one route, by result. Routes hold their row, so counting is one
/// atomic add; rows are kept by name, so counts survive a config reload.
#[derive(Debug)]
pub struct RouteRow {
    shards: Box<[Padded<[AtomicU64; RESULTS.len()]>]>,
}

impl RouteRow {
    fn new() -> RouteRow {
        RouteRow {
            shards: (0..SHARDS).map(|_| Padded::default()).collect(),
        }
    }

    pub fn count(&self, result: &str) {
        self.shards[shard()].0[result_index(result)].fetch_add(1, Relaxed);
    }

    pub fn get(&self, result: &str) -> u64 {
        let i = result_index(result);
        self.shards.iter().map(|s| s.0[i].load(Relaxed)).sum()
    }
}

/// The row of requests that matched no route; config validation keeps routes from this
/// name.
pub const UNROUTED: &str = "none";

/// A label value in the Prometheus text format: backslash, double quote and line feed
/// escaped (route names come from the config file and may hold any of them).
fn label_value(v: &str) -> std::borrow::Cow<'_, str> {
    if !v.contains(['\\', '"', '\n']) {
        return v.into();
    }
    let mut out = String::with_capacity(v.len() + 2);
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.into()
}

#[derive(Debug)]
pub struct Metrics {
    /// Route name → its row; [`UNROUTED`] counts requests that matched no route.
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
            rows: Mutex::new(vec![(UNROUTED.into(), none.clone())]),
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
            let route = label_value(route);
            for result in RESULTS {
                let v = row.get(result);
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
        out.push_str(
            "# HELP fencegate_mark_checkpoints_total Checkpoints of the mark journal into the store.\n",
        );
        out.push_str("# TYPE fencegate_mark_checkpoints_total counter\n");
        let _ = writeln!(
            out,
            "fencegate_mark_checkpoints_total {}",
            store.checkpoints.load(Relaxed)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Route names are label values: quotes, backslashes and line feeds are escaped, so
    /// one name cannot break the exposition or forge a series.
    #[test]
    fn route_names_are_escaped_as_label_values() {
        let m = Metrics::new(["a\"b\\c\nfencegate_forged 1".to_string()]);
        m.row("a\"b\\c\nfencegate_forged 1").count("accepted");
        let text = m.render(&StoreStats::default(), &[]);
        assert!(
            text.contains(
                "fencegate_requests_total{route=\"a\\\"b\\\\c\\nfencegate_forged 1\",result=\"accepted\"} 1\n"
            ),
            "{text}"
        );
        assert!(
            !text.lines().any(|l| l.starts_with("fencegate_forged")),
            "{text}"
        );
        assert_eq!(label_value("plain"), "plain");
    }
}
