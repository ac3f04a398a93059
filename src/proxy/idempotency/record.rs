//! A record's value: its state (in flight, unknown, released, or the completed answer)
//! and the request's fingerprint, encoded with its expiry; written within a bound on the
//! disk's wait, and collected once expired.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::fingerprint;
use crate::store::{MarkStore, StoreError};

/// Why a record was not written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(super) enum RecordError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("not committed within {0:?}")]
    NotCommitted(Duration),
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) enum State {
    InFlight,
    /// Sent; no response came back. The upstream may or may not have applied it.
    Unknown,
    /// Provably not applied (never reached the upstream): a retry may claim the key.
    Released,
    Completed {
        status: u16,
        headers: Vec<(String, Vec<u8>)>,
        /// False when the body was larger than `max_response_body`.
        body_stored: bool,
    },
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Meta {
    pub(super) fingerprint: String,
    /// What `fingerprint` covers ([`fingerprint::VERSION`]); absent from the records of
    /// versions before it, whose fingerprints covered no header (1).
    #[serde(default = "first_fingerprint_version")]
    pub(super) fingerprint_version: u32,
    pub(super) state: State,
    /// Which process run claimed it: an in-flight record of an earlier run is unknown.
    pub(super) boot: u64,
}

impl Meta {
    /// A record of this version's fingerprint.
    pub(super) fn new(fingerprint: String, state: State, boot: u64) -> Meta {
        Meta {
            fingerprint,
            fingerprint_version: fingerprint::VERSION,
            state,
            boot,
        }
    }

    /// Whether this record was made for the request fingerprinted `fingerprint` (by
    /// this version). A record of another fingerprint version is not: its fingerprint
    /// covered other parts of its request (a version 1 record, no header at all), so a
    /// retry that matched it could still be another request. It is answered
    /// `key_reused`, never `duplicate`.
    pub(super) fn made_for(&self, fingerprint: &str) -> bool {
        self.fingerprint_version == fingerprint::VERSION && self.fingerprint == fingerprint
    }
}

fn first_fingerprint_version() -> u32 {
    1
}

/// Record layout: expiry (8 bytes, big-endian unix seconds) · JSON length (4) · JSON · body.
pub(super) fn encode(expires: u64, meta: &Meta, body: &[u8]) -> Vec<u8> {
    let json = serde_json::to_vec(meta).unwrap_or_default();
    let mut v = Vec::with_capacity(12 + json.len() + body.len());
    v.extend_from_slice(&expires.to_be_bytes());
    v.extend_from_slice(&(json.len() as u32).to_be_bytes());
    v.extend_from_slice(&json);
    v.extend_from_slice(body);
    v
}

pub(super) fn decode(v: &[u8]) -> Option<(Meta, &[u8])> {
    let len = u32::from_be_bytes(v.get(8..12)?.try_into().ok()?) as usize;
    let json = v.get(12..12 + len)?;
    let body = v.get(12 + len..)?;
    Some((serde_json::from_slice(json).ok()?, body))
}

/// Writes a record, waiting at most `wait` for the disk (a hung disk must not hold an
/// answer the upstream already gave); the write itself is committed whether or not it is
/// waited for.
pub(super) async fn put_within(
    store: &MarkStore,
    key: String,
    value: Vec<u8>,
    wait: Duration,
) -> Result<(), RecordError> {
    match crate::rt::timer::timeout_from(
        std::time::Instant::now(),
        wait,
        store.put_record(key, value),
    )
    .await
    {
        Ok(done) => Ok(done?),
        Err(_) => Err(RecordError::NotCommitted(wait)),
    }
}

/// Seconds since the Unix epoch, for records' expiry.
pub(super) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// How often expired records are collected.
pub const COLLECT_EVERY: Duration = Duration::from_secs(60);
/// Expired records deleted per write transaction.
pub(super) const COLLECT_BATCH: usize = 1000;

/// Deletes expired records `batch` at a time until a batch comes back short. No cap on
/// the batches: records that expire faster than a capped run deletes would grow the table
/// without bound. Each batch is one short write transaction queued with the proxy's own
/// commits, and the task yields between batches.
pub(super) async fn collect_expired(store: &MarkStore, batch: usize) -> usize {
    let mut total = 0;
    loop {
        match store.collect_records(now_secs(), batch).await {
            Ok(n) => {
                total += n;
                if n < batch {
                    return total;
                }
            }
            Err(_) => return total,
        }
        tokio::task::yield_now().await;
    }
}

/// Whether `meta`'s fingerprint was made by this version's [`fingerprint`].
pub(super) fn fingerprint_version_is_current(meta: &Meta) -> bool {
    meta.fingerprint_version == fingerprint::VERSION
}
