//! The process's file descriptors: at start the soft open-file limit is raised to the
//! hard one (as nginx's `worker_rlimit_nofile`), and connections — the clients' and the
//! upstream ones alike — draw from a budget kept short of the limit by a reserve, so that
//! the listeners, the store, the log and the admin API never find none left. Past the
//! budget a new client connection is closed at accept and a new upstream connection is
//! not made (the request is refused, never sent), instead of `accept` failing with
//! EMFILE for everyone.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Descriptors always left to what is not a connection, at least.
pub const MIN_RESERVE: usize = 32;

/// The open-file limit and the budget of connections under it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The soft limit found at start.
    pub was: u64,
    /// The soft limit in force (raised to the hard one where it was lower).
    pub limit: u64,
    /// Descriptors open when the budget was set (listeners, store, log, runtime).
    pub baseline: usize,
    /// Connections that may be open at once.
    pub budget: usize,
}

static LIMITS: OnceLock<Limits> = OnceLock::new();
static OPEN: AtomicUsize = AtomicUsize::new(0);

/// The reserve under `limit`: [`MIN_RESERVE`], or a sixteenth of the limit if larger.
pub fn reserve(limit: u64) -> usize {
    usize::try_from(limit / 16)
        .unwrap_or(usize::MAX)
        .max(MIN_RESERVE)
}

/// Raises the soft limit to the hard one and sets the budget (once per process; later
/// calls answer what the first set).
pub fn raise() -> Limits {
    *LIMITS.get_or_init(|| {
        use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
        let found = getrlimit(Resource::Nofile);
        let was = found.current.unwrap_or(u64::MAX);
        // An unlimited hard limit is capped at what Linux allows a process (nr_open's
        // default); setrlimit refuses more.
        let hard = found.maximum.unwrap_or(1 << 20);
        let limit = if was < hard {
            match setrlimit(
                Resource::Nofile,
                Rlimit {
                    current: Some(hard),
                    maximum: found.maximum,
                },
            ) {
                Ok(()) => hard,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot raise the open-file limit; keeping {was}");
                    was
                }
            }
        } else {
            was
        };
        let baseline = open_now().unwrap_or(MIN_RESERVE);
        let usable = usize::try_from(limit).unwrap_or(usize::MAX);
        let budget = usable.saturating_sub(baseline + reserve(limit));
        Limits {
            was,
            limit,
            baseline,
            budget,
        }
    })
}

/// Descriptors open now (Linux: entries of /proc/self/fd).
fn open_now() -> Option<usize> {
    std::fs::read_dir("/proc/self/fd").ok().map(|d| d.count())
}

/// The budget in force (unbounded until [`raise`] ran).
fn budget() -> usize {
    LIMITS.get().map_or(usize::MAX, |l| l.budget)
}

/// A connection's descriptor, counted against the budget until dropped.
#[derive(Debug)]
pub struct Fd(());

impl Drop for Fd {
    fn drop(&mut self) {
        OPEN.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Takes a descriptor for a new connection; `None` when the budget is spent.
pub fn take() -> Option<Fd> {
    let budget = budget();
    OPEN.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
        (n < budget).then_some(n + 1)
    })
    .ok()
    .map(|_| Fd(()))
}

/// Whether three quarters of the budget are taken: idle connections are then not kept.
pub fn scarce() -> bool {
    let budget = budget();
    budget != usize::MAX && open().saturating_mul(4) >= budget.saturating_mul(3)
}

/// Connections counted now.
pub fn open() -> usize {
    OPEN.load(Ordering::Acquire)
}

/// The limits set by [`raise`], if it ran.
pub fn limits() -> Option<Limits> {
    LIMITS.get().copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_grows_with_the_limit() {
        assert_eq!(reserve(256), MIN_RESERVE);
        assert_eq!(reserve(4096), 256);
        assert_eq!(reserve(1 << 20), 1 << 16);
    }
}
