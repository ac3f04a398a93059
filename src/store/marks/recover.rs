//! Recovery: replaying the journal into redb at open, reopening the file after a failed
//! commit, and `store recover` for a journal that does not check out (SPEC §7).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use redb::{Database, ReadableDatabase, StorageBackend};

use crate::store::Mark;
use crate::store::journal::{self, Journal, OpenError};
use crate::store::quota::Tally;

use super::StoreError;
use super::records::tally_records;
use super::tables::Snapshot;
use super::tables::{
    JOURNAL_APPLIED, JOURNAL_CLEAN, META, builder, initialize, raise_floor_to, raise_marks,
    sync_dir,
};

/// The store file at `path` opened again as [`MarkStore::open`](super::MarkStore::open) opens it: the database,
/// its journal (applied), the epoch floor and the records' usage.
pub(super) fn reopen_parts(path: &Path) -> Result<(Database, Journal, u64, Tally), ReopenError> {
    let db = builder().create(path)?;
    let journal = JournalFile::open(&journal_path(path))?;
    let floor = initialize(&db)?;
    let journal = recover(&db, journal, &journal_path(path).display().to_string())?;
    let tally = tally_records(&db)?;
    Ok((db, journal, floor, tally))
}

/// Why the store file could not be opened again after a failure (logged; the writer tries
/// again later).
#[derive(Debug, thiserror::Error)]
pub(super) enum ReopenError {
    #[error(transparent)]
    Database(#[from] redb::DatabaseError),
    #[error(transparent)]
    Journal(#[from] std::io::Error),
    #[error(transparent)]
    Redb(#[from] redb::Error),
    #[error(transparent)]
    Recover(#[from] StoreError),
}

/// What `fencegate store recover` did.
#[derive(Debug)]
pub struct Recovered {
    /// Records of the journal that checked out, and the scopes they held.
    pub records: usize,
    pub scopes: usize,
    /// The epoch floor now in force: above every epoch seen in the store and its journal.
    pub floor: u64,
    /// redb's integrity check had to repair the store file.
    pub repaired: bool,
    /// Where the damaged journal was kept (None: there was none).
    pub journal_kept: Option<PathBuf>,
}

/// The way out of a damaged journal (or a journal that does not belong with its store),
/// safe by construction: every journal record that checks out is applied (max per scope),
/// and the epoch floor is raised above every epoch seen in the store file and the journal
/// and to at least `at_least`, so every token issued before the damage is stale and
/// owners re-acquire. The damaged journal is kept beside the store, a new empty one takes
/// its place. The server must be stopped.
pub fn recover_store(path: &Path, at_least: u64) -> Result<Recovered, StoreError> {
    let open_err = |reason: String| StoreError::Open {
        path: path.display().to_string(),
        reason,
    };
    if !path.exists() {
        return Err(open_err("no such file".into()));
    }
    let mut db = match builder().open(path) {
        Ok(db) => db,
        Err(redb::DatabaseError::DatabaseAlreadyOpen) => {
            return Err(StoreError::InUse(path.display().to_string()));
        }
        Err(e) => {
            return Err(open_err(format!(
                "{e}: the store file itself is damaged; restore a backup into a new store file (`fencegate restore`) and bump the epoch"
            )));
        }
    };
    let repaired = !db.check_integrity().map_err(|e| {
        open_err(format!(
            "{e}: the store file itself is damaged; restore a backup into a new store file (`fencegate restore`) and bump the epoch"
        ))
    })?;
    let floor = initialize(&db).map_err(|e| open_err(e.to_string()))?;
    let journal = journal_path(path);
    let saved = match std::fs::File::open(&journal) {
        Ok(f) => Some(
            journal::salvage(&JournalFile(f))
                .map_err(|e| open_err(format!("its journal {}: {e}", journal.display())))?,
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(open_err(format!("its journal {}: {e}", journal.display()))),
    };
    let mut seen = floor.max(saved.as_ref().map_or(0, |s| s.max_epoch));
    Snapshot::of(&db)?.for_each(|_, t| {
        seen = seen.max(t.epoch);
        true
    })?;
    let new_floor = seen
        .checked_add(1)
        .ok_or_else(|| open_err("an epoch of 2^64-1 was seen: no floor can be above it".into()))?
        .max(at_least);
    let (records, mut marks) = match saved {
        Some(s) => (s.records, s.pending.into_iter().collect::<Vec<_>>()),
        None => (0, Vec::new()),
    };
    marks.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    let scopes = marks.len();
    let failed = |e: redb::Error| open_err(e.to_string());
    // The floor first: a crash before the marks' commit leaves the store as damaged as it
    // was (and recover runs again), never marked clean without its floor.
    raise_floor_to(&db, new_floor).map_err(failed)?;
    // Then the salvaged marks, and a journal that starts over (empty, as after a clean
    // close).
    raise_marks(&db, &mut marks, Some((0, true))).map_err(failed)?;
    drop(db);
    let journal_kept = if journal.exists() {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut name = journal.file_name().unwrap_or_default().to_os_string();
        name.push(format!(".damaged-{secs}"));
        let kept = journal.with_file_name(name);
        std::fs::rename(&journal, &kept)
            .and_then(|()| sync_dir(&journal))
            .map_err(|e| open_err(format!("cannot move its journal aside: {e}")))?;
        Some(kept)
    } else {
        None
    };
    Ok(Recovered {
        records,
        scopes,
        floor: new_floor,
        repaired,
        journal_kept,
    })
}

/// Where the journal of the store at `path` lives: next to it, `<file name>.journal`.
pub fn journal_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".journal");
    path.with_file_name(name)
}

/// The journal's file (redb's backend trait, so that tests can inject a failing disk).
#[derive(Debug)]
pub(super) struct JournalFile(pub(super) std::fs::File);

impl JournalFile {
    pub(super) fn open(path: &Path) -> std::io::Result<JournalFile> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        // The file's name must survive a crash as surely as what is written in it (on every
        // open: a run that created it may have crashed before this).
        file.sync_all()?;
        sync_dir(path)?;
        Ok(JournalFile(file))
    }
}

impl StorageBackend for JournalFile {
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&self.0, out, offset)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.0.set_len(len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        self.0.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(&self.0, data, offset)
    }
}

/// Applies what the journal holds to redb in one transaction; returns the journal emptied.
/// Refuses a journal that is damaged, or that does not belong with this store file.
pub(super) fn recover(
    db: &Database,
    file: impl StorageBackend,
    name: &str,
) -> Result<Journal, StoreError> {
    let corrupt = |offset: u64, what: String| StoreError::Corrupt {
        path: name.to_string(),
        offset,
        what,
    };
    let failed = |e: redb::Error| StoreError::Open {
        path: name.to_string(),
        reason: e.to_string(),
    };
    let (applied, clean) = journal_meta(db).map_err(failed)?;
    let (mut journal, pending) = Journal::open(file, applied).map_err(|e| match e {
        OpenError::Corrupt(c) => corrupt(c.offset, c.what),
        OpenError::Io(e) => failed(redb::Error::Io(e)),
    })?;
    let generation = journal.generation();
    // No bookkeeping yet: a store from before it was kept, or a new one.
    if let Some(applied) = applied {
        // Generation 0 applied: the first reset (which writes the first header) may have
        // been cut short, so a blank journal lost nothing. From 1 on a header existed.
        if generation == 0 && !clean && applied >= 1 {
            return Err(corrupt(
                0,
                format!(
                    "the journal is missing or blank, but the store file has used one (up to generation {applied}) and was not closed cleanly"
                ),
            ));
        }
        if generation != 0 && generation != applied && generation != applied + 1 {
            let which = if generation > applied {
                "the store file is older than its journal (an older copy of it restored?)"
            } else {
                "the journal is older than the store file (an older copy of it restored?)"
            };
            return Err(corrupt(
                0,
                format!(
                    "the journal's generation is {generation}, the store file's last applied {applied}: {which}"
                ),
            ));
        }
    }
    let mut marks: Vec<(Arc<str>, Mark)> = pending.into_iter().collect();
    if !marks.is_empty() {
        marks.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        tracing::info!(
            scopes = marks.len(),
            "applying the mark journal left by the last run"
        );
    }
    // With the bookkeeping of a running server: not closed cleanly until `close` says so.
    raise_marks(db, &mut marks, Some((generation, false))).map_err(failed)?;
    journal.reset().map_err(|e| failed(redb::Error::Io(e)))?;
    Ok(journal)
}

/// The journal's bookkeeping in redb: the generation last applied (None: never kept) and
/// whether the last close was clean.
pub(super) fn journal_meta(db: &Database) -> Result<(Option<u64>, bool), redb::Error> {
    let txn = db.begin_read()?;
    let meta = txn.open_table(META)?;
    let applied = meta.get(JOURNAL_APPLIED)?.map(|g| g.value());
    let clean = meta.get(JOURNAL_CLEAN)?.map(|g| g.value()) == Some(1);
    Ok((applied, clean))
}
