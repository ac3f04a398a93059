//! The per-scope gate under a paused clock: generations ordered, drains bounded, settle
//! honoured, failures closed. No sockets and no sleeps: time moves only when every task
//! waits, so each assertion about time is exact.

use std::sync::Arc;
use std::time::Duration;

use crate::support;

use fencegate::fence::{Gates, Refusal};
use fencegate::metrics::Metrics;
use fencegate::settings::EqualPolicy::{Accept, Reject};
use fencegate::store::MarkStore;
use fencegate::token::Token;
use support::disk::Disk;
use tokio::time::Instant;

const DRAIN: Duration = Duration::from_secs(30);
const SETTLE: Duration = Duration::from_secs(5);

fn t(c: u64) -> Token {
    Token::new(0, c)
}

fn gates_on(disk: &Disk, settle: Duration) -> Gates {
    let store = MarkStore::open_inline_with_backend(disk.clone()).expect("store");
    Gates::new(store, Arc::new(Metrics::new(Vec::new())), DRAIN, settle)
}

fn gates() -> Gates {
    gates_on(&Disk::new(), SETTLE)
}

#[tokio::test(start_paused = true)]
async fn one_generation_runs_concurrently() {
    let g = gates();
    let a = g.admit("s", t(41), Accept).await.expect("first");
    let b = g
        .admit("s", t(41), Accept)
        .await
        .expect("second, same token");
    assert!(a.advanced && !b.advanced);
    assert_eq!(b.waited, Duration::ZERO);
    assert_eq!(g.mark("s").unwrap(), Some(t(41)));
}

#[tokio::test(start_paused = true)]
async fn higher_token_waits_for_older_in_flight_then_goes() {
    let g = Arc::new(gates());
    let mut old = g.admit("s", t(41), Accept).await.expect("41");
    let g2 = g.clone();
    let newer = tokio::spawn(async move { g2.admit("s", t(42), Accept).await });
    // Let 42 reach the gate: it has advanced the mark and now waits for 41 to drain.
    while g.waiting() == 0 {
        tokio::task::yield_now().await;
    }
    assert_eq!(g.mark("s").unwrap(), Some(t(42)), "durable before waiting");
    // Once 42 is admitted, 41 is stale: no new request of the old generation goes.
    assert_eq!(
        g.admit("s", t(41), Accept).await.unwrap_err(),
        Refusal::Stale {
            highest: Some(t(42))
        }
    );
    tokio::time::advance(Duration::from_secs(3)).await;
    assert!(
        !newer.is_finished(),
        "42 must not pass while 41 is in flight"
    );
    old.guard.complete();
    drop(old);
    let adm = newer.await.unwrap().expect("42 after the drain");
    assert!(adm.advanced);
    assert_eq!(adm.waited, Duration::from_secs(3));
    assert_eq!(g.waiting(), 0);
}

#[tokio::test(start_paused = true)]
async fn drain_that_outlasts_the_timeout_answers_draining() {
    let g = gates();
    let _held = g.admit("s", t(41), Accept).await.expect("41");
    let start = Instant::now();
    let r = g.admit("s", t(42), Accept).await.unwrap_err();
    assert_eq!(
        r,
        Refusal::Draining {
            highest: Some(t(42))
        }
    );
    assert_eq!(start.elapsed(), DRAIN);
    // The mark stays advanced: the old generation is fenced out from now on.
    assert!(matches!(
        g.admit("s", t(41), Accept).await,
        Err(Refusal::Stale { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn abandoned_request_makes_the_scope_settle() {
    let g = gates();
    let old = g.admit("s", t(41), Accept).await.expect("41");
    // Dropped without completion: the upstream may still apply it.
    drop(old);
    let start = Instant::now();
    let adm = g.admit("s", t(42), Accept).await.expect("42 after settle");
    assert_eq!(start.elapsed(), SETTLE);
    assert_eq!(adm.waited, SETTLE);
    // The same generation as the abandoned one is not held back.
    let g2 = gates();
    drop(g2.admit("x", t(7), Accept).await.unwrap());
    let start = Instant::now();
    g2.admit("x", t(7), Accept).await.expect("same generation");
    assert_eq!(start.elapsed(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn completed_requests_do_not_settle() {
    let g = gates();
    let mut old = g.admit("s", t(41), Accept).await.unwrap();
    old.guard.complete();
    drop(old);
    let start = Instant::now();
    g.admit("s", t(42), Accept).await.unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn after_restart_scopes_settle_once() {
    let disk = Disk::new();
    {
        let g = gates_on(&disk, SETTLE);
        let mut a = g.admit("s", t(41), Accept).await.unwrap();
        a.guard.complete();
    }
    // A new process on the same disk: a request older than the mark may still be in the
    // network, so even the mark's own generation waits out the settle, once.
    let g = gates_on(&disk, SETTLE);
    let start = Instant::now();
    let mut a = g.admit("s", t(41), Accept).await.expect("41 after settle");
    assert_eq!(start.elapsed(), SETTLE);
    assert_eq!(a.waited, SETTLE);
    a.guard.complete();
    drop(a);
    let mut again = g.admit("s", t(41), Accept).await.expect("41 again");
    again.guard.complete();
    drop(again);
    g.admit("s", t(42), Accept).await.expect("42");
    assert_eq!(start.elapsed(), SETTLE, "settled: no more waiting");
    // A scope with no mark had nothing in flight: no wait.
    let start = Instant::now();
    g.admit("fresh", t(1), Accept).await.unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO);
    // Restarted more than `settle` ago: no wait either.
    let g = gates_on(&disk, SETTLE);
    tokio::time::advance(SETTLE).await;
    let start = Instant::now();
    g.admit("s", t(43), Accept).await.unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO);
}

/// A mark is made durable before the older generation drains. If the process dies in
/// between, the older requests may still reach the backend after a restart, so the mark's
/// own generation must not be forwarded before the start-up settle has passed.
#[tokio::test(start_paused = true)]
async fn a_mark_committed_before_its_drain_waits_out_a_restart() {
    let disk = Disk::new();
    {
        let g = Arc::new(gates_on(&disk, SETTLE));
        let mut held = g
            .admit("s", t(41), Accept)
            .await
            .expect("41 at the backend");
        let g2 = g.clone();
        let newer = tokio::spawn(async move { g2.admit("s", t(42), Accept).await });
        while g.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(g.mark("s").unwrap(), Some(t(42)), "durable, draining 41");
        // The process dies: 42 was never forwarded; 41 is still on its way.
        newer.abort();
        held.guard.complete();
    }
    let g = gates_on(&disk, SETTLE);
    let start = Instant::now();
    // The client retries 42 with the same token, as a `draining` answer tells it to.
    let adm = g.admit("s", t(42), Accept).await.expect("42 once settled");
    assert_eq!(start.elapsed(), SETTLE);
    assert!(!adm.advanced, "the mark was already 42");
}

#[tokio::test(start_paused = true)]
async fn waiting_request_turns_stale_when_a_newer_one_is_admitted() {
    let g = Arc::new(gates());
    let mut held = g.admit("s", t(41), Accept).await.unwrap();
    let g2 = g.clone();
    let w42 = tokio::spawn(async move { g2.admit("s", t(42), Accept).await });
    while g.waiting() == 0 {
        tokio::task::yield_now().await;
    }
    let g3 = g.clone();
    let w43 = tokio::spawn(async move { g3.admit("s", t(43), Accept).await });
    while g.mark("s").unwrap() != Some(t(43)) {
        tokio::task::yield_now().await;
    }
    held.guard.complete();
    drop(held);
    assert_eq!(
        w42.await.unwrap().unwrap_err(),
        Refusal::Stale {
            highest: Some(t(43))
        }
    );
    assert!(w43.await.unwrap().is_ok());
}

#[tokio::test(start_paused = true)]
async fn equal_reject_admits_only_the_advancing_request() {
    let g = gates();
    let first = g
        .admit("s", t(5), Reject)
        .await
        .expect("first of generation");
    assert!(first.advanced);
    assert!(matches!(
        g.admit("s", t(5), Reject).await,
        Err(Refusal::Stale { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn store_failure_refuses_and_memory_never_runs_ahead() {
    let disk = Disk::new();
    let g = gates_on(&disk, SETTLE);
    g.admit("s", t(1), Accept).await.unwrap().guard.complete();
    disk.set_broken(true);
    assert_eq!(
        g.admit("s", t(2), Accept).await.unwrap_err(),
        Refusal::Unavailable
    );
    assert_eq!(g.mark("s").unwrap(), Some(t(1)), "memory stays with disk");
    assert!(g.store().is_failed());
    // Failed closed: even after the disk recovers, no advance until a restart.
    disk.set_broken(false);
    assert_eq!(
        g.admit("s", t(3), Accept).await.unwrap_err(),
        Refusal::Unavailable
    );
    assert_eq!(
        g.admit("other", t(3), Accept).await.unwrap_err(),
        Refusal::Unavailable
    );
}

#[tokio::test(start_paused = true)]
async fn cancelled_waiter_leaves_nothing_behind() {
    let g = Arc::new(gates());
    let mut held = g.admit("s", t(1), Accept).await.unwrap();
    let g2 = g.clone();
    let waiter = tokio::spawn(async move { g2.admit("s", t(2), Accept).await });
    while g.waiting() == 0 {
        tokio::task::yield_now().await;
    }
    waiter.abort();
    let _ = waiter.await;
    assert_eq!(g.waiting(), 0);
    held.guard.complete();
    drop(held);
    // Generation 2 was made durable by the cancelled request; its next request passes.
    let start = Instant::now();
    g.admit("s", t(2), Accept).await.unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn epoch_floor_makes_older_epochs_stale_everywhere() {
    let g = gates();
    g.admit("s", Token::new(0, 900), Accept)
        .await
        .unwrap()
        .guard
        .complete();
    g.store().raise_floor(1).await.unwrap();
    assert!(matches!(
        g.admit("s", Token::new(0, 901), Accept).await,
        Err(Refusal::Stale { .. })
    ));
    assert!(matches!(
        g.admit("never-seen", Token::new(0, 5), Accept).await,
        Err(Refusal::Stale { .. })
    ));
    g.admit("s", Token::new(1, 0), Accept)
        .await
        .expect("new epoch");
}

#[tokio::test(start_paused = true)]
async fn idle_gates_are_swept_and_marks_survive() {
    let g = gates();
    for i in 0..100 {
        g.admit(&format!("scope-{i}"), t(1), Accept)
            .await
            .unwrap()
            .guard
            .complete();
    }
    assert_eq!(g.len(), 100);
    g.sweep();
    assert_eq!(g.len(), 100, "recently used gates stay");
    tokio::time::advance(Duration::from_secs(31)).await;
    g.sweep();
    assert_eq!(g.len(), 0);
    assert!(matches!(
        g.admit("scope-7", t(0), Accept).await,
        Err(Refusal::Stale { highest: Some(h) }) if h == t(1)
    ));
}

#[tokio::test(start_paused = true)]
async fn a_burst_of_new_scopes_does_not_grow_memory_without_bound() {
    let g = gates().with_hot_capacity(64 * 16);
    for i in 0..1_500 {
        g.admit(&format!("burst-{i}"), t(1), Accept)
            .await
            .unwrap()
            .guard
            .complete();
    }
    // No time passed, so the idle TTL never expired: only the cap bounds the map.
    assert!(g.len() <= 64 * 16, "{} hot gates", g.len());
    assert!(matches!(
        g.admit("burst-3", t(0), Accept).await,
        Err(Refusal::Stale { .. })
    ));
}

/// Scopes are as long as a request head allows: the hot gates are bounded by the bytes
/// of their names too, or a burst of long scope names would take gigabytes.
#[tokio::test(start_paused = true)]
async fn long_scope_names_are_bounded_by_their_bytes() {
    let budget = 64 * 64 * 1024;
    let g = gates().with_hot_bytes(budget);
    let long = |i: usize| format!("{i:06}-{}", "x".repeat(16 * 1024));
    for i in 0..1_000 {
        g.admit(&long(i), t(1), Accept)
            .await
            .unwrap()
            .guard
            .complete();
    }
    // 1,000 names of 16 KiB would be ~16 MiB; the budget is 4 MiB.
    assert!(g.len() * long(0).len() <= budget, "{} hot gates", g.len());
    assert!(!g.is_empty());
    // Evicted marks are on disk still.
    assert!(matches!(
        g.admit(&long(3), t(0), Accept).await,
        Err(Refusal::Stale { .. })
    ));
}

/// The start-up settle does not pin gates: a flood of requests to scopes with marks right
/// after a restart stays within the hot-gate bound, and a scope whose gate was evicted
/// meanwhile still waits out the settle when it comes back.
#[tokio::test(start_paused = true)]
async fn the_start_up_settle_does_not_pin_gates_in_memory() {
    let disk = Disk::new();
    {
        let g = gates_on(&disk, SETTLE);
        for i in 0..1_500 {
            g.admit(&format!("s-{i}"), t(1), Accept)
                .await
                .unwrap()
                .guard
                .complete();
        }
    }
    let g = gates_on(&disk, SETTLE).with_hot_capacity(64 * 16);
    let start = Instant::now();
    for i in 0..1_500 {
        assert!(matches!(
            g.admit(&format!("s-{i}"), t(0), Accept).await,
            Err(Refusal::Stale { .. })
        ));
    }
    assert!(g.len() <= 64 * 16, "{} hot gates", g.len());
    let back = g.admit("s-0", t(1), Accept).await.expect("its own token");
    assert_eq!(start.elapsed(), SETTLE, "the settle is kept");
    assert_eq!(back.waited, SETTLE);
}
