//! fencegate: a reverse proxy that enforces fencing tokens in front of backends that
//! cannot compare them, with the lease authority that issues the tokens and a client
//! library that carries them.
//!
//! Module map, in the order a request meets them:
//! - [`server`]: listeners, connection and request-head limits, h2 bounds, graceful
//!   shutdown, SIGHUP reload; [`timer`]: the workers' coarse per-request deadlines
//! - [`tls`]: HTTPS on the listener (optional client certificates, files re-read on
//!   SIGHUP) and the client side of https upstreams
//! - [`route`]: canonical paths, route templates, scope rendering (SPEC §2)
//! - [`token`]: the `Fencing-Token` grammar and order (SPEC §1); [`proof`]: the
//!   authority's Ed25519 proofs that a token was issued for a scope (SPEC §9)
//! - [`fence`]: the decision table, the durable marks in redb, the per-scope gates (SPEC §3)
//! - [`proxy`]: the pipeline as tower layers over the forwarder, and every response of
//!   fencegate's own (SPEC §4): [`proxy::fence`] (routing, token, gate, refusals: the
//!   [`FenceLayer`](proxy::fence::FenceLayer) a Rust service can put in front of its own
//!   handlers), [`proxy::idempotency`] (`Idempotency-Key` records per scope: fingerprint,
//!   durable claim, replay, expiry), [`proxy::forward`] (the upstream exchange)
//!
//! Beside the request path:
//! - [`admin`]: health, readiness, metrics and the marks API (SPEC §7); [`metrics`]: the
//!   Prometheus counters, histograms and gauges it serves
//! - [`authority`]: the lease authority (SPEC §8), `local` (redb) or `etcd` backend behind
//!   one HTTP API
//! - [`client`]: the Rust client: leases as capabilities, background renewal, fenced
//!   requests with typed results
//! - [`config`]: the TOML file, validated with every error's key path (SPEC §5)
//! - [`cli`]: the commands (SPEC §6); [`demo`]: the paused-writer story against a built-in
//!   legacy store
#![forbid(unsafe_code)]

pub mod access_log;
pub mod admin;
pub mod authority;
pub mod cli;
pub mod client;
pub mod config;
pub mod demo;
mod drain;
pub mod fence;
mod first_bytes;
mod h1_scan;
mod h2_idle;
pub mod metrics;
pub mod proof;
pub mod proxy;
/// The idempotency stage lives in [`proxy::idempotency`]; its route options are read by
/// [`config`] by this path.
pub use proxy::idempotency;
pub mod route;
pub mod server;
pub mod timer;
pub mod tls;
pub mod token;
