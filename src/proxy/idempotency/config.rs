//! `[idempotency]` and the routes' `idempotency` / `idempotency_unknown` options.

use std::time::Duration;

use serde::Deserialize;

use crate::config::error::Errors;
use crate::config::value::{duration, size};
use crate::store::quota::Usage;

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
    /// Records on disk, over the whole store (`max_records`, `max_record_bytes`).
    pub max_records: Usage,
    /// Records on disk per scope (`max_records_per_scope`, `max_record_bytes_per_scope`).
    pub max_records_per_scope: Usage,
    /// Records on disk per client address (`max_records_per_client`,
    /// `max_record_bytes_per_client`).
    pub max_records_per_client: Usage,
}

/// Bytes a record's response head may take beyond its body, counted for it until it
/// completes.
pub const HEAD_ALLOWANCE: u64 = 64 << 10;

impl IdempotencyConfig {
    /// The bytes a record counts as from its claim until its completion is written.
    pub fn reserve(&self) -> u64 {
        self.max_response_body.saturating_add(HEAD_ALLOWANCE)
    }
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
    max_records: Option<u64>,
    max_record_bytes: Option<String>,
    max_records_per_scope: Option<u64>,
    max_record_bytes_per_scope: Option<String>,
    max_records_per_client: Option<u64>,
    max_record_bytes_per_client: Option<String>,
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
            max_records: Usage {
                records: raw.max_records.unwrap_or(1_000_000),
                bytes: size(
                    raw.max_record_bytes.as_deref(),
                    4 << 30,
                    "idempotency.max_record_bytes",
                    errors,
                ),
            },
            max_records_per_scope: Usage {
                records: raw.max_records_per_scope.unwrap_or(10_000),
                bytes: size(
                    raw.max_record_bytes_per_scope.as_deref(),
                    256 << 20,
                    "idempotency.max_record_bytes_per_scope",
                    errors,
                ),
            },
            max_records_per_client: Usage {
                records: raw.max_records_per_client.unwrap_or(10_000),
                bytes: size(
                    raw.max_record_bytes_per_client.as_deref(),
                    256 << 20,
                    "idempotency.max_record_bytes_per_client",
                    errors,
                ),
            },
        };
        let reserve = idempotency.reserve();
        for (name, bound) in [
            ("", idempotency.max_records),
            ("_per_scope", idempotency.max_records_per_scope),
            ("_per_client", idempotency.max_records_per_client),
        ] {
            if bound.records == 0 {
                errors.push(
                    format!("idempotency.max_records{name}"),
                    "must be at least 1 (a route that wants no records has idempotency = \"off\")",
                );
            }
            if bound.bytes < reserve {
                errors.push(
                    format!("idempotency.max_record_bytes{name}"),
                    format!(
                        "{} bytes is less than one record may take (idempotency.max_response_body plus 64 KiB of head: {reserve} bytes): no key would ever be recorded",
                        bound.bytes
                    ),
                );
            }
        }
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
