//! Connections to plain-HTTP upstreams: one kind of per-worker pool of idle connections
//! ([`pool`]), generic over the connection, holding either hyper's client connections
//! for requests whose body streams ([`streamed`]) or those of fencegate's own lean
//! HTTP/1.1 exchange for requests whose body is in memory ([`h1`]).

use std::time::{Duration, Instant};

use http::uri::Authority;
use tokio::net::TcpStream;

use crate::rt::fds::Fd;

mod decode;
pub mod h1;
pub mod pool;
pub mod streamed;

pub(crate) use decode::check_framing;
#[cfg(feature = "fuzzing")]
pub(crate) use decode::decode_all;
pub use h1::{H1Body, H1Pool};
pub use pool::{Connection, Pool, SWEEP_EVERY};
pub use streamed::{SendError, StreamedBody, StreamedPool};

/// A new TCP connection to a plain-HTTP upstream, with Nagle off, given up after `timeout`
/// or at `until` (the end of the exchange it is for), whichever comes first; on failure,
/// what went wrong (nothing was sent). The connection's descriptor is counted against the
/// process's budget while the [`Fd`] answered with it lives; past the budget none is made.
pub(crate) async fn connect_tcp(
    authority: &Authority,
    timeout: Duration,
    until: Instant,
) -> Result<(TcpStream, Fd), ConnectError> {
    let fd = crate::rt::fds::take().ok_or_else(|| ConnectError::NoFd(authority.clone()))?;
    let port = authority.port_u16().unwrap_or(80);
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let until = Instant::now()
        .checked_add(timeout)
        .map_or(until, |t| t.min(until));
    // On the worker's deadline wheel, as the exchange's own deadline is: at `until` both
    // expire in one pass, and this one, polled first, says the request was never sent.
    let stream = crate::rt::timer::timeout_at(until, TcpStream::connect((host, port)))
        .await
        .map_err(|_| ConnectError::TimedOut(authority.clone()))?
        .map_err(|source| ConnectError::Io {
            authority: authority.clone(),
            source,
        })?;
    let _ = stream.set_nodelay(true);
    Ok((stream, fd))
}

/// Why no connection to a plain-HTTP upstream was made (nothing was sent).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnectError {
    #[error(
        "no file descriptor to spare for a connection to {0} (the open-file limit's budget is spent)"
    )]
    NoFd(Authority),
    #[error("connect to {0} timed out")]
    TimedOut(Authority),
    #[error("connect to {authority}: {source}")]
    Io {
        authority: Authority,
        source: std::io::Error,
    },
}
