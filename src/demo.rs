//! `fencegate demo`: the paused-writer story with real HTTP on loopback.
//!
//! A legacy store with no conditional writes runs in-process; fencegate runs in front of
//! it. The story is played twice: through fencegate (the stale writer is refused) and
//! straight to the store (the stale writer silently overwrites newer work).

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

use crate::config::Config;

type Objects = Arc<Mutex<HashMap<String, Bytes>>>;

/// A legacy object store: PUT overwrites, GET reads, nothing is conditional.
pub async fn legacy_store() -> std::io::Result<(SocketAddr, Objects)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let objects: Objects = Arc::default();
    let shared = objects.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let objects = shared.clone();
            let svc = service_fn(move |req: Request<Incoming>| {
                let objects = objects.clone();
                async move { Ok::<_, Infallible>(store_request(req, objects).await) }
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok((addr, objects))
}

async fn store_request(req: Request<Incoming>, objects: Objects) -> Response<Full<Bytes>> {
    let key = req.uri().path().to_string();
    let reply = |status: StatusCode, body: Bytes| {
        let mut r = Response::new(Full::new(body));
        *r.status_mut() = status;
        r
    };
    match *req.method() {
        Method::PUT => match req.into_body().collect().await {
            Ok(body) => {
                let mut map = objects.lock().unwrap_or_else(|p| p.into_inner());
                map.insert(key, body.to_bytes());
                reply(StatusCode::NO_CONTENT, Bytes::new())
            }
            Err(_) => reply(StatusCode::BAD_REQUEST, Bytes::new()),
        },
        Method::GET => {
            let map = objects.lock().unwrap_or_else(|p| p.into_inner());
            match map.get(&key) {
                Some(v) => reply(StatusCode::OK, v.clone()),
                None => reply(StatusCode::NOT_FOUND, Bytes::new()),
            }
        }
        _ => reply(StatusCode::METHOD_NOT_ALLOWED, Bytes::new()),
    }
}

struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Http {
    async fn send(
        &self,
        method: Method,
        url: &str,
        token: Option<&str>,
        body: &str,
    ) -> Result<(StatusCode, String, String), Box<dyn std::error::Error>> {
        let mut req = Request::builder().method(method).uri(url);
        if let Some(t) = token {
            req = req.header("Fencing-Token", t);
        }
        let resp = self
            .client
            .request(req.body(Full::new(Bytes::from(body.to_string())))?)
            .await?;
        let status = resp.status();
        let result = resp
            .headers()
            .get("fencing-result")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_string();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok((status, result, String::from_utf8_lossy(&body).into_owned()))
    }
}

fn say(step: &str) {
    println!("  {step}");
}

/// Runs the story; returns an error only if the machinery itself fails.
pub async fn run() -> Result<std::process::ExitCode, Box<dyn std::error::Error>> {
    let (store_addr, _objects) = legacy_store().await?;
    let dir = std::env::temp_dir().join(format!("fencegate-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[store]
path = "demo.redb"
[fencing]
drain_timeout = "5s"
settle = "1s"
[[upstream]]
name = "legacy"
url = "http://{store_addr}"
timeout = "5s"
[[route]]
name = "reports"
path = "/reports/{{report}}/{{*rest}}"
scope = "report/{{report}}"
upstream = "legacy"
"#
    );
    let config = Config::parse(&text, &dir).map_err(|e| e.to_string())?;
    let running = crate::server::start(config, None).await?;
    let proxy = format!("http://{}", running.proxy_addr);
    let direct = format!("http://{store_addr}");
    let http = Http {
        client: Client::builder(TokioExecutor::new()).build_http(),
    };

    println!("fencegate demo: a legacy store at {direct} (no conditional writes),");
    println!("fencegate in front of it at {proxy}, fencing scope report/{{report}}.\n");

    println!("1) Through fencegate");
    let through = story(&http, &proxy, true).await?;
    println!("\n2) The same story straight to the store, without fencing");
    let straight = story(&http, &direct, false).await?;

    println!();
    println!("Through fencegate the published report is {through:?}: B's work survived.");
    println!("Straight to the store it is {straight:?}: A's stale write silently replaced B's.");
    running.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
    let ok = through == "report by B (token 42)" && straight == "report by A (token 41)";
    Ok(if ok {
        std::process::ExitCode::SUCCESS
    } else {
        println!("unexpected outcome");
        std::process::ExitCode::from(1)
    })
}

async fn story(
    http: &Http,
    base: &str,
    fenced: bool,
) -> Result<String, Box<dyn std::error::Error>> {
    let show = |who: &str, what: &str, r: &(StatusCode, String, String)| {
        let result = if fenced {
            format!(" Fencing-Result: {}", r.1)
        } else {
            String::new()
        };
        say(&format!("{who} {what} -> {}{result}", r.0));
    };
    say("A acquires the lock on report/july: token 41, lease 10s");
    let r = http
        .send(
            Method::PUT,
            &format!("{base}/reports/july/tmp-A"),
            Some("41"),
            "draft by A",
        )
        .await?;
    show("A", "PUT /reports/july/tmp-A (its temporary object)", &r);
    say("A pauses (a long GC pause); its lease expires while it sleeps");
    say("B acquires the lock on report/july: token 42");
    let r = http
        .send(
            Method::PUT,
            &format!("{base}/reports/july/final"),
            Some("42"),
            "report by B (token 42)",
        )
        .await?;
    show("B", "PUT /reports/july/final (publishes)", &r);
    say("A wakes up, still believing it holds the lock, and publishes");
    let r = http
        .send(
            Method::PUT,
            &format!("{base}/reports/july/final"),
            Some("41"),
            "report by A (token 41)",
        )
        .await?;
    show("A", "PUT /reports/july/final with token 41", &r);
    if r.0 == StatusCode::CONFLICT {
        say("A's write was refused at the destination: stale_fence. A discards its work.");
    }
    let r = http
        .send(Method::GET, &format!("{base}/reports/july/final"), None, "")
        .await?;
    say(&format!("GET /reports/july/final -> {} {:?}", r.0, r.2));
    Ok(r.2)
}
