//! The `Idempotency-Key` header's value: a structured-field string, unquoted.

use http::{HeaderValue, Request};

use super::Mode;
use crate::proxy::Outcome;
use crate::proxy::config::Route;

/// Why an `Idempotency-Key` value is refused (its text is the refusal's detail).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    #[error("Idempotency-Key must be a quoted string of printable ASCII, e.g. \"8e03978e-40d5\"")]
    NotAString,
    #[error("Idempotency-Key must have 1 to 255 characters")]
    Length,
}

/// Parses an `Idempotency-Key` value: a structured-field string (`"..."`), 1–255
/// printable ASCII characters.
pub fn parse_key(raw: &HeaderValue) -> Result<String, KeyError> {
    let bad = || KeyError::NotAString;
    let s = raw.to_str().map_err(|_| bad())?;
    let inner = s
        .strip_prefix('"')
        .and_then(|s| s.strip_suffix('"'))
        .ok_or_else(bad)?;
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(e @ ('"' | '\\')) => out.push(e),
                _ => return Err(bad()),
            },
            '"' => return Err(bad()),
            ' '..='~' => out.push(c),
            _ => return Err(bad()),
        }
    }
    if out.is_empty() || out.len() > 255 {
        return Err(KeyError::Length);
    }
    Ok(out)
}

/// The request's key (the key phase): `None` when it has none and its route lets it go
/// without one; a refusal when its route requires one, or its key is not one.
pub(super) fn of<B>(route: &Route, req: &Request<B>) -> Result<Option<String>, Outcome> {
    let mut keys = req.headers().get_all("idempotency-key").iter();
    match (keys.next(), keys.next()) {
        (None, _) => {
            if route.idempotency == Mode::Required && route.fences_method(req.method()) {
                return Err(Outcome::InvalidRequest {
                    detail: "this route requires an Idempotency-Key header".into(),
                });
            }
            Ok(None)
        }
        (Some(_), Some(_)) => Err(Outcome::InvalidRequest {
            detail: "more than one Idempotency-Key header".into(),
        }),
        (Some(v), None) => parse_key(v).map(Some).map_err(|e| Outcome::InvalidRequest {
            detail: e.to_string(),
        }),
    }
}
