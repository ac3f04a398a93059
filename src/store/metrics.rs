//! The store's series (commit times and batch sizes, failed commits, checkpoints),
//! rendered by the store itself for the admin listener's `/metrics`.

use std::fmt::Write as _;
use std::sync::atomic::Ordering::Relaxed;

use crate::metrics::FmtMetrics;
use crate::store::marks::StoreStats;

impl FmtMetrics for StoreStats {
    fn fmt_metrics(&self, out: &mut String) {
        self.commit_seconds.render(
            out,
            "fencegate_mark_commit_seconds",
            "Time of one durable mark commit (one batch).",
        );
        self.commit_batch_size.render(
            out,
            "fencegate_mark_commit_batch_size",
            "Mark advances served by one commit (group commit).",
        );
        out.push_str("# HELP fencegate_mark_commit_failures_total Failed mark commits.\n");
        out.push_str("# TYPE fencegate_mark_commit_failures_total counter\n");
        let _ = writeln!(
            out,
            "fencegate_mark_commit_failures_total {}",
            self.commit_failures.load(Relaxed)
        );
        out.push_str(
            "# HELP fencegate_mark_checkpoints_total Checkpoints of the mark journal into the store.\n",
        );
        out.push_str("# TYPE fencegate_mark_checkpoints_total counter\n");
        let _ = writeln!(
            out,
            "fencegate_mark_checkpoints_total {}",
            self.checkpoints.load(Relaxed)
        );
    }
}
