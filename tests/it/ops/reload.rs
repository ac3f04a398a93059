//! SIGHUP reloads routes and upstreams atomically; an invalid file is refused and the
//! running config kept.

use crate::support;

use std::time::Duration;

use support::{BOUND, Client, Double, spawn, write_config};

/// Waits (bounded) until the admin metrics show `line`.
async fn until_metric(admin: &Client, line: &str) {
    tokio::time::timeout(BOUND, async {
        loop {
            if admin.get("/metrics").await.body.contains(line) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("metrics never showed {line}"));
}

#[tokio::test]
async fn sighup_applies_new_routes_and_refuses_bad_files() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, p, a) = write_config(dir.path(), double.addr);
    let mut proc = spawn(&config, p, a);
    let client = Client::new(proc.proxy);
    let admin = Client::new(proc.admin);
    assert_eq!(client.put("/extra/x", "1", "").await.status, 404);
    assert_eq!(client.put("/reports/r/x", "5", "").await.status, 200);

    let original = std::fs::read_to_string(&config).unwrap();
    let extended = format!(
        "{original}\n[[route]]\nname = \"extra\"\npath = \"/extra/{{k}}\"\nscope = \"extra/{{k}}\"\nupstream = \"u\"\n"
    );
    std::fs::write(&config, &extended).unwrap();
    support::signal(proc.child.id(), "HUP");
    until_metric(&admin, "fencegate_config_reloads_total 1").await;
    let r = client.put("/extra/x", "1", "").await;
    assert_eq!((r.status, r.result()), (200, "accepted"));
    // Marks are not part of the config: they survive a reload.
    assert_eq!(client.put("/reports/r/x", "4", "").await.status, 409);

    std::fs::write(
        &config,
        format!("{extended}\n[[route]]\nname = \"broken\"\n"),
    )
    .unwrap();
    support::signal(proc.child.id(), "HUP");
    until_metric(&admin, "fencegate_config_reload_failures_total 1").await;
    assert_eq!(
        client.put("/extra/y", "1", "").await.status,
        200,
        "old config kept"
    );
    assert!(
        admin
            .get("/metrics")
            .await
            .body
            .contains("fencegate_config_reloads_total 1")
    );

    // Removing a route takes effect too.
    std::fs::write(&config, &original).unwrap();
    support::signal(proc.child.id(), "HUP");
    until_metric(&admin, "fencegate_config_reloads_total 2").await;
    assert_eq!(client.put("/extra/z", "1", "").await.status, 404);
    proc.child.kill().unwrap();
    proc.child.wait().unwrap();
}
