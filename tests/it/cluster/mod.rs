//! The cluster (SPEC §10), so far shard ownership against a real 3-member etcd on loopback.

mod ownership;
