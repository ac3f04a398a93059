//! An in-memory redb disk that can be told to fail every write and sync: store failures
//! (full disk, failed fsync) on demand.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use redb::StorageBackend;
use redb::backends::InMemoryBackend;

#[derive(Debug, Clone, Default)]
pub struct Disk {
    inner: Arc<InMemoryBackend>,
    broken: Arc<AtomicBool>,
}

impl Disk {
    pub fn new() -> Disk {
        Disk::default()
    }

    /// From now on every write and sync fails (or succeeds again with `false`).
    pub fn set_broken(&self, broken: bool) {
        self.broken.store(broken, Ordering::SeqCst);
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
        self.check()?;
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.check()?;
        self.inner.write(offset, data)
    }
}
