//! The integration tests of fencegate: one test binary (`cargo test --test it`), one module
//! per area, sharing `support`.

mod support;

mod abuse;
mod adversarial;
mod architecture;
mod authority;
mod body_timeout;
mod client;
mod cluster;
mod demo;
mod desync;
mod fencing;
mod idempotency;
mod limits;
mod listeners;
mod lockset;
mod nginx_harness;
mod ops;
mod oracle;
mod oracle_s3;
mod pool;
mod responses;
mod s3;
mod s3_api;
mod s3_compat;
mod send_timeout;
mod sequence;
mod store;
mod streaming;
mod tls;
mod webdav;
