//! What hyper does not let the service see of an HTTP/1 request head: a `#fragment` in
//! the request target (`http::Uri` drops it, so `DELETE /dav/c/#x` would be routed and
//! forwarded as `DELETE /dav/c/`), and a `Content-Length` sent with `Transfer-Encoding`
//! (hyper drops the length and reads the body as chunked; nginx refuses such a request, a
//! smuggling attempt or a broken client).
//!
//! [`Scan`] follows the bytes a connection reads, as [`crate::first_bytes::FirstBytes`]
//! hands them to hyper: each request head (parsed with httparse, as hyper parses it, in
//! place when it came in one read, which is the common case), then its body by its
//! framing (a length, or chunks), to the next head. A head with a flaw is noted in the
//! connection's [`Streams`] by its number, and the service refuses the request of that
//! number (HTTP/1 requests are served in order, one at a time) with 400 and
//! `Connection: close`; nothing of it is forwarded. What the scan cannot follow (an
//! upgrade, CONNECT, a head hyper would refuse itself) ends the scan for the connection:
//! hyper answers or closes those.

use std::sync::Arc;

use crate::h2_idle::Streams;

/// A flaw of a request head that hyper hides from the service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flaw {
    /// The target has a `#fragment`, which a client must not send.
    Fragment,
    /// Both `Content-Length` and `Transfer-Encoding`.
    LengthAndEncoding,
}

/// Header lines parsed (on the stack, unfilled); a head with more stops the scan (at
/// hyper's default `max_headers`, 100, hyper refuses it first).
const MAX_HEADERS: usize = 128;

/// Longest chunk-size line followed (hyper's own bound on chunk extensions is lower).
const MAX_CHUNK_LINE: usize = 4096;

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
    /// In the trailer section: whether the current line has anything on it.
    Trailers(bool),
    /// Not followed any more.
    Off,
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
                            self.at = At::Off;
                        }
                        return;
                    };
                    self.head.extend_from_slice(&data[..nl]);
                    data = &data[nl + 1..];
                    self.at = match chunk_size(&self.head) {
                        Some(0) => At::Trailers(false),
                        Some(n) => At::ChunkData(n),
                        None => At::Off,
                    };
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
                    Some(_) => self.at = At::Off,
                    None if data.len() <= 1 => return,
                    None => self.at = At::Off,
                },
                At::Trailers(content) => {
                    let Some(nl) = data.iter().position(|&b| b == b'\n') else {
                        // Trailer lines are bounded by hyper; a long one ends no section.
                        *content |= data.iter().any(|&b| b != b'\r');
                        return;
                    };
                    let line_content = *content || data[..nl].iter().any(|&b| b != b'\r');
                    data = &data[nl + 1..];
                    self.at = if line_content {
                        At::Trailers(false)
                    } else {
                        At::Head
                    };
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
                    // It was not whole before: it ends in this read.
                    return &data[n.saturating_sub(before).min(data.len())..];
                }
                Some(Err(())) => {
                    self.head = Vec::new();
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
        self.at = At::Off;
        self.head = Vec::new();
        &[]
    }

    /// Parses a head at the start of `bytes`: its length once whole (`None`: not yet),
    /// `Err` when the scan stops.
    fn parse(&mut self, bytes: &[u8]) -> Option<Result<usize, ()>> {
        let mut headers =
            [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut []);
        let n = match req.parse_with_uninit_headers(bytes, &mut headers) {
            Ok(httparse::Status::Complete(n)) => n,
            Ok(httparse::Status::Partial) => return None,
            Err(_) => {
                self.at = At::Off;
                return Some(Err(()));
            }
        };
        let number = self.heads;
        self.heads += 1;
        let mut length = None;
        let mut encoding = None;
        let mut upgrade = false;
        for h in req.headers.iter() {
            if h.name.eq_ignore_ascii_case("content-length") {
                length = Some(h.value);
            } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                encoding = Some(h.value);
            } else if h.name.eq_ignore_ascii_case("upgrade") {
                upgrade = true;
            }
        }
        let flaw = if req.path.is_some_and(|p| p.contains('#')) {
            Some(Flaw::Fragment)
        } else if length.is_some() && encoding.is_some() {
            Some(Flaw::LengthAndEncoding)
        } else {
            None
        };
        if let Some(flaw) = flaw {
            // Refused with `Connection: close`: nothing after it is read.
            self.streams.flaw(number, flaw);
            self.at = At::Off;
            return Some(Err(()));
        }
        if upgrade || req.method == Some("CONNECT") {
            self.at = At::Off;
            return Some(Err(()));
        }
        self.at = match (encoding, length) {
            (Some(te), _) if last_coding_is_chunked(te) => At::ChunkSize,
            (Some(_), _) => At::Off,
            (None, Some(cl)) => match std::str::from_utf8(cl)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
            {
                Some(0) => At::Head,
                Some(n) => At::Length(n),
                None => At::Off,
            },
            (None, None) => At::Head,
        };
        Some(Ok(n))
    }
}

fn last_coding_is_chunked(te: &[u8]) -> bool {
    te.rsplit(|&b| b == b',')
        .next()
        .is_some_and(|c| c.trim_ascii().eq_ignore_ascii_case(b"chunked"))
}

/// The size of a chunk-size line (its `\r`, extensions and whitespace after the digits
/// ignored).
fn chunk_size(line: &[u8]) -> Option<u64> {
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 || digits > 16 {
        return None;
    }
    let s = std::str::from_utf8(&line[..digits]).ok()?;
    u64::from_str_radix(s, 16).ok()
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
    fn what_cannot_be_followed_ends_the_scan() {
        for head in [
            &b"GET / HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\n\r\n"[..],
            b"CONNECT a:443 HTTP/1.1\r\nHost: a\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost a\r\n\r\n",
            b"PUT / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n",
            b"PUT / HTTP/1.1\r\nHost: a\r\nContent-Length: x\r\n\r\n",
        ] {
            let (mut s, _) = scan();
            s.feed(head);
            s.feed(b"GET /x#y HTTP/1.1\r\n\r\n");
            assert_eq!(s.at, At::Off, "{:?}", String::from_utf8_lossy(head));
        }
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
