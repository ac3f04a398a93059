//! Answers from the mark store's writer thread, handed to each proxy worker once per batch.
//!
//! A committed batch answers every advance in it. Sending each answer on its own oneshot
//! from the writer thread wakes each waiting task from outside its runtime: a remote
//! schedule, an eventfd write and often a thread wake-up per request. A worker runtime
//! that runs [`deliver`] instead gets one hand-over per batch: the writer puts that
//! worker's answers in its mailbox and wakes one task, which sends them on from inside the
//! runtime, where waking a task is a push onto the runtime's own queue.
//!
//! An advance queued on a thread without a mailbox (the main runtime, tests, the CLI) is
//! answered directly, as is every answer to a mailbox whose task has stopped.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{Notify, oneshot};

use super::marks::StoreError;
use crate::token::Token;

/// Where an advance's answer goes.
pub(crate) type Reply = oneshot::Sender<Result<Token, StoreError>>;
type Answer = (Reply, Result<Token, StoreError>);

/// One worker runtime's answers, waiting for its [`deliver`] task.
pub(crate) struct Mailbox {
    state: Mutex<State>,
    notify: Notify,
}

struct State {
    /// False once the delivering task has stopped: answers then go directly.
    open: bool,
    answers: Vec<Answer>,
}

impl Mailbox {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

thread_local! {
    static HERE: RefCell<Option<Arc<Mailbox>>> = const { RefCell::new(None) };
}

/// This thread's mailbox, if a [`deliver`] task runs on it.
pub(crate) fn here() -> Option<Arc<Mailbox>> {
    HERE.try_with(|h| h.borrow().clone()).ok().flatten()
}

/// Answers committed advances on the current thread's runtime, one wake-up per batch.
/// Spawned once on each proxy worker's runtime; runs until the runtime drops it.
pub async fn deliver() {
    let mailbox = Arc::new(Mailbox {
        state: Mutex::new(State {
            open: true,
            answers: Vec::new(),
        }),
        notify: Notify::new(),
    });
    HERE.with(|h| *h.borrow_mut() = Some(mailbox.clone()));
    // When the runtime drops this task, whatever is left is answered directly and later
    // answers bypass the mailbox.
    struct Close(Arc<Mailbox>);
    impl Drop for Close {
        fn drop(&mut self) {
            let _ = HERE.try_with(|h| {
                if let Ok(mut h) = h.try_borrow_mut()
                    && h.as_ref().is_some_and(|m| Arc::ptr_eq(m, &self.0))
                {
                    *h = None;
                }
            });
            let left = {
                let mut state = self.0.lock();
                state.open = false;
                std::mem::take(&mut state.answers)
            };
            for (reply, answer) in left {
                let _ = reply.send(answer);
            }
        }
    }
    let _close = Close(mailbox.clone());
    let mut taken = Vec::new();
    loop {
        mailbox.notify.notified().await;
        std::mem::swap(&mut mailbox.lock().answers, &mut taken);
        for (reply, answer) in taken.drain(..) {
            let _ = reply.send(answer);
        }
    }
}

/// The answers of one batch, grouped by mailbox; [`Outbox::post`] hands them over.
#[derive(Default)]
pub(crate) struct Outbox {
    touched: Vec<Arc<Mailbox>>,
}

impl Outbox {
    /// Answers `reply` through `to`, or at once if there is no mailbox or it has closed.
    pub(crate) fn put(
        &mut self,
        to: Option<&Arc<Mailbox>>,
        reply: Reply,
        answer: Result<Token, StoreError>,
    ) {
        let Some(to) = to else {
            let _ = reply.send(answer);
            return;
        };
        let mut state = to.lock();
        if !state.open {
            drop(state);
            let _ = reply.send(answer);
            return;
        }
        state.answers.push((reply, answer));
        drop(state);
        if !self.touched.iter().any(|m| Arc::ptr_eq(m, to)) {
            self.touched.push(to.clone());
        }
    }

    /// Wakes each mailbox's task once.
    pub(crate) fn post(self) {
        for mailbox in self.touched {
            mailbox.notify.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Answers reach their receivers through the mailbox of the runtime that queued them;
    /// with no mailbox, or once its task has stopped, they arrive directly.
    #[test]
    fn answers_arrive_through_the_mailbox_or_directly() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        let mailbox = rt.block_on(async {
            assert!(here().is_none());
            tokio::spawn(deliver());
            tokio::task::yield_now().await;
            here().expect("a mailbox once deliver runs")
        });
        let (tx, rx) = oneshot::channel();
        let (tx2, mut rx2) = oneshot::channel();
        let mut outbox = Outbox::default();
        outbox.put(Some(&mailbox), tx, Ok(Token::new(1, 5)));
        outbox.put(None, tx2, Ok(Token::new(1, 6)));
        // Without a mailbox the answer is there at once; the other waits for post().
        assert_eq!(
            rx2.try_recv().ok().and_then(|r| r.ok()),
            Some(Token::new(1, 6))
        );
        assert_eq!(mailbox.lock().answers.len(), 1);
        outbox.post();
        // Bounded, so a lost wake-up fails the test instead of hanging it.
        let got = rt
            .block_on(async { tokio::time::timeout(std::time::Duration::from_secs(10), rx).await })
            .ok()
            .and_then(|r| r.ok())
            .and_then(|r| r.ok());
        assert_eq!(got, Some(Token::new(1, 5)));
        // The runtime goes away: what is still in the mailbox is answered, and later
        // answers bypass it.
        let (tx3, mut rx3) = oneshot::channel();
        Outbox::default().put(Some(&mailbox), tx3, Ok(Token::new(1, 7)));
        drop(rt);
        assert!(!mailbox.lock().open);
        assert_eq!(
            rx3.try_recv().ok().and_then(|r| r.ok()),
            Some(Token::new(1, 7))
        );
        assert!(here().is_none());
        let (tx4, mut rx4) = oneshot::channel();
        Outbox::default().put(Some(&mailbox), tx4, Ok(Token::new(1, 8)));
        assert_eq!(
            rx4.try_recv().ok().and_then(|r| r.ok()),
            Some(Token::new(1, 8))
        );
    }
}
