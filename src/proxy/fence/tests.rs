//! Tests of the fence layer over a stub service: guards, refusals and the typed handoff.

use super::*;
use std::pin::Pin;
use std::time::Duration;

use http_body::Frame;

use crate::proxy::FENCING_RESULT;
use crate::proxy::context::Admitted;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::settings::Config;
use crate::store::MarkStore;

/// The proxy's part of a parsed file, as the binary builds it.
fn settings(c: Config) -> Settings {
    Settings::from_sections(
        c.routes,
        c.upstreams,
        c.fencing,
        c.idempotency,
        c.store,
        c.server.trusted_proxies,
        c.cluster.is_some(),
    )
}

const CONFIG: &str = r#"
[server]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[store]
path = "marks.redb"
[fencing]
drain_timeout = "60s"
settle = "0s"
[[upstream]]
name = "u"
url = "http://127.0.0.1:9"
[[route]]
name = "docs"
path = "/docs/{doc}"
scope = "doc/{doc}"
upstream = "u"
"#;

/// A response body that stays open until its sender says so (or goes).
struct Open(tokio::sync::oneshot::Receiver<()>);

impl http_body::Body for Open {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Pin::new(&mut self.0).poll(cx).map(|_| None)
    }
}

fn put(token: &str) -> Request<http_body_util::Empty<Bytes>> {
    Request::put("/docs/a")
        .header("host", "h")
        .header("fencing-token", token)
        .body(http_body_util::Empty::new())
        .unwrap()
}

/// An admitted request's generation stays in flight while its response body is
/// being sent: a newer owner waits for it at the gate, and goes once it ends.
#[tokio::test]
async fn the_guard_is_held_until_the_response_body_ends() {
    let config = Config::parse(CONFIG, std::path::Path::new(".")).unwrap();
    let metrics = Arc::new(Metrics::new(["docs".to_string()]));
    let store =
        MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new()).unwrap();
    let gates = Arc::new(Gates::new(
        store,
        metrics.clone(),
        Duration::from_secs(60),
        Duration::ZERO,
    ));
    let (end_first, first_body) = tokio::sync::oneshot::channel();
    let bodies = Arc::new(Mutex::new(vec![first_body]));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (bodies, seen, calls) = (bodies.clone(), seen.clone(), calls.clone());
        tower::service_fn(move |req: Request<http_body_util::Empty<Bytes>>| {
            calls.fetch_add(1, Ordering::SeqCst);
            let fenced = req.extensions().get::<FencedRequest>().cloned();
            seen.lock().unwrap().push(fenced);
            let body = bodies.lock().unwrap().pop();
            async move {
                let body = match body {
                    Some(rx) => Open(rx),
                    None => Open(tokio::sync::oneshot::channel().1),
                };
                Ok::<_, Infallible>(Response::new(body))
            }
        })
    };
    let fence = FenceLayer::new(Arc::new(settings(config)), gates.clone(), metrics).layer(handler);

    let first = fence.clone().call(put("5")).await.unwrap();
    assert_eq!(first.headers()[FENCING_RESULT], "accepted");
    let fenced = seen.lock().unwrap()[0].clone().unwrap();
    assert_eq!(
        (fenced.scope.as_str(), fenced.token),
        ("doc/a", Token::new(0, 5))
    );

    // Token 6 drains generation 5, whose body is still open.
    let mut newer = fence.clone();
    let second = tokio::spawn(async move { newer.call(put("6")).await });
    let mut waited = false;
    for _ in 0..10_000 {
        if gates.waiting() == 1 {
            waited = true;
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(waited, "the newer token did not wait for the open body");
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // The first body ends (read to its end): the newer token is admitted.
    let _ = end_first.send(());
    let mut body = first.into_body();
    assert!(
        std::future::poll_fn(|cx| http_body::Body::poll_frame(Pin::new(&mut body), cx))
            .await
            .is_none()
    );
    let second = second.await.unwrap().unwrap();
    assert_eq!(second.headers()[FENCING_RESULT], "accepted");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A 202 from the service says its write was queued, not applied (SPEC §3, invariant
/// 3): the scope settles before the next generation is let in, as after a lost
/// answer; after a 200 the next one goes at once. (Paused clock: `settle` passes
/// only when nothing else can run.)
#[tokio::test(start_paused = true)]
async fn a_202_leaves_the_generation_to_settle() {
    const SETTLE: Duration = Duration::from_secs(2);
    let config = Config::parse(CONFIG, std::path::Path::new(".")).unwrap();
    let metrics = Arc::new(Metrics::new(["docs".to_string()]));
    let store =
        MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new()).unwrap();
    let gates = Arc::new(Gates::new(
        store,
        metrics.clone(),
        Duration::from_secs(60),
        SETTLE,
    ));
    let handler = tower::service_fn(|req: Request<http_body_util::Empty<Bytes>>| {
        let status = req
            .headers()
            .get("x-status")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u16>().ok())
            .and_then(|v| http::StatusCode::from_u16(v).ok())
            .unwrap_or(http::StatusCode::OK);
        let mut resp = Response::new(http_body_util::Empty::<Bytes>::new());
        *resp.status_mut() = status;
        std::future::ready(Ok::<_, Infallible>(resp))
    });
    let mut fence = FenceLayer::new(Arc::new(settings(config)), gates, metrics).layer(handler);
    let req = |doc: &str, token: &str, status: &str| {
        Request::put(format!("/docs/{doc}"))
            .header("host", "h")
            .header("fencing-token", token)
            .header("x-status", status)
            .body(http_body_util::Empty::new())
            .unwrap()
    };
    for (doc, first, wait) in [("a", "200", Duration::ZERO), ("b", "202", SETTLE)] {
        let r = fence.call(req(doc, "5", first)).await.unwrap();
        assert_eq!(r.status().as_str(), first);
        drop(r);
        let started = tokio::time::Instant::now();
        let r = fence.call(req(doc, "6", "200")).await.unwrap();
        assert_eq!(r.headers()[FENCING_RESULT], "accepted", "{doc}");
        assert_eq!(started.elapsed(), wait, "after a {first}");
    }
}

/// Records what the typed handoff brings: the plan with its guard.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<Handed>>>);

/// Scope, token, and whether a guard came with the plan.
type Handed = (Option<String>, Option<Token>, bool);

impl<B> Stage<B> for Recorder {
    fn serve(&self, a: Admitted<B>) -> impl Future<Output = Response<Body>> + Send + '_ {
        let Admitted { mut plan, .. } = a;
        let held = plan.guard.is_some();
        if let Some(g) = plan.guard.as_mut() {
            g.complete();
        }
        self.0.lock().unwrap().push((plan.scope, plan.token, held));
        std::future::ready(Response::new(Body::default()))
    }
}

/// The binary's handoff, called as a tower `Service`: an admitted request reaches the
/// inner stage with its plan and guard; a stale one is answered by the layer.
#[tokio::test]
async fn the_typed_fence_hands_the_plan_on_and_refuses_stale_tokens_itself() {
    let config = Config::parse(CONFIG, std::path::Path::new(".")).unwrap();
    let metrics = Arc::new(Metrics::new(["docs".to_string()]));
    let store =
        MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new()).unwrap();
    let gates = Arc::new(Gates::new(
        store,
        metrics.clone(),
        Duration::from_secs(60),
        Duration::ZERO,
    ));
    let refusals = Arc::new(Refusals::new(metrics, AccessLog::off()));
    let inner = Recorder::default();
    let mut fence = FenceLayer::<Typed>::with(Arc::new(settings(config)), gates, refusals, None)
        .layer(inner.clone());
    let ok = fence.call(put("5")).await.unwrap();
    assert_eq!(ok.status(), http::StatusCode::OK);
    let stale = fence.call(put("4")).await.unwrap();
    assert_eq!(stale.status(), http::StatusCode::CONFLICT);
    assert_eq!(stale.headers()[FENCING_RESULT], "stale_fence");
    let seen = inner.0.lock().unwrap().clone();
    assert_eq!(
        seen,
        vec![(Some("doc/a".to_string()), Some(Token::new(0, 5)), true)]
    );
}
