//! Prometheus text metrics with bounded labels: route name and result, never the scope
//! (scopes are unbounded; a label per scope would be a memory leak in every scraper).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::store::marks::StoreStats;

pub mod histogram;
pub use histogram::{BATCH, Histogram, SECONDS};
use histogram::{Padded, SHARDS, shard};
/// Lease authority answer times: an acquire may wait up to `MAX_WAIT` (300 s).
pub const WAIT_SECONDS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0,
];
/// Lease ages at their end.
pub const LEASE_SECONDS: &[f64] = &[
    0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0,
];

/// Results of `POST /v1/locks/acquire`: the label values of
/// `fencegate_authority_acquisitions_total`.
pub const ACQUIRE_RESULTS: [&str; 6] = [
    "acquired",
    "busy",
    "unavailable",
    "forbidden",
    "unauthenticated",
    "invalid",
];

/// What the lease authority counts (SPEC §8), both backends alike; rendered on the admin
/// listener's `/metrics` of the process that runs the authority. Not on a hot path (every
/// grant is a durable commit or an etcd round trip), so plain atomics.
#[derive(Debug)]
pub struct AuthorityMetrics {
    /// Set when the authority starts: only then are its series rendered.
    enabled: std::sync::atomic::AtomicBool,
    acquisitions: [AtomicU64; ACQUIRE_RESULTS.len()],
    pub acquire_seconds: Histogram,
    renewed: AtomicU64,
    renew_lost: AtomicU64,
    released: AtomicU64,
    release_lost: AtomicU64,
    expiries: AtomicU64,
    age_released: Histogram,
    age_expired: Histogram,
    /// (epoch, counter) of the last token granted, any scope.
    last_token: Mutex<Option<(u64, u64)>>,
    epoch: AtomicU64,
}

impl Default for AuthorityMetrics {
    fn default() -> AuthorityMetrics {
        AuthorityMetrics {
            enabled: Default::default(),
            acquisitions: Default::default(),
            acquire_seconds: Histogram::new(WAIT_SECONDS),
            renewed: AtomicU64::new(0),
            renew_lost: AtomicU64::new(0),
            released: AtomicU64::new(0),
            release_lost: AtomicU64::new(0),
            expiries: AtomicU64::new(0),
            age_released: Histogram::new(LEASE_SECONDS),
            age_expired: Histogram::new(LEASE_SECONDS),
            last_token: Mutex::new(None),
            epoch: AtomicU64::new(0),
        }
    }
}

impl AuthorityMetrics {
    /// The authority runs in this process: render its series.
    pub fn enable(&self) {
        self.enabled.store(true, Relaxed);
    }

    /// One acquire answered with `result` (one of [`ACQUIRE_RESULTS`]) after `took`.
    pub fn acquire(&self, result: &str, took: Duration) {
        let i = ACQUIRE_RESULTS
            .iter()
            .position(|r| *r == result)
            .unwrap_or(ACQUIRE_RESULTS.len() - 1);
        self.acquisitions[i].fetch_add(1, Relaxed);
        self.acquire_seconds.observe_duration(took);
    }

    pub fn acquisitions(&self, result: &str) -> u64 {
        ACQUIRE_RESULTS
            .iter()
            .position(|r| *r == result)
            .map_or(0, |i| self.acquisitions[i].load(Relaxed))
    }

    /// A token granted: the last-token gauges, and the epoch of new tokens.
    pub fn granted(&self, epoch: u64, counter: u64) {
        *self.last_token.lock().unwrap_or_else(|p| p.into_inner()) = Some((epoch, counter));
        self.epoch.fetch_max(epoch, Relaxed);
    }

    /// The epoch of new tokens, as the backend knows it (at start-up, or read from etcd).
    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.fetch_max(epoch, Relaxed);
    }

    pub fn renewal(&self, renewed: bool) {
        let c = if renewed {
            &self.renewed
        } else {
            &self.renew_lost
        };
        c.fetch_add(1, Relaxed);
    }

    pub fn release(&self, released: bool) {
        let c = if released {
            &self.released
        } else {
            &self.release_lost
        };
        c.fetch_add(1, Relaxed);
    }

    /// A lease ended by its holder's release, `age` after its grant.
    pub fn ended_by_release(&self, age: Duration) {
        self.age_released.observe_duration(age);
    }

    /// A lease ended by expiry, without a release (its holder stopped renewing).
    pub fn ended_by_expiry(&self, age: Duration) {
        self.expiries.fetch_add(1, Relaxed);
        self.age_expired.observe_duration(age);
    }

    pub fn expiries(&self) -> u64 {
        self.expiries.load(Relaxed)
    }

    fn render(&self, out: &mut String) {
        if !self.enabled.load(Relaxed) {
            return;
        }
        let mut counter = |name: &str, help: &str, rows: &[(&str, u64)]| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (labels, v) in rows {
                let _ = writeln!(out, "{name}{labels} {v}");
            }
        };
        let acquisitions: Vec<(String, u64)> = ACQUIRE_RESULTS
            .iter()
            .zip(&self.acquisitions)
            .map(|(r, c)| (format!("{{result=\"{r}\"}}"), c.load(Relaxed)))
            .collect();
        let rows: Vec<(&str, u64)> = acquisitions.iter().map(|(l, v)| (l.as_str(), *v)).collect();
        counter(
            "fencegate_authority_acquisitions_total",
            "Lease acquisitions answered, by result (invalid: refused as a bad request).",
            &rows,
        );
        counter(
            "fencegate_authority_renewals_total",
            "Lease renewals answered, by result.",
            &[
                ("{result=\"renewed\"}", self.renewed.load(Relaxed)),
                ("{result=\"lost\"}", self.renew_lost.load(Relaxed)),
            ],
        );
        counter(
            "fencegate_authority_releases_total",
            "Lease releases answered, by result.",
            &[
                ("{result=\"released\"}", self.released.load(Relaxed)),
                ("{result=\"lost\"}", self.release_lost.load(Relaxed)),
            ],
        );
        counter(
            "fencegate_authority_expiries_total",
            "Leases that ended by expiry without a release: each one is a holder that stopped renewing (a pause, crash or partition).",
            &[("", self.expiries.load(Relaxed))],
        );
        self.acquire_seconds.render(
            out,
            "fencegate_authority_acquire_seconds",
            "Time to answer an acquire, waits included.",
        );
        let name = "fencegate_authority_lease_age_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} Age of a lease when it ended, by how it ended.\n# TYPE {name} histogram"
        );
        self.age_released
            .render_series(out, name, "end=\"released\",");
        self.age_expired
            .render_series(out, name, "end=\"expired\",");
        let (epoch, counter) = self
            .last_token
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .unwrap_or((0, 0));
        for (name, help, v) in [
            (
                "fencegate_authority_last_token_epoch",
                "Epoch of the last token granted (any scope; 0 before the first).",
                epoch,
            ),
            (
                "fencegate_authority_last_token_counter",
                "Counter of the last token granted (any scope; 0 before the first).",
                counter,
            ),
            (
                "fencegate_authority_epoch",
                "The epoch of new tokens.",
                self.epoch.load(Relaxed),
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
    }
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
    /// The lease authority's counts (rendered once it runs in this process).
    pub authority: Arc<AuthorityMetrics>,
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
            authority: Arc::default(),
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
        self.authority.render(&mut out);
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
