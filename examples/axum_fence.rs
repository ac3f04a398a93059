//! A Rust service that owns its storage, fenced in-process: the same `FenceLayer` the
//! fencegate binary runs in front of its forwarder, here in front of axum handlers.
//!
//! The service keeps documents in memory and writes them on `PUT /docs/{doc}`. The
//! layer routes each request by the config's routes, reads its `Fencing-Token`, admits
//! it at the scope's gate (the marks are the service's own store) and answers a stale
//! token with 409 `stale_fence` itself: the handler never sees it. An admitted request
//! carries a `FencedRequest` (scope, token) in its extensions.
//!
//! ```sh
//! cargo run --example axum_fence
//! curl -X PUT -H 'Fencing-Token: 5' --data v5 http://127.0.0.1:<port>/docs/a   # 200
//! curl -X PUT -H 'Fencing-Token: 3' --data v3 http://127.0.0.1:<port>/docs/a   # 409
//! ```
//!
//! Its tests run with the suite (`cargo test --example axum_fence`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Extension, Path as UrlPath, State};
use axum::http::StatusCode;
use axum::routing::put;
use fencegate::fence::Gates;
use fencegate::metrics::Metrics;
use fencegate::proxy::fence::{FenceLayer, FencedRequest};
use fencegate::settings::Config;
use fencegate::store::MarkStore;

/// The fence's config: routes and scopes as in `fencegate.toml`. The upstream is never
/// used (the layer's inner service is the app), but every route names one.
const CONFIG: &str = r#"
[server]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[store]
path = "marks.redb"
[fencing]
drain_timeout = "5s"
settle = "0s"
[[upstream]]
name = "self"
url = "http://127.0.0.1:9"
[[route]]
name = "docs"
path = "/docs/{doc}"
scope = "doc/{doc}"
upstream = "self"
"#;

/// The service's own storage, and how many writes its handler took (for the tests).
#[derive(Clone, Default)]
struct Docs {
    docs: Arc<Mutex<HashMap<String, (String, String)>>>,
    writes: Arc<AtomicUsize>,
}

async fn put_doc(
    State(docs): State<Docs>,
    UrlPath(doc): UrlPath<String>,
    Extension(fenced): Extension<FencedRequest>,
    body: String,
) -> Result<String, StatusCode> {
    docs.writes.fetch_add(1, Ordering::SeqCst);
    let mut all = docs
        .docs
        .lock()
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    all.insert(doc, (body, fenced.token.to_string()));
    Ok(format!("written under token {}\n", fenced.token))
}

async fn get_doc(State(docs): State<Docs>, UrlPath(doc): UrlPath<String>) -> (StatusCode, String) {
    let all = match docs.docs.lock() {
        Ok(all) => all,
        Err(_) => return (StatusCode::INTERNAL_SERVER_ERROR, String::new()),
    };
    match all.get(&doc) {
        Some((body, token)) => (StatusCode::OK, format!("{body} (token {token})\n")),
        None => (StatusCode::NOT_FOUND, String::new()),
    }
}

/// The fence over the service's handlers, sharing one mark store, gates and metrics.
fn app(config: Config, store: MarkStore, docs: Docs) -> (Router, Arc<Metrics>, MarkStore) {
    let metrics = Arc::new(Metrics::new(config.routes.iter().map(|r| r.name.clone())));
    let gates = Arc::new(Gates::new(
        store.clone(),
        metrics.clone(),
        config.fencing.drain_timeout,
        config.fencing.settle,
    ));
    let fence = FenceLayer::new(Arc::new(config.proxy_settings()), gates, metrics.clone());
    let router = Router::new()
        .route("/docs/{doc}", put(put_doc).get(get_doc))
        .with_state(docs)
        .layer(fence);
    (router, metrics, store)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("axum-fence-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let config = Config::parse(CONFIG, &dir)?;
    let store = MarkStore::open(&dir.join("marks.redb"))?;
    let (router, _, _) = app(config, store, Docs::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("fenced docs service on http://{}", listener.local_addr()?);
    axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    fn service() -> (Router, Docs, Arc<Metrics>, MarkStore) {
        let config = Config::parse(CONFIG, std::path::Path::new(".")).expect("config");
        let store = MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new())
            .expect("store");
        let docs = Docs::default();
        let (router, metrics, store) = app(config, store, docs.clone());
        (router, docs, metrics, store)
    }

    fn put(doc: &str, token: &str, body: &str) -> Request<Body> {
        Request::put(format!("/docs/{doc}"))
            .header("host", "docs.example")
            .header("fencing-token", token)
            .body(Body::from(body.to_string()))
            .expect("request")
    }

    async fn send(router: &Router, req: Request<Body>) -> (StatusCode, String, String) {
        let resp = router.clone().oneshot(req).await.expect("infallible");
        let status = resp.status();
        let result = resp
            .headers()
            .get("fencing-result")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        (status, result, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn a_stale_token_is_refused_by_the_layer_and_a_fresh_one_reaches_the_handler() {
        let (router, docs, metrics, store) = service();

        let (status, result, body) = send(&router, put("a", "5", "v5")).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(result, "accepted");
        assert_eq!(body, "written under token 5\n");
        assert_eq!(docs.writes.load(Ordering::SeqCst), 1);

        // An older owner wakes up: 409 from the layer, the handler is not called.
        let (status, result, body) = send(&router, put("a", "3", "v3")).await;
        assert_eq!(status, StatusCode::CONFLICT);
        assert_eq!(result, "stale_fence");
        let problem: serde_json::Value = serde_json::from_str(&body).expect("problem+json");
        assert_eq!(problem["scope"], "doc/a");
        assert_eq!(problem["highest_accepted"], "5");
        assert_eq!(docs.writes.load(Ordering::SeqCst), 1, "the handler ran");

        // The same owner again, and a newer one: both reach the handler.
        assert_eq!(send(&router, put("a", "5", "v5'")).await.0, StatusCode::OK);
        assert_eq!(send(&router, put("a", "6", "v6")).await.0, StatusCode::OK);
        assert_eq!(docs.writes.load(Ordering::SeqCst), 3);
        let get = Request::get("/docs/a")
            .header("host", "docs.example")
            .body(Body::empty())
            .expect("request");
        let (status, result, body) = send(&router, get).await;
        assert_eq!((status, result.as_str()), (StatusCode::OK, ""));
        assert_eq!(body, "v6 (token 6)\n");

        // The mark is durable in the service's store, and the layer counted into the
        // shared metrics.
        let text = metrics.render(&[store.stats()], &[]);
        for line in [
            r#"fencegate_requests_total{route="docs",result="accepted"} 3"#,
            r#"fencegate_requests_total{route="docs",result="stale_fence"} 1"#,
            r#"fencegate_requests_total{route="docs",result="unfenced"} 1"#,
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }

    #[tokio::test]
    async fn a_write_without_a_token_never_reaches_the_handler() {
        let (router, docs, _, _) = service();
        let req = Request::put("/docs/b")
            .header("host", "docs.example")
            .body(Body::from("x"))
            .expect("request");
        let (status, result, _) = send(&router, req).await;
        assert_eq!(
            (status, result.as_str()),
            (StatusCode::PRECONDITION_REQUIRED, "missing_token")
        );
        assert_eq!(docs.writes.load(Ordering::SeqCst), 0);
    }
}
