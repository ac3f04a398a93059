//! The Rust client (`fencegate::client`): leases as capabilities with conservative local
//! deadlines, background renewal, loss that is final, and fenced requests with typed
//! results.

use crate::support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fencegate::client::{
    AuthorityClient, ClientOptions, FenceResult, FencedError, FencedHttp, RenewError,
};
use fencegate::settings::Config;
use fencegate::token::Token;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use support::{BOUND, Double};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::time::Instant;

fn proxy_with_authority(upstream: SocketAddr, dir: &std::path::Path, timeout: &str) -> Config {
    let text = support::config_text(upstream, "10s", "0s", timeout)
        + "\n[authority]\nlisten = \"127.0.0.1:0\"\nmax_ttl = \"30s\"\n";
    Config::parse(&text, dir).expect("config")
}

#[tokio::test]
async fn acquire_returns_a_conservative_capability() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let running = support::start(proxy_with_authority(double.addr, dir.path(), "10s")).await;
    let base = format!("http://{}", running.authority_addr.unwrap());
    let authority = AuthorityClient::new(&base).unwrap();
    let ttl = Duration::from_secs(10);
    let sent = Instant::now();
    let lease = authority
        .acquire("report/july", "writer-1", ttl, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(lease.scope(), "report/july");
    assert_eq!(lease.token(), Token::new(0, 1));
    assert!(!lease.lease_id().is_empty());
    let received = Instant::now();
    let deadline = lease.deadline().unwrap();
    // Measured from before sending, less the margins: earlier than "received + ttl".
    assert!(deadline < received + ClientOptions::default().usable(ttl));
    assert!(deadline > sent + ttl / 2);
    // And before the authority's own deadline, whatever the time the answer took.
    let asked = Instant::now();
    let info = authority.status("report/july").await.unwrap();
    let remaining = Duration::from_millis(info.ttl_ms.unwrap());
    assert!(deadline + ClientOptions::default().clock_margin <= asked + remaining);
    assert_eq!(info.holder.as_deref(), Some("writer-1"));
    assert_eq!(info.token, Some(lease.token()));
    // An authority without clients shows no lease id to anyone.
    assert_eq!(info.lease_id, None);

    authority.release(&lease).await.unwrap();
    assert!(!lease.is_held(), "released means lost locally");
    assert!(matches!(
        authority.renew(&lease, ttl).await,
        Err(RenewError::Lost(_))
    ));
    running.shutdown().await;
}

#[tokio::test]
async fn keep_alive_renews_the_exact_lease_until_dropped() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let running = support::start(proxy_with_authority(double.addr, dir.path(), "10s")).await;
    let base = format!("http://{}", running.authority_addr.unwrap());
    let authority = AuthorityClient::new(&base).unwrap();
    let ttl = Duration::from_millis(300);
    let lease = authority
        .acquire("s", "a", ttl, Duration::ZERO)
        .await
        .unwrap();
    let first_deadline = lease.deadline().unwrap();
    let keep = authority.keep_alive(&lease, ttl);
    // Wait until renewals have carried the lease well past its first deadline.
    tokio::time::timeout(BOUND, async {
        while lease
            .deadline()
            .is_some_and(|d| d < first_deadline + ttl * 2)
        {
            tokio::time::sleep(ttl / 4).await;
        }
    })
    .await
    .expect("renewals extend the deadline");
    assert!(lease.is_held());
    let other = authority.acquire("s", "b", ttl, Duration::ZERO).await;
    assert!(other.is_err(), "still held by a: {other:?}");
    drop(keep);
    tokio::time::timeout(BOUND, lease.lost())
        .await
        .expect("without renewal the lease runs out");
    assert!(!lease.is_held());
    let b = authority
        .acquire("s", "b", ttl, BOUND)
        .await
        .expect("b gets the scope once a's lease expired");
    assert!(b.token() > lease.token());
    running.shutdown().await;
}

/// An authority double whose renewal answers wait for the test: grants 250 ms leases.
struct SlowAuthority {
    addr: SocketAddr,
    renew_arrived: Arc<Notify>,
    answer_renew: Arc<Notify>,
}

async fn slow_authority(renew_result: &'static str) -> SlowAuthority {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let renew_arrived = Arc::new(Notify::new());
    let answer_renew = Arc::new(Notify::new());
    let (arrived, answer) = (renew_arrived.clone(), answer_renew.clone());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (arrived, answer) = (arrived.clone(), answer.clone());
            let svc = service_fn(move |req: Request<Incoming>| {
                let (arrived, answer) = (arrived.clone(), answer.clone());
                async move {
                    let body = match req.uri().path() {
                        "/v1/locks/acquire" => {
                            r#"{"result":"acquired","scope":"s","lease_id":"L","token":"7","ttl_ms":250}"#
                        }
                        _ => {
                            arrived.notify_one();
                            answer.notified().await;
                            if renew_result == "renewed" {
                                r#"{"result":"renewed","ttl_ms":250}"#
                            } else {
                                r#"{"result":"lost","status":409}"#
                            }
                        }
                    };
                    let status = if body.contains("lost") { 409 } else { 200 };
                    let mut r = Response::new(Full::new(Bytes::from(body)));
                    *r.status_mut() = http::StatusCode::from_u16(status).unwrap();
                    Ok::<_, Infallible>(r)
                }
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    SlowAuthority {
        addr,
        renew_arrived,
        answer_renew,
    }
}

#[tokio::test]
async fn a_late_renewal_answer_does_not_revive_a_lost_lease() {
    let slow = slow_authority("renewed").await;
    let authority = AuthorityClient::new(&format!("http://{}", slow.addr)).unwrap();
    let ttl = Duration::from_millis(250);
    let lease = authority
        .acquire("s", "a", ttl, Duration::ZERO)
        .await
        .unwrap();
    let renewing = {
        let (authority, lease) = (authority.clone(), lease.clone());
        tokio::spawn(async move { authority.renew(&lease, ttl).await })
    };
    tokio::time::timeout(BOUND, slow.renew_arrived.notified())
        .await
        .expect("renewal sent");
    // The renewal is in flight; the local deadline passes first.
    tokio::time::timeout(BOUND, lease.lost())
        .await
        .expect("deadline passes");
    slow.answer_renew.notify_one();
    let late = renewing.await.unwrap();
    assert!(matches!(late, Err(RenewError::Lost(_))), "{late:?}");
    assert!(!lease.is_held());
    assert!(lease.fence().is_err());
}

#[tokio::test]
async fn a_lost_answer_ends_the_lease_at_once() {
    let slow = slow_authority("lost").await;
    let authority = AuthorityClient::new(&format!("http://{}", slow.addr)).unwrap();
    let ttl = Duration::from_millis(250);
    let lease = authority
        .acquire("s", "a", ttl, Duration::ZERO)
        .await
        .unwrap();
    assert!(lease.is_held());
    slow.answer_renew.notify_one(); // answer as soon as the renewal arrives
    let r = authority.renew(&lease, ttl).await;
    assert!(matches!(r, Err(RenewError::Lost(_))), "{r:?}");
    assert!(!lease.is_held());
}

#[tokio::test]
async fn fenced_requests_have_typed_results() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let running = support::start(proxy_with_authority(double.addr, dir.path(), "300ms")).await;
    let authority =
        AuthorityClient::new(&format!("http://{}", running.authority_addr.unwrap())).unwrap();
    let http = FencedHttp::new(&format!("http://{}", running.proxy_addr)).unwrap();
    let ttl = Duration::from_secs(5);

    let old = authority
        .acquire("report/july", "a", ttl, Duration::ZERO)
        .await
        .unwrap();
    let old_fence = old.fence().unwrap();
    match http
        .put(&old_fence, "/reports/july/final", "by a")
        .await
        .unwrap()
    {
        FenceResult::Applied { status, .. } => assert_eq!(status, 200),
        other => panic!("{other:?}"),
    }
    let seen = double.seen();
    let last = seen.last().unwrap();
    assert_eq!(last.header("fencing-token"), Some("1"));
    assert_eq!(last.header("fencing-scope"), Some("report/july"));
    authority.release(&old).await.unwrap();

    let new = authority
        .acquire("report/july", "b", ttl, Duration::ZERO)
        .await
        .unwrap();
    let fence = new.fence().unwrap();
    // A fenced read advances the mark (SPEC §2), so the old owner is out before b writes.
    assert!(matches!(
        http.get(&fence, "/reports/july/final").await.unwrap(),
        FenceResult::Applied { .. }
    ));
    // The old fence's lease is released: the client refuses it without sending.
    assert!(matches!(
        http.put(&old_fence, "/reports/july/final", "stale").await,
        Err(FencedError::LeaseLost)
    ));
    // Sent anyway (a process that paused past that check), the proxy refuses it.
    let paused = fencegate::client::Fence::new(old_fence.scope.clone(), old_fence.token);
    match http
        .put(&paused, "/reports/july/final", "stale")
        .await
        .unwrap()
    {
        FenceResult::StaleFence { highest_accepted } => {
            assert_eq!(highest_accepted, Some(new.token()))
        }
        other => panic!("{other:?}"),
    }
    // upstream_timeout: may or may not have been applied.
    let mut held = http::HeaderMap::new();
    held.insert("x-test-hold", "slow".parse().unwrap());
    let r = http
        .send(
            &fence,
            http::Method::PUT,
            "/reports/july/slow",
            held,
            Bytes::new(),
        )
        .await
        .unwrap();
    assert!(matches!(r, FenceResult::Unknown { .. }), "{r:?}");
    double.release("slow");
    // A client mistake is an error, not a result: the token's scope is another one.
    let elsewhere = fencegate::client::Fence::new("report/june", new.token());
    assert!(matches!(
        http.put(&elsewhere, "/reports/july/final", "x").await,
        Err(FencedError::Refused { status: 409, ref result, .. }) if result == "scope_mismatch"
    ));
    assert!(matches!(
        http.put(&fence, "/nowhere", "x").await,
        Err(FencedError::Refused { status: 404, .. })
    ));
    // An unfenced route answers without Fencing-Result: nothing protected the request.
    let public = fencegate::client::Fence::new("-", new.token());
    assert!(matches!(
        http.put(&public, "/public/x", "x").await,
        Err(FencedError::NotFenced { status: 200 })
    ));
    running.shutdown().await;

    // The proxy is gone: nothing was sent, retry later with the same token.
    let r = http.put(&fence, "/reports/july/final", "x").await.unwrap();
    assert!(matches!(r, FenceResult::Transient { .. }), "{r:?}");
}

/// `stale_fence` is final for a token (an epoch bump, an operator's raise, a token from
/// elsewhere): the lease it came with is given up at once, so no further request carries
/// it and its keep-alive ends, though the authority would still renew it.
#[tokio::test]
async fn a_stale_answer_gives_the_lease_up() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let running = support::start(proxy_with_authority(double.addr, dir.path(), "300ms")).await;
    let authority =
        AuthorityClient::new(&format!("http://{}", running.authority_addr.unwrap())).unwrap();
    let http = FencedHttp::new(&format!("http://{}", running.proxy_addr)).unwrap();
    let lease = authority
        .acquire("report/aug", "a", Duration::from_secs(30), Duration::ZERO)
        .await
        .unwrap();
    let fence = lease.fence().unwrap();
    // Someone with a higher token for the scope (not from this authority) writes first.
    let higher = fencegate::client::Fence::new(
        "report/aug",
        fencegate::token::Token::new(lease.token().epoch, lease.token().counter + 100),
    );
    assert!(matches!(
        http.put(&higher, "/reports/aug/x", "other").await.unwrap(),
        FenceResult::Applied { .. }
    ));
    assert!(lease.is_held());
    let r = http.put(&fence, "/reports/aug/x", "mine").await.unwrap();
    assert!(matches!(r, FenceResult::StaleFence { .. }), "{r:?}");
    assert!(!lease.is_held());
    assert!(matches!(
        http.put(&fence, "/reports/aug/x", "again").await,
        Err(FencedError::LeaseLost)
    ));
    // Nor is it renewed any more (a keep-alive loop ends here).
    let renewed = authority.renew(&lease, Duration::from_secs(30)).await;
    assert!(matches!(renewed, Err(RenewError::Lost(_))), "{renewed:?}");
    running.shutdown().await;
}

/// With a bearer secret the client is an authority client (the holder is its name, the
/// status shows it its lease id), and the grant's proof travels with every fenced request
/// by itself: a `proof = "required"` route accepts the lease's fences and refuses a fence
/// made apart from it, without a proof.
#[tokio::test]
async fn the_bearer_and_the_proof_travel_by_themselves() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    crate::support::write_secret(dir.path().join("w.token"), "w-secret\n");
    fencegate::proof::keygen(&dir.path().join("fence")).unwrap();
    let text = support::config_text(double.addr, "10s", "0s", "10s")
        .replace(
            "[fencing]\n",
            "[fencing]\nproof_keys = [\"fence.pub\"]\n",
        )
        .replace(
            "name = \"reports\"\npath = \"/reports/{report}/{*rest}\"\nscope = \"report/{report}\"\nupstream = \"u\"\n",
            "name = \"reports\"\npath = \"/reports/{report}/{*rest}\"\nscope = \"report/{report}\"\nupstream = \"u\"\nproof = \"required\"\n",
        )
        + "\n[authority]\nlisten = \"127.0.0.1:0\"\nmax_ttl = \"30s\"\nsigning_key = \"fence.key\"\n\
           [[authority.client]]\nname = \"writer\"\ntoken_file = \"w.token\"\nscopes = [\"report/*\"]\n";
    let running = support::start(Config::parse(&text, dir.path()).expect("config")).await;
    let base = format!("http://{}", running.authority_addr.unwrap());

    let anonymous = AuthorityClient::new(&base).unwrap();
    let refused = anonymous
        .acquire(
            "report/july",
            "writer",
            Duration::from_secs(10),
            Duration::ZERO,
        )
        .await;
    assert!(
        matches!(
            refused,
            Err(fencegate::client::AcquireError::Refused { status: 401, .. })
        ),
        "{refused:?}"
    );

    let options = ClientOptions {
        bearer: Some(fencegate::client::Secret("w-secret".into())),
        ..ClientOptions::default()
    };
    let authority = AuthorityClient::with_options(&base, options).unwrap();
    let lease = authority
        .acquire("report/july", "", Duration::from_secs(10), Duration::ZERO)
        .await
        .unwrap();
    assert!(lease.proof().is_some_and(|p| p.starts_with("v1.")));
    let info = authority.status("report/july").await.unwrap();
    assert_eq!(info.holder.as_deref(), Some("writer"));
    assert_eq!(info.lease_id.as_deref(), Some(lease.lease_id()));

    let http = FencedHttp::new(&format!("http://{}", running.proxy_addr)).unwrap();
    let fence = lease.fence().unwrap();
    let r = http.put(&fence, "/reports/july/a", "x").await.unwrap();
    assert!(matches!(r, FenceResult::Applied { .. }), "{r:?}");
    assert_eq!(
        double.seen()[0].header("fencing-proof"),
        lease.proof(),
        "the proof went with the request"
    );
    let bare = fencegate::client::Fence::new("report/july", lease.token());
    let r = http.put(&bare, "/reports/july/a", "x").await;
    assert!(
        matches!(&r, Err(FencedError::Refused { status: 403, result, .. }) if result == "invalid_proof"),
        "{r:?}"
    );
    authority
        .renew(&lease, Duration::from_secs(10))
        .await
        .unwrap();
    authority.release(&lease).await.unwrap();
    running.shutdown().await;
}
