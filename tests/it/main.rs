//! The integration tests of fencegate: one test binary (`cargo test --test it`), one module
//! per area, sharing `support`.

mod support;

mod access_log;
mod admin;
mod adversarial;
mod authority;
mod authority_metrics;
mod body_timeout;
mod client;
mod client_tls;
mod config_examples;
mod demo;
mod demo_access_log;
mod deploy;
mod etcd;
mod etcd_metrics;
mod fencing;
mod gate;
mod group_commit;
mod idempotency;
mod limits;
mod listeners;
mod lockset;
mod nginx_harness;
mod pool;
mod reload;
mod responses;
mod route_operations;
mod send_timeout;
mod store_integrity;
mod streaming;
mod tls;
mod trust;
