//! The advance journal: a write-ahead log of mark advances in front of redb.
//!
//! A batch made only of advances is appended to this file as one record and made durable
//! with one `fdatasync` of it, instead of a redb transaction: a redb commit copies and
//! checksums every B-tree page the batch touches and writes them, scattered, with its own
//! bookkeeping, and on the two-core machine the load bench runs on that CPU, not the
//! disk, bounds the rate of advances. The journal's advances are applied to redb in one
//! transaction now and then (a checkpoint: when the journal passes [`JOURNAL_BYTES`] or
//! its scopes pass [`PENDING_SCOPES`], at a clean close, before a listing or a backup,
//! and when the store is opened), after which the journal starts over.
//!
//! Replaying a record is taking the max per scope, so replaying it twice, or replaying one
//! already applied, changes nothing: a crash at any point of a checkpoint loses nothing.
//!
//! Layout: a header (`MAGIC`, generation, check), then records, each a header (body
//! length, generation, check) and a body of entries (scope length, scope, epoch, counter;
//! little-endian). An entry that carries a `Fencing-Sequence` has [`WITH_SEQUENCE`] set in
//! its scope length and the sequence after its counter: entries without one are written
//! as before sequences existed, so a journal left by an earlier build reads the same. A record counts only when it is whole, its check matches and it
//! belongs to the header's generation; reading stops at the first that does not (a torn
//! tail, or what is left of an earlier generation: the file is overwritten from the start
//! after each checkpoint, cut back to [`JOURNAL_BYTES`] only when a batch made it longer).
//! The check is the first 8 bytes of SHA-256.

use std::collections::BTreeMap;
use std::sync::Arc;

use redb::StorageBackend;
use sha2::{Digest, Sha256};

use super::Mark;
use crate::token::Token;

/// Set in an entry's scope length: a sequence (8 bytes) follows the counter. Scopes are
/// far shorter than 2^31 bytes (`fencing.max_scope_bytes`).
const WITH_SEQUENCE: u32 = 1 << 31;

const MAGIC: [u8; 8] = *b"fgjrnl\x00\x01";
const HEADER: u64 = 24;
const RECORD_HEADER: usize = 24;
/// A checkpoint is due once the journal is this long. The file is written to this length
/// once, when created, so that appends overwrite blocks it already has: an `fdatasync`
/// then has only data to write, no file size or block map.
pub const JOURNAL_BYTES: u64 = 4 << 20;
/// A checkpoint is due once this many scopes wait in the journal (they are held in
/// memory until then, and one checkpoint writes them all).
pub const PENDING_SCOPES: usize = 16_384;

fn check(generation: u64, body: &[u8]) -> u64 {
    let mut h = Sha256::new();
    h.update(generation.to_le_bytes());
    h.update(body);
    let d = h.finalize();
    let mut c = [0u8; 8];
    c.copy_from_slice(&d[..8]);
    u64::from_le_bytes(c)
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    let s = b.get(at..at.checked_add(8)?)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(s);
    Some(u64::from_le_bytes(a))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at.checked_add(4)?)?;
    let mut a = [0u8; 4];
    a.copy_from_slice(s);
    Some(u32::from_le_bytes(a))
}

/// The journal was changed by something other than a crash: a record or header fails its
/// check where a crash cannot have left one. Acknowledged advances may be behind it, so it
/// is never read past silently.
#[derive(Debug, Clone, thiserror::Error)]
#[error("corrupt at byte {offset}: {what}")]
pub struct Corruption {
    pub offset: u64,
    pub what: String,
}

impl Corruption {
    fn at(offset: u64, what: impl Into<String>) -> Corruption {
        Corruption {
            offset,
            what: what.into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Corrupt(#[from] Corruption),
}

pub struct Journal {
    file: Box<dyn StorageBackend>,
    generation: u64,
    /// Where the next record goes.
    end: u64,
    /// The file's length.
    len: u64,
    buf: Vec<u8>,
}

/// Advances read back from a journal: the highest mark per scope, ordered (the scopes
/// beneath a WebDAV collection's are one range of it).
pub type Pending = BTreeMap<Arc<str>, Mark>;

impl Journal {
    /// Reads every whole record of the current generation. The journal is then ready for
    /// [`reset`](Journal::reset), which must follow once what was read is applied.
    ///
    /// `applied`: the generation whose records the store file says it holds (None: it
    /// does not say). Records of it and earlier ones are in redb already, so a damaged
    /// header with only such records behind it lost nothing (a reset torn by a crash).
    pub fn open(
        file: impl StorageBackend,
        applied: Option<u64>,
    ) -> Result<(Journal, Pending), OpenError> {
        let len = file.len()?;
        let contents = read(&file, len, applied)?;
        if let Some(at) = contents.torn {
            // Expected after a crash mid-append (that record was never acknowledged); also
            // what a damaged last record looks like, which no check can tell apart.
            tracing::warn!(
                offset = at,
                "the mark journal ends in a torn record (a crash during its write); it was never acknowledged and is ignored"
            );
        }
        Ok((
            Journal {
                file: Box::new(file),
                generation: contents.generation,
                end: len.max(HEADER),
                len,
                buf: Vec::new(),
            },
            contents.pending,
        ))
    }

    /// The generation of the records now being written (0: never reset).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Starts over, empty, in a new generation: every record before is void. Only after
    /// what they hold has been committed to redb.
    pub fn reset(&mut self) -> std::io::Result<()> {
        let len = self.file.len()?;
        if len > JOURNAL_BYTES {
            // A batch crossed the mark; what lies past it is void from now on.
            self.file.set_len(JOURNAL_BYTES)?;
            self.len = JOURNAL_BYTES;
        } else if len < JOURNAL_BYTES {
            self.file.set_len(JOURNAL_BYTES)?;
            self.len = JOURNAL_BYTES;
            let zeros = vec![0u8; 1 << 20];
            let mut at = len;
            while at < JOURNAL_BYTES {
                let n = (JOURNAL_BYTES - at).min(zeros.len() as u64);
                // `n` is at most `zeros.len()`.
                self.file.write(at, &zeros[..n as usize])?;
                at += n;
            }
        }
        let generation = self.generation.wrapping_add(1).max(1);
        let mut header = Vec::with_capacity(HEADER as usize);
        header.extend_from_slice(&MAGIC);
        header.extend_from_slice(&generation.to_le_bytes());
        header.extend_from_slice(&check(generation, &MAGIC).to_le_bytes());
        self.file.write(0, &header)?;
        self.file.sync_data()?;
        self.generation = generation;
        self.end = HEADER;
        Ok(())
    }

    /// Appends one record and makes it durable.
    pub fn append(&mut self, entries: &[(Arc<str>, Mark)]) -> std::io::Result<()> {
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        buf.resize(RECORD_HEADER, 0);
        for (scope, mark) in entries {
            let n = u32::try_from(scope.len())
                .ok()
                .filter(|n| n & WITH_SEQUENCE == 0)
                .ok_or_else(|| std::io::Error::other("a scope of 2 GiB or more"))?;
            let flag = if mark.sequence.is_some() {
                WITH_SEQUENCE
            } else {
                0
            };
            buf.extend_from_slice(&(n | flag).to_le_bytes());
            buf.extend_from_slice(scope.as_bytes());
            buf.extend_from_slice(&mark.token.epoch.to_le_bytes());
            buf.extend_from_slice(&mark.token.counter.to_le_bytes());
            if let Some(seq) = mark.sequence {
                buf.extend_from_slice(&seq.to_le_bytes());
            }
        }
        let body_len = u32::try_from(buf.len() - RECORD_HEADER).map_err(std::io::Error::other)?;
        let c = check(self.generation, &buf[RECORD_HEADER..]);
        buf[0..4].copy_from_slice(&body_len.to_le_bytes());
        buf[8..16].copy_from_slice(&self.generation.to_le_bytes());
        buf[16..24].copy_from_slice(&c.to_le_bytes());
        let len = buf.len() as u64;
        let written = self
            .grow(self.end + len)
            .and_then(|()| self.file.write(self.end, &buf))
            .and_then(|()| self.file.sync_data());
        self.buf = buf;
        written?;
        self.end += len;
        Ok(())
    }

    fn grow(&mut self, to: u64) -> std::io::Result<()> {
        if to > self.len {
            self.file.set_len(to)?;
            self.len = to;
        }
        Ok(())
    }

    /// Whether a checkpoint is due by length.
    pub fn is_long(&self) -> bool {
        self.end >= JOURNAL_BYTES
    }
}

/// What a journal read back holds.
struct Contents {
    generation: u64,
    pending: Pending,
    /// Where a record of the current generation was found torn (the last one, written
    /// but never made durable: a crash during its append).
    torn: Option<u64>,
}

/// The generation and the advances of a journal of `len` bytes, read one record at a time
/// (memory bounded by the largest record, not the file).
///
/// A crash leaves at most one damaged record, the last one: a record is appended only
/// after the one before it was synced. So the reading stops at the first record that is
/// not a whole, checked record of the header's generation, and everything after it is
/// searched for a valid record of that generation: one found means something other than
/// a crash damaged the file, and the journal is refused (the records after the damage
/// are acknowledged advances). A damaged header is refused the same way.
fn read(file: &impl StorageBackend, len: u64, applied: Option<u64>) -> Result<Contents, OpenError> {
    let mut pending = Pending::new();
    if len < HEADER {
        // A journal is never shorter than its header once one was written (a reset sets
        // the length first): nothing was ever journaled here.
        let mut head = vec![0u8; len as usize];
        file.read(0, &mut head)?;
        if head.iter().any(|b| *b != 0) {
            return Err(Corruption::at(0, "shorter than a journal header, and not blank").into());
        }
        return Ok(Contents {
            generation: 0,
            pending,
            torn: None,
        });
    }
    let mut header = [0u8; HEADER as usize];
    file.read(0, &mut header)?;
    let generation = u64_at(&header, 8).unwrap_or(0);
    let damage = if header.iter().all(|b| *b == 0) {
        // Never written: a crash during the first reset, after the file got its length
        // and before its header reached the disk.
        Some("the header is blank")
    } else if header[..8] != MAGIC {
        Some("the header does not start with the journal's magic bytes")
    } else if u64_at(&header, 16) != Some(check(generation, &MAGIC)) {
        Some("the header's check does not match")
    } else {
        None
    };
    if let Some(damage) = damage {
        // A reset writes the header only once every record before it is in redb: if no
        // record behind it is of a later generation than redb holds, nothing is lost
        // (a reset torn by a crash, or a header never written).
        let unapplied = Want::Above(applied.unwrap_or(0));
        if let Some(at) = find_record(file, len, HEADER, unapplied)? {
            return Err(Corruption::at(
                0,
                format!(
                    "{damage}, and a valid record not yet in the store file follows at byte {at}"
                ),
            )
            .into());
        }
        if header.iter().any(|b| *b != 0) {
            tracing::warn!(
                damage,
                "the mark journal's header is damaged (a reset torn by a crash?); every record behind it is in the store file already"
            );
        }
        return Ok(Contents {
            generation: applied.unwrap_or(0),
            pending,
            torn: None,
        });
    }
    let mut at = HEADER;
    let mut torn = None;
    let mut body = Vec::new();
    let mut head = [0u8; RECORD_HEADER];
    while at + RECORD_HEADER as u64 <= len {
        // A file cut shorter while being read (an offline reader looking at a running
        // server's journal, which a reset may shorten) ends like a torn tail.
        if let Err(e) = file.read(at, &mut head) {
            return stop_at_eof(e, generation, pending);
        }
        let (Some(n), Some(g), Some(c)) = (u32_at(&head, 0), u64_at(&head, 8), u64_at(&head, 16))
        else {
            break;
        };
        if g != generation {
            // Zeros, a record of an earlier generation, or the middle of one: the end.
            break;
        }
        // Bytes 4..8 are written as zeros and not covered by the check: a record with
        // anything else there is damaged (as the search for records past damage has it).
        if head[4..8] != [0, 0, 0, 0] {
            torn = Some(at);
            break;
        }
        let start = at + RECORD_HEADER as u64;
        if n == 0 || start + u64::from(n) > len {
            torn = Some(at);
            break;
        }
        body.resize(n as usize, 0);
        if let Err(e) = file.read(start, &mut body) {
            return stop_at_eof(e, generation, pending);
        }
        if c != check(generation, &body) {
            torn = Some(at);
            break;
        }
        let Some(entries) = parse(&body) else {
            torn = Some(at);
            break;
        };
        for (scope, mark) in entries {
            let e = pending.entry(scope).or_insert(mark);
            *e = (*e).max(mark);
        }
        at = start + u64::from(n);
    }
    if let Some(next) = find_record(file, len, at + 1, Want::Exactly(generation))? {
        let what = match torn {
            Some(_) => {
                format!("the record here is damaged, but a valid record follows at byte {next}")
            }
            None => format!(
                "the record here is not of the header's generation {generation}, but a valid one follows at byte {next}"
            ),
        };
        return Err(Corruption::at(at, what).into());
    }
    Ok(Contents {
        generation,
        pending,
        torn,
    })
}

/// The (scope, mark) entries of one record.
type Entries = Vec<(Arc<str>, Mark)>;

/// Which records a scan looks for, by generation.
#[derive(Debug, Clone, Copy)]
enum Want {
    Exactly(u64),
    /// Every generation above this one.
    Above(u64),
}

/// The first offset at or after `from` where a whole, checked record of a wanted generation
/// starts.
fn find_record(
    file: &impl StorageBackend,
    len: u64,
    from: u64,
    want: Want,
) -> std::io::Result<Option<u64>> {
    let mut found = None;
    scan(file, len, from, want, &mut |at, _, _| {
        found = Some(at);
        false
    })?;
    Ok(found)
}

/// Calls `f(offset, generation, entries)` for each whole, checked record of a wanted
/// generation found at or after `from`, looking at every byte offset; stops when `f`
/// answers false. Reads the file a window at a time.
fn scan(
    file: &impl StorageBackend,
    len: u64,
    from: u64,
    want: Want,
    f: &mut dyn FnMut(u64, u64, Entries) -> bool,
) -> std::io::Result<()> {
    const WINDOW: u64 = 1 << 20;
    let eof_ends = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Ok(false)
        } else {
            Err(e)
        }
    };
    let rh = RECORD_HEADER as u64;
    let mut window = Vec::new();
    let mut base = from;
    let mut body = Vec::new();
    let mut at = from;
    while at + rh <= len {
        if at + rh > base + window.len() as u64 {
            // Next window (a file shorter than its length said ends the scan).
            base = at;
            window.resize((len - at).min(WINDOW) as usize, 0);
            if !file
                .read(base, &mut window)
                .map(|()| true)
                .or_else(eof_ends)?
            {
                return Ok(());
            }
        }
        let mut i = (at - base) as usize;
        if let Want::Exactly(w) = want {
            // Only where the generation's bytes are can a record of it start.
            let Some(found) = memchr::memmem::find(&window[i + 8..], &w.to_le_bytes()) else {
                // None in this window: go on where one could still start in the next.
                at = base + (window.len() - RECORD_HEADER + 1).max(i + 1) as u64;
                continue;
            };
            i += found;
            at = base + i as u64;
            if at + rh > base + window.len() as u64 {
                continue;
            }
        }
        let h = &window[i..i + RECORD_HEADER];
        let (Some(n), Some(g), Some(c)) = (u32_at(h, 0), u64_at(h, 8), u64_at(h, 16)) else {
            return Ok(());
        };
        let plausible = n > 0
            && h[4..8] == [0, 0, 0, 0]
            && match want {
                Want::Exactly(w) => g == w,
                Want::Above(w) => g > w,
            }
            && at + rh + u64::from(n) <= len;
        if plausible {
            body.resize(n as usize, 0);
            if !file
                .read(at + rh, &mut body)
                .map(|()| true)
                .or_else(eof_ends)?
            {
                return Ok(());
            }
            if c == check(g, &body)
                && let Some(entries) = parse(&body)
            {
                if !f(at, g, entries) {
                    return Ok(());
                }
                // Records do not overlap: go on after this one.
                at += rh + u64::from(n);
                continue;
            }
        }
        at += 1;
    }
    Ok(())
}

/// Every record of a damaged journal that checks out, whatever its generation (records of
/// earlier generations are in redb already; taking the max with them changes nothing).
pub struct Salvage {
    pub pending: Pending,
    pub records: usize,
    /// The highest epoch of any token found.
    pub max_epoch: u64,
}

/// Reads every valid record of a journal, damaged or not, for `store recover`.
pub fn salvage(file: &impl StorageBackend) -> std::io::Result<Salvage> {
    let len = file.len()?;
    let mut out = Salvage {
        pending: Pending::new(),
        records: 0,
        max_epoch: 0,
    };
    scan(
        file,
        len,
        HEADER.min(len),
        Want::Above(0),
        &mut |_, _, entries| {
            out.records += 1;
            for (scope, mark) in entries {
                out.max_epoch = out.max_epoch.max(mark.token.epoch);
                let e = out.pending.entry(scope).or_insert(mark);
                *e = (*e).max(mark);
            }
            true
        },
    )?;
    Ok(out)
}

fn stop_at_eof(
    e: std::io::Error,
    generation: u64,
    pending: Pending,
) -> Result<Contents, OpenError> {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        Ok(Contents {
            generation,
            pending,
            torn: None,
        })
    } else {
        Err(e.into())
    }
}

fn parse(body: &[u8]) -> Option<Entries> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < body.len() {
        let len = u32_at(body, at)?;
        let n = (len & !WITH_SEQUENCE) as usize;
        let s = body.get(at + 4..(at + 4).checked_add(n)?)?;
        let scope: Arc<str> = Arc::from(std::str::from_utf8(s).ok()?);
        let epoch = u64_at(body, at + 4 + n)?;
        let counter = u64_at(body, at + 12 + n)?;
        at += 20 + n;
        let sequence = if len & WITH_SEQUENCE != 0 {
            let seq = u64_at(body, at)?;
            at += 8;
            Some(seq)
        } else {
            None
        };
        out.push((
            scope,
            Mark {
                token: Token::new(epoch, counter),
                sequence,
            },
        ));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use redb::backends::InMemoryBackend;

    /// A file shared by journals opened one after another (a restart). It reports `.1`
    /// bytes more than it holds (0 but in one test: a file cut shorter after its length
    /// was read), and reads past its end fail as a file's do.
    #[derive(Debug, Clone, Default)]
    struct Shared(Arc<InMemoryBackend>, u64);

    impl StorageBackend for Shared {
        fn len(&self) -> std::io::Result<u64> {
            Ok(self.0.len()? + self.1)
        }
        fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
            if offset + out.len() as u64 > self.0.len()? {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            self.0.read(offset, out)
        }
        fn set_len(&self, len: u64) -> std::io::Result<()> {
            self.0.set_len(len)
        }
        fn sync_data(&self) -> std::io::Result<()> {
            Ok(())
        }
        fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            self.0.write(offset, data)
        }
    }

    fn t(c: u64) -> Mark {
        Mark::of(Token::new(0, c))
    }

    fn e(s: &str, c: u64) -> (Arc<str>, Mark) {
        (Arc::from(s), t(c))
    }

    fn seq(c: u64, n: u64) -> Mark {
        Mark {
            token: Token::new(0, c),
            sequence: Some(n),
        }
    }

    /// Entries with a sequence and without share records; the max per scope is taken as
    /// (token, sequence), so a higher token without one outranks a lower token's sequence.
    /// An entry without a sequence is written byte for byte as before sequences existed.
    #[test]
    fn sequences_are_read_back_with_their_marks() {
        let file = Shared::default();
        let (mut j, _) = Journal::open(file.clone(), None).unwrap();
        j.reset().unwrap();
        let s = |name: &str, m: Mark| (Arc::<str>::from(name), m);
        j.append(&[s("a", seq(3, 1)), e("b", 1), s("c", seq(4, 9))])
            .unwrap();
        j.append(&[s("a", seq(3, 2)), s("b", seq(1, 5)), e("c", 5)])
            .unwrap();
        j.append(&[s("a", seq(3, 1))]).unwrap();
        let (_, pending) = Journal::open(file, None).unwrap();
        assert_eq!(pending.get("a"), Some(&seq(3, 2)));
        assert_eq!(pending.get("b"), Some(&seq(1, 5)));
        assert_eq!(pending.get("c"), Some(&t(5)), "a new token starts over");

        // The layout of an entry without a sequence: length, scope, epoch, counter.
        let mut j = Journal {
            file: Box::new(Shared::default()),
            generation: 1,
            end: HEADER,
            len: 0,
            buf: Vec::new(),
        };
        j.append(&[e("ab", 7)]).unwrap();
        let body = &j.buf[RECORD_HEADER..];
        let mut old = 2u32.to_le_bytes().to_vec();
        old.extend_from_slice(b"ab");
        old.extend_from_slice(&0u64.to_le_bytes());
        old.extend_from_slice(&7u64.to_le_bytes());
        assert_eq!(body, &old[..]);
        assert_eq!(parse(&old), Some(vec![e("ab", 7)]));
    }

    #[test]
    fn records_are_read_back_as_the_highest_token_per_scope() {
        let file = Shared::default();
        let (mut j, pending) = Journal::open(file.clone(), None).unwrap();
        assert!(pending.is_empty());
        j.reset().unwrap();
        j.append(&[e("a", 3), e("b", 1)]).unwrap();
        j.append(&[e("a", 7), e("ü/x", 2)]).unwrap();
        j.append(&[e("a", 5)]).unwrap();
        let (_, pending) = Journal::open(file, None).unwrap();
        assert_eq!(pending.len(), 3);
        assert_eq!(pending.get("a"), Some(&t(7)));
        assert_eq!(pending.get("b"), Some(&t(1)));
        assert_eq!(pending.get("ü/x"), Some(&t(2)));
    }

    #[test]
    fn a_reset_voids_every_record_before_it() {
        let file = Shared::default();
        let (mut j, _) = Journal::open(file.clone(), None).unwrap();
        j.reset().unwrap();
        j.append(&[e("old", 9), e("old2", 9)]).unwrap();
        j.append(&[e("old3", 9)]).unwrap();
        j.reset().unwrap();
        // Shorter than the old records: they are still on disk behind it.
        j.append(&[e("n", 1)]).unwrap();
        let (mut j, pending) = Journal::open(file.clone(), None).unwrap();
        assert_eq!(pending.len(), 1, "{pending:?}");
        assert_eq!(pending.get("n"), Some(&t(1)));
        // The generation goes on from the file's, across opens.
        j.reset().unwrap();
        let (_, pending) = Journal::open(file, None).unwrap();
        assert!(pending.is_empty(), "{pending:?}");
    }

    fn flip(file: &Shared, at: u64, bit: u8) {
        let mut byte = [0u8];
        file.read(at, &mut byte).unwrap();
        file.write(at, &[byte[0] ^ (1 << bit)]).unwrap();
    }

    /// A journal of three records; answers the offsets of the second and third.
    fn three_records(file: &Shared) -> (u64, u64) {
        let (mut j, _) = Journal::open(file.clone(), None).unwrap();
        j.reset().unwrap();
        j.append(&[e("a", 1)]).unwrap();
        let second = j.end;
        j.append(&[e("b", 2), e("bb", 2)]).unwrap();
        let third = j.end;
        j.append(&[e("c", 3)]).unwrap();
        (second, third)
    }

    #[test]
    fn a_damaged_record_with_valid_ones_after_it_is_corruption() {
        let file = Shared::default();
        let (second, third) = three_records(&file);
        let image = file.0.clone();
        for at in second..third {
            for bit in [0, 5] {
                let copy = Shared(Arc::new(InMemoryBackend::new()), 0);
                let len = image.len().unwrap();
                let mut all = vec![0u8; len as usize];
                image.read(0, &mut all).unwrap();
                copy.set_len(len).unwrap();
                copy.write(0, &all).unwrap();
                flip(&copy, at, bit);
                match Journal::open(copy, None) {
                    // Never read as valid, the bytes 4..8 of its header (written as zeros,
                    // not covered by the check) included: found by the `journal` fuzz
                    // target, where such a record was read and the search for records
                    // past damage (and `store recover`) passed it over.
                    Ok((_, pending)) => panic!("byte {at} bit {bit}: read as {pending:?}"),
                    Err(OpenError::Corrupt(c)) => assert_eq!(c.offset, second, "byte {at}: {c}"),
                    Err(e) => panic!("byte {at} bit {bit}: {e}"),
                }
            }
        }
    }

    #[test]
    fn a_damaged_header_is_corruption() {
        for at in 0..HEADER {
            for bit in [0, 5] {
                let file = Shared::default();
                three_records(&file);
                flip(&file, at, bit);
                match Journal::open(file, None) {
                    Err(OpenError::Corrupt(c)) => assert_eq!(c.offset, 0, "{c}"),
                    Err(e) => panic!("byte {at} bit {bit}: {e}"),
                    Ok((_, p)) => panic!("byte {at} bit {bit}: read as {p:?}"),
                }
            }
        }
        // A blank header with records behind it: the records are not dropped either.
        let file = Shared::default();
        three_records(&file);
        file.write(0, &[0u8; HEADER as usize]).unwrap();
        assert!(matches!(
            Journal::open(file, None),
            Err(OpenError::Corrupt(_))
        ));
    }

    #[test]
    fn a_record_torn_by_a_crash_is_the_end_at_every_length() {
        let file = Shared::default();
        let (_, third) = three_records(&file);
        let end = file.0.len().unwrap();
        let mut last = vec![0u8; (JOURNAL_BYTES - third) as usize];
        file.read(third, &mut last).unwrap();
        let record = last.iter().rposition(|b| *b != 0).unwrap() + 1;
        assert!(record < 64 && end == JOURNAL_BYTES);
        // Only the first `k` bytes of the last record reached the disk.
        for k in 0..record {
            let copy = Shared::default();
            let mut all = vec![0u8; third as usize + k];
            file.read(0, &mut all).unwrap();
            copy.set_len(JOURNAL_BYTES).unwrap();
            copy.write(0, &all).unwrap();
            let (_, pending) =
                Journal::open(copy, None).unwrap_or_else(|e| panic!("{k} bytes: {e}"));
            assert_eq!(pending.len(), 3, "{k} bytes");
        }
        // A damaged last record cannot be told from a torn one: it is read as the end.
        flip(&file, third + RECORD_HEADER as u64 + 6, 0);
        let (_, pending) = Journal::open(file, None).unwrap();
        assert_eq!(pending.len(), 3);
    }

    #[test]
    fn a_salvage_reads_every_record_that_checks_out() {
        let file = Shared::default();
        let (second, _) = three_records(&file);
        flip(&file, second + RECORD_HEADER as u64 + 1, 3);
        flip(&file, 9, 0);
        assert!(Journal::open(file.clone(), None).is_err());
        let saved = salvage(&file).unwrap();
        assert_eq!(saved.records, 2);
        assert_eq!(saved.pending.get("a"), Some(&t(1)));
        assert_eq!(saved.pending.get("c"), Some(&t(3)));
        assert_eq!(saved.pending.get("b"), None);
    }

    #[test]
    fn a_file_cut_short_while_read_ends_like_a_torn_tail() {
        let file = Shared::default();
        let (mut j, _) = Journal::open(file.clone(), None).unwrap();
        j.reset().unwrap();
        let big: Vec<_> = (0..3_000).map(|i| e(&format!("s{i:0>200}"), 1)).collect();
        while !j.is_long() {
            j.append(&big).unwrap();
        }
        let grown = file.len().unwrap() - JOURNAL_BYTES;
        // The file cut back to 4 MiB (as a reset does) after a reader took its length and
        // read its header: the record that crossed 4 MiB is no longer whole.
        file.set_len(JOURNAL_BYTES).unwrap();
        let (_, pending) = Journal::open(Shared(file.0, grown), None).unwrap();
        assert_eq!(
            pending.len(),
            big.len(),
            "the whole records before it are read"
        );
    }

    #[test]
    fn a_fresh_journal_is_written_to_its_full_length_once() {
        let file = Shared::default();
        let (mut j, _) = Journal::open(file.clone(), None).unwrap();
        j.reset().unwrap();
        assert_eq!(file.len().unwrap(), JOURNAL_BYTES);
        assert!(!j.is_long());
        let big: Vec<_> = (0..2_000).map(|i| e(&"s".repeat(100 + i % 7), 1)).collect();
        while !j.is_long() {
            j.append(&big).unwrap();
        }
        assert!(
            file.len().unwrap() > JOURNAL_BYTES,
            "the last record crossed the mark"
        );
        let (mut j, pending) = Journal::open(file.clone(), None).unwrap();
        assert_eq!(pending.len(), 7);
        // A reset brings it back to its length.
        j.reset().unwrap();
        assert_eq!(file.len().unwrap(), JOURNAL_BYTES);
        let (_, pending) = Journal::open(file, None).unwrap();
        assert!(pending.is_empty());
    }
}
