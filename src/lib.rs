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
//! - [`proxy`]: one request's phases over its context (`proxy::context`: connection,
//!   plan, the typed verdict), stages of one trait (`proxy::stage`), and every response of
//!   fencegate's own (SPEC §4): [`proxy::fence`] (routing, token, gate, refusals: the
//!   [`FenceLayer`](proxy::fence::FenceLayer) a Rust service can put in front of its own
//!   handlers), [`proxy::idempotency`] (`Idempotency-Key` records per scope: fingerprint,
//!   durable claim, replay, expiry), [`proxy::forward`] (the upstream exchange, by phase),
//!   [`proxy::upstream`] (the pool and the lean HTTP/1.1 exchange); what it reads in
//!   force is its own [`proxy::Settings`], built from the file's sections
//! - [`route`]: canonical paths, route templates, scope rendering (SPEC §2)
//! - [`token`]: the `Fencing-Token` grammar and order (SPEC §1); [`proof`]: the
//!   authority's Ed25519 proofs that a token was issued for a scope (SPEC §9)
//! - [`fence`]: the decision table and the per-scope gates (SPEC §3), one concern per
//!   file under [`fence::gate`]: state, decide, admit, commit, guard, the sharded map
//! - [`store`]: the durable marks in redb ([`store::marks`]: handle, writer thread, tables,
//!   idempotency records, recovery, read-only reader) and their write-ahead journal
//!
//! Beside the request path:
//! - [`admin`]: health, readiness, metrics and the marks API (SPEC §7); [`metrics`]: the
//!   request series and the histogram, and [`FmtMetrics`](metrics::FmtMetrics), by which
//!   the store, the authority and the cluster render their own series for `/metrics`;
//!   [`access_log`]: one line per request, and refusal warnings
//! - [`authority`]: the lease authority (SPEC §8), `local` (redb) or `etcd` backend behind
//!   one HTTP API; the etcd backend is a folder (acquire, lease, the client per member)
//! - [`cluster`]: several instances on one fence through etcd (SPEC §10): shards and
//!   their owners, marks in etcd, hops to the owner, hand-offs and takeovers
//! - [`client`]: the Rust client: leases as capabilities, background renewal, fenced
//!   requests with typed results
//! - [`config`]: a leaf: how a section is read (the error accumulator with every error's
//!   key path, the value checks); each subsystem reads its own section with it
//! - [`settings`]: the TOML file assembled from the subsystems' sections and validated
//!   (SPEC §5); above the domain, imported by the wiring, the commands and the runtime
//!   types that hold the whole file. The routes and upstreams are the proxy's own section,
//!   [`proxy::config`]: a folder (types, upstream, route, api, checks across routes)
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
pub mod cluster;
pub mod config;
pub mod fence;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod listen;
pub mod metrics;
pub mod proof;
pub mod proxy;
pub mod route;
pub mod rt;
pub mod settings;
pub mod store;
pub mod tls;
pub mod token;
