//! Fenced requests through the proxy: every request carries `Fencing-Token` and
//! `Fencing-Scope` (and `Fencing-Proof`, when the fence has one), and every answer is read from `Fencing-Result` into a [`FenceResult`]
//! that says what the caller may do next.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};

use super::{BadUrl, ClientOptions, Http, Lease, base_url, http_client, retry_after};
use crate::token::Token;

/// What a request is fenced with: the scope of the lock and its token, and the lease they
/// came from when [`Lease::fence`] made it.
#[derive(Debug, Clone)]
pub struct Fence {
    pub scope: String,
    pub token: Token,
    /// Sent as `Fencing-Proof`: the authority's signature over (key id, scope, token),
    /// which a `proof = "required"` route asks for.
    pub proof: Option<String>,
    /// Shared with the lease, so a fence kept past its lease's loss (the local deadline
    /// passed, a renewal answered lost, a release) is refused before sending.
    pub(super) lease: Option<Lease>,
    /// The last `Fencing-Sequence` taken: the lease's counter (shared by every fence of
    /// it), or this fence's own.
    pub(super) sequence: Option<Arc<AtomicU64>>,
    /// Requests with this fence carry the next `Fencing-Sequence` (see [`Fence::numbered`]).
    pub(super) numbered: bool,
}

impl Fence {
    /// A fence not tied to a lease of this client (a token from another lock service, or
    /// handed over from another process): nothing here checks a deadline, only the proxy
    /// fences it.
    pub fn new(scope: impl Into<String>, token: Token) -> Fence {
        Fence {
            scope: scope.into(),
            token,
            proof: None,
            lease: None,
            sequence: None,
            numbered: false,
        }
    }

    /// The fence numbering its requests (SPEC §11): each request sent with it carries
    /// `Fencing-Sequence: n`, n counting from 1 per lease (every numbered fence of one
    /// lease shares the count; a fence not made from a lease counts on its own). The
    /// proxy then refuses a request overtaken by a later one of the same lease
    /// ([`FenceResult::StaleSequence`]) and forwards a later one only once the earlier
    /// ones in flight have finished. A request given a `Fencing-Sequence` header by the
    /// caller keeps it (a retry of a request answered "retry": the same number again).
    pub fn numbered(mut self) -> Fence {
        self.sequence.get_or_insert_with(Arc::default);
        self.numbered = true;
        self
    }

    /// The number the next request with this fence takes, if it is [`numbered`](Fence::numbered).
    fn take_sequence(&self) -> Option<u64> {
        let counter = self.sequence.as_ref().filter(|_| self.numbered)?;
        Some(counter.fetch_add(1, Ordering::AcqRel).saturating_add(1))
    }

    /// The fence with the authority's `proof` for its scope and token.
    pub fn with_proof(mut self, proof: impl Into<String>) -> Fence {
        self.proof = Some(proof.into());
        self
    }
}

impl PartialEq for Fence {
    fn eq(&self, other: &Fence) -> bool {
        (&self.scope, self.token) == (&other.scope, other.token)
    }
}

impl Eq for Fence {}

/// The outcome of one fenced request.
#[derive(Debug, Clone)]
pub enum FenceResult {
    /// Passed the fence and was forwarded; `status` is the backend's.
    Applied {
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
    },
    /// A replay of a completed request with the same Idempotency-Key: done already.
    Duplicate {
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
    },
    /// Definitive: a newer lock generation reached the scope. Stop, discard the work,
    /// re-acquire; never retry with this token.
    StaleFence { highest_accepted: Option<Token> },
    /// Definitive for this request: a later-numbered request of the same lease reached
    /// the scope first ([`Fence::numbered`]), so this one is out of order and was not
    /// applied. Do not retry it; the lease is still good.
    StaleSequence { highest_sequence: Option<u64> },
    /// Not applied; retry later with the same token (`draining`, `unavailable`,
    /// `upstream_unavailable`, `in_progress`, or the proxy could not be reached).
    Transient {
        result: String,
        retry_after: Option<Duration>,
    },
    /// May or may not have been applied (`upstream_timeout`, `outcome_unknown` for an
    /// Idempotency-Key whose first attempt got no answer, or the connection broke after
    /// the request was sent). Find out before acting on it.
    Unknown { detail: String },
}

/// Answers that say the request was wrong, or did not meet a fence at all.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FencedError {
    /// fencegate refused the request itself (`missing_token`, `invalid_token`,
    /// `scope_mismatch`, `invalid_path`, `invalid_request`, `no_route`, `key_reused`,
    /// `invalid_proof`): a bug in the caller or its configuration.
    #[error("refused by fencegate ({status} {result}): {title}")]
    Refused {
        status: u16,
        result: String,
        title: String,
    },
    /// The answer has no `Fencing-Result`: the request was not fenced (an unfenced route,
    /// or not fencegate at all). Nothing protected it.
    #[error("the answer ({status}) carries no Fencing-Result: the request was not fenced")]
    NotFenced { status: u16 },
    #[error("cannot build the request: {0}")]
    Request(String),
    /// The fence's lease is lost (its local deadline passed, a renewal answered lost, or
    /// it was released): nothing was sent. Re-acquire.
    #[error("the fence's lease is lost; nothing was sent")]
    LeaseLost,
}

/// The request's URI: the proxy's base and a path that must start with `/`. Anything
/// else would be read as part of the authority: `@evil.example/x` after
/// `http://proxy:8080` names the host `evil.example`.
fn target(base: &str, path_and_query: &str) -> Result<http::Uri, FencedError> {
    if !path_and_query.starts_with('/') {
        return Err(FencedError::Request(format!(
            "the path {path_and_query:?} does not start with '/'"
        )));
    }
    format!("{base}{path_and_query}")
        .parse()
        .map_err(|e: http::uri::InvalidUri| FencedError::Request(e.to_string()))
}

/// An HTTP client for a fencegate proxy.
#[derive(Clone)]
pub struct FencedHttp {
    http: Http,
    base: String,
    options: ClientOptions,
}

impl FencedHttp {
    /// `base` is `http://host:port` or `https://host:port` of the proxy.
    pub fn new(base: &str) -> Result<FencedHttp, BadUrl> {
        FencedHttp::with_options(base, ClientOptions::default())
    }

    pub fn with_options(base: &str, options: ClientOptions) -> Result<FencedHttp, BadUrl> {
        Ok(FencedHttp {
            http: http_client(options.tls.as_ref()),
            base: base_url(base)?,
            options,
        })
    }

    /// Sends `method path` with the fence's token and scope, plus `headers`. A fence from
    /// a lease that is lost by now is refused ([`FencedError::LeaseLost`]); `path_and_query`
    /// must start with `/`.
    pub async fn send(
        &self,
        fence: &Fence,
        method: Method,
        path_and_query: &str,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<FenceResult, FencedError> {
        // An optimisation, not the safety: the lease may be lost right after this check,
        // and only the proxy's fence stops a request sent then.
        if fence.lease.as_ref().is_some_and(|l| !l.is_held()) {
            return Err(FencedError::LeaseLost);
        }
        let mut req = Request::builder()
            .method(method)
            .uri(target(&self.base, path_and_query)?)
            .body(Full::new(body))
            .map_err(|e| FencedError::Request(e.to_string()))?;
        let h = req.headers_mut();
        h.extend(headers);
        let token = HeaderValue::from_str(&fence.token.to_string())
            .map_err(|e| FencedError::Request(e.to_string()))?;
        let scope = HeaderValue::from_str(&fence.scope)
            .map_err(|e| FencedError::Request(format!("scope is not a header value: {e}")))?;
        h.insert(self.options.token_header.clone(), token);
        h.insert("fencing-scope", scope);
        if let Some(proof) = &fence.proof {
            let proof = HeaderValue::from_str(proof)
                .map_err(|e| FencedError::Request(format!("proof is not a header value: {e}")))?;
            h.insert("fencing-proof", proof);
        }
        if !h.contains_key("fencing-sequence")
            && let Some(n) = fence.take_sequence()
        {
            h.insert("fencing-sequence", HeaderValue::from(n));
        }
        let timeout = self.options.request_timeout;
        let exchange = async {
            let resp = self.http.request(req).await.map_err(|e| {
                if e.is_connect() {
                    FenceResult::Transient {
                        result: "connect_failed".into(),
                        retry_after: None,
                    }
                } else {
                    FenceResult::Unknown {
                        detail: e.to_string(),
                    }
                }
            })?;
            let status = resp.status();
            let headers = resp.headers().clone();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| FenceResult::Unknown {
                    detail: format!("answer body broke off: {e}"),
                })?
                .to_bytes();
            Ok((status, headers, body))
        };
        let (status, headers, body) = match tokio::time::timeout(timeout, exchange).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(result)) => return Ok(result),
            Err(_) => {
                return Ok(FenceResult::Unknown {
                    detail: format!("no answer within {timeout:?}"),
                });
            }
        };
        let result = classify(status, headers, body)?;
        // `stale_fence` is final for this token (SPEC §4: stop, re-acquire): the lease is
        // given up here, so its keep-alive stops and no further request carries it.
        if let (FenceResult::StaleFence { .. }, Some(lease)) = (&result, &fence.lease) {
            lease.mark_lost();
        }
        Ok(result)
    }

    pub async fn get(&self, fence: &Fence, path: &str) -> Result<FenceResult, FencedError> {
        self.send(fence, Method::GET, path, HeaderMap::new(), Bytes::new())
            .await
    }

    pub async fn put(
        &self,
        fence: &Fence,
        path: &str,
        body: impl Into<Bytes>,
    ) -> Result<FenceResult, FencedError> {
        self.send(fence, Method::PUT, path, HeaderMap::new(), body.into())
            .await
    }

    pub async fn delete(&self, fence: &Fence, path: &str) -> Result<FenceResult, FencedError> {
        self.send(fence, Method::DELETE, path, HeaderMap::new(), Bytes::new())
            .await
    }
}

/// Reads `Fencing-Result` (SPEC §4) into what the caller may do next.
fn classify(
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
) -> Result<FenceResult, FencedError> {
    let Some(result) = headers
        .get("fencing-result")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
    else {
        return Err(FencedError::NotFenced {
            status: status.as_u16(),
        });
    };
    let problem = || serde_json::from_slice::<serde_json::Value>(&body).unwrap_or_default();
    Ok(match result.as_str() {
        "accepted" => FenceResult::Applied {
            status,
            headers,
            body,
        },
        "duplicate" => FenceResult::Duplicate {
            status,
            headers,
            body,
        },
        "stale_fence" => FenceResult::StaleFence {
            highest_accepted: problem()
                .get("highest_accepted")
                .and_then(|v| v.as_str())
                .and_then(|t| t.parse().ok()),
        },
        "stale_sequence" => FenceResult::StaleSequence {
            highest_sequence: problem()
                .get("highest_sequence")
                .and_then(|v| v.as_str())
                .and_then(|n| n.parse().ok()),
        },
        "draining" | "unavailable" | "upstream_unavailable" | "in_progress" | "key_rejected" => {
            FenceResult::Transient {
                retry_after: retry_after(&headers),
                result,
            }
        }
        "upstream_timeout" | "outcome_unknown" => FenceResult::Unknown { detail: result },
        _ => {
            return Err(FencedError::Refused {
                status: status.as_u16(),
                title: problem()
                    .get("title")
                    .and_then(|v| v.as_str())
                    .unwrap_or_default()
                    .to_string(),
                result,
            });
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_result(result: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("fencing-result", HeaderValue::from_str(result).unwrap());
        h
    }

    #[test]
    fn paths_must_start_with_a_slash() {
        let base = "http://127.0.0.1:8080";
        for bad in [
            "@evil.example/x",
            "evil.example/x",
            "",
            "?x=1",
            "#x",
            ":81/x",
        ] {
            assert!(
                matches!(target(base, bad), Err(FencedError::Request(ref m)) if m.contains("'/'")),
                "{bad:?}"
            );
        }
        let uri = target(base, "/reports/july?x=1").unwrap();
        assert_eq!(uri.authority().map(|a| a.as_str()), Some("127.0.0.1:8080"));
        assert_eq!(
            uri.path_and_query().map(|p| p.as_str()),
            Some("/reports/july?x=1")
        );
        // Even `//host/x` stays on the proxy: it is a path there.
        let uri = target(base, "//evil.example/x").unwrap();
        assert_eq!(uri.authority().map(|a| a.as_str()), Some("127.0.0.1:8080"));
    }

    /// Nothing is sent for a fence whose lease is lost: not to the proxy, not anywhere.
    #[tokio::test(start_paused = true)]
    async fn a_fence_outliving_its_lease_is_refused() {
        use tokio::time::Instant;
        // Nothing listens here: a request that went out comes back Transient (or Unknown,
        // should the paused clock run out the request timeout first), never LeaseLost.
        let http = FencedHttp::new("http://127.0.0.1:1").unwrap();
        let lease = Lease::from_parts(
            "s".into(),
            "l".into(),
            Token::new(0, 1),
            Instant::now() + Duration::from_secs(1),
        );
        let fence = lease.fence().unwrap();
        let early = http.put(&fence, "/x", "x").await;
        let went_out = |r: &Result<FenceResult, FencedError>| {
            matches!(
                r,
                Ok(FenceResult::Transient { .. } | FenceResult::Unknown { .. })
            )
        };
        assert!(went_out(&early), "{early:?}");
        tokio::time::advance(Duration::from_secs(2)).await;
        let late = http.put(&fence, "/x", "x").await;
        assert!(matches!(late, Err(FencedError::LeaseLost)), "{late:?}");
        // Released (or answered lost) before its deadline: refused as well.
        let released = Lease::from_parts(
            "s".into(),
            "l".into(),
            Token::new(0, 2),
            Instant::now() + Duration::from_secs(60),
        );
        let fence = released.fence().unwrap();
        released.mark_lost();
        assert!(matches!(
            http.put(&fence, "/x", "x").await,
            Err(FencedError::LeaseLost)
        ));
        // A fence made apart from any lease is the proxy's to judge.
        let apart = Fence::new("s", Token::new(0, 1));
        assert!(went_out(&http.put(&apart, "/x", "x").await));
        assert_eq!(apart, fence_of(&lease));
    }

    fn fence_of(lease: &Lease) -> Fence {
        Fence::new(lease.scope(), lease.token())
    }

    #[test]
    fn results_are_typed() {
        let stale = classify(
            StatusCode::CONFLICT,
            with_result("stale_fence"),
            Bytes::from_static(br#"{"highest_accepted":"1:7"}"#),
        )
        .unwrap();
        assert!(matches!(
            stale,
            FenceResult::StaleFence { highest_accepted: Some(t) } if t == Token::new(1, 7)
        ));
        assert!(matches!(
            classify(
                StatusCode::CONFLICT,
                with_result("stale_sequence"),
                Bytes::from_static(br#"{"sequence":"1","highest_sequence":"2"}"#),
            )
            .unwrap(),
            FenceResult::StaleSequence {
                highest_sequence: Some(2)
            }
        ));
        let mut draining = with_result("draining");
        draining.insert("retry-after", HeaderValue::from_static("1"));
        assert!(matches!(
            classify(StatusCode::SERVICE_UNAVAILABLE, draining, Bytes::new()).unwrap(),
            FenceResult::Transient { retry_after: Some(d), .. } if d == Duration::from_secs(1)
        ));
        assert!(matches!(
            classify(
                StatusCode::GATEWAY_TIMEOUT,
                with_result("upstream_timeout"),
                Bytes::new()
            )
            .unwrap(),
            FenceResult::Unknown { .. }
        ));
        assert!(matches!(
            classify(StatusCode::CREATED, with_result("accepted"), Bytes::new()).unwrap(),
            FenceResult::Applied {
                status: StatusCode::CREATED,
                ..
            }
        ));
        assert!(matches!(
            classify(
                StatusCode::PRECONDITION_REQUIRED,
                with_result("missing_token"),
                Bytes::new()
            ),
            Err(FencedError::Refused { status: 428, .. })
        ));
        assert!(matches!(
            classify(StatusCode::OK, HeaderMap::new(), Bytes::new()),
            Err(FencedError::NotFenced { status: 200 })
        ));
    }
}
