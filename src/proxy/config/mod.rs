//! `[[upstream]]` and `[[route]]`: where the proxy sends requests and how it fences them.
//! Owned by the proxy, which is what reads them on every request (and swaps them on
//! reload); the path and scope templates themselves are [`crate::route`]'s. The tables'
//! types are here; `upstream` and `route` read one table each, `api` the S3 and WebDAV
//! keys of a route, and `checks` the rules across routes (shadowing, one scope per
//! object, one policy per scope).

use http::{Method, Uri};
use serde::Deserialize;

use crate::fence::policy::EqualPolicy;
use crate::proxy::idempotency::config::{Mode, OnUnknown};
use crate::proxy::problem::Dialect;
use crate::route::{PathTemplate, RouteMatch, ScopeTemplate};
use crate::tls::UpstreamTls;

mod api;
mod checks;
mod route;
mod upstream;

pub(crate) use route::{RouteContext, parse_routes};
pub(crate) use upstream::{UpstreamDraft, parse_upstreams};

#[derive(Debug, Clone)]
pub struct Upstream {
    pub name: String,
    /// Scheme and authority only; the request's path is appended byte for byte.
    pub url: Uri,
    pub timeout: std::time::Duration,
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
        self.api == Api::Webdav && checks::ends_with_rest(&self.path, &self.scope)
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

/// One `[[route]]` table as written, read by `route` (and by `api` for the API's keys).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoute {
    pub(super) name: String,
    pub(super) path: String,
    pub(super) scope: Option<String>,
    pub(super) upstream: String,
    pub(super) host: Option<String>,
    pub(super) fenced: Option<bool>,
    pub(super) methods: Option<Vec<String>>,
    pub(super) equal: Option<String>,
    pub(super) idempotency: Option<String>,
    pub(super) idempotency_unknown: Option<String>,
    pub(super) max_body: Option<String>,
    pub(super) proof: Option<String>,
    pub(super) sequence: Option<String>,
    pub(super) errors: Option<String>,
    pub(super) api: Option<String>,
    pub(super) virtual_host_domain: Option<String>,
    pub(super) bucket_scope: Option<String>,
    pub(super) keys: Option<String>,
}

#[cfg(test)]
mod tests;
