//! A power-loss double of a disk: what was written but not synced may or may not survive
//! a crash, so a restart sees one of several images (as redb's own crash tests model it).
//! Every write, length change and sync of every disk on one [`Power`] is numbered; the
//! power can be cut before any one of them, and from then on each fails.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use redb::StorageBackend;

/// The power shared by the disks of one machine: one cut stops them all at once.
#[derive(Debug)]
pub struct Power {
    ops: AtomicU64,
    cut_at: AtomicU64,
}

impl Power {
    pub fn new() -> Arc<Power> {
        Arc::new(Power {
            ops: AtomicU64::new(0),
            cut_at: AtomicU64::new(u64::MAX),
        })
    }

    /// Writes and syncs so far, on every disk.
    pub fn ops(&self) -> u64 {
        self.ops.load(Ordering::SeqCst)
    }

    /// The power goes off just before op number `n` (counted from 0): it and every op after
    /// it fail and change nothing.
    pub fn cut_before(&self, n: u64) {
        self.cut_at.store(n, Ordering::SeqCst);
    }

    pub fn is_cut(&self) -> bool {
        self.ops() >= self.cut_at.load(Ordering::SeqCst)
    }

    fn tick(&self) -> std::io::Result<()> {
        let n = self.ops.fetch_add(1, Ordering::SeqCst);
        if n >= self.cut_at.load(Ordering::SeqCst) {
            // Not counted: the machine is off.
            self.ops.fetch_sub(1, Ordering::SeqCst);
            return Err(std::io::Error::other("power lost"));
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
enum Change {
    Write(u64, Vec<u8>),
    Len(u64),
}

fn apply(image: &mut Vec<u8>, change: &Change) {
    match change {
        Change::Write(at, data) => {
            let end = *at as usize + data.len();
            if image.len() < end {
                image.resize(end, 0);
            }
            image[*at as usize..end].copy_from_slice(data);
        }
        Change::Len(len) => image.resize(*len as usize, 0),
    }
}

#[derive(Debug, Default)]
struct State {
    /// What a sync made durable.
    durable: Vec<u8>,
    /// What reads see (the page cache).
    live: Vec<u8>,
    /// Changes since the last sync, in order.
    unsynced: Vec<Change>,
}

#[derive(Debug, Clone)]
pub struct PowerDisk {
    power: Arc<Power>,
    state: Arc<Mutex<State>>,
}

/// Which of the unsynced changes a restart finds on the disk.
#[derive(Debug, Clone, Copy)]
pub enum Survivors {
    /// None of them.
    None,
    /// All of them, in order (the cache was flushed just before the cut).
    All,
    /// The first half, the last of them cut in half (a write torn by the cut).
    TornHalf,
    /// Only the last one (the disk reordered them).
    LastOnly,
}

pub const SURVIVORS: [Survivors; 4] = [
    Survivors::None,
    Survivors::All,
    Survivors::TornHalf,
    Survivors::LastOnly,
];

impl PowerDisk {
    pub fn new(power: &Arc<Power>) -> PowerDisk {
        PowerDisk::from_image(power, Vec::new())
    }

    /// A disk holding `image`, durable.
    pub fn from_image(power: &Arc<Power>, image: Vec<u8>) -> PowerDisk {
        PowerDisk {
            power: power.clone(),
            state: Arc::new(Mutex::new(State {
                durable: image.clone(),
                live: image,
                unsynced: Vec::new(),
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What a restart after the cut finds on this disk.
    pub fn image_after_crash(&self, survivors: Survivors) -> Vec<u8> {
        let state = self.lock();
        let mut image = state.durable.clone();
        let unsynced = &state.unsynced;
        match survivors {
            Survivors::None => {}
            Survivors::All => unsynced.iter().for_each(|c| apply(&mut image, c)),
            Survivors::TornHalf => {
                let n = unsynced.len().div_ceil(2);
                for (i, c) in unsynced.iter().take(n).enumerate() {
                    match c {
                        Change::Write(at, data) if i + 1 == n => apply(
                            &mut image,
                            &Change::Write(*at, data[..data.len() / 2].to_vec()),
                        ),
                        c => apply(&mut image, c),
                    }
                }
            }
            Survivors::LastOnly => {
                if let Some(c) = unsynced.last() {
                    apply(&mut image, c)
                }
            }
        }
        image
    }

    /// Changes not yet synced.
    pub fn unsynced(&self) -> usize {
        self.lock().unsynced.len()
    }
}

impl StorageBackend for PowerDisk {
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.lock().live.len() as u64)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        let state = self.lock();
        let end = offset as usize + out.len();
        if end > state.live.len() {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        out.copy_from_slice(&state.live[offset as usize..end]);
        Ok(())
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.power.tick()?;
        let mut state = self.lock();
        let change = Change::Len(len);
        apply(&mut state.live, &change);
        state.unsynced.push(change);
        Ok(())
    }

    fn sync_data(&self) -> std::io::Result<()> {
        self.power.tick()?;
        let mut state = self.lock();
        state.durable = state.live.clone();
        state.unsynced.clear();
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.power.tick()?;
        let mut state = self.lock();
        let change = Change::Write(offset, data.to_vec());
        apply(&mut state.live, &change);
        state.unsynced.push(change);
        Ok(())
    }
}
