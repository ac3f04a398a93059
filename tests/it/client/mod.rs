//! The Rust client (`fencegate::client`) against a running proxy and authority.

mod lease;
mod tls;
