//! Where every refusal is counted and answered, once ([`Refusals::refuse`]), and how a
//! refused request's unread body decides whether its connection stays open.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderValue, Response, header};

use crate::access_log::{AccessLog, RefusalWarnings};
use crate::metrics::{Metrics, Op};
use crate::proxy::context::{Note, Verdict};
use crate::proxy::problem::Dialect;
use crate::proxy::{Body, Outcome, Table};

/// Where every refusal is counted, once: the route's metric row (or the unrouted one),
/// the access log's note, and the rate-limited warning for `stale_fence` and
/// `invalid_proof`. Every stage refuses through [`Refusals::refuse`] (the inner layers by
/// [`Table::refuse`]).
pub(crate) struct Refusals {
    pub(crate) metrics: Arc<Metrics>,
    /// `[log] access`; off unless set.
    pub(crate) access: AccessLog,
    /// Warnings for stale and unproven tokens, logged whether the access log is on or not.
    pub(crate) warnings: RefusalWarnings,
}

/// A refused request's head, for what only the fence knows of a refusal made before
/// anything was forwarded.
pub(crate) struct Asked<'a> {
    pub(crate) headers: &'a HeaderMap,
    /// The request's path, named in an S3 error document.
    pub(crate) path: &'a str,
    pub(crate) peer: SocketAddr,
    /// An HTTP/1 request whose body was not read: the answer closes the connection.
    pub(crate) unread_body: bool,
}

impl Refusals {
    pub(crate) fn new(metrics: Arc<Metrics>, access: AccessLog) -> Refusals {
        Refusals {
            metrics,
            access,
            warnings: RefusalWarnings::default(),
        }
    }

    /// The one place a refusal is counted and answered. `asked` is the request's head
    /// when the refusal was made before anything was forwarded (the fence's): then it is
    /// noted for the access log, warned about if stale or unproven, and answered with a
    /// request id and (body unread) `Connection: close`. The answer is in the route's
    /// dialect (`errors`); `resource`, the request's path, is named in an S3 document
    /// (`asked`'s path when there is one).
    pub(crate) fn refuse(
        &self,
        table: &Table,
        route: Option<usize>,
        op: Op,
        outcome: Outcome,
        asked: Option<Asked<'_>>,
        resource: Option<&str>,
    ) -> Response<Body> {
        match route {
            Some(i) => table.count(i, op, outcome.result()),
            None => self.metrics.count_unrouted(op, outcome.result()),
        }
        let dialect = match route {
            Some(i) => table.config.routes[i].errors,
            None => crate::proxy::s3::unrouted_dialect(
                &table.config.routes,
                asked.as_ref().map(|a| a.headers),
            ),
        };
        let Some(asked) = asked else {
            return outcome.into_response_in(dialect, resource, None);
        };
        let warned = matches!(
            outcome,
            Outcome::Stale { .. } | Outcome::InvalidProof { .. }
        );
        let logged = self.access.is_on();
        let mut note = None;
        let mut id = None;
        if warned || logged {
            let (scope, token, highest) = outcome.fields();
            // With the access log on, the request already carries the id the log keeps.
            let request_id = self.access.request_id(asked.headers);
            if let (Some(scope), Some(token), true) = (scope, token, warned) {
                self.warnings.warn(&crate::access_log::Refused {
                    result: outcome.result(),
                    scope,
                    token: *token,
                    highest,
                    peer: asked.peer,
                    route: route.map_or("-", |i| table.config.routes[i].name.as_str()),
                    request_id: request_id.to_str().unwrap_or("-"),
                });
            }
            if logged {
                note = Some(Note {
                    route: route.map(|i| table.config.routes[i].name.clone()),
                    scope: scope.cloned(),
                    token: token.copied(),
                    highest,
                    sequence: outcome.sequences().map(|s| s.0),
                    highest_sequence: outcome.sequences().map(|s| s.1),
                    upstream: None,
                    verdict: Some(Verdict::Refused(outcome.result())),
                });
            } else {
                id = Some(request_id);
            }
        }
        let shown_id = match (&id, dialect) {
            (_, Dialect::Problem) => None,
            (Some(id), _) => Some(id.clone()),
            // With the access log on, the request carries the id the log keeps.
            (None, _) => asked.headers.get(crate::access_log::X_REQUEST_ID).cloned(),
        };
        let mut resp = outcome.into_response_in(dialect, Some(asked.path), shown_id.as_ref());
        if let Some(id) = id {
            resp.headers_mut()
                .insert(crate::access_log::X_REQUEST_ID, id);
        }
        if let Some(note) = note {
            resp.extensions_mut().insert(note);
        }
        // Refused before its body was read: hyper closes the connection after the answer,
        // which says so, or a keep-alive client would send its next request into the close.
        if asked.unread_body {
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

/// The largest body of a refused HTTP/1 request that is read and dropped rather than left
/// unread (which closes the connection): W3's stale writes keep their connections.
const DISCARD_MAX: u64 = 64 * 1024;
/// How long a refusal waits for such a body. A body sent with its head is in hyper's
/// buffer already and takes one turn of the connection's loop; one the client holds back
/// is given up on after this, and the answer closes the connection.
const DISCARD_WAIT: Duration = Duration::from_millis(500);

/// Whether a refused request's answer must close the connection (see [`Refusals::refuse`]):
/// an HTTP/1 request whose body has not ended, unless it is small, of known length, not
/// waiting for `100 Continue` (reading would ask the client to send it) and arrives
/// within [`DISCARD_WAIT`]; that one is read and dropped, as nginx discards the body of a
/// request it refused, and the connection stays open.
pub(super) async fn unread<B: http_body::Body>(
    version: http::Version,
    headers: &HeaderMap,
    body: B,
) -> bool {
    use http_body_util::BodyExt;
    if version >= http::Version::HTTP_2 || body.is_end_stream() {
        return false;
    }
    if headers.contains_key(header::EXPECT)
        || body.size_hint().exact().is_none_or(|n| n > DISCARD_MAX)
    {
        return true;
    }
    let mut body = std::pin::pin!(body);
    let discarded = crate::rt::timer::timeout_from(Instant::now(), DISCARD_WAIT, async {
        while !body.is_end_stream() {
            let mut b = body.as_mut();
            match b.frame().await {
                Some(Ok(_)) => {}
                Some(Err(_)) => return false,
                None => break,
            }
        }
        true
    })
    .await;
    !matches!(discarded, Ok(true))
}
