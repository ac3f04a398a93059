//! Lock-free counters' plumbing: per-thread shards on their own cache lines, and the
//! fixed-bucket histogram every part of the process measures with (the store's commit
//! times among them), rendered in the Prometheus text format by [`super`].

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

/// Counter shards: each thread adds to its own (on its own cache line), so the proxy
/// workers do not pass counter cache lines back and forth on every request; a scrape
/// sums them.
pub(super) const SHARDS: usize = 8;
/// Most buckets a histogram may have.
const MAX_BUCKETS: usize = 20;

static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static SHARD: usize = NEXT_SHARD.fetch_add(1, Relaxed) % SHARDS;
}

pub(super) fn shard() -> usize {
    SHARD.try_with(|s| *s).unwrap_or(0)
}

/// One cache line (two, against adjacent-line prefetch) per shard.
#[derive(Debug, Default)]
#[repr(align(128))]
pub(super) struct Padded<T>(pub(super) T);

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

    pub(crate) fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        self.render_series(out, name, "");
    }

    /// The series of one histogram; `labels` (each `k="v",`) go before `le`.
    pub fn render_series(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (i, b) in self.bounds.iter().enumerate() {
            cumulative += self.bucket(i);
            let _ = writeln!(out, "{name}_bucket{{{labels}le=\"{b}\"}} {cumulative}");
        }
        let count = self.count();
        let _ = writeln!(out, "{name}_bucket{{{labels}le=\"+Inf\"}} {count}");
        let sum_micros: u64 = self
            .shards
            .iter()
            .map(|s| s.0.sum_micros.load(Relaxed))
            .sum();
        let plain = labels.trim_end_matches(',');
        let braced = if plain.is_empty() {
            String::new()
        } else {
            format!("{{{plain}}}")
        };
        let _ = writeln!(out, "{name}_sum{braced} {}", sum_micros as f64 / 1e6);
        let _ = writeln!(out, "{name}_count{braced} {count}");
    }
}

pub const SECONDS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0,
];
pub const BATCH: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0, 4096.0,
];
