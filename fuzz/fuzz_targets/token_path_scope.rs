//! The token grammar, path canonicalization and scope rendering never panic; a token
//! or a path accepted has one canonical spelling, which reads back as itself; and every
//! spelling of a path that decodes alike (escapes in either case, or none, a trailing
//! slash) renders one scope, through a fixed route and through one read from the input.
//!
//! Input: fields split at 0xff bytes: a token, a path, a mask of which bytes to escape,
//! a path template, a scope template.
#![no_main]

use std::borrow::Cow;

use fencegate::route::{PathTemplate, ScopeTemplate, canonicalize};
use fencegate::token::Token;
use libfuzzer_sys::fuzz_target;

/// Bytes that stand for themselves in the canonical spelling (RFC 3986 unreserved).
fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// The path of `segments`, each byte escaped unless unreserved, or when `mask` says so.
fn spell(segments: &[Cow<'_, str>], mask: &[u8], lower: bool) -> String {
    let mut out = String::new();
    let mut k = 0usize;
    for s in segments {
        out.push('/');
        for &b in s.as_bytes() {
            let bit = mask.get(k / 8).is_some_and(|m| m >> (k % 8) & 1 == 1);
            k += 1;
            if unreserved(b) && !bit {
                out.push(b as char);
            } else if lower {
                out.push_str(&format!("%{b:02x}"));
            } else {
                out.push_str(&format!("%{b:02X}"));
            }
        }
    }
    if out.is_empty() {
        out.push('/');
    }
    out
}

fn render(path: &PathTemplate, scope: &ScopeTemplate, segments: &[Cow<'_, str>]) -> Option<String> {
    path.matches(segments).map(|caps| scope.render(&caps))
}

fuzz_target!(|data: &[u8]| {
    let mut fields = data.split(|&b| b == 0xff);
    let token = fields.next().unwrap_or_default();
    let path = String::from_utf8_lossy(fields.next().unwrap_or_default());
    let mask = fields.next().unwrap_or_default();
    let path_template = String::from_utf8_lossy(fields.next().unwrap_or_default());
    let scope_template = String::from_utf8_lossy(fields.next().unwrap_or_default());

    // Tokens: one spelling each.
    if let Ok(t) = Token::parse(token) {
        // One spelling per token, but for an explicit epoch 0 (`0:42` is `42`, as SPEC
        // §1's grammar allows; tokens are compared by value, never by spelling).
        if !token.starts_with(b"0:") {
            assert_eq!(
                t.to_string().as_bytes(),
                token,
                "a token with two spellings"
            );
        }
        let mut w = Vec::new();
        t.write_to(&mut w);
        assert_eq!(w, t.to_string().as_bytes());
        assert_eq!(Token::parse(&w), Ok(t));
    }
    if token.len() >= 16 {
        let e = u64::from_le_bytes(token[..8].try_into().unwrap_or_default());
        let c = u64::from_le_bytes(token[8..16].try_into().unwrap_or_default());
        let t = Token::new(e, c);
        assert_eq!(Token::parse(t.to_string().as_bytes()), Ok(t));
    }

    // Paths: the canonical spelling is a fixed point; every other spelling reads alike.
    let Ok(segments) = canonicalize(&path) else {
        // Templates are parsed all the same (never a panic).
        if let Ok(p) = PathTemplate::parse(&path_template) {
            let _ = ScopeTemplate::parse(&scope_template, &p);
        }
        return;
    };
    let canonical = spell(&segments, &[], false);
    let again = canonicalize(&canonical).unwrap_or_else(|e| panic!("{canonical:?}: {e}"));
    assert_eq!(again, segments, "{path:?} -> {canonical:?}");
    assert_eq!(spell(&again, &[], false), canonical, "not a fixed point");
    let other = spell(&segments, mask, mask.first().is_some_and(|m| m & 0x80 != 0));
    let other_slash = format!("{other}/");
    for spelling in [&other, &other_slash] {
        // `//` (the root with a slash) is an empty segment: refused.
        if spelling.as_str() == "//" {
            continue;
        }
        let read =
            canonicalize(spelling).unwrap_or_else(|e| panic!("{path:?} as {spelling:?}: {e}"));
        assert_eq!(read, segments, "{path:?} as {spelling:?}");
    }

    // One scope per object: a fixed route, and one from the input.
    let fixed = PathTemplate::parse("/{bucket}/{*key}").unwrap_or_else(|e| panic!("{e}"));
    let fixed_scope =
        ScopeTemplate::parse("s3/{bucket}/{key}", &fixed).unwrap_or_else(|e| panic!("{e}"));
    let read = canonicalize(&other).unwrap_or_default();
    assert_eq!(
        render(&fixed, &fixed_scope, &segments),
        render(&fixed, &fixed_scope, &read)
    );
    if let Ok(p) = PathTemplate::parse(&path_template)
        && let Ok(s) = ScopeTemplate::parse(&scope_template, &p)
    {
        assert_eq!(render(&p, &s, &segments), render(&p, &s, &read));
        assert_eq!(render(&p, &s, &segments), render(&p, &s, &again));
    }
});
