//! AWS Signature Version 4 for the tests that speak S3 to a server that checks it
//! (s3s-fs): the `Authorization` of a request, and the policy and signature of a
//! browser-form upload. Written from the specification, as s3s verifies it.

use std::time::SystemTime;

use sha2::{Digest, Sha256};

const REGION: &str = "us-east-1";

/// The credentials requests are signed with.
#[derive(Clone, Copy)]
pub struct Keys<'a> {
    pub access: &'a str,
    pub secret: &'a str,
}

/// The headers that sign `method target` (path and query as sent) for `host` with
/// `body`: `x-amz-date`, `x-amz-content-sha256` and `authorization`. `extra` are the
/// request's other headers; those named `x-amz-*` are signed too (S3 wants them signed).
pub fn sign(
    keys: Keys<'_>,
    method: &str,
    target: &str,
    host: &str,
    extra: &[(&str, String)],
    body: &[u8],
) -> Vec<(&'static str, String)> {
    let amz_date = amz_date(SystemTime::now());
    let payload = hex(&Sha256::digest(body));
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let mut headers: Vec<(String, String)> = vec![
        ("host".into(), host.trim().to_string()),
        ("x-amz-content-sha256".into(), payload.clone()),
        ("x-amz-date".into(), amz_date.clone()),
    ];
    for (k, v) in extra {
        let k = k.to_ascii_lowercase();
        if k.starts_with("x-amz-") {
            headers.push((k, v.trim().to_string()));
        }
    }
    headers.sort();
    let signed: Vec<&str> = headers.iter().map(|(k, _)| k.as_str()).collect();
    let signed = signed.join(";");
    let canonical_headers: String = headers.iter().map(|(k, v)| format!("{k}:{v}\n")).collect();
    let canonical = format!(
        "{method}\n{}\n{}\n{canonical_headers}\n{signed}\n{payload}",
        canonical_path(path),
        canonical_query(query)
    );
    let date = &amz_date[..8];
    let scope = format!("{date}/{REGION}/s3/aws4_request");
    let to_sign = format!(
        "AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{}",
        hex(&Sha256::digest(canonical.as_bytes()))
    );
    let signature = hex(&hmac(&signing_key(keys.secret, date), to_sign.as_bytes()));
    vec![
        ("x-amz-date", amz_date),
        ("x-amz-content-sha256", payload),
        (
            "authorization",
            format!(
                "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={signed}, Signature={signature}",
                keys.access
            ),
        ),
    ]
}

/// The signed fields of a browser-form upload to `bucket`, any key: the policy (valid
/// until 2099) and its signature, with the algorithm, credential and date it names.
pub fn form_fields(keys: Keys<'_>, bucket: &str) -> Vec<(&'static str, String)> {
    let amz_date = amz_date(SystemTime::now());
    let date = &amz_date[..8];
    let credential = format!("{}/{date}/{REGION}/s3/aws4_request", keys.access);
    let policy = format!(
        r#"{{"expiration":"2099-01-01T00:00:00Z","conditions":[{{"bucket":"{bucket}"}},["starts-with","$key",""],{{"x-amz-algorithm":"AWS4-HMAC-SHA256"}},{{"x-amz-credential":"{credential}"}},{{"x-amz-date":"{amz_date}"}}]}}"#
    );
    let policy = base64(policy.as_bytes());
    let signature = hex(&hmac(&signing_key(keys.secret, date), policy.as_bytes()));
    vec![
        ("x-amz-algorithm", "AWS4-HMAC-SHA256".into()),
        ("x-amz-credential", credential),
        ("x-amz-date", amz_date),
        ("policy", policy),
        ("x-amz-signature", signature),
    ]
}

/// The path as S3 signs it: decoded, then each byte but the unreserved ones and `/`
/// escaped in upper case.
fn canonical_path(path: &str) -> String {
    let decoded: Vec<u8> = percent_encoding::percent_decode_str(path).collect();
    encode(&decoded, false)
}

/// The query's parameters decoded, escaped again, sorted by name (then value).
fn canonical_query(query: &str) -> String {
    let mut pairs: Vec<(String, String)> = query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (n, v) = p.split_once('=').unwrap_or((p, ""));
            let dec = |s: &str| -> Vec<u8> {
                percent_encoding::percent_decode_str(&s.replace('+', " ")).collect()
            };
            (encode(&dec(n), true), encode(&dec(v), true))
        })
        .collect();
    pairs.sort();
    pairs
        .iter()
        .map(|(n, v)| format!("{n}={v}"))
        .collect::<Vec<_>>()
        .join("&")
}

fn encode(bytes: &[u8], slash: bool) -> String {
    let mut out = String::new();
    for &b in bytes {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) || (b == b'/' && !slash) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn signing_key(secret: &str, date: &str) -> Vec<u8> {
    let mut key = hmac(format!("AWS4{secret}").as_bytes(), date.as_bytes());
    for part in [REGION, "s3", "aws4_request"] {
        key = hmac(&key, part.as_bytes());
    }
    key
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    ring::hmac::sign(&key, data).as_ref().to_vec()
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Standard base64 with padding.
pub fn base64(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ABC[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// `20261205T231525Z` for `t`.
fn amz_date(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t)
        .to_string()
        .replace(['-', ':'], "")
}

#[test]
fn base64_as_rfc_4648_has_it() {
    for (plain, coded) in [
        ("", ""),
        ("f", "Zg=="),
        ("fo", "Zm8="),
        ("foo", "Zm9v"),
        ("foobar", "Zm9vYmFy"),
    ] {
        assert_eq!(base64(plain.as_bytes()), coded);
    }
}
