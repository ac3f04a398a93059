//! The HTTP floor: a bare reverse proxy on the stack fencegate is built on — hyper's
//! HTTP/1.1 server, fencegate's upstream pools (its lean exchange for bodies in memory,
//! hyper's client connection for streamed ones), one single-threaded tokio runtime per
//! worker thread on a shared listener — with no routing, no fencing, no header policy and
//! no timeouts but the pools' own (a response body's wait for its upstream, on a worker
//! deadline wheel as in fencegate). fencegate cannot be faster than this; the gap between
//! the two is fencegate's own work, and the gap between this and nginx is the stack's.
//!
//! Without an upstream it is W3's floor instead: the same server answering every request
//! with fencegate's stale-fence refusal (rendered once by fencegate's own code, then
//! copied: the same status, headers and problem+json body), decided by nothing.
//!
//! The bench runs it as a process of its own (`--serve-floor`, `procs::floor_process`);
//! dropping [`Bare`] stops its acceptor.

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fencegate::proxy::upstream::H1Pool;
use fencegate::proxy::upstream::StreamedPool as Pool;
use fencegate::proxy::{Body, BoxError, Outcome};
use fencegate::token::Token;
use http::uri::{Authority, PathAndQuery};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::sync::watch;

/// How long a response body may wait for its upstream (fencegate's default `timeout`).
const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// No exchange deadline for connects (fencegate's comes from a clock read it makes anyway).
static CONNECT_BY: std::sync::LazyLock<std::time::Instant> =
    std::sync::LazyLock::new(|| std::time::Instant::now() + Duration::from_secs(86_400 * 365));

/// The running floor proxy; dropping it stops its workers.
pub struct Bare {
    pub addr: SocketAddr,
    stop: watch::Sender<bool>,
}

impl Drop for Bare {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// What fencegate answers a stale request in W3 (scope `report/w3-s0`, token 1), rendered
/// once by fencegate's own code; the refuser sends copies of it.
#[derive(Clone)]
struct Refusal {
    status: http::StatusCode,
    headers: http::HeaderMap,
    body: Bytes,
}

impl Refusal {
    fn render() -> io::Result<Refusal> {
        let resp = Outcome::Stale {
            scope: "report/w3-s0".into(),
            token: Token::new(0, 1),
            highest: Some(Token::new(0, 1_000_000)),
        }
        .into_response();
        let (parts, body) = resp.into_parts();
        let body = tokio::runtime::Builder::new_current_thread()
            .build()?
            .block_on(body.collect())
            .map_err(|e| io::Error::other(e.to_string()))?
            .to_bytes();
        Ok(Refusal {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    fn response(&self) -> hyper::Response<Body> {
        let body = Full::new(self.body.clone())
            .map_err(|e: Infallible| match e {})
            .boxed();
        let mut resp = hyper::Response::new(body);
        *resp.status_mut() = self.status;
        *resp.headers_mut() = self.headers.clone();
        resp
    }
}

/// Starts the floor: a bare proxy to `upstream`, or with `None` the bare refuser.
pub fn start(upstream: Option<SocketAddr>, workers: usize) -> io::Result<Bare> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let authority: Option<Authority> = upstream
        .map(|u| u.to_string().parse())
        .transpose()
        .map_err(|e| io::Error::other(format!("{e}")))?;
    let refusal = Refusal::render()?;
    let (stop, stopped) = watch::channel(false);
    // Workers get connections from one acceptor, in turn (as fencegate spreads them).
    let mut lanes = Vec::with_capacity(workers);
    for i in 0..workers {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<std::net::TcpStream>();
        lanes.push(tx);
        // Each worker its own copy, so no reference count is shared between threads.
        let (authority, refusal) = (authority.clone(), Arc::new(refusal.clone()));
        std::thread::Builder::new()
            .name(format!("bare-proxy-{i}"))
            .spawn(move || {
                runtime.block_on(async move {
                    // The pools' body read deadlines, as on a fencegate worker.
                    tokio::spawn(fencegate::rt::timer::drive());
                    let pool = (
                        Pool::new(1024, Duration::from_secs(60), Duration::from_secs(5)),
                        H1Pool::new(1024, Duration::from_secs(60), Duration::from_secs(5)),
                    );
                    while let Some(stream) = rx.recv().await {
                        let Ok(stream) = tokio::net::TcpStream::from_std(stream) else {
                            continue;
                        };
                        let (pool, authority, refusal) =
                            (pool.clone(), authority.clone(), refusal.clone());
                        let svc = service_fn(move |req| {
                            let (pool, authority, refusal) =
                                (pool.clone(), authority.clone(), refusal.clone());
                            async move {
                                Ok::<_, Infallible>(match authority {
                                    Some(authority) => forward(pool, authority, req).await,
                                    None => refusal.response(),
                                })
                            }
                        });
                        tokio::spawn(
                            // fencegate's setting (`server::http_builder`).
                            hyper::server::conn::http1::Builder::new()
                                .writev(false)
                                .serve_connection(TokioIo::new(stream), svc),
                        );
                    }
                })
            })?;
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut stopped = stopped;
    std::thread::Builder::new()
        .name("bare-proxy-accept".into())
        .spawn(move || {
            runtime.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                    return;
                };
                let mut next = 0;
                loop {
                    let stream = tokio::select! {
                        accepted = listener.accept() => match accepted {
                            Ok((s, _)) => s,
                            Err(_) => continue,
                        },
                        _ = stopped.changed() => return,
                    };
                    let _ = stream.set_nodelay(true);
                    if let Ok(stream) = stream.into_std() {
                        let _ = lanes[next % lanes.len()].send(stream);
                        next += 1;
                    }
                }
                // Returning drops the lanes: the workers stop.
            })
        })?;
    Ok(Bare { addr, stop })
}

async fn forward(
    (pool, h1): (Arc<Pool>, Arc<H1Pool>),
    authority: Authority,
    req: hyper::Request<Incoming>,
) -> hyper::Response<Body> {
    let (mut parts, body) = req.into_parts();
    parts.uri = http::Uri::from(
        parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/")),
    );
    // A body in memory (none, or a small one read whole) takes the lean exchange, as in
    // fencegate.
    if http_body::Body::is_end_stream(&body)
        || http_body::Body::size_hint(&body)
            .exact()
            .is_some_and(|n| n <= 64 * 1024)
    {
        let Ok(body) = body.collect().await else {
            return status(400);
        };
        return match h1
            .send(
                Some(&authority),
                &parts,
                [],
                &body.to_bytes(),
                READ_TIMEOUT,
                *CONNECT_BY,
            )
            .await
        {
            Ok(resp) => resp.map(|b| b.boxed()),
            Err(_) => status(502),
        };
    }
    let body = body.map_err(|e| Box::new(e) as BoxError).boxed();
    match pool
        .send(
            Some(&authority),
            hyper::Request::from_parts(parts, body),
            READ_TIMEOUT,
            *CONNECT_BY,
        )
        .await
    {
        Ok(resp) => resp.map(|b| b.boxed()),
        Err(_) => status(502),
    }
}

fn status(code: u16) -> hyper::Response<Body> {
    let mut resp = hyper::Response::new(Empty::new().map_err(|e: Infallible| match e {}).boxed());
    *resp.status_mut() = http::StatusCode::from_u16(code).unwrap_or(http::StatusCode::BAD_GATEWAY);
    resp
}
