//! `[idempotency]` and the routes' `idempotency` / `idempotency_unknown` options.

use std::time::Duration;

use serde::Deserialize;

use crate::config::error::Errors;
use crate::config::value::{duration, size};

/// Route option `idempotency`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Off,
    /// A key is honoured when present.
    Optional,
    /// Fenced methods without a key are refused (400).
    Required,
}

impl Mode {
    /// The option of the route at `path` (`route[0]`).
    pub(crate) fn parse(raw: Option<&str>, path: &str, errors: &mut Errors) -> Mode {
        match raw {
            None | Some("off") => Mode::Off,
            Some("optional") => Mode::Optional,
            Some("required") => Mode::Required,
            Some(other) => {
                errors.push(
                    format!("{path}.idempotency"),
                    format!("`{other}`: expected \"off\", \"optional\" or \"required\""),
                );
                Mode::Off
            }
        }
    }
}

/// Route option `idempotency_unknown`: a retry whose first attempt ended without a
/// response (timeout, reset, crash) may or may not repeat an applied change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnUnknown {
    /// Answer 409 `outcome_unknown`: the client checks the resource, then decides.
    Refuse,
    /// Forward again: for upstreams whose operations are naturally idempotent.
    Forward,
}

impl OnUnknown {
    /// The option of the route at `path` (`route[0]`).
    pub(crate) fn parse(raw: Option<&str>, path: &str, errors: &mut Errors) -> OnUnknown {
        match raw {
            None | Some("refuse") => OnUnknown::Refuse,
            Some("forward") => OnUnknown::Forward,
            Some(other) => {
                errors.push(
                    format!("{path}.idempotency_unknown"),
                    format!("`{other}`: expected \"refuse\" or \"forward\""),
                );
                OnUnknown::Refuse
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyConfig {
    /// How long a record is kept; a retry after this is a new request.
    pub ttl: Duration,
    /// Largest request body that is fingerprinted (it is read before forwarding); 413 beyond.
    pub max_request_body: u64,
    /// Largest response body stored for replay; a larger one is replayed without a body.
    pub max_response_body: u64,
    /// Bytes of request and response bodies held in memory at once by requests with a
    /// key, over all connections; a request body that finds no room gets 503.
    pub max_buffered: u64,
    /// Request headers left out of the fingerprint besides the built-in ones
    /// (`fingerprint_ignore`): a deployment's own trace or transport headers, which vary
    /// between retries of one request and would make them `key_reused`.
    pub fingerprint_ignore: Ignored,
}

/// Header names (lowercase) and name prefixes (given as `prefix*`) left out of the
/// fingerprint, sorted, without repeats.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ignored {
    pub names: Vec<String>,
    pub prefixes: Vec<String>,
}

impl Ignored {
    /// Whether `name` (lowercase, as `http` keeps names) is on the list.
    pub fn covers(&self, name: &str) -> bool {
        self.names
            .binary_search_by(|n| n.as_str().cmp(name))
            .is_ok()
            || self.prefixes.iter().any(|p| name.starts_with(p.as_str()))
    }

    /// Parses `fingerprint_ignore`: each entry a lowercase header name, or a name prefix
    /// ending in `*` (not `*` alone: a fingerprint blind to every header answers a
    /// different request's retry `duplicate`).
    fn parse(raw: Vec<String>, errors: &mut Errors) -> Ignored {
        let mut ignored = Ignored::default();
        for (i, entry) in raw.into_iter().enumerate() {
            let path = format!("idempotency.fingerprint_ignore[{i}]");
            let (name, prefix) = match entry.strip_suffix('*') {
                Some(p) => (p, true),
                None => (entry.as_str(), false),
            };
            let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'+-.^_`|~".contains(&b);
            let problem = if name.is_empty() {
                Some("a header name, or a prefix of one followed by `*`; `*` alone would leave every header out".to_string())
            } else if name.bytes().any(|b| b.is_ascii_uppercase()) {
                Some(format!(
                    "`{entry}`: header names here are lowercase (`{}`); they match whatever their case in a request",
                    entry.to_ascii_lowercase()
                ))
            } else if !name.bytes().all(token) {
                Some(format!(
                    "`{entry}` is not a header name (letters, digits and !#$%&'+-.^_`|~), or a prefix of one followed by `*`"
                ))
            } else {
                None
            };
            if let Some(problem) = problem {
                errors.push(path, problem);
                continue;
            }
            let list = if prefix {
                &mut ignored.prefixes
            } else {
                &mut ignored.names
            };
            list.push(name.to_string());
        }
        ignored.names.sort();
        ignored.names.dedup();
        ignored.prefixes.sort();
        ignored.prefixes.dedup();
        ignored
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawIdempotency {
    ttl: Option<String>,
    max_request_body: Option<String>,
    max_response_body: Option<String>,
    max_buffered: Option<String>,
    fingerprint_ignore: Option<Vec<String>>,
}

impl IdempotencyConfig {
    /// Validates `[idempotency]`.
    pub(crate) fn parse(raw: RawIdempotency, errors: &mut Errors) -> IdempotencyConfig {
        let idempotency = IdempotencyConfig {
            ttl: duration(
                raw.ttl.as_deref(),
                Duration::from_secs(24 * 3600),
                "idempotency.ttl",
                errors,
            ),
            max_request_body: size(
                raw.max_request_body.as_deref(),
                8 << 20,
                "idempotency.max_request_body",
                errors,
            ),
            max_response_body: size(
                raw.max_response_body.as_deref(),
                1 << 20,
                "idempotency.max_response_body",
                errors,
            ),
            max_buffered: size(
                raw.max_buffered.as_deref(),
                128 << 20,
                "idempotency.max_buffered",
                errors,
            ),
            fingerprint_ignore: Ignored::parse(raw.fingerprint_ignore.unwrap_or_default(), errors),
        };
        if idempotency.max_buffered < idempotency.max_request_body {
            errors.push(
                "idempotency.max_buffered",
                format!(
                    "{} bytes is less than idempotency.max_request_body ({} bytes): a body that size could never be read",
                    idempotency.max_buffered, idempotency.max_request_body
                ),
            );
        }
        idempotency
    }
}
