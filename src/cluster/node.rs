//! An instance of a cluster as `serve` runs it (SPEC §10): the ownership (its etcd lease),
//! the owned shards the gates decide on, the membership loop, and the proxy's
//! [`Placement`]: which instance decides for a scope, and how a hop reaches it.
//!
//! The placement is computed from each new view of the cluster, once, into a table by
//! shard (one atomic load per request): a shard owned here is `Here` (whether it admits
//! now is the gate's question: a takeover wait or a hand-off refuses `unavailable`); one
//! owned by a live instance is a hop to that instance's registered `peer_listen`; any
//! other is `Unknown` (no owner yet), answered `unavailable` with Retry-After.
//!
//! **Exchanges in flight.** Each exchange admitted here races a stop
//! ([`Placement::stop`]) until its response body has been read from the upstream to its
//! end: the validity's deadline, or the shard's own stop ([`OwnedShards::cut`], set by a
//! hand-off that could not drain, and resolved too when the shard is forgotten here).
//!
//! **A lost lease** ends this instance's part: every shard stops admitting at the
//! validity's deadline by itself, its exchanges in flight are cut then, and [`Node::lost`]
//! resolves once etcd says the lease is gone. `serve` then exits (status 3): a process that lost its lease owns nothing and
//! must join again as a new member, which its supervisor's restart does.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use http::{HeaderValue, Uri};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::config::ClusterConfig;
use super::member::{Busy, Member, MemberConfig};
use super::owned::OwnedShards;
use super::ownership::{Error, Ownership, OwnershipConfig, Validity};
use super::registry::View;
use crate::admin::ClusterView;
use crate::proxy::hop::{Hop, Place, Placement, Stop};

/// The first half of joining: the lease and the owned shards (the gates need the latter
/// before the membership starts).
pub struct Joining {
    ownership: Arc<Ownership>,
    owned: OwnedShards,
    config: ClusterConfig,
}

impl Joining {
    /// Connects to etcd and takes the instance's lease.
    pub async fn connect(config: &ClusterConfig) -> Result<Joining, Error> {
        let ownership = Ownership::start(
            &config.etcd_endpoints,
            OwnershipConfig {
                cluster: config.cluster_name.clone(),
                instance: config.name.clone(),
                ownership_ttl: config.ownership_ttl,
                drift_margin: config.drift_margin,
            },
        )
        .await?;
        // Before anything is claimed: one count for the whole cluster.
        crate::cluster::registry::agree_on_shards(&ownership, config.shards).await?;
        let owned = OwnedShards::new(&ownership, config.shards);
        Ok(Joining {
            ownership: Arc::new(ownership),
            owned,
            config: config.clone(),
        })
    }

    /// The gates' [`crate::fence::MarkSource`].
    pub fn owned(&self) -> &OwnedShards {
        &self.owned
    }

    /// Registers at `peer_addr` (the bound `peer_listen`) and starts the membership.
    /// `upstream_timeout` is the longest of the upstreams', `settle` and `drain_timeout`
    /// the fence's.
    pub async fn join(
        self,
        peer_addr: SocketAddr,
        busy: Busy,
        upstream_timeout: Duration,
        settle: Duration,
        drain_timeout: Duration,
    ) -> Result<Node, Error> {
        let member = Member::start(
            self.ownership.clone(),
            self.owned.clone(),
            busy,
            MemberConfig {
                shards: self.config.shards,
                peer_addr: peer_addr.to_string(),
                upstream_timeout,
                settle,
                // How long a hand-off waits for what the shard admitted (its wait for
                // older generations, its exchange, a settle); a response body still
                // streaming from the upstream may outlast it, and is then cut before the
                // release, which leaves no marker (the next owner waits the full
                // takeover wait).
                drain_bound: drain_timeout
                    .saturating_add(upstream_timeout)
                    .saturating_add(settle)
                    .saturating_add(Duration::from_secs(1)),
                tick: (self.config.ownership_ttl / 4).max(Duration::from_millis(100)),
                fence_command: self.config.fence_command.clone(),
                fence_timeout: self.config.fence_timeout,
            },
        )
        .await?;
        let key = HeaderValue::from_str(&self.config.peer_key.0)
            .map_err(|e| Error::Config(format!("peer key: {e}")))?;
        let table = Arc::new(ArcSwap::from_pointee(Table::default()));
        let mut views = member.view_watch().subscribe();
        let (me, shards) = (self.config.name.clone(), self.config.shards);
        let first = member.view();
        table.store(Arc::new(Table::of(&first, &me, shards, &key)));
        let updates = {
            let table = table.clone();
            tokio::spawn(async move {
                while views.changed().await.is_ok() {
                    let view = views.borrow_and_update().clone();
                    table.store(Arc::new(Table::of(&view, &me, shards, &key)));
                }
            })
        };
        Ok(Node {
            placement: Arc::new(NodePlacement {
                owned: self.owned,
                validity: self.ownership.validity(),
                table,
                cuts: Arc::default(),
            }),
            member: Arc::new(member),
            config: self.config,
            updates,
        })
    }
}

/// A joined instance.
pub struct Node {
    placement: Arc<NodePlacement>,
    member: Arc<Member>,
    config: ClusterConfig,
    updates: JoinHandle<()>,
}

impl Drop for Node {
    fn drop(&mut self) {
        self.updates.abort();
    }
}

impl Node {
    pub fn placement(&self) -> Arc<dyn Placement> {
        self.placement.clone()
    }

    pub fn member(&self) -> &Member {
        &self.member
    }

    /// What the admin API shows of the cluster.
    pub fn view(&self) -> Arc<dyn ClusterView> {
        Arc::new(NodeView {
            member: self.member.clone(),
            cuts: self.placement.cuts.clone(),
            cluster: self.config.cluster_name.clone(),
            shards: self.config.shards,
        })
    }

    /// Resolves when etcd has said the lease is gone (see the module doc). A deadline
    /// that passed while etcd could not be reached is not a loss: the shards stop
    /// admitting, and start again if the lease is renewed in time.
    pub async fn lost(&self) {
        while !self.placement.validity.is_lost() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// A planned leave: deregisters and hands every shard off (see [`Member::leave`]).
    pub async fn leave(&mut self) -> Result<(), Error> {
        self.member.leave().await
    }
}

/// Where each shard is decided, as of one view.
#[derive(Default)]
struct Table {
    by_shard: Vec<Place>,
}

impl Table {
    fn of(view: &View, me: &str, shards: u32, key: &HeaderValue) -> Table {
        let mut hops: HashMap<&str, Option<Arc<Hop>>> = HashMap::new();
        let by_shard = (0..shards)
            .map(|shard| {
                let Some(owner) = view.owners.get(&shard) else {
                    return Place::Unknown;
                };
                // Ours in etcd but not in memory (being claimed or released): no hop.
                if owner.instance == me {
                    return Place::Unknown;
                }
                let hop = hops.entry(owner.instance.as_str()).or_insert_with(|| {
                    let addr = view.instances.get(&owner.instance)?;
                    let url: Uri = format!("http://{addr}").parse().ok()?;
                    Some(Arc::new(Hop {
                        owner: owner.instance.clone(),
                        url,
                        key: key.clone(),
                    }))
                });
                match hop {
                    Some(hop) => Place::Owner(hop.clone()),
                    None => Place::Unknown,
                }
            })
            .collect();
        Table { by_shard }
    }
}

struct NodePlacement {
    owned: OwnedShards,
    validity: Validity,
    table: Arc<ArcSwap<Table>>,
    cuts: Arc<Cuts>,
}

impl Placement for NodePlacement {
    fn place(&self, scope: &str) -> Place {
        let shard = self.owned.shard_of(scope);
        if self.owned.epoch(shard).is_some() {
            return Place::Here;
        }
        self.table
            .load()
            .by_shard
            .get(shard as usize)
            .cloned()
            .unwrap_or(Place::Unknown)
    }

    fn stop(&self, scope: &str) -> Option<Stop> {
        let validity = self.validity.clone();
        let cut = self.owned.exchange_stop(self.owned.shard_of(scope));
        let cuts = self.cuts.clone();
        Some(Box::pin(async move {
            // Not owned here any more (forgotten between the admission and now): at once.
            let Some(mut cut) = cut else {
                cuts.handoff.fetch_add(1, Ordering::Relaxed);
                return;
            };
            let deadline = async {
                loop {
                    let Some(deadline) = validity.deadline() else {
                        return;
                    };
                    if Instant::now() >= deadline {
                        return;
                    }
                    tokio::time::sleep_until(deadline).await;
                }
            };
            tokio::select! {
                () = deadline => cuts.ownership.fetch_add(1, Ordering::Relaxed),
                // Set by a hand-off that could not drain, or the ownership forgotten here
                // (the sender dropped): released, deposed, or the lease gone.
                _ = cut.wait_for(|c| *c) => cuts.handoff.fetch_add(1, Ordering::Relaxed),
            };
        }))
    }
}

/// Exchanges given up by their stop (SPEC §10), by what ended them: the ownership's
/// self-fencing deadline, or the shard's hand-off (or loss) here.
#[derive(Default)]
struct Cuts {
    ownership: AtomicU64,
    handoff: AtomicU64,
}

/// The admin API's view (`GET /v1/cluster`, the cluster's metrics).
struct NodeView {
    member: Arc<Member>,
    cuts: Arc<Cuts>,
    cluster: String,
    shards: u32,
}

impl ClusterView for NodeView {
    fn status(&self) -> serde_json::Value {
        use std::sync::atomic::Ordering::Relaxed;
        let view = self.member.view();
        let now = Instant::now();
        let validity = self.member.ownership().validity();
        let owned: Vec<_> = self
            .member
            .owned()
            .owned()
            .into_iter()
            .map(|o| {
                serde_json::json!({
                    "shard": o.shard,
                    "epoch": o.epoch,
                    "state": match o.state {
                        super::owned::State::Admitting if o.admit_after > now => "takeover_wait",
                        super::owned::State::Admitting => "admitting",
                        super::owned::State::Draining => "draining",
                        super::owned::State::Reloading => "reloading",
                    },
                    "takeover_wait_remaining_ms": o.admit_after.saturating_duration_since(now).as_millis() as u64,
                    "marks": o.marks,
                })
            })
            .collect();
        let owners: Vec<_> = view
            .owners
            .iter()
            .map(|(shard, o)| serde_json::json!({"shard": shard, "instance": o.instance, "epoch": o.epoch}))
            .collect();
        let stats = self.member.stats();
        serde_json::json!({
            "cluster": self.cluster,
            "instance": self.member.ownership().instance(),
            "shards": self.shards,
            "revision": view.revision,
            "lease": {
                "id": format!("{:x}", self.member.ownership().lease_id()),
                "ttl_s": self.member.ownership().lease_ttl().as_secs(),
                "valid_for_ms": validity.deadline().map(|d| d.saturating_duration_since(now).as_millis() as u64),
            },
            "instances": view.instances,
            "owners": owners,
            "owned": owned,
            "takeovers_in_progress": self.member.owned().owned().iter()
                .filter(|o| o.admit_after > now).map(|o| o.shard).collect::<Vec<_>>(),
            "stats": {
                "claims": stats.claims.load(Relaxed),
                "takeovers": stats.takeovers.load(Relaxed),
                "handoffs": stats.handoffs.load(Relaxed),
                "handoff_drain_timeouts": stats.handoff_drain_timeouts.load(Relaxed),
                "exchanges_cut": {
                    "ownership": self.cuts.ownership.load(Relaxed),
                    "handoff": self.cuts.handoff.load(Relaxed),
                },
                "deposed": stats.deposed.load(Relaxed),
                "fence_runs": stats.fence_runs.load(Relaxed),
                "fence_failures": stats.fence_failures.load(Relaxed),
            },
            "unfenced": self.member.unfenced(),
        })
    }

    fn metrics(&self, out: &mut String) {
        use std::fmt::Write;
        use std::sync::atomic::Ordering::Relaxed;
        let now = Instant::now();
        let owned = self.member.owned().owned();
        let waiting = owned.iter().filter(|o| o.admit_after > now).count();
        let stats = self.member.stats();
        let valid = self.member.ownership().validity().is_valid();
        for (name, help, value) in [
            (
                "fencegate_cluster_shards_owned",
                "Shards this instance owns.",
                owned.len() as f64,
            ),
            (
                "fencegate_cluster_takeovers_waiting",
                "Owned shards still in their takeover wait.",
                waiting as f64,
            ),
            (
                "fencegate_cluster_ownership_valid",
                "1 while this instance's ownership may admit (its self-fencing deadline has not passed).",
                f64::from(u8::from(valid)),
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP fencegate_cluster_ownership_changes_total Shards claimed, taken over (after a wait), handed off, or found owned elsewhere.\n# TYPE fencegate_cluster_ownership_changes_total counter"
        );
        for (kind, v) in [
            ("claim", stats.claims.load(Relaxed)),
            ("takeover", stats.takeovers.load(Relaxed)),
            ("handoff", stats.handoffs.load(Relaxed)),
            ("deposed", stats.deposed.load(Relaxed)),
        ] {
            let _ = writeln!(
                out,
                "fencegate_cluster_ownership_changes_total{{kind=\"{kind}\"}} {v}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP fencegate_cluster_handoff_drain_timeouts_total Hand-offs that reached their drain bound with exchanges in flight: cut, then released with the full takeover wait for the next owner.\n# TYPE fencegate_cluster_handoff_drain_timeouts_total counter\nfencegate_cluster_handoff_drain_timeouts_total {}",
            stats.handoff_drain_timeouts.load(Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP fencegate_cluster_exchanges_cut_total Upstream exchanges given up mid-flight (before their answer, or with their response body cut), by what ended the ownership they were admitted under.\n# TYPE fencegate_cluster_exchanges_cut_total counter"
        );
        for (reason, v) in [
            ("ownership", self.cuts.ownership.load(Relaxed)),
            ("handoff", self.cuts.handoff.load(Relaxed)),
        ] {
            let _ = writeln!(
                out,
                "fencegate_cluster_exchanges_cut_total{{reason=\"{reason}\"}} {v}"
            );
        }
        stats.takeover_wait_seconds.render(
            out,
            "fencegate_cluster_takeover_wait_seconds",
            "Takeover waits: how long a shard taken from a lost owner admitted nothing.",
        );
        let writer = self.member.owned().writer_stats();
        writer.commit_seconds.render(
            out,
            "fencegate_cluster_mark_commit_seconds",
            "Seconds per guarded transaction of marks in etcd.",
        );
        writer.commit_batch_size.render(
            out,
            "fencegate_cluster_mark_commit_batch_size",
            "Advances per guarded transaction of marks in etcd.",
        );
    }
}
