//! Classification: everything the fence decides from the request's head alone, before the
//! gate. The path is canonicalized and routed, the token, scope, proof and sequence headers
//! are read (one each; aliases that a backend could read instead are refused), and what
//! would let a fenced write pass as something else is refused (method overrides, WebDAV
//! `Destination` into another scope, retargeting headers, `Upgrade`).

use http::{HeaderValue, Method, Request, header};

use super::Settings;
use super::config::{ProofMode, Route, S3Api, SequenceMode};
use super::s3::{self, Operation};
use super::{Outcome, Plan};
use crate::metrics::Op;
use crate::route;
use crate::token::Token;

/// Headers that ask a backend to treat a request as another method: each would let a
/// fenced write travel as an unfenced GET.
static METHOD_OVERRIDES: [http::HeaderName; 3] = [
    http::HeaderName::from_static("x-http-method-override"),
    http::HeaderName::from_static("x-http-method"),
    http::HeaderName::from_static("x-method-override"),
];

/// Headers with which some backends act on another path than the request's (IIS URL
/// Rewrite, older Symfony and Zend): that path was never routed nor fenced.
static RETARGETS: [http::HeaderName; 2] = [
    http::HeaderName::from_static("x-original-url"),
    http::HeaderName::from_static("x-rewrite-url"),
];

/// Where a request's WebDAV `Destination` (COPY, MOVE) points, routed like a request.
#[derive(Debug, PartialEq)]
enum Destination {
    /// No `Destination` header.
    None,
    /// A pass-through route's path.
    Unfenced,
    /// A fenced route's path, in this scope.
    Scope(String),
    /// A collection above the objects of an `api = "webdav"` route with one scope per
    /// object (named): overwriting it replaces them.
    AboveTree(String),
}

/// The fenced `api = "webdav"` route (of `upstream`) whose objects all lie beneath the
/// collection `segments` names, if there is one: `/files` holds every object of
/// `/files/{*path}`, and `/trees/a` every one of `/trees/{top}/{*rest}`'s scope `tree/a`,
/// and no request on them is routed there. A DELETE, MOVE
/// or COPY of it (or a COPY or MOVE onto it) would change those objects without their
/// tokens and without the route's check of its collections (SPEC §16). Hosts are not
/// compared: a WebDAV server may serve one tree under every name.
///
/// With it comes the one scope every object beneath is in, when there is one: a route with
/// one scope per tree (`tree/{top}`) whose captures the collection's path already gives.
/// A request fenced on that very scope, with its token, changes that tree's objects as
/// any of its requests may.
fn tree_above<'r>(
    config: &'r Settings,
    upstream: usize,
    segments: &[std::borrow::Cow<'_, str>],
) -> Option<(&'r Route, Option<String>)> {
    config.routes.iter().find_map(|r| {
        if r.upstream != upstream || !r.fenced || r.api != crate::proxy::config::Api::Webdav {
            return None;
        }
        let caps = r.path.matches_prefix(segments)?;
        let one = r
            .scope
            .uses_captures_below(caps.len())
            .then(|| r.scope.render(&caps));
        Some((r, one))
    })
}

/// Why a request's `Destination` (or a header naming a second target) is refused (its
/// text is the refusal's detail).
#[derive(Debug, thiserror::Error)]
enum DestinationError {
    #[error("{0} would make the backend act on a target that was not routed")]
    Retarget(&'static http::HeaderName),
    #[error("more than one Destination header")]
    Many,
    #[error("Destination is not ASCII")]
    NotAscii,
    #[error("Destination has a `#`: servers differ on whether it ends the path")]
    Fragment,
    #[error("Destination has a query: servers differ on whether it is part of the name")]
    Query,
    #[error(
        "Destination has an escaped `#`, `?` or `;` (%23, %3F, %3B): a server that decodes it before splitting it reads another path"
    )]
    EscapedDelimiter,
    #[error("Destination is not a URI: {0}")]
    NotAUri(#[source] http::uri::InvalidUri),
    #[error("Destination has the scheme {0}")]
    Scheme(String),
    #[error("Destination's host is not valid: {0}")]
    BadHost(&'static str),
    #[error("Destination names another host than the request")]
    OtherHost,
    #[error("Destination has no absolute path")]
    NoAbsolutePath,
    #[error("Destination: {0}")]
    Path(#[source] route::PathError),
    #[error("Destination matches no route")]
    NoRoute,
    #[error("Destination is on a route of another upstream")]
    OtherUpstream,
}

/// The target named by a request's `Destination` header, routed with the request's host
/// (a backend such as nginx's WebDAV module writes the destination's path on the server
/// the request reached, whatever host the header names, so another host is refused), on
/// a route of the request's own upstream (`upstream`). `X-Original-URL` and
/// `X-Rewrite-URL` are refused outright on every route. Called only when [`HeadScan`]
/// saw one of these names.
///
/// The header is read as every backend might read it (SPEC §16): a raw `#` (which
/// `http::Uri` would drop, and wsgidav keeps), a query, or an escaped `#`, `?` or `;`
/// (servers such as wsgidav decode the header before they split it, so `%3F` would end
/// the name there) is refused.
fn destination<B>(
    config: &Settings,
    req: &Request<B>,
    host: Option<&str>,
    upstream: usize,
    seen: Seen<'_>,
) -> Result<Destination, DestinationError> {
    if let Some(h) = RETARGETS.iter().find(|h| req.headers().contains_key(*h)) {
        return Err(DestinationError::Retarget(h));
    }
    let value = match seen {
        Seen::None => return Ok(Destination::None),
        Seen::Many => return Err(DestinationError::Many),
        Seen::One(v) => v.to_str().map_err(|_| DestinationError::NotAscii)?,
    };
    if value.contains('#') {
        return Err(DestinationError::Fragment);
    }
    if value.contains('?') {
        return Err(DestinationError::Query);
    }
    if ["%23", "%3f", "%3b"].iter().any(|e| {
        value
            .as_bytes()
            .windows(3)
            .any(|w| w.eq_ignore_ascii_case(e.as_bytes()))
    }) {
        return Err(DestinationError::EscapedDelimiter);
    }
    let uri: http::Uri = value.parse().map_err(DestinationError::NotAUri)?;
    if let Some(scheme) = uri.scheme_str()
        && !scheme.eq_ignore_ascii_case("http")
        && !scheme.eq_ignore_ascii_case("https")
    {
        return Err(DestinationError::Scheme(scheme.to_string()));
    }
    if let Some(authority) = uri.authority() {
        let named = route::host_of(authority.as_str()).map_err(DestinationError::BadHost)?;
        if host.is_some_and(|h| !h.eq_ignore_ascii_case(named)) {
            return Err(DestinationError::OtherHost);
        }
    }
    // `path()` of a bare `?x` would read as `/`: the path must be spelled out.
    if !uri
        .path_and_query()
        .is_some_and(|p| p.as_str().starts_with('/'))
    {
        return Err(DestinationError::NoAbsolutePath);
    }
    let segments = route::canonicalize(uri.path()).map_err(DestinationError::Path)?;
    if let Some((r, one)) = tree_above(config, upstream, &segments) {
        return Ok(match one {
            // Writing onto it writes objects of that one scope.
            Some(scope) => Destination::Scope(scope),
            None => Destination::AboveTree(r.name.clone()),
        });
    }
    match route::find(&config.routes, host, &segments) {
        None => Err(DestinationError::NoRoute),
        Some((_, r, _)) if r.upstream != upstream => Err(DestinationError::OtherUpstream),
        Some((_, r, _)) if !r.fenced => Ok(Destination::Unfenced),
        Some((_, r, caps)) => Ok(Destination::Scope(r.scope.render(&caps))),
    }
}

/// A refusal of [`classify`]: the route it was on (when it got that far) and why.
type Refusal = (Option<usize>, Outcome);

/// [`check`](super::check) up to the gate: routes the request, refuses what is unsafe, and
/// says what a fenced request asks the gate for. The questions in order: is the target in
/// origin form, which route, does it write a tree of another route's objects, is the route
/// fenced, and (on an S3 route) which operation it is.
pub(crate) fn classify<B>(config: &Settings, req: &Request<B>) -> Result<Classified, Refusal> {
    refuse_target(req).map_err(|o| (None, o))?;
    let head = HeadScan::of(req.headers(), &config.fencing.header);
    let (host, segments) = routed_path(config, req, &head)?;
    let (idx, route, caps) =
        route::find(&config.routes, host, &segments).ok_or((None, Outcome::NoRoute))?;
    let at = |o: Outcome| (Some(idx), o);
    if let Some(limit) = route.max_body
        && content_length(req).is_some_and(|len| len > limit)
    {
        return Err(at(Outcome::PayloadTooLarge { limit }));
    }
    // A COPY or MOVE writes its Destination too: that target must be fenced by this
    // request's own scope, or be a pass-through route's.
    let destination = if head.retarget {
        destination(config, req, host, route.upstream, head.destination).map_err(|e| {
            at(Outcome::InvalidRequest {
                detail: e.to_string(),
            })
        })?
    } else {
        Destination::None
    };
    refuse_tree_change(
        config,
        req.method(),
        (route, &caps),
        &segments,
        &destination,
    )
    .map_err(at)?;
    if !route.fenced {
        if let Destination::Scope(theirs) = &destination {
            return Err(at(Outcome::InvalidRequest {
                detail: format!(
                    "Destination is in the fenced scope {theirs}; an unfenced request cannot write it"
                ),
            }));
        }
        return passing_upload(config, route, req)
            .map(|id| match id {
                None => unfenced(idx, req.method()),
                Some(id) => Classified::PassUpload {
                    plan: unfenced_plan(idx, req.method()),
                    id,
                },
            })
            .map_err(at);
    }
    if head.suspect {
        refuse_unfenceable(req).map_err(|e| {
            at(Outcome::InvalidRequest {
                detail: e.to_string(),
            })
        })?;
    }
    let scope = match route.s3() {
        None => route.scope.render(&caps),
        Some(api) => match s3_scope(config, req, &head, (idx, route, &caps), api, &destination)? {
            S3Scope::Scope(scope) => scope,
            S3Scope::Decided(classified) => return Ok(classified),
        },
    };
    decide(
        config,
        req.method(),
        &head,
        (idx, route),
        scope,
        &destination,
    )
}

/// CONNECT, and a request target not in origin form, are refused before any header is
/// read.
#[inline]
fn refuse_target<B>(req: &Request<B>) -> Result<(), Outcome> {
    if req.method() == Method::CONNECT {
        return Err(Outcome::MethodNotAllowed);
    }
    // h2 always carries scheme and authority; in HTTP/1.x they mean absolute form. An
    // h2 `:path` must begin with `/` too: `?x` would be routed as `/` and forwarded as
    // `?x`, another target than the one classified.
    if (req.version() < http::Version::HTTP_2 && req.uri().scheme().is_some())
        || !req
            .uri()
            .path_and_query()
            .is_some_and(|p| p.as_str().starts_with('/'))
    {
        return Err(Outcome::InvalidPath {
            detail: "the request target is not in origin form".into(),
        });
    }
    Ok(())
}

/// The host and the canonical segments a request is routed on: its own host and path, or
/// on an S3 route's host, the route's endpoint and the bucket the Host names in front of
/// the path.
#[inline]
fn routed_path<'a, B>(
    config: &'a Settings,
    req: &'a Request<B>,
    head: &HeadScan<'a>,
) -> Result<(Option<&'a str>, route::Segments<'a>), Refusal> {
    if let Some(name) = head.alias {
        return Err((
            None,
            Outcome::InvalidRequest {
                detail: format!(
                    "header {name}: a name with `_` that backends may read as one with `-`"
                ),
            },
        ));
    }
    let host = request_host(req, head.host).map_err(|e| {
        (
            None,
            Outcome::InvalidRequest {
                detail: e.to_string(),
            },
        )
    })?;
    // An S3 route's host (SPEC §15): the bucket a virtual-hosted request names in its
    // Host goes in front of the path, so that it is routed as its path-style twin and
    // both render one scope; on `keys = "opaque"` the key is read whole.
    let raw_host = match head.host {
        Seen::One(v) => v.to_str().ok(),
        _ => req.uri().authority().map(http::uri::Authority::as_str),
    };
    let on_s3 = match host
        .zip(raw_host)
        .map(|(h, raw)| s3::for_host(&config.routes, h, raw))
    {
        Some(Err(e)) => {
            return Err((
                None,
                Outcome::InvalidRequest {
                    detail: e.to_string(),
                },
            ));
        }
        Some(Ok(found)) => found,
        None => None,
    };
    let bad_path = |e: route::PathError| {
        (
            None,
            Outcome::InvalidPath {
                detail: e.to_string(),
            },
        )
    };
    Ok(match on_s3 {
        None => (
            host,
            route::canonicalize(req.uri().path()).map_err(bad_path)?,
        ),
        Some(s) => (
            Some(s.endpoint),
            s3::segments(req.uri().path(), s.bucket, s.keys).map_err(bad_path)?,
        ),
    })
}

/// A request that would change the fenced objects of an `api = "webdav"` route's tree
/// without their tokens (SPEC §16): a Destination onto a collection above them, or a
/// method that may change a collection's members on one that holds them.
#[inline]
fn refuse_tree_change(
    config: &Settings,
    method: &Method,
    (route, caps): (&Route, &[route::Capture<'_>]),
    segments: &[std::borrow::Cow<'_, str>],
    destination: &Destination,
) -> Result<(), Outcome> {
    if let Destination::AboveTree(name) = destination {
        return Err(Outcome::MultiScope {
            detail: format!(
                "Destination is a collection that holds the fenced objects of route {name}: this request would change them"
            ),
        });
    }
    if !changes_one(method)
        && let Some((r, one)) = tree_above(config, route.upstream, segments)
        // The tree's one scope, and this request fenced on it: decided below as any.
        && !(route.fenced
            && route.s3().is_none()
            && one.is_some_and(|s| s == route.scope.render(caps)))
    {
        return Err(Outcome::MultiScope {
            detail: format!(
                "this request may change a collection that holds the fenced objects of route {}, without their tokens",
                r.name
            ),
        });
    }
    Ok(())
}

/// What [`s3_scope`] found: the scope to fence an S3 request on, or the whole answer.
enum S3Scope {
    Scope(String),
    Decided(Classified),
}

/// The scope of a request on a fenced S3 route, by its operation (SPEC §15): an object's
/// is the route's scope, a bucket's the route's `bucket_scope`; a request that names its
/// objects in its body is [`Named`], and what has no scope to fence passes only as a read
/// without a token.
fn s3_scope<B>(
    config: &Settings,
    req: &Request<B>,
    head: &HeadScan<'_>,
    (idx, route, caps): (usize, &Route, &[route::Capture<'_>]),
    api: &S3Api,
    destination: &Destination,
) -> Result<S3Scope, Refusal> {
    let at = |o: Outcome| (Some(idx), o);
    // One Content-Type: a server could read another of two (a form's, say).
    let mut types = req.headers().get_all(header::CONTENT_TYPE).iter();
    let content_type = types.next();
    if types.next().is_some() {
        return Err(at(Outcome::InvalidRequest {
            detail: "more than one Content-Type".into(),
        }));
    }
    let form = s3::is_form_data(content_type);
    let op = s3::operation(req.method(), req.uri().query(), caps.len(), form).map_err(|e| {
        at(Outcome::InvalidRequest {
            detail: e.to_string(),
        })
    })?;
    if let Some(h) = s3::SECOND_OBJECT
        .iter()
        .find(|h| req.headers().contains_key(**h))
    {
        return Err(at(Outcome::InvalidRequest {
            detail: format!("{h} names a second object that this request would change"),
        }));
    }
    // What has no scope to fence may pass only as a read without a token.
    let read = !route.fences_method(req.method()) && matches!(head.token, Seen::None);
    let unfenceable = |detail: &str| {
        at(Outcome::UnfencedOperation {
            detail: detail.into(),
        })
    };
    let decide_with = |scope: String, upload: Option<s3::upload::Upload>| {
        decide(config, req.method(), head, (idx, route), scope, destination)
            .map(|decided| S3Scope::Decided(decided.with_upload(upload)))
    };
    match op {
        Operation::Object => {
            let upload = s3::upload_of(req.method(), req.uri().query()).map_err(|e| {
                at(Outcome::InvalidRequest {
                    detail: e.to_string(),
                })
            })?;
            decide_with(route.scope.render(caps), upload)
        }
        Operation::Bucket => match &api.bucket_scope {
            Some(t) if s3::deletes_bucket(req.method(), req.uri().query()) => {
                let deletes = s3::bucket_objects(&route.scope, caps).ok_or_else(|| {
                    unfenceable(
                        "a DeleteBucket, and this route's scope uses the key where its marks cannot be found by prefix",
                    )
                })?;
                decide_with(t.render(caps), Some(deletes))
            }
            Some(t) => Ok(S3Scope::Scope(t.render(caps))),
            None if read => Ok(S3Scope::Decided(unfenced(idx, req.method()))),
            None => Err(unfenceable(
                "a request on the bucket itself, and this route has no bucket_scope",
            )),
        },
        Operation::Service if read => Ok(S3Scope::Decided(unfenced(idx, req.method()))),
        Operation::Service => Err(unfenceable(
            "a request on the service (`/`), not on a bucket",
        )),
        Operation::DeleteObjects | Operation::PostForm => {
            if *destination != Destination::None {
                return Err(at(Outcome::InvalidRequest {
                    detail: "a Destination on an S3 request".into(),
                }));
            }
            let bucket = match caps.first() {
                Some(route::Capture::One(b)) => (*b).to_string(),
                _ => return Err(unfenceable("a bucket's request without its bucket")),
            };
            // A form posted to an object's path names that key too, to a server that
            // reads the path.
            let path_key = match caps.get(1) {
                Some(route::Capture::Rest(segs)) => Some(segs.join("/")),
                Some(route::Capture::One(k)) => Some((*k).to_string()),
                None => None,
            };
            Ok(S3Scope::Decided(Classified::Named(Named {
                route: idx,
                op,
                bucket,
                path_key,
            })))
        }
    }
}

/// A request whose objects are named in its body (SPEC §15), once the fence has read
/// them: `scope` is theirs. Decided as any fenced request of its route.
pub(crate) fn named(
    config: &Settings,
    parts: &http::request::Parts,
    idx: usize,
    scope: String,
) -> Result<Classified, Refusal> {
    let head = HeadScan::of(&parts.headers, &config.fencing.header);
    let route = config.routes.get(idx).ok_or((None, Outcome::NoRoute))?;
    decide(
        config,
        &parts.method,
        &head,
        (idx, route),
        scope,
        &Destination::None,
    )
}

/// The token, sequence, scope and proof checks of a fenced request whose scope is known.
fn decide(
    config: &Settings,
    method: &Method,
    head: &HeadScan<'_>,
    (idx, route): (usize, &Route),
    scope: String,
    destination: &Destination,
) -> Result<Classified, Refusal> {
    let at = |o: Outcome| (Some(idx), o);
    // Source and destination in two scopes: one request, objects of two locks (SPEC §16,
    // the one-scope rule of §15). An unfenced request naming a fenced target is malformed.
    let into_other = |theirs: &str, ours: Option<&str>| {
        at(match ours {
            Some(ours) => Outcome::MultiScope {
                detail: format!(
                    "Destination is in scope {theirs}, another than the request's ({ours})"
                ),
            },
            None => Outcome::InvalidRequest {
                detail: format!(
                    "Destination is in the fenced scope {theirs}; an unfenced request cannot write it"
                ),
            },
        })
    };
    let token = match read_token(head.token, &config.fencing.header) {
        Ok(Some(t)) => t,
        Ok(None) if route.fences_method(method) => {
            return Err(at(Outcome::MissingToken { scope }));
        }
        // A safe method without a token is not fenced, nor may it write a fenced
        // Destination.
        Ok(None) => {
            return match destination {
                Destination::Scope(theirs) if *theirs == scope => {
                    Err(at(Outcome::MissingToken { scope }))
                }
                Destination::Scope(theirs) => Err(into_other(theirs, None)),
                _ => Ok(unfenced(idx, method)),
            };
        }
        Err(e) => {
            let detail = e.to_string();
            return Err(at(Outcome::InvalidToken { scope, detail }));
        }
    };
    let sequence = match (read_sequence(head.sequence), route.sequence) {
        (Ok(None), SequenceMode::Required) => {
            return Err(at(Outcome::InvalidToken {
                scope,
                detail: "this route requires a Fencing-Sequence header".into(),
            }));
        }
        (Ok(sequence), _) => sequence,
        (Err(e), _) => {
            let detail = e.to_string();
            return Err(at(Outcome::InvalidToken { scope, detail }));
        }
    };
    // An admitted scope is kept in memory while hot and as a mark for good: its length
    // is bounded (a path may be up to the head's size).
    if scope.len() > config.fencing.max_scope_bytes {
        return Err(at(Outcome::InvalidPath {
            detail: format!(
                "the path's scope would be {} bytes, more than fencing.max_scope_bytes ({})",
                scope.len(),
                config.fencing.max_scope_bytes
            ),
        }));
    }
    check_scope_header(head.scope, &scope).map_err(|_| {
        at(Outcome::ScopeMismatch {
            scope: scope.clone(),
            token,
        })
    })?;
    if let Destination::Scope(theirs) = destination
        && *theirs != scope
    {
        return Err(into_other(theirs, Some(&scope)));
    }
    // The proof is verified at the gate (which remembers what it verified); here only
    // whether there is exactly one.
    let proof = match (route.proof, head.proof) {
        (ProofMode::Off, _) => None,
        (ProofMode::Required, Seen::One(v)) => Some(v.clone()),
        (ProofMode::Required, seen) => {
            return Err(at(Outcome::InvalidProof {
                scope,
                token,
                detail: match seen {
                    Seen::Many => "more than one Fencing-Proof header".into(),
                    _ => "no Fencing-Proof header".into(),
                },
            }));
        }
    };
    Ok(Classified::Fenced(Fenced {
        route: idx,
        equal: route.equal,
        scope,
        token,
        sequence,
        proof,
        upload: None,
        tree: route.fences_trees() && !changes_one(method),
    }))
}

/// Methods that change at most the one resource their path names on a WebDAV server
/// (RFC 4918, 3253, 5323, 5789), matched without regard to case (some servers upper-case
/// methods). Every other method (DELETE, MOVE, COPY, and any this list does not know) may
/// change a collection's members whole (SPEC §16). A LOCK of depth infinity locks the
/// members, which refuses writes without its lock token, but changes none of them.
fn changes_one(method: &Method) -> bool {
    const ONE: [&str; 14] = [
        "GET",
        "HEAD",
        "OPTIONS",
        "TRACE",
        "PUT",
        "POST",
        "PATCH",
        "MKCOL",
        "PROPFIND",
        "PROPPATCH",
        "LOCK",
        "UNLOCK",
        "REPORT",
        "SEARCH",
    ];
    ONE.iter().any(|m| m.eq_ignore_ascii_case(method.as_str()))
}

/// A request forwarded as it is, on route `idx`.
fn unfenced(idx: usize, method: &Method) -> Classified {
    Classified::Unfenced(unfenced_plan(idx, method))
}

fn unfenced_plan(idx: usize, method: &Method) -> Plan {
    Plan {
        route: idx,
        op: Op::of(method),
        guard: None,
        scope: None,
        token: None,
        hop: None,
        stop: None,
        record_upload: false,
    }
}

/// What [`classify`] found: a request to forward as it is, one for the gate, or one
/// whose objects are named in its body, which the fence reads first.
pub(crate) enum Classified {
    Unfenced(Plan),
    Fenced(Fenced),
    Named(Named),
    /// An unfenced request naming an S3 upload id on an upstream that an S3 route fences:
    /// a server that keys uploads by id alone (s3s-fs) would let it change a fenced
    /// object's upload, so it is forwarded only if no fenced scope recorded that id
    /// (SPEC §15).
    PassUpload {
        plan: Plan,
        id: String,
    },
}

/// The upload id an unfenced request names, when an S3 route fences anything (`None`
/// otherwise, and for most requests: no query). Upload ids are looked up whatever the
/// route's upstream: two upstream entries (or two names) may be one server. A query the
/// fence cannot read as a server would is refused on a route whose upstream an S3 route
/// fences, and passed elsewhere (it names no upload a server could find).
fn passing_upload<B>(
    config: &Settings,
    route: &crate::proxy::config::Route,
    req: &Request<B>,
) -> Result<Option<String>, Outcome> {
    let Some(query) = req.uri().query() else {
        return Ok(None);
    };
    let s3_routes = || {
        config
            .routes
            .iter()
            .filter(|r| r.fenced && r.s3().is_some())
    };
    if s3_routes().next().is_none() {
        return Ok(None);
    }
    match s3::upload_of(req.method(), Some(query)) {
        Ok(Some(s3::upload::Upload::Uses(id))) => Ok(Some(id)),
        Ok(_) => Ok(None),
        Err(e) if s3_routes().any(|r| r.upstream == route.upstream) => {
            Err(Outcome::InvalidRequest {
                detail: e.to_string(),
            })
        }
        Err(_) => Ok(None),
    }
}

impl Classified {
    /// A fenced request with what it does with S3 uploads (and buckets) for the check.
    fn with_upload(mut self, upload: Option<s3::upload::Upload>) -> Classified {
        if let Classified::Fenced(f) = &mut self {
            f.upload = upload;
        }
        self
    }
}

/// An S3 request that names its objects in its body (DeleteObjects, a form upload): its
/// scope is known once the fence has read them (see [`named`]).
pub(crate) struct Named {
    pub(crate) route: usize,
    pub(crate) op: Operation,
    /// The bucket, from the path or the Host.
    pub(crate) bucket: String,
    /// The key of the path, when it names one (a form posted to an object's path).
    pub(crate) path_key: Option<String>,
}

/// A fenced request on its way to the gate.
pub(crate) struct Fenced {
    pub(super) route: usize,
    pub(super) equal: crate::fence::policy::EqualPolicy,
    pub(super) scope: String,
    pub(super) token: Token,
    /// The request's `Fencing-Sequence` (SPEC §11).
    pub(super) sequence: Option<u64>,
    /// The `Fencing-Proof` to verify, on a `proof = "required"` route.
    pub(super) proof: Option<HeaderValue>,
    /// On an S3 route: the multipart upload the request creates or names (SPEC §15).
    pub(super) upload: Option<s3::upload::Upload>,
    /// On an `api = "webdav"` route with one scope per object: a method that may change
    /// a collection's members, checked against the marks beneath its scope (SPEC §16).
    pub(super) tree: bool,
}

fn content_length<B>(req: &Request<B>) -> Option<u64> {
    req.headers()
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// Where a request head's policy headers are: `None`, one value, or more than one.
#[derive(Clone, Copy)]
enum Seen<'a> {
    None,
    One(&'a HeaderValue),
    Many,
}

impl<'a> Seen<'a> {
    fn add(&mut self, v: &'a HeaderValue) {
        *self = match self {
            Seen::None => Seen::One(v),
            _ => Seen::Many,
        };
    }
}

/// The headers the fence looks at, found in one pass over the head (a name compared by
/// its text) instead of a hash lookup each.
struct HeadScan<'a> {
    host: Seen<'a>,
    token: Seen<'a>,
    scope: Seen<'a>,
    proof: Seen<'a>,
    sequence: Seen<'a>,
    /// A method override, `Upgrade` or `Connection` is present (see
    /// [`refuse_unfenceable`]).
    suspect: bool,
    destination: Seen<'a>,
    /// A header naming a second target is present (see [`destination`]).
    retarget: bool,
    /// A name with `_` that reads as one of the names above once `_` is `-` (see
    /// [`underscore_alias`]).
    alias: Option<&'a str>,
}

impl<'a> HeadScan<'a> {
    fn of(headers: &'a http::HeaderMap, token_name: &http::HeaderName) -> HeadScan<'a> {
        let token_name = token_name.as_str();
        let mut scan = HeadScan {
            host: Seen::None,
            token: Seen::None,
            scope: Seen::None,
            proof: Seen::None,
            sequence: Seen::None,
            suspect: false,
            destination: Seen::None,
            retarget: false,
            alias: None,
        };
        for (name, value) in headers {
            let name = name.as_str();
            // Not `else`: a configured token header named like one below counts for both,
            // as separate lookups would.
            if name == token_name {
                scan.token.add(value);
            }
            match name {
                "host" => scan.host.add(value),
                "fencing-scope" => scan.scope.add(value),
                "fencing-proof" => scan.proof.add(value),
                "fencing-sequence" => scan.sequence.add(value),
                "connection" | "upgrade" => scan.suspect = true,
                "destination" => {
                    scan.destination.add(value);
                    scan.retarget = true;
                }
                n if RETARGETS.iter().any(|m| m.as_str() == n) => scan.retarget = true,
                n if METHOD_OVERRIDES.iter().any(|m| m.as_str() == n) => scan.suspect = true,
                n if maybe_alias(n, token_name) && underscore_alias(n, token_name) => {
                    scan.alias = Some(n)
                }
                _ => {}
            }
        }
        scan
    }
}

/// A cheap first look for [`underscore_alias`] (run on every header name the scan does
/// not know): the names it knows begin with `x` or `f` and are 13 to 22 bytes long, or
/// are as long as the token header's and begin as it does.
#[inline]
fn maybe_alias(name: &str, token_name: &str) -> bool {
    let (n, t) = (name.as_bytes(), token_name.as_bytes());
    let known = match n.first() {
        Some(b'x' | b'f') => matches!(n.len(), 13..=22),
        _ => false,
    };
    (known || (n.len() == t.len() && n.first() == t.first()))
        && name != token_name
        && n.contains(&b'_')
}

/// True when `name` (which has a `_`) reads, with `_` as `-`, as a header the fence
/// looks at. CGI, WSGI, Rack and PHP hand headers to applications as
/// `HTTP_X_HTTP_METHOD_OVERRIDE`-style variables, where `_` and `-` are one character: a
/// backend of that kind would read `X_HTTP_Method_Override` or `X_Original_URL` as the
/// header fencegate refuses, so such a request is refused too.
fn underscore_alias(name: &str, token_name: &str) -> bool {
    let same = |known: &str| {
        known.len() == name.len()
            && known
                .bytes()
                .zip(name.bytes())
                .all(|(k, n)| k == n || (k == b'-' && n == b'_'))
    };
    ["fencing-scope", token_name]
        .into_iter()
        .chain(METHOD_OVERRIDES.iter().map(|h| h.as_str()))
        .chain(RETARGETS.iter().map(|h| h.as_str()))
        // A configured token header may itself have `_`: that name is the header.
        .any(|known| known != name && same(known))
}

/// The request's host without port (see [`route::host_of`]), for `host =` routes. The
/// router and the backend must read one host from a request, so a request that names it
/// in a form that is not an authority, twice, or differently in `Host` and the HTTP/2
/// authority is refused, and so is an HTTP/1.1 or HTTP/2 request that names none (RFC 9112
/// §3.2: an upstream would fill in its own). Only HTTP/1.0 may leave it out (`None`: no
/// `host =` route matches).
fn request_host<'a, B>(
    req: &'a Request<B>,
    host: Seen<'a>,
) -> Result<Option<&'a str>, RequestHostError> {
    let header = match host {
        Seen::Many => return Err(RequestHostError::Many),
        Seen::One(v) => {
            let v = v.to_str().map_err(|_| RequestHostError::NotAscii)?;
            Some(
                route::host_of(v).map_err(|reason| RequestHostError::Invalid {
                    what: "Host",
                    reason,
                })?,
            )
        }
        Seen::None => None,
    };
    let authority = match req.uri().authority() {
        Some(a) => {
            Some(
                route::host_of(a.as_str()).map_err(|reason| RequestHostError::Invalid {
                    what: "the authority",
                    reason,
                })?,
            )
        }
        None => None,
    };
    match (header, authority) {
        (Some(h), Some(a)) if !h.eq_ignore_ascii_case(a) => Err(RequestHostError::Differs),
        (Some(h), _) | (None, Some(h)) => Ok(Some(h)),
        (None, None) if req.version() >= http::Version::HTTP_11 => Err(RequestHostError::Missing),
        (None, None) => Ok(None),
    }
}

/// Why the router cannot read one host from a request (the refusal's detail).
#[derive(Debug, thiserror::Error)]
pub(crate) enum RequestHostError {
    #[error("more than one Host header")]
    Many,
    #[error("Host is not ASCII")]
    NotAscii,
    #[error("{what} is not a valid host: {reason}")]
    Invalid {
        what: &'static str,
        reason: &'static str,
    },
    #[error("Host differs from the request's authority")]
    Differs,
    #[error("the request names no host (Host header)")]
    Missing,
}

/// Why a fenced request cannot pass the fence as it stands (its text is the refusal's
/// detail).
#[derive(Debug, thiserror::Error)]
pub(crate) enum Unfenceable {
    #[error("method-override header {0} on a fenced route")]
    MethodOverride(&'static http::HeaderName),
    #[error("protocol upgrade on a fenced route")]
    Upgrade,
}

/// Method overrides and upgrades would carry a request past the fence; refuse them.
/// Called only when [`HeadScan`] saw one of the names it looks for.
fn refuse_unfenceable<B>(req: &Request<B>) -> Result<(), Unfenceable> {
    if let Some(h) = METHOD_OVERRIDES
        .iter()
        .find(|h| req.headers().contains_key(*h))
    {
        return Err(Unfenceable::MethodOverride(h));
    }
    let connection_upgrade = req.headers().get_all(header::CONNECTION).iter().any(|v| {
        v.to_str()
            .map(|s| {
                s.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
            })
            .unwrap_or(true)
    });
    if req.headers().contains_key(header::UPGRADE) || connection_upgrade {
        return Err(Unfenceable::Upgrade);
    }
    Ok(())
}

/// `Ok(None)`: no `Fencing-Sequence`. More than one header, or a malformed value, is an
/// error (answered as a malformed token is).
fn read_sequence(seen: Seen<'_>) -> Result<Option<u64>, SequenceError> {
    match seen {
        Seen::None => Ok(None),
        Seen::Many => Err(SequenceError::Many),
        Seen::One(v) => crate::token::parse_sequence(v.as_bytes())
            .map(Some)
            .map_err(|_| SequenceError::Malformed),
    }
}

/// Why `Fencing-Sequence` cannot be read (the refusal's detail).
#[derive(Debug, thiserror::Error)]
pub(crate) enum SequenceError {
    #[error("more than one Fencing-Sequence header")]
    Many,
    #[error("Fencing-Sequence must be 1 to 20 ASCII digits, no leading zero, at most 2^64-1")]
    Malformed,
}

/// `Ok(None)`: no token. More than one header, or any malformed value, is an error.
fn read_token(seen: Seen<'_>, name: &http::HeaderName) -> Result<Option<Token>, TokenHeaderError> {
    match seen {
        Seen::None => Ok(None),
        Seen::Many => Err(TokenHeaderError::Many(name.clone())),
        Seen::One(v) => Token::parse(v.as_bytes())
            .map(Some)
            .map_err(TokenHeaderError::Malformed),
    }
}

/// Why the token header cannot be read (the refusal's detail).
#[derive(Debug, thiserror::Error)]
pub(crate) enum TokenHeaderError {
    #[error("more than one {0} header")]
    Many(http::HeaderName),
    #[error(transparent)]
    Malformed(crate::token::TokenError),
}

fn check_scope_header(seen: Seen<'_>, scope: &str) -> Result<(), ()> {
    match seen {
        Seen::None => Ok(()),
        Seen::One(v) if v.as_bytes() == scope.as_bytes() => Ok(()),
        _ => Err(()),
    }
}

#[cfg(test)]
mod tests {
    use super::{maybe_alias, underscore_alias};

    #[test]
    fn underscore_aliases_of_the_headers_the_fence_reads() {
        let token = "fencing-token";
        for alias in [
            "x_http_method_override",
            "x-http_method",
            "x_original_url",
            "fencing_scope",
            "fencing_token",
        ] {
            assert!(maybe_alias(alias, token), "{alias}");
            assert!(underscore_alias(alias, token), "{alias}");
        }
        for other in ["x_trace_id", "x_http_method_overrides", "fencing__token"] {
            assert!(!underscore_alias(other, token), "{other}");
        }
        // A configured token header with `_` is that header, not an alias of it; its dashed
        // spelling is not an alias either (only `_` stands for `-`).
        assert!(!maybe_alias("x_fence", "x_fence"));
        assert!(!underscore_alias("x_fence", "x_fence"));
        assert!(maybe_alias("x_fencing_token", "x-fencing-token"));
        assert!(underscore_alias("x_fencing_token", "x-fencing-token"));
        assert!(
            maybe_alias("y_fence", "y-fence"),
            "as long as the token header"
        );
        assert!(!maybe_alias("content-length", token));
    }

    /// An unfenced request naming an upload id is looked up whatever its upstream's name
    /// (two entries may be one server: one that reads the Host as a bucket tells hosts
    /// apart, or the host check would refuse this pair), and passes untouched without one.
    #[test]
    fn an_unfenced_upload_id_is_looked_up_whatever_its_upstream() {
        let text = r#"
[store]
path = "x.redb"
[[upstream]]
name = "objects"
url = "http://127.0.0.1:9000"
distinct_hosts = true
[[upstream]]
name = "same-server"
url = "http://localhost:9000"
distinct_hosts = true
[[route]]
name = "s3"
api = "s3"
host = "s3.example.com"
path = "/{bucket}/{*key}"
scope = "object/{bucket}/{key}"
upstream = "objects"
[[route]]
name = "public"
host = "public.example.com"
path = "/{*rest}"
upstream = "same-server"
fenced = false
"#;
        let config = crate::settings::Config::parse(text, std::path::Path::new("."))
            .expect("parses")
            .proxy_settings();
        let req = |target: &str| {
            http::Request::put(target)
                .header("host", "public.example.com")
                .body(())
                .unwrap()
        };
        match super::classify(&config, &req("/a?partNumber=1&uploadId=u1")) {
            Ok(super::Classified::PassUpload { id, .. }) => assert_eq!(id, "u1"),
            _ => panic!("an upload id on the public route is looked up"),
        }
        assert!(matches!(
            super::classify(&config, &req("/a?x=1")),
            Ok(super::Classified::Unfenced(_))
        ));
        assert!(matches!(
            super::classify(&config, &req("/a")),
            Ok(super::Classified::Unfenced(_))
        ));
    }
}
