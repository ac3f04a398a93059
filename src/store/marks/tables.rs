//! The schema: the redb tables of marks, sequences and store-wide facts, how a store file
//! is made and initialized, the reads and raises of marks within one transaction, and
//! [`Snapshot`]s and listings (with their byte budget) of the marks.

use std::path::Path;
use std::sync::Arc;

use redb::{
    ConcurrencyMode, Database, Durability, ReadableDatabase, ReadableTable, TableDefinition,
};

use crate::store::Mark;
use crate::token::Token;

use super::records::{RECORD_EXPIRY, RECORD_OWNER, RECORDS};
use super::{StoreError, read_err};

/// scope → (epoch, counter). Tokens as two integers, never as text.
pub(super) const MARKS: TableDefinition<&str, (u64, u64)> = TableDefinition::new("marks");

/// Store-wide facts: format version, epoch floor, and the journal's bookkeeping
/// ([`JOURNAL_APPLIED`], [`JOURNAL_CLEAN`]).
/// scope → (epoch, counter, sequence): the highest `Fencing-Sequence` accepted for that
/// token (SPEC §11). It counts only while that token is the scope's mark: a higher token
/// starts the sequence over without a write here. A table of its own, so that a store
/// file from before sequences opens as it is (the table is made at the first open).
pub(super) const SEQUENCES: TableDefinition<&str, (u64, u64, u64)> =
    TableDefinition::new("sequences");

pub(super) const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

pub(super) const FORMAT_VERSION: u64 = 1;

/// The journal generation whose records a checkpoint last committed to redb. The journal's
/// header is then that generation (a crash before its reset) or the next: anything else
/// means one of the two files is not the other's (an older copy restored, a journal
/// swapped), and acknowledged marks may be missing.
pub(super) const JOURNAL_APPLIED: &str = "journal_applied";

/// 1 once a clean close emptied the journal, 0 while a server runs: a journal missing or
/// blank is only harmless after a clean close.
pub(super) const JOURNAL_CLEAN: &str = "journal_clean";

/// redb's page cache; its default (1 GiB) would let RSS follow the file size.
pub(super) const CACHE_BYTES: usize = 32 << 20;

pub(super) fn builder() -> redb::Builder {
    let mut b = Database::builder();
    // ExclusiveWriter: one fsync per commit. (SingleWriter would let other processes read
    // the file while the server runs, but commits in two phases, with twice the fsyncs;
    // the CLI reads through the admin API instead while the server holds the file.)
    b.set_concurrency_mode(ConcurrencyMode::ExclusiveWriter);
    // Memory must not grow with the number of marks on disk; hot scopes live in the gates.
    b.set_cache_size(CACHE_BYTES);
    // A plain open trusts the file's pages: a flipped bit in a leaf reads as a mark that
    // is not there (measured: the scope's mark vanished, no error). The check verifies
    // every page's checksum, so a file changed behind redb's back fails to open.
    b.set_check_integrity_on_open(true);
    b
}

/// Creates the tables and checks the format; returns the epoch floor.
pub(super) fn initialize(db: &Database) -> Result<u64, redb::Error> {
    let mut txn = db.begin_write()?;
    txn.set_durability(Durability::Immediate)
        .map_err(|e| redb::Error::Io(std::io::Error::other(e.to_string())))?;
    let floor;
    {
        let mut meta = txn.open_table(META)?;
        let version = meta.get("format_version")?.map(|g| g.value());
        match version {
            None => {
                meta.insert("format_version", FORMAT_VERSION)?;
            }
            Some(FORMAT_VERSION) => {}
            Some(other) => {
                return Err(redb::Error::Io(std::io::Error::other(format!(
                    "store format version {other} is not supported (this build reads {FORMAT_VERSION})"
                ))));
            }
        }
        floor = meta.get("epoch_floor")?.map(|g| g.value()).unwrap_or(0);
        txn.open_table(MARKS)?;
        txn.open_table(SEQUENCES)?;
        txn.open_table(RECORDS)?;
        txn.open_table(RECORD_EXPIRY)?;
        txn.open_table(RECORD_OWNER)?;
    }
    txn.commit()?;
    Ok(floor)
}

/// An empty in-memory database: what the writer holds while its file is closed.
pub(super) fn placeholder() -> Result<Database, redb::DatabaseError> {
    Database::builder().create_with_backend(redb::backends::InMemoryBackend::new())
}

/// Makes a new store file whole under another name and renames it into place, so that a
/// crash while it is made leaves no half-made file at `path` (which redb would refuse).
pub(super) fn create_file(path: &Path) -> Result<(), redb::Error> {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".new");
    let new = path.with_file_name(name);
    match std::fs::remove_file(&new) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
    }
    let db = builder().create(&new)?;
    initialize(&db)?;
    drop(db);
    std::fs::File::open(&new)?.sync_all()?;
    std::fs::rename(&new, path)?;
    sync_dir(path)?;
    Ok(())
}

/// Makes a name created or renamed in `path`'s directory survive a crash.
pub(super) fn sync_dir(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)?.sync_all()
}

/// Durably raises the epoch floor to at least `floor` (never lowers it).
pub(super) fn raise_floor_to(db: &Database, floor: u64) -> Result<(), redb::Error> {
    let mut txn = db.begin_write()?;
    txn.set_durability(Durability::Immediate)
        .map_err(|e| redb::Error::Io(std::io::Error::other(e.to_string())))?;
    {
        let mut meta = txn.open_table(META)?;
        let now = meta.get("epoch_floor")?.map(|g| g.value()).unwrap_or(0);
        meta.insert("epoch_floor", now.max(floor))?;
    }
    txn.commit()?;
    Ok(())
}

/// Raises each mark to at least its token in one durable transaction (never lowers one);
/// each token becomes the mark stored.
/// With `journal` = (generation, clean), the journal's bookkeeping is committed with them
/// (see [`JOURNAL_APPLIED`]).
pub(super) fn raise_marks(
    db: &Database,
    marks: &mut [(Arc<str>, Mark)],
    journal: Option<(u64, bool)>,
) -> Result<(), redb::Error> {
    let mut txn = db.begin_write()?;
    txn.set_durability(Durability::Immediate)
        .map_err(|e| redb::Error::Io(std::io::Error::other(e.to_string())))?;
    let mut changed = false;
    {
        let mut table = txn.open_table(MARKS)?;
        let mut sequences = txn.open_table(SEQUENCES)?;
        for (scope, mark) in marks.iter_mut() {
            changed |= raise(&mut table, &mut sequences, scope, mark)?;
        }
    }
    if let Some((generation, clean)) = journal {
        let mut meta = txn.open_table(META)?;
        let was = (
            meta.get(JOURNAL_APPLIED)?.map(|g| g.value()),
            meta.get(JOURNAL_CLEAN)?.map(|g| g.value()),
        );
        let now = (Some(generation), Some(u64::from(clean)));
        if was != now {
            meta.insert(JOURNAL_APPLIED, generation)?;
            meta.insert(JOURNAL_CLEAN, u64::from(clean))?;
            changed = true;
        }
    }
    if changed {
        txn.commit()?;
    } else {
        txn.abort()?;
    }
    Ok(())
}

/// Raises one mark (and its sequence) to at least `mark`; `mark` becomes what is stored.
/// Answers whether anything changed.
pub(super) fn raise(
    marks: &mut redb::Table<&str, (u64, u64)>,
    sequences: &mut redb::Table<&str, (u64, u64, u64)>,
    scope: &str,
    mark: &mut Mark,
) -> Result<bool, redb::Error> {
    let mut token = mark.token;
    let mut changed = raise_token(marks, scope, &mut token)?;
    let held = sequence_of(sequences.get(scope)?.map(|g| g.value()), token);
    // A sequence counts for its own token only: under a higher stored one it is void.
    let wanted = mark.sequence.filter(|_| mark.token == token);
    if let Some(n) = wanted.filter(|n| held.is_none_or(|h| *n > h)) {
        sequences.insert(scope, (token.epoch, token.counter, n))?;
        changed = true;
    }
    *mark = Mark {
        token,
        sequence: wanted.max(held),
    };
    Ok(changed)
}

/// The sequence a `SEQUENCES` row holds for `token` (none if it is another token's).
pub(super) fn sequence_of(row: Option<(u64, u64, u64)>, token: Token) -> Option<u64> {
    row.filter(|(e, c, _)| Token::new(*e, *c) == token)
        .map(|(_, _, n)| n)
}

/// Raises one token to at least `token` in one walk down the tree; `token` becomes the
/// mark stored. Answers whether anything changed.
pub(super) fn raise_token(
    marks: &mut redb::Table<&str, (u64, u64)>,
    scope: &str,
    token: &mut Token,
) -> Result<bool, redb::Error> {
    // Write, and look at what was there. A higher one found is put back (rare: the gates
    // queue only advances above what they hold, and they hold what is on disk).
    let before = marks.insert(scope, (token.epoch, token.counter))?.map(|g| {
        let (e, c) = g.value();
        Token::new(e, c)
    });
    Ok(match before {
        Some(b) if b > *token => {
            marks.insert(scope, (b.epoch, b.counter))?;
            *token = b;
            false
        }
        Some(b) => b != *token,
        None => true,
    })
}

pub(super) fn get_mark(
    db: &impl ReadableDatabase,
    scope: &str,
) -> Result<Option<Mark>, StoreError> {
    let txn = db.begin_read().map_err(read_err)?;
    let table = txn.open_table(MARKS).map_err(read_err)?;
    let Some(token) = table.get(scope).map_err(read_err)?.map(|g| {
        let (e, c) = g.value();
        Token::new(e, c)
    }) else {
        return Ok(None);
    };
    let sequence = match txn.open_table(SEQUENCES) {
        Ok(t) => sequence_of(t.get(scope).map_err(read_err)?.map(|g| g.value()), token),
        // A store file from before sequences, read without a writer's open: none yet.
        Err(redb::TableError::TableDoesNotExist(_)) => None,
        Err(e) => return Err(read_err(e)),
    };
    Ok(Some(Mark { token, sequence }))
}

pub(super) fn list_marks(
    db: &impl ReadableDatabase,
    prefix: &str,
    after: Option<&str>,
    limit: usize,
) -> Result<Vec<(String, Token)>, StoreError> {
    let txn = db.begin_read().map_err(read_err)?;
    let table = txn.open_table(MARKS).map_err(read_err)?;
    let start = match after {
        Some(a) if a >= prefix => a,
        _ => prefix,
    };
    let mut out = Vec::new();
    let mut bytes = 0;
    for item in table.range(start..).map_err(read_err)? {
        let (k, v) = item.map_err(read_err)?;
        let key = k.value();
        if Some(key) == after {
            continue;
        }
        // `listed_all` tells a page cut short by the byte budget by this same rule.
        if !key.starts_with(prefix) || out.len() >= limit || bytes >= LIST_BYTES {
            break;
        }
        let (e, c) = v.value();
        bytes += key.len();
        out.push((key.to_string(), Token::new(e, c)));
    }
    Ok(out)
}

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
