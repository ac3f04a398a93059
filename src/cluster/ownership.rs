//! Shard ownership on etcd. A shard's owner is the key
//! `/fencegate/cluster/<cluster>/shards/<n>/owner` (value: the instance's name), attached
//! to the instance's one etcd lease of `ownership_ttl`; the key's create revision is the
//! shard's epoch, unique and increasing across the cluster.
//!
//! **Self-fencing.** One task keeps the lease alive. Each keep-alive notes when it was
//! *sent*; an answer with ttl t > 0 makes the instance's ownership [`Validity`] last until
//! `sent + t − drift_margin`. etcd counts the lease's t from when the leader *received*
//! the keep-alive, later than `sent`, so the owner's deadline comes before etcd can expire
//! the lease. Nothing needs to arrive for the deadline to pass: an owner that is paused,
//! cut off from etcd, or whose keep-alive task stopped stops admitting by itself, before
//! etcd deletes its keys and another instance can claim them. An answer of ttl 0 (the
//! lease is gone) ends the validity at once.
//!
//! **Takeover.** A shard whose previous owner was lost (its lease expired or was revoked;
//! not released) may still have requests the old owner admitted in flight to the backend:
//! the new owner admits nothing for [`takeover_wait`] after its claim. A planned hand-off
//! ([`Ownership::release`]) needs no wait: the old owner drains before it releases, and the
//! release leaves a marker (`.../released`, the released epoch) that the next claim
//! consumes in its own transaction. A hand-off that could not drain in its bound cuts
//! what is left and leaves `.../undrained` instead ([`Ownership::release_undrained`]):
//! the next claim waits the full takeover wait. A second key, `.../claimed` (the last claimant's name,
//! no lease), tells a shard that had an owner from one that never had one.
//!
//! **The remaining timing assumption.** Clocks are not compared between machines, only
//! durations: the owner's `t − drift_margin` must not outlast etcd's `t`. That holds
//! while the rates of the owner's monotonic clock and the etcd leader's differ by less
//! than `drift_margin / t` (e.g. 5% for 250 ms of a 5 s ttl; real clocks drift by parts per
//! million), and while a process paused *between* reading its validity and admitting is
//! paused for less than the margin too (an admission reads the validity, then forwards).
//! An exchange still streaming its response body at the deadline is cut then, by the
//! process: one paused across the deadline cannot cut it, and its backend may go on
//! sending into the sockets' buffers (`fence_command` is the guard against that).
//! Also assumed: nothing but fencegate deletes the ownership keys. An operator who deletes
//! an owner key by hand while the owner's lease lives leaves that owner valid (its
//! keep-alives still succeed) while another instance may claim the shard; a watch on the
//! owned keys is the next increment's guard against that.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::authority::etcd::{Members, lease_not_found};

/// What can go wrong talking to etcd about ownership.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// etcd could not be asked or did not answer; the outcome of a write is unknown
    /// (a claim may be tried again: claiming a shard already ours answers `Owned`).
    #[error("etcd: {0}")]
    Etcd(String),
    /// This instance's lease is gone: it owns nothing, and must start over with a new
    /// [`Ownership`].
    #[error("the instance's ownership lease is gone")]
    Lost,
    #[error("{0}")]
    Config(String),
}

fn etcd(e: impl std::fmt::Display) -> Error {
    Error::Etcd(e.to_string())
}

/// What an instance needs to own shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnershipConfig {
    /// The cluster's name: the key prefix, so clusters can share one etcd.
    pub cluster: String,
    /// This instance's name, unique in the cluster: the owner keys' value.
    pub instance: String,
    /// The lease's ttl (whole seconds, rounded up; etcd may grant more than asked).
    pub ownership_ttl: Duration,
    /// How much earlier than the lease's ttl from a keep-alive's send the owner stops
    /// admitting (see the module doc); less than `ownership_ttl`.
    pub drift_margin: Duration,
}

/// An instance's ownership: its lease, kept alive by one task, and the claims made under it.
/// Dropping it stops the keep-alive (the lease then expires in etcd); it does not revoke.
pub struct Ownership {
    members: Arc<Members>,
    cluster: String,
    prefix: String,
    instance: String,
    lease: i64,
    lease_ttl: Duration,
    validity: Validity,
    keeper: JoinHandle<()>,
}

/// Until when this instance's ownership may admit: cheap to read (a watch channel's
/// current value), and passing by itself when renewals stop.
#[derive(Debug, Clone)]
pub struct Validity(watch::Receiver<Until>);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Until {
    At(Instant),
    /// etcd said the lease is gone.
    Lost,
}

impl Validity {
    /// The deadline in force; None once the lease is known gone.
    pub fn deadline(&self) -> Option<Instant> {
        match *self.0.borrow() {
            Until::At(at) => Some(at),
            Until::Lost => None,
        }
    }

    /// Whether the ownership may admit at `now`.
    pub fn valid_at(&self, now: Instant) -> bool {
        self.deadline().is_some_and(|d| now < d)
    }

    pub fn is_valid(&self) -> bool {
        self.valid_at(Instant::now())
    }

    /// The lease is known gone (a deadline that merely passed is not this).
    pub fn is_lost(&self) -> bool {
        self.deadline().is_none()
    }
}

/// A claim's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The shard is this instance's, at `epoch`; `previous` says how the last ownership
    /// ended, and so whether a takeover wait applies ([`Claim::wait`]).
    Owned {
        shard: u32,
        epoch: u64,
        previous: Previous,
    },
    /// Another ownership holds it (`owner` may be this instance's name under an older
    /// lease: a previous run of it).
    Taken { owner: String, epoch: u64 },
}

/// How the shard's previous ownership ended, as the claim that took it saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Previous {
    /// The shard never had an owner.
    None,
    /// Released by its owner (a planned hand-off): no wait.
    Released { epoch: u64 },
    /// Released by its owner after cutting what it could not drain (a hand-off that
    /// reached its drain bound): the full takeover wait, but no `fence_command` (the
    /// owner is alive, and gave its exchanges up before it released).
    Undrained { epoch: u64 },
    /// Lost: its lease expired or was revoked; `owner` is the last claimant's name.
    Lost { owner: String, epoch: u64 },
    /// Already ours: the claim was made before (a retried claim).
    Ours,
}

impl Claim {
    /// How long the new owner must admit nothing for the shard after this claim.
    pub fn wait(
        &self,
        ownership_ttl: Duration,
        upstream_timeout: Duration,
        settle: Duration,
    ) -> Duration {
        match self {
            Claim::Owned {
                previous: Previous::Lost { .. } | Previous::Undrained { .. },
                ..
            } => takeover_wait(ownership_ttl, upstream_timeout, settle),
            _ => Duration::ZERO,
        }
    }
}

/// How long a new owner admits nothing after it claims a shard whose previous owner was
/// lost: the old ownership's remaining time, plus the longest upstream timeout (a request
/// it admitted last may still reach the backend that late), plus `settle` (an exchange
/// lost without an answer is held that long, SPEC §3).
///
/// The old ownership's remaining time is not known to the new owner; it is at most
/// `ownership_ttl`: every deadline the old owner holds came from a keep-alive answered
/// before its lease ended, so it ends within one ttl of that. When the lease *expired*,
/// the module's timing assumption already makes the remainder 0; a *revoked* lease (an
/// operator's `etcdctl lease revoke`) ends in etcd at once, and only this term covers the
/// old owner's last deadline. Pass the ttl etcd granted ([`Ownership::lease_ttl`]) when it
/// is longer than the one asked for.
pub fn takeover_wait(
    ownership_ttl: Duration,
    longest_upstream_timeout: Duration,
    settle: Duration,
) -> Duration {
    ownership_ttl
        .saturating_add(longest_upstream_timeout)
        .saturating_add(settle)
}

/// Whole seconds, rounded up (at least 1): etcd holds a lease at least as long as asked.
fn lease_seconds(d: Duration) -> i64 {
    let s = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    i64::try_from(s.max(1)).unwrap_or(i64::MAX)
}

fn epoch_of(revision: i64) -> Result<u64, Error> {
    u64::try_from(revision).map_err(|_| Error::Etcd(format!("negative revision {revision}")))
}

/// `sent + ttl − margin`: the deadline a keep-alive sent at `sent` and answered with `ttl`
/// gives.
fn deadline(sent: Instant, ttl: Duration, margin: Duration) -> Instant {
    sent + ttl.saturating_sub(margin)
}

impl Ownership {
    /// One transaction, through the members in turn (see [`Members::call`]).
    async fn txn(&self, txn: Txn) -> Result<TxnResponse, etcd_client::Error> {
        self.members
            .call(|mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await
    }

    /// Connects to etcd, grants the instance's lease and starts keeping it alive.
    pub async fn start(endpoints: &[String], config: OwnershipConfig) -> Result<Ownership, Error> {
        if config.cluster.is_empty() || config.cluster.contains('/') {
            return Err(Error::Config(format!(
                "cluster name {:?}: not empty, no '/'",
                config.cluster
            )));
        }
        if config.instance.is_empty() {
            return Err(Error::Config("instance name: not empty".into()));
        }
        if config.drift_margin >= config.ownership_ttl {
            return Err(Error::Config(format!(
                "drift_margin ({:?}) must be less than ownership_ttl ({:?})",
                config.drift_margin, config.ownership_ttl
            )));
        }
        // A request may take a third of the ttl: a member that lets one time out is left
        // for the next while the ownership still has two thirds to run.
        let timeout = (config.ownership_ttl / 3).max(Duration::from_millis(300));
        let members = Arc::new(
            Members::connect_with_timeout(endpoints, timeout)
                .await
                .map_err(etcd)?,
        );
        let asked = lease_seconds(config.ownership_ttl);
        let sent = Instant::now();
        let granted = members
            .call(|mut c| async move { c.lease_grant(asked, None).await })
            .await
            .map_err(etcd)?;
        let lease = granted.id();
        let lease_ttl = u64::try_from(granted.ttl())
            .ok()
            .filter(|&t| t > 0)
            .map(Duration::from_secs)
            .ok_or_else(|| Error::Etcd(format!("lease granted with ttl {}", granted.ttl())))?;
        let (tx, rx) = watch::channel(Until::At(deadline(sent, lease_ttl, config.drift_margin)));
        let keeper = tokio::spawn(keep_alive(
            members.clone(),
            lease,
            lease_ttl,
            config.drift_margin,
            tx,
        ));
        Ok(Ownership {
            members,
            prefix: format!("/fencegate/cluster/{}/shards/", config.cluster),
            cluster: config.cluster,
            instance: config.instance,
            lease,
            lease_ttl,
            validity: Validity(rx),
            keeper,
        })
    }

    /// The etcd members this ownership talks to, for the cluster's other keys (marks,
    /// the instance registry): one connection per instance.
    pub(crate) fn members(&self) -> &Arc<Members> {
        &self.members
    }

    pub fn validity(&self) -> Validity {
        self.validity.clone()
    }

    /// The cluster's name (its keys are under `/fencegate/cluster/<name>/`).
    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// The instance's etcd lease (for operators: `etcdctl lease revoke` ends every
    /// ownership of the instance at once).
    pub fn lease_id(&self) -> i64 {
        self.lease
    }

    /// The lease's ttl as etcd granted it.
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    /// Stops keeping the lease alive (as a crash would): the validity runs out by itself
    /// and etcd expires the lease later.
    pub fn stop_renewing(&self) {
        self.keeper.abort();
    }

    fn key(&self, shard: u32, name: &str) -> String {
        format!("{}{shard}/{name}", self.prefix)
    }

    /// Claims `shard` in one transaction: if no one owns it, it becomes this instance's
    /// (under its lease), the release marker is consumed and the claimant recorded; else
    /// the current owner is read.
    pub async fn claim(&self, shard: u32) -> Result<Claim, Error> {
        if self.validity.is_lost() {
            return Err(Error::Lost);
        }
        let (owner, claimed, released, undrained) = (
            self.key(shard, "owner"),
            self.key(shard, "claimed"),
            self.key(shard, "released"),
            self.key(shard, "undrained"),
        );
        let txn = Txn::new()
            .when([Compare::create_revision(
                owner.as_str(),
                CompareOp::Equal,
                0,
            )])
            .and_then([
                TxnOp::get(claimed.as_str(), None),
                TxnOp::get(released.as_str(), None),
                TxnOp::get(undrained.as_str(), None),
                TxnOp::put(
                    owner.as_str(),
                    self.instance.as_str(),
                    Some(PutOptions::new().with_lease(self.lease)),
                ),
                TxnOp::put(claimed.as_str(), self.instance.as_str(), None),
                TxnOp::delete(released.as_str(), None),
                TxnOp::delete(undrained.as_str(), None),
            ])
            .or_else([TxnOp::get(owner.as_str(), None)]);
        let resp = self.txn(txn).await.map_err(|e| {
            if lease_not_found(&e) {
                Error::Lost
            } else {
                etcd(e)
            }
        })?;
        let ops = resp.op_responses();
        let first = |i: usize| match ops.get(i) {
            Some(TxnOpResponse::Get(g)) => g.kvs().first().cloned(),
            _ => None,
        };
        if resp.succeeded() {
            // The owner key was created by this transaction: its create revision is the
            // transaction's revision.
            let epoch = epoch_of(resp.header().map_or(0, |h| h.revision()))?;
            let epoch_in = |kv: &etcd_client::KeyValue| {
                std::str::from_utf8(kv.value())
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            };
            let previous = match (first(0), first(1), first(2)) {
                (None, _, _) => Previous::None,
                (Some(_), Some(r), _) => Previous::Released {
                    epoch: epoch_in(&r),
                },
                (Some(_), None, Some(u)) => Previous::Undrained {
                    epoch: epoch_in(&u),
                },
                (Some(c), None, None) => Previous::Lost {
                    owner: String::from_utf8_lossy(c.value()).into_owned(),
                    // `claimed` was written by the claim that created the last owner key.
                    epoch: epoch_of(c.mod_revision())?,
                },
            };
            return Ok(Claim::Owned {
                shard,
                epoch,
                previous,
            });
        }
        let Some(kv) = first(0) else {
            // Deleted between the compare and the read cannot happen in one transaction.
            return Err(Error::Etcd(
                "claim: owner key neither absent nor present".into(),
            ));
        };
        let epoch = epoch_of(kv.create_revision())?;
        if kv.lease() == self.lease {
            return Ok(Claim::Owned {
                shard,
                epoch,
                previous: Previous::Ours,
            });
        }
        Ok(Claim::Taken {
            owner: String::from_utf8_lossy(kv.value()).into_owned(),
            epoch,
        })
    }

    /// A planned hand-off: deletes the owner key only if it is still the ownership of
    /// `epoch`, and leaves the release marker for the next claim (no takeover wait). The
    /// caller has stopped admitting for the shard and drained it first. Answers whether it
    /// released (false: the shard was not ours at `epoch` any more).
    pub async fn release(&self, shard: u32, epoch: u64) -> Result<bool, Error> {
        self.release_as(shard, epoch, true).await
    }

    /// A hand-off that could not drain (its exchanges were cut at the drain bound; the
    /// backend may still be working on what was cut): deletes the owner key as
    /// [`Ownership::release`] does, but leaves the `undrained` marker instead of the
    /// release marker, so the next claim waits the full [`takeover_wait`] (and, the owner
    /// being alive, runs no `fence_command`: [`Previous::Undrained`]).
    pub async fn release_undrained(&self, shard: u32, epoch: u64) -> Result<bool, Error> {
        self.release_as(shard, epoch, false).await
    }

    async fn release_as(&self, shard: u32, epoch: u64, drained: bool) -> Result<bool, Error> {
        let owner = self.key(shard, "owner");
        let marker = self.key(shard, if drained { "released" } else { "undrained" });
        let revision = i64::try_from(epoch).map_err(|_| Error::Etcd(format!("epoch {epoch}")))?;
        let txn = Txn::new()
            .when([Compare::create_revision(
                owner.as_str(),
                CompareOp::Equal,
                revision,
            )])
            .and_then([
                TxnOp::delete(owner.as_str(), None),
                TxnOp::put(marker.as_str(), epoch.to_string(), None),
            ]);
        let resp = self.txn(txn).await.map_err(etcd)?;
        Ok(resp.succeeded())
    }
}

impl Drop for Ownership {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

/// Keeps `lease` alive every third of its ttl (sooner again after a failure), moving the
/// validity's deadline on with each answer; ends when etcd says the lease is gone.
async fn keep_alive(
    members: Arc<Members>,
    lease: i64,
    ttl: Duration,
    margin: Duration,
    validity: watch::Sender<Until>,
) {
    let every = ttl / 3;
    let retry = (ttl / 10).max(Duration::from_millis(50));
    loop {
        let sent = Instant::now();
        // A stream to a stopped member may wait for its answer forever: the round has a
        // third of the ttl, then the next member is asked.
        let answer = tokio::time::timeout(
            every,
            members.call(|mut c| async move {
                let (mut keeper, mut stream) = c.lease_keep_alive(lease).await?;
                keeper.keep_alive().await?;
                Ok(stream.message().await?.map(|r| r.ttl()))
            }),
        )
        .await;
        let Ok(answer) = answer else {
            tracing::debug!(
                lease,
                "ownership keep-alive unanswered; asking the next member"
            );
            members.skip();
            continue;
        };
        let next = match answer {
            Ok(Some(t)) if t > 0 => {
                let t = Duration::from_secs(u64::try_from(t).unwrap_or(0));
                let until = deadline(sent, t, margin);
                // Answers come one at a time, each to a later send: the deadline only
                // moves on, but keep it so if one ever came out of order.
                validity.send_modify(|u| {
                    if let Until::At(at) = u {
                        *at = (*at).max(until);
                    }
                });
                sent + every
            }
            Ok(_) => {
                tracing::warn!(lease, "ownership lease gone: owning nothing");
                validity.send_replace(Until::Lost);
                return;
            }
            Err(e) if lease_not_found(&e) => {
                tracing::warn!(lease, "ownership lease gone: owning nothing");
                validity.send_replace(Until::Lost);
                return;
            }
            Err(e) => {
                tracing::debug!(lease, error = %e, "ownership keep-alive failed; trying again");
                Instant::now() + retry
            }
        };
        tokio::time::sleep_until(next).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_takeover_wait_is_the_ttl_the_upstream_timeout_and_settle() {
        let s = Duration::from_secs;
        assert_eq!(takeover_wait(s(5), s(30), s(1)), s(36));
        let lost = Claim::Owned {
            shard: 1,
            epoch: 9,
            previous: Previous::Lost {
                owner: "a".into(),
                epoch: 4,
            },
        };
        assert_eq!(lost.wait(s(5), s(30), s(1)), s(36));
        let undrained = Claim::Owned {
            shard: 1,
            epoch: 9,
            previous: Previous::Undrained { epoch: 4 },
        };
        assert_eq!(undrained.wait(s(5), s(30), s(1)), s(36));
        for previous in [
            Previous::None,
            Previous::Released { epoch: 4 },
            Previous::Ours,
        ] {
            let claim = Claim::Owned {
                shard: 1,
                epoch: 9,
                previous,
            };
            assert_eq!(claim.wait(s(5), s(30), s(1)), Duration::ZERO);
        }
    }

    #[test]
    fn lease_seconds_round_up() {
        assert_eq!(lease_seconds(Duration::from_millis(1500)), 2);
        assert_eq!(lease_seconds(Duration::from_secs(5)), 5);
        assert_eq!(lease_seconds(Duration::ZERO), 1);
    }

    /// The deadline passes by itself: no message is needed for an owner to stop.
    #[tokio::test(start_paused = true)]
    async fn validity_ends_by_itself_from_the_send_time() {
        let sent = Instant::now();
        let (tx, rx) = watch::channel(Until::At(deadline(
            sent,
            Duration::from_secs(5),
            Duration::from_millis(250),
        )));
        let v = Validity(rx);
        assert!(v.is_valid());
        tokio::time::advance(Duration::from_millis(4749)).await;
        assert!(v.is_valid());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!v.is_valid(), "sent + ttl - margin has passed");
        assert!(!v.is_lost());
        tx.send_replace(Until::Lost);
        assert!(v.is_lost() && !v.valid_at(sent));
    }
}
