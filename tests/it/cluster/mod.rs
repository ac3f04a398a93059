//! The cluster (SPEC §10), so far shard ownership and marks in etcd, against a real
//! 3-member etcd on loopback.

mod faults;
mod marks;
mod member;
mod owned;
mod ownership;
mod procs;
mod registry;
mod serve;
