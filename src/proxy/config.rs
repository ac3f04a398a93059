//! `[[upstream]]` and `[[route]]`: where the proxy sends requests and how it fences them.
//! Owned by the proxy, which is what reads them on every request (and swaps them on
//! reload); the path and scope templates themselves are [`crate::route`]'s.

use std::path::Path;
use std::time::Duration;

use http::{Method, Uri};
use serde::Deserialize;

use crate::config::error::Errors;
use crate::config::value::{array, duration, parse_size, section};
use crate::fence::policy::EqualPolicy;
use crate::proxy::idempotency::config::{Mode, OnUnknown};
use crate::proxy::problem::Dialect;
use crate::route::{PathTemplate, RouteMatch, ScopeTemplate, Segment};
use crate::tls::{RawUpstreamTls, UpstreamTls, UpstreamTlsFiles};

#[derive(Debug, Clone)]
pub struct Upstream {
    pub name: String,
    /// Scheme and authority only; the request's path is appended byte for byte.
    pub url: Uri,
    pub timeout: Duration,
    /// Client TLS settings; `Some` exactly for https upstreams.
    pub tls: Option<UpstreamTls>,
    /// The backend serves different objects for different Host names (name-based virtual
    /// hosts), so routes for different hosts may fence one path differently (SPEC §2).
    pub distinct_hosts: bool,
}

/// What an `api = "s3"` route knows beyond a plain route's table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Api {
    /// The endpoint as clients name it in Host (`host`, lowercase, with its port when
    /// they send one): a request to the route's host must name it exactly.
    pub endpoint: String,
    /// The backend also serves virtual-hosted requests, `Host: {bucket}.{domain}`: the
    /// bucket is then taken from the Host. Lowercase, without a trailing dot.
    pub virtual_host_domain: Option<String>,
    /// The scope of requests on a bucket itself (create, delete, its settings); rendered
    /// from the bucket capture only. `None`: those are refused when they would change
    /// anything (403 `unfenced_operation`).
    pub bucket_scope: Option<ScopeTemplate>,
    /// How keys are read: held to a path's rules, or whole and verbatim (`keys`).
    pub keys: Keys,
}

/// How an S3 route reads an object's key (`keys`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Keys {
    /// Held to a path's rules (SPEC §2): no empty, `.` or `..` segment, no `\`; one
    /// trailing `/` dropped. For backends that store objects as files.
    #[default]
    Strict,
    /// Whole and verbatim (only controls refused): `a//b`, `a/./b`, `a\b` and `dir/`
    /// are keys of their own, for backends that store keys as given (AWS S3).
    Opaque,
}

/// What a route's backend API is, where the path alone does not say what a request
/// changes (SPEC §15).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Api {
    /// Not said: the path names what a request changes.
    #[default]
    Unspecified,
    /// An API that changes only the one resource its path names; the operator vouches.
    Plain,
    /// S3's REST API: objects named in the Host, a DeleteObjects body or an upload form
    /// are fenced too (SPEC §15).
    S3(S3Api),
    /// WebDAV: a DELETE, MOVE or COPY of a collection changes every object beneath it, so
    /// it is refused while any of them is fenced under a scope of its own (SPEC §16).
    Webdav,
}

/// Whether a fenced route asks for a `Fencing-Proof` beside the token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProofMode {
    /// Today's behaviour, for lock services that cannot sign.
    Off,
    /// A proof from one of `[fencing] proof_keys` for this scope and token, or 403.
    Required,
}

/// Whether a fenced route asks for a `Fencing-Sequence` beside the token (SPEC §11).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SequenceMode {
    /// A sequence is checked and recorded when the request carries one.
    #[default]
    Optional,
    /// A fenced request without one is refused 400 `invalid_token`.
    Required,
}

#[derive(Debug, Clone)]
pub struct Route {
    pub name: String,
    pub path: PathTemplate,
    pub scope: ScopeTemplate,
    pub upstream: usize,
    /// Lowercase host without port.
    pub host: Option<String>,
    pub fenced: bool,
    /// Methods that need a token; `None` means every method but the safe ones.
    pub methods: Option<Vec<Method>>,
    pub equal: EqualPolicy,
    /// Largest request body in bytes (413 beyond); `None`: no limit.
    pub max_body: Option<u64>,
    /// Idempotency-Key handling on fenced requests.
    pub idempotency: Mode,
    /// A retry whose first attempt's outcome is unknown: refuse it, or forward it again.
    pub idempotency_unknown: OnUnknown,
    pub proof: ProofMode,
    /// `Fencing-Sequence`: checked when present, or required.
    pub sequence: SequenceMode,
    /// The dialect of fencegate's own refusals on this route.
    pub errors: Dialect,
    /// What the backend's API is (`api`).
    pub api: Api,
}

impl Route {
    /// The route's S3 table, on an `api = "s3"` route.
    pub fn s3(&self) -> Option<&S3Api> {
        match &self.api {
            Api::S3(s3) => Some(s3),
            _ => None,
        }
    }

    /// On an `api = "webdav"` route whose scope ends with its `{*name}` capture (one scope
    /// per object of a tree): a DELETE, MOVE or COPY is checked against the marks beneath
    /// its scope (SPEC §16).
    pub fn fences_trees(&self) -> bool {
        self.api == Api::Webdav && ends_with_rest(&self.path, &self.scope)
    }

    /// Does this method need a token on this route (SPEC §2)? A listed method is matched
    /// without regard to case: methods are case-sensitive, but many backends upper-case
    /// them, and to those `post` is a POST. The default set of safe methods is matched
    /// exactly, so `get` needs a token.
    pub fn fences_method(&self, method: &Method) -> bool {
        match &self.methods {
            Some(list) => list
                .iter()
                .any(|m| m.as_str().eq_ignore_ascii_case(method.as_str())),
            None => !matches!(
                *method,
                Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
            ),
        }
    }
}

impl RouteMatch for Route {
    fn path(&self) -> &PathTemplate {
        &self.path
    }
    fn host(&self) -> Option<&str> {
        self.host.as_deref()
    }
    fn takes_prefixes(&self) -> bool {
        matches!(self.api, Api::S3(_))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawUpstream {
    name: String,
    url: String,
    timeout: Option<String>,
    tls: Option<RawUpstreamTls>,
    distinct_hosts: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    name: String,
    path: String,
    scope: Option<String>,
    upstream: String,
    host: Option<String>,
    fenced: Option<bool>,
    methods: Option<Vec<String>>,
    equal: Option<String>,
    idempotency: Option<String>,
    idempotency_unknown: Option<String>,
    max_body: Option<String>,
    proof: Option<String>,
    sequence: Option<String>,
    errors: Option<String>,
    api: Option<String>,
    virtual_host_domain: Option<String>,
    bucket_scope: Option<String>,
    keys: Option<String>,
}

/// One `[[upstream]]` as parsed: its TLS files are named, not read yet.
#[derive(Debug)]
pub(crate) struct UpstreamDraft {
    name: String,
    url: Uri,
    timeout: Duration,
    tls: Option<UpstreamTlsFiles>,
    distinct_hosts: bool,
}

impl UpstreamDraft {
    /// Reads the TLS files and builds the client's TLS config.
    pub(crate) fn load(self, errors: &mut Errors) -> Upstream {
        Upstream {
            name: self.name,
            url: self.url,
            timeout: self.timeout,
            tls: self.tls.and_then(|t| t.load(errors)),
            distinct_hosts: self.distinct_hosts,
        }
    }
}

/// What an `api = "webdav"` route needs (SPEC §16), each refusal pushed: fenced, DELETE,
/// MOVE and COPY among its fenced methods (a collection's must carry a token), and a
/// scope whose tree's marks can be found by prefix.
fn webdav_api(
    raw: &RawRoute,
    template: Option<&PathTemplate>,
    scope: Option<&ScopeTemplate>,
    fenced: bool,
    path: &str,
    errors: &mut Errors,
) {
    if !fenced {
        errors.push(
            format!("{path}.fenced"),
            "an api = \"webdav\" route is fenced: a pass-through route needs no api",
        );
    }
    if let Some(list) = &raw.methods
        && let Some(m) = ["DELETE", "MOVE", "COPY"]
            .into_iter()
            .find(|m| !list.iter().any(|l| l == m))
    {
        errors.push(
            format!("{path}.methods"),
            format!(
                "leaves out {m}: on an api = \"webdav\" route a DELETE, MOVE or COPY may change \
                 a whole collection, and one without a token would pass unchecked"
            ),
        );
    }
    if let (Some(t), Some(s)) = (template, scope)
        && let Some(i) = rest_capture(t)
        && s.uses_capture(i)
        && !s.ends_with_capture(i)
    {
        errors.push(
            format!("{path}.scope"),
            "an api = \"webdav\" route's scope ends with the `{*name}` capture when it uses \
             it: the scopes of a collection's members must extend the collection's, to be \
             found by prefix",
        );
    }
}

/// The S3 table of an `api = "s3"` route (SPEC §15), its errors pushed: the route names
/// its endpoint (`host`), its path is `/{bucket}/{*key}`, it is fenced and leaves to S3
/// which requests change objects (no `methods`).
fn s3_api(
    raw: &RawRoute,
    template: Option<&PathTemplate>,
    fenced: bool,
    path: &str,
    errors: &mut Errors,
) -> S3Api {
    if raw.host.is_none() {
        errors.push(
            format!("{path}.host"),
            "an api = \"s3\" route names the endpoint its clients use: without it, a request to any host (a virtual-hosted one among them) would be read as path-style",
        );
    }
    if !fenced {
        errors.push(
            format!("{path}.fenced"),
            "an api = \"s3\" route is fenced: a pass-through route needs no api",
        );
    }
    if raw.methods.is_some() {
        errors.push(
            format!("{path}.methods"),
            "an api = \"s3\" route takes no methods list: S3 says which requests change objects",
        );
    }
    let bucket = template.and_then(|t| match t.segments.as_slice() {
        [Segment::Param(bucket), Segment::CatchAll(_)] => Some(bucket.clone()),
        _ => None,
    });
    if template.is_some() && bucket.is_none() {
        errors.push(
            format!("{path}.path"),
            "an api = \"s3\" route's path is `/{bucket}/{*key}` (the route also takes `/{bucket}` and `/`)",
        );
    }
    let bucket_scope = match (&raw.bucket_scope, &bucket) {
        (Some(s), Some(b)) => PathTemplate::parse(&format!("/{{{b}}}"))
            .and_then(|t| ScopeTemplate::parse(s, &t))
            .map_err(|e| {
                errors.push(
                    format!("{path}.bucket_scope"),
                    format!("{e} (only the bucket capture `{b}` is known for a bucket's requests)"),
                )
            })
            .ok(),
        _ => None,
    };
    // Both as clients send them in Host, port included when they send one: S3 servers
    // match their domain byte for byte, and read any other Host as a bucket's name.
    let mut authority = |key: &str, value: &str| {
        let v = value.to_ascii_lowercase();
        if crate::route::host_of(&v).is_err()
            || v.ends_with('.')
            || v.contains(".:")
            || v.starts_with('[')
        {
            errors.push(
                format!("{path}.{key}"),
                "must be a host name and optional port, as clients send it in Host (no scheme or path, no trailing dot)",
            );
        }
        v
    };
    let endpoint = raw
        .host
        .as_deref()
        .map(|h| authority("host", h))
        .unwrap_or_default();
    let virtual_host_domain = raw
        .virtual_host_domain
        .as_deref()
        .map(|d| authority("virtual_host_domain", d));
    let keys = match raw.keys.as_deref() {
        None | Some("strict") => Keys::Strict,
        Some("opaque") => Keys::Opaque,
        Some(other) => {
            errors.push(
                format!("{path}.keys"),
                format!("`{other}`: expected \"strict\" or \"opaque\""),
            );
            Keys::Strict
        }
    };
    S3Api {
        endpoint,
        virtual_host_domain,
        bucket_scope,
        keys,
    }
}

/// Validates the `[[upstream]]` array; names are unique.
pub(crate) fn parse_upstreams(
    value: Option<toml::Value>,
    base: &Path,
    errors: &mut Errors,
) -> Vec<UpstreamDraft> {
    let upstreams = array(value, "upstream", errors)
        .into_iter()
        .enumerate()
        .filter_map(|(i, v)| {
            let path = format!("upstream[{i}]");
            let raw: RawUpstream = section(Some(v), &path, errors)?;
            Some(parse_upstream(raw, &path, base, errors))
        })
        .collect::<Vec<_>>();
    let mut seen = std::collections::HashSet::new();
    for (i, u) in upstreams.iter().enumerate() {
        if !seen.insert(u.name.clone()) {
            errors.push(
                format!("upstream[{i}].name"),
                format!("`{}` is defined twice", u.name),
            );
        }
    }
    upstreams
}

fn parse_upstream(raw: RawUpstream, path: &str, base: &Path, errors: &mut Errors) -> UpstreamDraft {
    let timeout = duration(
        raw.timeout.as_deref(),
        Duration::from_secs(30),
        &format!("{path}.timeout"),
        errors,
    );
    // Credentials in the URL are never sent upstream, and would be shown wherever the URL
    // is: refused, and never echoed.
    if raw
        .url
        .split_once("://")
        .map_or(raw.url.as_str(), |(_, rest)| rest)
        .split(['/', '?', '#'])
        .next()
        .is_some_and(|authority| authority.contains('@'))
    {
        errors.push(
            format!("{path}.url"),
            "holds credentials (user:password@): fencegate does not send them upstream; remove them",
        );
        return UpstreamDraft {
            name: raw.name,
            url: Uri::from_static("http://invalid"),
            timeout,
            tls: None,
            distinct_hosts: raw.distinct_hosts.unwrap_or(false),
        };
    }
    let url = match raw.url.parse::<Uri>() {
        Ok(u) if matches!(u.scheme_str(), Some("http" | "https")) && u.authority().is_some() => {
            if u.path() != "/" && !u.path().is_empty() || u.query().is_some() {
                errors.push(
                    format!("{path}.url"),
                    "give scheme and authority only; the request path is forwarded as received",
                );
            }
            u
        }
        _ => {
            errors.push(
                format!("{path}.url"),
                format!("`{}` is not an http:// or https://host:port URL", raw.url),
            );
            Uri::from_static("http://invalid")
        }
    };
    let https = url.scheme_str() == Some("https");
    let tls = crate::tls::upstream_tls_files(raw.tls, https, base, path, errors);
    UpstreamDraft {
        name: raw.name,
        url,
        timeout,
        tls,
        distinct_hosts: raw.distinct_hosts.unwrap_or(false),
    }
}

/// What the routes are checked against, from the other sections.
pub(crate) struct RouteContext<'a> {
    pub upstreams: &'a [UpstreamDraft],
    /// An `[authority]` table is there: an authority-only process needs no routes.
    pub has_authority: bool,
    /// `[fencing] proof_keys` names a key (whether it loads is the key's own error).
    pub proof_keys: bool,
}

/// Validates the `[[route]]` array: names unique, none shadowed by an earlier one.
pub(crate) fn parse_routes(
    value: Option<toml::Value>,
    cx: RouteContext<'_>,
    errors: &mut Errors,
) -> Vec<Route> {
    let raw_routes = array(value, "route", errors);
    // An authority-only process needs no routes; a proxy without routes is a mistake.
    // (An [authority] table with errors has its own; it is no reason to ask for routes.)
    if raw_routes.is_empty() && !cx.has_authority {
        errors.push("route", "no routes: every request would get 404 no_route");
    }
    let mut routes: Vec<Route> = Vec::new();
    // Position in the file of each validated route, for error paths.
    let mut positions: Vec<usize> = Vec::new();
    let mut names = std::collections::HashSet::new();
    for (i, v) in raw_routes.into_iter().enumerate() {
        let path = format!("route[{i}]");
        let Some(raw) = section::<RawRoute>(Some(v), &path, errors) else {
            continue;
        };
        if !names.insert(raw.name.clone()) {
            errors.push(
                format!("{path}.name"),
                format!("`{}` is defined twice", raw.name),
            );
        }
        if raw.proof.as_deref() == Some("required") && !cx.proof_keys {
            errors.push(
                format!("{path}.proof"),
                "\"required\" needs [fencing] proof_keys: no proof could pass",
            );
        }
        if let Some(route) = parse_route(raw, &path, cx.upstreams, errors) {
            routes.push(route);
            positions.push(i);
        }
    }
    for (i, r) in routes.iter().enumerate() {
        // An S3 route takes every path of its host (its buckets and the service too).
        // An S3 route takes every path of its host and of its virtual hosts.
        let under_s3 = |e: &Route| {
            let (Some(s3), Some(h)) = (e.s3(), r.host.as_deref()) else {
                return false;
            };
            e.host.as_deref() == Some(h)
                || s3
                    .virtual_host_domain
                    .as_deref()
                    .and_then(|d| crate::route::host_of(d).ok())
                    .is_some_and(|d| {
                        h.len() > d.len() + 1
                            && h.ends_with(d)
                            && h.as_bytes()[h.len() - d.len() - 1] == b'.'
                    })
        };
        let covers = |e: &Route| {
            under_s3(e) || ((e.host.is_none() || e.host == r.host) && r.path.is_covered_by(&e.path))
        };
        if let Some(e) = routes[..i].iter().find(|e| covers(e)) {
            errors.push(
                format!("route[{}]", positions[i]),
                format!(
                    "route `{}` can never match: route `{}` ({}) comes first and matches every path it does",
                    r.name, e.name, e.path
                ),
            );
        }
    }
    shadowed_s3(&routes, &positions, errors);
    one_policy_per_scope(&routes, &positions, errors);
    for c in host_chosen_scopes(&routes, cx.upstreams) {
        errors.push(format!("route[{}]", positions[c.second]), c.message);
    }
    routes
}

/// The path templates a route answers for: its `path`. Every check of which routes share
/// paths asks this, so a route that answers for more paths than its template names them
/// here.
fn paths_of(route: &Route) -> Vec<PathTemplate> {
    let mut paths = vec![route.path.clone()];
    // An S3 route also takes its buckets and the service (`/{bucket}`, `/`).
    if route.s3().is_some()
        && let Some(Segment::Param(bucket)) = route.path.segments.first()
    {
        paths.extend(
            [format!("/{{{bucket}}}"), "/".to_string()]
                .iter()
                .filter_map(|t| PathTemplate::parse(t).ok()),
        );
    }
    paths
}

/// Two routes that would fence one object two ways, the Host header choosing which.
#[derive(Debug)]
struct HostChosenScope {
    /// Index in the routes of the later route of the two (the error's place).
    second: usize,
    message: String,
}

/// SPEC §2, one object, one scope. A backend that ignores Host (S3 path-style, WebDAV)
/// reads one path as one object whatever host name a client used; if the routes for two
/// host names fenced that path differently, a writer would pick its fence, or none, by
/// the name it connects to. So routes i < j on one backend that both get some path for
/// some host must fence it alike, unless the backend declares `distinct_hosts`.
///
/// Which pairs can both get a path: i names a host, and j names another or none (if i
/// names none it takes the path from every host first; two routes for one host are
/// ordered by the file, not by Host). A shared path that an earlier route takes from
/// every host that would bring it to i (or to j) does not count: neither gets it. Pairs
/// are judged one by one, so a shared path that several earlier routes take between
/// them still counts (a refusal on the safe side).
fn host_chosen_scopes(routes: &[Route], upstreams: &[UpstreamDraft]) -> Vec<HostChosenScope> {
    let mut out = Vec::new();
    for (j, b) in routes.iter().enumerate() {
        for (i, a) in routes[..j].iter().enumerate() {
            let Some(host) = a.host.as_deref() else {
                continue;
            };
            if b.host.as_deref() == Some(host) || fenced_alike(a, b) {
                continue;
            }
            let (Some(ua), Some(ub)) = (upstreams.get(a.upstream), upstreams.get(b.upstream))
            else {
                continue;
            };
            // Two entries with one URL are one backend, and it tells hosts apart only if
            // both say so.
            let one_backend = a.upstream == b.upstream || same_origin(&ua.url, &ub.url);
            if !one_backend || (ua.distinct_hosts && ub.distinct_hosts) {
                continue;
            }
            let Some(shared) = shared_paths(a, b)
                .into_iter()
                .find(|p| !taken_before(&routes[..i], a, p) && !taken_before(&routes[..j], b, p))
            else {
                continue;
            };
            let fence = |r: &Route| {
                if r.fenced {
                    format!("scope \"{}\"", r.scope)
                } else {
                    "pass-through".to_string()
                }
            };
            let (backend, on) = if a.upstream == b.upstream {
                (
                    format!("upstream `{}`", ua.name),
                    format!("on `{}`", ua.name),
                )
            } else {
                (
                    format!("upstreams `{}` and `{}` (one URL)", ua.name, ub.name),
                    "on both".to_string(),
                )
            };
            out.push(HostChosenScope {
                second: j,
                message: format!(
                    "routes `{}` (host {host}, {}) and `{}` ({}, {}) send the same paths to {backend}, such as {}: the Host header would choose how one object is fenced. \
                     Give both the same path and scope templates, send them to separate upstreams (different backends), \
                     or, if the backend serves different objects for different host names, set `distinct_hosts = true` {on}",
                    a.name,
                    fence(a),
                    b.name,
                    b.host
                        .as_deref()
                        .map_or_else(|| "any other host".to_string(), |h| format!("host {h}")),
                    fence(b),
                    shared.example(),
                ),
            });
        }
    }
    out
}

/// The index of the path template's `{*name}` capture among its captures, if it has one.
fn rest_capture(path: &PathTemplate) -> Option<usize> {
    path.segments
        .iter()
        .filter(|s| !matches!(s, crate::route::Segment::Literal(_)))
        .position(|s| matches!(s, crate::route::Segment::CatchAll(_)))
}

/// Does `scope` end with `path`'s `{*name}` capture (one scope per object of a tree)?
fn ends_with_rest(path: &PathTemplate, scope: &ScopeTemplate) -> bool {
    rest_capture(path).is_some_and(|i| scope.ends_with_capture(i))
}

/// Do two routes fence every path they share alike? Both pass-through, or both fenced
/// with one path template and one scope template (captures may be named differently).
fn fenced_alike(a: &Route, b: &Route) -> bool {
    let same_api = match (a.s3(), b.s3()) {
        (None, None) => true,
        // Two S3 routes fence a bucket's requests alike too.
        (Some(x), Some(y)) => {
            x.keys == y.keys
                && match (&x.bucket_scope, &y.bucket_scope) {
                    (None, None) => true,
                    (Some(p), Some(q)) => p.renders_like(q),
                    _ => false,
                }
        }
        // An S3 route reads what names objects outside the path; another route does not.
        _ => false,
    } && (a.api == Api::Webdav) == (b.api == Api::Webdav);
    match (a.fenced, b.fenced) {
        (false, false) => true,
        (true, true) => same_api && a.path.same_shape(&b.path) && a.scope.renders_like(&b.scope),
        _ => false,
    }
}

/// The paths both routes answer for, as templates.
fn shared_paths(a: &Route, b: &Route) -> Vec<PathTemplate> {
    let theirs = paths_of(b);
    paths_of(a)
        .iter()
        .flat_map(|p| theirs.iter().filter_map(|q| p.intersection(q)))
        .collect()
}

/// Does one of `earlier` take every path of `paths` from each host that would bring them
/// to `route` (a route with no host, or one for `route`'s host)?
fn taken_before(earlier: &[Route], route: &Route, paths: &PathTemplate) -> bool {
    earlier.iter().any(|e| {
        (e.host.is_none() || e.host == route.host)
            && paths_of(e).iter().any(|p| paths.is_covered_by(p))
    })
}

/// Do two upstream URLs name one server: scheme, host (in any case) and port, the
/// scheme's port where none is written?
fn same_origin(a: &Uri, b: &Uri) -> bool {
    let port = |u: &Uri| {
        u.port_u16().unwrap_or(if u.scheme_str() == Some("https") {
            443
        } else {
            80
        })
    };
    a.scheme_str() == b.scheme_str()
        && a.host()
            .zip(b.host())
            .is_some_and(|(x, y)| x.eq_ignore_ascii_case(y))
        && port(a) == port(b)
}

/// The scope templates a fenced route renders, each with what its captures may hold:
/// its `scope`, and an S3 route's `bucket_scope`.
fn scopes_of(route: &Route) -> Vec<(&ScopeTemplate, Vec<crate::route::CaptureKind>)> {
    use crate::route::CaptureKind;
    let mut kinds: Vec<CaptureKind> = route
        .path
        .segments
        .iter()
        .filter_map(|s| match s {
            Segment::Param(_) => Some(CaptureKind::Segment),
            Segment::CatchAll(_) => Some(CaptureKind::Segments),
            Segment::Literal(_) => None,
        })
        .collect();
    let mut out = Vec::new();
    if let Some(s3) = route.s3() {
        if s3.keys == Keys::Opaque
            && let Some(k) = kinds.get_mut(1)
        {
            *k = CaptureKind::Any;
        }
        if let Some(b) = &s3.bucket_scope {
            out.push((b, vec![CaptureKind::Segment]));
        }
    }
    out.push((&route.scope, kinds));
    out
}

/// SPEC §9: one scope, one proof policy. Two fenced routes that can render one scope
/// must agree on what decides it: `proof` (else a token nobody issued, taken on the route
/// without proofs, would decide the scope the other requires proofs for), `equal` and
/// `sequence` (else a client picks the weaker one by its path). Whether two templates
/// can render one scope is decided exactly ([`ScopeTemplate::can_meet`]).
fn one_policy_per_scope(routes: &[Route], positions: &[usize], errors: &mut Errors) {
    for (j, b) in routes.iter().enumerate().filter(|(_, r)| r.fenced) {
        for a in routes[..j].iter().filter(|r| r.fenced) {
            let differs = [
                ("proof", a.proof != b.proof),
                ("equal", a.equal != b.equal),
                ("sequence", a.sequence != b.sequence),
            ];
            let Some((setting, _)) = differs.iter().find(|(_, d)| *d) else {
                continue;
            };
            let meet = scopes_of(a).iter().find_map(|(sa, ka)| {
                scopes_of(b)
                    .into_iter()
                    .find(|(sb, kb)| sa.can_meet(ka, sb, kb))
                    .map(|(sb, _)| (sa.to_string(), sb.to_string()))
            });
            if let Some((sa, sb)) = meet {
                errors.push(
                    format!("route[{}]", positions[j]),
                    format!(
                        "routes `{}` (scope \"{sa}\") and `{}` (scope \"{sb}\") can render the same scope with different `{setting}` settings: whichever is weaker would decide the scope for both; give them one setting, or scopes that cannot meet",
                        a.name, b.name
                    ),
                );
            }
        }
    }
}

/// An S3 route must see every request of its host (SPEC §15): a route before it that
/// takes some of the paths it owns (`/{bucket}/{*key}`, `/{bucket}`, `/`) on its host
/// would pass there what the S3 route fences (a DeleteObjects, a form upload, an
/// object's write) without reading it as S3.
fn shadowed_s3(routes: &[Route], positions: &[usize], errors: &mut Errors) {
    let owned: Vec<PathTemplate> = ["/", "/{bucket}", "/{bucket}/{*key}"]
        .iter()
        .filter_map(|t| PathTemplate::parse(t).ok())
        .collect();
    for (i, r) in routes.iter().enumerate() {
        if r.s3().is_none() {
            continue;
        }
        // One S3 route per backend: S3 servers read a Host that is not their domain as
        // the name of a bucket, so a second route's host would name, as a bucket, what
        // the first route's clients reach by path under another scope.
        if let Some(e) = routes[..i]
            .iter()
            .find(|e| e.s3().is_some() && e.upstream == r.upstream)
        {
            errors.push(
                format!("route[{}]", positions[i]),
                format!(
                    "S3 routes `{}` and `{}` share an upstream: an S3 server reads any Host but its own as a bucket's name, so one object would have two scopes; give each S3 endpoint its own upstream",
                    e.name, r.name
                ),
            );
        }
        for e in &routes[..i] {
            if e.host.is_some() && e.host != r.host {
                continue;
            }
            if let Some(example) = owned.iter().find_map(|t| e.path.overlap(t)) {
                errors.push(
                    format!("route[{}]", positions[i]),
                    format!(
                        "route `{}` comes before S3 route `{}` and takes some of its paths (such as {example}) on its host: what it passes there is not read as S3 (a DeleteObjects body, an upload form); put the S3 route first",
                        e.name, r.name
                    ),
                );
                break;
            }
        }
    }
}

fn parse_route(
    raw: RawRoute,
    path: &str,
    upstreams: &[UpstreamDraft],
    errors: &mut Errors,
) -> Option<Route> {
    let before = errors.len();
    if raw.name == crate::metrics::UNROUTED {
        errors.push(
            format!("{path}.name"),
            format!(
                "`{}` is reserved: it labels the metrics of requests that matched no route",
                raw.name
            ),
        );
    }
    let template = PathTemplate::parse(&raw.path)
        .map_err(|e| errors.push(format!("{path}.path"), format!("`{}` {e}", raw.path)))
        .ok();
    let fenced = raw.fenced.unwrap_or(true);
    let scope = match (&template, &raw.scope) {
        (Some(t), Some(s)) => ScopeTemplate::parse(s, t)
            .map_err(|e| errors.push(format!("{path}.scope"), e))
            .ok(),
        (Some(t), None) if !fenced => ScopeTemplate::parse("-", t).ok(),
        (_, None) => {
            errors.push(
                format!("{path}.scope"),
                "missing: a fenced route needs a scope template",
            );
            None
        }
        (None, Some(_)) => None,
    };
    let upstream = upstreams.iter().position(|u| u.name == raw.upstream);
    if upstream.is_none() {
        errors.push(
            format!("{path}.upstream"),
            format!("no upstream named `{}`", raw.upstream),
        );
    }
    let api = match raw.api.as_deref() {
        None => Api::Unspecified,
        Some("plain") => Api::Plain,
        Some("s3") => Api::S3(s3_api(&raw, template.as_ref(), fenced, path, errors)),
        Some("webdav") => {
            webdav_api(
                &raw,
                template.as_ref(),
                scope.as_ref(),
                fenced,
                path,
                errors,
            );
            Api::Webdav
        }
        Some(other) => {
            errors.push(
                format!("{path}.api"),
                format!("`{other}`: expected \"s3\", \"webdav\" or \"plain\""),
            );
            Api::Unspecified
        }
    };
    // One scope per object of a tree: what a request changes beyond its path depends on
    // the backend's API (SPEC §16), so the route says which.
    if fenced
        && api == Api::Unspecified
        && raw.api.is_none()
        && let (Some(t), Some(s)) = (&template, &scope)
        && ends_with_rest(t, s)
    {
        errors.push(
            format!("{path}.api"),
            "missing: the scope ends with the path's `{*name}` capture (one scope per \
             object of a tree), so say what the backend's API is: \"webdav\" (a DELETE, \
             MOVE or COPY of a collection changes every object beneath it, and is checked), \
             \"s3\", or \"plain\" (every request changes only the resource its path names)",
        );
    }
    if !matches!(api, Api::S3(_)) {
        for (key, set) in [
            ("virtual_host_domain", raw.virtual_host_domain.is_some()),
            ("bucket_scope", raw.bucket_scope.is_some()),
            ("keys", raw.keys.is_some()),
        ] {
            if set {
                errors.push(format!("{path}.{key}"), "only for an api = \"s3\" route");
            }
        }
    }
    // Kept as the router compares it: lowercase, without a trailing dot.
    let host = raw.host.map(|h| {
        let h = h.to_ascii_lowercase();
        // An S3 route's endpoint may carry a port: the Host its clients send (its S3
        // table keeps it whole); it routes by the name.
        if let Api::S3(s3) = &api {
            return crate::route::host_of(&s3.endpoint)
                .unwrap_or(&s3.endpoint)
                .to_string();
        }
        let bare = h.strip_suffix('.').unwrap_or(&h);
        if crate::route::host_of(&h) != Ok(bare) {
            errors.push(
                format!("{path}.host"),
                "must be a host name without scheme, port or path",
            );
        }
        bare.to_string()
    });
    // An empty list would fence no method: an implicit pass-through (SPEC §2).
    if fenced && raw.methods.as_ref().is_some_and(Vec::is_empty) {
        errors.push(
            format!("{path}.methods"),
            format!(
                "empty on fenced route `{}`: no method would need a token; \
                 write `fenced = false` for a pass-through route",
                raw.name
            ),
        );
    }
    let methods = raw.methods.map(|list| {
        list.iter()
            .filter_map(|m| match Method::from_bytes(m.as_bytes()) {
                Ok(method) if m.chars().all(|c| c.is_ascii_uppercase()) => Some(method),
                _ => {
                    errors.push(
                        format!("{path}.methods"),
                        format!("`{m}` is not an upper-case HTTP method"),
                    );
                    None
                }
            })
            .collect::<Vec<_>>()
    });
    let equal = EqualPolicy::from_option(raw.equal.as_deref()).unwrap_or_else(|| {
        errors.push(
            format!("{path}.equal"),
            format!(
                "`{}`: expected \"accept\" or \"reject\"",
                raw.equal.as_deref().unwrap_or_default()
            ),
        );
        EqualPolicy::Accept
    });
    let idempotency = Mode::parse(raw.idempotency.as_deref(), path, errors);
    let idempotency_unknown = OnUnknown::parse(raw.idempotency_unknown.as_deref(), path, errors);
    let proof = match raw.proof.as_deref() {
        None | Some("off") => ProofMode::Off,
        Some("required") if !fenced => {
            errors.push(
                format!("{path}.proof"),
                "only for fenced routes: a pass-through route reads no token",
            );
            ProofMode::Off
        }
        Some("required") => ProofMode::Required,
        Some(other) => {
            errors.push(
                format!("{path}.proof"),
                format!("`{other}`: expected \"off\" or \"required\""),
            );
            ProofMode::Off
        }
    };
    let sequence = match raw.sequence.as_deref() {
        None | Some("optional") => SequenceMode::Optional,
        Some("required") if !fenced => {
            errors.push(
                format!("{path}.sequence"),
                "only for fenced routes: a pass-through route reads no token",
            );
            SequenceMode::Optional
        }
        Some("required") => SequenceMode::Required,
        Some(other) => {
            errors.push(
                format!("{path}.sequence"),
                format!("`{other}`: expected \"optional\" or \"required\""),
            );
            SequenceMode::Optional
        }
    };
    // An S3 route answers in S3's dialect unless told otherwise: its clients are S3 SDKs.
    let default_errors = if matches!(api, Api::S3(_)) && raw.errors.is_none() {
        Some("s3")
    } else {
        raw.errors.as_deref()
    };
    let errors_in = Dialect::from_option(default_errors).unwrap_or_else(|| {
        errors.push(
            format!("{path}.errors"),
            format!(
                "`{}`: expected \"problem\" or \"s3\"",
                raw.errors.as_deref().unwrap_or_default()
            ),
        );
        Dialect::Problem
    });
    let max_body = raw.max_body.as_deref().and_then(|s| {
        parse_size(s).or_else(|| {
            errors.push(
                format!("{path}.max_body"),
                format!("`{s}` is not a size (e.g. 10MiB)"),
            );
            None
        })
    });
    if errors.len() > before {
        return None;
    }
    Some(Route {
        proof,
        sequence,
        errors: errors_in,
        max_body,
        idempotency,
        idempotency_unknown,
        api,
        name: raw.name,
        path: template?,
        scope: scope?,
        upstream: upstream?,
        host,
        fenced,
        methods,
        equal,
    })
}

#[cfg(test)]
mod tests;
