use std::process::ExitCode;

use clap::Parser;
use fencegate::cli::{Cli, Command};

// Many small allocations per request (headers, URIs, scopes): mimalloc serves them with
// less work and less cross-thread contention than the system allocator.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo prints its own story; server logs would only interleave with it.
    let default = match cli.command {
        Command::Demo => "warn",
        _ => "info",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .with_writer(std::io::stderr)
        .init();
    fencegate::cli::run(cli)
}
