//! Reading without the writer: [`Snapshot`]s of the marks and [`MarkReader`], which opens
//! a store file read-only for `fencegate store` commands; and the listing's byte budget.

use std::path::Path;

use redb::{ReadableDatabase, ReadableTable};

use super::super::Mark;
use super::super::journal::{Journal, OpenError};
use crate::token::Token;

use super::recover::{JournalFile, journal_path, recover};
use super::tables::{MARKS, META, builder, get_mark, list_marks};
use super::{StoreError, read_err};

/// Scope bytes after which a listing stops short of its `limit` (see [`listed_all`]): a
/// scope is as long as a request head allows, and 10,000 long ones would take gigabytes.
pub const LIST_BYTES: usize = 4 << 20;

/// Whether a listing asked for `limit` marks holds every mark that was left: it is short
/// of its limit, and not because it reached [`LIST_BYTES`].
pub fn listed_all(marks: &[(String, Token)], limit: usize) -> bool {
    marks.len() < limit && marks.iter().map(|(s, _)| s.len()).sum::<usize>() < LIST_BYTES
}

/// One read transaction: the floor and the marks it shows belong together, whatever is
/// committed meanwhile (a floor read apart from the marks could be older or newer than
/// they are, and a backup of both would never have existed).
pub struct Snapshot {
    pub(super) txn: redb::ReadTransaction,
}

impl Snapshot {
    pub(super) fn of(db: &impl ReadableDatabase) -> Result<Snapshot, StoreError> {
        Ok(Snapshot {
            txn: db.begin_read().map_err(read_err)?,
        })
    }

    pub fn floor(&self) -> Result<u64, StoreError> {
        let meta = self.txn.open_table(META).map_err(read_err)?;
        Ok(meta
            .get("epoch_floor")
            .map_err(read_err)?
            .map(|g| g.value())
            .unwrap_or(0))
    }

    /// Every mark in scope order, until `f` answers false.
    pub fn for_each(&self, mut f: impl FnMut(&str, Token) -> bool) -> Result<(), StoreError> {
        let table = self.txn.open_table(MARKS).map_err(read_err)?;
        for item in table.iter().map_err(read_err)? {
            let (k, v) = item.map_err(read_err)?;
            let (e, c) = v.value();
            if !f(k.value(), Token::new(e, c)) {
                break;
            }
        }
        Ok(())
    }
}

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
