//! The one place that turns fencegate's own decisions into HTTP responses (RFC 9457
//! problem+json with a `Fencing-Result` header), so statuses stay consistent.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};

use crate::proxy::Body;
use crate::token::Token;

pub const FENCING_RESULT: http::HeaderName = http::HeaderName::from_static("fencing-result");

/// Everything fencegate can answer by itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Stale {
        scope: String,
        token: Token,
        highest: Option<Token>,
    },
    MissingToken {
        scope: String,
    },
    InvalidToken {
        scope: String,
        detail: String,
    },
    ScopeMismatch {
        scope: String,
        token: Token,
    },
    InvalidPath {
        detail: String,
    },
    InvalidRequest {
        detail: String,
    },
    /// CONNECT: a tunnel would be an unfenced path.
    MethodNotAllowed,
    NoRoute,
    Draining {
        scope: String,
        token: Token,
        highest: Option<Token>,
    },
    Unavailable {
        scope: String,
        token: Token,
    },
    UpstreamUnavailable {
        scope: Option<String>,
        detail: String,
    },
    UpstreamTimeout {
        scope: Option<String>,
        detail: String,
    },
    /// The body is larger than the route's `max_body`.
    PayloadTooLarge {
        limit: u64,
    },
    /// `proof = "required"` and the `Fencing-Proof` is missing, malformed, signed by an
    /// unknown key, or made for another scope or token (SPEC §9).
    InvalidProof {
        scope: String,
        token: Token,
        detail: String,
    },
    /// The same Idempotency-Key is still in flight.
    InProgress {
        scope: String,
        token: Token,
    },
    /// The same Idempotency-Key came with a different request.
    KeyReused {
        scope: String,
        token: Token,
    },
    /// The first attempt with this key ended without a response: it may or may not
    /// have been applied, and the route refuses to guess.
    OutcomeUnknown {
        scope: String,
        token: Token,
    },
}

impl Outcome {
    pub fn result(&self) -> &'static str {
        match self {
            Outcome::Stale { .. } => "stale_fence",
            Outcome::MissingToken { .. } => "missing_token",
            Outcome::InvalidToken { .. } => "invalid_token",
            Outcome::ScopeMismatch { .. } => "scope_mismatch",
            Outcome::InvalidPath { .. } => "invalid_path",
            Outcome::InvalidRequest { .. } | Outcome::MethodNotAllowed => "invalid_request",
            Outcome::NoRoute => "no_route",
            Outcome::Draining { .. } => "draining",
            Outcome::Unavailable { .. } => "unavailable",
            Outcome::UpstreamUnavailable { .. } => "upstream_unavailable",
            Outcome::UpstreamTimeout { .. } => "upstream_timeout",
            Outcome::PayloadTooLarge { .. } => "payload_too_large",
            Outcome::InvalidProof { .. } => "invalid_proof",
            Outcome::InProgress { .. } => "in_progress",
            Outcome::KeyReused { .. } => "key_reused",
            Outcome::OutcomeUnknown { .. } => "outcome_unknown",
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Outcome::Stale { .. } | Outcome::ScopeMismatch { .. } => StatusCode::CONFLICT,
            Outcome::MissingToken { .. } => StatusCode::PRECONDITION_REQUIRED,
            Outcome::InvalidToken { .. }
            | Outcome::InvalidPath { .. }
            | Outcome::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            Outcome::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Outcome::NoRoute => StatusCode::NOT_FOUND,
            Outcome::Draining { .. } | Outcome::Unavailable { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Outcome::UpstreamUnavailable { .. } => StatusCode::BAD_GATEWAY,
            Outcome::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            Outcome::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Outcome::InProgress { .. } | Outcome::OutcomeUnknown { .. } => StatusCode::CONFLICT,
            Outcome::KeyReused { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            Outcome::InvalidProof { .. } => StatusCode::FORBIDDEN,
        }
    }

    fn title(&self) -> std::borrow::Cow<'static, str> {
        match self {
            Outcome::Stale { .. } => {
                "A newer lock generation reached this scope; discard this work and re-acquire"
                    .into()
            }
            Outcome::MissingToken { .. } => "This method needs a fencing token".into(),
            Outcome::InvalidToken { detail, .. } => {
                format!("Malformed fencing token: {detail}").into()
            }
            Outcome::ScopeMismatch { .. } => {
                "Fencing-Scope does not match the scope of this request".into()
            }
            Outcome::InvalidPath { detail } => format!("Non-canonical or unsafe path: {detail}").into(),
            Outcome::InvalidRequest { detail } => format!("Refused: {detail}").into(),
            Outcome::MethodNotAllowed => "CONNECT is not proxied".into(),
            Outcome::NoRoute => "No route matches this request".into(),
            Outcome::Draining { .. } => {
                "An older generation is still in flight for this scope; retry with the same token"
                    .into()
            }
            Outcome::Unavailable { .. } => {
                "The fencing mark could not be made durable; retry with the same token".into()
            }
            Outcome::UpstreamUnavailable { detail, .. } => {
                format!("The upstream could not be reached: {detail}").into()
            }
            Outcome::InvalidProof { detail, .. } => format!(
                "The fencing token needs a proof from the lock authority for this scope and token: {detail}"
            )
            .into(),
            Outcome::InProgress { .. } => {
                "A request with this Idempotency-Key is still in flight; retry later".into()
            }
            Outcome::KeyReused { .. } => {
                "This Idempotency-Key was used for a different request".into()
            }
            Outcome::OutcomeUnknown { .. } => "The first attempt with this Idempotency-Key ended without a response; it may or may not have been applied. Check the resource, then retry with a new key".into(),
            Outcome::PayloadTooLarge { limit } => {
                format!("The request body is larger than this route allows ({limit} bytes)").into()
            }
            Outcome::UpstreamTimeout { detail, .. } => {
                format!(
                    "The upstream did not answer; the request may or may not have been applied: {detail}"
                ).into()
            }
        }
    }

    fn retry_after(&self) -> Option<u64> {
        match self {
            Outcome::Draining { .. } | Outcome::InProgress { .. } => Some(1),
            Outcome::Unavailable { .. } => Some(5),
            _ => None,
        }
    }

    /// The scope, token and highest accepted token the outcome names.
    pub fn fields(&self) -> (Option<&String>, Option<&Token>, Option<Token>) {
        match self {
            Outcome::Stale {
                scope,
                token,
                highest,
            }
            | Outcome::Draining {
                scope,
                token,
                highest,
            } => (Some(scope), Some(token), *highest),
            Outcome::ScopeMismatch { scope, token }
            | Outcome::Unavailable { scope, token }
            | Outcome::InProgress { scope, token }
            | Outcome::KeyReused { scope, token }
            | Outcome::OutcomeUnknown { scope, token }
            | Outcome::InvalidProof { scope, token, .. } => (Some(scope), Some(token), None),
            Outcome::MissingToken { scope } | Outcome::InvalidToken { scope, .. } => {
                (Some(scope), None, None)
            }
            Outcome::UpstreamUnavailable { scope, .. } | Outcome::UpstreamTimeout { scope, .. } => {
                (scope.as_ref(), None, None)
            }
            _ => (None, None, None),
        }
    }

    pub fn into_response(self) -> Response<Body> {
        let fields = self.fields();
        // Written directly into one buffer, not through a JSON value or `fmt`: a stale
        // storm is answered at the rate this runs.
        let result = self.result();
        let mut body: Vec<u8> = Vec::with_capacity(320);
        body.extend_from_slice(b"{\"type\":\"urn:fencegate:");
        body.extend_from_slice(result.as_bytes());
        body.extend_from_slice(b"\",\"title\":");
        json_string(&mut body, &self.title());
        body.extend_from_slice(b",\"status\":");
        body.extend_from_slice(self.status().as_str().as_bytes());
        body.extend_from_slice(b",\"result\":\"");
        body.extend_from_slice(result.as_bytes());
        body.push(b'"');
        if let Some(scope) = fields.0 {
            body.extend_from_slice(b",\"scope\":");
            json_string(&mut body, scope);
        }
        if let Some(t) = fields.1 {
            body.extend_from_slice(b",\"token\":\"");
            t.write_to(&mut body);
            body.push(b'"');
        }
        if let Some(h) = fields.2 {
            body.extend_from_slice(b",\"highest_accepted\":\"");
            h.write_to(&mut body);
            body.push(b'"');
        }
        body.push(b'}');
        let bytes = Bytes::from(body);
        let mut resp = Response::new(Full::new(bytes).map_err(|e| match e {}).boxed());
        *resp.status_mut() = self.status();
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        h.insert(FENCING_RESULT, HeaderValue::from_static(self.result()));
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(secs) = self.retry_after() {
            h.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

/// `v` as a JSON string. Text without quotes, backslashes or control characters (every
/// title, almost every scope) is copied as it is; the rest goes through serde_json.
fn json_string(out: &mut Vec<u8>, v: &str) {
    if v.bytes()
        .all(|b| b >= 0x20 && b != b'"' && b != b'\\' && b != 0x7f)
    {
        out.push(b'"');
        out.extend_from_slice(v.as_bytes());
        out.push(b'"');
    } else if serde_json::to_writer(&mut *out, v).is_err() {
        out.extend_from_slice(b"\"\"");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body_of(outcome: Outcome) -> serde_json::Value {
        let resp = outcome.into_response();
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        serde_json::from_slice(&bytes).expect("problem+json parses")
    }

    #[tokio::test]
    async fn bodies_are_json_whatever_the_scope_holds() {
        for scope in ["report/july", "a\"b\\c", "ctl\u{1}\u{7f}x", "é/ü 中"] {
            let v = body_of(Outcome::Stale {
                scope: scope.into(),
                token: Token::new(3, 7),
                highest: Some(Token::new(0, 12_345_678_901)),
            })
            .await;
            assert_eq!(v["scope"], scope);
            assert_eq!(v["token"], "3:7");
            assert_eq!(v["highest_accepted"], "12345678901");
            assert_eq!(v["status"], 409);
            assert_eq!(v["result"], "stale_fence");
            assert_eq!(v["type"], "urn:fencegate:stale_fence");
        }
        let v = body_of(Outcome::InvalidPath {
            detail: "bad \"escape\"".into(),
        })
        .await;
        assert_eq!(v["title"], "Non-canonical or unsafe path: bad \"escape\"");
        assert!(v.get("scope").is_none());
    }
}
