//! Tests of the S3 dialect: every outcome as an S3 error document.

use super::*;

/// One of each outcome. `variant` below matches them exhaustively, so a new outcome
/// fails to compile until it is listed here.
fn every_outcome() -> Vec<Outcome> {
    let scope = || "reports/<q&a>".to_string();
    let token = Token::new(1, 6);
    vec![
        Outcome::Stale {
            scope: scope(),
            token,
            highest: Some(Token::new(0, 12)),
        },
        Outcome::MissingToken { scope: scope() },
        Outcome::InvalidToken {
            scope: scope(),
            detail: "x".into(),
        },
        Outcome::ScopeMismatch {
            scope: scope(),
            token,
        },
        Outcome::InvalidPath { detail: "x".into() },
        Outcome::InvalidRequest { detail: "x".into() },
        Outcome::MethodNotAllowed,
        Outcome::NoRoute,
        Outcome::Draining {
            scope: scope(),
            token,
            highest: None,
        },
        Outcome::Unavailable {
            scope: scope(),
            token,
        },
        Outcome::UpstreamUnavailable {
            scope: Some(scope()),
            detail: "x".into(),
        },
        Outcome::UpstreamTimeout {
            scope: None,
            detail: "x".into(),
        },
        Outcome::PayloadTooLarge { limit: 1024 },
        Outcome::InvalidProof {
            scope: scope(),
            token,
            detail: "x".into(),
        },
        Outcome::InProgress {
            scope: scope(),
            token,
        },
        Outcome::KeyReused {
            scope: scope(),
            token,
        },
        Outcome::OutcomeUnknown {
            scope: scope(),
            token,
        },
        Outcome::StaleSequence {
            scope: scope(),
            token,
            sequence: 3,
            highest_sequence: 4,
        },
        Outcome::MultiScope { detail: "x".into() },
        Outcome::UnfencedOperation { detail: "x".into() },
        Outcome::MalformedBody {
            code: "MalformedXML",
            detail: "x".into(),
        },
        Outcome::UnknownUpload {
            scope: scope(),
            detail: "x".into(),
        },
        Outcome::FencedBeneath {
            scope: scope(),
            token,
            detail: "x".into(),
        },
        Outcome::KeyRejected {
            scope: scope(),
            token,
            detail: "x",
        },
    ]
}

fn variant(o: &Outcome) -> usize {
    match o {
        Outcome::Stale { .. } => 0,
        Outcome::MissingToken { .. } => 1,
        Outcome::InvalidToken { .. } => 2,
        Outcome::ScopeMismatch { .. } => 3,
        Outcome::InvalidPath { .. } => 4,
        Outcome::InvalidRequest { .. } => 5,
        Outcome::MethodNotAllowed => 6,
        Outcome::NoRoute => 7,
        Outcome::Draining { .. } => 8,
        Outcome::Unavailable { .. } => 9,
        Outcome::UpstreamUnavailable { .. } => 10,
        Outcome::UpstreamTimeout { .. } => 11,
        Outcome::PayloadTooLarge { .. } => 12,
        Outcome::InvalidProof { .. } => 13,
        Outcome::InProgress { .. } => 14,
        Outcome::KeyReused { .. } => 15,
        Outcome::OutcomeUnknown { .. } => 16,
        Outcome::StaleSequence { .. } => 17,
        Outcome::MultiScope { .. } => 18,
        Outcome::UnfencedOperation { .. } => 19,
        Outcome::MalformedBody { .. } => 20,
        Outcome::UnknownUpload { .. } => 21,
        Outcome::FencedBeneath { .. } => 22,
        Outcome::KeyRejected { .. } => 23,
    }
}

async fn text(resp: Response<Body>) -> String {
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    String::from_utf8(bytes.to_vec()).expect("utf-8")
}

/// The text of `<tag>` in `doc`, unescaped, for the few entities `xml_text` writes.
fn element(doc: &str, tag: &str) -> Option<String> {
    let open = format!("<{tag}>");
    let start = doc.find(&open)? + open.len();
    let end = start + doc[start..].find(&format!("</{tag}>"))?;
    Some(
        doc[start..end]
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&quot;", "\"")
            .replace("&apos;", "'")
            .replace("&#13;", "\r")
            .replace("&amp;", "&"),
    )
}

#[test]
fn every_outcome_is_listed_once() {
    let seen: std::collections::BTreeSet<usize> = every_outcome().iter().map(variant).collect();
    assert_eq!(seen, (0..24).collect());
}

#[tokio::test]
async fn every_outcome_has_a_code_and_keeps_status_and_headers() {
    let mut codes = std::collections::HashSet::new();
    for o in every_outcome() {
        let code = o.s3_code();
        assert!(
            !code.is_empty() && code.bytes().all(|b| b.is_ascii_alphanumeric()),
            "{code}"
        );
        assert!(codes.insert(code), "{code} used twice");
        let problem = o.clone().into_response();
        let id = HeaderValue::from_static("req-1");
        let s3 = o
            .clone()
            .into_response_in(Dialect::S3, Some("/b/k"), Some(&id));
        assert_eq!(s3.status(), problem.status(), "{o:?}");
        for name in [FENCING_RESULT, header::CACHE_CONTROL, header::RETRY_AFTER] {
            assert_eq!(
                s3.headers().get(&name),
                problem.headers().get(&name),
                "{o:?}"
            );
        }
        assert_eq!(s3.headers()[header::CONTENT_TYPE], "application/xml");
        assert_eq!(s3.headers().len(), problem.headers().len(), "{o:?}");
        let doc = text(s3).await;
        assert!(
            doc.starts_with("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>"),
            "{doc}"
        );
        assert!(doc.ends_with("</Error>"), "{doc}");
        assert_eq!(element(&doc, "Code").as_deref(), Some(code));
        assert_eq!(element(&doc, "Message"), Some(o.title().into_owned()));
        assert_eq!(element(&doc, "Resource").as_deref(), Some("/b/k"));
        assert_eq!(element(&doc, "RequestId").as_deref(), Some("req-1"));
        assert_eq!(element(&doc, "FencingResult").as_deref(), Some(o.result()));
        let (scope, token, highest) = o.fields();
        assert_eq!(element(&doc, "Scope").as_ref(), scope);
        assert_eq!(element(&doc, "Presented"), token.map(|t| t.to_string()));
        assert_eq!(
            element(&doc, "HighestAccepted"),
            highest.map(|t| t.to_string())
        );
        // The problem dialect is the plain response.
        let same = o
            .clone()
            .into_response_in(Dialect::Problem, Some("/b/k"), Some(&id));
        assert_eq!(
            same.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        assert_eq!(text(same).await, text(o.into_response()).await);
    }
}

#[tokio::test]
async fn s3_codes_that_sdks_know() {
    let by_code = |o: &Outcome| o.s3_code();
    let all = every_outcome();
    assert_eq!(by_code(&all[0]), "StaleFence");
    assert_eq!(by_code(&all[8]), "SlowDown");
    assert_eq!(by_code(&all[12]), "EntityTooLarge");
    let doc = text(all[12].clone().into_response_in(Dialect::S3, None, None)).await;
    assert_eq!(element(&doc, "MaxSizeAllowed").as_deref(), Some("1024"));
    // No request id or path given: no element rather than an empty one.
    assert!(!doc.contains("<RequestId>"), "{doc}");
    assert!(!doc.contains("<Resource>"), "{doc}");
}

#[tokio::test]
async fn s3_values_are_escaped() {
    for scope in [
        "plain/key",
        "a&b<c>d\"e'f",
        "]]><x/>&amp;",
        "cr\rlf\ntab\t",
        "é/ü 中",
    ] {
        let o = Outcome::Stale {
            scope: scope.into(),
            token: Token::new(3, 7),
            highest: Some(Token::new(0, 12_345_678_901)),
        };
        let id = HeaderValue::from_static("<id>&");
        let doc = text(o.into_response_in(Dialect::S3, Some("/b/<k>&'"), Some(&id))).await;
        assert_eq!(element(&doc, "Scope").as_deref(), Some(scope), "{doc}");
        assert_eq!(element(&doc, "Resource").as_deref(), Some("/b/<k>&'"));
        assert_eq!(element(&doc, "RequestId").as_deref(), Some("<id>&"));
        assert_eq!(element(&doc, "Presented").as_deref(), Some("3:7"));
        assert_eq!(
            element(&doc, "HighestAccepted").as_deref(),
            Some("12345678901")
        );
        // Markup only where fencegate wrote it: the declaration and 9 elements.
        assert_eq!(doc.matches('<').count(), 1 + 2 * 9, "{doc}");
        assert!(!doc.contains('\r'), "{doc}");
    }
    // What XML 1.0 cannot carry is replaced, not written.
    let mut out = Vec::new();
    xml_text(&mut out, "a\u{1}b\u{0}c\u{fffe}d\u{ffff}e\u{7f}");
    assert_eq!(
        String::from_utf8(out).expect("utf-8"),
        "a\u{fffd}b\u{fffd}c\u{fffd}d\u{fffd}e\u{7f}"
    );
}
