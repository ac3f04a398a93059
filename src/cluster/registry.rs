//! The cluster's instance registry and the watched view of it (SPEC §10). A live instance
//! is the key `/fencegate/cluster/<cluster>/instances/<name>` (value: the address its peers
//! reach it at), attached to the instance's ownership lease: etcd deletes it with the
//! instance's owner keys when the lease ends, so a name in the registry is a live lease.
//!
//! [`ViewWatch`] keeps, per instance, the cluster as etcd has it: the live instances and
//! each shard's owner and epoch, read whole at one revision and then followed by a watch.
//! It is what forwarding (who owns a shard, where it is) and the balancer (who is alive)
//! read. It is a view, not a guard: admission is decided by the owner's own
//! [`Validity`](super::ownership::Validity) and the marks' guarded writes, never by this.
//!
//! A watch on a member that stops answering but keeps its connection (a frozen process)
//! is found out by the connection's HTTP/2 keep-alive (within 15 s: a ping every 10 s, 5 s
//! for its answer); the view is stale until then, and read whole from the next member
//! after.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, KeyValue, PutOptions, Txn, TxnOp, TxnOpResponse,
    WatchOptions, WatchResponse, WatchStream,
};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::ownership::{Error, Ownership};
use crate::authority::etcd::{Members, lease_not_found};

/// The first wait before the view is read again after its watch failed; doubled per
/// failure up to [`MAX_BACKOFF`], back to this once a watch delivers again.
const MIN_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

fn instances_prefix(cluster: &str) -> String {
    format!("/fencegate/cluster/{cluster}/instances/")
}

fn shards_prefix(cluster: &str) -> String {
    format!("/fencegate/cluster/{cluster}/shards/")
}

fn instance_key(ownership: &Ownership) -> String {
    format!(
        "{}{}",
        instances_prefix(ownership.cluster()),
        ownership.instance()
    )
}

/// The key that holds a cluster's shard count, written by its first instance and kept
/// for its life (no lease).
fn shards_count_key(cluster: &str) -> String {
    format!("/fencegate/cluster/{cluster}/config/shards")
}

/// Agrees on the cluster's shard count: the first instance writes `shards`; every later
/// one must be configured with the same, else it is refused (`Error::Config`). Instances
/// of one cluster with two counts map one scope to two shards, with two marks in etcd:
/// a stale token would pass through the instance that reads the other mark.
pub async fn agree_on_shards(ownership: &Ownership, shards: u32) -> Result<(), Error> {
    let key = shards_count_key(ownership.cluster());
    let value = shards.to_string();
    let txn = Txn::new()
        .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
        .and_then([TxnOp::put(key.as_str(), value.as_str(), None)])
        .or_else([TxnOp::get(key.as_str(), None)]);
    let resp = ownership
        .members()
        .call(|mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await
        .map_err(|e| Error::Etcd(format!("agreeing on {key}: {e}")))?;
    if resp.succeeded() {
        return Ok(());
    }
    let held = resp.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.value().to_vec()),
        _ => None,
    });
    match held {
        Some(v) if v == value.as_bytes() => Ok(()),
        Some(v) => Err(Error::Config(format!(
            "cluster `{}` has {} shards ({key} in etcd), and this instance is configured with {shards}: a cluster's shard count is fixed for its life",
            ownership.cluster(),
            String::from_utf8_lossy(&v)
        ))),
        None => Err(Error::Etcd(format!("agreeing on {key}: no answer"))),
    }
}

/// Registers the instance under its name with `peer_addr`, in one transaction: created if
/// the name is free; if it is already held under this ownership's lease, it is a retry (an
/// answer that was lost, a new address) and the value is updated. A name held under
/// another lease is refused: two live instances must never share a name, as owner keys and
/// forwarding go by it. Once that other lease ends (its instance stopped, expired or was
/// revoked) etcd deletes the key and the name can be taken.
pub async fn register(ownership: &Ownership, peer_addr: &str) -> Result<(), Error> {
    if ownership.validity().is_lost() {
        return Err(Error::Lost);
    }
    let key = instance_key(ownership);
    let lease = ownership.lease_id();
    let put = || {
        TxnOp::put(
            key.as_str(),
            peer_addr,
            Some(PutOptions::new().with_lease(lease)),
        )
    };
    let ours = Txn::new()
        .when([Compare::lease(key.as_str(), CompareOp::Equal, lease)])
        .and_then([put()])
        .or_else([TxnOp::get(key.as_str(), None)]);
    let txn = Txn::new()
        .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
        .and_then([put()])
        .or_else([TxnOp::txn(ours)]);
    let resp = ownership
        .members()
        .call(|mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await
        .map_err(|e| {
            if lease_not_found(&e) {
                Error::Lost
            } else {
                Error::Etcd(format!("registering {key}: {e}"))
            }
        })?;
    if resp.succeeded() {
        return Ok(());
    }
    let inner = match resp.op_responses().into_iter().next() {
        Some(TxnOpResponse::Txn(inner)) => inner,
        other => {
            return Err(Error::Etcd(format!(
                "registering {key}: unexpected answer {other:?}"
            )));
        }
    };
    if inner.succeeded() {
        return Ok(());
    }
    let held = match inner.op_responses().into_iter().next() {
        Some(TxnOpResponse::Get(g)) => g.kvs().first().map(KeyValue::lease),
        _ => None,
    };
    match held {
        Some(other) => Err(Error::Config(format!(
            "instance name {:?} is already registered by a running instance (lease {other:x})",
            ownership.instance()
        ))),
        // Neither absent nor present in one transaction cannot happen.
        None => Err(Error::Etcd(format!(
            "registering {key}: the key is neither absent nor present"
        ))),
    }
}

/// Removes the instance's registration, for a clean shutdown: only if it is still under
/// this ownership's lease (a later instance of the same name, registered after this
/// lease ended, keeps its own).
pub async fn deregister(ownership: &Ownership) -> Result<(), Error> {
    let key = instance_key(ownership);
    let txn = Txn::new()
        .when([Compare::lease(
            key.as_str(),
            CompareOp::Equal,
            ownership.lease_id(),
        )])
        .and_then([TxnOp::delete(key.as_str(), None)]);
    ownership
        .members()
        .call(|mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await
        .map_err(|e| Error::Etcd(format!("deregistering {key}: {e}")))?;
    Ok(())
}

/// The cluster as etcd had it at one revision.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct View {
    /// etcd revision this view is current at.
    pub revision: i64,
    /// The revision up to which the shards' keys are known. The two prefixes are watched
    /// by two watchers of one stream, which may be delivered apart (a watcher created
    /// after the revision it starts from catches up on its own): an instance's event, and
    /// so [`View::revision`], may run ahead of owner keys already written. A shard absent
    /// from the view is known absent only up to this.
    pub owners_revision: i64,
    /// Live instances: name → peer address.
    pub instances: BTreeMap<String, String>,
    /// Shards that have an owner: shard → (owner name, epoch = owner key's create revision).
    pub owners: BTreeMap<u32, Owner>,
}

/// A shard's owner as the view saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// The owning instance's name (the owner key's value).
    pub instance: String,
    /// The owner key's create revision: the epoch the owner claimed the shard at.
    pub epoch: u64,
}

/// What a key under the watched prefixes is to the view.
#[derive(Debug, PartialEq, Eq)]
enum Entry {
    Instance(String),
    Owner(u32),
    /// Not part of the view: `claimed`, `released`, `undrained`, a shard past the count.
    Ignored,
}

/// The keys the view is made of, and how they are read.
struct Keys {
    instances: String,
    shards: String,
    /// Shards `0..count` are the cluster's; owner keys past it are not kept.
    count: u32,
}

impl Keys {
    /// What `key` is; a key under the prefixes that none of fencegate's writes makes is
    /// logged by name and ignored.
    fn entry(&self, key: &[u8]) -> Entry {
        let Ok(text) = std::str::from_utf8(key) else {
            tracing::warn!(key = %String::from_utf8_lossy(key), "cluster view: key not UTF-8; skipped");
            return Entry::Ignored;
        };
        if let Some(name) = text.strip_prefix(self.instances.as_str()) {
            if name.is_empty() {
                tracing::warn!(
                    key = text,
                    "cluster view: instance key without a name; skipped"
                );
                return Entry::Ignored;
            }
            return Entry::Instance(name.to_owned());
        }
        let rest = text.strip_prefix(self.shards.as_str()).unwrap_or_default();
        let parsed = rest.split_once('/').and_then(|(n, leaf)| {
            // One spelling per shard: digits only, no sign, no leading zero.
            let canonical = !n.is_empty()
                && n.bytes().all(|b| b.is_ascii_digit())
                && (n == "0" || !n.starts_with('0'));
            if !canonical {
                return None;
            }
            n.parse::<u32>().ok().map(|n| (n, leaf))
        });
        match parsed {
            Some((n, "owner")) if n < self.count => Entry::Owner(n),
            Some((_, "owner" | "claimed" | "released" | "undrained")) => Entry::Ignored,
            _ => {
                tracing::warn!(key = text, "cluster view: not a shard key; skipped");
                Entry::Ignored
            }
        }
    }

    /// Applies a key as it now is (read, or put by a watch event) to `view`. A value that
    /// cannot be read takes the key out of the view, as a full read would leave it out.
    fn put(&self, view: &mut View, kv: &KeyValue) {
        let key = String::from_utf8_lossy(kv.key());
        match self.entry(kv.key()) {
            Entry::Instance(name) => match std::str::from_utf8(kv.value()) {
                Ok(addr) => {
                    view.instances.insert(name, addr.to_owned());
                }
                Err(_) => {
                    tracing::warn!(key = %key, "cluster view: instance address not UTF-8; skipped");
                    view.instances.remove(&name);
                }
            },
            Entry::Owner(shard) => {
                let owner = std::str::from_utf8(kv.value())
                    .ok()
                    .filter(|name| !name.is_empty());
                let epoch = u64::try_from(kv.create_revision()).ok();
                match (owner, epoch) {
                    (Some(name), Some(epoch)) => {
                        view.owners.insert(
                            shard,
                            Owner {
                                instance: name.to_owned(),
                                epoch,
                            },
                        );
                    }
                    _ => {
                        tracing::warn!(key = %key, "cluster view: owner not a UTF-8 name; skipped");
                        view.owners.remove(&shard);
                    }
                }
            }
            Entry::Ignored => {}
        }
    }

    fn delete(&self, view: &mut View, key: &[u8]) {
        match self.entry(key) {
            Entry::Instance(name) => {
                view.instances.remove(&name);
            }
            Entry::Owner(shard) => {
                view.owners.remove(&shard);
            }
            Entry::Ignored => {}
        }
    }
}

/// Where the view's task reads and watches.
struct Source {
    members: Arc<Members>,
    keys: Keys,
}

impl Source {
    /// The whole view at one revision: the instances, then the shards at the revision the
    /// first read answered (the marks, which may be millions of keys, are not read).
    async fn read(&self) -> Result<View, Error> {
        let prefix = self.keys.instances.clone();
        let instances = self
            .members
            .call(|mut c| {
                let prefix = prefix.clone();
                async move { c.get(prefix, Some(GetOptions::new().with_prefix())).await }
            })
            .await
            .map_err(|e| Error::Etcd(format!("reading {prefix}: {e}")))?;
        let revision = instances.header().map_or(0, |h| h.revision());
        if revision <= 0 {
            return Err(Error::Etcd(format!(
                "reading {prefix}: answered at revision {revision}"
            )));
        }
        let prefix = self.keys.shards.clone();
        let shards = self
            .members
            .call(|mut c| {
                let prefix = prefix.clone();
                let options = GetOptions::new().with_prefix().with_revision(revision);
                async move { c.get(prefix, Some(options)).await }
            })
            .await
            .map_err(|e| Error::Etcd(format!("reading {prefix} at revision {revision}: {e}")))?;
        let mut view = View {
            revision,
            owners_revision: revision,
            ..View::default()
        };
        for kv in instances.kvs().iter().chain(shards.kvs()) {
            self.keys.put(&mut view, kv);
        }
        Ok(view)
    }

    /// One stream watching both prefixes from `from` (two watchers: the marks' prefix lies
    /// between them and must not be watched). Each prefix's events come in revision order,
    /// and a caught-up stream sends both watchers' events of a revision before the next;
    /// while a watch started in the past catches up the two may be delivered apart, so the
    /// view's revision is then the higher of the two (their keys are disjoint, so the view
    /// itself is right once both have caught up).
    async fn watch(&self, from: i64) -> Result<WatchStream, Error> {
        let (instances, shards) = (self.keys.instances.clone(), self.keys.shards.clone());
        self.members
            .call(|mut c| {
                let (instances, shards) = (instances.clone(), shards.clone());
                async move {
                    let options = || WatchOptions::new().with_prefix().with_start_revision(from);
                    let mut stream = c.watch(instances, Some(options())).await?;
                    stream.watch(shards, Some(options())).await?;
                    Ok(stream)
                }
            })
            .await
            .map_err(|e| {
                Error::Etcd(format!(
                    "watching {} and {} from revision {from}: {e}",
                    self.keys.instances, self.keys.shards
                ))
            })
    }
}

/// The view of the cluster, kept current by one task. Dropping it stops the task.
pub struct ViewWatch {
    view: watch::Receiver<Arc<View>>,
    task: JoinHandle<()>,
    restart: mpsc::UnboundedSender<i64>,
    reads: Arc<AtomicU64>,
}

impl ViewWatch {
    /// Reads the view of `ownership`'s cluster (shards `0..shards`) and starts following
    /// it; the first read is done when this returns.
    pub async fn start(ownership: &Ownership, shards: u32) -> Result<ViewWatch, Error> {
        let source = Source {
            members: ownership.members().clone(),
            keys: Keys {
                instances: instances_prefix(ownership.cluster()),
                shards: shards_prefix(ownership.cluster()),
                count: shards,
            },
        };
        let first = source.read().await?;
        let reads = Arc::new(AtomicU64::new(1));
        let (tx, view) = watch::channel(Arc::new(first));
        let (restart, restarts) = mpsc::unbounded_channel();
        let task = tokio::spawn(follow(source, tx, restarts, reads.clone()));
        Ok(ViewWatch {
            view,
            task,
            restart,
            reads,
        })
    }

    /// The view as last published.
    pub fn current(&self) -> Arc<View> {
        self.view.borrow().clone()
    }

    /// A receiver told of every new view.
    pub fn subscribe(&self) -> watch::Receiver<Arc<View>> {
        self.view.clone()
    }

    /// Waits until the view satisfies `f` or `timeout` passes (for tests and the balancer).
    pub async fn wait_for(
        &self,
        timeout: Duration,
        f: impl Fn(&View) -> bool,
    ) -> Option<Arc<View>> {
        let mut view = self.subscribe();
        let found = tokio::time::timeout(timeout, view.wait_for(|v| f(v))).await;
        match found {
            Ok(Ok(v)) => Some(v.clone()),
            _ => None,
        }
    }

    /// How many times the view was read whole (1 after [`start`](ViewWatch::start); one more
    /// per fallback from a failed watch).
    #[doc(hidden)]
    pub fn full_reads(&self) -> u64 {
        self.reads.load(Ordering::Acquire)
    }

    /// Test hook: drops the current watch and watches again from `revision` without
    /// reading first, as a watch resumed after a disconnection would. From a compacted
    /// revision etcd cancels it, and the view must fall back to a full read.
    #[doc(hidden)]
    pub fn rewatch_from(&self, revision: i64) {
        let _ = self.restart.send(revision);
    }
}

impl Drop for ViewWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Why a watch ended.
enum Ended {
    /// etcd cancelled it (compaction, a lost leader), it closed, or it failed: read again.
    Lost(String),
    /// The test hook asked to watch again from this revision.
    Rewatch(i64),
}

/// The view's task: follows the watch; whenever it ends, reads the view whole again and
/// watches from there, waiting a little longer after each failure in a row.
async fn follow(
    source: Source,
    tx: watch::Sender<Arc<View>>,
    mut restarts: mpsc::UnboundedReceiver<i64>,
    reads: Arc<AtomicU64>,
) {
    let mut view = (**tx.borrow()).clone();
    let mut from = view.revision + 1;
    let mut backoff = MIN_BACKOFF;
    loop {
        match watch_from(&source, from, &mut view, &tx, &mut restarts, &mut backoff).await {
            Ended::Rewatch(revision) => {
                from = revision;
                continue;
            }
            Ended::Lost(why) => {
                tracing::info!(why, "cluster view: watch ended; reading the view again");
            }
        }
        loop {
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
            match source.read().await {
                Ok(fresh) => {
                    reads.fetch_add(1, Ordering::AcqRel);
                    from = fresh.revision + 1;
                    view = fresh;
                    tx.send_replace(Arc::new(view.clone()));
                    break;
                }
                Err(e) => tracing::warn!(error = %e, "cluster view: read failed; trying again"),
            }
        }
    }
}

/// Watches from `from`, applying each response's events to `view` in order and publishing
/// it, until the watch ends.
async fn watch_from(
    source: &Source,
    from: i64,
    view: &mut View,
    tx: &watch::Sender<Arc<View>>,
    restarts: &mut mpsc::UnboundedReceiver<i64>,
    backoff: &mut Duration,
) -> Ended {
    let mut stream = match source.watch(from).await {
        Ok(stream) => stream,
        Err(e) => return Ended::Lost(e.to_string()),
    };
    loop {
        let message = tokio::select! {
            message = stream.message() => message,
            Some(revision) = restarts.recv() => return Ended::Rewatch(revision),
        };
        let resp = match message {
            Ok(Some(resp)) => resp,
            Ok(None) => return Ended::Lost("the watch stream closed".into()),
            Err(e) => return Ended::Lost(format!("etcd: {e}")),
        };
        if resp.canceled() || resp.compact_revision() > 0 {
            return Ended::Lost(format!(
                "watch cancelled (compacted to {}): {}",
                resp.compact_revision(),
                resp.cancel_reason()
            ));
        }
        if apply(&source.keys, view, &resp) {
            *backoff = MIN_BACKOFF;
            tx.send_replace(Arc::new(view.clone()));
        }
    }
}

/// Applies one watch response; false if it carried no events (the watch's creation, a
/// progress note), so nothing new is published.
fn apply(keys: &Keys, view: &mut View, resp: &WatchResponse) -> bool {
    if resp.events().is_empty() {
        return false;
    }
    for event in resp.events() {
        let Some(kv) = event.kv() else { continue };
        match event.event_type() {
            EventType::Put => keys.put(view, kv),
            EventType::Delete => keys.delete(view, kv.key()),
        }
        view.revision = view.revision.max(kv.mod_revision());
        if kv.key().starts_with(keys.shards.as_bytes()) {
            view.owners_revision = view.owners_revision.max(kv.mod_revision());
        }
    }
    let header = resp.header().map_or(0, |h| h.revision());
    view.revision = view.revision.max(header);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> Keys {
        Keys {
            instances: instances_prefix("c"),
            shards: shards_prefix("c"),
            count: 16,
        }
    }

    #[test]
    fn only_owner_keys_of_the_clusters_shards_and_named_instances_are_entries() {
        let k = keys();
        let e = |key: &str| k.entry(key.as_bytes());
        assert_eq!(
            e("/fencegate/cluster/c/instances/a"),
            Entry::Instance("a".into())
        );
        assert_eq!(e("/fencegate/cluster/c/shards/0/owner"), Entry::Owner(0));
        assert_eq!(e("/fencegate/cluster/c/shards/15/owner"), Entry::Owner(15));
        for ignored in [
            "/fencegate/cluster/c/instances/",
            "/fencegate/cluster/c/shards/16/owner",
            "/fencegate/cluster/c/shards/3/claimed",
            "/fencegate/cluster/c/shards/3/released",
            "/fencegate/cluster/c/shards/3/undrained",
            "/fencegate/cluster/c/shards/03/owner",
            "/fencegate/cluster/c/shards/+3/owner",
            "/fencegate/cluster/c/shards/x/owner",
            "/fencegate/cluster/c/shards/3/other",
            "/fencegate/cluster/c/shards/3",
            "/fencegate/cluster/c/shards/99999999999/owner",
        ] {
            assert_eq!(e(ignored), Entry::Ignored, "{ignored}");
        }
        assert_eq!(
            k.entry(b"/fencegate/cluster/c/shards/\xff/owner"),
            Entry::Ignored
        );
    }
}
