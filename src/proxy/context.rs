//! One request's context as it goes through the proxy's phases: the connection it came
//! on, the routing table and plan it was admitted under ([`Admitted`]), and what it came
//! to ([`Verdict`], and [`Note`] for the access log), typed, so no phase reads it back
//! from the `Fencing-Result` header text.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use http::Request;

use super::Table;
use super::hop;
use crate::fence::InflightGuard;
use crate::metrics::Op;
use crate::token::Token;

/// The connection a request came on: its peer (for `X-Forwarded-For`, the access log and
/// warnings) and whether it was TLS. A layer serving one connection is given it (see
/// [`Fence::on_connection`](super::fence::Fence::on_connection)); otherwise it is read
/// from the request's extensions, if there.
#[derive(Debug, Clone)]
pub struct Conn {
    pub peer: SocketAddr,
    pub tls: bool,
    /// The request came from another instance of the cluster, on this one's
    /// `peer_listen`, authenticated (SPEC §10): it may not hop again.
    pub hop: bool,
    /// The client's count of descriptors (see `listen::share`), on which an exchange that
    /// goes on after its client has gone counts; `None` where the listener counts none.
    pub client: Option<Arc<crate::listen::share::Held>>,
}

impl Default for Conn {
    fn default() -> Conn {
        Conn {
            peer: SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
            tls: false,
            hop: false,
            client: None,
        }
    }
}

/// Where a request stands after the checks (the decide phase): forward it, fenced or not.
pub(crate) struct Plan {
    pub(crate) route: usize,
    /// The request's method, as counted.
    pub(crate) op: Op,
    /// `Some` for fenced requests: the generation they hold at the gate.
    pub(crate) guard: Option<InflightGuard>,
    pub(crate) scope: Option<String>,
    pub(crate) token: Option<Token>,
    /// `Some` for a fenced request whose shard another instance owns: it goes there,
    /// not upstream (SPEC §10).
    pub(crate) hop: Option<Arc<hop::Hop>>,
    /// In a cluster, for a request admitted here: resolves when this instance must stop
    /// its upstream exchange (its ownership's self-fencing deadline passed).
    pub(crate) stop: Option<hop::Stop>,
    /// An S3 CreateMultipartUpload decided here: its answer's upload id is recorded with
    /// the scope before the answer goes on (SPEC §15).
    pub(crate) record_upload: bool,
}

/// An admitted request on its way to the inner stages of the binary's stack, with its
/// context: the plan holds the gate's guard, which goes on with the upstream exchange.
pub(crate) struct Admitted<B> {
    pub(crate) req: Request<B>,
    /// The table the request was classified with (its route indexes this one).
    pub(crate) table: Arc<Table>,
    pub(crate) plan: Plan,
    pub(crate) conn: Conn,
    /// A phase after the forwarder reads the [`Verdict`] (the access log, the
    /// idempotency record): the forwarder leaves it in its answer's extensions. Off for
    /// the plain request, whose answer then carries no extension map at all.
    pub(crate) report: bool,
}

/// What a request came to, as the access log and the idempotency record read it: the
/// `Fencing-Result` the answer carries, typed. Left in the answer's extensions by the
/// phase that decided it, when asked ([`Admitted::report`]); every refusal after admission
/// carries one ([`Table::refuse`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Forwarded without a token.
    Unfenced,
    /// Forwarded under its admitted generation, and answered by the upstream.
    Accepted,
    /// Answered from the idempotency record.
    Duplicate,
    /// Handed to the shard's owner (SPEC §10), whose own `Fencing-Result` is the answer's:
    /// that word arrived on the wire, in the owner's header.
    Owner,
    /// Refused, or failed, with this result; the request may have reached the upstream.
    Refused(&'static str),
    /// Refused with this result, provably before the upstream could apply it (never
    /// sent, or sent incomplete): a retry may go again.
    NotForwarded(&'static str),
}

impl Verdict {
    /// The result's name, as in `Fencing-Result`, the metrics and the access log; `None`
    /// for [`Verdict::Owner`], whose name is the owner's.
    pub(crate) fn result(self) -> Option<&'static str> {
        match self {
            Verdict::Unfenced => Some("unfenced"),
            Verdict::Accepted => Some("accepted"),
            Verdict::Duplicate => Some("duplicate"),
            Verdict::Owner => None,
            Verdict::Refused(r) | Verdict::NotForwarded(r) => Some(r),
        }
    }
}

/// What the access log records of a request beyond its head and response, left in the
/// response's extensions by the fence when the access log is on.
#[derive(Default, Clone)]
pub(crate) struct Note {
    /// The route's name (the table may be swapped by the time the line is written).
    pub(crate) route: Option<String>,
    pub(crate) scope: Option<String>,
    pub(crate) token: Option<Token>,
    pub(crate) highest: Option<Token>,
    /// The request's `Fencing-Sequence`, and on `stale_sequence` the highest recorded.
    pub(crate) sequence: Option<u64>,
    pub(crate) highest_sequence: Option<u64>,
    /// From admission to the response head: the upstream exchange, with reading a small
    /// request body whole before it.
    pub(crate) upstream: Option<Duration>,
    /// What the request came to.
    pub(crate) verdict: Option<Verdict>,
}

impl Note {
    /// What the access log notes of an admitted request before its exchange.
    pub(crate) fn of(table: &Table, plan: &Plan) -> Note {
        Note {
            route: Some(table.config.routes[plan.route].name.clone()),
            scope: plan.scope.clone(),
            token: plan.token,
            sequence: plan.guard.as_ref().and_then(InflightGuard::sequence),
            ..Note::default()
        }
    }
}
