//! `fencegate probe --keys URL`: does an S3 backend store keys verbatim, so that an
//! `api = "s3"` route may read them with `keys = "opaque"`, or does it read some spellings
//! as another key (a store of files reads `a//b` as `a/b`), so that the route needs
//! `keys = "strict"`? (SPEC §15: never two scopes for one object.)
//!
//! It writes a base object and then, for each spelling S3 allows and a path's rules
//! refuse, an object whose content says which spelling it is, and reads each back: a
//! spelling that overwrote the base object, or another spelling's, names the same object.
//! Everything it wrote is deleted at the end. Requests are signed with SigV4 when
//! credentials are given (`--access-key`, `--secret-key`, or `AWS_ACCESS_KEY_ID` and
//! `AWS_SECRET_ACCESS_KEY`).

use std::time::SystemTime;

use bytes::Bytes;
use http::{Method, Request, Uri};
use http_body_util::{BodyExt, Full};
use sha2::{Digest, Sha256};

/// The spellings tried, each against the key it would alias on a store that normalizes
/// paths (as sent: already escaped where a client escapes them).
const SPELLINGS: [(&str, &str); 5] = [
    ("a//b", "a/b"),
    ("a/./b", "a/b"),
    ("x/../a/b", "a/b"),
    ("a%5Cb", "a/b"),
    ("dir/", "dir"),
];

/// SigV4 credentials.
pub struct Credentials {
    pub access_key: String,
    pub secret_key: String,
    pub region: String,
}

/// What the probe found for one spelling.
#[derive(Debug, PartialEq, Eq)]
pub enum Found {
    /// Stored as a key of its own.
    Distinct,
    /// Read as another key (it overwrote that one, or was read from it).
    Alias(String),
    /// The backend refused to store it (its status).
    Refused(u16),
}

/// Probes the bucket at `bucket_url` (`http://host:port/bucket`); prints a line per
/// spelling and the `keys` setting the backend needs. Answers whether `opaque` is safe.
pub async fn keys(bucket_url: &str, creds: Option<&Credentials>) -> Result<bool, ProbeError> {
    let base: Uri = bucket_url
        .trim_end_matches('/')
        .parse()
        .map_err(|source| ProbeError::Url {
            url: bucket_url.to_string(),
            source,
        })?;
    let (Some(authority), Some("http")) = (base.authority().cloned(), base.scheme_str()) else {
        return Err(ProbeError::NotHttp(bucket_url.to_string()));
    };
    let bucket_path = base.path().trim_end_matches('/').to_string();
    if bucket_path.is_empty() || bucket_path[1..].contains('/') {
        return Err(ProbeError::NoBucket(bucket_url.to_string()));
    }
    let client = Client {
        http: hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http(),
        authority: authority.to_string(),
        bucket_path,
        creds,
    };
    let prefix = format!("fencegate-probe-{:016x}", nonce());
    let mut written: Vec<String> = Vec::new();
    let result = run(&client, &prefix, &mut written).await;
    for key in written.iter().rev() {
        let _ = client.send(Method::DELETE, key, Bytes::new()).await;
    }
    let found = result?;
    let mut opaque = true;
    for ((spelling, like), f) in SPELLINGS.iter().zip(&found) {
        let what = match f {
            Found::Distinct => "a key of its own".to_string(),
            Found::Alias(k) => {
                opaque = false;
                format!("the same object as `{k}`")
            }
            Found::Refused(status) => format!("refused by the backend ({status})"),
        };
        println!("{spelling:<10} (next to {like}): {what}");
    }
    if opaque {
        println!("keys = \"opaque\": this backend stores these keys as given");
    } else {
        println!("keys = \"strict\": this backend reads some spellings as another key");
    }
    Ok(opaque)
}

/// Why the probe could not finish (nothing is concluded about the backend).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProbeError {
    #[error("{url}: {source}")]
    Url {
        url: String,
        #[source]
        source: http::uri::InvalidUri,
    },
    #[error("{0}: give an http://host:port/bucket URL")]
    NotHttp(String),
    #[error("{0}: the URL's path must name the bucket")]
    NoBucket(String),
    #[error("PUT {key}: {status}: cannot write to this bucket")]
    CannotWrite { key: String, status: u16 },
    #[error("{0}")]
    Request(#[source] http::Error),
    #[error("{method} {path}: no answer in 30 s")]
    Timeout { method: Method, path: String },
    #[error("{method} {path}: {source}")]
    Send {
        method: Method,
        path: String,
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    #[error("{method} {path}: {source}")]
    Body {
        method: Method,
        path: String,
        #[source]
        source: hyper::Error,
    },
}

async fn run(
    client: &Client<'_>,
    prefix: &str,
    written: &mut Vec<String>,
) -> Result<Vec<Found>, ProbeError> {
    let mut found = Vec::new();
    for (i, (spelling, like)) in SPELLINGS.iter().enumerate() {
        let base = format!("{prefix}/{i}/{like}");
        let variant = format!("{prefix}/{i}/{spelling}");
        let status = client
            .send(Method::PUT, &base, Bytes::from("base"))
            .await?
            .0;
        if !(200..300).contains(&status) {
            return Err(ProbeError::CannotWrite { key: base, status });
        }
        written.push(base.clone());
        let status = client
            .send(Method::PUT, &variant, Bytes::from("variant"))
            .await?
            .0;
        if !(200..300).contains(&status) {
            found.push(Found::Refused(status));
            continue;
        }
        written.push(variant.clone());
        let (_, base_now) = client.send(Method::GET, &base, Bytes::new()).await?;
        let (status, variant_now) = client.send(Method::GET, &variant, Bytes::new()).await?;
        found.push(
            if base_now == "base" && status == 200 && variant_now == "variant" {
                Found::Distinct
            } else {
                Found::Alias((*like).to_string())
            },
        );
    }
    Ok(found)
}

struct Client<'c> {
    http: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        Full<Bytes>,
    >,
    authority: String,
    bucket_path: String,
    creds: Option<&'c Credentials>,
}

impl Client<'_> {
    /// `method` on `key` (as sent), signed when there are credentials; status and body.
    async fn send(
        &self,
        method: Method,
        key: &str,
        body: Bytes,
    ) -> Result<(u16, String), ProbeError> {
        let path = format!("{}/{key}", self.bucket_path);
        let payload = hex(&Sha256::digest(&body));
        let mut req = Request::builder()
            .method(method.clone())
            .uri(format!("http://{}{path}", self.authority))
            .header("host", &self.authority)
            .header("x-amz-content-sha256", &payload);
        if let Some(creds) = self.creds {
            let amz_date = amz_date(SystemTime::now());
            let auth = authorization(creds, &method, &path, &self.authority, &payload, &amz_date);
            req = req
                .header("x-amz-date", amz_date)
                .header("authorization", auth);
        }
        let req = req.body(Full::new(body)).map_err(ProbeError::Request)?;
        let resp = tokio::time::timeout(std::time::Duration::from_secs(30), self.http.request(req))
            .await
            .map_err(|_| ProbeError::Timeout {
                method: method.clone(),
                path: path.clone(),
            })?
            .map_err(|source| ProbeError::Send {
                method: method.clone(),
                path: path.clone(),
                source,
            })?;
        let status = resp.status().as_u16();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|source| ProbeError::Body {
                method,
                path,
                source,
            })?
            .to_bytes();
        Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
    }
}

/// The SigV4 `Authorization` of a request with no query, signing host, the payload hash
/// and the date. S3 signs the path as sent (no normalization, no second escaping).
fn authorization(
    creds: &Credentials,
    method: &Method,
    path: &str,
    host: &str,
    payload: &str,
    amz_date: &str,
) -> String {
    let date = &amz_date[..8];
    let signed = "host;x-amz-content-sha256;x-amz-date";
    let canonical = format!(
        "{method}\n{path}\n\nhost:{host}\nx-amz-content-sha256:{payload}\nx-amz-date:{amz_date}\n\n{signed}\n{payload}"
    );
    let scope = format!("{date}/{}/s3/aws4_request", creds.region);
    let to_sign = format!(
        "AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{}",
        hex(&Sha256::digest(canonical.as_bytes()))
    );
    let mut key = hmac(
        format!("AWS4{}", creds.secret_key).as_bytes(),
        date.as_bytes(),
    );
    for part in [creds.region.as_str(), "s3", "aws4_request"] {
        key = hmac(&key, part.as_bytes());
    }
    let signature = hex(&hmac(&key, to_sign.as_bytes()));
    format!(
        "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={signed}, Signature={signature}",
        creds.access_key
    )
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    ring::hmac::sign(&key, data).as_ref().to_vec()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `20261205T231525Z` for `t`.
fn amz_date(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t)
        .to_string()
        .replace(['-', ':'], "")
}

/// A probe's own prefix, so that two probes (or a probe and real data) never meet.
fn nonce() -> u64 {
    let mut b = [0u8; 8];
    // Without randomness the time alone still tells probes apart.
    if ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b).is_err() {
        return SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    }
    u64::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// AWS's documented example (the SigV4 test suite's GET object with a range, here
    /// without it): the signature is a function of the documented inputs.
    #[test]
    fn signs_as_sigv4_does() {
        let creds = Credentials {
            access_key: "AKIAIOSFODNN7EXAMPLE".into(),
            secret_key: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".into(),
            region: "us-east-1".into(),
        };
        let empty = hex(&Sha256::digest(b""));
        assert_eq!(
            empty,
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        let a = authorization(
            &creds,
            &Method::GET,
            "/test.txt",
            "examplebucket.s3.amazonaws.com",
            &empty,
            "20130524T000000Z",
        );
        assert!(a.starts_with("AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, SignedHeaders=host;x-amz-content-sha256;x-amz-date, Signature="), "{a}");
        assert_eq!(amz_date(SystemTime::UNIX_EPOCH), "19700101T000000Z");
    }
}
