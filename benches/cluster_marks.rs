//! The cluster's marks in etcd against etcd's own transaction rate, on one 3-member etcd
//! on loopback started here (the `etcd` feature and `/usr/bin/etcd`, or `ETCD_BIN`).
//!
//! `cargo bench --features etcd --bench cluster_marks [-- --seconds N --clients C]`
//!
//! Two measurements, each for `--seconds` (default 5) with `--clients` (default 64)
//! concurrent writers, each writing its own scopes:
//! - **etcd alone**: each client sends one transaction per write, guarded as the marks'
//!   are (a compare on an owner key's create revision, one put): what etcd itself does.
//! - **marks**: each client queues an advance on the owner's `MarkWriter` and waits for it;
//!   the writer group-commits what is queued, so advances per second can exceed
//!   transactions per second.
//!
//! Reports both rates and their ratio; no speed is asserted. Under `cargo test` (no
//! `--bench` argument) it does nothing.

use std::time::Duration;

#[path = "cluster/etcd.rs"]
mod etcd;

fn args() -> (Duration, usize) {
    let mut seconds = 5.0;
    let mut clients = 64;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seconds" => {
                seconds = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|s: &f64| (0.1..=600.0).contains(s))
                    .unwrap_or_else(|| panic!("--seconds needs 0.1..=600"));
            }
            "--clients" => {
                clients = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|c| (1..=4096).contains(c))
                    .unwrap_or_else(|| panic!("--clients needs 1..=4096"));
            }
            "--bench" => {}
            other => panic!("unknown argument {other:?}: --seconds N --clients C"),
        }
    }
    (Duration::from_secs_f64(seconds), clients)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo test --all-targets` runs bench targets without `--bench`: nothing to do then.
    if !std::env::args().skip(1).any(|a| a == "--bench") {
        return;
    }
    let (duration, clients) = args();
    let etcd = etcd::Etcd::start();
    let (raw, grouped, per_txn) = etcd::etcd_alone(&etcd.endpoints, duration, clients, "bench")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    println!(
        "etcd alone (one guarded transaction per write, {clients} clients): {raw:.0} writes/s"
    );
    println!(
        "marks through the MarkWriter ({clients} clients): {grouped:.0} advances/s, {per_txn:.1} advances per transaction"
    );
    println!("ratio: {:.2}× etcd's own transaction rate", grouped / raw);
}
