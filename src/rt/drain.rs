//! Graceful shutdown for one worker's connections.
//!
//! hyper-util's `GracefulShutdown` watches each connection through a `watch` channel whose
//! `changed()` future is polled at every poll of the connection, and that poll takes the
//! channel's waiter lock. Here a connection looks at an atomic flag per poll, and takes a
//! lock only when its task's waker changes (on a worker's single-threaded runtime: once,
//! at its first poll). [`Drain::shutdown`] raises the flag, wakes every watched connection
//! so that it starts its graceful shutdown (finish the in-flight request, then close; an
//! idle one closes at once), and waits until all of them have ended.
//!
//! It also waits for the worker's detached tasks ([`spawn_detached`]): work a request
//! hands off so that it goes on after its client has gone (an idempotent exchange, whose
//! answer is recorded for the client's retry). No connection waits for such a task, so
//! without the count a worker would stop, and drop it, as soon as its last connection ended.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// A connection that can be asked to finish what it is doing and close.
pub trait Drainable: Future {
    fn graceful_shutdown(self: Pin<&mut Self>);
}

impl<C: hyper_util::server::graceful::GracefulConnection> Drainable for C {
    fn graceful_shutdown(self: Pin<&mut Self>) {
        hyper_util::server::graceful::GracefulConnection::graceful_shutdown(self)
    }
}

#[derive(Default)]
struct Watched {
    /// By slot; `None` for a free slot or a connection not yet polled.
    wakers: Vec<Option<Waker>>,
    free: Vec<usize>,
    /// Watched connections, and watchers still waiting for theirs.
    live: usize,
    /// Detached tasks not yet ended.
    detached: usize,
}

impl Watched {
    fn idle(&self) -> bool {
        self.live == 0 && self.detached == 0
    }
}

#[derive(Default)]
struct Shared {
    closing: AtomicBool,
    watched: Mutex<Watched>,
    /// Signalled when the last watched connection or detached task ends.
    ended: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Watched> {
        self.watched.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Signals [`Drain::shutdown`] if nothing is left; called with what the lock guards.
    fn ended_one(&self, w: MutexGuard<'_, Watched>) {
        let last = w.idle();
        drop(w);
        if last {
            self.ended.notify_waiters();
        }
    }

    /// Wakes every watched connection's task (outside the lock: a task may run at once).
    fn wake_all(&self) {
        let wakers: Vec<Waker> = self.lock().wakers.iter().flatten().cloned().collect();
        for w in wakers {
            w.wake();
        }
    }
}

thread_local! {
    /// The drain of the worker serving on this thread, which counts the tasks
    /// [`spawn_detached`] starts here.
    static DETACHED: RefCell<Option<Arc<Shared>>> = const { RefCell::new(None) };
}

/// Spawns `task` on the current runtime, apart from the request that hands it off. On a
/// worker's thread the worker's drain counts it, so that shutdown waits for it (within the
/// same grace as for connections) instead of dropping it with the worker's runtime.
pub fn spawn_detached<F>(task: F) -> JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    // Counted before the task exists: the request handing it off still holds its
    // connection open, so a shutdown cannot find nothing left in between.
    let counted = DETACHED.with(|d| d.borrow().clone()).map(|shared| {
        shared.lock().detached += 1;
        DetachedGuard { shared }
    });
    tokio::spawn(async move {
        let _counted = counted;
        task.await
    })
}

/// Counts one detached task until it ends or is dropped.
struct DetachedGuard {
    shared: Arc<Shared>,
}

impl Drop for DetachedGuard {
    fn drop(&mut self) {
        let mut w = self.shared.lock();
        w.detached -= 1;
        self.shared.ended_one(w);
    }
}

/// One worker's set of watched connections (and of its detached tasks).
#[derive(Default)]
pub struct Drain {
    shared: Arc<Shared>,
}

impl Drain {
    pub fn new() -> Drain {
        Drain::default()
    }

    /// Wraps `conn`; the answer ends when `conn` does.
    pub fn watch<C: Drainable>(&self, conn: C) -> WatchedConn<C> {
        self.watcher().watch(conn)
    }

    /// Counts a connection from now (a TLS one, during its handshake) that is watched
    /// later, from its own task; [`Drain::shutdown`] waits for it from now on.
    pub fn watcher(&self) -> Watcher {
        let mut w = self.shared.lock();
        let slot = match w.free.pop() {
            Some(i) => i,
            None => {
                w.wakers.push(None);
                w.wakers.len() - 1
            }
        };
        w.live += 1;
        drop(w);
        Watcher {
            guard: SlotGuard {
                shared: self.shared.clone(),
                slot,
            },
        }
    }

    /// From now on, [`spawn_detached`] on this thread counts its tasks here. For a worker,
    /// whose single-threaded runtime runs every task it spawns on this thread.
    pub fn count_detached_tasks_of_this_thread(&self) {
        DETACHED.with(|d| *d.borrow_mut() = Some(self.shared.clone()));
    }

    /// Asks every watched connection (and any watched from now on) to shut down
    /// gracefully, then waits until none is left, nor any detached task. Bound it with a
    /// timeout: a connection with a request in flight ends only when that request does.
    pub async fn shutdown(&self) {
        self.shared.closing.store(true, Ordering::Release);
        self.shared.wake_all();
        loop {
            let ended = self.shared.ended.notified();
            tokio::pin!(ended);
            // Registered before looking, so an end between the look and the wait is seen.
            ended.as_mut().enable();
            if self.shared.lock().idle() {
                return;
            }
            ended.await;
        }
    }

    /// Connections and detached tasks not yet ended (what a shutdown past its grace
    /// abandons).
    pub fn remaining(&self) -> (usize, usize) {
        let w = self.shared.lock();
        (w.live, w.detached)
    }
}

/// A counted connection slot, to be given its connection.
pub struct Watcher {
    guard: SlotGuard,
}

impl Watcher {
    pub fn watch<C: Drainable>(self, conn: C) -> WatchedConn<C> {
        WatchedConn {
            conn,
            guard: self.guard,
            waker: None,
            shutting_down: false,
        }
    }
}

/// Frees its slot when the watched connection ends or is dropped.
struct SlotGuard {
    shared: Arc<Shared>,
    slot: usize,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let mut w = self.shared.lock();
        w.wakers[self.slot] = None;
        w.free.push(self.slot);
        w.live -= 1;
        self.shared.ended_one(w);
    }
}

pin_project_lite::pin_project! {
    /// [`Drain::watch`]'s future.
    #[must_use = "futures do nothing unless polled"]
    pub struct WatchedConn<C> {
        #[pin]
        conn: C,
        guard: SlotGuard,
        // The waker last registered in the slot.
        waker: Option<Waker>,
        shutting_down: bool,
    }
}

impl<C: Drainable> Future for WatchedConn<C> {
    type Output = C::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let mut this = self.project();
        if !*this.shutting_down {
            let shared = &this.guard.shared;
            let mut closing = shared.closing.load(Ordering::Acquire);
            if !closing && !this.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                shared.lock().wakers[this.guard.slot] = Some(cx.waker().clone());
                *this.waker = Some(cx.waker().clone());
                // Look again after registering: a shutdown that collected the wakers just
                // before ours was stored is seen here.
                closing = shared.closing.load(Ordering::Acquire);
            }
            if closing {
                *this.shutting_down = true;
                this.conn.as_mut().graceful_shutdown();
            }
        }
        this.conn.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    /// A connection with one request in flight until `done` is set; told to shut down,
    /// it records it, and an idle one (`busy == false`) ends at once.
    struct Fake {
        busy: bool,
        told: Arc<AtomicUsize>,
        done: Arc<AtomicBool>,
        shutting: bool,
    }

    impl Future for Fake {
        type Output = ();
        fn poll(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<()> {
            let done = self.done.load(Ordering::Acquire);
            if (self.shutting && !self.busy) || done {
                return Poll::Ready(());
            }
            Poll::Pending
        }
    }

    impl Drainable for Fake {
        fn graceful_shutdown(mut self: Pin<&mut Self>) {
            self.told.fetch_add(1, Ordering::Relaxed);
            self.shutting = true;
        }
    }

    fn fake(busy: bool) -> (Fake, Arc<AtomicUsize>, Arc<AtomicBool>) {
        let told = Arc::new(AtomicUsize::new(0));
        let done = Arc::new(AtomicBool::new(false));
        let f = Fake {
            busy,
            told: told.clone(),
            done: done.clone(),
            shutting: false,
        };
        (f, told, done)
    }

    async fn bounded<F: Future>(f: F) -> F::Output {
        tokio::time::timeout(Duration::from_secs(10), f)
            .await
            .expect("finished within 10 s")
    }

    #[tokio::test]
    async fn shutdown_closes_idle_connections_and_waits_for_busy_ones() {
        let drain = Drain::new();
        let (idle, idle_told, _) = fake(false);
        let (busy, busy_told, busy_done) = fake(true);
        let idle = tokio::spawn(drain.watch(idle));
        let busy = tokio::spawn(drain.watch(busy));
        // Both polled once (registered), neither ends by itself.
        tokio::task::yield_now().await;
        assert!(!idle.is_finished() && !busy.is_finished());

        let shutdown = drain.shutdown();
        tokio::pin!(shutdown);
        // The idle one closes; the busy one is told but its request is still running.
        assert!(futures_poll_once(shutdown.as_mut()).await.is_pending());
        bounded(idle).await.expect("idle task");
        assert_eq!(idle_told.load(Ordering::Relaxed), 1);
        tokio::task::yield_now().await;
        assert_eq!(busy_told.load(Ordering::Relaxed), 1);
        assert!(futures_poll_once(shutdown.as_mut()).await.is_pending());

        // Its request finishes: the connection ends and so does the shutdown.
        finish(&drain, &busy, &busy_done).await;
        bounded(shutdown).await;
        assert_eq!(busy_told.load(Ordering::Relaxed), 1, "told once");
    }

    #[tokio::test]
    async fn a_connection_watched_after_shutdown_began_is_told_at_its_first_poll() {
        let drain = Drain::new();
        let (held, _, held_done) = fake(true);
        let held = tokio::spawn(drain.watch(held));
        tokio::task::yield_now().await;
        let shutdown = drain.shutdown();
        tokio::pin!(shutdown);
        assert!(futures_poll_once(shutdown.as_mut()).await.is_pending());
        let (late, late_told, _) = fake(false);
        bounded(drain.watch(late)).await;
        assert_eq!(late_told.load(Ordering::Relaxed), 1);
        finish(&drain, &held, &held_done).await;
        bounded(shutdown).await;
    }

    #[tokio::test]
    async fn shutdown_waits_for_a_watcher_whose_connection_comes_later() {
        let drain = Drain::new();
        let watcher = drain.watcher();
        let shutdown = drain.shutdown();
        tokio::pin!(shutdown);
        assert!(futures_poll_once(shutdown.as_mut()).await.is_pending());
        // Its handshake done, the connection is told at its first poll and, idle, ends.
        let (c, told, _) = fake(false);
        bounded(watcher.watch(c)).await;
        assert_eq!(told.load(Ordering::Relaxed), 1);
        bounded(shutdown).await;
    }

    #[tokio::test]
    async fn shutdown_with_nothing_watched_returns_at_once() {
        let drain = Drain::new();
        let (c, _, _) = fake(false);
        // Watched and dropped unpolled: its slot is freed.
        drop(drain.watch(c));
        bounded(drain.shutdown()).await;
        assert_eq!(drain.shared.lock().live, 0);
    }

    #[tokio::test]
    async fn shutdown_waits_for_detached_tasks_of_its_thread() {
        let drain = Drain::new();
        drain.count_detached_tasks_of_this_thread();
        let (done, finished) = tokio::sync::oneshot::channel::<()>();
        let task = spawn_detached(async move {
            let _ = finished.await;
        });
        let shutdown = drain.shutdown();
        tokio::pin!(shutdown);
        assert!(futures_poll_once(shutdown.as_mut()).await.is_pending());
        assert_eq!(drain.remaining(), (0, 1));
        let _ = done.send(());
        bounded(task).await.expect("detached task");
        bounded(shutdown).await;
        assert_eq!(drain.remaining(), (0, 0));
    }

    #[tokio::test]
    async fn a_detached_task_dropped_unfinished_is_no_longer_waited_for() {
        let drain = Drain::new();
        drain.count_detached_tasks_of_this_thread();
        let task = spawn_detached(std::future::pending::<()>());
        assert_eq!(drain.remaining(), (0, 1));
        task.abort();
        let _ = bounded(task).await;
        bounded(drain.shutdown()).await;
    }

    /// Ends the in-flight request of a busy fake and waits until its task has finished.
    /// The fake registers no waker of its own, so its task is woken the way its socket
    /// would wake it.
    async fn finish(drain: &Drain, task: &tokio::task::JoinHandle<()>, done: &AtomicBool) {
        done.store(true, Ordering::Release);
        bounded(async {
            while !task.is_finished() {
                tokio::task::yield_now().await;
                // Standing in for the sockets' readiness.
                drain.shared.wake_all();
            }
        })
        .await;
    }

    /// Polls `f` once, answering whether it finished.
    async fn futures_poll_once<F: Future + Unpin>(mut f: F) -> Poll<F::Output> {
        std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut f).poll(cx))).await
    }
}
