//! The hop to a shard's owner (SPEC §10). In a cluster, only the instance that owns a
//! scope's shard decides for the scope; a fenced request that lands on another instance
//! is handed, whole, to the owner's `peer_listen`, at most once: the owner's answer (its
//! `Fencing-Result` included) is the client's. What owns what is the cluster's business
//! ([`Placement`], implemented by `cluster::node`); the proxy asks it once per fenced
//! request, before the gate.
//!
//! **Authentication.** A hop carries `Fencegate-Peer` with the cluster's peer key (the
//! SHA-256 of the shared secret); the peer listener answers 403 to a request without it,
//! and a client's own `Fencegate-Peer` is never passed on, to a peer or to an upstream.
//! A request that came by a hop and whose shard is not owned here any more is refused
//! `unavailable` (retry), never hopped again: ownership that moves mid-flight cannot make
//! a request go round.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use http::{HeaderName, HeaderValue, Uri};

/// The hop's credential header.
pub const FENCEGATE_PEER: HeaderName = HeaderName::from_static("fencegate-peer");

/// A shard's owner, as a hop reaches it.
#[derive(Debug)]
pub struct Hop {
    /// The owner's instance name (for logs and errors).
    pub owner: String,
    /// `http://<peer_listen>` of the owner.
    pub url: Uri,
    /// The value of [`FENCEGATE_PEER`].
    pub key: HeaderValue,
}

/// Where a fenced request for a scope is decided.
#[derive(Debug, Clone)]
pub enum Place {
    /// Here: this instance owns the scope's shard (whether it admits now is the gate's
    /// question).
    Here,
    /// At another instance, by a hop.
    Owner(Arc<Hop>),
    /// No owner is known (a takeover under way): `unavailable`, retry.
    Unknown,
}

/// Resolves when an owner must give up an upstream exchange it admitted: the exchange
/// races it until its response body has been read from the upstream to its end (the
/// forwarder's `Cuttable`), and holds it that long.
pub type Stop = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Which instance decides for a scope (see the module doc).
pub trait Placement: Send + Sync + 'static {
    fn place(&self, scope: &str) -> Place;

    /// For a request admitted here for `scope`: what ends its upstream exchange early
    /// (the ownership's self-fencing deadline, the shard's hand-off), response body
    /// included, if anything can.
    fn stop(&self, scope: &str) -> Option<Stop>;
}
