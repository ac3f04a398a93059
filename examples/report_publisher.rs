//! A report publisher that follows the catalog pattern with `fencegate::client`:
//!
//! 1. acquire the lease on `report/<month>` from the authority (and keep it renewed);
//! 2. write the report as an immutable object under a key nobody else uses
//!    (`/reports/<month>/objects/<token>.csv`): a fenced-out writer can only leave an
//!    orphan behind, never damage anything;
//! 3. publish with one fenced write of the pointer `/reports/<month>/current`.
//!
//! The example plays two publishers: A pauses after writing its object (its lease runs
//! out), B takes over and publishes, then A wakes up and tries to publish its stale
//! pointer. fencegate refuses it (`StaleFence`); the catalog keeps pointing at B's report.
//!
//! ```sh
//! cargo run --example report_publisher
//! ```
//!
//! Runs anywhere: the legacy store is the in-process one of `fencegate demo`.

use std::error::Error;
use std::time::Duration;

use fencegate::client::{AuthorityClient, FenceResult, FencedHttp, Lease};

const MONTH: &str = "2024-07";

/// What a publisher's attempt came to.
enum Published {
    Done {
        object: String,
    },
    /// Fenced out: discard the work, never retry with this token.
    Stale,
}

/// Writes the immutable object, then (after `pause`, if any) publishes the pointer.
async fn publish(
    http: &FencedHttp,
    lease: &Lease,
    csv: &str,
    pause: impl std::future::Future<Output = ()>,
) -> Result<Published, Box<dyn Error>> {
    let fence = lease.fence()?;
    let object = format!("/reports/{MONTH}/objects/{}.csv", lease.token());
    // Retries of a transient answer keep the same token (SPEC §4).
    let mut attempts = 0;
    loop {
        attempts += 1;
        match http.put(&fence, &object, csv.to_string()).await? {
            FenceResult::Applied { status, .. } if status.is_success() => break,
            FenceResult::Applied { status, .. } => {
                return Err(format!("store said {status}").into());
            }
            FenceResult::StaleFence { .. } => return Ok(Published::Stale),
            FenceResult::Transient { retry_after, .. } if attempts < 5 => {
                tokio::time::sleep(retry_after.unwrap_or(Duration::from_millis(200))).await;
            }
            // An unknown outcome for an immutable object under a unique key is harmless:
            // writing it again with the same token is idempotent.
            FenceResult::Unknown { .. } if attempts < 5 => {}
            other => return Err(format!("object write: {other:?}").into()),
        }
    }
    println!("  token {} wrote {object}", lease.token());
    pause.await;
    // `send` refuses a fence whose lease is lost by now, but a real pause can strike just
    // after that check, with the request about to leave: the pointer goes out with the bare
    // token, as it would then, and it is the proxy that must refuse it.
    let fence = fencegate::client::Fence::new(fence.scope.clone(), fence.token);
    match http
        .put(&fence, &format!("/reports/{MONTH}/current"), object.clone())
        .await?
    {
        FenceResult::Applied { status, .. } if status.is_success() => {
            Ok(Published::Done { object })
        }
        FenceResult::StaleFence { .. } => Ok(Published::Stale),
        other => Err(format!("pointer write: {other:?}").into()),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let (store, _objects) = fencegate::cli::demo::legacy_store().await?;
    let dir = std::env::temp_dir().join(format!("fencegate-publisher-{}", std::process::id()));
    let config = fencegate::settings::Config::parse(
        &format!(
            r#"
[server]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[store]
path = "marks.redb"
[fencing]
settle = "0s"
[authority]
listen = "127.0.0.1:0"
max_ttl = "60s"
[[upstream]]
name = "objects"
url = "http://{store}"
[[route]]
name = "reports"
path = "/reports/{{report}}/{{*object}}"
scope = "report/{{report}}"
upstream = "objects"
"#
        ),
        &dir,
    )?;
    let running = fencegate::app::start(config, None).await?;
    let authority_addr = running.authority_addr.ok_or("no authority")?;
    let authority = AuthorityClient::new(&format!("http://{authority_addr}"))?;
    let http = FencedHttp::new(&format!("http://{}", running.proxy_addr))?;
    let scope = format!("report/{MONTH}");
    let ttl = Duration::from_millis(800);

    // A: acquires, keeps the lease alive while it computes, writes its object...
    let a = authority
        .acquire(&scope, "publisher-a", ttl, Duration::ZERO)
        .await?;
    println!("A holds {scope} with token {}", a.token());
    let keep_a = authority.keep_alive(&a, ttl);
    let (paused_tx, paused_rx) = tokio::sync::oneshot::channel::<()>();
    let (resume_tx, resume_rx) = tokio::sync::oneshot::channel::<()>();
    let a_task = {
        let (http, a) = (http.clone(), a.clone());
        tokio::spawn(async move {
            publish(&http, &a, "month,total\n2024-07,41\n", async move {
                // ...then stalls (a GC pause, a swapped-out VM) before publishing.
                let _ = paused_tx.send(());
                let _ = resume_rx.await;
            })
            .await
            .map_err(|e| e.to_string())
        })
    };
    paused_rx.await?;
    drop(keep_a); // the stall stops A's renewals too
    println!("A is paused; its lease runs out");
    a.lost().await;

    // B: acquires once A's lease has expired at the authority, and publishes.
    let b = authority
        .acquire(&scope, "publisher-b", ttl, Duration::ZERO)
        .await;
    let b = match b {
        Ok(b) => b,
        Err(fencegate::client::AcquireError::Busy { retry_after, .. }) => {
            tokio::time::sleep(retry_after).await;
            authority
                .acquire(&scope, "publisher-b", ttl, Duration::ZERO)
                .await?
        }
        Err(e) => return Err(e.into()),
    };
    println!("B holds {scope} with token {}", b.token());
    match publish(&http, &b, "month,total\n2024-07,42\n", async {}).await? {
        Published::Done { object } => println!("B published {object}"),
        Published::Stale => println!("B was fenced out (unexpected)"),
    }
    authority.release(&b).await?;

    // A wakes up and tries to publish its pointer with its old token.
    let _ = resume_tx.send(());
    match a_task.await?? {
        Published::Done { object } => println!("A published {object} (this must not happen)"),
        Published::Stale => {
            println!(
                "A was fenced out (409 stale_fence): it discards its work; its object is an orphan"
            )
        }
    }
    // Anyone can read the catalog; this read goes straight through (no token).
    let pointer = plain_get(running.proxy_addr, &format!("/reports/{MONTH}/current")).await?;
    println!("the catalog points at {pointer}");
    running.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A plain unfenced GET (a safe method without a token passes through, SPEC §2).
async fn plain_get(proxy: std::net::SocketAddr, path: &str) -> Result<String, Box<dyn Error>> {
    use http_body_util::BodyExt;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let resp = client.get(format!("http://{proxy}{path}").parse()?).await?;
    let body = resp.into_body().collect().await?.to_bytes();
    Ok(String::from_utf8_lossy(&body).into_owned())
}
