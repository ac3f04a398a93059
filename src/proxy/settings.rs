//! What the proxy reads in force: its routes and upstreams, and the `[fencing]`,
//! `[idempotency]` and store values a request consults. Built from those sections alone,
//! so the proxy never depends on the whole file's assembled configuration.

use crate::fence::config::FencingConfig;
use crate::listen::config::IpNet;
use crate::store::config::StoreConfig;

use super::config::{Route, Upstream};
use super::idempotency::config::IdempotencyConfig;

/// The settings of one table: swapped as a whole on reload (see [`super::Table`]).
#[derive(Debug, Clone)]
pub struct Settings {
    pub routes: Vec<Route>,
    pub upstreams: Vec<Upstream>,
    /// `[fencing]`: the token header, drain timeout, scope bound and proof keys.
    pub fencing: FencingConfig,
    /// `[idempotency]`: record lifetime and size bounds.
    pub idempotency: IdempotencyConfig,
    /// `[store]`: the free-space floor below which new records are refused.
    pub store: StoreConfig,
    /// `[server] trusted_proxies`: peers whose forwarding headers are handed on.
    pub trusted_proxies: Vec<IpNet>,
    /// Whether this instance is one of a cluster's (`[cluster]` set): the peer
    /// credential header then means something and is never passed on from a client.
    pub clustered: bool,
}

impl Settings {
    /// The proxy's settings from the sections it reads.
    pub fn from_sections(
        routes: Vec<Route>,
        upstreams: Vec<Upstream>,
        fencing: FencingConfig,
        idempotency: IdempotencyConfig,
        store: StoreConfig,
        trusted_proxies: Vec<IpNet>,
        clustered: bool,
    ) -> Settings {
        Settings {
            routes,
            upstreams,
            fencing,
            idempotency,
            store,
            trusted_proxies,
            clustered,
        }
    }
}
