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
use crate::route::{PathTemplate, RouteMatch, ScopeTemplate};
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
}

impl Route {
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
        if let Some(e) = routes[..i]
            .iter()
            .find(|e| (e.host.is_none() || e.host == r.host) && r.path.is_covered_by(&e.path))
        {
            errors.push(
                format!("route[{}]", positions[i]),
                format!(
                    "route `{}` can never match: route `{}` ({}) comes first and matches every path it does",
                    r.name, e.name, e.path
                ),
            );
        }
    }
    for c in host_chosen_scopes(&routes, cx.upstreams) {
        errors.push(format!("route[{}]", positions[c.second]), c.message);
    }
    routes
}

/// The path templates a route answers for: its `path`. Every check of which routes share
/// paths asks this, so a route that answers for more paths than its template names them
/// here.
fn paths_of(route: &Route) -> Vec<PathTemplate> {
    vec![route.path.clone()]
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

/// Do two routes fence every path they share alike? Both pass-through, or both fenced
/// with one path template and one scope template (captures may be named differently).
fn fenced_alike(a: &Route, b: &Route) -> bool {
    match (a.fenced, b.fenced) {
        (false, false) => true,
        (true, true) => a.path.same_shape(&b.path) && a.scope.renders_like(&b.scope),
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
    // Kept as the router compares it: lowercase, without a trailing dot.
    let host = raw.host.map(|h| {
        let h = h.to_ascii_lowercase();
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
    let errors_in = Dialect::from_option(raw.errors.as_deref()).unwrap_or_else(|| {
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
mod tests {
    use std::path::Path;

    use crate::config::Config;
    use crate::proxy::problem::Dialect;

    const ROUTES: &str = r#"
[store]
path = "x.redb"
[[upstream]]
name = "objects"
url = "http://127.0.0.1:9000"
[[route]]
name = "plain"
path = "/plain/{*rest}"
scope = "plain"
upstream = "objects"
[[route]]
name = "s3"
path = "/{bucket}/{*key}"
scope = "object/{bucket}/{key}"
upstream = "objects"
"#;

    #[test]
    fn errors_dialect_per_route() {
        let c = Config::parse(ROUTES, Path::new(".")).expect("parses");
        assert_eq!(c.routes[0].errors, Dialect::Problem);
        assert_eq!(c.routes[1].errors, Dialect::Problem);
        assert!(!c.describe().contains("errors s3"));
        let s3 = format!("{ROUTES}errors = \"s3\"\n");
        let c = Config::parse(&s3, Path::new(".")).expect("parses");
        assert_eq!(c.routes[0].errors, Dialect::Problem);
        assert_eq!(c.routes[1].errors, Dialect::S3);
        let described = c.describe();
        let line = described
            .lines()
            .find(|l| l.starts_with("route s3"))
            .expect("the s3 route is described");
        assert!(line.ends_with(" · errors s3"), "{line}");
        let explicit = format!("{ROUTES}errors = \"problem\"\n");
        let c = Config::parse(&explicit, Path::new(".")).expect("parses");
        assert_eq!(c.routes[1].errors, Dialect::Problem);
    }

    /// `sequence` is optional by default, "required" on fenced routes only, and any
    /// other value is refused at its key.
    #[test]
    fn sequence_mode_per_route() {
        use super::SequenceMode;
        let c = Config::parse(ROUTES, Path::new(".")).expect("parses");
        assert_eq!(c.routes[1].sequence, SequenceMode::Optional);
        let required = format!("{ROUTES}sequence = \"required\"\n");
        let c = Config::parse(&required, Path::new(".")).expect("parses");
        assert_eq!(c.routes[1].sequence, SequenceMode::Required);
        assert!(c.describe().contains(" · sequence required"));
        let explicit = format!("{ROUTES}sequence = \"optional\"\n");
        let c = Config::parse(&explicit, Path::new(".")).expect("parses");
        assert_eq!(c.routes[1].sequence, SequenceMode::Optional);
        let bad = format!("{ROUTES}sequence = \"always\"\n");
        let errs = Config::parse(&bad, Path::new(".")).unwrap_err().0;
        assert_eq!(errs[0].path, "route[1].sequence");
        assert_eq!(
            errs[0].message,
            "`always`: expected \"optional\" or \"required\""
        );
        let unfenced = format!("{ROUTES}fenced = false\nsequence = \"required\"\n");
        let errs = Config::parse(&unfenced, Path::new(".")).unwrap_err().0;
        assert_eq!(errs[0].path, "route[1].sequence", "{errs:?}");
    }

    #[test]
    fn unknown_errors_dialect_is_refused_at_its_key() {
        let bad = format!("{ROUTES}errors = \"xml\"\n");
        let errs = Config::parse(&bad, Path::new(".")).unwrap_err().0;
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].path, "route[1].errors");
        assert_eq!(errs[0].message, "`xml`: expected \"problem\" or \"s3\"");
        let typed = format!("{ROUTES}errors = 3\n");
        let errs = Config::parse(&typed, Path::new(".")).unwrap_err().0;
        assert_eq!(errs[0].path, "route[1]", "{errs:?}");
    }
}
