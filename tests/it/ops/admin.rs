//! The admin listener (SPEC §7): probes, metrics, the marks API, raise and floor, and the
//! bearer token.

use crate::support;

use support::{Client, Double};

#[tokio::test]
async fn marks_api_lists_gets_raises_and_never_lowers() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start(support::config(double.addr, dir.path())).await;
    let client = Client::new(proxy.proxy_addr);
    let admin = Client::new(proxy.admin_addr);
    for (r, t) in [("a", "3"), ("b", "4"), ("c", "1:2")] {
        assert_eq!(
            client.put(&format!("/reports/{r}/x"), t, "").await.status,
            200
        );
    }
    assert_eq!(client.put("/strict/zz", "1", "").await.status, 200);

    let list = admin.get("/v1/scopes?prefix=report%2F&limit=2").await;
    assert_eq!(list.status, 200);
    let v = list.json();
    assert_eq!(v["scopes"][0]["scope"], "report/a");
    assert_eq!(v["scopes"][1]["highest_accepted"], "4");
    assert_eq!(v["scopes"].as_array().unwrap().len(), 2);
    assert_eq!(v["next_after"], "report/b");
    let rest = admin
        .get("/v1/scopes?prefix=report%2F&after=report%2Fb")
        .await
        .json();
    assert_eq!(rest["scopes"][0]["scope"], "report/c");
    assert_eq!(rest["scopes"].as_array().unwrap().len(), 1);
    assert_eq!(admin.get("/v1/scopes?limit=0").await.status, 400);

    let one = admin.get("/v1/scopes/report%2Fc").await.json();
    assert_eq!(one["highest_accepted"], "1:2");
    let none = admin.get("/v1/scopes/report%2Fnever").await.json();
    assert!(none["highest_accepted"].is_null());

    // Raise fences out the current owner at once; a lower raise changes nothing.
    let r = admin
        .send(
            "POST",
            "/v1/scopes/report%2Fa/raise",
            &[],
            r#"{"token":"10"}"#,
        )
        .await;
    assert_eq!(
        (r.status, r.json()["highest_accepted"].clone()),
        (200, "10".into())
    );
    let r = admin
        .send(
            "POST",
            "/v1/scopes/report%2Fa/raise",
            &[],
            r#"{"token":"2"}"#,
        )
        .await;
    assert_eq!(r.json()["highest_accepted"], "10");
    assert_eq!(client.put("/reports/a/x", "3", "").await.status, 409);
    assert_eq!(
        admin
            .send(
                "POST",
                "/v1/scopes/report%2Fa/raise",
                &[],
                r#"{"token":"-1"}"#
            )
            .await
            .status,
        400
    );

    // The floor makes every lower epoch stale, everywhere, and never goes down.
    let r = admin.send("PUT", "/v1/floor", &[], r#"{"epoch": 1}"#).await;
    assert_eq!((r.status, r.json()["epoch"].clone()), (200, 1.into()));
    assert_eq!(client.put("/reports/b/x", "5", "").await.status, 409);
    assert_eq!(client.put("/reports/new/x", "99", "").await.status, 409);
    assert_eq!(client.put("/reports/new/x", "1:0", "").await.status, 200);
    let r = admin.send("PUT", "/v1/floor", &[], r#"{"epoch": 0}"#).await;
    assert_eq!(r.json()["epoch"], 1);
    assert_eq!(
        admin.send("PUT", "/v1/floor", &[], "{oops").await.status,
        400
    );

    let backup = admin.get("/v1/backup").await;
    assert_eq!(backup.status, 200);
    assert_eq!(backup.body.lines().count(), 1 + 5 + 1, "{}", backup.body);
    assert!(
        backup
            .body
            .starts_with("{\"fencegate_backup\":2,\"epoch_floor\":1}\n"),
        "{}",
        backup.body
    );
    assert!(
        backup.body.ends_with("\n{\"fencegate_backup_end\":5}\n"),
        "{}",
        backup.body
    );
    proxy.shutdown().await;
}

/// A backup larger than one piece of the stream (64 KiB) arrives whole and in order, its
/// end line last.
#[tokio::test]
async fn a_large_backup_streams_whole() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start(support::config(double.addr, dir.path())).await;
    let store = proxy.app.store.clone();
    let advances: Vec<_> = (0..3_000u64)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let scope: std::sync::Arc<str> = format!("bulk/{i:05}").into();
                store
                    .advance(scope, fencegate::token::Token::new(0, i + 1))
                    .await
            })
        })
        .collect();
    for a in advances {
        a.await.expect("task").expect("advance");
    }
    let admin = Client::new(proxy.admin_addr);
    let backup = admin.get("/v1/backup").await;
    assert_eq!(backup.status, 200);
    assert!(backup.body.len() > 64 * 1024, "{} bytes", backup.body.len());
    let lines: Vec<&str> = backup.body.lines().collect();
    assert_eq!(lines.len(), 1 + 3_000 + 1);
    assert_eq!(lines[3_001], r#"{"fencegate_backup_end":3000}"#);
    for (i, line) in lines[1..3_001].iter().enumerate() {
        let want = format!(r#"{{"scope":"bulk/{i:05}","token":"{}"}}"#, i + 1);
        assert_eq!(*line, want);
    }
    proxy.shutdown().await;
}

/// A backup's epoch floor and marks come from one moment: a floor raised and a mark
/// advanced while the backup is being read show in neither (a floor newer than the marks
/// would make a restore stale marks the backup holds; an older one, miss a raise).
#[tokio::test]
async fn a_backup_snapshot_holds_the_floor_and_the_marks_of_one_moment() {
    use fencegate::store::MarkStore;
    use fencegate::token::Token;
    use std::sync::Arc;

    let store =
        MarkStore::open_with_backend(redb::backends::InMemoryBackend::new()).expect("store");
    store
        .advance(Arc::from("a"), Token::new(0, 5))
        .await
        .expect("advance");
    let snapshot = store.snapshot().expect("snapshot");
    // Committed after the snapshot began, before it is read.
    assert_eq!(store.raise_floor(1).await.expect("floor"), 1);
    store
        .advance(Arc::from("b"), Token::new(1, 1))
        .await
        .expect("advance");
    let read = |snapshot: fencegate::store::Snapshot| {
        let mut marks = Vec::new();
        snapshot
            .for_each(|scope, token| {
                marks.push(format!("{scope}={token}"));
                true
            })
            .expect("marks");
        (snapshot.floor().expect("floor"), marks)
    };
    assert_eq!(read(snapshot), (0, vec!["a=5".to_string()]));
    let now = store.snapshot().expect("snapshot");
    assert_eq!(read(now), (1, vec!["a=5".to_string(), "b=1:1".to_string()]));
}

#[tokio::test]
async fn metrics_use_bounded_labels() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start(support::config(double.addr, dir.path())).await;
    let client = Client::new(proxy.proxy_addr);
    let admin = Client::new(proxy.admin_addr);
    assert_eq!(
        client.put("/reports/secret-scope/x", "2", "").await.status,
        200
    );
    assert_eq!(
        client.put("/reports/secret-scope/x", "1", "").await.status,
        409
    );
    assert_eq!(client.get("/nowhere").await.status, 404);
    assert_eq!(client.get("/public/p").await.status, 200);
    let m = admin.get("/metrics").await;
    assert_eq!(m.status, 200);
    let text = m.body;
    for line in [
        r#"fencegate_requests_total{route="reports",result="accepted"} 1"#,
        r#"fencegate_requests_total{route="reports",result="stale_fence"} 1"#,
        r#"fencegate_requests_total{route="none",result="no_route"} 1"#,
        r#"fencegate_requests_total{route="public",result="unfenced"} 1"#,
        "fencegate_stale_rejections_total 1",
        "fencegate_mark_commit_batch_size_count 1",
        "fencegate_mark_commit_seconds_count 1",
    ] {
        assert!(text.contains(line), "missing {line} in\n{text}");
    }
    assert!(
        !text.contains("secret-scope"),
        "scopes must never be labels"
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn bearer_token_guards_all_but_probes() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    crate::support::write_secret(dir.path().join("admin.token"), "s3cret\n");
    let text = support::config_text(double.addr, "10s", "0s", "10s")
        .replace("[admin]\n", "[admin]\ntoken_file = \"admin.token\"\n");
    let config = fencegate::settings::Config::parse(&text, dir.path()).unwrap();
    let proxy = support::start(config).await;
    let admin = Client::new(proxy.admin_addr);
    assert_eq!(admin.get("/healthz").await.status, 200);
    assert_eq!(admin.get("/readyz").await.status, 200);
    let denied = admin.get("/metrics").await;
    assert_eq!(denied.status, 401);
    assert_eq!(denied.headers["www-authenticate"], "Bearer");
    let wrong = admin
        .send(
            "GET",
            "/v1/scopes",
            &[("authorization", "Bearer s3creX")],
            "",
        )
        .await;
    assert_eq!(wrong.status, 401);
    let ok = admin
        .send(
            "GET",
            "/v1/scopes",
            &[("authorization", "Bearer s3cret")],
            "",
        )
        .await;
    assert_eq!(ok.status, 200);
    let raise = admin
        .send("POST", "/v1/scopes/x/raise", &[], r#"{"token":"5"}"#)
        .await;
    assert_eq!(raise.status, 401);
    proxy.shutdown().await;
}

/// RFC 9110 §11.1: the auth scheme is case-insensitive and one or more spaces may
/// separate it from the token.
#[tokio::test]
async fn the_bearer_scheme_is_case_insensitive() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    crate::support::write_secret(dir.path().join("admin.token"), "s3cret\n");
    let text = support::config_text(double.addr, "10s", "0s", "10s")
        .replace("[admin]\n", "[admin]\ntoken_file = \"admin.token\"\n");
    let config = fencegate::settings::Config::parse(&text, dir.path()).unwrap();
    let proxy = support::start(config).await;
    let admin = Client::new(proxy.admin_addr);
    let status = |value: &'static str| {
        let admin = admin.clone();
        async move {
            admin
                .send("GET", "/v1/floor", &[("authorization", value)], "")
                .await
                .status
        }
    };
    for ok in ["bearer s3cret", "BEARER s3cret", "BeArEr   s3cret"] {
        assert_eq!(status(ok).await, 200, "{ok}");
    }
    for denied in [
        "Bearers3cret",
        "Bearer s3cre",
        "Basic s3cret",
        "Bearer",
        "s3cret",
    ] {
        assert_eq!(status(denied).await, 401, "{denied}");
    }
    proxy.shutdown().await;
}

/// Load balancers probe with HEAD as often as with GET: the probes answer it, with the
/// same status and no body, with or without an admin token.
#[tokio::test]
async fn probes_answer_head() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    crate::support::write_secret(dir.path().join("admin.token"), "s3cret\n");
    let plain = support::config_text(double.addr, "10s", "0s", "10s");
    let guarded = plain.replace("[admin]\n", "[admin]\ntoken_file = \"admin.token\"\n");
    for text in [plain, guarded] {
        let config = fencegate::settings::Config::parse(&text, dir.path()).unwrap();
        let proxy = support::start(config).await;
        for path in ["/healthz", "/readyz"] {
            let request = format!("HEAD {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
            let (status, wire) = support::raw(proxy.admin_addr, request.as_bytes()).await;
            assert_eq!(status, 200, "{path}: {wire}");
            let (_, body) = wire.split_once("\r\n\r\n").expect("headers end");
            assert_eq!(body, "", "{path}: HEAD has no body");
        }
        proxy.shutdown().await;
    }
}

/// A web page the operator visits can reach a loopback admin listener: a "simple" POST
/// goes out without a preflight, and a name rebound to 127.0.0.1 lets the page read the
/// answers. Requests with `Origin` (browsers add it) are refused, and without a token a
/// `Host` that is not an address or `localhost`; tools that send neither are served.
#[tokio::test]
async fn requests_from_web_pages_are_refused() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start(support::config(double.addr, dir.path())).await;
    let admin = Client::new(proxy.admin_addr);
    let raise = |headers: &'static [(&'static str, &'static str)]| {
        let admin = admin.clone();
        async move {
            admin
                .send(
                    "POST",
                    "/v1/scopes/report%2Fa/raise",
                    headers,
                    r#"{"token":"18446744073709551615"}"#,
                )
                .await
        }
    };
    let csrf = raise(&[
        ("origin", "http://evil.example"),
        ("content-type", "text/plain"),
    ])
    .await;
    assert_eq!(csrf.status, 403, "{csrf:?}");
    let rebound = admin
        .send("GET", "/v1/scopes", &[("host", "evil.example:9090")], "")
        .await;
    assert_eq!(rebound.status, 403, "{rebound:?}");
    let mark = admin.get("/v1/scopes/report%2Fa").await.json();
    assert!(mark["highest_accepted"].is_null(), "{mark}");
    for host in ["localhost:9090", "127.0.0.1", "[::1]:9090"] {
        let r = admin.send("GET", "/v1/floor", &[("host", host)], "").await;
        assert_eq!(r.status, 200, "{host}: {r:?}");
    }
    // Probes stay open to anyone.
    let probe = admin
        .send("GET", "/healthz", &[("origin", "http://evil.example")], "")
        .await;
    assert_eq!(probe.status, 200);
    // From a tool, as before.
    assert_eq!(raise(&[]).await.status, 200);
    proxy.shutdown().await;
}

/// Online backups are bounded: each holds a read transaction and a blocking thread for as
/// long as its client reads. Beyond the bound a backup is refused with 503 and
/// `Retry-After`, and a finished backup gives its place back.
#[tokio::test]
async fn concurrent_backups_are_bounded() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::start(support::config(double.addr, dir.path())).await;
    let admin = Client::new(proxy.admin_addr);
    let max = fencegate::admin::MAX_BACKUPS;
    // As if `max` backups were running.
    let running = proxy
        .app
        .backups
        .clone()
        .try_acquire_many_owned(u32::try_from(max).unwrap())
        .expect("every place free at start");
    let refused = admin.get("/v1/backup").await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(
        refused
            .headers
            .get("retry-after")
            .and_then(|v| v.to_str().ok()),
        Some("5")
    );
    drop(running);
    let backup = admin.get("/v1/backup").await;
    assert_eq!(backup.status, 200, "{}", backup.body);
    // The producer lets go of its place once it has sent the end.
    tokio::time::timeout(support::BOUND, async {
        while proxy.app.backups.available_permits() < max {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the finished backup gives its place back");
    proxy.shutdown().await;
}
