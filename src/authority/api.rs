//! The authority's HTTP API (SPEC §8): JSON in, JSON out. Requests are validated here,
//! before any backend sees them; every answer is made by [`answer`], so statuses and
//! bodies stay the same whichever backend decided. Who is calling (SPEC §9) is decided
//! here too: the bearer secret names a client, the client's patterns bound its scopes,
//! and its name is the holder the backends record and compare.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use percent_encoding::percent_decode_str;
use serde::Deserialize;
use tokio::sync::watch;

use super::{AcquireRequest, AuthorityConfig, Client, Engine, LockStatus, MAX_WAIT, Outcome};
use crate::authority::metrics::AuthorityMetrics;
use crate::proof::SigningKey;
use crate::proxy::Body;
use crate::token::Token;

const MAX_BODY: usize = 16 * 1024;
/// Scopes and holders are names, not payloads.
const MAX_NAME: usize = 1024;

/// What the handlers decide with, from `[authority]`.
pub(super) struct Policy {
    pub max_ttl: Duration,
    /// Empty: calls are anonymous (loopback only, `check-config` makes sure).
    pub clients: Vec<Client>,
    /// Signs a proof into every `acquired` answer.
    pub signing_key: Option<Arc<SigningKey>>,
    /// Answers are counted here, whichever backend decided.
    pub metrics: Arc<AuthorityMetrics>,
}

impl Policy {
    pub fn of(config: &AuthorityConfig, metrics: Arc<AuthorityMetrics>) -> Policy {
        Policy {
            max_ttl: config.max_ttl,
            clients: config.clients.clone(),
            signing_key: config.signing_key.clone(),
            metrics,
        }
    }

    /// The client whose secret the request's `Authorization: Bearer` carries; `Ok(None)`
    /// when no clients are configured. Every client's digest is compared (in constant
    /// time), so the answer's timing says nothing of which one, or how close.
    /// `Err(())`: no such client (answered with [`unauthenticated`]).
    fn authenticate(&self, headers: &http::HeaderMap) -> Result<Option<&Client>, ()> {
        if self.clients.is_empty() {
            return Ok(None);
        }
        let mut values = headers.get_all(header::AUTHORIZATION).iter();
        let secret = match (values.next(), values.next()) {
            (Some(v), None) => bearer(v.as_bytes()),
            _ => None,
        };
        let secret = secret.ok_or(())?;
        let presented = super::digest(secret);
        let mut found = None;
        for c in &self.clients {
            let diff = c
                .secret_digest
                .iter()
                .zip(presented.iter())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b));
            if diff == 0 {
                found = Some(c);
            }
        }
        found.map(Some).ok_or(())
    }
}

/// The secret of an `Authorization: Bearer <secret>` value (the scheme's case ignored).
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    let secret = rest.trim_ascii();
    (!secret.is_empty()).then_some(secret)
}

fn unauthenticated() -> Response<Body> {
    let mut r = problem(
        StatusCode::UNAUTHORIZED,
        "unauthenticated",
        "This authority needs `Authorization: Bearer <secret>` of one of its clients",
        json_map(),
    );
    r.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}

fn forbidden(detail: String) -> Response<Body> {
    problem(
        StatusCode::FORBIDDEN,
        "forbidden",
        &format!("Forbidden: {detail}"),
        json_map(),
    )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAcquire {
    scope: Option<String>,
    holder: Option<String>,
    ttl_ms: Option<i64>,
    wait_ms: Option<i64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLease {
    scope: Option<String>,
    lease_id: Option<String>,
    token: Option<String>,
    ttl_ms: Option<i64>,
}

/// A refusal of the request itself: 400 problem+json.
struct BadRequest(String);

/// Serves one call and counts its answer: acquisitions by result and their time (waits
/// included), renewals and releases by result. Counted by the answer's status, which
/// [`answer`] and the refusals make the same for every backend.
pub(super) async fn handle(
    engine: &Engine,
    policy: &Policy,
    body_timeout: Duration,
    req: Request<Incoming>,
    stop: watch::Receiver<bool>,
) -> Response<Body> {
    let started = tokio::time::Instant::now();
    let call = match req.uri().path() {
        "/v1/locks/acquire" => Call::Acquire,
        "/v1/locks/renew" => Call::Renew,
        "/v1/locks/release" => Call::Release,
        _ => Call::Other,
    };
    let response = serve_call(engine, policy, body_timeout, req, stop).await;
    let status = response.status();
    let m = &policy.metrics;
    match call {
        Call::Acquire => {
            let result = match status {
                StatusCode::OK => "acquired",
                StatusCode::CONFLICT => "busy",
                StatusCode::SERVICE_UNAVAILABLE => "unavailable",
                StatusCode::FORBIDDEN => "forbidden",
                StatusCode::UNAUTHORIZED => "unauthenticated",
                _ => "invalid",
            };
            m.acquire(result, started.elapsed());
        }
        Call::Renew | Call::Release
            if status == StatusCode::OK || status == StatusCode::CONFLICT =>
        {
            let ok = status == StatusCode::OK;
            if matches!(call, Call::Renew) {
                m.renewal(ok);
            } else {
                m.release(ok);
            }
        }
        _ => {}
    }
    response
}

enum Call {
    Acquire,
    Renew,
    Release,
    Other,
}

/// One call: its path and method checked, its caller authenticated before its body is
/// read, then the call itself.
async fn serve_call(
    engine: &Engine,
    policy: &Policy,
    body_timeout: Duration,
    req: Request<Incoming>,
    stop: watch::Receiver<bool>,
) -> Response<Body> {
    let path = req.uri().path().to_string();
    let query = req.uri().query().map(str::to_string);
    let allowed = match allowed_method(&path, req.method()) {
        Ok(allowed) => allowed,
        Err(refused) => return *refused,
    };
    // Before the body is read: an unknown caller gets nothing of the authority's time.
    let caller = match policy.authenticate(req.headers()) {
        Ok(c) => c,
        Err(()) => return unauthenticated(),
    };
    let body = if allowed == "POST" {
        match read_body(req.into_body(), body_timeout).await {
            Ok(body) => body,
            Err(refused) => return refused,
        }
    } else {
        Bytes::new()
    };
    let result = match path.as_str() {
        "/v1/locks" => match query_param(query.as_deref(), "scope") {
            Some(scope) if !scope.is_empty() => return status_call(engine, &scope, caller).await,
            _ => Err(BadRequest("the query needs scope=S".into())),
        },
        "/v1/locks/acquire" => {
            match parse_json::<RawAcquire>(&body)
                .map(|raw| acquire_request(raw, policy.max_ttl, caller))
            {
                Ok(Ok(a)) => return acquire_call(engine, policy, &a, caller, stop).await,
                Ok(Err(AcquireRefusal::Bad(e))) | Err(e) => Err(e),
                Ok(Err(AcquireRefusal::OtherHolder(detail))) => return forbidden(detail),
            }
        }
        renew_or_release => {
            let renew = renew_or_release == "/v1/locks/renew";
            let call = parse_json::<RawLease>(&body)
                .and_then(|raw| lease_call(raw, renew, policy.max_ttl));
            match call {
                Ok(call) => return renew_or_release_call(engine, policy, call, caller).await,
                Err(e) => Err(e),
            }
        }
    };
    match result {
        Ok(outcome) => answer(outcome, policy.signing_key.as_deref()),
        Err(BadRequest(detail)) => problem(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            &format!("Bad request: {detail}"),
            json_map(),
        ),
    }
}

/// The method a call's path answers, or the refusal of another path or method.
fn allowed_method(path: &str, method: &http::Method) -> Result<&'static str, Box<Response<Body>>> {
    let allowed = match path {
        "/v1/locks/acquire" | "/v1/locks/renew" | "/v1/locks/release" => "POST",
        "/v1/locks" => "GET",
        _ => {
            return Err(Box::new(problem(
                StatusCode::NOT_FOUND,
                "not_found",
                "No such call",
                json_map(),
            )));
        }
    };
    if method.as_str() != allowed {
        let mut r = problem(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            &format!("{path} answers {allowed} only"),
            json_map(),
        );
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static(allowed));
        return Err(Box::new(r));
    }
    Ok(allowed)
}

/// With clients: the refusal of a scope outside the caller's.
fn out_of_bounds(caller: Option<&Client>, scope: &str) -> Option<Response<Body>> {
    caller.filter(|c| !c.allows(scope)).map(|c| {
        forbidden(format!(
            "client `{}` may not use scope `{scope}` (its scopes: {})",
            c.name,
            c.scopes.join(", ")
        ))
    })
}

/// `GET /v1/locks?scope=S`.
async fn status_call(engine: &Engine, scope: &str, caller: Option<&Client>) -> Response<Body> {
    if let Some(refused) = out_of_bounds(caller, scope) {
        return refused;
    }
    match engine.status(scope).await {
        Ok(status) => status_json(&status, caller),
        Err(e) => answer(
            Outcome::Unavailable {
                retry_after: Duration::from_secs(1),
                detail: e.to_string(),
            },
            None,
        ),
    }
}

/// `POST /v1/locks/acquire`, its request read.
async fn acquire_call(
    engine: &Engine,
    policy: &Policy,
    a: &AcquireRequest,
    caller: Option<&Client>,
    stop: watch::Receiver<bool>,
) -> Response<Body> {
    if let Some(refused) = out_of_bounds(caller, &a.scope) {
        return refused;
    }
    let outcome = engine.acquire(a, stop).await;
    if let Outcome::Acquired(g) = &outcome {
        policy.metrics.granted(g.token.epoch, g.token.counter);
    }
    tracing::debug!(scope = %a.scope, holder = %a.holder, ?outcome, "acquire");
    answer(outcome, policy.signing_key.as_deref())
}

/// `POST /v1/locks/renew` (with a ttl) or `/v1/locks/release` (without), its request read.
async fn renew_or_release_call(
    engine: &Engine,
    policy: &Policy,
    (scope, lease_id, token, ttl): (String, String, Token, Option<Duration>),
    caller: Option<&Client>,
) -> Response<Body> {
    if let Some(refused) = out_of_bounds(caller, &scope) {
        return refused;
    }
    // With clients, only the lease's holder renews or releases it: another client's call
    // with the right (lease_id, token) is `lost` too (not 403, which would tell it that
    // the lease exists), and changes nothing.
    let holder = caller.map(|c| c.name.as_str());
    let outcome = match ttl {
        Some(ttl) => engine.renew(&scope, &lease_id, token, ttl, holder).await,
        None => engine.release(&scope, &lease_id, token, holder).await,
    };
    answer(outcome, policy.signing_key.as_deref())
}

fn name(value: Option<String>, what: &str) -> Result<String, BadRequest> {
    match value {
        None => Err(BadRequest(format!("`{what}` is missing"))),
        Some(s) if s.is_empty() => Err(BadRequest(format!("`{what}` is empty"))),
        Some(s) if s.len() > MAX_NAME => Err(BadRequest(format!(
            "`{what}` is longer than {MAX_NAME} bytes"
        ))),
        Some(s) if s.chars().any(char::is_control) => {
            Err(BadRequest(format!("`{what}` contains a control character")))
        }
        Some(s) => Ok(s),
    }
}

fn ttl(value: Option<i64>, max_ttl: Duration) -> Result<Duration, BadRequest> {
    match value {
        None => Err(BadRequest("`ttl_ms` is missing".into())),
        Some(ms) if ms <= 0 => Err(BadRequest("`ttl_ms` must be greater than 0".into())),
        Some(ms) => {
            let ttl = Duration::from_millis(ms.unsigned_abs());
            if ttl > max_ttl {
                Err(BadRequest(format!(
                    "`ttl_ms` {ms} is above max_ttl ({} ms)",
                    max_ttl.as_millis()
                )))
            } else {
                Ok(ttl)
            }
        }
    }
}

enum AcquireRefusal {
    Bad(BadRequest),
    /// `holder` names another client than the caller: 403.
    OtherHolder(String),
}

impl From<BadRequest> for AcquireRefusal {
    fn from(e: BadRequest) -> AcquireRefusal {
        AcquireRefusal::Bad(e)
    }
}

/// With a `caller`, the holder is the caller's name: `holder` may be left out, and must
/// name the caller if given. Without clients it is required, as the caller says.
fn acquire_request(
    raw: RawAcquire,
    max_ttl: Duration,
    caller: Option<&Client>,
) -> Result<AcquireRequest, AcquireRefusal> {
    let scope = name(raw.scope, "scope")?;
    let holder = match (caller, raw.holder) {
        (None, holder) => name(holder, "holder")?,
        (Some(c), None) => c.name.clone(),
        (Some(c), Some(h)) if h == c.name => h,
        (Some(c), Some(h)) => {
            return Err(AcquireRefusal::OtherHolder(format!(
                "client `{}` cannot acquire for holder `{h}`",
                c.name
            )));
        }
    };
    let ttl = ttl(raw.ttl_ms, max_ttl)?;
    let wait = match raw.wait_ms {
        None => Duration::ZERO,
        Some(ms) if ms < 0 => {
            return Err(BadRequest("`wait_ms` must not be negative".into()).into());
        }
        Some(ms) => {
            let wait = Duration::from_millis(ms.unsigned_abs());
            if wait > MAX_WAIT {
                return Err(
                    BadRequest(format!("`wait_ms` is above {} ms", MAX_WAIT.as_millis())).into(),
                );
            }
            wait
        }
    };
    Ok(AcquireRequest {
        scope,
        holder,
        ttl,
        wait,
    })
}

/// (scope, lease_id, token, ttl for renew / None for release)
fn lease_call(
    raw: RawLease,
    renew: bool,
    max_ttl: Duration,
) -> Result<(String, String, Token, Option<Duration>), BadRequest> {
    let scope = name(raw.scope, "scope")?;
    let lease_id = name(raw.lease_id, "lease_id")?;
    let token = match raw.token {
        None => return Err(BadRequest("`token` is missing".into())),
        Some(t) => t
            .parse::<Token>()
            .map_err(|e| BadRequest(format!("`token` is malformed: {e}")))?,
    };
    let ttl = match (renew, raw.ttl_ms) {
        (true, v) => Some(ttl(v, max_ttl)?),
        (false, None) => None,
        (false, Some(_)) => return Err(BadRequest("release takes no `ttl_ms`".into())),
    };
    Ok((scope, lease_id, token, ttl))
}

/// Reads a request body whole, within `timeout` of its head (a client that announces a
/// body and sends less must not hold its connection for good): else 408, and the
/// connection is closed (the rest of the body is unread).
async fn read_body(body: Incoming, timeout: Duration) -> Result<Bytes, Response<Body>> {
    match tokio::time::timeout(timeout, Limited::new(body, MAX_BODY).collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(_)) => Err(problem(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            &format!("Bad request: body unreadable or above {MAX_BODY} bytes"),
            json_map(),
        )),
        Err(_) => {
            let mut r = problem(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                &format!(
                    "The request body did not arrive within {} ms (header_read_timeout)",
                    timeout.as_millis()
                ),
                json_map(),
            );
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            Err(r)
        }
    }
}

fn parse_json<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, BadRequest> {
    serde_json::from_slice(body).map_err(|e| BadRequest(format!("malformed JSON: {e}")))
}

fn query_param(query: Option<&str>, name: &str) -> Option<String> {
    query?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == name).then(|| {
            percent_decode_str(&v.replace('+', " "))
                .decode_utf8_lossy()
                .into_owned()
        })
    })
}

fn json_map() -> serde_json::Map<String, serde_json::Value> {
    serde_json::Map::new()
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn respond(status: StatusCode, content_type: &'static str, body: String) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(body)).map_err(|e| match e {}).boxed());
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

fn problem(
    status: StatusCode,
    result: &str,
    title: &str,
    mut fields: serde_json::Map<String, serde_json::Value>,
) -> Response<Body> {
    fields.insert(
        "type".into(),
        format!("urn:fencegate:authority:{result}").into(),
    );
    fields.insert("title".into(), title.into());
    fields.insert("status".into(), status.as_u16().into());
    fields.insert("result".into(), result.into());
    respond(
        status,
        "application/problem+json",
        serde_json::Value::Object(fields).to_string(),
    )
}

fn with_retry_after(mut r: Response<Body>, after: Duration) -> Response<Body> {
    // Whole seconds, rounded up: never invite a retry before the scope can be free.
    let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    r
}

/// The one place that turns a decision into a response.
fn answer(outcome: Outcome, signing_key: Option<&SigningKey>) -> Response<Body> {
    use serde_json::json;
    match outcome {
        Outcome::Acquired(g) => {
            let mut body = json!({
                "result": "acquired",
                "scope": g.scope,
                "lease_id": g.lease_id,
                "token": g.token.to_string(),
                "ttl_ms": millis(g.ttl),
            });
            if let Some(key) = signing_key {
                body["proof"] = key.prove(&g.scope, g.token).into();
            }
            respond(StatusCode::OK, "application/json", body.to_string())
        }
        Outcome::Renewed { ttl } => respond(
            StatusCode::OK,
            "application/json",
            json!({"result": "renewed", "ttl_ms": millis(ttl)}).to_string(),
        ),
        Outcome::Released => respond(
            StatusCode::OK,
            "application/json",
            json!({"result": "released"}).to_string(),
        ),
        Outcome::Busy {
            holder,
            retry_after,
        } => {
            let mut f = json_map();
            f.insert("holder".into(), holder.into());
            f.insert("retry_after_ms".into(), millis(retry_after).into());
            with_retry_after(
                problem(
                    StatusCode::CONFLICT,
                    "busy",
                    "The scope is held, or may still be held; retry later",
                    f,
                ),
                retry_after,
            )
        }
        Outcome::Lost => problem(
            StatusCode::CONFLICT,
            "lost",
            "Not the current lease (expired, superseded or unknown); nothing changed",
            json_map(),
        ),
        Outcome::Unavailable {
            retry_after,
            detail,
        } => {
            let mut f = json_map();
            f.insert("retry_after_ms".into(), millis(retry_after).into());
            f.insert("detail".into(), detail.into());
            with_retry_after(
                problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    "The authority could not decide; retry later",
                    f,
                ),
                retry_after,
            )
        }
    }
}

/// A lease id is shown to its holder only: with it, anyone could renew or release the
/// lease. Without clients nobody can prove to be the holder, so it is shown to nobody.
fn status_json(s: &LockStatus, caller: Option<&Client>) -> Response<Body> {
    let lease_id = match (caller, &s.holder) {
        (Some(c), Some(h)) if c.name == *h => s.lease_id.as_deref(),
        _ => None,
    };
    respond(
        StatusCode::OK,
        "application/json",
        serde_json::json!({
            "scope": s.scope,
            "holder": s.holder,
            "lease_id": lease_id,
            "token": s.token.map(|t| t.to_string()),
            "ttl_ms": s.remaining.map(millis),
            "last_issued": s.last_issued.map(|t| t.to_string()),
        })
        .to_string(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_scope_is_percent_decoded() {
        assert_eq!(
            query_param(Some("scope=report%2Fjuly"), "scope").as_deref(),
            Some("report/july")
        );
        assert_eq!(query_param(Some("x=1"), "scope"), None);
    }

    #[test]
    fn ttl_bounds() {
        let max = Duration::from_secs(60);
        assert!(ttl(Some(0), max).is_err());
        assert!(ttl(Some(-5), max).is_err());
        assert!(ttl(Some(60_001), max).is_err());
        assert!(ttl(None, max).is_err());
        assert_eq!(ttl(Some(60_000), max).ok(), Some(max));
    }
}
