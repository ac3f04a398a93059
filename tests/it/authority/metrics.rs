//! The lease authority's metrics over real sockets: real calls to a running authority,
//! then its process's admin `/metrics` scraped and the counts compared.

use crate::support;

use std::path::Path;

use support::{Client, metric_value};

/// A local-backend authority (max_ttl 60 s, no lock delay) with `clients` (its
/// `[[authority.client]]` tables, or nothing).
async fn start(dir: &Path, clients: &str) -> support::Authority {
    let table = format!("backend = \"local\"\nmax_ttl = \"60s\"\nlock_delay = \"0s\"\n{clients}");
    support::start_authority(&table, dir).await
}

async fn scrape(admin: &Client) -> String {
    let r = admin.get("/metrics").await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.body
}

fn lease(j: &serde_json::Value) -> (String, String) {
    (
        j["lease_id"].as_str().expect("lease_id").to_string(),
        j["token"].as_str().expect("token").to_string(),
    )
}

/// Acquisitions by result (acquired, busy, invalid), renewals and releases by result,
/// lease age at release, the last token and the epoch: each counted once per answer.
#[tokio::test]
async fn authority_calls_are_counted_by_result() {
    let dir = tempfile::tempdir().unwrap();
    let support::Authority {
        running,
        api: c,
        admin,
    } = start(dir.path(), "").await;

    let r = c
        .post_json_as(
            "/v1/locks/acquire",
            r#"{"scope":"s","holder":"a","ttl_ms":30000}"#,
            None,
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let (id, token) = lease(&r.json());
    let r = c
        .post_json_as(
            "/v1/locks/acquire",
            r#"{"scope":"s","holder":"b","ttl_ms":30000}"#,
            None,
        )
        .await;
    assert_eq!(r.status, 409, "{}", r.body);
    for bad in [
        r#"{"scope":"s","holder":"b"}"#,
        r#"{"scope":"s","holder":"b","ttl_ms":999999999}"#,
        "not json",
    ] {
        let r = c.post_json_as("/v1/locks/acquire", bad, None).await;
        assert_eq!(r.status, 400, "{}", r.body);
    }
    let call = |ttl: bool, id: &str| {
        let ttl = if ttl { r#","ttl_ms":30000"# } else { "" };
        format!(r#"{{"scope":"s","lease_id":"{id}","token":"{token}"{ttl}}}"#)
    };
    for (path, body, status) in [
        ("/v1/locks/renew", call(true, &id), 200),
        ("/v1/locks/renew", call(true, &id), 200),
        ("/v1/locks/renew", call(true, "0000"), 409),
        ("/v1/locks/release", call(false, "0000"), 409),
        ("/v1/locks/release", call(false, &id), 200),
        ("/v1/locks/release", call(false, &id), 409),
        ("/v1/locks/renew", call(true, &id), 409),
    ] {
        let r = c.post_json_as(path, &body, None).await;
        assert_eq!(r.status, status, "{path} {body}: {}", r.body);
    }
    // A second grant of the scope: the last token is its token.
    let r = c
        .post_json_as(
            "/v1/locks/acquire",
            r#"{"scope":"s","holder":"b","ttl_ms":30000}"#,
            None,
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["token"], "2");

    let m = scrape(&admin).await;
    let acq = |result: &str| {
        metric_value(
            &m,
            &format!("fencegate_authority_acquisitions_total{{result=\"{result}\"}}"),
        )
    };
    assert_eq!(acq("acquired"), 2.0, "{m}");
    assert_eq!(acq("busy"), 1.0);
    assert_eq!(acq("invalid"), 3.0);
    assert_eq!(acq("unavailable"), 0.0);
    assert_eq!(
        metric_value(&m, "fencegate_authority_acquire_seconds_count"),
        6.0
    );
    let renewals = |result: &str| {
        metric_value(
            &m,
            &format!("fencegate_authority_renewals_total{{result=\"{result}\"}}"),
        )
    };
    assert_eq!((renewals("renewed"), renewals("lost")), (2.0, 2.0));
    let releases = |result: &str| {
        metric_value(
            &m,
            &format!("fencegate_authority_releases_total{{result=\"{result}\"}}"),
        )
    };
    assert_eq!((releases("released"), releases("lost")), (1.0, 2.0));
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
            "fencegate_authority_lease_age_seconds_count{end=\"expired\"}"
        ),
        0.0
    );
    assert_eq!(metric_value(&m, "fencegate_authority_expiries_total"), 0.0);
    assert_eq!(
        metric_value(&m, "fencegate_authority_last_token_counter"),
        2.0
    );
    assert_eq!(
        metric_value(&m, "fencegate_authority_last_token_epoch"),
        0.0
    );
    assert_eq!(metric_value(&m, "fencegate_authority_epoch"), 0.0);
    // Bounded labels: neither the scope nor a holder appears.
    assert!(
        !m.lines()
            .any(|l| l.starts_with("fencegate_authority") && l.contains("\"s\"")),
        "{m}"
    );
    running.shutdown().await;
}

/// A lease whose holder stops renewing expires without a release: counted as an expiry,
/// with its age, when the authority sees it (here: the next acquire of the scope, which
/// waits for it).
#[tokio::test]
async fn an_expiry_without_release_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let support::Authority {
        running,
        api: c,
        admin,
    } = start(dir.path(), "").await;
    let r = c
        .post_json_as(
            "/v1/locks/acquire",
            r#"{"scope":"e","holder":"a","ttl_ms":300}"#,
            None,
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // `a` never renews: `b`'s wait ends when the lease expires (the authority's clock).
    let r = c
        .post_json_as(
            "/v1/locks/acquire",
            r#"{"scope":"e","holder":"b","ttl_ms":30000,"wait_ms":20000}"#,
            None,
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let m = scrape(&admin).await;
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
    // Its age is its ttl (it ended at its deadline): 0.3 s, in the 0.5 s bucket.
    assert_eq!(
        metric_value(
            &m,
            "fencegate_authority_lease_age_seconds_bucket{end=\"expired\",le=\"0.1\"}"
        ),
        0.0
    );
    assert_eq!(
        metric_value(
            &m,
            "fencegate_authority_lease_age_seconds_bucket{end=\"expired\",le=\"0.5\"}"
        ),
        1.0
    );
    assert_eq!(
        metric_value(
            &m,
            "fencegate_authority_lease_age_seconds_count{end=\"released\"}"
        ),
        0.0
    );
    // `b` waited for the expiry: its acquire took at least the rest of `a`'s lease.
    assert!(
        metric_value(&m, "fencegate_authority_acquire_seconds_sum") >= 0.2,
        "{m}"
    );
    running.shutdown().await;
}

/// Refusals before any backend: no bearer secret (unauthenticated), a scope outside the
/// client's patterns (forbidden).
#[tokio::test]
async fn refused_acquisitions_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    crate::support::write_secret(dir.path().join("a.token"), "secret-of-a");
    let clients = r#"
[[authority.client]]
name = "a"
token_file = "a.token"
scopes = ["mine/*"]
"#;
    let support::Authority {
        running,
        api: c,
        admin,
    } = start(dir.path(), clients).await;
    let body = r#"{"scope":"mine/x","ttl_ms":1000}"#;
    assert_eq!(
        c.post_json_as("/v1/locks/acquire", body, None).await.status,
        401
    );
    assert_eq!(
        c.post_json_as("/v1/locks/acquire", body, Some("Bearer wrong"))
            .await
            .status,
        401
    );
    let other = r#"{"scope":"theirs/x","ttl_ms":1000}"#;
    let r = c
        .post_json_as("/v1/locks/acquire", other, Some("Bearer secret-of-a"))
        .await;
    assert_eq!(r.status, 403, "{}", r.body);
    let r = c
        .post_json_as("/v1/locks/acquire", body, Some("Bearer secret-of-a"))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let m = scrape(&admin).await;
    let acq = |result: &str| {
        metric_value(
            &m,
            &format!("fencegate_authority_acquisitions_total{{result=\"{result}\"}}"),
        )
    };
    assert_eq!(
        (acq("unauthenticated"), acq("forbidden"), acq("acquired")),
        (2.0, 1.0, 1.0),
        "{m}"
    );
    running.shutdown().await;
}

/// A process without `[authority]` exports none of its series.
#[tokio::test]
async fn no_authority_no_authority_series() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = support::Double::start().await;
    let running = support::start(support::config(upstream.addr, dir.path())).await;
    let m = scrape(&Client::new(running.admin_addr)).await;
    assert!(!m.contains("fencegate_authority"), "{m}");
    running.shutdown().await;
}
