//! One `[[route]]` table read into a [`Route`], each mistake pushed at its key, and the
//! `[[route]]` array as a whole (names unique, the rules across routes of `checks`).

use http::Method;

use super::upstream::UpstreamDraft;
use super::{Api, ProofMode, RawRoute, Route, SequenceMode, api, checks};
use crate::config::error::Errors;
use crate::config::value::{array, parse_size, section};
use crate::fence::policy::EqualPolicy;
use crate::proxy::idempotency::config::{Mode, OnUnknown};
use crate::proxy::problem::Dialect;
use crate::route::{PathTemplate, ScopeTemplate};

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
    checks::never_matched(&routes, &positions, errors);
    checks::shadowed_s3(&routes, &positions, errors);
    checks::one_policy_per_scope(&routes, &positions, errors);
    for c in checks::host_chosen_scopes(&routes, cx.upstreams) {
        errors.push(format!("route[{}]", positions[c.second]), c.message);
    }
    routes
}
/// One `[[route]]`, or `None` when it has errors (each pushed at its key, in the order of
/// the keys below).
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
    let fenced = raw.fenced.unwrap_or(true);
    let (template, scope) = templates(&raw, fenced, path, errors);
    let upstream = upstreams.iter().position(|u| u.name == raw.upstream);
    if upstream.is_none() {
        errors.push(
            format!("{path}.upstream"),
            format!("no upstream named `{}`", raw.upstream),
        );
    }
    let api = api_of(
        &raw,
        (template.as_ref(), scope.as_ref()),
        fenced,
        path,
        errors,
    );
    let host = raw
        .host
        .as_deref()
        .map(|h| route_host(h, &api, path, errors));
    let methods = methods(&raw, fenced, path, errors);
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
    let (proof, sequence) = token_modes(&raw, fenced, path, errors);
    let errors_in = dialect(&raw, &api, path, errors);
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

/// The route's path template and its scope template (`-` on a pass-through route that
/// names none).
fn templates(
    raw: &RawRoute,
    fenced: bool,
    path: &str,
    errors: &mut Errors,
) -> (Option<PathTemplate>, Option<ScopeTemplate>) {
    let template = PathTemplate::parse(&raw.path)
        .map_err(|e| errors.push(format!("{path}.path"), format!("`{}` {e}", raw.path)))
        .ok();
    let scope = match (&template, &raw.scope) {
        (Some(t), Some(s)) => ScopeTemplate::parse(s, t)
            .map_err(|e| errors.push(format!("{path}.scope"), e.to_string()))
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
    (template, scope)
}

/// The route's `api` with its own keys checked; a tree's scope must say it, and the S3
/// keys are for S3 routes only.
fn api_of(
    raw: &RawRoute,
    (template, scope): (Option<&PathTemplate>, Option<&ScopeTemplate>),
    fenced: bool,
    path: &str,
    errors: &mut Errors,
) -> Api {
    let api = match raw.api.as_deref() {
        None => Api::Unspecified,
        Some("plain") => Api::Plain,
        Some("s3") => Api::S3(api::s3_api(raw, template, fenced, path, errors)),
        Some("webdav") => {
            api::webdav_api(raw, template, scope, fenced, path, errors);
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
        && let (Some(t), Some(s)) = (template, scope)
        && checks::ends_with_rest(t, s)
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
    api
}

/// The route's `host`, kept as the router compares it: lowercase, without a trailing dot.
fn route_host(h: &str, api: &Api, path: &str, errors: &mut Errors) -> String {
    let h = h.to_ascii_lowercase();
    // An S3 route's endpoint may carry a port: the Host its clients send (its S3
    // table keeps it whole); it routes by the name.
    if let Api::S3(s3) = api {
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
}

/// The route's `methods`, upper-case HTTP methods, not empty on a fenced route.
fn methods(raw: &RawRoute, fenced: bool, path: &str, errors: &mut Errors) -> Option<Vec<Method>> {
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
    raw.methods.as_ref().map(|list| {
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
    })
}

/// What the route asks for beside the token: `proof` and `sequence`, each "required" on
/// fenced routes only.
fn token_modes(
    raw: &RawRoute,
    fenced: bool,
    path: &str,
    errors: &mut Errors,
) -> (ProofMode, SequenceMode) {
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
    (proof, sequence)
}

/// The dialect of the route's refusals (`errors`).
fn dialect(raw: &RawRoute, api: &Api, path: &str, errors: &mut Errors) -> Dialect {
    // An S3 route answers in S3's dialect unless told otherwise: its clients are S3 SDKs.
    let default_errors = if matches!(api, Api::S3(_)) && raw.errors.is_none() {
        Some("s3")
    } else {
        raw.errors.as_deref()
    };
    Dialect::from_option(default_errors).unwrap_or_else(|| {
        errors.push(
            format!("{path}.errors"),
            format!(
                "`{}`: expected \"problem\" or \"s3\"",
                raw.errors.as_deref().unwrap_or_default()
            ),
        );
        Dialect::Problem
    })
}
