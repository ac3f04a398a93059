//! The one place that turns fencegate's own decisions into HTTP responses (RFC 9457
//! problem+json with a `Fencing-Result` header, or on an `errors = "s3"` route an S3 XML
//! error document), so statuses and headers stay the same in every dialect.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};

use crate::proxy::Body;
use crate::token::Token;

pub const FENCING_RESULT: http::HeaderName = http::HeaderName::from_static("fencing-result");

/// The body a route's refusals are written in (`[[route]] errors`). Status and headers
/// are the same in both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Dialect {
    /// RFC 9457 `application/problem+json`.
    #[default]
    Problem,
    /// An S3 `<Error>` document (`application/xml`), so S3 SDKs surface the code.
    S3,
}

impl Dialect {
    /// The config value, `None` for an unknown one.
    pub fn from_option(v: Option<&str>) -> Option<Dialect> {
        match v {
            None | Some("problem") => Some(Dialect::Problem),
            Some("s3") => Some(Dialect::S3),
            Some(_) => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::Problem => "problem",
            Dialect::S3 => "s3",
        }
    }
}

/// Everything fencegate can answer by itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Stale {
        scope: String,
        token: Token,
        highest: Option<Token>,
    },
    /// The request's `Fencing-Sequence` is not above the highest recorded for its token
    /// on this scope (SPEC §11).
    StaleSequence {
        scope: String,
        token: Token,
        sequence: u64,
        highest_sequence: u64,
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
    /// A new Idempotency-Key past a bound on the records kept (the store's, the scope's,
    /// the client's, or the volume's free space): nothing was recorded or forwarded.
    KeyRejected {
        scope: String,
        token: Token,
        detail: &'static str,
    },
    /// The objects one request changes fall in more than one scope (SPEC §15, §16): a
    /// token is for one lock.
    MultiScope {
        detail: String,
    },
    /// A DELETE, MOVE or COPY that may change a collection's members while one of them is
    /// fenced under a scope of its own (SPEC §16): answered 409, as the collection's
    /// state (members fenced by other locks) is what conflicts.
    FencedBeneath {
        scope: String,
        token: Token,
        detail: String,
    },
    /// A change the route has no scope to fence (SPEC §15: a request on an S3 bucket
    /// without `bucket_scope`): refused, never passed unfenced.
    UnfencedOperation {
        detail: String,
    },
    /// An S3 request names a multipart upload that was not created through the fence in
    /// its scope, or that has expired (SPEC §15).
    UnknownUpload {
        scope: String,
        detail: String,
    },
    /// A body the fence reads to know what a request changes is not one the API takes
    /// (`code`: the API's own error code, e.g. S3's `MalformedXML`).
    MalformedBody {
        code: &'static str,
        detail: String,
    },
}

impl Outcome {
    pub fn result(&self) -> &'static str {
        match self {
            Outcome::Stale { .. } => "stale_fence",
            Outcome::StaleSequence { .. } => "stale_sequence",
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
            Outcome::KeyRejected { .. } => "key_rejected",
            Outcome::MultiScope { .. } | Outcome::FencedBeneath { .. } => "multi_scope",
            Outcome::UnfencedOperation { .. } => "unfenced_operation",
            Outcome::MalformedBody { .. } => "invalid_request",
            Outcome::UnknownUpload { .. } => "unknown_upload",
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Outcome::Stale { .. }
            | Outcome::StaleSequence { .. }
            | Outcome::ScopeMismatch { .. }
            | Outcome::FencedBeneath { .. } => StatusCode::CONFLICT,
            Outcome::MissingToken { .. } => StatusCode::PRECONDITION_REQUIRED,
            Outcome::InvalidToken { .. }
            | Outcome::InvalidPath { .. }
            | Outcome::InvalidRequest { .. }
            | Outcome::MultiScope { .. }
            | Outcome::MalformedBody { .. } => StatusCode::BAD_REQUEST,
            Outcome::UnfencedOperation { .. } => StatusCode::FORBIDDEN,
            Outcome::UnknownUpload { .. } => StatusCode::NOT_FOUND,
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
            Outcome::KeyRejected { .. } => StatusCode::TOO_MANY_REQUESTS,
            Outcome::InvalidProof { .. } => StatusCode::FORBIDDEN,
        }
    }

    fn title(&self) -> std::borrow::Cow<'static, str> {
        match self {
            Outcome::Stale { .. } => {
                "A newer lock generation reached this scope; discard this work and re-acquire"
                    .into()
            }
            Outcome::StaleSequence { .. } => {
                "A request of this token with a higher Fencing-Sequence was accepted first; this one is out of order".into()
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
            Outcome::MultiScope { detail } => {
                format!("The request changes objects of more than one scope: {detail}").into()
            }
            Outcome::UnfencedOperation { detail } => {
                format!("No scope of this route fences this request: {detail}").into()
            }
            Outcome::FencedBeneath { detail, .. } => {
                format!("The request changes objects of more than one scope: {detail}").into()
            }
            Outcome::UnknownUpload { detail, .. } => {
                format!("No such multipart upload in this scope: {detail}").into()
            }
            Outcome::MalformedBody { detail, .. } => {
                format!("The request body is not one this API takes: {detail}").into()
            }
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
            Outcome::KeyRejected { detail, .. } => format!(
                "No room to record this Idempotency-Key ({detail}); nothing was forwarded. Retry after Retry-After, when older records have expired"
            )
            .into(),
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
            // Room comes back as records expire, collected once a minute.
            Outcome::KeyRejected { .. } => Some(60),
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
            | Outcome::StaleSequence { scope, token, .. }
            | Outcome::Unavailable { scope, token }
            | Outcome::InProgress { scope, token }
            | Outcome::KeyReused { scope, token }
            | Outcome::OutcomeUnknown { scope, token }
            | Outcome::KeyRejected { scope, token, .. }
            | Outcome::InvalidProof { scope, token, .. }
            | Outcome::FencedBeneath { scope, token, .. } => (Some(scope), Some(token), None),
            Outcome::MissingToken { scope }
            | Outcome::InvalidToken { scope, .. }
            | Outcome::UnknownUpload { scope, .. } => (Some(scope), None, None),
            Outcome::UpstreamUnavailable { scope, .. } | Outcome::UpstreamTimeout { scope, .. } => {
                (scope.as_ref(), None, None)
            }
            _ => (None, None, None),
        }
    }

    /// The presented and the highest recorded `Fencing-Sequence` of a `stale_sequence`.
    pub fn sequences(&self) -> Option<(u64, u64)> {
        match self {
            Outcome::StaleSequence {
                sequence,
                highest_sequence,
                ..
            } => Some((*sequence, *highest_sequence)),
            _ => None,
        }
    }

    /// The S3 error code of this outcome on an `errors = "s3"` route. S3's own code where
    /// one means the same (an SDK already knows it: botocore's standard and adaptive retry
    /// modes retry `SlowDown` by its code, besides the 503), else a fencegate code in S3's
    /// style.
    pub fn s3_code(&self) -> &'static str {
        match self {
            Outcome::Stale { .. } => "StaleFence",
            Outcome::StaleSequence { .. } => "StaleFencingSequence",
            Outcome::MissingToken { .. } => "MissingFencingToken",
            Outcome::InvalidToken { .. } => "InvalidFencingToken",
            Outcome::ScopeMismatch { .. } => "FencingScopeMismatch",
            Outcome::InvalidPath { .. } => "InvalidURI",
            Outcome::InvalidRequest { .. } => "InvalidRequest",
            Outcome::MethodNotAllowed => "MethodNotAllowed",
            Outcome::NoRoute => "NoSuchRoute",
            // Retry with the same token after Retry-After: S3's "reduce your request rate".
            Outcome::Draining { .. } => "SlowDown",
            Outcome::Unavailable { .. } => "ServiceUnavailable",
            Outcome::UpstreamUnavailable { .. } => "BadGateway",
            Outcome::UpstreamTimeout { .. } => "GatewayTimeout",
            Outcome::PayloadTooLarge { .. } => "EntityTooLarge",
            Outcome::InvalidProof { .. } => "InvalidProof",
            // S3's "a conflicting operation is in progress; try again".
            Outcome::InProgress { .. } => "OperationAborted",
            Outcome::KeyReused { .. } => "IdempotencyKeyReused",
            Outcome::OutcomeUnknown { .. } => "IdempotencyOutcomeUnknown",
            // Not S3's own (its `SlowDown` is a 503, said by `draining`), but one of the
            // throttling codes botocore's standard and adaptive retry modes back off on.
            Outcome::KeyRejected { .. } => "TooManyRequestsException",
            Outcome::MultiScope { .. } => "MultiScope",
            Outcome::FencedBeneath { .. } => "MembersFencedBeneath",
            Outcome::UnfencedOperation { .. } => "UnfencedOperation",
            Outcome::MalformedBody { code, .. } => code,
            // S3's own: the SDKs know it.
            Outcome::UnknownUpload { .. } => "NoSuchUpload",
        }
    }

    /// The response in the route's dialect. `resource` is the request's path, and
    /// `request_id` its `X-Request-Id`, where the caller has them; both are named only in
    /// the S3 document (and left out when not given).
    pub fn into_response_in(
        self,
        dialect: Dialect,
        resource: Option<&str>,
        request_id: Option<&HeaderValue>,
    ) -> Response<Body> {
        match dialect {
            Dialect::Problem => self.into_response(),
            Dialect::S3 => {
                let body = self.s3_body(resource, request_id.map(HeaderValue::as_bytes));
                self.respond(body, "application/xml")
            }
        }
    }

    fn s3_body(&self, resource: Option<&str>, request_id: Option<&[u8]>) -> Vec<u8> {
        let (scope, token, highest) = self.fields();
        let mut body: Vec<u8> = Vec::with_capacity(480);
        body.extend_from_slice(b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>");
        body.extend_from_slice(self.s3_code().as_bytes());
        body.extend_from_slice(b"</Code><Message>");
        xml_text(&mut body, &self.title());
        body.extend_from_slice(b"</Message>");
        if let Some(resource) = resource {
            body.extend_from_slice(b"<Resource>");
            xml_text(&mut body, resource);
            body.extend_from_slice(b"</Resource>");
        }
        if let Some(id) = request_id {
            body.extend_from_slice(b"<RequestId>");
            xml_text(&mut body, &String::from_utf8_lossy(id));
            body.extend_from_slice(b"</RequestId>");
        }
        body.extend_from_slice(b"<FencingResult>");
        body.extend_from_slice(self.result().as_bytes());
        body.extend_from_slice(b"</FencingResult>");
        if let Some(scope) = scope {
            body.extend_from_slice(b"<Scope>");
            xml_text(&mut body, scope);
            body.extend_from_slice(b"</Scope>");
        }
        if let Some(t) = token {
            body.extend_from_slice(b"<Presented>");
            t.write_to(&mut body);
            body.extend_from_slice(b"</Presented>");
        }
        if let Some(h) = highest {
            body.extend_from_slice(b"<HighestAccepted>");
            h.write_to(&mut body);
            body.extend_from_slice(b"</HighestAccepted>");
        }
        if let Some((presented, highest)) = self.sequences() {
            body.extend_from_slice(b"<Sequence>");
            body.extend_from_slice(presented.to_string().as_bytes());
            body.extend_from_slice(b"</Sequence><HighestSequence>");
            body.extend_from_slice(highest.to_string().as_bytes());
            body.extend_from_slice(b"</HighestSequence>");
        }
        if let Outcome::PayloadTooLarge { limit } = self {
            // S3's own element for EntityTooLarge.
            body.extend_from_slice(b"<MaxSizeAllowed>");
            body.extend_from_slice(limit.to_string().as_bytes());
            body.extend_from_slice(b"</MaxSizeAllowed>");
        }
        body.extend_from_slice(b"</Error>");
        body
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
        // As strings, as tokens are: a u64 is beyond what JSON numbers carry exactly.
        if let Some((presented, highest)) = self.sequences() {
            body.extend_from_slice(b",\"sequence\":\"");
            body.extend_from_slice(presented.to_string().as_bytes());
            body.extend_from_slice(b"\",\"highest_sequence\":\"");
            body.extend_from_slice(highest.to_string().as_bytes());
            body.push(b'"');
        }
        body.push(b'}');
        self.respond(body, "application/problem+json")
    }

    /// `body` with the outcome's status and headers, the same in every dialect.
    fn respond(&self, body: Vec<u8>, content_type: &'static str) -> Response<Body> {
        let bytes = Bytes::from(body);
        let mut resp = Response::new(Full::new(bytes).map_err(|e| match e {}).boxed());
        *resp.status_mut() = self.status();
        let h = resp.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
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

/// `v` as XML character data (element text or attribute value): `&`, `<`, `>`, `"` and
/// `'` escaped, `\r` as a reference (a parser would turn a bare one into `\n`), and the
/// characters XML 1.0 cannot carry at all (other C0 controls, U+FFFE, U+FFFF) replaced
/// by U+FFFD.
fn xml_text(out: &mut Vec<u8>, v: &str) {
    if v.bytes()
        .all(|b| b >= 0x20 && !matches!(b, b'&' | b'<' | b'>' | b'"' | b'\'' | 0xef))
    {
        out.extend_from_slice(v.as_bytes());
        return;
    }
    for c in v.chars() {
        match c {
            '&' => out.extend_from_slice(b"&amp;"),
            '<' => out.extend_from_slice(b"&lt;"),
            '>' => out.extend_from_slice(b"&gt;"),
            '"' => out.extend_from_slice(b"&quot;"),
            '\'' => out.extend_from_slice(b"&apos;"),
            '\r' => out.extend_from_slice(b"&#13;"),
            '\t' | '\n' => out.push(c as u8),
            '\u{0}'..='\u{1f}' | '\u{fffe}' | '\u{ffff}' => {
                out.extend_from_slice("\u{fffd}".as_bytes());
            }
            c => {
                let mut buf = [0; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
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
        let v = body_of(Outcome::StaleSequence {
            scope: "report/july".into(),
            token: Token::new(0, 7),
            sequence: 1,
            highest_sequence: u64::MAX,
        })
        .await;
        assert_eq!(v["status"], 409);
        assert_eq!(v["result"], "stale_sequence");
        assert_eq!(v["token"], "7");
        assert_eq!(v["sequence"], "1");
        assert_eq!(v["highest_sequence"], "18446744073709551615");
        let v = body_of(Outcome::InvalidPath {
            detail: "bad \"escape\"".into(),
        })
        .await;
        assert_eq!(v["title"], "Non-canonical or unsafe path: bad \"escape\"");
        assert!(v.get("scope").is_none());
    }
}

#[cfg(test)]
mod s3_tests;
