//! Several fencegate instances enforcing one fence (SPEC §10). Built so far: the shard
//! map ([`shard`]: which shard a scope belongs to), the balance ([`balance`]: which
//! instance should own each shard), the `[cluster]` section ([`config`]:
//! checked, then refused, as serving is not built), and with the `etcd` feature shard
//! ownership on etcd ([`ownership`]: claims, self-fencing validity, release, the takeover
//! wait) and the marks in etcd ([`marks`]: guarded group commit, load). Not yet wired
//! into `serve`: the gate on etcd's marks, forwarding to the owner and the admin view
//! come next.

pub mod balance;
pub mod config;
#[cfg(feature = "etcd")]
pub mod marks;
#[cfg(feature = "etcd")]
pub mod member;
#[cfg(feature = "etcd")]
pub mod node;
#[cfg(feature = "etcd")]
pub mod owned;
#[cfg(feature = "etcd")]
pub mod ownership;
#[cfg(feature = "etcd")]
pub mod registry;
pub mod shard;
