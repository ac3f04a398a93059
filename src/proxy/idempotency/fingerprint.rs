//! The fingerprint of a request with an `Idempotency-Key` (SPEC §4): what must be the same
//! for a retry to be answered with the first attempt's stored response.
//!
//! It covers the method, the target as received, the token, the body, and every request
//! header but those that only authenticate, describe the transport, or vary between an
//! SDK's retries of one request ([`IGNORED`], [`IGNORED_PREFIXES`], the names a request's
//! `Connection` lists, and `[idempotency] fingerprint_ignore`). A header left in that a
//! retry changes answers it `key_reused` (the client is told, and nothing is applied);
//! a header left out that changes the request would answer a different request
//! `duplicate`, which is never safe: the list leans to the first.

use http::HeaderName;
use http::request::Parts;
use sha2::{Digest, Sha256};

use super::config::Ignored;
use crate::token::Token;

/// The fingerprint's definition, stored with each record: a record whose version differs
/// was fingerprinted over other parts of its request, and its fingerprint says nothing
/// about a retry's (version 1, before this field: method, target, token and body, no
/// header). Bump it whenever what is hashed changes.
pub const VERSION: u32 = 2;

/// Header names (lowercase) left out of the fingerprint: they authenticate (a retry may be
/// signed anew, with a fresh date), describe the connection or the client, carry tracing
/// that changes per attempt, or are fencegate's own and covered otherwise.
pub const IGNORED: &[&str] = &[
    // Authentication and signing: SigV4 signs each attempt anew with its own date.
    "authorization",
    "proxy-authorization",
    "date",
    "x-amz-date",
    // The body's hash (or `UNSIGNED-PAYLOAD`): the body itself is covered.
    "x-amz-content-sha256",
    // A session token: renewed credentials sign the same request.
    "x-amz-security-token",
    // Transport and framing: the body is covered, whatever its framing.
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
    "expect",
    "host",
    "forwarded",
    "x-real-ip",
    "via",
    // The client, not the request.
    "user-agent",
    "x-amz-user-agent",
    // Tracing: a new span (or request id) per attempt.
    "traceparent",
    "tracestate",
    "baggage",
    "x-request-id",
    "x-amzn-trace-id",
    "b3",
    "uber-trace-id",
    // fencegate's own: the proof authenticates; the key names the record; the scope must
    // equal the record's; a retry of a request that may have been forwarded takes the
    // next `Fencing-Sequence` (SPEC §11). The token header is covered as its token.
    "fencing-proof",
    "idempotency-key",
    "fencing-scope",
    "fencing-sequence",
];

/// Header name prefixes left out: `Accept*` (what the client would like back), the AWS
/// SDKs' retry headers (`amz-sdk-invocation-id`, `amz-sdk-request`, `amz-sdk-retry`),
/// B3 trace headers and the forwarding headers a proxy in front adds.
pub const IGNORED_PREFIXES: &[&str] = &["accept", "amz-sdk-", "x-b3-", "x-forwarded-"];

/// The fingerprint of a request whose head is `parts`, whose token is `token` (its
/// header, `token_header`, is covered as the token, not as text) and whose body is
/// `body`, with `extra` the configured `fingerprint_ignore`.
pub fn fingerprint(
    parts: &Parts,
    token: Token,
    token_header: &HeaderName,
    body: &[u8],
    extra: &Ignored,
) -> String {
    let mut h = Sha256::new();
    let mut put = |part: &[u8]| {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    };
    // The version first: no record of another definition can match by accident (one of
    // version 1 over a request with no header left in would hash the same parts).
    put(&VERSION.to_be_bytes());
    // The configured list too: a change to it leaves earlier records matching nothing
    // (`key_reused`), rather than matching a request whose headers it no longer ignores.
    put(&(extra.names.len() as u64).to_be_bytes());
    for n in &extra.names {
        put(n.as_bytes());
    }
    put(&(extra.prefixes.len() as u64).to_be_bytes());
    for p in &extra.prefixes {
        put(p.as_bytes());
    }
    put(parts.method.as_str().as_bytes());
    // The path as forwarded, not its canonical form: two spellings that share a scope
    // may still name two objects (`x` and `x/` on an object store), and a retry that
    // respells its path is refused (422), never taken for another.
    put(parts.uri.path().as_bytes());
    put(parts.uri.query().unwrap_or("").as_bytes());
    put(token.to_string().as_bytes());
    let headers = canonical_headers(parts, token_header, extra);
    put(&(headers.len() as u64).to_be_bytes());
    for (name, value) in &headers {
        put(name.as_bytes());
        put(value);
    }
    put(body);
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The headers the fingerprint covers, in a canonical order: by name (lowercase), the
/// values of one name in the order they came. Reordered headers are the same request;
/// `Cookie` lines are joined as one (HTTP/2 sends one per cookie, HTTP/1.1 one in all).
fn canonical_headers(
    parts: &Parts,
    token_header: &HeaderName,
    extra: &Ignored,
) -> Vec<(String, Vec<u8>)> {
    let headers = &parts.headers;
    // Names the request's `Connection` lists are this hop's, and never forwarded.
    let listed: Vec<&[u8]> = headers
        .get_all(http::header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
        .collect();
    let ignored = |name: &HeaderName| {
        let name = name.as_str();
        IGNORED.contains(&name)
            || IGNORED_PREFIXES.iter().any(|p| name.starts_with(p))
            || name == token_header.as_str()
            || extra.covers(name)
            || listed
                .iter()
                .any(|l| l.eq_ignore_ascii_case(name.as_bytes()))
    };
    let mut out: Vec<(String, Vec<u8>)> = Vec::new();
    for name in headers.keys() {
        if ignored(name) {
            continue;
        }
        let values = headers.get_all(name).iter().map(|v| v.as_bytes());
        if name == http::header::COOKIE {
            out.push((
                name.as_str().to_string(),
                values.collect::<Vec<_>>().join(&b"; "[..]),
            ));
        } else {
            out.extend(values.map(|v| (name.as_str().to_string(), v.to_vec())));
        }
    }
    // Stable: the values of one name keep their order.
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut b = http::Request::builder().method("MOVE").uri("/tree/t/a?x=1");
        for (n, v) in headers {
            b = b.header(*n, *v);
        }
        b.body(()).expect("request").into_parts().0
    }

    fn fp(headers: &[(&str, &str)], extra: &Ignored) -> String {
        let token_header = HeaderName::from_static("fencing-token");
        fingerprint(
            &parts(headers),
            Token::new(0, 7),
            &token_header,
            b"body",
            extra,
        )
    }

    fn plain(headers: &[(&str, &str)]) -> String {
        fp(headers, &Ignored::default())
    }

    /// The reproduction: a MOVE to another `Destination` is another request, and
    /// so is a change to any header that says what the request does.
    #[test]
    fn a_header_that_changes_the_request_changes_the_fingerprint() {
        let base = plain(&[("destination", "/tree/t/b"), ("content-type", "text/plain")]);
        for changed in [
            vec![("destination", "/tree/t/c"), ("content-type", "text/plain")],
            vec![("destination", "/tree/t/b"), ("content-type", "text/html")],
            vec![("destination", "/tree/t/b")],
            vec![
                ("destination", "/tree/t/b"),
                ("content-type", "text/plain"),
                ("if-match", "\"1\""),
            ],
            vec![
                ("destination", "/tree/t/b"),
                ("content-type", "text/plain"),
                ("x-amz-meta-owner", "a"),
            ],
            vec![
                ("destination", "/tree/t/b"),
                ("content-type", "text/plain"),
                ("x-amz-tagging", "a=b"),
            ],
            // Values byte for byte.
            vec![("destination", "/tree/t/B"), ("content-type", "text/plain")],
        ] {
            assert_ne!(plain(&changed), base, "{changed:?}");
        }
    }

    /// What a retry of one request changes (a new signature, date, attempt counter, trace)
    /// and the order of the headers leave the fingerprint as it was.
    #[test]
    fn what_a_retry_changes_leaves_it_the_same() {
        let first = plain(&[
            ("Destination", "/tree/t/b"),
            ("x-amz-meta-a", "1"),
            ("x-amz-meta-a", "2"),
            (
                "authorization",
                "AWS4-HMAC-SHA256 Credential=x, Signature=aa",
            ),
            ("x-amz-date", "20260101T000000Z"),
            ("amz-sdk-invocation-id", "i-1"),
            ("amz-sdk-request", "attempt=1; max=3"),
            ("user-agent", "Boto3/1.0"),
            ("traceparent", "00-aa-01"),
            ("x-b3-traceid", "1"),
            ("fencing-token", "7"),
            ("fencing-sequence", "3"),
            ("idempotency-key", "\"k\""),
            ("content-length", "4"),
        ]);
        let retry = plain(&[
            ("fencing-sequence", "4"),
            ("amz-sdk-request", "attempt=2; max=3"),
            ("x-amz-meta-a", "1"),
            ("x-amz-date", "20260101T000002Z"),
            (
                "authorization",
                "AWS4-HMAC-SHA256 Credential=x, Signature=bb",
            ),
            ("DESTINATION", "/tree/t/b"),
            ("amz-sdk-invocation-id", "i-1"),
            ("x-amz-meta-a", "2"),
            ("accept-encoding", "identity"),
            ("fencing-token", "0:7"),
            ("traceparent", "00-bb-01"),
            ("x-request-id", "r2"),
            ("expect", "100-continue"),
            ("connection", "keep-alive, x-hop"),
            ("x-hop", "only this hop's"),
        ]);
        assert_eq!(first, retry);
        // The values of one name in their order: another order is another request.
        let swapped = plain(&[
            ("destination", "/tree/t/b"),
            ("x-amz-meta-a", "2"),
            ("x-amz-meta-a", "1"),
        ]);
        assert_ne!(swapped, first);
    }

    /// `fingerprint_ignore` leaves its names and prefixes out, and is itself part of the
    /// fingerprint: a record made under another list matches nothing.
    #[test]
    fn the_configured_list_leaves_its_headers_out() {
        let extra = Ignored {
            names: vec!["x-my-trace".into()],
            prefixes: vec!["x-span-".into()],
        };
        let a = fp(&[("x-my-trace", "1"), ("x-span-id", "a")], &extra);
        let b = fp(&[("x-my-trace", "2"), ("x-span-id", "b")], &extra);
        assert_eq!(a, b);
        assert_ne!(fp(&[], &extra), plain(&[]));
        assert_ne!(plain(&[("x-my-trace", "1")]), plain(&[("x-my-trace", "2")]));
    }

    /// HTTP/2 sends one `Cookie` field per cookie, HTTP/1.1 one for all: the same request.
    #[test]
    fn cookies_are_one_list() {
        assert_eq!(
            plain(&[("cookie", "a=1"), ("cookie", "b=2")]),
            plain(&[("cookie", "a=1; b=2")])
        );
        assert_ne!(plain(&[("cookie", "a=1")]), plain(&[("cookie", "a=2")]));
    }
}
