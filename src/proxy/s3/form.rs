//! Browser-form uploads (`POST /{bucket}`, `multipart/form-data`): the object's key is
//! the form's `key` field, read before anything is forwarded; the body goes on as read.
//!
//! S3 takes the fields before the `file` part and ignores those after it. A `key` with
//! `${filename}` names the file part's filename on AWS, but not on every server (s3s-fs
//! stores the key as written): such a form names both keys, which must fall in one scope. The form is read with `multer`
//! up to the file part's headers (not its content), bounded by [`MAX_PREFIX`]. Field
//! names are matched without regard to case, and a second `key` field is refused: a
//! backend could take either.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderValue;
use http_body::{Body, Frame, SizeHint};

use crate::body::BoxError;

/// The most of a form read before its file part: the fields (a policy document and its
/// signature among them) come first and are small.
pub const MAX_PREFIX: usize = 1024 * 1024;
/// The longest field before the file part.
const MAX_FIELD: u64 = 64 * 1024;

/// A request body forwarded after some of it was read: the frames read, then the rest.
pub struct Replay<B> {
    prefix: VecDeque<Bytes>,
    rest: Option<Pin<Box<B>>>,
}

impl<B: Body> Replay<B> {
    /// `read` first, then whatever `rest` still has.
    pub fn new(read: Vec<Bytes>, rest: Option<Pin<Box<B>>>) -> Replay<B> {
        Replay {
            prefix: read.into(),
            rest,
        }
    }
}

impl<B> Body for Replay<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        if let Some(b) = this.prefix.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(b))));
        }
        match &mut this.rest {
            Some(rest) => rest.as_mut().poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_empty() && self.rest.as_ref().is_none_or(|r| r.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let read: u64 = self.prefix.iter().map(|b| b.len() as u64).sum();
        let rest = self
            .rest
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), |r| r.size_hint());
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower().saturating_add(read));
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(read));
        }
        hint
    }
}

/// A body shared between the form reader (as a stream) and whoever takes it back after,
/// with every chunk read kept for the [`Replay`].
struct Tee<B> {
    body: Option<Pin<Box<B>>>,
    read: Vec<Bytes>,
    len: usize,
}

struct TeeStream<B>(Arc<Mutex<Tee<B>>>);

impl<B> futures_util::Stream for TeeStream<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Item = Result<Bytes, BoxError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let Ok(mut tee) = self.0.lock() else {
            return Poll::Ready(Some(Err("the form reader's lock is poisoned".into())));
        };
        if tee.len > MAX_PREFIX {
            return Poll::Ready(Some(Err(format!(
                "the fields before the file part are longer than {MAX_PREFIX} bytes"
            )
            .into())));
        }
        let Some(body) = tee.body.as_mut() else {
            return Poll::Ready(None);
        };
        match body.as_mut().poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => {
                    tee.len += data.len();
                    tee.read.push(data.clone());
                    Poll::Ready(Some(Ok(data)))
                }
                Err(_) => Poll::Ready(Some(Err("trailers in a form upload".into()))),
            },
        }
    }
}

/// The keys a form upload may write (one, or with `${filename}` the key as written and
/// as resolved), and the body to forward.
pub async fn read_key<B>(
    content_type: Option<&HeaderValue>,
    body: B,
) -> (Result<Vec<String>, FormError>, Replay<B>)
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let tee = Arc::new(Mutex::new(Tee {
        body: Some(Box::pin(body)),
        read: Vec::new(),
        len: 0,
    }));
    let (key, boundary) = match boundary(content_type) {
        Ok(boundary) => (
            fields(TeeStream(tee.clone()), boundary.clone()).await,
            boundary,
        ),
        Err(e) => (Err(FormError::Boundary(e)), String::new()),
    };
    // The reader (and its handle on the body) is gone: the body is this one's again.
    let (read, rest) = match tee.lock() {
        Ok(mut t) => (std::mem::take(&mut t.read), t.body.take()),
        Err(_) => (Vec::new(), None),
    };
    let key = key.and_then(|(names, parts)| {
        let mut raw = Vec::with_capacity(read.iter().map(Bytes::len).sum());
        for b in &read {
            raw.extend_from_slice(b);
        }
        delimiters_agree(&raw, &boundary, parts)?;
        Ok(names)
    });
    (key, Replay::new(read, rest))
}

/// Checks that the delimiters a line-by-line reader of the form would see before its file
/// part are the ones `multer` saw: the first `parts + 1` occurrences of `--boundary` each
/// begin the body or follow a CRLF, and end their line, and the last of them starts the
/// part named `file`. s3s reads a form by lines, so a `--boundary` line inside a field's
/// value (after its blank line, with no CRLF of the value's before it) is a delimiter
/// there and data to multer: a second `key` the fence never read.
fn delimiters_agree(raw: &[u8], boundary: &str, parts: usize) -> Result<(), DelimitersError> {
    let delimiter = format!("--{boundary}");
    let at: Vec<usize> = memchr::memmem::find_iter(raw, delimiter.as_bytes())
        .take(parts + 1)
        .collect();
    let bad = || Err(DelimitersError::Misplaced);
    if at.len() != parts + 1 {
        return bad();
    }
    for &p in &at {
        let line_start = p == 0 || raw.get(..p).is_some_and(|b| b.ends_with(b"\r\n"));
        let line_end = raw
            .get(p + delimiter.len()..)
            .is_some_and(|b| b.starts_with(b"\r\n"));
        if !line_start || !line_end {
            return bad();
        }
    }
    // The file part's headers, up to its blank line, name it `file`.
    let start = at[parts] + delimiter.len() + 2;
    let headers = raw.get(start..).unwrap_or_default();
    let end = memchr::memmem::find(headers, b"\r\n\r\n").ok_or(DelimitersError::HeadersOpen)?;
    let headers = String::from_utf8_lossy(&headers[..end]).to_ascii_lowercase();
    let named_file = headers.split(';').any(|p| {
        p.split_once('=')
            .is_some_and(|(n, v)| n.trim() == "name" && v.trim().trim_matches('"') == "file")
    });
    if !named_file {
        return bad();
    }
    Ok(())
}

/// Why a form's delimiters are not the ones every reader of it sees.
#[derive(Debug, thiserror::Error)]
pub enum DelimitersError {
    #[error("the form has a delimiter inside a field, or around its file part")]
    Misplaced,
    #[error("the file part's headers do not end")]
    HeadersOpen,
}

fn boundary(content_type: Option<&HeaderValue>) -> Result<String, BoundaryError> {
    if !super::is_form_data(content_type) {
        return Err(BoundaryError::NotForm);
    }
    let value = content_type
        .and_then(|v| v.to_str().ok())
        .ok_or(BoundaryError::NotAscii)?;
    // Exactly one `boundary`, a token or a quoted string without escapes: from a type
    // with two, or an escape, a server could read another boundary, and other fields.
    let mut found: Option<&str> = None;
    for param in value.split(';').skip(1) {
        let Some((name, v)) = param.split_once('=') else {
            continue;
        };
        if !name.trim().eq_ignore_ascii_case("boundary") {
            continue;
        }
        if found.is_some() {
            return Err(BoundaryError::Two);
        }
        let v = v.trim();
        let v = match v.strip_prefix('"') {
            Some(q) => q.strip_suffix('"').ok_or(BoundaryError::Unclosed)?,
            None => v,
        };
        if v.is_empty() || v.len() > 70 || v.contains(['"', '\\', ';', ',']) {
            return Err(BoundaryError::NotPlain);
        }
        found = Some(v);
    }
    found.map(str::to_string).ok_or(BoundaryError::Missing)
}

/// Why a form upload's Content-Type gives no one boundary every reader takes.
#[derive(Debug, thiserror::Error)]
pub enum BoundaryError {
    #[error("a POST on a bucket is a form upload: its body must be multipart/form-data")]
    NotForm,
    #[error("the Content-Type is not ASCII")]
    NotAscii,
    #[error("the Content-Type names two boundaries")]
    Two,
    #[error("an unclosed quoted boundary")]
    Unclosed,
    #[error("the form's boundary is not a plain one of 1 to 70 characters")]
    NotPlain,
    #[error("the Content-Type names no boundary")]
    Missing,
}

/// The keys the form names and how many parts come before its file part.
async fn fields<B>(
    stream: TeeStream<B>,
    boundary: String,
) -> Result<(Vec<String>, usize), FormError>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let limits =
        multer::Constraints::new().size_limit(multer::SizeLimit::new().per_field(MAX_FIELD));
    let mut form = multer::Multipart::with_constraints(stream, boundary, limits);
    let mut key: Option<String> = None;
    let mut parts = 0;
    while let Some(field) = form.next_field().await? {
        // One Content-Disposition with one name: a server could read another of two.
        let dispositions = field.headers().get_all(http::header::CONTENT_DISPOSITION);
        let mut values = dispositions.iter();
        let (Some(disposition), None) = (values.next(), values.next()) else {
            return Err(FormError::Disposition);
        };
        let names = disposition
            .to_str()
            .map_err(|_| FormError::DispositionNotAscii)?
            .split(';')
            .filter(|p| {
                p.split_once('=')
                    .is_some_and(|(n, _)| n.trim().eq_ignore_ascii_case("name"))
            })
            .count();
        if names != 1 {
            return Err(FormError::Named);
        }
        let name = field.name().unwrap_or_default().to_string();
        if name.eq_ignore_ascii_case("file") {
            let key = key.ok_or(FormError::NoKey)?;
            return Ok((resolve(key, field.file_name()), parts));
        }
        if name.eq_ignore_ascii_case("key") {
            if key.is_some() {
                return Err(FormError::TwoKeys);
            }
            let headers = field.headers().clone();
            let bytes = field.bytes().await?;
            key = Some(key_value(&headers, &bytes)?);
        } else {
            field.bytes().await?;
        }
        parts += 1;
    }
    Err(FormError::NoFile)
}

/// Why a form upload's key cannot be read as S3 would read it (the refusal's detail).
#[derive(Debug, thiserror::Error)]
pub enum FormError {
    #[error("more than one Content-Type")]
    ContentTypes,
    #[error(transparent)]
    Boundary(#[from] BoundaryError),
    #[error("the form: {0}")]
    Multipart(#[from] multer::Error),
    #[error("a form part without one Content-Disposition")]
    Disposition,
    #[error("a Content-Disposition that is not ASCII")]
    DispositionNotAscii,
    #[error("a form part's Content-Disposition names it twice, or not at all")]
    Named,
    #[error("the form has no key field before its file")]
    NoKey,
    #[error("the form has two key fields")]
    TwoKeys,
    #[error(transparent)]
    Key(#[from] KeyValueError),
    #[error("the form has no file field")]
    NoFile,
    #[error(transparent)]
    Delimiters(#[from] DelimitersError),
}

/// The key field's value: its bytes as UTF-8, as S3 servers read a field (s3s takes
/// them as they are). Refused where readers differ: a part whose `Content-Type` names a
/// charset other than UTF-8 (multer's `text` decodes by it: `victim` in UTF-16 is
/// another key), or a value that starts with a byte order mark (which decoders drop:
/// `\u{feff}k` would be `k` to the fence and itself to the server).
fn key_value(headers: &http::HeaderMap, bytes: &[u8]) -> Result<String, KeyValueError> {
    for value in headers.get_all(http::header::CONTENT_TYPE) {
        let value = value.to_str().map_err(|_| KeyValueError::TypeNotAscii)?;
        let other = value.split(';').skip(1).any(|p| {
            p.split_once('=').is_some_and(|(n, v)| {
                n.trim().eq_ignore_ascii_case("charset")
                    && !v.trim().trim_matches('"').eq_ignore_ascii_case("utf-8")
            })
        });
        if other {
            return Err(KeyValueError::Charset(value.to_owned()));
        }
    }
    let text = std::str::from_utf8(bytes).map_err(KeyValueError::NotUtf8)?;
    if text.starts_with('\u{feff}') {
        return Err(KeyValueError::ByteOrderMark);
    }
    Ok(text.to_string())
}

/// Why a form's key field has no value every reader of it takes.
#[derive(Debug, thiserror::Error)]
pub enum KeyValueError {
    #[error("the key part's Content-Type is not ASCII")]
    TypeNotAscii,
    /// The part's Content-Type as sent.
    #[error("the key part names a charset other than UTF-8 ({0}): readers differ on it")]
    Charset(String),
    #[error("the key field is not UTF-8")]
    NotUtf8(#[source] std::str::Utf8Error),
    #[error("the key starts with a byte order mark: readers differ on it")]
    ByteOrderMark,
}

/// The key as written and, if it has S3's `${filename}`, with it replaced by the file
/// part's filename (empty without one): a backend may store either.
fn resolve(key: String, file_name: Option<&str>) -> Vec<String> {
    const VAR: &str = "${filename}";
    if !key.contains(VAR) {
        return vec![key];
    }
    let resolved = key.replace(VAR, file_name.unwrap_or_default());
    vec![resolved, key]
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full, StreamBody};

    fn form(parts: &[(&str, Option<&str>, &str)]) -> String {
        let mut s = String::new();
        for (name, file, value) in parts {
            s.push_str("--XyZ\r\nContent-Disposition: form-data; name=\"");
            s.push_str(name);
            s.push('"');
            if let Some(f) = file {
                s.push_str("; filename=\"");
                s.push_str(f);
                s.push('"');
            }
            s.push_str("\r\n\r\n");
            s.push_str(value);
            s.push_str("\r\n");
        }
        s.push_str("--XyZ--\r\n");
        s
    }

    async fn key_of(body: String) -> (Result<Vec<String>, String>, String) {
        let ct = HeaderValue::from_static("multipart/form-data; boundary=XyZ");
        // In small chunks, so the reader stops in the middle of the body.
        let chunks: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = body
            .as_bytes()
            .chunks(7)
            .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        let stream = StreamBody::new(futures_util::stream::iter(chunks));
        let (key, replay) = read_key(Some(&ct), stream).await;
        let forwarded = replay.collect().await.expect("replay").to_bytes();
        (
            key.map_err(|e| e.to_string()),
            String::from_utf8(forwarded.to_vec()).expect("utf-8"),
        )
    }

    #[tokio::test]
    async fn the_key_and_the_body_as_sent() {
        let body = form(&[
            ("key", None, "reports/${filename}"),
            ("Policy", None, "eyJ4IjoxfQ=="),
            ("file", Some("july.csv"), &"x".repeat(10_000)),
            ("key", None, "after-the-file-is-ignored"),
        ]);
        let (key, forwarded) = key_of(body.clone()).await;
        assert_eq!(
            key,
            Ok(vec![
                "reports/july.csv".to_string(),
                "reports/${filename}".to_string()
            ])
        );
        assert_eq!(forwarded, body, "the body goes on byte for byte");

        let (key, _) = key_of(form(&[("KEY", None, "a/b"), ("file", None, "x")])).await;
        assert_eq!(key, Ok(vec!["a/b".to_string()]));
    }

    #[tokio::test]
    async fn refused_forms() {
        for parts in [
            vec![
                ("key", None, "a"),
                ("Key", None, "b"),
                ("file", Some("f"), "x"),
            ],
            vec![("file", Some("f"), "x"), ("key", None, "a")],
            vec![("key", None, "a")],
        ] {
            let (key, forwarded) = key_of(form(&parts)).await;
            assert!(key.is_err(), "{parts:?}: {key:?}");
            assert_eq!(forwarded, form(&parts), "the body is kept whole even so");
        }
        let long = "p".repeat(MAX_FIELD as usize + 1);
        let (key, _) = key_of(form(&[
            ("policy", None, &long),
            ("key", None, "a"),
            ("file", None, "x"),
        ]))
        .await;
        assert!(key.is_err(), "{key:?}");
        for ct in [
            "multipart/form-data; boundary=XyZ; boundary=other",
            "multipart/form-data; boundary=\"X\\yZ\"",
            "multipart/form-data",
        ] {
            let ct = HeaderValue::from_static(ct);
            let (key, _) = read_key(
                Some(&ct),
                Full::new(Bytes::from(form(&[
                    ("key", None, "a"),
                    ("file", None, "x"),
                ]))),
            )
            .await;
            assert!(key.is_err(), "{ct:?}: {key:?}");
        }
        let quoted = HeaderValue::from_static("multipart/form-data; Boundary=\"XyZ\"");
        let (key, _) = read_key(
            Some(&quoted),
            Full::new(Bytes::from(form(&[
                ("key", None, "a"),
                ("file", None, "x"),
            ]))),
        )
        .await;
        assert_eq!(key.map_err(|e| e.to_string()), Ok(vec!["a".to_string()]));
        // A `--boundary` line right after a field's blank line: data to multer, a
        // delimiter to a server that reads by lines (and a second key there).
        let smuggled = "--XyZ\r\nContent-Disposition: form-data; name=\"key\"\r\n\r\nmine\r\n--XyZ\r\nContent-Disposition: form-data; name=\"x\"\r\n\r\n--XyZ\r\nContent-Disposition: form-data; name=\"key\"\r\n\r\nvictim\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nx\r\n--XyZ--\r\n";
        let (key, forwarded) = key_of(smuggled.to_string()).await;
        assert!(key.is_err(), "{key:?}");
        assert_eq!(forwarded, smuggled);
        let lf_only = "--XyZ\r\nContent-Disposition: form-data; name=\"key\"\r\n\r\nmine\n--XyZ\nx\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nx\r\n--XyZ--\r\n";
        let (key, _) = key_of(lf_only.to_string()).await;
        assert!(key.is_err(), "{key:?}");
        let twice = "--XyZ\r\nContent-Disposition: form-data; name=\"key\"; name=\"other\"\r\n\r\na\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nx\r\n--XyZ--\r\n";
        let (key, _) = key_of(twice.to_string()).await;
        assert!(key.is_err(), "{key:?}");
        let ct = HeaderValue::from_static("application/xml");
        let (key, _) = read_key(Some(&ct), Full::new(Bytes::from_static(b"<x/>"))).await;
        assert!(key.is_err());
    }

    /// The key field as s3s reads it: its bytes as UTF-8. A charset on its part, or a
    /// byte order mark, would make multer's text another key (the object-identity
    /// oracle's finding: `\u{feff}é` written while `é` was decided).
    #[tokio::test]
    async fn the_key_is_its_bytes_as_utf8() {
        let with_type = |t: &str, value: &str| {
            format!(
                "--XyZ\r\nContent-Disposition: form-data; name=\"key\"\r\nContent-Type: {t}\r\n\r\n{value}\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nx\r\n--XyZ--\r\n"
            )
        };
        for refused in [
            with_type("text/plain; charset=iso-8859-1", "\u{e9}"),
            with_type("text/plain; charset=utf-16le", "victim"),
            with_type("text/plain; Charset=\"UTF-16\"", "victim"),
            form(&[("key", None, "\u{feff}\u{e9}"), ("file", None, "x")]),
        ] {
            let (key, _) = key_of(refused.clone()).await;
            assert!(key.is_err(), "{refused:?}: {key:?}");
        }
        for (body, expected) in [
            (with_type("text/plain; charset=UTF-8", "\u{e9}"), "\u{e9}"),
            (with_type("text/plain", "a\u{feff}"), "a\u{feff}"),
        ] {
            let (key, _) = key_of(body).await;
            assert_eq!(key, Ok(vec![expected.to_string()]));
        }
        let headers = http::HeaderMap::new();
        assert!(key_value(&headers, b"\xc3").is_err(), "not UTF-8");
    }
}
