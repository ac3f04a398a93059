//! The lease authority (SPEC §8, §9) over real sockets: its API, its metrics, trust, and
//! the etcd backend against a real etcd on loopback.

mod api;
mod etcd;
mod etcd_metrics;
mod metrics;
mod trust;
