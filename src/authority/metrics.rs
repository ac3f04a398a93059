//! What the lease authority counts (SPEC §8), both backends alike, and how it renders
//! those series: the admin listener's `/metrics` composes them with the others once the
//! authority runs in this process.

use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::metrics::{FmtMetrics, Histogram};

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
}

impl FmtMetrics for AuthorityMetrics {
    fn fmt_metrics(&self, out: &mut String) {
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
