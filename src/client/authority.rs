//! Talking to the lease authority: acquire, renew, release, status.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use tokio::sync::watch;
use tokio::time::Instant;

use super::{BadUrl, ClientOptions, Http, base_url, http_client};
use crate::client::fenced::Fence;
use crate::token::Token;

/// A lease the client no longer holds (expired by its local clock, answered `lost`, or
/// released). Final: a lease that is lost never becomes held again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the lease is lost")]
pub struct LeaseLost;

#[derive(Debug, Clone, thiserror::Error)]
pub enum AcquireError {
    #[error("busy (holder {holder:?}); retry after {retry_after:?}")]
    Busy {
        holder: Option<String>,
        retry_after: Duration,
    },
    #[error("authority unavailable; retry after {retry_after:?}")]
    Unavailable { retry_after: Duration },
    /// The request itself was refused (400): a bug in the caller.
    #[error("refused by the authority ({status}): {title}")]
    Refused { status: u16, title: String },
    /// No answer: the lease may or may not have been granted (if it was, it expires).
    #[error("no answer from the authority: {0}")]
    Transport(String),
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum RenewError {
    /// Definitive: the lease is gone. Stop using it.
    #[error(transparent)]
    Lost(#[from] LeaseLost),
    /// No decision; the lease stays usable until its local deadline.
    #[error("renewal not answered: {0}")]
    Transient(String),
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum ReleaseError {
    /// The authority no longer had this lease (it had expired): nothing to release.
    #[error(transparent)]
    Lost(#[from] LeaseLost),
    /// No answer: the lease expires by itself.
    #[error("release not answered: {0}")]
    Transient(String),
}

/// Why one exchange with the authority got no answer it could read. The lease operations
/// keep its message in their own errors (which are `Clone`, as a source is not).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CallError {
    #[error("{0}")]
    Request(#[source] http::Error),
    #[error("the bearer secret is not a header value")]
    Bearer,
    #[error("{0}")]
    Send(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("{0}")]
    Body(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("answer is not JSON ({status}): {source}")]
    NotJson {
        status: StatusCode,
        #[source]
        source: serde_json::Error,
    },
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// Why [`AuthorityClient::status`] has no answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StatusError {
    #[error(transparent)]
    Call(#[from] CallError),
    /// The authority answered, but not 200.
    #[error("{status}: {title}")]
    Refused { status: StatusCode, title: String },
    /// A 200 whose body is not a lock's status.
    #[error("{0}")]
    Malformed(#[source] serde_json::Error),
}

/// `GET /v1/locks?scope=S`, as seen by the authority.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct LockInfo {
    pub scope: String,
    pub holder: Option<String>,
    pub lease_id: Option<String>,
    pub token: Option<Token>,
    pub ttl_ms: Option<u64>,
    pub last_issued: Option<Token>,
}

#[derive(Debug)]
enum Validity {
    Held { deadline: Instant },
    Lost,
}

struct LeaseState {
    validity: Mutex<Validity>,
    /// Renewals in flight: while several overlap, their answers only lower the deadline
    /// ([`Lease::renewed`]).
    renewals: Mutex<Renewals>,
    /// Carries the deadline (None once lost) to [`Lease::lost`] waiters.
    changes: watch::Sender<Option<Instant>>,
    /// The last `Fencing-Sequence` taken by a numbered fence of this lease (SPEC §11).
    sequence: Arc<AtomicU64>,
}

#[derive(Default)]
struct Renewals {
    in_flight: usize,
    /// Renewals ever sent; a renewal that finds it moved on had company.
    sent: u64,
    /// The shortest span (from its sending) of any renewal that got no answer: the
    /// authority may still apply it, at any later moment, and so hold the lease no longer
    /// than that span from then on.
    unanswered: Option<Duration>,
}

/// One renewal in flight; ends when dropped (answered, failed or abandoned).
struct Renewal<'a> {
    lease: &'a Lease,
    seq: u64,
    /// No other renewal was in flight when this one was sent.
    alone: bool,
    sent: Instant,
    /// How long after sending it holds the lease, once applied.
    span: Duration,
    answered: std::cell::Cell<bool>,
}

impl Renewal<'_> {
    /// Did another renewal run at any moment of this one's flight?
    fn overlapped(&self) -> bool {
        !self.alone || self.lease.renewals().sent != self.seq
    }

    /// The authority answered it (whatever it said): it will not be applied later.
    fn answered(&self) {
        self.answered.set(true);
    }
}

impl Drop for Renewal<'_> {
    fn drop(&mut self) {
        let mut r = self.lease.renewals();
        r.in_flight = r.in_flight.saturating_sub(1);
        if !self.answered.get() {
            r.unanswered = Some(r.unanswered.map_or(self.span, |s| s.min(self.span)));
        }
    }
}

/// A granted lease: a capability to act on `scope` with `token` until the local deadline.
/// Clones share one state, so a renewal or a loss seen by one clone holds for all.
#[derive(Clone)]
pub struct Lease {
    scope: String,
    lease_id: String,
    token: Token,
    /// The authority's proof of (scope, token), when it signs (SPEC §9).
    proof: Option<String>,
    state: Arc<LeaseState>,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("scope", &self.scope)
            .field("lease_id", &self.lease_id)
            .field("token", &self.token)
            .field("deadline", &self.deadline())
            .finish()
    }
}

impl Lease {
    fn new(scope: String, lease_id: String, token: Token, deadline: Instant) -> Lease {
        let (changes, _) = watch::channel(Some(deadline));
        let validity = if Instant::now() < deadline {
            Validity::Held { deadline }
        } else {
            Validity::Lost
        };
        Lease {
            scope,
            lease_id,
            token,
            proof: None,
            state: Arc::new(LeaseState {
                validity: Mutex::new(validity),
                renewals: Mutex::default(),
                changes,
                sequence: Arc::default(),
            }),
        }
    }

    /// Builds a lease from parts (tests, or a lease handed over from another process).
    pub fn from_parts(scope: String, lease_id: String, token: Token, deadline: Instant) -> Lease {
        Lease::new(scope, lease_id, token, deadline)
    }

    pub fn scope(&self) -> &str {
        &self.scope
    }

    pub fn lease_id(&self) -> &str {
        &self.lease_id
    }

    pub fn token(&self) -> Token {
        self.token
    }

    /// The authority's proof for this lease's scope and token, if it signs.
    pub fn proof(&self) -> Option<&str> {
        self.proof.as_deref()
    }

    /// The lease with `proof` (a lease handed over from another process, with its proof).
    pub fn with_proof(mut self, proof: impl Into<String>) -> Lease {
        self.proof = Some(proof.into());
        self
    }

    fn validity(&self) -> std::sync::MutexGuard<'_, Validity> {
        self.state
            .validity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// The local deadline; `None` once the lease is lost. Past the deadline the lease is
    /// lost, and stays lost.
    pub fn deadline(&self) -> Option<Instant> {
        let mut v = self.validity();
        match *v {
            Validity::Held { deadline } if Instant::now() < deadline => Some(deadline),
            Validity::Held { .. } => {
                *v = Validity::Lost;
                drop(v);
                self.state.changes.send_replace(None);
                None
            }
            Validity::Lost => None,
        }
    }

    pub fn is_held(&self) -> bool {
        self.deadline().is_some()
    }

    /// The fence to put on requests, if the lease is still held now. The fence shares
    /// this lease's state: [`FencedHttp::send`](crate::client::FencedHttp::send) refuses it
    /// once the lease is lost. That is a courtesy, not the safety: the process may pause
    /// between that check and the request, and only the proxy's fence stops it then.
    pub fn fence(&self) -> Result<Fence, LeaseLost> {
        self.deadline().ok_or(LeaseLost)?;
        Ok(Fence {
            scope: self.scope.clone(),
            token: self.token,
            proof: self.proof.clone(),
            lease: Some(self.clone()),
            sequence: Some(self.state.sequence.clone()),
            numbered: false,
        })
    }

    /// Gives the lease up locally, for good.
    pub fn mark_lost(&self) {
        *self.validity() = Validity::Lost;
        self.state.changes.send_replace(None);
    }

    fn renewals(&self) -> std::sync::MutexGuard<'_, Renewals> {
        self.state
            .renewals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Notes a renewal sent now that, once the authority applies it, holds the lease at
    /// least `until` (measured from sending). The authority may apply it before its answer
    /// arrives, and a renewal for a shorter ttl shortens the lease there: from now on the
    /// deadline is at most `until`.
    fn renewal_sent(&self, until: Instant) -> Renewal<'_> {
        let mut v = self.validity();
        if let Validity::Held { deadline } = *v
            && until < deadline
        {
            *v = Validity::Held { deadline: until };
            drop(v);
            self.state.changes.send_replace(Some(until));
        }
        let mut r = self.renewals();
        r.sent += 1;
        let sent = Instant::now();
        let renewal = Renewal {
            lease: self,
            seq: r.sent,
            alone: r.in_flight == 0,
            sent,
            span: until.saturating_duration_since(sent),
            answered: std::cell::Cell::new(false),
        };
        r.in_flight += 1;
        renewal
    }

    /// The authority renewed the lease until at least `until` (measured from sending), if
    /// it is still held. A renewal that ran alone sets the deadline to `until`, earlier
    /// too: a renewal for a shorter ttl shortens the lease at the authority as well. When
    /// renewals overlap, the authority keeps whichever it applied last, and requests on
    /// separate connections may be applied in any order, so the client cannot know which:
    /// an overlapped renewal only ever lowers the deadline (the minimum is a bound on every
    /// order). The next renewal that runs alone extends it again. A lost lease stays lost
    /// (a late renewal answer must not revive it).
    fn renewed(&self, renewal: &Renewal<'_>, until: Instant) -> Result<(), LeaseLost> {
        renewal.answered();
        // A renewal that never got its answer may be applied after this one, for its
        // own (shorter) span.
        let until = match self.renewals().unanswered {
            Some(span) => until.min(renewal.sent + span),
            None => until,
        };
        let mut v = self.validity();
        match *v {
            Validity::Held { deadline } if Instant::now() < deadline => {
                let deadline = if renewal.overlapped() {
                    until.min(deadline)
                } else {
                    until
                };
                *v = Validity::Held { deadline };
                drop(v);
                self.state.changes.send_replace(Some(deadline));
                Ok(())
            }
            Validity::Held { .. } | Validity::Lost => {
                *v = Validity::Lost;
                drop(v);
                self.state.changes.send_replace(None);
                Err(LeaseLost)
            }
        }
    }

    /// Resolves when the lease is lost (its deadline passes, or it is marked lost).
    pub async fn lost(&self) {
        let mut rx = self.state.changes.subscribe();
        loop {
            let deadline = *rx.borrow_and_update();
            let Some(deadline) = deadline else { return };
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => {
                    if self.deadline().is_none() {
                        return;
                    }
                }
                changed = rx.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

/// A client of the lease authority's HTTP API.
#[derive(Clone)]
pub struct AuthorityClient {
    http: Http,
    base: String,
    options: ClientOptions,
}

/// An answer, read whole.
struct Answer {
    status: StatusCode,
    headers: http::HeaderMap,
    json: serde_json::Value,
}

impl Answer {
    fn str(&self, key: &str) -> Option<&str> {
        self.json.get(key).and_then(|v| v.as_str())
    }
    fn millis(&self, key: &str) -> Option<Duration> {
        self.json
            .get(key)
            .and_then(|v| v.as_u64())
            .map(Duration::from_millis)
    }
    fn result(&self) -> &str {
        self.str("result").unwrap_or("")
    }
    fn title(&self) -> String {
        self.str("title").unwrap_or("").to_string()
    }
}

impl AuthorityClient {
    /// `base` is `http://host:port` or `https://host:port` of the authority listener.
    pub fn new(base: &str) -> Result<AuthorityClient, BadUrl> {
        AuthorityClient::with_options(base, ClientOptions::default())
    }

    pub fn with_options(base: &str, options: ClientOptions) -> Result<AuthorityClient, BadUrl> {
        Ok(AuthorityClient {
            http: http_client(options.tls.as_ref()),
            base: base_url(base)?,
            options,
        })
    }

    pub fn options(&self) -> &ClientOptions {
        &self.options
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
        timeout: Duration,
    ) -> Result<Answer, CallError> {
        let bytes = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(bytes))
            .map_err(CallError::Request)?;
        if let Some(secret) = &self.options.bearer {
            let mut value = http::HeaderValue::from_str(&format!("Bearer {}", secret.0))
                .map_err(|_| CallError::Bearer)?;
            value.set_sensitive(true);
            req.headers_mut().insert(header::AUTHORIZATION, value);
        }
        let exchange = async {
            let resp = self
                .http
                .request(req)
                .await
                .map_err(|e| CallError::Send(e.into()))?;
            let status = resp.status();
            let headers = resp.headers().clone();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| CallError::Body(e.into()))?
                .to_bytes();
            let json = serde_json::from_slice(&body)
                .map_err(|source| CallError::NotJson { status, source })?;
            Ok(Answer {
                status,
                headers,
                json,
            })
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .unwrap_or(Err(CallError::Timeout(timeout)))
    }

    /// Acquires `scope` for `ttl`, waiting up to `wait` while it is busy. The lease's local
    /// deadline is measured from now (before sending), minus the clock margins: the grant
    /// may have happened at any moment of the wait, so a wait eats into the lease (a lease
    /// that arrives already expired is returned not held). Wait only with `ttl` ≫ `wait`.
    /// With a bearer secret the authority takes the holder from it: an empty `holder` is
    /// left out of the request (any other must be the client's name). The grant's proof,
    /// when the authority signs, goes into every fence the lease makes.
    pub async fn acquire(
        &self,
        scope: &str,
        holder: &str,
        ttl: Duration,
        wait: Duration,
    ) -> Result<Lease, AcquireError> {
        let sent = Instant::now();
        let mut body = serde_json::json!({
            "scope": scope,
            "ttl_ms": u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
            "wait_ms": u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
        });
        if !holder.is_empty() {
            body["holder"] = holder.into();
        }
        let a = self
            .call(
                Method::POST,
                "/v1/locks/acquire",
                Some(body),
                self.options.request_timeout + wait,
            )
            .await
            .map_err(|e| AcquireError::Transport(e.to_string()))?;
        let retry = |a: &Answer| {
            a.millis("retry_after_ms")
                .or_else(|| super::retry_after(&a.headers))
                .unwrap_or(Duration::from_secs(1))
        };
        match (a.status, a.result()) {
            (StatusCode::OK, "acquired") => {
                let lease_id = a.str("lease_id").map(str::to_string);
                let token = a.str("token").and_then(|t| t.parse::<Token>().ok());
                let granted = a.millis("ttl_ms");
                match (lease_id, token, granted) {
                    (Some(lease_id), Some(token), Some(granted)) => {
                        // Never rely on more than was asked for, nor more than was granted.
                        let usable = self.options.usable(ttl.min(granted));
                        let mut lease =
                            Lease::new(scope.to_string(), lease_id, token, sent + usable);
                        lease.proof = a.str("proof").map(str::to_string);
                        Ok(lease)
                    }
                    _ => Err(AcquireError::Transport(format!(
                        "malformed acquired answer: {}",
                        a.json
                    ))),
                }
            }
            (_, "busy") => Err(AcquireError::Busy {
                holder: a.str("holder").map(str::to_string),
                retry_after: retry(&a),
            }),
            (_, "unavailable") => Err(AcquireError::Unavailable {
                retry_after: retry(&a),
            }),
            (status, _) if status.is_client_error() => Err(AcquireError::Refused {
                status: status.as_u16(),
                title: a.title(),
            }),
            (status, _) => Err(AcquireError::Transport(format!(
                "unexpected answer {status}: {}",
                a.json
            ))),
        }
    }

    /// Renews the exact lease for `ttl` from now. On `renewed`, the local deadline moves
    /// to (time sent + ttl − margins), unless the lease was lost meanwhile.
    pub async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<(), RenewError> {
        if !lease.is_held() {
            return Err(LeaseLost.into());
        }
        let sent = Instant::now();
        let renewal = lease.renewal_sent(sent + self.options.usable(ttl));
        let body = serde_json::json!({
            "scope": lease.scope,
            "lease_id": lease.lease_id,
            "token": lease.token.to_string(),
            "ttl_ms": u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
        });
        let a = self
            .call(
                Method::POST,
                "/v1/locks/renew",
                Some(body),
                self.options.request_timeout,
            )
            .await
            .map_err(|e| RenewError::Transient(e.to_string()))?;
        // Answered, whatever it says: the authority is done with it. Without an answer
        // (no reply in time, a broken connection) it may still be applied later.
        renewal.answered();
        match (a.status, a.result()) {
            (StatusCode::OK, "renewed") => {
                let granted = a.millis("ttl_ms").unwrap_or(Duration::ZERO);
                lease.renewed(&renewal, sent + self.options.usable(ttl.min(granted)))?;
                Ok(())
            }
            (_, "lost") => {
                lease.mark_lost();
                Err(LeaseLost.into())
            }
            (status, result) => Err(RenewError::Transient(format!(
                "{status} {result}: {}",
                a.title()
            ))),
        }
    }

    /// Releases the exact lease. The lease is given up locally first, whatever the answer.
    pub async fn release(&self, lease: &Lease) -> Result<(), ReleaseError> {
        lease.mark_lost();
        let body = serde_json::json!({
            "scope": lease.scope,
            "lease_id": lease.lease_id,
            "token": lease.token.to_string(),
        });
        let a = self
            .call(
                Method::POST,
                "/v1/locks/release",
                Some(body),
                self.options.request_timeout,
            )
            .await
            .map_err(|e| ReleaseError::Transient(e.to_string()))?;
        match (a.status, a.result()) {
            (StatusCode::OK, "released") => Ok(()),
            (_, "lost") => Err(LeaseLost.into()),
            (status, result) => Err(ReleaseError::Transient(format!(
                "{status} {result}: {}",
                a.title()
            ))),
        }
    }

    /// What the authority knows of `scope`.
    pub async fn status(&self, scope: &str) -> Result<LockInfo, StatusError> {
        let q = percent_encoding::utf8_percent_encode(scope, percent_encoding::NON_ALPHANUMERIC);
        let a = self
            .call(
                Method::GET,
                &format!("/v1/locks?scope={q}"),
                None,
                self.options.request_timeout,
            )
            .await?;
        if a.status != StatusCode::OK {
            return Err(StatusError::Refused {
                status: a.status,
                title: a.title().to_string(),
            });
        }
        serde_json::from_value(a.json).map_err(StatusError::Malformed)
    }

    /// Renews `lease` in the background every `ttl / 3` until it is lost or the handle is
    /// dropped. Failed renewals are retried while the lease is still held locally.
    pub fn keep_alive(&self, lease: &Lease, ttl: Duration) -> KeepAlive {
        let client = self.clone();
        let lease = lease.clone();
        let task = tokio::spawn(async move {
            let period = (ttl / 3).max(Duration::from_millis(1));
            let mut next = Instant::now() + period;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep_until(next) => {}
                    _ = lease.lost() => return,
                }
                let started = Instant::now();
                // The renewal races the deadline: whichever comes first decides.
                let renewed = tokio::select! {
                    r = client.renew(&lease, ttl) => r,
                    _ = lease.lost() => return,
                };
                next = match renewed {
                    Ok(()) => started + period,
                    Err(RenewError::Lost(_)) => return,
                    Err(RenewError::Transient(e)) => {
                        tracing::debug!(scope = %lease.scope, error = %e, "renewal failed; retrying");
                        Instant::now() + (period / 4).max(Duration::from_millis(1))
                    }
                };
            }
        });
        KeepAlive { task }
    }
}

/// Background renewal; stops when dropped.
pub struct KeepAlive {
    task: tokio::task::JoinHandle<()>,
}

impl KeepAlive {
    /// Stops renewing (the lease then expires unless released).
    pub fn stop(self) {}
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn lost_is_final() {
        let now = Instant::now();
        let lease = Lease::new(
            "s".into(),
            "l".into(),
            Token::new(0, 1),
            now + Duration::from_secs(1),
        );
        assert!(lease.is_held());
        let renew = |until: Instant| {
            let renewal = lease.renewal_sent(until);
            lease.renewed(&renewal, until)
        };
        assert!(renew(now + Duration::from_secs(2)).is_ok());
        assert_eq!(lease.deadline(), Some(now + Duration::from_secs(2)));
        // A renewal for a shorter ttl shortens the lease (the authority's view is shorter
        // too): the holder must not believe it holds longer than the authority grants.
        assert!(renew(now + Duration::from_millis(1500)).is_ok());
        assert_eq!(lease.deadline(), Some(now + Duration::from_millis(1500)));
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(!lease.is_held());
        // A late renewal answer cannot revive it.
        assert_eq!(renew(now + Duration::from_secs(10)), Err(LeaseLost));
        assert!(lease.fence().is_err());
    }

    /// A renewal that got no answer (a timeout) may still be applied later, after one
    /// that did: from then on no renewal holds the lease longer than the unanswered one's
    /// span from its own sending.
    #[tokio::test(start_paused = true)]
    async fn an_unanswered_renewal_bounds_every_later_one() {
        let now = Instant::now();
        let secs = Duration::from_secs;
        let lease = Lease::new("s".into(), "l".into(), Token::new(0, 1), now + secs(30));
        // Sent for 2 s, never answered.
        drop(lease.renewal_sent(now + secs(2)));
        assert_eq!(lease.deadline(), Some(now + secs(2)));
        tokio::time::advance(secs(1)).await;
        // A 30 s renewal alone, answered: the lost one may land right after it.
        let later = Instant::now();
        let alone = lease.renewal_sent(later + secs(30));
        lease.renewed(&alone, later + secs(30)).unwrap();
        drop(alone);
        assert_eq!(lease.deadline(), Some(later + secs(2)));
        // An answered one leaves no such bound behind.
        let other = Lease::new("s".into(), "m".into(), Token::new(0, 2), now + secs(30));
        let short = other.renewal_sent(later + secs(2));
        short.answered();
        drop(short);
        let alone = other.renewal_sent(later + secs(30));
        other.renewed(&alone, later + secs(30)).unwrap();
        assert_eq!(other.deadline(), Some(later + secs(30)));
    }

    /// Two renewals in flight at once, answered in either order: the authority may have
    /// applied either one last, so the client relies on the shorter.
    #[tokio::test(start_paused = true)]
    async fn overlapping_renewals_keep_the_shorter_deadline() {
        let now = Instant::now();
        let secs = Duration::from_secs;
        for short_answers_first in [true, false] {
            let lease = Lease::new("s".into(), "l".into(), Token::new(0, 1), now + secs(5));
            let long = lease.renewal_sent(now + secs(60));
            let short = lease.renewal_sent(now + secs(10));
            // The shorter one may be in force at the authority already.
            assert_eq!(lease.deadline(), Some(now + secs(5)));
            if short_answers_first {
                lease.renewed(&short, now + secs(10)).unwrap();
                drop(short);
                lease.renewed(&long, now + secs(60)).unwrap();
            } else {
                lease.renewed(&long, now + secs(60)).unwrap();
                drop(long);
                lease.renewed(&short, now + secs(10)).unwrap();
            }
            assert_eq!(
                lease.deadline(),
                Some(now + secs(5)),
                "{short_answers_first}"
            );
        }
        // Overlapping renewals from a later deadline: the answers keep the minimum.
        let lease = Lease::new("s".into(), "l".into(), Token::new(0, 1), now + secs(30));
        let long = lease.renewal_sent(now + secs(60));
        let short = lease.renewal_sent(now + secs(10));
        assert_eq!(
            lease.deadline(),
            Some(now + secs(10)),
            "shortened at sending"
        );
        lease.renewed(&short, now + secs(10)).unwrap();
        drop(short);
        lease.renewed(&long, now + secs(60)).unwrap();
        drop(long);
        assert_eq!(lease.deadline(), Some(now + secs(10)));
        // A renewal alone again extends it.
        let alone = lease.renewal_sent(now + secs(20));
        lease.renewed(&alone, now + secs(20)).unwrap();
        assert_eq!(lease.deadline(), Some(now + secs(20)));
    }

    #[tokio::test(start_paused = true)]
    async fn lost_resolves_at_the_deadline() {
        let start = Instant::now();
        let lease = Lease::new(
            "s".into(),
            "l".into(),
            Token::new(0, 1),
            start + Duration::from_secs(3),
        );
        lease.lost().await;
        assert_eq!(Instant::now() - start, Duration::from_secs(3));
        let marked = Lease::new(
            "s".into(),
            "l".into(),
            Token::new(0, 2),
            start + Duration::from_secs(60),
        );
        let waiter = {
            let l = marked.clone();
            tokio::spawn(async move { l.lost().await })
        };
        marked.mark_lost();
        waiter.await.unwrap();
        assert!(!marked.is_held());
    }
}
