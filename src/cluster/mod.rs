//! Several fencegate instances enforcing one fence (SPEC §10). Without the `etcd`
//! feature: the shard map ([`shard`]: which shard a scope belongs to), the balance
//! ([`balance`]: which instance should own each shard) and the `[cluster]` section
//! ([`config`]). With it: shard ownership on etcd ([`ownership`]: claims, self-fencing
//! validity, release, the takeover wait), the instance registry and the watched view
//! ([`registry`]), the membership loop ([`member`]: claims, `fence_command`, hand-offs),
//! the marks in etcd ([`marks`]: guarded group commit, load), the owned shards the gates
//! decide on ([`owned`]) and `serve`'s handle on all of it ([`node`]: the proxy's
//! placement, the admin view). `docs/ARCHITECTURE.md` ("The cluster") has the picture.

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
