//! `Fencing-Sequence` (SPEC §11): the requests of one token on one scope in order. The
//! gate under a paused clock (ordering, settle, a new token, retries), then the proxy in
//! front of a test backend whose log is the "catalog": two publishes of one owner,
//! reordered, with and without a crash of the proxy between them.

use std::sync::Arc;
use std::time::Duration;

use crate::support;

use fencegate::fence::{Gates, Refusal};
use fencegate::metrics::Metrics;
use fencegate::settings::EqualPolicy::Accept;
use fencegate::store::{Mark, MarkStore};
use fencegate::token::Token;
use support::disk::Disk;
use support::{BOUND, Client, Double};

const DRAIN: Duration = Duration::from_secs(30);
const SETTLE: Duration = Duration::from_secs(5);

fn t(c: u64) -> Token {
    Token::new(0, c)
}

fn gates() -> Arc<Gates> {
    let store = MarkStore::open_inline_with_backend(Disk::new()).expect("store");
    Arc::new(Gates::new(
        store,
        Arc::new(Metrics::new(Vec::new())),
        DRAIN,
        SETTLE,
    ))
}

async fn admit(
    g: &Gates,
    token: u64,
    seq: Option<u64>,
) -> Result<fencegate::fence::Admission, Refusal> {
    g.admit_sequenced("s", t(token), seq, Accept, None).await
}

fn stale(token: u64, highest: u64) -> Refusal {
    Refusal::StaleSequence {
        highest: Some(t(token)),
        sequence: highest,
    }
}

/// Until `n` requests wait at the gate (time stands still meanwhile: the clock is paused
/// and only moves when every task waits).
async fn until_waiting(g: &Gates, n: usize) {
    for _ in 0..10_000 {
        if g.waiting() == n {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("{} waiting, not {n}", g.waiting());
}

/// #2 arrives while #1 is in flight: it is recorded first (so a late #1 is refused), then
/// waits; it is admitted only once #1 has finished.
#[tokio::test(start_paused = true)]
async fn a_higher_sequence_waits_for_the_lower_one_in_flight() {
    let g = gates();
    let mut first = admit(&g, 7, Some(1)).await.expect("#1");
    assert!(
        first.advanced,
        "the token's first request advances the mark"
    );
    let g2 = g.clone();
    let second = tokio::spawn(async move { admit(&g2, 7, Some(2)).await });
    until_waiting(&g, 1).await;
    assert_eq!(
        g.store().get_mark("s").unwrap(),
        Some(Mark {
            token: t(7),
            sequence: Some(2)
        }),
        "recorded durably before it waits"
    );
    assert_eq!(admit(&g, 7, Some(1)).await.unwrap_err(), stale(7, 2));
    tokio::time::advance(Duration::from_secs(3)).await;
    assert!(
        !second.is_finished(),
        "#2 must not pass while #1 is in flight"
    );
    // A request of the token without a sequence is not ordered.
    let mut plain = admit(&g, 7, None).await.expect("unsequenced");
    plain.guard.complete();
    drop(plain);
    first.guard.complete();
    drop(first);
    let mut adm = second.await.unwrap().expect("#2 after #1");
    assert_eq!(adm.waited, Duration::from_secs(3));
    adm.guard.complete();
    drop(adm);
    assert_eq!(
        admit(&g, 7, Some(2)).await.unwrap_err(),
        stale(7, 2),
        "once"
    );
}

/// #1 ended without a response (the backend may still apply it): #2 waits out the settle.
#[tokio::test(start_paused = true)]
async fn a_lost_lower_sequence_settles_before_a_higher_one_goes() {
    let g = gates();
    let first = admit(&g, 7, Some(1)).await.expect("#1");
    drop(first);
    let started = tokio::time::Instant::now();
    let mut second = admit(&g, 7, Some(2)).await.expect("#2 after the settle");
    assert_eq!(started.elapsed(), SETTLE);
    second.guard.complete();
}

/// A higher token starts the sequence over; the old token stays stale whatever its
/// sequence; a token's sequence never goes back; a sequence is recorded with the advance.
#[tokio::test(start_paused = true)]
async fn a_new_token_starts_the_sequence_over() {
    let g = gates();
    for n in [5, 9] {
        let mut a = admit(&g, 7, Some(n)).await.expect("7");
        a.guard.complete();
    }
    assert_eq!(admit(&g, 7, Some(8)).await.unwrap_err(), stale(7, 9));
    let mut a = admit(&g, 8, Some(1)).await.expect("8 starts over");
    assert!(a.advanced);
    a.guard.complete();
    drop(a);
    assert_eq!(
        g.store().get_mark("s").unwrap(),
        Some(Mark {
            token: t(8),
            sequence: Some(1)
        })
    );
    assert_eq!(
        admit(&g, 7, Some(10)).await.unwrap_err(),
        Refusal::Stale {
            highest: Some(t(8))
        }
    );
    assert_eq!(admit(&g, 8, Some(1)).await.unwrap_err(), stale(8, 1));
    // Without a sequence, a newer token's request resets nothing in order.
    let mut a = admit(&g, 9, None).await.expect("9");
    a.guard.complete();
    drop(a);
    let mut a = admit(&g, 9, Some(0)).await.expect("0 is above none");
    a.guard.complete();
}

/// A sequenced request recorded and then refused before anything was forwarded (here a
/// drain that outlasted `drain_timeout`, which says "retry"): its retry, same sequence,
/// gets through once, unless a higher sequence was recorded meanwhile.
#[tokio::test(start_paused = true)]
async fn a_refused_recorded_sequence_admits_its_retry_once() {
    let g = gates();
    let mut first = admit(&g, 7, Some(1)).await.expect("#1");
    let refused = admit(&g, 7, Some(2)).await.unwrap_err();
    assert_eq!(
        refused,
        Refusal::Draining {
            highest: Some(t(7))
        }
    );
    first.guard.complete();
    drop(first);
    let mut retry = admit(&g, 7, Some(2)).await.expect("the retry of #2");
    retry.guard.complete();
    drop(retry);
    assert_eq!(admit(&g, 7, Some(2)).await.unwrap_err(), stale(7, 2));

    // Refused unsent after admission, then overtaken by #4: #3's retry is out of order.
    let mut third = admit(&g, 7, Some(3)).await.expect("#3");
    third.guard.not_forwarded();
    drop(third);
    let mut fourth = admit(&g, 7, Some(4)).await.expect("#4");
    fourth.guard.complete();
    drop(fourth);
    assert_eq!(admit(&g, 7, Some(3)).await.unwrap_err(), stale(7, 4));
}

fn config_with_sequence_routes(upstream: std::net::SocketAddr) -> String {
    support::config_text(upstream, "10s", "0s", "10s")
        + r#"
[[route]]
name = "catalog"
path = "/catalog/{name}"
scope = "catalog/{name}"
upstream = "u"
sequence = "required"
"#
}

/// The catalog as the backend has it: the body of the last write it was sent to `path`.
fn catalog(double: &Double, path: &str) -> Option<String> {
    double
        .seen()
        .iter()
        .rev()
        .find(|s| s.method == "PUT" && s.target == path)
        .map(|s| String::from_utf8_lossy(&s.body).into_owned())
}

async fn publish(client: &Client, path: &str, token: &str, seq: &str, body: &str) -> support::Resp {
    client
        .send(
            "PUT",
            path,
            &[("fencing-token", token), ("fencing-sequence", seq)],
            body,
        )
        .await
}

/// Waits (bounded) until the access log at `path` holds `n` lines; answers them.
async fn access_log(path: &std::path::Path, n: usize) -> Vec<serde_json::Value> {
    tokio::time::timeout(BOUND, async {
        loop {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            if text.lines().count() >= n {
                return text
                    .lines()
                    .map(|l| serde_json::from_str(l).expect("a JSON line"))
                    .collect();
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("access log lines")
}

/// One owner publishes #1 then #2; the network delivers #2 first. #2 lands, #1 is
/// refused `stale_sequence` with the highest sequence, and the catalog still points at
/// #2. Counted in the request metrics and written to the access log.
#[tokio::test]
async fn a_reordered_publish_cannot_move_the_catalog_back() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let text = config_with_sequence_routes(double.addr) + "\n[log]\naccess = \"access.log\"\n";
    let proxy = support::start_text(&text, dir.path()).await;
    let client = Client::new(proxy.proxy_addr);
    let path = "/catalog/daily";

    let second = publish(&client, path, "7", "2", "v2").await;
    assert_eq!((second.status, second.result()), (200, "accepted"));
    let first = publish(&client, path, "7", "1", "v1").await;
    assert_eq!((first.status, first.result()), (409, "stale_sequence"));
    let body = first.json();
    assert_eq!(body["highest_sequence"], "2");
    assert_eq!(body["sequence"], "1");
    assert_eq!(body["token"], "7");
    assert_eq!(body["scope"], "catalog/daily");
    assert_eq!(catalog(&double, path).as_deref(), Some("v2"));
    assert_eq!(double.seen().len(), 1, "#1 never reached the backend");

    // The next owner starts over.
    let next = publish(&client, path, "8", "1", "v3").await;
    assert_eq!((next.status, next.result()), (200, "accepted"));
    assert_eq!(catalog(&double, path).as_deref(), Some("v3"));

    let log = access_log(&dir.path().join("access.log"), 3).await;
    let (accepted, refused) = (&log[0], &log[1]);
    assert_eq!(
        (accepted["result"].as_str(), accepted["sequence"].as_str()),
        (Some("accepted"), Some("2"))
    );
    assert!(accepted["highest_sequence"].is_null(), "{accepted}");
    assert_eq!(
        (
            refused["result"].as_str(),
            refused["sequence"].as_str(),
            refused["highest_sequence"].as_str()
        ),
        (Some("stale_sequence"), Some("1"), Some("2")),
        "{refused}"
    );
    let metrics = Client::new(proxy.admin_addr).get("/metrics").await.body;
    assert_eq!(
        support::metric_value(
            &metrics,
            "fencegate_requests_total{route=\"catalog\",result=\"stale_sequence\"}"
        ),
        1.0
    );
    proxy.shutdown().await;
}

/// `sequence = "required"` refuses a fenced request without the header, and every route
/// refuses a malformed one, 400 `invalid_token`, nothing forwarded.
#[tokio::test]
async fn missing_and_malformed_sequences_are_refused() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start_text(&config_with_sequence_routes(double.addr), dir.path()).await;
    let client = Client::new(proxy.proxy_addr);

    let r = client.put("/catalog/daily", "7", "v").await;
    assert_eq!((r.status, r.result()), (400, "invalid_token"));
    assert!(
        r.json()["title"]
            .as_str()
            .unwrap()
            .contains("Fencing-Sequence"),
        "{}",
        r.body
    );
    // Optional elsewhere: without it nothing changes.
    let r = client.put("/reports/july/x", "7", "v").await;
    assert_eq!((r.status, r.result()), (200, "accepted"));

    let twenty_one = "1".repeat(21);
    for bad in [
        "",
        "x",
        "-1",
        "+1",
        "01",
        "1.5",
        "18446744073709551616",
        &twenty_one,
    ] {
        let r = publish(&client, "/reports/july/x", "7", bad, "v").await;
        assert_eq!((r.status, r.result()), (400, "invalid_token"), "{bad:?}");
    }
    let r = client
        .send(
            "PUT",
            "/reports/july/x",
            &[
                ("fencing-token", "7"),
                ("fencing-sequence", "1"),
                ("fencing-sequence", "2"),
            ],
            "v",
        )
        .await;
    assert_eq!(
        (r.status, r.result()),
        (400, "invalid_token"),
        "two headers"
    );
    assert_eq!(
        double.seen().len(),
        1,
        "only the unsequenced PUT was forwarded"
    );
    let r = publish(&client, "/reports/july/x", "7", "18446744073709551615", "v").await;
    assert_eq!(
        (r.status, r.result()),
        (200, "accepted"),
        "2^64-1 is a sequence"
    );
    proxy.shutdown().await;
}

/// Over HTTP: #1 is held inside the backend; #2 of the same token waits at the gate and
/// reaches the backend only after #1's response.
#[tokio::test]
async fn the_backend_sees_one_tokens_sequences_in_order() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start_text(&config_with_sequence_routes(double.addr), dir.path()).await;
    let client = Client::new(proxy.proxy_addr);
    let c = client.clone();
    let first = tokio::spawn(async move {
        c.send(
            "PUT",
            "/catalog/daily",
            &[
                ("fencing-token", "7"),
                ("fencing-sequence", "1"),
                ("x-test-hold", "one"),
            ],
            "v1",
        )
        .await
    });
    double.arrived("one").await;
    let c = client.clone();
    let second = tokio::spawn(async move { publish(&c, "/catalog/daily", "7", "2", "v2").await });
    tokio::time::timeout(BOUND, async {
        while proxy.app.gates.waiting() != 1 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .expect("#2 waits at the gate");
    assert_eq!(
        double.seen().len(),
        1,
        "#2 is not forwarded while #1 is in flight"
    );
    double.release("one");
    assert_eq!(first.await.unwrap().status, 200);
    let second = second.await.unwrap();
    assert_eq!((second.status, second.result()), (200, "accepted"));
    let bodies: Vec<_> = double.seen().iter().map(|s| s.body.clone()).collect();
    assert_eq!(bodies, ["v1", "v2"]);
    assert_eq!(catalog(&double, "/catalog/daily").as_deref(), Some("v2"));
    proxy.shutdown().await;
}

/// The reorder with a crash between: #2 is accepted, the proxy is killed (SIGKILL: the
/// sequence is only in the journal), restarted on the same store; the late #1 is refused
/// and the catalog still points at #2. A kill during a stream of sequences never loses
/// an acknowledged one.
#[tokio::test]
async fn a_recorded_sequence_survives_a_kill() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = support::write_config(dir.path(), double.addr);
    let mut proc = support::spawn(&config, p, a);
    let client = Client::new(proc.proxy);
    let path = "/reports/daily/catalog";

    let second = publish(&client, path, "7", "2", "v2").await;
    assert_eq!((second.status, second.result()), (200, "accepted"));
    // More sequences on another scope, acknowledged one by one.
    let mut acked = 0;
    for n in 1..=20u64 {
        let r = publish(&client, "/reports/other/x", "3", &n.to_string(), "o").await;
        assert_eq!(r.status, 200, "{n}");
        acked = n;
    }
    proc.child.kill().unwrap();
    proc.child.wait().unwrap();

    let mut proc = support::spawn(&config, p, a);
    let client = Client::new(proc.proxy);
    let first = publish(&client, path, "7", "1", "v1").await;
    assert_eq!((first.status, first.result()), (409, "stale_sequence"));
    assert_eq!(first.json()["highest_sequence"], "2");
    assert_eq!(catalog(&double, path).as_deref(), Some("v2"));
    let r = publish(&client, "/reports/other/x", "3", &acked.to_string(), "o").await;
    assert_eq!(r.result(), "stale_sequence", "the last acknowledged one");
    let r = publish(&client, path, "7", "3", "v3").await;
    assert_eq!((r.status, r.result()), (200, "accepted"));
    // The admin API and the offline CLI show the sequence with the mark.
    let v = Client::new(proc.admin)
        .get("/v1/scopes/report%2Fdaily")
        .await
        .json();
    assert_eq!(
        (
            v["highest_accepted"].as_str(),
            v["highest_sequence"].as_str()
        ),
        (Some("7"), Some("3"))
    );
    proc.child.kill().unwrap();
    proc.child.wait().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["marks", "get", "report/daily", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "7\nsequence 3\n");
}

/// The Rust client numbers the requests of a lease by itself: every numbered fence of one
/// lease shares one count from 1, the backend sees them in order, and a request the
/// caller gave its own number keeps it (here an old one: refused, typed).
#[tokio::test]
async fn the_client_numbers_a_leases_requests() {
    use fencegate::client::{Fence, FenceResult, FencedHttp, Lease};
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start_text(&config_with_sequence_routes(double.addr), dir.path()).await;
    let http = FencedHttp::new(&format!("http://{}", proxy.proxy_addr)).unwrap();
    let lease = Lease::from_parts(
        "catalog/daily".into(),
        "l".into(),
        t(7),
        tokio::time::Instant::now() + Duration::from_secs(60),
    );
    let first = lease.fence().unwrap().numbered();
    let second = lease.fence().unwrap().numbered();
    for (fence, body) in [(&first, "v1"), (&second, "v2"), (&first, "v3")] {
        let r = http.put(fence, "/catalog/daily", body).await.unwrap();
        assert!(matches!(r, FenceResult::Applied { .. }), "{body}: {r:?}");
    }
    let numbers: Vec<_> = double
        .seen()
        .iter()
        .map(|s| s.header("fencing-sequence").unwrap_or("-").to_string())
        .collect();
    assert_eq!(numbers, ["1", "2", "3"]);
    let mut headers = http::HeaderMap::new();
    headers.insert("fencing-sequence", http::HeaderValue::from_static("2"));
    let r = http
        .send(
            &first,
            http::Method::PUT,
            "/catalog/daily",
            headers,
            bytes::Bytes::from_static(b"late"),
        )
        .await
        .unwrap();
    assert!(
        matches!(
            r,
            FenceResult::StaleSequence {
                highest_sequence: Some(3)
            }
        ),
        "{r:?}"
    );
    assert!(
        lease.is_held(),
        "an out-of-order request does not lose the lease"
    );
    // A fence apart from a lease counts on its own; an unnumbered one sends none (and
    // the route requires one).
    let apart = Fence::new("catalog/daily", t(8)).numbered();
    assert!(matches!(
        http.put(&apart, "/catalog/daily", "v4").await.unwrap(),
        FenceResult::Applied { .. }
    ));
    assert_eq!(
        double
            .seen()
            .last()
            .and_then(|s| s.header("fencing-sequence").map(str::to_string)),
        Some("1".into())
    );
    let plain = Fence::new("catalog/daily", t(8));
    assert!(matches!(
        http.put(&plain, "/catalog/daily", "v5").await,
        Err(fencegate::client::FencedError::Refused { status: 400, .. })
    ));
    proxy.shutdown().await;
}

/// A retry of a forwarded sequenced request is the Idempotency-Key's job: with the same
/// sequence it is out of order; with the same key and the next sequence (what the Rust
/// client sends) it is the stored answer, and the backend sees the request once.
#[tokio::test]
async fn a_keyed_retry_takes_the_next_sequence_and_is_a_duplicate() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start(support::config(double.addr, dir.path())).await;
    let client = Client::new(proxy.proxy_addr);
    let send = |seq: &'static str| {
        let client = client.clone();
        async move {
            client
                .send(
                    "PUT",
                    "/idem/k",
                    &[
                        ("fencing-token", "7"),
                        ("fencing-sequence", seq),
                        ("idempotency-key", "\"op-1\""),
                    ],
                    "v",
                )
                .await
        }
    };
    assert_eq!(send("1").await.result(), "accepted");
    assert_eq!(send("1").await.result(), "stale_sequence");
    let retry = send("2").await;
    assert_eq!((retry.status, retry.result()), (200, "duplicate"));
    assert_eq!(double.seen().len(), 1);
    proxy.shutdown().await;
}
