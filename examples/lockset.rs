//! The lock-set history check as a command:
//!
//! ```sh
//! cargo run --release --example lockset            # 5 workers, 8 rounds each
//! cargo run --release --example lockset -- 8 20     # 8 workers, 20 rounds each
//! ```
//!
//! Starts nginx (WebDAV) as the legacy store and fencegate (proxy and lease authority)
//! in front of it, runs the workload straight to nginx and then through fencegate, and
//! prints what each run observed. Needs nginx installed (`apt-get install nginx`).

#[path = "support/lockset.rs"]
mod lockset;
// The test suite's nginx harness, of which this uses a part.
#[allow(dead_code)]
#[path = "../tests/it/support/nginx.rs"]
mod nginx;

use std::process::ExitCode;

use lockset::{Mode, Settings};

#[tokio::main]
async fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let mut settings = Settings::default();
    if let Some(w) = args.next().and_then(|a| a.parse().ok()) {
        settings.workers = w;
    }
    if let Some(r) = args.next().and_then(|a| a.parse().ok()) {
        settings.rounds = r;
    }
    match run(settings).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("lockset: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(settings: Settings) -> Result<bool, String> {
    let dav = nginx::Nginx::webdav().map_err(|e| format!("nginx: {e}"))?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let fencegate = lockset::start_fencegate(dav.addr(), dir.path()).await?;
    let authority = fencegate.authority_addr.ok_or("no authority")?;
    println!(
        "lock-set: {} workers x {} rounds, leases of {:?}, workers 0..{} pause past their lease every other round",
        settings.workers, settings.rounds, settings.ttl, settings.pausers
    );
    let direct = lockset::run(
        Mode::Direct,
        settings.clone(),
        authority,
        fencegate.proxy_addr,
        dav.addr(),
    )
    .await?;
    println!("straight to nginx:  {direct}");
    let fenced = lockset::run(
        Mode::Fenced,
        settings,
        authority,
        fencegate.proxy_addr,
        dav.addr(),
    )
    .await?;
    println!("through fencegate:  {fenced}");
    if !direct.lost.is_empty() {
        println!("lost without the fence: {}", direct.lost.join(" "));
    }
    fencegate.shutdown().await;
    let ok = fenced.lost.is_empty() && fenced.stale_rejected == fenced.stale_writes;
    println!(
        "{}",
        if ok {
            "OK: no acknowledged update lost through fencegate; every stale write refused (409)"
        } else {
            "FAILED: fencegate lost acknowledged updates or forwarded a stale write"
        }
    );
    Ok(ok)
}
