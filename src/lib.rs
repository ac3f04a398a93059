//! fencegate: a reverse proxy that enforces fencing tokens in front of backends that
//! cannot compare them.
//!
//! Module map, in the order a request meets them:
//! - [`route`]: canonical paths, route templates, scope rendering (SPEC §2)
//! - [`token`]: the `Fencing-Token` grammar and order (SPEC §1)
//! - [`fence`]: the decision table, the durable marks in redb, the per-scope gates (SPEC §3)
//! - [`proxy`]: the hyper service that runs the pipeline and forwards (SPEC §4)
//! - [`server`]: listeners and graceful shutdown; [`admin`]: the admin API (SPEC §7)
//! - [`tls`]: HTTPS on the listener (certificates reloaded on SIGHUP, optional client
//!   certificates) and to upstreams
//! - [`config`], [`cli`]: configuration and commands (SPEC §5, §6); [`demo`]: the story
#![forbid(unsafe_code)]

pub mod admin;
pub mod authority;
pub mod cli;
pub mod client;
pub mod config;
pub mod demo;
pub mod fence;
pub mod idempotency;
pub mod metrics;
pub mod proxy;
pub mod route;
pub mod server;
pub mod tls;
pub mod token;
