//! S3's REST API on an `api = "s3"` route (SPEC §15): every request that changes objects
//! is fenced on the scope of the objects it changes, wherever the request names them.
//!
//! S3 names objects in three places besides the path: the Host (virtual-hosted
//! addressing, `{bucket}.{domain}`), the XML body of DeleteObjects (`POST /{bucket}?delete`,
//! [`delete`]) and the form of a browser upload (`POST /{bucket}`, [`form`]). The first is
//! read before routing ([`for_host`]): the bucket taken from the Host is put in front
//! of the path, so both addressing styles route and render alike. The other two are read
//! from the body by the fence before the gate, and the body is forwarded as it was read.
//! Requests on the bucket itself are fenced on the route's `bucket_scope`, or refused.

pub mod delete;
pub mod form;
pub mod upload;

use std::borrow::Cow;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, header};

use crate::body::BoxError;

pub use crate::proxy::config::{Keys, S3Api};
use crate::route::{Capture, ScopeTemplate, Segments};

/// What an S3 request acts on, from its method, query and path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// A request on the object its path names (reads, PutObject, CopyObject's target,
    /// the parts of a multipart upload, DeleteObject, tagging, ACLs, retention, restore):
    /// the route's scope.
    Object,
    /// A request on the bucket itself (listing, creation, deletion, settings).
    Bucket,
    /// The service: `/` on the endpoint (ListBuckets).
    Service,
    /// DeleteObjects: the keys are in the XML body.
    DeleteObjects,
    /// A browser-form upload: the key is a form field.
    PostForm,
}

/// The operation of a request whose route captured `captures` values (bucket and key: an
/// object; the bucket only: the bucket; none: the service).
///
/// A bucket's POST is DeleteObjects when its query names `delete` in any case or
/// spelling (a backend that matched it without regard to case would delete keys the
/// fence never read), a form upload when it has no query at all (S3 reads a bare
/// POST on a bucket as one, whatever its `Content-Type`), and any other POST on the bucket
/// is a request on the bucket.
pub fn operation(
    method: &Method,
    query: Option<&str>,
    captures: usize,
    form: bool,
) -> Result<Operation, OperationError> {
    // A POST of `multipart/form-data` is a form upload to s3s whatever its path and
    // query (it checks the form's signature before it routes): read as one.
    if form && *method == Method::POST {
        return Ok(Operation::PostForm);
    }
    Ok(match captures {
        0 => Operation::Service,
        1 if *method == Method::POST => {
            let names = query_names(query.unwrap_or(""))?;
            if names.iter().any(|n| n.eq_ignore_ascii_case("delete")) {
                Operation::DeleteObjects
            } else if names.is_empty() {
                Operation::PostForm
            } else {
                Operation::Bucket
            }
        }
        1 => Operation::Bucket,
        _ if *method == Method::POST => {
            // S3's POSTs on an object say what they are in the query. A bare one, or one
            // naming `delete`, is no S3 request on an object, and a server could read it
            // as one on the bucket (a form upload, a DeleteObjects): refused.
            let names = query_names(query.unwrap_or(""))?;
            let named = |n: &str| names.iter().any(|m| m.eq_ignore_ascii_case(n));
            if named("delete") || !OBJECT_POSTS.iter().any(|n| named(n)) {
                return Err(OperationError::ObjectPost);
            }
            Operation::Object
        }
        _ => Operation::Object,
    })
}

/// Why a request's method, query and path name no S3 operation the fence can read.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum OperationError {
    #[error(transparent)]
    Query(#[from] QueryError),
    #[error("a POST on an object is S3's only with ?uploads, ?uploadId, ?restore or ?select")]
    ObjectPost,
}

/// A query name or value whose escapes do not decode to UTF-8 (the text as sent): the
/// backend would read something, and the fence could not say what.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("the query's `{0}` does not decode to UTF-8")]
pub struct QueryError(String);

/// Is this a DeleteBucket: a DELETE on the bucket whose query names none of the
/// sub-resources S3 deletes instead ([`BUCKET_DELETES`])?
///
/// S3 servers take a DELETE on a bucket for a DeleteBucket whatever else its query holds
/// (s3s: `?versionId=1`, `?delete`, `?Tagging` all delete the bucket, and s3s-fs its
/// objects with it), so only a sub-resource's name, spelled exactly, makes it something
/// else. A name in another case or escaped is not one here: a server that reads it as the
/// sub-resource deletes less than the fence checked for.
pub fn deletes_bucket(method: &Method, query: Option<&str>) -> bool {
    *method == Method::DELETE
        && !query
            .unwrap_or("")
            .split('&')
            .map(|pair| pair.split('=').next().unwrap_or_default())
            .any(|name| BUCKET_DELETES.contains(&name))
}

/// The sub-resources of a bucket a DELETE removes instead of the bucket.
const BUCKET_DELETES: [&str; 14] = [
    "analytics",
    "cors",
    "encryption",
    "intelligent-tiering",
    "inventory",
    "lifecycle",
    "metadataTable",
    "metrics",
    "ownershipControls",
    "policy",
    "publicAccessBlock",
    "replication",
    "tagging",
    "website",
];

/// The object scopes of a bucket under the route's scope template (`caps` holds the
/// bucket only): the one scope of all its objects when the template does not use the
/// key, the prefix of all of them when it ends with the key, else `None`.
pub fn bucket_objects(template: &ScopeTemplate, caps: &[Capture<'_>]) -> Option<upload::Upload> {
    if !template.uses_capture(1) {
        return Some(upload::Upload::DeletesBucket {
            scopes: template.render(caps),
            exact: true,
        });
    }
    template
        .ends_with_capture(1)
        .then(|| upload::Upload::DeletesBucket {
            scopes: template.render(caps),
            exact: false,
        })
}

/// The query names of S3's POSTs on an object: CreateMultipartUpload,
/// CompleteMultipartUpload, RestoreObject, SelectObjectContent.
const OBJECT_POSTS: [&str; 4] = ["uploads", "uploadId", "restore", "select"];

/// Headers with which a request changes a second object that its path does not name
/// (S3 Express's RenameObject removes the source it names): refused on an S3 route.
pub const SECOND_OBJECT: [&str; 1] = ["x-amz-rename-source"];

/// What a request on an object does with multipart uploads: creates one (`?uploads` on a
/// POST), names one (`uploadId`), or neither. Two `uploadId` parameters are an error (a
/// backend could take either).
pub fn upload_of(
    method: &Method,
    query: Option<&str>,
) -> Result<Option<upload::Upload>, UploadOfError> {
    let Some(query) = query else {
        return Ok(None);
    };
    let mut id: Option<String> = None;
    let mut creates = false;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let name = decode(name)?;
        if name.eq_ignore_ascii_case("uploadId") {
            if id.is_some() {
                return Err(UploadOfError::TwoIds);
            }
            id = Some(decode(value)?.into_owned());
        } else if name.eq_ignore_ascii_case("uploads") {
            creates = true;
        }
    }
    Ok(match (id, creates) {
        (Some(_), true) => return Err(UploadOfError::Both),
        (Some(id), false) => Some(upload::Upload::Uses(id)),
        (None, true) if *method == Method::POST => Some(upload::Upload::Creates),
        (None, _) => None,
    })
}

/// Why a query's uploads and upload id cannot be read as one.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum UploadOfError {
    #[error(transparent)]
    Query(#[from] QueryError),
    #[error("two uploadId parameters")]
    TwoIds,
    #[error("both uploads and uploadId")]
    Both,
}

/// One query name or value, decoded as a form decodes it (`+` is a space).
fn decode(text: &str) -> Result<Cow<'_, str>, QueryError> {
    if !text.contains(['%', '+']) {
        return Ok(Cow::Borrowed(text));
    }
    let spaced = text.replace('+', " ");
    percent_encoding::percent_decode_str(&spaced)
        .decode_utf8()
        .map(|d| Cow::Owned(d.into_owned()))
        .map_err(|_| QueryError(text.to_owned()))
}

/// The decoded names of a query's parameters (`+` is a space, as form decoding has it).
/// A name whose escapes do not decode to UTF-8 is an error: the backend would read
/// something, and the fence could not say what.
fn query_names(query: &str) -> Result<Vec<Cow<'_, str>>, QueryError> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| decode(pair.split('=').next().unwrap_or_default()))
        .collect()
}

/// A request to an S3 route's host: the route's endpoint (to route by), the bucket a
/// virtual-hosted request names in its Host, and how the route reads keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct S3Host<'a, 'h> {
    pub endpoint: &'a str,
    pub bucket: Option<&'h str>,
    pub keys: Keys,
}

/// The S3 route whose endpoint `host` names, or whose `virtual_host_domain` it is a
/// subdomain of (the first in file order); `raw` is the Host as sent (with its port).
///
/// S3 servers match their domain byte for byte, port included, and read any other Host
/// as the name of a bucket (s3s: the whole Host, lower-cased): `Host: S3.TEST` or
/// `s3.test` without the expected port would write bucket `s3.test`, not the bucket of
/// the path. So a request that names the route's host must name it exactly as the route
/// does (`s3.test:18080`, or `bkt.s3.test:18080` virtual-hosted), with no upper-case
/// letter anywhere (S3 bucket names are lower case); anything else is an error.
pub fn for_host<'a, 'h>(
    routes: &'a [crate::proxy::config::Route],
    host: &str,
    raw: &'h str,
) -> Result<Option<S3Host<'a, 'h>>, HostError> {
    for r in routes {
        let (Some(s3), Some(name)) = (r.s3(), r.host.as_deref()) else {
            continue;
        };
        let domain = s3.virtual_host_domain.as_deref();
        let named = host.eq_ignore_ascii_case(name)
            || domain
                .and_then(|d| crate::route::host_of(d).ok())
                .is_some_and(|d| strip_domain(host, d).is_some());
        if !named {
            continue;
        }
        if raw.bytes().any(|b| b.is_ascii_uppercase()) {
            return Err(HostError::UpperCase(raw.to_owned()));
        }
        if raw == s3.endpoint {
            return Ok(Some(S3Host {
                endpoint: name,
                bucket: None,
                keys: s3.keys,
            }));
        }
        if let Some(bucket) = domain.and_then(|d| strip_domain(raw, d)) {
            return Ok(Some(S3Host {
                endpoint: name,
                bucket: Some(bucket),
                keys: s3.keys,
            }));
        }
        let expected = match domain {
            Some(d) => format!("`{}` or `<bucket>.{d}`", s3.endpoint),
            None => format!("`{}`", s3.endpoint),
        };
        return Err(HostError::NotExact {
            raw: raw.to_owned(),
            expected,
        });
    }
    Ok(None)
}

/// Why a Host that names an S3 route's host is refused (the Host as sent in each).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    #[error(
        "the Host `{0}` has upper-case letters: S3 names are lower case, and a backend may read it as another bucket"
    )]
    UpperCase(String),
    /// `expected`: the route's endpoint, or a bucket under its virtual-host domain.
    #[error(
        "the Host `{raw}` must be {expected} exactly: an S3 server reads any other Host as the name of a bucket"
    )]
    NotExact { raw: String, expected: String },
}

/// The segments an S3 route is matched on: the bucket (from the Host when `bucket` is
/// given, else the path's first segment), then the key. With [`Keys::Strict`] they are
/// the canonical path's; with [`Keys::Opaque`] the key is one segment, the rest of the
/// path percent-decoded whole (`%2F` is a `/` of the key, as S3 reads it).
pub fn segments<'p>(
    path: &'p str,
    bucket: Option<&'p str>,
    keys: Keys,
) -> Result<Segments<'p>, crate::route::PathError> {
    use crate::route::{PathError, canonicalize};
    let rest = path.strip_prefix('/').ok_or(PathError::NotOriginForm)?;
    if keys == Keys::Strict {
        let mut segments = canonicalize(path)?;
        if let Some(b) = bucket {
            segments.insert(0, Cow::Borrowed(b));
        }
        return Ok(segments);
    }
    let (bucket, key) = match bucket {
        Some(b) => (Cow::Borrowed(b), rest),
        None => {
            let (raw, key) = rest.split_once('/').unwrap_or((rest, ""));
            if raw.is_empty() {
                return match key {
                    "" => Ok(Segments::new()),
                    _ => Err(PathError::EmptySegment),
                };
            }
            let mut one = canonicalize(path.get(..raw.len() + 1).unwrap_or(path))?;
            match (one.pop(), one.is_empty()) {
                (Some(b), true) => (b, key),
                _ => return Err(PathError::ForbiddenCharacter),
            }
        }
    };
    let mut out = Segments::new();
    out.push(bucket);
    if !key.is_empty() {
        out.push(decode_key(key)?);
    }
    Ok(out)
}

/// A key read whole: percent-decoded, valid UTF-8, no control character.
fn decode_key(raw: &str) -> Result<Cow<'_, str>, crate::route::PathError> {
    use crate::route::PathError;
    let decoded = percent_encoding::percent_decode_str(raw);
    // A `%` that starts no escape would be taken literally by the decoder: refused, as
    // a path's is.
    let bytes = raw.as_bytes();
    for (i, b) in bytes.iter().enumerate() {
        if *b == b'%'
            && !(bytes.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                && bytes.get(i + 2).is_some_and(u8::is_ascii_hexdigit))
        {
            return Err(PathError::BadEscape);
        }
    }
    let text = decoded.decode_utf8().map_err(|_| PathError::NotUtf8)?;
    if text.chars().any(char::is_control) {
        return Err(PathError::ForbiddenCharacter);
    }
    Ok(text)
}

/// The dialect of a refusal made before a route was chosen (an unsafe path, no route):
/// S3's when the request's Host is an S3 route's (its endpoint or a virtual host under
/// it) and every route that could take that host (those before the S3 route, which takes
/// all its paths) answers in S3's dialect, so that an S3
/// SDK reads the error's code; problem+json otherwise.
pub fn unrouted_dialect(
    routes: &[crate::proxy::config::Route],
    headers: Option<&HeaderMap>,
) -> crate::proxy::problem::Dialect {
    use crate::proxy::problem::Dialect;
    let Some(host) = headers
        .and_then(|h| h.get(header::HOST))
        .and_then(|v| v.to_str().ok())
        .and_then(|v| crate::route::host_of(v).ok())
    else {
        return Dialect::Problem;
    };
    let mut s3_route = false;
    for r in routes {
        let takes = match &r.host {
            None => true,
            Some(h) => {
                h.eq_ignore_ascii_case(host)
                    || r.s3()
                        .and_then(|s| s.virtual_host_domain.as_deref())
                        .and_then(|d| crate::route::host_of(d).ok())
                        .is_some_and(|d| strip_domain(host, d).is_some())
            }
        };
        if !takes {
            continue;
        }
        if r.errors != Dialect::S3 {
            return Dialect::Problem;
        }
        if r.s3().is_some() {
            // It takes every path of its host: no route after it could.
            s3_route = true;
            break;
        }
    }
    if s3_route {
        Dialect::S3
    } else {
        Dialect::Problem
    }
}

/// `host` without `.{domain}` (ASCII case ignored), if that leaves a non-empty label.
fn strip_domain<'h>(host: &'h str, domain: &str) -> Option<&'h str> {
    let cut = host.len().checked_sub(domain.len() + 1)?;
    let (bucket, rest) = (host.get(..cut)?, host.get(cut..)?);
    (!bucket.is_empty() && rest.starts_with('.') && rest[1..].eq_ignore_ascii_case(domain))
        .then_some(bucket)
}

/// The scope of `key` in `bucket` under an S3 route's object scope template, for a key
/// named outside the path (a DeleteObjects body, an upload form). The key is split at `/`
/// as a path is, with the rules of a path's decoded segments (SPEC §2): no empty, `.` or
/// `..` segment, no `\`, NUL or control character; one trailing `/` is dropped, as a
/// path's is. So a key named in a body and the same key named in a path render one scope.
pub fn object_scope(
    template: &ScopeTemplate,
    bucket: &str,
    key: &str,
    keys: Keys,
) -> Result<String, ObjectKeyError> {
    if keys == Keys::Opaque {
        if key.is_empty() || key.chars().any(char::is_control) {
            return Err(ObjectKeyError::Opaque(key.to_owned()));
        }
        return Ok(template.render(&[Capture::One(bucket), Capture::Rest(&[Cow::Borrowed(key)])]));
    }
    let trimmed = key.strip_suffix('/').unwrap_or(key);
    if trimmed.is_empty() {
        return Err(ObjectKeyError::Empty);
    }
    let mut segments = Segments::new();
    for s in trimmed.split('/') {
        crate::route::check_decoded(s).map_err(|source| ObjectKeyError::Segment {
            key: key.to_owned(),
            source,
        })?;
        segments.push(Cow::Borrowed(s));
    }
    Ok(template.render(&[Capture::One(bucket), Capture::Rest(&segments)]))
}

/// Why a key named outside the path has no scope.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ObjectKeyError {
    /// On a route with opaque keys: the key as sent.
    #[error("the key `{}`: empty, or with a control character", .0.escape_debug())]
    Opaque(String),
    #[error("an empty key")]
    Empty,
    /// A segment no path may have (SPEC §2).
    #[error("the key `{key}`: {source}")]
    Segment {
        key: String,
        source: crate::route::PathError,
    },
}

/// The one scope of every key of a request, or a `multi_scope` refusal naming two.
pub fn one_scope<'k>(
    template: &ScopeTemplate,
    bucket: &str,
    names: impl IntoIterator<Item = &'k str>,
    keys: Keys,
) -> Result<String, Refused> {
    let mut scope: Option<String> = None;
    for key in names {
        let s = object_scope(template, bucket, key, keys)
            .map_err(|e| Refused::Malformed(e.to_string()))?;
        match &scope {
            None => scope = Some(s),
            Some(first) if *first == s => {}
            Some(first) => {
                return Err(Refused::MultiScope(format!(
                    "the request names objects of two scopes ({first} and {s}); a token is for one lock"
                )));
            }
        }
    }
    scope.ok_or_else(|| Refused::Malformed("the request names no object".into()))
}

/// Why a request's objects could not be given one scope.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// The body is not what S3 takes (answered as S3 would, 400).
    Malformed(String),
    /// Objects of more than one scope (400 `multi_scope`).
    MultiScope(String),
}

/// Reads the keys a [`Operation::DeleteObjects`] or [`Operation::PostForm`] names in its
/// body (at most `max_body` bytes of a DeleteObjects), and the body to forward: the bytes
/// read, then the rest. An error says why the body is not what S3 takes.
pub async fn read_named<B>(
    op: Operation,
    headers: &HeaderMap,
    body: B,
    max_body: Option<u64>,
) -> (Result<Vec<String>, NamedError>, form::Replay<B>)
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    if op == Operation::PostForm {
        // One Content-Type: a server could read the boundary of another.
        let mut types = headers.get_all(header::CONTENT_TYPE).iter();
        let content_type = match (types.next(), types.next()) {
            (one, None) => one,
            _ => {
                let refused = Err(form::FormError::ContentTypes.into());
                return (refused, form::Replay::new(Vec::new(), Some(Box::pin(body))));
            }
        };
        let (keys, replay) = form::read_key(content_type, body).await;
        return (keys.map_err(NamedError::Form), replay);
    }
    let limit = max_body.map_or(delete::MAX_BYTES, |m| {
        usize::try_from(m).map_or(delete::MAX_BYTES, |m| m.min(delete::MAX_BYTES))
    });
    let (keys, replay) = delete::read(body, limit).await;
    (keys.map_err(NamedError::Delete), replay)
}

/// Why a body that names objects is not what S3 takes (the refusal's detail).
#[derive(Debug, thiserror::Error)]
pub enum NamedError {
    #[error(transparent)]
    Form(#[from] form::FormError),
    #[error(transparent)]
    Delete(delete::DeleteError),
}

/// S3's error code for a body of `op` that is not what S3 takes.
pub fn malformed_code(op: Operation) -> &'static str {
    match op {
        Operation::PostForm => "MalformedPOSTRequest",
        _ => "MalformedXML",
    }
}

/// Is `value` a `multipart/form-data` media type (parameters aside)?
pub fn is_form_data(value: Option<&HeaderValue>) -> bool {
    value
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("multipart/form-data"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::PathTemplate;

    fn template(s: &str) -> ScopeTemplate {
        let path = PathTemplate::parse("/{bucket}/{*key}").expect("path");
        ScopeTemplate::parse(s, &path).expect("scope")
    }

    #[test]
    fn operations() {
        let op = |m: Method, q: Option<&str>, n| operation(&m, q, n, false).expect("operation");
        assert_eq!(op(Method::PUT, None, 2), Operation::Object);
        assert_eq!(op(Method::POST, Some("uploads"), 2), Operation::Object);
        assert_eq!(
            op(Method::POST, Some("uploadId=x&x-id=Complete"), 2),
            Operation::Object
        );
        assert_eq!(op(Method::POST, Some("restore"), 2), Operation::Object);
        for q in [
            None,
            Some("delete"),
            Some("uploads&delete"),
            Some("x-id=PutObject"),
        ] {
            assert!(operation(&Method::POST, q, 2, false).is_err(), "{q:?}");
        }
        assert_eq!(op(Method::GET, None, 0), Operation::Service);
        assert_eq!(op(Method::PUT, Some("lifecycle"), 1), Operation::Bucket);
        assert_eq!(op(Method::DELETE, None, 1), Operation::Bucket);
        assert_eq!(
            op(Method::POST, Some("delete"), 1),
            Operation::DeleteObjects
        );
        assert_eq!(
            op(Method::POST, Some("delete="), 1),
            Operation::DeleteObjects
        );
        assert_eq!(
            op(Method::POST, Some("x-id=DeleteObjects&delete"), 1),
            Operation::DeleteObjects
        );
        assert_eq!(
            op(Method::POST, Some("%64elete"), 1),
            Operation::DeleteObjects
        );
        assert_eq!(
            op(Method::POST, Some("DELETE"), 1),
            Operation::DeleteObjects
        );
        assert_eq!(op(Method::POST, None, 1), Operation::PostForm);
        assert_eq!(op(Method::POST, Some(""), 1), Operation::PostForm);
        assert_eq!(op(Method::POST, Some("policy"), 1), Operation::Bucket);
        assert!(operation(&Method::POST, Some("%ff"), 1, false).is_err());
        for (q, n) in [
            (Some("x"), 1),
            (Some("uploads"), 2),
            (None, 2),
            (Some("delete"), 1),
        ] {
            assert_eq!(
                operation(&Method::POST, q, n, true),
                Ok(Operation::PostForm),
                "{q:?}"
            );
        }
        assert_eq!(
            operation(&Method::PUT, None, 2, true),
            Ok(Operation::Object)
        );
    }

    /// A finding of the object-identity oracle: `DELETE /bkt?versionId=1` was fenced as
    /// a request on the bucket's settings, while s3s reads it as a DeleteBucket and
    /// s3s-fs removes the bucket's objects with it.
    #[test]
    fn a_delete_on_the_bucket_is_a_delete_bucket_but_for_a_sub_resource() {
        for q in [
            None,
            Some(""),
            Some("x-id=DeleteBucket"),
            Some("versionId=1"),
            Some("delete"),
            Some("Tagging"),
            Some("%74agging"),
            Some("tagging%3D"),
            Some("uploads"),
        ] {
            assert!(deletes_bucket(&Method::DELETE, q), "{q:?}");
        }
        for q in [
            "tagging",
            "tagging=",
            "x-id=DeleteBucketTagging&tagging",
            "policy",
            "cors",
            "lifecycle",
            "website",
            "publicAccessBlock",
        ] {
            assert!(!deletes_bucket(&Method::DELETE, Some(q)), "{q}");
        }
        assert!(!deletes_bucket(&Method::PUT, None));
    }

    #[test]
    fn virtual_hosts_strip_their_domain() {
        assert_eq!(
            strip_domain("bkt.s3.example.com", "s3.example.com"),
            Some("bkt")
        );
        assert_eq!(
            strip_domain("a.b.S3.Example.com", "s3.example.com"),
            Some("a.b")
        );
        assert_eq!(strip_domain("s3.example.com", "s3.example.com"), None);
        assert_eq!(strip_domain(".s3.example.com", "s3.example.com"), None);
        assert_eq!(strip_domain("bkts3.example.com", "s3.example.com"), None);
        assert_eq!(
            strip_domain("bkt.s3.example.com.evil", "s3.example.com"),
            None
        );
    }

    #[test]
    fn keys_named_in_a_body_render_as_paths_do() {
        let t = template("object/{bucket}/{key}");
        assert_eq!(
            object_scope(&t, "b", "a/b.csv", Keys::Strict).as_deref(),
            Ok("object/b/a/b.csv")
        );
        assert_eq!(
            object_scope(&t, "b", "dir/", Keys::Strict).as_deref(),
            Ok("object/b/dir")
        );
        assert_eq!(
            object_scope(&t, "b", "a;b %", Keys::Strict).as_deref(),
            Ok("object/b/a;b %")
        );
        for bad in [
            "", "/", "a//b", "/a", "a/./b", "..", "a\\b", "a\u{0}b", "a\nb", "a//",
        ] {
            assert!(object_scope(&t, "b", bad, Keys::Strict).is_err(), "{bad:?}");
        }
        let coarse = template("report/{bucket}");
        assert_eq!(
            one_scope(&coarse, "b", ["x", "y/z"], Keys::Strict).as_deref(),
            Ok("report/b")
        );
        assert!(matches!(
            one_scope(&t, "b", ["x", "y"], Keys::Strict),
            Err(Refused::MultiScope(_))
        ));
        assert!(matches!(
            one_scope(&t, "b", [], Keys::Strict),
            Err(Refused::Malformed(_))
        ));
    }

    #[test]
    fn opaque_keys_are_read_whole() {
        let t = template("object/{bucket}/{key}");
        for (key, scope) in [
            ("a//b", "object/b/a//b"),
            ("a/./b", "object/b/a/./b"),
            ("a\\b", "object/b/a\\b"),
            ("dir/", "object/b/dir/"),
            ("/lead", "object/b//lead"),
        ] {
            assert_eq!(
                object_scope(&t, "b", key, Keys::Opaque).as_deref(),
                Ok(scope),
                "{key}"
            );
        }
        assert!(object_scope(&t, "b", "", Keys::Opaque).is_err());
        assert!(object_scope(&t, "b", "a\nb", Keys::Opaque).is_err());
        let seg = |p, b, k| {
            segments(p, b, k).map(|s| s.iter().map(|c| c.to_string()).collect::<Vec<_>>())
        };
        assert_eq!(
            seg("/bkt/a//b", None, Keys::Opaque),
            Ok(vec!["bkt".into(), "a//b".into()])
        );
        assert_eq!(
            seg("/bkt/a%2Fb%5C", None, Keys::Opaque),
            Ok(vec!["bkt".into(), "a/b\\".into()])
        );
        assert_eq!(seg("/bkt/", None, Keys::Opaque), Ok(vec!["bkt".into()]));
        assert_eq!(seg("/", None, Keys::Opaque), Ok(vec![]));
        assert_eq!(
            seg("//a", Some("bkt"), Keys::Opaque),
            Ok(vec!["bkt".into(), "/a".into()])
        );
        assert_eq!(seg("/", Some("bkt"), Keys::Opaque), Ok(vec!["bkt".into()]));
        assert_eq!(
            seg("/a/b/", Some("bkt"), Keys::Strict),
            Ok(vec!["bkt".into(), "a".into(), "b".into()])
        );
        for bad in [
            "//a",
            "/b%2Fx/k",
            "/bkt/a%zz",
            "/bkt/a%0A",
            "/bkt/%ff",
            "/../k",
        ] {
            assert!(seg(bad, None, Keys::Opaque).is_err(), "{bad}");
        }
        // One key, two spellings: one scope.
        assert_eq!(
            seg("/bkt/a/b", None, Keys::Opaque),
            seg("/bkt/a%2Fb", None, Keys::Opaque)
        );
    }

    #[test]
    fn form_data_types() {
        let v = |s: &'static str| HeaderValue::from_static(s);
        assert!(is_form_data(Some(&v("multipart/form-data; boundary=x"))));
        assert!(is_form_data(Some(&v("Multipart/Form-Data"))));
        assert!(!is_form_data(Some(&v("multipart/mixed; boundary=x"))));
        assert!(!is_form_data(None));
    }
}
