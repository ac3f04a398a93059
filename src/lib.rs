//! fencegate: a reverse proxy that enforces fencing tokens in front of backends that
//! cannot compare them, with the lease authority that issues the tokens and a client
//! library that carries them. `docs/ARCHITECTURE.md` draws the tree and a request's way
//! through it; `docs/SPEC.md` is the contract the code's "SPEC §n" notes cite.
//!
//! Module map, in the order a request meets them:
//! - [`listen`]: plumbing: accept loop, connection limits, first bytes, HTTP/1 head scan,
//!   HTTP/2 idle and send bounds, graceful drain; serves any handler
//! - [`tls`]: HTTPS on the listeners (optional client certificates, files re-read on
//!   SIGHUP) and the client side of https upstreams
//! - [`proxy`]: the service the proxy listener runs: classify, the fence and idempotency
//!   in front of the forwarder, every response of its own (SPEC §4)
//! - [`route`]: canonical paths, route templates, scope rendering (SPEC §2)
//! - [`token`]: the `Fencing-Token` grammar and order (SPEC §1); [`proof`]: the
//!   authority's Ed25519 proofs that a token was issued for a scope (SPEC §9)
//! - [`fence`]: the decision table and the per-scope gates (SPEC §3)
//! - [`idempotency`]: `Idempotency-Key` records per scope: fingerprint, durable claim,
//!   replay, expiry
//! - [`store`]: the durable marks in redb and their write-ahead journal
//!
//! Beside the request path:
//! - [`admin`]: health, readiness, metrics and the marks API (SPEC §7); [`metrics`]: the
//!   Prometheus counters, histograms and gauges it serves; [`access_log`]: one line per
//!   request, and refusal warnings
//! - [`authority`]: the lease authority (SPEC §8), `local` (redb) or `etcd` backend behind
//!   one HTTP API
//! - [`client`]: the Rust client: leases as capabilities, background renewal, fenced
//!   requests with typed results
//! - [`config`]: the TOML file, validated with every error's key path (SPEC §5)
//! - [`rt`]: runtime plumbing: coarse timers and deadlines, drain
//! - [`app`]: the wiring (start, reload, shutdown), imported only by `main` and [`cli`];
//!   [`cli`]: the commands (SPEC §6) and the demo
#![forbid(unsafe_code)]

pub mod access_log;
pub mod admin;
pub mod app;
pub mod authority;
mod body;
pub mod cli;
pub mod client;
pub mod config;
pub mod fence;
pub mod idempotency;
pub mod listen;
pub mod metrics;
pub mod proof;
pub mod proxy;
pub mod route;
pub mod rt;
pub mod store;
pub mod tls;
pub mod token;
