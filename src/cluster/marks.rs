//! Marks in etcd (SPEC §10): in a cluster, a scope's high-water mark lives under
//! `/fencegate/cluster/<cluster>/marks/<shard>/<scope>`, written only by the shard's owner
//! and only while it owns it.
//!
//! **Guarded writes.** Every transaction that writes marks compares, for each shard it
//! touches, the owner key's create revision (`.../shards/<n>/owner`, see
//! [`super::ownership`]) with the epoch the writer claimed it at. A deposed owner — its
//! lease expired, the shard released and claimed again — has an epoch that no longer
//! matches, so its transaction writes nothing,
//! however late it arrives: etcd, not the owner's clock, decides. The transaction's
//! failure branch reads the owner keys, so the writer learns which shards it lost and
//! commits the rest again without them.
//!
//! **Group commit.** [`MarkWriter`] is the cluster's counterpart of the local store's
//! writer: advances queued while a commit is in flight go together in the next, the highest
//! per scope, and each is answered once its transaction has committed. etcd limits a
//! transaction to 128 operations (`--max-txn-ops`), so a batch is cut into transactions of
//! at most [`MAX_TXN_OPS`] puts and as many compares; each is acknowledged on its own.
//!
//! The writer never compares a mark with the one stored: the shard's owner is the only
//! writer, and it queues an advance only above what it has decided for the scope (the
//! gate does so under the scope's lock), so the order of its advances is the order of its
//! decisions. Within one batch the highest per scope wins.
//!
//! **Values.** A mark is stored as its token's canonical text, then a space and the
//! sequence when it has one (`7:12 3`), so `etcdctl get` shows it as the headers spell it.
//! A value read back that is not exactly that (a key written by something else, a bit
//! flipped) is refused by name: a mark that cannot be read is never taken for no mark.
//!
//! **An answer that never came.** A transaction whose answer is lost (a timeout, a member
//! gone mid-request) may have committed or not. Its advances are answered
//! [`CommitError::Unknown`]; nothing carrying them may be forwarded. The owner's memory of
//! those scopes is then no longer known to match etcd, so the caller must reload the shard
//! ([`EtcdMarks::load`]) before it decides for it again, or a lower token could be written
//! over one that did commit.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp, TxnOpResponse};
use tokio::sync::{mpsc, oneshot};

use super::ownership::Ownership;
use crate::authority::etcd::Members;
use crate::metrics::histogram::Histogram;
use crate::store::Mark;
use crate::token::{Token, parse_sequence};

/// The most puts (and compares) in one transaction: etcd's default `--max-txn-ops`.
pub const MAX_TXN_OPS: usize = 128;
/// The most advances one batch takes from the queue.
const MAX_BATCH: usize = 4096;
/// Marks read per request while loading a shard.
const PAGE: i64 = 1000;

/// Why advances were not committed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommitError {
    /// The shard is no longer owned at the epoch the advance was made under: nothing was
    /// written, and the shard is someone else's (or no one's) now.
    #[error("shard {shard} is no longer owned at epoch {epoch}")]
    Deposed { shard: u32, epoch: u64 },
    /// etcd's answer did not come: the advance may or may not have committed (see the
    /// module doc: the shard must be reloaded before deciding for it again).
    #[error("the outcome of the marks' commit is unknown: {0}")]
    Unknown(String),
    /// The writer has stopped.
    #[error("the cluster's mark writer has stopped")]
    Stopped,
}

/// Why marks could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    #[error("etcd: {0}")]
    Etcd(String),
    /// A value under the marks' prefix that is not a mark.
    #[error("the mark at {key:?} is unreadable ({value:?}): {reason}")]
    Corrupt {
        key: String,
        value: String,
        reason: String,
    },
}

/// One advance: `scope` (of `shard`, owned at `epoch`) to at least `mark`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Advance {
    pub shard: u32,
    pub epoch: u64,
    pub scope: Arc<str>,
    pub mark: Mark,
}

/// The marks' keys in etcd, written under an [`Ownership`]'s guard.
#[derive(Clone)]
pub struct EtcdMarks {
    members: Arc<Members>,
    /// `/fencegate/cluster/<cluster>/marks/`.
    prefix: String,
    /// `/fencegate/cluster/<cluster>/shards/`: the owner keys are `<this><n>/owner`.
    shards: String,
}

/// A mark as stored: the token's canonical text, then ` <sequence>` if it has one.
pub fn encode(mark: &Mark) -> Vec<u8> {
    let mut out = Vec::with_capacity(24);
    mark.token.write_to(&mut out);
    if let Some(s) = mark.sequence {
        out.push(b' ');
        crate::token::push_decimal(&mut out, s);
    }
    out
}

/// Why a stored value is not a mark.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("token: {0}")]
    Token(#[source] crate::token::TokenError),
    #[error("sequence: {0}")]
    Sequence(#[source] crate::token::TokenError),
    #[error("more than a token and a sequence")]
    TooManyParts,
}

/// The inverse of [`encode`], strictly: one spelling per mark.
pub fn decode(value: &[u8]) -> Result<Mark, DecodeError> {
    let mut parts = value.splitn(3, |b| *b == b' ');
    let token = parts.next().unwrap_or_default();
    let token = Token::parse(token).map_err(DecodeError::Token)?;
    let sequence = match (parts.next(), parts.next()) {
        (None, _) => None,
        (Some(s), None) => Some(parse_sequence(s).map_err(DecodeError::Sequence)?),
        (Some(_), Some(_)) => return Err(DecodeError::TooManyParts),
    };
    Ok(Mark { token, sequence })
}

fn etcd(e: impl std::fmt::Display) -> ReadError {
    ReadError::Etcd(e.to_string())
}

/// The key just after every key that starts with `prefix` (etcd's range end for a prefix).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

impl EtcdMarks {
    /// The marks of `ownership`'s cluster, on its etcd connection.
    pub fn new(ownership: &Ownership) -> EtcdMarks {
        EtcdMarks {
            members: ownership.members().clone(),
            prefix: format!("/fencegate/cluster/{}/marks/", ownership.cluster()),
            shards: format!("/fencegate/cluster/{}/shards/", ownership.cluster()),
        }
    }

    /// The key of `scope`'s mark.
    pub fn key(&self, shard: u32, scope: &str) -> String {
        format!("{}{shard}/{scope}", self.prefix)
    }

    fn shard_prefix(&self, shard: u32) -> String {
        format!("{}{shard}/", self.prefix)
    }

    fn owner_key(&self, shard: u32) -> String {
        format!("{}{shard}/owner", self.shards)
    }

    /// Commits `advances` in one transaction, guarded by each shard's epoch. They must
    /// name at most [`MAX_TXN_OPS`] scopes, each once, and each shard with one epoch.
    /// Answers the shards found deposed (nothing was written then), or an empty list.
    pub async fn commit_one(&self, advances: &[Advance]) -> Result<Vec<(u32, u64)>, CommitError> {
        let guards: BTreeMap<u32, u64> = advances.iter().map(|a| (a.shard, a.epoch)).collect();
        let mut compares = Vec::with_capacity(guards.len());
        let mut otherwise = Vec::with_capacity(guards.len());
        for (&shard, &epoch) in &guards {
            let revision = i64::try_from(epoch)
                .map_err(|_| CommitError::Unknown(format!("epoch {epoch} out of range")))?;
            let owner = self.owner_key(shard);
            compares.push(Compare::create_revision(
                owner.as_str(),
                CompareOp::Equal,
                revision,
            ));
            otherwise.push(TxnOp::get(owner, None));
        }
        let puts: Vec<TxnOp> = advances
            .iter()
            .map(|a| TxnOp::put(self.key(a.shard, &a.scope), encode(&a.mark), None))
            .collect();
        let txn = Txn::new().when(compares).and_then(puts).or_else(otherwise);
        let resp = self
            .members
            .call(|mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await
            .map_err(|e| CommitError::Unknown(e.to_string()))?;
        if resp.succeeded() {
            return Ok(Vec::new());
        }
        // The failure branch read the owner keys, in the order of `guards`.
        let mut deposed = Vec::new();
        for ((&shard, &epoch), op) in guards.iter().zip(resp.op_responses()) {
            let held = match op {
                TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.create_revision()),
                _ => None,
            };
            if held.and_then(|r| u64::try_from(r).ok()) != Some(epoch) {
                deposed.push((shard, epoch));
            }
        }
        if deposed.is_empty() {
            // Every guard held when read, yet the compare failed: not a state etcd's
            // single revision allows; say so rather than retry forever.
            return Err(CommitError::Unknown(
                "the guarded commit failed with every ownership in place".into(),
            ));
        }
        Ok(deposed)
    }

    /// Every mark of `shard`, read at one revision (in pages): what a new owner starts
    /// from. A value that is not a mark fails the load by its key.
    pub async fn load(&self, shard: u32) -> Result<Vec<(String, Mark)>, ReadError> {
        let prefix = self.shard_prefix(shard);
        let end = prefix_end(prefix.as_bytes());
        let mut from = prefix.clone().into_bytes();
        let mut revision = 0;
        let mut marks = Vec::new();
        loop {
            let options = GetOptions::new()
                .with_range(end.clone())
                .with_limit(PAGE)
                .with_revision(revision);
            let key = from.clone();
            let resp = self
                .members
                .call(|mut c| {
                    let (key, options) = (key.clone(), options.clone());
                    async move { c.get(key, Some(options)).await }
                })
                .await
                .map_err(etcd)?;
            if revision == 0 {
                revision = resp.header().map_or(0, |h| h.revision());
            }
            for kv in resp.kvs() {
                let scope = kv
                    .key()
                    .strip_prefix(prefix.as_bytes())
                    .and_then(|s| std::str::from_utf8(s).ok());
                let scope = scope.ok_or_else(|| ReadError::Corrupt {
                    key: String::from_utf8_lossy(kv.key()).into_owned(),
                    value: String::from_utf8_lossy(kv.value()).into_owned(),
                    reason: "the scope is not UTF-8".into(),
                })?;
                marks.push((scope.to_owned(), self.checked(kv.key(), kv.value())?));
            }
            match (resp.more(), resp.kvs().last()) {
                (true, Some(last)) => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => return Ok(marks),
            }
        }
    }

    /// The mark of one scope (a linearizable read).
    pub async fn get(&self, shard: u32, scope: &str) -> Result<Option<Mark>, ReadError> {
        let key = self.key(shard, scope);
        let resp = self
            .members
            .call(|mut c| {
                let key = key.clone();
                async move { c.get(key, None).await }
            })
            .await
            .map_err(etcd)?;
        match resp.kvs().first() {
            Some(kv) => Ok(Some(self.checked(kv.key(), kv.value())?)),
            None => Ok(None),
        }
    }

    fn checked(&self, key: &[u8], value: &[u8]) -> Result<Mark, ReadError> {
        decode(value).map_err(|reason| ReadError::Corrupt {
            key: String::from_utf8_lossy(key).into_owned(),
            value: String::from_utf8_lossy(value).into_owned(),
            reason: reason.to_string(),
        })
    }
}

/// What the writer reports, for the metrics.
#[derive(Debug)]
pub struct WriterStats {
    /// Seconds per transaction.
    pub commit_seconds: Histogram,
    /// Advances per transaction.
    pub commit_batch_size: Histogram,
}

impl Default for WriterStats {
    fn default() -> WriterStats {
        WriterStats {
            commit_seconds: Histogram::new(crate::metrics::histogram::SECONDS),
            commit_batch_size: Histogram::new(crate::metrics::histogram::BATCH),
        }
    }
}

type Reply = oneshot::Sender<Result<Mark, CommitError>>;

/// The group-commit writer of a cluster's marks: one task, one transaction in flight.
/// Cheap to clone; the task stops when the last handle drops.
#[derive(Clone)]
pub struct MarkWriter {
    queue: mpsc::UnboundedSender<(Advance, Reply)>,
    stats: Arc<WriterStats>,
}

impl MarkWriter {
    /// Starts the writer's task on the current runtime.
    pub fn spawn(marks: EtcdMarks) -> MarkWriter {
        let (queue, rx) = mpsc::unbounded_channel();
        let stats = Arc::new(WriterStats::default());
        tokio::spawn(write(marks, rx, stats.clone()));
        MarkWriter { queue, stats }
    }

    pub fn stats(&self) -> &WriterStats {
        &self.stats
    }

    /// Queues an advance; the receiver answers the mark committed for its scope (the
    /// highest of its batch) once its transaction has committed.
    pub fn begin_advance(&self, advance: Advance) -> oneshot::Receiver<Result<Mark, CommitError>> {
        let (reply, rx) = oneshot::channel();
        if let Err(mpsc::error::SendError((_, reply))) = self.queue.send((advance, reply)) {
            let _ = reply.send(Err(CommitError::Stopped));
        }
        rx
    }

    /// [`begin_advance`](MarkWriter::begin_advance), waited for.
    pub async fn advance(&self, advance: Advance) -> Result<Mark, CommitError> {
        self.begin_advance(advance)
            .await
            .unwrap_or(Err(CommitError::Stopped))
    }
}

/// One scope's advances in a batch: the highest, and everyone waiting on it.
struct Merged {
    advance: Advance,
    replies: Vec<Reply>,
}

async fn write(
    marks: EtcdMarks,
    mut rx: mpsc::UnboundedReceiver<(Advance, Reply)>,
    stats: Arc<WriterStats>,
) {
    let mut queued = Vec::with_capacity(MAX_BATCH);
    while rx.recv_many(&mut queued, MAX_BATCH).await > 0 {
        // The highest per (shard, epoch, scope). An advance under an older epoch of a
        // shard is kept apart: it fails its guard on its own.
        let mut merged: BTreeMap<(u32, u64, Arc<str>), Merged> = BTreeMap::new();
        for (advance, reply) in queued.drain(..) {
            let key = (advance.shard, advance.epoch, advance.scope.clone());
            match merged.get_mut(&key) {
                Some(m) => {
                    m.advance.mark = m.advance.mark.max(advance.mark);
                    m.replies.push(reply);
                }
                None => {
                    merged.insert(
                        key,
                        Merged {
                            advance,
                            replies: vec![reply],
                        },
                    );
                }
            }
        }
        let mut pending: Vec<Merged> = merged.into_values().collect();
        while !pending.is_empty() {
            let chunk = take_chunk(&mut pending);
            commit_chunk(&marks, chunk, &stats).await;
        }
    }
}

/// Takes from the front of `pending` (sorted by shard, epoch, scope) at most
/// [`MAX_TXN_OPS`] advances, with each shard under one epoch.
fn take_chunk(pending: &mut Vec<Merged>) -> Vec<Merged> {
    let mut seen: BTreeMap<u32, u64> = BTreeMap::new();
    let mut n = 0;
    for m in pending.iter() {
        if n == MAX_TXN_OPS {
            break;
        }
        match seen.get(&m.advance.shard) {
            Some(&e) if e != m.advance.epoch => break,
            _ => {
                seen.insert(m.advance.shard, m.advance.epoch);
            }
        }
        n += 1;
    }
    pending.drain(..n).collect()
}

/// Commits one chunk; drops the deposed shards' advances (answered `Deposed`) and commits
/// the rest again, until it commits or nothing is left.
async fn commit_chunk(marks: &EtcdMarks, mut chunk: Vec<Merged>, stats: &WriterStats) {
    let mut deposed: BTreeSet<(u32, u64)> = BTreeSet::new();
    loop {
        let advances: Vec<Advance> = chunk.iter().map(|m| m.advance.clone()).collect();
        if advances.is_empty() {
            return;
        }
        let started = Instant::now();
        let outcome = marks.commit_one(&advances).await;
        stats.commit_seconds.observe_duration(started.elapsed());
        stats.commit_batch_size.observe(advances.len() as f64);
        match outcome {
            Ok(lost) if lost.is_empty() => {
                for m in chunk {
                    for r in m.replies {
                        let _ = r.send(Ok(m.advance.mark));
                    }
                }
                return;
            }
            Ok(lost) => {
                // Each round removes at least one shard, so this ends.
                deposed.extend(lost);
                let (gone, kept): (Vec<Merged>, Vec<Merged>) = chunk
                    .into_iter()
                    .partition(|m| deposed.contains(&(m.advance.shard, m.advance.epoch)));
                for m in gone {
                    let e = CommitError::Deposed {
                        shard: m.advance.shard,
                        epoch: m.advance.epoch,
                    };
                    for r in m.replies {
                        let _ = r.send(Err(e.clone()));
                    }
                }
                chunk = kept;
            }
            Err(e) => {
                tracing::warn!(error = %e, advances = advances.len(), "cluster marks: commit outcome unknown");
                for m in chunk {
                    for r in m.replies {
                        let _ = r.send(Err(e.clone()));
                    }
                }
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_is_stored_as_the_headers_spell_it_and_read_back_strictly() {
        let cases = [
            (Mark::of(Token::new(0, 7)), "7"),
            (Mark::of(Token::new(3, 12)), "3:12"),
            (
                Mark {
                    token: Token::new(3, 12),
                    sequence: Some(0),
                },
                "3:12 0",
            ),
            (
                Mark {
                    token: Token::new(u64::MAX, u64::MAX),
                    sequence: Some(u64::MAX),
                },
                "18446744073709551615:18446744073709551615 18446744073709551615",
            ),
        ];
        for (mark, text) in cases {
            assert_eq!(encode(&mark), text.as_bytes());
            assert_eq!(decode(text.as_bytes()), Ok(mark));
        }
        for bad in [
            "", " ", "7 ", "07", "7  1", "7 1 2", "7 01", "a", "7:", "1:2:3", "7 -1",
        ] {
            assert!(decode(bad.as_bytes()).is_err(), "{bad:?} must not read");
        }
    }

    #[test]
    fn a_prefix_range_ends_after_every_key_that_starts_with_it() {
        assert_eq!(prefix_end(b"a/1/"), b"a/10".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }

    fn merged(shard: u32, epoch: u64, scope: &str) -> Merged {
        Merged {
            advance: Advance {
                shard,
                epoch,
                scope: scope.into(),
                mark: Mark::of(Token::new(0, 1)),
            },
            replies: Vec::new(),
        }
    }

    #[test]
    fn a_chunk_holds_at_most_the_txn_limit_and_one_epoch_per_shard() {
        let mut pending: Vec<Merged> = (0..300)
            .map(|i| merged(i % 3, 5, &format!("s{i:03}")))
            .collect();
        pending.sort_by(|a, b| {
            (a.advance.shard, a.advance.epoch, &a.advance.scope).cmp(&(
                b.advance.shard,
                b.advance.epoch,
                &b.advance.scope,
            ))
        });
        let sizes: Vec<usize> =
            std::iter::from_fn(|| (!pending.is_empty()).then(|| take_chunk(&mut pending).len()))
                .collect();
        assert_eq!(sizes, vec![128, 128, 44]);

        let mut pending = vec![merged(1, 5, "a"), merged(1, 6, "a"), merged(2, 5, "b")];
        assert_eq!(
            take_chunk(&mut pending).len(),
            1,
            "shard 1 under two epochs"
        );
        assert_eq!(take_chunk(&mut pending).len(), 2);
        assert!(pending.is_empty());
    }
}
