//! Commands (SPEC §6). Config is parsed and validated before any runtime starts.

pub mod demo;
pub mod probe;

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};

use crate::settings::Config;
use crate::store::MarkStore;
use crate::store::marks::MarkReader;
use crate::token::Token;

/// The command line. Each command's first doc line is its one-line `--help` summary; the
/// rest shows under `fencegate COMMAND --help`.
#[derive(Parser, Debug)]
#[command(
    name = "fencegate",
    version,
    about = "A proxy that refuses writes carrying a lock's stale fencing token",
    long_about = "A proxy that refuses writes carrying a lock's stale fencing token.\n\n\
        A lock holder that pauses past its lease can still write after another holder took \
        over. fencegate stands in front of a backend that cannot compare tokens (an object \
        store, an HTTP API, a file server): every write carries the token its lock gave, \
        fencegate remembers the highest token each scope accepted, and refuses older ones, \
        atomically with forwarding the write.\n\n\
        Start with `fencegate demo`; then write a config (see config/ and docs/REFERENCE.md), \
        check it with `fencegate check-config --config FILE` and run \
        `fencegate serve --config FILE`."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the proxy (and the admin API, and the lease authority if configured).
    ///
    /// SIGHUP reloads routes, upstreams and certificates; SIGTERM or SIGINT stop taking
    /// new requests, let those in flight finish (up to `server.shutdown_timeout`) and exit.
    Serve {
        /// The config file (TOML).
        #[arg(long)]
        config: PathBuf,
    },
    /// Check a config file and print what it sets up.
    ///
    /// Reads the files it names too (keys, certificates, secrets). Exits 0 when the file
    /// is good (warnings are printed but do not fail), 1 with every error and where it is.
    CheckConfig {
        /// The config file (TOML).
        #[arg(long)]
        config: PathBuf,
    },
    /// Watch a paused writer get fenced, against a built-in legacy store.
    ///
    /// Starts fencegate, a lease authority and a store that cannot compare tokens, all on
    /// loopback, and tells what happens as a writer pauses past its lease.
    Demo,
    /// Read the marks (each scope's highest accepted token).
    ///
    /// Reads the store file when no server holds it, else asks the running server's admin
    /// API.
    Marks {
        #[command(subcommand)]
        command: MarksCommand,
    },
    /// Export every mark, consistently, as JSON lines.
    ///
    /// Works whether or not the server runs; the file is written beside `--out` and renamed
    /// into place once complete.
    Backup {
        /// The config file of the server whose marks to export.
        #[arg(long)]
        config: PathBuf,
        /// Where to write the backup.
        #[arg(long)]
        out: PathBuf,
    },
    /// Lease authority maintenance.
    Authority {
        #[command(subcommand)]
        command: AuthorityCommand,
    },
    /// Mark store maintenance.
    Store {
        #[command(subcommand)]
        command: StoreCommand,
    },
    /// Make an Ed25519 key pair for token proofs.
    ///
    /// Writes `<out>.key` (mode 0600: name it in `[authority] signing_key`, so that every
    /// lease comes with a proof) and `<out>.pub` (name it in `[fencing] proof_keys`, so
    /// that routes with `proof = "required"` accept only tokens the authority signed).
    /// Prints the key id. Never overwrites a file.
    Keygen {
        /// The two files' path without extension.
        #[arg(long)]
        out: PathBuf,
    },
    /// Find out how an S3 store names keys, to choose a route's `keys` setting.
    ///
    /// `--keys http://host:port/bucket` tells whether the store keeps keys such as `a//b`
    /// apart (choose `keys = "opaque"`) or reads them as another key (`keys = "strict"`).
    /// It writes, reads and deletes a few objects under a prefix of its own. Requests are
    /// signed with SigV4, with the keys given or AWS_ACCESS_KEY_ID and
    /// AWS_SECRET_ACCESS_KEY.
    Probe {
        /// The bucket's URL, `http://host:port/bucket`.
        #[arg(long)]
        keys: String,
        /// The access key id (else AWS_ACCESS_KEY_ID).
        #[arg(long)]
        access_key: Option<String>,
        /// The secret access key (else AWS_SECRET_ACCESS_KEY).
        #[arg(long)]
        secret_key: Option<String>,
        /// The region requests are signed for.
        #[arg(long, default_value = "us-east-1")]
        region: String,
    },
    /// Merge a backup into the store, never lowering a mark.
    ///
    /// Each scope keeps the higher of its mark and the backup's, and the epoch floor the
    /// higher of the two. The server must be stopped (it holds the store file).
    Restore {
        /// The config file naming the store.
        #[arg(long)]
        config: PathBuf,
        /// The backup to merge (from `fencegate backup`).
        #[arg(long = "in")]
        input: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
pub enum AuthorityCommand {
    /// Start a new token epoch: every later token compares above every earlier one.
    ///
    /// Use after restoring an old copy of the store, or an etcd cluster from a snapshot:
    /// tokens issued since that copy was made would otherwise be issued again.
    BumpEpoch {
        /// The config file naming the authority.
        #[arg(long)]
        config: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
pub enum StoreCommand {
    /// Recover from a damaged mark journal.
    ///
    /// Applies every record that checks out, raises the epoch floor above every epoch seen
    /// (every earlier token becomes stale; owners re-acquire) and keeps the damaged
    /// journal beside the store. The server must be stopped.
    Recover {
        /// The config file naming the store.
        #[arg(long)]
        config: PathBuf,
        /// Raise the floor to at least this epoch (an external lock service's next epoch).
        #[arg(long, default_value_t = 0)]
        floor: u64,
    },
}

#[derive(Subcommand, Debug)]
pub enum MarksCommand {
    /// List marks in scope order.
    List {
        /// The config file naming the store (or the running server's admin API).
        #[arg(long)]
        config: PathBuf,
        /// Only scopes that start with this.
        #[arg(long, default_value = "")]
        prefix: String,
        /// At most this many marks.
        #[arg(long, default_value_t = 1000)]
        limit: usize,
    },
    /// Show one scope's mark.
    Get {
        /// The scope, as the route's template renders it (e.g. `report/2024-07`).
        scope: String,
        /// The config file naming the store (or the running server's admin API).
        #[arg(long)]
        config: PathBuf,
    },
}

fn load(path: &Path) -> Result<Config, ExitCode> {
    Config::load(path).map_err(|errs| {
        eprintln!("{}: invalid configuration:", path.display());
        for e in errs.0 {
            eprintln!("  {e}");
        }
        ExitCode::from(1)
    })
}

fn runtime() -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            eprintln!("cannot start the runtime: {e}");
            ExitCode::from(1)
        })
}

pub fn run(cli: Cli) -> ExitCode {
    match execute(cli) {
        Ok(code) | Err(code) => code,
    }
}

fn execute(cli: Cli) -> Result<ExitCode, ExitCode> {
    match cli.command {
        Command::CheckConfig { config } => {
            let c = load(&config)?;
            print!("{}", c.describe());
            for w in c.warnings() {
                println!("warning: {w}");
            }
            println!("{}: OK", config.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Serve { config } => {
            let c = load(&config)?;
            let runtime = runtime()?;
            let code = runtime.block_on(serve(config, c));
            // Shutdown has bounded its waits; what it left behind (a blocking task of the
            // lease authority stuck in a write at a hung disk, for one) must not keep the
            // process from exiting, as dropping the runtime would: it waits for them all.
            runtime.shutdown_background();
            code
        }
        Command::Demo => runtime()?.block_on(crate::cli::demo::run()).map_err(|e| {
            eprintln!("demo failed: {e}");
            ExitCode::from(1)
        }),
        Command::Marks { command } => marks(command),
        Command::Backup { config, out } => backup(&load(&config)?, &out),
        Command::Restore { config, input } => restore(&load(&config)?, &input),
        Command::Store {
            command: StoreCommand::Recover { config, floor },
        } => recover(&load(&config)?, floor),
        Command::Probe {
            keys,
            access_key,
            secret_key,
            region,
        } => {
            let access_key = access_key.or_else(|| std::env::var("AWS_ACCESS_KEY_ID").ok());
            let secret_key = secret_key.or_else(|| std::env::var("AWS_SECRET_ACCESS_KEY").ok());
            let creds = match (access_key, secret_key) {
                (Some(access_key), Some(secret_key)) => Some(probe::Credentials {
                    access_key,
                    secret_key,
                    region,
                }),
                (None, None) => None,
                _ => return Err(fail("give both an access key and a secret key, or neither")),
            };
            runtime()?
                .block_on(probe::keys(&keys, creds.as_ref()))
                .map_err(fail)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Keygen { out } => {
            let id = crate::proof::keygen(&out).map_err(fail)?;
            println!("key id {id}: {0}.key (secret), {0}.pub", out.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Authority {
            command: AuthorityCommand::BumpEpoch { config },
        } => {
            let epoch = crate::authority::bump_epoch(&load(&config)?).map_err(fail)?;
            println!("{epoch}");
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn serve(path: PathBuf, config: Config) -> Result<ExitCode, ExitCode> {
    use tokio::signal::unix::{SignalKind, signal};
    for w in config.warnings() {
        tracing::warn!("{w}");
    }
    let running = crate::app::start(config, None).await.map_err(|e| {
        eprintln!("fencegate: {e}");
        ExitCode::from(1)
    })?;
    let (mut term, mut int, mut hup) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) {
        (Ok(t), Ok(i), Ok(h)) => (t, i, h),
        _ => {
            eprintln!("fencegate: cannot install signal handlers");
            running.shutdown().await;
            return Err(ExitCode::from(1));
        }
    };
    let mut lost = false;
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = hup.recv() => crate::app::reload(&running, &path),
            () = cluster_lost(&running) => {
                lost = true;
                break;
            }
        }
    }
    if lost {
        // SPEC §10: an instance whose lease is gone owns nothing and cannot get it back
        // under the same membership; its supervisor starts it again as a new member.
        tracing::error!(
            "the cluster lease is gone: this instance owns no shard; exiting (status 3) to join again"
        );
        running.shutdown().await;
        return Ok(ExitCode::from(3));
    }
    tracing::info!("shutting down: no new connections; finishing in-flight requests");
    running.shutdown().await;
    tracing::info!("stopped");
    Ok(ExitCode::SUCCESS)
}

/// Resolves when the instance's cluster lease is gone; never without `[cluster]`.
async fn cluster_lost(running: &crate::app::Running) {
    #[cfg(feature = "etcd")]
    if let Some(node) = &running.cluster {
        node.lost().await;
        return;
    }
    let _ = running;
    std::future::pending::<()>().await
}

fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("fencegate: {msg}");
    ExitCode::from(1)
}

/// Where the CLI reads marks: the store file when no server holds it, else the running
/// server's admin API (the server keeps the file locked for itself).
enum Source {
    File(MarkReader),
    Server(Box<Config>),
}

fn source(c: Config) -> Result<Source, ExitCode> {
    match MarkReader::open(&c.store.path) {
        Ok(r) => Ok(Source::File(r)),
        Err(crate::store::StoreError::InUse(_)) => Ok(Source::Server(Box::new(c))),
        Err(e) => Err(fail(e)),
    }
}

/// GET on the admin listener of the server named by `config`.
fn admin_get(config: &Config, path_and_query: &str) -> Result<String, ExitCode> {
    let mut text = Vec::new();
    admin_stream(config, path_and_query, |piece| {
        text.extend_from_slice(piece);
        Ok(())
    })?;
    Ok(String::from_utf8_lossy(&text).into_owned())
}

/// GET on the admin listener of the server named by `config`, handing the body to
/// `piece` as it arrives (a backup is not held in memory whole).
fn admin_stream(
    config: &Config,
    path_and_query: &str,
    mut piece: impl FnMut(&[u8]) -> std::io::Result<()>,
) -> Result<(), ExitCode> {
    use http_body_util::BodyExt;
    let mut addr = config.admin.listen;
    if addr.ip().is_unspecified() {
        addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    let url = format!("http://{addr}{path_and_query}");
    let token = config.admin.token.clone();
    runtime()?.block_on(async move {
        let client = hyper_util::client::legacy::Client::builder(
            hyper_util::rt::TokioExecutor::new(),
        )
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
        let mut req = http::Request::get(&url);
        if let Some(t) = token {
            req = req.header(http::header::AUTHORIZATION, format!("Bearer {t}"));
        }
        let req = req.body(http_body_util::Empty::new()).map_err(fail)?;
        let resp = tokio::time::timeout(std::time::Duration::from_secs(30), client.request(req))
            .await
            .map_err(|_| fail(format!("{url}: no answer")))?
            .map_err(|e| fail(format!("the store is held by a running server, and its admin API at {url} did not answer: {e}")))?;
        let status = resp.status();
        let mut body = resp.into_body();
        if !status.is_success() {
            let body = body.collect().await.map_err(fail)?.to_bytes();
            let text = String::from_utf8_lossy(&body);
            return Err(fail(format!("{url}: {status}: {text}")));
        }
        while let Some(frame) = body.frame().await {
            // A body cut off midway is an error here, never a short answer.
            if let Ok(data) = frame.map_err(|e| fail(format!("{url}: {e}")))?.into_data() {
                piece(&data).map_err(fail)?;
            }
        }
        Ok(())
    })
}

fn marks(command: MarksCommand) -> Result<ExitCode, ExitCode> {
    let enc = |s: &str| {
        percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
    };
    match command {
        MarksCommand::List {
            config,
            prefix,
            limit,
        } => {
            // The same in both modes: from the file, and from a running server.
            if limit == 0 {
                return Err(fail("--limit must be at least 1"));
            }
            let list = match source(load(&config)?)? {
                // In pages too: a listing stops short at `LIST_BYTES` of scope names.
                Source::File(reader) => paged(limit, |after, page| {
                    let marks = reader.list(&prefix, after, page).map_err(fail)?;
                    let next = (!crate::store::marks::listed_all(&marks, page))
                        .then(|| marks.last().map(|m| m.0.clone()))
                        .flatten();
                    Ok((marks, next))
                })?,
                Source::Server(c) => paged(limit, |after, page| {
                    let after = after
                        .map(|a| format!("&after={}", enc(a)))
                        .unwrap_or_default();
                    let text = admin_get(
                        &c,
                        &format!("/v1/scopes?prefix={}&limit={page}{after}", enc(&prefix)),
                    )?;
                    let v: serde_json::Value = serde_json::from_str(&text).map_err(fail)?;
                    let marks = v["scopes"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|m| {
                            let scope = m["scope"].as_str()?.to_string();
                            let token = m["highest_accepted"].as_str()?.parse().ok()?;
                            Some((scope, token))
                        })
                        .collect();
                    Ok((marks, v["next_after"].as_str().map(str::to_string)))
                })?,
            };
            for (scope, token) in &list {
                println!("{token}\t{scope}");
            }
            Ok(ExitCode::SUCCESS)
        }
        MarksCommand::Get { scope, config } => {
            let mark: Option<(Token, Option<u64>)> = match source(load(&config)?)? {
                Source::File(reader) => reader
                    .get_mark(&scope)
                    .map_err(fail)?
                    .map(|m| (m.token, m.sequence)),
                Source::Server(c) => {
                    let text = admin_get(&c, &format!("/v1/scopes/{}", enc(&scope)))?;
                    let v: serde_json::Value = serde_json::from_str(&text).map_err(fail)?;
                    v["highest_accepted"]
                        .as_str()
                        .and_then(|t| t.parse().ok())
                        .map(|t| {
                            let seq = v["highest_sequence"].as_str().and_then(|n| n.parse().ok());
                            (t, seq)
                        })
                }
            };
            match mark {
                Some((t, sequence)) => {
                    println!("{t}");
                    // The token's highest `Fencing-Sequence`, on a line of its own.
                    if let Some(n) = sequence {
                        println!("sequence {n}");
                    }
                    Ok(ExitCode::SUCCESS)
                }
                None => {
                    eprintln!("no mark for scope {scope:?}");
                    Ok(ExitCode::from(3))
                }
            }
        }
    }
}

/// The most marks the admin API answers at once (`GET /v1/scopes?limit=`, 1..=10000).
const ADMIN_PAGE: usize = 10_000;

/// Marks in scope order, up to `limit`, from pages of at most [`ADMIN_PAGE`]: `page` is
/// asked for the marks after a scope (None: from the start) and answers them with the
/// scope to continue after (None: there are no more).
fn paged(
    limit: usize,
    mut page: impl FnMut(
        Option<&str>,
        usize,
    ) -> Result<(Vec<(String, Token)>, Option<String>), ExitCode>,
) -> Result<Vec<(String, Token)>, ExitCode> {
    let mut list = Vec::new();
    let mut after = None;
    while list.len() < limit {
        let want = (limit - list.len()).min(ADMIN_PAGE);
        let (marks, next) = page(after.as_deref(), want)?;
        let empty = marks.is_empty();
        list.extend(marks.into_iter().take(want));
        match next {
            Some(next) if !empty => after = Some(next),
            _ => break,
        }
    }
    Ok(list)
}

fn backup(config: &Config, out: &Path) -> Result<ExitCode, ExitCode> {
    let reader = match MarkReader::open(&config.store.path) {
        Ok(r) => r,
        // A running server holds the file: its /v1/backup is one read transaction, a
        // consistent snapshot too.
        Err(crate::store::StoreError::InUse(_)) => {
            let tmp = out.with_extension("partial");
            let file =
                std::fs::File::create(&tmp).map_err(|e| fail(format!("{}: {e}", tmp.display())))?;
            let mut w = std::io::BufWriter::new(file);
            let mut lines = 0usize;
            let mut last = LastLine::default();
            let streamed = admin_stream(config, "/v1/backup", |piece| {
                lines += piece.iter().filter(|b| **b == b'\n').count();
                last.push(piece);
                w.write_all(piece)
            });
            // A body that ended cleanly is whole only if its end line says so: a server
            // that gave up midway must never leave a short backup in place.
            let marks = streamed.and_then(|()| {
                streamed_marks(last.line(), lines).map_err(|e| {
                    fail(format!(
                        "the backup from the running server is incomplete: {e}"
                    ))
                })
            });
            let marks = match marks {
                Ok(marks) => marks,
                Err(code) => {
                    drop(w);
                    let _ = std::fs::remove_file(&tmp);
                    return Err(code);
                }
            };
            let file = w.into_inner().map_err(|e| fail(e.error()))?;
            file.sync_all().map_err(fail)?;
            std::fs::rename(&tmp, out).map_err(fail)?;
            sync_dir_of(out).map_err(fail)?;
            eprintln!(
                "backed up {marks} marks to {} (from the running server)",
                out.display()
            );
            return Ok(ExitCode::SUCCESS);
        }
        Err(e) => return Err(fail(e)),
    };
    // Write beside the target and rename, so a crash never leaves half a backup.
    let tmp = out.with_extension("partial");
    let file = std::fs::File::create(&tmp).map_err(|e| fail(format!("{}: {e}", tmp.display())))?;
    let mut w = std::io::BufWriter::new(file);
    let mut io_err = None;
    let mut count = 0u64;
    // The floor and the marks from one read transaction.
    let snapshot = reader.snapshot().map_err(fail)?;
    let header = crate::admin::backup_header(snapshot.floor().map_err(fail)?);
    w.write_all(header.as_bytes()).map_err(fail)?;
    snapshot
        .for_each(|scope, token| {
            match w.write_all(crate::admin::backup_line(scope, token).as_bytes()) {
                Ok(()) => {
                    count += 1;
                    true
                }
                Err(e) => {
                    io_err = Some(e);
                    false
                }
            }
        })
        .map_err(fail)?;
    if let Some(e) = io_err {
        return Err(fail(e));
    }
    w.write_all(crate::admin::backup_footer(count).as_bytes())
        .map_err(fail)?;
    let file = w.into_inner().map_err(|e| fail(e.error()))?;
    file.sync_all().map_err(fail)?;
    std::fs::rename(&tmp, out).map_err(fail)?;
    sync_dir_of(out).map_err(fail)?;
    eprintln!("backed up {count} marks to {}", out.display());
    Ok(ExitCode::SUCCESS)
}

/// The last complete line of a stream that arrives in pieces, and what follows it.
#[derive(Default)]
struct LastLine {
    line: Vec<u8>,
    rest: Vec<u8>,
}

impl LastLine {
    fn push(&mut self, piece: &[u8]) {
        let Some(end) = piece.iter().rposition(|b| *b == b'\n') else {
            self.rest.extend_from_slice(piece);
            return;
        };
        match piece[..end].iter().rposition(|b| *b == b'\n') {
            Some(start) => self.line = piece[start + 1..end].to_vec(),
            None => {
                self.rest.extend_from_slice(&piece[..end]);
                self.line = std::mem::take(&mut self.rest);
            }
        }
        self.rest = piece[end + 1..].to_vec();
    }

    /// The last line, if the stream ended with a newline.
    fn line(&self) -> Option<&[u8]> {
        self.rest.is_empty().then_some(self.line.as_slice())
    }
}

/// The marks in a streamed backup of `lines` lines whose last line is `last`: the end
/// line must close it and count every line between it and the header.
fn streamed_marks(last: Option<&[u8]>, lines: usize) -> Result<u64, Incomplete> {
    let last = last.ok_or(Incomplete::CutLine)?;
    match serde_json::from_slice::<BackupLine>(last) {
        Ok(BackupLine::End {
            fencegate_backup_end,
        }) if usize::try_from(fencegate_backup_end).ok() == lines.checked_sub(2) => {
            Ok(fencegate_backup_end)
        }
        Ok(BackupLine::End {
            fencegate_backup_end,
        }) => Err(Incomplete::Count {
            counted: fencegate_backup_end,
            lines: lines.saturating_sub(2),
        }),
        _ => Err(Incomplete::NoEnd),
    }
}

/// Why a streamed backup is not whole (its text follows "the backup ... is incomplete").
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
enum Incomplete {
    #[error("it does not end with a whole line")]
    CutLine,
    #[error("its end line counts {counted} marks, but {lines} mark lines came before it")]
    Count { counted: u64, lines: usize },
    #[error("it does not end with its end line")]
    NoEnd,
}

/// A backup line of exactly one kind: a line with the fields of two (a header that also
/// carries a mark) matches none, and is refused rather than read as one and the rest
/// dropped (a mark dropped from a restore is a mark lowered).
#[derive(serde::Deserialize)]
#[serde(untagged, deny_unknown_fields)]
enum BackupLine {
    Header {
        fencegate_backup: u64,
        epoch_floor: u64,
    },
    End {
        fencegate_backup_end: u64,
    },
    Mark {
        scope: String,
        token: Token,
    },
}

/// The longest line a backup may hold: a mark line's scope comes from a request head
/// (64 KiB by default, `server.max_header_bytes`), escaped into JSON.
const MAX_BACKUP_LINE: u64 = 1 << 20;

/// After a rename into place: the directory entry is made durable too, so a backup
/// reported done survives a power loss.
fn sync_dir_of(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)?.sync_all()
}

/// The epoch floor and the marks of a backup, read whole before anything is restored.
/// Every format begins with its one header line. Format 2 is checked: the end line last,
/// counting the marks.
/// Format 1 has no end line, so a cut-short one cannot be told from a whole one.
fn read_backup(mut input: impl BufRead, name: &str) -> Result<(u64, Vec<(String, Token)>), String> {
    let mut entries = Vec::new();
    let mut floor = 0;
    let mut format = None;
    let mut end = None;
    let mut buf = Vec::new();
    for n in 0.. {
        buf.clear();
        // One line at a time, each bounded: a file without line breaks (or a hostile
        // scope of hundreds of MB) fails here instead of filling memory.
        let read = std::io::Read::take(&mut input, MAX_BACKUP_LINE + 1)
            .read_until(b'\n', &mut buf)
            .map_err(|e| format!("{name}: {e}"))?;
        if read == 0 {
            break;
        }
        let at = format!("{name}:{}", n + 1);
        if buf.len() as u64 > MAX_BACKUP_LINE {
            return Err(format!(
                "{at}: a line longer than {MAX_BACKUP_LINE} bytes (no backup line is)"
            ));
        }
        let line = std::str::from_utf8(&buf).map_err(|_| format!("{at}: the line is not UTF-8"))?;
        if line.trim().is_empty() {
            continue;
        }
        if end.is_some() {
            return Err(format!(
                "the backup is incomplete: {at}: a line follows the end line"
            ));
        }
        let parsed = serde_json::from_str::<BackupLine>(line);
        if format.is_none() && !matches!(parsed, Ok(BackupLine::Header { .. })) {
            return Err(format!(
                "{at}: the backup does not begin with its header line (not a fencegate backup)"
            ));
        }
        match parsed {
            Ok(BackupLine::Header { .. }) if format.is_some() => {
                return Err(format!("{at}: a second header line"));
            }
            Ok(BackupLine::Header {
                fencegate_backup: version @ (1 | 2),
                epoch_floor,
            }) => {
                format = Some(version);
                floor = epoch_floor;
            }
            Ok(BackupLine::Header {
                fencegate_backup, ..
            }) => {
                return Err(format!("backup format {fencegate_backup} is not supported"));
            }
            Ok(BackupLine::End {
                fencegate_backup_end,
            }) if format == Some(2) => end = Some(fencegate_backup_end),
            Ok(BackupLine::End { .. }) => {
                return Err(format!(
                    "{at}: an end line, but the header does not say format 2"
                ));
            }
            // A scope no request could have produced (empty, or with a control character:
            // a path segment with one is refused) is damage, not a mark; it would also
            // forge lines in `marks list`.
            Ok(BackupLine::Mark { scope, .. })
                if scope.is_empty() || scope.chars().any(char::is_control) =>
            {
                return Err(format!(
                    "{at}: the scope {scope:?} is empty or has a control character: no request has such a scope"
                ));
            }
            Ok(BackupLine::Mark { scope, token }) => entries.push((scope, token)),
            Err(e) => return Err(format!("{at}: {e}")),
        }
    }
    if format.is_none() {
        return Err(format!("{name} is empty: not a fencegate backup"));
    }
    if format == Some(2) {
        match end {
            None => {
                return Err(format!(
                    "the backup is incomplete: {name} has no end line (it was cut short)"
                ));
            }
            Some(n) if n != entries.len() as u64 => {
                return Err(format!(
                    "the backup is incomplete: its end line counts {n} marks, but {name} holds {}",
                    entries.len()
                ));
            }
            Some(_) => {}
        }
    }
    Ok((floor, entries))
}

/// `fencegate store recover`: see [`crate::store::marks::recover_store`]. With the local
/// lease authority (whose counters live in the same file), its epoch is bumped first, so
/// that its new tokens are above every token it issued before and pass the new floor.
fn recover(config: &Config, at_least: u64) -> Result<ExitCode, ExitCode> {
    let path = &config.store.path;
    let local = matches!(
        config.authority.as_ref().map(|a| &a.backend),
        Some(crate::authority::Backend::Local)
    );
    let stopped = |e: String| fail(format!("{e} (recover needs the server stopped)"));
    let mut floor = at_least;
    if local {
        floor = floor
            .max(crate::authority::local::bump_epoch(path).map_err(|e| stopped(e.to_string()))?);
    }
    let done =
        crate::store::marks::recover_store(path, floor).map_err(|e| stopped(e.to_string()))?;
    if local && done.floor > floor {
        // Marks of a higher epoch than the authority ever issued (tokens from elsewhere):
        // its new tokens must still pass the floor.
        crate::authority::local::bump_epoch_at_least(path, done.floor)
            .map_err(|e| stopped(e.to_string()))?;
    }
    if done.repaired {
        eprintln!("redb's integrity check repaired {}", path.display());
    }
    match &done.journal_kept {
        Some(kept) => eprintln!(
            "applied {} journal records that check out ({} scopes); the damaged journal is kept as {}",
            done.records,
            done.scopes,
            kept.display()
        ),
        None => eprintln!("no journal found beside {}", path.display()),
    }
    eprintln!(
        "epoch floor raised to {}: every token of a lower epoch is refused as stale, in every scope; owners re-acquire",
        done.floor
    );
    if !local {
        eprintln!(
            "the lock service must now issue tokens of epoch {} or above (`fencegate authority bump-epoch` for the etcd backend, then check the epoch it prints)",
            done.floor
        );
    }
    println!("{}", done.floor);
    Ok(ExitCode::SUCCESS)
}

fn restore(config: &Config, input: &Path) -> Result<ExitCode, ExitCode> {
    let file = std::fs::File::open(input).map_err(|e| fail(format!("{}: {e}", input.display())))?;
    let (floor, entries) = read_backup(std::io::BufReader::new(file), &input.display().to_string())
        .map_err(|e| fail(format!("{e}; nothing was restored")))?;
    let store = MarkStore::open(&config.store.path).map_err(|e| {
        fail(format!("{e} (restore needs the server stopped; to raise marks online use POST /v1/scopes/{{scope}}/raise)"))
    })?;
    let count = entries.len();
    runtime()?.block_on(async move {
        store.raise_floor(floor).await.map_err(fail)?;
        // Chunks keep the writer's batches bounded; each chunk is one durable commit.
        for chunk in entries.chunks(4096) {
            let waits: Vec<_> = chunk
                .iter()
                .map(|(s, t)| {
                    let (store, scope, token) = (store.clone(), Arc::from(s.as_str()), *t);
                    tokio::spawn(async move { store.advance(scope, token).await })
                })
                .collect();
            for w in waits {
                w.await.map_err(fail)?.map_err(fail)?;
            }
        }
        store.close().await;
        Ok::<_, ExitCode>(())
    })?;
    eprintln!(
        "merged {count} marks (by max; none lowered) into {}",
        config.store.path.display()
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A running server answers at most 10,000 marks at once: a larger `--limit` is
    /// fetched in pages, so it lists as many as the store file would.
    #[test]
    fn limits_above_a_page_are_fetched_in_pages() {
        let store: Vec<(String, Token)> = (0..25_000u64)
            .map(|i| (format!("s/{i:06}"), Token::new(0, i + 1)))
            .collect();
        let mut asked = Vec::new();
        let mut server = |after: Option<&str>, limit: usize| {
            assert!((1..=ADMIN_PAGE).contains(&limit), "limit={limit}");
            asked.push(limit);
            let from = after.map_or(0, |a| store.partition_point(|(s, _)| s.as_str() <= a));
            let marks: Vec<_> = store[from..].iter().take(limit).cloned().collect();
            let next = (marks.len() == limit)
                .then(|| marks.last().map(|m| m.0.clone()))
                .flatten();
            Ok((marks, next))
        };
        let list = paged(12_345, &mut server).unwrap();
        assert_eq!(list.len(), 12_345);
        assert_eq!(list[..], store[..12_345]);
        let list = paged(50_000, &mut server).unwrap();
        assert_eq!(list, store);
        let list = paged(7, &mut server).unwrap();
        assert_eq!(list[..], store[..7]);
        assert_eq!(
            asked,
            [10_000, 2_345, 10_000, 10_000, 10_000, 7],
            "pages asked for"
        );
    }

    /// The last line is found however the stream is cut into pieces, and a stream that
    /// stops inside a line has none.
    #[test]
    fn the_last_line_is_found_across_pieces() {
        let text = b"{\"fencegate_backup\":2,\"epoch_floor\":0}\n{\"scope\":\"a\",\"token\":\"1\"}\n{\"fencegate_backup_end\":1}\n";
        for a in 0..=text.len() {
            for b in a..=text.len() {
                let mut last = LastLine::default();
                for piece in [&text[..a], &text[a..b], &text[b..]] {
                    last.push(piece);
                }
                assert_eq!(
                    last.line(),
                    Some(&b"{\"fencegate_backup_end\":1}"[..]),
                    "cut at {a} and {b}"
                );
                assert_eq!(streamed_marks(last.line(), 3), Ok(1));
            }
        }
        let mut last = LastLine::default();
        last.push(&text[..text.len() - 1]);
        assert_eq!(last.line(), None);
    }

    /// A streamed backup is whole only if it ends with an end line counting its marks.
    #[test]
    fn a_streamed_backup_without_its_end_line_is_incomplete() {
        let end = b"{\"fencegate_backup_end\":2}".as_slice();
        assert_eq!(streamed_marks(Some(end), 4), Ok(2));
        assert!(streamed_marks(Some(end), 3).is_err(), "a wrong count");
        assert!(streamed_marks(None, 4).is_err(), "cut inside a line");
        let mark = b"{\"scope\":\"a\",\"token\":\"1\"}".as_slice();
        assert!(streamed_marks(Some(mark), 4).is_err(), "cut after a mark");
        let header = b"{\"fencegate_backup\":2,\"epoch_floor\":0}".as_slice();
        assert!(streamed_marks(Some(header), 1).is_err(), "only a header");
    }

    /// `restore` takes no garbage: a line of two kinds (a header that also carries a mark)
    /// and a scope no request could produce are refused, naming the line; a whole backup
    /// reads as written.
    #[test]
    fn a_backup_line_of_two_kinds_or_an_impossible_scope_is_refused() {
        let read = |text: &str| super::read_backup(text.as_bytes(), "b.jsonl");
        let whole = "{\"fencegate_backup\":2,\"epoch_floor\":3}\n{\"scope\":\"s/h\",\"token\":\"7\"}\n{\"fencegate_backup_end\":1}\n";
        let (floor, marks) = read(whole).expect("a whole backup");
        assert_eq!(floor, 3);
        assert_eq!(marks, vec![("s/h".to_string(), Token::new(0, 7))]);
        for (what, text) in [
            (
                "a header with a mark",
                "{\"fencegate_backup\":2,\"epoch_floor\":0,\"scope\":\"s/h\",\"token\":\"7\"}\n{\"fencegate_backup_end\":0}\n",
            ),
            (
                "a mark with an extra field",
                "{\"fencegate_backup\":2,\"epoch_floor\":0}\n{\"scope\":\"s\",\"token\":\"7\",\"x\":1}\n{\"fencegate_backup_end\":1}\n",
            ),
            (
                "a NUL in a scope",
                "{\"fencegate_backup\":2,\"epoch_floor\":0}\n{\"scope\":\"a\\u0000b\",\"token\":\"7\"}\n{\"fencegate_backup_end\":1}\n",
            ),
            (
                "a newline in a scope",
                "{\"fencegate_backup\":2,\"epoch_floor\":0}\n{\"scope\":\"a\\nb\",\"token\":\"7\"}\n{\"fencegate_backup_end\":1}\n",
            ),
            (
                "an empty scope",
                "{\"fencegate_backup\":2,\"epoch_floor\":0}\n{\"scope\":\"\",\"token\":\"7\"}\n{\"fencegate_backup_end\":1}\n",
            ),
        ] {
            let err = read(text).expect_err(what);
            assert!(err.contains("b.jsonl:"), "{what}: {err}");
        }
    }
}
