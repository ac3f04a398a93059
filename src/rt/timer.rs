//! Coarse deadlines for the per-request timeouts of the proxy workers.
//!
//! Every request carries two timeouts (the request head must arrive in time, the upstream
//! must answer in time) that almost never fire. A tokio timer entry per timeout costs a
//! registration and a removal under the timer driver's lock, a handle lookup and a clock
//! read at each; at tens of thousands of requests per second that is measurable. Here a
//! worker thread keeps its armed deadlines in a slab that one task scans every [`TICK`]:
//! arming is a slab insert, disarming a slab remove, and a deadline fires at most one
//! tick late — irrelevant for timeouts measured in seconds.
//!
//! A deadline armed on a thread without a wheel (the main runtime), or polled on another
//! thread than the one it was armed on, falls back to a tokio timer, so it is correct
//! anywhere; only the workers run [`drive`].

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// How often a worker looks for expired deadlines; a deadline fires at most this late.
pub const TICK: Duration = Duration::from_millis(50);

static NEXT_WHEEL: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static WHEEL: RefCell<Option<Wheel>> = const { RefCell::new(None) };
}

struct Slot {
    /// Bumped whenever the slot is freed, so a stale handle cannot touch its successor.
    generation: u32,
    armed: Option<(Instant, Waker)>,
}

struct Wheel {
    id: u64,
    slots: Vec<Slot>,
    free: Vec<usize>,
    /// The generation a new slot starts at: above that of every slot [`Wheel::shrink`]
    /// removed, so a handle to a removed slot never matches the slot pushed in its place.
    base: u32,
}

/// A wheel with more slots than this shrinks once three quarters of them are free.
const SHRINK_ABOVE: usize = 1024;

impl Wheel {
    fn new(id: u64) -> Wheel {
        Wheel {
            id,
            slots: Vec::new(),
            free: Vec::new(),
            base: 0,
        }
    }

    fn arm(&mut self, at: Instant, waker: Waker) -> (usize, u32) {
        let index = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(Slot {
                    generation: self.base,
                    armed: None,
                });
                self.slots.len() - 1
            }
        };
        let slot = &mut self.slots[index];
        slot.armed = Some((at, waker));
        (index, slot.generation)
    }

    /// Frees `index` if it still belongs to `generation`.
    fn disarm(&mut self, index: usize, generation: u32) {
        if let Some(slot) = self.slots.get_mut(index)
            && slot.generation == generation
            && slot.armed.is_some()
        {
            slot.armed = None;
            slot.generation = slot.generation.wrapping_add(1);
            self.free.push(index);
        }
    }

    /// The slot is still armed for this handle (it has not fired).
    fn armed(&mut self, index: usize, generation: u32) -> Option<&mut Waker> {
        let slot = self.slots.get_mut(index)?;
        if slot.generation != generation {
            return None;
        }
        slot.armed.as_mut().map(|(_, w)| w)
    }

    /// After a burst, drops the free slots at the end, so that every tick does not go on
    /// scanning as many slots as the burst once needed.
    fn shrink(&mut self) {
        if self.slots.len() <= SHRINK_ABOVE
            || self.free.len() * 4 < self.slots.len() * 3
            || self.slots.last().is_some_and(|s| s.armed.is_some())
        {
            return;
        }
        while let Some(last) = self.slots.last()
            && last.armed.is_none()
        {
            // A free slot's generation was bumped when it was freed: every handle to it
            // is below it.
            self.base = self.base.max(last.generation);
            self.slots.pop();
        }
        let len = self.slots.len();
        self.free.retain(|&i| i < len);
        self.slots.shrink_to(len.max(SHRINK_ABOVE));
        self.free.shrink_to(len.max(SHRINK_ABOVE));
    }

    /// Frees every slot due at `now` and answers their wakers.
    fn expire(&mut self, now: Instant, woken: &mut Vec<Waker>) {
        for (index, slot) in self.slots.iter_mut().enumerate() {
            if slot.armed.as_ref().is_some_and(|(at, _)| *at <= now)
                && let Some((_, waker)) = slot.armed.take()
            {
                slot.generation = slot.generation.wrapping_add(1);
                self.free.push(index);
                woken.push(waker);
            }
        }
    }
}

/// Runs this thread's wheel until the runtime stops; deadlines armed on this thread from
/// now on use it. Only for single-threaded runtimes (a worker), where a task never moves.
pub async fn drive() {
    let id = NEXT_WHEEL.fetch_add(1, Ordering::Relaxed);
    WHEEL.with(|w| *w.borrow_mut() = Some(Wheel::new(id)));
    // Disarms the wheel if this task is dropped (runtime shutdown): deadlines then fall
    // back to tokio timers instead of waiting for a tick that never comes.
    struct Uninstall;
    impl Drop for Uninstall {
        fn drop(&mut self) {
            let _ = WHEEL.try_with(|w| {
                if let Ok(mut w) = w.try_borrow_mut()
                    && let Some(wheel) = w.take()
                {
                    // Wake everything armed: each re-polls and moves to a tokio timer.
                    for slot in wheel.slots {
                        if let Some((_, waker)) = slot.armed {
                            waker.wake();
                        }
                    }
                }
            });
        }
    }
    let _uninstall = Uninstall;
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut woken = Vec::new();
    loop {
        tick.tick().await;
        let now = Instant::now();
        WHEEL.with(|w| {
            if let Some(wheel) = w.borrow_mut().as_mut() {
                wheel.expire(now, &mut woken);
                wheel.shrink();
            }
        });
        // Outside the borrow: a waker may be for a task that arms a deadline when polled.
        for waker in woken.drain(..) {
            waker.wake();
        }
    }
}

enum Registration {
    None,
    Wheel {
        wheel: u64,
        index: usize,
        generation: u32,
    },
    Tokio(Pin<Box<tokio::time::Sleep>>),
}

/// A point in time that a future can wait for; see the module docs.
pub struct Deadline {
    at: Instant,
    registration: Registration,
}

impl Deadline {
    pub fn at(at: Instant) -> Deadline {
        Deadline {
            at,
            registration: Registration::None,
        }
    }

    pub fn after(duration: Duration) -> Deadline {
        Deadline::after_from(Instant::now(), duration)
    }

    /// `duration` after `from` (a year on if that overflows).
    pub fn after_from(from: Instant, duration: Duration) -> Deadline {
        Deadline::at(
            from.checked_add(duration)
                .unwrap_or(from + Duration::from_secs(86_400 * 365)),
        )
    }

    /// Moves the deadline (hyper re-arms its head timeout for each request).
    pub fn reset(&mut self, at: Instant) {
        self.disarm();
        self.at = at;
    }

    fn disarm(&mut self) {
        if let Registration::Wheel {
            wheel,
            index,
            generation,
        } = std::mem::replace(&mut self.registration, Registration::None)
        {
            let _ = WHEEL.try_with(|w| {
                if let Ok(mut w) = w.try_borrow_mut()
                    && let Some(current) = w.as_mut()
                    && current.id == wheel
                {
                    current.disarm(index, generation);
                }
            });
        }
        // Slots of a wheel on another thread free themselves when they expire.
    }

    /// Registers with this thread's wheel, or answers `false` if it has none.
    fn arm_on_wheel(&mut self, waker: &Waker) -> bool {
        WHEEL
            .try_with(|w| {
                let Ok(mut w) = w.try_borrow_mut() else {
                    return false;
                };
                let Some(wheel) = w.as_mut() else {
                    return false;
                };
                let (index, generation) = wheel.arm(self.at, waker.clone());
                self.registration = Registration::Wheel {
                    wheel: wheel.id,
                    index,
                    generation,
                };
                true
            })
            .unwrap_or(false)
    }
}

impl Future for Deadline {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        match &mut this.registration {
            Registration::Tokio(sleep) => return sleep.as_mut().poll(cx),
            Registration::Wheel {
                wheel,
                index,
                generation,
            } => {
                let (wheel, index, generation) = (*wheel, *index, *generation);
                let state = WHEEL
                    .try_with(|w| {
                        let mut w = w.try_borrow_mut().ok()?;
                        let current = w.as_mut().filter(|c| c.id == wheel)?;
                        Some(match current.armed(index, generation) {
                            Some(armed) => {
                                if !armed.will_wake(cx.waker()) {
                                    *armed = cx.waker().clone();
                                }
                                Poll::Pending
                            }
                            // Freed by the wheel: it fired.
                            None => Poll::Ready(()),
                        })
                    })
                    .ok()
                    .flatten();
                match state {
                    Some(Poll::Pending) => return Poll::Pending,
                    Some(Poll::Ready(())) => {
                        this.registration = Registration::None;
                        return Poll::Ready(());
                    }
                    // Polled away from its wheel (or the wheel is gone): a tokio timer
                    // from here on.
                    None => this.registration = Registration::None,
                }
            }
            Registration::None => {}
        }
        // No clock read here: the wheel fires a deadline already past at its next tick
        // (within the one tick of slack every deadline has), and a tokio timer at once.
        if this.arm_on_wheel(cx.waker()) {
            return Poll::Pending;
        }
        let mut sleep = Box::pin(tokio::time::sleep_until(this.at.into()));
        let poll = sleep.as_mut().poll(cx);
        this.registration = Registration::Tokio(sleep);
        poll
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        self.disarm();
    }
}

/// A limit on each wait for a source that delivers in pieces (an upstream's response
/// body): the clock starts when a read finds nothing and stops when one brings something.
/// Time in which nobody reads — a slow consumer that is not asking for more — never counts.
pub struct ReadTimeout {
    limit: Duration,
    /// Armed while a read is waiting: when the wait began, plus `limit`.
    waiting: Option<Deadline>,
}

impl ReadTimeout {
    pub fn new(limit: Duration) -> ReadTimeout {
        ReadTimeout {
            limit,
            waiting: None,
        }
    }

    /// A read found nothing (and registered `cx` with its source). Ready, with the error
    /// to end the read with, once the wait, counted from the first such read with nothing
    /// arriving since, has lasted the limit; until then `cx` is also woken when it will have.
    pub fn poll_waiting(&mut self, cx: &mut Context<'_>) -> Poll<ReadTimedOut> {
        let limit = self.limit;
        let deadline = self.waiting.get_or_insert_with(|| Deadline::after(limit));
        Pin::new(deadline).poll(cx).map(|()| ReadTimedOut { limit })
    }

    /// A read brought something: the next wait starts afresh.
    pub fn progressed(&mut self) {
        // Dropping the deadline frees its slot in the wheel.
        self.waiting = None;
    }
}

/// A wait for more of a body outlasted its [`ReadTimeout`]. A type of its own, so that
/// whoever reads the body can tell it from a body that broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadTimedOut {
    pub limit: Duration,
}

impl std::fmt::Display for ReadTimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the upstream sent no more of the body for {:?}",
            self.limit
        )
    }
}

impl std::error::Error for ReadTimedOut {}

/// The future did not finish before its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Elapsed;

/// `fut`, unless `duration` after `from` passes first. The caller passes the time it
/// started (on the request path it has just read the clock anyway).
pub fn timeout_from<F: Future>(from: Instant, duration: Duration, fut: F) -> Timeout<F> {
    Timeout {
        fut,
        deadline: Deadline::after_from(from, duration),
    }
}

/// `fut`, unless `at` passes first.
pub fn timeout_at<F: Future>(at: Instant, fut: F) -> Timeout<F> {
    Timeout {
        fut,
        deadline: Deadline::at(at),
    }
}

pin_project_lite::pin_project! {
    /// [`timeout_from`]'s future. A type of its own rather than an `async fn`, whose state would
    /// hold `fut` twice (the argument and its pinned copy): this one is on every forwarded
    /// request, inside the request's future, which is moved whole as hyper sets it up.
    #[must_use = "futures do nothing unless polled"]
    pub struct Timeout<F> {
        #[pin]
        fut: F,
        deadline: Deadline,
    }
}

impl<F: Future> Future for Timeout<F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(v) = this.fut.poll(cx) {
            return Poll::Ready(Ok(v));
        }
        Pin::new(this.deadline).poll(cx).map(|()| Err(Elapsed))
    }
}

/// hyper's timer for the HTTP/1 head timeout, on [`Deadline`]s.
#[derive(Debug, Clone, Copy, Default)]
pub struct CoarseTimer;

impl hyper::rt::Sleep for Deadline {}

impl hyper::rt::Timer for CoarseTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(Deadline::after(duration))
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(Deadline::at(deadline))
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>, new_deadline: Instant) {
        match sleep.as_mut().downcast_mut_pin::<Deadline>() {
            Some(d) => d.get_mut().reset(new_deadline),
            None => *sleep = self.sleep_until(new_deadline),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    /// Awaits `f` for at most 10 s (a tokio timer, not the wheel under test): a broken
    /// deadline fails the test instead of hanging it.
    async fn bounded<F: Future>(f: F) -> F::Output {
        tokio::time::timeout(Duration::from_secs(10), f)
            .await
            .expect("finished within 10 s")
    }

    #[test]
    fn after_a_burst_the_wheel_shrinks_and_old_handles_stay_stale() {
        let mut wheel = Wheel::new(1);
        let now = Instant::now();
        let waker = std::task::Waker::noop();
        let mut handles: Vec<_> = (0..5_000).map(|_| wheel.arm(now, waker.clone())).collect();
        // One deadline far off, in the middle, stays.
        let kept = wheel.arm(now + Duration::from_secs(60), waker.clone());
        handles.extend((0..5_000).map(|_| wheel.arm(now, waker.clone())));
        let mut woken = Vec::new();
        wheel.expire(now, &mut woken);
        assert_eq!(woken.len(), 10_000);
        wheel.shrink();
        assert_eq!(kept.0, 5_000);
        assert_eq!(wheel.slots.len(), 5_001, "free slots at the end dropped");
        assert!(wheel.armed(kept.0, kept.1).is_some());
        // New deadlines reuse freed slots first, then push new ones: none of the old
        // handles (fired) matches any of them.
        let fresh: Vec<_> = (0..20_000)
            .map(|_| wheel.arm(now + Duration::from_secs(1), waker.clone()))
            .collect();
        for &(index, generation) in &handles {
            assert!(wheel.armed(index, generation).is_none(), "{index}");
        }
        for &(index, generation) in &fresh {
            assert!(wheel.armed(index, generation).is_some());
        }
        // A small wheel is left alone.
        let mut small = Wheel::new(2);
        let h = small.arm(now, waker.clone());
        small.expire(now, &mut woken);
        small.shrink();
        assert_eq!(small.slots.len(), 1);
        assert!(small.armed(h.0, h.1).is_none());
    }

    /// Runs `test` on a single-threaded runtime whose wheel is installed, like a worker's.
    fn on_worker<F: Future<Output = ()>>(test: F) {
        worker().block_on(async {
            tokio::spawn(drive());
            tokio::task::yield_now().await;
            test.await
        })
    }

    #[test]
    fn a_deadline_on_a_wheel_fires_not_before_it_is_due_and_frees_its_slot() {
        on_worker(async {
            let started = Instant::now();
            bounded(Deadline::after(Duration::from_millis(120))).await;
            let took = started.elapsed();
            assert!(took >= Duration::from_millis(120), "{took:?}");
            assert!(took < Duration::from_secs(10), "{took:?}");
            // Everything that fired is freed.
            WHEEL.with(|w| {
                let w = w.borrow();
                let wheel = w.as_ref().expect("wheel");
                assert!(wheel.slots.iter().all(|s| s.armed.is_none()));
            });
        });
    }

    #[test]
    fn timeout_answers_the_future_or_elapsed() {
        on_worker(async {
            assert_eq!(
                bounded(timeout_from(
                    Instant::now(),
                    Duration::from_secs(5),
                    async { 7 }
                ))
                .await,
                Ok(7)
            );
            let never = std::future::pending::<()>();
            assert_eq!(
                bounded(timeout_from(
                    Instant::now(),
                    Duration::from_millis(60),
                    never
                ))
                .await,
                Err(Elapsed)
            );
            // A finished timeout leaves no armed slot behind.
            let quick = tokio::time::sleep(Duration::from_millis(5));
            assert_eq!(
                bounded(timeout_from(Instant::now(), Duration::from_secs(30), quick)).await,
                Ok(())
            );
            WHEEL.with(|w| {
                let w = w.borrow();
                let wheel = w.as_ref().expect("wheel");
                assert!(wheel.slots.iter().all(|s| s.armed.is_none()));
                assert_eq!(wheel.free.len(), wheel.slots.len());
            });
        });
    }

    #[test]
    fn without_a_wheel_a_tokio_timer_is_used() {
        let rt = worker();
        rt.block_on(async {
            let started = Instant::now();
            bounded(Deadline::after(Duration::from_millis(30))).await;
            assert!(started.elapsed() >= Duration::from_millis(30));
            let never = std::future::pending::<()>();
            assert_eq!(
                bounded(timeout_from(
                    Instant::now(),
                    Duration::from_millis(30),
                    never
                ))
                .await,
                Err(Elapsed)
            );
        });
    }

    /// When each armed slot of this thread's wheel is due.
    fn armed_at() -> Vec<Instant> {
        WHEEL.with(|w| {
            let w = w.borrow();
            let wheel = w.as_ref().expect("wheel");
            wheel
                .slots
                .iter()
                .filter_map(|s| s.armed.as_ref().map(|(at, _)| *at))
                .collect()
        })
    }

    #[test]
    fn a_read_timeout_counts_each_wait_from_its_start_and_progress_stops_it() {
        on_worker(async {
            let limit = Duration::from_millis(80);
            let mut read = ReadTimeout::new(limit);
            // The first read that finds nothing starts the clock; later ones keep it.
            let before = Instant::now();
            let first = std::future::poll_fn(|cx| Poll::Ready(read.poll_waiting(cx))).await;
            assert!(first.is_pending());
            let after = Instant::now();
            let at = armed_at();
            assert_eq!(at.len(), 1);
            assert!(at[0] >= before + limit && at[0] <= after + limit, "{at:?}");
            let again = std::future::poll_fn(|cx| Poll::Ready(read.poll_waiting(cx))).await;
            assert!(again.is_pending());
            assert_eq!(armed_at(), at, "a repeated poll does not move the deadline");
            // Something arrived: nothing is armed until the next wait, counted from then.
            read.progressed();
            assert!(armed_at().is_empty());
            let restarted = Instant::now();
            let waited = bounded(std::future::poll_fn(|cx| read.poll_waiting(cx))).await;
            assert_eq!(waited, ReadTimedOut { limit });
            assert!(restarted.elapsed() >= limit, "{:?}", restarted.elapsed());
        });
    }

    #[test]
    fn reset_moves_an_armed_deadline() {
        on_worker(async {
            let timer = CoarseTimer;
            let mut sleep = hyper::rt::Timer::sleep(&timer, Duration::from_secs(3600));
            // Armed by a first poll, then moved close.
            let mut cx = Context::from_waker(Waker::noop());
            assert!(sleep.as_mut().poll(&mut cx).is_pending());
            let started = Instant::now();
            hyper::rt::Timer::reset(&timer, &mut sleep, started + Duration::from_millis(60));
            bounded(sleep).await;
            let took = started.elapsed();
            assert!(took >= Duration::from_millis(60), "{took:?}");
            assert!(took < Duration::from_secs(10), "{took:?}");
        });
    }
}
