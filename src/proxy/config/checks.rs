//! The rules across routes, each refusal pushed at the later route's place: no route
//! shadowed by an earlier one, an S3 route first on its host, one way to fence a path
//! whatever the Host (SPEC §2), and one proof, equal and sequence policy per scope (§9).

use http::Uri;

use super::upstream::UpstreamDraft;
use super::{Api, Keys, Route};
use crate::config::error::Errors;
use crate::route::{PathTemplate, ScopeTemplate, Segment};

/// A route that can never match: an earlier route takes every path it does, on its host.
pub(super) fn never_matched(routes: &[Route], positions: &[usize], errors: &mut Errors) {
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
pub(super) struct HostChosenScope {
    /// Index in the routes of the later route of the two (the error's place).
    pub(super) second: usize,
    pub(super) message: String,
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
pub(super) fn host_chosen_scopes(
    routes: &[Route],
    upstreams: &[UpstreamDraft],
) -> Vec<HostChosenScope> {
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
            // A backend tells hosts apart only if both its entries say so.
            if ua.distinct_hosts && ub.distinct_hosts {
                continue;
            }
            // Two entries with one URL are one backend.
            let one_url = a.upstream == b.upstream || same_origin(&ua.url, &ub.url);
            let Some(shared) = shared_paths(a, b)
                .into_iter()
                .find(|p| !taken_before(&routes[..i], a, p) && !taken_before(&routes[..j], b, p))
            else {
                continue;
            };
            // Two URLs spelled apart may still name one server (`localhost:9000` and
            // `127.0.0.1:9000`): resolved, only for a pair that would share a path.
            let server = if one_url {
                None
            } else {
                match one_server(&ua.url, &ub.url) {
                    Some(addr) => Some(addr),
                    None => continue,
                }
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
            } else if let Some(addr) = server {
                (
                    format!(
                        "upstreams `{}` and `{}` (one server: both reach {addr})",
                        ua.name, ub.name
                    ),
                    "on both".to_string(),
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
pub(super) fn rest_capture(path: &PathTemplate) -> Option<usize> {
    path.segments
        .iter()
        .filter(|s| !matches!(s, crate::route::Segment::Literal(_)))
        .position(|s| matches!(s, crate::route::Segment::CatchAll(_)))
}

/// Does `scope` end with `path`'s `{*name}` capture (one scope per object of a tree)?
pub(super) fn ends_with_rest(path: &PathTemplate, scope: &ScopeTemplate) -> bool {
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
    a.scheme_str() == b.scheme_str()
        && a.host()
            .zip(b.host())
            .is_some_and(|(x, y)| x.eq_ignore_ascii_case(y))
        && port_of(a) == port_of(b)
}

/// The port a URL names, or its scheme's.
fn port_of(u: &Uri) -> u16 {
    u.port_u16().unwrap_or(if u.scheme_str() == Some("https") {
        443
    } else {
        80
    })
}

/// Do two upstream URLs spelled apart reach one server? Their hosts resolved (as the
/// upstream connection resolves them), an address both reach: the same address and port,
/// or two loopback addresses on one port (a server listening on all of loopback answers
/// on every one). `None` if not, or if either does not resolve now: then they are taken
/// for two servers, as their URLs say (SPEC §2 asks to keep one server's entries one URL).
fn one_server(a: &Uri, b: &Uri) -> Option<std::net::SocketAddr> {
    if a.scheme_str() != b.scheme_str() {
        return None;
    }
    let addrs = |u: &Uri| -> Vec<std::net::SocketAddr> {
        use std::net::ToSocketAddrs;
        let host = u.host().unwrap_or_default();
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        // The config fuzz target parses what it makes up: no name it invents is looked
        // up (no query leaves the process), only addresses and `localhost`.
        if cfg!(fuzzing)
            && host.parse::<std::net::IpAddr>().is_err()
            && !host.eq_ignore_ascii_case("localhost")
        {
            return Vec::new();
        }
        (host, port_of(u))
            .to_socket_addrs()
            .map(|a| {
                a.map(|a| (a.ip().to_canonical(), a.port()).into())
                    .collect()
            })
            .unwrap_or_default()
    };
    let (xs, ys) = (addrs(a), addrs(b));
    xs.into_iter().find(|x| {
        ys.iter().any(|y| {
            x == y || (x.port() == y.port() && x.ip().is_loopback() && y.ip().is_loopback())
        })
    })
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
pub(super) fn one_policy_per_scope(routes: &[Route], positions: &[usize], errors: &mut Errors) {
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
pub(super) fn shadowed_s3(routes: &[Route], positions: &[usize], errors: &mut Errors) {
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
