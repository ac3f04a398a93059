//! An in-memory redb disk that can be told to fail every write and sync: store failures
//! (full disk, failed fsync) on demand; or to hold or panic in a sync.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use redb::StorageBackend;
use redb::backends::InMemoryBackend;

#[derive(Debug, Clone, Default)]
pub struct Disk {
    inner: Arc<InMemoryBackend>,
    broken: Arc<AtomicBool>,
    /// While true, every sync waits (a commit held mid-way); `syncing` says one does.
    held: Arc<(Mutex<bool>, Condvar)>,
    syncing: Arc<AtomicBool>,
    /// While true, a sync panics: the thread committing dies mid-commit.
    panicking: Arc<AtomicBool>,
}

impl Disk {
    pub fn new() -> Disk {
        Disk::default()
    }

    /// From now on every write and sync fails (or succeeds again with `false`).
    pub fn set_broken(&self, broken: bool) {
        self.broken.store(broken, Ordering::SeqCst);
    }

    /// From now on a sync waits until [`release`](Disk::release): commits stop mid-way.
    #[allow(dead_code)]
    pub fn hold(&self) {
        *self.held.0.lock().unwrap_or_else(|p| p.into_inner()) = true;
    }

    #[allow(dead_code)]
    pub fn release(&self) {
        *self.held.0.lock().unwrap_or_else(|p| p.into_inner()) = false;
        self.held.1.notify_all();
    }

    /// From now on a sync panics (or works again with `false`): the writer thread dies.
    #[allow(dead_code)]
    pub fn set_panicking(&self, panicking: bool) {
        self.panicking.store(panicking, Ordering::SeqCst);
    }

    /// A sync is waiting in [`hold`](Disk::hold).
    #[allow(dead_code)]
    pub fn syncing(&self) -> bool {
        self.syncing.load(Ordering::SeqCst)
    }

    fn check(&self) -> std::io::Result<()> {
        if self.broken.load(Ordering::SeqCst) {
            Err(std::io::Error::other("injected disk failure"))
        } else {
            Ok(())
        }
    }
}

impl StorageBackend for Disk {
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        self.inner.read(offset, out)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.check()?;
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        if self.panicking.load(Ordering::SeqCst) {
            panic!("injected panic in a sync");
        }
        let (held, released) = &*self.held;
        let mut h = held.lock().unwrap_or_else(|p| p.into_inner());
        while *h {
            self.syncing.store(true, Ordering::SeqCst);
            h = released.wait(h).unwrap_or_else(|p| p.into_inner());
        }
        drop(h);
        self.syncing.store(false, Ordering::SeqCst);
        self.check()?;
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.check()?;
        self.inner.write(offset, data)
    }
}
