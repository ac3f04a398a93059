//! The access log (`[log] access`): one JSON line per proxy request, handed to a writer
//! thread through a bounded queue so the request path never waits on a disk; and the
//! rate-limited warnings for refusals that prove an expiry race, logged with or without it.

use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, HeaderValue};

/// Where access-log lines go (`[log] access`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Sink {
    #[default]
    Off,
    Stdout,
    File(PathBuf),
}

/// `[log]`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LogConfig {
    /// `access = "off" | "stdout" | "<file>"`: one JSON line per proxy request. A relative
    /// file is resolved against the config file's directory.
    pub access: Sink,
}

#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawLog {
    access: Option<String>,
}

impl LogConfig {
    /// Validates `[log]`; a relative file is resolved against `base`.
    pub(crate) fn parse(
        raw: RawLog,
        base: &Path,
        errors: &mut crate::config::error::Errors,
    ) -> LogConfig {
        LogConfig {
            access: match raw.access.as_deref() {
                None | Some("off") => Sink::Off,
                Some("stdout") => Sink::Stdout,
                Some("") => {
                    errors.push(
                        "log.access",
                        "must be \"off\", \"stdout\" or a file path, not empty",
                    );
                    Sink::Off
                }
                Some(path) => Sink::File(base.join(path)),
            },
        }
    }
}

/// Lines waiting for the writer thread; a full queue drops (and counts) new lines rather
/// than hold a request back.
const QUEUE: usize = 8192;

/// How long the writer waits for a line before it looks at reopen and flush requests.
const IDLE: Duration = Duration::from_millis(200);

/// How often the writer says how many lines it dropped (when it dropped any).
const DROP_REPORT: Duration = Duration::from_secs(10);

/// The access log's handle on the request path.
pub struct AccessLog {
    /// `None` when off: the request path checks this one pointer and does nothing else.
    queue: Option<SyncSender<String>>,
    shared: Arc<Shared>,
    /// Request ids made here: a per-process random prefix and a counter.
    ids: RequestIds,
}

struct Shared {
    dropped: AtomicU64,
    reopen: AtomicBool,
    /// [`AccessLog::flush`]'s requests, and the last one the writer found its queue
    /// empty after: every line queued before that request is written.
    flush_asked: AtomicU64,
    flush_done: AtomicU64,
}

impl AccessLog {
    /// The off log.
    pub fn off() -> AccessLog {
        AccessLog {
            queue: None,
            shared: Arc::new(Shared {
                dropped: AtomicU64::new(0),
                reopen: AtomicBool::new(false),
                flush_asked: AtomicU64::new(0),
                flush_done: AtomicU64::new(0),
            }),
            ids: RequestIds::new(),
        }
    }

    /// Opens the sink (a file is created 0640 if missing, appended to) and starts the
    /// writer thread.
    pub fn open(sink: &Sink) -> std::io::Result<AccessLog> {
        let mut log = AccessLog::off();
        let out = match sink {
            Sink::Off => return Ok(log),
            Sink::Stdout => Out::Stdout,
            Sink::File(path) => Out::File {
                file: open_append(path)?,
                path: path.clone(),
            },
        };
        let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE);
        let shared = log.shared.clone();
        std::thread::Builder::new()
            .name("fencegate-access-log".into())
            .spawn(move || write_lines(rx, out, &shared))?;
        log.queue = Some(tx);
        Ok(log)
    }

    pub fn is_on(&self) -> bool {
        self.queue.is_some()
    }

    /// Queues one line (with its newline). Never waits: a full queue drops it.
    pub fn write(&self, line: String) {
        if let Some(q) = &self.queue
            && let Err(TrySendError::Full(_)) = q.try_send(line)
        {
            self.shared.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// SIGHUP: the next line goes to a file opened anew at the configured path (after
    /// logrotate renamed the old one).
    pub fn reopen(&self) {
        self.shared.reopen.store(true, Ordering::Release);
    }

    /// Waits (at most `bound`) until every line queued so far is written: at shutdown,
    /// so that the last requests' lines are not lost with the process.
    pub async fn flush(&self, bound: Duration) {
        if self.queue.is_none() {
            return;
        }
        let asked = self.shared.flush_asked.fetch_add(1, Ordering::AcqRel) + 1;
        let end = tokio::time::Instant::now() + bound;
        while self.shared.flush_done.load(Ordering::Acquire) < asked {
            if tokio::time::Instant::now() >= end {
                tracing::warn!("shutdown: the access log's last lines were not written in time");
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The request's `X-Request-Id` if it is sane (one header, 1 to
    /// [`MAX_REQUEST_ID`] visible ASCII characters), else a new one.
    pub fn request_id(&self, headers: &HeaderMap) -> HeaderValue {
        let mut all = headers.get_all(X_REQUEST_ID).iter();
        if let (Some(v), None) = (all.next(), all.next())
            && sane_request_id(v.as_bytes())
        {
            return v.clone();
        }
        self.ids.next()
    }
}

pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The longest client `X-Request-Id` kept (a UUID is 36; some tracers send 64).
pub const MAX_REQUEST_ID: usize = 128;

fn sane_request_id(v: &[u8]) -> bool {
    (1..=MAX_REQUEST_ID).contains(&v.len()) && v.iter().all(|b| (0x21..=0x7e).contains(b))
}

struct RequestIds {
    prefix: u64,
    next: AtomicU64,
}

impl RequestIds {
    fn new() -> RequestIds {
        use std::hash::{BuildHasher, Hasher};
        // std's hasher keys are random per process: a prefix without a dependency.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        RequestIds {
            prefix: h.finish(),
            next: AtomicU64::new(1),
        }
    }

    fn next(&self) -> HeaderValue {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let text = format!("{:016x}-{n}", self.prefix);
        // Hex digits, `-` and decimal digits only.
        HeaderValue::from_str(&text).unwrap_or(HeaderValue::from_static("-"))
    }
}

enum Out {
    Stdout,
    File { file: File, path: PathBuf },
}

fn open_append(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o640)
        .open(path)
}

/// The writer thread: whole lines only, several per write when they queue up (one
/// writer, so no line is torn by another); ends when the log's handle is dropped.
fn write_lines(rx: Receiver<String>, mut out: Out, shared: &Shared) {
    let mut batch: Vec<u8> = Vec::with_capacity(64 * 1024);
    let mut reported = Instant::now();
    loop {
        // Read before waiting: a wait that finds nothing has seen every line queued
        // before this flush request.
        let asked = shared.flush_asked.load(Ordering::Acquire);
        let first = match rx.recv_timeout(IDLE) {
            Ok(line) => Some(line),
            Err(RecvTimeoutError::Timeout) => {
                shared.flush_done.store(asked, Ordering::Release);
                None
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        if shared.reopen.swap(false, Ordering::AcqRel)
            && let Out::File { file, path } = &mut out
        {
            match open_append(path) {
                Ok(f) => {
                    *file = f;
                    tracing::info!(file = %path.display(), "access log reopened");
                }
                Err(e) => {
                    tracing::error!(file = %path.display(), error = %e, "cannot reopen the access log; writing to the file already open")
                }
            }
        }
        if let Some(line) = first {
            batch.extend_from_slice(line.as_bytes());
            while batch.len() < 64 * 1024 {
                match rx.try_recv() {
                    Ok(line) => batch.extend_from_slice(line.as_bytes()),
                    Err(_) => break,
                }
            }
            let written = match &mut out {
                Out::Stdout => std::io::stdout().lock().write_all(&batch),
                Out::File { file, .. } => file.write_all(&batch),
            };
            if let Err(e) = written {
                tracing::error!(error = %e, "access log write failed");
            }
            batch.clear();
        }
        if reported.elapsed() >= DROP_REPORT {
            reported = Instant::now();
            let n = shared.dropped.swap(0, Ordering::Relaxed);
            if n > 0 {
                tracing::warn!("{n} access log lines dropped (the writer fell behind)");
            }
        }
    }
}

/// One request, as the access log records it.
pub struct Entry<'a> {
    pub time: SystemTime,
    pub request_id: &'a [u8],
    pub peer: std::net::SocketAddr,
    pub method: &'a str,
    pub route: Option<&'a str>,
    pub scope: Option<&'a str>,
    pub token: Option<crate::token::Token>,
    pub highest: Option<crate::token::Token>,
    /// The request's `Fencing-Sequence`, and the highest recorded for its token when it
    /// was refused `stale_sequence` (SPEC §11).
    pub sequence: Option<u64>,
    pub highest_sequence: Option<u64>,
    pub result: &'a str,
    pub status: u16,
    /// Body bytes of the response when its length is known at its head (`Content-Length`
    /// or a body in hand); `None` for a streamed body of unknown length.
    pub bytes: Option<u64>,
    pub duration: Duration,
    pub upstream: Option<Duration>,
}

impl Entry<'_> {
    /// The JSON line, with its newline. serde_json escapes what a client sent (request id,
    /// method, scope); humantime writes the time.
    pub fn line(&self) -> String {
        let line = Line {
            time: Shown(humantime::format_rfc3339_millis(self.time)),
            request_id: &String::from_utf8_lossy(self.request_id),
            peer: self.peer,
            method: self.method,
            route: self.route,
            scope: self.scope,
            token: self.token.map(Shown),
            highest: self.highest.map(Shown),
            sequence: self.sequence.map(Shown),
            highest_sequence: self.highest_sequence.map(Shown),
            result: self.result,
            status: self.status,
            bytes: self.bytes,
            duration_ms: millis(self.duration),
            upstream_ms: self.upstream.map(millis),
        };
        let mut s = serde_json::to_string(&line).unwrap_or_default();
        s.push('\n');
        s
    }
}

/// The line's fields, in the order they are written.
#[derive(serde::Serialize)]
struct Line<'a> {
    time: Shown<humantime::Rfc3339Timestamp>,
    request_id: &'a str,
    peer: std::net::SocketAddr,
    method: &'a str,
    route: Option<&'a str>,
    scope: Option<&'a str>,
    token: Option<Shown<crate::token::Token>>,
    highest: Option<Shown<crate::token::Token>>,
    sequence: Option<Shown<u64>>,
    highest_sequence: Option<Shown<u64>>,
    result: &'a str,
    status: u16,
    bytes: Option<u64>,
    duration_ms: f64,
    upstream_ms: Option<f64>,
}

/// A value written as the string it displays as: tokens (`epoch:counter`) and sequences
/// (a u64 is beyond what a JSON reader's number keeps exactly).
struct Shown<T>(T);

impl<T: std::fmt::Display> serde::Serialize for Shown<T> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.0)
    }
}

/// Milliseconds to the microsecond.
fn millis(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// Warnings for refusals that prove an expiry race (`stale_fence`, `invalid_proof`): at
/// most [`REFUSALS_PER_SECOND`] a second, then one line with how many were left out.
pub struct RefusalWarnings {
    window: Mutex<Window>,
}

pub const REFUSALS_PER_SECOND: u32 = 10;

struct Window {
    start: Instant,
    logged: u32,
    suppressed: u64,
}

/// One refusal to warn about.
pub struct Refused<'a> {
    pub result: &'a str,
    pub scope: &'a str,
    pub token: crate::token::Token,
    pub highest: Option<crate::token::Token>,
    pub peer: std::net::SocketAddr,
    pub route: &'a str,
    pub request_id: &'a str,
}

impl Default for RefusalWarnings {
    fn default() -> Self {
        RefusalWarnings {
            window: Mutex::new(Window {
                start: Instant::now(),
                logged: 0,
                suppressed: 0,
            }),
        }
    }
}

impl RefusalWarnings {
    /// Logs `r` at warn unless this second's share is used up.
    pub fn warn(&self, r: &Refused<'_>) {
        let now = Instant::now();
        // Decided under the lock, logged after it: no request waits on another's write.
        let (admitted, left_out) = {
            let Ok(mut w) = self.window.lock() else {
                return;
            };
            let left_out = roll(&mut w, now);
            let admitted = if w.logged < REFUSALS_PER_SECOND {
                w.logged += 1;
                true
            } else {
                w.suppressed += 1;
                false
            };
            (admitted, left_out)
        };
        say_suppressed(left_out);
        if admitted {
            let highest = r.highest.map(|t| t.to_string());
            tracing::warn!(
                result = r.result,
                scope = r.scope,
                token = %r.token,
                highest = highest.as_deref().unwrap_or("none"),
                peer = %r.peer,
                route = r.route,
                request_id = r.request_id,
                "refused: a stale or unproven token (a lock holder that lost its lease wrote)"
            );
        }
    }

    /// Says how many warnings the last full second left out; called every second.
    pub fn flush(&self) {
        let left_out = match self.window.lock() {
            Ok(mut w) => roll(&mut w, Instant::now()),
            Err(_) => 0,
        };
        say_suppressed(left_out);
    }
}

fn say_suppressed(n: u64) {
    if n > 0 {
        tracing::warn!(
            suppressed = n,
            "{n} more refusal warnings suppressed (at most {REFUSALS_PER_SECOND} a second)"
        );
    }
}

/// Starts a new window once a second has passed; answers how many the old one left out.
fn roll(w: &mut Window, now: Instant) -> u64 {
    if now.duration_since(w.start) < Duration::from_secs(1) {
        return 0;
    }
    let left_out = w.suppressed;
    *w = Window {
        start: now,
        logged: 0,
        suppressed: 0,
    };
    left_out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The line is JSON whatever a client put in its strings, the time RFC 3339 in UTC
    /// to the millisecond, tokens and sequences strings.
    #[test]
    fn lines() {
        let entry = Entry {
            time: UNIX_EPOCH + Duration::from_millis(1_796_165_880_123),
            request_id: b"id\"\\\x7f",
            peer: "127.0.0.1:9".parse().expect("addr"),
            method: "PUT",
            route: Some("r"),
            scope: Some("a\nb\u{0}c"),
            token: Some(crate::token::Token {
                epoch: 1,
                counter: 2,
            }),
            highest: None,
            sequence: Some(u64::MAX),
            highest_sequence: None,
            result: "accepted",
            status: 200,
            bytes: Some(5),
            duration: Duration::from_micros(1_500),
            upstream: None,
        };
        let line = entry.line();
        assert!(line.ends_with("}\n") && !line[..line.len() - 1].contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&line).expect("JSON");
        assert_eq!(v["time"], "2026-12-01T22:58:00.123Z");
        assert_eq!(v["request_id"], "id\"\\\x7f");
        assert_eq!(v["scope"], "a\nb\u{0}c");
        assert_eq!(v["token"], "1:2");
        assert_eq!(v["sequence"], u64::MAX.to_string());
        assert!(v["highest"].is_null() && v["upstream_ms"].is_null());
        assert_eq!(v["duration_ms"], 1.5);
        let leap = Entry {
            time: UNIX_EPOCH + Duration::from_secs(951_782_400),
            ..entry
        };
        assert!(
            leap.line()
                .starts_with("{\"time\":\"2000-02-29T00:00:00.000Z\",")
        );
    }

    #[test]
    fn request_ids() {
        assert!(sane_request_id(b"abc-123"));
        assert!(!sane_request_id(b""));
        assert!(!sane_request_id(b"a b"));
        assert!(!sane_request_id(&[b'a'; MAX_REQUEST_ID + 1]));
        let ids = RequestIds::new();
        assert_ne!(ids.next(), ids.next());
    }
}
