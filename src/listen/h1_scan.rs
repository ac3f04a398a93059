//! What hyper does not let the service see of an HTTP/1 request head: a `#fragment` in
//! the request target (`http::Uri` drops it, so `DELETE /dav/c/#x` would be routed and
//! forwarded as `DELETE /dav/c/`), and a `Content-Length` sent with `Transfer-Encoding`
//! (hyper drops the length and reads the body as chunked; nginx refuses such a request, a
//! smuggling attempt or a broken client).
//!
//! [`Scan`] follows the bytes a connection reads, as [`crate::listen::first_bytes::FirstBytes`]
//! hands them to hyper: each request head (read in place when it came in one read, the
//! common case; hyper validates it), then its body by its framing (a length, or chunks),
//! to the next head. A head with a flaw is noted in the connection's [`Streams`] by its
//! number, and the service refuses the request of that number (HTTP/1 requests are served
//! in order, one at a time) with 400 and `Connection: close`; nothing of it is forwarded.
//! What the scan cannot follow (a head or a chunk that hyper refuses itself, and then
//! closes the connection) ends the scan for the connection. No connection is upgraded:
//! fencegate answers neither 101 nor 2xx to CONNECT, so an `Upgrade` header or a CONNECT
//! leaves the connection speaking HTTP/1.1, and the scan goes on.

use std::sync::Arc;

use super::conn::{Flaw, Streams};

/// Longest chunk-size line followed (hyper's bound on chunk extensions, 16 KiB).
const MAX_CHUNK_LINE: usize = 16 << 10;

/// Where the scan is in the connection's bytes.
#[derive(Debug, PartialEq, Eq)]
enum At {
    /// In a head (its bytes so far in `Scan::head` when it began in an earlier read).
    Head,
    /// In a body with this many bytes left.
    Length(u64),
    /// In a chunked body: a chunk-size line so far (in `Scan::head`).
    ChunkSize,
    /// In a chunk's data, then the CRLF after it.
    ChunkData(u64),
    ChunkEnd,
    /// In the trailer section, read as hyper reads it: lines end at a CRLF only (a bare
    /// LF is a byte of the line), and the section at an empty line.
    Trailers(Trailer),
    /// Not followed any more.
    Off,
}

/// Where the scan is in a trailer section (hyper's chunked decoder's states).
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum Trailer {
    /// At the start of a line: a CR here begins the section's end.
    LineStart,
    /// In a line, up to its CR.
    Line,
    /// After a line's CR: its LF.
    LineLf,
    /// After the empty line's CR: its LF ends the body.
    EndLf,
}

pub(crate) struct Scan {
    at: At,
    /// A head (or chunk-size line) begun in an earlier read.
    head: Vec<u8>,
    max_head: usize,
    /// The number of the next head.
    heads: u64,
    streams: Arc<Streams>,
}

impl Scan {
    pub fn new(streams: Arc<Streams>, max_head: usize) -> Scan {
        Scan {
            at: At::Head,
            head: Vec::new(),
            max_head,
            heads: 0,
            streams,
        }
    }

    /// Follows `data`, the next bytes the connection read.
    pub fn feed(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            match &mut self.at {
                At::Off => return,
                At::Length(left) => {
                    let n = usize::try_from(*left).unwrap_or(usize::MAX).min(data.len());
                    *left -= n as u64;
                    data = &data[n..];
                    if *left == 0 {
                        self.at = At::Head;
                    }
                }
                At::Head => data = self.head_bytes(data),
                At::ChunkSize => {
                    let Some(nl) = data.iter().position(|&b| b == b'\n') else {
                        self.head.extend_from_slice(data);
                        if self.head.len() > MAX_CHUNK_LINE {
                            self.lose();
                        }
                        return;
                    };
                    self.head.extend_from_slice(&data[..nl]);
                    data = &data[nl + 1..];
                    match chunk_size(&self.head) {
                        Some(0) => self.at = At::Trailers(Trailer::LineStart),
                        Some(n) => self.at = At::ChunkData(n),
                        None => self.lose(),
                    }
                    self.head.clear();
                }
                At::ChunkData(left) => {
                    let n = usize::try_from(*left).unwrap_or(usize::MAX).min(data.len());
                    *left -= n as u64;
                    data = &data[n..];
                    if *left == 0 {
                        self.at = At::ChunkEnd;
                    }
                }
                At::ChunkEnd => match data.iter().position(|&b| b == b'\n') {
                    Some(nl) if nl <= 1 => {
                        data = &data[nl + 1..];
                        self.at = At::ChunkSize;
                    }
                    Some(_) => self.lose(),
                    None if data.len() <= 1 => return,
                    None => self.lose(),
                },
                At::Trailers(at) => {
                    // hyper's states, byte by byte but for a line's content; any other
                    // byte is an error to hyper, which closes the connection.
                    let next = match (*at, data[0]) {
                        (Trailer::LineStart, b'\r') => Trailer::EndLf,
                        (Trailer::LineStart | Trailer::Line, _) => {
                            match data.iter().position(|&b| b == b'\r') {
                                Some(cr) => {
                                    data = &data[cr..];
                                    Trailer::LineLf
                                }
                                None => {
                                    *at = Trailer::Line;
                                    return;
                                }
                            }
                        }
                        (Trailer::LineLf, b'\n') => Trailer::LineStart,
                        (Trailer::EndLf, b'\n') => {
                            data = &data[1..];
                            self.at = At::Head;
                            continue;
                        }
                        _ => {
                            self.lose();
                            return;
                        }
                    };
                    data = &data[1..];
                    *at = next;
                }
            }
        }
    }

    /// Bytes of a head: parses it once whole; answers what follows it.
    fn head_bytes<'a>(&mut self, data: &'a [u8]) -> &'a [u8] {
        if self.head.is_empty() {
            // The common case: the whole head in this read, parsed in place.
            match self.parse(data) {
                Some(Ok(n)) => return &data[n..],
                Some(Err(())) => return &[],
                None => {}
            }
            if data.len() > self.max_head {
                return self.stop();
            }
            self.head.extend_from_slice(data);
            // A request is on its way: the connection is not idle.
            self.streams.head_begun(true);
            return &[];
        }
        let before = self.head.len();
        let take = data.len().min((self.max_head + 1).saturating_sub(before));
        self.head.extend_from_slice(&data[..take]);
        // A head ends at an empty line: parsed only once one may have come, so a head
        // sent a line at a time is not parsed again for every line.
        let window = &self.head[before.saturating_sub(2)..];
        if window.windows(2).any(|w| w == b"\n\n") || window.windows(3).any(|w| w == b"\n\r\n") {
            let head = std::mem::take(&mut self.head);
            let parsed = self.parse(&head);
            self.head = head;
            match parsed {
                Some(Ok(n)) => {
                    self.head.clear();
                    // Its request is in the service's hands from here.
                    self.streams.head_begun(false);
                    // It was not whole before: it ends in this read.
                    return &data[n.saturating_sub(before).min(data.len())..];
                }
                Some(Err(())) => {
                    self.head = Vec::new();
                    self.streams.head_begun(false);
                    return &[];
                }
                None => {}
            }
        }
        if self.head.len() > self.max_head {
            // hyper refuses it (431).
            return self.stop();
        }
        &data[take..]
    }

    fn stop<'a>(&mut self) -> &'a [u8] {
        self.streams.head_begun(false);
        // hyper refuses a head this long (431) as a rule; if it takes it after all, its
        // request is refused as unchecked.
        self.lose();
        self.head = Vec::new();
        &[]
    }

    /// Stops the scan where hyper may go on: the next head (the one after a body not
    /// followed, or the one too long to follow) is refused as [`Flaw::Unfollowed`]. Where
    /// hyper refuses and closes itself, no such request comes.
    fn lose(&mut self) {
        self.streams.flaw(self.heads, Flaw::Unfollowed);
        self.at = At::Off;
    }

    /// Parses a head at the start of `bytes`: its length once whole (`None`: not yet),
    /// `Err` when the scan stops.
    ///
    /// Only what the scan needs is read: the request line's target, and the lines of the
    /// two header names it acts on; hyper validates the head (and refuses
    /// a malformed one, closing the connection). Counted by callgrind on a W1 head and
    /// body: ~700 instructions, where httparse's full parse took ~1,000 and a byte loop
    /// per line ~1,300.
    fn parse(&mut self, bytes: &[u8]) -> Option<Result<usize, ()>> {
        // Empty lines before a request line are skipped (httparse and hyper do too).
        let start = match bytes.first()? {
            b'\r' | b'\n' => bytes.iter().position(|&b| b != b'\r' && b != b'\n')?,
            _ => 0,
        };
        let mut lines = LineEnds::new(bytes, start);
        let line_end = lines.next()?;
        let line = &bytes[start..line_end];
        // METHOD SP target SP HTTP/1.x
        let Some(sp) = line.iter().position(|&b| b == b' ') else {
            return self.off();
        };
        let Some(len) = line[sp + 1..].iter().position(|&b| b == b' ') else {
            return self.off();
        };
        let target = &line[sp + 1..sp + 1 + len];
        let mut length = None;
        let mut encoding = None;
        let mut at = line_end + 1;
        loop {
            let nl = lines.next()?;
            let line = &bytes[at..nl];
            at = nl + 1;
            // The empty line (`\r` or nothing before its `\n`): the head's end.
            let Some(&first) = line.first() else {
                break;
            };
            if line == b"\r" {
                break;
            }
            // Only lines that may be one of the three names are looked at further.
            let value = |name: &[u8]| {
                (line.get(name.len()) == Some(&b':') && is_name(&line[..name.len()], name))
                    .then(|| line[name.len() + 1..].trim_ascii())
            };
            match first | 0x20 {
                b'c' => {
                    if let Some(v) = value(b"content-length") {
                        length = Some(v);
                    }
                }
                b't' => {
                    if let Some(v) = value(b"transfer-encoding") {
                        encoding = Some(v);
                    }
                }
                _ => {}
            }
        }
        let number = self.heads;
        self.heads += 1;
        let flaw = if target.contains(&b'#') {
            Some(Flaw::Fragment)
        } else if length.is_some() && encoding.is_some() {
            Some(Flaw::LengthAndEncoding)
        } else {
            None
        };
        if let Some(flaw) = flaw {
            // Refused with `Connection: close`: nothing after it is read.
            self.streams.flaw(number, flaw);
            return self.off();
        }
        match (encoding, length) {
            (Some(te), _) if last_coding_is_chunked(te) => self.at = At::ChunkSize,
            (Some(_), _) => self.lose(),
            (None, Some(cl)) => match decimal(cl) {
                Some(0) => self.at = At::Head,
                Some(n) => self.at = At::Length(n),
                None => self.lose(),
            },
            (None, None) => self.at = At::Head,
        }
        #[cfg(feature = "fuzzing")]
        self.record(number, &bytes[start..at]);
        Some(Ok(at))
    }

    /// Notes head `number` and the framing read for its body, for the fuzz targets.
    #[cfg(feature = "fuzzing")]
    fn record(&self, number: u64, head: &[u8]) {
        use super::conn::ScanFraming;
        let framing = match self.at {
            At::Head => ScanFraming::None,
            At::Length(n) => ScanFraming::Length(n),
            At::ChunkSize => ScanFraming::Chunked,
            _ => ScanFraming::Lost,
        };
        self.streams
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((number, head.to_vec(), framing));
    }

    /// Stops the scan (the answer for [`Scan::parse`]).
    fn off(&mut self) -> Option<Result<usize, ()>> {
        self.at = At::Off;
        Some(Err(()))
    }
}

/// The places of the `\n`s in a head, found eight bytes at a time in one pass (a head's
/// lines are short: a vector search per line costs more than it saves on them).
struct LineEnds<'a> {
    hay: &'a [u8],
    /// Where the next word starts, and the `\n`s of the current one not yet answered (a
    /// bit at each one's high bit).
    next: usize,
    word: usize,
    found: u64,
}

impl<'a> LineEnds<'a> {
    fn new(hay: &'a [u8], from: usize) -> LineEnds<'a> {
        LineEnds {
            hay,
            next: from,
            word: from,
            found: 0,
        }
    }
}

impl Iterator for LineEnds<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
        const NL: u64 = u64::from_ne_bytes([b'\n'; 8]);
        loop {
            if self.found != 0 {
                let at = self.word + (self.found.trailing_zeros() / 8) as usize;
                self.found &= self.found - 1;
                return Some(at);
            }
            let start = self.next;
            match self.hay.get(start..start + 8) {
                Some(bytes) => {
                    let mut w = [0u8; 8];
                    w.copy_from_slice(bytes);
                    let x = u64::from_le_bytes(w) ^ NL;
                    // Exact where no lower byte matched; every match of the word is
                    // exact with this form (no borrow crosses a zero byte's bit).
                    self.found = !((x & !HIGH).wrapping_add(!HIGH) | x) & HIGH;
                    self.word = start;
                    self.next = start + 8;
                }
                None => {
                    let rest = self.hay.get(start..)?;
                    let p = rest.iter().position(|&b| b == b'\n')?;
                    self.next = start + p + 1;
                    self.word = start;
                    return Some(start + p);
                }
            }
        }
    }
}

/// Whether `got` is `name` (lowercase letters and `-`) in any case. Compared eight bytes
/// at a time, each byte with its 0x20 bit set: that maps an upper-case letter to its
/// lower-case one, and of the other bytes only `\r` to one of `name`'s (`-`), which no
/// header name hyper accepts holds.
fn is_name(got: &[u8], name: &[u8]) -> bool {
    let word = |b: &[u8], at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[at..at + 8]);
        u64::from_le_bytes(w)
    };
    const LOWER: u64 = u64::from_ne_bytes([0x20; 8]);
    match got.len() {
        n if n != name.len() => false,
        n if n >= 8 => {
            // Every whole word, then the last eight bytes (overlapping the one before): a
            // name of 17 bytes (`transfer-encoding`) is three words, not the first and
            // last alone, which left its ninth byte unread (`Transfer%Encoding` was taken
            // for it, while hyper reads another header: found by the `head_scan` fuzz
            // target).
            let mut at = 0;
            while at + 8 < n {
                if word(got, at) | LOWER != word(name, at) {
                    return false;
                }
                at += 8;
            }
            word(got, n - 8) | LOWER == word(name, n - 8)
        }
        _ => got.iter().zip(name).all(|(g, n)| g | 0x20 == *n),
    }
}

/// A Content-Length value: decimal digits only (hyper refuses anything else).
/// A `Content-Length` as hyper reads it: digits only, leading zeros allowed, at most
/// 2^64 − 1.
fn decimal(v: &[u8]) -> Option<u64> {
    if v.is_empty() {
        return None;
    }
    v.iter().try_fold(0u64, |n, &b| {
        if !b.is_ascii_digit() {
            return None;
        }
        n.checked_mul(10)?.checked_add(u64::from(b - b'0'))
    })
}

fn last_coding_is_chunked(te: &[u8]) -> bool {
    te.rsplit(|&b| b == b',')
        .next()
        .is_some_and(|c| c.trim_ascii().eq_ignore_ascii_case(b"chunked"))
}

/// The size of a chunk-size line (its `\r`, extensions and whitespace after the digits
/// ignored).
/// Leading zeros allowed, as hyper reads it.
fn chunk_size(line: &[u8]) -> Option<u64> {
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 {
        return None;
    }
    line[..digits].iter().try_fold(0u64, |n, &b| {
        let d = (b as char).to_digit(16)?;
        n.checked_mul(16)?.checked_add(u64::from(d))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan() -> (Scan, Arc<Streams>) {
        let streams = Streams::new(None);
        (Scan::new(streams.clone(), 16 << 10), streams)
    }

    /// Feeds `parts`, answers the flaws noted (by head number) and the scan's place.
    fn run(parts: &[&[u8]]) -> (Vec<(u64, Flaw)>, u64, bool) {
        let (mut s, streams) = scan();
        for p in parts {
            s.feed(p);
        }
        let flaws = (0..s.heads)
            .filter_map(|i| streams.take_flaw(i).map(|f| (i, f)))
            .collect();
        (flaws, s.heads, s.at == At::Off)
    }

    #[test]
    fn heads_are_followed_across_bodies_and_reads() {
        let body_with_fake_head = b"GET /x#y HTTP/1.1\r\nHost: a\r\n\r\n";
        let mut one = b"PUT /a HTTP/1.1\r\nHost: a\r\nContent-Length: 31\r\n\r\n".to_vec();
        one.extend_from_slice(body_with_fake_head);
        one.extend_from_slice(
            b"PUT /b HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n\
              1f;ext=1\r\nGET /x#y HTTP/1.1\r\nHost: a\r\n\r\n\r\n0\r\nX-T: 1\r\n\r\n\
              GET /c HTTP/1.1\r\nHost: a\r\n\r\n",
        );
        // Whole, and then byte by byte: the same three heads, no flaw (the `#` lines are
        // bodies).
        assert_eq!(run(&[&one]), (vec![], 3, false));
        let bytes: Vec<&[u8]> = one.chunks(1).collect();
        assert_eq!(run(&bytes), (vec![], 3, false));
        let bytes: Vec<&[u8]> = one.chunks(7).collect();
        assert_eq!(run(&bytes), (vec![], 3, false));
    }

    #[test]
    fn a_fragment_or_a_length_with_an_encoding_is_noted_by_its_head_number() {
        let two = b"GET /a HTTP/1.1\r\nHost: a\r\n\r\nDELETE /dav/c/#m HTTP/1.1\r\nHost: a\r\n\r\n";
        assert_eq!(run(&[two]), (vec![(1, Flaw::Fragment)], 2, true));
        let split: Vec<&[u8]> = two.chunks(5).collect();
        assert_eq!(run(&split), (vec![(1, Flaw::Fragment)], 2, true));
        let cl_te = b"PUT /a HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
        assert_eq!(run(&[cl_te]), (vec![(0, Flaw::LengthAndEncoding)], 1, true));
        let te_cl = b"PUT /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\nHost: a\r\ncontent-length: 4\r\n\r\n";
        assert_eq!(run(&[te_cl]), (vec![(0, Flaw::LengthAndEncoding)], 1, true));
        // A `#` in a header value is no fragment.
        let header = b"GET /a HTTP/1.1\r\nHost: a\r\nX-C: #1\r\n\r\n";
        assert_eq!(run(&[header]), (vec![], 1, false));
    }

    #[test]
    fn a_connection_whose_head_has_begun_is_not_idle() {
        let (mut s, streams) = scan();
        assert!(streams.evictable(false));
        s.feed(b"GET / HTTP/1.1\r\nHost: a\r\n");
        assert!(!streams.evictable(false), "a head on its way");
        s.feed(b"\r\n");
        assert!(streams.evictable(false), "whole: the service's from here");
        // Read whole at once, a head never marks the connection busy.
        s.feed(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n");
        assert!(streams.evictable(false));
    }

    #[test]
    fn names_are_matched_in_any_case_and_only_whole() {
        for (got, name, is) in [
            (&b"Content-Length"[..], &b"content-length"[..], true),
            (b"CONTENT-LENGTH", b"content-length", true),
            (b"content-lengtx", b"content-length", false),
            (b"xontent-length", b"content-length", false),
            (b"content-lengt", b"content-length", false),
            (b"Transfer-Encoding", b"transfer-encoding", true),
            (b"UpGrade", b"upgrade", true),
            (b"upgrad", b"upgrade", false),
            // Every byte counts, the ninth of a 17-byte name too.
            (b"Transfer%Encoding", b"transfer-encoding", false),
            (b"TransferXEncoding", b"transfer-encoding", false),
            (b"transfer_encoding", b"transfer-encoding", false),
            (b"content_length", b"content-length", false),
            (b"content-lengtH", b"content-length", true),
        ] {
            assert_eq!(is_name(got, name), is, "{:?}", String::from_utf8_lossy(got));
        }
    }

    /// A header that only looks like `Transfer-Encoding` (a byte in the middle of its
    /// name differs) is another header to hyper: the body has no framing, and the next
    /// head, right after it, is checked. Read as chunked, the next head was taken for a
    /// chunk and a fragment in it went unseen (`DELETE /dav/c/#x` served as `/dav/c/`).
    #[test]
    fn a_name_like_transfer_encoding_frames_no_body() {
        for name in [
            "Transfer%Encoding",
            "TransferXEncoding",
            "Transfer_Encoding",
        ] {
            let stream = format!(
                "POST / HTTP/1.1\r\nHost: a\r\n{name}: chunked\r\n\r\n\
                 abcDELETE /dav/c/#x HTTP/1.1\r\nHost: a\r\n\r\n"
            );
            // `abcDELETE` is a method token: hyper reads the second head from there.
            assert_eq!(
                run(&[stream.as_bytes()]),
                (vec![(1, Flaw::Fragment)], 2, true),
                "{name}"
            );
            let bytes: Vec<&[u8]> = stream.as_bytes().chunks(1).collect();
            assert_eq!(run(&bytes), (vec![(1, Flaw::Fragment)], 2, true), "{name}");
        }
    }

    /// Trailer lines end at a CRLF only, as hyper's chunked decoder reads them: a bare LF
    /// is a byte of the line, and `\n\n` no end of the section. Read otherwise, the scan
    /// counted a head hyper took for a trailer, and the flaw of every head after it was
    /// noted under the next request's number (found by the `head_scan` fuzz target).
    #[test]
    fn trailer_lines_end_only_at_crlf() {
        let stream = b"PUT / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n\
                       0\r\nX: 1\n\nGET /a HTTP/1.1\r\n\r\n\
                       DELETE /dav/c/#x HTTP/1.1\r\nHost: a\r\n\r\n";
        assert_eq!(run(&[stream]), (vec![(1, Flaw::Fragment)], 2, true));
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(run(&bytes), (vec![(1, Flaw::Fragment)], 2, true));
        // A CR not followed by LF in the section: hyper refuses and closes.
        let (mut s, _) = scan();
        s.feed(b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX: 1\rY\r\n\r\n");
        assert_eq!(s.at, At::Off);
    }

    #[test]
    fn line_ends_are_every_newline_in_order() {
        // Every placement of up to three `\n`s (and bytes with the high bit) in 0..20 bytes.
        for len in 0..20usize {
            for a in 0..len.max(1) {
                for b in a..len.max(1) {
                    let mut hay: Vec<u8> =
                        (0..len).map(|i| [b'x', 0x8a, 0x0b, 0xff][i % 4]).collect();
                    for &i in &[a, b, len.saturating_sub(1)] {
                        if i < len {
                            hay[i] = b'\n';
                        }
                    }
                    for from in 0..=len {
                        let want: Vec<usize> = (from..len).filter(|&i| hay[i] == b'\n').collect();
                        let got: Vec<usize> = LineEnds::new(&hay, from).collect();
                        assert_eq!(got, want, "{hay:?} from {from}");
                    }
                }
            }
        }
    }

    #[test]
    fn what_cannot_be_followed_ends_the_scan() {
        // No upgrade happens: the scan goes on past an `Upgrade` header or a CONNECT.
        for head in [
            &b"GET / HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\n\r\n"[..],
            b"CONNECT a:443 HTTP/1.1\r\nHost: a\r\n\r\n",
        ] {
            let (mut s, streams) = scan();
            s.feed(head);
            s.feed(b"GET /x#y HTTP/1.1\r\n\r\n");
            assert_eq!(streams.take_flaw(1), Some(Flaw::Fragment));
        }
        // A head hyper refuses (and then closes): nothing after it is a request.
        let (mut s, streams) = scan();
        s.feed(b"GET/ HTTP/1.1\r\nHost: a\r\n\r\n");
        assert_eq!(s.at, At::Off);
        s.feed(b"GET /x#y HTTP/1.1\r\n\r\n");
        assert_eq!(streams.take_flaw(1), None);
        // A body not followed: the next head is refused unchecked, whatever it holds
        // (fail closed: hyper may take what the scan could not).
        for head in [
            &b"PUT / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n"[..],
            b"PUT / HTTP/1.1\r\nHost: a\r\nContent-Length: x\r\n\r\n",
            b"PUT / HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999999\r\n\r\n",
        ] {
            let (mut s, streams) = scan();
            s.feed(head);
            assert_eq!(s.at, At::Off, "{:?}", String::from_utf8_lossy(head));
            s.feed(b"GET /x HTTP/1.1\r\n\r\n");
            assert_eq!(streams.take_flaw(1), Some(Flaw::Unfollowed));
        }
        // Lengths and chunk sizes with leading zeros are read as hyper reads them.
        let (mut s, streams) = scan();
        s.feed(b"PUT / HTTP/1.1\r\nContent-Length: 000000000000000000001\r\n\r\nx");
        s.feed(b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n00000000000000000001\r\ny\r\n0\r\n\r\n");
        s.feed(b"DELETE /dav/c/#x HTTP/1.1\r\n\r\n");
        assert_eq!(streams.take_flaw(1), None);
        assert_eq!(streams.take_flaw(2), Some(Flaw::Fragment));
        // A head past the limit, a byte at a time: the scan stops, its buffer bounded.
        let (mut s, _) = scan();
        s.feed(b"GET / HTTP/1.1\r\n");
        for _ in 0..(20 << 10) {
            s.feed(b"a");
        }
        assert_eq!(s.at, At::Off);
        assert!(s.head.capacity() <= 64 << 10);
    }
}
