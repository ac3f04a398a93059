//! Several fencegate instances enforcing one fence (SPEC §10). Built so far: the shard
//! map ([`shard`]: which shard a scope belongs to) and, with the `etcd` feature, shard
//! ownership on etcd ([`ownership`]: claims, self-fencing validity, release, the takeover
//! wait). Not yet wired into `serve`: marks in etcd, forwarding to the owner and the
//! admin view come next.

#[cfg(feature = "etcd")]
pub mod ownership;
pub mod shard;
