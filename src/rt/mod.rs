//! Runtime plumbing that knows nothing of HTTP's meaning: the workers' coarse timers and
//! deadlines ([`timer`]), graceful drain of connections ([`drain`]) and the budget of
//! file descriptors ([`fds`]).

pub(crate) mod drain;
pub mod fds;
pub mod timer;
