//! Reading without the writer: [`MarkReader`] opens a store file read-only (its journal
//! replayed in memory) for `fencegate store` commands.

use std::path::Path;

use crate::store::Mark;
use crate::store::journal::{Journal, OpenError};
use crate::token::Token;

use super::StoreError;
use super::recover::{JournalFile, journal_path, recover};
use super::tables::{Snapshot, builder, get_mark, list_marks};

/// A read-only view of a store file, for the CLI (works while a server has it open).
pub struct MarkReader {
    pub(super) db: redb::ReadOnlyDatabase,
}

impl MarkReader {
    pub fn open(path: &Path) -> Result<MarkReader, StoreError> {
        if !path.exists() {
            return Err(StoreError::Open {
                path: path.display().to_string(),
                reason: "no such file".into(),
            });
        }
        let open_err = |e: redb::DatabaseError| StoreError::Open {
            path: path.display().to_string(),
            reason: e.to_string(),
        };
        let journal = journal_path(path);
        let journal_err = |e: std::io::Error| StoreError::Open {
            path: journal.display().to_string(),
            reason: e.to_string(),
        };
        // Whether a run left advances in the journal that redb does not have yet. Read
        // without the store's lock: while a server runs this view may be torn, but then
        // the opens below find the store in use.
        let left = || match std::fs::File::open(&journal) {
            Ok(f) => match Journal::open(JournalFile(f), None) {
                Ok((_, pending)) => Ok(!pending.is_empty()),
                // A running server's journal may look damaged while it is being written
                // (a reset in progress): judged again below, with the store's lock held.
                Err(OpenError::Corrupt(_)) => Ok(true),
                Err(OpenError::Io(e)) => Err(journal_err(e)),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(journal_err(e)),
        };
        // A server may start (and stop) between the look at the journal and the read-only
        // open; the journal is looked at again once the handle is held.
        for _ in 0..3 {
            if left()? {
                // Applying them needs the store for writing, which a running server holds.
                let db = match builder().open(path) {
                    Ok(db) => db,
                    Err(redb::DatabaseError::DatabaseAlreadyOpen) => {
                        return Err(StoreError::InUse(path.display().to_string()));
                    }
                    Err(e) => return Err(open_err(e)),
                };
                let file = JournalFile::open(&journal).map_err(journal_err)?;
                recover(&db, file, &journal.display().to_string())?;
            }
            let db = match builder().open_read_only(path) {
                Ok(db) => db,
                Err(redb::DatabaseError::DatabaseAlreadyOpen) => {
                    return Err(StoreError::InUse(path.display().to_string()));
                }
                // Not closed cleanly (a crash) and nobody has it open: a read-only handle
                // cannot repair, so open it once for writing, which repairs, then read.
                Err(redb::DatabaseError::RepairAborted) => {
                    drop(builder().open(path).map_err(open_err)?);
                    builder().open_read_only(path).map_err(open_err)?
                }
                Err(e) => return Err(open_err(e)),
            };
            if !left()? {
                return Ok(MarkReader { db });
            }
        }
        Err(StoreError::InUse(path.display().to_string()))
    }

    pub fn get(&self, scope: &str) -> Result<Option<Token>, StoreError> {
        Ok(get_mark(&self.db, scope)?.map(|m| m.token))
    }

    /// The mark of one scope with its sequence.
    pub fn get_mark(&self, scope: &str) -> Result<Option<Mark>, StoreError> {
        get_mark(&self.db, scope)
    }

    pub fn list(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Token)>, StoreError> {
        list_marks(&self.db, prefix, after, limit)
    }

    pub fn snapshot(&self) -> Result<Snapshot, StoreError> {
        Snapshot::of(&self.db)
    }
}
