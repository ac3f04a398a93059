//! The idempotency records' tables: records keyed by scope and key, their expiry index
//! and their owners, with the bookkeeping that keeps the three in step and within quota.

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use super::Claimed;

use crate::store::quota::{self, Changes, Delta, RecordQuota, Rejected, Tally, Volume};

/// Idempotency records: "scope\0key" → 8 bytes expiry (unix seconds, big-endian) + record.
pub(super) const RECORDS: TableDefinition<&str, &[u8]> = TableDefinition::new("idempotency");

/// (expiry, record key), so expired records are found without a scan.
pub(super) const RECORD_EXPIRY: TableDefinition<(u64, &str), ()> =
    TableDefinition::new("idempotency_expiry");

/// Record key → (client, bytes counted for it): who a record counts against in the
/// quotas, and how much (a record in flight counts as its largest completion). A record
/// without a row (made before quotas, or an S3 upload's) counts against the client ""
/// with its own size.
pub(super) const RECORD_OWNER: TableDefinition<&str, (&str, u64)> =
    TableDefinition::new("idempotency_owner");

/// Expired records a refused claim deletes first, in its own transaction.
pub(super) const RECLAIM_BATCH: usize = 256;

/// An idempotency claim, as the writer takes it from its queue.
pub(super) struct Claim<'a> {
    pub(super) key: &'a String,
    pub(super) value: &'a Vec<u8>,
    pub(super) replace_if: Option<&'a Vec<u8>>,
    pub(super) now: u64,
    /// The client it counts against and its bounds; none: counted, never refused.
    pub(super) quota: Option<&'a (String, RecordQuota)>,
}

/// The records' usage as the file holds it (once, at open; bounded by the records).
pub(super) fn tally_records(db: &Database) -> Result<Tally, redb::Error> {
    let txn = db.begin_read()?;
    let records = txn.open_table(RECORDS)?;
    let owners = txn.open_table(RECORD_OWNER)?;
    let mut changes = Changes::default();
    for item in records.iter()? {
        let (k, v) = item?;
        let key = k.value();
        let (client, bytes) = owner_of(&owners, key, v.value().len())?;
        changes.add(quota::scope_of(key), &client, Delta::of(1, bytes));
    }
    let mut tally = Tally::default();
    tally.apply(&changes);
    Ok(tally)
}

/// Who a record counts against and its bytes (see [`RECORD_OWNER`]).
pub(super) fn owner_of(
    owners: &impl ReadableTable<&'static str, (&'static str, u64)>,
    key: &str,
    value_len: usize,
) -> Result<(String, u64), redb::StorageError> {
    Ok(match owners.get(key)? {
        Some(g) => {
            let (client, bytes) = g.value();
            (client.to_string(), bytes)
        }
        None => (String::new(), quota::size_of(key, value_len)),
    })
}

/// The idempotency tables of one write transaction, and the usage it changes.
pub(super) struct RecordTables<'a, 't> {
    pub(super) records: &'a mut redb::Table<'t, &'static str, &'static [u8]>,
    pub(super) expiry: &'a mut redb::Table<'t, (u64, &'static str), ()>,
    pub(super) owners: &'a mut redb::Table<'t, &'static str, (&'static str, u64)>,
    pub(super) usage: &'a mut Changes,
}

impl RecordTables<'_, '_> {
    /// Deletes the record under `key` (if any), with its expiry entry and owner row.
    pub(super) fn remove(&mut self, key: &str) -> Result<(), redb::Error> {
        let Some(old) = self.records.remove(key)?.map(|g| g.value().to_vec()) else {
            return Ok(());
        };
        let (client, bytes) = owner_of(&*self.owners, key, old.len())?;
        self.expiry.remove((record_expiry(&old), key))?;
        self.owners.remove(key)?;
        self.usage
            .add(quota::scope_of(key), &client, Delta::of(1, bytes).neg());
        Ok(())
    }

    /// Inserts a new record counted as `bytes` against `client`.
    pub(super) fn insert(
        &mut self,
        key: &str,
        value: &[u8],
        client: &str,
        bytes: u64,
    ) -> Result<(), redb::Error> {
        self.records.insert(key, value)?;
        self.expiry.insert((record_expiry(value), key), ())?;
        self.owners.insert(key, (client, bytes))?;
        self.usage
            .add(quota::scope_of(key), client, Delta::of(1, bytes));
        Ok(())
    }

    /// Overwrites a record (its expiry unchanged); it now counts as its own size.
    pub(super) fn replace(&mut self, key: &str, value: &[u8]) -> Result<(), redb::Error> {
        let old_len = self.records.get(key)?.map_or(0, |g| g.value().len());
        let (client, old) = owner_of(&*self.owners, key, old_len)?;
        let new = quota::size_of(key, value.len());
        self.records.insert(key, value)?;
        self.owners.insert(key, (client.as_str(), new))?;
        let scope = quota::scope_of(key);
        self.usage.add(scope, &client, Delta::of(1, new));
        self.usage.add(scope, &client, Delta::of(1, old).neg());
        Ok(())
    }

    /// Deletes up to `limit` records expired by `now`; answers how many.
    pub(super) fn collect(&mut self, now: u64, limit: usize) -> Result<usize, redb::Error> {
        let due: Vec<String> = self
            .expiry
            .range(..(now + 1, ""))?
            .take(limit)
            .map(|item| item.map(|(k, _)| k.value().1.to_string()))
            .collect::<Result<_, _>>()?;
        for key in &due {
            self.remove(key)?;
        }
        Ok(due.len())
    }

    /// Which bound one more record would pass, if any: the quota's, then the volume's
    /// free space (asked only when the counts allow the record).
    pub(super) fn refuses(
        &self,
        tally: &Tally,
        key: &str,
        client: &str,
        bytes: u64,
        q: &RecordQuota,
        volume: &Option<Volume>,
    ) -> Option<Rejected> {
        self.usage
            .refuses(tally, quota::scope_of(key), client, bytes, q)
            .or_else(|| {
                let free = volume.as_ref().and_then(Volume::free)?;
                (free < q.min_free.saturating_add(bytes)).then_some(Rejected::Disk)
            })
    }

    /// Claims `c.key` for a request unless a live record holds it (answered instead), or
    /// its client's quota or the volume refuses it. `changed`: the tables were written.
    pub(super) fn claim(
        &mut self,
        tally: &Tally,
        volume: &Option<Volume>,
        c: Claim<'_>,
        changed: &mut bool,
    ) -> Result<Claimed, redb::Error> {
        let Claim {
            key,
            value,
            replace_if,
            now,
            quota,
        } = c;
        let existing = self.records.get(key.as_str())?.map(|g| g.value().to_vec());
        let live = existing
            .as_ref()
            .filter(|v| record_expiry(v) > now && Some(*v) != replace_if);
        Ok(match live {
            Some(v) => Claimed::Held(v.clone()),
            None => {
                let (client, bytes) = match quota {
                    Some((client, q)) => (
                        client.as_str(),
                        q.reserve.max(quota::size_of(key, value.len())),
                    ),
                    None => ("", quota::size_of(key, value.len())),
                };
                if existing.is_some() {
                    self.remove(key)?;
                }
                let refused = match quota {
                    Some((_, q)) => {
                        let refused = self.refuses(tally, key, client, bytes, q, volume);
                        if refused.is_some() {
                            // Expired records first: what they free may be enough.
                            *changed |= self.collect(now, RECLAIM_BATCH)? > 0;
                            self.refuses(tally, key, client, bytes, q, volume)
                        } else {
                            None
                        }
                    }
                    None => None,
                };
                match refused {
                    Some(r) => {
                        // An expired record taken out above stays out.
                        *changed |= existing.is_some();
                        Claimed::Rejected(r)
                    }
                    None => {
                        self.insert(key, value, client, bytes)?;
                        *changed = true;
                        Claimed::Claimed
                    }
                }
            }
        })
    }
}

/// The expiry stamped at the front of an idempotency record.
pub(super) fn record_expiry(value: &[u8]) -> u64 {
    value
        .get(..8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map_or(0, u64::from_be_bytes)
}
