//! The forwarder, the innermost stage: an admitted request's upstream exchange, as phases
//! over its context ([`Admitted`]): choose the peer (the route's upstream, or the shard's
//! owner) → take the body (in memory, or to stream) → the upstream request's head → the
//! exchange (raced by a cluster's stop) → the client's response, or the failure's answer.
//!
//! One concern per file: [`mod@client`] (the pools, the https clients, sending), [`headers`]
//! (the upstream head: hop-by-hop and forwarding headers), [`body`] (the request body on
//! its way) and [`response`] (the answer's body, which holds the generation until it is
//! over). HTTP/1.1 to the upstream whatever the client spoke; bodies streamed both ways.

mod body;
mod client;
mod headers;
mod response;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::{HeaderValue, Response};

use body::{Outbound, Taken};
pub use body::{Outgoing, upstream_request};
pub use client::{
    Client, TlsBody, UpstreamError, Upstreamed, client, error_chain, send, send_whole, sweep_idle,
};
pub use headers::{Added, strip_hop_by_hop, upstream_parts};
pub use response::{Confirms, CutShort, client_response, holds_back};

use super::config::Upstream;
use super::context::{Admitted, Conn, Plan, Verdict};
use super::hop::{FENCEGATE_PEER, Hop, Stop};
use super::problem::{self, Outcome};
use super::stage::Stage;
use super::{Body, FENCING_RESULT, Table};
use crate::fence::InflightGuard;
use crate::metrics::{Metrics, Op};
use crate::token::Token;

/// The forwarding stage and what it reports to (the upstream connections are the
/// worker's pool, or the https upstream's client in the routing table).
#[derive(Clone)]
pub(crate) struct Forwarder {
    pub(super) metrics: Arc<Metrics>,
}

/// Where the exchange goes (the choose-peer phase): the route's upstream, by its index
/// in the table, or for a hop the shard's owner as an upstream of its own.
struct Peer {
    index: usize,
    /// Boxed: a cluster's case, kept out of every request's future.
    hop: Option<Box<Upstream>>,
}

impl Peer {
    /// A hop goes to the shard's owner instead (SPEC §10), plain HTTP, and may wait there
    /// for older generations to drain before the owner's own exchange.
    fn choose(table: &Table, route: usize, hop: Option<&Hop>) -> Peer {
        let config = &table.config;
        let index = config.routes[route].upstream;
        let hop = hop.map(|h| {
            let route_upstream = &config.upstreams[index];
            Box::new(Upstream {
                name: String::new(),
                url: h.url.clone(),
                timeout: route_upstream
                    .timeout
                    .saturating_add(config.fencing.drain_timeout),
                tls: None,
                distinct_hosts: route_upstream.distinct_hosts,
            })
        });
        Peer { index, hop }
    }
}

/// One exchange's context, gathered by the first phases and read by the last. It owns
/// what it names (the table too), so the exchange's future holds it and nothing of the
/// request it was made from.
struct Exchange {
    table: Arc<Table>,
    route: usize,
    op: Op,
    peer: Peer,
    /// The request's path, named only in an S3 error document: copied only on such routes.
    resource: Option<String>,
    max_body: Option<u64>,
    /// The client's HTTP version, which decides how a failing body ends.
    client_version: http::Version,
    /// A later phase reads the [`Verdict`] ([`Admitted::report`]).
    report: bool,
}

impl Exchange {
    /// The upstream the exchange goes to.
    fn upstream(&self) -> &Upstream {
        match &self.peer.hop {
            Some(owner) => owner,
            None => &self.table.config.upstreams[self.peer.index],
        }
    }

    /// The https upstream's own client; `None`: this worker's plain-HTTP pools (a hop's
    /// too).
    fn tls_client(&self) -> Option<&Client> {
        match self.peer.hop {
            Some(_) => None,
            None => self.table.clients[self.peer.index].as_ref(),
        }
    }

    /// Refuses the request, which may have reached the upstream.
    fn refuse(&self, outcome: Outcome) -> Response<Body> {
        self.table
            .refuse(self.route, self.op, outcome, self.resource.as_deref())
    }

    /// Refuses a request the upstream provably did not apply (a retry may go again).
    fn refuse_unsent(&self, outcome: Outcome) -> Response<Body> {
        self.table
            .refuse_unsent(self.route, self.op, outcome, self.resource.as_deref())
    }

    fn timeout(&self) -> Duration {
        self.upstream().timeout
    }
}

/// How an exchange ended without an answer (an answer goes to [`respond`] as it came,
/// not moved into this first).
enum Ended {
    Failed(UpstreamError),
    /// No response within the upstream's timeout.
    TimedOut,
    /// The cluster's stop fired mid-exchange.
    Stopped,
}

/// Refuses a request that was not forwarded: its guard says so (nothing to settle, the
/// token was not used).
fn not_forwarded(
    ex: &Exchange,
    guard: &mut Option<InflightGuard>,
    detail: String,
) -> Response<Body> {
    if let Some(g) = guard.as_mut() {
        g.not_forwarded();
    }
    ex.refuse_unsent(Outcome::InvalidRequest { detail })
}

impl Forwarder {
    /// Forwards an admitted request, phase by phase. The phases before the first await
    /// run here, before the future is made: it then holds the exchange's context and
    /// nothing of the request it came from (what an `async` block takes in, it keeps to
    /// its end, beside every local that lives across an await). (A plain function
    /// returning its future, as [`Proxy::handle`](super::Proxy::handle).)
    #[inline(always)]
    pub(crate) fn forward(
        &self,
        a: Admitted<Body>,
    ) -> impl Future<Output = Response<Body>> + Send + '_ {
        let Admitted {
            req,
            table,
            plan,
            conn,
            report,
        } = a;
        let Plan {
            route,
            op,
            guard,
            scope,
            token,
            hop,
            stop,
            ..
        } = plan;
        // The upstream timeout counts from here: reading the body is part of the exchange
        // (as it was when the body streamed upstream), and the clock is read once.
        let started = Instant::now();
        let peer = Peer::choose(&table, route, hop.as_deref());
        let route_config = &table.config.routes[route];
        let ex = Exchange {
            route,
            op,
            resource: (route_config.errors != problem::Dialect::Problem)
                .then(|| req.uri().path().to_owned()),
            peer,
            max_body: route_config.max_body,
            client_version: req.version(),
            report,
            table,
        };
        // A connection not made by the exchange's end is given up on its own, so that
        // the request is known not to have reached the upstream: 502 and no settle,
        // rather than the exchange's 504 (outcome unknown).
        let connect_by = started
            .checked_add(ex.timeout())
            .unwrap_or(started + Duration::from_secs(86_400 * 365));
        let (mut parts, body) = req.into_parts();
        let taken = body::take(body, parts.version, ex.max_body);
        // The upstream head, made now; a failure is answered after the body is read, as
        // a body that cannot be read is answered first.
        let added = head(&ex, &mut parts, hop.as_deref(), conn);
        self.exchange(Prepared {
            ex,
            parts,
            taken,
            added,
            guard,
            scope,
            token,
            hop,
            stop,
            started,
            connect_by,
        })
    }

    /// The phases that await: the body (if read whole), the exchange (raced by a
    /// cluster's stop), then the client's response or the failure's answer.
    #[inline(always)]
    fn exchange(&self, p: Prepared) -> impl Future<Output = Response<Body>> + Send + '_ {
        // `p`'s fields are read where they are, not bound to locals first: a local that
        // lives across an await takes room of its own beside what the block took in.
        let mut p = p;
        async move {
            let ex = &p.ex;
            let body = match p.taken {
                Taken::Ready(body) => body,
                // Awaited here, not in a function of its own: one future less per request.
                Taken::ReadWhole(body) => {
                    match crate::rt::timer::timeout_from(
                        p.started,
                        ex.timeout(),
                        body::read_whole(body),
                    )
                    .await
                    {
                        Ok(Ok(bytes)) => Outbound::Whole(bytes),
                        Ok(Err(_)) | Err(_) => {
                            let detail = "the request body could not be read (in time)".into();
                            return not_forwarded(ex, &mut p.guard, detail);
                        }
                    }
                }
            };
            let added = match p.added {
                Ok(added) => added,
                Err(e) => return not_forwarded(ex, &mut p.guard, format!("cannot forward: {e}")),
            };
            // The exchange: the lean one for a plain-HTTP upstream and a body in hand, else
            // through hyper's client, streaming. Awaited here, each way once, not in a
            // function of its own: its awaits stay in this future, with no nested one (a
            // nested one cost W1 1.5% more instructions, `benches/callgrind.sh`).
            let upstream = ex.upstream();
            let (started, connect_by) = (p.started, p.connect_by);
            let (sent, outgoing) = match (body, ex.tls_client()) {
                (Outbound::Whole(bytes), None) => {
                    let send = send_whole(upstream, &p.parts, &added, &bytes, connect_by);
                    let timed = crate::rt::timer::timeout_from(started, upstream.timeout, send);
                    // Raced only where there is a stop (a lone instance has none).
                    let sent = match p.stop.as_mut() {
                        None => Ok(timed.await),
                        stop => Stoppable::new(stop, timed).await,
                    };
                    (sent, None)
                }
                (body, tls_client) => {
                    let mut parts = p.parts;
                    added.put_into(&mut parts.headers);
                    let (out, outgoing) = upstream_request(parts, body.into_body(), ex.max_body);
                    // Boxed: hyper's client exchange makes a large future, which would
                    // make every request's future (moved whole on its way to hyper) that
                    // large.
                    let send = Box::pin(send(upstream, tls_client, out, connect_by));
                    let timed = crate::rt::timer::timeout_from(started, upstream.timeout, send);
                    (Stoppable::new(p.stop.as_mut(), timed).await, Some(outgoing))
                }
            };
            self.metrics
                .upstream_seconds
                .observe_duration(started.elapsed());
            let hopped = p.hop.is_some();
            let ended = match sent {
                Ok(Ok(Ok(resp))) => {
                    return respond(ex, resp, p.guard, outgoing, p.stop, hopped);
                }
                Ok(Ok(Err(e))) => Ended::Failed(e),
                Ok(Err(_)) => Ended::TimedOut,
                Err(Stopped) => {
                    // One that fired here is done with (held until the exchange was
                    // dropped: a hand-off counts the stops).
                    drop(p.stop.take());
                    Ended::Stopped
                }
            };
            let hop = p.hop.as_deref();
            failed(ex, ended, outgoing, p.guard, hop, p.scope, p.token)
        }
    }
}

/// What the exchange's future is made with: the context, the upstream head and the body
/// as the first phases left them, and the plan's part that the last phases read.
struct Prepared {
    ex: Exchange,
    parts: http::request::Parts,
    taken: Taken,
    added: Result<Added, http::Error>,
    guard: Option<InflightGuard>,
    scope: Option<String>,
    token: Option<Token>,
    hop: Option<Arc<Hop>>,
    stop: Option<Stop>,
    started: Instant,
    connect_by: Instant,
}

/// The upstream request's head (the upstream-request phase), from the client's: the
/// cluster's credential, then [`upstream_parts`]. Answers the forwarding headers still to
/// add ([`Added`]).
fn head(
    ex: &Exchange,
    parts: &mut http::request::Parts,
    hop: Option<&Hop>,
    conn: Conn,
) -> Result<Added, http::Error> {
    let config = &ex.table.config;
    // The peer credential is a cluster's own: never a client's, and never sent upstream;
    // a hop carries this cluster's. (A lone instance gives the header no meaning and
    // leaves it be.)
    if config.clustered {
        parts.headers.remove(FENCEGATE_PEER);
    }
    if let Some(h) = hop {
        parts.headers.insert(FENCEGATE_PEER, h.key.clone());
    }
    // An authenticated peer hands on its client's forwarding headers.
    let trusted = conn.hop
        || config
            .trusted_proxies
            .iter()
            .any(|net| net.contains(conn.peer.ip()));
    upstream_parts(
        parts,
        ex.upstream(),
        conn.peer.ip(),
        conn.tls,
        trusted,
        ex.tls_client().is_some(),
    )
}

/// The cluster's stop fired mid-exchange.
struct Stopped;

pin_project_lite::pin_project! {
    /// An exchange raced by a cluster's stop, if it has one (the stop first). In a
    /// cluster, an owner whose ownership ends mid-exchange (its self-fencing deadline, or
    /// its shard's hand-off cutting what did not drain; SPEC §10) gives the exchange up
    /// there and then: the shard's next owner may start admitting once that ownership
    /// could have expired. The stop goes on with the response body, which races it too
    /// (see `response::Cuttable`).
    struct Stoppable<'s, F> {
        stop: Option<&'s mut Stop>,
        #[pin]
        exchange: F,
    }
}

impl<'s, F: Future> Stoppable<'s, F> {
    fn new(stop: Option<&'s mut Stop>, exchange: F) -> Self {
        Stoppable { stop, exchange }
    }
}

impl<F: Future> Future for Stoppable<'_, F> {
    type Output = Result<F::Output, Stopped>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Some(stop) = this.stop
            && stop.as_mut().poll(cx).is_ready()
        {
            return Poll::Ready(Err(Stopped));
        }
        this.exchange.poll(cx).map(Ok)
    }
}

/// The client's response to an upstream's answer (the response phase): counted, its
/// `Fencing-Result` fencegate's word, its body holding the generation until it is over.
/// (Inline: a call of its own moved the answer once more per request.)
#[inline(always)]
fn respond(
    ex: &Exchange,
    resp: Upstreamed,
    guard: Option<InflightGuard>,
    outgoing: Option<Arc<Outgoing>>,
    stop: Option<Stop>,
    hopped: bool,
) -> Response<Body> {
    let fenced = guard.is_some();
    // The guard is completed, or not, when the answer is over.
    let confirms = Confirms::new(resp.status(), outgoing);
    let (verdict, counted) = match (fenced, hopped) {
        (_, true) => (Verdict::Owner, "forwarded_to_owner"),
        (true, _) => (Verdict::Accepted, "accepted"),
        _ => (Verdict::Unfenced, "unfenced"),
    };
    ex.table.rows[ex.route].count(ex.op, counted);
    // A body that stops moving for the upstream's timeout lets go of its generation.
    let mut resp = client_response(resp, guard, confirms, ex.timeout(), ex.client_version, stop);
    match verdict {
        // The owner decided: its Fencing-Result is the answer's.
        Verdict::Owner => {}
        Verdict::Accepted => {
            resp.headers_mut()
                .insert(FENCING_RESULT, HeaderValue::from_static("accepted"));
        }
        // The header is fencegate's word: an upstream's own must not make an unfenced
        // answer look fenced.
        _ => {
            resp.headers_mut().remove(FENCING_RESULT);
        }
    }
    if ex.report {
        resp.extensions_mut().insert(verdict);
    }
    resp
}

/// The answer to an exchange that ended without a response, and what it means for the
/// generation (settled or not).
fn failed(
    ex: &Exchange,
    ended: Ended,
    outgoing: Option<Arc<Outgoing>>,
    mut guard: Option<InflightGuard>,
    hop: Option<&Hop>,
    scope: Option<String>,
    token: Option<Token>,
) -> Response<Body> {
    let upstream = ex.upstream();
    match ended {
        // The body outgrew the route's limit mid-stream: the upstream saw an incomplete
        // message, which it cannot apply, so there is nothing to settle.
        Ended::Failed(_) if outgoing.as_ref().is_some_and(|o| o.tripped()) => {
            if let Some(g) = guard.as_mut() {
                g.complete();
            }
            ex.refuse_unsent(Outcome::PayloadTooLarge {
                limit: ex.max_body.unwrap_or(0),
            })
        }
        // The owner could not be reached: nothing was decided, retry.
        Ended::Failed(e) if e.not_sent && hop.is_some() => {
            tracing::debug!(owner = hop.map(|h| h.owner.as_str()), error = %e.detail, "hop to the shard's owner not sent");
            ex.refuse(Outcome::Unavailable {
                scope: scope.unwrap_or_default(),
                token: token.unwrap_or(Token::new(0, 0)),
            })
        }
        Ended::Failed(e) if e.not_sent => {
            // Never reached the upstream: nothing to settle, and the token was not used
            // (the answer says retry).
            if let Some(g) = guard.as_mut() {
                g.not_forwarded();
            }
            upstream_failure(&upstream.name, &e.detail);
            ex.refuse_unsent(Outcome::UpstreamUnavailable {
                scope,
                detail: "the connection (or its TLS handshake) failed".into(),
            })
        }
        // Sent, then reset or timed out: the upstream may still apply it. The guard
        // drops uncompleted, so the scope settles before a newer generation goes.
        Ended::Failed(e) => {
            upstream_failure(&upstream.name, &e.detail);
            ex.refuse(Outcome::UpstreamTimeout {
                scope,
                detail: "the exchange ended without a response".into(),
            })
        }
        Ended::Stopped => ex.refuse(Outcome::UpstreamTimeout {
            scope,
            detail: "this instance's ownership of the scope's shard ended mid-exchange".into(),
        }),
        Ended::TimedOut => ex.refuse(Outcome::UpstreamTimeout {
            scope,
            detail: format!("no response within {:?}", upstream.timeout),
        }),
    }
}

/// Logs why an exchange with `upstream` failed: addresses, TLS and socket details are
/// for the operator's log, never for the client's answer. At most one line a second
/// (an upstream that is down fails every request), with the count of those not logged.
fn upstream_failure(upstream: &str, detail: &str) {
    use std::sync::atomic::AtomicU64;
    static LAST: AtomicU64 = AtomicU64::new(0);
    static QUIET: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if LAST.swap(now, Ordering::Relaxed) == now {
        QUIET.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let unlogged = QUIET.swap(0, Ordering::Relaxed);
    tracing::warn!(upstream, detail, unlogged, "upstream exchange failed");
}

/// The forwarder as the binary calls it (see [`Stage`]).
impl Stage<Body> for Forwarder {
    // Forced inline, as the idempotency stage's: with the exchange's future returned as
    // it is, 29,285 instructions per W1 request against 29,597 with neither (see
    // docs/PERFORMANCE.md).
    #[inline(always)]
    fn serve(&self, a: Admitted<Body>) -> impl Future<Output = Response<Body>> + Send + '_ {
        // The exchange's own future, not one wrapped around it: one state machine less
        // per request.
        self.forward(a)
    }
}

#[cfg(test)]
mod tests;
