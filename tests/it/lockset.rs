//! The lock-set history check (after Jepsen's etcd lock-set workload) against a real
//! legacy store, nginx WebDAV. Straight to the backend, short leases and pauses past them
//! lose acknowledged updates; through fencegate none are lost and every stale write is
//! refused with 409. `cargo run --release --example lockset` runs the same workload.

use crate::support;

#[path = "../../examples/support/lockset.rs"]
pub(crate) mod workload;

use workload::{Mode, Settings};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockset_loses_acknowledged_updates_without_the_fence_and_none_with_it() {
    let nginx = support::nginx::Nginx::webdav().expect("nginx (run scripts/test.sh)");
    let dir = tempfile::tempdir().unwrap();
    let fencegate = workload::start_fencegate(nginx.addr(), dir.path())
        .await
        .expect("fencegate");
    let authority = fencegate.authority_addr.expect("authority");
    let settings = Settings::default();
    assert!(settings.workers >= 5);

    let direct = workload::run(
        Mode::Direct,
        settings.clone(),
        authority,
        fencegate.proxy_addr,
        nginx.addr(),
    )
    .await
    .expect("direct run");
    println!("direct:  {direct}");
    assert!(
        !direct.lost.is_empty(),
        "the unfenced run must lose acknowledged updates, or the check proves nothing: {direct}"
    );
    assert!(direct.stale_writes > 0);

    let fenced = workload::run(
        Mode::Fenced,
        settings,
        authority,
        fencegate.proxy_addr,
        nginx.addr(),
    )
    .await
    .expect("fenced run");
    println!("fenced:  {fenced}");
    assert!(
        fenced.lost.is_empty(),
        "lost through fencegate: {:?}",
        fenced.lost
    );
    assert!(
        fenced.stale_writes > 0,
        "the fenced run had no stale writes: {fenced}"
    );
    assert_eq!(
        fenced.stale_rejected, fenced.stale_writes,
        "every stale write is refused with 409: {fenced}"
    );
    assert_eq!(fenced.final_size, fenced.acknowledged);
    fencegate.shutdown().await;
}
