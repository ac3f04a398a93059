//! Prometheus text metrics with bounded labels: route name and result, never the scope
//! (scopes are unbounded; a label per scope would be a memory leak in every scraper).
//! This module holds the request series and the histogram; each subsystem renders its own
//! series ([`FmtMetrics`]: the store's commits, the authority's leases, the cluster's
//! shards) and the admin listener's `/metrics` composes them in one call to
//! [`Metrics::render`]. Plumbing: it imports nothing of the domain.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

pub mod histogram;
pub use histogram::{BATCH, Histogram, SECONDS};
use histogram::{Padded, SHARDS, shard};
/// A subsystem's series in Prometheus' text format, rendered by the subsystem that owns
/// them and composed by [`Metrics::render`].
pub trait FmtMetrics {
    fn fmt_metrics(&self, out: &mut String);
}

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
    "stale_sequence",
    "unfenced",
    // Handed to the shard's owner in a cluster, which counts its own result (SPEC §10).
    "forwarded_to_owner",
];

pub fn result_index(result: &str) -> usize {
    RESULTS.iter().position(|r| *r == result).unwrap_or(0)
}

/// The `method` label values of `fencegate_route_operations_total`: a bounded set, every
/// other method is `other`.
pub const METHODS: [&str; 8] = [
    "GET", "HEAD", "PUT", "POST", "DELETE", "PATCH", "OPTIONS", "other",
];

/// A request's method as an index into [`METHODS`]: standard methods compare as enum
/// values (no string hashing, no allocation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Op(u8);

impl Op {
    pub fn of(method: &http::Method) -> Op {
        use http::Method;
        let i = if *method == Method::GET {
            0
        } else if *method == Method::HEAD {
            1
        } else if *method == Method::PUT {
            2
        } else if *method == Method::POST {
            3
        } else if *method == Method::DELETE {
            4
        } else if *method == Method::PATCH {
            5
        } else if *method == Method::OPTIONS {
            6
        } else {
            7
        };
        Op(i)
    }
}

/// Request counts of one route, by method and result. Routes hold their row, so counting
/// is one atomic add (at an index: the method's row, the result's column); rows are kept
/// by name, so counts survive a config reload.
#[derive(Debug)]
pub struct RouteRow {
    shards: Box<[Padded<[[AtomicU64; RESULTS.len()]; METHODS.len()]>]>,
}

impl RouteRow {
    fn new() -> RouteRow {
        RouteRow {
            shards: (0..SHARDS).map(|_| Padded::default()).collect(),
        }
    }

    pub fn count(&self, op: Op, result: &str) {
        self.shards[shard()].0[usize::from(op.0)][result_index(result)].fetch_add(1, Relaxed);
    }

    /// Requests that ended in `result`, every method.
    pub fn get(&self, result: &str) -> u64 {
        let i = result_index(result);
        self.shards
            .iter()
            .flat_map(|s| s.0.iter().map(move |m| m[i].load(Relaxed)))
            .sum()
    }

    fn get_op(&self, method: usize, result: usize) -> u64 {
        self.shards
            .iter()
            .map(|s| s.0[method][result].load(Relaxed))
            .sum()
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
    pub fn count_unrouted(&self, op: Op, result: &str) {
        self.none.count(op, result);
    }

    /// The exposition: the request series, then each subsystem's `parts` in order, then
    /// the `extra` gauges read at the time of the scrape.
    pub fn render(&self, parts: &[&dyn FmtMetrics], extra: &[(&str, &str, f64)]) -> String {
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
        out.push_str(
            "# HELP fencegate_route_operations_total Requests by route, method (GET HEAD PUT POST DELETE PATCH OPTIONS, else other) and result.\n",
        );
        out.push_str("# TYPE fencegate_route_operations_total counter\n");
        for (route, row) in &rows {
            let route = label_value(route);
            for (m, method) in METHODS.iter().enumerate() {
                for (r, result) in RESULTS.iter().enumerate() {
                    let v = row.get_op(m, r);
                    if v > 0 {
                        let _ = writeln!(
                            out,
                            "fencegate_route_operations_total{{route=\"{route}\",method=\"{method}\",result=\"{result}\"}} {v}"
                        );
                    }
                }
            }
        }
        let stale: u64 = rows.iter().map(|(_, row)| row.get("stale_fence")).sum();
        out.push_str(
            "# HELP fencegate_stale_rejections_total Requests refused with stale_fence.\n",
        );
        out.push_str("# TYPE fencegate_stale_rejections_total counter\n");
        let _ = writeln!(out, "fencegate_stale_rejections_total {stale}");
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
        for part in parts {
            part.fmt_metrics(&mut out);
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
        m.row("a\"b\\c\nfencegate_forged 1")
            .count(Op::of(&http::Method::PUT), "accepted");
        let text = m.render(&[], &[]);
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
