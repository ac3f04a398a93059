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
//! little-endian). A record counts only when it is whole, its check matches and it
//! belongs to the header's generation; reading stops at the first that does not (a torn
//! tail, or what is left of an earlier generation: the file is overwritten from the start
//! after each checkpoint, cut back to [`JOURNAL_BYTES`] only when a batch made it longer).
//! The check is the first 8 bytes of SHA-256.

use std::collections::HashMap;
use std::sync::Arc;

use redb::StorageBackend;
use sha2::{Digest, Sha256};

use crate::token::Token;

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

pub struct Journal {
    file: Box<dyn StorageBackend>,
    generation: u64,
    /// Where the next record goes.
    end: u64,
    /// The file's length.
    len: u64,
    buf: Vec<u8>,
}

/// Advances read back from a journal: the highest token per scope.
pub type Pending = HashMap<Arc<str>, Token>;

impl Journal {
    /// Reads every whole record of the current generation. The journal is then ready for
    /// [`reset`](Journal::reset), which must follow once what was read is applied.
    pub fn open(file: impl StorageBackend) -> std::io::Result<(Journal, Pending)> {
        let len = file.len()?;
        let (generation, pending) = read(&file, len)?;
        Ok((
            Journal {
                file: Box::new(file),
                generation,
                end: len.max(HEADER),
                len,
                buf: Vec::new(),
            },
            pending,
        ))
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
    pub fn append(&mut self, entries: &[(Arc<str>, Token)]) -> std::io::Result<()> {
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        buf.resize(RECORD_HEADER, 0);
        for (scope, token) in entries {
            let n = u32::try_from(scope.len()).map_err(std::io::Error::other)?;
            buf.extend_from_slice(&n.to_le_bytes());
            buf.extend_from_slice(scope.as_bytes());
            buf.extend_from_slice(&token.epoch.to_le_bytes());
            buf.extend_from_slice(&token.counter.to_le_bytes());
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

/// The generation and the advances of a journal of `len` bytes, read one record at a time
/// (memory bounded by the largest record, not the file).
fn read(file: &impl StorageBackend, len: u64) -> std::io::Result<(u64, Pending)> {
    let mut pending = Pending::new();
    if len < HEADER {
        return Ok((0, pending));
    }
    let mut header = [0u8; HEADER as usize];
    file.read(0, &mut header)?;
    let generation = u64_at(&header, 8).unwrap_or(0);
    if header[..8] != MAGIC || u64_at(&header, 16) != Some(check(generation, &MAGIC)) {
        // No journal yet, or a header torn while a reset wrote it: a reset writes the
        // header only after a checkpoint, so nothing behind it is needed.
        return Ok((generation, pending));
    }
    let mut at = HEADER;
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
        let start = at + RECORD_HEADER as u64;
        if n == 0 || g != generation || start + u64::from(n) > len {
            break;
        }
        body.resize(n as usize, 0);
        if let Err(e) = file.read(start, &mut body) {
            return stop_at_eof(e, generation, pending);
        }
        if c != check(generation, &body) {
            break;
        }
        let Some(entries) = parse(&body) else { break };
        for (scope, token) in entries {
            let e = pending.entry(scope).or_insert(token);
            *e = (*e).max(token);
        }
        at = start + u64::from(n);
    }
    Ok((generation, pending))
}

fn stop_at_eof(
    e: std::io::Error,
    generation: u64,
    pending: Pending,
) -> std::io::Result<(u64, Pending)> {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        Ok((generation, pending))
    } else {
        Err(e)
    }
}

fn parse(body: &[u8]) -> Option<Vec<(Arc<str>, Token)>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < body.len() {
        let n = u32_at(body, at)? as usize;
        let s = body.get(at + 4..(at + 4).checked_add(n)?)?;
        let scope: Arc<str> = Arc::from(std::str::from_utf8(s).ok()?);
        let epoch = u64_at(body, at + 4 + n)?;
        let counter = u64_at(body, at + 12 + n)?;
        out.push((scope, Token::new(epoch, counter)));
        at += 20 + n;
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

    fn t(c: u64) -> Token {
        Token::new(0, c)
    }

    fn e(s: &str, c: u64) -> (Arc<str>, Token) {
        (Arc::from(s), t(c))
    }

    #[test]
    fn records_are_read_back_as_the_highest_token_per_scope() {
        let file = Shared::default();
        let (mut j, pending) = Journal::open(file.clone()).unwrap();
        assert!(pending.is_empty());
        j.reset().unwrap();
        j.append(&[e("a", 3), e("b", 1)]).unwrap();
        j.append(&[e("a", 7), e("ü/x", 2)]).unwrap();
        j.append(&[e("a", 5)]).unwrap();
        let (_, pending) = Journal::open(file).unwrap();
        assert_eq!(pending.len(), 3);
        assert_eq!(pending.get("a"), Some(&t(7)));
        assert_eq!(pending.get("b"), Some(&t(1)));
        assert_eq!(pending.get("ü/x"), Some(&t(2)));
    }

    #[test]
    fn a_reset_voids_every_record_before_it() {
        let file = Shared::default();
        let (mut j, _) = Journal::open(file.clone()).unwrap();
        j.reset().unwrap();
        j.append(&[e("old", 9), e("old2", 9)]).unwrap();
        j.append(&[e("old3", 9)]).unwrap();
        j.reset().unwrap();
        // Shorter than the old records: they are still on disk behind it.
        j.append(&[e("n", 1)]).unwrap();
        let (mut j, pending) = Journal::open(file.clone()).unwrap();
        assert_eq!(pending.len(), 1, "{pending:?}");
        assert_eq!(pending.get("n"), Some(&t(1)));
        // The generation goes on from the file's, across opens.
        j.reset().unwrap();
        let (_, pending) = Journal::open(file).unwrap();
        assert!(pending.is_empty(), "{pending:?}");
    }

    #[test]
    fn reading_stops_at_a_torn_or_damaged_record() {
        let file = Shared::default();
        let (mut j, _) = Journal::open(file.clone()).unwrap();
        j.reset().unwrap();
        j.append(&[e("a", 1)]).unwrap();
        let second = j.end;
        j.append(&[e("b", 2)]).unwrap();
        j.append(&[e("c", 3)]).unwrap();
        // One byte of the second record's body flipped: it and everything after is void.
        let at = second + RECORD_HEADER as u64 + 4;
        let mut byte = [0u8];
        file.read(at, &mut byte).unwrap();
        file.write(at, &[byte[0] ^ 1]).unwrap();
        let (_, pending) = Journal::open(file.clone()).unwrap();
        assert_eq!(pending.len(), 1, "{pending:?}");
        assert_eq!(pending.get("a"), Some(&t(1)));
        // A damaged header voids the lot (a reset writes it only after a checkpoint).
        file.write(3, b"X").unwrap();
        let (_, pending) = Journal::open(file).unwrap();
        assert!(pending.is_empty());
    }

    #[test]
    fn a_file_cut_short_while_read_ends_like_a_torn_tail() {
        let file = Shared::default();
        let (mut j, _) = Journal::open(file.clone()).unwrap();
        j.reset().unwrap();
        let big: Vec<_> = (0..3_000).map(|i| e(&format!("s{i:0>200}"), 1)).collect();
        while !j.is_long() {
            j.append(&big).unwrap();
        }
        let grown = file.len().unwrap() - JOURNAL_BYTES;
        // The file cut back to 4 MiB (as a reset does) after a reader took its length and
        // read its header: the record that crossed 4 MiB is no longer whole.
        file.set_len(JOURNAL_BYTES).unwrap();
        let (_, pending) = Journal::open(Shared(file.0, grown)).unwrap();
        assert_eq!(
            pending.len(),
            big.len(),
            "the whole records before it are read"
        );
    }

    #[test]
    fn a_fresh_journal_is_written_to_its_full_length_once() {
        let file = Shared::default();
        let (mut j, _) = Journal::open(file.clone()).unwrap();
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
        let (mut j, pending) = Journal::open(file.clone()).unwrap();
        assert_eq!(pending.len(), 7);
        // A reset brings it back to its length.
        j.reset().unwrap();
        assert_eq!(file.len().unwrap(), JOURNAL_BYTES);
        let (_, pending) = Journal::open(file).unwrap();
        assert!(pending.is_empty());
    }
}
