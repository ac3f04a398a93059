//! The journal's record reader. Any bytes after a valid header are either read as
//! records whose entries, written again, read back alike, or refused; and a record
//! written from the input's entries with any one bit flipped (in the header or the
//! record) is never read as a valid record: the open is refused, or the record is
//! dropped as a torn tail.
//!
//! Input: the first byte picks the case (even: raw bytes after a header; odd: entries
//! from the rest, and the bit to flip from its first two bytes).
#![no_main]

use std::sync::Arc;

use fencegate::store::Mark;
use fencegate::store::journal::Journal;
use fencegate::token::Token;
use libfuzzer_sys::fuzz_target;
use redb::StorageBackend;
use redb::backends::InMemoryBackend;

/// A file shared by journals opened one after another; reads past its end fail as a
/// file's do.
#[derive(Debug, Clone, Default)]
struct File(Arc<InMemoryBackend>);

impl StorageBackend for File {
    fn len(&self) -> std::io::Result<u64> {
        self.0.len()
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

const HEADER: u64 = 24;

/// A journal file with its header written (no record yet). The header is made once by
/// a journal's own reset (which writes the file's full length) and copied.
fn fresh() -> File {
    static HEAD: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let head = HEAD.get_or_init(|| {
        let file = File::default();
        let (mut j, pending) =
            Journal::open(file.clone(), None).unwrap_or_else(|e| panic!("{e:?}"));
        assert!(pending.is_empty());
        j.reset().unwrap_or_else(|e| panic!("{e}"));
        let mut head = vec![0u8; HEADER as usize];
        file.read(0, &mut head).unwrap_or_else(|e| panic!("{e}"));
        head
    });
    let file = File::default();
    file.set_len(HEADER).unwrap_or_else(|e| panic!("{e}"));
    file.write(0, head).unwrap_or_else(|e| panic!("{e}"));
    file
}

fn entries(mut data: &[u8]) -> Vec<(Arc<str>, Mark)> {
    let mut out = Vec::new();
    // Bounded by the input's length: each entry takes at least one byte.
    while let Some((&n, rest)) = data.split_first() {
        let n = usize::from(n % 24).min(rest.len());
        let (scope, rest) = rest.split_at(n);
        let mut num = [0u8; 17];
        let k = rest.len().min(17);
        num[..k].copy_from_slice(&rest[..k]);
        data = &rest[k..];
        let word = |i: usize| u64::from_le_bytes(num[i..i + 8].try_into().unwrap_or_default());
        let token = Token::new(word(0) % 4, word(8));
        let sequence = (num[16] & 1 == 1).then_some(u64::from(num[16]));
        let scope = String::from_utf8_lossy(scope).into_owned();
        out.push((Arc::from(scope), Mark { token, sequence }));
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&case, rest)) = data.split_first() else {
        return;
    };
    if case % 2 == 0 {
        let file = fresh();
        // Cut to the header and the input: the open searches every offset past damage.
        file.set_len(HEADER + rest.len() as u64)
            .unwrap_or_else(|e| panic!("{e}"));
        file.write(HEADER, rest).unwrap_or_else(|e| panic!("{e}"));
        let Ok((_, pending)) = Journal::open(file.clone(), None) else {
            return;
        };
        // Read as valid: what it holds, written anew, reads back the same.
        let again = fresh();
        let (mut j, _) = Journal::open(again.clone(), None).unwrap_or_else(|e| panic!("{e:?}"));
        let all: Vec<(Arc<str>, Mark)> = pending.iter().map(|(k, v)| (k.clone(), *v)).collect();
        if !all.is_empty() {
            j.append(&all).unwrap_or_else(|e| panic!("{e}"));
        }
        drop(j);
        let (_, back) = Journal::open(again, None).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(back, pending);
        return;
    }
    let Some((flip, rest)) = rest.split_first_chunk::<2>() else {
        return;
    };
    let entries = entries(rest);
    if entries.is_empty() {
        return;
    }
    let file = fresh();
    let (mut j, _) = Journal::open(file.clone(), None).unwrap_or_else(|e| panic!("{e:?}"));
    j.append(&entries).unwrap_or_else(|e| panic!("{e}"));
    drop(j);
    // The record: its header (body length, generation, check), then its body. The file
    // is cut after it (it is written longer), so that the open's search for records past
    // damage has only the record to look at.
    let mut len = [0u8; 4];
    file.read(HEADER, &mut len)
        .unwrap_or_else(|e| panic!("{e}"));
    let end = HEADER + 24 + u64::from(u32::from_le_bytes(len));
    file.set_len(end).unwrap_or_else(|e| panic!("{e}"));
    let (_, pending) = Journal::open(file.clone(), None).unwrap_or_else(|e| panic!("{e:?}"));
    assert!(!pending.is_empty(), "a record written is read back");
    let mut bytes = vec![0u8; end as usize];
    file.read(0, &mut bytes).unwrap_or_else(|e| panic!("{e}"));
    let bit = usize::from(u16::from_le_bytes(*flip)) % (bytes.len() * 8);
    bytes[bit / 8] ^= 1 << (bit % 8);
    file.write(0, &bytes).unwrap_or_else(|e| panic!("{e}"));
    if let Ok((_, pending)) = Journal::open(file, None) {
        assert!(
            pending.is_empty(),
            "bit {bit} flipped, and the record still reads as valid: {pending:?}"
        );
    }
});
