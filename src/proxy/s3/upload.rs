//! Multipart uploads belong to the key they were created for (SPEC §15). Some S3 servers
//! (s3s-fs among them) take a part, a completion or an abort for an upload id under any
//! key: a stale writer could put a part into the current owner's upload of another key
//! with a token of its own scope. So the upload id a CreateMultipartUpload answer names is
//! recorded durably with the scope it was created in, before the answer reaches the
//! client, and a fenced request that names an upload id is refused unless the id was
//! recorded for the request's own scope.
//!
//! The records live in the mark store's record table (with the idempotency records,
//! under keys no idempotency record can have) and expire after [`UPLOAD_TTL`].

use std::time::Duration;

use bytes::Bytes;
use quick_xml::Reader;
use quick_xml::events::Event;

/// How long an upload id is known: S3 keeps an incomplete upload until it is completed,
/// aborted or removed by a lifecycle rule; a week is the common rule.
pub const UPLOAD_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
/// The largest CreateMultipartUpload answer read for its upload id.
pub const MAX_ANSWER: usize = 64 * 1024;

/// What a fenced S3 request does with multipart uploads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Upload {
    /// CreateMultipartUpload (`POST ?uploads`): its answer's upload id is recorded.
    Creates,
    /// A part, a copied part, a completion or an abort of this upload id: checked.
    Uses(String),
    /// DeleteBucket: some servers (s3s-fs) delete a bucket with its objects, so no object
    /// scope of the bucket but the request's own may hold a mark: these scopes, the one
    /// scope of all its objects (`exact`), or every scope with this prefix.
    DeletesBucket { scopes: String, exact: bool },
}

/// The record key of `upload_id` from upstream `upstream`. A scope never starts with a
/// NUL (no path segment or scope template holds a control character), so no idempotency
/// record (`{scope}\0{key}`) has such a key.
pub fn record_key(upstream: &str, upload_id: &str) -> String {
    format!("\0s3-upload\0{upstream}\0{upload_id}")
}

/// A record's value: its expiry (big-endian unix seconds, as every record's) and the scope.
pub fn record_value(expires: u64, scope: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(8 + scope.len());
    v.extend_from_slice(&expires.to_be_bytes());
    v.extend_from_slice(scope.as_bytes());
    v
}

/// The scope of a live record (`None` if expired by `now` or not one of these).
pub fn record_scope(value: &[u8], now: u64) -> Option<&str> {
    let expires = u64::from_be_bytes(value.get(..8)?.try_into().ok()?);
    (expires > now)
        .then(|| std::str::from_utf8(value.get(8..)?).ok())
        .flatten()
}

/// The upload id of a CreateMultipartUpload answer: the text of its one `UploadId`.
pub fn answered_id(body: &Bytes) -> Result<String, AnswerError> {
    let text = std::str::from_utf8(body).map_err(AnswerError::NotUtf8)?;
    let mut reader = Reader::from_str(text);
    let mut inside = false;
    let mut id: Option<String> = None;
    loop {
        match reader.read_event().map_err(AnswerError::Xml)? {
            Event::Start(e) if e.local_name().as_ref() == "UploadId" => {
                if id.is_some() {
                    return Err(AnswerError::TwoIds);
                }
                inside = true;
                id = Some(String::new());
            }
            Event::End(_) => inside = false,
            Event::Text(t) if inside => {
                if let Some(id) = id.as_mut() {
                    id.push_str(&t.xml10_content());
                }
            }
            Event::GeneralRef(r) if inside => {
                let c = super::delete::reference(&r)?;
                if let Some(id) = id.as_mut() {
                    id.push(c);
                }
            }
            Event::Eof => break,
            _ => {}
        }
    }
    id.filter(|i| !i.is_empty()).ok_or(AnswerError::NoId)
}

/// Why a CreateMultipartUpload answer gives no upload id to record.
#[derive(Debug, thiserror::Error)]
pub enum AnswerError {
    #[error("the answer is not UTF-8")]
    NotUtf8(#[source] std::str::Utf8Error),
    #[error("the answer is not well-formed XML: {0}")]
    Xml(#[source] quick_xml::Error),
    #[error("the answer names two upload ids")]
    TwoIds,
    #[error(transparent)]
    Reference(#[from] super::delete::ReferenceError),
    #[error("the answer names no upload id")]
    NoId,
}

/// Two errors are equal when they say the same (quick-xml's errors do not compare).
impl PartialEq for AnswerError {
    fn eq(&self, other: &Self) -> bool {
        self.to_string() == other.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records() {
        let v = record_value(100, "object/b/k");
        assert_eq!(record_scope(&v, 99), Some("object/b/k"));
        assert_eq!(record_scope(&v, 100), None, "expired");
        assert_eq!(record_scope(b"short", 0), None);
        assert!(record_key("s3", "id").starts_with('\0'));
    }

    #[test]
    fn the_upload_id_of_an_answer() {
        let body = Bytes::from_static(
            b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<InitiateMultipartUploadResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Bucket>b</Bucket><Key>k</Key><UploadId>a&amp;b~1</UploadId></InitiateMultipartUploadResult>",
        );
        assert_eq!(answered_id(&body).as_deref(), Ok("a&b~1"));
        for bad in [
            &b"<R><UploadId></UploadId></R>"[..],
            b"<R><Key>k</Key></R>",
            b"<R><UploadId>a</UploadId><UploadId>b</UploadId></R>",
            b"<R><UploadId>a</R>",
        ] {
            assert!(answered_id(&Bytes::from_static(bad)).is_err(), "{bad:?}");
        }
    }
}
