//! One instance's part in the cluster (SPEC §10): it registers, follows the cluster's
//! view, and owns the shards the balance gives it.
//!
//! **The loop.** On every new view (and every `tick`, to retry what failed), the instance
//! computes [`balance::assignment`] over the live instances' names, as every instance
//! does, and then for each shard:
//! - given to it and not owned: it claims the shard; a claim whose previous owner was
//!   lost admits nothing for the takeover wait ([`Claim::wait`]); the shard's marks are
//!   loaded from etcd before anything is decided ([`OwnedShards::take`]);
//! - owned and given to another instance: a planned hand-off. The shard stops admitting,
//!   what it admitted drains (its requests at the gates, and every exchange still reading
//!   its response body from the upstream), then it is released, which lets the next owner
//!   admit at once. A shard not drained by `drain_bound` has what is left cut (an exchange
//!   waiting for its answer gives it up, a response body still streaming is cut short),
//!   and is released without the marker: the next owner waits the full takeover wait;
//! - owned here but the view shows another owner, or no owner at a revision after ours
//!   (an operator deleted the key): the shard is dropped here at once.
//!
//! A shard held under an older lease of the same name (a previous run that was killed)
//! is left until that lease expires: its claim answers `Taken`.
//!
//! **Leaving.** [`Member::leave`] deregisters first, so the others' assignment no longer
//! counts this instance, hands every shard off, then stops.
//!
//! **Losing the lease.** The ownership's validity ends by itself; every shard stops
//! admitting at its deadline without this loop. Once etcd says the lease is gone the loop
//! forgets every shard and stops: the instance must start a new ownership.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{Mutex, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use super::balance;
use super::owned::OwnedShards;
use super::ownership::{Claim, Error, Ownership, Previous};
use super::registry::{self, View, ViewWatch};

/// Whether a shard still has requests of its own at the backend (the gates' answer).
pub type Busy = Arc<dyn Fn(u32) -> bool + Send + Sync>;

/// How one instance takes part.
#[derive(Debug, Clone)]
pub struct MemberConfig {
    pub shards: u32,
    /// This instance's `peer_listen` address, as the others reach it.
    pub peer_addr: String,
    /// A takeover's wait: the longest upstream timeout plus the settle (the ownership's
    /// ttl is added by [`Claim::wait`]).
    pub upstream_timeout: Duration,
    pub settle: Duration,
    /// The longest a hand-off waits for its shard to drain before it cuts what is left
    /// and releases it (without the marker: the next owner waits).
    pub drain_bound: Duration,
    /// Run, and must exit 0, before a lost owner's shards are taken over (argv; the lost
    /// instance's name in `FENCEGATE_FENCED_INSTANCE`), bounded by `fence_timeout`.
    pub fence_command: Option<Vec<String>>,
    pub fence_timeout: Duration,
    /// How often the loop looks again without a new view (to retry what failed).
    pub tick: Duration,
}

/// What the loop has done, for the metrics and `GET /v1/cluster`.
#[derive(Debug)]
pub struct MemberStats {
    /// Shards claimed (each claim that made this instance the owner).
    pub claims: AtomicU64,
    /// Of those, takeovers: the previous owner was lost, so the shard waited.
    pub takeovers: AtomicU64,
    /// Planned hand-offs: shards drained and released to their next owner.
    pub handoffs: AtomicU64,
    /// Hand-offs whose drain reached `drain_bound` with requests still counted or
    /// exchanges in flight: those were cut, and the shard released without the marker.
    pub handoff_drain_timeouts: AtomicU64,
    /// Shards found owned elsewhere while held here.
    pub deposed: AtomicU64,
    /// Runs of `fence_command`, and those that failed (exit not 0, or past the timeout).
    pub fence_runs: AtomicU64,
    pub fence_failures: AtomicU64,
    /// Takeover waits, in seconds.
    pub takeover_wait_seconds: crate::metrics::histogram::Histogram,
}

impl MemberStats {
    fn new() -> MemberStats {
        MemberStats {
            claims: AtomicU64::new(0),
            takeovers: AtomicU64::new(0),
            handoffs: AtomicU64::new(0),
            handoff_drain_timeouts: AtomicU64::new(0),
            deposed: AtomicU64::new(0),
            fence_runs: AtomicU64::new(0),
            fence_failures: AtomicU64::new(0),
            takeover_wait_seconds: crate::metrics::histogram::Histogram::new(
                crate::metrics::histogram::SECONDS,
            ),
        }
    }
}

struct Shared {
    ownership: Arc<Ownership>,
    owned: OwnedShards,
    busy: Busy,
    config: MemberConfig,
    stats: MemberStats,
    /// Shards being handed off right now.
    leaving: Mutex<BTreeSet<u32>>,
    /// Shards claimed from a lost owner whose `fence_command` has not succeeded yet:
    /// claimed, admitting nothing.
    unfenced: std::sync::Mutex<HashMap<u32, String>>,
    /// Shards this instance released (a hand-off), with the released epoch, until the
    /// view stops showing that ownership: a view that still does is late, not an orphan.
    released: std::sync::Mutex<HashMap<u32, u64>>,
    /// Set to stop claiming (the instance is leaving).
    stopping: watch::Sender<bool>,
}

/// One instance's membership: its registration, its view and its loop.
pub struct Member {
    shared: Arc<Shared>,
    view: ViewWatch,
    task: JoinHandle<()>,
}

impl Drop for Member {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Member {
    /// Registers the instance (refused if a live instance has its name), starts following
    /// the view and starts the loop.
    pub async fn start(
        ownership: Arc<Ownership>,
        owned: OwnedShards,
        busy: Busy,
        config: MemberConfig,
    ) -> Result<Member, Error> {
        // A name still registered under another lease may be this instance's previous
        // run, killed a moment ago: its lease expires within one ttl. Past that, the name
        // belongs to a live instance and the start is refused.
        let give_up = Instant::now() + ownership.lease_ttl() + Duration::from_secs(1);
        loop {
            match registry::register(&ownership, &config.peer_addr).await {
                Ok(()) => break,
                Err(Error::Config(why)) if Instant::now() < give_up => {
                    tracing::info!(%why, "waiting for the name's previous registration to expire");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(e),
            }
        }
        let view = ViewWatch::start(&ownership, config.shards).await?;
        let shared = Arc::new(Shared {
            ownership,
            owned,
            busy,
            config,
            stats: MemberStats::new(),
            leaving: Mutex::new(BTreeSet::new()),
            unfenced: std::sync::Mutex::new(HashMap::new()),
            released: std::sync::Mutex::new(HashMap::new()),
            stopping: watch::Sender::new(false),
        });
        let task = tokio::spawn(run(shared.clone(), view.subscribe()));
        Ok(Member { shared, view, task })
    }

    /// The cluster as this instance last saw it.
    pub fn view(&self) -> Arc<View> {
        self.view.current()
    }

    pub fn view_watch(&self) -> &ViewWatch {
        &self.view
    }

    pub fn owned(&self) -> &OwnedShards {
        &self.shared.owned
    }

    pub fn ownership(&self) -> &Arc<Ownership> {
        &self.shared.ownership
    }

    pub fn stats(&self) -> &MemberStats {
        &self.shared.stats
    }

    /// Shards claimed from a lost owner whose `fence_command` has not succeeded yet, with
    /// that owner's name: claimed here, admitting nothing.
    pub fn unfenced(&self) -> BTreeMap<u32, String> {
        unfenced(&self.shared)
            .iter()
            .map(|(s, o)| (*s, o.clone()))
            .collect()
    }

    /// Whether the loop still runs (it stops when the lease is gone).
    pub fn is_running(&self) -> bool {
        !self.task.is_finished()
    }

    /// A planned leave: deregisters, hands every owned shard off (drained, released),
    /// and stops the loop.
    pub async fn leave(&self) -> Result<(), Error> {
        self.shared.stopping.send_replace(true);
        registry::deregister(&self.shared.ownership).await?;
        let mut handoffs = JoinSet::new();
        for o in self.shared.owned.owned() {
            let shared = self.shared.clone();
            handoffs.spawn(async move { hand_off(&shared, o.shard, o.epoch).await });
        }
        let mut result = Ok(());
        while let Some(done) = handoffs.join_next().await {
            if let Ok(Err(e)) = done {
                result = Err(e);
            }
        }
        result
    }
}

async fn run(shared: Arc<Shared>, mut views: watch::Receiver<Arc<View>>) {
    let mut stopping = shared.stopping.subscribe();
    loop {
        if *stopping.borrow() {
            return;
        }
        if shared.ownership.validity().is_lost() {
            for o in shared.owned.owned() {
                shared.owned.forget(o.shard);
            }
            tracing::error!(
                instance = shared.ownership.instance(),
                "the ownership lease is gone: this instance owns nothing"
            );
            return;
        }
        let view = views.borrow_and_update().clone();
        reconcile(&shared, &view).await;
        tokio::select! {
            changed = views.changed() => if changed.is_err() { return },
            _ = stopping.changed() => {}
            _ = tokio::time::sleep(shared.config.tick) => {}
        }
    }
}

/// One pass over the shards against `view` (see the module doc).
async fn reconcile(shared: &Arc<Shared>, view: &View) {
    let me = shared.ownership.instance();
    let names: Vec<&str> = view.instances.keys().map(String::as_str).collect();
    // Not (yet) in the view: this instance's registration has not been seen; the others
    // do not count it either, so it claims nothing.
    if !view.instances.contains_key(me) {
        return;
    }
    let assignment = balance::assignment(&names, shared.config.shards);
    let mut claims = Vec::new();
    for shard in 0..shared.config.shards {
        let given = names.get(assignment[shard as usize]).copied() == Some(me);
        let viewed = view.owners.get(&shard);
        // Released by us at the epoch the view still shows: the view is late.
        let just_released = {
            let mut released = lock(&shared.released);
            match released.get(&shard) {
                Some(e) if viewed.is_some_and(|o| o.epoch == *e) => true,
                Some(_) => {
                    released.remove(&shard);
                    false
                }
                None => false,
            }
        };
        let here = shared.owned.epoch(shard);
        if let Some(epoch) = here {
            // A shard being handed off goes from here to its next owner by itself.
            if shared.leaving.lock().await.contains(&shard) {
                continue;
            }
            let elsewhere = match viewed {
                Some(o) => o.instance != me || o.epoch != epoch,
                // Absent from a view whose shard keys have been seen past our claim:
                // deleted. (Not `view.revision`: an instance's event may be seen before
                // our claim's, see `View::owners_revision`.)
                None => view.owners_revision >= i64::try_from(epoch).unwrap_or(i64::MAX),
            };
            if elsewhere && viewed.is_none_or(|o| o.epoch >= epoch) {
                tracing::warn!(
                    shard,
                    epoch,
                    ?viewed,
                    "shard owned elsewhere now: dropped here"
                );
                shared.owned.forget(shard);
                shared.stats.deposed.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if given {
                // A hand-off whose release failed, the shard given back here since.
                if shared.owned.resume(shard, epoch) {
                    tracing::info!(shard, epoch, "hand-off called off: the shard is ours again");
                }
            } else {
                let shared = shared.clone();
                tokio::spawn(async move {
                    if let Err(e) = hand_off(&shared, shard, epoch).await {
                        tracing::warn!(shard, epoch, error = %e, "hand-off failed; trying again");
                    }
                });
            }
        } else if given && viewed.is_none_or(|o| o.instance == me) {
            claims.push(shard);
        } else if unfenced(shared).contains_key(&shard)
            || (viewed.is_some_and(|o| o.instance == me) && !just_released)
        {
            // Claimed by this instance and not held in memory: claimed from a lost owner
            // and not fenced yet, or its marks not loaded, or dropped on a view that was
            // wrong. Only this instance can finish it, whatever the balance says now: a
            // release would let the next claimant skip the fence or the takeover wait. It
            // is claimed again (with the full wait) and taken; a hand-off follows.
            claims.push(shard);
        }
    }
    // Claims one at a time would take a round trip each: together.
    let mut set = JoinSet::new();
    for shard in claims {
        let shared = shared.clone();
        set.spawn(async move { claim(&shared, shard).await });
    }
    let mut claimed = Vec::new();
    while let Some(done) = set.join_next().await {
        if let Ok(Some(c)) = done {
            claimed.push(c);
        }
    }
    // The fence command, once per lost owner, after every claim of this pass: a run that
    // starts once the owner's lease is gone (it is, or the claims would not have won)
    // fences every shard it held.
    let mut fenced: BTreeMap<String, bool> = BTreeMap::new();
    for c in &claimed {
        if let Some(owner) = &c.fence
            && !fenced.contains_key(owner)
        {
            let ok = fence(shared, owner).await;
            fenced.insert(owner.clone(), ok);
        }
    }
    let mut set = JoinSet::new();
    for c in claimed {
        if let Some(owner) = &c.fence {
            if !fenced.get(owner).copied().unwrap_or(false) {
                // The shard stays claimed (no one else can take it) and admits nothing;
                // the next pass runs the command again.
                unfenced(shared).insert(c.shard, owner.clone());
                continue;
            }
            unfenced(shared).remove(&c.shard);
        }
        let shared = shared.clone();
        set.spawn(async move { take(&shared, c).await });
    }
    while set.join_next().await.is_some() {}
}

fn unfenced(shared: &Shared) -> std::sync::MutexGuard<'_, HashMap<u32, String>> {
    lock(&shared.unfenced)
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A shard claimed by this pass, not yet taken.
struct Claimed {
    shard: u32,
    epoch: u64,
    previous: Previous,
    claimed_at: Instant,
    wait: Duration,
    /// The lost owner to fence first (with `fence_command`).
    fence: Option<String>,
}

async fn claim(shared: &Arc<Shared>, shard: u32) -> Option<Claimed> {
    if *shared.stopping.borrow() {
        return None;
    }
    let claimed_at = Instant::now();
    let claim = match shared.ownership.claim(shard).await {
        Ok(claim) => claim,
        Err(e) => {
            tracing::debug!(shard, error = %e, "claim failed; trying again");
            return None;
        }
    };
    let Claim::Owned {
        epoch,
        ref previous,
        ..
    } = claim
    else {
        return None;
    };
    let c = &shared.config;
    let wait = claim.wait(shared.ownership.lease_ttl(), c.upstream_timeout, c.settle);
    // A retried claim (`Ours`: an earlier answer was lost, or the shard was left unfenced)
    // does not know how the previous ownership ended any more: the full wait.
    let wait = if *previous == Previous::Ours {
        claim_wait_for_retry(shared, c)
    } else {
        wait
    };
    let fence = match previous {
        _ if c.fence_command.is_none() => None,
        Previous::Lost { owner, .. } => Some(owner.clone()),
        Previous::Ours => unfenced(shared).get(&shard).cloned(),
        _ => None,
    };
    Some(Claimed {
        shard,
        epoch,
        previous: previous.clone(),
        claimed_at,
        wait,
        fence,
    })
}

/// Runs `fence_command` for the lost instance `owner` (its name in
/// `FENCEGATE_FENCED_INSTANCE`), bounded by `fence_timeout`; answers whether it exited 0.
async fn fence(shared: &Shared, owner: &str) -> bool {
    let Some(argv) = shared.config.fence_command.as_ref() else {
        return true;
    };
    let Some((program, args)) = argv.split_first() else {
        return false;
    };
    // std's process, polled: tokio's would add its process driver (a look at the
    // orphan queue) to every turn of every runtime, for a command run once per takeover.
    let mut command = std::process::Command::new(program);
    command
        .args(args)
        .env("FENCEGATE_FENCED_INSTANCE", owner)
        .env("FENCEGATE_INSTANCE", shared.ownership.instance())
        .stdin(std::process::Stdio::null());
    let started = Instant::now();
    let outcome = match command.spawn() {
        Ok(mut child) => {
            let until = started + shared.config.fence_timeout;
            loop {
                match child.try_wait() {
                    Ok(Some(status)) if status.success() => break Ok(()),
                    Ok(Some(status)) => break Err(format!("exited with {status}")),
                    Ok(None) if Instant::now() >= until => {
                        let _ = child.kill();
                        let _ = child.wait();
                        break Err(format!(
                            "still running after fence_timeout ({:?}); killed",
                            shared.config.fence_timeout
                        ));
                    }
                    Ok(None) => tokio::time::sleep(Duration::from_millis(10)).await,
                    Err(e) => {
                        let _ = child.kill();
                        let _ = child.wait();
                        break Err(e.to_string());
                    }
                }
            }
        }
        Err(e) => Err(format!("cannot run {program:?}: {e}")),
    };
    shared.stats.fence_runs.fetch_add(1, Ordering::Relaxed);
    match outcome {
        Ok(()) => {
            tracing::info!(
                owner,
                took_ms = started.elapsed().as_millis() as u64,
                "fence_command fenced the lost instance"
            );
            true
        }
        Err(why) => {
            shared.stats.fence_failures.fetch_add(1, Ordering::Relaxed);
            tracing::error!(owner, %why, "fence_command failed: its shards admit nothing until it succeeds (tried again each pass)");
            false
        }
    }
}

async fn take(shared: &Arc<Shared>, c: Claimed) {
    let Claimed {
        shard,
        epoch,
        previous,
        claimed_at,
        wait,
        ..
    } = c;
    match shared.owned.take(shard, epoch, claimed_at + wait).await {
        Ok(marks) => {
            shared.stats.claims.fetch_add(1, Ordering::Relaxed);
            if !wait.is_zero() {
                shared.stats.takeovers.fetch_add(1, Ordering::Relaxed);
                shared.stats.takeover_wait_seconds.observe_duration(wait);
            }
            tracing::info!(
                shard,
                epoch,
                marks,
                ?previous,
                wait_ms = wait.as_millis() as u64,
                "shard claimed"
            );
        }
        Err(e) => {
            // Still ours in etcd: the next pass claims again (answered `Ours`) and loads.
            tracing::warn!(shard, epoch, error = %e, "shard claimed, its marks not loaded; trying again");
        }
    }
}

/// The wait of a claim answered `Ours` (an earlier claim's answer was lost): how the
/// shard's previous ownership ended is not known any more, so the full takeover wait.
fn claim_wait_for_retry(shared: &Shared, c: &MemberConfig) -> Duration {
    super::ownership::takeover_wait(shared.ownership.lease_ttl(), c.upstream_timeout, c.settle)
}

/// How long a hand-off waits, once it has cut its shard's exchanges, for each to let go
/// (a matter of scheduling: the cut drops their upstream side at once).
const CUT_BOUND: Duration = Duration::from_secs(1);

/// A planned hand-off of `shard` (owned at `epoch`): stop admitting, drain (at most
/// `drain_bound`, then cut what is left), release.
async fn hand_off(shared: &Arc<Shared>, shard: u32, epoch: u64) -> Result<(), Error> {
    if !shared.leaving.lock().await.insert(shard) {
        return Ok(());
    }
    let result = async {
        if !shared.owned.drain(shard, epoch) {
            return Ok(());
        }
        // A shard still in its takeover wait may have the lost owner's requests at the
        // backend: a release now would let the next owner admit at once. The wait is over
        // first.
        if let Some(at) = shared.owned.admit_after(shard, epoch) {
            tokio::time::sleep_until(at).await;
        }
        // Drained: nothing counted at the gates (in flight, settling, committing) and
        // no exchange of the shard still at its upstream (one whose response body is
        // still being read from it: a client that stopped reading lets go of the gate's
        // count, not of the backend).
        let until = Instant::now() + shared.config.drain_bound;
        let mut pause = Duration::from_millis(2);
        // A hand-off tried again after its release failed, which had cut: undrained.
        let mut drained = !shared.owned.was_cut(shard, epoch);
        while (shared.busy)(shard) || shared.owned.exchanges(shard, epoch) > 0 {
            if Instant::now() >= until {
                shared
                    .stats
                    .handoff_drain_timeouts
                    .fetch_add(1, Ordering::Relaxed);
                drained = false;
                break;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(50));
        }
        if !drained {
            // What is still in flight is cut here and now, before the release: an
            // exchange waiting for its answer gives it up, a response body still
            // streaming from the upstream is cut (its upstream connection closed).
            tracing::warn!(
                shard,
                epoch,
                in_flight = shared.owned.exchanges(shard, epoch),
                "hand-off not drained (its drain bound reached, or cut before): cutting what is in flight, then releasing with the full takeover wait"
            );
            shared.owned.cut(shard, epoch);
            // Each cut exchange lets go of its stop once its upstream side is dropped.
            let until = Instant::now() + CUT_BOUND;
            while shared.owned.exchanges(shard, epoch) > 0 && Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        // A release that drained leaves the marker that lets the next owner admit at
        // once; one that had to cut does not (the backend may still be working on what
        // was cut): the next owner waits the full takeover wait.
        let released = if drained {
            shared.ownership.release(shard, epoch).await?
        } else {
            shared.ownership.release_undrained(shard, epoch).await?
        };
        if released {
            lock(&shared.released).insert(shard, epoch);
        }
        shared.owned.forget(shard);
        if released {
            shared.stats.handoffs.fetch_add(1, Ordering::Relaxed);
            tracing::info!(shard, epoch, "shard handed off");
        }
        Ok(())
    }
    .await;
    shared.leaving.lock().await.remove(&shard);
    result
}
