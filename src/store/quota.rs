//! What the idempotency records take on disk: their count and bytes over the whole store,
//! per scope and per client, kept in memory by the writer (rebuilt from the file at open)
//! so that a claim past a bound is refused without a read, and the free space of the
//! store's volume, below which no new record is made.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Records and bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub records: u64,
    pub bytes: u64,
}

impl Usage {
    fn add(&mut self, d: Delta) {
        self.records = self.records.saturating_add_signed(d.records);
        self.bytes = self.bytes.saturating_add_signed(d.bytes);
    }

    fn with(self, d: Delta) -> Usage {
        let mut u = self;
        u.add(d);
        u
    }

    /// Whether `self` plus one record of `bytes` stays within `limit`.
    fn fits(self, bytes: u64, limit: Usage) -> bool {
        self.records < limit.records && self.bytes.saturating_add(bytes) <= limit.bytes
    }
}

/// A change to a [`Usage`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Delta {
    pub records: i64,
    pub bytes: i64,
}

impl Delta {
    fn add(&mut self, d: Delta) {
        self.records += d.records;
        self.bytes += d.bytes;
    }

    pub(crate) fn of(records: i64, bytes: u64) -> Delta {
        Delta {
            records,
            bytes: i64::try_from(bytes).unwrap_or(i64::MAX),
        }
    }

    pub(crate) fn neg(self) -> Delta {
        Delta {
            records: -self.records,
            bytes: -self.bytes,
        }
    }
}

/// The bounds a new idempotency record is claimed within.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordQuota {
    pub total: Usage,
    pub per_scope: Usage,
    pub per_client: Usage,
    /// Bytes counted for a record from its claim until its completion is written: the
    /// most it may grow to (its response body, head and key), so that records in flight
    /// cannot together overshoot the bounds once they complete.
    pub reserve: u64,
    /// Free bytes the store's volume keeps: no new record is made below it, so the
    /// marks' commits always find room.
    pub min_free: u64,
}

/// Which bound refused a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejected {
    /// `idempotency.max_records` / `max_record_bytes`: the whole store.
    Store,
    /// `max_records_per_scope` / `max_record_bytes_per_scope`.
    Scope,
    /// `max_records_per_client` / `max_record_bytes_per_client`.
    Client,
    /// The store's volume has less than `store.min_free` free.
    Disk,
}

impl Rejected {
    pub fn describe(self) -> &'static str {
        match self {
            Rejected::Store => "the store holds as many idempotency records as it may",
            Rejected::Scope => "this scope holds as many idempotency records as it may",
            Rejected::Client => "this client holds as many idempotency records as it may",
            Rejected::Disk => "the store's volume is short of free space",
        }
    }
}

/// A record's owner: the scope is the part of its key before the first NUL.
pub(crate) fn scope_of(key: &str) -> &str {
    key.split('\0').next().unwrap_or(key)
}

/// The bytes counted for a record: its key and value.
pub(crate) fn size_of(key: &str, value_len: usize) -> u64 {
    (key.len() + value_len) as u64
}

/// Every record's count and bytes, in total, per scope and per client. A scope or client
/// is listed only while it has records, so the maps are bounded by the records.
/// The client a new record counts against: its address, an IPv6 one by its /64, as
/// `max_connections_per_ip` counts it (a host may use every address of its /64, and
/// would otherwise have a quota per address).
pub(crate) fn client_key(ip: std::net::IpAddr) -> String {
    crate::listen::client_of(ip).to_string()
}

#[derive(Debug, Default)]
pub struct Tally {
    pub total: Usage,
    scopes: HashMap<String, Usage>,
    clients: HashMap<String, Usage>,
}

impl Tally {
    pub(crate) fn apply(&mut self, changes: &Changes) {
        self.total.add(changes.total);
        for (map, deltas) in [
            (&mut self.scopes, &changes.scopes),
            (&mut self.clients, &changes.clients),
        ] {
            for (name, d) in deltas {
                let u = map.entry(name.clone()).or_default();
                u.add(*d);
                if u.records == 0 {
                    map.remove(name);
                }
            }
        }
    }

    /// The usage of `scope` and `client`.
    pub fn of(&self, scope: &str, client: &str) -> (Usage, Usage) {
        (
            self.scopes.get(scope).copied().unwrap_or_default(),
            self.clients.get(client).copied().unwrap_or_default(),
        )
    }

    /// Scopes and clients tracked (for tests: bounded by the records).
    pub fn owners(&self) -> (usize, usize) {
        (self.scopes.len(), self.clients.len())
    }
}

/// The changes one write transaction makes, applied to the [`Tally`] once committed.
#[derive(Debug, Default)]
pub(crate) struct Changes {
    total: Delta,
    scopes: HashMap<String, Delta>,
    clients: HashMap<String, Delta>,
}

impl Changes {
    pub(crate) fn add(&mut self, scope: &str, client: &str, d: Delta) {
        self.total.add(d);
        self.scopes.entry(scope.to_string()).or_default().add(d);
        self.clients.entry(client.to_string()).or_default().add(d);
    }

    /// Which bound, if any, one more record of `bytes` for (`scope`, `client`) would pass,
    /// counting what `tally` holds and these changes.
    pub(crate) fn refuses(
        &self,
        tally: &Tally,
        scope: &str,
        client: &str,
        bytes: u64,
        quota: &RecordQuota,
    ) -> Option<Rejected> {
        let (s, c) = tally.of(scope, client);
        let s = s.with(self.scopes.get(scope).copied().unwrap_or_default());
        let c = c.with(self.clients.get(client).copied().unwrap_or_default());
        let t = tally.total.with(self.total);
        if !t.fits(bytes, quota.total) {
            Some(Rejected::Store)
        } else if !s.fits(bytes, quota.per_scope) {
            Some(Rejected::Scope)
        } else if !c.fits(bytes, quota.per_client) {
            Some(Rejected::Client)
        } else {
            None
        }
    }
}

/// The volume the store file is on, asked for its free space.
#[derive(Debug, Clone)]
pub(crate) struct Volume(PathBuf);

impl Volume {
    /// The volume of the store file at `path` (its directory).
    pub(crate) fn of(path: &Path) -> Volume {
        match path.parent().filter(|d| !d.as_os_str().is_empty()) {
            Some(dir) => Volume(dir.to_path_buf()),
            None => Volume(PathBuf::from(".")),
        }
    }

    /// Bytes an unprivileged writer may still use; `None` when it cannot be told.
    pub(crate) fn free(&self) -> Option<u64> {
        let st = rustix::fs::statvfs(&self.0).ok()?;
        Some(st.f_bavail.saturating_mul(st.f_frsize))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two addresses of one IPv6 /64 are one client, and so are an IPv4 address and its
    /// IPv4-mapped IPv6 spelling; two /64s are two.
    #[test]
    fn a_client_is_its_address_or_its_ipv6_64() {
        let key = |s: &str| client_key(s.parse().expect("address"));
        assert_eq!(key("2001:db8:1:2::1"), key("2001:db8:1:2:ffff:1:2:3"));
        assert_ne!(key("2001:db8:1:2::1"), key("2001:db8:1:3::1"));
        assert_eq!(key("::ffff:192.0.2.7"), key("192.0.2.7"));
        assert_ne!(key("192.0.2.7"), key("192.0.2.8"));
    }

    fn quota(n: u64) -> RecordQuota {
        let u = Usage {
            records: n,
            bytes: 1000,
        };
        RecordQuota {
            total: Usage {
                records: 10,
                bytes: 10_000,
            },
            per_scope: u,
            per_client: u,
            reserve: 100,
            min_free: 0,
        }
    }

    /// Each bound refuses the record past it; owners leave the tally with their last record.
    #[test]
    fn each_bound_refuses_past_it_and_owners_go_with_their_records() {
        let mut tally = Tally::default();
        let mut c = Changes::default();
        let q = quota(2);
        assert_eq!(c.refuses(&tally, "s", "a", 100, &q), None);
        c.add("s", "a", Delta::of(1, 100));
        c.add("s", "a", Delta::of(1, 100));
        assert_eq!(c.refuses(&tally, "s", "b", 100, &q), Some(Rejected::Scope));
        assert_eq!(c.refuses(&tally, "t", "a", 100, &q), Some(Rejected::Client));
        assert_eq!(c.refuses(&tally, "t", "b", 100, &q), None);
        assert_eq!(
            c.refuses(&tally, "t", "b", 1001, &q),
            Some(Rejected::Scope),
            "bytes count as well as records"
        );
        tally.apply(&c);
        assert_eq!(tally.total.records, 2);
        let mut big = quota(100);
        big.total.records = 2;
        assert_eq!(
            Changes::default().refuses(&tally, "u", "c", 1, &big),
            Some(Rejected::Store)
        );
        let mut gone = Changes::default();
        gone.add("s", "a", Delta::of(1, 100).neg());
        gone.add("s", "a", Delta::of(1, 100).neg());
        tally.apply(&gone);
        assert_eq!(tally.owners(), (0, 0));
        assert_eq!(tally.total, Usage::default());
    }

    #[test]
    fn scopes_are_the_keys_before_the_nul() {
        assert_eq!(scope_of("a/b\0key"), "a/b");
        assert_eq!(scope_of("upload-id"), "upload-id");
    }
}
