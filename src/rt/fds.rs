//! The process's file descriptors: at start the soft open-file limit is raised to the
//! hard one (as nginx's `worker_rlimit_nofile`), and connections — the clients' and the
//! upstream ones alike — draw from a budget kept short of the limit by a reserve, so that
//! the listeners, the store, the log and the admin API never find none left. Past the
//! budget a new client connection is closed at accept and a new upstream connection is
//! not made (the request is refused, never sent), instead of `accept` failing with
//! EMFILE for everyone. The other listeners' connections (admin, authority, peers) draw
//! on half of the reserve ([`Pool::Services`]).

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

/// Which budget a connection draws on: the proxy's (client and upstream connections), or
/// the services' (the admin, authority and peer listeners' connections), a half of the
/// reserve, so that those listeners are served when the proxy's budget is spent and can
/// never take the rest of the reserve from the store and the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pool {
    Proxy,
    Services,
}

static SERVICES_OPEN: AtomicUsize = AtomicUsize::new(0);

impl Pool {
    fn count(self) -> &'static AtomicUsize {
        match self {
            Pool::Proxy => &OPEN,
            Pool::Services => &SERVICES_OPEN,
        }
    }

    /// The pool's budget (unbounded until [`raise`] ran).
    pub fn budget(self) -> usize {
        match self {
            Pool::Proxy => budget(),
            Pool::Services => LIMITS.get().map_or(usize::MAX, |l| reserve(l.limit) / 2),
        }
    }

    /// Takes a descriptor for a new connection; `None` when the pool's budget is spent.
    pub fn take(self) -> Option<Fd> {
        let budget = self.budget();
        let count = self.count();
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < budget).then_some(n + 1)
            })
            .ok()
            .map(|_| Fd(count))
    }

    /// Descriptors of the pool's budget not taken now (`usize::MAX` until [`raise`] ran):
    /// what one client may hold at most, so that as many are left to the others (see
    /// `listen::limits`).
    pub fn free(self) -> usize {
        let budget = self.budget();
        if budget == usize::MAX {
            return usize::MAX;
        }
        budget.saturating_sub(self.count().load(Ordering::Acquire))
    }
}

/// A connection's descriptor, counted against its pool's budget until dropped.
#[derive(Debug)]
pub struct Fd(&'static AtomicUsize);

impl Drop for Fd {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Takes a descriptor of the proxy's budget for a new connection; `None` when it is spent.
pub fn take() -> Option<Fd> {
    Pool::Proxy.take()
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

/// A connector (hyper's `HttpConnector` under the https upstreams' TLS) whose connections
/// count against the budget while they live, as the plain-HTTP upstreams' do: past it no
/// connection is made and the request fails before anything is sent.
#[derive(Clone, Debug)]
pub struct Counted<C>(pub C);

/// A connection made by [`Counted`], with its descriptor's count.
#[derive(Debug)]
pub struct CountedIo<T> {
    io: T,
    _fd: Fd,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<C> tower::Service<http::Uri> for Counted<C>
where
    C: tower::Service<http::Uri>,
    C::Error: Into<BoxError>,
    C::Future: Send + 'static,
    C::Response: Send + 'static,
{
    type Response = CountedIo<C::Response>;
    type Error = BoxError;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, BoxError>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let Some(fd) = take() else {
            let why = format!(
                "no file descriptor to spare for a connection to {} (the open-file limit's budget is spent)",
                uri.authority().map_or("the upstream", |a| a.as_str())
            );
            return Box::pin(std::future::ready(Err(why.into())));
        };
        let connecting = self.0.call(uri);
        Box::pin(async move {
            let io = connecting.await.map_err(Into::into)?;
            Ok(CountedIo { io, _fd: fd })
        })
    }
}

impl<T: hyper::rt::Read + Unpin> hyper::rt::Read for CountedIo<T> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: hyper::rt::Write + Unpin> hyper::rt::Write for CountedIo<T> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
}

impl<T: hyper_util::client::legacy::connect::Connection>
    hyper_util::client::legacy::connect::Connection for CountedIo<T>
{
    fn connected(&self) -> hyper_util::client::legacy::connect::Connected {
        self.io.connected()
    }
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
