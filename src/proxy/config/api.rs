//! The keys of a route that depend on its backend's API (SPEC §15, §16): an `api = "s3"`
//! route's S3 table, and what an `api = "webdav"` route must fence.

use super::{Keys, RawRoute, S3Api};
use crate::config::error::Errors;
use crate::route::{PathTemplate, ScopeTemplate, Segment};

/// What an `api = "webdav"` route needs (SPEC §16), each refusal pushed: fenced, DELETE,
/// MOVE and COPY among its fenced methods (a collection's must carry a token), and a
/// scope whose tree's marks can be found by prefix.
pub(super) fn webdav_api(
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
        && let Some(i) = super::checks::rest_capture(t)
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
pub(super) fn s3_api(
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
