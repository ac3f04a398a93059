//! DeleteObjects (`POST /{bucket}?delete`): the keys it deletes, read from its XML body
//! before anything is forwarded.
//!
//! The body is read strictly, so that the keys the fence reads are the keys any XML
//! reader of the backend's would read: a `<Delete>` of `<Quiet>` and `<Object>`s, each
//! with exactly one `<Key>` (and optionally `<VersionId>`, `<ETag>`, `<LastModifiedTime>`,
//! `<Size>`, whose values do not name objects). Anything a reader might take another way
//! is refused rather than guessed at: a DOCTYPE (entities of its own), a comment or
//! processing instruction, an unknown element, text outside the elements that hold it,
//! an undefined entity, a second root, CDATA (which s3s skips and other readers keep).
//! XML's own rules apply to what is kept: predefined and character references resolved,
//! line ends normalized.

use std::pin::Pin;

use bytes::{Bytes, BytesMut};
use http_body::Body;
use http_body_util::BodyExt;
use quick_xml::Reader;
use quick_xml::events::Event;

use super::form::Replay;
use crate::body::BoxError;

/// S3's limit on the objects of one DeleteObjects.
pub const MAX_KEYS: usize = 1000;
/// The largest body read: 1,000 keys of S3's longest (1,024 bytes) with their elements,
/// and room for escapes and versions.
pub const MAX_BYTES: usize = 2 * 1024 * 1024;

/// Reads a DeleteObjects body whole (at most `limit` bytes) and its keys; the body to
/// forward is what was read.
pub async fn read<B>(body: B, limit: usize) -> (Result<Vec<String>, DeleteError>, Replay<B>)
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut body: Pin<Box<B>> = Box::pin(body);
    let mut read: Vec<Bytes> = Vec::new();
    let mut len = 0usize;
    let whole = loop {
        match body.frame().await {
            None => break Ok(()),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    len += data.len();
                    read.push(data);
                    if len > limit {
                        break Err(DeleteError::TooLarge(limit));
                    }
                }
                Err(_) => break Err(DeleteError::Trailers),
            },
            Some(Err(e)) => break Err(DeleteError::Unreadable(e.into())),
        }
    };
    let keys = whole.and_then(|()| {
        let mut all = BytesMut::with_capacity(len);
        for b in &read {
            all.extend_from_slice(b);
        }
        keys(&all)
    });
    (keys, Replay::new(read, Some(body)))
}

/// Where the reader is in the document.
#[derive(Clone, Copy, PartialEq, Eq)]
enum At {
    /// Before the root.
    Prolog,
    Delete,
    Quiet,
    Object,
    Key,
    /// `VersionId` and the other fields of an `Object` that name no object.
    Field,
    /// After the root's end.
    Epilog,
}

/// The keys of a DeleteObjects body, in document order. An error says what is wrong
/// (answered 400 `MalformedXML`).
pub fn keys(body: &[u8]) -> Result<Vec<String>, DeleteError> {
    if body.len() > MAX_BYTES {
        return Err(DeleteError::TooLarge(MAX_BYTES));
    }
    let text = std::str::from_utf8(body).map_err(|_| DeleteError::NotUtf8)?;
    let mut reader = Reader::from_str(text);
    let mut at = At::Prolog;
    let mut keys: Vec<String> = Vec::new();
    // The current object's key, once its `<Key>` has opened.
    let mut key: Option<String> = None;
    let mut seen_decl = false;
    loop {
        let event = reader.read_event().map_err(DeleteError::Xml)?;
        match event {
            Event::Decl(_) if at == At::Prolog && !seen_decl => seen_decl = true,
            Event::Start(e) => {
                let name = e.local_name();
                let name = name.as_ref();
                at = match (at, name) {
                    (At::Prolog, "Delete") => At::Delete,
                    (At::Delete, "Quiet") => At::Quiet,
                    (At::Delete, "Object") => {
                        if keys.len() == MAX_KEYS {
                            return Err(DeleteError::TooMany);
                        }
                        At::Object
                    }
                    (At::Object, "Key") if key.is_none() => {
                        key = Some(String::new());
                        At::Key
                    }
                    (At::Object, "Key") => return Err(DeleteError::TwoKeys),
                    (At::Object, "VersionId" | "ETag" | "LastModifiedTime" | "Size") => At::Field,
                    _ => return Err(DeleteError::Unexpected(name.to_owned(), inside(at))),
                };
            }
            Event::Empty(e) => {
                let name = e.local_name();
                let name = name.as_ref();
                match (at, name) {
                    (At::Object, "Key") => return Err(DeleteError::EmptyKey),
                    (At::Object, "VersionId" | "ETag" | "LastModifiedTime" | "Size") => {}
                    (At::Prolog, "Delete") => return Err(DeleteError::NoObjects),
                    _ => return Err(DeleteError::Unexpected(name.to_owned(), inside(at))),
                }
            }
            Event::End(_) => {
                // quick-xml checks that an end tag names the element it closes.
                at = match at {
                    At::Delete if keys.is_empty() => return Err(DeleteError::NoObjects),
                    At::Delete => At::Epilog,
                    At::Object => {
                        let k = key.take().ok_or(DeleteError::NoKey)?;
                        keys.push(k);
                        At::Delete
                    }
                    At::Quiet => At::Delete,
                    At::Key | At::Field => At::Object,
                    At::Prolog | At::Epilog => return Err(DeleteError::EndWithoutStart),
                };
            }
            Event::Text(t) => {
                let content = t.xml10_content();
                match (at, key.as_mut()) {
                    (At::Key, Some(k)) => k.push_str(&content),
                    (At::Quiet | At::Field, _) => {}
                    _ if content.bytes().all(|b| b.is_ascii_whitespace()) => {}
                    _ => return Err(DeleteError::TextOutside),
                }
            }
            // Readers differ on CDATA: s3s skips it, so `victim<![CDATA[zz]]>` is
            // `victim` there and `victimzz` to a reader that keeps it. S3 clients do not
            // write it.
            Event::CData(_) => return Err(DeleteError::CData),
            Event::GeneralRef(r) => {
                let c = reference(&r)?;
                match (at, key.as_mut()) {
                    (At::Key, Some(k)) => k.push(c),
                    (At::Quiet | At::Field, _) => {}
                    _ => return Err(DeleteError::ReferenceOutside),
                }
            }
            Event::Decl(_) => return Err(DeleteError::LateDecl),
            Event::Comment(_) => return Err(DeleteError::Comment),
            Event::PI(_) => return Err(DeleteError::ProcessingInstruction),
            Event::DocType(_) => return Err(DeleteError::DocType),
            Event::Eof => break,
        }
    }
    if at != At::Epilog {
        return Err(DeleteError::EndsEarly);
    }
    Ok(keys)
}

/// The character a reference in text stands for: a character reference, or one of
/// XML's five predefined entities (no DOCTYPE is read, so no other is defined).
pub(super) fn reference(r: &quick_xml::events::BytesRef<'_>) -> Result<char, ReferenceError> {
    match r.resolve_char_ref() {
        Ok(Some(c)) => Ok(c),
        Ok(None) => match r.as_ref() {
            "amp" => Ok('&'),
            "lt" => Ok('<'),
            "gt" => Ok('>'),
            "quot" => Ok('"'),
            "apos" => Ok('\''),
            other => Err(ReferenceError::Undefined(other.to_owned())),
        },
        Err(e) => Err(ReferenceError::CharRef(e)),
    }
}

/// Why a reference in text stands for no character.
#[derive(Debug, thiserror::Error)]
pub enum ReferenceError {
    /// An entity other than XML's five (the name as written).
    #[error("the undefined entity &{0};")]
    Undefined(String),
    #[error("a character reference: {0}")]
    CharRef(#[source] quick_xml::Error),
}

/// Where an element out of place was met, as [`DeleteError::Unexpected`] says it.
fn inside(at: At) -> &'static str {
    match at {
        At::Prolog => "as the root (a DeleteObjects body is a Delete)",
        At::Delete => "in Delete",
        At::Quiet => "in Quiet",
        At::Object => "in Object",
        At::Key => "in Key",
        At::Field => "in an Object's field",
        At::Epilog => "after the root",
    }
}

/// Why a DeleteObjects body is not what S3 takes (answered 400 `MalformedXML`).
#[derive(Debug, thiserror::Error)]
pub enum DeleteError {
    #[error("the body is larger than {0} bytes")]
    TooLarge(usize),
    #[error("trailers on a DeleteObjects body")]
    Trailers,
    #[error("the body could not be read: {0}")]
    Unreadable(#[source] BoxError),
    #[error("the body is not UTF-8")]
    NotUtf8,
    #[error("not well-formed XML: {0}")]
    Xml(#[source] quick_xml::Error),
    #[error("more than {MAX_KEYS} objects")]
    TooMany,
    #[error("an Object with two Keys")]
    TwoKeys,
    #[error("an empty Key")]
    EmptyKey,
    #[error("a Delete of no objects")]
    NoObjects,
    #[error("an Object without a Key")]
    NoKey,
    #[error("an end tag without its start")]
    EndWithoutStart,
    #[error("text outside the elements that hold it")]
    TextOutside,
    #[error("CDATA (refused: readers differ on it)")]
    CData,
    #[error(transparent)]
    Reference(#[from] ReferenceError),
    #[error("a reference outside the elements that hold text")]
    ReferenceOutside,
    #[error("an XML declaration after the start")]
    LateDecl,
    #[error("a comment (refused: readers differ on them)")]
    Comment,
    #[error("a processing instruction")]
    ProcessingInstruction,
    #[error("a DOCTYPE (entities of its own)")]
    DocType,
    #[error("the document ends before its Delete does")]
    EndsEarly,
    /// An element (its local name) where a DeleteObjects body has none of that name.
    #[error("the element <{0}> {1}")]
    Unexpected(String, &'static str),
}

/// Two errors are equal when they say the same (quick-xml's and the body's errors do
/// not compare).
impl PartialEq for DeleteError {
    fn eq(&self, other: &Self) -> bool {
        self.to_string() == other.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(objects: &str) -> String {
        format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Delete xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Quiet>true</Quiet>{objects}</Delete>"
        )
    }

    #[test]
    fn the_keys_s3_reads() {
        let body = doc(
            "<Object><Key>a/b.csv</Key></Object>\n  <Object><Key>x&amp;y&#x41;&#66;&lt;</Key><VersionId>v1</VersionId></Object><Object><Key> sp </Key><ETag>\"e\"</ETag><Size>3</Size></Object>",
        );
        assert_eq!(
            keys(body.as_bytes()),
            Ok(vec!["a/b.csv".to_string(), "x&yAB<".into(), " sp ".into()])
        );
        // A prefix on the elements: read by their local names.
        let prefixed = "<s3:Delete xmlns:s3=\"http://s3.amazonaws.com/doc/2006-03-01/\"><s3:Object><s3:Key>k</s3:Key></s3:Object></s3:Delete>";
        assert_eq!(keys(prefixed.as_bytes()), Ok(vec!["k".to_string()]));
        // Line ends are normalized as any XML reader does.
        assert_eq!(
            keys(doc("<Object><Key>a\r\nb</Key></Object>").as_bytes()),
            Ok(vec!["a\nb".to_string()])
        );
    }

    #[test]
    fn what_a_reader_could_take_another_way_is_refused() {
        for (what, body) in [
            ("two keys", doc("<Object><Key>a</Key><Key>b</Key></Object>")),
            ("no key", doc("<Object><VersionId>v</VersionId></Object>")),
            ("empty key", doc("<Object><Key/></Object>")),
            (
                "comment in a key",
                doc("<Object><Key>a<!--x-->b</Key></Object>"),
            ),
            ("comment", doc("<!--x--><Object><Key>a</Key></Object>")),
            (
                "cdata in a key",
                doc("<Object><Key>victim<![CDATA[zz]]></Key></Object>"),
            ),
            (
                "cdata alone",
                doc("<Object><Key><![CDATA[k]]></Key></Object>"),
            ),
            (
                "cdata in a version",
                doc("<Object><Key>k</Key><VersionId><![CDATA[v]]></VersionId></Object>"),
            ),
            (
                "unknown element",
                doc("<Object><Key>a</Key><Other>b</Other></Object>"),
            ),
            (
                "element in a key",
                doc("<Object><Key><b>a</b></Key></Object>"),
            ),
            ("text in Delete", doc("x<Object><Key>a</Key></Object>")),
            ("undefined entity", doc("<Object><Key>&ent;</Key></Object>")),
            ("no objects", doc("")),
            ("pi", doc("<?x y?><Object><Key>a</Key></Object>")),
            (
                "doctype",
                format!(
                    "<!DOCTYPE Delete [<!ENTITY e \"v\">]>{}",
                    doc("<Object><Key>&e;</Key></Object>")
                ),
            ),
            (
                "two roots",
                format!("{}<Delete/>", doc("<Object><Key>a</Key></Object>")),
            ),
            ("unclosed", "<Delete><Object><Key>a</Key></Object>".into()),
            (
                "mismatched end",
                "<Delete><Object><Key>a</Object></Key></Delete>".into(),
            ),
            (
                "another root",
                "<Remove><Object><Key>a</Key></Object></Remove>".into(),
            ),
            ("empty", String::new()),
            ("not xml", "--boundary\r\n".into()),
        ] {
            assert!(
                keys(body.as_bytes()).is_err(),
                "{what}: {:?}",
                keys(body.as_bytes())
            );
        }
        assert!(keys(b"<Delete><Object><Key>\xff</Key></Object></Delete>").is_err());
    }

    #[test]
    fn bounded() {
        let one = "<Object><Key>k</Key></Object>";
        assert_eq!(
            keys(doc(&one.repeat(MAX_KEYS)).as_bytes()).map(|k| k.len()),
            Ok(MAX_KEYS)
        );
        assert!(keys(doc(&one.repeat(MAX_KEYS + 1)).as_bytes()).is_err());
        assert!(keys(&vec![b' '; MAX_BYTES + 1]).is_err());
    }
}
