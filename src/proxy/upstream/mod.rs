//! Connections to plain-HTTP upstreams: the per-worker pools of idle connections
//! ([`pool`]) and fencegate's own lean HTTP/1.1 exchange ([`h1`]).

pub mod h1;
pub mod pool;
