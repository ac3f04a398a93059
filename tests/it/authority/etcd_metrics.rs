//! The lease authority's metrics with the etcd backend, against a real etcd on loopback:
//! the same counts as `local`, and an expiry without release counted when this process
//! observes it (a renew that finds the etcd lease gone).
//!
//! Needs `--features etcd` and `etcd` on the machine.
#![cfg(feature = "etcd")]

use crate::support;

use std::time::{Duration, Instant};

use support::etcd::{self, EtcdCluster};
use support::{BOUND, Client, metric_value};

/// Acquires `scope` for `holder`, retrying while etcd is briefly without a leader.
async fn acquire(c: &Client, scope: &str, holder: &str, ttl_ms: u64) -> serde_json::Value {
    let started = Instant::now();
    loop {
        let r = c
            .post_json(
                "/v1/locks/acquire",
                &format!(r#"{{"scope":"{scope}","holder":"{holder}","ttl_ms":{ttl_ms}}}"#),
            )
            .await;
        if r.status == 200 {
            return r.json();
        }
        assert_eq!(r.status, 503, "{}", r.body);
        assert!(started.elapsed() < BOUND, "etcd never answered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn lease_call(j: &serde_json::Value, scope: &str, renew: bool) -> String {
    let ttl = if renew { r#","ttl_ms":1000"# } else { "" };
    format!(
        r#"{{"scope":"{scope}","lease_id":"{}","token":"{}"{ttl}}}"#,
        j["lease_id"].as_str().unwrap(),
        j["token"].as_str().unwrap()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_counts_like_local_and_sees_an_expiry_without_release() {
    let cluster = EtcdCluster::start(1).await;
    let dir = tempfile::tempdir().unwrap();
    let support::Authority {
        running,
        api: c,
        admin,
    } = support::start_authority(
        &etcd::authority_table(&cluster.endpoints(), None),
        dir.path(),
    )
    .await;

    // Released: its age is counted as `released`, not as an expiry.
    let kept = acquire(&c, "kept", "a", 10_000).await;
    let r = c
        .post_json("/v1/locks/renew", &lease_call(&kept, "kept", true))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = c
        .post_json("/v1/locks/release", &lease_call(&kept, "kept", false))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);

    // Not renewed: etcd expires it (1 s). Wait, bounded, until etcd no longer shows it.
    let dropped = acquire(&c, "dropped", "a", 1000).await;
    let started = Instant::now();
    loop {
        let r = c.get("/v1/locks?scope=dropped").await;
        assert_eq!(r.status, 200, "{}", r.body);
        if r.json()["holder"].is_null() {
            break;
        }
        assert!(
            started.elapsed() < BOUND,
            "the lease never expired: {}",
            r.body
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before = admin.get("/metrics").await.body;
    assert_eq!(
        metric_value(&before, "fencegate_authority_expiries_total"),
        0.0
    );
    // Its holder comes back and renews: lost, and the authority now knows it expired.
    let r = c
        .post_json("/v1/locks/renew", &lease_call(&dropped, "dropped", true))
        .await;
    assert_eq!(r.status, 409, "{}", r.body);
    // Again: still one expiry.
    let r = c
        .post_json("/v1/locks/release", &lease_call(&dropped, "dropped", false))
        .await;
    assert_eq!(r.status, 409, "{}", r.body);

    let m = admin.get("/metrics").await.body;
    assert_eq!(
        metric_value(&m, "fencegate_authority_expiries_total"),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric_value(
            &m,
            "fencegate_authority_lease_age_seconds_count{end=\"expired\"}"
        ),
        1.0
    );
    assert_eq!(
        metric_value(
            &m,
            "fencegate_authority_lease_age_seconds_count{end=\"released\"}"
        ),
        1.0
    );
    assert_eq!(
        metric_value(
            &m,
            "fencegate_authority_acquisitions_total{result=\"acquired\"}"
        ),
        2.0
    );
    assert_eq!(
        metric_value(&m, "fencegate_authority_renewals_total{result=\"renewed\"}"),
        1.0
    );
    assert_eq!(
        metric_value(&m, "fencegate_authority_renewals_total{result=\"lost\"}"),
        1.0
    );
    assert_eq!(
        metric_value(
            &m,
            "fencegate_authority_releases_total{result=\"released\"}"
        ),
        1.0
    );
    assert_eq!(
        metric_value(&m, "fencegate_authority_releases_total{result=\"lost\"}"),
        1.0
    );
    let token: fencegate::token::Token = dropped["token"].as_str().unwrap().parse().unwrap();
    assert_eq!(
        metric_value(&m, "fencegate_authority_last_token_counter"),
        token.counter as f64
    );
    assert_eq!(metric_value(&m, "fencegate_authority_epoch"), 0.0);
    running.shutdown().await;
}

/// A lease nobody renews or releases again: the authority's sweep (every 10 s) asks etcd
/// about its leases past their deadline, and counts the expiry without any call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_counts_an_etcd_expiry_nobody_asked_about() {
    let cluster = EtcdCluster::start(1).await;
    let dir = tempfile::tempdir().unwrap();
    let support::Authority {
        running,
        api: c,
        admin,
    } = support::start_authority(
        &etcd::authority_table(&cluster.endpoints(), None),
        dir.path(),
    )
    .await;
    acquire(&c, "left", "a", 1000).await;
    // Bounded: the lease's second, then at most one sweep interval (10 s) and slack.
    let started = Instant::now();
    loop {
        let m = admin.get("/metrics").await.body;
        if metric_value(&m, "fencegate_authority_expiries_total") == 1.0 {
            assert_eq!(
                metric_value(
                    &m,
                    "fencegate_authority_lease_age_seconds_count{end=\"expired\"}"
                ),
                1.0
            );
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the sweep never counted the expiry:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    running.shutdown().await;
}
