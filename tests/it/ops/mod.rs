//! What an operator sees and does: the admin listener, the access log, metrics by route,
//! SIGHUP reload, the deploy rules and dashboards, the example configurations.

mod access_log;
mod admin;
mod config_examples;
mod deploy;
mod reload;
mod route_operations;
