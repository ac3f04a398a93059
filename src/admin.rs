//! The admin listener (SPEC §7): health, readiness, metrics and the marks API. Separate
//! port, loopback by default; an optional bearer token guards all but the probes.

pub mod config;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use percent_encoding::percent_decode_str;
use serde::Deserialize;

use std::sync::Arc;

use crate::authority::AuthorityMetrics;
use crate::fence::{Gates, Refusal};
use crate::metrics::Metrics;
use crate::proxy::Body;
use crate::proxy::Proxy;
use crate::settings::Config;
use crate::store::MarkStore;
use crate::token::Token;

const MAX_BODY: usize = 64 * 1024;
const MAX_LIMIT: usize = 10_000;

fn respond(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).map_err(|e| match e {}).boxed());
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

fn json(status: StatusCode, value: serde_json::Value) -> Response<Body> {
    respond(status, "application/json", value.to_string())
}

fn problem(status: StatusCode, title: &str) -> Response<Body> {
    respond(
        status,
        "application/problem+json",
        serde_json::json!({"type": "about:blank", "title": title, "status": status.as_u16()})
            .to_string(),
    )
}

/// Constant-time comparison: the time taken must not tell how much of a guess was right.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The running instance, as the admin API answers from it and acts on it (the wiring
/// builds it and shares it with every listener).
pub struct State {
    pub config: Arc<Config>,
    pub store: MarkStore,
    pub gates: Arc<Gates>,
    pub metrics: Arc<Metrics>,
    /// The lease authority's series: rendered once it runs in this process.
    pub authority: Arc<AuthorityMetrics>,
    pub proxy: Proxy,
    /// Online backups running now, at most [`crate::admin::MAX_BACKUPS`]: each holds a
    /// read transaction and a blocking thread for as long as its client reads.
    pub backups: Arc<tokio::sync::Semaphore>,
    /// With `[cluster]`: the instance's view of its cluster (`GET /v1/cluster`, metrics).
    pub cluster: Option<Arc<dyn ClusterView>>,
}

/// What the admin API shows of a cluster (SPEC §10), from `cluster::node`.
pub trait ClusterView: Send + Sync {
    /// `GET /v1/cluster`: shards, owners, epochs, takeovers in progress.
    fn status(&self) -> serde_json::Value;
    /// The cluster's series, in Prometheus' text format.
    fn metrics(&self, out: &mut String);
}

/// Why [`not_from_a_browser`] refused a request (its text is the refusal's title).
#[derive(Debug, thiserror::Error)]
enum FromABrowser {
    #[error("the admin API does not answer requests from web pages (Origin)")]
    Origin,
    #[error("Host: {0}")]
    BadHost(&'static str),
    #[error(
        "Host {0} is not an address: without admin.token_file the admin API answers only requests to an IP address or localhost"
    )]
    NamedHost(String),
}

/// The admin API is for operators' tools, not for web pages. A page the operator visits
/// can send requests to a loopback listener (a POST with a body a browser calls text is
/// sent without asking first) and, by rebinding a name of its own to 127.0.0.1, read the
/// answers. Browsers mark such requests with `Origin`, refused here; and without a token
/// (so on loopback only), a `Host` that names neither an address nor `localhost` (a
/// rebound name) is refused too.
fn not_from_a_browser(app: &State, req: &Request<Incoming>) -> Result<(), FromABrowser> {
    if req.headers().contains_key(header::ORIGIN) {
        return Err(FromABrowser::Origin);
    }
    if app.config.admin.token.is_some() {
        return Ok(());
    }
    let named = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| req.uri().authority().map(|a| a.as_str()));
    let Some(named) = named else {
        return Ok(());
    };
    let host = crate::route::host_of(named).map_err(FromABrowser::BadHost)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.eq_ignore_ascii_case("localhost") || host.parse::<std::net::IpAddr>().is_ok() {
        Ok(())
    } else {
        Err(FromABrowser::NamedHost(host.to_string()))
    }
}

fn authorized(app: &State, req: &Request<Incoming>) -> bool {
    let Some(want) = &app.config.admin.token else {
        return true;
    };
    req.headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| bearer_credentials(v.as_bytes()))
        .is_some_and(|got| same_secret(got, want.as_bytes()))
}

/// The credentials of `Authorization: Bearer <token>`. RFC 9110 §11.1: the scheme is
/// case-insensitive and one or more spaces separate it from the credentials.
fn bearer_credentials(value: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"Bearer";
    let (scheme, rest) = value.split_at_checked(SCHEME.len())?;
    if !scheme.eq_ignore_ascii_case(SCHEME) || rest.first() != Some(&b' ') {
        return None;
    }
    let start = rest.iter().position(|&b| b != b' ')?;
    Some(&rest[start..])
}

fn query_param(req: &Request<Incoming>, name: &str) -> Option<String> {
    req.uri().query()?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == name).then(|| {
            percent_decode_str(&v.replace('+', " "))
                .decode_utf8_lossy()
                .into_owned()
        })
    })
}

async fn read_json<T: for<'de> Deserialize<'de>>(
    req: Request<Incoming>,
) -> Result<T, Response<Body>> {
    let body = Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|_| {
            problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body too large or unreadable",
            )
        })?
        .to_bytes();
    serde_json::from_slice(&body)
        .map_err(|e| problem(StatusCode::BAD_REQUEST, &format!("malformed JSON: {e}")))
}

fn mark_json(scope: &str, mark: Option<Token>) -> serde_json::Value {
    serde_json::json!({
        "scope": scope,
        "highest_accepted": mark.map(|t| t.to_string()),
    })
}

/// The admin listener's one entry: the probes answer anyone, everything else needs a
/// bearer token and a request no browser could have been made to send; each endpoint
/// group is a function of its own.
pub async fn handle(app: &State, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    // Probes answer HEAD as GET (hyper sends no body for HEAD) and need no token.
    match (&method, path.as_str()) {
        (&Method::GET | &Method::HEAD, "/healthz") => {
            return respond(StatusCode::OK, "text/plain", "ok\n");
        }
        (&Method::GET | &Method::HEAD, "/readyz") => return readyz(app),
        _ => {}
    }
    if let Err(why) = not_from_a_browser(app, &req) {
        return problem(StatusCode::FORBIDDEN, &why.to_string());
    }
    if !authorized(app, &req) {
        let mut r = problem(StatusCode::UNAUTHORIZED, "a valid bearer token is required");
        r.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return r;
    }
    match (&method, path.as_str()) {
        (&Method::GET, "/metrics") => metrics(app),
        (&Method::GET, "/v1/cluster") => match &app.cluster {
            Some(cluster) => json(StatusCode::OK, cluster.status()),
            None => problem(
                StatusCode::NOT_FOUND,
                "this instance runs alone: no [cluster] in its config",
            ),
        },
        // In a cluster the marks are in etcd, by shard, and the floor and the store file
        // are one instance's: these would answer for this instance alone.
        (_, "/v1/scopes" | "/v1/floor" | "/v1/backup") if app.cluster.is_some() => problem(
            StatusCode::NOT_IMPLEMENTED,
            "not in cluster mode: the marks are in etcd (see GET /v1/cluster and etcdctl get --prefix /fencegate/cluster/<cluster>/marks/)",
        ),
        (&Method::GET, "/v1/scopes") => list_scopes(app, &req).await,
        (&Method::GET, "/v1/floor") => json(
            StatusCode::OK,
            serde_json::json!({"epoch": app.store.floor()}),
        ),
        (&Method::PUT, "/v1/floor") => raise_floor(app, req).await,
        (&Method::GET, "/v1/backup") => backup(app).await,
        (m, p) if p.starts_with("/v1/scopes/") => {
            let m = m.clone();
            one_scope(app, &m, &p["/v1/scopes/".len()..], req).await
        }
        _ => problem(StatusCode::NOT_FOUND, "no such admin endpoint"),
    }
}

/// `/readyz`: ready while the mark store has not failed closed.
fn readyz(app: &State) -> Response<Body> {
    if app.store.is_failed() {
        respond(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            "not ready: the mark store has failed\n",
        )
    } else {
        respond(StatusCode::OK, "text/plain", "ready\n")
    }
}

/// `GET /metrics`: the registry's counters, the gauges read here, and the cluster's.
fn metrics(app: &State) -> Response<Body> {
    let floor = app.store.floor() as f64;
    let records = app.store.record_usage("", "").0;
    let mut text = app.metrics.render(
        &[app.store.stats(), &*app.authority],
        &[
            (
                "fencegate_hot_scopes",
                "Scopes with a gate in memory.",
                app.gates.len() as f64,
            ),
            (
                "fencegate_store_failed",
                "1 when the mark store has failed closed.",
                f64::from(u8::from(app.store.is_failed())),
            ),
            (
                "fencegate_epoch_floor",
                "Tokens of a lower epoch are stale everywhere.",
                floor,
            ),
            (
                "fencegate_idempotency_buffered_bytes",
                "Bytes of bodies held in memory for requests with an Idempotency-Key (bounded by idempotency.max_buffered).",
                app.proxy.idempotency().buffered() as f64,
            ),
            (
                "fencegate_idempotency_records",
                "Idempotency records on disk (bounded by idempotency.max_records).",
                records.records as f64,
            ),
            (
                "fencegate_idempotency_record_bytes",
                "Bytes the idempotency records count for (bounded by idempotency.max_record_bytes).",
                records.bytes as f64,
            ),
            (
                "fencegate_connection_fds",
                "Descriptors held by client and upstream connections (bounded by fencegate_connection_fds_budget).",
                crate::rt::fds::open() as f64,
            ),
            (
                "fencegate_connection_fds_budget",
                "Descriptors connections may hold: the open-file limit less a reserve.",
                crate::rt::fds::limits().map_or(0.0, |l| l.budget as f64),
            ),
        ],
    );
    if let Some(cluster) = &app.cluster {
        cluster.metrics(&mut text);
    }
    respond(StatusCode::OK, "text/plain; version=0.0.4", text)
}

/// `GET /v1/scopes`: the marks under `prefix`, `limit` at a time after `after`.
async fn list_scopes(app: &State, req: &Request<Incoming>) -> Response<Body> {
    let prefix = query_param(req, "prefix").unwrap_or_default();
    let after = query_param(req, "after");
    let limit = match query_param(req, "limit").map(|l| l.parse::<usize>()) {
        None => 100,
        Some(Ok(l)) if (1..=MAX_LIMIT).contains(&l) => l,
        Some(_) => return problem(StatusCode::BAD_REQUEST, "limit must be 1..=10000"),
    };
    // redb alone shows every acknowledged mark once the journal is applied.
    let listed = checkpoint(app)
        .await
        .and_then(|_| app.store.list(&prefix, after.as_deref(), limit));
    match listed {
        Ok(marks) => {
            let next = (!crate::store::marks::listed_all(&marks, limit))
                .then(|| marks.last().map(|m| m.0.clone()))
                .flatten();
            let scopes: Vec<_> = marks.iter().map(|(s, t)| mark_json(s, Some(*t))).collect();
            json(
                StatusCode::OK,
                serde_json::json!({"scopes": scopes, "next_after": next}),
            )
        }
        Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}

/// `PUT /v1/floor`: tokens of a lower epoch are stale from now on, everywhere.
async fn raise_floor(app: &State, req: Request<Incoming>) -> Response<Body> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Floor {
        epoch: u64,
    }
    let f: Floor = match read_json(req).await {
        Ok(f) => f,
        Err(r) => return r,
    };
    match app.store.raise_floor(f.epoch).await {
        Ok(epoch) => json(StatusCode::OK, serde_json::json!({"epoch": epoch})),
        Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}

/// `GET /v1/scopes/{scope}` (its mark and sequence) and `POST /v1/scopes/{scope}/raise`
/// (the mark raised to a token); `rest` is the path after `/v1/scopes/`.
async fn one_scope(
    app: &State,
    method: &Method,
    rest: &str,
    req: Request<Incoming>,
) -> Response<Body> {
    let (raw_scope, raise) = match (method, rest.strip_suffix("/raise")) {
        (&Method::POST, Some(s)) => (s, true),
        (&Method::GET, _) => (rest, false),
        _ => {
            return problem(
                StatusCode::METHOD_NOT_ALLOWED,
                "GET a scope, or POST .../raise",
            );
        }
    };
    let scope = match percent_decode_str(raw_scope).decode_utf8() {
        Ok(s) if !s.is_empty() => s.into_owned(),
        _ => {
            return problem(
                StatusCode::BAD_REQUEST,
                "scope must be non-empty UTF-8 (percent-encoded)",
            );
        }
    };
    if !raise {
        return match app.gates.mark_with_sequence(&scope) {
            Ok(m) => {
                let mut v = mark_json(&scope, m.map(|m| m.token));
                // As a string, as tokens are (SPEC §11).
                v["highest_sequence"] = m.and_then(|m| m.sequence).map(|n| n.to_string()).into();
                json(StatusCode::OK, v)
            }
            Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
        };
    }
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Raise {
        token: Token,
    }
    let r: Raise = match read_json(req).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    match app.gates.raise(&scope, r.token).await {
        Ok(m) => json(StatusCode::OK, mark_json(&scope, Some(m))),
        Err(Refusal::Unavailable) | Err(_) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "the mark could not be made durable",
        ),
    }
}

/// Online backups that may run at once; another gets 503 with `Retry-After`.
pub const MAX_BACKUPS: usize = 2;

/// How long a listing or a backup waits for the journal to be applied (a hung disk).
const CHECKPOINT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Applies the mark journal to redb (bounded by [`CHECKPOINT_WAIT`]); answers a snapshot
/// taken right after.
async fn checkpoint(app: &State) -> Result<crate::store::Snapshot, crate::store::StoreError> {
    tokio::time::timeout(CHECKPOINT_WAIT, app.store.checkpoint())
        .await
        .unwrap_or_else(|_| {
            Err(crate::store::StoreError::Read(
                "the mark journal was not applied in time (the disk is not answering)".into(),
            ))
        })
}

/// A backup's text in pieces of about this size.
const BACKUP_CHUNK: usize = 64 * 1024;
/// A client that takes no piece of a backup for this long is given up on (the backup
/// holds a read transaction, which keeps the store from reusing freed pages).
const BACKUP_STALL: std::time::Duration = std::time::Duration::from_secs(30);

/// What the backup's producer hands the response body.
enum Piece {
    Data(Bytes),
    /// Everything was sent, the footer included. Without it a closed channel means the
    /// producer gave up (a stalled client, a failed read), so the body must not end cleanly.
    End,
    Failed(String),
}

/// Writes the backup of `snapshot` through `send`, which answers false once the piece
/// could not be handed on (the client stalled or went away). [`Piece::End`] is sent only
/// after every mark and the footer were; a stop before that sends nothing more.
fn produce_backup(
    snapshot: Result<crate::store::Snapshot, crate::store::StoreError>,
    mut send: impl FnMut(Piece) -> bool,
) {
    let mut text = String::new();
    let mut open = true;
    let mut count = 0u64;
    // The floor from the marks' own transaction: the two are of one moment.
    let res = snapshot.and_then(|snapshot| {
        text = backup_header(snapshot.floor()?);
        snapshot.for_each(|scope, token| {
            text.push_str(&backup_line(scope, token));
            count += 1;
            if text.len() >= BACKUP_CHUNK {
                open = send(Piece::Data(Bytes::from(std::mem::take(&mut text))));
            }
            open
        })
    });
    match res {
        Ok(()) if open => {
            text.push_str(&backup_footer(count));
            if send(Piece::Data(Bytes::from(text))) {
                send(Piece::End);
            }
        }
        Ok(()) => {}
        Err(e) => {
            send(Piece::Failed(e.to_string()));
        }
    }
}

/// `GET /v1/backup`: the epoch floor and every mark from one read transaction (a
/// consistent snapshot), streamed in pieces so that memory does not grow with the number
/// of scopes. A failure before the first piece is a 503; one later aborts the body, so
/// the client sees a truncated transfer, never a short backup that looks whole.
async fn backup(app: &State) -> Response<Body> {
    let Ok(running) = app.backups.clone().try_acquire_owned() else {
        let mut r = problem(
            StatusCode::SERVICE_UNAVAILABLE,
            &format!("{MAX_BACKUPS} backups are running already; retry when one has ended"),
        );
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
        return r;
    };
    // redb alone shows every acknowledged mark once the journal is applied; the snapshot
    // is taken right after, before anything else is committed.
    let snapshot = match checkpoint(app).await {
        Ok(s) => s,
        Err(e) => return problem(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Piece>(2);
    let runtime = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        // Held until the producer stops: the read transaction and this thread with it.
        let _running = running;
        produce_backup(Ok(snapshot), |piece| {
            runtime
                .block_on(tokio::time::timeout(BACKUP_STALL, tx.send(piece)))
                .is_ok_and(|sent| sent.is_ok())
        })
    });
    let first = match rx.recv().await {
        Some(Piece::Data(first)) => first,
        Some(Piece::Failed(e)) => return problem(StatusCode::SERVICE_UNAVAILABLE, &e),
        Some(Piece::End) | None => {
            return problem(StatusCode::SERVICE_UNAVAILABLE, "the backup stopped");
        }
    };
    let body = Pieces {
        first: Some(first),
        rest: rx,
        ended: false,
    };
    let mut r = Response::new(body.boxed());
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    r
}

/// A body made of the pieces a backup sends. It ends cleanly only on [`Piece::End`]; a
/// channel closed before it is an error, so hyper aborts the chunked body instead of
/// writing the final chunk that would make a short backup look whole.
struct Pieces {
    first: Option<Bytes>,
    rest: tokio::sync::mpsc::Receiver<Piece>,
    ended: bool,
}

impl http_body::Body for Pieces {
    type Data = Bytes;
    type Error = crate::proxy::BoxError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        use std::task::Poll;
        let this = self.get_mut();
        if let Some(first) = this.first.take() {
            return Poll::Ready(Some(Ok(http_body::Frame::data(first))));
        }
        if this.ended {
            return Poll::Ready(None);
        }
        match std::task::ready!(this.rest.poll_recv(cx)) {
            Some(Piece::Data(data)) => Poll::Ready(Some(Ok(http_body::Frame::data(data)))),
            Some(Piece::End) => {
                this.ended = true;
                Poll::Ready(None)
            }
            Some(Piece::Failed(e)) => Poll::Ready(Some(Err(e.into()))),
            None => Poll::Ready(Some(Err("the backup stopped before its end".into()))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}

/// The first line of a backup: what it is (format 2: it has an end line) and the epoch
/// floor.
pub fn backup_header(floor: u64) -> String {
    format!("{{\"fencegate_backup\":2,\"epoch_floor\":{floor}}}\n")
}

pub fn backup_line(scope: &str, token: Token) -> String {
    format!(
        "{}\n",
        serde_json::json!({"scope": scope, "token": token.to_string()})
    )
}

/// The last line of a backup (format 2): how many mark lines came before it, so a
/// restore can tell a whole backup from one cut short.
pub fn backup_footer(marks: u64) -> String {
    format!("{{\"fencegate_backup_end\":{marks}}}\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::sync::Arc;

    fn pieces(rest: Vec<Piece>) -> Pieces {
        let (tx, rx) = tokio::sync::mpsc::channel(rest.len().max(1));
        for piece in rest {
            assert!(tx.try_send(piece).is_ok());
        }
        Pieces {
            first: Some(Bytes::from_static(b"head\n")),
            rest: rx,
            ended: false,
        }
    }

    /// A producer that stops without its end item (a stalled client, a failed read)
    /// leaves a body that fails, so hyper aborts the transfer instead of ending it cleanly.
    #[tokio::test]
    async fn pieces_closed_without_the_end_item_fail() {
        let body = pieces(vec![Piece::Data(Bytes::from_static(b"more\n"))]);
        let err = body.collect().await.err().map(|e| e.to_string());
        assert_eq!(err.as_deref(), Some("the backup stopped before its end"));

        let body = pieces(vec![Piece::Data(Bytes::from_static(b"more\n")), Piece::End]);
        let whole = body.collect().await.map(|c| c.to_bytes());
        assert_eq!(whole.ok().as_deref(), Some(&b"head\nmore\n"[..]));
    }

    async fn store_of(marks: u64) -> crate::store::MarkStore {
        let store =
            crate::store::MarkStore::open_with_backend(redb::backends::InMemoryBackend::new())
                .expect("store");
        let advances: Vec<_> = (0..marks)
            .map(|i| {
                let store = store.clone();
                tokio::spawn(async move {
                    let scope: Arc<str> = format!("bulk/{i:05}").into();
                    store.advance(scope, Token::new(0, i + 1)).await
                })
            })
            .collect();
        for a in advances {
            a.await.expect("task").expect("advance");
        }
        store
    }

    /// A whole backup is its header, the marks and the end line counting them, then the
    /// end item; a send that fails midway (the client stalled) ends it with nothing more.
    #[tokio::test]
    async fn a_backup_sends_its_end_only_when_whole() {
        let store = store_of(3_000).await;
        let mut sent = Vec::new();
        produce_backup(store.snapshot(), |piece| {
            sent.push(piece);
            true
        });
        assert!(sent.len() > 2, "{} pieces", sent.len());
        assert!(matches!(sent.pop(), Some(Piece::End)));
        let mut text = Vec::new();
        for piece in sent {
            match piece {
                Piece::Data(data) => text.extend_from_slice(&data),
                _ => panic!("only data before the end"),
            }
        }
        let text = String::from_utf8(text).expect("utf-8");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1 + 3_000 + 1);
        assert_eq!(lines[0], r#"{"fencegate_backup":2,"epoch_floor":0}"#);
        assert_eq!(lines[3_001], r#"{"fencegate_backup_end":3000}"#);

        let mut sent = Vec::new();
        produce_backup(store.snapshot(), |piece| {
            sent.push(piece);
            false
        });
        assert_eq!(sent.len(), 1, "nothing after a failed send");
        assert!(matches!(sent[0], Piece::Data(_)));
    }
}
